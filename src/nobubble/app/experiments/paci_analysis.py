"""Paper B in miniature: PACI vs 1F1B-flush quality, drift, memory and time to target.

Time to target is reported two ways: *projected* (each stage's forward and backward time
measured on this machine, fed to the simulator for both schedules, then read at the step where
each run first reached the target) and *measured* (two real processes, wall clock).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nobubble.app.experiments import stats
from nobubble.app.experiments.analysis import FORMAT, _curves, _ms, final_val, mean_std, select
from nobubble.app.experiments.paci_arms import analyze_arms, arms_table
from nobubble.app.experiments.runner import RunOutcome


def stage_costs(overrides: dict[str, Any], repeats: int = 5) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds of one micro-batch on each stage (this machine)."""
    from nobubble.app.train.assemble import make_plan, make_stages
    from nobubble.app.train.config import TrainConfig

    cfg = TrainConfig.from_mapping({**overrides, "out": None, "resume": None})
    plan = make_plan(cfg, cfg.data.vocab_size)
    stages = make_stages(plan)
    b, t, v = cfg.run.micro_batch_size, cfg.data.seq_len, cfg.data.vocab_size
    tokens = torch.randint(0, v, (b, t))
    fwd, bwd = [], []
    x: torch.Tensor = tokens
    for module in stages:
        inputs = x if module.is_first else x.detach().requires_grad_(True)
        f_times, b_times = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            out = module(inputs, tokens) if module.is_last else module(inputs)
            t1 = time.perf_counter()
            grad = None if module.is_last else torch.ones_like(out)
            torch.autograd.backward(out, grad)
            t2 = time.perf_counter()
            f_times.append(t1 - t0)
            b_times.append(t2 - t1)
        fwd.append(statistics.median(f_times[1:]))
        bwd.append(statistics.median(b_times[1:]))
        x = out.detach() if not module.is_last else x
    return fwd, bwd


def first_reach(run: RunOutcome, target: float, key: str = "step") -> float | None:
    for r in run.metrics:
        if r.get("val_loss") is not None and r["val_loss"] <= target:
            return float(r[key])
    return None


def _projected_seconds(
    run: RunOutcome, steps: int, costs: tuple[list[float], list[float]]
) -> float:
    from nobubble.app.train.config import TrainConfig
    from nobubble.core.schedules import build_schedule
    from nobubble.core.sim import CostModel, simulate

    saved = json.loads((run.run_dir / "config.json").read_text())["config"]
    cfg = TrainConfig.normalized(saved)  # a run saved before num_ranks was P's name: "stages"
    drain = None if cfg["schedule"] == "1f1b" else cfg["eval_every"]
    schedule = build_schedule(
        cfg["schedule"],
        cfg["num_ranks"],
        cfg["microbatches"],
        steps,
        cfg["accum"],
        drain_every=drain,
    )
    return simulate(schedule, CostModel(fwd=tuple(costs[0]), bwd=tuple(costs[1]))).metrics.makespan


def analyze_paci(
    outcomes: dict[str, RunOutcome],
    out: Path,
    optimizers: tuple[str, ...],
    lrs: dict[str, float],
    base: dict[str, Any],
) -> dict[str, Any]:
    """The paci experiment's summary: each (optimizer, a) pair of flush and paci runs compared,
    the lower-lr study, the arms and the measured runs; draws the curves and drift figures."""
    pairs = _pairs(outcomes, optimizers, base)
    measured = _measured(outcomes)
    _curves(
        out / "paci_curves.png",
        "1f1b flush (solid) vs paci (dashed), P=4",
        _curve_series(outcomes, pairs),
        x_key="tokens",
    )
    _drift_figure(out / "paci_drift.png", pairs)
    return {
        "format": FORMAT,
        "pairs": pairs,
        "lower_lr": _lower_lr(outcomes),
        "arms": analyze_arms(outcomes),
        "measured": measured,
        "figures": ["paci_curves.png", "paci_drift.png"],
    }


