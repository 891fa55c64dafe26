"""Host memory: keep freed tensor memory in the process instead of handing it back to the OS.

glibc's malloc serves a large block with a fresh ``mmap`` and returns the heap's free top to
the OS once it exceeds a trim threshold. Both thresholds adapt to the process's history: each
freed mmapped block raises them, up to 32 MiB and 64 MiB. Until they have risen, every
micro-batch's activations, logits and gradients (megabytes each) come back as new pages, which
the kernel zero-fills one 4 KiB fault at a time, inside the compute kernels that first touch
them. How fast a process gets there depends on what it freed before, so two processes running
the same modules at the same sizes can differ by percents (docs/benchmarks.md, "The host
allocator").

``tune_host_allocator`` sets both thresholds to those maxima from the start (the values glibc
would reach itself after seeing a 32 MiB block freed), so a training step reuses the memory of
the one before. It is process-wide; ``nobubble train`` calls it before any work. Other
allocators and platforms are left alone. ``NOBUBBLE_MALLOC=default`` turns it off;
``NOBUBBLE_MALLOC=tuned`` also tunes processes that do not by default (the torch peers of
``nobubble bench runtime``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
import time
from collections.abc import Callable

ENV = "NOBUBBLE_MALLOC"
CHOICES = ("default", "tuned")
# mallopt parameters (malloc.h) and glibc's own ceilings for their dynamic values on 64-bit
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


def allocator_setting(default: str = "tuned") -> str:
    """``NOBUBBLE_MALLOC`` (``default`` or ``tuned``), else ``default``; a clear error for any
    other value."""
    value = os.environ.get(ENV, default)
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: use one of {', '.join(CHOICES)}, or leave it unset")
    return value


def tune_host_allocator(default: str = "tuned") -> bool:
    """Fix glibc malloc's mmap and trim thresholds at their maxima (see the module doc);
    True if it did. ``default``: what to do when ``NOBUBBLE_MALLOC`` is unset."""
    if allocator_setting(default) != "tuned":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    # mallopt returns 1 on success; setting either also stops glibc's dynamic adjustment
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def rss_bytes() -> int | None:
    """This process's resident set size now (Linux ``/proc/self/statm``), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The largest resident set size this process has had (``getrusage``'s ru_maxrss: KiB on
    Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if platform.system() == "Darwin" else int(peak) * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def malloc_free_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its arenas (``mallinfo2``'s fordblks): freed memory
    kept for reuse, resident once touched; None on other C libraries."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


class PeakSampler:
    """Where a process's resident set peaks: a daemon thread reads it (``/proc/self/statm``)
    every ``interval`` seconds and keeps the largest value seen with ``label()`` at that
    moment. A diagnostic (``NOBUBBLE_PEAK_WHERE=1`` in ``nobubble train --runtime dist``,
    ``nobubble bench memory --where``): a rise shorter than the interval can be missed, so its
    peak is at most ``getrusage``'s; Linux only (elsewhere it records nothing)."""

    def __init__(self, label: Callable[[], str], interval: float = 0.0005) -> None:
        self.label, self.interval = label, interval
        self.peak, self.where = 0, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nobubble-peak", daemon=True)

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def stop(self) -> tuple[int, str]:
        """The largest resident set seen (bytes) and its label."""
        self._stop.set()
        self._thread.join()
        return self.peak, self.where

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes()
            if rss is None:
                return
            if rss > self.peak:
                self.peak, self.where = rss, self.label()
            time.sleep(self.interval)
