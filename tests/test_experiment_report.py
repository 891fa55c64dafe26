"""The report's targets, statistics, verdict rules and run keys, without training anything."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from nobubble.experiments import (
    analysis,
    grids,
    keys,
    paci_arms,
    report,
    runner,
    stats,
    targets,
)
from nobubble.experiments.runner import RunOutcome, RunSpec

DOCS = Path(__file__).resolve().parents[1] / "docs"

# Paper A (arXiv 2606.30634), Table 2 at 360M: sync | EF | sync start | standard 2BW.
ISSUE_TABLE2 = {
    "adamw": (2.612, 2.640, 2.658, 2.890),
    "muon": (2.578, 2.583, 2.589, 2.590),
    "lion": (2.624, 2.642, 2.639, 2.654),
    "nadam": (2.651, 2.703, 2.695, 2.694),
    "soap": (2.581, 2.590, 2.602, 2.608),
}


# ----- targets ---------------------------------------------------------------------------------
def test_targets_are_paper_a_table_2():
    assert targets.TABLE2_COLUMNS == ("sync", "ef", "sync-start", "standard")
    assert targets.TABLE2 == ISSUE_TABLE2


@pytest.mark.parametrize(
    ("optimizer", "correction", "share"),
    [
        ("adamw", "sync-warmup", 0.84),  # 83.45%: 84% as the issue rounds it
        ("muon", "sync-warmup", 0.08),
        ("lion", "sync-warmup", 0.50),
        ("adamw", "ef", 0.90),
        ("lion", "ef", 0.40),
        ("soap", "ef", 0.67),
        ("muon", "ef", 0.58),  # from the rounded losses; the paper's text says 71%
    ],
)
def test_recoveries_derive_from_the_table(optimizer, correction, share):
    assert targets.recovered(optimizer, correction) == pytest.approx(share, abs=0.006)


def test_stated_muon_recovery_is_quoted_beside_the_derived_one():
    assert targets.STATED_EF_RECOVERY["muon"] == 0.71
    table = targets.table2_markdown()
    assert "| muon | 2.578 | 2.583 | 2.589 | 2.590 | +0.012 | 58.3% (stated: 71%) | 8.3% |" in table
    assert (
        "| adamw | 2.612 | 2.640 | 2.658 | 2.890 | +0.278 | 89.9% (stated: 90%) | 83.5% |" in table
    )


def test_report_prints_rules_and_targets_before_any_number(tmp_path):
    target = tmp_path / "results.md"
    report.write_report(tmp_path / "no-runs", target)
    text = target.read_text()
    assert text.index("## Verdict rules") < text.index("## The papers' targets")
    assert text.index("## The papers' targets") < text.index("## One-step delay")
    for rule in stats.RULES.values():
        assert rule in text
    assert targets.table2_markdown() in text
    assert "20-30%" not in text


@pytest.mark.parametrize("page", ["results.md", "results-discussion.md"])
def test_docs_drop_the_wrong_targets(page):
    text = (DOCS / page).read_text()
    assert "~20-30%" not in text and "about 20-30%" not in text
    assert "no EF figure for Lion" not in text


# ----- statistics ------------------------------------------------------------------------------
# two-sided 95% critical values of Student's t, as printed in statistics tables
T_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 9: 2.262}
T_TABLE |= {10: 2.228, 15: 2.131, 20: 2.086, 29: 2.045, 30: 2.042}


@pytest.mark.parametrize(("df", "value"), sorted(T_TABLE.items()))
def test_t_critical_matches_the_tables(df, value):
    assert stats.t_critical(df) == pytest.approx(value, abs=5e-4)


def test_t_critical_other_levels_and_limits():
    assert stats.t_critical(5, 0.99) == pytest.approx(4.032, abs=5e-4)
    assert stats.t_critical(10, 0.90) == pytest.approx(1.812, abs=5e-4)
    assert stats.t_critical(2000) == pytest.approx(1.961, abs=5e-4)  # the normal's 1.960
    with pytest.raises(ValueError, match="df >= 1"):
        stats.t_critical(0)


def test_interval_of_three_values():
    iv = stats.interval({2: 3.0, 0: 1.0, 1: 2.0})
    assert iv["seeds"] == [0, 1, 2] and iv["values"] == [1.0, 2.0, 3.0]
    half = 4.3027 / math.sqrt(3)  # t(2) * sd 1 / sqrt(n)
    assert (iv["mean"], iv["sd"]) == (2.0, 1.0)
    assert (iv["lo"], iv["hi"]) == (pytest.approx(2 - half, 1e-4), pytest.approx(2 + half, 1e-4))
    assert stats.interval({0: 1.0})["lo"] is None


def test_pairs_by_seed_not_by_sorted_value():
    assert stats.diff({0: 1.0, 1: 5.0, 2: 9.0}, {1: 2.0, 0: 4.0}) == {0: -3.0, 1: 3.0}


def _outcome(name: str, value: float, **labels) -> RunOutcome:
    spec = RunSpec(name, {}, labels)
    return RunOutcome(spec, Path(name), {"val_loss": value}, [{"step": 1, "val_loss": value}])


def test_delay_analysis_pairs_runs_by_their_seed(tmp_path):
    sync = {0: 4.0, 1: 5.0, 2: 4.5}
    delayed = {0: 5.1, 1: 5.0, 2: 4.9}
    runs = [
        _outcome(f"s{s}", v, optimizer="adamw", schedule="1f1b", seed=s) for s, v in sync.items()
    ]
    runs += [
        _outcome(f"d{s}", v, optimizer="adamw", schedule="2bw", seed=s) for s, v in delayed.items()
    ]
    summary = analysis.analyze_delay(
        {o.spec.name: o for o in runs}, tmp_path, ("adamw",), {"adamw": 1e-2}
    )
    gap = summary["optimizers"]["adamw"]["gap"]
    assert gap["seeds"] == [0, 1, 2]
    assert gap["values"] == pytest.approx([1.1, 0.0, 0.4])  # by sorted value: 0.9, 0.5, 0.1


def _iv(*values: float) -> dict:
    return stats.interval(dict(enumerate(values)))


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ((0.001, -0.002, 0.003), stats.MATCHES),
        ((0.5, 0.6, 0.55), stats.ABOVE),
        ((-0.5, -0.6, -0.55), stats.BELOW),
        ((0.03, 0.04, 0.05), stats.ABOVE),  # above 0, reaching past the margin: worse
        ((-0.1, 0.1, 0.0), stats.INCONCLUSIVE),  # straddles 0 and the margin
        ((0.5, 0.6), stats.INCONCLUSIVE),  # two seeds never carry a verdict
    ],
)
def test_classification_follows_the_rules(values, expected):
    assert stats.classify(_iv(*values), stats.LOSS_MARGIN) == expected


def test_every_verdict_names_its_interval_seeds_and_rule():
    text = stats.describe(_iv(0.5, 0.6, 0.55), stats.LOSS_MARGIN, "2bw - sync")
    assert re.search(r"95% CI \[\+0\.\d{4}, \+0\.\d{4}\], 3 seeds: above \(R2, m=0\.02\)", text)
    assert "inconclusive (2 seeds; R4)" in stats.describe(_iv(0.5, 0.6), 0.02, "x")
    summary = {
        "optimizers": {
            "adamw": {"gap": _iv(0.9, 1.0, 0.95)},
            "muon": {"gap": _iv(0.2, 0.25, 0.22)},
        },
        "adamw_gap_minus_muon_gap": _iv(0.7, 0.75, 0.73),
    }
    parts = report.verdict_delay(summary)
    assert len(parts) == 3
    assert parts[0].startswith("reproduced: AdamW gap - Muon gap")
    assert parts[2].startswith("not reproduced: muon 2bw - sync")  # the paper's +0.012 matches
    for part in parts:
        assert "95% CI [" in part and "3 seeds" in part and re.search(r"\(R[1-4], m=", part)


def test_ef_verdict_compares_the_recovered_share_with_table_2():
    shares = {0: 0.88, 1: 0.91, 2: 0.90}
    row = {
        "gap_none": _iv(0.9, 1.0, 0.95),
        "ef": {"recovered": stats.interval(shares)},
        "sync-warmup": {"recovered": _iv(0.1, 0.12, 0.08)},
    }
    parts = report.verdict_ef({"optimizers": {"adamw": row}})
    assert parts[0].startswith("reproduced: adamw EF recovers +90% [")
    assert parts[1].startswith("not reproduced: adamw sync start")  # 10% against 83.5%
    no_gap = report.verdict_ef(
        {"optimizers": {"adamw": {**row, "gap_none": _iv(0.0, 0.01, -0.01)}}}
    )
    assert all("no established gap" in part for part in no_gap)


def test_depth_and_paci_verdicts_follow_the_papers_classes():
    growth = {"pipedream": _iv(0.3, 0.35, 0.4), "pipedream+EF": _iv(0.2, 0.25, 0.3)}
    growth["2bw"] = _iv(0.0, 0.002, -0.002)
    depth = {
        "growth_depths": [2, 8],
        "growth": {"muon": growth},
        "gaps": {"muon": {"pipedream+EF": {"4": _iv(0.005, -0.004, 0.0)}}},
    }
    parts = report.verdict_depth(depth)
    assert len(parts) == 4 and all(p.startswith("reproduced: muon ") for p in parts), parts
    pair = {
        "optimizer": "adamw",
        "stages": 4,
        "a": 4,
        "diff": _iv(0.6, 0.62, 0.61),
        "max_crossed": [1, 1, 1, 0],
        "peak_activation_bytes": {"flush": [1, 1], "paci": [1, 1]},
    }
    (part,) = report.verdict_paci({"pairs": [pair]})
    assert part.startswith("not reproduced: adamw a=4 paci - flush +0.6100, 95% CI")
    assert "within the bound [1, 1, 1, 0]" in part and "equal to flush's" in part


def test_paci_arms_pair_each_arm_with_its_flush_by_seed():
    vals = {
        ("1f1b", None): (4.0, 4.5, 5.0),
        ("paci", None): (4.2, 4.6, 5.3),
        (None, "bf16"): (4.1, 4.55, 5.05),
        (None, "flush-bf16"): (4.0, 4.5, 5.0),
        (None, "pipedream"): (4.3, 4.7, 5.4),
    }
    runs = []
    for (schedule, arm), per_seed in vals.items():
        for seed, v in enumerate(per_seed):
            labels = {"optimizer": "adamw", "a": 4, "seed": seed}
            labels |= {"schedule": schedule} if arm is None else {"study": "arms", "arm": arm}
            runs.append(_outcome(f"{schedule or arm}-s{seed}", v, **labels))
    summary = paci_arms.analyze_arms({o.spec.name: o for o in runs})
    assert summary is not None and summary["paper_b_arm"] == "bf16"
    arms = summary["arms"]
    assert stats.per_seed(arms["fp32"]["minus_flush"]) == pytest.approx({0: 0.2, 1: 0.1, 2: 0.3})
    assert stats.per_seed(arms["pipedream"]["minus_flush"]) == pytest.approx(
        {0: 0.3, 1: 0.2, 2: 0.4}
    )
    assert stats.per_seed(arms["bf16"]["minus_flush_bf16"]) == pytest.approx(
        {0: 0.1, 1: 0.05, 2: 0.05}
    )
    parts = report.verdict_paci({"pairs": [], "arms": summary})
    bf16 = [p for p in parts if "paper B's setting" in p]
    assert len(bf16) == 1 and "paci bf16 a=4 - flush bf16 +0.0667, 95% CI" in bf16[0]
    assert any("arm pipedream: pipedream a=4 - flush +0.3000" in p for p in parts)


def test_report_marks_old_summaries_stale(tmp_path):
    (tmp_path / "delay-vs-optimizer").mkdir()
    old = {"optimizers": {"adamw": {"gap": 0.9, "gap_per_seed": [0.9]}}, "seeds": 2}
    (tmp_path / "delay-vs-optimizer" / "summary.json").write_text(json.dumps(old))
    result = report.write_report(tmp_path, tmp_path / "results.md")
    assert result["verdicts"]["delay-vs-optimizer"] == "inconclusive (stale summary)"
    assert "predates seed-paired statistics" in (tmp_path / "results.md").read_text()


# ----- grids -----------------------------------------------------------------------------------
def test_every_verdict_pair_has_enough_seeds_in_the_full_grids():
    profile = grids.FULL
    lrs = {opt: profile.lr_grid[opt][0] for opt in profile.optimizers}
    assert profile.seeds >= stats.MIN_SEEDS
    for make in (grids.delay_vs_optimizer, grids.error_feedback, grids.depth, grids.paci):
        seeds: dict[tuple, set[int]] = {}
        for spec in make(profile, lrs, profile.seeds):
            labels = dict(spec.labels)
            side = labels.get("study") or labels.get("runtime") or labels.get("lam", 1.0) != 1.0
            if side or "seed" not in labels:  # side studies carry no verdict
                assert side, f"{spec.name}: a verdict run without a seed label"
                continue
            seed = labels.pop("seed")
            seeds.setdefault(tuple(sorted(labels.items())), set()).add(seed)
        assert seeds, make.__name__
        assert all(len(s) >= stats.MIN_SEEDS for s in seeds.values()), (make.__name__, seeds)


# ----- run keys --------------------------------------------------------------------------------
BASE = {**grids.QUICK.base}


def test_run_key_is_readable_and_stable():
    spec = RunSpec("2bw-adamw-s0", {"optimizer": "adamw", "schedule": "2bw", "stages": 1})
    key = runner.run_key(spec, BASE, code="v1")
    assert re.fullmatch(r"2bw-adamw-s0-[0-9a-f]{8}", key)
    assert runner.run_key(spec, dict(BASE), code="v1") == key


@pytest.mark.parametrize(
    ("field", "value"), [("lr", 1e-4), ("weight_decay", 0.0), ("momentum", 0.9), ("dtype", "bf16")]
)
def test_a_changed_setting_changes_the_key(field, value):
    spec = RunSpec("run", {"optimizer": "adamw", "stages": 1})
    changed = RunSpec("run", {**spec.overrides, field: value})
    assert runner.run_key(changed, BASE, code="v1") != runner.run_key(spec, BASE, code="v1")


def test_the_key_covers_the_resolved_config_only():
    spec = RunSpec("run", {"optimizer": "adamw", "stages": 1})
    explicit_default = RunSpec("run", {**spec.overrides, "weight_decay": 0.1, "out": "x"})
    assert runner.run_key(explicit_default, BASE, code="v1") == runner.run_key(spec, BASE, "v1")


def test_a_changed_code_version_changes_the_key(monkeypatch):
    spec = RunSpec("run", {"optimizer": "adamw", "stages": 1})
    monkeypatch.setattr(keys, "code_version", lambda: "before")
    before = runner.run_key(spec, BASE)
    monkeypatch.setattr(keys, "code_version", lambda: "after")
    assert runner.run_key(spec, BASE) != before


def test_code_version_ignores_comments_and_docstrings_not_code(tmp_path):
    module = tmp_path / "optim" / "step.py"
    module.parent.mkdir()
    module.write_text('"""Doc."""\nLR = 1\n')
    version = keys.code_version(tmp_path)
    module.write_text('"""Another doc."""\n# a comment\nLR = (\n    1\n)\n')
    assert keys.code_version(tmp_path) == version
    module.write_text('"""Doc."""\nLR = 2\n')
    assert keys.code_version(tmp_path) != version
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "report.py").write_text("X = 1\n")  # not training code
    module.write_text('"""Doc."""\nLR = 1\n')
    assert keys.code_version(tmp_path) == version


def test_training_sources_cover_the_numerics_and_skip_the_readers():
    names = set(keys.training_sources())
    for name in ("model/gpt.py", "optim/build.py", "exec/worker.py", "core/schedules/paci.py"):
        assert name in names
    for name in ("core/ir.py", "core/deps.py", "core/ledger.py", "config.py", "train.py"):
        assert name in names
    assert not any(n.startswith(("experiments/", "core/viz/")) for n in names)
