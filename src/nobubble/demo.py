"""``nobubble demo``: PACI with Muon against 1F1B-flush and the best synchronous schedule.

Three runs of the multi-process runtime (two processes) on the default corpus, with the same
model, data, micro-batches, optimizer and seed: ``1f1b``, the synchronous schedule with the
smallest simulated bubble that the runtime trains (``zbv`` at P=2), and ``paci``.

Speed on a shared machine moves by tens of percent from one minute to the next, so a single
run of each schedule can flip a ratio. The demo therefore trains in rounds: each run is cut
into ``rounds`` segments at its own drain points (``--stop-at``, then ``--resume``; resuming
continues with the numbers of the uninterrupted run that has the same drain points), and
round r runs segment r of every schedule back to back, in an order that rotates each round.
Each ratio is taken within a round, where both runs met the same conditions, and the demo
reports the median over rounds with every round's value. The losses are those of the whole
run, which the segments do not change.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nobubble.core.errors import NobubbleError
from nobubble.core.ir import Action
from nobubble.core.schedules import DIST_TRAINABLE, SCHEDULES, build_schedule
from nobubble.core.sim import CostModel, simulate
from nobubble.core.viz import save_gantt

STAGES, MICROBATCHES = 2, 4
BASELINE, ASYNC = "1f1b", "paci"
# Cores other processes may keep busy before the table warns: a bubble is idle time only when
# nothing else wants the core (2026-12-02: paci/1f1b 1.22x in `bench runtime` on an idle
# machine; the demo gave 0.96x while test suites ran beside it, load average 3.5 on 2 cores)
BUSY_CORES = 0.25


def best_synchronous(stages: int = STAGES, microbatches: int = MICROBATCHES) -> str:
    """The synchronous schedule, other than gpipe and 1f1b, with the smallest simulated bubble
    that the multi-process runtime trains at this (P, M), under unit costs (F = I = W = 1)."""
    bubbles = {}
    for name in DIST_TRAINABLE:
        if not SCHEDULES[name].synchronous or name in ("gpipe", BASELINE):
            continue
        try:
            schedule = build_schedule(name, stages, microbatches, 2)
        except ValueError:  # this (P, M) is outside the schedule's preconditions
            continue
        bubbles[name] = simulate(schedule, CostModel(fwd=1.0, bwd=2.0, wgrad=1.0)).metrics
    if not bubbles:
        return BASELINE
    return min(bubbles, key=lambda n: (bubbles[n].bubble_share, n))


def demo_schedules() -> tuple[str, ...]:
    best = best_synchronous()
    return (BASELINE, ASYNC) if best == BASELINE else (BASELINE, best, ASYNC)


DEMO_MODEL = "mini"


def demo_flags(steps: int, rounds: int, model: str = DEMO_MODEL) -> list[str]:
    # `mini` with a 1024-token vocabulary: the blocks, not the head, carry the cost, so the two
    # stages are balanced and the bubble is the schedule's, not the partition's. Validation (a
    # drain point) only where a segment ends, so no segment times a validation inside it.
    flags = f"--runtime dist --stages {STAGES} --microbatches {MICROBATCHES} --optimizer muon"
    flags += f" --lr 1e-2 --model {model} --vocab-size 1024 --sample-tokens 0"
    every = str(steps // rounds)
    return [
        *flags.split(),
        "--steps",
        str(steps),
        "--eval-every",
        every,
        "--checkpoint-every",
        every,
    ]


def check_demo_args(steps: int, rounds: int) -> None:
    """Refuse a demo that cannot be cut into equal segments, before any run starts."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"--rounds must be an integer >= 1, got {rounds!r}")
    if not isinstance(steps, int) or steps < 2 * rounds or steps % rounds:
        raise ValueError(
            f"--steps {steps!r} must be a multiple of --rounds {rounds} with at least 2 steps "
            f"per round (the first step of each segment is warm-up): e.g. --steps {50 * rounds}"
        )


