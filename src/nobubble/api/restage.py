"""A checkpoint of one split loaded into another: the parts of P stages cut at this pipeline's
stages (another P, other virtual stages). Every parameter's weights, optimizer state and
correction buffers (error feedback's) move with the parameter, by name, to the stage that holds
it now; what belongs to the stage as a whole (the version count, the correction's step count)
must agree across the saved stages.

Only a drained checkpoint moves: every stage at the same weight version and optimizer step (as
every drain point leaves them). An asynchronous schedule then runs a new pipeline from there:
its delays and ledger are those of the new depth. The older weight versions it keeps at a drain
point (2BW's previous version, which its next batch reads) move by name like the weights; a
version the new split reads but the old one did not keep (a deeper PipeDream's stash) and
predicted weights (made for the old split's delays) are refused, by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nobubble.optim.build import ParamState, state_by_name


class Saved:
    """The parts of every saved stage, merged by parameter name."""

    def __init__(self, parts: Sequence[Mapping[str, Any]]) -> None:
        if any(part["optimizer"].get("optimizer") == "callable" for part in parts):
            raise ValueError(
                "the checkpoint's optimizer is a user's torch optimizer (a callable), whose "
                "state torch keys by position: it cannot move to another split; load it into "
                "a pipeline split as it was saved"
            )
        predicted = [part["stage"] for part in parts if part["versions"].get("predicted")]
        if predicted:
            raise ValueError(
                f"the checkpoint's stages {predicted} hold predicted weights still to be read "
                "(--correction predict), extrapolated for the old split's delays: it resumes "
                "only at the --stages and --virtual-stages it was written with"
            )
        self.stash: dict[int, dict[str, Any]] = {}  # older version -> name -> tensor
        self.weights: dict[str, Any] = {}
        self.optimizer: dict[str, ParamState] = {}
        self.buffers: dict[str, dict[str, Any]] = {}  # correction key -> name -> tensor
        for part in parts:
            self.weights.update(part["module"])
            for version, weights in part["versions"]["stash"].items():
                self.stash.setdefault(int(version), {}).update(weights)
            self.optimizer.update(state_by_name(part["optimizer"]))
            for key, values in part["correction"].items():
                if isinstance(values, list):  # one buffer per parameter, in the stage's order
                    names = part_names(part)
                    self.buffers.setdefault(key, {}).update(zip(names, values, strict=True))
        self.stage_wide = agreed(parts)
        self.first = parts[0]

    def part_for(self, worker: Any) -> dict[str, Any]:
        """The part of ``worker``'s stage (a ``StageWorker`` of the new split)."""
        names = [name for name, _ in worker.named]
        missing = [n for n in names if n not in self.weights]
        if missing:
            raise ValueError(
                f"stage {worker.stage} holds parameters {missing[:3]} that the checkpoint does "
                "not (another model, or tied weights split differently): resume the same model "
                "with --untie-embeddings as it was saved"
            )
        wrong = [n for n, p in worker.named if tuple(self.weights[n].shape) != tuple(p.shape)]
        if wrong:
            raise ValueError(
                f"stage {worker.stage}'s parameters {wrong[:3]} have other shapes in the "
                "checkpoint: load it into the model it was saved from"
            )
        stash = {  # a version some of whose tensors were not kept is refused once read
            v: {n: weights[n] for n in names}
            for v, weights in self.stash.items()
            if all(n in weights for n in names)
        }
        correction = dict(self.stage_wide["correction"])
        for key, by_name in self.buffers.items():
            correction[key] = [by_name[n] for n in names]
        return {
            "stage": worker.stage,
            "names": names,
            "module": {n: self.weights[n] for n in names},
            "optimizer": worker.optimizer.restaged(self.optimizer),
            "correction": correction,
            "versions": {"current": self.stage_wide["current"], "stash": stash, "predicted": {}},
            "peak_saved": 0,
            "peak_activation_bytes": 0,
        }


def part_names(part: Mapping[str, Any]) -> list[str]:
    if "names" not in part:
        raise ValueError(
            f"the checkpoint's stage {part['stage']} was written without its parameter names (by "
            "an older nobubble): resume at the --stages and --virtual-stages it was written with"
        )
    return list(part["names"])


def agreed(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What every saved stage holds alike: its weight version and the correction's scalars."""
    currents = {part["versions"]["current"] for part in parts}
    scalars = [
        {k: v for k, v in part["correction"].items() if not isinstance(v, list) and v is not None}
        for part in parts
    ]
    if len(currents) != 1 or any(s != scalars[0] for s in scalars):
        raise ValueError(
            f"the checkpoint's stages disagree on their weight version ({sorted(currents)}) or "
            "their correction's state: it is not drained (a drain point leaves every stage at "
            "the same version and step), so no stage's state is the one to move; resume from "
            "a checkpoint of a drain point (every one nobubble train writes)"
        )
    none = {k for k, v in parts[0]["correction"].items() if v is None}
    return {
        "current": currents.pop(),
        "correction": {**scalars[0], **dict.fromkeys(none)},
    }


def restage(parts: Sequence[Mapping[str, Any]], workers: Sequence[Any]) -> list[dict[str, Any]]:
    """The parts of ``workers``' stages, cut from ``parts``, a checkpoint of another split."""
    saved = Saved(parts)
    return [saved.part_for(worker) for worker in workers]


def check_versions(workers: Sequence[Any]) -> None:
    """After loading: every older version the new split's ledger reads is alive."""
    for worker in workers:
        versions = worker.versions
        missing = sorted(
            key[0]
            for key, reads in versions.reads_left.items()
            if reads > 0 and key[0] < versions.current and key not in versions.live
        )
        if missing:
            raise ValueError(
                f"at the new split, stage {worker.stage} reads weight versions {missing} that "
                "the checkpoint's stages did not keep (an asynchronous schedule keeps as many "
                "as its depth needs): resume at the --stages it was written with or fewer"
            )


__all__ = ["check_versions", "restage"]
