"""``nobubble experiment NAME``: run (or resume) one experiment grid and summarize it."""

from __future__ import annotations

import argparse
import json

EXPERIMENT_NAMES = ("delay-vs-optimizer", "error-feedback", "depth", "paci", "report")


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


def cmd_experiment(args: argparse.Namespace) -> int:
    from nobubble.experiments import run_experiment

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
    )
    if args.json:
        print(json.dumps(summary, default=str))
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


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nobubble.demo import format_demo, run_demo

    result = run_demo(Path(args.out), args.steps, progress=not args.json)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_demo(result))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="paci + Muon vs 1f1b on 2 real processes, side by side")
    p.add_argument("--steps", type=int, default=150)
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
        help="depth: pipeline depths to run (default 2,4,8; --quick 2,4)",
    )
    p.add_argument(
        "--regime",
        choices=("short", "long"),
        default="short",
        help="long: ~20 tokens per parameter (issue 12 item 7), for error-feedback and paci; "
        "its summaries go beside the short regime's (NAME-long) and share its runs",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--report-to",
        default="docs/results.md",
        help="where `report` writes the page (figures go to img/results beside it)",
    )
    p.set_defaults(func=cmd_experiment)
