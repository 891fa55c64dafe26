"""Oracle tests of the single-process emulator against independent reference loops.

Each test runs a schedule through nobubble.engine (workers, weight versions, interpreter,
emulator) and compares its per-micro-batch losses and final weights with a loop written in
tests/_reference.py from the semantics of docs/semantics.md, which never touches nobubble.engine:
- sync schedules (gpipe, 1f1b) == plain gradient accumulation on the unsplit model;
- 2bw == the delayed-gradient loop x[j+1] = x[j] - u(g_j(x[j-1])) (with written-out EF);
- pipedream == per-stage deep-copied weight versions; paci == live weights behind restored
  autograd version counters (the paper's patched-PyTorch route), or recompute at backward.
Tiny model, fp32 CPU; the tolerance is 1e-6 relative (the runs are in fact bitwise equal or close).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from _reference import (
    BATCH_SIZE,
    CFG,
    SEED,
    LiveWeightsLoop,
    RefResult,
    StashedWeightsLoop,
    batch_fn,
    delayed_gradient,
    optim_config,
    plain_accumulation,
)
from nobubble.core.ir import Schedule
from nobubble.core.ledger import Ledger, build_ledger
from nobubble.core.schedules import build_schedule
from nobubble.core.validate import validate
from nobubble.engine import InProcessTransport, Interpreter, StageWorker
from nobubble.engine.worker import Batch, LossFn
from nobubble.model import build_model, lm_loss, split_model
from nobubble.optim import (
    DelayCorrection,
    ErrorFeedback,
    NoCorrection,
    StageOptimizer,
    build_optimizer,
    lr_at,
)
from nobubble.runtime.emulator import Emulator

RTOL = 1e-6
M, N = 4, 6  # micro-batches per step and steps of the whole-model comparisons


def build_workers(
    schedule: Schedule,
    ledger: Ledger,
    stages: list[nn.Module],
    optimizers: list[StageOptimizer],
    corrections: list[DelayCorrection],
    batch_fn: Callable[[int], Batch],
    lr_fn: Callable[[int], float],
    clip_norm: float | None,
    autocast_dtype: torch.dtype | None = None,
    recompute: bool = False,
    loss_fn: LossFn | None = None,
) -> list[StageWorker]:
    return [
        StageWorker(
            module,
            schedule,
            ledger.stages[s],
            optimizers[s],
            corrections[s],
            batch_fn,
            lr_fn,
            clip_norm,
            autocast_dtype,
            recompute,
            loss_fn=loss_fn,
        )
        for s, module in enumerate(stages)
    ]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny matmuls: one thread is as fast and never stalls when the cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class EmuRun:
    schedule: Schedule
    ledger: Ledger
    workers: list[StageWorker]
    losses: list[float]  # per micro-batch, from the last stage
    params: dict[str, torch.Tensor]  # full-model names


def emulate(
    name: str,
    num_stages: int,
    num_microbatches: int = M,
    num_steps: int = N,
    *,
    optimizer: str = "adamw",
    accum: int | None = None,
    ef_lam: float | None = None,
    clip_norm: float | None = None,
    global_clip: bool = False,
    recompute: bool = False,
    autocast_dtype: torch.dtype | None = None,
    correction: Callable[[], DelayCorrection] | None = None,
) -> EmuRun:
    """Run ``name`` through the emulator on the tiny model of _reference (same seed, data);
    ``correction`` makes each stage's delay correction (default: EF with ``ef_lam``, or none)."""
    ocfg = optim_config(optimizer)
    stages = split_model(build_model(CFG, SEED), num_stages)
    schedule = build_schedule(name, num_stages, num_microbatches, num_steps, accum=accum)
    validate(schedule)
    ledger = build_ledger(schedule)
    opts = [build_optimizer(ocfg, list(s.named_parameters())) for s in stages]
    if correction is None:
        correction = NoCorrection if ef_lam is None else (lambda: ErrorFeedback(ef_lam))
    corrections = [correction() for _ in stages]
    workers = build_workers(
        schedule,
        ledger,
        stages,
        opts,
        corrections,
        batch_fn,
        lambda j: lr_at(j, num_steps, ocfg),
        clip_norm=clip_norm,
        autocast_dtype=autocast_dtype,
        recompute=recompute,
        loss_fn=lm_loss,
    )
    transport = InProcessTransport(num_stages)
    interpreters = [Interpreter([w], transport, num_stages, global_clip) for w in workers]
    Emulator(schedule, interpreters, transport).run(num_steps)
    losses = workers[-1].pop_losses(range(schedule.total_microbatches))
    params = {n: p.detach().clone() for s in stages for n, p in s.named_parameters()}
    return EmuRun(schedule, ledger, workers, losses, params)


