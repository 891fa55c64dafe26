"""Per-rank communication as plain data, and a check that it cannot deadlock under NCCL's rules.

The runtime does not decide on the fly what to post: ``rank_batches`` lowers one rank's action
order into the batches of point-to-point operations (and collectives) it posts, and
``check_communication`` replays every rank's batches under the strictest semantics a backend may
have. That is NCCL's:

- each rank has one stream: a batch starts only when the rank's previous batch has completed;
- within a batch, operations progress together (one ``batch_isend_irecv`` call);
- a send completes only when the peer's matching receive is in the peer's active batch
  (rendezvous; no buffering is assumed);
- tags are ignored: the k-th send from rank a to rank b meets the k-th receive on b from a, so
  both must name the same message;
- a collective completes when every rank's active batch is that collective.

With one stage per rank the lowering is the Megatron pattern (``paired_batches``): before
action i a rank posts one batch holding the send of action i-1's output and the receive of
action i's input, so two neighbours that both send before they receive (the 1F1B steady state)
meet in one batch instead of waiting for each other. No receive is posted ahead of the action
that consumes it, so none stays pending across a collective or a drain point. A rank with
several stages (interleaved-1f1b, zbv) sends a neighbour messages of two stages in an order the
neighbour may not consume them in; its receives follow the sender's order instead, some posted
before their consumer's turn and buffered (``sender_order.py``). A hop between two stages of
one rank (the turn of a V placement) is a local hand-off: no operation is posted for it; a
weight-gradient action (W) sends nothing.
With data parallelism (``data_parallel=True``) each STEP is preceded by the all-reduce of that
stage's gradients over its dp group (``with_allreduce``), a batch of its own after the exchange
that posts the last backward's send, so the gradient reaches the previous stage first and no
receive is pending across the all-reduce.
``prefetch_batches`` keeps the earlier runtime's order (each receive posted one action ahead,
each operation alone) for the test that shows why it had to go.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from nobubble.core.comm_ops import (
    ALLREDUCE,
    COLLECTIVES,
    DRAIN,
    GATHER,
    RECV,
    SEND,
    Batch,
    CommOp,
    exchange_ops,
    incoming,
    outgoing,
    with_collectives,
)
from nobubble.core.ir import STEP, Action, Schedule, ScheduleError
from nobubble.core.sender_order import sender_order_plans


def rank_batches(
    schedule: Schedule, rank: int, global_clip: bool = False, drain_points: Collection[int] = ()
) -> list[Batch]:
    """What rank ``rank`` posts, in order. With ``global_clip`` the rank's first STEP of each
    step gathers the squared gradient norms of all stages (a collective, one per rank and step)
    after its exchange; after the rank's last STEP of each step in ``drain_points`` the ranks meet
    (modelled as a collective: nothing may be pending there).

    One stage per rank: ``paired_batches``, each action's receive with the previous action's
    send. Several stages per rank (interleaved-1f1b, zbv): ``sender_order.sender_order_plans``,
    the receives between two ranks in the sender's order (module docstring there).
    """
    if schedule.placement.stages_per_rank > 1:
        return sender_order_plans(schedule, global_clip, drain_points)[rank]
    return paired_batches(schedule, rank, global_clip, drain_points)


def paired_batches(
    schedule: Schedule, rank: int, global_clip: bool = False, drain_points: Collection[int] = ()
) -> list[Batch]:
    """The per-action pairing (module docstring): before action i, action i-1's send and action
    i's receive. Every receive is posted by its consumer.

    It is the plan of every schedule with one stage per rank. With several stages per rank it
    fails in the steady phases of interleaved-1f1b (M >= 2P) and zbv (M > 1): a rank sends a
    neighbour messages of two stages in an order the neighbour does not consume them in (ZB-V's
    F and I cross), and with tags ignored the receives must follow the sender's order;
    ``check_communication`` then names the crossing messages (kept for the test that shows it).
    """
    order, where, P = schedule.ranks[rank], schedule.placement, schedule.num_stages
    exchanges = {}
    for i in range(len(order) + 1):
        previous = order[i - 1] if i else None
        action = order[i] if i < len(order) else None
        if ops := exchange_ops(previous, action, P, where):
            exchanges[i] = ops
    return with_collectives(order, exchanges, global_clip, drain_points)


def with_allreduce(batches: Sequence[Batch], order: Sequence[Action]) -> list[Batch]:
    """``batches`` with each STEP's dp all-reduce: alone in its batch, at the STEP's position,
    after the exchange posted there (the send of the last backward's gradient) and before the
    STEP's gather of the global norm (which must see the averaged gradients)."""
    out = list(batches)
    for i, action in enumerate(order):
        if action.kind != STEP:
            continue
        at = next(
            (
                k
                for k, b in enumerate(out)
                if b.position > i or (b.position == i and b.ops[0].kind == GATHER)
            ),
            len(out),
        )
        out.insert(at, Batch(i, (CommOp(ALLREDUCE, -1, action),)))
    return out


def prefetch_batches(
    schedule: Schedule, rank: int, global_clip: bool = False, drain_points: Collection[int] = ()
) -> list[Batch]:
    """The order nobubble's runtime used before: the next action's receive posted before this
    action's own, each operation alone, each send right after its action. Gloo forgives it;
    NCCL deadlocks on it (kept for the test that shows so)."""
    order, P = schedule.ranks[rank], schedule.num_stages
    batches, posted = [], set()
    for i, action in enumerate(order):
        wanted = [order[i + 1]] if i + 1 < len(order) else []
        for a in [*wanted, action]:
            recv = incoming(a, P, schedule.placement)
            if recv is not None and recv.message not in posted:
                posted.add(recv.message)
                batches.append(Batch(i, (recv,)))
        if global_clip and action.kind == STEP:
            batches.append(Batch(i, (CommOp(GATHER, -1, action),)))
        send = outgoing(action, P, schedule.placement)
        if send is not None:
            batches.append(Batch(i + 1, (send,)))
        if action.kind == STEP and action.number in drain_points:
            batches.append(Batch(i + 1, (CommOp(DRAIN, -1, action),)))
    return batches


class CommDeadlock(ScheduleError):
    """The ranks' batches cannot all complete under NCCL's rules; the message shows the cycle."""


Planner = Callable[[Schedule, int, bool, Collection[int]], list[Batch]]


def check_communication(
    schedule: Schedule,
    global_clip: bool = False,
    drain_points: Collection[int] = (),
    planner: Planner = rank_batches,
    data_parallel: bool = False,
) -> list[list[Batch]]:
    """Replay every rank's batches under the rules above; return them, or raise
    ``CommDeadlock`` naming the mismatch or the cycle of waiting ranks.

    ``data_parallel``: the plans of one pipeline replica among several, with each STEP's dp
    all-reduce (``with_allreduce``). Every replica posts the same plan, so in the replay of all
    replicas in lockstep a stage's dp peers reach its all-reduce together: one replica's replay,
    where an all-reduce completes once it is the rank's active batch, stands for all of them.
    It still occupies the rank's stream, which is what the check is about."""
    if planner is rank_batches and schedule.placement.stages_per_rank > 1:
        plans = sender_order_plans(schedule, global_clip, drain_points)  # every rank's at once
    else:
        plans = [planner(schedule, r, global_clip, drain_points) for r in range(schedule.num_ranks)]
    if data_parallel:
        plans = [with_allreduce(p, schedule.ranks[r]) for r, p in enumerate(plans)]
    partner = _match(plans)
    _replay(schedule, plans, partner)
    return plans


OpRef = tuple[int, int, int]  # (rank, batch index, op index)


def _match(plans: Sequence[Sequence[Batch]]) -> dict[OpRef, OpRef | int]:
    """Pair the k-th send a->b with the k-th receive on b from a (tags are ignored); the k-th
    gather of every rank is collective number k. Raises on a count or message mismatch."""
    sends: dict[tuple[int, int], list[tuple[OpRef, Action]]] = {}
    recvs: dict[tuple[int, int], list[tuple[OpRef, Action]]] = {}
    partner: dict[OpRef, OpRef | int] = {}
    gathers: list[list[OpRef]] = [[] for _ in plans]
    kinds: list[list[tuple[str, int]]] = [[] for _ in plans]
    for rank, batches in enumerate(plans):
        for b, batch in enumerate(batches):
            for o, op in enumerate(batch.ops):
                ref = (rank, b, o)
                if op.kind == SEND:
                    sends.setdefault((rank, op.peer), []).append((ref, op.message))
                elif op.kind == RECV:
                    recvs.setdefault((op.peer, rank), []).append((ref, op.message))
                elif op.kind == ALLREDUCE:  # its partners are the other replicas' twins
                    partner[ref] = ref
                else:
                    partner[ref] = len(gathers[rank])
                    gathers[rank].append(ref)
                    kinds[rank].append((op.kind, op.message.number))
    for pair in sorted(set(sends) | set(recvs)):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        if len(out) != len(into):
            raise CommDeadlock(
                f"rank {pair[0]} sends {len(out)} messages to rank {pair[1]}, which receives "
                f"{len(into)} from it: the unmatched operations wait forever"
            )
        for k, ((s_ref, s_msg), (r_ref, r_msg)) in enumerate(zip(out, into, strict=True)):
            if s_msg != r_msg:
                raise CommDeadlock(
                    f"message {k} from rank {pair[0]} to rank {pair[1]} is {s_msg} but rank "
                    f"{pair[1]} expects {r_msg}: with tags ignored the two ranks must post "
                    "their messages in the same order"
                )
            partner[s_ref], partner[r_ref] = r_ref, s_ref
    for rank, joined in enumerate(kinds[1:], start=1):
        if joined != kinds[0]:
            first = next(
                (k for k, (a, b) in enumerate(zip(joined, kinds[0], strict=False)) if a != b),
                min(len(joined), len(kinds[0])),
            )
            raise CommDeadlock(
                f"rank {rank} joins the collectives {joined[first : first + 2]}... at collective "
                f"{first}, rank 0 {kinds[0][first : first + 2]}...: every rank must join the "
                "same collectives in the same order"
            )
    return partner


def _replay(
    schedule: Schedule, plans: Sequence[Sequence[Batch]], partner: dict[OpRef, OpRef | int]
) -> None:
    num_ranks = len(plans)
    pointer = [0] * num_ranks
    done: list[set[int]] = [set() for _ in plans]
    gather_at: list[dict[int, int]] = [{} for _ in plans]  # collective number -> batch index
    for rank, batches in enumerate(plans):
        for b, batch in enumerate(batches):
            for o, op in enumerate(batch.ops):
                if op.kind in COLLECTIVES:
                    number = partner[(rank, b, o)]
                    assert isinstance(number, int)
                    gather_at[rank][number] = b
    pending = list(range(num_ranks))
    while pending:
        rank = pending.pop()
        while pointer[rank] < len(plans[rank]):
            b = pointer[rank]
            woken = _progress(rank, b, plans, pointer, partner, done, gather_at)
            pending.extend(woken)
            if len(done[rank]) < len(plans[rank][b].ops):
                break
            pointer[rank], done[rank] = b + 1, set()
            pending.extend(r for r in range(num_ranks) if r != rank)
    stuck = [r for r in range(num_ranks) if pointer[r] < len(plans[r])]
    if stuck:
        raise CommDeadlock(_describe(schedule, plans, pointer, partner, done, gather_at, stuck))


def _progress(
    rank: int,
    b: int,
    plans: Sequence[Sequence[Batch]],
    pointer: list[int],
    partner: dict[OpRef, OpRef | int],
    done: list[set[int]],
    gather_at: list[dict[int, int]],
) -> list[int]:
    """Complete every operation of rank's active batch whose partner is active too."""
    woken = []
    for o in range(len(plans[rank][b].ops)):
        if o in done[rank]:
            continue
        other = partner[(rank, b, o)]
        if isinstance(other, int):  # collective number ``other``
            if all(pointer[r] == gather_at[r][other] for r in range(len(plans))):
                for r in range(len(plans)):
                    done[r].add(0)  # a collective is alone in its batch
                    woken.append(r)
        else:
            peer, pb, po = other
            if pointer[peer] == pb:
                done[rank].add(o)
                done[peer].add(po)
                woken.append(peer)
    return woken


def _waits_for(
    rank: int,
    plans: Sequence[Sequence[Batch]],
    pointer: list[int],
    partner: dict[OpRef, OpRef | int],
    done: list[set[int]],
    gather_at: list[dict[int, int]],
) -> tuple[CommOp, int, int]:
    """The first unfinished operation of a stuck rank, the rank it waits for and where that
    rank holds the matching operation (batch index)."""
    b = pointer[rank]
    for o, op in enumerate(plans[rank][b].ops):
        if o in done[rank]:
            continue
        other = partner[(rank, b, o)]
        if isinstance(other, int):
            late = next(r for r in range(len(plans)) if pointer[r] != gather_at[r][other])
            return op, late, gather_at[late][other]
        return op, other[0], other[1]
    raise AssertionError("a stuck rank has an unfinished operation")


def _describe(
    schedule: Schedule,
    plans: Sequence[Sequence[Batch]],
    pointer: list[int],
    partner: dict[OpRef, OpRef | int],
    done: list[set[int]],
    gather_at: list[dict[int, int]],
    stuck: list[int],
) -> str:
    edges = {r: _waits_for(r, plans, pointer, partner, done, gather_at) for r in stuck}
    seen: list[int] = []
    rank = stuck[0]
    while rank not in seen and rank in edges:  # follow the waits until a rank repeats
        seen.append(rank)
        rank = edges[rank][1]
    cycle = seen[seen.index(rank) :] if rank in seen else seen
    lines = [
        f"{schedule.name} (P={schedule.num_ranks}, M={schedule.num_microbatches}) deadlocks "
        "under NCCL's rules (one stream per rank, operations in posting order, tags ignored):"
    ]
    for r in cycle:
        op, peer, where = edges[r]
        b = pointer[r]
        batch, order = plans[r][b], schedule.ranks[r]
        before = order[batch.position] if batch.position < len(order) else "the end"
        lines.append(
            f"  rank {r} is blocked in its batch {b} {batch} (posted before {before}) on "
            f"'{op}'; rank {peer} posts the match only in its batch {where} "
            f"{plans[peer][where]}, behind its blocked batch {pointer[peer]}"
        )
    return "\n".join(lines)
