"""nobubble's synchronous schedules against torch.distributed.pipelining, gradient by gradient.

torch's ScheduleGPipe and Schedule1F1B are the independent reference: two gloo processes run one
batch (M=4 micro-batches) of the same tiny model on the same micro-batches through a stage split
written here (plain PipelineStage on the stage modules, the last one returning logits, loss
``lm_loss``), and save every parameter's averaged gradient. nobubble's side is the single-process
emulator (worker, interpreter, in-process transport) with a worker that records ``.grad`` when
the first optimizer step begins. The same processes also run the benchmark's torch peer
(``nobubble.app.ranks.torch_peer.PeerRun``), which must give the reference's gradients too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nobubble.app.ranks.launch import free_port
from nobubble.app.train.assemble import load_data, make_plan, make_schedule, make_stages
from nobubble.app.train.config import TrainConfig
from nobubble.core.ledger import build_ledger
from nobubble.data import fetch_shakespeare
from nobubble.engine import InProcessTransport, Interpreter, StageWorker
from nobubble.model import lm_loss
from nobubble.optim import NoCorrection, build_optimizer, lr_at
from nobubble.runtime.emulator import Emulator

RTOL = 1e-6
SRC = Path(__file__).resolve().parents[1] / "src"

# Runs on each of the 2 ranks: argv = config JSON, output folder.
TORCH_SIDE = """
import json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from nobubble.app.train.config import TrainConfig
from nobubble.data import prepare_data
from nobubble.app.ranks.torch_peer import PeerRun
from nobubble.model import build_model, model_config, partition_layers, split_model
from nobubble.model.gpt import lm_loss, run_layers

class Logits(nn.Module):  # the last stage without its loss, same parameter names
    def __init__(self, stage):
        super().__init__()
        self.cfg, self.layers = stage.cfg, stage.layers
        self.norm, self.head = stage.norm, stage.head
    def forward(self, h):
        return self.head(self.norm(run_layers(self.layers, h, self.cfg)))

torch.set_num_threads(1)
cfg = TrainConfig.of(**json.loads(sys.argv[1]))
dist.init_process_group("gloo")
rank, M, B = dist.get_rank(), cfg.schedule.microbatches, cfg.run.micro_batch_size
data = prepare_data(cfg.data_config())
pairs = [data.train_microbatch(m, B) for m in range(M)]
x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
mcfg = model_config(cfg.model.model, data.vocab_size, cfg.data.seq_len)
ranges = partition_layers(mcfg, 2, seq_len=cfg.data.seq_len)
out = {}
for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
    stage = split_model(build_model(mcfg, cfg.run.seed), 2, ranges)[rank]
    module = stage if rank == 0 else Logits(stage)
    schedule = cls(PipelineStage(module, rank, 2, torch.device("cpu")), M, loss_fn=lm_loss)
    schedule.step(x) if rank == 0 else schedule.step(target=y, return_outputs=False)
    out["reference-" + name] = {n: p.grad for n, p in module.named_parameters()}
    peer = PeerRun(cfg, "torch-" + name, torch.device("cpu"))
    peer.run_batch(0)
    out["peer-" + name] = {n: p.grad for n, p in peer.module.named_parameters()}
torch.save(out, f"{sys.argv[2]}/grads-{rank}.pt")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> TrainConfig:
    """A 100 kB slice of the default corpus, vocab 512; the tiny model, seq 32, B=2, M=4."""
    corpus = tmp_path_factory.mktemp("corpus") / "plays.txt"
    corpus.write_text(fetch_shakespeare().read_text()[:100_000])
    config = TrainConfig.of(
        data=str(corpus),
        vocab_size=512,
        seq_len=32,
        model="tiny",
        micro_batch_size=2,
        stages=2,
        microbatches=4,
        steps=1,
        eval_every=1,
        sample_tokens=0,
        progress=False,
        schedule="1f1b",
    )
    load_data(config)  # fill the cache before the two processes read it
    return config


