"""The delay corrections of issue 34 (``--correction ef | predict | delay-lr``) on every
asynchronous schedule, against loops written out from docs/semantics.md in tests/_reference.py
(which never touch nobubble.engine): exactness at delay 0, the reference numbers, checkpoints and
resume, memory, and the refusals."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from _reference import CorrectedLoop
from nobubble import Pipeline
from nobubble.optim import (
    DelayAwareLR,
    DelayCorrection,
    ErrorFeedback,
    NoCorrection,
    WeightPrediction,
    make_correction,
)
from test_emulator_oracles import EmuRun, assert_bitwise, assert_matches, emulate

ASYNC = [("2bw", None), ("pipedream", 1), ("pipedream", 2), ("paci", 2), ("paci", 4)]
FACTORIES: dict[str, Callable[[], DelayCorrection]] = {
    "ef": lambda: ErrorFeedback(1.0),
    "predict": WeightPrediction,
    "delay-lr": lambda: DelayAwareLR(4),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def corrected(name: str, accum: int | None, correction: str, num_stages: int = 4) -> EmuRun:
    steps = 12 if accum == 1 else 6
    return emulate(name, num_stages, num_steps=steps, accum=accum, correction=FACTORIES[correction])


def reference(run: EmuRun, correction: str) -> CorrectedLoop:
    options = {"predict": {"predict": True}, "ef": {"ef_lam": 1.0}, "delay-lr": {"delay_lr": 4}}
    return CorrectedLoop(run.schedule, run.ledger, **options[correction])  # type: ignore[arg-type]


# ----- 1. at delay 0 every correction is the plain update, bit for bit --------------------------
@pytest.mark.parametrize("correction", sorted(FACTORIES))
def test_every_correction_at_delay_zero_is_no_correction_bitwise(correction: str) -> None:
    # paci on one stage: each forward's backward comes before the next step, so every delay is 0
    run = corrected("paci", 4, correction, num_stages=1)
    assert {d for st in run.ledger.stages for d in st.delay} == {0}
    assert_bitwise(run, emulate("paci", 1, num_steps=6, accum=4), f"paci P=1 {correction}")


def test_delay_zero_leaves_each_rule_untouched() -> None:
    assert DelayAwareLR(10).lr_factor(0, 0.0) == 1.0
    assert DelayAwareLR(10).lr_factor(3, 0.0) == 1.0
    assert DelayAwareLR(10).lr_factor(10, 2.0) == 1.0  # faded out
    assert DelayAwareLR(10).lr_factor(0, 1.0) == 0.5  # delay 1 starts at half the lr
    ends = []
    for correction in (ErrorFeedback(1.0), NoCorrection()):
        y = torch.tensor([1.0, -2.0])
        for step in range(5):  # EF from the third step would move y if the delay counted
            correction.apply([y], lambda y=y, k=step: y.sub_(0.1 * (k + 1) * y), delay=0.0)
        ends.append(y)
    assert torch.equal(ends[0], ends[1])


# ----- 2. every correction equals its written-out reference ------------------------------------
@pytest.mark.parametrize("correction", sorted(FACTORIES))
@pytest.mark.parametrize(("name", "accum"), ASYNC)
def test_correction_equals_written_out_reference(
    name: str, accum: int | None, correction: str
) -> None:
    run = corrected(name, accum, correction)
    loop = reference(run, correction)
    ref = loop.run()
    assert_matches(run, ref, f"{name} a={accum} {correction}")
    plain = emulate(name, 4, num_steps=12 if accum == 1 else 6, accum=accum)
    gap = max(float((run.params[n] - p).abs().max()) for n, p in plain.params.items())
    assert gap > 1e-6, f"{correction} changed nothing on {name}: the test proves nothing"
    if correction == "predict":
        assert loop.predicted > 0


def test_prediction_reads_one_version_ahead_under_2bw() -> None:
    """2BW + predict is x[j+1] = x[j] - u(g_j(x[j-1] + (x[j-1] - x[j-2]))) on every stage:
    the same numbers for every P (P=1 included), as plain 2BW."""
    runs = {p: emulate("2bw", p, correction=WeightPrediction) for p in (1, 2, 4)}
    assert_bitwise(runs[1], runs[2], "2bw+predict P=1 vs P=2")
    assert_bitwise(runs[1], runs[4], "2bw+predict P=1 vs P=4")


# ----- 3. memory: predictions are weight copies, counted ----------------------------------------
# Peak weight copies per stage (master, stashes and predictions; docs/semantics.md), plain ->
# predict. A prediction exists from the step that makes its version until its last reader, one
# per (version, delay) pair: PipeDream with a=2 reads one version at two delays.
PREDICTION_COPIES = [
    ("2bw", None, 2, [2, 2], [3, 3]),
    ("paci", 4, 2, [1, 1], [2, 1]),
    ("pipedream", 1, 4, [4, 3, 2, 1], [5, 4, 3, 1]),
    ("pipedream", 2, 4, [3, 2, 2, 1], [6, 3, 3, 1]),
]


@pytest.mark.parametrize(("name", "accum", "num_stages", "plain", "predicted"), PREDICTION_COPIES)
def test_prediction_memory_is_counted_as_live_weight_copies(
    name: str, accum: int | None, num_stages: int, plain: list[int], predicted: list[int]
) -> None:
    runs = [
        emulate(name, num_stages, num_steps=8, accum=accum, correction=factory)
        for factory in (NoCorrection, WeightPrediction)
    ]
    assert [[w.versions.peak_live for w in run.workers] for run in runs] == [plain, predicted]


# ----- 4. checkpoints and resume ----------------------------------------------------------------
def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
        nn.Tanh(), nn.Linear(16, 4),
    )  # fmt: skip


def _pipe(schedule: str, correction: str, steps: int) -> Pipeline:
    model = _model()
    stages = [model[:2], model[2:4], model[4:6], model[6:]]
    options: dict = {"delay_lr_steps": 5} if correction == "delay-lr" else {}
    return Pipeline(
        stages, nn.functional.mse_loss, schedule=schedule, microbatches=4, optimizer="adamw",
        lr=3e-2, correction=correction, steps=steps, **options,
    )  # fmt: skip


def _batch(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(j)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


@pytest.mark.parametrize("correction", sorted(FACTORIES))
@pytest.mark.parametrize("schedule", ["2bw", "paci", "pipedream"])
def test_correction_state_checkpoints_and_resumes_exactly(schedule: str, correction: str) -> None:
    steps, cut = 8, 4
    whole = _pipe(schedule, correction, steps)
    for j in range(steps):
        whole.step(*_batch(j))
        if j + 1 == cut:
            whole.drain()  # the same drain point as the resumed run's
    whole.drain()
    first = _pipe(schedule, correction, steps)
    for j in range(cut):
        first.step(*_batch(j))
    first.drain()
    state = first.state_dict()
    if correction == "predict" and schedule == "2bw":  # batch 4 reads version 3's prediction
        parts = state.get("stages", state)
        assert "predicted" in repr(parts)
    second = _pipe(schedule, correction, steps)
    second.load_state_dict(state)
    for j in range(cut, steps):
        second.step(*_batch(j))
    second.drain()
    for a, b in zip(whole.stages, second.stages, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), f"{schedule}+{correction}: {name} differs after resume"


def test_a_predicting_checkpoint_is_refused_without_prediction() -> None:
    pipe = _pipe("2bw", "predict", 8)
    for j in range(4):
        pipe.step(*_batch(j))
    pipe.drain()
    plain = _pipe("2bw", "none", 8)
    with pytest.raises(ValueError, match="predicted weights"):
        plain.load_state_dict(pipe.state_dict())


# ----- 5. refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "10"])
def test_bad_delay_lr_steps_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="delay_lr_steps"):
        _pipe_kw(correction="delay-lr", delay_lr_steps=bad)


def test_delay_lr_steps_without_delay_lr_is_refused() -> None:
    with pytest.raises(ValueError, match="applies to correction='delay-lr' only"):
        _pipe_kw(correction="ef", delay_lr_steps=10)


@pytest.mark.parametrize("correction", ["predict", "delay-lr", "ef"])
def test_corrections_of_a_synchronous_schedule_are_refused(correction: str) -> None:
    with pytest.raises(ValueError, match="corrects asynchronous schedules"):
        _pipe_kw(schedule="1f1b", correction=correction)


def test_an_unknown_correction_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="predict"):
        _pipe_kw(correction="spectrain")
    with pytest.raises(ValueError, match="unknown"):
        make_correction("spectrain")


def _pipe_kw(**options: object) -> Pipeline:
    model = _model()
    settings: dict = {"schedule": "paci", "microbatches": 4, **options}
    return Pipeline([model[:4], model[4:]], nn.functional.mse_loss, **settings)


def test_cli_refuses_delay_lr_steps_without_its_correction() -> None:
    from nobubble.app.train.config import TrainConfig

    # the same refusal as the API's: one text, in the correction registry
    with pytest.raises(ValueError, match="delay_lr_steps=10 applies to correction='delay-lr'"):
        TrainConfig.of(schedule="paci", correction="ef", delay_lr_steps=10)
    assert TrainConfig.of(schedule="paci", correction="delay-lr", steps=40).delay_lr_span == 10
    assert (
        TrainConfig.of(schedule="paci", correction="delay-lr", delay_lr_steps=7).delay_lr_span == 7
    )


def test_prediction_with_a_sharded_stage_is_refused() -> None:
    from nobubble.app.train.config import TrainConfig

    with pytest.raises(ValueError, match="shard='fsdp'"):
        _pipe_kw(correction="predict", shard="fsdp", data_parallel=2, runtime="dist")
    with pytest.raises(ValueError, match="correction='predict' with shard='fsdp'"):
        TrainConfig.of(
            schedule="paci", correction="predict", shard="fsdp", data_parallel=2, runtime="dist"
        )
