"""Activation checkpointing (``Pipeline(activation_checkpointing=...)``): each block keeps only
its input and rebuilds its activations at backward, reading the weights its forward read.

The reference is the same pipeline without checkpointing (itself checked against independent
loops in test_emulator_oracles and test_api): a rebuild runs the same kernels on the same
tensors, so losses and weights are bitwise equal under every weight-version rule, the split
backward included, and under plain PACI, whose steps update the weights in place between a
forward and its backward (the rebuild computes from a copy of the forward's values and leaves
the live weights to the tensors its graph saves by reference). A rebuild that read another
version (the live weights under 2BW's stash or PACI's) breaks that equality, and the tests of
it show the comparison sees it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nobubble
from _api_reference import M, Problem, adamw, assert_bitwise, run_pipeline, weights
from _reference import CFG, batch_fn
from nobubble.engine import blocks
from nobubble.model import build_model, lm_loss
from nobubble.model.blocks import stage_blocks
from test_api import refuses

STEPS = 3


def gpt_batch(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [batch_fn(j * M + i) for i in range(M)]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


GPT = Problem(
    lambda: build_model(CFG, seed=0), lambda model, n: nobubble.split(model, n), gpt_batch, lm_loss
)


def train(schedule: str, **compute: object) -> tuple[list[float], dict[str, torch.Tensor], object]:
    pipe, losses, _ = run_pipeline(GPT, schedule, 2, STEPS, **compute)
    return losses, weights(pipe.stages), pipe


@pytest.mark.parametrize(
    ("schedule", "mode", "extra"),
    [
        ("2bw", "full", {}),
        ("1f1b", "selective", {}),
        ("zb-h1", "full", {}),
        ("paci", "full", {"paci_recompute": True}),
        ("2bw", "full", {"fused_grad_accumulation": True}),
    ],
)
def test_checkpointing_trains_bitwise_as_without(schedule, mode, extra):
    """2BW stashes the forward's version, zb-h1 splits the backward into I and W (each
    rebuilds the activations it needs), PACI with paci_recompute rebuilds its stage at the live
    weights and each block again from there, fused layers add into .grad from the rebuild's
    graph as from the forward's."""
    ref_losses, ref_weights, _ = train(schedule, **extra)
    losses, trained, pipe = train(
        schedule, activation_checkpointing=mode, selective_every=2, **extra
    )
    assert pipe.wrapped_blocks == (  # type: ignore[attr-defined]
        {0: ["layers.0", "layers.1"], 1: ["layers.2", "layers.3"]}
        if mode == "full"
        else {0: ["layers.0"], 1: ["layers.2"]}
    )
    assert losses == ref_losses
    assert_bitwise(trained, ref_weights)


def test_a_rebuild_reading_the_live_weights_would_differ(monkeypatch):
    """The equality above fails when the rebuild (a call inside a backward) reads the block's
    live parameters instead of the version its forward read (2BW reads a stash a step old)."""
    ref_losses, ref_weights, _ = train("2bw")
    original = blocks.BlockCall._on

    def live(self, capture, *args, **kwargs):  # type: ignore[no-untyped-def]
        if torch._C._current_graph_task_id() != -1:  # a rebuild: the master parameters
            capture = blocks.Capture(dict(self.block.named_parameters()))
        return original(self, capture, *args, **kwargs)

    monkeypatch.setattr(blocks.BlockCall, "_on", live)
    losses, trained, _ = train("2bw", activation_checkpointing="full")
    # 2BW's forwards read the version before the last step: three steps show no loss apart yet
    assert losses == ref_losses
    assert any(not torch.equal(trained[n], ref_weights[n]) for n in ref_weights)


def test_checkpointing_saves_activation_bytes():
    _, _, none = train("1f1b")
    _, _, full = train("1f1b", activation_checkpointing="full")
    kept = [w.peak_activation_bytes for w in none.workers]  # type: ignore[attr-defined]
    checkpointed = [w.peak_activation_bytes for w in full.workers]  # type: ignore[attr-defined]
    assert all(c < k / 2 for c, k in zip(checkpointed, kept, strict=True)), (checkpointed, kept)


def test_a_later_pipeline_on_the_same_modules_unwraps_them():
    model = GPT.make_model()
    nobubble.Pipeline(GPT.cut(model, 2), lm_loss, schedule="1f1b", activation_checkpointing="full")
    pipe = nobubble.Pipeline(GPT.cut(model, 2), lm_loss, schedule="1f1b")
    assert pipe.wrapped_blocks == {0: [], 1: []}
    assert all("forward" not in block.__dict__ for block in model.layers.values())


def test_blocks_of_a_stage_and_the_refusal():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    assert [n for n, _ in stage_blocks(seq)] == ["0", "1"]
    gpt_stage = nobubble.split(build_model(CFG, seed=0), 2)[1]
    assert [n for n, _ in stage_blocks(gpt_stage)] == ["layers.2", "layers.3"]
    refuses(
        r"stage 0 \(Linear\) has no blocks.*nn.ModuleList", lambda: stage_blocks(nn.Linear(2, 2), 0)
    )
    refuses(
        r"activation_checkpointing='some' is unknown: use one of 'none', 'full', 'selective'",
        lambda: nobubble.PipelineConfig.build(activation_checkpointing="some"),
    )
    refuses(r"selective_every=0", lambda: nobubble.PipelineConfig.build(selective_every=0))


