"""``nobubble bench memory``: each rank's peak resident memory when a Hugging Face Llama trains
under ``nobubble train --runtime dist``, against what its own stage needs.

Every run is a real ``nobubble train --model hf:DIR --runtime dist`` (gloo on CPUs) of a few
steps; each rank reports in the run's summary its peak resident set (``getrusage``'s
ru_maxrss), the bytes of its own stage's weights and optimizer state, and the most bytes of
activations it held for backward. An idle rank's baseline is the same rank of the same command
on a model of negligible size (hidden 16, the same vocabulary, data and shapes): its peak holds
everything but the model (interpreter, torch and transformers, the process group, the data). A
rank's growth, its peak minus that baseline, is compared with its stage's own weights +
gradients (the weights' bytes) + optimizer state + activations, and with the whole model.

The model is built once in this process (seed 0, saved as safetensors shards) and read per
stage by every run; at the largest P one more run starts from its config alone (each rank
replays the init for its stage). ``build``: a rank's peak once its model was built, minus the
idle rank's at the same point: its stage's weights, never the whole model's.

A process's resident set also holds memory it freed: nobubble keeps it for reuse on purpose
(``nobubble.tune_host_allocator``; glibc's own thresholds grow to the same values). With
``allocator="release"`` the ranks run under glibc tunables that hand every block of 64 KiB or
more back to the system when it is freed, so the peak follows the memory the rank uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIB = 1 << 20


@dataclass(frozen=True)
class MemoryBench:
    """The Llama of the benchmark (about 100M parameters by default) and its short runs."""

    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 8192
    stages: tuple[int, ...] = (1, 4, 8)
    schedule: str = "paci"
    steps: int = 4
    microbatches: int = 8  # M >= P: every stage busy in the steady state at P=8
    micro_batch_size: int = 1
    seq_len: int = 64
    data: str = "shakespeare"
    allocator: str = "as-shipped"  # or "release" (module docstring)
    fused_adamw: bool = False  # AdamW's step without per-tensor scratch (OptimConfig.fused_adamw)
    # weight gradients added into .grad inside the backward (Pipeline's fused_grad_accumulation)
    fused_grad_accumulation: bool = False
    # per block: "none", "full" or "selective" (nobubble train --activation-checkpointing)
    activation_checkpointing: str = "none"
    where: bool = False  # each rank also samples where its peak happens (NOBUBBLE_PEAK_WHERE)

    def num_params(self) -> int:
        """Embedding and head (untied), per block attention (q, o full; k, v of kv_heads) and
        SwiGLU, two norms per block and the final norm."""
        d, f = self.hidden, self.intermediate
        kv = d // self.heads * self.kv_heads
        block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
        return 2 * self.vocab * d + self.layers * block + d


def write_model(cfg: MemoryBench, folder: Path, idle: bool = False, weights: bool = False) -> Path:
    """The Llama's config.json, and with ``weights`` its weights as built normally from seed 0,
    as safetensors shards of at most 100 MB with their index. ``idle``: the same model at
    hidden 16 (2 heads), for the baseline."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=16 if idle else cfg.hidden,
        intermediate_size=16 if idle else cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=2 if idle else cfg.heads,
        num_key_value_heads=2 if idle else cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=False,
    )
    config.save_pretrained(folder)
    if weights:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100MB")
    return folder


def train_flags(cfg: MemoryBench, model: Path, stages: int, out: Path) -> list[str]:
    return [
        "--model", f"hf:{model}", "--runtime", "dist", "--stages", str(stages),
        "--schedule", cfg.schedule, "--steps", str(cfg.steps), "--eval-every", str(cfg.steps),
        "--microbatches", str(cfg.microbatches), "--micro-batch-size", str(cfg.micro_batch_size),
        "--seq-len", str(cfg.seq_len), "--vocab-size", str(cfg.vocab), "--data", cfg.data,
        "--eval-batches", "1", "--sample-tokens", "0", "--threads", "1", "--no-progress",
        "--dist-timeout", "600", "--out", str(out), "--optimizer", "adamw",
        "--fused-adamw", str(cfg.fused_adamw).lower(),
        "--fused-grad-accumulation", str(cfg.fused_grad_accumulation).lower(),
        "--activation-checkpointing", cfg.activation_checkpointing,
    ]  # fmt: skip