@pytest.fixture(scope="module")
def torch_grads(cfg, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Gradients of batch 0 from torch.distributed.pipelining, both ranks merged per run."""
    out = tmp_path_factory.mktemp("torch")
    script = out / "torch_side.py"
    script.write_text(TORCH_SIDE)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        )
        command = [sys.executable, str(script), json.dumps(cfg.to_json()), str(out)]
        procs.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True))
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for rank in range(2):
        for run, grads in torch.load(out / f"grads-{rank}.pt").items():
            merged.setdefault(run, {}).update(grads)
    return merged


class GradRecorder(StageWorker):
    """A worker that keeps the accumulated gradients when the first step begins."""

    recorded: dict[str, torch.Tensor]

    def step(self, step: int, total_sq_norm: torch.Tensor | None = None) -> None:
        if step == 1:
            self.recorded = {n: torch.clone(p.grad) for n, p in self.named if p.grad is not None}
        super().step(step, total_sq_norm)


def emulator_grads(cfg: TrainConfig, schedule: str) -> dict[str, torch.Tensor]:
    cfg = TrainConfig.from_mapping({"schedule": schedule}, base=cfg)
    data = load_data(cfg)
    plan = make_plan(cfg, data.vocab_size)
    schedule = make_schedule(cfg)
    ledger = build_ledger(schedule)
    optim_cfg = cfg.optim_config()
    workers = [
        GradRecorder(
            module,
            schedule,
            ledger.stages[module.stage],
            build_optimizer(optim_cfg, list(module.named_parameters())),
            NoCorrection(),
            lambda m: data.train_microbatch(m, cfg.run.micro_batch_size),
            lambda j: lr_at(j, cfg.run.steps, optim_cfg),
            loss_fn=lm_loss,
        )
        for module in make_stages(plan)
    ]
    transport = InProcessTransport(cfg.num_ranks)
    interpreters = [Interpreter([w], transport, cfg.num_ranks, cfg.global_clip) for w in workers]
    Emulator(schedule, interpreters, transport).run(1)
    return {n: g for w in workers for n, g in w.recorded.items()}


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        scale = float(g.abs().max())
        assert scale > 0, f"{name}: zero reference gradient"
        diff = float((got[name] - g).abs().max()) / scale
        assert diff <= RTOL, f"{name}: relative difference {diff:.2e} > {RTOL}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_emulator_gradients_equal_torch_pipelining(cfg, torch_grads, schedule):
    assert_same_grads(emulator_grads(cfg, schedule), torch_grads["reference-" + schedule])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_benchmark_peer_gradients_equal_torch_pipelining(torch_grads, schedule):
    assert_same_grads(torch_grads["peer-" + schedule], torch_grads["reference-" + schedule])


def test_benchmark_peer_rejects_a_nobubble_schedule(cfg):
    from nobubble.app.ranks.torch_peer import peer_config

    with pytest.raises(ValueError, match=r"'paci' is not a torch\.distributed\.pipelining"):
        peer_config(cfg, "paci")


# ----- the zero-bubble and interleaved peers (several stages per rank, split backwards) ---------
# Runs on each of the 2 ranks: argv = config JSON, output folder. Each torch schedule trains the
# config's steps from the same initial weights; the rank holding the last stage has the losses.
NEW_PEERS = (
    "torch-zb-h1",
    "torch-interleaved-1f1b",
    "torch-interleaved-zb",
    "torch-zbv",
    "torch-dualpipev",
    "torch-looped-bfs",
)
PEERS_SIDE = """
import json, sys
import torch, torch.distributed as dist
from nobubble.app.train.config import TrainConfig
from nobubble.app.ranks.torch_peer import PeerRun

torch.set_num_threads(1)
cfg = TrainConfig.of(**json.loads(sys.argv[1]))
dist.init_process_group("gloo")
out = {}
for schedule in sys.argv[3].split(","):
    run = PeerRun(cfg, schedule, torch.device("cpu"))
    run.train()
    kinds = sorted((a.stage, a.kind) for a, _, _ in run.spans)
    out[schedule] = {"losses": run.losses, "stages": list(run.mine), "spans": kinds}
with open(f"{sys.argv[2]}/peers-{dist.get_rank()}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def launch_script(script: str, args: list[str], out: Path) -> None:
    """Run ``script`` on 2 gloo ranks with ``args``; fail with their stderr if one fails."""
    path = out / "side.py"
    path.write_text(script)
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        )
        command = [sys.executable, str(path), *args]
        procs.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True))
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)


@pytest.fixture(scope="module")
def steps3(cfg) -> TrainConfig:
    return TrainConfig.from_mapping({"steps": 3, "eval_every": 3}, base=cfg)


@pytest.fixture(scope="module")
def peer_runs(steps3, tmp_path_factory) -> dict[str, dict]:
    """Losses, stages and compute spans per rank of each new torch peer, 3 steps on 2 ranks."""
    out = tmp_path_factory.mktemp("peers")
    launch_script(PEERS_SIDE, [json.dumps(steps3.to_json()), str(out), ",".join(NEW_PEERS)], out)
    ranks = [json.loads((out / f"peers-{r}.json").read_text()) for r in range(2)]
    return {
        name: {
            "losses": next(r[name]["losses"] for r in ranks if r[name]["losses"]),
            "stages": [r[name]["stages"] for r in ranks],
            "spans": [[tuple(k) for k in r[name]["spans"]] for r in ranks],
        }
        for name in NEW_PEERS
    }


def emulator_losses(cfg: TrainConfig, schedule: str, out: Path) -> list[float]:
    """Per-step mean losses of ``nobubble train`` in the emulator (all stages in one process)."""
    from nobubble.app.train.trainer import Trainer

    run = TrainConfig.from_mapping({"schedule": schedule, "out": str(out / schedule)}, base=cfg)
    return [record["loss"] for record in Trainer(run).run().records]