def rel_diff(run: EmuRun, ref: RefResult) -> tuple[float, float]:
    """(max relative loss difference, max relative weight difference per tensor)."""
    assert len(run.losses) == len(ref.losses)
    loss = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
    assert run.params.keys() == ref.params.keys()
    weights = max(
        float((run.params[n] - p).abs().max() / p.abs().max()) for n, p in ref.params.items()
    )
    return loss, weights


def assert_matches(run: EmuRun, ref: RefResult, label: str) -> None:
    loss, weights = rel_diff(run, ref)
    print(f"{label}: max rel diff loss {loss:.2e} weights {weights:.2e}")
    assert loss <= RTOL, f"{label}: losses differ by {loss:.2e} relative"
    assert weights <= RTOL, f"{label}: final weights differ by {weights:.2e} relative"


def assert_bitwise(a: EmuRun, b: EmuRun, label: str) -> None:
    assert a.losses == b.losses, f"{label}: losses differ"
    for n, p in a.params.items():
        assert torch.equal(p, b.params[n]), f"{label}: {n} differs"


def assert_differs(a: RefResult, b: RefResult, label: str) -> None:
    """Guard against vacuous comparisons: two semantics that must give different numbers."""
    gap = max(float((a.params[n] - p).abs().max()) for n, p in b.params.items())
    assert gap > 1e-4, f"{label}: the two references agree ({gap:.1e}), the test proves nothing"


# ----- 1. synchronous schedules == plain gradient accumulation -------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_sync_schedule_equals_plain_accumulation(name: str, optimizer: str) -> None:
    ref = plain_accumulation(optimizer, M, N)
    for num_stages in (1, 2, 4):
        assert_matches(
            emulate(name, num_stages, optimizer=optimizer),
            ref,
            f"{name} {optimizer} P={num_stages}",
        )


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_sync_global_clipping_equals_clip_grad_norm(name: str) -> None:
    # AdamW only: torch's clip_grad_norm_ reduces the norm in another order (fp32 norm of
    # per-tensor norms) than the per-stage sum of squares, so the clipped gradients differ in
    # the last bit, and Muon's bf16 Newton-Schulz turns that bit into ~1e-3 weight differences.
    clip, optimizer = 0.05, "adamw"
    ref = plain_accumulation(optimizer, M, N, clip_norm=clip)
    assert min(ref.grad_norms) > clip, f"clipping never active: norms {ref.grad_norms}"
    assert_differs(ref, plain_accumulation(optimizer, M, N), "clipped vs unclipped")
    for num_stages in (1, 2, 4):
        run = emulate(name, num_stages, optimizer=optimizer, clip_norm=clip, global_clip=True)
        assert_matches(run, ref, f"{name} {optimizer} clip P={num_stages}")


# ----- 2. 2bw == delayed-gradient training ----------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_2bw_equals_delayed_gradient_loop(optimizer: str) -> None:
    ref = delayed_gradient(optimizer, M, N)
    assert_differs(ref, plain_accumulation(optimizer, M, N), "delayed vs sync")
    runs = {p: emulate("2bw", p, optimizer=optimizer) for p in (1, 2, 4)}
    for num_stages in (2, 4):
        assert_matches(runs[num_stages], ref, f"2bw {optimizer} P={num_stages}")
    assert_bitwise(runs[1], runs[2], f"2bw {optimizer} P=1 vs P=2")
    assert_bitwise(runs[1], runs[4], f"2bw {optimizer} P=1 vs P=4")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_2bw_error_feedback_equals_written_out_formula(optimizer: str) -> None:
    ref = delayed_gradient(optimizer, M, N, ef_lam=1.0)
    assert_differs(ref, delayed_gradient(optimizer, M, N), "EF vs plain delayed")
    for num_stages in (2, 4):
        run = emulate("2bw", num_stages, optimizer=optimizer, ef_lam=1.0)
        assert_matches(run, ref, f"2bw+EF {optimizer} P={num_stages}")


