"""A Hugging Face causal LM's stages: a slice of its blocks under the model's own names, with
what is cheaper to recompute than to send (positions, rotary tables, the attention masks)
recomputed per stage; each layer gets its own attention type's mask (full, sliding window,
chunked) as in the model's forward (see ``nobubble.model.hf`` for the support as a whole)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _layers(blocks: nn.ModuleList, ids: Sequence[int]) -> nn.ModuleList:
    """The blocks ``ids`` under their indices in the model (names stay the model's)."""
    out = nn.ModuleList()
    for i in ids:
        out.add_module(str(i), blocks[i])
    return out


class _Holder(nn.Module):
    """A plain container that gives its children the model's attribute path."""


_MASK_MAKERS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}


def attention_types(config: Any) -> list[str]:
    """Each layer's attention type, as the model's own forward picks its mask: the config's
    ``layer_types`` where it has them (Qwen2 and Qwen3 derive them from ``use_sliding_window``
    and ``max_window_layers``), else one type for all, sliding where the config sets a
    ``sliding_window`` (Mistral) and full otherwise."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is not None:
        types = list(types)
        unknown = sorted(set(types) - set(_MASK_MAKERS))
        if unknown:
            raise ValueError(
                f"{config.model_type} config: layer_types has {unknown}, which nobubble's "
                f"stages cannot mask; supported: {sorted(_MASK_MAKERS)}"
            )
        return types[:n]
    sliding = getattr(config, "sliding_window", None) is not None
    return ["sliding_attention" if sliding else "full_attention"] * n


def _masks(config: Any, kinds: set[str], hidden: torch.Tensor, positions: torch.Tensor) -> Any:
    """One mask per attention type among ``kinds``, built as the model's forward builds it."""
    from transformers import masking_utils

    return {
        kind: getattr(masking_utils, _MASK_MAKERS[kind])(
            config=config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        for kind in sorted(kinds)
    }


class LlamaStage(nn.Module):
    """Layers ``layer_ids`` of a Llama-family model, with the embedding on the first stage and
    the final norm and head on the last; the forward is ``LlamaModel.forward``'s, cut."""

    model: Any
    lm_head: Any

    def __init__(self, model: Any, layer_ids: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.config, self.first, self.last = model.config, first, last
        self.layer_ids = tuple(layer_ids)
        types = attention_types(model.config)
        self.layer_kinds = tuple(types[i] for i in self.layer_ids)
        inner = _Holder()
        if first:
            inner.embed_tokens = model.model.embed_tokens
        inner.layers = _layers(model.model.layers, layer_ids)
        if last:
            inner.norm = model.model.norm
        inner.rotary_emb = model.model.rotary_emb  # buffers only: recomputed per stage
        self.model = inner
        if last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x  # (B, T, D)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks = _masks(self.config, set(self.layer_kinds), h, positions)
        rope = self.model.rotary_emb(h, position_ids=positions)
        for layer, kind in zip(self.model.layers, self.layer_kinds, strict=True):
            h = layer(
                h, attention_mask=masks[kind], position_embeddings=rope, position_ids=positions
            )
        return self.lm_head(self.model.norm(h)) if self.last else h

    def extra_repr(self) -> str:
        return f"layers={self.layer_ids}, first={self.first}, last={self.last}"


class GPT2Stage(nn.Module):
    """Blocks ``layer_ids`` of a GPT-2, with the token and position embeddings on the first stage
    and the final norm and head on the last; the forward is ``GPT2Model.forward``'s, cut."""

    transformer: Any
    lm_head: Any

    def __init__(self, model: Any, layer_ids: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.config, self.first, self.last = model.config, first, last
        self.layer_ids = tuple(layer_ids)
        inner = _Holder()
        if first:
            inner.wte, inner.wpe, inner.drop = (
                model.transformer.wte,
                model.transformer.wpe,
                model.transformer.drop,
            )
        inner.h = _layers(model.transformer.h, layer_ids)
        if last:
            inner.ln_f = model.transformer.ln_f
        self.transformer = inner
        if last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.first:
            embeds = t.wte(x)
            h = t.drop(embeds + t.wpe(positions))
        else:
            h = x
        mask = _masks(self.config, {"full_attention"}, h, positions)["full_attention"]
        for block in t.h:
            h = block(h, None, mask, position_ids=positions)
        return self.lm_head(t.ln_f(h)) if self.last else h

    def extra_repr(self) -> str:
        return f"layers={self.layer_ids}, first={self.first}, last={self.last}"
