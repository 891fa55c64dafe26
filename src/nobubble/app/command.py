"""A command run in this process: ``run_command`` (logging set up, a user error as one line on
stderr and exit status 2, a failure of the world's making as exit status 1) and ``train_main``
(``nobubble train``: a run from its flags, on the runtime they choose, its summary printed).

The command line (``nobubble.cli``) runs every command through ``run_command``, and the
experiment runner's runs are ``run_command("train", ...)`` of ``train_main`` too: one path."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from nobubble.app.train.flags import build_train_parser, config_from_args
from nobubble.core.errors import MissingExtra, NobubbleError

if TYPE_CHECKING:
    from nobubble.app.train.trainer import RunResult


def train_main(argv: Sequence[str]) -> int:
    """``nobubble train ARGV``: parse the flags, run (the emulator's ``Trainer``, this rank of
    ``--runtime dist``, or the launcher of all ranks), print the summary; the exit status."""
    args = build_train_parser().parse_args(list(argv))
    cfg = config_from_args(args)
    from nobubble.core.host_memory import tune_host_allocator

    tune_host_allocator()  # this process trains: keep freed memory between steps
    if cfg.runtime.runtime == "dist":  # imported only when asked for
        if "RANK" in os.environ:  # one rank, started by torchrun or by our launcher
            from nobubble.app.ranks.rank_env import leave_process
            from nobubble.app.ranks.runtime import run_rank

            rank_result = run_rank(cfg)
            # only the last rank reports, or the launcher does
            if rank_result is not None and not os.environ.get("NOBUBBLE_LAUNCHED"):
                _print_summary(rank_result, args.json)
            leave_process(0)  # no interpreter finalization: see its docstring
        from nobubble.app.ranks.launch import launch

        result = launch(cfg, list(argv))
    else:
        from nobubble.app.train.trainer import Trainer

        result = Trainer(cfg).run()
    _print_summary(result, args.json)
    return 0


def _print_summary(result: RunResult, as_json: bool) -> None:
    summary = result.summary
    if as_json:
        print(json.dumps({"run_dir": str(result.run_dir), **summary}))
        return
    out = sys.stdout
    print(f"run directory: {result.run_dir}", file=out)
    for key in (
        "schedule",
        "optimizer",
        "correction",
        "stages",
        "steps",
        "first_loss",
        "last_loss",
        "val_loss",
        "tokens",
        "elapsed_s",
        "tokens_per_s",
        "peak_inflight",
        "peak_weight_versions",
        "peak_activation_bytes",
    ):
        value = summary.get(key)
        if key not in summary:
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, list) and value and isinstance(value[0], float):
            value = "[" + ", ".join(f"{v:.3f}" for v in value) + "]"
        print(f"  {key:<22} {value}", file=out)
    if summary.get("sample"):
        print("sample:\n" + summary["sample"], file=out)


def _rank_prefix() -> str:
    rank = os.environ.get("RANK")  # set by torchrun and by `--runtime dist`'s launcher
    return f"[rank {rank}] " if rank is not None else ""


def run_command(command: str, func: Callable[[], int | None], verbose: bool = False) -> int:
    """Run ``nobubble COMMAND`` (``func``) with logging on stderr; its exit status.

    User errors (``ValueError``, ``TypeError``, ``FileNotFoundError``, a missing extra) print one
    clear line and give 2, with no traceback; a ``NobubbleError`` gives 1."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=_rank_prefix() + "%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(func() or 0)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, MissingExtra) as err:
        print(f"nobubble {command}: error: {err}", file=sys.stderr)
        return 2
    except NobubbleError as err:
        print(f"nobubble {command}: failed: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `nobubble ... | head`: the reader left, not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"nobubble {command}: interrupted", file=sys.stderr)
        return 130