def test_error_feedback_lam0_is_no_correction_bitwise() -> None:
    plain = emulate("2bw", 4)
    assert_bitwise(emulate("2bw", 4, ef_lam=0.0), plain, "EF(lam=0)")


# ----- 3. pipedream and paci == ledger-driven per-stage loops ---------------------------------
@pytest.mark.parametrize(("accum", "num_steps"), [(1, 12), (2, 6)])
def test_pipedream_equals_stashed_weight_loop(accum: int, num_steps: int) -> None:
    run = emulate("pipedream", 4, num_steps=num_steps, accum=accum)
    ref_loop = StashedWeightsLoop(run.schedule, run.ledger)
    ref = ref_loop.run()
    # The reference read stale copies: some forward ran on a version older than the newest one
    # its stage had when the micro-batch's gradient was applied.
    assert max(max(st.delay) for st in run.ledger.stages) >= 1
    assert len({v for v in ref_loop.versions_used.values()}) > 1
    assert_matches(run, ref, f"pipedream a={accum}")


@pytest.mark.parametrize(("accum", "num_steps"), [(2, 6), (4, 4)])
def test_paci_equals_live_weight_loop(accum: int, num_steps: int) -> None:
    run = emulate("paci", 4, num_steps=num_steps, accum=accum)
    ref_loop = LiveWeightsLoop(run.schedule, run.ledger)
    ref = ref_loop.run()
    crossed = [c for st in run.ledger.stages for c in st.crossed]
    assert max(crossed) >= 1, "no micro-batch crossed an update: live weights not exercised"
    assert len(ref_loop.bwd_steps) == run.schedule.total_microbatches * 4
    assert_matches(run, ref, f"paci a={accum}")


# ----- 4. recompute mode ----------------------------------------------------------------------
def test_paci_recompute_equals_recompute_reference() -> None:
    run = emulate("paci", 4, num_steps=6, accum=2, recompute=True)
    ref = LiveWeightsLoop(run.schedule, run.ledger, recompute=True).run()
    assert_matches(run, ref, "paci a=2 recompute")
    saved_graph = LiveWeightsLoop(run.schedule, run.ledger).run()
    assert_differs(ref, saved_graph, "recompute vs saved graph")


def test_1f1b_recompute_is_bitwise_identical() -> None:
    assert_bitwise(emulate("1f1b", 4, recompute=True), emulate("1f1b", 4), "1f1b recompute")


# ----- 5. memory facts ------------------------------------------------------------------------
ALL_SCHEDULES = [
    ("gpipe", None),
    ("1f1b", None),
    ("2bw", None),
    ("pipedream", 1),
    ("pipedream", 2),
    ("paci", 2),
    ("paci", M),
]


@pytest.mark.parametrize(("name", "accum"), ALL_SCHEDULES)
def test_peak_versions_and_inflight_follow_ledger(name: str, accum: int | None) -> None:
    run = emulate(name, 4, num_steps=8 if accum == 1 else 4, accum=accum)
    summary = run.ledger.summary()
    live = [w.versions.peak_live for w in run.workers]
    saved = [w.peak_saved for w in run.workers]
    print(f"{name} a={accum}: peak_live {live} peak_saved {saved}")
    assert live == [row["peak_versions"] for row in summary]
    assert saved == [row["peak_inflight"] for row in summary]
    expected_live = {"2bw": 2, "paci": 1, "gpipe": 1, "1f1b": 1}
    if name in expected_live:
        assert live == [expected_live[name]] * 4
    if name == "pipedream":  # a stash on every stage but the last
        assert min(live[:-1]) >= 2 and live[-1] == 1


