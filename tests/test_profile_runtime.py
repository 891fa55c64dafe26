"""scripts/profile-runtime: a function's time is counted inside the training loop only."""

from __future__ import annotations

import cProfile
import importlib.machinery
import importlib.util
import pstats
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile-runtime"


def _script():
    loader = importlib.machinery.SourceFileLoader("profile_runtime", str(SCRIPT))
    spec = importlib.util.spec_from_loader("profile_runtime", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


CLOCK = [0.0]  # the profiler's clock: only work() moves it, so every figure is exact


def work(units: int) -> None:
    CLOCK[0] += units


def first_step() -> None:  # one-time set-up inside the loop
    work(3)


def advance() -> None:  # the loop
    first_step()
    work(5)
    helper()


def helper() -> None:  # called inside and outside the loop
    work(2)


def program() -> None:
    work(4)  # start-up, outside the loop
    advance()
    helper()  # teardown, outside the loop


def test_time_is_attributed_to_the_loop_only_and_set_up_is_left_out():
    profiler = cProfile.Profile(lambda: CLOCK[0])
    profiler.runcall(program)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    key = {k[2]: k for k in stats if k[0] == __file__}
    inside = _script().Loop(stats, [key["advance"]], [key["first_step"]])
    total_work = stats[key["work"]][2]
    in_loop = inside.time(key["work"])
    # 16 units of work: 5 in advance and 2 in helper's call from advance are the loop's; the
    # 3 of the first step's set-up and the 6 outside are not
    assert total_work == 16
    assert in_loop == pytest.approx(7)
    assert inside.share(key["helper"]) == pytest.approx(0.5)  # one call of two
    assert inside.share(key["first_step"]) == 0.0
