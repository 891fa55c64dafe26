"""The conformance suite of the Hugging Face support: every supported family, over the config
fields that change its forward (``_hf_cases.CASES``), computes through nobubble's stages what the
model's own forward computes, and trains under 1f1b as plain training of the unsplit model
does. A field the stages do not honour is refused by name at split time.

References: the unsplit ``transformers`` model (its forward, and gradient accumulation on it in
``_api_reference.plain_accumulation``)."""

from __future__ import annotations

import pytest
import torch

import nobubble
from _api_reference import Problem, plain_accumulation, run_pipeline, weights
from _hf_cases import CASES, FAMILY_OF, SEQ_LEN, VOCAB, build, tied, tokens
from nobubble.hf import FAMILIES
from nobubble.model import lm_loss

transformers = pytest.importorskip("transformers")


def _through(stages: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def test_every_supported_family_has_cases():
    assert sorted(set(FAMILY_OF.values())) == sorted(FAMILIES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_stages_give_the_models_own_logits(name):
    """Two stages, then one block per stage (each stage rebuilds its masks and rotary tables;
    the head and the final soft-cap on the last alone)."""
    model = build(name)
    x = tokens(1)[0]
    with torch.no_grad():
        ref = model(x).logits
        for cut in (2, 4):
            ours = _through(nobubble.split(model, cut), x)
            assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6), (cut, (ours - ref).abs().max())


def _sgd(named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9)


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_1f1b_step_equals_plain_training(name):
    """Losses bitwise; weights bitwise, or within 1e-5 of their scale for a tied pair (the
    pipeline adds the head's and the embedding's gradient sums in another order: see
    test_hf.py's tied GPT-2 test). SGD keeps such differences at their size."""
    problem = Problem(
        lambda: build(name),
        lambda model, n: nobubble.split(model, n),
        tokens,
        lm_loss,
        lambda model, x: model(x).logits,
    )
    _, losses, model = run_pipeline(problem, "1f1b", 2, 1, optimizer=_sgd)
    ref_losses, ref_weights = plain_accumulation(problem, 1, optimizer=_sgd)
    assert losses == ref_losses
    ours, pair = weights([model]), tied(name)
    if pair:
        embed, head = nobubble.hf.embedding_names(FAMILY_OF[name])
        assert head not in ref_weights  # one parameter in the unsplit model
        assert torch.equal(ours.pop(head), ours[embed])  # the two copies took the same step
    assert ours.keys() == ref_weights.keys()
    for key, value in ours.items():
        ref = ref_weights[key]
        exact = torch.equal(value, ref)
        assert exact or (pair and (value - ref).abs().max() <= 1e-5 * ref.abs().max()), key


def test_soft_caps_and_windows_bite_so_the_checks_above_can_fail():
    """Guard: in the capped Gemma 2 case, leaving out the final soft-cap, or giving the sliding
    layers a full mask, moves the logits far beyond the tolerance."""
    model = build("gemma2")
    x = tokens(1)[0]
    stages = nobubble.split(model, 2)
    with torch.no_grad():
        ref = model(x).logits
        stages[-1].layout = nobubble.hf.Layout(attention="layer_types")  # no soft-cap
        assert (_through(stages, x) - ref).abs().max() > 1e-3
        stages[-1].layout = nobubble.hf.LAYOUTS["gemma2"]
        for stage in stages:
            stage.layer_kinds = ("full_attention",) * len(stage.layer_kinds)
        assert (_through(stages, x) - ref).abs().max() > 1e-3


# ----- refusals, by name, before any work ---------------------------------------------------
def _config(model_type: str, **over):
    name = next(n for n, family in FAMILY_OF.items() if family == model_type)
    config = CASES[name][0]()
    for key, value in over.items():
        setattr(config, key, value)
    return config


def test_bidirectional_attention_is_refused():
    config = _config("gemma3_text", use_bidirectional_attention=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True .*set .*=False"):
        nobubble.split(model, 2)
    gemma = transformers.AutoModelForCausalLM.from_config(
        _config("gemma", use_bidirectional_attention=True)
    )
    with pytest.raises(ValueError, match=r"gemma config: use_bidirectional_attention=True"):
        nobubble.split(gemma, 2)
    llama = build("llama")
    llama.config.is_causal = False  # transformers' masks then let every token see every other
    with pytest.raises(ValueError, match=r"llama config: is_causal=False .*set is_causal=True"):
        nobubble.split(llama, 2)


def test_gpt2_cross_attention_is_refused():
    config = _config("gpt2", add_cross_attention=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"gpt2 config: add_cross_attention=True .*=False"):
        nobubble.split(model, 2)


def test_an_unknown_attention_implementation_is_refused_and_a_gpu_kernel_warned(caplog):
    model = build("llama")
    model.config._attn_implementation = "my_kernel"
    with pytest.raises(
        ValueError, match=r"attn_implementation='my_kernel' .* use one of eager, sdpa, flash"
    ):
        nobubble.split(model, 2)
    model.config._attn_implementation = "flash_attention_2"
    with caplog.at_level("WARNING"):
        nobubble.split(model, 2)
    assert "checks only eager, sdpa" in caplog.text


def test_an_attention_type_without_a_mask_is_refused():
    config = _config("qwen2", layer_types=["full_attention", "linear_attention"] * 2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"layer_types has \['linear_attention'\]"):
        nobubble.split(model, 2)


def test_other_families_and_models_without_a_head_are_refused():
    olmo = transformers.AutoModelForCausalLM.from_config(
        transformers.OlmoConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ_LEN,
            pad_token_id=0,
            eos_token_id=0,
        )
    )
    with pytest.raises(ValueError, match=r"model type 'olmo' is not supported yet; supported: "):
        nobubble.split(olmo, 2)
    with pytest.raises(ValueError, match=r"'gemma3' is Gemma 3 with its vision tower.*gemma3_text"):
        nobubble.hf.check_family("gemma3")
    base = transformers.AutoModel.from_config(_config("llama"))  # LlamaModel: no head
    with pytest.raises(ValueError, match=r"LlamaModel has no lm_head.*ForCausalLM"):
        nobubble.split(base, 2)
