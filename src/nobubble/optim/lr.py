"""Learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math

from nobubble.optim.config import OptimConfig


def warmup_steps(total_steps: int, warmup_frac: float) -> int:
    """ceil(warmup_frac * total_steps), capped so that at least one decay step remains."""
    # round() first: 0.1 * 30 is 3.0000000000000004 in floating point, which must not ceil to 4.
    return min(math.ceil(round(warmup_frac * total_steps, 9)), total_steps - 1)


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The lr of optimizer step `step` (0-based index of the step about to be applied).

    With W = warmup_steps(total_steps, cfg.warmup_frac), peak = cfg.lr, floor = min_lr_ratio*peak:
        step < W:  peak * (step + 1) / W                  (first step > 0, step W-1 at the peak)
        step >= W: floor + (peak - floor) * (1 + cos(pi * q)) / 2,  q = (step - W + 1) / (T - W)
    so the cosine continues from the peak at step W-1 and reaches the floor exactly at the last
    step T-1. With no warmup the first step is already one decay step below the peak.
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r} is not allowed: use an int >= 1")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < total_steps:
        raise ValueError(f"step={step!r} is not allowed: use an int in [0, {total_steps})")
    peak = cfg.lr
    warmup = warmup_steps(total_steps, cfg.warmup_frac)
    if step < warmup:
        return peak * (step + 1) / warmup
    floor = cfg.min_lr_ratio * peak
    progress = (step - warmup + 1) / (total_steps - warmup)  # in (0, 1], 1 at the last step
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
