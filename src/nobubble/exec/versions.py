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
"""

from __future__ import annotations

from collections import Counter

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


class WeightVersions:
    """The alias sets of the live versions of one stage and how many reads each has left."""

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        schedule: Schedule,
        ledger: StageLedger,
        current: int = 0,
    ) -> None:
        self.named = named
        self.current = current
        self.reads_left = self._reads(schedule, ledger)
        self.reads_done: Counter[int] = Counter()
        self.live: dict[int, dict[str, torch.Tensor]] = {current: self._aliases()}
        self.peak_live = 1

    @staticmethod
    def _reads(schedule: Schedule, ledger: StageLedger) -> Counter[int]:
        reads: Counter[int] = Counter(ledger.fwd_version)
        if schedule.backward_rule == "stashed":
            reads.update(ledger.bwd_version)
        return reads

    def extend(self, schedule: Schedule, ledger: StageLedger) -> None:
        """Go on under a longer schedule whose actions so far are the ones already run.

        The reads left become the new ledger's minus the ones done. A version the new ledger
        still reads must not have been freed (or moved) already under the shorter horizon.
        """
        reads = self._reads(schedule, ledger)
        reads.subtract(self.reads_done)
        lost = [v for v, n in reads.items() if n > 0 and v <= self.current and v not in self.live]
        if lost or any(n < 0 for n in reads.values()):
            raise RuntimeError(
                f"the longer schedule reads versions {lost} this stage already freed: its "
                "actions so far differ from those run (a schedule generator that is not "
                "prefix-stable)"
            )
        self.reads_left = reads

    def _aliases(self) -> dict[str, torch.Tensor]:
        return {name: alias(p) for name, p in self.named}

    def get(self, version: int) -> dict[str, torch.Tensor]:
        assert version in self.live, f"version {version} is not alive (live: {sorted(self.live)})"
        return self.live[version]

    def consumed(self, version: int) -> None:
        """One read of ``version`` happened; free it once nobody will read it again."""
        self.reads_left[version] -= 1
        self.reads_done[version] += 1
        if self.reads_left[version] == 0 and version != self.current:
            del self.live[version]

    def forget_before(self, microbatch: int, ledger: StageLedger, stashed: bool) -> None:
        """Drop the reads of micro-batches < ``microbatch`` (a resumed run starts there)."""
        for m in range(microbatch):
            self.reads_left[ledger.fwd_version[m]] -= 1
            self.reads_done[ledger.fwd_version[m]] += 1
            if stashed:
                self.reads_left[ledger.bwd_version[m]] -= 1
                self.reads_done[ledger.bwd_version[m]] += 1

    def before_update(self) -> None:
        """Called right before the optimizer updates the master in place."""
        if self.reads_left[self.current] > 0:
            # Someone still reads this version: move the master to a fresh copy, the alias keeps
            # the old storage (the stash); otherwise update in place (live weights).
            with torch.no_grad():
                for _, p in self.named:
                    p.data = p.data.clone()
        else:
            del self.live[self.current]

    def after_update(self) -> None:
        self.current += 1
        self.live[self.current] = self._aliases()
        self.peak_live = max(self.peak_live, len(self.live))

    # ----- checkpoints (taken at drain points: nothing in flight) ---------------------------
    def state_dict(self) -> dict[str, object]:
        """The current version number and the stashed versions other than the current one."""
        stash = {
            v: {name: t.detach().clone() for name, t in weights.items()}
            for v, weights in self.live.items()
            if v != self.current
        }
        return {"current": self.current, "stash": stash}

    def load_state_dict(
        self, state: dict[str, object], ledger: StageLedger, stashed: bool, first_microbatch: int
    ) -> None:
        """Restore after the master parameters were loaded; reads before the drain are spent."""
        current = state["current"]
        assert isinstance(current, int)
        self.current = current
        self.live = {current: self._aliases()}
        stash = state["stash"]
        assert isinstance(stash, dict)
        for v, weights in stash.items():
            self.live[int(v)] = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
        self.forget_before(first_microbatch, ledger, stashed)
