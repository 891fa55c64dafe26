"""How much of a model Muon steps: the routing rule's counts for a preset at a vocabulary.

``optim.routing.route_parameters`` sends the 2-D hidden matrices to Muon and the embedding,
head and norm gains to AdamW, so at a large vocabulary a small model's "Muon" run is mostly
AdamW (issue 12, item 5). Built on the meta device: no memory, no initialization.

    python -m nobubble.app.experiments.muon_share tiny:4096 tiny:512 tiny-deep:512
"""

from __future__ import annotations

import sys

import torch

from nobubble.model import GPT, model_config
from nobubble.optim.routing import route_parameters


def muon_share(preset: str, vocab_size: int, seq_len: int = 128) -> dict[str, float | int]:
    """Parameters of ``preset`` at ``vocab_size``: total, Muon's, AdamW's, Muon's share."""
    with torch.device("meta"):
        model = GPT(model_config(preset, vocab_size, seq_len))
    counts = route_parameters(model.named_parameters(), "muon").counts()
    muon, adamw = counts["muon"].elements, counts["adamw"].elements
    return {
        "params": muon + adamw,
        "muon": muon,
        "adamw": adamw,
        "muon_share": muon / (muon + adamw),
    }


def main(argv: list[str]) -> int:
    print("| model | vocab | params | Muon | AdamW | Muon share |")
    print("|---|---|---|---|---|---|")
    for arg in argv or ["tiny:4096", "tiny:512", "tiny-deep:512", "tiny-deep:4096"]:
        preset, vocab = arg.split(":")
        r = muon_share(preset, int(vocab))
        print(
            f"| {preset} | {vocab} | {r['params']:,} | {r['muon']:,} | {r['adamw']:,} "
            f"| {r['muon_share']:.1%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
