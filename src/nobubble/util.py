"""Small helpers with no better home."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
