"""Adam in a rotated basis for asynchronous pipelines, after arXiv 2602.03515 (basis rotation).

Jung, Shin and Lee trace the delay's growing cost with depth under Adam to its per-coordinate
scaling, misaligned with the curvature's eigenbasis; they run Adam in an estimated eigenbasis
instead. For a matrix W (r x c) with gradient G, each step of their Algorithm 1 with the
eigenbasis estimate they recommend (two-sided, from the gradients' second moments):

    L_t = b * L_{t-1} + (1 - b) * G G^T        R_t = b * R_{t-1} + (1 - b) * G^T G
    step 1:          U, V = eigenvectors of L_1, R_1 (eigenvalues descending)
    every T steps:   U <- QR(L_t U'), V <- QR(R_t V'), where U', V' are U, V with their
                     columns sorted by the estimated eigenvalues diag(U^T L_t U) (descending),
                     and the second moment's rows/columns are permuted the same way
    m_t = b1 * m_{t-1} + (1 - b1) * G                 (kept in W's own coordinates)
    v_t = b2 * v_{t-1} + (1 - b2) * (U^T G V) ** 2     (kept in the rotated coordinates)
    W  <- W - lr * wd * W
    W  <- W - lr * sqrt(1 - b2**t) / (1 - b1**t) * U [(U^T m_t V) / (sqrt(v_t) + eps)] V^T

with b = b2 unless ``shampoo_beta`` is given. ``geometry="uni"`` rotates the smaller side only
(U when r < c, else V; the other is the identity). The basis is refreshed BEFORE the step that
uses it, so every step, the first included, moves the weights. This is SOAP's rotation (arXiv
2409.11321) with three differences from pytorch-optimizer's ``SOAP``: SOAP's first step only
builds the basis and does not move the weights; SOAP refreshes after the update (the new basis
serves the next step); SOAP applies the decay after the update. The paper rotates the attention
and MLP matrices only and steps everything else with AdamW (same lr, betas, decay), the rule
``routing.muon_group`` already draws for Muon: this class accepts 2-D tensors only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

GEOMETRIES = ("bi", "uni")
DEFAULT_BETAS = (0.9, 0.999)  # the authors' launcher: --momentum 0.9, beta2 0.999
DEFAULT_FREQUENCY = 10  # their --subspace_update_frequency


def _sides(shape: torch.Size, geometry: str) -> tuple[bool, bool]:
    """Whether the left (rows) and the right (columns) side are rotated."""
    rows, cols = shape
    if geometry == "bi":
        return True, True
    return rows < cols, rows >= cols


def _eigenbasis(cov: Tensor) -> Tensor:
    """Eigenvectors of a symmetric ``cov``, columns by descending eigenvalue."""
    _, vectors = torch.linalg.eigh(cov)
    return torch.flip(vectors, dims=[1])


def _refresh(cov: Tensor, basis: Tensor, exp_avg_sq: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """One power iteration from ``basis``, its columns first sorted by estimated eigenvalue;
    ``exp_avg_sq`` is permuted along ``dim`` so each entry stays with its direction."""
    order = torch.argsort(torch.diag(basis.T @ cov @ basis), descending=True)
    q, _ = torch.linalg.qr(cov @ basis[:, order])
    return q, exp_avg_sq.index_select(dim, order)


def _project(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """U^T x V, a missing side being the identity."""
    if left is not None:
        x = left.T @ x
    if right is not None:
        x = x @ right
    return x


def _project_back(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """U x V^T, a missing side being the identity."""
    if right is not None:
        x = x @ right.T
    if left is not None:
        x = left @ x
    return x


class BasisRotation(torch.optim.Optimizer):
    """Adam in the gradients' estimated eigenbasis, for 2-D tensors (module docstring).

    State per (r, c) matrix: ``step``; ``exp_avg`` and ``exp_avg_sq`` (r x c each); per rotated
    side the second-moment statistics ``cov_left`` (r x r) / ``cov_right`` (c x c) and the basis
    ``basis_left`` / ``basis_right`` of the same size (None for a side not rotated).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = DEFAULT_BETAS,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        precondition_frequency: int = DEFAULT_FREQUENCY,
        geometry: str = "bi",
        shampoo_beta: float | None = None,
    ) -> None:
        _check(lr, betas, eps, weight_decay, precondition_frequency, geometry, shampoo_beta)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "geometry": geometry,
            "shampoo_beta": betas[1] if shampoo_beta is None else shampoo_beta,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        tensors = [params] if isinstance(params, Tensor) else list(params)
        for p in tensors:
            if p.ndim != 2:
                raise ValueError(
                    f"BasisRotation rotates 2-D matrices only, got a tensor of shape "
                    f"{tuple(p.shape)}: give norm gains, biases and other non-matrices to AdamW "
                    "(the routing of muon does this: routing.muon_group)"
                )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, p.grad, group)
        return loss

    def _step_one(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            self._init_state(state, grad, group["geometry"])
        state["step"] += 1
        self._update_basis(state, grad, group)
        beta1, beta2 = group["betas"]
        left, right = state["basis_left"], state["basis_right"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).add_(_project(grad, left, right).square(), alpha=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        step = state["step"]
        step_size = group["lr"] * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        update = _project_back(_project(exp_avg, left, right) / denom, left, right)
        if group["weight_decay"] > 0.0:
            p.add_(p, alpha=-group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-step_size)

    @staticmethod
    def _init_state(state: dict[str, Any], grad: Tensor, geometry: str) -> None:
        rows, cols = grad.shape
        use_left, use_right = _sides(grad.shape, geometry)
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(grad)
        state["exp_avg_sq"] = torch.zeros_like(grad)
        state["cov_left"] = grad.new_zeros(rows, rows) if use_left else None
        state["cov_right"] = grad.new_zeros(cols, cols) if use_right else None
        state["basis_left"] = None
        state["basis_right"] = None

    @staticmethod
    def _update_basis(state: dict[str, Any], grad: Tensor, group: dict[str, Any]) -> None:
        """Accumulate the statistics; build the basis at the first step, refresh it every
        ``precondition_frequency`` steps."""
        weight = 1.0 - group["shampoo_beta"]
        if state["cov_left"] is not None:
            state["cov_left"].lerp_(grad @ grad.T, weight)
        if state["cov_right"] is not None:
            state["cov_right"].lerp_(grad.T @ grad, weight)
        first = state["step"] == 1
        if not first and state["step"] % group["precondition_frequency"] != 0:
            return
        for side, dim in (("left", 0), ("right", 1)):
            cov = state[f"cov_{side}"]
            if cov is None:
                continue
            if first:
                state[f"basis_{side}"] = _eigenbasis(cov)
            else:
                basis, state["exp_avg_sq"] = _refresh(
                    cov, state[f"basis_{side}"], state["exp_avg_sq"], dim
                )
                state[f"basis_{side}"] = basis


def _check(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    frequency: int,
    geometry: str,
    shampoo_beta: float | None,
) -> None:
    """Refuse values the update cannot use, naming what is allowed."""
    if geometry not in GEOMETRIES:
        raise ValueError(
            f"BasisRotation geometry={geometry!r} is unknown: use 'bi' (both sides, the paper's "
            "default) or 'uni' (the smaller side only)"
        )
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ValueError(
            f"BasisRotation precondition_frequency={frequency!r} is not allowed: use the number "
            "of steps between basis refreshes, an int >= 1 (the paper's 10)"
        )
    checks = (
        ("lr", lr, lr >= 0.0, "lr >= 0"),
        ("betas", betas, all(0.0 <= b < 1.0 for b in betas), "each beta in [0, 1)"),
        ("eps", eps, eps > 0.0, "eps > 0 (a direction with no gradient yet divides by it)"),
        ("weight_decay", weight_decay, weight_decay >= 0.0, "weight_decay >= 0"),
        (
            "shampoo_beta",
            shampoo_beta,
            shampoo_beta is None or 0.0 <= shampoo_beta < 1.0,
            "None (beta2) or a value in [0, 1)",
        ),
    )
    for name, value, ok, allowed in checks:
        if not ok:
            raise ValueError(f"BasisRotation {name}={value!r} is not allowed: use {allowed}")


def build_basis_rotation(
    groups: list[dict[str, Any]],
    lr: float,
    betas: tuple[float, float] = DEFAULT_BETAS,
    eps: float = 1e-8,
    precondition_frequency: int = DEFAULT_FREQUENCY,
    geometry: str = "bi",
) -> BasisRotation:
    """One stage's BasisRotation over the hidden matrices' ``groups`` (build.py's groups)."""
    return BasisRotation(
        groups,
        lr=lr,
        betas=betas,
        eps=eps,
        precondition_frequency=precondition_frequency,
        geometry=geometry,
    )
