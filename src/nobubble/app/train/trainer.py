"""``nobubble train``: the training loop around the emulator, with evaluation, checkpoints and a
run directory holding the resolved config, metrics, TensorBoard events, ledger and a sample.

The loop runs the schedule from drain point to drain point (docs/semantics.md, "Schedule
fields"): there every stage holds the same weight version, so validation sees one well-defined
model and a checkpoint holds no micro-batch in flight.
"""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from nobubble import __version__
from nobubble.api.pipeline import Observer, Pipeline, StepResult
from nobubble.app.train.assemble import load_data, make_model, make_pipeline, make_plan
from nobubble.app.train.checkpoint import (
    check_fingerprint,
    check_resumable,
    check_stream,
    check_work_left,
    finalize,
    read_manifest,
    reshaped,
    resume_pipeline,
    save_part,
    staging_dir,
)
from nobubble.app.train.config import TrainConfig
from nobubble.app.train.metrics import MetricsWriter, truncate_metrics
from nobubble.app.train.sampling import sample
from nobubble.core.schedule_spec import FILE_KEYS
from nobubble.data import TokenData

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def provenance() -> dict[str, Any]:
    return {
        "nobubble": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_revision": git_revision(),
        "created": datetime.now().isoformat(timespec="seconds"),
    }


def resolve_run_dir(cfg: TrainConfig) -> Path:
    if cfg.launch.resume:
        return Path(cfg.launch.resume)
    if cfg.launch.out:
        out = Path(cfg.launch.out)
        if (out / "metrics.jsonl").exists():
            raise ValueError(
                f"--out {cfg.launch.out!r} already holds a run: use --resume {cfg.launch.out} to "
                "continue it, or another --out"
            )
        return out
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.schedule.name}-{cfg.optimizer.optimizer}"


def validation_loss(pipe: Pipeline, cfg: TrainConfig, data: TokenData) -> float | None:
    """The run's validation loss: ``--eval-batches`` batches of the global micro-batch size
    (``--micro-batch-size`` × ``--data-parallel``) windows through the pipeline
    (``Pipeline.evaluate``), the mean of their losses; None on a rank of the multi-process
    runtime that does not hold the last stage."""
    batches = data.val_batches(cfg.global_micro_batch_size, cfg.run.eval_batches)
    inputs = torch.cat([x for x, _ in batches])
    targets = torch.cat([y for _, y in batches])
    return pipe.evaluate(inputs, targets, microbatches=len(batches))


