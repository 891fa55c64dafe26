"""``Pipeline(runtime="dist")``: real processes over gloo give the emulator's numbers.

Each launch starts one rank per stage and runs the cases of its P one after the other; the ranks
build the same pipeline and feed the same batches (with a drain in the middle), then each test
compares the last rank's losses and each rank's weights with the emulated pipeline of this
process, bitwise: the runtime posts the same
arithmetic in the same order, and the only cross-rank reductions (the global gradient norm, the
sum of tied gradients) add the stages' shares in stage order on every rank.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _api_reference import M, Problem, run_pipeline
from nobubble.app.ranks.launch import free_port
from test_api import batch, loss_fn

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
STEPS, DRAIN = 6, 3
SCHEDULES = ["gpipe", "1f1b", "pipedream", "2bw", "paci", "zb-h1"]

RANK_SCRIPT = """
import json, sys, torch
cases, out = json.loads(sys.argv[1]), sys.argv[2]
import problems
from _api_reference import run_pipeline
saved = {}
for case in cases:  # the cases of one P, one after the other in the same processes
    problem = problems.get(case["problem"])
    pipe, losses, _ = run_pipeline(problem, case["schedule"], case["stages"], case["steps"],
                                   case["drain"], runtime="dist", timeout=60, **case["options"])
    saved[case["id"]] = {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in pipe.stages[pipe.rank].named_parameters()},
        "merged": sorted(pipe.merged_state_dict()),
        "val": pipe.evaluate(*problem.batch(99)),
        # a language model samples through its stages on every rank
        "generated": pipe.generate([1, 2, 3], 4, context=5, top_k=8, seed=0)
        if case["problem"].removeprefix("meta-") in problems.HF else None,
        "others_meta": all(p.is_meta for s, m in enumerate(pipe.stages) if s != pipe.rank
                           for p in m.parameters()),
    }
    pipe.save_weights(f"{out}/weights-{case['id']}")
torch.save(saved, f"{out}/rank{pipe.rank}.pt")
pipe.close()
"""

GRID_SCRIPT = """
import json, sys, torch
stages, out, schedules = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
import problems
from _api_reference import run_pipeline
saved = {}
for schedule, transport in [(s, t) for s in schedules for t in ("strict", "eager")]:
    options = {"accum": 4} if schedule == "pipedream" else {}  # M=4 (pipedream's default a=1)
    pipe, losses, _ = run_pipeline(problems.PROBLEMS["seq"], schedule, stages, 4, 2, clip=0.5,
                                   runtime="dist", timeout=60,
                                   strict_p2p=transport == "strict", **options)
    saved[schedule, transport] = {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in pipe.stages[pipe.rank].named_parameters()},
    }
torch.save(saved, f"{out}/rank{pipe.rank}.pt")
pipe.close()
"""

# Several stages per rank: interleaved-1f1b (v=2), zbv, looped-bfs (v=2) and dualpipev (P=2
# only: it needs M >= 2P), P=2 and P=3, one launch per P; each run under NCCL's rules and under
# eager posting, with global clipping and a drain point, then evaluated.
MULTI_STAGE = ["interleaved-1f1b", "zbv", "looped-bfs"]
V_LAST_ON_RANK_0 = ("zbv", "dualpipev")  # the V's last stage is on rank 0


def multi_stage(ranks: int) -> list[str]:
    return MULTI_STAGE + (["dualpipev"] if 2 * ranks <= M else [])


MULTI_STAGE_SCRIPT = """
import json, sys, torch
stages, out, schedules = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
import test_api_dist  # not problems.py: importing transformers would cost seconds a process
from _api_reference import run_pipeline
problem, saved = test_api_dist.DEEP, {}
for schedule, transport in [(s, t) for s in schedules for t in ("strict", "eager")]:
    pipe, losses, _ = run_pipeline(problem, schedule, 2 * stages, 4, 2, clip=0.5,
                                   runtime="dist", timeout=60,
                                   strict_p2p=transport == "strict")
    saved[schedule, transport] = {
        "losses": losses,
        "weights": {s: {n: p.detach().clone() for n, p in pipe.stages[s].named_parameters()}
                    for s in pipe.local},
        "val": pipe.evaluate(*problem.batch(99)),
        "merged": pipe.merged_state_dict(),
    }
torch.save(saved, f"{out}/rank{pipe.rank}.pt")
pipe.close()
"""


def deep_model() -> torch.nn.Sequential:
    """Six (Linear, Tanh) pairs: enough stages with weights for 2P = 6 at P = 3."""
    torch.manual_seed(0)
    widths = [8, 16, 16, 16, 16, 16, 4]
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def deep_cut(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    import nobubble

    points = {4: ["2", "4", "6"], 6: ["2", "4", "6", "8", "10"]}[n]
    return nobubble.split(model, points)


DEEP = Problem(deep_model, deep_cut, batch, loss_fn)

PROBLEMS_MODULE = """
import nobubble
from _api_reference import Problem, built_on_meta, tree_model, tree_forward
import test_api
PROBLEMS = {
    "seq": test_api.SEQ,
    "tree": Problem(tree_model, lambda m, n: [m[0], m[1]], test_api.batch, test_api.loss_fn,
                    tree_forward),
}
HF = ("llama", "gpt2")


