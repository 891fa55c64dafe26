"""Which transformer blocks each pipeline stage holds: a cost model and an exact min-max split.

Torch-free: it only needs a ModelConfig. Costs are estimated forward FLOPs per token; the
backward is about twice the forward for every piece, so the ratios, which are all a split
depends on, hold for a training step too. Measured costs can replace the estimates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypedDict

from nobubble.model.config import ModelConfig


class StageRow(TypedDict):
    """One stage of a partition, as partition_rows() reports it (JSON-ready)."""

    stage: int
    layers: str  # "0-3", or "4" for a single layer
    num_layers: int
    params: int  # embedding on stage 0, final norm + head on the last stage included
    cost: float  # estimated (or given) cost per token
    cost_share: float  # cost / total cost over all stages, in [0, 1]


def block_cost(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block.

    Every weight of a matmul costs a multiply and an add (2 FLOPs) per token; the attention
    scores q.k and the weighted sum of values cost 2 * seq_len * dim each per token (the full
    T x T product; a causal flash kernel skips about half of it). Norms are ignored.
    """
    matmul_params = cfg.block_params() - 2 * cfg.dim  # minus the two RMSNorm gains
    return 2.0 * matmul_params + 2 * 2 * seq_len * cfg.dim


def embed_cost_default(cfg: ModelConfig) -> float:
    """A row gather: no FLOPs, counted as ``dim`` so that the embedding is not free."""
    return float(cfg.dim)


def head_cost_default(cfg: ModelConfig) -> float:
    """Head matmul 2 * dim * vocab per token, plus ~4 FLOPs per logit for the log-softmax
    (max, subtract, exp, sum) of the cross-entropy; the final norm is ignored."""
    return 2.0 * cfg.dim * cfg.vocab_size + 4.0 * cfg.vocab_size


