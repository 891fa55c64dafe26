"""``nobubble bench time-to-target``: the race of docs/benchmarks.md ("Time to accuracy"), a thin
layer over ``nobubble.app.time_to_target_bench.run_race``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nobubble.cli.schedule_cmds import positive_int


def _seed_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"seeds {text!r}: give a comma list of integers, e.g. 0,1,2") from None


def race_config(args: argparse.Namespace) -> Any:
    from nobubble.app.time_to_target_bench import RaceConfig
    from nobubble.app.time_to_target_tune import Tune

    tune = None
    if args.tune:
        tune = Tune(_seed_list(args.tune_seeds), args.tune_points, args.tune_factor)
    return RaceConfig(
        variants=args.variants,
        seeds=_seed_list(args.seeds),
        steps=args.steps,
        rounds=args.rounds,
        eval_every=args.eval_every,
        train=tuple(args.train),
        equal_budget=args.equal_budget,
        sync=args.sync == "all",
        check_projection=args.check_projection,
        projection_from=None if args.projection_from is None else Path(args.projection_from),
        transfers=args.transfers,
        tune=tune,
        lean_budget=args.lean_budget,
        out=Path(args.out),
        progress=not args.json,
    )


def print_race(result: dict[str, Any], equal_budget: bool) -> None:
    from nobubble.app.time_to_target_report import (
        format_projection_check,
        format_race,
        format_tuning,
    )

    races = {"equal steps": result}
    if equal_budget:
        clock = next(iter(result["equal_steps"]["variants"].values()))["clock"]
        budget = (
            f"equal wall-clock budget ({result['equal_budget']['budget_of']}'s; steps scaled by "
            f"each variant's {clock} throughput, rounded down)"
        )
        races = {"equal steps": result["equal_steps"], budget: result["equal_budget"]}
    for title, one in races.items():
        if "tuning" in one:
            print(format_tuning(one["tuning"]) + "\n")
        print(f"{title}:\n{format_race(one)}")
        if "projection_check" in one:
            print("\n" + format_projection_check(one["projection_check"]))
        print()
    print(f"figure: {result.get('figure') or result['equal_steps']['figure']}")


def show_races(args: argparse.Namespace) -> int:
    """``--show FILE[,FILE...]``: saved races printed again (one: its tables; several: one row
    per race and variant), with ``--projection-from``'s error bars; nothing trains."""
    from nobubble.app.time_to_target_bench import load_race, rebase, verdict_rows
    from nobubble.app.time_to_target_report import format_verdicts

    check = None if args.projection_from is None else Path(args.projection_from)
    files = [Path(f) for f in args.show.split(",") if f.strip()]
    results = {f.stem: load_race(f, check) for f in files}
    if args.against:
        results = {name: rebase(result, args.against) for name, result in results.items()}
    if args.json:
        print(json.dumps(results if len(files) > 1 else results[files[0].stem]))
    elif len(files) == 1:
        result = results[files[0].stem]
        print_race(result, "equal_budget" in result)
    else:
        print(format_verdicts(verdict_rows(results)))
    return 0


def cmd_bench_time_to_target(args: argparse.Namespace) -> int:
    from nobubble.app.time_to_target_bench import run_race

    if args.show is not None:
        return show_races(args)
    if args.against is not None:
        raise ValueError(f"--against {args.against}: it reads saved races; give --show FILE too")
    result = run_race(race_config(args))
    if args.json:
        print(json.dumps(result))
    else:
        print_race(result, args.equal_budget)
    return 0


