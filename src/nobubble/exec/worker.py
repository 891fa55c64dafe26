"""The stage worker: one stage's module, its weight versions, gradients and optimizer step.

It knows nothing about other stages or transports: the interpreter hands it inputs and ships its
outputs. Forward reads the weight version the ledger names; backward accumulates the averaged
gradient into the master parameters' ``.grad``; step applies the batch (clip, delay correction,
optimizer) and creates the next version.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call

from nobubble.exec.versions import WeightVersions
from nobubble.ir import Schedule
from nobubble.ledger import StageLedger
from nobubble.model import StageModule
from nobubble.optim import (
    DelayCorrection,
    StageOptimizer,
    clip_coefficient,
    grad_sq_norm,
    grads_finite,
    scale_grads_,
)

Batch = tuple[torch.Tensor, torch.Tensor]


def expect_device(tensor: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """``tensor``, after checking it lives on the stage's device (a cheap comparison that turns
    a forgotten ``.to(device)`` into an error naming the tensor, on any machine)."""
    if tensor.device != device:
        raise RuntimeError(f"{what} is on {tensor.device}, but the stage runs on {device}")
    return tensor


def misplaced(tree: Any, device: torch.device, path: str = "state") -> list[str]:
    """Paths of the tensors of a nested dict/list/tuple that are not on ``device``."""
    if isinstance(tree, torch.Tensor):
        return [f"{path} ({tree.device})"] if tree.device != device else []
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in misplaced(v, device, f"{path}.{k}")]
    if isinstance(tree, list | tuple):
        return [p for i, v in enumerate(tree) for p in misplaced(v, device, f"{path}[{i}]")]
    return []


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of a nested dict/list/tuple moved to ``device`` (checkpoint state)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


@dataclass
class Saved:
    """What a forward keeps for its backward."""

    version: int
    weights: dict[str, torch.Tensor]  # the alias leaves the graph was built on
    inputs: torch.Tensor  # stage input: token ids on stage 0, a grad-requiring leaf elsewhere
    output: torch.Tensor | None  # None in recompute mode (the graph is rebuilt at backward)
    activation_bytes: int  # autograd's saved tensors (the stage input alone when recomputing)


def accumulate_grads(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    held: Sequence[torch.Tensor | None] = (),
) -> None:
    """Add one micro-batch's weight gradients ``grads`` into ``params``' ``.grad``.

    A parameter without ``.grad`` adopts autograd's result without a copy (as autograd's own
    accumulation does), unless that tensor may be shared: a view, a storage of ``held`` (the
    incoming gradient, a transport buffer the next receive overwrites; the input gradient, which
    the transport sends or hands on), or a storage already adopted by another parameter; those
    are copied, so a later in-place accumulation never changes a tensor someone else reads.
    """
    taken = {t.untyped_storage().data_ptr() for t in held if t is not None}
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if p.grad is not None:
                p.grad.add_(g)
                continue
            ptr = g.untyped_storage().data_ptr()
            owned = not g._is_view() and ptr not in taken
            if owned and g.dtype == p.dtype and g.stride() == p.stride():
                p.grad = g
            else:
                p.grad = g.to(p.dtype).clone()
            taken.add(ptr)


class StageWorker:
    def __init__(
        self,
        module: StageModule,
        schedule: Schedule,
        ledger: StageLedger,
        optimizer: StageOptimizer,
        correction: DelayCorrection,
        batch_fn: Callable[[int], Batch],
        lr_fn: Callable[[int], float],
        clip_norm: float | None = None,
        autocast_dtype: torch.dtype | None = None,
        recompute: bool = False,
    ) -> None:
        self.module, self.schedule, self.ledger = module, schedule, ledger
        self.stage = module.stage
        self.optimizer, self.correction = optimizer, correction
        self.batch_fn, self.lr_fn, self.clip_norm = batch_fn, lr_fn, clip_norm
        self.autocast_dtype, self.recompute = autocast_dtype, recompute
        self.named = list(module.named_parameters())
        # the stage's declared device: inputs, state and buffers must all live there
        self.device = self.named[0][1].device
        self.versions = WeightVersions(self.named, schedule, ledger)
        self.saved: dict[int, Saved] = {}
        self.backwards_in_batch = 0
        # micro-batch -> loss (last stage only), kept as a device tensor until a drain point reads
        # it: a float() per micro-batch would stall a GPU's queue once per micro-batch
        self.losses: dict[int, torch.Tensor] = {}
        self.peak_saved = 0
        self.peak_activation_bytes = 0
        self.grad_norms: dict[int, float] = {}  # step -> gradient norm before clipping

    # ----- forward -------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = self.named[0][1].device.type
        return torch.autocast(device_type=device, dtype=self.autocast_dtype)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def _run(self, version: int, inputs: torch.Tensor, m: int) -> torch.Tensor:
        weights = self.versions.get(version)
        targets = None
        if self.module.is_last:
            targets = expect_device(self._to_device(self.batch_fn(m)[1]), self.device, "targets")
        with self.autocast(), self._count_saved(weights):
            out = functional_call(self.module, weights, (inputs,), {"targets": targets})
        if self.module.is_last:
            self.losses[m] = out.detach()
            out = out / self.schedule.num_microbatches  # the batch loss is the micro-batch mean
        return out

    def _count_saved(self, weights: dict[str, torch.Tensor]) -> Any:
        """Measure the activation bytes autograd saves for backward (weights excluded).

        Unique storages are counted once; the count lands in ``self._saved_bytes``.
        """
        weight_storages = {w.untyped_storage().data_ptr() for w in weights.values()}
        seen: set[int] = set()
        self._saved_bytes = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in weight_storages and ptr not in seen:
                seen.add(ptr)
                self._saved_bytes += storage.nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def forward(self, m: int, received: torch.Tensor | None) -> torch.Tensor | None:
        """Run micro-batch m; return the activation to send on (None on the last stage)."""
        version = self.ledger.fwd_version[m]
        if self.module.is_first:
            inputs = self._to_device(self.batch_fn(m)[0])
        else:
            assert received is not None, f"stage {self.stage} got no activation for {m}"
            inputs = received.detach().requires_grad_(True)
        expect_device(inputs, self.device, f"the input of micro-batch {m}")
        if self.recompute:  # keep only the stage input; the graph is rebuilt at backward
            with torch.no_grad():
                out = self._run(version, inputs, m)
            saved_out, nbytes = None, inputs.numel() * inputs.element_size()
        else:
            out = self._run(version, inputs, m)
            saved_out, nbytes = out, self._saved_bytes
        self.saved[m] = Saved(version, self.versions.get(version), inputs, saved_out, nbytes)
        self._track_memory()
        self.versions.consumed(version)
        return None if self.module.is_last else out.detach()

    def _track_memory(self) -> None:
        self.peak_saved = max(self.peak_saved, len(self.saved))
        held = sum(s.activation_bytes for s in self.saved.values())
        self.peak_activation_bytes = max(self.peak_activation_bytes, held)

    # ----- backward ------------------------------------------------------------------------
    def backward(self, m: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of micro-batch m; return the gradient for the previous stage (or None)."""
        saved = self.saved.pop(m)
        version = self.ledger.bwd_version[m]
        if self.recompute:  # rebuild the graph with the weights current now (live weights)
            weights = self.versions.get(version)
            out = self._run(version, saved.inputs, m)
        else:
            # Stashed rules: the forward's aliases hold the stash. Live rules: the aliases share
            # the master's storage, so the saved graph reads the weights as updated since.
            assert saved.output is not None
            weights, out = saved.weights, saved.output
        if grad_out is not None:
            expect_device(grad_out, self.device, f"the gradient of micro-batch {m}")
        leaves = list(weights.values())
        wants_input = not self.module.is_first
        targets = ([saved.inputs] if wants_input else []) + leaves
        grads = torch.autograd.grad(out, targets, grad_outputs=grad_out)
        grad_in = grads[0] if wants_input else None
        params = [p for _, p in self.named]
        accumulate_grads(params, grads[len(grads) - len(leaves) :], (grad_out, grad_in))
        if self.schedule.backward_rule == "stashed":
            self.versions.consumed(version)
        self.backwards_in_batch += 1
        return grad_in

    def pop_losses(self, micro_batches: range) -> list[float]:
        """The losses of ``micro_batches`` as floats (one host sync for all of them)."""
        values = torch.stack([self.losses.pop(m) for m in micro_batches]).float().cpu()
        return values.tolist()

    @property
    def batch_complete(self) -> bool:
        return self.backwards_in_batch == self.schedule.num_microbatches

    def grad_sq_norm(self) -> torch.Tensor:
        return grad_sq_norm(p for _, p in self.named)

    # ----- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything this stage needs to continue from a drain point."""
        assert not self.saved and self.backwards_in_batch == 0, "checkpoint only at a drain point"
        return {
            "stage": self.stage,
            "module": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "correction": self.correction.state_dict(),
            "versions": self.versions.state_dict(),
            "peak_saved": self.peak_saved,
            "peak_activation_bytes": self.peak_activation_bytes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["stage"] != self.stage:
            raise ValueError(
                f"checkpoint part of stage {state['stage']} given to stage {self.stage}"
            )
        state = to_device(state, self.device)  # EF buffers and stashed versions included
        with torch.no_grad():
            for name, p in self.named:
                p.copy_(state["module"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.correction.load_state_dict(state["correction"])
        stashed = self.schedule.backward_rule == "stashed"
        first = state["versions"]["current"] * self.schedule.num_microbatches
        self.versions.load_state_dict(state["versions"], self.ledger, stashed, first)
        self.peak_saved = state["peak_saved"]
        self.peak_activation_bytes = state["peak_activation_bytes"]

    # ----- step ----------------------------------------------------------------------------
    def step(self, step: int, total_sq_norm: torch.Tensor | None = None) -> None:
        """Apply batch ``step - 1``: lr, clipping, correction and optimizer, new version."""
        assert self.batch_complete, f"stage {self.stage}: step {step} before its batch finished"
        params: list[torch.Tensor] = [p for _, p in self.named]
        if not grads_finite(params):
            raise FloatingPointError(
                f"stage {self.stage}, step {step}: non-finite gradients; lower --lr, enable "
                "clipping (--clip 1.0) or train in fp32 (--dtype fp32)"
            )
        norm = math.sqrt(float(self.grad_sq_norm() if total_sq_norm is None else total_sq_norm))
        self.grad_norms[step] = norm
        if self.clip_norm is not None:
            scale_grads_(params, clip_coefficient(norm, self.clip_norm))
        self.optimizer.set_lr(self.lr_fn(step - 1))
        self.versions.before_update()
        self.correction.apply(params, self.optimizer.step)
        self.optimizer.zero_grad(set_to_none=True)
        self.versions.after_update()
        self.backwards_in_batch = 0
