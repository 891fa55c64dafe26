"""Sharding within a stage (``shard="fsdp"``): P=2 stages × D=2 replicas, each stage's
parameters, gradients and optimizer state sharded over its two replicas by FSDP2, equal the
emulator with micro-batches twice as large, under every schedule that data parallelism runs.

The oracle is the replicated one (test_data_parallel.py): replica r's micro-batch m is the r-th
half of the emulator's micro-batch m. Not bitwise: each backward's gradient is reduce-scattered
right away (the mean of the two replicas' sums of b rows, where the emulator takes one mean of
2b rows and the replicated runtime averages once per step), and the gradient norm adds the two
shards' squares; the same sums in another order differ in the last bits. So losses, gathered
weights and checkpoint contents are compared within 1e-6 relative (per tensor, in norm), error
feedback's buffer and the Hugging Face Llama's weights and state within 1e-5 (reasons at
RTOL_DISPLACEMENT and RTOL_STATE); the two replicas' gathered weights with each other bitwise.

What the sharded runtime adds is checked bitwise against itself: a run resumed from its
gathered checkpoint continues with the uninterrupted run's numbers, and ``ShardedMuon``'s step
equals ``torch.optim.Muon``'s on unsharded matrices. Every case runs in one launch of 4
processes (process start-up dominates on 2 cores), under NCCL's stream rules on gloo.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

import nobubble
import test_api
from _api_reference import M, Problem
from nobubble.api.pipeline import Observer
from test_api_dist import launch
from test_data_parallel import RTOL, relative_error

STAGES, REPLICAS, STEPS, DRAIN = 2, 2, 4, 2
# error feedback's buffer is the difference of two consecutive weights: its error is the
# weights' (RTOL) times |x| / |x_after - x_before| (above 1e-6 for the 2bw Muon case)
RTOL_DISPLACEMENT = 1e-5
RESUME_AT = 2  # a drain point: the checkpoint the resume case starts from


def uneven_model() -> nn.Sequential:
    """Rows that do not split evenly over two replicas (7 -> 4 + 3, 5 -> 3 + 2) and a head of
    one row, whose second shard is empty."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 1))


def uneven_batch(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(j)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)


UNEVEN = Problem(
    uneven_model,
    lambda model, n: nobubble.split(model, ["2"]),
    uneven_batch,
    nn.functional.mse_loss,
)

# name -> (problem, schedule, Pipeline options); "seq" trains with the callable AdamW of
# _api_reference, the others with named optimizers (StageOptimizer: Muon's part sharded)
CASES: dict[str, tuple[str, str, dict]] = {
    "1f1b": ("seq", "1f1b", {"clip": 0.05}),  # global clipping: the norm summed over shards
    "gpipe": ("seq", "gpipe", {}),
    "zb-h1": ("seq", "zb-h1", {}),  # split backward: I and W each gather the weights
    "pipedream": ("seq", "pipedream", {"accum": 4}),  # stashes of local shards
    "2bw": ("seq", "2bw", {}),
    "paci": ("seq", "paci", {"clip": 0.05}),  # live weights, clipped per stage
    "paci-recompute-lion-ef": (
        "uneven",
        "paci",
        {"recompute": True, "correction": "ef", "optimizer": "lion", "lr": 1e-3},
    ),
    "2bw-muon-ef": ("uneven", "2bw", {"optimizer": "muon", "correction": "ef", "lr": 2e-2}),
    "llama-paci": ("llama", "paci", {}),  # a Hugging Face Llama's stages (test_hf.py's)
}
# AdamW turns last-bit differences of near-zero gradient entries (the embedding rows of tokens a
# batch lacks) into lr-sized steps of either sign: weights and state of the Llama within 1e-5
# (above 1e-6 here), as test_dist_data_parallel.py's GPT
RTOL_STATE = {"llama-paci": 1e-5}
RESUMED = "2bw-muon-ef"  # stashed version, EF buffer and Muon momentum in its checkpoint

RANK_SCRIPT = """
import sys, torch
import test_fsdp
saved = test_fsdp.rank_main()
torch.save(saved, f"{sys.argv[1]}/rank{saved['rank']}.pt")
"""


