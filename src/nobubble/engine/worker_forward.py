"""The forward side of a stage worker (``WorkerForward``): the weights of the ledger's version
for a micro-batch, the stage run under them (``functional_call``, autocast), the last stage's
loss, the boundary checked against the agreed spec, and the saved-activation accounting."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.func import functional_call

from nobubble.engine.devices import expect_device, tensors_of
from nobubble.engine.saved import Saved
from nobubble.engine.tree import (
    BoundarySpec,
    Tree,
    call_args,
    detached,
    moved,
    non_tensor_leaves,
)
from nobubble.engine.worker_step import WorkerStep


class WorkerForward(WorkerStep):
    def _materialized(
        self, leaves: Sequence[torch.Tensor], version: int
    ) -> contextlib.AbstractContextManager[Any]:
        """Around an action on a sharded stage: ``leaves`` hold ``version``'s whole weights."""
        if self.sharded is None:
            return contextlib.nullcontext()
        return self.sharded.materialized(self.versions, leaves, version)

    # ----- forward -------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = self.named[0][1].device.type
        return torch.autocast(device_type=device, dtype=self.autocast_dtype)

    def _to_device(self, value: Tree) -> Tree:
        return moved(value, self.device)

    def _weights(self, m: int, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        """The leaves micro-batch m's graph is built on, ``key`` = (version, tau) being the
        weights it reads (tau > 0: a prediction, ``engine.versions``): the master parameters
        themselves when the forward reads the current version and the stage takes no step
        before m's gradient is done (every micro-batch of a synchronous schedule), else the
        version's aliases or the prediction's own tensors (on a sharded stage always its
        leaves, filled around each action)."""
        ledger, (version, tau) = self.ledger, key
        if (
            self.sharded is None
            and tau == 0
            and version == self.versions.current
            and ledger.fwd_current[m] == version
            and ledger.applied_step[m] == version + 1
        ):
            return self.master
        return self.versions.get(key)

    def _run(
        self, weights: dict[str, torch.Tensor], inputs: Tree, m: int, record: bool = True
    ) -> Tree:
        args, kwargs = call_args(inputs)
        with self.autocast(), self._count_saved(weights):
            if weights is self.master:  # the module's own parameters: no reparametrization
                out = self.module(*args, **kwargs)
            else:
                out = functional_call(self.module, weights, args, kwargs)
            if not self.is_last:
                return out
            targets = self._to_device(self.batch_fn(m)[1])
            for t in tensors_of(targets):
                expect_device(t, self.device, "targets")
            assert self.loss_fn is not None
            loss = self.loss_fn(out, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + ": reduce the loss of the micro-batch to one number (e.g. its mean)"
            )
        if record:  # the loss of the forward; a recomputing backward does not report again
            self.losses[m] = loss.detach()
        return loss / self.schedule.num_microbatches  # the batch loss is the micro-batch mean

    def _count_saved(self, weights: dict[str, torch.Tensor]) -> Any:
        """Measure the activation bytes autograd saves for backward (weights excluded).

        Unique storages are counted once; the count lands in ``self._saved_bytes``. The hook
        keeps a detached alias, never ``t`` itself: when an op saves its own output, ``t``'s
        grad_fn is the node that saves it, and that cycle (node -> saved tensor -> node) is
        broken only by a backward that frees the graph. The split backward retains the graph
        (I, then W), so every micro-batch's activations would stay alive for good.
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
            return t.detach()

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _check_boundary(
        self, value: Tree, what: str, m: int, agreed: BoundarySpec | None
    ) -> BoundarySpec:
        """The spec of ``value``, checked against the one agreed at the first micro-batch."""
        strays = non_tensor_leaves(value)
        if strays:
            raise TypeError(
                f"stage {self.stage} {what} for micro-batch {m} holds {', '.join(strays)}: a "
                "stage boundary carries tensors only (a tensor, or a tuple or dict of tensors); "
                "recompute other values inside the next stage"
            )
        spec = BoundarySpec.of(value)
        if agreed is not None and spec != agreed:
            raise ValueError(
                f"stage {self.stage} {what} for micro-batch {m} is {spec.describe()}, but the "
                f"first micro-batch agreed on {agreed.describe()}: every micro-batch must keep "
                "the shapes and dtypes of the first (equal batch sizes, fixed sequence length)"
            )
        return spec

    def forward(self, m: int, received: Tree | None) -> Tree | None:
        """Run micro-batch m; return the activation to send on (None on the last stage)."""
        version = self.ledger.fwd_version[m]
        key = self.versions.key(m)
        weights = self._weights(m, key)
        if self.is_first:
            inputs = self._to_device(self.batch_fn(m)[0])
        else:
            assert received is not None, f"stage {self.stage} got no activation for {m}"
            inputs = detached(received, requires_grad=True)
        for t in tensors_of(inputs):
            expect_device(t, self.device, f"the input of micro-batch {m}")
        self.in_spec = self._check_boundary(inputs, "input", m, self.in_spec)
        if self.recompute:  # keep only the stage input; the graph is rebuilt at backward
            with torch.no_grad(), self._materialized(list(weights.values()), version):
                out = self._run(weights, inputs, m)
            saved_out = None
            nbytes = sum(t.numel() * t.element_size() for t in tensors_of(inputs))
        else:
            with self._materialized(list(weights.values()), version):
                out = self._run(weights, inputs, m)
            saved_out, nbytes = out, self._saved_bytes
        self.saved[m] = Saved(version, weights, inputs, saved_out, nbytes)
        self._track_memory()
        self.versions.consumed(key)
        self.forwards += 1
        if self.is_last:
            return None
        self.out_spec = self._check_boundary(out, "output", m, self.out_spec)
        return detached(out, requires_grad=False)

    @torch.no_grad()
    def infer(self, inputs: Tree, targets: Tree = None, outputs: bool = False) -> Tree:
        """A forward on the master weights for evaluation, outside the schedule: the stage's
        output, or on the last stage the loss of ``targets`` (its output with ``outputs``;
        nothing saved, no version read)."""
        inputs = self._to_device(inputs)
        args, kwargs = call_args(inputs)
        current = self.versions.current
        weights = self.master if self.sharded is None else self.versions.get((current, 0))
        with self.autocast(), self._materialized(list(weights.values()), current):
            if weights is self.master:
                out = self.module(*args, **kwargs)
            else:
                out = functional_call(self.module, weights, args, kwargs)
            if not self.is_last or outputs:
                return out
            assert self.loss_fn is not None
            return self.loss_fn(out, self._to_device(targets))

    def _track_memory(self) -> None:
        """Micro-batches held for backward: saved for B or I, or waiting for their W."""
        self.peak_saved = max(self.peak_saved, len(self.saved) + len(self.pending))
        held = sum(s.activation_bytes for s in self.saved.values())
        held += sum(p.activation_bytes for p in self.pending.values())
        self.peak_activation_bytes = max(self.peak_activation_bytes, held)


__all__ = [
    "WorkerForward",
]
