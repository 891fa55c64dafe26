"""``nobubble bench memory``'s arithmetic: the parameter count it prints and the bound each rank
is held to (the runs themselves are the benchmark, not a test)."""

from __future__ import annotations

import pytest
import torch

from nobubble.app.bench.memory import MIB, MemoryBench, rank_rows

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("cfg", [MemoryBench(), MemoryBench(hidden=64, intermediate=96, layers=3)])
def test_the_printed_parameter_count_is_the_llamas(cfg, tmp_path):
    from nobubble.app.bench.memory import write_model

    config = transformers.AutoConfig.from_pretrained(write_model(cfg, tmp_path / "m"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_a_rank_is_held_to_its_weights_grads_optimizer_state_and_activations():
    mine = {"rank": 0, "params": 10, "param_bytes": 40 * MIB, "optimizer_bytes": 80 * MIB}
    summary = {
        "memory": [
            {**mine, "activation_bytes": 30 * MIB, "peak_rss": 900 * MIB, "peak_after_model": 560}
        ]
    }
    idle = {
        "memory": [{**mine, "activation_bytes": 0, "peak_rss": 700 * MIB, "peak_after_model": 0}]
    }
    summary["memory"][0]["peak_after_model"] = 550 * MIB
    idle["memory"][0]["peak_after_model"] = 500 * MIB
    (row,) = rank_rows(summary, idle)
    # growth 200 MiB; bound 40 (weights) + 40 (grads) + 80 (Adam) + 30 (activations) = 190
    assert (row["growth_MiB"], row["bound_MiB"], row["holds"]) == (200, 190, False)
    assert (row["weights_MiB"], row["build_MiB"], row["over_MiB"]) == (40, 50, 10)
    summary["memory"][0]["peak_rss"] = 880 * MIB
    assert rank_rows(summary, idle)[0]["holds"]
    # plain paci with checkpointing: the stash of its rebuilds counts in the bound
    summary["memory"][0].update(peak_rss=900 * MIB, stash_bytes=15 * MIB)
    (row,) = rank_rows(summary, idle)
    assert (row["bound_MiB"], row["stash_MiB"], row["holds"]) == (205, 15, True)
    # the last stage stashes nothing: its row has the column too (0), so the table prints
    last = {**summary["memory"][0], "rank": 1, "stash_bytes": 0}
    rows = rank_rows(
        {"memory": [summary["memory"][0], last]},
        {"memory": [*idle["memory"], {**idle["memory"][0], "rank": 1}]},
    )
    assert [r["stash_MiB"] for r in rows] == [15, 0]
    assert (
        "stash_MiB" not in rank_rows({"memory": [{**last, "rank": 0}]}, idle)[0]
    )  # no rank stashed
