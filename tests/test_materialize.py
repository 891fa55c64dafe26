"""Models built on the meta device: each process materializes only its stages, with bitwise the
values the model's own init gives a model built normally with the same seed.

The references are the models built normally (``build_model``, transformers' ``from_config``,
``torch.manual_seed`` then the constructor), cut by the same split; the stage under test is
materialized alone, so the replayed init must land on the random stream's right position.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import nobubble
from _api_reference import assert_bitwise, run_pipeline, weights
from nobubble.model import GPT, build_model, model_config
from test_api import CUTS, SEQ, loss_fn, make_model

transformers = pytest.importorskip("transformers")


def on_meta(module: nn.Module) -> bool:
    return all(t.is_meta for t in [*module.parameters(), *module.buffers()])


def meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (non-persistent ones too: the rotary tables)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def assert_each_stage_alone_equals(reference: list[nn.Module], cut: Callable[[], list], **kw):
    """Materialize each stage of a fresh meta split alone; it must equal the reference stage,
    and the other stages must stay on meta."""
    for k in range(len(reference)):
        stages = cut()
        filled = nobubble.materialize(stages, k, **kw)
        assert filled and all(on_meta(s) for i, s in enumerate(stages) if i != k)
        ours, theirs = state(stages[k]), state(reference[k])
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), (k, name)


def test_internal_gpt_stage_by_stage_equals_build_model():
    cfg = model_config("tiny", 256, 32)
    reference = nobubble.split(build_model(cfg, 7), 3)
    assert_each_stage_alone_equals(
        reference, lambda: nobubble.split(meta(lambda: GPT(cfg)), 3), seed=7
    )


def llama_config(tied: bool) -> object:
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=tied,
    )  # fmt: skip


def gpt2_config() -> object:
    return transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip


HF_CASES = [  # (config, stages, untie)
    (lambda: llama_config(False), 2, False),
    (lambda: llama_config(True), 2, False),  # the head's copy starts as the embedding
    (lambda: llama_config(True), 1, False),  # one stage: still one tensor
    (lambda: llama_config(True), 3, True),
    (gpt2_config, 3, False),  # tied, Conv1D layers, scaled residual projections
]


@pytest.mark.parametrize(
    ("config", "n", "untie"), HF_CASES, ids=["llama", "tied", "tied-1", "untie", "gpt2"]
)
def test_hugging_face_stage_by_stage_equals_from_config(config, n, untie):
    auto = transformers.AutoModelForCausalLM

    def build() -> nn.Module:
        return auto.from_config(copy.deepcopy(config()), dtype=torch.float32)

    torch.manual_seed(0)
    reference = nobubble.split(build(), n, untie=untie)
    after_build = torch.get_rng_state()  # the global stream, where the normal build leaves it
    for k in range(n):
        stages = nobubble.split(meta(build), n, untie=untie)
        torch.manual_seed(123)  # wherever the stream stands before, the seed decides
        nobubble.materialize(stages, k, seed=0)
        assert torch.equal(torch.get_rng_state(), after_build)
        ours, theirs = state(stages[k]), state(reference[k])
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours), k
        if n == 1 and config is not gpt2_config and llama_config(True).tie_word_embeddings:
            model = stages[0]
            assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor


def test_a_user_sequential_equals_its_normal_build_and_untouched_stages_stay_empty():
    reference = nobubble.split(make_model(), CUTS[3])
    assert_each_stage_alone_equals(
        reference, lambda: nobubble.split(meta(make_model), CUTS[3]), seed=0
    )
    # several stages at once, on another device name
    stages = nobubble.split(meta(make_model), CUTS[3])
    nobubble.materialize(stages, [0, 2], seed=0, device="cpu")
    assert on_meta(stages[1]) and not on_meta(stages[0]) and not on_meta(stages[2])


class Scaled(nn.Module):
    """A parameter of its own, initialized in __init__ with no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


def test_a_module_whose_init_is_unknown_is_refused_and_init_replaces_it():
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), Scaled(), nn.Linear(8, 4))

    stages = nobubble.split(meta(build), ["2"])
    with pytest.raises(
        ValueError, match=r"module '1' \(Scaled\) holds parameters \(scale\).*init="
    ):
        nobubble.materialize(stages, 1, seed=0)
    assert on_meta(stages[1])  # refused before anything was allocated

    def my_init(model: nn.Module) -> None:  # the user's own init, run after construction
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)

    normal = build()
    torch.manual_seed(3)  # torch.manual_seed(seed); init(model), as torchtitan's init_weights
    my_init(normal)
    nobubble.materialize(stages, 1, seed=3, init=my_init)
    assert_bitwise(
        weights([stages[1]]), {n: p for n, p in normal.named_parameters() if n.startswith("2.")}
    )

    def partial(model: nn.Module) -> None:
        nn.init.zeros_(model[2].weight)

    fresh = nobubble.split(meta(build), ["2"])
    with pytest.raises(ValueError, match=r"the init left 2.bias unset"):
        nobubble.materialize(fresh, 1, init=partial)
    assert on_meta(fresh[1])  # left as given


def test_bad_arguments_are_refused_with_the_fix():
    stages = nobubble.split(meta(make_model), CUTS[2])
    with pytest.raises(ValueError, match=r"need values: seed="):
        nobubble.materialize(stages, 0)
    with pytest.raises(ValueError, match=r"keep=\[5\]: give stage indices in 0..1"):
        nobubble.materialize(stages, [5], seed=0)
    with pytest.raises(ValueError, match=r"weights= or init=, not both"):
        nobubble.materialize(stages, 0, weights="x", init=lambda m: None)
    with pytest.raises(ValueError, match=r"stage 0 is on the meta device: give seed="):
        nobubble.Pipeline(stages, loss_fn)
    with pytest.raises(ValueError, match=r"seed= gives values to stages built on the meta device"):
        nobubble.Pipeline(nobubble.split(make_model(), CUTS[2]), loss_fn, seed=0)


# ----- the pipeline on meta stages trains as the model built normally ---------------------------
META_SEQ = type(SEQ)(lambda: meta(make_model), SEQ.cut, SEQ.batch, SEQ.loss_fn)


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_pipeline_on_meta_stages_trains_bitwise_as_on_the_normal_build(schedule):
    pipe, losses, _ = run_pipeline(META_SEQ, schedule, 3, 6, 3, seed=0)
    ref_pipe, ref_losses, _ = run_pipeline(SEQ, schedule, 3, 6, 3)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), weights(ref_pipe.stages))
