"""Hugging Face models under the pipeline: a tiny Llama and a tiny GPT-2 with tied embeddings,
random init from a config (no network), against plain training of the unsplit ``transformers``
model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nobubble
from _api_reference import (
    LiveLoop,
    M,
    Problem,
    assert_bitwise,
    delayed_loop,
    plain_accumulation,
    run_pipeline,
    weights,
)
from nobubble.ledger import build_ledger
from nobubble.model import lm_loss
from nobubble.schedules import build_schedule

transformers = pytest.importorskip("transformers")
VOCAB, SEQ_LEN, ROWS = 64, 16, 8


def llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=SEQ_LEN,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def tokens(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ_LEN + 1), generator=torch.Generator().manual_seed(j))
    return ids[:, :-1], ids[:, 1:]


def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits


LLAMA = Problem(llama, lambda model, n: nobubble.split(model, n), tokens, lm_loss, logits)
STEPS = 6


@pytest.mark.parametrize("stages_n", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_llama_sync_pipeline_equals_plain_accumulation(schedule, stages_n):
    _, losses, model = run_pipeline(LLAMA, schedule, stages_n, STEPS)
    ref_losses, ref_weights = plain_accumulation(LLAMA, STEPS)
    assert losses == ref_losses
    assert_bitwise(weights([model]), ref_weights)  # the transformers model itself is trained


def test_llama_2bw_equals_the_delayed_loop():
    _, losses, model = run_pipeline(LLAMA, "2bw", 2, STEPS)
    ref_losses, ref_weights = delayed_loop(LLAMA, STEPS)
    assert losses == ref_losses
    assert_bitwise(weights([model]), ref_weights)


def test_llama_paci_equals_the_ledger_driven_live_weight_loop():
    pipe, losses, _ = run_pipeline(LLAMA, "paci", 2, STEPS)
    schedule = build_schedule("paci", 2, M, STEPS)
    ref = LiveLoop(LLAMA, schedule, build_ledger(schedule)).run()
    assert losses == ref.losses
    assert_bitwise(weights(pipe.stages), ref.params)


def test_split_keeps_the_model_names_and_balances_blocks():
    model = llama()
    stages = nobubble.split(model, ["model.layers.2"])
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert "model.layers.2.self_attn.q_proj.weight" in dict(stages[1].named_parameters())
    with pytest.raises(
        ValueError, match=r"'model.layers.9' names no block .* model.layers.0 .. model.layers.3"
    ):
        nobubble.split(model, ["model.layers.9"])
    with pytest.raises(ValueError, match="split into 5 stages, but the model has 4 blocks"):
        nobubble.split(model, 5)


def test_tied_embeddings_are_refused_for_asynchronous_schedules_and_never_untied_silently():
    model = gpt2()
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to transformer.wte.weight"):
        nobubble.split(model, 2)
    assert model.lm_head.weight is model.transformer.wte.weight  # nothing changed


def test_export_round_trip_loads_with_transformers_and_gives_equal_logits(tmp_path: Path):
    pipe, _, model = run_pipeline(LLAMA, "paci", 2, 3)
    out = nobubble.hf.export(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    x = tokens(99)[0]
    with torch.no_grad():
        ours = pipe.stages[1](pipe.stages[0](x))
        assert torch.equal(reloaded(x).logits, ours)


def test_hf_paths_fail_clearly_offline(tmp_path: Path):
    from nobubble.hf import load_model

    with pytest.raises(FileNotFoundError, match=r"looks like a hub id.*does not download"):
        load_model("HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(FileNotFoundError, match=r"folder without a config\.json"):
        load_model(str(tmp_path))
    llama().config.save_pretrained(tmp_path / "cfg")
    model = load_model(str(tmp_path / "cfg" / "config.json"))  # a config alone: random init
    assert model.config.model_type == "llama" and model.training
