"""Benchmarks that print figures (never timed tests): the emulator against plain training.

``nobubble bench emulator`` trains the same model on the same batches (M micro-batches of B
sequences per step, random token ids: timing does not depend on their values) with plain
gradient accumulation and with the emulator for each schedule, alternating the variants round by
round so that every ratio comes from the same conditions, and reports the median time per step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import (
    build_schedule,
    resolve_virtual_stages,
    schedule_info,
)
from nobubble.engine import InProcessTransport, StageWorker
from nobubble.model import build_model, lm_loss, model_config, partition_layers, split_model
from nobubble.optim import NoCorrection, OptimConfig, build_optimizer
from nobubble.runtime.emulator import Emulator, rank_interpreters


@dataclass(frozen=True)
class EmulatorBench:
    model: str = "small"
    vocab_size: int = 4096
    seq_len: int = 128
    micro_batch_size: int = 8
    stages: int = 2
    microbatches: int = 4
    steps: int = 6  # per round; the first is a warm-up and not timed
    rounds: int = 3
    schedules: tuple[str, ...] = ("1f1b", "paci", "2bw")
    optimizer: str = "adamw"
    seed: int = 0
    api: bool = True  # also time each schedule through nobubble.Pipeline ("api-<name>")
    # also through the Pipeline with each block torch.compile'd ("compile-<name>"); the first
    # step of a round (the compile) is the untimed warm-up
    compile: bool = False

    def __post_init__(self) -> None:
        for name in self.schedules:
            schedule_info(name)  # an unknown name gets the list of known ones


def _batches(cfg: EmulatorBench) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + m)
        ids = torch.randint(
            0, cfg.vocab_size, (cfg.micro_batch_size, cfg.seq_len + 1), generator=gen
        )
        return ids[:, :-1], ids[:, 1:]

    return batch


def _time_steps(step: Callable[[int], None], steps: int) -> list[float]:
    times = []
    for j in range(steps):
        t0 = time.perf_counter()
        step(j)
        times.append(time.perf_counter() - t0)
    return times[1:]  # drop the warm-up step


def plain_steps(cfg: EmulatorBench) -> list[float]:
    """Plain gradient accumulation on the whole model: the reference the emulator must meet."""
    mcfg = model_config(cfg.model, cfg.vocab_size, cfg.seq_len)
    model = build_model(mcfg, cfg.seed)
    opt = build_optimizer(
        OptimConfig(name=cfg.optimizer, clip_norm=None), list(model.named_parameters())
    )
    batch, m_per_step = _batches(cfg), cfg.microbatches

    def step(j: int) -> None:
        for i in range(m_per_step):
            x, y = batch(j * m_per_step + i)
            (model(x, y) / m_per_step).backward()
        opt.step()
        opt.zero_grad()

    return _time_steps(step, cfg.steps)


def emulator_steps(cfg: EmulatorBench, name: str) -> list[float]:
    mcfg = model_config(cfg.model, cfg.vocab_size, cfg.seq_len)
    schedule = build_schedule(name, cfg.stages, cfg.microbatches, cfg.steps)
    ranges = partition_layers(mcfg, schedule.num_stages, seq_len=cfg.seq_len)  # v·P stages
    stages = split_model(build_model(mcfg, cfg.seed), schedule.num_stages, ranges)
    ledger = build_ledger(schedule)
    ocfg = OptimConfig(name=cfg.optimizer, clip_norm=None)
    batch = _batches(cfg)
    workers = [
        StageWorker(
            m,
            schedule,
            ledger.stages[s],
            build_optimizer(ocfg, list(m.named_parameters())),
            NoCorrection(),
            batch,
            lambda j: ocfg.lr,
            loss_fn=lm_loss,
        )
        for s, m in enumerate(stages)
    ]
    transport = InProcessTransport(schedule.num_stages)
    emulator = Emulator(schedule, rank_interpreters(schedule, workers, transport), transport)
    return _time_steps(lambda j: emulator.run(j + 1), cfg.steps)


def api_steps(cfg: EmulatorBench, name: str, compile: bool = False) -> list[float]:
    """The same run through the public ``nobubble.Pipeline``: its overhead over the direct one
    (``compile``: with its blocks compiled)."""
    from nobubble.api.pipeline import Pipeline

    mcfg = model_config(cfg.model, cfg.vocab_size, cfg.seq_len)
    num_stages = cfg.stages * resolve_virtual_stages(name, None)
    ranges = partition_layers(mcfg, num_stages, seq_len=cfg.seq_len)
    stages = split_model(build_model(mcfg, cfg.seed), num_stages, ranges)
    pipe = Pipeline(
        list(stages),
        lm_loss,
        schedule=name,
        microbatches=cfg.microbatches,
        optimizer=cfg.optimizer,
        lr=OptimConfig().lr,
        steps=cfg.steps,
        compile=compile,
    )
    batch, m = _batches(cfg), cfg.microbatches

    def step(j: int) -> None:
        pieces = [batch(j * m + i) for i in range(m)]
        pipe.step(torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces]))
        if j + 1 == cfg.steps:
            pipe.drain()

    return _time_steps(step, cfg.steps)


def bench_emulator(
    cfg: EmulatorBench, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    variants: dict[str, Callable[[], list[float]]] = {"plain": lambda: plain_steps(cfg)}
    for name in cfg.schedules:
        variants[name] = lambda name=name: emulator_steps(cfg, name)  # type: ignore[misc]
        if cfg.api:
            variants[f"api-{name}"] = lambda name=name: api_steps(cfg, name)  # type: ignore[misc]
        if cfg.compile:
            variants[f"compile-{name}"] = lambda name=name: api_steps(cfg, name, True)  # type: ignore[misc]
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(cfg.rounds):
        for key, run in variants.items():  # alternate: every round visits every variant
            if progress is not None:
                progress(f"round {r + 1}/{cfg.rounds}: {key}")
            samples[key] += run()
    plain = statistics.median(samples["plain"])
    tokens = cfg.microbatches * cfg.micro_batch_size * cfg.seq_len
    return {
        key: {
            "median_step_s": statistics.median(v),
            "steps_timed": len(v),
            "tokens_per_s": tokens / statistics.median(v),
            "overhead_vs_plain": statistics.median(v) / plain - 1.0,
        }
        for key, v in samples.items()
    }