def check_num_stages(n_layers: int, num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise TypeError(f"num_stages must be an int, got {num_stages!r}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > n_layers:
        raise ValueError(
            f"num_stages={num_stages} exceeds n_layers={n_layers}: every stage holds at least "
            f"one transformer block; use at most {n_layers} stages or a deeper model"
        )


def check_layer_ranges(n_layers: int, num_stages: int, ranges: Sequence[range]) -> None:
    """ValueError unless ``ranges`` are num_stages non-empty contiguous ranges covering all
    layers 0..n_layers-1 in order."""
    check_num_stages(n_layers, num_stages)
    if len(ranges) != num_stages:
        raise ValueError(f"got {len(ranges)} layer ranges for num_stages={num_stages}")
    start = 0
    for stage, r in enumerate(ranges):
        if not isinstance(r, range) or r.step != 1 or len(r) == 0 or r.start != start:
            raise ValueError(
                f"layer range {r!r} of stage {stage} must be a non-empty range(start, stop) "
                f"starting at layer {start}, where the previous stage ended; got {list(ranges)}"
            )
        start = r.stop
    if start != n_layers:
        raise ValueError(f"layer ranges {list(ranges)} end at {start}, not n_layers={n_layers}")


def resolve_costs(
    cfg: ModelConfig,
    seq_len: int | None = None,
    layer_costs: Sequence[float] | None = None,
    embed_cost: float | None = None,
    head_cost: float | None = None,
) -> tuple[list[float], float, float]:
    """(per-layer costs, embedding cost, head cost): the given ones, checked, or the estimates."""
    seq_len = cfg.max_seq_len if seq_len is None else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if layer_costs is None:
        layer_costs = [block_cost(cfg, seq_len)] * cfg.n_layers
    if len(layer_costs) != cfg.n_layers:
        raise ValueError(
            f"layer_costs has {len(layer_costs)} entries; give one per layer, n_layers="
            f"{cfg.n_layers}"
        )
    embed = embed_cost_default(cfg) if embed_cost is None else embed_cost
    head = head_cost_default(cfg) if head_cost is None else head_cost
    for name, value in [("embed_cost", embed), ("head_cost", head)] + [
        (f"layer_costs[{i}]", c) for i, c in enumerate(layer_costs)
    ]:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return [float(c) for c in layer_costs], float(embed), float(head)


def partition_layers(
    cfg: ModelConfig,
    num_stages: int,
    seq_len: int | None = None,
    layer_costs: list[float] | None = None,
    embed_cost: float | None = None,
    head_cost: float | None = None,
) -> list[range]:
    """Contiguous non-empty layer ranges, one per stage, minimizing the largest stage cost.

    Stage 0 also pays ``embed_cost``, the last stage ``head_cost`` (final norm, head and loss).
    Defaults: estimated forward FLOPs per token at ``seq_len`` (default cfg.max_seq_len).
    Among optimal splits, earlier stages get as few layers as possible: under 1F1B stage s
    keeps activations of up to P - s micro-batches, so the early stages are the memory-bound
    ones.
    """
    check_num_stages(cfg.n_layers, num_stages)
    costs, embed, head = resolve_costs(cfg, seq_len, layer_costs, embed_cost, head_cost)
    L, P = cfg.n_layers, num_stages
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(k: int, i: int, j: int) -> float:  # stage k holding layers i..j-1
        return prefix[j] - prefix[i] + (embed if k == 0 else 0.0) + (head if k == P - 1 else 0.0)

    # best[k][i]: smallest max cost of layers i..L-1 over stages k..P-1 (inf when infeasible).
    best = [[math.inf] * (L + 1) for _ in range(P)]
    for i in range(L):
        best[P - 1][i] = stage_cost(P - 1, i, L)
    for k in range(P - 2, -1, -1):
        for i in range(k, L - (P - 1 - k)):
            best[k][i] = min(
                max(stage_cost(k, i, j), best[k + 1][j]) for j in range(i + 1, L - (P - 2 - k))
            )
    # Walk forward, ending each stage at the first layer that keeps the optimum reachable.
    target, ranges, i = best[0][0], [], 0
    for k in range(P - 1):
        j = next(j for j in range(i + 1, L) if max(stage_cost(k, i, j), best[k + 1][j]) <= target)
        ranges.append(range(i, j))
        i = j
    ranges.append(range(i, L))
    return ranges


def partition_rows(
    cfg: ModelConfig,
    ranges: Sequence[range],
    seq_len: int | None = None,
    layer_costs: list[float] | None = None,
    embed_cost: float | None = None,
    head_cost: float | None = None,
) -> list[StageRow]:
    """One JSON-ready dict per stage: stage, layers ("0-3"), num_layers, params, cost, share."""
    check_layer_ranges(cfg.n_layers, len(ranges), ranges)
    costs, embed, head = resolve_costs(cfg, seq_len, layer_costs, embed_cost, head_cost)
    last = len(ranges) - 1
    stage_costs = [
        sum(costs[i] for i in r) + (embed if s == 0 else 0.0) + (head if s == last else 0.0)
        for s, r in enumerate(ranges)
    ]
    total = sum(stage_costs) or 1.0  # all-zero costs: report 0% shares, not a division error
    rows: list[StageRow] = []
    for s, r in enumerate(ranges):
        params = len(r) * cfg.block_params()
        params += cfg.vocab_size * cfg.dim if s == 0 else 0  # embedding
        params += cfg.dim + cfg.dim * cfg.vocab_size if s == last else 0  # final norm + head
        layers = f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)
        rows.append(
            StageRow(
                stage=s,
                layers=layers,
                num_layers=len(r),
                params=params,
                cost=stage_costs[s],
                cost_share=stage_costs[s] / total,
            )
        )
    return rows


def describe_partition(
    cfg: ModelConfig,
    ranges: Sequence[range],
    seq_len: int | None = None,
    layer_costs: list[float] | None = None,
    embed_cost: float | None = None,
    head_cost: float | None = None,
) -> str:
    """A printable table of partition_rows(), with the max/mean stage cost (1.00 = balanced)."""
    rows = partition_rows(cfg, ranges, seq_len, layer_costs, embed_cost, head_cost)
    lines = [f"{'stage':>5}  {'layers':>7}  {'params':>13}  {'cost share':>10}"]
    for row in rows:
        lines.append(
            f"{row['stage']:>5}  {row['layers']:>7}  {row['params']:>13,}  "
            f"{100 * row['cost_share']:>9.1f}%"
        )
    costs = [row["cost"] for row in rows]
    mean = sum(costs) / len(costs)
    imbalance = max(costs) / mean if mean > 0 else 1.0
    lines.append(f"max/mean stage cost: {imbalance:.2f} (1.00 = balanced)")
    return "\n".join(lines)


def balanced_cuts(costs: Sequence[int], num_stages: int) -> list[int]:
    """Start index of every stage after the first: contiguous, non-empty stages whose largest
    total cost is the smallest possible (ties: the earliest cuts)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest max cost of cutting units[:i] into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    cuts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        cuts.append(i)
    return sorted(cuts)[1:]
