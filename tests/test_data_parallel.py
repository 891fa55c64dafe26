"""Data parallel × pipeline: P=2 stages × D=2 replicas equal one emulated pipeline.

The oracle (issue 11): replica r's micro-batch m is the r-th half of micro-batch m of the
emulator's run, whose micro-batches are twice as large, so the two train the same model. Not
bitwise: the emulator's gradient of a micro-batch of 2b rows is one mean over 2b rows, the
replicas' is the mean of two means over b rows each, added by the all-reduce (and the loss a
mean of two losses); the same sums in another order differ in the last bits. So losses, final
weights and checkpoint contents are compared within 1e-6 relative (per tensor, in norm), and the
two replicas with each other bitwise (every rank receives the same all-reduced sums).

All four schedules run in one launch of 4 processes (process start-up dominates on 2 cores),
under NCCL's stream rules enforced on gloo (``strict``): the dp all-reduce shares each rank's
stream with its point-to-point batches, so an order where a receive stays pending across it
would hang here and fail by the timeout.
"""

from __future__ import annotations

import json

import pytest
import torch

from _api_reference import M, run_pipeline
from test_api_dist import launch, problems

STAGES, REPLICAS, STEPS, DRAIN = 2, 2, 4, 2
SCHEDULES = {
    "1f1b": {"clip": 0.05},  # global clipping: the norm of the dp-averaged gradient
    "2bw": {},
    "paci": {"clip": 0.05},  # per-stage clipping, of the averaged gradient too
    "pipedream": {"accum": 4},
}
RTOL = 1e-6

