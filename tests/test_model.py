"""Model layer: a Llama-style GPT checked against a from-scratch reference, its pipeline split,
initialization, presets and the layer partitioner. fp32 on the CPU, tiny shapes."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch

from nobubble.model import (
    GPT,
    MODEL_PRESETS,
    ModelConfig,
    build_model,
    model_config,
    partition_layers,
    split_model,
)

VOCAB, SEQ = 61, 12


def make_cfg(**overrides: object) -> ModelConfig:
    fields: dict = dict(
        vocab_size=VOCAB, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=16
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def batch(seed: int = 0, B: int = 3, T: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def perturb(model: torch.nn.Module, seed: int = 7) -> None:
    """Move every parameter (norm gains included) off its init so that all of them matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


# ---------------------------------------------------------------- independent reference


def reference_logits(params: Mapping[str, torch.Tensor], cfg: ModelConfig, idx: torch.Tensor):
    """Llama forward written from scratch in float64: complex-number rotary, explicit causal
    mask and softmax, kv heads repeated by index, RMSNorm by hand."""
    p = {k: v.double() for k, v in params.items()}
    B, T = idx.shape
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    freqs = cfg.rope_theta ** (-torch.arange(hd // 2, dtype=torch.float64) * 2 / hd)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # (1, T, 1, hd/2)

    def rope(x):  # channel pair (i, i + hd/2) is one complex number
        z = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * rot
        return torch.cat([z.real, z.imag], dim=-1)

    def rms(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    h = p["embed.weight"][idx]
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    kv_of_head = [i // (H // KV) for i in range(H)]
    for layer in range(cfg.n_layers):
        w = {k.split(f"layers.{layer}.", 1)[1]: v for k, v in p.items() if f"s.{layer}." in k}
        x = rms(h, w["attn_norm.weight"])
        q = rope((x @ w["attn.wq.weight"].T).view(B, T, H, hd))
        k = rope((x @ w["attn.wk.weight"].T).view(B, T, KV, hd))[:, :, kv_of_head]
        v = (x @ w["attn.wv.weight"].T).view(B, T, KV, hd)[:, :, kv_of_head]
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
        attn = scores.masked_fill(causal, -math.inf).softmax(-1)
        h = h + torch.einsum("bhts,bshd->bthd", attn, v).reshape(B, T, -1) @ w["attn.wo.weight"].T
        x = rms(h, w["mlp_norm.weight"])
        gate = x @ w["mlp.w1.weight"].T
        h = h + (gate * torch.sigmoid(gate) * (x @ w["mlp.w3.weight"].T)) @ w["mlp.w2.weight"].T
    return rms(h, p["norm.weight"]) @ p["head.weight"].T


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # multi-head, grouped, multi-query
def test_gpt_matches_from_scratch_reference(n_kv_heads: int) -> None:
    cfg = make_cfg(n_kv_heads=n_kv_heads, rope_theta=500.0)
    model = build_model(cfg, seed=1)
    perturb(model)
    idx, targets = batch()
    params = dict(model.named_parameters())
    expected = reference_logits(params, cfg, idx)
    torch.testing.assert_close(model(idx).double(), expected, atol=2e-5, rtol=1e-5)
    log_probs = expected.log_softmax(-1).gather(-1, targets[..., None])
    torch.testing.assert_close(model(idx, targets).double(), -log_probs.mean(), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- (a) split equivalence


def run_pipeline(stages, idx, targets) -> torch.Tensor:
    """Forward stage by stage through detached boundaries, then backward stage by stage, as a
    pipeline does: the gradient of each stage's input is the next-to-last stage's output grad."""
    inputs, outputs, x = [], [], idx
    for stage in stages:
        if not stage.is_first:
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = stage(x, targets if stage.is_last else None)
        outputs.append(x)
    outputs[-1].backward()
    for s in range(len(stages) - 2, -1, -1):
        outputs[s].backward(inputs[s + 1].grad)
    return outputs[-1]


@pytest.mark.parametrize(
    "num_stages,layer_ranges",
    [
        (1, None),
        (2, None),
        (3, None),
        (4, None),
        (2, [range(0, 1), range(1, 4)]),
        (3, [range(0, 2), range(2, 3), range(3, 4)]),
    ],
)
def test_split_stages_reproduce_loss_and_gradients(num_stages, layer_ranges) -> None:
    cfg = make_cfg()
    idx, targets = batch(seed=3)
    reference = build_model(cfg, seed=5)
    perturb(reference)
    model = build_model(cfg, seed=5)
    perturb(model)
    ref_loss = reference(idx, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    stages = split_model(model, num_stages, layer_ranges)
    loss = run_pipeline(stages, idx, targets)
    assert torch.equal(loss, ref_loss)  # same ops in the same order: bitwise equal on a CPU
    seen = []
    for stage in stages:
        for name, p in stage.named_parameters():
            assert p.grad is not None, name
            assert torch.equal(p.grad, ref_grads[name]), name
            seen.append(name)
    assert sorted(seen) == sorted(ref_grads)  # every parameter on exactly one stage
    assert all(p.grad is None for p in model.parameters())  # stages are copies


def test_stage_attributes() -> None:
    cfg = make_cfg()
    stages = split_model(build_model(cfg, 0), 3, [range(0, 1), range(1, 3), range(3, 4)])
    assert [s.stage for s in stages] == [0, 1, 2]
    assert [s.num_stages for s in stages] == [3, 3, 3]
    assert [(s.is_first, s.is_last) for s in stages] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert [s.layer_ids for s in stages] == [(0,), (1, 2), (3,)]
    (only,) = split_model(build_model(cfg, 0), 1)
    assert only.is_first and only.is_last and only.layer_ids == (0, 1, 2, 3)
    idx, targets = batch()
    assert stages[0](idx).shape == (3, SEQ, cfg.dim)
    assert only(idx, targets).dim() == 0


# ---------------------------------------------------------------- (b) initialization


def test_same_seed_same_weights_for_every_split_and_different_seed_differs() -> None:
    cfg = make_cfg()
    state = torch.get_rng_state()
    a, b, c = build_model(cfg, 11), build_model(cfg, 11), build_model(cfg, 12)
    assert torch.equal(torch.get_rng_state(), state), "build_model touched the global RNG"
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    full = dict(a.named_parameters())
    for P in (1, 2, 4):
        stages = split_model(build_model(cfg, 11), P)
        for stage in stages:
            for name, p in stage.named_parameters():
                assert torch.equal(p, full[name]), (P, name)


def test_init_statistics() -> None:
    cfg = make_cfg(dim=64, hidden_dim=128, n_layers=8)
    model = build_model(cfg, 0)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        expected = residual_std if name.endswith(("attn.wo.weight", "mlp.w2.weight")) else 0.02
        assert abs(p.std().item() / expected - 1) < 0.1, name
        assert abs(p.mean().item()) < 0.2 * expected, name


def test_stages_are_independent_copies() -> None:
    model = build_model(make_cfg(), 0)
    stages = split_model(model, 2)
    with torch.no_grad():
        stages[0].embed.weight.zero_()
        stages[1].head.weight.zero_()
    assert model.embed.weight.abs().sum() > 0 and model.head.weight.abs().sum() > 0
    ptrs = [p.data_ptr() for s in [model, *stages] for p in s.parameters()]
    assert len(ptrs) == len(set(ptrs))


# ---------------------------------------------------------------- (c) names


def test_parameter_names_follow_convention() -> None:
    cfg = make_cfg()
    block = [
        "attn_norm.weight",
        "attn.wq.weight",
        "attn.wk.weight",
        "attn.wv.weight",
        "attn.wo.weight",
        "mlp_norm.weight",
        "mlp.w1.weight",
        "mlp.w3.weight",
        "mlp.w2.weight",
    ]
    expected = {"embed.weight", "norm.weight", "head.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(cfg.n_layers) for n in block}
    model = build_model(cfg, 0)
    assert set(dict(model.named_parameters())) == expected
    for name, p in model.named_parameters():  # norms 1-D, everything else 2-D: Muon routing
        assert p.dim() == (1 if name.endswith("norm.weight") else 2), name
    full_keys = set(model.state_dict())
    stages = split_model(model, 3, [range(0, 1), range(1, 3), range(3, 4)])
    assert set(stages[1].state_dict()) == {f"layers.{i}.{n}" for i in (1, 2) for n in block}
    for stage in stages:
        assert set(stage.state_dict()) <= full_keys


# ---------------------------------------------------------------- (e) errors


@pytest.mark.parametrize(
    "overrides,error,fragment",
    [
        ({"dim": 0}, ValueError, "dim must be >= 1, got 0"),
        ({"vocab_size": -5}, ValueError, "-5"),
        ({"dim": 30}, ValueError, "dim=30"),
        ({"n_kv_heads": 3}, ValueError, "n_kv_heads=3"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 4}, ValueError, "head_dim.*3"),
        ({"n_layers": 2.0}, TypeError, "2.0"),
        ({"max_seq_len": True}, TypeError, "True"),
        ({"rope_theta": 0.0}, ValueError, "rope_theta.*0.0"),
        ({"norm_eps": -1e-5}, ValueError, "norm_eps"),
    ],
)
def test_bad_config_values(overrides, error, fragment) -> None:
    with pytest.raises(error, match=fragment):
        make_cfg(**overrides)


def test_split_errors() -> None:
    model = build_model(make_cfg(), 0)
    with pytest.raises(ValueError, match=r"num_stages=5 exceeds n_layers=4.*at most 4"):
        split_model(model, 5)
    with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
        split_model(model, 0)
    with pytest.raises(ValueError, match="2 layer ranges for num_stages=3"):
        split_model(model, 3, [range(0, 2), range(2, 4)])
    with pytest.raises(ValueError, match="end at 3"):
        split_model(model, 2, [range(0, 2), range(2, 3)])
    with pytest.raises(ValueError, match="num_stages=9 exceeds n_layers=4"):
        partition_layers(model.cfg, 9)
    with pytest.raises(ValueError, match="layer_costs has 2 entries"):
        partition_layers(model.cfg, 2, layer_costs=[1.0, 2.0])


def test_forward_input_errors() -> None:
    cfg = make_cfg()
    model = build_model(cfg, 0)
    idx, targets = batch()
    first, last = split_model(model, 2)
    assert last(first(idx)).shape == (*idx.shape, cfg.vocab_size)  # logits without targets
    with pytest.raises(ValueError, match="int64"):
        model(idx.int())
    with pytest.raises(ValueError, match=r"sequence length 17 .*max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.int64))
    with pytest.raises(ValueError, match="hidden states"):
        last(idx, targets)
    with pytest.raises(ValueError, match="targets must be int64"):
        model(idx, targets[:, :-1])
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*tiny, mini, small"):
        model_config("huge", 8192, 128)


# ---------------------------------------------------------------- (f) causality, (g) buffers


def test_future_tokens_do_not_change_earlier_logits() -> None:
    model = build_model(make_cfg(), 0)
    idx, _ = batch()
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7], atol=1e-6, rtol=0)
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_no_rotary_state_in_state_dict() -> None:
    model = build_model(make_cfg(), 0)
    assert list(model.buffers()) == []
    assert list(model.state_dict()) == [name for name, _ in model.named_parameters()]
    for stage in split_model(model, 2):
        assert list(stage.state_dict()) == [name for name, _ in stage.named_parameters()]


# ---------------------------------------------------------------- (h) presets


@pytest.mark.parametrize(
    "name,low,high",
    [
        ("tiny", 0.5e6, 1.5e6),
        ("tiny-deep", 1e6, 1.5e6),
        ("tiny-deep16", 1.5e6, 2.5e6),
        ("mini", 3e6, 4e6),
        ("small", 5e6, 10e6),
        ("medium", 30e6, 50e6),
        ("gpt2-medium", 300e6, 420e6),
        ("1b", 0.9e9, 1.1e9),
    ],
)
def test_preset_parameter_counts_on_meta_device(name, low, high) -> None:
    cfg = model_config(name, vocab_size=8192, seq_len=1024)
    with torch.device("meta"):
        model = GPT(cfg)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == cfg.num_params()
    assert low <= counted <= high
    assert set(MODEL_PRESETS) == {
        "tiny",
        "tiny-deep",
        "tiny-deep16",
        "mini",
        "small",
        "medium",
        "gpt2-medium",
        "1b",
    }


def test_gpt2_medium_matches_the_paper_size_at_gpt2_vocab() -> None:
    # PACI (arXiv 2606.07881): GPT-2 Medium with an untied head, 406M parameters.
    assert abs(model_config("gpt2-medium", 50257, 1024).num_params() / 406e6 - 1) < 0.01


def test_tiny_preset_learns_a_repeated_batch() -> None:
    cfg = model_config("tiny", vocab_size=VOCAB, seq_len=SEQ)
    model = build_model(cfg, 0)
    idx, targets = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = model(idx, targets).item()
    assert abs(first - math.log(VOCAB)) < 0.1  # small init: near-uniform predictions
    for _ in range(30):
        opt.zero_grad()
        model(idx, targets).backward()
        opt.step()
    assert model(idx, targets).item() < 0.5 * first