def get(name):
    # transformers only where a case needs it: importing it costs seconds a process
    if name.removeprefix("meta-") in HF and name not in PROBLEMS:
        import test_hf
        PROBLEMS.update(llama=test_hf.LLAMA, gpt2=test_hf.GPT2)
        PROBLEMS.update({"meta-llama": built_on_meta(test_hf.LLAMA),
                         "meta-gpt2": built_on_meta(test_hf.GPT2)})
    return PROBLEMS[name]


def available():
    try:
        for name in HF:
            get(name)
    except Exception:  # transformers missing: the HF cases skip
        pass
    return PROBLEMS
"""


def problems() -> dict:
    sys.path.insert(0, str(TESTS))
    namespace: dict = {}
    exec(PROBLEMS_MODULE, namespace)
    return namespace["available"]()


def launch(out: Path, world: int, args: list[str]) -> None:
    """``world`` ranks of ``python ARGS`` on this machine, one torch thread each."""
    (out / "problems.py").write_text(PROBLEMS_MODULE)
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(out), str(TESTS), str(SRC)]),
        )
        command = [sys.executable, *args]
        procs.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True))
    try:
        errors = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)


CASES = [
    ("seq", "1f1b", 2, {"clip": 0.5}),  # global clipping: the norm gathered across the ranks
    ("seq", "paci", 2, {}),
    ("seq", "2bw", 2, {"correction": "ef"}),
    ("tree", "1f1b", 2, {}),  # a dict boundary with an integer leaf
    ("llama", "paci", 2, {}),
    # tied embeddings on ranks 0 and 2: the pair swaps gradients, rank 1 gets their square
    ("gpt2", "1f1b", 3, {"clip": 0.5}),
    # built on the meta device: each rank materializes its own stage alone (seed=0, the seed of
    # the normal build), the tied head's copy from the embedding's draws
    ("meta-llama", "paci", 2, {"seed": 0}),
    ("meta-gpt2", "1f1b", 3, {"clip": 0.5, "seed": 0}),
]


def case_id(problem: str, schedule: str, options: dict) -> str:
    return f"{problem}-{schedule}-{json.dumps(options, sort_keys=True)}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(P)``: each rank's results of every case at P, from one launch per P."""
    runs: dict[int, list[dict]] = {}

    def get(stages: int) -> list[dict]:
        if stages not in runs:
            out = tmp_path_factory.mktemp(f"cases-{stages}")
            available = problems()
            cases = [
                {
                    "id": case_id(problem, schedule, options),
                    "problem": problem,
                    "schedule": schedule,
                    "stages": stages,
                    "steps": STEPS,
                    "drain": DRAIN,
                    "options": options,
                }
                for problem, schedule, p, options in CASES
                if p == stages and problem in available
            ]
            (out / "rank.py").write_text(RANK_SCRIPT)
            launch(out, stages, [str(out / "rank.py"), json.dumps(cases), str(out)])
            runs[stages] = [torch.load(out / f"rank{r}.pt") for r in range(stages)]
            get.out[stages] = out  # type: ignore[attr-defined]
        return runs[stages]

    get.out = {}  # type: ignore[attr-defined]
    return get


@pytest.mark.parametrize(("problem", "schedule", "stages", "options"), CASES, ids=lambda v: str(v))
def test_dist_pipeline_equals_the_emulated_pipeline(problem, schedule, stages, options, launched):
    available = problems()
    if problem not in available:
        pytest.skip("transformers is not installed")
    parts = [part[case_id(problem, schedule, options)] for part in launched(stages)]
    torch.set_num_threads(1)
    reference, options = problem.removeprefix("meta-"), dict(options)
    built_on_meta = options.pop("seed", None) is not None  # the reference is built normally
    pipe, losses, _ = run_pipeline(available[reference], schedule, stages, STEPS, DRAIN, **options)
    assert all(part["losses"] == [] for part in parts[:-1]) and parts[-1]["losses"] == losses
    for rank, part in enumerate(parts):
        ours = {n: p.detach() for n, p in pipe.stages[rank].named_parameters()}
        assert part["weights"].keys() == ours.keys()
        for name, value in ours.items():
            assert torch.equal(part["weights"][name], value), (rank, name)
    assert [part["val"] for part in parts] == [None] * (stages - 1) + [
        pipe.evaluate(*available[problem].batch(99))
    ]
    whole = sorted(n for s in pipe.stages for n in s.state_dict())
    assert all(part["merged"] == whole for part in parts)
    if reference in ("llama", "gpt2"):  # every rank got the emulated pipeline's tokens
        ids = pipe.generate([1, 2, 3], 4, context=5, top_k=8, seed=0)
        assert all(part["generated"] == ids for part in parts)
    # no rank held another rank's stage (built on meta), or every rank did (built normally)
    assert all(part["others_meta"] == built_on_meta for part in parts)


