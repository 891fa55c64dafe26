"""The Muon-dominated preset (issue 12, item 5): Muon, not AdamW, steps most of its parameters."""

from __future__ import annotations

import pytest

from nobubble.app.experiments.muon_share import muon_share
from nobubble.model import model_config


def test_tiny_deep_at_vocab_512_is_mostly_muon() -> None:
    share = muon_share("tiny-deep", 512)
    assert share["muon_share"] > 0.5
    assert share["muon_share"] == pytest.approx(393_216 / 459_840)  # 8 blocks of 49,152
    assert share["params"] == model_config("tiny-deep", 512, 128).num_params()


def test_tiny_at_vocab_4096_is_mostly_adamw() -> None:
    """Why the preset exists: the embedding and head of `tiny` at vocab 4096 go to AdamW."""
    assert muon_share("tiny", 4096)["muon_share"] < 0.3
