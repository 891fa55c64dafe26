"""``nobubble study``: asynchronous against zero-bubble schedules, measured and simulated.

Two parts, written to docs/async-vs-zero-bubble.md:

1. **Measured** at P=2: ``nobubble bench runtime`` (alternating rounds) gives every variant's
   tokens/s on this machine; the study reads its JSON (``--bench FILE``) as it is.
2. **Simulated** for P in {4, 8, 16, 32} and M in {P, 2P, 4P}, with the per-micro-batch costs
   measured on this machine: F, the fused B, the split I and W, the optimizer step and the send
   of one boundary, each the median of a measured timeline's spans (``measure_costs``). Every
   stage of a P-stage pipeline is given the mean measured stage's costs: the model grows with P
   at constant work per stage (weak scaling), so the grid isolates the schedules, not a model's
   split. A rank holding v stages spends 1/v of those costs on each (``CostModel``).

Two cost scenarios for the split backward: ``measured`` (I and W as this machine runs them, two
autograd passes) and ``ideal`` (I + W = B, W's measured share of it kept: the accounting the
zero-bubble papers use and GPUs approach). The fused schedules use B in both.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nobubble.core.comm_ops import outgoing
from nobubble.core.schedules import SCHEDULES, build_schedule
from nobubble.core.sim import CostModel, simulate

# the synchronous schedules, then the asynchronous ones; 1f1b is every ratio's denominator
STUDY_SCHEDULES = (
    "1f1b",
    "interleaved-1f1b",
    "looped-bfs",
    "zb-h1",
    "zbv",
    "dualpipev",
    "2bw",
    "paci",
)
PIPELINE_SIZES = (4, 8, 16, 32)
M_FACTORS = (1, 2, 4)  # M = factor * P
SCENARIOS = ("measured", "ideal")


@dataclass(frozen=True)
class MeasuredCosts:
    """Seconds per micro-batch on one stage of the measured two-stage runs (mean over the two
    stages of each kind's median span), and the bytes of one stage boundary."""

    fwd: float
    bwd: float  # the fused backward B
    bwd_input: float  # I
    bwd_weight: float  # W
    step: float
    transfer: float  # one send of a boundary activation or gradient
    boundary_bytes: int
    activation_bytes: int  # autograd's saved tensors of one micro-batch on one stage
    tokens_per_microbatch: int


def _spans(run_dir: Path) -> dict[tuple[str, int], list[float]]:
    """Durations (s) of a run's measured spans by (kind, stage): F, B, I, W, STEP, SEND_F..."""
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    out: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e.get("ph") == "X":
            out.setdefault((e["args"]["kind"], e["args"]["stage"]), []).append(e["dur"] / 1e6)
    return out


def _mean_median(
    spans: dict[tuple[str, int], list[float]], kinds: Sequence[str], first: int = 0
) -> float:
    """The mean over stages ``first``.. of each stage's median span of ``kinds``."""
    medians = [statistics.median(v) for (k, s), v in spans.items() if k in kinds and s >= first]
    if not medians:
        raise ValueError(f"the measured timeline has no {'/'.join(kinds)} spans")
    return statistics.mean(medians)


def measure_costs(fused_run: Path, split_run: Path) -> MeasuredCosts:
    """Costs from a finished ``--runtime dist`` run of a fused-backward schedule (1f1b) and one
    of a split-backward schedule (zb-h1) of the same configuration."""
    from nobubble.model import model_config

    fused, split = _spans(fused_run), _spans(split_run)
    cfg = json.loads((fused_run / "config.json").read_text())["config"]
    dim = model_config(cfg["model"], cfg["vocab_size"], cfg["seq_len"]).dim
    summary = json.loads((fused_run / "summary.json").read_text())
    per_stage = [
        b / max(n, 1)
        for b, n in zip(summary["peak_activation_bytes"], summary["peak_inflight"], strict=True)
    ]
    tokens = cfg["micro_batch_size"] * cfg["seq_len"]
    return MeasuredCosts(
        fwd=_mean_median(fused, ["F"]),
        bwd=_mean_median(fused, ["B"]),
        # from the stages whose input takes a gradient: the first stage's I is empty and its
        # W the whole backward (engine/split_backward.py); the simulator charges every stage
        # these costs
        bwd_input=_mean_median(split, ["I"], first=1),
        bwd_weight=_mean_median(split, ["W"], first=1),
        step=_mean_median(fused, ["STEP"]),
        transfer=_mean_median(fused, ["SEND_F", "SEND_B"]),
        boundary_bytes=tokens * dim * 4,  # fp32 hidden states, and their gradient
        activation_bytes=int(statistics.mean(per_stage)),
        tokens_per_microbatch=tokens,
    )


def measure_runs(out: Path, **bench: Any) -> MeasuredCosts:
    """Run 1f1b and zb-h1 on two processes (``bench``: ``RuntimeBench`` fields) and measure."""
    from nobubble.app.bench.runtime import RuntimeBench, run_nobubble

    spec = RuntimeBench(schedules=("1f1b", "zb-h1"), **bench)
    for name in spec.schedules:
        run_nobubble(spec.train_config(name), out / name, out / f"{name}.log")
    return measure_costs(out / "1f1b", out / "zb-h1")


def cost_model(costs: MeasuredCosts, schedule: str, scenario: str) -> CostModel:
    split = SCHEDULES[schedule].split_backward
    if split and scenario == "measured":
        bwd, wgrad = costs.bwd_input + costs.bwd_weight, costs.bwd_weight
    else:  # fused, or the ideal split: I + W = B with W's measured share of the split
        share = costs.bwd_weight / (costs.bwd_input + costs.bwd_weight)
        bwd, wgrad = costs.bwd, costs.bwd * share
    return CostModel(fwd=costs.fwd, bwd=bwd, wgrad=wgrad, step=costs.step, latency=costs.transfer)


def bytes_sent_per_step(schedule_name: str, P: int, M: int, steps: int, boundary: int) -> int:
    """The most bytes one rank sends to other ranks per optimizer step."""
    schedule = build_schedule(schedule_name, P, M, steps, max_actions=None)
    counts = [
        sum(outgoing(a, schedule.num_stages, schedule.placement) is not None for a in order)
        for order in schedule.ranks
    ]
    return max(counts) * boundary // steps


def simulate_row(
    costs: MeasuredCosts, schedule: str, P: int, M: int, scenario: str, steps: int = 4
) -> dict[str, Any]:
    built = build_schedule(schedule, P, M, steps, max_actions=None)
    metrics = simulate(built, cost_model(costs, schedule, scenario)).metrics
    virtual = built.num_stages // P
    return {
        "schedule": schedule,
        "P": P,
        "M": M,
        "scenario": scenario,
        "tokens_per_s": metrics.throughput * costs.tokens_per_microbatch,
        "bubble": metrics.steady_bubble_share,
        # a rank's stages hold 1/v of its layers each: stage-micro-batches / v micro-batches
        "peak_activation_bytes": max(metrics.rank_peak_inflight)
        * costs.activation_bytes
        // virtual,
        "peak_inflight": max(metrics.rank_peak_inflight) / virtual,
        "weight_copies": max(metrics.peak_versions),
        "bytes_sent_per_step": bytes_sent_per_step(schedule, P, M, steps, costs.boundary_bytes),
    }


def simulate_grid(
    costs: MeasuredCosts,
    schedules: Sequence[str] = STUDY_SCHEDULES,
    sizes: Sequence[int] = PIPELINE_SIZES,
    factors: Sequence[int] = M_FACTORS,
    scenarios: Sequence[str] = SCENARIOS,
) -> list[dict[str, Any]]:
    """Every (scenario, P, M, schedule) of the grid; ``vs_1f1b`` is throughput over 1f1b's. A
    schedule that refuses a point (dualpipev needs M >= 2P) has no row there."""
    rows = []
    for scenario in scenarios:
        for P in sizes:
            for factor in factors:
                runs = [s for s in schedules if _valid(s, P, factor * P)]
                group = [simulate_row(costs, s, P, factor * P, scenario) for s in runs]
                base = next(r for r in group if r["schedule"] == "1f1b")["tokens_per_s"]
                rows += [{**r, "vs_1f1b": r["tokens_per_s"] / base} for r in group]
    return rows


def _valid(schedule: str, P: int, M: int) -> bool:
    try:
        build_schedule(schedule, P, M, 1, max_actions=None)
    except ValueError:
        return False
    return True


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (scenario, P, M): the fastest synchronous and asynchronous schedules and the margin."""
    out = []
    keys = sorted({(r["scenario"], r["P"], r["M"]) for r in rows})
    for key in keys:
        group = [r for r in rows if (r["scenario"], r["P"], r["M"]) == key]
        sync = max((r for r in group if SCHEDULES[r["schedule"]].synchronous), key=_speed)
        asyn = max((r for r in group if not SCHEDULES[r["schedule"]].synchronous), key=_speed)
        out.append(
            {
                "scenario": key[0],
                "P": key[1],
                "M": key[2],
                "best_sync": sync["schedule"],
                "best_async": asyn["schedule"],
                "async_over_sync": asyn["tokens_per_s"] / sync["tokens_per_s"],
            }
        )
    return out


def _speed(row: dict[str, Any]) -> float:
    return float(row["tokens_per_s"])


def plot_grid(rows: list[dict[str, Any]], path: Path) -> Path:
    """Throughput over 1f1b's against P, one panel per M/P, the measured scenario solid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factors = sorted({r["M"] // r["P"] for r in rows})
    fig, axes = plt.subplots(1, len(factors), figsize=(4.2 * len(factors), 3.6), sharey=True)
    for ax, factor in zip(axes, factors, strict=True):
        for i, schedule in enumerate(STUDY_SCHEDULES):
            for scenario, style in (("measured", "-"), ("ideal", ":")):
                pts = sorted(
                    (r["P"], r["vs_1f1b"])
                    for r in rows
                    if r["schedule"] == schedule
                    and r["scenario"] == scenario
                    and r["M"] == factor * r["P"]
                )
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        style,
                        marker="o",
                        color=f"C{i}",
                        label=schedule if scenario == "measured" else None,
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pipeline stages P")
        ax.set_title(f"M = {factor}P")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("simulated tokens/s / 1f1b's")
    axes[-1].legend(fontsize=8, loc="best")
    fig.suptitle("solid: split backward as measured; dotted: ideal split (I + W = B)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_study(
    out: Path,
    bench_json: Path | None = None,
    runs: tuple[Path, Path] | None = None,
    **bench: Any,
) -> dict[str, Any]:
    """Measure the costs (from ``runs``, or two fresh runs), simulate the grid, plot it."""
    if runs is not None:
        costs = measure_costs(*runs)
    else:
        with tempfile.TemporaryDirectory(prefix="nobubble-study-") as tmp:
            costs = measure_runs(Path(tmp), **bench)
    rows = simulate_grid(costs)
    figure = plot_grid(rows, out / "async-vs-zero-bubble.png")
    result = {
        "costs": asdict(costs),
        "grid": rows,
        "verdicts": verdicts(rows),
        "figure": str(figure),
        "measured": json.loads(bench_json.read_text()) if bench_json else None,
    }
    (out / "study.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def format_measured(bench: dict[str, Any]) -> list[str]:
    """The table of a ``bench runtime --json`` result: medians over its alternating rounds."""
    lines = [
        "| variant | tokens/s (median) | per round | vs 1f1b | vs torch twin | bubble | "
        "peak act. MB/rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in bench.items():
        if name == "config":
            continue
        rounds = ", ".join(f"{t:,.0f}" for t in r["tokens_per_s_rounds"])
        twin = r.get("vs_torch_twin")
        bubble = r.get("bubble")
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {rounds} | {r['vs_1f1b']:.2f} | "
            f"{'-' if twin is None else f'{twin:.2f}'} | "
            f"{'-' if bubble is None else f'{bubble:.1%}'} | "
            f"{max(r['peak_activation_bytes']) / 2**20:.0f} |"
        )
    return lines


def format_study(result: dict[str, Any]) -> str:
    c = result["costs"]
    lines = [*format_measured(result["measured"]), ""] if result.get("measured") else []
    lines += [
        "measured per micro-batch and stage (s): "
        f"F {c['fwd']:.4f}  B {c['bwd']:.4f}  I {c['bwd_input']:.4f}  W {c['bwd_weight']:.4f}  "
        f"STEP {c['step']:.4f}  send {c['transfer']:.6f}",
        "",
        "| scenario | P | M | schedule | tokens/s | vs 1f1b | bubble | peak act. MB/rank "
        "| weight copies | MB sent/step/rank |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["grid"]:
        lines.append(
            f"| {r['scenario']} | {r['P']} | {r['M']} | {r['schedule']} | "
            f"{r['tokens_per_s']:,.0f} | {r['vs_1f1b']:.2f} | {r['bubble']:.1%} | "
            f"{r['peak_activation_bytes'] / 2**20:.1f} | {r['weight_copies']} | "
            f"{r['bytes_sent_per_step'] / 2**20:.1f} |"
        )
    lines += [
        "",
        "| scenario | P | M | best sync | best async | async / sync |",
        "|---|---|---|---|---|---|",
    ]
    for v in result["verdicts"]:
        lines.append(
            f"| {v['scenario']} | {v['P']} | {v['M']} | {v['best_sync']} | {v['best_async']} | "
            f"{v['async_over_sync']:.3f} |"
        )
    lines.append(f"\nfigure: {result['figure']}")
    return "\n".join(lines)
