"""Point-to-point transport on torch.distributed: it posts what ``comm.rank_batches`` plans.

The plan is checked (``comm.check_communication``) to complete under NCCL's rules before a run
starts; this transport then posts exactly those batches, in that order, on NCCL: before action
i, one ``batch_isend_irecv`` with the send of action i-1's output and the receive of action i's
input (the Megatron ``send_forward_recv_backward`` pattern). A send handed over by the
interpreter waits for the next batch; a receive is posted by the action that consumes it, so
nothing is pending at a collective or a drain point. On gloo the receives of the next
``recv_lookahead`` actions are posted earlier, in the plan's order and never across a collective
or a drain point, each receive alone, so that its consumer waits for it and for no other
(``_post_early``: gloo moves a message only once its receive is posted). Tags are 0 everywhere,
as NCCL ignores them: messages between two ranks match in posting order, which the plan fixes.

Activations and gradients have one shape per run, agreed before training (``(B, T, D)``), so a
receive allocates its buffer without a shape exchange. Waits are bounded by ``timeout_s``: a dead
or hung peer becomes an error naming the peer and the message, on NCCL too (whose own watchdog
would abort the process without saying why).

``StrictTransport`` runs the same plan with NCCL's completion rules enforced on any backend: one
stream per rank (a batch starts only when the previous one has completed), so an order that
NCCL would deadlock on hangs on gloo too, and the tests catch it on a CPU.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from nobubble.core.comm_ops import ALLREDUCE, COLLECTIVES, DRAIN, GATHER, RECV, SEND, Batch, CommOp
from nobubble.core.ir import STEP, Action
from nobubble.core.placement import Placement, one_per_rank, rank_of
from nobubble.optim import sum_over_stages
from nobubble.runtime.distributed.waits import Handle, QueuedWork

# Evaluation traffic (blocking send/recv at drain points, when nothing else is pending).
EVAL_TAG_BASE = 1 << 30


class DistTransport:
    # the dp all-reduce is launched bucket by bucket from inside the last backward (DDP's
    # overlap, data_parallel.GradReducer); its own process group runs it beside the pipeline's
    eager_allreduce = True
    # on gloo, receives are posted up to this many actions before their consumer (_post_early)
    recv_lookahead = 2

    def __init__(
        self,
        batches: Sequence[Batch],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        num_stages: int,
        start_position: int = 0,
        timeout_s: float = 600.0,
        placement: Placement | None = None,
    ) -> None:
        self.batches = list(batches)
        self.shape, self.dtype, self.device, self.num_stages = shape, dtype, device, num_stages
        self.timeout_s = timeout_s
        # which rank runs which stage (None: stage s on rank s); the world is its ranks
        self.placement = placement or one_per_rank(num_stages)
        self.num_ranks = self.placement.num_ranks
        self.on_cuda = device.type == "cuda"
        self.cursor = next(
            (k for k, b in enumerate(self.batches) if b.position >= start_position),
            len(self.batches),
        )
        self.position = start_position  # index (in the rank's order) of the next action
        self.outgoing: dict[Action, torch.Tensor] = {}  # handed over, waiting for its batch
        self.posted: dict[Action, tuple[Handle, torch.Tensor]] = {}  # receives in flight
        # sends in flight: (handle, tensors, message, destination rank, post number)
        self.sending: list[tuple[Handle, list[torch.Tensor], Action, int, int]] = []
        self.posts = 0  # batches launched so far (``_post``), numbering sends and receives
        self.recv_post: dict[Action, int] = {}  # a receive in flight -> the post that launched it
        self.early: set[Action] = set()  # receives posted ahead of their batch (_post_early)
        # whether a message's micro-batch was fed (the runner of a Pipeline tells); a receive
        # is posted early only for one
        self.fed: Callable[[Action], bool] = lambda message: True
        self.shares: dict[int, dict[int, torch.Tensor]] = {}  # step -> local stage -> share
        self.reduced: dict[int, tuple[torch.Tensor, int]] = {}  # step -> (sum, reads left)
        self.peer_of_last_wait: int | None = None  # a pipeline rank, while a receive waits
        self.peers_of_failed_post: list[int] = []  # global ranks of a batch that failed to post
        # one pipeline replica among several (data parallel): its ranks by stage, its group for
        # the norm gather, and the dp all-reduce of this rank's gradients (use_mesh)
        self.ranks: list[int] = list(range(self.num_ranks))
        self.group: Any = None
        self.reducer: Any = None
        self.dp_group: Any = None

    def use_mesh(self, ranks: Sequence[int], group: Any, reducer: Any, dp_group: Any) -> None:
        """Run as one replica: ``ranks[r]`` is the global rank of pipeline rank r, ``group`` the
        replica's process group, ``reducer`` the ``GradReducer`` over ``dp_group`` (or None)."""
        self.ranks, self.group = list(ranks), group
        self.reducer, self.dp_group = reducer, dp_group
        if reducer is not None:
            reducer.bind(self._allreduce, self.eager_allreduce)

    # ----- the plan -------------------------------------------------------------------------
    def _next_batch(self, position: int) -> Batch | None:
        if self.cursor < len(self.batches) and self.batches[self.cursor].position <= position:
            return self.batches[self.cursor]
        return None

    def _post_point_to_point(self, position: int) -> None:
        """Post every point-to-point batch planned before ``position`` (less its receives
        posted early); stop at a collective. Then post the receives coming up early."""
        while (batch := self._next_batch(position)) is not None:
            if self._post_allreduce(batch):
                continue
            if batch.ops[0].kind in COLLECTIVES:
                return
            self.cursor += 1
            ops = [op for op in batch.ops if not (op.kind == RECV and op.message in self.early)]
            self.early.difference_update(op.message for op in batch.ops if op.kind == RECV)
            self._post(ops)
        self._post_early(position)

    def _post_early(self, position: int) -> None:
        """On gloo, post the receives of the batches planned up to ``recv_lookahead`` actions
        ahead now, in the plan's order, stopping at a collective, a drain point or a micro-batch
        not fed yet.

        gloo moves a message only once its receive is posted (a send posted first just
        announces itself and waits for the receiver's notice), so a receive posted by its
        consumer costs a round trip of notices between the two ranks' gloo threads, which on a
        loaded CPU take milliseconds to wake; posted ahead, the data is on its way while this
        rank still computes. The k-th receive from a peer meets the k-th send from it, and the
        receives posted early are the next ones of the plan, in its order, so every message
        still meets its own. Each is posted alone: one handle for several would make the
        consumer of the first wait for the others too, among them a gradient from the next
        rank that needs this rank's own next forward first (with M < P - 2 every rank hung so).
        A message of a micro-batch that was fed exists in every longer or drained schedule, and
        per peer those come in one fixed order (one stage per rank: by micro-batch; several:
        within the batch up to its gather, whose plan is fixed), so a replanned schedule keeps
        them. Off on NCCL: a pending receive there holds back the
        rank's stream, which the plan's NCCL order is built to avoid."""
        if self.recv_lookahead <= 0 or self.on_cuda:
            return
        early = []
        for batch in self.batches[self.cursor :]:
            kind = batch.ops[0].kind
            if batch.position > position + self.recv_lookahead or kind in (*COLLECTIVES, ALLREDUCE):
                break
            receives = [op for op in batch.ops if op.kind == RECV and op.message not in self.early]
            if not all(self.fed(op.message) for op in receives):
                break
            early += receives
        self.early.update(op.message for op in early)
        for op in early:  # each alone: a consumer waits for its own receive, not for the others
            self._post([op])

    def _post(self, ops: Sequence[CommOp]) -> None:
        """Launch ``ops`` in one call; keep the sends' tensors until they complete and the
        receives' buffers for their consumers."""
        if not ops:
            return
        p2p, tensors = [], []
        for op in ops:
            if op.kind == SEND:
                held = self._sent_tensors(op.message)
                p2p += [dist.P2POp(dist.isend, t, self.ranks[op.peer], tag=0) for t in held]
            else:
                assert op.kind == RECV
                held = self._recv_buffers(op.message)
                p2p += [dist.P2POp(dist.irecv, t, self.ranks[op.peer], tag=0) for t in held]
            tensors.append(held)
        handle = self._launch(p2p)
        self.posts += 1
        for op, held in zip(ops, tensors, strict=True):
            if op.kind == SEND:
                self.sending.append((handle, held, op.message, op.peer, self.posts))
            else:
                self.recv_post[op.message] = self.posts
                self._keep_received(op.message, handle, held)
        self._reap()

    def _sent_tensors(self, message: Action) -> list[torch.Tensor]:
        tensor = self.outgoing.pop(message, None)
        assert tensor is not None, f"plan sends {message}; nothing was handed over"
        return [tensor]

    def _recv_buffers(self, message: Action) -> list[torch.Tensor]:
        return [torch.empty(self.shape, dtype=self.dtype, device=self.device)]

    def _keep_received(self, message: Action, handle: Handle, buffers: list[torch.Tensor]) -> None:
        self.posted[message] = (handle, buffers[0])

    def _post_allreduce(self, batch: Batch) -> bool:
        """Launch what is left of the dp all-reduce where the plan puts it (its stream
        position: after the exchange before it, before anything after it): everything under
        the strict stream, nothing if the last backward launched it all; False if ``batch``
        is another kind."""
        if batch.ops[0].kind != ALLREDUCE:
            return False
        self.cursor += 1
        step = batch.ops[0].message.number
        assert self.reducer is not None, f"plan all-reduces for step {step}; no dp group"
        self.reducer.launch_rest(step)
        return True

    def _allreduce(self, flats: list[torch.Tensor]) -> Handle:
        works = [
            dist.all_reduce(f, op=dist.ReduceOp.SUM, group=self.dp_group, async_op=True)
            for f in flats
        ]
        return Handle(works, self.on_cuda)

    def _finish_allreduce(self, action: Action) -> None:
        """Just before a STEP: its gradients, averaged over the replicas."""
        if action.kind == STEP and self.reducer is not None and self.reducer.has(action.number):
            self.reducer.finish(
                action.number, self.timeout_s, f"the dp all-reduce of step {action.number}"
            )

    def _skip_drain(self) -> None:
        batch = self._next_batch(self.position)
        if batch is not None and batch.ops[0].kind == DRAIN:  # the runtime meets there itself
            self.cursor += 1

    def _launch(self, ops: list[dist.P2POp]) -> Handle:
        try:
            return Handle(dist.batch_isend_irecv(ops), self.on_cuda)
        except Exception:  # gloo refuses a send to a peer whose connection is closed
            self.peers_of_failed_post = sorted({op.peer for op in ops})
            raise

    def _all_gather(self, share: torch.Tensor) -> tuple[Handle, list[torch.Tensor]]:
        parts = [torch.empty_like(share) for _ in range(self.num_ranks)]
        work = dist.all_gather(parts, share, group=self.group, async_op=True)
        return Handle([work], self.on_cuda), parts

    def _reap(self) -> None:
        self.sending = [s for s in self.sending if not s[0].is_completed()]

    def _received(self, message: Action) -> None:
        """After the wait of ``message``'s receive: wait for the sends posted before it, and
        let their tensors go.

        gloo's ``Work.is_completed`` stays False until ``wait`` is called, so ``_reap`` alone
        would keep every sent tensor (autograd's activation and gradient outputs) until the
        next drain point: memory growing by a step's sends every step. Waiting here never
        waits longer than NCCL's rules do: the plan puts those sends in batches at or before
        the receive's, and on NCCL's one stream per rank a batch completes only after every
        batch before it, so the receive just waited for implies them there; the plan is
        checked to complete under those rules (``comm.check_communication``). A send is
        thus held until the rank's next receive, at most about one step."""
        post = self.recv_post.pop(message)
        keep = []
        for sent in self.sending:
            handle, _, sent_message, peer, sent_post = sent
            if sent_post > post:
                keep.append(sent)
                continue
            self.peer_of_last_wait = peer
            handle.wait(self.timeout_s, f"the send of {sent_message} to rank {peer}")
        self.peer_of_last_wait = None
        self.sending = keep

    # ----- the interpreter's side -------------------------------------------------------------
    def begin(self, action: Action) -> None:
        self._skip_drain()
        self._post_point_to_point(self.position)
        self._finish_allreduce(action)
        self.position += 1

    def send(self, producer: Action, tensor: torch.Tensor, dst_stage: int) -> None:
        self.outgoing[producer] = tensor.contiguous()

    def recv(self, producer: Action, dst_stage: int) -> torch.Tensor:
        handle, buffer = self.posted.pop(producer)
        self.peer_of_last_wait = peer = rank_of(producer.stage, self.placement)
        handle.wait(self.timeout_s, f"the receive of {producer} from rank {peer}")
        self.peer_of_last_wait = None
        self._received(producer)
        return buffer

    def contribute(self, step: int, stage: int, value: torch.Tensor) -> None:
        share = value.detach().to(self.device, torch.float64).reshape(1)
        self.shares.setdefault(step, {})[stage] = share

    def _share(self, step: int) -> torch.Tensor:
        """This rank's shares of step ``step``'s meeting, one per local stage in stage order;
        with data parallelism (one stage per rank) taken again from the averaged gradients
        (the one offered after the backward was this replica's)."""
        mine = self.shares[step]
        if self.reducer is not None:
            assert len(mine) == 1, "data parallelism runs one stage per rank"
            return self.reducer.share().detach().to(self.device, torch.float64).reshape(1)
        return torch.cat([mine[s] for s in sorted(mine)])

    def reduce(self, step: int, stage: int) -> torch.Tensor:
        """Every stage's share, gathered and added in stage order (bitwise the emulator's).
        A rank with several stages gathers once, at its first STEP of the step (the plan's
        gather), as a vector of its stages' shares; its other STEPs read the same sum."""
        if step in self.reduced:
            total, reads = self.reduced.pop(step)
            if reads > 1:
                self.reduced[step] = total, reads - 1
            return total
        batch = self._next_batch(self.position)
        assert batch is not None and batch.ops[0].kind == GATHER, f"plan has no gather at {step}"
        assert batch.ops[0].message.number == step, f"plan gathers {batch.ops[0]}, not step {step}"
        self.cursor += 1
        handle, parts = self._all_gather(self._share(step))
        mine = self.shares.pop(step)
        handle.wait(self.timeout_s, f"the gradient-norm gather of step {step}")
        where = self.placement
        by_stage = [
            parts[where.rank_of(s)][where.stages_of(where.rank_of(s)).index(s)]
            for s in range(self.num_stages)
        ]
        total = sum_over_stages(by_stage)
        if len(mine) > 1:
            self.reduced[step] = total, len(mine) - 1
        return total

    def flush(self) -> None:
        """Wait for every send to complete (at a drain point, which follows a STEP: the plan
        has posted every send by then, and the next receive waits for the next action)."""
        assert not self.outgoing, f"handed over but not posted: {sorted(self.outgoing)}"
        assert not self.early, f"posted early across a drain point: {sorted(self.early)}"
        for handle, _, message, peer, _ in self.sending:
            handle.wait(self.timeout_s, f"the send of {message} to rank {peer}")
        self.sending.clear()


