"""The layer partitioner: contiguous layer ranges per stage that minimise the most loaded
stage's cost (checked against brute force), and the partition's table. From test_model.py."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nobubble.model import ModelConfig, describe_partition, partition_layers, partition_rows


def make_cfg(**overrides: object) -> ModelConfig:
    fields: dict = dict(
        vocab_size=61, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=16
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def brute_force(costs, embed, head, P):
    """All compositions of len(costs) into P positive parts: the optimal max cost and the
    lexicographically smallest layer-count tuple among the optimal splits."""
    L, found = len(costs), []
    for cuts in itertools.combinations(range(1, L), P - 1):
        bounds = (0, *cuts, L)
        stage_costs = [sum(costs[bounds[s] : bounds[s + 1]]) for s in range(P)]
        stage_costs[0] += embed
        stage_costs[-1] += head
        found.append((max(stage_costs), tuple(b - a for a, b in itertools.pairwise(bounds))))
    best = min(c for c, _ in found)
    return best, min(counts for c, counts in found if c == best)


@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    embed=st.integers(0, 20),
    head=st.integers(0, 20),
    data=st.data(),
)
def test_partition_is_optimal_against_brute_force(costs, embed, head, data) -> None:
    P = data.draw(st.integers(1, len(costs)))
    cfg = make_cfg(n_layers=len(costs))
    ranges = partition_layers(
        cfg, P, layer_costs=[float(c) for c in costs], embed_cost=embed, head_cost=head
    )
    assert len(ranges) == P and all(len(r) > 0 and r.step == 1 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(len(costs)))  # contiguous, each once
    got = [sum(costs[i] for i in r) for r in ranges]
    got[0] += embed
    got[-1] += head
    best, counts = brute_force(costs, embed, head, P)
    assert max(got) == best
    assert tuple(len(r) for r in ranges) == counts  # ties: earlier stages get fewer layers


def test_huge_head_cost_gives_last_stage_fewer_layers() -> None:
    cfg = make_cfg(n_layers=8)
    even = partition_layers(cfg, 2, layer_costs=[1.0] * 8, embed_cost=0.0, head_cost=0.0)
    assert [len(r) for r in even] == [4, 4]
    heavy = partition_layers(cfg, 2, layer_costs=[1.0] * 8, embed_cost=0.0, head_cost=4.0)
    assert [len(r) for r in heavy] == [6, 2]
    # Default FLOP estimates: a 4096-token vocabulary head outweighs a 32-wide block.
    ranges = partition_layers(make_cfg(n_layers=8, vocab_size=4096), 4)
    assert len(ranges[-1]) < len(ranges[0]) or len(ranges[-1]) == 1


def test_partition_rows_and_table() -> None:
    cfg = make_cfg(n_layers=6)
    ranges = [range(0, 3), range(3, 4), range(4, 6)]
    rows = partition_rows(cfg, ranges)
    assert [r["layers"] for r in rows] == ["0-2", "3", "4-5"]
    assert sum(r["params"] for r in rows) == cfg.num_params()
    assert math.isclose(sum(r["cost_share"] for r in rows), 1.0)
    table = describe_partition(cfg, ranges)
    assert len(table.splitlines()) == 1 + 3 + 1
    assert "0-2" in table and "4-5" in table and "%" in table
    with pytest.raises(ValueError, match="range"):
        partition_rows(cfg, [range(0, 3), range(4, 6)])  # gap