class Trainer:
    """Runs one configuration through ``nobubble.Pipeline`` and writes the run directory."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        if cfg.launch.threads:
            torch.set_num_threads(cfg.launch.threads)
        self.run_dir = resolve_run_dir(cfg)
        self.start_step, manifest = 0, None
        if cfg.launch.resume:  # check everything before any work or any write
            saved = TrainConfig.load(self.run_dir / "config.json")["config"]
            # a given order is read where it is now; the checkpoint's hash of it is checked below
            saved.update({k: getattr(cfg.schedule, k) for k in FILE_KEYS if k in saved})
            check_fingerprint(
                {"fingerprint": TrainConfig.from_mapping(saved).fingerprint()},
                cfg.fingerprint(),
                self.run_dir,
            )
            manifest = read_manifest(self.run_dir)
            check_resumable(manifest, cfg, self.run_dir)
            self.start_step = manifest["step"]
            check_work_left(self.start_step, cfg.run.stop_at or cfg.run.steps, self.run_dir)
        self.data = load_data(cfg)
        if manifest is not None:
            check_stream(manifest, self.data.stream_id, self.run_dir)
        self.plan = make_plan(cfg, self.data.vocab_size)
        if self.start_step and self.start_step not in self.plan.drain_points:
            raise ValueError(f"checkpoint step {self.start_step} is not a drain point")
        self.model = make_model(self.plan)
        # every action's duration recorded, for the projected clock of `bench time-to-target`
        self.pipe = make_pipeline(self.plan, self.model.stages, Observer(record=True))
        self.workers = self.pipe.workers
        self.reshape = manifest is not None and reshaped(manifest, cfg)
        if manifest is not None:
            resume_pipeline(self.pipe, self.run_dir, manifest, self.reshape)
        self.step_losses: dict[int, list[float]] = {}
        self.result = RunResult(self.run_dir)

    # ----- per-step bookkeeping ----------------------------------------------------------------
    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` (0-based): its micro-batches, stacked along dim 0."""
        m = self.cfg.num_microbatches
        pieces = [
            self.data.train_microbatch(i, self.cfg.run.micro_batch_size)
            for i in range(step * m, (step + 1) * m)
        ]
        return torch.cat([x for x, _ in pieces]), torch.cat([y for _, y in pieces])

    def _collect(self, result: StepResult, point: int, metrics: MetricsWriter) -> None:
        """Record the steps that ``result`` finished; the drain point's waits for validation."""
        for item in result.losses:
            self.step_losses.setdefault(item.step, []).append(item.value)
        for step in result.steps:
            losses = self.step_losses.pop(step)
            elapsed = self.elapsed_offset + time.perf_counter() - self.t0
            record = {
                "step": step,
                "loss": sum(losses) / len(losses),
                "lr": self.workers[0].lr_of(step),
                "tokens": step * self.cfg.tokens_per_step,
                "elapsed_s": elapsed,
                "train_s": elapsed - self.paused_s,
                "grad_norm": result.grad_norms[step],
            }
            if step == point:
                self.pending = record
            else:
                self.result.records.append(record)
                metrics.write(record)
            if self.bar is not None:
                done = step - self.start_step
                tok_s = done * self.cfg.tokens_per_step / (time.perf_counter() - self.t0)
                self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:,.0f}")
                self.bar.update(1)

    def _drain_point(self, step: int, metrics: MetricsWriter) -> None:
        """Validation and checkpoint: time off the training clock (``train_s``)."""
        began = time.perf_counter()
        record = self.pending
        record["val_loss"] = validation_loss(self.pipe, self.cfg, self.data)
        self.result.records.append(record)
        metrics.write(record)
        every = self.cfg.run.checkpoint_every
        if step in (self.cfg.run.steps, self.cfg.run.stop_at) or (every and step % every == 0):
            self._checkpoint(step)
        self.paused_s += time.perf_counter() - began

    def _checkpoint(self, step: int) -> None:
        staging = staging_dir(self.run_dir, step)
        for worker, part in zip(self.workers, self.pipe.stage_parts(), strict=True):
            save_part(staging, worker.stage, part, self.cfg.model_stages)
        finalize(
            self.run_dir,
            step,
            self.cfg.model_stages,
            self.cfg.fingerprint(),
            {
                "elapsed_s": self.pending["elapsed_s"],
                "train_s": self.pending["train_s"],
                "data_stream": self.data.stream_id,
            },
        )

    # ----- the loop ------------------------------------------------------------------------------
    def run(self) -> RunResult:
        from tqdm import tqdm

        self._write_config()
        self.elapsed_offset = self._resumed_elapsed()  # truncates metrics.jsonl: open it after
        self.paused_s = self.elapsed_offset - self._resumed_train()
        metrics = MetricsWriter(self.run_dir)
        self.bar = tqdm(
            total=self.cfg.run.steps,
            initial=self.start_step,
            desc=self.cfg.schedule.name,
            unit="step",
            disable=not self.cfg.launch.progress,
            leave=False,
        )
        self.t0 = time.perf_counter()
        step_done = self.start_step
        try:
            stop = self.cfg.run.stop_at or self.cfg.run.steps
            for point in (p for p in self.plan.drain_points if self.start_step < p <= stop):
                # feed batch by batch so each step gets its metrics line; drain only at `point`
                for step in range(step_done + 1, point + 1):
                    self._collect(self.pipe.step(*self._batch(step - 1)), point, metrics)
                self._collect(self.pipe.drain(), point, metrics)
                self._drain_point(point, metrics)
                step_done = point
        finally:
            self.bar.close()
            metrics.close()
        self._finish()
        return self.result

    def _resumed_train(self) -> float:
        """The training clock at the checkpoint (wall clock less validations and checkpoints;
        a checkpoint from before the training clock existed counts it as the wall clock)."""
        if not self.start_step:
            return 0.0
        manifest = read_manifest(self.run_dir)
        return float(manifest.get("train_s", manifest.get("elapsed_s", 0.0)))

    def _resumed_elapsed(self) -> float:
        if not self.start_step:
            return 0.0
        truncate_metrics(self.run_dir, self.start_step)
        return float(read_manifest(self.run_dir).get("elapsed_s", 0.0))

    def _record_action_costs(self) -> None:
        """Every F, B and STEP duration of each stage as this process ran them, one at a time:
        the costs a P-device pipeline would pay (``time_to_target.projected_times``), added to
        those of the run's earlier segments."""
        path = self.run_dir / "action_costs.json"
        durations: dict[str, dict[str, list[float]]] = {}
        if self.start_step and path.exists():
            durations = json.loads(path.read_text())["durations_s"]
        for action, start, end in self.pipe.spans():
            kinds = durations.setdefault(str(action.stage), {})
            kinds.setdefault(action.kind, []).append(round(end - start, 7))
        path.write_text(json.dumps({"durations_s": durations}) + "\n")

    def _write_config(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "config": self.cfg.to_json(),
            "provenance": provenance(),
            "resolved": {
                "microbatches_per_step": self.cfg.num_microbatches,
                "tokens_per_step": self.cfg.tokens_per_step,
                "sync_warmup_steps": self.cfg.sync_warmup_steps,
                "global_clip": self.cfg.global_clip,
                "layer_ranges": [[r.start, r.stop] for r in self.model.layer_ranges],
                "vocab_size": self.data.vocab_size,
                "num_params": self.model.num_params,
                "drain_points": self.plan.drain_points,
            },
        }
        if not self.cfg.launch.resume or self.reshape:  # the run's split is the resumed one's
            (self.run_dir / "config.json").write_text(json.dumps(payload, indent=1) + "\n")

    def _finish(self) -> None:
        records = self.result.records
        ledger = self.pipe.ledger  # the schedule that ran, through its last step
        (self.run_dir / "ledger.json").write_text(
            json.dumps(
                {
                    "summary": ledger.summary(),
                    "crossed_histogram": {str(k): v for k, v in ledger.crossed_histogram().items()},
                },
                indent=1,
            )
            + "\n"
        )
        self._record_action_costs()
        text = sample(self.plan, self.pipe, self.data)
        if text is not None:
            (self.run_dir / "sample.txt").write_text(text + "\n")
        peaks = [
            (w.peak_saved, w.peak_activation_bytes, w.versions.peak_live) for w in self.workers
        ]
        summary = run_summary(self.cfg, records, peaks, text)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.result.summary = summary


