"""The optimizer's configuration: one frozen dataclass, validated on construction.

The defaults follow the recipe of arXiv 2606.30634 (weight decay 0.1, clipping 1.0, warmup 10 %
then cosine to 0.1x peak, AdamW betas (0.9, 0.95), Muon momentum 0.95).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import nobubble.optim.library as library
from nobubble.optim.registry import OPTIMIZER_ENTRIES, optimizer_entry

# torch's and the ones written here first (registry.py), then pytorch-optimizer's (library.py)
OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_ENTRIES)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_real(name: str, value: object, low: float, high: float, *, open_low: bool) -> None:
    """Raise ValueError unless `value` is a finite number in (low, high] or [low, high]."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)  # type: ignore[arg-type]
    too_low = v <= low if open_low else v < low
    if not math.isfinite(v) or too_low or v > high:
        bracket = "(" if open_low else "["
        allowed = f"{bracket}{low}, {high}]"
        raise ValueError(f"{name}={value!r} is not allowed: use a finite value in {allowed}")


@dataclass(frozen=True)
class OptimConfig:
    """How one pipeline stage updates its parameters.

    Fields:
        name: one of OPTIMIZERS. "muon" runs torch.optim.Muon on the 2-D hidden matrices and AdamW
            on everything else (see `route_parameters`); "normuon" does the same with NorMuon.
            "rotation" does the same with basis rotation (rotation.py); "nadam-delay" is NAdam
            whose beta1 follows the stage's delay (lookahead.py). soap, adan, mars, normuon and
            adamuon come from pytorch-optimizer (library.py), which must be installed
            (`pip install 'nobubble[optim]'`).
        lr: peak learning rate of the schedule. For "muon" it is the AdamW-side lr, and Muon uses
            the same value with its update RMS matched to AdamW (`adjust_lr_fn="match_rms_adamw"`,
            i.e. the Muon lr is scaled by 0.2 * sqrt(max(rows, cols))), so one lr serves both.
        weight_decay: decoupled weight decay, applied to 2-D tensors only (norm weights get 0).
        betas: (beta1, beta2) of AdamW / NAdam / Lion; None picks the registry entry's pair,
            (0.9, 0.95) for the Adam family, (0.9, 0.99) for Lion, (0.99, 0.999) for
            nadam-delay and (0.9, 0.999) for rotation (their papers' code).
        eps: denominator epsilon of AdamW / NAdam (Muon keeps torch's own 1e-7 for Newton-Schulz).
        momentum, nesterov, ns_steps: Muon's momentum, Nesterov flag and Newton-Schulz steps.
        warmup_frac: fraction of the run spent in linear warmup, in [0, 1).
        min_lr_ratio: the cosine decays to min_lr_ratio * lr at the last step, in [0, 1].
        clip_norm: max gradient norm, or None for no clipping.
        fused_adamw: run AdamW (adamw, and the AdamW side of muon and normuon) through torch's
            fused kernel (``torch.optim.AdamW(fused=True)``), which updates every tensor in one
            pass without temporaries: the default per-tensor step holds two scratch tensors the
            size of the tensor it updates. Its results differ from the default's in the last
            bits, so a run keeps the choice it started with.
    """

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] | None = None
    eps: float = 1e-8
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    warmup_frac: float = 0.1
    min_lr_ratio: float = 0.1
    clip_norm: float | None = 1.0
    fused_adamw: bool = False

    def __post_init__(self) -> None:
        entry = optimizer_entry(self.name)
        library.check_installed(self.name)
        _check_real("lr", self.lr, 0.0, math.inf, open_low=True)
        _check_real("weight_decay", self.weight_decay, 0.0, math.inf, open_low=False)
        if self.betas is not None:
            if entry.betas is None:
                raise ValueError(
                    f"betas={self.betas!r} cannot be given for {self.name}: {entry.own_betas}; "
                    "leave betas unset"
                )
            self._check_betas()
        _check_real("eps", self.eps, 0.0, 1.0, open_low=True)
        _check_real("momentum", self.momentum, 0.0, 1.0, open_low=False)
        if self.momentum == 1.0:
            raise ValueError("momentum=1.0 is not allowed: use a value in [0, 1), e.g. 0.95")
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"nesterov must be a bool, got {self.nesterov!r}")
        if not isinstance(self.ns_steps, int) or isinstance(self.ns_steps, bool):
            raise TypeError(f"ns_steps must be an int, got {self.ns_steps!r}")
        if not 1 <= self.ns_steps < 100:  # torch.optim.Muon refuses 100 or more
            raise ValueError(f"ns_steps={self.ns_steps} is not allowed: use 1..99 (usually 5)")
        _check_real("warmup_frac", self.warmup_frac, 0.0, 1.0, open_low=False)
        if self.warmup_frac == 1.0:
            raise ValueError(
                "warmup_frac=1.0 is not allowed (no decay phase left): use a value in [0, 1)"
            )
        _check_real("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0, open_low=False)
        if self.clip_norm is not None:
            _check_real("clip_norm", self.clip_norm, 0.0, math.inf, open_low=True)
        if not isinstance(self.fused_adamw, bool):
            raise TypeError(f"fused_adamw must be a bool, got {self.fused_adamw!r}")
        if self.fused_adamw and not entry.fused_adamw:
            fused = tuple(n for n, e in OPTIMIZER_ENTRIES.items() if e.fused_adamw)
            raise ValueError(
                f"fused_adamw=True does not apply to optimizer {self.name!r}, which runs no "
                f"AdamW: use it with one of {fused} or leave it off"
            )

    def _check_betas(self) -> None:
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas={betas!r} is not allowed: use a pair (beta1, beta2)")
        for i, beta in enumerate(betas):
            _check_real(f"betas[{i}]", beta, 0.0, 1.0, open_low=False)
            if beta == 1.0:
                raise ValueError(f"betas={betas!r} is not allowed: each beta must be < 1")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))  # lists -> tuple

    @property
    def resolved_betas(self) -> tuple[float, float]:
        """The betas the optimizer actually uses (explicit, or the default for `name`)."""
        default = OPTIMIZER_ENTRIES[self.name].betas
        return self.betas if self.betas is not None else default  # type: ignore[return-value]


__all__ = ["OPTIMIZERS", "OptimConfig"]
