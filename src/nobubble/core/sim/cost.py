"""Cost model for the simulator: how long each action and each hop takes (any time unit)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """Per-stage forward and backward durations, step cost and point-to-point transfer cost.

    ``fwd`` and ``bwd`` are one number for every stage or one per stage. A transfer between
    neighbouring stages costs ``latency + activation_bytes / bandwidth`` (bandwidth in bytes per
    time unit; ``inf`` means free transfers).
    """

    fwd: float | tuple[float, ...] = 1.0
    bwd: float | tuple[float, ...] = 2.0
    step: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    activation_bytes: float = 0.0

    def __post_init__(self) -> None:
        for label, value in (("fwd", self.fwd), ("bwd", self.bwd)):
            values = value if isinstance(value, tuple) else (value,)
            if not values or any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"--{label} durations must be finite and >= 0, got {value!r}")
        for label, number in (
            ("step", self.step),
            ("latency", self.latency),
            ("activation-bytes", self.activation_bytes),
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

    def transfer(self) -> float:
        return self.latency + self.activation_bytes / self.bandwidth


def parse_durations(values: Sequence[float]) -> float | tuple[float, ...]:
    return values[0] if len(values) == 1 else tuple(values)
