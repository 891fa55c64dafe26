"""The public API on a user's own model: ``nobubble.split`` and ``nobubble.Pipeline``.

The references are plain PyTorch written here from the semantics (docs/semantics.md): gradient
accumulation on the unsplit model, the one-step delayed loop of 2BW, and a per-stage loop over the
simulator's global order that updates live weights in place (PACI). None of them imports
``nobubble.engine`` or ``nobubble.api.pipeline``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nobubble
from _api_reference import (
    LiveLoop,
    M,
    Problem,
    adamw,
    assert_bitwise,
    delayed_loop,
    plain_accumulation,
    run_pipeline,
    weights,
)
from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import build_schedule

ROWS = 8  # rows per batch (2 per micro-batch)


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32),
        nn.Tanh(),
        nn.LayerNorm(32),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


CUTS = {1: [], 2: ["3"], 3: ["2", "5"], 4: ["2", "3", "5"]}


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A user's loss: not cross-entropy, and not the pipeline's own."""
    return F.smooth_l1_loss(out, y) + 0.1 * out.pow(2).mean()


def batch(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(j)
    return torch.randn(ROWS, 8, generator=gen), torch.randn(ROWS, 4, generator=gen)


SEQ = Problem(make_model, lambda model, n: nobubble.split(model, CUTS[n]), batch, loss_fn)


# ----- oracles ---------------------------------------------------------------------------------
STEPS = 20  # past the first schedule horizon (16 steps): the open-ended loop regenerates


@pytest.mark.parametrize("stages_n", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sync_pipeline_on_a_user_model_equals_plain_accumulation(schedule, stages_n):
    pipe, losses, model = run_pipeline(SEQ, schedule, stages_n, STEPS)
    ref_losses, ref_weights = plain_accumulation(SEQ, STEPS)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)
    assert_bitwise(weights([model]), ref_weights)  # the stages share the user's modules


@pytest.mark.parametrize("stages_n", [2, 4])
def test_2bw_on_a_user_model_equals_the_delayed_loop(stages_n):
    pipe, losses, _ = run_pipeline(SEQ, "2bw", stages_n, STEPS)
    ref_losses, ref_weights = delayed_loop(SEQ, STEPS)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)


@pytest.mark.parametrize("stages_n", [2, 4])
def test_paci_on_a_user_model_equals_the_ledger_driven_live_weight_loop(stages_n):
    pipe, losses, _ = run_pipeline(SEQ, "paci", stages_n, STEPS)
    schedule = build_schedule("paci", stages_n, M, STEPS)
    ref = LiveLoop(SEQ, schedule, build_ledger(schedule)).run()
    assert losses == ref.losses
    assert_bitwise(weights(pipe.stages), ref.params)
    # PACI really is asynchronous here: the oracle would not tell it from a flush otherwise
    _, plain = plain_accumulation(SEQ, STEPS)
    assert any(not torch.equal(ref.params[n], plain[n]) for n in plain)


def test_2bw_drains_keep_the_one_step_delay():
    """2BW's batch j reads version j-1 across a drain too: drains leave the delayed loop."""
    pipe, losses, _ = run_pipeline(SEQ, "2bw", 2, 12, drain_every=5)
    ref_losses, ref_weights = delayed_loop(SEQ, 12)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)


def test_drain_is_a_drain_point_of_the_schedule():
    """drain() after step 5 gives the numbers of the schedule with a drain point at 5."""
    steps, every = 10, 5
    pipe, losses, _ = run_pipeline(SEQ, "paci", 2, steps, drain_every=every)
    schedule = build_schedule("paci", 2, M, steps, drain_every=every)
    ref = LiveLoop(SEQ, schedule, build_ledger(schedule)).run()
    assert losses == ref.losses
    assert_bitwise(weights(pipe.stages), ref.params)


# ----- results, state --------------------------------------------------------------------------
def test_step_results_say_which_step_each_loss_belongs_to_and_when_steps_finish():
    model = make_model()
    sync = nobubble.Pipeline(nobubble.split(model, ["3"]), loss_fn, schedule="1f1b")
    first = sync.step(*batch(0))
    assert first.steps == [1] and [x.step for x in first.losses] == [1] * M
    assert first.in_flight == 0 and first.loss == pytest.approx(
        sum(x.value for x in first.losses) / M
    )
    pipe = nobubble.Pipeline(nobubble.split(make_model(), ["3"]), loss_fn, schedule="paci")
    first, second = pipe.step(*batch(0)), pipe.step(*batch(1))
    assert first.steps == [] and second.steps == [1]  # an asynchronous step finishes late
    assert [x.step for x in first.losses] == [1] * M
    assert [x.microbatch for x in second.losses] == list(range(M, 2 * M))
    assert pipe.in_flight
    assert pipe.drain().steps == [2] and not pipe.in_flight
    assert sorted(first.grad_norms) == [] and sorted(second.grad_norms) == [1]