def segment_figures(records: list[dict[str, Any]], start: int, end: int) -> dict[str, Any]:
    """Tokens/s over steps start+2 .. end (the segment's first step, after a process start,
    is warm-up), and the utilization measured between the drain points start and end."""
    by_step = {r["step"]: r for r in records}
    first, last = by_step[start + 1], by_step[end]
    seconds = last["elapsed_s"] - first["elapsed_s"]
    return {
        "tokens_per_s": (last["tokens"] - first["tokens"]) / seconds,
        "utilization": last["utilization"],
        "bubble_share": last["bubble_share"],
    }


def _read_records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _check_earlier_run(run_dir: Path, flags: list[str]) -> None:
    """A run folder from an earlier demo is continued only if it has this demo's settings."""
    from nobubble.cli.train_cmds import build_train_parser, config_from_args
    from nobubble.config import TrainConfig

    if not (run_dir / "config.json").exists():
        return
    wanted = config_from_args(build_train_parser().parse_args(flags)).fingerprint()
    saved = TrainConfig.from_mapping(TrainConfig.load(run_dir / "config.json")["config"])
    if saved.fingerprint() != wanted:
        raise ValueError(
            f"{run_dir} holds a run with other settings than this demo's (another --steps, "
            "--rounds or version): remove it, or give the demo another --out"
        )


def _run_segment(run_dir: Path, flags: list[str], stop: int, steps: int, progress: bool) -> None:
    command = [sys.executable, "-m", "nobubble", "train"]
    if (run_dir / "config.json").exists():
        command += ["--resume", str(run_dir)]  # the saved settings, from the last checkpoint
    else:
        command += [*flags, "--out", str(run_dir)]
    if stop < steps:
        command += ["--stop-at", str(stop)]
    if not progress:
        command.append("--no-progress")
    # the runs report on stderr (file descriptor 2, whatever sys.stderr is now): stdout carries
    # only the demo's own table or JSON
    if subprocess.run(command, stdout=2).returncode != 0:
        raise NobubbleError(f"the demo run in {run_dir} failed; see the messages above")


