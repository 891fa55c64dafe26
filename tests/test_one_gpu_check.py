"""``scripts/one-gpu-check --device cpu --quick``: the dry run of the one-GPU check, so that the
script a lent GPU runs cannot rot between loans.

On CPUs the same code runs: ``nobubble train --runtime dist --backend gloo`` at P = 2 and 4 (the
transport that carries a GPU's tensors through host memory; on a CPU the tensors are already
there), the emulator through ``nobubble.Pipeline``, a user's ``Pipeline``, the resume, the
timeline PNG and the JSON. Every process runs one torch thread, so the runtime must give the
emulator's losses bit for bit, which the test asserts beyond the script's tolerances.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from _dist_helpers import clean_env
from nobubble.data import fetch_shakespeare

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "one-gpu-check"


def load_script() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))  # its helper module, one_gpu_runs
    loader = importlib.machinery.SourceFileLoader("one_gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("one_gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_dry_run_passes_every_check_and_writes_the_json_and_png(tmp_path):
    corpus = tmp_path / "plays.txt"
    corpus.write_text(fetch_shakespeare().read_text()[:150_000])
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--device", "cpu", "--quick",
         "--data", str(corpus), "--budget-s", "3600"],  # a loaded CI machine skips nothing
        env=clean_env(PYTHONPATH=str(ROOT / "src")),
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((out / "one-gpu-check.json").read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert all(c["ok"] for c in checks.values())
    assert report["summary"] == {
        "passed": len(checks),
        "failed": 0,
        "wall_s": report["summary"]["wall_s"],
    }
    for stages, schedule in [(2, "1f1b"), (2, "paci"), (2, "2bw"), (4, "paci")]:
        label = f"P={stages} {schedule} bf16"
        assert checks[f"{label} runtime vs emulator on cpu"]["bitwise"], label
        assert len(checks[f"{label} measured timeline"]["utilization"]) == stages
    resume = checks["P=2 paci resume"]  # the dry run resumes the P=2 paci run of the grid
    assert resume["gap"] == 0.0 and "stopped at step 4" in resume["detail"], resume["detail"]
    for name in ("emulator P=4 paci cpu bf16 vs cpu fp32", "HostClock times the work"):
        assert name in checks
    models = {(f["model"], f["runtime"]) for f in report["throughput"] if f["tokens_per_s"]}
    assert models == {("tiny", "runtime"), ("tiny", "emulator"), ("mini", "emulator"),
                      ("mini", "runtime")}  # fmt: skip
    assert report["skipped"] == [
        "--quick: P=4 with paci only",
        "compiled blocks: on a GPU only",
        "--quick: mini figures for 1f1b only",
    ]
    ttt = report["time_to_target"]
    assert ttt["status"] == "measured" and ttt["by_depth"]["P=2"]["vs_1f1b"]["1f1b"] == 1.0
    assert (out / "timelines.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_check_makes_the_exit_status_non_zero(tmp_path):
    script = load_script()
    check = script.Check(tmp_path, SimpleNamespace(budget_s=60.0))
    check.record("a check that held", True, "fine")
    assert script.exit_status(check.report["summary"]) == 0
    check.record("a check that did not", False, "broken")
    check.attempt("work that raised", lambda: 1 / 0)
    report = json.loads((tmp_path / "one-gpu-check.json").read_text())
    assert report["summary"]["failed"] == 2 and report["summary"]["passed"] == 1
    assert "ZeroDivisionError" in report["checks"][-1]["detail"]
    assert script.exit_status(report["summary"]) == 1
    assert script.exit_status({"passed": 0, "failed": 0}) == 1  # nothing checked is no pass


def test_a_missing_gpu_is_refused_with_the_dry_run_named(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--device", "cuda"],
        env=clean_env(PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "sees no GPU; use --device cpu for the dry run" in done.stderr
