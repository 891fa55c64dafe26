"""Seed-paired comparisons and the verdict rules of the report, fixed before any number is read.

Two runs are paired when they share a seed: same initial weights, same data order. Their
difference removes what the seed alone moves, so a comparison is the mean of the per-seed
differences with a two-sided Student-t interval. A verdict classifies that interval by the rules
below; docs/results.md prints them before the numbers.

An interval is a plain dict (it goes into summary.json): ``seeds`` and ``values`` (the per-seed
differences, in seed order), ``n``, ``mean``, ``sd`` and the bounds ``lo``, ``hi`` (``None``
below two seeds).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

# ----- the rules -------------------------------------------------------------------------------
CONFIDENCE = 0.95
MIN_SEEDS = 3  # fewer paired seeds than this never carry a verdict
# A loss difference whose whole interval lies inside ±LOSS_MARGIN "matches". 0.02 sits between
# what the papers treat as no real loss (paper B's "slight" lag of a=4, +0.009; paper A's Muon
# delay gap, +0.012, "hardly at all") and what paper A calls a loss (> 0.03 at P=16).
LOSS_MARGIN = 0.02
# A recovered share (of the delay's gap) matches the paper's when its whole interval lies within
# ±SHARE_MARGIN of it: the paper's own Muon figure is 71% as stated and 58% from its rounded
# losses, so its shares are not known more closely than about 13 points.
SHARE_MARGIN = 0.15

MATCHES, ABOVE, BELOW, INCONCLUSIVE = "matches", "above", "below", "inconclusive"
RULES = {
    MATCHES: "R1 matches: the whole interval lies inside the margin ±m",
    ABOVE: "R2 above (for a loss difference: worse): not R1, and the whole interval lies above 0",
    BELOW: "R3 below (for a loss difference: better): not R1, and the whole interval lies below 0",
    INCONCLUSIVE: f"R4 inconclusive: none of R1-R3, or fewer than {MIN_SEEDS} paired seeds",
}
RULE_IDS = {cls: text.split(" ", 1)[0] for cls, text in RULES.items()}


# ----- Student t -------------------------------------------------------------------------------
def _t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's T with ``df`` degrees of freedom.

    Exact for integer df: the finite series of Abramowitz & Stegun 26.7.3 (odd df) and 26.7.4
    (even df) in theta = atan(t / sqrt(df)).
    """
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # 2/pi [theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)], (df-1)/2 terms
        term = total = 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term = total = 1.0  # sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), df/2 terms
    for k in range(1, df // 2):
        term *= cos2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_critical(df: int, confidence: float = CONFIDENCE) -> float:
    """Two-sided critical value t with P(|T| <= t) = confidence (df 4, 95%: 2.776)."""
    if df < 1 or not 0 < confidence < 1:
        raise ValueError(f"need df >= 1 and 0 < confidence < 1, got df={df}, {confidence}")
    lo, hi = 0.0, 1.0
    while _t_central(hi, df) < confidence:
        hi *= 2
    for _ in range(100):  # bisection to float precision
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, df) < confidence else (lo, mid)
    return (lo + hi) / 2


# ----- intervals -------------------------------------------------------------------------------
def interval(per_seed: Mapping[int, float]) -> dict[str, Any]:
    """Mean of per-seed values with its two-sided Student-t interval at CONFIDENCE."""
    seeds = sorted(per_seed)
    values = [float(per_seed[s]) for s in seeds]
    n = len(values)
    mean = statistics.fmean(values) if values else math.nan
    sd = statistics.stdev(values) if n > 1 else None
    half = t_critical(n - 1) * sd / math.sqrt(n) if sd is not None else None
    return {
        "seeds": seeds,
        "values": values,
        "n": n,
        "mean": mean,
        "sd": sd,
        "lo": None if half is None else mean - half,
        "hi": None if half is None else mean + half,
    }


def per_seed(iv: Mapping[str, Any]) -> dict[int, float]:
    """The per-seed values of an interval (also of one read back from JSON)."""
    return {int(s): float(v) for s, v in zip(iv["seeds"], iv["values"], strict=True)}


def diff(a: Mapping[int, float], b: Mapping[int, float]) -> dict[int, float]:
    """a - b for every seed both have: pairing by seed, never by sorted value."""
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b))}


def paired(treatment: Mapping[int, float], baseline: Mapping[int, float]) -> dict[str, Any]:
    """Interval of treatment - baseline over the seeds both ran."""
    return interval(diff(treatment, baseline))


# ----- verdicts --------------------------------------------------------------------------------
def classify(iv: Mapping[str, Any], margin: float) -> str:
    """MATCHES, ABOVE, BELOW or INCONCLUSIVE by RULES (the margin is ±margin around 0)."""
    if iv["n"] < MIN_SEEDS:
        return INCONCLUSIVE
    lo, hi = iv["lo"], iv["hi"]
    if -margin <= lo and hi <= margin:
        return MATCHES
    if lo > 0:
        return ABOVE
    if hi < 0:
        return BELOW
    return INCONCLUSIVE


def classify_point(value: float, margin: float) -> str:
    """The class RULES give an exact number (a paper's difference, taken as known)."""
    if abs(value) <= margin:
        return MATCHES
    return ABOVE if value > 0 else BELOW


def describe(iv: Mapping[str, Any], margin: float, what: str, pct: bool = False) -> str:
    """``what`` = mean [lo, hi], n seeds, its class and the rule that gave it."""
    cls = classify(iv, margin)
    fmt = "{:+.0%}" if pct else "{:+.4f}"
    m = ("{:.0%}" if pct else "{:g}").format(margin)
    if iv["n"] < MIN_SEEDS:
        mean = fmt.format(iv["mean"]) if iv["n"] else "n/a"
        return f"{what} {mean}: inconclusive ({n_seeds(iv['n'])}; {RULE_IDS[cls]})"
    return (
        f"{what} {fmt.format(iv['mean'])}, {CONFIDENCE:.0%} CI [{fmt.format(iv['lo'])}, "
        f"{fmt.format(iv['hi'])}], {n_seeds(iv['n'])}: {cls} ({RULE_IDS[cls]}, m={m})"
    )


def n_seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def judge(iv: Mapping[str, Any], margin: float, expected: str) -> str:
    """reproduced / not reproduced / inconclusive: the interval's class against the paper's."""
    cls = classify(iv, margin)
    if cls == INCONCLUSIVE:
        return "inconclusive"
    return "reproduced" if cls == expected else "not reproduced"


def fmt_interval(iv: Mapping[str, Any] | None, pct: bool = False) -> str:
    """mean [lo, hi] (n) for a table cell."""
    if iv is None or not iv["n"]:
        return "n/a"
    fmt = "{:+.0%}" if pct else "{:+.4f}"
    mean = fmt.format(iv["mean"])
    if iv["lo"] is None:
        return f"{mean} (n={iv['n']})"
    return f"{mean} [{fmt.format(iv['lo'])}, {fmt.format(iv['hi'])}] (n={iv['n']})"
