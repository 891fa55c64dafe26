"""Replaying a model's own init over the whole model with only some tensors real.

``DrawAside`` makes every random draw into a meta tensor on the CPU, into a view of one reused
scratch buffer, so the generator advances exactly as it would for a real tensor; ``own_init``
is the call that initializes a model as its normal build does (docs in
``nobubble.api.materializing``): transformers' construction and ``initialize_weights`` for a
Hugging Face model, ``init_weights`` for the internal GPT, ``reset_parameters`` in
construction order for torch.nn layers, or a user's ``init``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

SEEDED = torch.Tag.nondeterministic_seeded  # the ops that draw from a generator

Init = Callable[[nn.Module], Any]


# ----- random draws into meta tensors, made on the side ----------------------------------------
def _span(x: torch.Tensor) -> int:
    """Elements of storage a tensor of ``x``'s sizes and strides reaches."""
    if x.numel() == 0:
        return 0
    return 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride(), strict=True)
    )


class DrawAside(TorchDispatchMode):
    """A random op on a meta tensor (or creating one) also runs on the CPU on scratch tensors of
    the same shapes and strides, so the generator it reads advances as it would for a real
    tensor. The scratch tensors are views of one buffer, reused from draw to draw and grown to
    the largest: thousands of draws of megabytes each would otherwise leave the allocator's
    heap fragmented, its freed holes still resident."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def _scratch(self, metas: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        align = 64
        sizes = [-(-_span(t) * t.element_size() // align) * align for t in metas]
        if sum(sizes) > self.buffer.numel():
            self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        views, offset = {}, 0
        for t, size in zip(metas, sizes, strict=True):
            flat = self.buffer[offset : offset + _span(t) * t.element_size()].view(t.dtype)
            views[id(t)] = flat.as_strided(t.shape, t.stride())
            offset += size
        return views

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if SEEDED in func.tags:
            device = kwargs.get("device")
            creates_meta = device is not None and torch.device(device).type == "meta"
            leaves = pytree.tree_leaves((args, kwargs))
            metas = [a for a in leaves if isinstance(a, torch.Tensor) and a.is_meta]
            if creates_meta or metas:
                views = self._scratch(metas)
                args_cpu, kwargs_cpu = pytree.tree_map(
                    lambda x: views.get(id(x), x) if isinstance(x, torch.Tensor) else x,
                    (args, kwargs),
                )
                if creates_meta:
                    kwargs_cpu["device"] = torch.device("cpu")
                func(*args_cpu, **kwargs_cpu)
        return func(*args, **kwargs)


# ----- the model's own init ---------------------------------------------------------------------
def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        yield from _post_order(child, seen)
    yield module


def _check_generic(model: nn.Module) -> None:
    for name, module in model.named_modules():
        own = [n for n, p in module._parameters.items() if p is not None]
        if own and not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"module {name or type(model).__name__!r} ({type(module).__name__}) holds "
                f"parameters ({', '.join(own)}) that no reset_parameters() draws, so where its "
                "init draws in the random stream is unknown: give materialize (or Pipeline) "
                "init=(a function that initializes the whole model) or weights=(a safetensors "
                "file or folder)"
            )


def _generic_init(model: nn.Module) -> None:
    for module in _post_order(model, set()):
        has_own = any(
            t is not None for t in (*module._parameters.values(), *module._buffers.values())
        )
        reset = getattr(module, "reset_parameters", None)
        if has_own and callable(reset):
            reset()


def _hf_init(model: Any) -> None:
    """Re-run the model's construction on meta (its layers' draws when built); at each
    ``post_init`` run transformers' ``initialize_weights`` on the same submodule of ``model``."""
    from transformers import PreTrainedModel

    targets: list[Any] = [m for m in _post_order(model, set()) if isinstance(m, PreTrainedModel)]
    calls: list[Any] = []

    def init_weights(built: Any) -> None:
        k = len(calls)
        if k >= len(targets) or type(targets[k]) is not type(built):
            raise ValueError(
                f"cannot replay the init of {type(model).__name__}: its construction does not "
                "post_init its submodels in module order; give weights= or init="
            )
        calls.append(built)
        with torch.device("cpu"):  # values computed inside (rotary tables) are real
            targets[k].initialize_weights()

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    shared = head.weight if head is not None and head.weight is embed.weight else None
    if shared is not None:  # built normally, the head is tied only after its own draws
        head.weight = nn.Parameter(torch.empty_like(shared, device="meta"))
    dtype = torch.get_default_dtype()
    floating = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    original = PreTrainedModel.init_weights
    PreTrainedModel.init_weights = init_weights  # type: ignore[method-assign]
    try:
        torch.set_default_dtype(floating[0] if floating else dtype)
        with torch.device("meta"):
            type(model)(copy.deepcopy(model.config))
    finally:
        PreTrainedModel.init_weights = original  # type: ignore[method-assign]
        torch.set_default_dtype(dtype)
        if shared is not None:
            head.weight = shared
        for module in model.modules():
            module.__dict__.pop("_is_hf_initialized", None)
    if len(calls) != len(targets):
        raise ValueError(f"cannot replay the init of {type(model).__name__}: give weights=")


def own_init(model: nn.Module, seed: int | None, init: Init | None) -> Callable[[], None]:
    """The call that initializes ``model`` as its normal build would."""
    from nobubble.model.gpt import GPT, init_weights
    from nobubble.model.hf import is_hf_model

    if isinstance(model, GPT) and init is None:
        assert seed is not None
        return lambda: init_weights(model, seed)  # its own generator: torch's RNG untouched
    if init is None and not is_hf_model(model):
        _check_generic(model)
    rule: Init = init or (_hf_init if is_hf_model(model) else _generic_init)

    def run() -> None:
        if seed is not None:
            torch.manual_seed(seed)  # as the normal build: torch.manual_seed(seed), then build
        rule(model)

    return run
