"""Which rank runs which stage.

Three placements of ``S = v x P`` stages on ``P`` ranks:

- ``one``: one stage per rank, stage s on rank s (every schedule but the ones below);
- ``loop``: interleaved (Megatron, arXiv 2104.04473): stage s on rank s mod P, so rank r holds
  r, r+P, ..., r+(v-1)P and a micro-batch loops over the ranks v times;
- ``v``: two stages per rank in a V (ZB-V, arXiv 2401.10241 sec. 6): rank r holds r and 2P-1-r,
  so the turn of the V (stages P-1 and P) and both ends of the pipeline share ranks.

Stage-to-stage hops stay s -> s+1 in every placement; only the rank that runs a stage changes, and
a hop between two stages of one rank is a local hand-off, not a message.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("one", "loop", "v")


@dataclass(frozen=True)
class Placement:
    kind: str
    num_ranks: int
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"placement {self.kind!r} is not one of {', '.join(PLACEMENTS)}")
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"a placement needs at least one rank, got {self.num_ranks!r}")
        expected = {"one": 1, "v": 2}.get(self.kind)
        if expected is not None and self.stages_per_rank != expected:
            raise ValueError(
                f"placement {self.kind!r} holds {expected} stage(s) per rank, "
                f"not {self.stages_per_rank}"
            )
        if self.stages_per_rank < 1:
            raise ValueError(f"stages per rank must be >= 1, got {self.stages_per_rank}")

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        if self.kind == "loop":
            return stage % self.num_ranks
        if self.kind == "v" and stage >= self.num_ranks:
            return 2 * self.num_ranks - 1 - stage
        return stage

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The rank's stages in pipeline order (its first stage first)."""
        if self.kind == "loop":
            return tuple(rank + k * self.num_ranks for k in range(self.stages_per_rank))
        if self.kind == "v":
            return (rank, 2 * self.num_ranks - 1 - rank)
        return (rank,)

    def same_rank(self, stage: int, other: int) -> bool:
        return self.rank_of(stage) == self.rank_of(other)

    def lane_name(self, rank: int) -> str:
        """How timelines label the rank's lane."""
        if self.kind == "one":
            return f"stage {rank}"
        return f"rank {rank}: stages " + ",".join(map(str, self.stages_of(rank)))

    def describe(self) -> str:
        if self.kind == "one":
            return f"{self.num_ranks} stages, one per rank"
        return f"{self.num_stages} stages on {self.num_ranks} ranks ({self.kind} placement)"


def one_per_rank(num_stages: int) -> Placement:
    return Placement("one", num_stages)


def rank_of(stage: int, placement: Placement | None = None) -> int:
    """The rank of ``stage``; without a placement, one stage per rank (stage s on rank s)."""
    return stage if placement is None else placement.rank_of(stage)


def stages_of(rank: int, placement: Placement | None = None) -> tuple[int, ...]:
    return (rank,) if placement is None else placement.stages_of(rank)
