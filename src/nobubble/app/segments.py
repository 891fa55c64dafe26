"""Runs trained in alternating segments, so that their speeds are compared under equal conditions.

Speed on a shared machine moves by tens of percent from one minute to the next, so one run of
each schedule after the other can flip a ratio. Here each run is cut into ``segments`` pieces at
its own drain points (``--stop-at``, then ``--resume``; resuming continues with the numbers of
the uninterrupted run that has the same drain points) and segment r of every run is trained in
round r, back to back, in an order that rotates from round to round. A ratio taken within a
round compares runs that met the same conditions. Used by ``nobubble demo`` and ``nobubble bench
time-to-target``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nobubble.core.errors import NobubbleError


def check_segments(steps: int, segments: int, flag: str = "--rounds") -> None:
    """Refuse runs that cannot be cut into equal segments, before any run starts."""
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"{flag} must be an integer >= 1, got {segments!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2 * segments:
        raise ValueError(
            f"--steps {steps!r} must be a multiple of {flag} {segments} with at least 2 steps "
            f"per segment (the first step of each is warm-up): e.g. --steps {50 * segments}"
        )
    if steps % segments:
        raise ValueError(
            f"--steps {steps} is not a multiple of {flag} {segments}: use e.g. --steps "
            f"{steps - steps % segments}"
        )


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (none when the run has not started)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def clock(record: Mapping[str, Any]) -> float:
    """A record's training clock: wall seconds less validations and checkpoints (``train_s``;
    ``elapsed_s`` in runs written before the training clock existed)."""
    return float(record.get("train_s", record["elapsed_s"]))


def segment_figures(records: list[dict[str, Any]], start: int, end: int) -> dict[str, Any]:
    """Tokens/s over steps start+2 .. end on the training clock (the segment's first step,
    after a process start, is warm-up), and the utilization measured between the drain points
    before ``end`` (the multi-process runtime's; None for an emulated run)."""
    by_step = {r["step"]: r for r in records}
    first, last = by_step[start + 1], by_step[end]
    seconds = clock(last) - clock(first)
    return {
        "tokens_per_s": (last["tokens"] - first["tokens"]) / seconds,
        "utilization": last.get("utilization"),
        "bubble_share": last.get("bubble_share"),
    }


def check_earlier_run(run_dir: Path, flags: Sequence[str]) -> None:
    """A run folder from an earlier invocation is continued only if it has these settings."""
    from nobubble.app.train.config import TrainConfig
    from nobubble.app.train.flags import build_train_parser, config_from_args

    if not (run_dir / "config.json").exists():
        return
    wanted = config_from_args(build_train_parser().parse_args([*flags, "--out", "x"]))
    saved = TrainConfig.from_mapping(TrainConfig.load(run_dir / "config.json")["config"])
    if saved.fingerprint() != wanted.fingerprint():
        raise ValueError(
            f"{run_dir} holds a run with other settings than asked now (another --steps, "
            "--rounds, variant or version): remove it, or give another --out"
        )


def _run_segment(
    run_dir: Path, flags: Sequence[str], stop: int, steps: int, progress: bool
) -> None:
    command = [sys.executable, "-m", "nobubble", "train"]
    if (run_dir / "config.json").exists():
        command += ["--resume", str(run_dir)]  # the saved settings, from the last checkpoint
    else:
        command += [*flags, "--out", str(run_dir)]
    if stop < steps:
        command += ["--stop-at", str(stop)]
    if not progress:
        command.append("--no-progress")
    # the runs report on stderr (file descriptor 2, whatever sys.stderr is now): stdout carries
    # only the caller's own table or JSON
    if subprocess.run(command, stdout=2).returncode != 0:
        raise NobubbleError(f"the run in {run_dir} failed; see the messages above")


def run_alternating(
    out: Path,
    runs: Mapping[str, Sequence[str]],
    steps: int | Mapping[str, int],
    segments: int,
    progress: bool = True,
    rotate: int = 0,
) -> None:
    """Train every run (label -> ``nobubble train`` flags with its ``--steps``: ``steps``, or
    ``steps[label]``) under ``out/label`` in ``segments`` alternating segments; round r starts
    with the run at position ``(r + rotate) % len(runs)``. A segment finished by an earlier
    invocation is kept."""
    labels = list(runs)
    lengths = {label: steps if isinstance(steps, int) else steps[label] for label in labels}
    flags = {}
    for label in labels:  # before any run starts
        check_segments(lengths[label], segments)
        # a checkpoint where every segment ends (and, by then, wherever the flags ask too)
        every = lengths[label] // segments
        flags[label] = [
            *runs[label],
            "--steps",
            str(lengths[label]),
            "--checkpoint-every",
            str(every),
        ]
        check_earlier_run(out / label, flags[label])
    for r in range(segments):
        k = (r + rotate) % len(labels)
        for label in labels[k:] + labels[:k]:
            run_dir, every = out / label, lengths[label] // segments
            if (r + 1) * every not in {rec["step"] for rec in read_records(run_dir)}:
                _run_segment(run_dir, flags[label], (r + 1) * every, lengths[label], progress)
