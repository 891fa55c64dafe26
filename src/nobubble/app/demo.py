"""``nobubble demo``: PACI with Muon against 1F1B-flush and the best synchronous schedule.

Three runs of the multi-process runtime (two processes) on the default corpus, with the same
model, data, micro-batches, optimizer and seed: ``1f1b``, the synchronous schedule with the
smallest simulated bubble that the runtime trains (``zbv`` at P=2), and ``paci``.

Speed on a shared machine moves by tens of percent from one minute to the next, so a single
run of each schedule can flip a ratio. The demo therefore trains in rounds
(``nobubble.app.segments``): each run is cut into ``rounds`` segments at its own drain points, and
round r runs segment r of every schedule back to back, in an order that rotates each round.
Each ratio is taken within a round, where both runs met the same conditions, and the demo
reports the median over rounds with every round's value. The losses are those of the whole
run, which the segments do not change. Each run evaluates EVALS_PER_ROUND times per round, and
the demo reports each schedule's time to 1f1b's final validation loss on the training clock
(``nobubble.app.time_to_target``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from nobubble.app.segments import check_segments, read_records, run_alternating, segment_figures
from nobubble.app.time_to_target import crossing, final_val, val_curve
from nobubble.core.ir import Action
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule
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
    for name in SCHEDULE_NAMES:
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
# Validations per round (segment): where the time to 1f1b's final loss is interpolated. Each
# costs the asynchronous schedules a drain, which stays on their training clock.
EVALS_PER_ROUND = 5


def eval_every(steps: int, rounds: int) -> int:
    """Steps between validations: a fifth of a round, or the round where it does not divide."""
    segment = steps // rounds
    return segment // EVALS_PER_ROUND if segment % EVALS_PER_ROUND == 0 else segment


def demo_flags(steps: int, rounds: int, model: str = DEMO_MODEL) -> list[str]:
    # `mini` with a 1024-token vocabulary: the blocks, not the head, carry the cost, so the two
    # stages are balanced and the bubble is the schedule's, not the partition's.
    flags = f"--runtime dist --stages {STAGES} --microbatches {MICROBATCHES} --optimizer muon"
    flags += f" --lr 1e-2 --model {model} --vocab-size 1024 --sample-tokens 0"
    return [
        *flags.split(),
        "--steps",
        str(steps),
        "--eval-every",
        str(eval_every(steps, rounds)),
        "--checkpoint-every",
        str(steps // rounds),
    ]


def check_demo_args(steps: int, rounds: int) -> None:
    """Refuse a demo that cannot be cut into equal segments, before any run starts."""
    check_segments(steps, rounds)


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
    runs = {schedule: [*flags, "--schedule", schedule] for schedule in schedules}
    busy, began = machine_busy_s(), time.monotonic()  # None: not measurable here
    ours = children_cpu_s() if busy is not None else 0.0
    run_alternating(out, runs, steps, rounds, progress)
    others = None
    if busy is not None and (now := machine_busy_s()) is not None:
        wall = max(time.monotonic() - began, 1e-9)
        others = max(0.0, (now - busy) - (children_cpu_s() - ours)) / wall
    records = {s: read_records(out / s) for s in schedules}
    per_round = {
        s: [segment_figures(records[s], r * every, (r + 1) * every) for r in range(rounds)]
        for s in schedules
    }
    summaries = {s: json.loads((out / s / "summary.json").read_text()) for s in schedules}
    target = final_val(records[BASELINE])
    reached = {s: crossing(val_curve(records[s]), target) for s in schedules}
    speed = {}
    for s in schedules:
        tokens = [f["tokens_per_s"] for f in per_round[s]]
        ratios = [t / f["tokens_per_s"] for t, f in zip(tokens, per_round[BASELINE], strict=True)]
        mine, base_time = reached[s], reached[BASELINE]
        speed[s] = {
            "time_to_target_s": mine,
            "time_vs_1f1b": None if mine is None or not base_time else mine / base_time,
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
        "target": target,
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


def _reached(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


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
    if result.get("target") is not None:  # each schedule's time to 1f1b's final loss
        rows[3:3] = [
            (
                f"time to {result['target']:.3f} (s)",
                *(_reached(speed[s]["time_to_target_s"]) for s in schedules),
            ),
            ("  vs 1f1b's time", *(_ratio(speed[s]["time_vs_1f1b"]) for s in schedules)),
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