def test_state_dict_resumes_exactly_and_merges_under_the_model_names():
    steps, cut = 8, 5
    uninterrupted, losses, _ = run_pipeline(SEQ, "2bw", 2, steps, drain_every=cut)
    pipe, _, _ = run_pipeline(SEQ, "2bw", 2, cut)
    with pytest.raises(RuntimeError, match="drain"):
        pipe.step(*batch(cut))
        pipe.state_dict()
    state = nobubble.Pipeline(
        nobubble.split(make_model(), ["3"]), loss_fn, schedule="2bw", optimizer=adamw
    )
    pipe2, _, _ = run_pipeline(SEQ, "2bw", 2, cut)
    saved = pipe2.state_dict()
    state.load_state_dict(saved)
    assert state.step_count == cut
    later = {}
    for j in range(cut, steps):
        later.update({x.microbatch: x.value for x in state.step(*batch(j)).losses})
    later.update({x.microbatch: x.value for x in state.drain().losses})
    assert [later[m] for m in range(cut * M, steps * M)] == losses[cut * M :]
    assert_bitwise(weights(state.stages), weights(uninterrupted.stages))
    merged = state.merged_state_dict()
    assert list(merged) == list(make_model().state_dict())


def test_evaluate_gives_the_unsplit_models_loss_and_changes_no_training_state():
    """``evaluate`` at a drain point: the mean of the micro-batch losses that the unsplit model
    with the pipeline's weights gives, in eval mode; training then goes on as if it never ran."""
    pipe, _, _ = run_pipeline(SEQ, "paci", 2, 5, drain_every=3)
    model = make_model()
    model.load_state_dict(pipe.merged_state_dict())
    x, y = batch(99)
    model.train(False)
    with torch.no_grad():
        pieces = zip(x.chunk(2), y.chunk(2), strict=True)
        expected = [float(loss_fn(model(a), b)) for a, b in pieces]
    assert pipe.evaluate(x, y, microbatches=2) == sum(expected) / 2
    assert all(stage.training for stage in pipe.stages)  # back in train mode
    # an evaluation at the drain point after step 3 leaves the run where it would have been
    again, _, _ = run_pipeline(SEQ, "paci", 2, 3)
    again.evaluate(x, y)
    for j in range(3, 5):
        again.step(*batch(j))
    again.drain()
    assert_bitwise(weights(again.stages), weights(pipe.stages))
    pipe.step(*batch(5))
    assert pipe.in_flight  # paci finishes a batch's last backward a step later
    with pytest.raises(RuntimeError, match=r"drain\(\) first"):
        pipe.evaluate(x, y)
    pipe.drain()
    with pytest.raises(ValueError, match="microbatches=0"):
        pipe.evaluate(x, y, microbatches=0)


