"""Execution of the split-backward and several-stages-per-rank schedules in the emulator.

interleaved-1f1b, zb-h1 and zbv are synchronous: every forward and backward of batch j reads
version j, so a run must equal plain gradient accumulation on the unsplit model, bitwise, as
gpipe and 1f1b do (docs/semantics.md, "Orders"). The references are _api_reference's, written in
plain PyTorch without nobubble.engine or nobubble.api.pipeline. The split backward (I, then W) must
also give exactly the weights of the fused B under the same order of forwards and backwards.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call

import nobubble
from _api_reference import (
    Problem,
    adamw,
    assert_bitwise,
    plain_accumulation,
    run_pipeline,
    weights,
)
from nobubble.api.arguments import TorchOptimizer
from nobubble.app.train.config import TrainConfig
from nobubble.core.ir import Action, B, I, Schedule, W
from nobubble.core.ledger import build_ledger
from nobubble.core.schedules import build_schedule
from nobubble.core.validate import validate
from nobubble.engine import InProcessTransport, StageWorker
from nobubble.engine import split_backward as split
from nobubble.model import build_model, lm_loss, model_config, split_model
from nobubble.optim import NoCorrection
from nobubble.runtime.emulator import Emulator, rank_interpreters
from test_api import CUTS, SEQ, batch, loss_fn, make_model  # a user's model, loss and data

ROWS = 8  # rows per batch: 2 per micro-batch at M = 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----- the internal GPT, preset "tiny" (4 layers) at a small vocabulary ------------------------
GPT_CFG = model_config("tiny", vocab_size=64, seq_len=16)


def gpt_batch(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + j)
    tokens = torch.randint(0, GPT_CFG.vocab_size, (ROWS, GPT_CFG.max_seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


GPT = Problem(
    lambda: build_model(GPT_CFG, 0),
    lambda model, n: list(split_model(model, n)),  # type: ignore[arg-type]
    gpt_batch,
    lm_loss,
)

# (schedule, stage modules): P=2 for all three (v·P = 4 modules for interleaved and zbv), P=4
# for zb-h1
CASES = [("zb-h1", 2), ("zb-h1", 4), ("interleaved-1f1b", 4), ("zbv", 4)]


@pytest.mark.parametrize(("schedule", "modules"), CASES)
def test_on_a_user_model_they_equal_plain_accumulation_bitwise(schedule, modules):
    steps = 20  # past the first horizon (16 steps): the open-ended loop regenerates
    pipe, losses, model = run_pipeline(SEQ, schedule, modules, steps)
    ref_losses, ref_weights = plain_accumulation(SEQ, steps)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)
    assert_bitwise(weights([model]), ref_weights)  # the stages share the user's modules


@pytest.mark.parametrize(("schedule", "modules"), CASES)
def test_on_the_internal_gpt_they_equal_plain_accumulation_bitwise(schedule, modules):
    steps = 3
    pipe, losses, _ = run_pipeline(GPT, schedule, modules, steps)
    ref_losses, ref_weights = plain_accumulation(GPT, steps)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_drains_pass_every_stage_of_a_rank(schedule):
    """drain() runs each rank past all its stages' steps (two STEP actions per rank)."""
    pipe, losses, _ = run_pipeline(SEQ, schedule, 4, 7, drain_every=3)
    ref_losses, ref_weights = plain_accumulation(SEQ, 7)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), ref_weights)


def test_global_clipping_meets_every_stage_of_every_rank():
    """The clip norm sums all v·P stages, two of them per rank here. The per-stage sum of
    squares reduces in another order than torch's clip_grad_norm_ (see test_emulator_oracles),
    so plain accumulation is met to 1e-6; 1f1b on the same four stages sums alike, bitwise."""
    clip, steps = 0.05, 6
    pipe, losses, _ = run_pipeline(SEQ, "zbv", 4, steps, clip=clip)
    ref_losses, ref_weights = plain_accumulation(SEQ, steps, clip=clip)
    _, unclipped = plain_accumulation(SEQ, steps)
    assert any(not torch.allclose(unclipped[n], ref_weights[n]) for n in unclipped), "no clip"
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for name, tensor in weights(pipe.stages).items():
        torch.testing.assert_close(tensor, ref_weights[name], rtol=1e-6, atol=1e-7)
    one_f_one_b, ref_losses, _ = run_pipeline(SEQ, "1f1b", 4, steps, clip=clip)
    assert losses == ref_losses
    assert_bitwise(weights(pipe.stages), weights(one_f_one_b.stages))


