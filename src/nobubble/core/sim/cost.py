"""Cost model for the simulator: how long each action and each hop takes (any time unit)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nobubble.core.ir import B, F, I, W
from nobubble.core.placement import Placement


@dataclass(frozen=True)
class CostModel:
    """Forward, backward and weight-gradient durations, step cost and point-to-point transfer cost.

    ``fwd`` and ``bwd`` are one number for every rank, one per rank, or one per stage; a rank
    that holds v stages (interleaved, ZB-V) spends 1/v of its rank's number on each, so the same
    numbers describe the same model whatever the schedule. ``wgrad`` is the weight-gradient part W
    of ``bwd``; a split backward runs I = bwd - wgrad then W = wgrad (None: half of bwd each).
    A transfer between neighbouring stages on different ranks costs ``latency + activation_bytes
    / bandwidth`` (bandwidth in bytes per time unit; ``inf`` means free transfers).
    ``allreduce`` is the data-parallel all-reduce of a stage's gradients, once per step and
    stage (``ring_allreduce`` estimates it from bytes and bandwidth): the runtime launches it
    after the stage's last backward of the batch and waits for it at the STEP, which follows
    directly, so it adds to the STEP (nothing of the stage's own is left to hide it behind).
    """

    fwd: float | tuple[float, ...] = 1.0
    bwd: float | tuple[float, ...] = 2.0
    step: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    activation_bytes: float = 0.0
    wgrad: float | tuple[float, ...] | None = None
    allreduce: float = 0.0

    def __post_init__(self) -> None:
        for label, value in (("fwd", self.fwd), ("bwd", self.bwd), ("wgrad", self.wgrad)):
            if value is None:
                continue
            values = value if isinstance(value, tuple) else (value,)
            if not values or any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"--{label} durations must be finite and >= 0, got {value!r}")
        if isinstance(self.bwd, (int, float)) and isinstance(self.wgrad, (int, float)):
            _check_wgrad(self.wgrad, self.bwd, "")
        for label, number in (
            ("step", self.step),
            ("latency", self.latency),
            ("activation-bytes", self.activation_bytes),
            ("allreduce", self.allreduce),
        ):
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"--{label} must be finite and >= 0, got {number!r}")
        if not self.bandwidth > 0:
            raise ValueError(
                f"--bandwidth must be > 0 (inf for free transfers), got {self.bandwidth!r}"
            )

    def per_stage(
        self, value: float | tuple[float, ...], num_stages: int, label: str
    ) -> list[float]:
        if isinstance(value, tuple):
            if len(value) == 1:
                return [value[0]] * num_stages
            if len(value) != num_stages:
                raise ValueError(
                    f"--{label} gives {len(value)} durations for {num_stages} stages; "
                    f"give one number or exactly {num_stages}"
                )
            return list(value)
        return [value] * num_stages

    def fwd_costs(self, num_stages: int) -> list[float]:
        return self.per_stage(self.fwd, num_stages, "fwd")

    def bwd_costs(self, num_stages: int) -> list[float]:
        return self.per_stage(self.bwd, num_stages, "bwd")

    def durations(self, placement: Placement) -> dict[str, list[float]]:
        """Per-stage durations of F, B, I and W under ``placement`` (see the class docstring)."""
        fwd = _spread(self.fwd, placement, "fwd")
        bwd = _spread(self.bwd, placement, "bwd")
        if self.wgrad is None:
            wgrad = [b / 2 for b in bwd]
        else:
            wgrad = _spread(self.wgrad, placement, "wgrad")
        for stage, (b, w) in enumerate(zip(bwd, wgrad, strict=True)):
            _check_wgrad(w, b, f" on stage {stage}")
        return {F: fwd, B: bwd, I: [b - w for b, w in zip(bwd, wgrad, strict=True)], W: wgrad}

    def transfer(self) -> float:
        return self.latency + self.activation_bytes / self.bandwidth


def ring_allreduce(
    nbytes: float, data_parallel: int, bandwidth: float, latency: float = 0.0
) -> float:
    """A ring all-reduce of ``nbytes`` over ``data_parallel`` ranks: 2(D-1) steps, each moving
    1/D of the bytes (bandwidth in bytes per time unit)."""
    if data_parallel <= 1:
        return 0.0
    steps = 2 * (data_parallel - 1)
    return steps * (latency + nbytes / data_parallel / bandwidth)


def _check_wgrad(wgrad: float, bwd: float, where: str) -> None:
    if wgrad > bwd:
        raise ValueError(
            f"--wgrad {wgrad:g} exceeds --bwd {bwd:g}{where}: the weight gradient W is part of "
            "the backward (I = bwd - wgrad), so give a --wgrad of at most --bwd"
        )


def _spread(value: float | tuple[float, ...], placement: Placement, label: str) -> list[float]:
    """Per-stage durations from one number, one per rank or one per stage."""
    values = value if isinstance(value, tuple) else (value,)
    share = placement.stages_per_rank
    if len(values) == placement.num_stages:
        return list(values)
    if len(values) in (1, placement.num_ranks):
        per_rank = values * placement.num_ranks if len(values) == 1 else values
        return [per_rank[placement.rank_of(s)] / share for s in range(placement.num_stages)]
    raise ValueError(
        f"--{label} gives {len(values)} durations for {placement.describe()}; give one number, "
        f"one per rank ({placement.num_ranks}) or one per stage ({placement.num_stages})"
    )


def parse_durations(values: Sequence[float]) -> float | tuple[float, ...]:
    return values[0] if len(values) == 1 else tuple(values)