def run_summary(
    cfg: TrainConfig,
    records: list[dict[str, Any]],
    peaks: list[tuple[int, int, int]],
    text: str | None,
) -> dict[str, Any]:
    """First and last loss, final validation loss, throughput over the steady window."""
    warm = max(1, len(records) // 10)  # steady window: skip the first 10 % of the steps
    steady = records[warm - 1 :]
    tokens = steady[-1]["tokens"] - steady[0]["tokens"] if len(steady) > 1 else 0
    seconds = steady[-1]["elapsed_s"] - steady[0]["elapsed_s"] if len(steady) > 1 else 0.0
    return {
        "schedule": cfg.schedule.name,
        "optimizer": cfg.optimizer.optimizer,
        "correction": cfg.correction.correction,
        "stages": cfg.num_ranks,
        "steps": cfg.run.steps,
        "first_loss": records[0]["loss"] if records else None,
        "last_loss": records[-1]["loss"] if records else None,
        "val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None),
        "tokens": records[-1]["tokens"] if records else 0,
        "elapsed_s": records[-1]["elapsed_s"] if records else 0.0,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "peak_inflight": [p[0] for p in peaks],
        "peak_activation_bytes": [p[1] for p in peaks],
        "peak_weight_versions": [p[2] for p in peaks],
        "sample": text,
    }


__all__ = [
    "RunResult",
    "Trainer",
    "git_revision",
    "provenance",
    "resolve_run_dir",
    "run_summary",
    "validation_loss",
]