DP_SCRIPT = """
import json, sys, torch
out, schedules = sys.argv[1], json.loads(sys.argv[2])
import problems, nobubble
from _api_reference import M, adamw
from nobubble.api.pipeline import Observer
problem = problems.PROBLEMS["seq"]
saved = {}
for schedule, options in schedules.items():
    model = problem.make_model()
    pipe = nobubble.Pipeline(problem.cut(model, 2), problem.loss_fn, schedule=schedule,
                             microbatches=M, optimizer=adamw, runtime="dist", timeout=60,
                             data_parallel=2, bucket_mb=0.0005,
                             observe=Observer(strict_p2p=True), **options)
    losses = {}
    for j in range(%(steps)d):
        x, y = problem.batch(j)
        result = pipe.step(pipe.shard(x), pipe.shard(y))
        losses.update({r.microbatch: r.value for r in result.losses})
        if (j + 1) %% %(drain)d == 0:
            losses.update({r.microbatch: r.value for r in pipe.drain().losses})
    losses.update({r.microbatch: r.value for r in pipe.drain().losses})
    saved[schedule] = {
        "losses": [losses[m] for m in sorted(losses)],
        "weights": {n: p.detach().clone() for n, p in pipe.stages[pipe.rank].named_parameters()},
        "part": pipe.stage_parts()[0],
        "val": pipe.evaluate(*problem.batch(99)),
    }
rank = torch.distributed.get_rank()
torch.save(saved, f"{out}/rank{rank}.pt")
pipe.close()
"""


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_close_state(a, b, where: str = "part") -> None:
    """Recursive comparison; tensors within RTOL relative (in norm), the rest equal."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            assert relative_error(a, b) <= RTOL, (where, relative_error(a, b))
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(a), sorted(b))
        for key in a:
            if key not in ("peak_saved", "peak_activation_bytes"):
                assert_close_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def dp_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp")
    script = DP_SCRIPT % {"steps": STEPS, "drain": DRAIN}
    (out / "dp.py").write_text(script)
    launch(out, STAGES * REPLICAS, [str(out / "dp.py"), str(out), json.dumps(SCHEDULES)])
    return [torch.load(out / f"rank{r}.pt") for r in range(STAGES * REPLICAS)]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_replicas_of_two_stages_equal_the_emulator_with_twice_the_micro_batch(
    schedule, dp_ranks
):
    torch.set_num_threads(1)
    pipe, ref_losses, _ = run_pipeline(
        problems()["seq"], schedule, STAGES, STEPS, DRAIN, **SCHEDULES[schedule]
    )
    ranks = [part[schedule] for part in dp_ranks]  # global rank = dp * P + pp
    last = [ranks[d * STAGES + STAGES - 1] for d in range(REPLICAS)]
    assert len(ref_losses) == STEPS * M and all(len(r["losses"]) == STEPS * M for r in last)
    for m, ref in enumerate(ref_losses):  # the global loss: the mean of the replicas' losses
        mean = sum(r["losses"][m] for r in last) / REPLICAS
        assert abs(mean - ref) <= RTOL * abs(ref), (m, mean, ref)
    for stage in range(STAGES):
        replica0, replica1 = ranks[stage], ranks[STAGES + stage]
        ours = {n: p.detach() for n, p in pipe.stages[stage].named_parameters()}
        for name, value in ours.items():
            assert relative_error(replica0["weights"][name], value) <= RTOL, (stage, name)
            assert torch.equal(replica0["weights"][name], replica1["weights"][name])
        assert_close_state(replica0["part"], pipe.stage_parts()[stage], f"stage{stage}")
    val = pipe.evaluate(*problems()["seq"].batch(99))
    assert abs(last[0]["val"] - val) <= RTOL * abs(val)


def test_the_replicas_really_differ_before_the_all_reduce():
    """The oracle would hold trivially if both replicas read the same rows: they do not."""
    x, _ = problems()["seq"].batch(0)
    m, rows = M, x.shape[0] // (M * REPLICAS)
    halves = [x.reshape(m, REPLICAS, rows, -1)[:, r] for r in range(REPLICAS)]
    assert not torch.equal(halves[0], halves[1])


def test_a_global_batch_is_cut_into_each_replicas_slice_of_every_micro_batch():
    from nobubble.api.steps import shard_tree as _shard_tree

    x = torch.arange(16).reshape(16, 1)  # M=2 micro-batches of 8 rows, D=4 replicas of 2
    parts = [_shard_tree({"x": x}, 2, 4, r)["x"].flatten().tolist() for r in range(4)]
    assert parts == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]
    with pytest.raises(ValueError, match="multiple of microbatches × data_parallel = 8"):
        _shard_tree(x[:12], 2, 4, 0)


def test_data_parallel_bad_values_are_refused_before_any_work():
    import nobubble
    from test_api import CUTS, loss_fn, make_model

    stages = nobubble.split(make_model(), CUTS[2])
    with pytest.raises(ValueError, match="data_parallel=0 is not allowed"):
        nobubble.Pipeline(stages, loss_fn, runtime="dist", data_parallel=0)
    with pytest.raises(ValueError, match="needs runtime='dist'"):
        nobubble.Pipeline(stages, loss_fn, data_parallel=2)


def test_a_world_that_is_not_p_times_d_is_refused_before_the_rendezvous(monkeypatch):
    import nobubble
    from test_api import CUTS, loss_fn, make_model

    for key, value in dict(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: a rendezvous would hang
    stages = nobubble.split(make_model(), CUTS[2])
    with pytest.raises(ValueError, match="holds 3 processes for 2 stages × data_parallel=2"):
        nobubble.Pipeline(stages, loss_fn, runtime="dist", data_parallel=2)


# ----- the plan: where the all-reduce sits in each rank's stream ---------------------------------
def test_every_step_all_reduces_once_with_no_receive_pending_across_it():
    """Pure plan check over a grid: each STEP has one dp all-reduce at its position, after the
    send of the last backward's gradient, before the STEP's norm gather, and every receive
    posted before it was consumed by an earlier action (none is pending across it)."""
    from nobubble.core.comm import ALLREDUCE, GATHER, RECV, SEND, check_communication
    from nobubble.core.deps import remote_dependency
    from nobubble.core.schedules import SCHEDULES, build_schedule

    for name in ("gpipe", "1f1b", "pipedream", "2bw", "paci", "zb-h1"):
        for stages in (1, 2, 3, 4):
            for micro in (1, 2, 4):
                if name == "2bw" and micro < stages - 1:
                    continue
                schedule = build_schedule(name, stages, micro, 3)
                clip = SCHEDULES[name].synchronous
                plans = check_communication(schedule, clip, [3], data_parallel=True)
                for rank, batches in enumerate(plans):
                    order = schedule.ranks[rank]
                    steps = [i for i, a in enumerate(order) if a.kind == "STEP"]
                    reduces = [k for k, b in enumerate(batches) if b.ops[0].kind == ALLREDUCE]
                    assert [batches[k].position for k in reduces] == steps, (name, rank)
                    for k in reduces:
                        step = batches[k].ops[0].message
                        earlier = [op for b in batches[:k] for op in b.ops]
                        consumers = {
                            op.message: i
                            for i, a in enumerate(order)
                            if (src := remote_dependency(a, stages)) is not None
                            for op in earlier
                            if op.kind == RECV and op.message == src
                        }
                        assert all(i < batches[k].position for i in consumers.values())
                        later = batches[k + 1] if k + 1 < len(batches) else None
                        if later is not None and later.position == batches[k].position:
                            assert later.ops[0].kind == GATHER, (name, rank, step)
                        previous = order[batches[k].position - 1]
                        if stages > 1 and previous.kind == "B" and previous.stage > 0:
                            assert any(
                                op.kind == SEND and op.message == previous
                                for b in batches[:k]
                                for op in b.ops
                            ), (name, rank, step)


# ----- the simulator's cost of the all-reduce ----------------------------------------------------
def test_the_simulator_adds_the_all_reduce_to_every_step_of_every_stage():
    """P=1 closed form: each step is M forwards and backwards, then the all-reduce it waits
    for; at P=2 under 1F1B's flush each step's critical path crosses both stages' STEP once
    before the next batch starts, so N steps add N·allreduce too."""
    from nobubble.core.schedules import build_schedule
    from nobubble.core.sim import CostModel, simulate
    from nobubble.core.sim.cost import ring_allreduce

    fwd, bwd, a, steps, micro = 1.0, 2.0, 0.75, 3, 4
    one = build_schedule("1f1b", 1, micro, steps)
    cost = CostModel(fwd=fwd, bwd=bwd, allreduce=a)
    assert simulate(one, cost).metrics.makespan == steps * (micro * (fwd + bwd) + a)
    two = build_schedule("1f1b", 2, micro, steps)
    base = simulate(two, CostModel(fwd=fwd, bwd=bwd)).metrics.makespan
    assert simulate(two, cost).metrics.makespan == base + steps * a
    assert ring_allreduce(8.0, 4, bandwidth=1.0) == 2 * 3 * 2.0  # 2(D-1) hops of bytes/D
    assert ring_allreduce(8.0, 1, bandwidth=1.0) == 0.0
    with pytest.raises(ValueError, match="--allreduce must be finite and >= 0"):
        CostModel(allreduce=-1.0)


# ----- the overlap: buckets launched from inside the last backward -------------------------------
class _Done:
    """The handle of an all-reduce over one replica: the sum is the tensor itself."""

    def wait(self, timeout_s: float, what: str) -> None:
        pass


def _linear_worker(
    model: torch.nn.Module, micro: int, schedule_name: str = "1f1b", stages: int = 1
):
    """The last stage of a ``stages``-stage ``schedule_name`` pipeline, trained with SGD."""
    from nobubble.api.arguments import TorchOptimizer
    from nobubble.core.ledger import build_ledger
    from nobubble.core.schedules import build_schedule
    from nobubble.engine import StageWorker
    from nobubble.optim import NoCorrection

    schedule = build_schedule(schedule_name, stages, micro, 1)
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)) for _ in "ab"]
    return StageWorker(
        model,
        schedule,
        build_ledger(schedule).stages[stages - 1],
        TorchOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
        NoCorrection(),
        lambda m: data[m],
        None,
        loss_fn=torch.nn.functional.mse_loss,
    )


@pytest.mark.parametrize("micro", [1, 2])
def test_the_last_backward_launches_each_bucket_while_autograd_still_runs(micro):
    """DDP's overlap (issue 11): the backward that completes the batch launches each bucket as
    soon as its gradients are final, from inside autograd, the last layers' first; earlier
    backwards launch nothing. The first layer's gradient is not final at the first launch, so
    autograd had work left. The gradients written back are bitwise those of the accumulation
    without hooks (one replica: the mean is the sum)."""
    import copy

    from nobubble.runtime.distributed.data_parallel import GradReducer

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    twin = _linear_worker(copy.deepcopy(model), micro)
    worker = _linear_worker(model, micro)
    reducer = GradReducer(worker, 1, bucket_mb=300 / 2**20)  # one Linear (288 bytes) a bucket
    assert [len(b) for b in reducer.groups] == [2, 2, 2, 2]
    launches: list[tuple[int, bool, bool]] = []
    first = layers[0].weight
    before: list[torch.Tensor | None] = []

    def start(flats: list[torch.Tensor]) -> _Done:
        inside = torch._C._current_graph_task_id() != -1  # called from inside a backward
        now, then = first.grad, before[0]
        unchanged = now is None if then is None else now is not None and torch.equal(now, then)
        launches.append((len(flats), inside, unchanged))
        return _Done()

    reducer.bind(start, eager=True)
    for m in range(micro):
        for w in (worker, twin):
            w.forward(m, None)
        before[:] = [None if first.grad is None else first.grad.clone()]
        for w in (worker, twin):
            w.backward(m, None)
        assert len(launches) == (0 if m < micro - 1 else 4), (m, launches)
    assert [n for n, _, _ in launches] == [1, 1, 1, 1]  # one bucket a launch
    assert all(inside for _, inside, _ in launches), launches
    assert all(unchanged for _, _, unchanged in launches[:3]), launches
    assert reducer.early[1] == 4
    assert sorted(reducer.pending[1].flats) == [0, 1, 2, 3]
    reducer.finish(1, 1.0, "the test's all-reduce")
    for (name, p), (_, q) in zip(worker.named, twin.named, strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_without_the_eager_binding_the_plan_launches_every_bucket_at_once():
    """The strict stream's way: the backward launches nothing, ``launch_rest`` all of it."""
    from nobubble.runtime.distributed.data_parallel import GradReducer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    worker = _linear_worker(model, 1)
    reducer = GradReducer(worker, 1, bucket_mb=300 / 2**20)
    launches: list[int] = []
    reducer.bind(lambda flats: launches.append(len(flats)) or _Done(), eager=False)
    worker.forward(0, None)
    worker.backward(0, None)
    assert launches == [] and worker.reducer is None
    reducer.launch_rest(1)
    assert launches == [2] and reducer.early[1] == 0