class StrictTransport(DistTransport):
    """The same plan under NCCL's completion rules, on any backend (a testing aid).

    One worker thread is the rank's stream: it runs the posted batches one after the other and
    starts a batch only when the previous one has completed, as an NCCL stream does. A plan
    that NCCL would deadlock on then hangs here too, and the peers' timeout reports it.
    """

    # The plan's placement, not the backward's: on the one stream a bucket launched from
    # inside the last backward would run before that backward's gradient is sent, so the
    # previous stage would wait for the whole all-reduce, and the plan checked against NCCL's
    # rules (comm.check_communication) puts the all-reduce after that send. NCCL runs the dp
    # group on a stream of its own, which the eager launch of DistTransport relies on.
    eager_allreduce = False
    recv_lookahead = 0  # NCCL's rules: every receive where the plan puts it

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream: queue.Queue[tuple[Callable[[], Any], QueuedWork] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run_stream, name="strict-stream", daemon=True)
        self.thread.start()

    def _run_stream(self) -> None:
        while (item := self.stream.get()) is not None:
            work, future = item
            try:
                for w in work():
                    w.wait()
            except Exception as err:  # surfaced by the waiting caller
                future.error = err
            future.done.set()

    def _enqueue(self, work: Callable[[], Any]) -> QueuedWork:
        future = QueuedWork()
        self.stream.put((work, future))
        return future

    def _launch(self, ops: list[dist.P2POp]) -> Handle:
        return Handle([self._enqueue(lambda: dist.batch_isend_irecv(ops))], on_cuda=False)

    def _all_gather(self, share: torch.Tensor) -> tuple[Handle, list[torch.Tensor]]:
        parts = [torch.empty_like(share) for _ in range(self.num_ranks)]
        group = self.group
        future = self._enqueue(lambda: [dist.all_gather(parts, share, group=group, async_op=True)])
        return Handle([future], on_cuda=False), parts

    def _allreduce(self, flats: list[torch.Tensor]) -> Handle:
        group = self.dp_group
        future = self._enqueue(
            lambda: [
                dist.all_reduce(f, op=dist.ReduceOp.SUM, group=group, async_op=True) for f in flats
            ]
        )
        return Handle([future], on_cuda=False)

    def close(self) -> None:
        self.stream.put(None)
        self.thread.join()
