"""``nobubble train``: its flags are built only when it is chosen (``app/train/flags.py``), so the
other commands start without importing torch; the run itself is ``app.command.train_main``."""

from __future__ import annotations

import argparse

from nobubble.app.train.flags import build_train_parser, config_from_args

__all__ = ["build_train_parser", "cmd_train", "config_from_args", "register"]


def cmd_train(outer: argparse.Namespace) -> int:
    from nobubble.app.command import train_main

    return train_main(outer.train_args)


def register(sub: argparse._SubParsersAction) -> None:
    # The flags are parsed by build_train_parser() once `train` is chosen, so the torch-free
    # commands start without importing torch.
    p = sub.add_parser(
        "train", help="train a language model under a pipeline schedule", add_help=False
    )
    p.set_defaults(func=cmd_train, takes_unknown=True)
