"""Which rank runs which stage. This version places one stage per rank (stage s on rank s).

Interleaved placements (several stages per rank) would change only this module and the generators.
"""

from __future__ import annotations


def rank_of(stage: int) -> int:
    return stage


def stages_of(rank: int) -> tuple[int, ...]:
    return (rank,)
