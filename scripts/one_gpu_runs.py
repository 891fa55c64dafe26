"""How the one-GPU check runs things (``scripts/one-gpu-check``): ``nobubble train`` on the
device through ``--backend gloo``, ``nobubble train``'s recipe emulated on the device through
``nobubble.Pipeline``, a user's ``nobubble.Pipeline``, and the measured timeline read back.
Clients of the CLI and the public API only."""

from __future__ import annotations

import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def settings(size: dict[str, Any], args: Any, **more: Any) -> dict[str, Any]:
    values = dict(size, data=args.data, sample_tokens=0, eval_batches=1, dist_timeout=120, **more)
    if args.device == "cpu":
        values["threads"] = 1  # CPUs: equal thread counts, so runtime and emulator agree bitwise
    return values


def train_flags(values: dict[str, Any]) -> list[str]:
    flags = []
    for key, value in values.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def dist_run(values: dict[str, Any], out: Path, args: Any) -> dict[str, Any]:
    """``nobubble train --runtime dist --backend gloo`` on the device: every rank shares it."""
    flags = [
        *train_flags(values),
        "--runtime",
        "dist",
        "--backend",
        "gloo",
        "--device",
        args.device,
        "--out",
        str(out),
    ]
    return nobubble_train(flags, out)


def nobubble_train(flags: list[str], run_dir: Path, timeout_s: float = 200.0) -> dict[str, Any]:
    """``nobubble train FLAGS``; past ``timeout_s`` the launcher and its ranks (one process
    group) are killed, so no rank stays on the GPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nobubble", "train", *flags, "--no-progress"],
        env=dict(env, TOKENIZERS_PARALLELISM="false"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise RuntimeError(f"nobubble train {' '.join(flags)} ran past {timeout_s:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"nobubble train {' '.join(flags)} failed:\n{err[-3000:]}")
    return dict(json.loads((run_dir / "summary.json").read_text()))


def step_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line.strip()]


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def emulate(values: dict[str, Any], device: Any) -> dict[str, Any]:
    """``nobubble train``'s recipe on ``device`` through ``nobubble.Pipeline(runtime="emulate")``:
    its stages, data and drain points; no validation. Returns each step's loss and the tokens/s
    after the first drain point (the warm-up), timed between two synchronisations."""
    import torch

    from nobubble.app.train.assemble import load_data, make_model, make_pipeline, make_plan
    from nobubble.app.train.config import TrainConfig

    cfg = TrainConfig.from_mapping({**values, "runtime": "emulate"})
    data = load_data(cfg)
    plan = make_plan(cfg, data.vocab_size)
    pipe = make_pipeline(plan, [s.to(device) for s in make_model(plan).stages])
    m, b = cfg.num_microbatches, cfg.run.micro_batch_size
    per_step: dict[int, list[float]] = {}
    done, t0 = 0, 0.0
    for point in plan.drain_points:
        for j in range(done, point):
            pieces = [data.train_microbatch(i, b) for i in range(j * m, (j + 1) * m)]
            inputs, targets = (torch.cat([p[k] for p in pieces]) for k in (0, 1))
            for item in pipe.step(inputs, targets).losses:
                per_step.setdefault(item.step, []).append(item.value)
        for item in pipe.drain().losses:
            per_step.setdefault(item.step, []).append(item.value)
        if done == 0:
            synchronize(device)
            t0, warm = time.perf_counter(), point
        done = point
    synchronize(device)
    seconds = time.perf_counter() - t0
    tokens = (cfg.run.steps - warm) * cfg.tokens_per_step
    del pipe
    gc.collect()  # the interpreter's dispatch table holds the workers in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()  # for the ranks started next
    return {
        "losses": [sum(v) / len(v) for _, v in sorted(per_step.items())],
        "tokens_per_s": tokens / seconds if tokens and seconds > 0 else None,
    }


def user_pipeline(device: Any, dtype: str, schedule: str, steps: int = 20) -> list[float]:
    """A user's own stages, loss and torch optimizer through ``nobubble.Pipeline``; the batches
    are made on the CPU and moved by the pipeline."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    import nobubble

    torch.manual_seed(0)
    widths = [32, 256, 256, 256, 8]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.GELU()]
    model = nn.Sequential(*layers[:-1]).to(device)
    pipe = nobubble.Pipeline(
        nobubble.split(model, ["4"]),
        F.mse_loss,
        schedule=schedule,
        microbatches=4,
        optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3),
        dtype=dtype,
    )
    gen, per_step = torch.Generator().manual_seed(1), {}
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        result = pipe.step(x, x[:, :8].sin())  # a learnable target: the loss falls
        for item in result.losses:
            per_step.setdefault(item.step, []).append(item.value)
    for item in pipe.drain().losses:
        per_step.setdefault(item.step, []).append(item.value)
    return [sum(v) / len(v) for _, v in sorted(per_step.items())]


def gap(got: list[float], want: list[float]) -> float:
    if len(got) != len(want):
        raise ValueError(f"{len(got)} steps against {len(want)}")
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


def read_lanes(run_dir: Path) -> list[list[tuple[Any, float, float]]]:
    """The compute spans of the measured timeline (trace.json), one lane per rank, in seconds."""
    from nobubble.core.ir import Action

    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    lanes: dict[int, list[tuple[Any, float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == 0:
            start = e["ts"] / 1e6
            lanes.setdefault(e["tid"], []).append(
                (Action.parse(e["name"]), start, start + e["dur"] / 1e6)
            )
    return [sorted(lanes[k], key=lambda s: s[1]) for k in sorted(lanes)]


def ordered(lane: list[tuple[Any, float, float]]) -> bool:
    """A rank runs one action at a time: spans of positive length, none overlapping the next."""
    slack = 1e-6  # the trace's microsecond rounding
    return all(e > s for _, s, e in lane) and all(
        lane[k][2] <= lane[k + 1][1] + slack for k in range(len(lane) - 1)
    )
