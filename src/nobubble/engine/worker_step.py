"""The step side of a stage worker (``WorkerStep``, the base of ``StageWorker``): the gradient
norm and its non-finite check, tied parameters' gradients added across stages (``share``), the
optimizer step at the ledger's version (clip, lr, delay correction, new version), the weight
versions, and the stage's checkpoint state. The engine reads the stage's delay correction here
only (docs/architecture.md, "The path of one option")."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nobubble.core.ir import Schedule
from nobubble.core.ledger import StageLedger
from nobubble.engine.blocks import BlockCall, stash_bytes
from nobubble.engine.devices import to_device
from nobubble.engine.ties import Tie, TieMeeting, tied_square
from nobubble.engine.versions import WeightVersions
from nobubble.optim import (
    DelayCorrection,
    StageOptimizer,
    clip_coefficient,
    grad_sq_norm,
    grads_finite,
    scale_grads_,
    sum_over_stages,
)


class WorkerStep:
    """The parts of a stage worker, declared here and built by ``StageWorker.__init__``
    (worker.py); the forward, backward and step sides (worker_forward.py, worker_backward.py,
    this module) read them."""

    module: nn.Module
    schedule: Schedule
    ledger: StageLedger
    stage: int
    optimizer: StageOptimizer
    correction: DelayCorrection
    lr_fn: Callable[[int], float] | None
    clip_norm: float | None
    named: list[tuple[str, nn.Parameter]]
    device: torch.device
    sharded: Any
    versions: WeightVersions
    checkpointed: list[BlockCall]  # the stage's checkpointed blocks (engine/blocks.py)
    saved: dict[int, Any]
    backwards_in_batch: int
    peak_saved: int
    peak_activation_bytes: int
    peak_stash_bytes: int
    grad_norms: dict[int, float]
    ties: list[Tie]
    num_stages: int
    is_first: bool
    is_last: bool
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    batch_fn: Callable[[int], Any]
    autocast_dtype: torch.dtype | None
    recompute: bool
    master: dict[str, torch.Tensor]
    pending: dict[int, Any]
    reducer: Any
    losses: dict[int, torch.Tensor]
    in_spec: Any
    out_spec: Any
    forwards: int
    _saved_bytes: int

    def grad_sq_norm(self) -> torch.Tensor:
        if self.sharded is not None:  # the shards' shares, summed over the dp group
            return self.sharded.grad_sq_norm()
        return grad_sq_norm(p for _, p in self.named)

    def _grads_finite(self) -> bool:
        if self.sharded is not None:
            return bool(self.sharded.grads_finite())
        return grads_finite([p for _, p in self.named])

    def _tied_here(self) -> list[str]:
        return [n for t in self.ties for s, n in ((t[0], t[1]), (t[2], t[3])) if s == self.stage]

    def share(self) -> Any:
        """What this stage offers the others before a step that meets across stages: its
        squared gradient norm, or with tied parameters (its norm without them, their grads)."""
        if not self.ties:
            return self.grad_sq_norm()
        tied = set(self._tied_here())
        grads = {n: p.grad for n, p in self.named if n in tied}
        return grad_sq_norm(p for n, p in self.named if n not in tied), grads

    def _add_tied(self, shares: list[Any] | TieMeeting) -> torch.Tensor:
        """Give each tied parameter of this stage the sum of both copies' gradients (lower
        stage first, on every stage alike); return the global squared norm, each tied pair
        counted once. Both copies then take the same step, so they stay bitwise equal.

        ``shares``: every stage's ``share()`` in stage order (the emulator), or the meeting a
        rank of the runtime pooled (its pairs' gradients, the other pairs' squares)."""
        meeting = shares if isinstance(shares, TieMeeting) else TieMeeting.pool(shares)
        params = dict(self.named)
        pairs = []
        for k, (a, name_a, b, name_b) in enumerate(self.ties):
            if k in meeting.pair_squares:  # a pair of two other ranks: its square came along
                pairs.append(meeting.pair_squares[k])
                continue
            total = meeting.grads[a, name_a] + meeting.grads[b, name_b]
            pairs.append(tied_square(total))
            for stage, name in ((a, name_a), (b, name_b)):
                if stage == self.stage:
                    params[name].grad = total.clone()
        squares = sum_over_stages(meeting.squares)
        for square in pairs:
            squares = squares + square.to(squares.device)
        return squares

    # ----- the weight versions ------------------------------------------------------------
    def _new_versions(self, schedule: Schedule, ledger: StageLedger) -> WeightVersions:
        """The stage's weight versions under ``schedule``; they keep predicted weights when the
        correction predicts (weight prediction)."""
        if self.sharded is None:
            return WeightVersions(self.named, schedule, ledger, predict=self.correction.predicts)
        assert not self.correction.predicts, "Pipeline refuses predict with shard='fsdp'"
        return self.sharded.versions(self.named, schedule, ledger)

    # ----- checkpoints ---------------------------------------------------------------------
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Everything this stage needs to continue from a drain point. ``copy=False``: the
        module's own tensors instead of copies (a checkpoint written at once, without a
        second copy of the weights)."""
        assert not self.saved and self.backwards_in_batch == 0, "checkpoint only at a drain point"
        module = {k: v.detach() for k, v in self.module.state_dict().items()}
        state = {
            "stage": self.stage,
            "names": [name for name, _ in self.named],  # the order of the correction's buffers
            "module": {k: v.clone() for k, v in module.items()} if copy else module,
            "optimizer": self.optimizer.state_dict(),
            "correction": self.correction.state_dict(),
            "versions": self.versions.state_dict(),
            "peak_saved": self.peak_saved,
            "peak_activation_bytes": self.peak_activation_bytes,
        }
        if self.sharded is not None:  # whole tensors: a dp collective, on every replica
            state = self.sharded.gathered(state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, a ``state_dict`` of this stage (moved to its device)."""
        if state["stage"] != self.stage:
            raise ValueError(
                f"checkpoint part of stage {state['stage']} given to stage {self.stage}"
            )
        state = to_device(state, self.device)  # EF buffers and stashed versions included
        if self.sharded is not None:  # this replica's shards of the whole tensors
            state = self.sharded.scattered(state, self.optimizer, self.correction.parameter_buffers)
        with torch.no_grad():
            for name, p in self.named:
                p.copy_(state["module"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.correction.load_state_dict(state["correction"])
        stashed = self.schedule.backward_rule == "stashed"
        first = state["versions"]["current"] * self.schedule.num_microbatches
        self.versions.load_state_dict(state["versions"], self.ledger, stashed, first)
        self.peak_saved = state["peak_saved"]
        self.peak_activation_bytes = state["peak_activation_bytes"]

    def module_state(self) -> dict[str, torch.Tensor]:
        """A copy of the stage module's state dict, whole (a dp collective when sharded)."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        return state if self.sharded is None else self.sharded.gathered(state)

    def lr_of(self, step: int) -> float:
        """The learning rate step ``step`` (1-based) applies."""
        return self.optimizer.lr if self.lr_fn is None else self.lr_fn(step - 1)

    def step(self, step: int, total_sq_norm: Any = None) -> None:
        """Apply batch ``step - 1``: lr, clipping, correction and optimizer, new version.

        ``total_sq_norm``: the global squared gradient norm (global clipping), or, with tied
        parameters, every stage's ``share()`` in stage order; None: this stage's own norm.
        """
        assert self.batch_complete, f"stage {self.stage}: step {step} before its batch finished"
        if self.ties:
            assert isinstance(total_sq_norm, list | TieMeeting), "tied parameters need the meeting"
            total_sq_norm = self._add_tied(total_sq_norm)
        params: list[torch.Tensor] = [p for _, p in self.named]
        norm = math.sqrt(float(self.grad_sq_norm() if total_sq_norm is None else total_sq_norm))
        # A non-finite entry makes the norm non-finite, so the norm (read anyway) screens every
        # step for free; only a non-finite norm pays the exact pass, which tells a non-finite
        # gradient of this stage from an overflowing square or another stage's.
        if not math.isfinite(norm) and not self._grads_finite():
            raise FloatingPointError(
                f"stage {self.stage}, step {step}: non-finite gradients; lower --lr, enable "
                "clipping (--clip 1.0) or train in fp32 (--dtype fp32)"
            )
        self.grad_norms[step] = norm
        if self.clip_norm is not None:
            scale_grads_(params, clip_coefficient(norm, self.clip_norm))
        delay = self.batch_delay(step)
        self.optimizer.on_delay(delay, self.num_stages)  # an optimizer that reads it (nadam-delay)
        factor = self.correction.lr_factor(step - 1, delay)
        if self.lr_fn is not None:
            self.optimizer.set_lr(self.lr_fn(step - 1) * factor)
        elif self.correction.scales_lr:  # a user's optimizer (lr_fn None): scale its own lr
            self.optimizer.set_lr(factor)
        # prediction: the weights before the update, from which the new version's predictions
        # are extrapolated (a transient copy, only when the ledger says they will be read)
        due = self.versions.predictions_due()
        previous = [p.detach().clone() for p in params] if due else None
        self.versions.before_update()
        if self.checkpointed:  # rebuilds to come keep the values their forward read
            for block in self.checkpointed:
                block.stash_live()
            # stashes are made only here and freed later: the peak is right after a step's
            self.peak_stash_bytes = max(self.peak_stash_bytes, stash_bytes(self.checkpointed))
        self.correction.apply(params, self.optimizer.step, delay)
        self.optimizer.zero_grad(set_to_none=True)
        self.versions.after_update(previous)
        self.backwards_in_batch = 0

    def batch_delay(self, step: int) -> float:
        """The stage's delay at step ``step``: the mean, over the micro-batches of the batch it
        applies, of the versions between the one each forward read and the one its gradient
        is applied to (the ledger's ``delay``; 1 for 2BW, the crossed share for PACI)."""
        m = self.schedule.num_microbatches
        delays = self.ledger.delay[(step - 1) * m : step * m]
        return sum(delays) / len(delays)

    @property
    def batch_complete(self) -> bool:
        return self.backwards_in_batch == self.schedule.num_microbatches


__all__ = [
    "WorkerStep",
]