def test_hand_offs_between_stages_of_one_rank_never_reach_the_transport():
    sent: list[tuple[Action, int]] = []
    pipe = nobubble.Pipeline(
        nobubble.split(make_model(), CUTS[4]), loss_fn, schedule="zbv", optimizer=adamw
    )
    send = pipe.transport.send
    pipe.transport.send = lambda a, t, dst: (sent.append((a, dst)), send(a, t, dst))[1]  # type: ignore[method-assign]
    pipe.step(*batch(0))
    pipe.drain()
    placement = pipe.schedule.placement
    assert sent, "the two ranks exchange messages"
    assert all(not placement.same_rank(a.stage, dst) for a, dst in sent)
    # the turn of the V (stage 1 -> 2) and nothing else stays on rank 1
    assert {(a.stage, dst) for a, dst in sent} == {(0, 1), (2, 3), (1, 0), (3, 2)}


# ----- fused B against split I and W -----------------------------------------------------------
def fused(schedule: Schedule) -> Schedule:
    """The same order with each I turned into a fused B and each W dropped."""
    ranks = tuple(
        tuple(Action(a.stage, B, a.number) if a.kind == I else a for a in order if a.kind != W)
        for order in schedule.ranks
    )
    return Schedule(
        schedule.name,
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.num_steps,
        schedule.forward_rule,
        schedule.backward_rule,
        ranks,
        schedule.drain_every,
        placement=schedule.placement,
    )