def get_problem(name: str) -> Problem:
    if name == "llama":
        import test_hf  # transformers only where a case needs it: seconds a process

        return test_hf.LLAMA
    return UNEVEN if name == "uneven" else test_api.SEQ


def runnable(case: str) -> bool:
    return CASES[case][0] != "llama" or importlib.util.find_spec("transformers") is not None


def feed(pipe: nobubble.Pipeline, problem: Problem, start: int, stop: int, sharded: bool) -> dict:
    """Steps ``start`` .. ``stop - 1`` of ``problem``'s batches (this replica's part when
    ``sharded``), draining every DRAIN steps; the losses by micro-batch."""
    losses: dict[int, float] = {}
    for j in range(start, stop):
        x, y = problem.batch(j)
        result = pipe.step(pipe.shard(x), pipe.shard(y)) if sharded else pipe.step(x, y)
        losses.update({r.microbatch: r.value for r in result.losses})
        if (j + 1) % DRAIN == 0:
            losses.update({r.microbatch: r.value for r in pipe.drain().losses})
    return losses


def build(case: str, sharded: bool = True) -> tuple[nobubble.Pipeline, Problem]:
    from _api_reference import adamw

    name, schedule, options = CASES[case]
    problem, options = get_problem(name), dict(options)
    extra = {"runtime": "dist", "timeout": 60, "data_parallel": REPLICAS, "shard": "fsdp"}
    pipe = nobubble.Pipeline(
        problem.cut(problem.make_model(), STAGES),
        problem.loss_fn,
        schedule=schedule,
        microbatches=M,
        optimizer=options.pop("optimizer", adamw),
        observe=Observer(strict_p2p=True),  # NCCL's completion rules on gloo too
        **options,
        **(extra if sharded else {}),
    )
    return pipe, problem


def local_layout(pipe: nobubble.Pipeline) -> dict:
    """This replica's rows of each parameter and of its optimizer state: what is sharded."""
    worker = pipe.by_stage[pipe.rank]
    params = {n: p for n, p in worker.named}
    state = {}
    for opt in getattr(worker.optimizer, "parts", {"all": worker.optimizer}).values():
        torch_opt = getattr(opt, "optimizer", opt)
        for p, s in torch_opt.state.items():
            name = next(n for n, q in params.items() if q is p)
            state[name] = {k: tuple(v.to_local().shape) for k, v in s.items() if v.dim() > 0}
    return {
        "params": {n: (type(p).__name__, tuple(p.to_local().shape)) for n, p in params.items()},
        "state": state,
    }


def muon_step_check(pipe: nobubble.Pipeline) -> float:
    """Three ``ShardedMuon`` steps against ``torch.optim.Muon`` on unsharded copies, the same
    gradients on both: the largest difference of the gathered weights (0 when bitwise)."""
    from nobubble.runtime.distributed.fsdp import _like, shard_stage
    from nobubble.runtime.distributed.shard_comm import Rows
    from nobubble.runtime.distributed.sharded_muon import ShardedMuon

    torch.manual_seed(1)
    full = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Linear(7, 1, bias=False))
    sharded = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Linear(7, 1, bias=False))
    sharded.load_state_dict(full.state_dict())
    fsdp = shard_stage(sharded, pipe.mesh, 60.0, 0)
    settings = {"lr": 0.05, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.1}
    ours = ShardedMuon(torch.optim.Muon(sharded.parameters(), **settings), fsdp.dp)
    theirs = torch.optim.Muon(full.parameters(), **settings)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for p, q in zip(sharded.parameters(), full.parameters(), strict=True):
            g = torch.randn(q.shape, generator=gen)
            q.grad = g.clone()
            p.grad = _like(Rows(g.shape, fsdp.dp.size).local(g, fsdp.dp.rank).clone(), p)
        ours.step()
        theirs.step()
    whole = fsdp.gathered({n: p.detach() for n, p in sharded.named_parameters()})
    return max(float((whole[n] - q).abs().max()) for n, q in full.named_parameters())


