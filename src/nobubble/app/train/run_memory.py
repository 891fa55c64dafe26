"""The memory a training run plans to fill, estimated before it starts (model/memory.py), and
the refusal of a run that would not fit this machine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nobubble.core import util
from nobubble.core.program import peak_inflight
from nobubble.model import model_config
from nobubble.model.memory import FP32, StageLoad, machine_bytes, stage_bytes, stage_loads

# ``cfg`` below is a TrainConfig (app/train/config.py, which calls check_memory on construction)
TrainConfig = Any

# Share of the machine's memory a run may plan to fill; the rest is for the OS, other programs and
# what the estimate leaves out (the allocator's slack, transient copies while the model is built).
MEMORY_SHARE = 0.8
# One Python process with torch imported and the tokens loaded: 0.2 GiB right after `import
# torch`; the estimate plus this matched the peak RSS of short runs of tiny, small and medium.
PROCESS_BYTES = 2**29


def check_memory(cfg: TrainConfig) -> None:
    """Refuse a run whose estimated peak memory exceeds MEMORY_SHARE of this machine's."""
    total = util.physical_memory_bytes()
    if total is None or not _in_host_memory(cfg) or cfg.model.is_hf:
        return  # a Hugging Face model's size is not estimated yet
    available = MEMORY_SHARE * total
    need = memory_bytes(cfg)
    if need <= available:
        return
    seq_len = _largest(lambda t: memory_bytes(cfg, seq_len=t) <= available, cfg.data.seq_len - 1)
    batch = _largest(
        lambda b: memory_bytes(cfg, micro_batch_size=b) <= available, cfg.run.micro_batch_size - 1
    )
    fixes = [f"--seq-len {seq_len} or less"] if seq_len else []
    fixes += [f"--micro-batch-size {batch} or less"] if batch else []
    inflight = max(load.inflight for load in run_stage_loads(cfg))
    raise ValueError(
        f"--seq-len {cfg.data.seq_len} with --micro-batch-size {cfg.run.micro_batch_size} needs "
        f"about {_gib(need)} of memory on this machine (model {cfg.model.model}, {cfg.num_ranks} "
        f"stages, up to {inflight} micro-batches in flight on a stage: saved activations, "
        f"weights, gradients and optimizer state), more than the {_gib(available)} available "
        f"({MEMORY_SHARE:.0%} of {_gib(total)}): use "
        + (", or ".join(fixes) or "a smaller --model (the weights and state alone do not fit)")
    )


def _in_host_memory(cfg: TrainConfig) -> bool:
    """The emulator and CPU ranks keep everything in this machine's memory. CUDA ranks are
    not checked: asking a GPU for its memory would initialize CUDA in this process."""
    if cfg.runtime.runtime == "emulate" or cfg.launch.device == "cpu":
        return True
    if cfg.launch.device == "cuda":
        return False
    import torch

    return not torch.cuda.is_available()


def run_stage_loads(cfg: TrainConfig, seq_len: int | None = None) -> list[StageLoad]:
    """Layers, parameters, micro-batches in flight and weight versions of each stage."""
    seq_len = seq_len or cfg.data.seq_len
    model = model_config(cfg.model.model, cfg.model_vocab_size, seq_len)
    loads = stage_loads(
        model,
        cfg.schedule.name,
        cfg.num_ranks,
        cfg.num_microbatches,
        cfg.run.steps,
        seq_len,
        cfg.model_stages // cfg.num_ranks,
    )
    program = cfg.schedule.program
    if program is None or program.num_stages != len(loads):
        return loads  # a given order of other stages is refused by the run's checks
    # a given order has no closed form: walk its batch
    return [replace(load, inflight=peak_inflight(program, s)) for s, load in enumerate(loads)]


def memory_bytes(
    cfg: TrainConfig, seq_len: int | None = None, micro_batch_size: int | None = None
) -> int:
    """Estimated peak bytes of the stages that share one machine (model/memory.py)."""
    seq_len = seq_len or cfg.data.seq_len
    batch = micro_batch_size or cfg.run.micro_batch_size
    model = model_config(cfg.model.model, cfg.model_vocab_size, seq_len)
    per_stage = [
        stage_bytes(model, load, batch, seq_len, cfg.compute.dtype, cfg.compute.paci_recompute)
        for load in run_stage_loads(cfg, seq_len)
    ]
    if cfg.runtime.runtime == "emulate":  # one process; evaluation merges the stages into a model
        return sum(per_stage) + PROCESS_BYTES + FP32 * model.num_params()
    machine = cfg.stages_per_machine
    return machine_bytes(per_stage, machine) + PROCESS_BYTES * machine


def _largest(fits: Callable[[int], bool], upper: int) -> int:
    """Largest v in 1..upper with fits(v), by bisection (fits holds up to some v, then not);
    0 if none does."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


__all__ = ["MEMORY_SHARE", "PROCESS_BYTES", "check_memory", "memory_bytes", "run_stage_loads"]