@pytest.mark.parametrize(("bucket_mb", "first_mb"), [(25.0, 1.0), (0.5, 0.5)])
def test_buckets_are_cut_from_the_last_layer_and_the_first_launched_is_small(bucket_mb, first_mb):
    """DDP's layout: buckets cover the parameters in order, cut from the last parameter back,
    the order the backward finishes them; the one launched first (the last) holds at most 1 MB
    (or the bucket size if smaller), the others at most the bucket size."""
    from types import SimpleNamespace

    from nobubble.runtime.distributed.data_parallel import GradReducer

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(12)])  # 257 KB each
    named = list(model.named_parameters())
    stage = SimpleNamespace(named=named, share=lambda: None)
    groups = GradReducer(stage, 2, bucket_mb).groups
    assert [p for group in groups for p in group] == [p for _, p in named]  # in order, once
    sizes = [sum(p.numel() * p.element_size() for p in group) / 2**20 for group in groups]
    assert sizes[-1] <= first_mb < sizes[-1] + 0.26, sizes  # as full as one more weight allows
    assert all(size <= bucket_mb for size in sizes), sizes
    if bucket_mb == 25.0:
        assert len(groups) == 2  # 1 MB last, the remaining 2 MB in one


def test_a_split_last_w_with_input_gradient_launches_every_bucket_when_it_returns():
    """Stage 1 of zb-h1 splits its backward into I and W; W's per-group autograd calls give a
    weight only part of its gradient each, so nothing launches from inside W: every bucket goes
    in one launch when the batch's last W returns, outside autograd. The gradients are bitwise
    those of the fused backward's accumulation (one replica: the mean is the sum)."""
    import copy

    from nobubble.runtime.distributed.data_parallel import GradReducer

    micro = 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    gen = torch.Generator().manual_seed(1)
    received = [torch.randn(4, 8, generator=gen) for _ in "ab"]

    def stage_1(module: torch.nn.Module):
        return _linear_worker(module, micro, "zb-h1", stages=2)

    worker, fused = stage_1(model), stage_1(copy.deepcopy(model))
    reducer = GradReducer(worker, 1, bucket_mb=300 / 2**20)  # one Linear a bucket
    launches: list[tuple[int, bool]] = []

    def start(flats: list[torch.Tensor]) -> _Done:
        launches.append((len(flats), torch._C._current_graph_task_id() != -1))
        return _Done()

    reducer.bind(start, eager=True)
    for m in range(micro):
        worker.forward(m, received[m])
        fused.forward(m, received[m])
        assert worker.backward_input(m, None) is not None  # the previous stage's gradient
        worker.backward_weight(m)
        fused.backward(m, None)
        assert launches == ([] if m < micro - 1 else [(4, False)]), (m, launches)
    assert reducer.early[1] == 0 and sorted(reducer.pending[1].flats) == [0, 1, 2, 3]
    reducer.finish(1, 1.0, "the test's all-reduce")
    for (name, p), (_, q) in zip(worker.named, fused.named, strict=True):
        assert torch.equal(p.grad, q.grad), name