def emulate(problem: Problem, schedule: Schedule, modules: int) -> dict[str, torch.Tensor]:
    validate(schedule)
    ledger = build_ledger(schedule)
    stages = problem.cut(problem.make_model(), modules)

    def micro(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        return problem.micro(m)

    workers = [
        StageWorker(
            module,
            schedule,
            ledger.stages[s],
            TorchOptimizer(adamw(list(module.named_parameters()))),  # type: ignore[arg-type]
            NoCorrection(),
            micro,
            None,
            loss_fn=problem.loss_fn,
        )
        for s, module in enumerate(stages)
    ]
    transport = InProcessTransport(schedule.num_stages)
    emulator = Emulator(schedule, rank_interpreters(schedule, workers, transport), transport)
    emulator.run(schedule.num_steps)
    return weights(stages)


@pytest.mark.parametrize("problem", [SEQ, GPT], ids=["user-model", "gpt"])
def test_zb_h1_split_backward_gives_the_weights_of_the_fused_backward(problem):
    split = build_schedule("zb-h1", 2, 4, 3)
    assert split.split_backward and not fused(split).split_backward
    assert_bitwise(emulate(problem, split, 2), emulate(problem, fused(split), 2))


def test_w_runs_no_activation_node_that_i_ran_except_the_boundaries():
    """W re-enters the graph where the weights hang off the activation path and runs only
    the weight side (the last stage, ending in the loss); on the first stage, whose token input
    takes no gradient, I runs nothing and W the whole backward once."""
    for s, stage in enumerate(split_model(build_model(GPT_CFG, 0), 2)):
        leaves = {n: p.detach().clone().requires_grad_() for n, p in stage.named_parameters()}
        x, y = gpt_batch(0)
        inputs = [] if s == 0 else [torch.randn(ROWS, 16, GPT_CFG.dim, requires_grad=True)]
        out = functional_call(stage, leaves, (x if s == 0 else inputs[0],))
        out = lm_loss(out, y) if s == 1 else out
        summary = split._leaf_summaries([get_gradient_edge(out).node])
        weight_nodes = {get_gradient_edge(w).node: i for i, w in enumerate(leaves.values())}
        entered = {n for nodes, _ in split._groups(summary, weight_nodes) for n in nodes}
        ran: list[str] = []
        for node, reached in summary.items():
            if reached is split._MANY and node not in entered:
                node.register_hook(lambda *_, n=node, ran=ran: ran.append(n.name()))
        grads = None if s == 1 else [torch.randn_like(out)]
        _, work = split.input_backward([out], grads, inputs, list(leaves.values()))
        if s == 0:
            assert ran == [], "nobody waits for the first stage's I: it runs nothing"
            split.weight_backward(work, list(leaves.values()))
            activation_side = [n for n, r in summary.items() if r is split._MANY]
            assert sorted(ran) == sorted(n.name() for n in activation_side if n not in entered)
            continue
        assert ran, "I runs the activation path"
        ran.clear()
        split.weight_backward(work, list(leaves.values()))
        assert ran == []


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_a_split_backward_frees_each_micro_batchs_graph_after_its_w(schedule, monkeypatch):
    """I retains the graph for W; once W ran, nothing may keep it (or its activations) alive.
    An op that saves its own output (softmax, SDPA) would close a cycle through the graph if the
    worker's saved-tensor hook stored the tensor itself: every micro-batch leaked, and the run
    slowed down as memory grew (zb-h1 at 0.33x 1f1b's tokens/s)."""
    outputs: list[weakref.ref[torch.Tensor]] = []
    run = StageWorker._run

    def recording(self, version, inputs, m, record=True):  # type: ignore[no-untyped-def]
        out = run(self, version, inputs, m, record)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(StageWorker, "_run", recording)
    modules = 4 if schedule == "zbv" else 2
    pipe = nobubble.Pipeline(
        nobubble.split(make_model(), CUTS[modules]), loss_fn, schedule=schedule, optimizer=adamw
    )
    for j in range(2):
        pipe.step(*batch(j))
    pipe.drain()
    gc.collect()
    assert len(outputs) == 2 * 4 * modules  # every forward of every stage was seen
    alive = [i for i, ref in enumerate(outputs) if ref() is not None]
    assert alive == [], f"{len(alive)} of {len(outputs)} forward outputs outlived their W"


# ----- bad inputs ----------------------------------------------------------------------------
def test_stage_modules_that_do_not_fit_the_placement_are_refused_with_the_fix():
    three = nobubble.split(make_model(), ["2", "5"])
    with pytest.raises(ValueError, match=r"needs a multiple of 2 stage modules, got 3"):
        nobubble.Pipeline(three, loss_fn, schedule="zbv")
    with pytest.raises(ValueError, match=r"virtual_stages=2.*got 3.*set virtual_stages"):
        nobubble.Pipeline(three, loss_fn, schedule="interleaved-1f1b")
    four = nobubble.split(make_model(), CUTS[4])
    with pytest.raises(ValueError, match=r"virtual_stages=3.*got 4"):
        nobubble.Pipeline(four, loss_fn, schedule="interleaved-1f1b", virtual_stages=3)
    with pytest.raises(ValueError, match=r"zb-h1 runs one stage per rank.*does not apply"):
        nobubble.Pipeline(four, loss_fn, schedule="zb-h1", virtual_stages=2)
    with pytest.raises(ValueError, match=r"places exactly 2 stages per rank"):
        nobubble.Pipeline(four, loss_fn, schedule="zbv", virtual_stages=4)


def test_microbatches_that_do_not_fit_the_schedule_are_refused_with_the_fix():
    four = nobubble.split(make_model(), CUTS[4])
    with pytest.raises(
        ValueError, match=r"'interleaved-1f1b' on 2 ranks with microbatches=5:.* equal rounds"
    ):
        nobubble.Pipeline(four, loss_fn, schedule="interleaved-1f1b", microbatches=5)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_the_multi_process_runtime_accepts_them(schedule):
    """Refused until the runtime could order a rank's several stages (tests/test_api_dist.py
    and tests/test_dist_runtime.py run them in real processes)."""
    assert TrainConfig.of(schedule=schedule, runtime="dist").schedule.schedule == schedule


def test_tied_parameters_across_a_v_under_the_runtime_are_refused_with_the_fix():
    """The runtime swaps tied gradients between ranks of one stage each; under zbv's V the
    tied first and last stages share rank 0. Refused before any process group is needed."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4) if k % 2 == 0 else torch.nn.Tanh() for k in range(7)]
    modules = nobubble.split(torch.nn.Sequential(*layers), ["2", "4", "6"])
    with torch.no_grad():
        modules[3][0].weight.copy_(modules[0][0].weight)
    modules[3].tied_parameters = {"6.weight": "0.weight"}
    with pytest.raises(ValueError, match=r"tied to 0.weight of stage 0.*untie=True"):
        nobubble.Pipeline(modules, loss_fn, schedule="zbv", runtime="dist")