def rank_rows(summary: dict[str, Any], idle: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank: its stage's weights; the memory building them took (the peak once the model
    was built, minus the idle rank's at the same point); the run's growth (peak minus the idle
    rank's peak) against the bound (with the stash of plain paci's checkpointed blocks when
    there is one); the freed memory malloc kept at the end."""
    rows = []
    for m, base in zip(summary["memory"], idle["memory"], strict=True):
        assert m["rank"] == base["rank"]
        growth = m["peak_rss"] - base["peak_rss"]
        # plain paci with checkpointing also holds the weights stashed for rebuilds to come
        stash = m.get("stash_bytes", 0)
        bound = 2 * m["param_bytes"] + m["optimizer_bytes"] + m["activation_bytes"] + stash
        free = m.get("malloc_free")
        rows.append(
            {
                "rank": m["rank"],
                "params_M": round(m["params"] / 1e6, 2),
                "weights_MiB": round(m["param_bytes"] / MIB),
                # the most bytes of activations the rank held for backward at once
                "activation_MiB": round(m["activation_bytes"] / MIB, 2),
                "build_MiB": round((m["peak_after_model"] - base["peak_after_model"]) / MIB),
                "idle_peak_MiB": round(base["peak_rss"] / MIB),
                "peak_MiB": round(m["peak_rss"] / MIB),
                "growth_MiB": round(growth / MIB),
                "bound_MiB": round(bound / MIB),
                "holds": growth < bound,
                "over_MiB": round((growth - bound) / MIB),
                "malloc_free_MiB": None if free is None else round(free / MIB),
            }
        )
        rows[-1]["stash_MiB"] = round(stash / MIB, 2)
        if "peak_where" in m:  # --where: the sampled peak (at most the true one) and its moment
            rows[-1]["sampled_peak_MiB"] = round(m["sampled_peak"] / MIB)
            rows[-1]["peak_during"] = m["peak_where"]
    if not any(r["stash_MiB"] for r in rows):  # a column only where some rank stashed
        for r in rows:
            del r["stash_MiB"]
    return rows


# glibc gives back every block of 64 KiB or more when it is freed, and the heap's free top at
# once: a process's resident set then follows the memory it uses, at the cost of page faults
RELEASE = {
    "NOBUBBLE_MALLOC": "default",
    "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=0",
}


def train(cfg: MemoryBench, model: Path, stages: int, out: Path, progress: Any) -> dict[str, Any]:
    """One ``nobubble train --runtime dist`` run; its summary."""
    flags = train_flags(cfg, model, stages, out)
    progress(f"P={stages}: nobubble train {' '.join(flags)}")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if cfg.allocator == "release":
        env.update(RELEASE)
    if cfg.where:
        env["NOBUBBLE_PEAK_WHERE"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "nobubble", "train", *flags],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the run at P={stages} failed:\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def run(cfg: MemoryBench, progress: Any = print) -> dict[str, Any]:
    """Train at each P in ``cfg.stages`` (weights read per stage), and the idle model at the
    same P; at the largest P also from the config alone (the init replayed per stage), and the
    export's check. Every rank's figures."""
    result: dict[str, Any] = {
        "params": cfg.num_params(),
        "whole_weights_bytes": 4 * cfg.num_params(),
    }
    with tempfile.TemporaryDirectory(prefix="nobubble-bench-memory-") as tmp:
        root = Path(tmp)
        progress("building the model once here (seed 0), saved as safetensors shards")
        sharded = write_model(cfg, root / "safetensors", weights=True)
        config_only = write_model(cfg, root / "config")
        idle_model = write_model(cfg, root / "idle", idle=True)
        for stages in cfg.stages:
            idle = train(cfg, idle_model, stages, root / f"idle-p{stages}", progress)
            start = time.perf_counter()
            out = root / f"run-p{stages}"
            summary = train(cfg, sharded, stages, out, progress)
            rows = rank_rows(summary, idle)
            result[f"P={stages}"] = {
                "seconds": round(time.perf_counter() - start, 1),
                "val_loss": summary.get("val_loss"),
                "ranks": rows,
            }
            if stages != max(cfg.stages):
                continue
            seed = rank_rows(train(cfg, config_only, stages, root / "seed", progress), idle)
            for row, other in zip(rows, seed, strict=True):
                row["seed_build_MiB"] = other["build_MiB"]
                row["seed_growth_MiB"] = other["growth_MiB"]
            progress(f"P={stages}: nobubble export, then transformers' from_pretrained")
            result["export"] = export_check(out, root / "export", summary["val_loss"])
    return result


def export_check(run_dir: Path, out: Path, val_loss: float) -> dict[str, Any]:
    """Export the run (sharded safetensors, a stage at a time), load it with transformers'
    ``from_pretrained`` and compute the run's validation loss again: the pipeline's last
    validation loss and the reloaded model's, on the same batches."""
    import torch
    import transformers

    from nobubble.app.export import export_run, run_config
    from nobubble.app.train.assemble import load_data
    from nobubble.model import lm_loss

    cfg = run_config(run_dir)
    export_run(run_dir, out)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batches = load_data(cfg).val_batches(cfg.global_micro_batch_size, cfg.run.eval_batches)
    with torch.no_grad():
        losses = [float(lm_loss(model(x).logits, y)) for x, y in batches]
    reloaded = sum(losses) / len(losses)
    return {
        "shards": shards,
        "pipeline_val_loss": val_loss,
        "reloaded_val_loss": reloaded,
        "difference": abs(reloaded - val_loss),
    }
