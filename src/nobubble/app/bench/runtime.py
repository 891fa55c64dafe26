"""``nobubble bench runtime``: nobubble's multi-process runtime vs torch.distributed.pipelining.

Every variant trains the same model on the same data with the same optimizer, P processes on
this machine, for ``steps`` optimizer steps of M micro-batches of B sequences: nobubble's
schedules through ``nobubble train --runtime dist`` (validation only after the last step, so
the asynchronous schedules never drain before it; pipedream and paci step every M backwards,
so that every variant applies the same tokens per step), torch's schedules (``TORCH_SCHEDULES``:
GPipe, 1F1B, ZB-H1, interleaved 1F1B, interleaved zero-bubble, ZBV, DualPipeV, Looped BFS) through
``nobubble.app.ranks.torch_peer``. The schedules that hold several stages per rank
(nobubble's interleaved-1f1b, looped-bfs, zbv and dualpipev, and their torch twins) cut the model
into v·P stages, v = ``virtual_stages`` for the loop ones (default 2) and 2 for the V ones, and
each torch schedule is cut as its nobubble twin. Rounds alternate the variants, so every ratio
comes from the same conditions, and every other round runs them in reverse order
(``round_order``), so that no variant always runs first (after a quiet spell, before a page
cache is warm, early in a drift within the round); each figure is the median over the rounds.

Reported per variant: tokens per second over the steady window (both sides skip the first
``max(1, steps // 10)`` steps), the measured steady utilization per rank and bubble share
(nobubble's compute spans; torch's schedules record none: null), the peak activation bytes per
rank (autograd's saved tensors of the micro-batches in flight, measured the same way on both
sides), and the ratio of each nobubble schedule to its torch twin when both ran: the ratio of
the medians, and over the rounds, where each pair ran back to back, the per-round ratios'
median, mean with its 95% Student-t interval, and the rounds won (``paired_ratios``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nobubble.app.experiments.stats import interval
from nobubble.app.ranks.torch_peer import TORCH_SCHEDULES, launch_peer, peer_config
from nobubble.app.train.assemble import load_data
from nobubble.app.train.config import TrainConfig
from nobubble.app.train.flags import FLAG_NAMES
from nobubble.core.errors import NobubbleError
from nobubble.core.host_memory import ENV as MALLOC_ENV
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES
from nobubble.model import model_config, partition_layers, partition_rows

# --allocator -> NOBUBBLE_MALLOC of (nobubble's ranks, torch's peers)
ALLOCATORS = {
    "as-shipped": ("tuned", "default"),
    "tuned": ("tuned", "tuned"),
    "default": ("default", "default"),
}
REFERENCES = ("1f1b", "torch-1f1b")  # the ratios' denominators, when they are benchmarked
# nobubble schedule -> the torch schedule with the same per-rank order (vs_torch_twin)
TORCH_TWINS = {
    "gpipe": "torch-gpipe",
    "1f1b": "torch-1f1b",
    "zb-h1": "torch-zb-h1",
    "interleaved-1f1b": "torch-interleaved-1f1b",
    "zbv": "torch-zbv",
    "dualpipev": "torch-dualpipev",
    "looped-bfs": "torch-looped-bfs",
}


@dataclass(frozen=True)
class RuntimeBench:
    """What to run. ``synthetic`` (FWD_S, BWD_S): reserved for a compute-free mode."""

    model: str = "small"
    stages: int = 2
    microbatches: int = 4
    micro_batch_size: int = 8
    seq_len: int = 128
    steps: int = 20
    rounds: int = 3
    schedules: tuple[str, ...] = (
        "1f1b",
        "paci",
        "2bw",
        "gpipe",
        "pipedream",
        "torch-1f1b",
        "torch-gpipe",
    )
    threads: int = 0  # torch threads per process; 0: cores / stages, as `nobubble train`
    data: str = "shakespeare"
    vocab_size: int = 4096
    optimizer: str = "adamw"
    synthetic: tuple[float, float] | None = None
    virtual_stages: int | None = None  # v of the interleaved variants (None: 2)
    # glibc malloc in the ranks (nobubble.core.host_memory): "as-shipped" runs nobubble's ranks
    # tuned and torch's peers with glibc's own thresholds, as each runs out of the box;
    # "tuned" and "default" give both sides the same setting
    allocator: str = "as-shipped"

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"--allocator {self.allocator!r}: use one of {', '.join(ALLOCATORS)}")
        if self.synthetic is not None:
            raise ValueError(
                "synthetic mode runs through `nobubble bench runtime --synthetic` "
                "(nobubble.app.ranks.synthetic), not RuntimeBench"
            )
        known = (*SCHEDULE_NAMES, *TORCH_SCHEDULES)
        unknown = [s for s in self.schedules if s not in known]
        if unknown or not self.schedules:
            raise ValueError(
                f"--schedule {','.join(self.schedules)!r} names {unknown or 'no schedule'}; "
                f"valid: a comma list of {', '.join(known)}"
            )
        if len(set(self.schedules)) != len(self.schedules):
            raise ValueError(f"--schedule {','.join(self.schedules)!r} repeats a schedule")
        if self.steps < 2 or self.rounds < 1:
            raise ValueError(
                f"--steps {self.steps} --rounds {self.rounds}: use --steps >= 2 (the first "
                "is warm-up) and --rounds >= 1"
            )
        for variant in self.schedules:
            self.train_config(variant)  # every TrainConfig check, before any run

    def train_config(self, variant: str) -> TrainConfig:
        """The run of ``variant``; a torch variant gets the nobubble schedule whose placement,
        split and checks it takes (``peer_config``), its errors named for the torch one."""
        if variant in TORCH_SCHEDULES:
            return peer_config(self._config("gpipe", None), variant, self.virtual_stages)
        loop = SCHEDULES[variant].placement == "loop"
        return self._config(variant, self.virtual_stages if loop else None)

    def _config(self, name: str, virtual_stages: int | None) -> TrainConfig:
        return TrainConfig.of(
            schedule=name,
            virtual_stages=virtual_stages,
            num_ranks=self.stages,
            microbatches=self.microbatches,
            accum=self.microbatches if SCHEDULES[name].uses_accum else None,
            micro_batch_size=self.micro_batch_size,
            seq_len=self.seq_len,
            steps=self.steps,
            model=self.model,
            data=self.data,
            vocab_size=self.vocab_size,
            optimizer=self.optimizer,
            threads=self.threads,
            eval_every=self.steps,  # drain and validate only after the last step
            eval_batches=1,
            sample_tokens=0,
            progress=False,
            runtime="dist",
        )


def train_argv(cfg: TrainConfig, skip: tuple[str, ...] = ()) -> list[str]:
    """``nobubble train`` flags that give ``cfg`` (the fields that differ from the defaults)."""
    argv = []
    defaults = TrainConfig().to_json()
    for key, value in cfg.to_json().items():
        if value == defaults[key] or value is None or key in skip:
            continue
        if key == "progress":
            argv.append("--no-progress")
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        argv += ["--" + FLAG_NAMES.get(key, key).replace("_", "-"), text]
    return argv


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def run_nobubble(cfg: TrainConfig, out: Path, log: Path, malloc: str = "tuned") -> dict[str, Any]:
    """One ``nobubble train --runtime dist`` run; its figures from summary.json. ``malloc``:
    its ranks' ``NOBUBBLE_MALLOC``."""
    command = [sys.executable, "-m", "nobubble", "train", *train_argv(cfg), "--out", str(out)]
    env = dict(os.environ, **{MALLOC_ENV: malloc})
    with log.open("ab") as sink:
        code = subprocess.run(command, stdout=sink, stderr=sink, env=env).returncode
    if code != 0:
        raise NobubbleError(f"{cfg.schedule.name} exited with status {code}:\n{_tail(log)}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "utilization": summary.get("steady_utilization"),
        "bubble": summary.get("steady_bubble_share"),
        "peak_activation_bytes": summary["peak_activation_bytes"],
        "last_loss": summary["last_loss"],
    }