def test_paci_activation_memory_equals_1f1b() -> None:
    paci = emulate("paci", 4, num_steps=4, accum=M)
    one_f_one_b = emulate("1f1b", 4, num_steps=4)
    gpipe = emulate("gpipe", 4, num_steps=4)
    paci_bytes = [w.peak_activation_bytes for w in paci.workers]
    assert paci_bytes == [w.peak_activation_bytes for w in one_f_one_b.workers]
    # Stage s holds the saved graphs of P - s micro-batches (1F1B's cap), GPipe of all M.
    per_microbatch = [b // (4 - s) for s, b in enumerate(paci_bytes)]
    assert paci_bytes == [(4 - s) * b for s, b in enumerate(per_microbatch)]
    assert [w.peak_activation_bytes for w in gpipe.workers] == [M * b for b in per_microbatch]
    # what autograd keeps is far more than the stage input (hidden states, fp32)
    hidden = BATCH_SIZE * CFG.max_seq_len * CFG.dim * 4
    assert min(per_microbatch[1:]) > 4 * hidden


# ----- 6. bf16 autocast -----------------------------------------------------------------------
@pytest.mark.parametrize(("name", "accum"), ALL_SCHEDULES)
def test_bf16_autocast_runs_every_schedule(name: str, accum: int | None) -> None:
    run = emulate(name, 4, num_steps=4, accum=accum, autocast_dtype=torch.bfloat16)
    initial = {
        n: p for s in split_model(build_model(CFG, SEED), 4) for n, p in s.named_parameters()
    }
    assert all(torch.isfinite(torch.tensor(loss)) for loss in run.losses)
    for n, p in run.params.items():
        assert p.dtype == torch.float32, f"{n} is {p.dtype}"
        assert torch.isfinite(p).all(), n
    assert any(not torch.equal(p, initial[n]) for n, p in run.params.items()), "nothing trained"


def test_gradient_accumulation_adopts_fresh_tensors_and_copies_shared_ones() -> None:
    from nobubble.engine.saved import accumulate_grads

    params = [torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(6)]
    grad_out, grad_in = torch.ones(2, 3), torch.full((2, 3), 5.0)
    fresh, shared = torch.full((2, 3), 2.0), torch.full((2, 3), 3.0)
    view = torch.full((4, 3), 4.0)[:2]
    first = (fresh, grad_out, shared, shared, view, grad_in)
    accumulate_grads(params, first, (grad_out, grad_in))
    assert params[0].grad is fresh and params[2].grad is shared  # autograd's own: no copy
    # the transport's buffer, a storage adopted already, a view, the gradient sent on: copied
    for p, g in zip(params, first, strict=True):
        assert p.grad is not None
        assert (p.grad.data_ptr() == g.data_ptr()) == (p is params[0] or p is params[2])
    grad_out.fill_(100.0)  # the transport reuses its buffer for the next receive
    view.fill_(100.0)
    accumulate_grads(params, tuple(torch.full((2, 3), 0.5) for _ in params))
    assert torch.equal(grad_in, torch.full((2, 3), 5.0))  # what was sent on is unchanged
    expected = [2.5, 1.5, 3.5, 3.5, 4.5, 5.5]
    for p, value in zip(params, expected, strict=True):
        assert p.grad is not None and torch.equal(p.grad, torch.full((2, 3), value)), value


@pytest.mark.parametrize(
    ("name", "accum", "synchronous"),
    [("gpipe", None, True), ("1f1b", None, True), ("2bw", None, False), ("paci", 2, False)],
)
def test_a_graph_is_built_on_the_parameters_only_when_no_step_can_reach_it(
    name: str, accum: int | None, synchronous: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward whose stage takes no step before its gradient is done reads the module's own
    parameters (no reparametrization per forward); one whose weights a step updates or
    replaces in flight must read aliases, or the update would reach its saved graph."""
    on_params: dict[tuple[int, int], bool] = {}
    forward = StageWorker.forward

    def recording(self: StageWorker, m: int, received: object) -> object:
        out = forward(self, m, received)
        own = dict(self.module.named_parameters())
        leaves = self.saved[m].weights
        on_params[self.stage, m] = all(leaves[n] is p for n, p in own.items())
        return out

    monkeypatch.setattr(StageWorker, "forward", recording)
    run = emulate(name, 2, accum=accum, num_steps=3)
    assert len(on_params) == 2 * run.schedule.total_microbatches
    for st in run.ledger.stages:
        for m in range(run.schedule.total_microbatches):
            stale = st.fwd_version[m] != st.fwd_current[m]  # reads a stash
            reached = stale or st.applied_step[m] != st.fwd_current[m] + 1
            if reached:
                assert not on_params[st.stage, m], f"stage {st.stage} m{m}: a step reaches it"
    if synchronous:
        assert all(on_params.values()), on_params
    else:
        assert not all(on_params.values()), f"{name}: no micro-batch a step reaches"