def test_stages_may_pass_tuples_and_dicts():
    """A stage output of several tensors reaches the next stage as arguments; the gradient of
    each floating tensor flows back (an integer tensor carries none)."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 16)

        def forward(self, x):
            return {"h": torch.tanh(self.a(x)), "skip": self.b(x), "n": torch.ones(1).long()}

    class Tail(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Linear(16, 4)

        def forward(self, h, skip, n):
            return self.c(h + skip) * n

    torch.manual_seed(0)
    head, tail = Head(), Tail()
    ref_head, ref_tail = copy.deepcopy(head), copy.deepcopy(tail)
    pipe = nobubble.Pipeline([head, tail], loss_fn, schedule="1f1b", optimizer=adamw)
    opt = adamw(list(ref_head.named_parameters()) + list(ref_tail.named_parameters()))
    for j in range(3):
        x, y = batch(j)
        pipe.step(x, y)
        for xs, ys in zip(x.chunk(M), y.chunk(M), strict=True):
            (loss_fn(ref_tail(**ref_head(xs)), ys) / M).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert_bitwise(weights([head, tail]), weights([ref_head, ref_tail]))


# ----- bad inputs --------------------------------------------------------------------------------
def refuses(match: str, make: Callable[[], object], error: type[Exception] = ValueError) -> None:
    with pytest.raises(error, match=match):
        make()


def test_split_refuses_bad_points_with_the_fix():
    model = make_model()
    refuses(
        r"split point 'layers.9' names no child.*0, 1, 2",
        lambda: nobubble.split(model, ["layers.9"]),
    )
    refuses(r"stage 1 \(1\) has no parameters", lambda: nobubble.split(model, ["1", "2"]))
    refuses(r"split into 9 stages, but the model has 8 children", lambda: nobubble.split(model, 9))
    refuses(r"'3' does not come after '5'", lambda: nobubble.split(model, ["5", "3"]))
    refuses(
        r"cuts nn.Sequential models, not Linear",
        lambda: nobubble.split(nn.Linear(2, 2), 2),
        TypeError,
    )


def test_split_balances_compute_over_the_children():
    stages = nobubble.split(make_model(), 2)
    sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert [list(dict(s.named_children())) for s in stages] == [
        ["0", "1", "2", "3"],
        ["4", "5", "6", "7"],
    ]
    assert max(sizes) < sum(sizes)


def test_pipeline_refuses_bad_stages_and_batches():
    def stages():
        return nobubble.split(make_model(), ["3"])

    refuses(
        r"stage 1 has no parameters",
        lambda: nobubble.Pipeline([nn.Linear(2, 2), nn.Tanh()], loss_fn),
    )
    refuses(
        r"clip_scope='global' would make the stages of the asynchronous paci meet",
        lambda: nobubble.Pipeline(
            stages(), loss_fn, schedule="paci", clip=1.0, clip_scope="global"
        ),
    )
    shared = nn.Linear(4, 4)
    refuses(
        r"parameter 'weight' of stage 1 is also 'weight' of stage 0 \(tied weights\)",
        lambda: nobubble.Pipeline([shared, shared], loss_fn),
    )
    refuses(
        r"unknown schedule 'zb-h3'", lambda: nobubble.Pipeline(stages(), loss_fn, schedule="zb-h3")
    )
    refuses(
        r"runtime='dist' needs a process group: start the script with torchrun",
        lambda: nobubble.Pipeline(stages(), loss_fn, runtime="dist"),
    )
    for looped in ("interleaved-1f1b", "looped-bfs"):  # v is theirs to choose: name it
        refuses(
            rf"schedule='{looped}' places 2 stages on each rank \(virtual_stages=2\).*"
            "or set virtual_stages to a divisor of it",
            lambda looped=looped: nobubble.Pipeline(
                nobubble.split(make_model(), ["1", "3"]), loss_fn, schedule=looped
            ),
        )
    pipe = nobubble.Pipeline(stages(), loss_fn)
    refuses(
        r"batch dimension 6.*multiple of 4", lambda: pipe.step(torch.randn(6, 8), torch.randn(6, 4))
    )

    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x), 3

    bad = nobubble.Pipeline([Bad(), nn.Linear(8, 4)], loss_fn)
    refuses(
        r"stage 0 output for micro-batch 0 holds int: a stage boundary carries tensors",
        lambda: bad.step(*batch(0)),
        TypeError,
    )

    grow = nobubble.Pipeline(stages(), loss_fn)
    grow.step(*batch(0))
    refuses(
        r"stage 0 input for micro-batch 4 is \[\[3, 8\] float32\], but the first micro-batch "
        r"agreed on \[\[2, 8\] float32\]",
        lambda: grow.step(torch.randn(12, 8), torch.randn(12, 4)),
    )


def test_the_front_door_exports_the_api_without_importing_torch():
    import subprocess
    import sys

    assert set(nobubble.__all__) >= {"Pipeline", "split", "StepResult", "MicrobatchLoss"}
    code = "import sys, nobubble; assert 'torch' not in sys.modules; nobubble.Pipeline"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hf_models_without_transformers_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    import sys

    from nobubble.cli import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama", "vocab_size": 512}')
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    out = tmp_path / "run"
    argv = ["train", "--model", f"hf:{tmp_path / 'model'}", "--out", str(out), "--steps", "2"]
    assert main(argv) == 2
    assert "pip install 'nobubble[hf]'" in capsys.readouterr().err
    assert not out.exists()


# ----- non-finite gradients ------------------------------------------------------------------
class GradientScale(nn.Module):
    """Leaves the output as it is and gives its parameter the gradient ``scale`` times the sum
    of the output's (a stand-in for a layer whose gradient blows up)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale, self.weight = scale, nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blown = self.scale * self.weight * x
        return x + (blown - blown.detach())


def scaled_model(scale: float) -> nn.Sequential:
    return nn.Sequential(*make_model(), GradientScale(scale))  # the last layer: stage 1


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_a_non_finite_gradient_stops_the_step_naming_its_stage(schedule: str) -> None:
    pipe = nobubble.Pipeline(
        nobubble.split(scaled_model(float("inf")), ["3"]), loss_fn, schedule=schedule
    )
    before = copy.deepcopy(pipe.stages[1].state_dict())
    with pytest.raises(FloatingPointError, match="stage 1, step 1: non-finite gradients"):
        pipe.step(*batch(0))
        pipe.drain()
    for name, value in pipe.stages[1].state_dict().items():  # the step did not apply
        assert torch.equal(value, before[name]), name


def test_a_finite_gradient_whose_square_overflows_is_not_called_non_finite() -> None:
    """The norm screens for non-finite entries; a gradient entry of about 1e30 squares to inf in
    fp32, yet every entry is finite: the exact check lets the step apply (clipping by an
    infinite norm then scales the gradients to zero)."""
    pipe = nobubble.Pipeline(nobubble.split(scaled_model(1e32), ["3"]), loss_fn, schedule="paci")
    pipe.step(*batch(0))
    result = pipe.drain()
    assert result.steps == [1] and result.grad_norms[1][1] == float("inf")
    assert pipe.step_count == 1
    assert all(bool(p.isfinite().all()) for p in pipe.stages[1].parameters())
