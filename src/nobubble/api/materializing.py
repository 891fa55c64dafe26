"""Stages of a model built on the meta device, given real tensors only where they run.

A model built under ``torch.device("meta")`` holds shapes and no memory. ``nobubble.split`` cuts
it like any model and remembers the whole model on its stages; ``materialize(stages, keep)``
then gives the stages ``keep`` (a process's own) real tensors on ``device`` and fills them:

- from ``weights``, a safetensors file or folder (sharded with its index): only the tensors of
  those stages are read (``nobubble.api.weights``), under the names transformers saves them
  (GPT-NeoX's head as ``embed_out.weight``);
- from ``seed``: bitwise the values that a model built normally after ``torch.manual_seed(seed)``
  starts with, whatever stages are kept.

Exact values need the whole model's draws. A model built normally draws its init from one random
stream, module after module, so the values of stage k depend on how many numbers every earlier
module drew. The model's own init is therefore replayed over the whole model, in its own order,
with this process's tensors real and the others still on meta. ``DrawAside`` makes every random
draw into a meta tensor on the CPU, into a scratch tensor of the same shape that is dropped at
once, so the stream advances exactly as in the normal build. That costs the time of drawing the
whole model's init on every process, and the memory of one tensor (the largest drawn). The init
replayed is:

- a Hugging Face model: its construction, run again on meta for the draws its layers make when
  built, with transformers' own ``initialize_weights`` at each ``post_init``, interleaved as
  ``from_config`` interleaves them;
- the internal GPT: ``nobubble.model.init_weights`` (its own generator, seeded with ``seed``);
- any other module: ``torch.manual_seed(seed)``, then each module's ``reset_parameters()``,
  children before their parent, siblings in registration order. That is what torch.nn layers
  draw when a model is built from them in that order (``nn.Sequential(nn.Linear(...), ...)``).
  A module holding parameters without a ``reset_parameters`` is refused: where its init draws
  in the stream is unknown. Pass ``init`` (the model's init, run over the whole model) or
  ``weights`` instead.

``init(model)`` replaces the model's own init, torchtitan's way: the values are those of
``torch.manual_seed(seed); init(model)`` run on the model built normally, so ``init`` must write
every tensor (the construction's own draws are not replayed). A floating-point tensor the init
leaves unwritten (tensors start as NaN) is refused by name. An init whose values read another
stage's tensors cannot be replayed per stage: torch refuses it (meta and real tensors mixed).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from nobubble.api.replay import DrawAside, Init, own_init
from nobubble.api.weights import SafetensorsWeights

SOURCE = "_nobubble_source"  # the attribute of a stage that holds its Source


@dataclass(eq=False)
class Source:
    """The whole model the stages were cut from (on meta), and the tensors that start as a
    copy of another (a tied head split into its own copy takes the embedding's values)."""

    model: nn.Module
    copies: dict[str, str] = field(default_factory=dict)  # name -> name it starts equal to


def on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def remember(stages: Sequence[nn.Module], model: nn.Module, copies: dict[str, str] | None = None):
    """Record ``model`` on its ``stages`` (``nobubble.split`` does) when it is on meta."""
    if not on_meta(model):
        return
    source = Source(model, dict(copies or {}))
    for stage in stages:
        stage.__dict__[SOURCE] = source  # a plain attribute: not a submodule, not saved


# ----- where each tensor lives ------------------------------------------------------------------
def _modules(roots: Sequence[nn.Module]) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for root in roots:
        for module in root.modules():
            seen.setdefault(id(module), module)
    return list(seen.values())


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _swap(modules: list[nn.Module], old: torch.Tensor, new: torch.Tensor) -> None:
    """Put ``new`` wherever ``old`` is held (a shared tensor stays shared)."""
    for module in modules:
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is old:
                    slots[name] = new  # type: ignore[assignment]


def _fresh(old: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``old``'s shape: NaN when floating (so an unwritten one shows)."""
    fill = math.nan if old.dtype.is_floating_point or old.dtype.is_complex else 0
    new = torch.full(old.shape, fill, dtype=old.dtype, device="cpu")
    return (
        nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else new
    )


def _names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, t in itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    ):
        names.setdefault(id(t), []).append(name)
    return names


def source_of(stages: Sequence[nn.Module]) -> Source:
    sources = {id(s.__dict__.get(SOURCE)): s.__dict__.get(SOURCE) for s in stages}
    if len(sources) > 1:
        raise ValueError(
            "the stages come from different models (or only some from nobubble.split): "
            "materialize the stages of one split together"
        )
    found = next(iter(sources.values()))
    # stages built on meta as a list of one's own modules: as if built one after the other
    return found if found is not None else Source(nn.ModuleList(stages))


# ----- loading ----------------------------------------------------------------------------------
def _init_buffers(model: nn.Module, modules: list[nn.Module], buffers: list[torch.Tensor]) -> None:
    """Non-persistent buffers (rotary tables) are in no weights file: compute them as the
    model's init does."""
    from nobubble.model.hf import is_hf_model

    ids = {id(b) for b in buffers}
    holders = [m for m in modules if any(id(b) in ids for b in m._buffers.values())]
    for module in holders:
        if is_hf_model(model):
            model._init_weights(module)  # type: ignore[operator]
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()  # type: ignore[operator]
        else:
            raise ValueError(
                f"{type(module).__name__} holds non-persistent buffers, which no weights file "
                "holds, and no reset_parameters() to compute them: build it normally"
            )


def _load(
    source: Source,
    modules: list[nn.Module],
    mine: list[torch.Tensor],
    weights: str | Path | SafetensorsWeights,
) -> SafetensorsWeights:
    from nobubble.model.hf import stored_names

    model = source.model
    reader = weights if isinstance(weights, SafetensorsWeights) else SafetensorsWeights(weights)
    names, renamed = _names(model), stored_names(model)
    stored = set(model.state_dict(keep_vars=True))
    plan: dict[str, torch.Tensor] = {}
    computed: list[torch.Tensor] = []
    for t in mine:
        saved = [n for n in names[id(t)] if n in stored]
        if not saved:
            computed.append(t)
            continue
        # a head split from a tied embedding starts as the embedding (from_pretrained ties it)
        wanted = [source.copies.get(n, n) for n in saved]
        wanted += [renamed[n] for n in wanted if n in renamed]  # the name a file may use
        plan[next((n for n in wanted if n in reader.weight_map), wanted[0])] = t
    reader.check({n: tuple(t.shape) for n, t in plan.items()})
    with torch.no_grad(), DrawAside():
        _init_buffers(model, modules, computed)
        for name, t in plan.items():
            t.copy_(reader.get(name))
    return reader


# ----- the entry point --------------------------------------------------------------------------
def materialize(
    stages: Sequence[nn.Module],
    keep: int | Collection[int],
    *,
    seed: int | None = None,
    init: Init | None = None,
    weights: str | Path | SafetensorsWeights | None = None,
    device: str | torch.device = "cpu",
) -> list[str]:
    """Give the stages ``keep`` real tensors on ``device`` (module docstring): loaded from
    ``weights``, or initialized as the model's own init from ``seed`` (or by ``init``). The
    other stages stay on meta. Returns the names of the tensors filled."""
    stages = list(stages)
    own = {keep} if isinstance(keep, int) else set(keep)
    if not own or not all(isinstance(s, int) and 0 <= s < len(stages) for s in own):
        raise ValueError(f"keep={keep!r}: give stage indices in 0..{len(stages) - 1}")
    if weights is not None and init is not None:
        raise ValueError("give weights= or init=, not both: loaded weights need no init")
    if weights is None and seed is None and init is None:
        raise ValueError(
            "stages on the meta device need values: seed= (the seed the model would be built "
            "with, after torch.manual_seed), init= (a function initializing the whole model), "
            "or weights= (a safetensors file or folder)"
        )
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    source = source_of(stages)
    modules = _modules([source.model, *stages])
    mine = {id(t): t for s in sorted(own) for t in _tensors(stages[s]) if t.is_meta}
    if not mine:
        return []
    names = _names(source.model)
    by_name = dict(
        itertools.chain(
            source.model.named_parameters(remove_duplicate=False),
            source.model.named_buffers(remove_duplicate=False),
        )
    )
    helpers: dict[int, torch.Tensor] = {}
    if weights is None:  # a copy's values come from its original: fill that one here too
        for t in mine.values():
            for n in names.get(id(t), []):
                original = by_name.get(source.copies.get(n, ""))
                if original is not None and id(original) not in mine:
                    helpers[id(original)] = original
    fresh: dict[int, torch.Tensor] = {}
    for i, old in itertools.chain(mine.items(), helpers.items()):
        fresh[i] = _fresh(old)
        _swap(modules, old, fresh[i])
    filled = sorted(n for i in mine for n in names.get(i, []))
    try:
        if weights is not None:
            _load(source, modules, [fresh[i] for i in mine], weights)
        else:
            run = own_init(source.model, seed, init)
            with torch.no_grad(), DrawAside():
                run()
            _check_written({n: fresh[i] for i in mine for n in names.get(i, [])[:1]})
            _copy_originals(source, names, mine, fresh, by_name)
    except BaseException:
        for i, old in itertools.chain(mine.items(), helpers.items()):
            _swap(modules, fresh[i], old)  # leave the stages as they were given
        raise
    for i, old in helpers.items():
        _swap(modules, fresh[i], old)
    target = torch.device(device)
    if target.type != "cpu":
        for i in mine:
            t = fresh[i]
            if isinstance(t, nn.Parameter):
                t.data = t.data.to(target)
            else:
                _swap(modules, t, t.to(target))
    return filled


def _check_written(tensors: dict[str, torch.Tensor]) -> None:
    unset = [n for n, t in tensors.items() if t.is_floating_point() and bool(t.isnan().any())]
    if unset:
        raise ValueError(
            f"the init left {', '.join(unset[:5])} unset: initialize every tensor of the model "
            "in init=, or give weights="
        )


def _copy_originals(
    source: Source,
    names: dict[int, list[str]],
    mine: dict[int, torch.Tensor],
    fresh: dict[int, torch.Tensor],
    by_name: dict[str, torch.Tensor],
) -> None:
    """A copy (a tied head of its own) starts with its original's values."""
    for i in mine:
        for n in names.get(i, []):
            if n in source.copies:
                original = by_name[source.copies[n]]
                value = fresh.get(id(original), original)
                with torch.no_grad():
                    fresh[i].copy_(value)
