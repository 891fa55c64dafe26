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
from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import build_schedule
from nobubble.model import lm_loss

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


def sgd(named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=0.05, momentum=0.9)


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


def test_a_balanced_split_weighs_the_heads_compute_not_the_embeddings_lookup(tmp_path):
    """With a head as costly as two blocks, balancing compute moves a block to the first stage;
    balancing raw parameters would count the embedding instead and cut in the middle."""
    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    head = model.lm_head.weight.numel()
    # the contiguous cut that minimizes the heavier stage, by hand: k blocks | 8 - k + head
    best = min(range(1, 8), key=lambda k: max(k * block, (8 - k) * block + head))
    stages = nobubble.split(model, 2)
    assert [s.layer_ids for s in stages] == [tuple(range(best)), tuple(range(best, 8))]
    assert best == 5
    config.save_pretrained(tmp_path)
    balance = nobubble.hf.split_balance(str(tmp_path), 2)
    assert balance["layers"] == ["0-4", "5-7"] and balance["balance"] > 0.99


GPT2 = Problem(gpt2, lambda model, n: nobubble.split(model, n), tokens, lm_loss, logits)


@pytest.mark.parametrize("stages_n", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tied_gpt2_sync_pipeline_equals_plain_accumulation_and_keeps_the_copies_equal(
    schedule, stages_n
):
    """The unsplit model holds one tied parameter; the pipeline's two copies get the sum of
    both stages' gradients, so they take the same step and stay bitwise equal to each other.

    Against the unsplit model the match is within 1e-5, not bitwise, for a stated reason: there
    autograd adds the head's and the embedding's contributions into one .grad micro-batch by
    micro-batch (h0 + e0 + h1 + e1 ...), while each stage here accumulates its own copy's and
    the step adds the two sums ((e0 + e1 ...) + (h0 + h1 ...)); float addition is not
    associative. SGD keeps such differences at their size (Adam's normalisation would blow up
    those of near-zero gradients). With global clipping at 0.5 (active: the norm starts near
    2.6), the pair is counted once in the norm; counting it twice would move the weights far
    beyond the tolerance.
    """
    _, losses, model = run_pipeline(GPT2, schedule, stages_n, STEPS, clip=0.5, optimizer=sgd)
    assert "lm_head.weight" not in dict(gpt2().named_parameters())  # one tied parameter
    ref_losses, ref_weights = plain_accumulation(GPT2, STEPS, clip=0.5, optimizer=sgd)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    ours = weights([model])
    assert torch.equal(ours.pop("lm_head.weight"), ours["transformer.wte.weight"])
    assert ours.keys() == ref_weights.keys()
    for name, value in ours.items():
        scale = ref_weights[name].abs().max()
        assert (value - ref_weights[name]).abs().max() <= 1e-5 * scale, name


def test_tied_embeddings_are_refused_for_asynchronous_schedules_with_the_way_out():
    model = gpt2()
    with pytest.raises(
        ValueError,
        match=r"lm_head.weight of stage 1 is tied to transformer.wte.weight of stage 0; paci "
        r".* untie=True",
    ):
        nobubble.Pipeline(nobubble.split(model, 2), lm_loss, schedule="paci")
    untied = nobubble.split(gpt2(), 2, untie=True)  # asked for: two parameters from here on
    nobubble.Pipeline(untied, lm_loss, schedule="paci")


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


def test_train_cli_on_a_tied_hf_llama_then_export_reloads_with_equal_logits(tmp_path: Path):
    """`nobubble train --model hf:CONFIG` for 20 steps (tied SmolLM2-style embeddings over two
    stages), `nobubble export`, then transformers' own loader: the same logits, bitwise."""
    from nobubble.app.export import load_run_model
    from nobubble.cli import main

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    config.save_pretrained(tmp_path / "model")
    run, out = tmp_path / "run", tmp_path / "export"
    flags = "--schedule 1f1b --stages 2 --steps 20 --eval-every 10 --micro-batch-size 2"
    flags += " --seq-len 16 --vocab-size 512 --eval-batches 2 --sample-tokens 0 --no-progress"
    argv = ["train", "--model", f"hf:{tmp_path / 'model' / 'config.json'}", *flags.split()]
    assert main([*argv, "--out", str(run)]) == 0
    assert main(["export", str(run), "--hf", str(out)]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # still one parameter
    _, stages, step = load_run_model(run)
    assert step == 20
    x = tokens(7)[0]
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, stages[1](stages[0](x)))
    assert main(["export", str(run), "--hf", str(out)]) == 2  # never overwrites