def run_torch(bench: RuntimeBench, variant: str, out: Path, log: Path) -> dict[str, Any]:
    cfg = bench.train_config(variant)
    out.mkdir(parents=True)
    try:
        # the peer's own --schedule names the torch schedule
        result = launch_peer(
            train_argv(cfg, skip=("schedule",)),
            variant,
            out / "result.json",
            cfg.num_ranks,
            log,
            malloc=ALLOCATORS[bench.allocator][1],
        )
    except NobubbleError as err:
        raise NobubbleError(f"{err}:\n{_tail(log)}") from None
    return {
        "tokens_per_s": result["tokens_per_s"],
        "utilization": result["steady_utilization"],  # the peer's spans (CPU only)
        "bubble": result["steady_bubble_share"],
        "peak_activation_bytes": result["peak_activation_bytes"],
        "last_loss": result["losses"][-1],
    }


def paired_ratios(ratios: list[float]) -> dict[str, Any]:
    """What the per-round ratios of a variant to its torch twin say beyond one ratio of medians.

    On a shared machine the speed drifts between runs by more than two close engines differ,
    so a ratio of medians over a few rounds lands either side of 1. Each round runs the pair
    back to back, so its ratio sees one condition; over the rounds: their median, their mean
    with the report's two-sided Student-t interval (``experiments.stats.interval``, the rounds
    in place of seeds; no bounds below two rounds), and the rounds in which the variant was
    faster.
    """
    if not ratios:
        raise ValueError("paired_ratios needs at least one round")
    iv = interval(dict(enumerate(ratios)))
    return {
        "rounds": iv["n"],
        "median": statistics.median(ratios),
        "mean": iv["mean"],
        "mean_ci95": None if iv["lo"] is None else [iv["lo"], iv["hi"]],
        "faster_rounds": sum(r > 1 for r in ratios),
    }


