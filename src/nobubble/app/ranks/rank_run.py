"""``RankRun``: one rank of ``nobubble train --runtime dist`` around ``Pipeline(runtime="dist")``:
the run's config checked equal on every rank, drain-point validation through ``Pipeline.evaluate``,
gathered metrics, checkpoint parts, the measured timeline, and the run's end."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nobubble.api.pipeline import Observer, StepResult
from nobubble.app.ranks.outputs import by_stage, lane, write_outputs
from nobubble.app.ranks.rank_env import RankEnv, check_same_config
from nobubble.app.train.assemble import load_data, make_model, make_pipeline, make_plan
from nobubble.app.train.checkpoint import (
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
from nobubble.app.train.metrics import MetricsWriter, rank_memory, truncate_metrics
from nobubble.app.train.sampling import sample
from nobubble.app.train.trainer import (
    RunResult,
    provenance,
    resolve_run_dir,
    validation_loss,
)
from nobubble.core.host_memory import PeakSampler, peak_rss_bytes, rss_bytes
from nobubble.core.sim.metrics import measured_utilization
from nobubble.engine import misplaced
from nobubble.runtime.distributed.clock import CudaClock, HostClock
from nobubble.runtime.distributed.data_parallel import overlap


class RankRun:
    def __init__(self, cfg: TrainConfig, env: RankEnv, device: torch.device) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        P = self.num_ranks = cfg.num_ranks  # pipeline ranks per replica
        # rank: the global rank; pp and dp: its coordinates on the (dp, pp) mesh
        self.rank, self.pp, self.dp = env.rank, env.rank % P, env.rank // P
        # Object collectives (pickles) go over gloo: on NCCL they would cross the GPU.
        self.objects = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        check_same_config(cfg, env.world_size, self.objects)
        run_dir: list[Any] = [str(resolve_run_dir(cfg)) if self.rank == 0 else None]
        dist.broadcast_object_list(run_dir, src=0, group=self.objects)  # one directory for all
        self.run_dir = Path(run_dir[0])
        self.start_step, manifest = 0, None
        if cfg.launch.resume:
            manifest = read_manifest(self.run_dir)
            check_resumable(manifest, cfg, self.run_dir)
            self.start_step = manifest["step"]
            check_work_left(self.start_step, cfg.run.stop_at or cfg.run.steps, self.run_dir)
        if self.rank != 0:
            self._barrier()  # rank 0 fills the data cache first (tokenizer training, encoding)
        self.data = load_data(cfg)
        if self.rank == 0:
            self._barrier()
        if manifest is not None:
            check_stream(manifest, self.data.stream_id, self.run_dir)
        self.plan = make_plan(cfg, self.data.vocab_size)
        placement = self.plan.placement
        self.local = placement.stages_of(self.pp)  # one stage, or v (interleaved, V)
        # the rank of the last stage holds the loss; replica 0's writes the metrics (pipeline
        # rank 0 in a V); replica 0's global ranks are its pipeline ranks
        self.last = placement.rank_of(cfg.model_stages - 1)
        self.rss_before_model = rss_bytes()
        # this rank's stages only: the others stay on the meta device (docs/runtime.md)
        stages = make_model(self.plan, self.local, self.device).stages
        self.peak_after_model = peak_rss_bytes()
        # spans from CUDA events on a GPU (the host clock would time the kernel launches), else
        # the wall clock, comparable across the processes of one machine
        self.clock = CudaClock(self.device) if self.device.type == "cuda" else HostClock()
        # the runner checks what every rank will post under NCCL's rules before it runs it
        observe = Observer(
            record=True, clock=self.clock, strict_p2p=cfg.launch.strict_p2p, on_step=self._on_step
        )
        self.pipe = make_pipeline(self.plan, stages, observe)
        assert (self.pipe.rank, self.pipe.dp_rank) == (self.pp, self.dp), "mesh layout"
        # where this rank's resident set peaks (a diagnostic: nobubble bench memory --where)
        self.peak_sampler = (
            PeakSampler(self._doing).start() if os.environ.get("NOBUBBLE_PEAK_WHERE") else None
        )
        self.reshape = manifest is not None and reshaped(manifest, cfg)
        if manifest is not None:
            resume_pipeline(self.pipe, self.run_dir, manifest, self.reshape, self.device)
            for worker in self.pipe.workers:
                wrong = misplaced(worker.state_dict(), self.device)
                assert not wrong, f"resumed state off {self.device}: {', '.join(wrong[:5])}"
        self.workers = self.pipe.workers
        self.worker = self.workers[0]
        self.bar: Any = None
        self.losses: dict[int, float] = {}  # micro-batch -> loss (last rank)
        self.grad_norms: dict[int, list[float]] = {}  # step -> norm of each local stage
        self.step_times: dict[int, float] = {}
        self.records: list[dict[str, Any]] = []
        self.segment_start = 0  # spans since the last drain point
        # What the ranks meet for at a drain point (None while executing the schedule): a
        # failure there names the meeting and the ranks it waits for, not the last action.
        self.meeting: tuple[str, list[int]] | None = None

    def where(self) -> Any:
        """This rank's position, its action and the peer it waits for (``RankPosition``)."""
        return self.pipe.where()

    # ----- the loop ------------------------------------------------------------------------------
    def run(self) -> RunResult | None:
        from tqdm import tqdm

        writer = self._open_run_dir()
        show = self.rank == self.last and self.cfg.launch.progress
        self.bar = bar = tqdm(
            total=self.cfg.run.steps,
            initial=self.start_step,
            desc=f"{self.cfg.schedule.name} (dist, {self.env.world_size} ranks)",
            unit="step",
            disable=not show,
            leave=False,
        )
        start_time: list[Any] = [time.time()]
        dist.broadcast_object_list(start_time, src=0, group=self.objects)
        self.t0 = float(start_time[0]) - self._resumed_elapsed()
        # validations and checkpoints so far: off the training clock (train_s = elapsed - paused)
        self.paused_s = self._resumed_elapsed() - self._resumed_train()
        stop = self.cfg.run.stop_at or self.cfg.run.steps
        try:
            done = self.start_step
            for point in (p for p in self.plan.drain_points if self.start_step < p <= stop):
                self._run_until(done, point)
                self._drain_point(point, writer)
                done = point
        finally:
            bar.close()
            if writer is not None:
                writer.close()
        return self._finish()

    def _run_until(self, done: int, step: int) -> None:
        """Feed batches ``done`` .. ``step - 1`` and drain after step ``step``."""
        m = self.cfg.num_microbatches
        b, d = self.cfg.run.micro_batch_size, self.cfg.runtime.data_parallel
        for j in range(done, step):
            # replica r's micro-batch i: the r-th slice of global micro-batch i (D·b sequences)
            pieces = [
                tuple(
                    t[self.dp * b : (self.dp + 1) * b] for t in self.data.train_microbatch(i, b * d)
                )
                for i in range(j * m, (j + 1) * m)
            ]
            x, y = torch.cat([a for a, _ in pieces]), torch.cat([b for _, b in pieces])
            self._collect(self.pipe.step(x, y))
        self._collect(self.pipe.drain())  # runs through this rank's STEP `step`, sends done

    def _on_step(self, number: int) -> None:
        if number not in self.step_times:  # a rank with several stages takes a STEP for each
            self.bar.update(1)
        self.step_times[number] = time.time()

    def _collect(self, result: StepResult) -> None:
        self.losses.update({item.microbatch: item.value for item in result.losses})
        self.grad_norms.update(result.grad_norms)

    def _barrier(self) -> None:
        dist.barrier(group=self.objects)

    # ----- drain points --------------------------------------------------------------------------
    def _drain_point(self, step: int, writer: MetricsWriter | None) -> None:
        """Validation, gathered metrics and checkpoint. Their time is off the training clock:
        from the moment the last rank finished the drain's actions to the end here."""
        entered = time.time()
        self.meeting = f"running the pipelined validation after step {step}", self._neighbours()
        val_loss = validation_loss(self.pipe, self.cfg, self.data)
        spans = self.pipe.spans()  # settled: a GPU's spans are seconds after each drain
        segment = spans[self.segment_start :]
        self.segment_start = len(spans)
        mine = {
            "stages": self.local,
            "grad_norms": self.grad_norms,
            "times": self.step_times,
            "spans": [(str(a), s, e) for a, s, e in segment],
            "losses": self.losses,  # the last stage's, of this replica's micro-batches
            "entered": entered,
        }
        self.losses = {}
        gathered: list[Any] = [None] * self.env.world_size
        others = [r for r in range(self.env.world_size) if r != self.rank]
        self.meeting = f"gathering the metrics of step {step}", others
        dist.all_gather_object(gathered, mine, group=self.objects)
        if self.rank == self.last:
            self._write_records(step, gathered, val_loss, writer)
        self.grad_norms, self.step_times = {}, {}
        every = self.cfg.run.checkpoint_every
        if step in (self.cfg.run.steps, self.cfg.run.stop_at) or (every and step % every == 0):
            self.meeting = f"writing the checkpoint of step {step}", others
            # one part per stage, written by dp 0; a sharded stage's part is gathered from its
            # dp group first (whole tensors, the replicated format), so every replica takes part
            if self.dp == 0 or self.cfg.runtime.shard != "none":
                for worker in self.workers:
                    part = worker.state_dict(copy=False)  # written at once: no copy
                    if self.dp == 0:
                        save_part(
                            staging_dir(self.run_dir, step),
                            worker.stage,
                            part,
                            self.cfg.model_stages,
                        )
            self._barrier()  # every part is on disk before the manifest marks it complete
            if self.rank == self.last:
                finalize(
                    self.run_dir,
                    step,
                    self.cfg.model_stages,
                    self.cfg.fingerprint(),
                    {
                        "elapsed_s": self.records[-1]["elapsed_s"],
                        "train_s": self.records[-1]["train_s"],
                        "data_stream": self.data.stream_id,
                    },
                )
            self._barrier()
            self.last_checkpoint = step
        self.meeting = None
        if self.rank == self.last:  # the records' writer keeps the clock
            self.paused_s += time.time() - max(g["entered"] for g in gathered)

    def _write_records(
        self,
        step: int,
        gathered: list[dict[str, Any]],
        val_loss: float | None,
        writer: MetricsWriter | None,
    ) -> None:
        m, P, D = self.cfg.num_microbatches, self.num_ranks, self.cfg.runtime.data_parallel
        done = sorted(gathered[self.last]["times"])
        for j in done:
            # a micro-batch's loss: the mean of its D slices' (equal-size means), replica order
            losses = [
                sum(g["losses"].pop(i) for g in gathered[self.last :: P]) / D
                for i in range((j - 1) * m, j * m)
            ]
            record = {
                "step": j,
                "loss": sum(losses) / len(losses),
                "lr": self.worker.lr_of(j),
                "tokens": j * self.cfg.tokens_per_step,
                "elapsed_s": max(g["times"][j] for g in gathered) - self.t0,
                "train_s": max(g["times"][j] for g in gathered) - self.t0 - self.paused_s,
                "grad_norm": by_stage(gathered[:P], [g["grad_norms"][j] for g in gathered[:P]]),
            }
            if j == step:  # the drain point: validation and the segment's measured timeline
                record["val_loss"] = val_loss
                util = measured_utilization([lane(g["spans"]) for g in gathered])
                record.update(utilization=util["utilization"], bubble_share=util["bubble_share"])
            self.records.append(record)
            if writer is not None:
                writer.write(record)

    # ----- run directory -------------------------------------------------------------------------
    def _open_run_dir(self) -> MetricsWriter | None:
        if self.rank != self.last:
            self._barrier()
            return None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.cfg.launch.resume or self.reshape:  # the run's split is the resumed one's
            payload = {
                "config": self.cfg.to_json(),
                "provenance": provenance(),
                "resolved": {
                    "world_size": self.env.world_size,
                    "backend": dist.get_backend(),
                    "device": str(self.device),
                    "tokens_per_step": self.cfg.tokens_per_step,
                    "drain_points": self.plan.drain_points,
                },
            }
            (self.run_dir / "config.json").write_text(json.dumps(payload, indent=1) + "\n")
        if self.cfg.launch.resume:
            truncate_metrics(self.run_dir, self.start_step)
        writer = MetricsWriter(self.run_dir)
        self._barrier()
        return writer

    def _resumed_elapsed(self) -> float:
        if not self.start_step:
            return 0.0
        return float(read_manifest(self.run_dir).get("elapsed_s", 0.0))

    def _resumed_train(self) -> float:
        """The training clock at the checkpoint (the wall clock, for a checkpoint without it)."""
        if not self.start_step:
            return 0.0
        manifest = read_manifest(self.run_dir)
        return float(manifest.get("train_s", manifest.get("elapsed_s", 0.0)))

    def _neighbours(self) -> list[int]:
        """The global ranks of this rank's pipeline neighbours in its replica."""
        P = self.num_ranks
        base = self.dp * P  # this replica's first global rank
        return [base + r for r in (self.pp - 1, self.pp + 1) if 0 <= r < P]

    def _doing(self) -> str:
        """What this rank is doing now, for the peak sampler."""
        meeting = getattr(self, "meeting", None)  # set once the run starts
        if meeting is not None:
            return str(meeting[0])
        current = self.where().current if getattr(self, "pipe", None) is not None else None
        return f"running {current or 'between actions'}"

    def _finish(self) -> RunResult | None:
        self.meeting = "sampling text through the stages", self._neighbours()
        text = sample(self.plan, self.pipe, self.data)  # every rank: its stages' forwards
        self.meeting = None
        where = {}
        if self.peak_sampler is not None:
            where = dict(zip(("sampled_peak", "peak_where"), self.peak_sampler.stop(), strict=True))
        mine = {
            "stages": self.local,
            "spans": [(str(a), s, e) for a, s, e in self.pipe.spans()],
            "comm": [(k, str(a), s, e) for k, a, s, e in self.pipe.comm_spans()],
            "peaks": [
                (w.peak_saved, w.peak_activation_bytes, w.versions.peak_live) for w in self.workers
            ],
            "allreduce": overlap(self.pipe.allreduce_spans()),
            "memory": {
                "rank": self.rank,
                **rank_memory(self.workers, self.rss_before_model, self.peak_after_model),
                **where,
            },
        }
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, mine, group=self.objects)
        if self.rank != self.last:
            return None
        return write_outputs(self, gathered, text)


__all__ = [
    "RankRun",
]