def add_time_to_target(bench: argparse._SubParsersAction) -> None:
    q = bench.add_parser(
        "time-to-target",
        help="each variant's time to the best synchronous schedule's final loss, a round per seed",
        description="Train 1f1b, every synchronous schedule the runtime trains at this P and M, "
        "and every variant for every seed (the demo's settings: mini, Muon, 2 stages on 2 "
        "processes, M=4; change any with --train), the runs of a seed cut into --rounds "
        "segments that alternate; print each variant's time to its seed's final validation "
        "loss of the best synchronous schedule (the one that reaches its own soonest) and of "
        "1f1b, and the ratios to their times. With --train '--runtime emulate' the clock is "
        "projected from the emulator's measured action costs.",
    )
    q.add_argument(
        "--variants",
        default="1f1b,paci,2bw",
        help="comma list of SCHEDULE[:CORRECTION][@LR], e.g. paci,paci:predict,2bw:ef@0.008 "
        "(1f1b is always run)",
    )
    q.add_argument("--seeds", default="0,1,2", help="comma list of seeds, one round each")
    q.add_argument("--steps", type=positive_int, default=150)
    q.add_argument("--rounds", type=positive_int, default=3, help="segments per run")
    q.add_argument(
        "--eval-every", type=positive_int, default=0, help="0: a fifth of a round's steps"
    )
    q.add_argument(
        "--train",
        type=str.split,
        default=[],
        help="nobubble train flags in one string, after the demo's (they win), e.g. "
        "'--optimizer adamw --lr 3e-3 --stages 4 --runtime emulate'",
    )
    q.add_argument(
        "--sync",
        choices=["all", "1f1b"],
        default="all",
        help="all: race every synchronous schedule the runtime trains here (1f1b, zbv, "
        "interleaved-1f1b, zb-h1; the others are named with the reason); 1f1b: only it",
    )
    q.add_argument(
        "--equal-budget",
        action="store_true",
        help="then train every variant again for the best synchronous schedule's wall-clock "
        "budget: its steps (and lr schedule) scaled by its throughput, rounded down",
    )
    q.add_argument(
        "--lean-budget",
        action="store_true",
        help="(--equal-budget) keep the equal-steps race's tuned lrs instead of tuning again at "
        "the budget's steps, and leave out the plain synchronous schedules other than 1f1b and "
        "the baseline (the same gradients, fewer steps): about 40%% fewer runs",
    )
    _add_tuning(q)
    _add_projection(q)
    q.add_argument("--out", default="runs/time-to-target")
    q.add_argument("--json", action="store_true")
    q.add_argument(
        "--show",
        default=None,
        metavar="FILE[,FILE...]",
        help="print saved races (their --json output) again instead of training: one file, its "
        "tables; several, one row per race and variant; with --projection-from, its error bars",
    )
    q.add_argument(
        "--against",
        default=None,
        metavar="SCHEDULE",
        help="(--show) take every ratio against SCHEDULE's equal-steps run (e.g. zbv) instead "
        "of the best synchronous schedule's: each variant's time to its final loss over its own",
    )
    q.set_defaults(func=cmd_bench_time_to_target)


def _add_tuning(q: argparse.ArgumentParser) -> None:
    q.add_argument(
        "--tune",
        action="store_true",
        help="first tune every variant's lr (a grid around its @LR or --lr) on --tune-seeds at "
        "the race's steps and budget, grown past an edge until the best is interior",
    )
    q.add_argument("--tune-seeds", default="100", help="comma list; none of --seeds")
    q.add_argument("--tune-points", type=positive_int, default=5, help="grid size (>= 5)")
    q.add_argument("--tune-factor", type=float, default=2.0, help="grid spacing (1.4-2.5)")


def _add_projection(q: argparse.ArgumentParser) -> None:
    q.add_argument(
        "--check-projection",
        action="store_true",
        help="(--runtime dist) train every run under the emulator too and report the projected "
        "clock's error against the measured one, per variant",
    )
    q.add_argument(
        "--projection-from",
        default=None,
        metavar="FILE",
        help="a --check-projection race's JSON: its errors become error bars on this race's "
        "projected figures",
    )
    q.add_argument(
        "--transfers",
        action="store_true",
        help="projected clocks charge each hop the send cost measured in --projection-from",
    )
