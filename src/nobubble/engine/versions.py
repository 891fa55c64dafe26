"""Weight versions of one stage on stock PyTorch, driven by the ledger.

The optimizer owns the master parameters and updates them in place. A forward never reads the
master tensors directly: it reads an *alias* per version, a separate leaf tensor on the same
storage (``Tensor.set_``) with its own autograd version counter. Hence:

- updating the master in place changes what an in-flight graph reads at backward time without
  tripping autograd's "modified by an inplace operation" check: PACI's live weights;
- when the ledger says the current version is still needed after a step (a stashed backward
  or a delayed forward will read it), the master moves to a fresh copy first and the alias keeps
  the old storage: PipeDream's and 2BW's stashes, freed when their last reader has run.

Memory follows the ledger exactly: one copy per live version, one for PACI and sync schedules.

With weight prediction (``predict=True``, ``--correction predict``) a forward whose gradient will
be applied ``tau = ledger.delay[m] > 0`` versions later reads a *prediction* instead: the weights
of version v extrapolated along the update that made them, ``w_v + tau * (w_v - w_{v-1})``. A
prediction is a set of its own (one weight copy), keyed ``(v, tau)`` beside the plain ``(v, 0)``,
made right after the step that creates v (the only moment both w_v and w_{v-1} are at hand) for
every tau the ledger says v will be read with, and freed after its last reader like a stash.
Version 0 has no update behind it: its readers read it plain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nobubble.core.ir import Schedule
from nobubble.core.ledger import StageLedger


def alias(p: torch.Tensor) -> torch.Tensor:
    """A leaf on ``p``'s storage with its own version counter (in-place updates of p show)."""
    with torch.no_grad():
        out = torch.empty(0, dtype=p.dtype, device=p.device)
        out.set_(p.untyped_storage(), p.storage_offset(), p.size(), p.stride())
    return out.requires_grad_(p.requires_grad)


Key = tuple[int, int]  # (version, tau): tau = 0 the version itself, tau > 0 its prediction


def _read_key(ledger: StageLedger, m: int, predict: bool) -> Key:
    """The weights micro-batch m's forward reads: its version, predicted ``delay`` versions
    ahead when predicting (version 0, made by no update, is never predicted)."""
    version = ledger.fwd_version[m]
    tau = ledger.delay[m] if predict and version > 0 else 0
    return (version, max(tau, 0))


