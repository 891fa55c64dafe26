"""Memory of one pipeline stage while it trains, estimated from sizes alone.

Torch-free, like ``config`` and ``partition``, so a training config can refuse a run that cannot
fit before anything is built. Two parts:

- saved activations: the tensors autograd keeps for backward, per micro-batch in flight, counted
  the way ``StageWorker`` measures them (each storage once, weights excluded). The counts below
  were read off the autograd graph of ``gpt.py`` under torch 2.13 on the CPU, where RMSNorm is
  decomposed into pow, rsqrt and two multiplies and attention runs the flash kernel, which
  saves a log-sum-exp per query head instead of the T x T probabilities; tests/test_memory.py
  checks them against measured bytes.
- state: fp32 weights (one copy per live weight version), gradients and two optimizer moments
  (AdamW and NAdam keep two; Muon and Lion one, so this is an upper bound for them).
"""

from __future__ import annotations

from dataclasses import dataclass

from nobubble.core.schedules.bounds import peak_inflight, peak_versions
from nobubble.model.config import ModelConfig
from nobubble.model.partition import partition_layers, partition_rows

FP32, BF16, INT64 = 4, 2, 8


def block_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """Bytes one block saves for backward per token.

    fp32: each RMSNorm keeps its input, the normalized input and (as the next matmul's input)
    its output: 6 x dim; the attention keeps the rotated q (dim), k and v (kv_dim each) and its
    output, which is also wo's input (dim); SwiGLU keeps gate, up, silu(gate) and their product
    (4 x hidden). bf16 autocast keeps the norms' input and normalized input in fp32 (4 x dim)
    but a bf16 copy of the normed input for each of wq, wk, wv, w1, w3 (5 x dim), plus q and
    the attention output in bf16 (2 x dim). Both keep two rstd and a log-sum-exp per head.
    """
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    stats = FP32 * (2 + cfg.n_heads)
    if dtype == "bf16":
        return FP32 * 4 * cfg.dim + BF16 * (7 * cfg.dim + 2 * kv_dim + 4 * cfg.hidden_dim) + stats
    return FP32 * (8 * cfg.dim + 2 * kv_dim + 4 * cfg.hidden_dim) + stats


def head_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """Bytes the final norm, head and cross-entropy save per token: the norm as in a block
    (its output is the head's input, a bf16 copy under autocast), the fp32 log-probabilities
    over the vocabulary and the int64 target."""
    if dtype == "bf16":
        return FP32 * (2 * cfg.dim + cfg.vocab_size + 1) + BF16 * cfg.dim + INT64
    return FP32 * (3 * cfg.dim + cfg.vocab_size + 1) + INT64


def matmul_params(cfg: ModelConfig, num_layers: int, is_last: bool) -> int:
    """Weights that go through a matmul; bf16 autocast saves a cast copy of each per forward."""
    block = cfg.block_params() - 2 * cfg.dim  # minus the two RMSNorm gains
    return num_layers * block + (cfg.dim * cfg.vocab_size if is_last else 0)


@dataclass(frozen=True)
class StageLoad:
    """What a stage holds: its blocks, its ends, and the schedule's peaks on it."""

    num_layers: int
    is_first: bool
    is_last: bool
    params: int  # embedding, blocks, final norm and head as the stage holds them
    inflight: int  # most micro-batches held for backward at once
    versions: int  # most weight versions alive at once


def stage_loads(
    cfg: ModelConfig,
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    num_steps: int,
    seq_len: int,
    virtual: int = 1,
) -> list[StageLoad]:
    """Each stage's load under ``schedule`` with the default split (``partition_layers``):
    ``num_stages`` is P, the ranks, each holding ``virtual`` stages."""
    ranges = partition_layers(cfg, virtual * num_stages, seq_len=seq_len)
    rows = partition_rows(cfg, ranges, seq_len=seq_len)
    return [
        StageLoad(
            num_layers=len(layers),
            is_first=s == 0,
            is_last=s == len(ranges) - 1,
            params=row["params"],
            inflight=peak_inflight(schedule, num_stages, num_microbatches, num_steps, s),
            versions=peak_versions(schedule, num_stages, num_microbatches, s),
        )
        for s, (layers, row) in enumerate(zip(ranges, rows, strict=True))
    ]


def saved_bytes(
    cfg: ModelConfig, load: StageLoad, micro_batch_size: int, seq_len: int, dtype: str
) -> int:
    """Activation bytes one micro-batch keeps on the stage until its backward."""
    tokens = micro_batch_size * seq_len
    total = load.num_layers * tokens * block_bytes_per_token(cfg, dtype)
    total += FP32 * seq_len * cfg.head_dim  # rotary cos and sin, (T, head_dim/2) each
    if load.is_first:
        total += INT64 * tokens  # token ids, kept by the embedding
    if load.is_last:
        total += tokens * head_bytes_per_token(cfg, dtype) + FP32  # + the loss's total weight
    if dtype == "bf16":
        total += BF16 * matmul_params(cfg, load.num_layers, load.is_last)
    return total


def backward_workspace_bytes(
    cfg: ModelConfig, load: StageLoad, micro_batch_size: int, seq_len: int
) -> int:
    """Transient bytes of the one backward running: the gradients of one block's activations,
    and on the last stage the gradients of the log-probabilities and of the logits, two more
    (B, T, vocab) fp32 tensors next to the saved log-probabilities."""
    tokens = micro_batch_size * seq_len
    logits = 2 * FP32 * tokens * cfg.vocab_size if load.is_last else 0
    return tokens * block_bytes_per_token(cfg, "fp32") + logits


def stage_bytes(
    cfg: ModelConfig,
    load: StageLoad,
    micro_batch_size: int,
    seq_len: int,
    dtype: str,
    recompute: bool = False,
) -> int:
    """Peak bytes of one stage: activations in flight, backward workspace, weights and state.

    ``recompute`` keeps only each micro-batch's stage input and rebuilds one graph at a time.
    """
    graph = saved_bytes(cfg, load, micro_batch_size, seq_len, dtype)
    if recompute:
        width = INT64 if load.is_first else FP32 * cfg.dim
        held = load.inflight * width * micro_batch_size * seq_len + graph
    else:
        held = load.inflight * graph
    state = FP32 * load.params * (load.versions + 3)  # weights per version, grad, 2 moments
    return held + backward_workspace_bytes(cfg, load, micro_batch_size, seq_len) + state


def machine_bytes(per_stage: list[int], stages_per_machine: int) -> int:
    """Peak bytes of the heaviest machine: rank s runs stage s, and a machine holds
    ``stages_per_machine`` consecutive ranks."""
    window = max(1, min(stages_per_machine, len(per_stage)))
    return max(sum(per_stage[i : i + window]) for i in range(len(per_stage) - window + 1))