@pytest.fixture(scope="module")
def emulated(steps3, tmp_path_factory) -> dict[str, list[float]]:
    out = tmp_path_factory.mktemp("emulated")
    twins = ("zb-h1", "interleaved-1f1b", "zbv", "dualpipev", "looped-bfs")
    return {s: emulator_losses(steps3, s, out) for s in twins}


@pytest.mark.parametrize(
    ("peer", "twin", "stages"),
    [
        ("torch-zb-h1", "zb-h1", [[0], [1]]),
        ("torch-interleaved-1f1b", "interleaved-1f1b", [[0, 2], [1, 3]]),  # loop: r, r+P
        ("torch-interleaved-zb", "interleaved-1f1b", [[0, 2], [1, 3]]),
        ("torch-zbv", "zbv", [[0, 3], [1, 2]]),  # V: r, 2P-1-r
        ("torch-dualpipev", "dualpipev", [[0, 3], [1, 2]]),
        ("torch-looped-bfs", "looped-bfs", [[0, 2], [1, 3]]),
    ],
)
def test_zero_bubble_and_interleaved_peer_losses_equal_the_emulator_bitwise(
    peer_runs, emulated, peer, twin, stages
):
    """3 steps at P=2, M=4, v=2 (4 stages of one layer each; zb-h1: 2 of two), AdamW with
    global clipping: every step's mean loss is bitwise nobubble's emulator's for the same cut
    (which equals plain gradient accumulation, tests/test_zero_bubble_exec.py). Bitwise: the
    per-rank orders are the same (test_zero_bubble's torch oracle), torch's division of the
    summed gradients by M=4 is exact as nobubble's 1/M per loss is (a power of two), and both
    sides add the stages' squared norms in stage order in float64."""
    assert peer_runs[peer]["stages"] == stages
    losses = peer_runs[peer]["losses"]
    assert len(losses) == 3 and losses[0] != losses[-1]  # it trains
    assert losses == emulated[twin]


@pytest.mark.parametrize(
    ("peer", "backward"),
    [
        ("torch-zb-h1", ("I", "W")),
        ("torch-interleaved-1f1b", ("B",)),
        ("torch-interleaved-zb", ("I", "W")),
        ("torch-zbv", ("I", "W")),
        ("torch-looped-bfs", ("B",)),
    ],
)
def test_zero_bubble_and_interleaved_peers_time_every_compute_action(
    steps3, peer_runs, peer, backward
):
    """The measured bubble of a torch peer rests on its spans: each stage of each rank notes
    M forwards and M of each backward kind per step (split backward for the zero-bubble
    ones), and one optimizer step."""
    n, m = steps3.run.steps, steps3.num_microbatches
    for stages, spans in zip(peer_runs[peer]["stages"], peer_runs[peer]["spans"], strict=True):
        want = [(s, k) for s in stages for k in ("F", *backward) for _ in range(n * m)]
        want += [(s, "STEP") for s in stages for _ in range(n)]
        assert spans == sorted(want)


def test_the_dualpipev_peer_times_fused_and_split_backwards(steps3, peer_runs):
    """torch's DualPipeV fuses most backwards (B) and splits the last ones (I, then W): per
    stage and step, M forwards, M backwards B or I, a W for each I, one optimizer step."""
    n, m = steps3.run.steps, steps3.num_microbatches
    runs = peer_runs["torch-dualpipev"]
    for stages, spans in zip(runs["stages"], runs["spans"], strict=True):
        for s in stages:
            count = {k: spans.count((s, k)) for k in ("F", "B", "I", "W", "STEP")}
            assert count["F"] == count["B"] + count["I"] == n * m, (s, count)
            assert count["W"] == count["I"] > 0 and count["STEP"] == n, (s, count)


def test_bench_runtime_runs_zero_bubble_variants_with_their_bubble(capsys, cfg):
    """nobubble's zb-h1 (multi-process runtime) beside torch's ZBV: same loss, a measured bubble
    for both (the peer notes torch's compute spans itself), both cuts reported."""
    from nobubble.cli import main

    argv = "bench runtime --model tiny --vocab-size 512 --seq-len 32 --micro-batch-size 2"
    argv += " --stages 2 --microbatches 4 --steps 2 --rounds 1 --schedule zb-h1,torch-zbv"
    assert main([*argv.split(), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for variant in ("zb-h1", "torch-zbv"):
        assert 0 < out[variant]["bubble"] < 1
        assert len(out[variant]["utilization"]) == 2
    assert out["zb-h1"]["last_loss"] == pytest.approx(out["torch-zbv"]["last_loss"], rel=1e-6)
    assert all(b > 0 for b in out["torch-zbv"]["peak_activation_bytes"])
    assert out["config"]["partitions"].keys() == {"2", "4"}
