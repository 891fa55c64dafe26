"""``nobubble bench runtime``: nobubble's processes against the ``torch.distributed.pipelining``
peers (``--synthetic``: fixed-duration stages against the simulator)."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from nobubble.cli.schedule_cmds import print_table
from nobubble.core.schedules import SCHEDULE_NAMES

if TYPE_CHECKING:  # the bench imports torch, which the parser does not load
    from nobubble.app.bench.runtime import RuntimeBench

# the torch peers of `bench runtime` (nobubble.app.ranks.torch_peer.TORCH_SCHEDULES, named
# here so that the CLI's parser does not import torch)
TORCH_PEERS = (
    "torch-gpipe",
    "torch-1f1b",
    "torch-zb-h1",
    "torch-interleaved-1f1b",
    "torch-interleaved-zb",
    "torch-zbv",
    "torch-dualpipev",
    "torch-looped-bfs",
)


# ----- nobubble bench runtime --------------------------------------------------------------------
def synthetic_pair(text: str) -> tuple[float, float]:
    try:
        fwd, bwd = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected FWD_S,BWD_S (two numbers of seconds), got {text!r}"
        ) from None
    return fwd, bwd


def bench_synthetic(args: argparse.Namespace) -> int:
    """Fixed-duration waits on real processes against the simulator's prediction."""
    from nobubble.app.ranks.synthetic import compare_with_simulator

    names = [n.strip() for n in args.schedule.split(",") if n.strip() in SCHEDULE_NAMES]
    fwd, bwd = args.synthetic
    rows = compare_with_simulator(
        names,
        args.stages,
        args.microbatches,
        args.steps,
        fwd,
        bwd,
        accum=args.microbatches,
        rounds=args.rounds,
        data_parallel=args.data_parallel,
        grad_mb=args.grad_mb,
    )
    if args.json:
        print(json.dumps({"synthetic": {"fwd_s": fwd, "bwd_s": bwd}, "runs": rows}))
        return 0
    print(
        f"synthetic: forward {fwd * 1e3:g} ms, backward {bwd * 1e3:g} ms, P={args.stages}, "
        f"M=a={args.microbatches}, {args.steps} steps, median of {args.rounds} rounds"
        + (
            f", D={args.data_parallel} replicas all-reducing {args.grad_mb:g} MB per step"
            if args.data_parallel > 1
            else ""
        )
    )
    print_table(
        rows,
        [
            "schedule",
            "measured_s",
            "predicted_s",
            "error",
            "predicted_with_latency_s",
            "error_with_latency",
            "latency_ms",
            *(["step_measured_s", "step_predicted_s", "allreduce_ms"] * (args.data_parallel > 1)),
        ],
    )
    return 0


def cmd_bench_runtime(args: argparse.Namespace) -> int:
    if args.synthetic is not None:  # compute-free: the runtime's own overhead vs the simulator
        return bench_synthetic(args)
    from tqdm import tqdm

    from nobubble.app.bench.runtime import RuntimeBench, bench_runtime

    cfg = RuntimeBench(
        model=args.model,
        vocab_size=args.vocab_size,
        optimizer=args.optimizer,
        stages=args.stages,
        microbatches=args.microbatches,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        rounds=args.rounds,
        schedules=tuple(s.strip() for s in args.schedule.split(",")),
        threads=args.threads,
        synthetic=args.synthetic,
        virtual_stages=args.virtual_stages,
        allocator=args.allocator,
    )
    bar = tqdm(total=cfg.rounds * len(cfg.schedules), disable=args.json, leave=False)

    def progress(text: str) -> None:
        bar.set_description(text)
        bar.update(1)

    result = bench_runtime(cfg, progress)
    bar.close()
    if args.json:
        print(json.dumps(result))
        return 0
    _print_setup(cfg, result["config"])
    rows = [_row(variant, result[variant]) for variant in cfg.schedules]
    print_table(rows, list(rows[0]))
    _print_paired(cfg, result)
    return 0


def _print_setup(cfg: RuntimeBench, conf: dict[str, Any]) -> None:
    """What was measured and under which load; the partition and its balance, which caps the
    lighter stages' utilization."""
    print(
        f"model {cfg.model}, P={cfg.stages}, M={cfg.microbatches}, B={cfg.micro_batch_size}, "
        f"T={cfg.seq_len}, {conf['tokens_per_step']} tokens/step, {cfg.rounds} alternating "
        f"rounds x {cfg.steps} steps ({conf['warmup_steps']} warm-up), medians over rounds; "
        f"load average {conf['load_average'][0]:.1f} before, {conf['load_average'][1]:.1f} "
        f"after; allocator {cfg.allocator}"
    )
    part = conf["partition"]
    print(
        f"vocab {cfg.vocab_size}, {cfg.optimizer}; layers per stage {' | '.join(part['layers'])}, "
        f"estimated stage-{part.get('measure', 'cost')} balance (lightest / heaviest) "
        f"{part['balance']:.3f}: "
        "the lighter stages' utilization ceiling"
    )
    for n, cut in conf["partitions"].items():
        if int(n) != cfg.stages:  # the v·P cut of the variants with several stages per rank
            print(
                f"{n} stages ({int(n) // cfg.stages} per rank): layers "
                f"{' | '.join(cut['layers'])}, balance {cut['balance']:.3f}"
            )


def _row(variant: str, r: dict[str, Any]) -> dict[str, Any]:
    """One variant's line of the table; "-" where a comparison does not apply."""
    util = r["utilization"]
    return {
        "variant": variant,
        "tokens_per_s": round(r["tokens_per_s"]),
        "spread": (max(r["tokens_per_s_rounds"]) - min(r["tokens_per_s_rounds"]))
        / r["tokens_per_s"],
        "vs_1f1b": r["vs_1f1b"] if r["vs_1f1b"] is not None else "-",
        "vs_torch_1f1b": r["vs_torch_1f1b"] if r["vs_torch_1f1b"] is not None else "-",
        "vs_torch_twin": r["vs_torch_twin"] if r["vs_torch_twin"] is not None else "-",
        "utilization": [round(u, 3) for u in util] if util else "-",
        "bubble": r["bubble"] if r["bubble"] is not None else "-",
        "peak_act_MB": [round(b / 2**20, 1) for b in r["peak_activation_bytes"]],
        "last_loss": r["last_loss"],
    }


def _print_paired(cfg: RuntimeBench, result: dict[str, Any]) -> None:
    """Each variant against its torch twin, paired by round."""
    from nobubble.app.bench.runtime import TORCH_TWINS

    for variant in cfg.schedules:
        paired = result[variant].get("vs_torch_twin_paired")
        if paired is None:
            continue
        ci = paired["mean_ci95"]
        spread = f" (95% interval {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""
        print(
            f"{variant} / {TORCH_TWINS[variant]}, paired by round: median {paired['median']:.3f}, "
            f"mean {paired['mean']:.3f}{spread}, faster in "
            f"{paired['faster_rounds']} of {paired['rounds']} rounds"
        )