def rank_main() -> dict:
    """Every case on this rank (rank_script's body)."""
    saved: dict = {}
    for case in filter(runnable, CASES):
        pipe, problem = build(case)
        losses = feed(pipe, problem, 0, RESUME_AT, sharded=True)
        # gathered from the dp group (every replica calls it); a copy, as a file would be: the
        # optimizer's step counts are live tensors
        middle = copy.deepcopy(pipe.stage_parts())
        losses.update(feed(pipe, problem, RESUME_AT, STEPS, sharded=True))
        saved[case] = {
            "losses": [losses[m] for m in sorted(losses)],
            "weights": pipe.by_stage[pipe.rank].module_state(),
            "part": pipe.stage_parts()[0],
            "middle": middle[0],
            "val": pipe.evaluate(*problem.batch(99)),
            "layout": local_layout(pipe),
        }
    pipe, problem = build(RESUMED)
    pipe.load_stage_parts(RESUME_AT, [saved[RESUMED]["middle"]])
    losses = feed(pipe, problem, RESUME_AT, STEPS, sharded=True)
    saved["resumed"] = {
        "losses": [losses[m] for m in sorted(losses)],
        "part": pipe.stage_parts()[0],
    }
    saved["muon"] = muon_step_check(pipe)
    saved["rank"] = torch.distributed.get_rank()
    pipe.close()
    return saved


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp")
    (out / "rank.py").write_text(RANK_SCRIPT)
    launch(out, STAGES * REPLICAS, [str(out / "rank.py"), str(out)])
    return [torch.load(out / f"rank{r}.pt") for r in range(STAGES * REPLICAS)]


def emulated(case: str) -> tuple[nobubble.Pipeline, list[float]]:
    pipe, problem = build(case, sharded=False)
    losses = feed(pipe, problem, 0, STEPS, sharded=False)
    return pipe, [losses[m] for m in sorted(losses)]


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_replicas_equal_the_emulator_with_twice_the_micro_batch(case, ranks):
    if not runnable(case):
        pytest.skip("transformers is not installed")
    torch.set_num_threads(1)
    rtol = RTOL_STATE.get(case, RTOL)
    pipe, ref_losses = emulated(case)
    runs = [part[case] for part in ranks]  # global rank = dp * P + pp
    last = [runs[d * STAGES + STAGES - 1] for d in range(REPLICAS)]
    assert len(ref_losses) == STEPS * M and all(len(r["losses"]) == STEPS * M for r in last)
    for m, ref in enumerate(ref_losses):  # the global loss: the mean of the replicas' losses
        mean = sum(r["losses"][m] for r in last) / REPLICAS
        assert abs(mean - ref) <= RTOL * abs(ref), (m, mean, ref)
    for stage in range(STAGES):
        replica0, replica1 = runs[stage], runs[STAGES + stage]
        for name, value in pipe.stages[stage].named_parameters():
            assert relative_error(replica0["weights"][name], value.detach()) <= rtol, name
            assert torch.equal(replica0["weights"][name], replica1["weights"][name]), name
        # the checkpoint part: whole tensors, the replicated format
        assert_close_part(replica0["part"], pipe.stage_parts()[stage], f"stage{stage}", rtol)
        assert_close_part(replica0["part"], replica1["part"], f"stage{stage} replicas")
    val = pipe.evaluate(*get_problem(CASES[case][0]).batch(99))
    assert abs(last[0]["val"] - val) <= RTOL * abs(val)


