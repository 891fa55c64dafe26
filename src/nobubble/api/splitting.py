"""``nobubble.split``: cut a model into pipeline stages that keep its parameter names.

A stage is an ``nn.Sequential`` of consecutive children of the model under their own names, so
``stage.named_parameters()`` yields the unsplit model's names (``"3.weight"``) and the stages'
state dicts merge back into the model's. The stages share the model's modules: no copy is made,
and training the stages trains ``model``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from nobubble.api.materializing import remember
from nobubble.model.gpt import GPT
from nobubble.model.partition import balanced_cuts
from nobubble.model.stages import compute_cost


def _units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"nobubble.split cuts nn.Sequential models, not {type(model).__name__}: pass your own "
            "list of stage modules to nobubble.Pipeline (each stage's output is the next one's "
            "input)"
        )
    units = list(model.named_children())
    if not units:
        raise ValueError("the model has no children to split")
    return units


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def split(model: nn.Module, points: Sequence[str] | int, *, untie: bool = False) -> list[nn.Module]:
    """Cut ``model`` into stages.

    ``points`` names the children before which a new stage begins (as torch's
    ``SplitPoint.BEGINNING``), e.g. ``["4", "8"]`` gives three stages; or it is the number of
    stages, and the cut balances their compute over the children (``compute_cost``).

    A Hugging Face causal LM (``nobubble.model.hf``) is cut before its named blocks instead, e.g.
    ``["model.layers.4"]``; ``untie`` gives a head tied to the embedding its own copy. The
    internal GPT (``nobubble.model.GPT``) is cut before its blocks, ``["layers.4"]``, or into
    ``points`` stages balanced by ``partition_layers``.

    A model built under ``torch.device("meta")`` is cut the same way; its stages remember the
    whole model, so that ``nobubble.Pipeline`` (or ``nobubble.materialize``) gives each process
    real tensors for its own stages only, initialized as the model's own init would.
    """
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        from nobubble.api.split_hf import split_hf

        return split_hf(model, points, untie=untie)
    if isinstance(model, GPT):
        gpt_stages = _split_gpt(model, points)
        remember(gpt_stages, model)
        return gpt_stages
    units = _units(model)
    names = [name for name, _ in units]
    if isinstance(points, int) and not isinstance(points, bool):
        if points < 1:
            raise ValueError(f"split into {points} stages: use 1 or more")
        if points > len(units):
            raise ValueError(
                f"split into {points} stages, but the model has {len(units)} children to cut "
                f"between ({', '.join(names)}): use at most {len(units)} stages"
            )
        starts = balanced_cuts([compute_cost(m) for _, m in units], points)
    else:
        if isinstance(points, str) or not isinstance(points, Sequence):
            raise TypeError(
                f"points must be a list of child names or a number of stages, got {points!r}"
            )
        starts = []
        for point in points:
            if point not in names:
                raise ValueError(
                    f"split point {point!r} names no child of the model; its children are "
                    f"{', '.join(names)}"
                )
            index = names.index(point)
            if index == 0:
                raise ValueError(
                    f"split point {point!r} is the first child: a stage would be empty; cut "
                    "before a later child"
                )
            if starts and index <= starts[-1]:
                raise ValueError(
                    f"split point {point!r} does not come after {names[starts[-1]]!r}: list the "
                    "points in the model's order, each once"
                )
            starts.append(index)
    bounds = [0, *starts, len(units)]
    stages: list[nn.Module] = []
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        stage = nn.Sequential(OrderedDict(units[a:b]))
        if _numel(stage) == 0:
            raise ValueError(
                f"stage {s} ({', '.join(names[a:b])}) has no parameters: move a split point so "
                "that every stage holds at least one layer with weights"
            )
        stages.append(stage)
    remember(stages, model)
    return stages


def _split_gpt(model: GPT, points: Sequence[str] | int) -> list[nn.Module]:
    """The internal GPT's stages sharing its modules: cut before the named blocks
    (``"layers.4"``), or into ``points`` stages balanced by ``partition_layers``."""
    from nobubble.model import partition_layers, split_model

    cfg = model.cfg
    if isinstance(points, int) and not isinstance(points, bool):
        ranges = partition_layers(cfg, points)
    else:
        names = [f"layers.{i}" for i in range(cfg.n_layers)]
        if isinstance(points, str) or not isinstance(points, Sequence):
            raise TypeError(f"points must be a list of block names or a number, got {points!r}")
        starts: list[int] = []
        for point in points:
            if point not in names or names.index(point) == 0:
                raise ValueError(
                    f"split point {point!r} names no block after the first; the GPT's blocks "
                    f"are layers.0 .. layers.{cfg.n_layers - 1}"
                )
            if starts and names.index(point) <= starts[-1]:
                raise ValueError(f"split point {point!r}: list the points in order, each once")
            starts.append(names.index(point))
        bounds = [0, *starts, cfg.n_layers]
        ranges = [range(a, b) for a, b in itertools.pairwise(bounds)]
    return list(split_model(model, len(ranges), ranges, share=True))
