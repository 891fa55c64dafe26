"""The stage side of the torch peers (``torch_peer``): a nobubble stage module under torch's
``PipelineStage``, what it holds in activations, and when it computes.

- ``ActivationMeter`` counts autograd's saved tensors per micro-batch in flight, the way
  nobubble's worker does, one meter per rank;
- ``PeerStage`` wraps a stage module (the internal GPT's or a Hugging Face model's) under the
  same parameter names, the last one returning logits;
- ``TimedStage`` is a ``PipelineStage`` that notes each compute action's span (forward, fused or
  input-gradient backward, weight gradient), as nobubble's interpreter does, so that a torch
  schedule's bubble is measured with nobubble's definition (``measured_utilization``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from nobubble.core.ir import Action, B, F, I, W
from nobubble.model.gpt import lm_loss

Span = tuple[Action, float, float]  # (action, start, end), wall-clock seconds


class ActivationMeter:
    """Bytes autograd saves for backward per micro-batch (weights excluded), held until the
    micro-batch's backward starts: nobubble's worker measures the same (``_count_saved``).
    One meter per rank, shared by the rank's stages: its peaks are the rank's."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weight_storages = {w.untyped_storage().data_ptr() for w in weights}
        # bytes per (stage, micro-batch) forward in flight, keyed by opening order: a rank with
        # several stages releases them out of order (the later stage's backward comes first)
        self.held: dict[int, int] = {}
        self.opened = 0
        self.peak_inflight = 0
        self.peak_bytes = 0

    def saving(self, new: bool) -> tuple[int, contextlib.AbstractContextManager[Any]]:
        """Count what autograd saves inside; ``new`` opens a micro-batch, else adds to the
        newest (the loss, right after the last stage's forward). Returns the entry's key."""
        if new:
            self.opened += 1
            self.held[self.opened] = 0
        key = self.opened
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.weight_storages and ptr not in seen and key in self.held:
                seen.add(ptr)
                # min: a micro-batch split from the whole batch counts its own bytes only
                self.held[key] += min(t.untyped_storage().nbytes(), t.numel() * t.element_size())
                self._peaks()
            return t.detach()  # never t itself: see StageWorker._count_saved (a graph cycle)

        return key, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def reset(self) -> None:
        """Forget everything so far. Called after the first step: torch's shape inference runs
        one more forward on stage 0 whose backward never comes."""
        self.held, self.peak_inflight, self.peak_bytes = {}, 0, 0

    def _peaks(self) -> None:
        self.peak_inflight = max(self.peak_inflight, len(self.held))
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))

    def releaser(self, key: int) -> Callable[[torch.Tensor], None]:
        """A hook for a stage output: its gradient arrives when the micro-batch's backward
        (fused, or the input-gradient half of a split one) starts."""

        def release(grad: torch.Tensor) -> None:
            self.held.pop(key, None)

        return release


class PeerStage(nn.Module):
    """A stage module (the internal GPT's or a Hugging Face model's) under torch's schedules,
    its parameters under the same names; the last stage returns logits (torch applies the
    loss), the others their hidden states in fp32."""

    def __init__(
        self,
        stage: nn.Module,
        is_last: bool,
        meter: ActivationMeter,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, child in stage.named_children():  # the same parameter names as the stage's
            self.add_module(name, child)
        for name, param in stage.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.inner = [stage]  # a list: its modules are registered above, under their names
        self.is_last, self.autocast_dtype = is_last, autocast_dtype
        self.meter = meter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        autocast = torch.autocast(
            x.device.type,
            dtype=self.autocast_dtype or torch.bfloat16,
            enabled=self.autocast_dtype is not None,
        )
        # torch's shape inference runs one forward first (meta tensors past stage 0): not a
        # micro-batch; stage 0's, on real ids, is dropped by meter.reset() after step 1
        counted = not x.is_meta and torch.is_grad_enabled()
        key, meter = self.meter.saving(new=True) if counted else (0, contextlib.nullcontext())
        with autocast, meter:
            out = self.inner[0](x)  # (B, T, V) logits or (B, T, D) hidden states
            out = out if self.is_last else out.float()
        if counted and out.requires_grad:
            out.register_hook(self.meter.releaser(key))
        return out

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """lm_loss, its saved tensors counted with the micro-batch's (as in StageModule)."""
        if logits.is_meta or not torch.is_grad_enabled():
            return lm_loss(logits, targets)
        with self.meter.saving(new=False)[1]:
            return lm_loss(logits, targets)


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that appends (action, start, end) to ``spans`` for each forward and
    backward it computes; micro-batch numbers are global (``first`` is the current batch's
    first, set by the caller before each ``step``). Wall-clock spans: on CPU only (a GPU's
    kernels would need events, as nobubble's CudaClock has)."""

    def __init__(self, *args: Any, spans: list[Span], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spans, self.first = spans, 0

    def _note(self, kind: str, chunk: int, start: float) -> None:
        self.spans.append((Action(self.stage_index, kind, self.first + chunk), start, time.time()))

    def loss_in_span(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``loss_fn`` whose time joins the forward span just noted: torch computes the loss
        right after ``forward_one_chunk``, nobubble's last stage inside its forward."""

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            value = loss_fn(logits, targets)
            if self.spans and not logits.is_meta:
                action, start, _ = self.spans[-1]
                self.spans[-1] = (action, start, time.time())
            return value

        return loss

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        start = time.time()
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self._note(F, fwd_chunk_id, start)
        return out

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: Any = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        start = time.time()
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self._note(B if full_backward else I, bwd_chunk_id, start)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        start = time.time()
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self._note(W, bwd_chunk_id, start)
