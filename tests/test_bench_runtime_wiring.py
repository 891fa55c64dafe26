"""The wiring of ``nobubble bench runtime``'s torch peers, checked without starting a process:
the M each torch schedule refuses, a model too shallow for v·P stages, the v an interleaved
variant and its torch twin get, and the command line's list of peers. The peers' numbers against
torch's own schedules are in test_torch_pipelining.py."""

from __future__ import annotations

import pytest

from nobubble.app.train.config import TrainConfig


def test_torch_peers_refuse_an_m_their_schedule_cannot_take():
    from nobubble.app.ranks.torch_peer import peer_config

    cfg = TrainConfig.of(model="tiny", stages=2, microbatches=4, micro_batch_size=2, seq_len=32)
    bad = TrainConfig.from_mapping({"microbatches": 5}, base=cfg)
    for peer in ("torch-interleaved-1f1b", "torch-interleaved-zb"):
        with pytest.raises(ValueError, match=rf"{peer} .*M=5 .*--microbatches 4"):
            peer_config(bad, peer)
    few = TrainConfig.from_mapping({"microbatches": 3}, base=cfg)
    with pytest.raises(ValueError, match=r"torch-dualpipev .*M=3 < 2P=4 .*--microbatches 4"):
        peer_config(few, "torch-dualpipev")


def test_bench_refuses_a_model_too_shallow_for_v_times_p_stages_before_any_process():
    from nobubble.app.bench.runtime import RuntimeBench

    # tiny has 4 layers: P=3 ranks of 2 stages need 6
    with pytest.raises(ValueError, match=r"torch-zbv .*--stages 3 cuts the model into 6 stages"):
        RuntimeBench(model="tiny", stages=3, schedules=("1f1b", "torch-zbv"))
    with pytest.raises(ValueError, match=r"6 stages \(3 per rank .*--stages 1 or fewer"):
        RuntimeBench(model="tiny", virtual_stages=3, schedules=("torch-interleaved-1f1b",))


def test_bench_wiring_gives_interleaved_variants_their_v():
    """nobubble's interleaved-1f1b gets --virtual-stages and its torch twin the same cut."""
    from nobubble.app.bench.runtime import RuntimeBench, train_argv

    bench = RuntimeBench(
        model="mini", virtual_stages=4, schedules=("interleaved-1f1b", "torch-interleaved-1f1b")
    )
    argv = train_argv(bench.train_config("interleaved-1f1b"))
    assert argv[argv.index("--virtual-stages") + 1] == "4"
    assert argv[argv.index("--runtime") + 1] == "dist"
    assert bench.train_config("torch-interleaved-1f1b").model_stages == 8
    assert bench.train_config("torch-zbv").model_stages == 4  # v is interleaved's only


def test_cli_names_every_torch_peer():
    from nobubble.app.ranks.torch_peer import TORCH_SCHEDULES
    from nobubble.cli.bench_cmds import TORCH_PEERS

    assert tuple(TORCH_SCHEDULES) == TORCH_PEERS