@pytest.mark.parametrize("problem", ["meta-llama", "meta-gpt2"])
def test_dist_weights_saved_per_rank_load_with_from_pretrained(problem, launched):
    """``Pipeline.save_weights`` on every rank: each writes its stage's shard, rank 0 the index
    from their records; with the model's config beside them, transformers' from_pretrained
    loads the folder and gives the logits of the trained pipeline's stages (the emulator's)."""
    available = problems()
    if problem not in available:
        pytest.skip("transformers is not installed")
    case = next(c for c in CASES if c[0] == problem)
    _, schedule, stages, options = case
    launched(stages)
    folder = launched.out[stages] / f"weights-{case_id(problem, schedule, options)}"
    reference = available[problem.removeprefix("meta-")]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-{k:05d}-of-{stages:05d}.safetensors" for k in range(1, stages + 1)
    ]
    reference.make_model().config.save_pretrained(folder)
    transformers = pytest.importorskip("transformers")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    torch.set_num_threads(1)
    options = {k: v for k, v in options.items() if k != "seed"}
    pipe, _, _ = run_pipeline(reference, schedule, stages, STEPS, DRAIN, **options)
    x = reference.batch(7)[0]
    with torch.no_grad():
        ours = x
        for stage in pipe.stages:
            ours = stage(ours)
        assert torch.equal(reloaded(x).logits, ours)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_schedule_under_either_transport_equals_the_emulated_pipeline(stages, tmp_path):
    """NCCL's rules enforced on gloo (one stream per rank, a batch starts when the previous one
    completed, tags ignored): an order NCCL would deadlock on hangs here and fails by the
    timeout. Every schedule, with clipping (global for the synchronous ones) and a drain point,
    under those rules and under gloo's eager posting (the production transport on gloo), in one
    launch per P."""
    (tmp_path / "grid.py").write_text(GRID_SCRIPT)
    args = [str(tmp_path / "grid.py"), str(stages), str(tmp_path), json.dumps(SCHEDULES)]
    launch(tmp_path, stages, args)
    torch.set_num_threads(1)
    available = problems()
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(stages)]
    for schedule in SCHEDULES:
        options = {"accum": 4} if schedule == "pipedream" else {}
        pipe, losses, _ = run_pipeline(
            available["seq"], schedule, stages, 4, 2, clip=0.5, **options
        )
        for transport in ("strict", "eager"):
            run = (schedule, transport)
            assert parts[-1][run]["losses"] == losses, run
            for rank, part in enumerate(parts):
                ours = {n: p.detach() for n, p in pipe.stages[rank].named_parameters()}
                theirs = part[run]["weights"]
                assert theirs.keys() == ours.keys()
                assert all(torch.equal(theirs[n], v) for n, v in ours.items()), (run, rank)


@pytest.mark.parametrize("ranks", [2, 3])
def test_several_stages_per_rank_equal_the_emulated_pipeline(ranks, tmp_path):
    """interleaved-1f1b (v=2), zbv, looped-bfs and dualpipev: each rank runs 2 stages, posts
    its receives in the sender's order (some early, buffered until their consumer runs) and
    hands its own stages' activations over locally. Under NCCL's rules (strict) and under
    gloo's eager posting, the path users run (a batch of several receives is waited for once
    per message: gloo's second wait on a completed receive hung until the timeout), with the
    global norm gathered and a drain in the middle: losses, every stage's weights, evaluate
    (returned by the rank of the last stage: rank 0 under the V) and the merged state are
    bitwise the emulator's."""
    (tmp_path / "multi.py").write_text(MULTI_STAGE_SCRIPT)
    args = [str(tmp_path / "multi.py"), str(ranks), str(tmp_path), json.dumps(multi_stage(ranks))]
    launch(tmp_path, ranks, args)
    torch.set_num_threads(1)
    problem = DEEP
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(ranks)]
    for schedule in multi_stage(ranks):
        pipe, losses, _ = run_pipeline(problem, schedule, 2 * ranks, 4, 2, clip=0.5)
        last = pipe.schedule.placement.rank_of(2 * ranks - 1)
        assert last == (0 if schedule in V_LAST_ON_RANK_0 else ranks - 1)
        expected_val = pipe.evaluate(*problem.batch(99))
        merged = pipe.merged_state_dict()
        for rank, transport in itertools.product(range(ranks), ("strict", "eager")):
            where = (schedule, transport, rank)
            mine = parts[rank][schedule, transport]
            assert mine["losses"] == (losses if rank == last else []), where
            assert sorted(mine["weights"]) == list(pipe.schedule.placement.stages_of(rank))
            for stage, theirs in mine["weights"].items():
                ours = {n: p.detach() for n, p in pipe.stages[stage].named_parameters()}
                assert theirs.keys() == ours.keys()
                assert all(torch.equal(theirs[n], v) for n, v in ours.items()), (where, stage)
            assert mine["val"] == (expected_val if rank == last else None), where
            assert mine["merged"].keys() == merged.keys()
            assert all(torch.equal(mine["merged"][k], v) for k, v in merged.items()), where
