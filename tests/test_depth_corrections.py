"""The corrections made for depth (issue 44 item 5): the delay-aware Nesterov look-ahead
(optim/lookahead.py, after arXiv 2505.01099) and Adam in a rotated basis (optim/rotation.py,
after arXiv 2602.03515).

Each is checked against the plain path (PyTorch's NAdam at delay 0; Adam where the rotation is
the identity), against a loop written out here from the equations in docs/semantics.md, for an
exact resume from a state_dict, and for its refusals. Gradients are drawn, not computed: an
optimizer step reads only ``.grad``.
"""

from __future__ import annotations

import importlib.util
import io
import math

import pytest
import torch

from nobubble.optim.lookahead import DelayNAdam, build_delay_nadam
from nobubble.optim.rotation import BasisRotation, build_basis_rotation

SHAPES = ((5, 3), (4, 6), (7,))  # two matrices (tall, wide) and a vector


def _params(shapes=SHAPES, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in shapes]


def _grads(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def _run(opt, params, grads, delays=None) -> None:
    for k, step_grads in enumerate(grads):
        for p, grad in zip(params, step_grads, strict=True):
            p.grad = grad.clone()
        if delays is not None:
            opt.set_delay(delays[k])
        opt.step()


def _resumed(make, grads, split: int, delays=None) -> list[torch.Tensor]:
    """Run ``grads[:split]`` (at ``delays``), save weights and state through torch.save,
    rebuild, run the rest (at the saved delay)."""
    params = _params()
    opt = make(params)
    _run(opt, params, grads[:split], delays)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    params = [p.clone().requires_grad_() for p in saved["params"]]
    opt = make(params)
    opt.load_state_dict(saved["opt"])
    _run(opt, params, grads[split:])
    return params


# ----- the delay-aware Nesterov look-ahead ----------------------------------------------------
def _delay_nadam(params, **kw):
    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.1, "stages": 4, **kw}
    return DelayNAdam([{"params": params}], **kw)


def test_delay_nadam_at_delay_zero_is_torch_nadam_bitwise():
    grads = _grads(_params(), 8)
    ours, ref = _params(), _params()
    _run(_delay_nadam(ours, delay=0.0), ours, grads)
    plain = torch.optim.NAdam(
        ref, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, decoupled_weight_decay=True
    )
    _run(plain, ref, grads)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


def test_delay_nadam_at_the_published_beta1_ignores_the_delay_bitwise():
    grads = _grads(_params(), 8)
    ours, ref = _params(), _params()
    _run(_delay_nadam(ours, betas=(0.99, 0.999)), ours, grads, delays=[3.0] * 8)
    plain = torch.optim.NAdam(
        ref, lr=1e-2, betas=(0.99, 0.999), weight_decay=0.1, decoupled_weight_decay=True
    )
    _run(plain, ref, grads)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


def _nadam_loop(params, grads, delays, lr, betas, wd, stages, max_beta1=0.99, psi=4e-3, eps=1e-8):
    """NAdam (Dozat) with PyTorch's momentum schedule and decoupled decay, beta1 moved toward
    ``max_beta1`` by delay / stages, written out from docs/semantics.md."""
    x = [p.detach().clone().double() for p in params]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    mu_prod = 1.0
    for t, (step_grads, tau) in enumerate(zip(grads, delays, strict=True), start=1):
        b1 = betas[0] + min(tau, stages) / stages * (max_beta1 - betas[0])
        mu = b1 * (1 - 0.5 * 0.96 ** (t * psi))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
        mu_prod *= mu
        for i, g in enumerate(step_grads):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            d = (v[i] / (1 - betas[1] ** t)).sqrt() + eps
            x[i] = x[i] * (1 - lr * wd)
            x[i] = x[i] - lr * (1 - mu) / (1 - mu_prod) * g / d
            x[i] = x[i] - lr * mu_next / (1 - mu_prod * mu_next) * m[i] / d
    return x


def test_delay_nadam_matches_a_loop_written_from_the_equations():
    delays = [0.0, 1.0, 0.5, 2.0, 3.0, 1.0, 4.0, 0.25]  # a stage's delay may change every step
    grads = _grads(_params(), len(delays))
    ours = _params()
    _run(_delay_nadam(ours), ours, grads, delays)
    ref = _nadam_loop(_params(), grads, delays, lr=1e-2, betas=(0.9, 0.999), wd=0.1, stages=4)
    plain = _nadam_loop(
        _params(), grads, [0.0] * len(delays), lr=1e-2, betas=(0.9, 0.999), wd=0.1, stages=4
    )
    for a, b, c in zip(ours, ref, plain, strict=True):
        torch.testing.assert_close(a.detach().double(), b, rtol=1e-6, atol=1e-6)
        assert (b - c).abs().max() > 1e-3  # the delay did change the trajectory


