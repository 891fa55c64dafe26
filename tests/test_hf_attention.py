"""Per-layer attention under the pipeline: each layer of a Hugging Face model gets its own
attention type's mask (full or sliding window) in its stage, as in the model's own forward.
The reference is the unsplit ``transformers`` model on the same tokens."""

from __future__ import annotations

import pytest
import torch

import nobubble
from _api_reference import Problem, assert_bitwise, plain_accumulation, run_pipeline, weights
from nobubble.model import lm_loss

transformers = pytest.importorskip("transformers")
VOCAB, SEQ_LEN, WINDOW = 64, 32, 8


def _small(**over):
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
        **over,
    )


CONFIGS = {
    "mistral-window": lambda: transformers.MistralConfig(**_small(sliding_window=WINDOW)),
    "qwen2-window": lambda: transformers.Qwen2Config(
        **_small(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    ),
    "qwen3-window": lambda: transformers.Qwen3Config(
        **_small(head_dim=8, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    ),
    "mistral-full": lambda: transformers.MistralConfig(**_small(sliding_window=None)),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).train()


def _through(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("cuts", [2, 4])
def test_stages_give_the_models_own_logits(name, cuts):
    model = _model(name)
    x = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x).logits
        ours = _through(nobubble.split(model, cuts), x)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6), (ours - ref).abs().max()


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window", "qwen3-window"])
def test_the_window_changes_the_logits_so_the_check_above_can_fail(name):
    """Guard for the test above: with the window shorter than the sequence, a full causal mask
    gives other logits (what the stages computed before they honoured the window)."""
    model = _model(name)
    x = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    stages = nobubble.split(model, 2)
    with torch.no_grad():
        ref = model(x).logits
        for stage in stages:
            stage.layer_kinds = ("full_attention",) * len(stage.layer_kinds)
        full = _through(stages, x)
    assert (full - ref).abs().max() > 1e-3


def test_qwen2_layer_types_follow_max_window_layers():
    from nobubble.model.hf_stages import attention_types

    config = CONFIGS["qwen2-window"]()
    assert attention_types(config) == ["full_attention"] * 2 + ["sliding_attention"] * 2
    model = _model("qwen2-window")
    stages = nobubble.split(model, 2)
    assert [s.layer_kinds for s in stages] == [
        ("full_attention",) * 2,
        ("sliding_attention",) * 2,
    ]


def test_a_sliding_window_model_trains_under_1f1b_as_plain_training():
    def batch(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (8, SEQ_LEN + 1), generator=torch.Generator().manual_seed(j))
        return ids[:, :-1], ids[:, 1:]

    problem = Problem(
        lambda: _model("qwen2-window"),
        lambda model, n: nobubble.split(model, n),
        batch,
        lm_loss,
        lambda model, x: model(x).logits,
    )
    _, losses, model = run_pipeline(problem, "1f1b", 2, 2)
    ref_losses, ref_weights = plain_accumulation(problem, 2)
    assert losses == ref_losses
    assert_bitwise(weights([model]), ref_weights)
