"""Small helpers with no better home."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Where a container's memory limit lives: cgroup v2, then v1 (which reports "no limit" as ~2**63).
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building millions of small tuples.

    Schedules and timelines hold no reference cycles, but the collector's generational scans
    over a growing heap would make their construction super-linear in the number of actions.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def physical_memory_bytes() -> int | None:
    """This machine's memory, or the container's limit when that is lower; None if unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total if total > 0 else None