def test_delay_nadam_resumes_bitwise_mid_run():
    delays = [1.0, 0.5, 3.0]  # the last one is saved and serves the steps after the resume
    grads = _grads(_params(), 6)
    straight = _params()
    opt = _delay_nadam(straight)
    _run(opt, straight, grads[:3], delays)
    _run(opt, straight, grads[3:])
    resumed = _resumed(_delay_nadam, grads, split=3, delays=delays)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 0}, r"stages=0 is not allowed: use the pipeline's number of stages"),
        ({"stages": 2.5}, r"stages=2.5 is not allowed"),
        (
            {"betas": (0.995, 0.999)},
            r"betas\[0\]=0.995 is not allowed: .*use 0 <= beta1 <= max_beta1",
        ),
        ({"max_beta1": 1.0}, r"max_beta1=1.0 is not allowed: use 0 <= max_beta1 < 1"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\]=1.0 is not allowed: use 0 <= beta2 < 1"),
        ({"lr": -1.0}, r"lr=-1.0 is not allowed: use lr >= 0"),
        ({"delay": -1.0}, r"delay=-1.0 is not allowed: use the stage's delay from the ledger"),
        ({"delay": 5.0}, r"delay=5.0 is not allowed: .*0 <= delay <= stages=4"),
    ],
)
def test_delay_nadam_refuses_what_cannot_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _delay_nadam(_params(), **kwargs)


def test_delay_nadam_refuses_a_delay_beyond_the_stages_at_each_step():
    opt = build_delay_nadam([{"params": _params()}], lr=1e-2, stages=2)
    with pytest.raises(ValueError, match=r"delay=3.0 is not allowed: .*0 <= delay <= stages=2"):
        opt.set_delay(3.0)
    with pytest.raises(TypeError, match=r"delay must be a finite number"):
        opt.set_delay(math.nan)


# ----- Adam in a rotated basis ----------------------------------------------------------------
MATRICES = ((5, 3), (4, 6))


def _rotation(params, **kw):
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "precondition_frequency": 3, **kw}
    return BasisRotation([{"params": params}], **kw)


def _adam_loop(params, grads, lr, betas, wd, eps=1e-8):
    """Adam with the paper's arithmetic: decoupled decay first, eps added to sqrt(v)."""
    x = [p.detach().clone() for p in params]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    for t, step_grads in enumerate(grads, start=1):
        size = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
        for i, g in enumerate(step_grads):
            m[i].mul_(betas[0]).add_(g, alpha=1 - betas[0])
            v[i].mul_(betas[1]).add_(g.square(), alpha=1 - betas[1])
            x[i].add_(x[i], alpha=-lr * wd)
            x[i].add_(m[i] / (v[i].sqrt() + eps), alpha=-size)
    return x


def test_rotation_reduced_to_identity_is_adam():
    # A one-row matrix rotated on its smaller side only: the basis is 1 x 1, +-1.
    shapes = ((1, 6), (1, 3))
    grads = _grads(_params(shapes), 7)
    ours = _params(shapes)
    _run(_rotation(ours, geometry="uni"), ours, grads)
    ref = _adam_loop(_params(shapes), grads, lr=1e-2, betas=(0.9, 0.95), wd=0.1)
    adamw = _params(shapes)
    _run(torch.optim.AdamW(adamw, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), adamw, grads)
    for a, b, c in zip(ours, ref, adamw, strict=True):
        assert torch.equal(a.detach(), b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)  # PyTorch's AdamW, eps aside


def _rotation_loop(params, grads, lr, betas, wd, freq, geometry, eps=1e-8):
    """Algorithm 1 of arXiv 2602.03515 with its two-sided (or smaller-side) second-moment
    eigenbasis, written out with explicit identity bases for a side not rotated."""
    out = []
    for i, p in enumerate(params):
        x = p.detach().clone()
        r, c = x.shape
        left_on, right_on = (True, True) if geometry == "bi" else (r < c, r >= c)
        L, R = torch.zeros(r, r), torch.zeros(c, c)
        U, V = torch.eye(r), torch.eye(c)
        m, v = torch.zeros_like(x), torch.zeros_like(x)
        for t, step_grads in enumerate(grads, start=1):
            G = step_grads[i]
            L = betas[1] * L + (1 - betas[1]) * (G @ G.T)
            R = betas[1] * R + (1 - betas[1]) * (G.T @ G)
            if t == 1:
                U = torch.linalg.eigh(L).eigenvectors.flip(1) if left_on else U
                V = torch.linalg.eigh(R).eigenvectors.flip(1) if right_on else V
            elif t % freq == 0:
                if left_on:
                    order = (U * (L @ U)).sum(0).argsort(descending=True)
                    v, U = v[order, :], torch.linalg.qr(L @ U[:, order]).Q
                if right_on:
                    order = (V * (R @ V)).sum(0).argsort(descending=True)
                    v, V = v[:, order], torch.linalg.qr(R @ V[:, order]).Q
            m = betas[0] * m + (1 - betas[0]) * G
            v = betas[1] * v + (1 - betas[1]) * (U.T @ G @ V) ** 2
            size = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
            x = x - lr * wd * x
            x = x - size * (U @ ((U.T @ m @ V) / (v.sqrt() + eps)) @ V.T)
        out.append(x)
    return out


