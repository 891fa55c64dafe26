"""The state of a ``Pipeline``: the merged weights, safetensors shards a stage at a time, the state
dict, and the per-stage parts of a checkpoint (``nobubble train``'s on-disk format), loaded
back at a drain point."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nobubble.api.steps import FIRST_HORIZON, StepLoop, dist_runner

FORMAT = "nobubble.pipeline/1"


class PipelineState(StepLoop):
    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights under its own parameter names (a copy). The master
        weights: in flight, the newest version of every stage. With runtime="dist" every rank
        gathers every stage's (a collective: call it on every rank; tensors on the CPU)."""
        state: dict[str, torch.Tensor] = {}
        for s in self.local:  # whole tensors (a dp collective when the stages are sharded)
            state.update(self.by_stage[s].module_state())
        if self.mesh is not None:
            return dist_runner().gather_state(state, self.mesh.pp_group)
        return state

    def save_weights(self, folder: str | os.PathLike[str]) -> Path:
        """The model's weights as safetensors shards in ``folder``, one per stage under the
        model's own names (``model-0000k-of-0000n.safetensors``), with the index transformers
        reads. Each process writes its own stages' shards; the index is assembled from the
        shards' small records, so no process holds another stage's tensors. With
        runtime="dist", call it on every rank (replica 0 writes). A Hugging Face model's
        folder loads with ``from_pretrained`` once its config is saved there too."""
        from nobubble.api.weights import index_of, write_index, write_shard

        self._check_drained("save_weights()")
        out = Path(os.fspath(folder))
        records = []
        if self.dp_rank == 0:
            for s in self.local:
                state = self.stages[s].state_dict()
                records.append(write_shard(out, s, self.num_stages, state))
        if self.mesh is not None:
            records = dist_runner().gather_records(records, self.mesh.pp_group)
        if self.dp_rank == 0 and self.rank in (None, 0):
            write_index(out, index_of(sorted(records, key=lambda r: r["stage"])))
        if self.mesh is not None:
            dist_runner().gather_records([], self.mesh.pp_group)  # the index exists on return
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: weights, optimizer and correction state per stage."""
        self._check_drained("state_dict()")
        return {
            "format": FORMAT,
            "schedule": self.schedule_name,
            "num_stages": self.num_stages,
            "microbatches": self.microbatches,
            "step": self.step_count,
            "stages": self.stage_parts(),
        }

    def stage_parts(self) -> list[dict[str, Any]]:
        """Each local stage's part of a checkpoint (``nobubble train``'s on-disk format, which
        the multi-process runtime reads and writes too); with runtime="dist", this rank's."""
        self._check_drained("a checkpoint")
        return [w.state_dict() for w in self.workers]

    def load_stage_parts(self, step: int, parts: Sequence[Mapping[str, Any]]) -> None:
        """Continue from the parts of a checkpoint written at step ``step`` (a drain point):
        the schedule goes on from there with a drain point at ``step``."""
        self._check_drained("loading a checkpoint")
        if self.fed:
            raise RuntimeError("load a checkpoint into a new pipeline, before any step()")
        for worker, part in zip(self.workers, parts, strict=True):
            if part["stage"] != worker.stage:
                raise ValueError(
                    f"checkpoint part of stage {part['stage']} given to stage {worker.stage}"
                )
        self.drains = [step] if step else []
        self.fed = self.step_count = step
        self._reported = step * self.microbatches
        self.schedule, self.ledger = self._generate(step + FIRST_HORIZON)
        for worker, part in zip(self.workers, parts, strict=True):
            worker.use_schedule(self.schedule, self.ledger.stages[worker.stage], fresh=True)
            worker.load_state_dict(dict(part))
        self.emulator = self._runner(step)

    def load_restaged_parts(self, step: int, parts: Sequence[Mapping[str, Any]]) -> None:
        """Continue from every stage's part of a checkpoint of another split (another number
        of stages or virtual stages), written at drain point ``step``: each parameter's
        weights, optimizer state and correction buffers move to the stage that holds it now,
        by name (api/restage.py). With runtime="dist", every rank passes every saved part."""
        from nobubble.api.restage import check_versions, restage

        self.load_stage_parts(step, restage(parts, self.workers))
        check_versions(self.workers)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state_dict()``'s dict; one saved at another number of stages moves
        each parameter's state by name (``load_restaged_parts``)."""
        self._check_drained("load_state_dict()")
        if state.get("format") != FORMAT:
            raise ValueError(
                f"not a nobubble pipeline state (format {state.get('format')!r}, expected "
                f"{FORMAT!r}): load the dict that Pipeline.state_dict() returned"
            )
        if state["num_stages"] != self.num_stages:  # another split: move state by name
            self.load_restaged_parts(state["step"], state["stages"])
            return
        for worker, part in zip(self.workers, state["stages"], strict=True):
            ours = {n: tuple(p.shape) for n, p in worker.named}
            theirs = {n: tuple(t.shape) for n, t in part["module"].items() if n in ours}
            if ours != theirs:
                differ = sorted(n for n in ours if ours[n] != theirs.get(n))
                raise ValueError(
                    f"stage {worker.stage}'s parameters {differ[:3]} are missing from the state "
                    "or have other shapes: split the same model at the same points"
                )
        self.load_stage_parts(state["step"], state["stages"])