def summarize(bench: RuntimeBench, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the rounds and the ratios to the reference schedules."""
    out: dict[str, Any] = {}
    for variant, rounds in runs.items():
        tok = [r["tokens_per_s"] for r in rounds]
        utils = [r["utilization"] for r in rounds if r["utilization"] is not None]
        bubbles = [r["bubble"] for r in rounds if r.get("bubble") is not None]
        out[variant] = {
            "tokens_per_s": statistics.median(tok),
            "tokens_per_s_rounds": tok,
            "utilization": [statistics.median(u) for u in zip(*utils, strict=True)]
            if utils
            else None,
            "bubble": statistics.median(bubbles) if bubbles else None,
            "peak_activation_bytes": rounds[-1]["peak_activation_bytes"],  # deterministic
            "last_loss": rounds[-1]["last_loss"],
        }
    for variant in out:
        for ref in REFERENCES:
            key = "vs_" + ref.replace("-", "_")
            out[variant][key] = (
                out[variant]["tokens_per_s"] / out[ref]["tokens_per_s"] if ref in out else None
            )
        twin = TORCH_TWINS.get(variant)
        out[variant]["vs_torch_twin"] = (
            out[variant]["tokens_per_s"] / out[twin]["tokens_per_s"] if twin in out else None
        )
        # paired by round (the two ran minutes apart): what the spread of the ratio reads
        out[variant]["vs_torch_twin_rounds"] = (
            [
                a / b
                for a, b in zip(
                    out[variant]["tokens_per_s_rounds"],
                    out[twin]["tokens_per_s_rounds"],
                    strict=True,
                )
            ]
            if twin in out
            else None
        )
        pairs = out[variant]["vs_torch_twin_rounds"]
        out[variant]["vs_torch_twin_paired"] = paired_ratios(pairs) if pairs else None
    cuts = sorted({bench.train_config(v).model_stages for v in bench.schedules})
    out["config"] = asdict(bench) | {
        "tokens_per_step": bench.train_config(bench.schedules[0]).tokens_per_step,
        "warmup_steps": max(1, bench.steps // 10),
        "partition": partition_balance(bench, bench.stages),
        # every cut a variant uses: P stages, and v·P for those with several stages per rank
        "partitions": {str(n): partition_balance(bench, n) for n in cuts},
    }
    return out


def partition_balance(bench: RuntimeBench, num_stages: int) -> dict[str, Any]:
    """The split into ``num_stages`` stages the variants of that cut use and its estimated
    balance (lightest / heaviest stage cost).

    Layers are indivisible, so a split can be uneven; the lighter stages then idle for the
    difference whatever the schedule, and their utilization cannot pass this balance.
    """
    if bench.model.startswith("hf:"):  # split by parameters: the balance is theirs
        from nobubble.api.split_hf import split_balance

        return split_balance(bench.model.removeprefix("hf:"), num_stages)
    cfg = model_config(bench.model, bench.vocab_size, bench.seq_len)
    ranges = partition_layers(cfg, num_stages, seq_len=bench.seq_len)
    rows = partition_rows(cfg, ranges, bench.seq_len)
    costs = [row["cost"] for row in rows]
    return {"layers": [row["layers"] for row in rows], "balance": min(costs) / max(costs)}


def round_order(schedules: Sequence[str], r: int) -> list[str]:
    """The variants in the order round ``r`` (from 0) runs them: as given in even rounds,
    reversed in odd ones. Over two rounds each variant runs once before and once after each
    other one, so a cost that falls on whichever runs first (or second) in a round cancels
    from the paired ratios instead of biasing them toward one side."""
    return list(schedules) if r % 2 == 0 else list(reversed(schedules))


def bench_runtime(bench: RuntimeBench, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run every variant ``bench.rounds`` times, alternating, in ``round_order``;
    ``progress`` after each run."""
    load_data(bench.train_config(bench.schedules[0]))  # fill the data cache before any rank
    load = [os.getloadavg()[0]]  # other work on the machine skews every figure: report it
    work = Path(tempfile.mkdtemp(prefix="nobubble-bench-runtime-"))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in bench.schedules}
    for r in range(bench.rounds):
        for variant in round_order(bench.schedules, r):
            out, log = work / f"{variant}-{r}", work / f"{variant}-{r}.log"
            if variant in TORCH_SCHEDULES:
                figures = run_torch(bench, variant, out, log)
            else:
                malloc = ALLOCATORS[bench.allocator][0]
                figures = run_nobubble(bench.train_config(variant), out, log, malloc)
            runs[variant].append(figures)
            progress(f"round {r + 1} {variant}: {figures['tokens_per_s']:,.0f} tok/s")
    shutil.rmtree(work)  # kept on failure: the error names the log
    load.append(os.getloadavg()[0])
    result = summarize(bench, runs)
    result["config"]["load_average"] = load  # 1-minute load before and after
    return result
