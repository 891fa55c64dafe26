"""The memory estimate against what autograd really saves, and the schedule bounds it reads."""

from __future__ import annotations

import itertools

import pytest
import torch

from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import SCHEDULE_NAMES, SCHEDULES, build_schedule
from nobubble.core.schedules.bounds import num_actions, peak_inflight, peak_versions
from nobubble.model import ModelConfig, build_model, model_config, split_model
from nobubble.model.memory import StageLoad, machine_bytes, saved_bytes


def measured_saved_bytes(stage: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: str):
    """Bytes autograd saves in one stage forward, counted as StageWorker counts them: each
    storage once, the stage's own weights excluded."""
    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x, y if stage.is_last else None)
    return sum(seen.values())


GQA = model_config("tiny", vocab_size=300, seq_len=24)  # 4 query heads share 2 kv heads
MHA = ModelConfig(vocab_size=300, dim=48, n_layers=3, n_heads=3, n_kv_heads=3, hidden_dim=96,
                  max_seq_len=24)  # fmt: skip


@pytest.mark.parametrize("cfg", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_saved_bytes_match_what_autograd_saves(cfg, dtype):
    batch, seq_len = 3, 24
    stages = split_model(build_model(cfg, 0), 3)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    hidden = torch.randn(batch, seq_len, cfg.dim, requires_grad=True)
    for stage in stages:
        x = ids if stage.is_first else hidden
        load = StageLoad(len(stage.layer_ids), stage.is_first, stage.is_last, 0, 1, 1)
        expected = saved_bytes(cfg, load, batch, seq_len, dtype)
        assert measured_saved_bytes(stage, x, ids, dtype) == expected, stage.stage


def test_peak_inflight_and_versions_bound_the_ledger():
    for name, p, m, n in itertools.product(SCHEDULE_NAMES, range(1, 6), range(1, 6), (1, 3)):
        if (
            (name == "2bw" and m < p - 1)
            or (name == "interleaved-1f1b" and m % max(1, m // p))
            or (name == "dualpipev" and m < 2 * p)
        ):
            continue  # 2bw needs M >= P-1, interleaved-1f1b whole rounds of M, dualpipev M >= 2P
        info = SCHEDULES[name]
        accum = m if info.uses_accum else None
        schedule = build_schedule(name, p, m, n, accum=accum)
        v = schedule.placement.stages_per_rank
        assert schedule.num_actions() == num_actions(p, m, n, v, info.split_backward)
        for st in build_ledger(schedule).stages:
            assert st.peak_inflight == peak_inflight(name, p, m, n, st.stage), (name, p, m, n)
            assert st.peak_versions <= peak_versions(name, p, m, st.stage), (name, p, m, n)


def test_a_machine_holds_its_heaviest_run_of_consecutive_stages():
    assert machine_bytes([5, 1, 4, 3], 4) == 13  # the emulator: every stage in one process
    assert machine_bytes([5, 1, 4, 3], 2) == 7  # stages 2 and 3
    assert machine_bytes([5, 1, 4, 3], 1) == 5  # one rank per machine: the heaviest stage