@pytest.mark.parametrize("case", ["1f1b", "2bw-muon-ef"])
def test_each_replica_holds_its_rows_of_every_parameter_and_of_its_optimizer_state(case, ranks):
    """FSDP2's Shard(0): replica r holds rows r·c .. min((r+1)·c, n), c = ceil(n / 2), of each
    parameter (DTensors) and of each parameter-shaped optimizer state (AdamW's moments,
    Muon's momentum); a one-row head leaves the second replica empty."""
    from nobubble.runtime.distributed.shard_comm import Rows

    pipe, _ = emulated(case)
    for stage in range(STAGES):
        for name, p in pipe.stages[stage].named_parameters():
            rows = [ranks[d * STAGES + stage][case]["layout"] for d in range(REPLICAS)]
            for d, layout in enumerate(rows):
                start, stop = Rows(p.shape, REPLICAS).span(d)
                expect = (stop - start, *p.shape[1:])
                assert layout["params"][name] == ("DTensor", expect), (stage, name, d)
                assert all(shape == expect for shape in layout["state"][name].values()), name
            assert sum(layout["params"][name][1][0] for layout in rows) == p.shape[0]
    if case == "2bw-muon-ef":
        layout = ranks[STAGES + 1][case]["layout"]  # replica 1 of stage 1: the head's 0 rows
        assert layout["params"]["4.weight"] == ("DTensor", (0, 5))
        assert set(layout["state"]["2.weight"]) == {"momentum_buffer"}  # Muon's


def test_a_sharded_run_resumed_from_its_checkpoint_continues_bitwise(ranks):
    """The checkpoint is gathered per stage and cut again on load: the 2bw run resumed at step
    2 (its stashed version, EF buffer and Muon momentum included) gives the uninterrupted run's
    losses and final state bit for bit."""
    for rank in ranks:
        uninterrupted, resumed = rank[RESUMED], rank["resumed"]
        assert resumed["losses"] == uninterrupted["losses"][RESUME_AT * M :]
        assert_bitwise(resumed["part"], uninterrupted["part"], "part")
    assert ranks[0][RESUMED]["middle"]["versions"]["stash"], "2bw keeps a stash at step 2"


def test_a_sharded_checkpoint_resumes_in_the_emulator(ranks):
    """The gathered parts are the replicated format: the emulator (one process, micro-batches
    twice as large) continues from them with the sharded run's numbers, within RTOL."""
    pipe, problem = build(RESUMED, sharded=False)
    middle = [ranks[stage][RESUMED]["middle"] for stage in range(STAGES)]  # replica 0's
    pipe.load_stage_parts(RESUME_AT, middle)
    feed(pipe, problem, RESUME_AT, STEPS, sharded=False)
    for stage in range(STAGES):
        assert_close_part(ranks[stage][RESUMED]["part"], pipe.stage_parts()[stage], str(stage))


def test_sharded_muon_steps_as_torch_muon_on_whole_matrices(ranks):
    assert all(rank["muon"] == 0.0 for rank in ranks), [rank["muon"] for rank in ranks]


def test_newton_schulz_is_torch_muons_iteration():
    from torch.optim._muon import _zeropower_via_newtonschulz

    from nobubble.runtime.distributed.sharded_muon import newton_schulz

    gen = torch.Generator().manual_seed(0)
    for shape in [(7, 5), (5, 7), (1, 5)]:
        g = torch.randn(shape, generator=gen)
        coefficients = (3.4445, -4.7750, 2.0315)
        expect = _zeropower_via_newtonschulz(g, coefficients, 5, 1e-7)
        assert torch.equal(newton_schulz(g, coefficients, 5, 1e-7), expect), shape


def assert_close_part(a, b, where: str, rtol: float = RTOL) -> None:
    """Checkpoint parts: tensors within ``rtol`` relative (in norm), EF's buffer within
    RTOL_DISPLACEMENT, the rest equal (peaks are per replica: half the rows)."""
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype, where
        if a.is_floating_point():
            assert relative_error(a, b) <= rtol, (where, relative_error(a, b))
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(a), sorted(b))
        for key in set(a) - {"peak_saved", "peak_activation_bytes"}:
            tol = RTOL_DISPLACEMENT if key == "correction" else rtol
            assert_close_part(a[key], b[key], f"{where}.{key}", tol)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close_part(x, y, f"{where}[{i}]", rtol)
    else:
        assert a == b, (where, a, b)


def assert_bitwise(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_the_cases_cover_every_schedule_data_parallelism_runs():
    """Data parallelism runs one stage per rank: every schedule but the virtual-stage ones."""
    from nobubble.core.schedules import SCHEDULES

    ran = {schedule for _, schedule, _ in CASES.values()}
    assert ran == set(SCHEDULES) - {"interleaved-1f1b", "zbv", "dualpipev", "looped-bfs"}
