"""Torch-free subcommands: ``schedules``, ``show``, ``ledger``, ``simulate``, ``bench sim``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from nobubble.ir import Schedule, format_grid
from nobubble.ledger import build_ledger
from nobubble.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule, schedule_info
from nobubble.sim import CostModel, simulate
from nobubble.sim.cost import parse_durations
from nobubble.validate import validate


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_schedule_args(p: argparse.ArgumentParser, allow_all: bool = False) -> None:
    names = ", ".join(SCHEDULE_NAMES) + (", all" if allow_all else "")
    help_text = f"one of {names}" + (" (or a comma list)" if allow_all else "")
    p.add_argument("--schedule", default="all" if allow_all else "1f1b", help=help_text)
    p.add_argument("--stages", "-P", type=positive_int, default=4, help="pipeline stages P")
    p.add_argument(
        "--microbatches",
        "-M",
        type=positive_int,
        default=8,
        help="micro-batches per optimizer step M",
    )
    p.add_argument(
        "--accum",
        "-a",
        type=positive_int,
        default=None,
        help="accumulation factor a of pipedream (default 1) and paci (default M)",
    )
    p.add_argument("--steps", "-N", type=positive_int, default=4, help="optimizer steps")
    p.add_argument(
        "--drain-every",
        type=positive_int,
        default=None,
        help="async schedules drain every K steps (checkpoint points)",
    )
    p.add_argument(
        "--from-json",
        metavar="FILE",
        default=None,
        help="read a (hand-written) schedule from a JSON file instead of generating one",
    )


def schedules_from_args(args: argparse.Namespace) -> list[Schedule]:
    """Schedules named by --schedule (one name, a comma list, or all) or read from --from-json."""
    if args.from_json:
        return [Schedule.load_json(args.from_json)]
    every = args.schedule == "all"
    names = list(SCHEDULE_NAMES) if every else [n.strip() for n in args.schedule.split(",")]
    out = []
    for name in names:
        info = schedule_info(name)
        if name == "2bw" and every and args.microbatches < args.stages - 1:
            print(
                f"note: 2bw skipped: it needs M >= P-1 (M={args.microbatches}, P={args.stages})",
                file=sys.stderr,
            )
            continue
        if len(names) == 1 and args.accum is not None and not info.uses_accum:
            raise ValueError(
                f"--accum {args.accum} applies to pipedream and paci only, not to "
                f"{name}; use --microbatches for {name}"
            )
        accum = args.accum if info.uses_accum else None
        out.append(
            build_schedule(
                name, args.stages, args.microbatches, args.steps, accum, args.drain_every
            )
        )
    return out


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, list):
            return ",".join(fmt(x) for x in v)
        return str(v)

    cells = [[fmt(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


# ----- nobubble schedules ------------------------------------------------------------------------
def cmd_schedules(args: argparse.Namespace) -> int:
    if args.json:
        print(
            json.dumps(
                {
                    n: {"summary": i.summary, "synchronous": i.synchronous}
                    for n, i in SCHEDULES.items()
                }
            )
        )
        return 0
    for name, info in SCHEDULES.items():
        print(f"{name:<10} {info.summary}")
    return 0


# ----- nobubble show -----------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> int:
    for schedule in schedules_from_args(args):
        validate(schedule)
        if args.format == "json":
            print(json.dumps(schedule.to_json()))
        elif args.format == "text":
            print(schedule.to_text(), end="")
        else:
            print(schedule.header())
            print(format_grid(schedule.ranks, max_columns=args.columns))
    return 0


# ----- nobubble ledger ---------------------------------------------------------------------------
def cmd_ledger(args: argparse.Namespace) -> int:
    (schedule,) = schedules_from_args(args)
    validate(schedule)
    ledger = build_ledger(schedule)
    if args.json:
        print(
            json.dumps(
                {
                    "schedule": schedule.name,
                    "stages": schedule.num_stages,
                    "microbatches": schedule.num_microbatches,
                    "steps": schedule.num_steps,
                    "records": list(ledger.records()),
                    "summary": ledger.summary(),
                    "crossed_histogram": {str(k): v for k, v in ledger.crossed_histogram().items()},
                }
            )
        )
        return 0
    print(schedule.header())
    if not args.summary_only:
        print_table(
            list(ledger.records()),
            [
                "stage",
                "microbatch",
                "fwd_version",
                "bwd_version",
                "applied_step",
                "crossed",
                "delay",
            ],
        )
        print()
    print_table(
        ledger.summary(),
        ["stage", "max_crossed", "share_crossed", "max_delay", "peak_inflight", "peak_versions"],
    )
    print("crossed-update histogram:", ledger.crossed_histogram())
    return 0


# ----- nobubble simulate -------------------------------------------------------------------------
def cost_from_args(args: argparse.Namespace) -> CostModel:
    return CostModel(
        fwd=parse_durations(args.fwd),
        bwd=parse_durations(args.bwd),
        step=args.step_cost,
        latency=args.latency,
        bandwidth=args.bandwidth,
        activation_bytes=args.activation_bytes,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    cost = cost_from_args(args)
    results = {s.name: (s, simulate(s, cost)) for s in schedules_from_args(args)}
    if args.trace:
        from nobubble.viz import save_trace, trace_events

        events = []
        for pid, (schedule, res) in enumerate(results.values()):
            lanes = [res.timeline.spans(r) for r in range(schedule.num_ranks)]
            events += trace_events(lanes, process_name=schedule.name, pid=pid)
        save_trace(args.trace, events)
    if args.plot:
        from nobubble.viz import save_gantt

        panels = [
            (
                f"{s.name}  P={s.num_stages} M={s.num_microbatches} steps={s.num_steps}  "
                f"bubble {r.metrics.bubble_share:.1%}",
                [r.timeline.spans(k) for k in range(s.num_ranks)],
            )
            for s, r in results.values()
        ]
        save_gantt(args.plot, panels, time_unit="simulated time (cost-model units)")
    if args.json:
        print(
            json.dumps(
                {
                    name: {"microbatches": s.num_microbatches, **r.metrics.to_json()}
                    for name, (s, r) in results.items()
                }
            )
        )
        return 0
    rows = []
    for name, (s, r) in results.items():
        m = r.metrics
        rows.append(
            {
                "schedule": name,
                "M": s.num_microbatches,
                "makespan": m.makespan,
                "bubble": m.bubble_share,
                "steady_util_min": min(m.steady_utilization),
                "throughput": m.throughput,
                "inflight": m.peak_inflight,
                "versions": m.peak_versions,
                "max_crossed": m.max_crossed,
            }
        )
    print_table(rows, list(rows[0]))
    for path in (args.trace, args.plot):
        if path:
            print(f"wrote {path}")
    return 0


# ----- nobubble bench sim ------------------------------------------------------------------------
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

    from nobubble.bench import EmulatorBench, bench_emulator

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
    )
    per_round = 1 + len(cfg.schedules) * (2 if cfg.api else 1)
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
    from nobubble.dist.synthetic import compare_with_simulator

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
    )
    if args.json:
        print(json.dumps({"synthetic": {"fwd_s": fwd, "bwd_s": bwd}, "runs": rows}))
        return 0
    print(
        f"synthetic: forward {fwd * 1e3:g} ms, backward {bwd * 1e3:g} ms, P={args.stages}, "
        f"M=a={args.microbatches}, {args.steps} steps, median of {args.rounds} rounds"
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
        ],
    )
    return 0


def cmd_bench_runtime(args: argparse.Namespace) -> int:
    if args.synthetic is not None:  # compute-free: the runtime's own overhead vs the simulator
        return bench_synthetic(args)
    from tqdm import tqdm

    from nobubble.bench_runtime import RuntimeBench, bench_runtime

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
    conf = result["config"]
    print(
        f"model {cfg.model}, P={cfg.stages}, M={cfg.microbatches}, B={cfg.micro_batch_size}, "
        f"T={cfg.seq_len}, {conf['tokens_per_step']} tokens/step, {cfg.rounds} alternating "
        f"rounds x {cfg.steps} steps ({conf['warmup_steps']} warm-up), medians over rounds; "
        f"load average {conf['load_average'][0]:.1f} before, {conf['load_average'][1]:.1f} after"
    )
    part = conf["partition"]
    print(
        f"vocab {cfg.vocab_size}, {cfg.optimizer}; layers per stage {' | '.join(part['layers'])}, "
        f"estimated stage-cost balance (lightest / heaviest) {part['balance']:.3f}: "
        "the lighter stages' utilization ceiling"
    )
    rows = []
    for variant in cfg.schedules:
        r = result[variant]
        util = r["utilization"]
        rows.append(
            {
                "variant": variant,
                "tokens_per_s": round(r["tokens_per_s"]),
                "spread": (max(r["tokens_per_s_rounds"]) - min(r["tokens_per_s_rounds"]))
                / r["tokens_per_s"],
                "vs_1f1b": r["vs_1f1b"] if r["vs_1f1b"] is not None else "-",
                "vs_torch_1f1b": r["vs_torch_1f1b"] if r["vs_torch_1f1b"] is not None else "-",
                "utilization": [round(u, 3) for u in util] if util else "-",
                "peak_act_MB": [round(b / 2**20, 1) for b in r["peak_activation_bytes"]],
                "last_loss": r["last_loss"],
            }
        )
    print_table(rows, list(rows[0]))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedules", help="list the schedules, one line each")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_schedules)

    p = sub.add_parser("show", help="print a schedule as a grid, text or JSON")
    add_schedule_args(p)
    p.add_argument("--format", choices=["grid", "text", "json"], default="grid")
    p.add_argument("--columns", type=positive_int, default=48, help="grid width in actions")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("ledger", help="weight versions per stage and micro-batch")
    add_schedule_args(p)
    p.add_argument("--summary-only", action="store_true", help="only the per-stage summary")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(func=cmd_ledger)

    p = sub.add_parser("simulate", help="simulate schedules under a cost model")
    add_schedule_args(p, allow_all=True)
    p.add_argument(
        "--fwd",
        type=float,
        nargs="+",
        default=[1.0],
        help="forward duration, one value or one per stage",
    )
    p.add_argument(
        "--bwd",
        type=float,
        nargs="+",
        default=[2.0],
        help="backward duration, one value or one per stage",
    )
    p.add_argument("--step-cost", type=float, default=0.0, help="optimizer step duration")
    p.add_argument("--latency", type=float, default=0.0, help="per-transfer latency")
    p.add_argument("--bandwidth", type=float, default=float("inf"), help="bytes per time unit")
    p.add_argument("--activation-bytes", type=float, default=0.0, help="bytes per transfer")
    p.add_argument("--json", action="store_true", help="one JSON object keyed by schedule")
    p.add_argument("--trace", metavar="OUT.json", help="write a Perfetto/Chrome trace")
    p.add_argument("--plot", metavar="OUT.png", help="write a Gantt chart")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("bench", help="benchmarks that print figures")
    bench = p.add_subparsers(dest="target", metavar="TARGET", required=True)
    q = bench.add_parser("sim", help="simulator speed at two sizes (linear scaling check)")
    q.add_argument("--schedule", default="paci", choices=SCHEDULE_NAMES)
    q.add_argument("--stages", type=positive_int, default=64)
    q.add_argument("--microbatches", type=positive_int, default=256)
    q.add_argument("--accum", type=positive_int, default=None)
    q.add_argument("--steps", type=positive_int, default=100)
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_bench_sim)

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
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_bench_emulator)

    q = bench.add_parser(
        "runtime", help="multi-process runtime vs torch.distributed.pipelining (tokens/s)"
    )
    q.add_argument(
        "--schedule",
        default="1f1b,paci,2bw,gpipe,pipedream,torch-1f1b,torch-gpipe",
        help="comma list of nobubble schedules and torch-1f1b, torch-gpipe",
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
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=cmd_bench_runtime)
