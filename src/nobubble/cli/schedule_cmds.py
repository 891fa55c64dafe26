"""Torch-free subcommands: ``schedules``, ``show``, ``ledger``, ``simulate``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nobubble.core.ir import Schedule, ScheduleError, format_grid
from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule, schedule_info
from nobubble.core.sim import CostModel, simulate
from nobubble.core.sim.cost import parse_durations
from nobubble.core.torch_csv import load_torch_csv, to_torch_csv
from nobubble.core.validate import validate


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
    p.add_argument(
        "--stages",
        "-P",
        type=positive_int,
        default=4,
        help="pipeline stages P, one per rank (the ranks, for interleaved-1f1b and zbv)",
    )
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
        "--virtual-stages",
        "-v",
        type=positive_int,
        default=None,
        help="stages per rank v of interleaved-1f1b (default 2; the model is cut into v x P "
        "stages); zbv always places 2",
    )
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
    p.add_argument(
        "--from-torch-csv",
        metavar="FILE",
        default=None,
        help="read a schedule in torch.distributed.pipelining's CSV format (one row per rank, "
        "one batch; --steps repeats it, M and the placement come from the file)",
    )


def schedules_from_args(args: argparse.Namespace) -> list[Schedule]:
    """Schedules named by --schedule (one name, a comma list, or all) or read from --from-json
    or --from-torch-csv."""
    if args.from_json and args.from_torch_csv:
        raise ValueError("give --from-json or --from-torch-csv, not both")
    if args.from_json:
        return [Schedule.load_json(args.from_json)]
    if args.from_torch_csv:
        return [load_torch_csv(args.from_torch_csv, num_steps=args.steps)]
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
        # Like --accum, -v goes to the schedules that take it unless one schedule is named.
        virtual = args.virtual_stages if len(names) == 1 or info.placement == "loop" else None
        if every and info.check is not None:
            try:
                info.check(args.stages, args.microbatches, virtual or info.default_virtual)
            except ScheduleError as err:
                print(f"note: {name} skipped: {err}", file=sys.stderr)
                continue
        out.append(
            build_schedule(
                name,
                args.stages,
                args.microbatches,
                args.steps,
                accum,
                args.drain_every,
                virtual_stages=virtual,
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
    width = max(map(len, SCHEDULES))
    for name, info in SCHEDULES.items():
        print(f"{name:<{width}}  {info.summary}")
    return 0


# ----- nobubble show -----------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> int:
    schedules = schedules_from_args(args)
    if args.format == "torch-csv" and len(schedules) != 1:
        raise ValueError("--format torch-csv writes one schedule: name one with --schedule")
    for schedule in schedules:
        validate(schedule)
        if args.format == "torch-csv":
            print(to_torch_csv(schedule), end="")
        elif args.format == "json":
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
        wgrad=parse_durations(args.wgrad) if args.wgrad else None,
        allreduce=args.allreduce,
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    cost = cost_from_args(args)
    results = {s.name: (s, simulate(s, cost)) for s in schedules_from_args(args)}
    if args.trace:
        from nobubble.core.viz import save_trace, trace_events

        events = []
        for pid, (schedule, res) in enumerate(results.values()):
            lanes = [res.timeline.spans(r) for r in range(schedule.num_ranks)]
            names = [schedule.placement.lane_name(r) for r in range(schedule.num_ranks)]
            events += trace_events(lanes, process_name=schedule.name, pid=pid, lane_names=names)
        save_trace(args.trace, events)
    if args.plot:
        from nobubble.core.viz import save_gantt

        panels = [
            (
                f"{s.name}  P={s.num_stages} M={s.num_microbatches} steps={s.num_steps}  "
                f"bubble {r.metrics.bubble_share:.1%}",
                [r.timeline.spans(k) for k in range(s.num_ranks)],
            )
            for s, r in results.values()
        ]
        lane_names = [
            [s.placement.lane_name(r) for r in range(s.num_ranks)] for s, _ in results.values()
        ]
        save_gantt(
            args.plot,
            panels,
            time_unit="simulated time (cost-model units)",
            lane_names=lane_names,
        )
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
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedules", help="list the schedules, one line each")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_schedules)

    p = sub.add_parser("show", help="print a schedule as a grid, text or JSON")
    add_schedule_args(p)
    p.add_argument(
        "--format",
        choices=["grid", "text", "json", "torch-csv"],
        default="grid",
        help="torch-csv: torch.distributed.pipelining's compute-only CSV, one batch "
        "(synchronous schedules only)",
    )
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
        help="forward duration, one value, one per rank or one per stage",
    )
    p.add_argument(
        "--bwd",
        type=float,
        nargs="+",
        default=[2.0],
        help="backward duration (B = I + W), one value, one per rank or one per stage; a rank "
        "holding v stages spends 1/v of its value on each",
    )
    p.add_argument(
        "--wgrad",
        type=float,
        nargs="+",
        default=None,
        help="the weight-gradient part W of --bwd, for schedules that split the backward into "
        "I = bwd - wgrad and W (default: half of --bwd)",
    )
    p.add_argument("--step-cost", type=float, default=0.0, help="optimizer step duration")
    p.add_argument("--latency", type=float, default=0.0, help="per-transfer latency")
    p.add_argument("--bandwidth", type=float, default=float("inf"), help="bytes per time unit")
    p.add_argument("--activation-bytes", type=float, default=0.0, help="bytes per transfer")
    p.add_argument(
        "--allreduce",
        type=float,
        default=0.0,
        help="data-parallel all-reduce of a stage's gradients, per step and stage (added to "
        "the STEP, which waits for it)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object keyed by schedule")
    p.add_argument("--trace", metavar="OUT.json", help="write a Perfetto/Chrome trace")
    p.add_argument("--plot", metavar="OUT.png", help="write a Gantt chart")
    p.set_defaults(func=cmd_simulate)