class WeightVersions:
    """The alias sets of the live versions (and predictions) of one stage and how many reads
    each has left."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        schedule: Schedule,
        ledger: StageLedger,
        current: int = 0,
        predict: bool = False,
    ) -> None:
        self.named = named
        self.current = current
        self.predict = predict
        self.ledger = ledger
        self.reads_left = self._reads(schedule, ledger)
        self.reads_done: Counter[Key] = Counter()
        self.live: dict[Key, dict[str, torch.Tensor]] = {(current, 0): self._aliases()}
        self.peak_live = 1

    def _reads(self, schedule: Schedule, ledger: StageLedger) -> Counter[Key]:
        """Reads per key: every forward; every stashed backward, which reads what its forward
        read (a live backward reads the master, or the prediction its graph holds)."""
        keys = [_read_key(ledger, m, self.predict) for m in range(len(ledger.fwd_version))]
        reads: Counter[Key] = Counter(keys)
        if schedule.backward_rule == "stashed":
            reads.update(keys)
        return reads

    def key(self, m: int) -> Key:
        return _read_key(self.ledger, m, self.predict)

    def extend(self, schedule: Schedule, ledger: StageLedger) -> None:
        """Go on under a longer schedule whose actions so far are the ones already run.

        The reads left become the new ledger's minus the ones done. A version the new ledger
        still reads must not have been freed (or moved) already under the shorter horizon.
        """
        reads = self._reads(schedule, ledger)
        reads.subtract(self.reads_done)
        lost = [
            k for k, n in reads.items() if n > 0 and k[0] <= self.current and k not in self.live
        ]
        if lost or any(n < 0 for n in reads.values()):
            raise RuntimeError(
                f"the longer schedule reads versions {lost} (version, predicted ahead) this "
                "stage already freed or never made: its actions so far differ from those run "
                "(a schedule generator that is not prefix-stable)"
            )
        self.reads_left = reads
        self.ledger = ledger

    def _aliases(self) -> dict[str, torch.Tensor]:
        return {name: alias(p) for name, p in self.named}

    def get(self, key: Key) -> dict[str, torch.Tensor]:
        assert key in self.live, f"weights {key} are not alive (live: {sorted(self.live)})"
        return self.live[key]

    def consumed(self, key: Key) -> None:
        """One read of ``key`` happened; free it once nobody will read it again."""
        self.reads_left[key] -= 1
        self.reads_done[key] += 1
        if self.reads_left[key] == 0 and key != (self.current, 0):
            del self.live[key]

    def forget_before(self, microbatch: int, ledger: StageLedger, stashed: bool) -> None:
        """Drop the reads of micro-batches < ``microbatch`` (a resumed run starts there)."""
        for m in range(microbatch):
            key = _read_key(ledger, m, self.predict)
            for _ in range(2 if stashed else 1):
                self.reads_left[key] -= 1
                self.reads_done[key] += 1

    def predictions_due(self) -> list[int]:
        """The taus the next version will be read with (empty without prediction): the caller
        keeps the weights before the update for ``after_update``."""
        if not self.predict:
            return []
        nxt = self.current + 1
        return sorted(k[1] for k, n in self.reads_left.items() if k[0] == nxt and k[1] and n > 0)

    def before_update(self) -> None:
        """Called right before the optimizer updates the master in place."""
        if self.reads_left[(self.current, 0)] > 0:
            # Someone still reads this version: move the master to a fresh copy, the alias keeps
            # the old storage (the stash); otherwise update in place (live weights).
            with torch.no_grad():
                for _, p in self.named:
                    p.data = p.data.clone()
        else:
            del self.live[(self.current, 0)]

    def after_update(self, previous: list[torch.Tensor] | None = None) -> None:
        """The update made version current + 1; ``previous``: the weights before it, from
        which the predictions ``predictions_due()`` named are made (w + tau * (w - previous))."""
        taus = self.predictions_due()
        self.current += 1
        self.live[(self.current, 0)] = self._aliases()
        if taus:
            assert previous is not None, "predictions are due: pass the weights before the step"
            with torch.no_grad():
                for tau in taus:
                    self.live[(self.current, tau)] = {
                        name: torch.add(p, p - before, alpha=tau).requires_grad_(p.requires_grad)
                        for (name, p), before in zip(self.named, previous, strict=True)
                    }
        self.peak_live = max(self.peak_live, len(self.live))

    # ----- checkpoints (taken at drain points: nothing in flight) ---------------------------
    def state_dict(self) -> dict[str, object]:
        """The current version number, the stashed versions other than the current one, and
        the predictions still to be read."""

        def copies(keep: Callable[[Key], bool]) -> dict[Any, dict[str, torch.Tensor]]:
            return {
                (k if k[1] else k[0]): {name: t.detach().clone() for name, t in weights.items()}
                for k, weights in self.live.items()
                if keep(k)
            }

        stash = copies(lambda k: k[1] == 0 and k[0] != self.current)
        predicted = copies(lambda k: k[1] > 0)
        return {"current": self.current, "stash": stash, "predicted": predicted}

    def load_state_dict(
        self, state: dict[str, object], ledger: StageLedger, stashed: bool, first_microbatch: int
    ) -> None:
        """Restore after the master parameters were loaded; reads before the drain are spent."""
        current = state["current"]
        assert isinstance(current, int)
        self.current = current
        self.live = {(current, 0): self._aliases()}
        stash, predicted = state["stash"], state.get("predicted", {})
        assert isinstance(stash, dict) and isinstance(predicted, dict)
        if predicted and not self.predict:
            raise ValueError(
                "the checkpoint holds predicted weights (--correction predict) but this stage "
                "does not predict: resume with the correction it was saved with"
            )
        for v, weights in stash.items():
            self.live[(int(v), 0)] = self._restored(weights)
        for (v, tau), weights in predicted.items():
            self.live[(int(v), int(tau))] = self._restored(weights)
        self.forget_before(first_microbatch, ledger, stashed)
        self.ledger = ledger

    def _restored(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        grads = dict((n, p.requires_grad) for n, p in self.named)
        return {n: t.clone().requires_grad_(grads.get(n, True)) for n, t in weights.items()}


__all__ = [
    "Key",
    "WeightVersions",
    "alias",
]
