"""Paper A's other optimizers, taken from a maintained library instead of written here.

arXiv 2606.30634 also runs SOAP (its EF recovers 67% of SOAP's gap), Adan (which EF slightly
hurts) and NorMuon. They come from ``pytorch-optimizer`` (the ``optim`` extra,
``pip install 'nobubble[optim]'``), a pure-Python package that needs only torch and numpy, so it
never replaces the installed torch. MARS, from the same package, is offered beside them.

Each is built over the param groups of ``build.py`` (decay on 2-D tensors only, one lr that the
schedule sets on every group) with the library's published defaults except where the project's
policy differs, said at each call. The library is imported only when one of these optimizers is
built, and ``check_installed`` refuses a missing one at config time with the install command.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from nobubble.core.errors import MissingExtra
from nobubble.optim.registry import (
    OPTIMIZER_ENTRIES,
    Groups,
    OptimizerEntry,
    OptimSettings,
    adamw,
    register_optimizer,
)

PACKAGE = "pytorch_optimizer"
INSTALL = "pip install 'nobubble[optim]'"


def _missing(name: str) -> MissingExtra:
    return MissingExtra(
        f"optimizer {name!r} comes from the pytorch-optimizer package, which is not installed: "
        f"{INSTALL}"
    )


def check_installed(name: str) -> None:
    """Refuse ``name`` early, without importing the library, when it is not installed."""
    if name not in OPTIMIZER_ENTRIES or not OPTIMIZER_ENTRIES[name].library:
        return
    try:
        found = importlib.util.find_spec(PACKAGE) is not None
    except (ValueError, ImportError):  # a module set to None in sys.modules, a broken install
        found = False
    if not found:
        raise _missing(name)


def _library(name: str) -> Any:
    try:
        import pytorch_optimizer
    except ImportError as exc:
        raise _missing(name) from exc
    return pytorch_optimizer


def _soap(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    return _library("soap").SOAP(groups, lr=cfg.lr, eps=cfg.eps, betas=cfg.resolved_betas)


def _adan(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    # decoupled decay, the project's policy for every optimizer (the library's default adds it
    # to the gradient); Adan's three betas stay the library's (0.98, 0.92, 0.99)
    return _library("adan").Adan(groups, lr=cfg.lr, eps=cfg.eps, weight_decouple=True)


def _mars(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    # MARS steps 1-D tensors with its own AdamW unless optimize_1d; give that side the same lr
    # (the schedule scales both) and no decay: norm gains are never decayed here.
    return _library("mars").MARS(
        groups,
        lr=cfg.lr,
        eps=cfg.eps,
        lr_1d=cfg.lr,
        betas_1d=(0.9, 0.95),
        weight_decay_1d=0.0,
        betas=cfg.resolved_betas,
    )


def _normuon(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    """NorMuon over the hidden matrices' groups; its update RMS is matched to AdamW's (0.2, the
    convention of ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``), so one lr serves the
    matrices and the AdamW side."""
    return _library("normuon").NorMuon(
        [{**g, "use_muon": True} for g in groups],
        lr=cfg.lr,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps,
        update_scale="match_rms",
    )


for _entry in (
    # SOAP's and MARS's own papers' pairs (arXiv 2409.11321, 2411.10438), the library's defaults
    OptimizerEntry("soap", "SOAP (pytorch-optimizer)", _soap, betas=(0.95, 0.95), library=True),
    OptimizerEntry(
        "adan",
        "Adan (pytorch-optimizer)",
        _adan,
        betas=None,
        own_betas="it has three betas and keeps the library's (0.98, 0.92, 0.99)",
        library=True,
    ),
    OptimizerEntry("mars", "MARS (pytorch-optimizer)", _mars, betas=(0.95, 0.99), library=True),
    OptimizerEntry(
        "normuon",
        "NorMuon on the 2-D hidden matrices, AdamW on the rest (pytorch-optimizer)",
        adamw,  # the AdamW side, as for muon
        matrix=_normuon,
        fused_adamw=True,
        library=True,
    ),
):
    register_optimizer(_entry)


def _adamuon(cfg: OptimSettings, groups: Groups) -> torch.optim.Optimizer:
    """AdaMuon (arXiv 2507.11005) over the hidden matrices' groups: Muon's orthogonalized
    momentum with a second moment of the orthogonalized update, rescaled to an update RMS of
    0.2 (``use_adjusted_lr``, AdamW's), so one lr serves the matrices and the AdamW side.
    ``betas``: the momentum's and the second moment's, (0.9, 0.95) as the library's."""
    return _library("adamuon").AdaMuon(
        [{**g, "use_muon": True} for g in groups],
        lr=cfg.lr,
        betas=cfg.resolved_betas,
        ns_steps=cfg.ns_steps,
        use_adjusted_lr=True,
    )


register_optimizer(
    OptimizerEntry(
        "adamuon",
        "AdaMuon on the 2-D hidden matrices, AdamW on the rest (pytorch-optimizer)",
        adamw,  # the AdamW side, as for muon
        matrix=_adamuon,
        fused_adamw=True,
        library=True,
    )
)
# soap, adan and mars step every tensor; normuon steps the 2-D hidden matrices and leaves the
# rest to AdamW, as muon does
LIBRARY_OPTIMIZERS: tuple[str, ...] = tuple(n for n, e in OPTIMIZER_ENTRIES.items() if e.library)


__all__ = [
    "INSTALL",
    "LIBRARY_OPTIMIZERS",
    "PACKAGE",
    "check_installed",
]
