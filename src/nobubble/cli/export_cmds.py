"""``nobubble export RUN_DIR --hf OUT``: a trained Hugging Face model as a transformers folder."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_export(args: argparse.Namespace) -> int:
    from nobubble.app.export import export_run

    out = export_run(Path(args.run_dir), Path(args.hf))
    print(f"wrote {out} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained Hugging Face model (--model hf:...) as a transformers folder",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with a checkpoint")
    p.add_argument("--hf", metavar="OUT", required=True, help="the folder to write (must be new)")
    p.set_defaults(func=cmd_export)
