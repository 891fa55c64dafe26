"""A Hugging Face causal LM cut into stages (``split``'s route for those models), and the
balance of a cut."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nobubble.api.materializing import remember
from nobubble.model.hf import (
    block_layout,
    check_model,
    model_folder,
    require_transformers,
    tied_names,
    untie_embeddings,
)
from nobubble.model.hf_stages import HFStage
from nobubble.model.partition import balanced_cuts
from nobubble.model.stages import compute_cost


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def split_hf(model: Any, points: Sequence[str] | int, untie: bool = False) -> list[nn.Module]:
    """Cut a Hugging Face causal LM before the named blocks (``["model.layers.4"]``), or into
    ``points`` stages that balance their compute (embedding on the first, head on the last).
    A family or config field the stages would not compute as the model does is refused."""
    check_model(model)
    prefix, blocks = block_layout(model)
    n = len(blocks)
    names = [f"{prefix}.{i}" for i in range(n)]
    if isinstance(points, int) and not isinstance(points, bool):
        if not 1 <= points <= n:
            raise ValueError(
                f"split into {points} stages, but the model has {n} blocks ({prefix}.0 .. "
                f"{prefix}.{n - 1}): use 1 to {n} stages"
            )
        # compute, not memory: a multiply-add per parameter and token, so the head's matmul
        # counts on the last stage (tied or not) and the embedding, a lookup, counts nothing
        costs = [_numel(b) for b in blocks]
        costs[-1] += model.lm_head.weight.numel()
        starts = balanced_cuts(costs, points)
    else:
        if isinstance(points, int | str):
            raise TypeError(f"points must be a list of block names or a number, got {points!r}")
        starts = []
        for point in points:
            if point not in names:
                raise ValueError(
                    f"split point {point!r} names no block of this {model.config.model_type} "
                    f"model; its blocks are {prefix}.0 .. {prefix}.{n - 1}"
                )
            index = names.index(point)
            if index == 0 or (starts and index <= starts[-1]):
                raise ValueError(
                    f"split point {point!r} would leave a stage without blocks: list points "
                    f"after {prefix}.0, in order, each once"
                )
            starts.append(index)
    bounds = [0, *starts, n]
    num_stages = len(bounds) - 1
    tied = tied_names(model)
    if tied is not None and num_stages > 1:
        if untie:
            untie_embeddings(model)
        else:  # two copies, declared tied: the pipeline adds their gradients at each step
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    stages: list[Any] = [
        HFStage(model, range(a, b), first=s == 0, last=s == num_stages - 1)
        for s, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
    if tied is not None and num_stages > 1 and not untie:
        stages[-1].tied_parameters = {tied[1]: tied[0]}
    # on meta: the head's own copy starts as the embedding (as the clone above would)
    remember(stages, model, {tied[1]: tied[0]} if tied is not None and num_stages > 1 else None)
    return stages


def split_balance(path: str, num_stages: int) -> dict[str, Any]:
    """The blocks per stage of ``split(model, num_stages)`` and the estimated balance of their
    compute (lightest / heaviest): the parameters outside embeddings, each one multiply-add per
    token (an embedding is a lookup; attention's T^2 term is left out). Built on a meta model,
    so nothing is allocated whatever the model's size."""
    transformers = require_transformers()
    config = transformers.AutoConfig.from_pretrained(model_folder(path), local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    stages = split_hf(model, num_stages)
    costs = [compute_cost(stage) for stage in stages]
    ids = [getattr(stage, "layer_ids") for stage in stages]  # noqa: B009
    return {
        "layers": [f"{i[0]}-{i[-1]}" for i in ids],
        "balance": min(costs) / max(costs),
        "measure": "compute",
    }
