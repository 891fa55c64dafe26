"""``TreeTransport``: the distributed transport for stage boundaries that are a tuple or dict of
tensors (one message, several tensors), tied pairs swapping gradients at the step's gather; its
strict and host-staged variants (``TRANSPORTS``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from nobubble.core.comm_ops import GATHER, Batch
from nobubble.core.ir import Action, F
from nobubble.core.placement import Placement
from nobubble.engine.ties import Tie, TieMeeting, tied_square
from nobubble.engine.tree import pack_grads, tensor_leaves, unpack_grads
from nobubble.runtime.distributed.staging import HostStaged
from nobubble.runtime.distributed.transport import DistTransport, StrictTransport
from nobubble.runtime.distributed.waits import Handle

MAX_LEAVES = 1024  # evaluation tags: one per boundary leaf of a micro-batch


def spec_of(value: Any) -> Spec:
    flat, treespec = pytree.tree_flatten(value)
    return pytree.treespec_dumps(treespec), [(tuple(t.shape), t.dtype) for t in flat]


class TreeTransport(DistTransport):
    """``DistTransport`` for boundaries of several tensors: a message is the list of its leaves,
    one point-to-point operation each, all in the batch the plan puts it in. ``in_specs`` are
    the boundaries this rank's stages receive from other ranks (by receiving stage),
    ``out_specs`` those they send to other ranks (by sending stage; their gradients come back
    with the floating leaves). A receive the plan posts before its consumer's turn keeps its
    leaves in ``leaves_in`` until the consumer takes them."""

    def __init__(
        self,
        batches: Sequence[Batch],
        in_specs: dict[int, Spec],
        out_specs: dict[int, Spec],
        device: torch.device,
        num_stages: int,
        start_position: int,
        timeout_s: float,
        ties: Sequence[Tie] = (),
        placement: Placement | None = None,
    ) -> None:
        super().__init__(
            batches, (), torch.float32, device, num_stages, start_position, timeout_s, placement
        )
        self.in_specs, self.out_specs = in_specs, out_specs
        self.ties = list(ties)  # the pipeline's tied pairs (engine/worker.py), for ``gather``
        self.tied_shares: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.leaves_out: dict[Action, list[torch.Tensor]] = {}  # handed over, not posted yet
        self.leaves_in: dict[Action, tuple[Handle, list[torch.Tensor]]] = {}  # receives posted
        self.in_trees = {s: pytree.treespec_loads(spec[0]) for s, spec in in_specs.items()}
        # the gradients coming back are those of the sending stage's floating output leaves
        self.grad_leaves = {
            s: [(shape, dtype) for shape, dtype in spec[1] if dtype.is_floating_point]
            for s, spec in out_specs.items()
        }

    def replan(self, batches: Sequence[Batch]) -> None:
        """A longer (or drained) schedule: the batches not posted yet come from its plan."""
        self.batches = list(batches)
        self.cursor = next(
            (k for k, b in enumerate(self.batches) if b.position >= self.position),
            len(self.batches),
        )

    def send(self, producer: Action, tensor: Any, dst_stage: int) -> None:
        leaves = tensor_leaves(tensor) if producer.kind == F else unpack_grads(tensor)
        self.leaves_out[producer] = [t.contiguous() for t in leaves]

    def _recv_buffers(self, message: Action) -> list[torch.Tensor]:
        if message.kind == F:  # stage s's output, the input of stage s+1 (on this rank)
            leaves = self.in_specs[message.stage + 1][1]
        else:  # the gradient of stage s's input, for stage s-1's output
            leaves = self.grad_leaves[message.stage - 1]
        return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in leaves]

    def _sent_tensors(self, message: Action) -> list[torch.Tensor]:
        handed = self.leaves_out.pop(message, None)
        assert handed is not None, f"plan sends {message}; nothing handed over"
        return handed

    def _keep_received(self, message: Action, handle: Handle, buffers: list[torch.Tensor]) -> None:
        self.leaves_in[message] = (handle, buffers)

    def flush(self) -> None:
        assert not self.leaves_out, f"handed over but not posted: {sorted(self.leaves_out)}"
        super().flush()

    def recv(self, producer: Action, dst_stage: int) -> Any:
        handle, leaves = self.leaves_in.pop(producer)
        self.peer_of_last_wait = peer = self.placement.rank_of(producer.stage)
        handle.wait(self.timeout_s, f"the receive of {producer} from rank {peer}")
        self.peer_of_last_wait = None
        self._received(producer)
        if producer.kind == F:
            return pytree.tree_unflatten(leaves, self.in_trees[dst_stage])
        return pack_grads(leaves)

    def contribute(self, step: int, stage: int, value: Any) -> None:
        if isinstance(value, tuple):  # tied parameters: (squared norm without them, their grads)
            self.tied_shares[step] = value
        else:
            super().contribute(step, stage, value)

    def gather(self, step: int, stage: int) -> TieMeeting:
        """The step's meeting with tied parameters, at the plan's gather (nothing else is in
        flight there): each pair's two ranks swap their gradients, the lower one computes the
        square of the sum, and every rank gathers every stage's norm and the pairs' squares.
        The arithmetic is the emulator's, so the result is bitwise the same."""
        batch = self._next_batch(self.position)
        assert batch is not None and batch.ops[0].kind == GATHER, f"plan has no gather at {step}"
        assert batch.ops[0].message.number == step, f"plan gathers {batch.ops[0]}, not step {step}"
        self.cursor += 1
        square, mine = self.tied_shares.pop(step)
        if self.reducer is not None:  # the averaged gradients' share (DistTransport._share)
            square, mine = self.reducer.share()
        grads = {(stage, name): g for name, g in mine.items()}
        ops = []
        for a, name_a, b, name_b in self.ties:
            if stage in (a, b):
                own, peer, other = (name_a, b, (b, name_b))
                if stage == b:
                    own, peer, other = name_b, a, (a, name_a)
                grads[other] = torch.empty_like(mine[own])
                to = self.ranks[peer]
                ops.append(dist.P2POp(dist.isend, mine[own].contiguous(), to, tag=0))
                ops.append(dist.P2POp(dist.irecv, grads[other], to, tag=0))
        if ops:
            self._launch(ops).wait(self.timeout_s, f"the tied gradients of step {step}")
        mine_squares = [square.detach().to(self.device, torch.float64).reshape(1)]
        for a, name_a, b, name_b in self.ties:
            pair = tied_square(grads[a, name_a] + grads[b, name_b]) if stage == a else None
            zero = torch.zeros(1, dtype=torch.float64, device=self.device)
            mine_squares.append(zero if pair is None else pair.to(self.device).reshape(1))
        handle, parts = self._all_gather(torch.cat(mine_squares))
        handle.wait(self.timeout_s, f"the gradient-norm gather of step {step}")
        pair_squares = {
            k: parts[a][1 + k] for k, (a, _, b, _) in enumerate(self.ties) if stage not in (a, b)
        }
        return TieMeeting([part[:1] for part in parts], grads, pair_squares)


class StrictTreeTransport(TreeTransport, StrictTransport):
    """``TreeTransport`` under NCCL's one-stream completion rule, on any backend."""


class StagedTreeTransport(HostStaged, TreeTransport):
    """``TreeTransport`` on gloo: every tensor through host memory (``staging.py``)."""


class StrictStagedTreeTransport(HostStaged, StrictTreeTransport):
    """``StrictTreeTransport`` on gloo: every tensor through host memory."""


TRANSPORTS = {  # (strict, staged) -> the runner's transport
    (False, False): TreeTransport,
    (True, False): StrictTreeTransport,
    (False, True): StagedTreeTransport,
    (True, True): StrictStagedTreeTransport,
}


Spec = tuple[str, list[tuple[tuple[int, ...], torch.dtype]]]  # treespec, leaf shapes and dtypes
