"""Discrete-event engine: give every action of a schedule a start and end time.

Each rank runs its order strictly in sequence; an action starts when its rank is free and its
remote dependency (``deps.remote_dependency``) has finished plus the transfer time. The engine
sweeps the ranks, advancing each as far as its dependencies allow, so its cost is linear in the
number of actions times the number of sweeps over ranks that make no progress.
"""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.core.deps import FLOW, remote_dependency
from nobubble.core.ir import STEP, Action, Schedule
from nobubble.core.sim.cost import CostModel


class Deadlock(RuntimeError):
    """No rank can advance: ``positions[r]`` is where rank r is stuck (len(order) when done)."""

    def __init__(self, positions: list[int]) -> None:
        super().__init__(f"deadlock at positions {positions}")
        self.positions = positions


@dataclass(frozen=True)
class Timeline:
    """Start and end time of every action, aligned with each rank's order."""

    schedule: Schedule
    starts: tuple[list[float], ...]
    ends: tuple[list[float], ...]

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.ends if e), default=0.0)

    def spans(self, rank: int) -> list[tuple[Action, float, float]]:
        order = self.schedule.ranks[rank]
        return list(zip(order, self.starts[rank], self.ends[rank], strict=True))


def run_timeline(schedule: Schedule, cost: CostModel) -> Timeline:
    """Place every action in time; raise ``Deadlock`` if the orders cannot all finish.

    A work list of ranks: a rank runs until it waits for a neighbour; whenever it advances, the
    ranks that consume its outputs are revisited. Each action is placed once, so the cost is
    linear in the number of actions. A hop between two stages of one rank costs no transfer.
    """
    num_stages, num_ranks = schedule.num_stages, schedule.num_ranks
    placement = schedule.placement
    total = schedule.total_microbatches
    durations = cost.durations(placement)  # kind -> per-stage durations
    hop, step_cost = cost.transfer(), cost.step + cost.allreduce  # the STEP waits for it
    # done[kind][stage][m]: end time of that action, -1.0 while it has not run.
    done = {kind: [[-1.0] * total for _ in range(num_stages)] for kind in FLOW}
    starts: tuple[list[float], ...] = tuple([] for _ in range(num_ranks))
    ends: tuple[list[float], ...] = tuple([] for _ in range(num_ranks))
    pointer, clock = [0] * num_ranks, [0.0] * num_ranks
    # Per stage: its own end-time arrays, the arrays it reads from with the hop each costs (None
    # at the pipeline's ends), and its durations, all keyed by kind as the dependency rule says.
    own = [{k: done[k][s] for k in FLOW} for s in range(num_stages)]
    reads = [
        {
            k: (done[k][s + off], 0.0 if placement.same_rank(s, s + off) else hop)
            if 0 <= s + off < num_stages
            else None
            for k, off in FLOW.items()
        }
        for s in range(num_stages)
    ]
    dur = [{STEP: step_cost, **{k: durations[k][s] for k in durations}} for s in range(num_stages)]
    consumers = [
        sorted(
            {
                placement.rank_of(s - off)
                for s in placement.stages_of(r)
                for off in FLOW.values()
                if 0 <= s - off < num_stages and not placement.same_rank(s, s - off)
            }
        )
        for r in range(num_ranks)
    ]
    pending, queued = list(range(num_ranks - 1, -1, -1)), [True] * num_ranks
    while pending:
        rank = pending.pop()
        queued[rank] = False
        order, i, now = schedule.ranks[rank], pointer[rank], clock[rank]
        s_append, e_append = starts[rank].append, ends[rank].append
        n, last = len(order), -1
        while i < n:
            stage, kind, m = order[i]
            if stage != last:  # rebind the stage's tables only when the stage changes
                own_get, reads_s, dur_s, last = own[stage].get, reads[stage], dur[stage], stage
            mine = own_get(kind)
            start = now
            if mine is None:  # local action (W, STEP)
                now += dur_s[kind]
            else:
                source = reads_s[kind]
                if source is not None:
                    ready = source[0][m]
                    if ready < 0.0:
                        break  # waiting for a neighbour; it will requeue this rank
                    ready += source[1]
                    if ready > now:
                        start = ready
                now = start + dur_s[kind]
                mine[m] = now
            s_append(start)
            e_append(now)
            i += 1
        if i != pointer[rank]:
            for other in consumers[rank]:
                if not queued[other] and pointer[other] < len(schedule.ranks[other]):
                    queued[other] = True
                    pending.append(other)
        pointer[rank], clock[rank] = i, now
    if any(pointer[r] < len(schedule.ranks[r]) for r in range(num_ranks)):
        raise Deadlock(list(pointer))
    return Timeline(schedule, starts, ends)


def blocked_on(
    schedule: Schedule, positions: list[int]
) -> list[tuple[int, int, Action, Action | None]]:
    """For a deadlock: (rank, position, action, the remote action it waits for) per stuck rank."""
    stuck = []
    for rank, pos in enumerate(positions):
        order = schedule.ranks[rank]
        if pos < len(order):
            stuck.append(
                (rank, pos, order[pos], remote_dependency(order[pos], schedule.num_stages))
            )
    return stuck
