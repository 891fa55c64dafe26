"""Tests of nobubble.optim: routing, update rules, schedule, clipping, error feedback, state."""

from __future__ import annotations

import copy
import io
import itertools
import logging
import math

import pytest
import torch
from torch import nn

from nobubble.optim import (
    OPTIMIZERS,
    ErrorFeedback,
    NoCorrection,
    OptimConfig,
    build_optimizer,
    clip_coefficient,
    grad_sq_norm,
    grads_finite,
    lr_at,
    route_parameters,
    scale_grads_,
)
from nobubble.optim.library import LIBRARY_OPTIMIZERS

D, V, F = 8, 16, 12  # hidden size, vocabulary, MLP width
HIDDEN_SHAPES = {"attn.wq": (D, D), "attn.wk": (4, D), "attn.wv": (4, D), "attn.wo": (D, D)}
HIDDEN_SHAPES |= {"mlp.w1": (F, D), "mlp.w2": (D, F), "mlp.w3": (F, D)}


def stage_params(
    num_layers: int = 2, *, embed: bool = True, head: bool = True, seed: int = 0
) -> list[tuple[str, nn.Parameter]]:
    """Named parameters shaped like a Llama stage: embed, layers (7 matrices, 2 norms), head."""
    gen = torch.Generator().manual_seed(seed)
    named: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (V, D))] if embed else []
    for i in range(num_layers):
        named.append((f"layers.{i}.attn_norm.weight", (D,)))
        named += [(f"layers.{i}.{k}.weight", shape) for k, shape in HIDDEN_SHAPES.items()]
        named.append((f"layers.{i}.mlp_norm.weight", (D,)))
    if head:
        named += [("norm.weight", (D,)), ("head.weight", (V, D))]
    return [(n, nn.Parameter(torch.randn(s, generator=gen) * 0.5)) for n, s in named]


