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

# soap, adan and mars step every tensor of a stage; normuon steps the 2-D hidden matrices and
# leaves the rest to AdamW, as muon does (routing.MATRIX_OPTIMIZERS).
LIBRARY_OPTIMIZERS: tuple[str, ...] = ("soap", "adan", "mars", "normuon")
PACKAGE = "pytorch_optimizer"
INSTALL = "pip install 'nobubble[optim]'"


def _missing(name: str) -> MissingExtra:
    return MissingExtra(
        f"optimizer {name!r} comes from the pytorch-optimizer package, which is not installed: "
        f"{INSTALL}"
    )


def check_installed(name: str) -> None:
    """Refuse ``name`` early, without importing the library, when it is not installed."""
    if name not in LIBRARY_OPTIMIZERS:
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


def build_library_optimizer(
    name: str,
    groups: list[dict[str, Any]],
    lr: float,
    betas: tuple[float, float] | None,
    eps: float,
) -> torch.optim.Optimizer:
    """The library optimizer ``name`` (soap | adan | mars) over ``groups``.

    ``betas``: the pair of SOAP or MARS (config.DEFAULT_BETAS has their published ones); Adan
    has three betas and keeps the library's (0.98, 0.92, 0.99), so it takes None.
    """
    lib = _library(name)
    pair = {} if betas is None else {"betas": betas}
    if name == "soap":
        return lib.SOAP(groups, lr=lr, eps=eps, **pair)
    if name == "adan":
        # decoupled decay, the project's policy for every optimizer (the library's default
        # adds it to the gradient)
        return lib.Adan(groups, lr=lr, eps=eps, weight_decouple=True)
    if name == "mars":
        # MARS steps 1-D tensors with its own AdamW unless optimize_1d; give that side the same
        # lr (the schedule scales both) and no decay: norm gains are never decayed here.
        return lib.MARS(
            groups, lr=lr, eps=eps, lr_1d=lr, betas_1d=(0.9, 0.95), weight_decay_1d=0.0, **pair
        )
    raise ValueError(f"{name!r} is not a library optimizer: use one of {LIBRARY_OPTIMIZERS}")


def build_normuon(
    groups: list[dict[str, Any]], lr: float, momentum: float, nesterov: bool, ns_steps: int
) -> torch.optim.Optimizer:
    """NorMuon over the hidden matrices' groups; its update RMS is matched to AdamW's (0.2, the
    convention of ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``), so one lr serves the
    matrices and the AdamW side."""
    lib = _library("normuon")
    return lib.NorMuon(
        [{**g, "use_muon": True} for g in groups],
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        update_scale="match_rms",
    )