def _pairs(
    outcomes: dict[str, RunOutcome], optimizers: tuple[str, ...], base: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per (optimizer, a) of the emulated runs, in the profile's optimizer order, for
    which both schedules finished on a common seed."""
    pairs = []
    costs_cache: dict[int, tuple[list[float], list[float]]] = {}
    emulated = [o for o in select(outcomes) if o.spec.labels.get("runtime") != "dist"]
    configs = sorted(
        {(o.spec.labels["optimizer"], o.spec.labels["a"]) for o in emulated},
        key=lambda c: (optimizers.index(c[0]) if c[0] in optimizers else len(optimizers), c[1]),
    )
    for opt, a in configs:
        by_schedule = {
            schedule: {
                o.spec.labels["seed"]: o
                for o in select(emulated, optimizer=opt, a=a, schedule=schedule)
            }
            for schedule in ("1f1b", "paci")
        }
        seeds = sorted(set(by_schedule["1f1b"]) & set(by_schedule["paci"]))
        if not seeds:
            continue
        if a not in costs_cache:
            costs_cache[a] = stage_costs({**base, **by_schedule["1f1b"][seeds[0]].spec.overrides})
        pairs.append(_pair(opt, a, by_schedule, seeds, costs_cache[a]))
    return pairs


def _pair(
    opt: str,
    a: int,
    by_schedule: dict[str, dict[int, RunOutcome]],
    seeds: list[int],
    costs: tuple[list[float], list[float]],
) -> dict[str, Any]:
    """Flush against paci for one (optimizer, a): final losses paired by seed; time to target,
    drift and memory from the lowest seed's pair (drift and memory do not depend on the seed; the
    time is one run's)."""
    flush, p = by_schedule["1f1b"][seeds[0]], by_schedule["paci"][seeds[0]]
    target = max(
        min(r["val_loss"] for r in run.metrics if r.get("val_loss") is not None)
        for run in (flush, p)
    )
    steps = {"flush": first_reach(flush, target), "paci": first_reach(p, target)}
    proj = {
        k: _projected_seconds(run, int(steps[k] or 1), costs)
        for k, run in (("flush", flush), ("paci", p))
    }
    ledger = json.loads((p.run_dir / "ledger.json").read_text())
    val = {k: {s: final_val(by_schedule[k][s]) for s in seeds} for k in by_schedule}
    return {
        "optimizer": opt,
        "a": a,
        "stages": flush.spec.overrides["stages"],
        "val_flush": mean_std(list(val["1f1b"].values())),
        "val_paci": mean_std(list(val["paci"].values())),
        "diff": stats.paired(val["paci"], val["1f1b"]),
        "timed_seed": seeds[0],
        "target": target,
        "steps_to_target": steps,
        "projected_s": proj,
        "projected_speedup": proj["flush"] / proj["paci"],
        "ideal_speedup": (a + 4 - 1) / a,
        "drift_histogram": ledger["crossed_histogram"],
        "max_crossed": [row["max_crossed"] for row in ledger["summary"]],
        "peak_activation_bytes": {
            "flush": flush.summary["peak_activation_bytes"],
            "paci": p.summary["peak_activation_bytes"],
        },
        "stage_costs_s": {"fwd": costs[0], "bwd": costs[1]},
    }


def _curve_series(
    outcomes: dict[str, RunOutcome], pairs: list[dict[str, Any]]
) -> list[tuple[str, str, str, list[RunOutcome]]]:
    """The curves figure's lines: one colour per (optimizer, a); solid flush, dashed paci."""
    series = []
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860"]
    for i, pair in enumerate(pairs):
        for schedule, style in (("1f1b", "-"), ("paci", "--")):
            runs = [
                o
                for o in select(
                    outcomes, schedule=schedule, a=pair["a"], optimizer=pair["optimizer"]
                )
                if o.spec.labels.get("runtime") != "dist"
            ]
            name = "flush" if schedule == "1f1b" else "paci"
            series.append(
                (
                    f"{pair['optimizer']} a={pair['a']} {name}",
                    palette[i % len(palette)],
                    style,
                    runs,
                )
            )
    return series


def _lower_lr(outcomes: dict[str, RunOutcome]) -> list[dict[str, Any]]:
    """The lower-lr study: flush and paci at each lower learning rate, highest lr first."""
    rows = []
    for flush in select(outcomes, schedule="1f1b", study="lower-lr"):
        lr = flush.spec.labels["lr"]
        twin = select(outcomes, schedule="paci", study="lower-lr", lr=lr)
        if twin:
            rows.append(
                {
                    "optimizer": "adamw",
                    "a": flush.spec.labels["a"],
                    "lr": lr,
                    "val_flush": final_val(flush),
                    "val_paci": final_val(twin[0]),
                    "diff": final_val(twin[0]) - final_val(flush),
                }
            )
    return sorted(rows, key=lambda r: -r["lr"])


def _measured(outcomes: dict[str, RunOutcome]) -> dict[str, Any] | None:
    runs = {
        o.spec.labels["schedule"]: o
        for o in outcomes.values()
        if o.spec.labels.get("runtime") == "dist"
    }
    if set(runs) != {"1f1b", "paci"}:
        return None
    target = max(
        min(r["val_loss"] for r in run.metrics if r.get("val_loss") is not None)
        for run in runs.values()
    )
    seconds = {k: first_reach(v, target, key="elapsed_s") for k, v in runs.items()}
    return {
        "target": target,
        "seconds_to_target": seconds,
        "speedup": (
            seconds["1f1b"] / seconds["paci"] if seconds["1f1b"] and seconds["paci"] else None
        ),
        "tokens_per_s": {k: v.summary["tokens_per_s"] for k, v in runs.items()},
        "steady_utilization": {k: v.summary.get("steady_utilization") for k, v in runs.items()},
        "ideal_speedup": (4 + 2 - 1) / 4,
        "model": runs["paci"].spec.overrides["model"],
    }


def _drift_figure(path: Path, pairs: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / max(1, len(pairs))
    for i, pair in enumerate(pairs):
        hist = {int(k): v for k, v in pair["drift_histogram"].items()}
        total = sum(hist.values())
        xs = sorted(hist)
        ax.bar(
            [x + i * width for x in xs],
            [hist[x] / total for x in xs],
            width=width,
            label=f"{pair['optimizer']} a={pair['a']}",
        )
    ticks = sorted({int(k) for pair in pairs for k in pair["drift_histogram"]})
    ax.set_xticks([x + width * (len(pairs) - 1) / 2 for x in ticks], [str(x) for x in ticks])
    ax.set_xlabel("updates crossed between forward and backward")
    ax.set_ylabel("share of (stage, micro-batch)")
    ax.set_title("paci drift at P=4 (from the ledger)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def paci_table(summary: dict[str, Any]) -> str:
    lines = [
        f"paci - flush paired by seed: mean [{stats.CONFIDENCE:.0%} CI] (n seeds). Time to "
        "target, drift and memory: the pair of the lowest seed.",
        "",
        "| optimizer | a | flush val | paci val | paci - flush | steps to target "
        "(flush / paci) | projected speed-up | ideal (a+P-1)/a | max crossed per stage "
        "| peak activation MB stage 0 (flush / paci) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in summary["pairs"]:
        mb = [x[0] / 1e6 for x in p["peak_activation_bytes"].values()]
        lines.append(
            f"| {p['optimizer']} | {p['a']} | {_ms(p['val_flush'])} | {_ms(p['val_paci'])} | "
            f"{stats.fmt_interval(p['diff'])} | {p['steps_to_target']['flush']} / "
            f"{p['steps_to_target']['paci']} | {p['projected_speedup']:.2f}x | "
            f"{p['ideal_speedup']:.2f}x | {p['max_crossed']} | {mb[0]:.1f} / {mb[1]:.1f} |"
        )
    if summary.get("lower_lr"):
        lines += [
            "",
            "Smaller steps (AdamW, a=4, seed 0): paci - flush at lower learning rates.",
            "",
            "| lr | flush val | paci val | paci - flush |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['lr']:g} | {r['val_flush']:.4f} | {r['val_paci']:.4f} | {r['diff']:+.4f} |"
            for r in summary["lower_lr"]
        ]
    lines += arms_table(summary.get("arms") or {})
    m = summary.get("measured")
    if m:
        seconds = {
            k: "not reached" if v is None else f"{v:.1f}" for k, v in m["seconds_to_target"].items()
        }
        lines += [
            "",
            "Measured on 2 real processes, one run each (a measurement, no verdict; model "
            f"{m['model']}, a=M=4): seconds to val loss {m['target']:.4f}: "
            f"flush {seconds['1f1b']}, paci {seconds['paci']}"
            f", speed-up {m['speedup'] if m['speedup'] is None else round(m['speedup'], 2)}"
            f" (ideal {m['ideal_speedup']:.2f}); tokens/s flush "
            f"{m['tokens_per_s']['1f1b']:.0f}, paci {m['tokens_per_s']['paci']:.0f}.",
        ]
    return "\n".join(lines)