def test_compile_is_refused_with_a_split_backward():
    refuses(
        r"compile=True with schedule='zb-h1': its split backward",
        lambda: nobubble.PipelineConfig.build(schedule="zb-h1", compile=True),
    )


def paci(stages: int, **compute: object) -> tuple[list[float], dict[str, torch.Tensor], object]:
    pipe, losses, _ = run_pipeline(GPT, "paci", stages, STEPS, **compute)
    return losses, weights(pipe.stages), pipe


@pytest.mark.parametrize(
    ("stages", "mode", "dtype"),
    [(3, "full", "fp32"), (4, "selective", "fp32"), (3, "full", "bf16")],
)
def test_plain_paci_with_checkpointing_trains_bitwise_as_without(stages, mode, dtype):
    """M = 4 < P + 1: early stages take steps between a forward and its backward (delay > 0),
    so the rebuild needs the stash of the forward's values; the last stage needs none. Under
    bf16 autocast the weights' casts are computed activations, rebuilt from the stash too."""
    ref_losses, ref_weights, _ = paci(stages, dtype=dtype)
    losses, trained, pipe = paci(
        stages, activation_checkpointing=mode, selective_every=2, dtype=dtype
    )
    delays = [w.ledger.delay for w in pipe.workers]  # type: ignore[attr-defined]
    assert max(delays[0]) > 0 and max(delays[-1]) == 0
    assert losses == ref_losses
    assert_bitwise(trained, ref_weights)


@pytest.mark.parametrize("broken", ["no stash", "stash kept"])
def test_plain_paci_rebuilds_need_the_stash_and_the_live_weights(monkeypatch, broken):
    """Without the stash the rebuild computes from the live weights; keeping the stash in the
    rebuilt graph makes its saved weights the forward's instead of the live ones. Either way
    the run leaves the one without checkpointing."""
    ref_losses, ref_weights, _ = paci(3)
    if broken == "no stash":
        monkeypatch.setattr(blocks.BlockCall, "stash_live", lambda self: None)
    else:
        monkeypatch.setattr(blocks.Capture, "to_live", lambda self, fresh: None)
    losses, trained, _ = paci(3, activation_checkpointing="full")
    assert losses != ref_losses
    assert any(not torch.equal(trained[n], ref_weights[n]) for n in ref_weights)


@pytest.mark.parametrize(("stages", "microbatches", "first"), [(3, 4, 1), (4, 2, 2)])
def test_the_stash_is_a_copy_of_the_blocks_weights_per_version_in_flight(
    stages, microbatches, first
):
    """Captures of one version share one copy of their block's weights, made at the step that
    first passes their forward: a stage holds at most its largest delay copies (P=4, M=2:
    stage 0 has micro-batches of two versions in flight, two copies), the last stage none.
    Once their backward has run nothing is pending, and the copies go with the captures."""
    model = GPT.make_model()
    pipe = nobubble.Pipeline(
        GPT.cut(model, stages),
        lm_loss,
        schedule="paci",
        microbatches=microbatches,
        optimizer=adamw,
        activation_checkpointing="full",
    )
    for j in range(STEPS):
        x, y = GPT.batch(j)
        pipe.step(x[: 2 * microbatches], y[: 2 * microbatches])
    pipe.drain()
    copies = []
    for w in pipe.workers:  # type: ignore[attr-defined]
        block = sum(
            p.numel() * p.element_size() for c in w.checkpointed for p in c.block.parameters()
        )
        assert w.peak_stash_bytes % block == 0
        copies.append(w.peak_stash_bytes // block)
        assert copies[-1] <= max(w.ledger.delay)
        assert all(len(c.pending) == 0 for c in w.checkpointed)
    assert copies[0] == first and copies[-1] == 0


def test_checkpointing_with_paci_is_refused_only_on_sharded_stages():
    refuses(
        r"activation_checkpointing='full' with schedule='paci' and shard='fsdp'.*shard='none'",
        lambda: nobubble.PipelineConfig.build(
            schedule="paci",
            activation_checkpointing="full",
            runtime="dist",
            data_parallel=2,
            shard="fsdp",
        ),
    )
    for recompute in (False, True):
        nobubble.PipelineConfig.build(
            schedule="paci", activation_checkpointing="full", paci_recompute=recompute
        )


def test_checkpointing_a_hugging_face_stage():
    """An HFStage's blocks are its model's layers; their keyword inputs (masks, positions,
    rotary tables) reach the rebuild."""
    from test_hf import LLAMA

    pipe, losses, _ = run_pipeline(LLAMA, "2bw", 2, 2, activation_checkpointing="full")
    assert pipe.wrapped_blocks[0][0].startswith("model.layers.")
    ref_pipe, ref, _ = run_pipeline(LLAMA, "2bw", 2, 2)
    assert losses == ref
    assert_bitwise(weights(pipe.stages), weights(ref_pipe.stages))
