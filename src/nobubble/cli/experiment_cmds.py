"""``nobubble experiment NAME``: run (or resume) one experiment grid and summarize it."""

from __future__ import annotations

import argparse
import json

EXPERIMENT_NAMES = (
    "delay-vs-optimizer",
    "error-feedback",
    "depth",
    "paci",
    "lr-gap",
    "corrections",
    "depth-verdict",
    "report",
)


def _depths(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(int(x) for x in text.split(","))
    except ValueError:
        depths = ()
    if not depths or any(p < 1 for p in depths):
        raise argparse.ArgumentTypeError(
            f"expected a comma list of stage counts >= 1 such as 2,4,8, got {text!r}"
        )
    return depths


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected a comma list of distinct optimizer names such as adamw,muon, got {text!r}"
        )
    return names


def cmd_experiment(args: argparse.Namespace) -> int:
    from nobubble.app.experiments.experiment import run_experiment

    summary = run_experiment(
        args.name,
        args.quick,
        args.seeds,
        args.out,
        args.jobs,
        progress=not args.json,
        report_to=args.report_to,
        depths=args.depths,
        regime=args.regime,
        optimizers=args.optimizers,
        dry_run=args.dry_run,
    )
    if args.json:
        print(json.dumps(summary, default=str))
        return 0
    if summary.get("dry_run"):
        print(format_dry_run(summary))
        return 0
    if args.name == "report":
        print(f"wrote {summary['report']}")
        for name, verdict in summary["verdicts"].items():
            print(f"  {name}: {verdict}")
        return 0
    from pathlib import Path

    folder = Path(summary["folder"])
    print((folder / "table.md").read_text())
    print(f"figures and summary.json in {folder}")
    return 0


def format_dry_run(listing: dict) -> str:
    """How many runs, and their estimated CPU time one at a time (``--jobs`` runs divide it)."""
    runs = listing["runs"]
    head = (
        f"{listing['experiment']} ({listing['profile']}): {len(runs)} runs, "
        f"{listing['sweep_runs']} of them the learning-rate sweep"
    )
    seconds = listing["cpu_seconds"]
    if seconds is None:
        return head + "; no time estimate for this grid"
    return head + f"; estimated {seconds / 3600:.1f} h of training, one run at a time"


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nobubble.app.demo import format_demo, run_demo

    result = run_demo(Path(args.out), args.steps, args.rounds, progress=not args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_demo(result))
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nobubble.app.study import format_study, run_study

    runs = None
    if args.runs:
        parts = args.runs.split(",")
        if len(parts) != 2:
            raise ValueError(
                f"--runs {args.runs!r}: give two run folders, FUSED,SPLIT (a 1f1b and a zb-h1 "
                "run of `nobubble train --runtime dist` with the same settings)"
            )
        runs = (Path(parts[0]), Path(parts[1]))
        for run in runs:
            if not (run / "trace.json").exists():
                raise FileNotFoundError(
                    f"{run} has no trace.json: not a finished --runtime dist run"
                )
    bench = Path(args.bench) if args.bench else None
    if bench is not None and not bench.exists():
        raise FileNotFoundError(
            f"--bench {bench}: no such file (the JSON of `bench runtime --json`)"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run_study(
        out,
        bench,
        runs,
        model=args.model,
        vocab_size=args.vocab_size,
        micro_batch_size=args.micro_batch_size,
        microbatches=args.microbatches,
        steps=args.steps,
        optimizer=args.optimizer,
    )
    print(json.dumps(result) if args.json else format_study(result))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "study",
        help="async vs zero-bubble: costs measured on 2 processes, simulated for P up to 32",
    )
    p.add_argument("--runs", help="FUSED,SPLIT: measure from these runs instead of fresh ones")
    p.add_argument("--bench", help="the JSON of `nobubble bench runtime --json` to include")
    p.add_argument("--model", default="mini")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="steps of each measuring run")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_study)

    p = sub.add_parser(
        "demo",
        help="paci + Muon vs 1f1b and the best synchronous schedule on 2 real processes",
    )
    p.add_argument("--steps", type=int, default=150)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="segments per run; each round runs one segment of every schedule (ratios per round)",
    )
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("experiment", help="reproduce the papers' claims at small scale")
    p.add_argument("name", choices=EXPERIMENT_NAMES)
    p.add_argument("--quick", action="store_true", help="a few-minute smoke version")
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per configuration (default 3, the fewest that carry a verdict; --quick 1)",
    )
    p.add_argument("--out", default=None, help="root folder (default runs/experiments[-quick])")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    p.add_argument(
        "--depths",
        type=_depths,
        default=None,
        metavar="P,P,...",
        help="depth, depth-verdict: pipeline depths to run (default 2,4,8 and 2,4,8,16; "
        "--quick 2,4 and 2)",
    )
    p.add_argument(
        "--optimizers",
        type=_names,
        default=None,
        metavar="NAME,NAME,...",
        help="run the grid for these of the regime's optimizers only (the lr sweep still covers "
        "all of them); the report names the ones left out",
    )
    p.add_argument(
        "--regime",
        choices=("short", "long", "depth"),
        default="short",
        help="long: ~20 tokens per parameter (issue 12 item 7), for error-feedback and paci; "
        "its summaries go beside the short regime's (NAME-long) and share its runs; "
        "depth: depth-verdict's P = 2..16 on tiny-deep16 (issue 44)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the runs (the lr sweep's included) and their estimated training time; "
        "run nothing",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--report-to",
        default="docs/results.md",
        help="where `report` writes the page (figures go to img/results beside it)",
    )
    p.set_defaults(func=cmd_experiment)