@pytest.mark.parametrize("geometry", ["bi", "uni"])
def test_rotation_matches_a_loop_written_from_the_paper(geometry):
    grads = _grads(_params(MATRICES), 8)  # refreshes at steps 3 and 6
    ours = _params(MATRICES)
    _run(_rotation(ours, geometry=geometry), ours, grads)
    ref = _rotation_loop(_params(MATRICES), grads, 1e-2, (0.9, 0.95), 0.1, 3, geometry)
    adam = _adam_loop(_params(MATRICES), grads, lr=1e-2, betas=(0.9, 0.95), wd=0.1)
    for a, b, c in zip(ours, ref, adam, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-5)
        assert (b - c).abs().max() > 1e-3  # the rotation did change the trajectory


@pytest.mark.parametrize("geometry", ["bi", "uni"])
def test_rotation_resumes_bitwise_mid_run(geometry):
    def make(params):
        matrices = [p for p in params if p.ndim == 2]
        return _rotation(matrices, precondition_frequency=2, geometry=geometry)

    grads = _grads(_params(), 7)
    straight = _params()
    _run(make(straight), straight, grads)
    resumed = _resumed(make, grads, split=3)  # after a refresh, before the next
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"geometry": "tri"}, r"geometry='tri' is unknown: use 'bi' .* or 'uni'"),
        ({"precondition_frequency": 0}, r"precondition_frequency=0 is not allowed: .*an int >= 1"),
        ({"precondition_frequency": 2.5}, r"precondition_frequency=2.5 is not allowed"),
        ({"betas": (1.0, 0.95)}, r"betas=\(1.0, 0.95\) is not allowed: use each beta in \[0, 1\)"),
        ({"eps": 0.0}, r"eps=0.0 is not allowed: use eps > 0"),
        ({"lr": -1.0}, r"lr=-1.0 is not allowed: use lr >= 0"),
        ({"weight_decay": -0.1}, r"weight_decay=-0.1 is not allowed"),
        ({"shampoo_beta": 1.0}, r"shampoo_beta=1.0 is not allowed"),
    ],
)
def test_rotation_refuses_bad_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _rotation(_params(MATRICES), **kwargs)


def test_rotation_refuses_a_tensor_that_is_not_a_matrix():
    with pytest.raises(
        ValueError, match=r"2-D matrices only, got a tensor of shape \(7,\): give .* to AdamW"
    ):
        build_basis_rotation([{"params": _params()}], lr=1e-2)


@pytest.mark.skipif(importlib.util.find_spec("pytorch_optimizer") is None, reason="optim extra")
def test_soap_is_not_the_papers_rotation_its_first_step_does_not_move():
    from pytorch_optimizer import SOAP

    soap_params, ours = _params(MATRICES), _params(MATRICES)
    grads = _grads(soap_params, 1)
    _run(SOAP(soap_params, lr=1e-2), soap_params, grads)
    _run(_rotation(ours), ours, grads)
    for p, q, start in zip(soap_params, ours, _params(MATRICES), strict=True):
        assert torch.equal(p.detach(), start)
        assert not torch.equal(q.detach(), start)


def test_rotation_trains_a_tiny_gpt_with_adamw_on_the_rest():
    # The paper's split: hidden matrices rotated, embedding, head and norm gains to AdamW.
    from nobubble.model import GPT, model_config

    torch.manual_seed(0)
    model = GPT(model_config("tiny", 128, 16))
    named = list(model.named_parameters())
    hidden = [p for n, p in named if p.ndim == 2 and not n.startswith(("embed.", "head."))]
    rest = [p for n, p in named if not any(p is h for h in hidden)]
    assert {tuple(p.shape) for p in hidden} >= {(64, 64), (192, 64), (64, 192)}  # not all square
    opts = [
        BasisRotation(hidden, lr=3e-3, betas=(0.9, 0.999)),
        torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.999)),
    ]
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), x.roll(-1, 1).ravel())
        losses.append(loss.item())
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()
    assert losses[-1] < losses[0] - 0.5, losses
