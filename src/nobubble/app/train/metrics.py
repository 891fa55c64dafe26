"""One metrics stream per run: JSON lines (``metrics.jsonl``) and TensorBoard events (``tb/``)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
            except ImportError:  # tensorboard is a dependency, but keep training without it
                log.warning("tensorboard is not installed: writing metrics.jsonl only")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Keep the records up to ``last_step`` (a resumed run rewrites what came after)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= last_step
    ]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rank_memory(
    workers: Sequence[Any], rss_before_model: int | None, peak_after_model: int
) -> dict[str, Any]:
    """A rank's memory figures for its run summary: its resident set before the model was
    built, its peak once the model was built and at the end (``getrusage``), what its own
    stages hold (weights, optimizer state, the most bytes of activations held for backward, of
    weights stashed for checkpointed blocks' rebuilds; gradients take the weights' bytes), and
    the freed memory malloc keeps at the end."""
    from nobubble.core.host_memory import malloc_free_bytes, peak_rss_bytes

    params = [p for w in workers for p in w.module.parameters()]
    state = [
        t
        for w in workers
        for opt in getattr(w.optimizer, "parts", {}).values()
        for entry in opt.state.values()
        for t in entry.values()
        if hasattr(t, "element_size")
    ]
    return {
        "stages": [w.stage for w in workers],
        "rss_before_model": rss_before_model,
        "peak_after_model": peak_after_model,
        "peak_rss": peak_rss_bytes(),
        "malloc_free": malloc_free_bytes(),
        "params": sum(p.numel() for p in params),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
        "activation_bytes": max(w.peak_activation_bytes for w in workers),
        # weights copied for checkpointed blocks' rebuilds under plain paci (engine/blocks.py)
        "stash_bytes": max(w.peak_stash_bytes for w in workers),
    }
