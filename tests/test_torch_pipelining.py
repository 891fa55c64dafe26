"""nobubble's synchronous schedules against torch.distributed.pipelining, gradient by gradient.

torch's ScheduleGPipe and Schedule1F1B are the independent reference: two gloo processes run one
batch (M=4 micro-batches) of the same tiny model on the same micro-batches through a stage split
written here (plain PipelineStage on the stage modules, the last one returning logits, loss
``lm_loss``), and save every parameter's averaged gradient. nobubble's side is the single-process
emulator (worker, interpreter, in-process transport) with a worker that records ``.grad`` when
the first optimizer step begins. The same processes also run the benchmark's torch peer
(``nobubble.distributed.torch_peer.PeerRun``), which must give the reference's gradients too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nobubble.assemble import load_data, make_plan, make_stages
from nobubble.config import TrainConfig
from nobubble.data import fetch_shakespeare
from nobubble.distributed.launch import free_port
from nobubble.exec import Emulator, InProcessTransport, Interpreter, StageWorker
from nobubble.model import lm_loss
from nobubble.optim import NoCorrection, build_optimizer, lr_at

RTOL = 1e-6
SRC = Path(__file__).resolve().parents[1] / "src"

# Runs on each of the 2 ranks: argv = config JSON, output folder.
TORCH_SIDE = """
import json, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from nobubble.config import TrainConfig
from nobubble.data import prepare_data
from nobubble.distributed.torch_peer import PeerRun
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
cfg = TrainConfig(**json.loads(sys.argv[1]))
dist.init_process_group("gloo")
rank, M, B = dist.get_rank(), cfg.microbatches, cfg.micro_batch_size
data = prepare_data(cfg.data_config())
pairs = [data.train_microbatch(m, B) for m in range(M)]
x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
mcfg = model_config(cfg.model, data.vocab_size, cfg.seq_len)
ranges = partition_layers(mcfg, 2, seq_len=cfg.seq_len)
out = {}
for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
    stage = split_model(build_model(mcfg, cfg.seed), 2, ranges)[rank]
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
    config = TrainConfig(
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
    optim_cfg = cfg.optim_config()
    workers = [
        GradRecorder(
            module,
            plan.schedule,
            plan.ledger.stages[module.stage],
            build_optimizer(optim_cfg, list(module.named_parameters())),
            NoCorrection(),
            lambda m: data.train_microbatch(m, cfg.micro_batch_size),
            lambda j: lr_at(j, cfg.steps, optim_cfg),
            loss_fn=lm_loss,
        )
        for module in make_stages(plan)
    ]
    transport = InProcessTransport(cfg.stages)
    interpreters = [Interpreter([w], transport, cfg.stages, cfg.global_clip) for w in workers]
    Emulator(plan.schedule, interpreters, transport).run(1)
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
    from nobubble.distributed.torch_peer import peer_config

    with pytest.raises(ValueError, match=r"'paci' is not a torch\.distributed\.pipelining"):
        peer_config(cfg, "paci")
