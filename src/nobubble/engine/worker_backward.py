"""The backward side of a stage worker (``WorkerBackward``): the fused backward (B) and the split
one (I, then W) of a micro-batch, their gradients added into the masters' ``.grad``, and the
data-parallel all-reduce launched by the batch's last backward."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from nobubble.engine.devices import expect_device
from nobubble.engine.saved import Pending, Saved, accumulate_grads, no_work
from nobubble.engine.split_backward import input_backward, weight_backward
from nobubble.engine.tree import (
    Tree,
    differentiable,
    pack_grads,
    unpack_grads,
)
from nobubble.engine.worker_forward import WorkerForward


class WorkerBackward(WorkerForward):
    # ----- backward ------------------------------------------------------------------------
    def _graph(
        self, m: int, saved: Saved, grad_out: Tree | None
    ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """The weights, outputs and output gradients micro-batch m's backward starts from."""
        version = self.ledger.bwd_version[m]
        if self.recompute:  # rebuild the graph with the weights current now (live weights)
            weights = self._weights(m, (version, 0))
            out = self._run(weights, saved.inputs, m, record=False)
        else:
            # Stashed rules: the forward's aliases hold the stash. Live rules: the aliases share
            # the master's storage, so the saved graph reads the weights as updated since.
            assert saved.output is not None
            weights, out = saved.weights, saved.output
        if self.is_last:
            return weights, [out], None
        assert grad_out is not None, f"stage {self.stage} got no gradient for {m}"
        grad_list = unpack_grads(grad_out)
        for g in grad_list:
            expect_device(g, self.device, f"the gradient of micro-batch {m}")
        return weights, differentiable(out), grad_list

    def backward(self, m: int, grad_out: Tree | None) -> Tree | None:
        """Backward of micro-batch m; return the gradient for the previous stage (or None)."""
        saved = self.saved.pop(m)
        with self._materialized(self._backward_leaves(m, saved), self.ledger.bwd_version[m]):
            weights, outputs, grad_outputs = self._graph(m, saved, grad_out)
            leaves = list(weights.values())
            input_leaves = [] if self.is_first else differentiable(saved.inputs)
            if self.reducer is None and self.sharded is None:
                grads_in = self._backward_into_grad(outputs, grad_outputs, input_leaves, leaves)
            else:
                with self._reducing(m, leaves) as done:
                    grads = torch.autograd.grad(
                        outputs,
                        input_leaves + leaves,
                        grad_outputs=grad_outputs,
                        materialize_grads=True,  # an input or weight the outputs do not use: 0
                    )
                grads_in = list(grads[: len(input_leaves)])
                held = [*(grad_outputs or []), *grads_in]
                self._accumulate(m, grads[len(input_leaves) :], held, done)
        self._backward_done(m)
        self.backwards_in_batch += 1
        return pack_grads(grads_in) if grads_in else None

    def _backward_into_grad(
        self,
        outputs: list[torch.Tensor],
        grad_outputs: list[torch.Tensor] | None,
        input_leaves: list[torch.Tensor],
        leaves: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The fused backward of a stage without dp or sharding: autograd adds each weight's
        gradient into the master's ``.grad`` as soon as it is computed (in place, as
        ``loss.backward()`` does), so a stage never holds a micro-batch's gradients beside the
        accumulated ones; a delayed version's leaves get the master's ``.grad`` lent for the
        call. Returns the input gradients; an input or weight the outputs do not use: zeros."""
        params = [p for _, p in self.named]
        lent = [leaf is not p for leaf, p in zip(leaves, params, strict=True)]
        for leaf, p, borrow in zip(leaves, params, lent, strict=True):
            if borrow:
                leaf.grad = p.grad
        for leaf in input_leaves:
            leaf.grad = None
        torch.autograd.backward(outputs, grad_tensors=grad_outputs, inputs=input_leaves + leaves)
        with torch.no_grad():
            for leaf, p, borrow in zip(leaves, params, lent, strict=True):
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(p)
                if borrow:
                    leaf.grad = None
                p.grad = grad
        grads_in = []
        for leaf in input_leaves:
            grads_in.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
            leaf.grad = None
        return grads_in

    def backward_input(self, m: int, grad_out: Tree | None) -> Tree | None:
        """I, the first half of a split backward: the gradient for the previous stage (None
        on the first stage); what W needs stays in ``pending`` (``engine/split_backward``)."""
        saved = self.saved.pop(m)
        with self._materialized(self._backward_leaves(m, saved), self.ledger.bwd_version[m]):
            weights, outputs, grad_outputs = self._graph(m, saved, grad_out)
            leaves = list(weights.values())
            input_leaves = [] if self.is_first else differentiable(saved.inputs)
            grads_in, work = input_backward(outputs, grad_outputs, input_leaves, leaves)
        held = [*(grad_outputs or []), *grads_in]  # what B's accumulation keeps apart too
        self.pending[m] = Pending(leaves, work, held, saved.activation_bytes)
        self._backward_done(m)
        return pack_grads(grads_in) if grads_in else None

    def backward_weight(self, m: int) -> None:
        """W, the second half: micro-batch m's weight gradients, accumulated as B's are."""
        pending = self.pending.pop(m)
        # one autograd call over the weight leaves (a stage without input gradient) launches
        # the dp buckets from inside as B does; W's per-group calls give a weight that several
        # groups reach only a partial gradient per call, so they launch when W returns
        whole = pending.work.whole is not None
        with (
            self._materialized(pending.weights, self.ledger.bwd_version[m]),
            self._reducing(m, pending.weights) if whole else no_work() as done,
        ):
            grads = weight_backward(pending.work, pending.weights)
        self._accumulate(m, grads, pending.held, done)
        self.backwards_in_batch += 1

    def _backward_leaves(self, m: int, saved: Saved) -> list[torch.Tensor]:
        """The leaves micro-batch m's backward differentiates: the forward's, or in recompute
        mode those of the version it recomputes at."""
        if self.recompute:
            return list(self._weights(m, (self.ledger.bwd_version[m], 0)).values())
        return list(saved.weights.values())

    def _last_of_batch(self) -> bool:
        """Whether the backward running now (B, or W of a split backward) completes the batch."""
        return self.backwards_in_batch + 1 == self.schedule.num_microbatches

    def _reducing(
        self, m: int, leaves: Sequence[torch.Tensor]
    ) -> contextlib.AbstractContextManager[set[int]]:
        """Around the autograd call of micro-batch m's weight gradients: with data parallelism,
        the batch's last backward launches the dp all-reduce bucket by bucket from inside, as
        gradients become final (``GradReducer.launching``); it yields the parameters whose
        gradients it accumulated already."""
        if self.reducer is None or not self._last_of_batch():
            return no_work()
        return self.reducer.launching(m // self.schedule.num_microbatches + 1, leaves)

    def _accumulate(
        self, m: int, grads: Sequence[torch.Tensor], held: Sequence[torch.Tensor], done: set[int]
    ) -> None:
        """Accumulate the weight gradients the dp hooks did not (``done``: all, or none); the
        batch's last backward then launches the buckets still waiting (weights it never
        reached)."""
        if self.sharded is not None:  # reduce-scattered into the sharded .grad right away
            self.sharded.accumulate(grads)
            return
        params = [p for _, p in self.named]
        rest = [i for i in range(len(params)) if i not in done]
        accumulate_grads([params[i] for i in rest], [grads[i] for i in rest], held)
        if self.reducer is not None and self._last_of_batch():
            self.reducer.launch_rest(m // self.schedule.num_microbatches + 1)

    def _backward_done(self, m: int) -> None:
        if self.schedule.backward_rule == "stashed":  # it read what its forward read
            self.versions.consumed(self.versions.key(m))


__all__ = [
    "WorkerBackward",
]
