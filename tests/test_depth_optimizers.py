"""The optimizers made for depth, selected by name through the pipeline: ``nadam-delay`` (the
delay-aware Nesterov look-ahead, optim/lookahead.py) and ``rotation`` (Adam in the gradients'
eigenbasis on the hidden matrices, optim/rotation.py).

References are plain PyTorch on the unsplit model (test_api's ``SEQ`` problem): torch's NAdam,
and the library's BasisRotation on the 2-D tensors beside torch's AdamW on the rest, built here
from the paper's split. The delays each stage's optimizer reads are compared with the ledger's,
recomputed here from ``build_ledger``. The optimizers' own arithmetic is checked against loops
written from the equations in test_depth_corrections.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nobubble
from _api_reference import (
    LR,
    M,
    assert_bitwise,
    plain_accumulation,
    run_pipeline,
    weights,
)
from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import build_schedule
from nobubble.optim.rotation import BasisRotation
from test_api import SEQ, batch, loss_fn, make_model

BETAS = (0.9, 0.999)  # a beta1 below 0.99, where the delay moves it
OPTIONS = {"betas": BETAS, "weight_decay": 0.1}


def _decayed(named: list[tuple[str, nn.Parameter]]) -> list[dict]:
    """The project's decay policy written out: 2-D tensors decayed, the rest not."""
    groups = [
        {"params": [p for _, p in named if p.ndim == 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.ndim != 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _nadam(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.NAdam(
        _decayed(named), lr=LR, betas=BETAS, eps=1e-8, decoupled_weight_decay=True
    )


class _RotationAndAdamW(torch.optim.Optimizer):
    """The paper's split: BasisRotation on every 2-D tensor of SEQ (all hidden matrices: no
    embedding, no head), torch's AdamW with the same betas on the rest."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        matrices = [(n, p) for n, p in named if p.ndim == 2]
        rest = [(n, p) for n, p in named if p.ndim != 2]
        self.parts = [
            BasisRotation(_decayed(matrices), lr=LR, betas=BETAS, eps=1e-8),
            torch.optim.AdamW(_decayed(rest), lr=LR, betas=BETAS, eps=1e-8),
        ]
        super().__init__([p for _, p in named], {})

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def test_both_are_choices_of_the_command_line():
    from nobubble.app.train.flags import build_train_parser

    parser = build_train_parser()
    for name in ("nadam-delay", "rotation"):
        assert parser.parse_args(["--optimizer", name]).optimizer == name


@pytest.mark.parametrize(
    "name, reference", [("nadam-delay", _nadam), ("rotation", _RotationAndAdamW)]
)
def test_1f1b_equals_plain_training_with_the_same_optimizer_bitwise(name, reference):
    """Synchronous: every delay is 0, so nadam-delay is plain NAdam; rotation is the paper's
    split on the unsplit model. 12 steps cross the rotation's basis refresh at step 10."""
    steps = 12
    pipe, losses, _ = run_pipeline(
        SEQ, "1f1b", 2, steps, optimizer=name, lr=LR, optimizer_options=OPTIONS
    )
    ref_losses, ref_weights = plain_accumulation(SEQ, steps, optimizer=reference)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)


@pytest.mark.parametrize("schedule", ["paci", "2bw"])
def test_nadam_delay_reads_each_stages_delay_from_the_ledger(schedule):
    """Before every step, each stage's beta1 is beta1 + min(tau, P)/P * (0.99 - beta1), tau the
    mean over the batch's micro-batches of the ledger's delay, recomputed here."""
    stages_n, steps = 4, 6
    model = make_model()
    pipe = nobubble.Pipeline(
        nobubble.split(model, ["2", "3", "5"]),
        loss_fn,
        schedule=schedule,
        microbatches=M,
        optimizer="nadam-delay",
        lr=LR,
        optimizer_options=OPTIONS,
    )
    used: dict[int, list[float]] = {s: [] for s in range(stages_n)}
    for s, worker in enumerate(pipe.workers):
        opt = worker.optimizer.parts["adamw"]
        opt.register_step_pre_hook(lambda o, *_, s=s: used[s].append(o.param_groups[0]["betas"][0]))
    for j in range(steps):
        pipe.step(*batch(j))
    pipe.drain()
    ledger = build_ledger(build_schedule(schedule, stages_n, M, steps))
    for s in range(stages_n):
        delays = ledger.stages[s].delay
        taus = [sum(delays[j * M : (j + 1) * M]) / M for j in range(steps)]
        expected = [BETAS[0] + min(t, stages_n) / stages_n * (0.99 - BETAS[0]) for t in taus]
        assert used[s] == pytest.approx(expected, rel=0, abs=1e-15), s
    assert max(used[0]) > BETAS[0]  # the first stage is delayed: its beta1 moved
    last = [BETAS[0]] * steps if schedule == "paci" else [BETAS[0]] + [used[0][-1]] * (steps - 1)
    assert used[stages_n - 1] == last  # paci's last stage has no delay; 2bw's every stage 1


@pytest.mark.parametrize("name", ["nadam-delay", "rotation"])
def test_a_run_split_by_the_state_dict_equals_one_uninterrupted_run_bitwise(name):
    """paci, 12 steps cut at 9: the rotation's basis is refreshed (step 10) after the resume,
    from statistics saved with it; nadam-delay's saved delay and P come back with its groups."""
    steps, cut = 12, 9
    kw = {"optimizer": name, "lr": LR, "optimizer_options": OPTIONS}
    whole, losses, _ = run_pipeline(SEQ, "paci", 2, steps, drain_every=cut, **kw)
    first, _, _ = run_pipeline(SEQ, "paci", 2, cut, **kw)
    resumed = nobubble.Pipeline(
        nobubble.split(make_model(), ["3"]), loss_fn, schedule="paci", microbatches=M, **kw
    )
    resumed.load_state_dict(first.state_dict())
    later = {}
    for j in range(cut, steps):
        later.update({x.microbatch: x.value for x in resumed.step(*batch(j)).losses})
    later.update({x.microbatch: x.value for x in resumed.drain().losses})
    assert [later[m] for m in range(cut * M, steps * M)] == losses[cut * M :]
    assert_bitwise(weights(resumed.stages), weights(whole.stages))


def test_rotation_is_refused_on_sharded_stages_naming_the_fix():
    with pytest.raises(ValueError, match=r"optimizer='rotation' with shard='fsdp'.*shard='none'"):
        nobubble.Pipeline(
            nobubble.split(make_model(), ["3"]),
            loss_fn,
            schedule="paci",
            runtime="dist",
            data_parallel=2,
            shard="fsdp",
            optimizer="rotation",
        )


def test_rotation_is_refused_for_a_model_without_a_hidden_matrix():
    model = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"optimizer='rotation' found no 2-D hidden.*'adamw'"):
        nobubble.Pipeline(
            nobubble.split(model, ["1"]), nn.functional.mse_loss, optimizer="rotation"
        )


def test_nadam_delay_refuses_a_beta1_above_the_one_the_delay_moves_toward():
    with pytest.raises(ValueError, match=r"betas\[0\]=0.995 .*use 0 <= beta1 <= max_beta1"):
        nobubble.Pipeline(
            nobubble.split(make_model(), ["3"]),
            loss_fn,
            schedule="paci",
            optimizer="nadam-delay",
            optimizer_options={"betas": (0.995, 0.999)},
        )


def test_the_betas_flag_reaches_the_optimizer_and_a_bad_pair_is_refused():
    """``nobubble train --betas B1,B2`` (the command line's way to the beta1 that nadam-delay's
    delay raises toward 0.99): the stage's optimizer gets that pair; "auto" leaves the entry's
    own (0.99, 0.999); a pair out of [0, 1) is refused naming the flag and the fix."""
    from nobubble.app.train.flags import build_train_parser, config_from_args
    from nobubble.optim import build_optimizer

    def betas_of(*flags: str) -> tuple[float, float]:
        cfg = config_from_args(
            build_train_parser().parse_args(["--optimizer", "nadam-delay", *flags])
        )
        stage = build_optimizer(cfg.optim_config(), nn.Linear(2, 2).named_parameters())
        (part,) = stage.parts.values()
        return tuple(part.param_groups[0]["betas"])

    assert betas_of("--betas", "0.8,0.95") == (0.8, 0.95)
    assert betas_of() == (0.99, 0.999)
    with pytest.raises(ValueError, match=r"--betas '0.9,1.0' is not a pair .* give B1,B2"):
        betas_of("--betas", "0.9,1.0")