def clone_params(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    return [(n, nn.Parameter(p.detach().clone())) for n, p in named]


def set_grads(params: list[nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": "sgd"}, "'sgd'"),
        ({"lr": 0.0}, "lr=0.0"),
        ({"lr": -1e-3}, "lr=-0.001"),
        ({"lr": math.nan}, "lr=nan"),
        ({"lr": math.inf}, "lr=inf"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1"),
        ({"betas": (0.9, 1.0)}, "(0.9, 1.0)"),
        ({"betas": (0.9,)}, "(0.9,)"),
        ({"eps": 0.0}, "eps=0.0"),
        ({"momentum": 1.0}, "momentum=1.0"),
        ({"ns_steps": 0}, "ns_steps=0"),
        ({"warmup_frac": 1.5}, "warmup_frac=1.5"),
        ({"warmup_frac": 1.0}, "warmup_frac=1.0"),
        ({"min_lr_ratio": -0.5}, "min_lr_ratio=-0.5"),
        ({"clip_norm": 0.0}, "clip_norm=0.0"),
    ],
)
def test_bad_config_raises_value_error_naming_the_value(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=r"not allowed|unknown") as info:
        OptimConfig(**kwargs)
    assert needle in str(info.value)


def test_unknown_optimizer_message_lists_the_choices() -> None:
    with pytest.raises(ValueError) as info:
        OptimConfig(name="sgd")
    assert all(name in str(info.value) for name in OPTIMIZERS)


def test_betas_default_per_optimizer() -> None:
    assert OptimConfig(name="adamw").resolved_betas == (0.9, 0.95)
    assert OptimConfig(name="lion").resolved_betas == (0.9, 0.99)
    assert OptimConfig(name="lion", betas=(0.95, 0.98)).resolved_betas == (0.95, 0.98)


# ----------------------------------------------------------------------------- routing


def test_muon_routing_takes_every_hidden_matrix_and_nothing_else() -> None:
    named = stage_params(num_layers=3)
    routing = route_parameters(named, "muon")
    expected_muon = [f"layers.{i}.{k}.weight" for i in range(3) for k in HIDDEN_SHAPES]
    assert list(routing.muon) == expected_muon
    expected_adamw = [n for n, _ in named if n not in expected_muon]
    assert list(routing.adamw) == expected_adamw
    assert {"embed.weight", "head.weight", "norm.weight"} <= set(routing.adamw)

    hidden_elems = 3 * sum(a * b for a, b in HIDDEN_SHAPES.values())
    counts = routing.counts()
    assert counts["muon"] == (21, hidden_elems)
    assert counts["adamw"] == (3 * 2 + 3, 2 * V * D + D + 3 * 2 * D)
    assert "muon: 21 tensors" in routing.describe() and "adamw: 9 tensors" in routing.describe()


@pytest.mark.parametrize("name", ["adamw", "nadam", "lion"])
def test_other_optimizers_take_everything(name: str) -> None:
    named = stage_params()
    routing = route_parameters(named, name)
    assert routing.muon == () and list(routing.adamw) == [n for n, _ in named]
    assert routing.counts()["adamw"].elements == sum(p.numel() for _, p in named)


def test_muon_without_hidden_matrix_raises() -> None:
    norms_only = [(f"layers.0.{k}.weight", nn.Parameter(torch.ones(D))) for k in ("a", "b")]
    with pytest.raises(ValueError, match=r"no 2-D hidden matrix.*adamw"):
        route_parameters(norms_only, "muon")
    embed_head_norm = stage_params(num_layers=0)  # 2-D tensors, but embedding and head only
    with pytest.raises(ValueError, match="no 2-D hidden matrix"):
        build_optimizer(OptimConfig(name="muon"), embed_head_norm)


def test_duplicate_names_raise() -> None:
    p = nn.Parameter(torch.ones(D, D))
    with pytest.raises(ValueError, match="appears twice"):
        route_parameters([("layers.0.w.weight", p), ("layers.0.w.weight", p)], "adamw")


def test_build_logs_routing_counts(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nobubble.optim.build"):
        build_optimizer(OptimConfig(name="muon"), stage_params(num_layers=1))
    assert "muon: 7 tensors" in caplog.text and "adamw: 5 tensors" in caplog.text


def test_muon_uses_adamw_matched_lr_and_config() -> None:
    cfg = OptimConfig(name="muon", lr=3e-3, momentum=0.9, ns_steps=4)
    opt = build_optimizer(cfg, stage_params(num_layers=1))
    muon, adamw = opt.parts["muon"], opt.parts["adamw"]
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    (group,) = muon.param_groups
    assert group["adjust_lr_fn"] == "match_rms_adamw" and group["lr"] == 3e-3
    assert (group["momentum"], group["ns_steps"], group["nesterov"]) == (0.9, 4, True)
    opt.set_lr(1e-4)
    assert all(g["lr"] == 1e-4 for o in opt.parts.values() for g in o.param_groups)
    assert opt.lr == 1e-4


# ----------------------------------------------------------------------------- update rules


# The library optimizers (the optim extra) have these checks in test_optim_library.py.
CORE = tuple(o for o in OPTIMIZERS if o not in LIBRARY_OPTIMIZERS)


@pytest.mark.parametrize("name", CORE)
def test_weight_decay_only_on_2d_tensors(name: str) -> None:
    """With zero gradients every rule's step is pure decoupled decay: x * (1 - lr * wd)."""
    lr, wd = 0.05, 0.1
    named = stage_params(num_layers=1)
    before = {n: p.detach().clone() for n, p in named}
    opt = build_optimizer(OptimConfig(name=name, lr=lr, weight_decay=wd), named)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in named:
        if p.ndim == 1:
            assert torch.equal(p, before[n]), n
        else:
            torch.testing.assert_close(p.detach(), before[n] * (1 - lr * wd), msg=n)


def test_lion_matches_reference_formula_for_three_steps() -> None:
    lr, wd, (b1, b2) = 0.01, 0.2, (0.8, 0.97)
    named = stage_params(num_layers=1)
    ref = {n: p.detach().clone() for n, p in named}
    ref_m = {n: torch.zeros_like(p) for n, p in named}
    opt = build_optimizer(OptimConfig(name="lion", lr=lr, weight_decay=wd, betas=(b1, b2)), named)
    for step in range(3):
        set_grads([p for _, p in named], seed=100 + step)
        opt.step()
        for n, p in named:  # Lion, arXiv 2302.06675, Algorithm 2 with decoupled decay
            assert p.grad is not None
            g, m = p.grad, ref_m[n]
            c = b1 * m + (1 - b1) * g
            decay = wd if p.ndim == 2 else 0.0
            ref[n] = ref[n] - lr * (torch.sign(c) + decay * ref[n])
            ref_m[n] = b2 * m + (1 - b2) * g
            torch.testing.assert_close(p.detach(), ref[n], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(opt.parts["adamw"].state[p]["exp_avg"], ref_m[n])


@pytest.mark.parametrize("name", CORE)
def test_state_dict_round_trip_is_bitwise(name: str) -> None:
    cfg = OptimConfig(name=name, lr=1e-2)
    named = stage_params(num_layers=1)
    opt = build_optimizer(cfg, named)
    for step in range(2):
        set_grads(opt.params, seed=step)
        opt.step()
    opt.set_lr(7e-3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # the checkpoint path: through bytes
    twin_named = clone_params(named)
    twin = build_optimizer(cfg, twin_named)
    buffer.seek(0)
    twin.load_state_dict(torch.load(buffer))
    assert twin.lr == 7e-3
    set_grads(opt.params, seed=9)
    set_grads(twin.params, seed=9)
    opt.step()
    twin.step()
    for (n, p), (_, q) in zip(named, twin_named, strict=True):
        assert torch.equal(p, q), n


def test_load_state_dict_does_not_alias_the_source() -> None:
    cfg = OptimConfig(name="adamw")
    named = stage_params(num_layers=1)
    opt = build_optimizer(cfg, named)
    set_grads(opt.params, seed=0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin = build_optimizer(cfg, clone_params(named))
    twin.load_state_dict(opt.state_dict())  # live tensors of `opt`
    set_grads(opt.params, seed=1)
    opt.step()  # must not change twin's state
    exp_avg = twin.parts["adamw"].state[twin.params[0]]["exp_avg"]
    assert torch.equal(exp_avg, saved["parts"]["adamw"]["state"][0]["exp_avg"])


def test_load_state_dict_refuses_another_optimizer() -> None:
    named = stage_params(num_layers=1)
    adamw = build_optimizer(OptimConfig(name="adamw"), named)
    nadam = build_optimizer(OptimConfig(name="nadam"), clone_params(named))
    with pytest.raises(ValueError, match="does not match"):
        nadam.load_state_dict(adamw.state_dict())


# ----------------------------------------------------------------------------- lr schedule


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    cfg = OptimConfig(lr=1e-3, warmup_frac=0.1, min_lr_ratio=0.1)
    total = 100  # warmup = 10 steps
    lrs = [lr_at(s, total, cfg) for s in range(total)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[0] > 0
    assert lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[10] < 1e-3
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-12)
    mid = 9 + 45  # half way through the 90 decay steps: the cosine is at the midpoint
    assert lrs[mid] == pytest.approx(0.5 * (1e-3 + 1e-4))


def test_lr_schedule_edges() -> None:
    assert lr_at(0, 30, OptimConfig(lr=1.0, warmup_frac=0.1)) == pytest.approx(1 / 3)  # 3, not 4
    no_warmup = OptimConfig(lr=1.0, warmup_frac=0.0, min_lr_ratio=0.0)
    assert 0.99 < lr_at(0, 100, no_warmup) < 1.0
    assert lr_at(99, 100, no_warmup) == pytest.approx(0.0, abs=1e-15)
    for step, total in [(-1, 10), (10, 10), (0, 0)]:
        with pytest.raises(ValueError, match="not allowed"):
            lr_at(step, total, OptimConfig())


# ----------------------------------------------------------------------------- clipping


def test_clip_helpers() -> None:
    params = [
        nn.Parameter(torch.zeros(3)),
        nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16)),
        nn.Parameter(torch.zeros(1)),
    ]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]], dtype=torch.bfloat16)
    sq = grad_sq_norm(params)  # params[2] has no grad: counts 0
    assert sq.dtype == torch.float32 and sq.item() == 25.0
    coef = clip_coefficient(sq.sqrt(), 1.0)
    assert isinstance(coef, torch.Tensor) and coef.item() == pytest.approx(0.2)
    assert clip_coefficient(0.5, 1.0) == 1.0
    small = clip_coefficient(torch.tensor(0.5), 1.0)
    assert isinstance(small, torch.Tensor) and small.item() == 1.0  # never scales up
    scale_grads_(params, coef)
    assert grad_sq_norm(params).item() == pytest.approx(1.0, rel=1e-2)  # bf16 entry
    assert grads_finite(params)
    params[0].grad[1] = math.nan
    assert not grads_finite(params)
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_coefficient(1.0, 0)


# ----------------------------------------------------------------------------- error feedback


def least_squares(seed: int = 0) -> tuple[nn.Parameter, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    x = nn.Parameter(torch.randn(4, 3, generator=gen, dtype=torch.float64))
    return x, a, b


def ls_grad_(x: nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
    x.grad = None
    ((a @ x - b) ** 2).mean().backward()


def test_ef_with_lam_zero_equals_no_correction_bitwise() -> None:
    runs = []
    for correction in (NoCorrection(), ErrorFeedback(lam=0.0)):
        x, a, b = least_squares()
        opt = torch.optim.AdamW([x], lr=0.05, weight_decay=0.1)
        for _ in range(10):
            ls_grad_(x, a, b)
            correction.apply([x], opt.step)
        runs.append(x.detach().clone())
    assert torch.equal(runs[0], runs[1])


def test_ef_lam_one_applies_two_d_t_minus_d_prev_from_step_three() -> None:
    x, a, b = least_squares()
    opt = torch.optim.AdamW([x], lr=0.05, weight_decay=0.1)
    ef = ErrorFeedback(lam=1.0)
    d_prev = torch.zeros_like(x)  # unused before step 3
    for step in range(1, 8):
        ls_grad_(x, a, b)
        assert x.grad is not None
        # Independent clone of the optimizer at the current weights: its step is the raw d_t.
        x_ref = nn.Parameter(x.detach().clone())
        x_ref.grad = x.grad.clone()
        opt_ref = torch.optim.AdamW([x_ref], lr=0.05, weight_decay=0.1)
        opt_ref.load_state_dict(copy.deepcopy(opt.state_dict()))
        opt_ref.step()
        x_before = x.detach().clone()
        d = x_ref.detach() - x_before

        ef.apply([x], opt.step)
        applied = x.detach() - x_before
        expected = d if step <= 2 else 2 * d - d_prev
        torch.testing.assert_close(applied, expected, rtol=1e-12, atol=1e-14, msg=f"step {step}")
        if step >= 3:
            assert not torch.allclose(applied, d)  # the correction did something
        d_prev = d


def test_ef_state_round_trip_and_validation() -> None:
    x, a, b = least_squares()
    opt = torch.optim.AdamW([x], lr=0.05)
    ef = ErrorFeedback(lam=1.0)
    for _ in range(3):
        ls_grad_(x, a, b)
        ef.apply([x], opt.step)
    twin_x = nn.Parameter(x.detach().clone())
    twin_opt = torch.optim.AdamW([twin_x], lr=0.05)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    twin_ef = ErrorFeedback(lam=1.0)
    twin_ef.load_state_dict(ef.state_dict())
    for p, o, e in ((x, opt, ef), (twin_x, twin_opt, twin_ef)):
        ls_grad_(p, a, b)
        e.apply([p], o.step)
    assert torch.equal(x, twin_x) and twin_ef.steps == 4
    with pytest.raises(ValueError, match="shapes"):
        ef.apply([nn.Parameter(torch.zeros(2, 2))], lambda: None)
    for lam in (-0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match=f"lam={lam}"):
            ErrorFeedback(lam=lam)
