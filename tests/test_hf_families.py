"""Each supported Hugging Face family through the rest of the support: PACI against the
ledger-driven live-weight loop, a meta-device build materialized stage by stage from a seed and
from the model's safetensors, and ``export`` reloaded by transformers.

One case per family (``_hf_cases``), the one with the most fields set. References: the
``_api_reference`` loops, transformers' ``from_config`` and ``from_pretrained``."""

from __future__ import annotations

import pytest
import torch

import nobubble
from _api_reference import LiveLoop, M, Problem, assert_bitwise, run_pipeline, weights
from _hf_cases import CASES, build, tokens
from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import build_schedule
from nobubble.hf import FAMILIES, meta_model
from nobubble.model import lm_loss

transformers = pytest.importorskip("transformers")

FAMILY_CASE = {
    "llama": "llama-tied-head-dim",
    "mistral": "mistral-window-eager",
    "qwen2": "qwen2-window-tied",
    "qwen3": "qwen3-window",
    "gpt2": "gpt2",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3-window-partial",
    "olmo2": "olmo2-eager-bias-tied-linear",
    "gpt_neox": "gpt_neox",
}
NEW = ["gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "gpt_neox"]


def test_one_case_per_family():
    assert sorted(FAMILY_CASE) == sorted(FAMILIES)
    assert all(CASES[name][0]().model_type == family for family, name in FAMILY_CASE.items())


@pytest.mark.parametrize("family", NEW)
def test_paci_equals_the_ledger_driven_live_weight_loop(family):
    """Tied heads are untied for an asynchronous schedule (it refuses a tied pair)."""
    name, steps = FAMILY_CASE[family], 3
    problem = Problem(
        lambda: build(name),
        lambda model, n: nobubble.split(model, n, untie=True),
        tokens,
        lm_loss,
    )
    pipe, losses, _ = run_pipeline(problem, "paci", 2, steps)
    schedule = build_schedule("paci", 2, M, steps)
    ref = LiveLoop(problem, schedule, build_ledger(schedule)).run()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses == ref.losses
    assert_bitwise(weights(pipe.stages), ref.params)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (non-persistent ones too: rotary tables, Gemma's scale)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _assert_equal(ours: torch.nn.Module, theirs: torch.nn.Module, what: object) -> None:
    a, b = _state(ours), _state(theirs)
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), (what, key)


def _meta(name: str) -> torch.nn.Module:
    config, attention = CASES[name]
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            config(), attn_implementation=attention, dtype=torch.float32
        )


@pytest.mark.parametrize("family", sorted(FAMILY_CASE))
def test_a_meta_build_materializes_each_stage_alone_as_the_normal_build(family):
    """The model's own init replayed over the meta model (its ``_init_weights``: Gemma's
    zero-centred norms and embedding scale, per-type rotary tables), one stage at a time."""
    name = FAMILY_CASE[family]
    reference = nobubble.split(build(name, seed=0), 3)
    for k in range(3):
        stages = nobubble.split(_meta(name), 3)
        nobubble.materialize(stages, k, seed=0)
        _assert_equal(stages[k], reference[k], k)
        assert all(p.is_meta for i, s in enumerate(stages) if i != k for p in s.parameters())


@pytest.mark.parametrize("family", sorted(FAMILY_CASE))
def test_safetensors_load_per_stage_and_export_reloads_with_the_same_logits(family, tmp_path):
    name = FAMILY_CASE[family]
    build(name, seed=3).save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "saved", dtype=torch.float32
    )
    reference = nobubble.split(loaded, 2)
    for k in range(2):
        stages = nobubble.split(meta_model(str(tmp_path / "saved")), 2)
        nobubble.materialize(stages, k, weights=tmp_path / "saved")
        _assert_equal(stages[k], reference[k], k)
    # trained a step through the stages (a tied head as its own copy), then exported
    model = build(name, seed=3)
    pipe = nobubble.Pipeline(nobubble.split(model, 2), lm_loss, schedule="1f1b", microbatches=2)
    pipe.step(*tokens(0))
    pipe.drain()
    out = nobubble.hf.export(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation=CASES[name][1]
    )
    x = tokens(9)[0]
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, pipe.stages[1](pipe.stages[0](x)))
    assert reloaded.config.tie_word_embeddings == model.config.tie_word_embeddings


@pytest.mark.parametrize("family", ["gemma2", "gpt_neox"])
def test_train_cli_then_export_reloads_with_equal_logits(family, tmp_path):
    """`nobubble train --model hf:CONFIG` over two stages, `nobubble export`, then transformers'
    own loader: the same logits, bitwise (Gemma 2: a tied, soft-capped head; GPT-NeoX: a head
    that transformers saves under another name)."""
    from nobubble.app.export import load_run_model
    from nobubble.cli import main

    name = FAMILY_CASE[family]
    config = CASES[name][0]()
    config.vocab_size = 512  # the CLI's byte-level BPE needs its 256 bytes and some merges
    config.save_pretrained(tmp_path / "model")
    run, out = tmp_path / "run", tmp_path / "export"
    flags = "--schedule 1f1b --stages 2 --steps 4 --eval-every 4 --micro-batch-size 2"
    flags += " --seq-len 16 --vocab-size 512 --eval-batches 1 --sample-tokens 0 --no-progress"
    argv = ["train", "--model", f"hf:{tmp_path / 'model' / 'config.json'}", *flags.split()]
    assert main([*argv, "--out", str(run)]) == 0
    assert main(["export", str(run), "--hf", str(out)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, local_files_only=True, dtype=torch.float32, attn_implementation=CASES[name][1]
    )
    _, stages, step = load_run_model(run)
    assert step == 4
    x = tokens(7)[0]
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, stages[1](stages[0](x)))
