"""The ``nobubble`` command line: one parser, one function per subcommand.

User errors (``ValueError``, ``TypeError``, ``FileNotFoundError``) print one clear line to stderr
and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from nobubble import __version__
from nobubble.cli import bench_cmds, experiment_cmds, export_cmds, schedule_cmds, train_cmds
from nobubble.core.errors import MissingExtra, NobubbleError

log = logging.getLogger("nobubble")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nobubble",
        description="Pipeline-parallel LM pretraining with synchronous and asynchronous schedules.",
    )
    parser.add_argument("--version", action="version", version=f"nobubble {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    schedule_cmds.register(sub)
    bench_cmds.register(sub)
    train_cmds.register(sub)
    experiment_cmds.register(sub)
    export_cmds.register(sub)
    return parser


def _rank_prefix() -> str:
    rank = os.environ.get("RANK")  # set by torchrun and by `--runtime dist`'s launcher
    return f"[rank {rank}] " if rank is not None else ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "takes_unknown", False):
        args.train_args = unknown  # `train` parses its own flags (see train_cmds)
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format=_rank_prefix() + "%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, MissingExtra) as err:
        print(f"nobubble {args.command}: error: {err}", file=sys.stderr)
        return 2
    except NobubbleError as err:
        print(f"nobubble {args.command}: failed: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `nobubble ... | head`: the reader left, not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"nobubble {args.command}: interrupted", file=sys.stderr)
        return 130
