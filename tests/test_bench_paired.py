"""``bench runtime``'s paired per-round ratios: the statistic its >= / within-x% claims rest on."""

import statistics

import pytest

from nobubble.app.bench.runtime import RuntimeBench, paired_ratios, summarize


def test_paired_ratios_of_equal_rounds_have_an_interval_of_that_ratio():
    out = paired_ratios([1.04] * 7)
    assert out["rounds"] == 7
    assert out["median"] == out["mean"] == pytest.approx(1.04)
    assert out["mean_ci95"] == [pytest.approx(1.04), pytest.approx(1.04)]
    assert out["faster_rounds"] == 7


# two-sided 95% Student-t critical values (tables): df 5 and 47
T_95 = {5: 2.5706, 47: 2.0117}


def test_paired_ratios_interval_holds_the_mean_and_narrows_with_rounds():
    few = [0.9, 1.1, 0.95, 1.05, 1.0, 1.12]
    many = few * 8  # the same spread over 8x the rounds: the mean's interval about 1/sqrt(8)
    a, b = paired_ratios(few), paired_ratios(many)
    for out, rounds in ((a, few), (b, many)):
        low, high = out["mean_ci95"]
        assert min(rounds) <= low < statistics.fmean(rounds) < high <= max(rounds)
        # the closed form: mean +- t(n - 1) sd / sqrt(n)
        half = T_95[len(rounds) - 1] * statistics.stdev(rounds) / len(rounds) ** 0.5
        assert (high - low) / 2 == pytest.approx(half, rel=1e-4)
    width_a, width_b = (o["mean_ci95"][1] - o["mean_ci95"][0] for o in (a, b))
    # 8x the rounds: 1/sqrt(8) of the width, times the ratio of t's and of the sds (40/47)
    shrink = T_95[47] / T_95[5] * (40 / 47) ** 0.5 / 8**0.5
    assert width_b == pytest.approx(width_a * shrink, rel=1e-4)
    assert a["faster_rounds"] == 3  # 1.0 is a tie, not a win
    assert paired_ratios(few) == a  # the same rounds print the same interval


def test_one_round_has_a_mean_but_no_interval():
    out = paired_ratios([0.97])
    assert out["mean"] == out["median"] == pytest.approx(0.97)
    assert out["mean_ci95"] is None


def test_paired_ratios_refuse_no_rounds():
    with pytest.raises(ValueError, match="at least one round"):
        paired_ratios([])


def test_summary_pairs_a_variant_with_its_torch_twin_round_by_round():
    bench = RuntimeBench(model="tiny", rounds=3, schedules=("1f1b", "paci", "torch-1f1b"))

    def run(tok):
        return {
            "tokens_per_s": tok,
            "utilization": None,
            "peak_activation_bytes": [1],
            "last_loss": 1,
        }

    out = summarize(
        bench,
        {
            "1f1b": [run(110.0), run(90.0), run(100.0)],
            "paci": [run(120.0), run(120.0), run(120.0)],
            "torch-1f1b": [run(100.0), run(100.0), run(80.0)],
        },
    )
    assert out["1f1b"]["vs_torch_twin_rounds"] == pytest.approx([1.1, 0.9, 1.25])
    paired = out["1f1b"]["vs_torch_twin_paired"]
    assert paired["median"] == pytest.approx(1.1)
    assert paired["faster_rounds"] == 2
    assert out["1f1b"]["vs_torch_twin"] == pytest.approx(1.0)  # 100 / 100: the medians'
    assert out["paci"]["vs_torch_twin_paired"] is None  # no twin


def test_rounds_run_the_variants_in_alternating_order(monkeypatch, tmp_path):
    """Every other round reverses the order, so neither side of a pair always runs first."""
    import nobubble.app.bench.runtime as br

    ran: list[str] = []

    def fake(variant):
        ran.append(variant)
        return {
            "tokens_per_s": 100.0,
            "utilization": None,
            "bubble": None,
            "peak_activation_bytes": [1],
            "last_loss": 1.0,
        }

    monkeypatch.setattr(br, "load_data", lambda cfg: None)
    monkeypatch.setattr(
        br, "run_nobubble", lambda cfg, out, log, malloc: fake(cfg.schedule.schedule)
    )
    monkeypatch.setattr(br, "run_torch", lambda bench, variant, out, log: fake(variant))
    monkeypatch.setattr(br.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "work"))
    (tmp_path / "work").mkdir()
    bench = RuntimeBench(model="tiny", rounds=4, schedules=("1f1b", "paci", "torch-1f1b"))
    out = br.bench_runtime(bench, lambda line: None)
    forward, backward = ["1f1b", "paci", "torch-1f1b"], ["torch-1f1b", "paci", "1f1b"]
    assert ran == forward + backward + forward + backward
    # each variant's rounds stay in round order: the pairs are still taken round by round
    assert out["1f1b"]["vs_torch_twin_rounds"] == [1.0] * 4


def test_the_command_prints_the_setup_a_row_per_variant_and_the_pairs(
    monkeypatch, tmp_path, capsys
):
    import nobubble.app.bench.runtime as br
    from nobubble.cli import main

    speeds = iter([100.0, 90.0, 80.0, 100.0, 90.0, 80.0])  # rounds: 1f1b, paci, torch; reversed

    def fake(variant):
        return {
            "tokens_per_s": next(speeds),
            "utilization": [0.5, 0.25] if variant != "torch-1f1b" else None,
            "bubble": 0.3 if variant != "torch-1f1b" else None,
            "peak_activation_bytes": [2**21, 2**22],
            "last_loss": 1.5,
        }

    monkeypatch.setattr(br, "load_data", lambda cfg: None)
    monkeypatch.setattr(
        br, "run_nobubble", lambda cfg, out, log, malloc: fake(cfg.schedule.schedule)
    )
    monkeypatch.setattr(br, "run_torch", lambda bench, variant, out, log: fake(variant))
    monkeypatch.setattr(br.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "work"))
    (tmp_path / "work").mkdir()
    argv = ["bench", "runtime", "--model", "tiny", "--rounds", "2"]
    assert main([*argv, "--schedule", "1f1b,paci,torch-1f1b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model tiny, P=2, M=4") and "2 alternating rounds" in lines[0]
    assert "balance (lightest / heaviest)" in lines[1]
    assert lines[2].split() == [
        "variant",
        "tokens_per_s",
        "spread",
        "vs_1f1b",
        "vs_torch_1f1b",
        "vs_torch_twin",
        "utilization",
        "bubble",
        "peak_act_MB",
        "last_loss",
    ]
    # 1f1b ran at 100 in round 1 and 80 in round 2 (the order reverses), torch at 80 then 100:
    # medians 90 and 90, spread 20/90; paired by round 100/80 and 80/100
    assert lines[3].split()[:6] == ["1f1b", "90", "0.2222", "1", "1", "1"]
    assert lines[3].split()[6:] == ["0.5,0.25", "0.3", "2,4", "1.5"]
    assert lines[5].split()[5:8] == ["-", "-", "-"]  # torch's own row: nothing to compare
    assert lines[6].startswith("1f1b / torch-1f1b, paired by round: median 1.025, mean 1.025")