def _compute_lanes(trace: Path, window_s: float) -> list[list[tuple[Action, float, float]]]:
    """The first ``window_s`` seconds of a run's measured compute spans, one lane per stage."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] == 0]
    t0 = min(e["ts"] for e in spans)
    lanes: dict[int, list[tuple[Action, float, float]]] = {}
    for e in spans:
        start = (e["ts"] - t0) / 1e6
        if start <= window_s:
            lanes.setdefault(e["tid"], []).append(
                (Action.parse(e["name"]), start, start + e["dur"] / 1e6)
            )
    return [lanes[k] for k in sorted(lanes)]


def run_demo(
    out: Path,
    steps: int,
    rounds: int = 3,
    progress: bool = True,
    schedules: tuple[str, ...] | None = None,
    model: str = DEMO_MODEL,
) -> dict[str, Any]:
    """Train every schedule (default: ``demo_schedules()``; 1f1b first) in ``rounds``
    alternating segments under ``out``; return the summaries, per-round speeds and figure.
    ``model`` is a preset of ``nobubble train --model`` (the demo's is balanced on 2 stages)."""
    check_demo_args(steps, rounds)
    schedules = schedules or demo_schedules()
    if schedules[0] != BASELINE:
        raise ValueError(f"the demo's schedules start with {BASELINE}, got {schedules!r}")
    flags, every = demo_flags(steps, rounds, model), steps // rounds
    for schedule in schedules:  # before any run starts
        _check_earlier_run(out / schedule, [*flags, "--schedule", schedule, "--out", "x"])
    busy, began = machine_busy_s(), time.monotonic()  # None: not measurable here
    ours = children_cpu_s() if busy is not None else 0.0
    for r in range(rounds):
        order = schedules[r % len(schedules) :] + schedules[: r % len(schedules)]
        for schedule in order:
            run_dir = out / schedule
            done = [rec["step"] for rec in _read_records(run_dir)] if run_dir.exists() else []
            if (r + 1) * every not in done:  # a finished segment of an earlier demo stays
                _run_segment(
                    run_dir, [*flags, "--schedule", schedule], (r + 1) * every, steps, progress
                )
    others = None
    if busy is not None and (now := machine_busy_s()) is not None:
        wall = max(time.monotonic() - began, 1e-9)
        others = max(0.0, (now - busy) - (children_cpu_s() - ours)) / wall
    per_round = {
        s: [
            segment_figures(_read_records(out / s), r * every, (r + 1) * every)
            for r in range(rounds)
        ]
        for s in schedules
    }
    summaries = {s: json.loads((out / s / "summary.json").read_text()) for s in schedules}
    speed = {}
    for s in schedules:
        tokens = [f["tokens_per_s"] for f in per_round[s]]
        ratios = [t / f["tokens_per_s"] for t, f in zip(tokens, per_round[BASELINE], strict=True)]
        speed[s] = {
            "tokens_per_s": statistics.median(tokens),
            "tokens_per_s_rounds": tokens,
            "vs_1f1b": statistics.median(ratios),
            "vs_1f1b_rounds": ratios,
            "utilization": [
                statistics.median(u)
                for u in zip(*(f["utilization"] for f in per_round[s]), strict=True)
            ],
            "bubble_share": statistics.median(f["bubble_share"] for f in per_round[s]),
        }
    window = 1.5  # seconds of each timeline: a few batches, readable
    panels = [
        (
            f"{s}: measured, 2 processes, first {window} s of the last round "
            f"(bubble {speed[s]['bubble_share']:.0%})",
            _compute_lanes(out / s / "trace.json", window),
        )
        for s in schedules
    ]
    figure = save_gantt(out / "timelines.png", panels, time_unit="seconds", max_labels=400)
    return {
        "schedules": list(schedules),
        "rounds": rounds,
        "steps": steps,
        "runs": summaries,
        "speed": speed,
        "figure": str(figure),
        "other_cores": others,  # cores that other processes kept busy on average, or None
        "cores": os.cpu_count() or 1,
    }


def machine_busy_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (Linux ``/proc/stat``),
    or None where that is not available."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children (the demo's training processes)."""
    import resource  # Unix only, as /proc/stat; imported here so the demo loads anywhere

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def format_demo(result: dict[str, Any]) -> str:
    schedules, runs, speed = result["schedules"], result["runs"], result["speed"]

    def rounds_text(values: list[float], fmt: str) -> str:
        return " / ".join(format(v, fmt) for v in values)

    rows = [
        ("", *schedules),
        ("final train loss", *(f"{runs[s]['last_loss']:.3f}" for s in schedules)),
        ("final val loss", *(f"{runs[s]['val_loss']:.3f}" for s in schedules)),
        ("tokens/s (median)", *(f"{speed[s]['tokens_per_s']:,.0f}" for s in schedules)),
        (
            "tokens/s per round",
            *(rounds_text(speed[s]["tokens_per_s_rounds"], ",.0f") for s in schedules),
        ),
        ("vs 1f1b (median)", *(f"{speed[s]['vs_1f1b']:.2f}x" for s in schedules)),
        ("vs 1f1b per round", *(rounds_text(speed[s]["vs_1f1b_rounds"], ".2f") for s in schedules)),
        (
            "utilization per stage",
            *(", ".join(f"{u:.2f}" for u in speed[s]["utilization"]) for s in schedules),
        ),
        ("bubble share", *(f"{speed[s]['bubble_share']:.1%}" for s in schedules)),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(len(schedules) + 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    lines.append(
        f"{result['rounds']} rounds of {result['steps'] // result['rounds']} steps, schedules "
        "alternating within each round; ratios are taken within a round (ideal for paci: "
        f"(M+P-1)/M = {(MICROBATCHES + STAGES - 1) / MICROBATCHES:.2f} at M={MICROBATCHES}, "
        f"P={STAGES}, before the optimizer's own cost)"
    )
    lines.append(f"timelines: {result['figure']}")
    others, cores = result.get("other_cores"), result.get("cores", 1)
    if others is not None and others >= BUSY_CORES:
        lines.append(
            f"warning: other processes kept {others:.1f} of this machine's {cores} cores busy "
            "during the demo. A busy CPU fills the pipelines' bubbles with that work, so these "
            "ratios understate (or erase) what removing the bubble gains on an idle machine: "
            "rerun `nobubble demo` when nothing else runs."
        )
    return "\n".join(lines)
