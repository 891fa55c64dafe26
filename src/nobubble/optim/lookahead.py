"""A delay-aware Nesterov look-ahead for asynchronous pipelines, after arXiv 2505.01099.

Ajanthan et al. ("Nesterov Method for Asynchronous Pipeline Parallel Optimization", ICML 2025)
fight the gradient's delay with Nesterov's look-ahead. Their public code (PluralisResearch/AsyncPP)
trains its decoder-only models with NAdam (Dozat's Nesterov-Adam, PyTorch's implementation) with
decoupled weight decay and a first-moment coefficient near 1 (beta1 = 0.99), under PipeDream's
weight stashing; an option of the same code raises beta1 with the stage's delay. This module is
that optimizer with the stage's delay as an input:

    beta1(tau) = beta1 + min(tau, P) / P * (beta1_max - beta1)      (the code's rule, P stages)
    mu_t       = beta1(tau) * (1 - 0.5 * 0.96 ** (t * psi))          (PyTorch's momentum schedule)
    m_t        = beta1(tau) * m_{t-1} + (1 - beta1(tau)) * g_t
    v_t        = beta2 * v_{t-1} + (1 - beta2) * g_t ** 2
    x_t        = x_{t-1} * (1 - lr * wd)
                 - lr * (1 - mu_t) / (1 - prod_{i<=t} mu_i) * g_t / d_t
                 - lr * mu_{t+1} / (1 - prod_{i<=t+1} mu_i) * m_t / d_t,
    d_t        = sqrt(v_t / (1 - beta2 ** t)) + eps.

The look-ahead is the last term: the step already applies the momentum the next step will
apply (mu_{t+1} m_t), so the weights the next forward reads are ahead along the momentum; with
beta1 near 1 the momentum dominates the stale gradient's own term ((1 - mu_t) g_t). At tau = 0
(a last stage; any stage of a synchronous schedule) or beta1 = beta1_max (the code's published
runs) the delay changes nothing and this is ``torch.optim.NAdam(decoupled_weight_decay=True)``,
bit for bit. The paper's own text was not at hand; docs/semantics.md says what is inferred.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

DEFAULT_BETAS = (0.99, 0.999)  # the authors' published runs (momentum 0.99, PyTorch's beta2)
MAX_BETA1 = 0.99  # the momentum the delay rule moves beta1 toward


def delay_beta1(beta1: float, delay: float, stages: int, max_beta1: float = MAX_BETA1) -> float:
    """The first-moment coefficient of a stage whose gradients are ``delay`` versions old:
    ``beta1`` moved toward ``max_beta1`` by ``delay / stages`` of the way (0 <= delay <= stages)."""
    return beta1 + min(delay, stages) / stages * (max_beta1 - beta1)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"DelayNAdam {name} must be a finite number, got {value!r}")
    return float(value)


def _check_stages(stages: Any) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(
            f"DelayNAdam stages={stages!r} is not allowed: use the pipeline's number of "
            "stages P (an int >= 1)"
        )


class DelayNAdam(torch.optim.NAdam):
    """NAdam with decoupled weight decay whose beta1 follows the stage's delay (module docstring).

    ``delay``: the stage's delay tau (the ledger's; update it each step with `set_delay`);
    ``stages``: P, the pipeline's number of stages. State per tensor: PyTorch NAdam's ``step``,
    ``mu_product`` (scalars), ``exp_avg`` and ``exp_avg_sq`` (two parameter-sized buffers, as
    AdamW); the groups keep ``base_beta1``, ``max_beta1``, ``stages`` and ``delay``, so a
    state_dict resumes exactly.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = DEFAULT_BETAS,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum_decay: float = 4e-3,
        delay: float = 0.0,
        stages: int = 1,
        max_beta1: float = MAX_BETA1,
    ) -> None:
        _check_stages(stages)
        max_beta1 = _number("max_beta1", max_beta1)
        if not 0.0 <= max_beta1 < 1.0:
            raise ValueError(
                f"DelayNAdam max_beta1={max_beta1} is not allowed: use 0 <= max_beta1 < 1"
            )
        beta1 = _number("betas[0]", betas[0])
        if not 0.0 <= beta1 <= max_beta1:
            raise ValueError(
                f"DelayNAdam betas[0]={beta1} is not allowed: the delay moves beta1 toward "
                f"max_beta1={max_beta1}; use 0 <= beta1 <= max_beta1 (or raise max_beta1)"
            )
        for name, value, ok, allowed in (
            ("betas[1]", betas[1], lambda b: 0.0 <= b < 1.0, "0 <= beta2 < 1"),
            ("lr", lr, lambda x: x >= 0.0, "lr >= 0"),
            ("eps", eps, lambda x: x >= 0.0, "eps >= 0"),
            ("weight_decay", weight_decay, lambda x: x >= 0.0, "weight_decay >= 0"),
            ("momentum_decay", momentum_decay, lambda x: x >= 0.0, "momentum_decay >= 0"),
        ):
            if not ok(_number(name, value)):
                raise ValueError(f"DelayNAdam {name}={value!r} is not allowed: use {allowed}")
        super().__init__(
            params,
            lr=lr,
            betas=(beta1, betas[1]),
            eps=eps,
            weight_decay=weight_decay,
            momentum_decay=momentum_decay,
            decoupled_weight_decay=True,
        )
        for group in self.param_groups:
            group.update(base_beta1=beta1, max_beta1=max_beta1, stages=stages)
        self.set_delay(delay)

    def set_delay(self, delay: float, stages: int | None = None) -> None:
        """Set the stage's delay tau (0 <= tau <= stages) for the next steps; ``stages``: the
        pipeline's P, where it was not known when the optimizer was built (the registry's
        ``nadam-delay`` learns it from the worker with the first delay)."""
        if stages is not None:
            _check_stages(stages)
            for group in self.param_groups:
                group["stages"] = stages
        stages = self.param_groups[0]["stages"]
        tau = _number("delay", delay)
        if not 0.0 <= tau <= stages:
            raise ValueError(
                f"DelayNAdam delay={tau} is not allowed: use the stage's delay from the ledger, "
                f"0 <= delay <= stages={stages}"
            )
        for group in self.param_groups:
            beta1 = delay_beta1(group["base_beta1"], tau, group["stages"], group["max_beta1"])
            group["betas"] = (beta1, group["betas"][1])
            group["delay"] = tau


def build_delay_nadam(
    groups: list[dict[str, Any]],
    lr: float,
    betas: tuple[float, float] = DEFAULT_BETAS,
    eps: float = 1e-8,
    delay: float = 0.0,
    stages: int = 1,
) -> DelayNAdam:
    """One stage's DelayNAdam over ``groups`` (build.py's groups: decay on 2-D tensors only)."""
    return DelayNAdam(groups, lr=lr, betas=betas, eps=eps, delay=delay, stages=stages)
