"""A Hugging Face causal LM's stages: a slice of its blocks under the model's own names, with
what is cheaper to recompute than to send (positions, rotary tables, the attention masks)
recomputed per stage; each layer gets its own attention type's mask (full, sliding window,
chunked) and rotary table as in the model's forward (see ``nobubble.model.hf`` for the support
as a whole).

One stage class serves every family: a family is a ``Layout`` (where its parts live in its
``...ForCausalLM`` and what its forward does around the blocks). Everything inside a block
(norms, biases, query/key norms, partial rotary, parallel residuals, soft-capped attention) and
inside the embedding (Gemma's scaling by sqrt(hidden)) is the model's own modules, run as they
are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Layout:
    """Where a family's parts live in its ``...ForCausalLM`` (attribute names), and what its
    forward does around the blocks."""

    base: str = "model"  # the inner model: embeddings, blocks, final norm, rotary tables
    tokens: str = "embed_tokens"  # the token embedding (the one a tied head shares)
    positions: str | None = None  # a learned position embedding, added to the tokens'
    dropout: str | None = None  # dropout on the embeddings, before the first block
    blocks: str = "layers"
    norm: str = "norm"  # the final norm, before the head
    attention: str = "full"  # each layer's mask: "full", "window" (sliding_window for all
    # layers when set), "layer_types" (the config's list)
    rotary: str | None = "rotary_emb"  # the rotary tables, or None (learned positions)
    rope_per_type: bool = False  # one rotary table per attention type (Gemma 3)
    logit_softcap: bool = False  # the head's logits soft-capped: tanh(x / c) * c (Gemma 2, 3)
    stored_as: tuple[tuple[str, str], ...] = ()  # (module name, its name in weight files)


LAYOUTS: dict[str, Layout] = {
    "llama": Layout(),
    "mistral": Layout(attention="window"),
    "qwen2": Layout(attention="layer_types"),
    "qwen3": Layout(attention="layer_types"),
    "gemma": Layout(),
    "gemma2": Layout(attention="layer_types", logit_softcap=True),
    "gemma3_text": Layout(attention="layer_types", rope_per_type=True, logit_softcap=True),
    "phi3": Layout(attention="window"),
    "olmo2": Layout(),
    "gpt_neox": Layout(
        base="gpt_neox",
        tokens="embed_in",
        dropout="emb_dropout",
        norm="final_layer_norm",
        stored_as=(("lm_head.weight", "embed_out.weight"),),  # transformers saves its old name
    ),
    "gpt2": Layout(
        base="transformer",
        tokens="wte",
        positions="wpe",
        dropout="drop",
        blocks="h",
        norm="ln_f",
        rotary=None,
    ),
}


_MASK_MAKERS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}


def attention_types(config: Any) -> list[str]:
    """Each layer's attention type, as the family's own forward picks its mask: the config's
    ``layer_types`` where the family reads them (Qwen2 and Qwen3 derive them from
    ``use_sliding_window`` and ``max_window_layers``; Gemma 2 and 3 alternate), one sliding type
    for all where it reads ``sliding_window`` alone (Mistral, Phi-3), else full attention."""
    n = int(config.num_hidden_layers)
    reads = LAYOUTS[config.model_type].attention
    if reads == "layer_types":
        types = list(config.layer_types)
        unknown = sorted(set(types) - set(_MASK_MAKERS))
        if unknown:
            raise ValueError(
                f"{config.model_type} config: layer_types has {unknown}, which nobubble's "
                f"stages cannot mask; supported: {sorted(_MASK_MAKERS)}"
            )
        return types[:n]
    sliding = reads == "window" and getattr(config, "sliding_window", None) is not None
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


class HFStage(nn.Module):
    """Blocks ``layer_ids`` of a causal LM, with the embeddings on the first stage and the final
    norm and head on the last; the forward is the model's, cut at the stage's blocks."""

    def __init__(self, model: Any, layer_ids: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.config, self.first, self.last = model.config, first, last
        self.layout = layout = LAYOUTS[model.config.model_type]
        self.layer_ids = tuple(layer_ids)
        types = attention_types(model.config)
        self.layer_kinds = tuple(types[i] for i in self.layer_ids)
        base = getattr(model, layout.base)
        inner = _Holder()  # registered in the model's order: embeddings, blocks, norm, rotary
        for name in (layout.tokens, layout.positions, layout.dropout) if first else ():
            if name is not None:
                inner.add_module(name, getattr(base, name))
        inner.add_module(layout.blocks, _layers(getattr(base, layout.blocks), layer_ids))
        if last:
            inner.add_module(layout.norm, getattr(base, layout.norm))
        if layout.rotary is not None:  # buffers only: recomputed per stage
            inner.add_module(layout.rotary, getattr(base, layout.rotary))
        self.add_module(layout.base, inner)
        if last:
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout, inner = self.layout, getattr(self, self.layout.base)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        h = self._embed(inner, x, positions) if self.first else x  # (B, T, D)
        kinds = set(self.layer_kinds)
        masks = _masks(self.config, kinds, h, positions)
        ropes = self._rotary(inner, kinds, h, positions)
        for layer, kind in zip(getattr(inner, layout.blocks), self.layer_kinds, strict=True):
            rope = {} if ropes is None else {"position_embeddings": ropes[kind]}
            h = layer(h, attention_mask=masks[kind], position_ids=positions, **rope)
        if not self.last:
            return h
        logits = self.lm_head(getattr(inner, layout.norm)(h))
        cap = self.config.final_logit_softcapping if layout.logit_softcap else None
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _embed(self, inner: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        h = getattr(inner, layout.tokens)(x)
        if layout.positions is not None:
            h = h + getattr(inner, layout.positions)(positions)
        return h if layout.dropout is None else getattr(inner, layout.dropout)(h)

    def _rotary(
        self, inner: nn.Module, kinds: set[str], h: torch.Tensor, positions: torch.Tensor
    ) -> dict[str, Any] | None:
        """Each attention type's (cos, sin): one table for all, or one per type (Gemma 3)."""
        if self.layout.rotary is None:
            return None
        rotary = getattr(inner, self.layout.rotary)
        if self.layout.rope_per_type:
            return {kind: rotary(h, positions, kind) for kind in sorted(kinds)}
        table = rotary(h, position_ids=positions)
        return dict.fromkeys(kinds, table)

    def extra_repr(self) -> str:
        return f"layers={self.layer_ids}, first={self.first}, last={self.last}"
