"""The ``nobubble`` command line: one parser, one function per subcommand.

Each command runs through ``nobubble.app.command.run_command``: user errors (``ValueError``,
``TypeError``, ``FileNotFoundError``) print one clear line to stderr and exit with status 2; no
traceback.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from nobubble import __version__
from nobubble.app.command import run_command
from nobubble.cli import bench_cmds, experiment_cmds, export_cmds, schedule_cmds, train_cmds

log = logging.getLogger("nobubble")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nobubble",
        description="Pipeline-parallel LM pretraining with synchronous and asynchronous schedules.",
    )
    parser.add_argument("--version", action="version", version=f"nobubble {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    schedule_cmds.register(sub)
    bench_cmds.register(sub)
    train_cmds.register(sub)
    experiment_cmds.register(sub)
    export_cmds.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "takes_unknown", False):
        args.train_args = unknown  # `train` parses its own flags (app/train/flags.py)
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return run_command(args.command, lambda: args.func(args), args.verbose)
