"""``nobubble bench sim | emulator | runtime | memory | time-to-target``: benchmarks that
print figures, never timed tests."""

from __future__ import annotations

import argparse
import json
import time

from nobubble.cli.bench_runtime_cmds import TORCH_PEERS, cmd_bench_runtime, synthetic_pair
from nobubble.cli.schedule_cmds import positive_int, print_table
from nobubble.cli.time_to_target_cmds import add_time_to_target
from nobubble.core.schedules import SCHEDULE_NAMES, build_schedule
from nobubble.core.sim import CostModel, simulate


def cmd_bench_sim(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    rows = []
    simulate(build_schedule(args.schedule, 4, 4, 4, args.accum), CostModel())  # warm imports
    sizes = [max(1, args.steps // 2), args.steps]
    for steps in tqdm(sizes, desc="bench sim", disable=args.json, leave=False):
        t0 = time.perf_counter()
        schedule = build_schedule(args.schedule, args.stages, args.microbatches, steps, args.accum)
        t1 = time.perf_counter()
        simulate(schedule, CostModel(fwd=1.0, bwd=2.0))  # validation included
        t2 = time.perf_counter()
        n = schedule.num_actions()
        rows.append(
            {
                "schedule": args.schedule,
                "stages": args.stages,
                "microbatches": schedule.num_microbatches,
                "steps": steps,
                "actions": n,
                "generate_s": t1 - t0,
                "simulate_s": t2 - t1,
                "total_s": t2 - t0,
                "us_per_action": (t2 - t0) / n * 1e6,
            }
        )
        del schedule  # free before the next size so both are measured alike
    if args.json:
        print(json.dumps({"runs": rows}))
    else:
        print_table(rows, list(rows[0]))
        ratio = rows[1]["total_s"] / rows[0]["total_s"]
        actions = rows[1]["actions"] / rows[0]["actions"]
        print(f"time ratio {ratio:.2f} for {actions:.2f}x the actions (linear: equal)")
    return 0


# ----- nobubble bench emulator -------------------------------------------------------------------
def cmd_bench_emulator(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from nobubble.app.bench.emulator import EmulatorBench, bench_emulator

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EmulatorBench(
        model=args.model,
        stages=args.stages,
        microbatches=args.microbatches,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        rounds=args.rounds,
        schedules=tuple(args.schedule.split(",")),
        compile=args.compile,
    )
    per_round = 1 + len(cfg.schedules) * (1 + cfg.api + cfg.compile)
    bar = tqdm(total=args.rounds * per_round, disable=args.json, leave=False)

    def progress(text: str) -> None:
        bar.set_description(text)
        bar.update(1)

    result = bench_emulator(cfg, progress)
    bar.close()
    if args.json:
        print(json.dumps({"config": vars(args) | {"func": None}, "results": result}))
        return 0
    print(
        f"model {cfg.model}, P={cfg.stages}, M={cfg.microbatches}, B={cfg.micro_batch_size}, "
        f"T={cfg.seq_len}, {cfg.rounds} alternating rounds x {cfg.steps - 1} timed steps, "
        f"torch threads {torch.get_num_threads()}"
    )
    rows = [{"variant": k, **v} for k, v in result.items()]
    print_table(
        rows, ["variant", "median_step_s", "tokens_per_s", "overhead_vs_plain", "steps_timed"]
    )
    return 0


# ----- nobubble bench memory ----------------------------------------------------------------------
def cmd_bench_memory(args: argparse.Namespace) -> int:
    from nobubble.app.bench.memory import MemoryBench, run

    cfg = MemoryBench(
        hidden=args.hidden,
        intermediate=args.intermediate,
        layers=args.layers,
        vocab=args.vocab_size,
        stages=tuple(int(p) for p in args.stages.split(",")),
        schedule=args.schedule,
        steps=args.steps,
        microbatches=args.microbatches,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        data=args.data,
        allocator=args.allocator,
        fused_adamw=args.fused_adamw,
        fused_grad_accumulation=args.fused_grad_accumulation,
        activation_checkpointing=args.activation_checkpointing,
        where=args.where,
    )

    def progress(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    result = run(cfg, progress)
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"HF Llama, {cfg.layers} blocks, hidden {cfg.hidden}, intermediate {cfg.intermediate}, "
        f"vocab {cfg.vocab}: {result['params'] / 1e6:.1f}M parameters, "
        f"{result['whole_weights_bytes'] / (1 << 20):.0f} MiB of fp32 weights (the whole "
        "model). build: peak once the model was built, minus the idle rank's; growth: the "
        "run's peak minus the idle rank's; bound: the stage's weights + grads + optimizer "
        "state + activations; malloc_free: freed memory malloc kept at the end; seed_*: the "
        "same from the config alone"
    )
    held = True
    for stages in cfg.stages:
        run_p = result[f"P={stages}"]
        print(
            f"\nP={stages} ({cfg.schedule}, {run_p['seconds']} s, val loss {run_p['val_loss']:.4f})"
        )
        print_table(run_p["ranks"], list(run_p["ranks"][0]))
        held = held and all(r["holds"] for r in run_p["ranks"])
    if "export" in result:
        e = result["export"]
        print(
            f"\nexport: {len(e['shards'])} shards; from_pretrained's val loss "
            f"{e['reloaded_val_loss']:.6f}, the pipeline's {e['pipeline_val_loss']:.6f} "
            f"(|difference| {e['difference']:.2e})"
        )
    print("every rank within its bound" if held else "some rank exceeded its bound")
    return 0


def _add_sim(bench: argparse._SubParsersAction) -> None:
    q = bench.add_parser("sim", help="simulator speed at two sizes (linear scaling check)")
    q.add_argument("--schedule", default="paci", choices=SCHEDULE_NAMES)
    q.add_argument("--stages", type=positive_int, default=64)
    q.add_argument("--microbatches", type=positive_int, default=256)
    q.add_argument("--accum", type=positive_int, default=None)
    q.add_argument("--steps", type=positive_int, default=100)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_bench_sim)


def _add_emulator(bench: argparse._SubParsersAction) -> None:
    q = bench.add_parser("emulator", help="emulator time per step vs plain training")
    q.add_argument("--schedule", default="1f1b,paci,2bw", help="comma list of schedules")
    q.add_argument("--model", default="small")
    q.add_argument("--stages", type=positive_int, default=2)
    q.add_argument("--microbatches", type=positive_int, default=4)
    q.add_argument("--micro-batch-size", type=positive_int, default=8)
    q.add_argument("--seq-len", type=positive_int, default=128)
    q.add_argument("--steps", type=positive_int, default=6, help="per round, first not timed")
    q.add_argument("--rounds", type=positive_int, default=3)
    q.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    q.add_argument(
        "--compile",
        action="store_true",
        help="also each schedule through the Pipeline with its blocks compiled (compile-<name>)",
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_bench_emulator)


def _add_runtime(bench: argparse._SubParsersAction) -> None:
    q = bench.add_parser(
        "runtime", help="multi-process runtime vs torch.distributed.pipelining (tokens/s)"
    )
    q.add_argument(
        "--schedule",
        default="1f1b,paci,2bw,gpipe,pipedream,torch-1f1b,torch-gpipe",
        help="comma list of nobubble schedules and torch peers: " + ", ".join(TORCH_PEERS),
    )
    q.add_argument("--model", default="small")
    q.add_argument(
        "--vocab-size",
        type=positive_int,
        default=4096,
        help="BPE vocabulary; it sets the head's cost, so the balance of the split",
    )
    q.add_argument("--optimizer", default="adamw")
    q.add_argument("--stages", type=positive_int, default=2)
    q.add_argument(
        "--virtual-stages",
        type=positive_int,
        default=None,
        help="stages per rank v of interleaved-1f1b, looped-bfs and their torch peers "
        "(default 2; zbv, dualpipev and their torch peers: always 2)",
    )
    q.add_argument("--microbatches", type=positive_int, default=4)
    q.add_argument("--micro-batch-size", type=positive_int, default=8)
    q.add_argument("--seq-len", type=positive_int, default=128)
    q.add_argument("--steps", type=positive_int, default=20, help="per run, first 10%% warm-up")
    q.add_argument("--rounds", type=positive_int, default=3)
    q.add_argument("--threads", type=int, default=0, help="torch threads (0: cores / stages)")
    q.add_argument(
        "--synthetic",
        type=synthetic_pair,
        default=None,
        metavar="FWD_S,BWD_S",
        help="fixed-duration waits instead of compute, compared with the simulator",
    )
    q.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        help="with --synthetic: D replicas, each stage all-reducing --grad-mb per step",
    )
    q.add_argument("--grad-mb", type=float, default=4.0, help="with --data-parallel: MB")
    q.add_argument(
        "--allocator",
        default="as-shipped",
        choices=["as-shipped", "tuned", "default"],
        help="glibc malloc in the ranks: as-shipped (nobubble tuned, torch's peers glibc's "
        "defaults), or the same for both (docs/benchmarks.md, the host allocator)",
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_bench_runtime)


def _add_memory(bench: argparse._SubParsersAction) -> None:
    q = bench.add_parser(
        "memory", help="peak resident memory per rank of a HF Llama under --runtime dist"
    )
    q.add_argument("--stages", default="1,4,8", help="comma list of P")
    q.add_argument("--schedule", default="paci", choices=SCHEDULE_NAMES)
    q.add_argument("--hidden", type=positive_int, default=1024)
    q.add_argument("--intermediate", type=positive_int, default=2816)
    q.add_argument("--layers", type=positive_int, default=8)
    q.add_argument("--vocab-size", type=positive_int, default=8192)
    q.add_argument("--steps", type=positive_int, default=4)
    q.add_argument("--microbatches", type=positive_int, default=8)
    q.add_argument("--micro-batch-size", type=positive_int, default=1)
    q.add_argument("--seq-len", type=positive_int, default=64)
    q.add_argument("--data", default="shakespeare")
    q.add_argument(
        "--allocator",
        default="as-shipped",
        choices=["as-shipped", "release"],
        help="glibc malloc in the ranks: as shipped (freed memory kept for reuse), or every "
        "freed block of 64 KiB or more given back at once (the peak follows the memory in use)",
    )
    q.add_argument(
        "--fused-adamw",
        action="store_true",
        help="train with AdamW's fused step (no per-tensor scratch; nobubble train --fused-adamw)",
    )
    q.add_argument(
        "--fused-grad-accumulation",
        action="store_true",
        help="train with the weight gradients added into .grad inside the backward (no fresh "
        "gradient per micro-batch; nobubble train --fused-grad-accumulation)",
    )
    q.add_argument(
        "--activation-checkpointing",
        default="none",
        choices=["none", "full", "selective"],
        help="train with each block's activations rebuilt at backward (activation_MiB shows "
        "the peak it saves; nobubble train --activation-checkpointing)",
    )
    q.add_argument(
        "--where",
        action="store_true",
        help="each rank samples its resident set every 0.5 ms and reports what it was doing at "
        "the largest (NOBUBBLE_PEAK_WHERE=1; a diagnostic: the sampled peak is at most the true "
        "one)",
    )
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_bench_memory)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures")
    bench = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    _add_sim(bench)
    _add_emulator(bench)
    _add_runtime(bench)
    add_time_to_target(bench)
    _add_memory(bench)
