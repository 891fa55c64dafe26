"""The host allocator setting (nobubble.core.host_memory): freed memory stays in the process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from nobubble.core.host_memory import ENV, allocator_setting, tune_host_allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A fresh interpreter frees, as a backward frees a micro-batch's activations, 10 MB of
# 100 kB blocks (below glibc's initial 128 kB mmap threshold, so they come from the heap) and
# allocates them again, ten times; it prints the page faults of the last nine rounds.
CHURN = textwrap.dedent(
    """
    import ctypes, ctypes.util, resource, sys
    from nobubble.core.host_memory import tune_host_allocator
    print(tune_host_allocator(), file=sys.stderr)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    size, count = 100_000, 100
    def round_trip():
        blocks = [libc.malloc(size) for _ in range(count)]
        for b in blocks:
            libc.memset(b, 1, size)
        for b in reversed(blocks):
            libc.free(b)
    round_trip()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(9):
        round_trip()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(setting: str) -> int:
    env = dict(os.environ, **{ENV: setting})
    out = subprocess.run(
        [sys.executable, "-c", CHURN], env=env, capture_output=True, text=True, check=True
    )
    assert out.stderr.strip().splitlines()[-1] == str(setting == "tuned"), out.stderr
    return int(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="the setting applies to glibc's malloc only")
def test_tuned_malloc_keeps_freed_memory_that_glibcs_defaults_hand_back():
    # 9 rounds x 10 MB: glibc's defaults trim the freed top of the heap each round and fault
    # it in again (about 2,400 faults of 4 kB a round); tuned, the heap keeps it
    default, tuned = _faults("default"), _faults("tuned")
    assert default > 9 * 2000, default
    assert tuned < 500, tuned


def test_the_setting_reads_the_environment_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert allocator_setting() == "tuned"
    assert allocator_setting(default="default") == "default"
    monkeypatch.setenv(ENV, "default")
    assert tune_host_allocator() is False  # turned off: nothing changed
    monkeypatch.setenv(ENV, "jemalloc")
    with pytest.raises(ValueError, match=r"NOBUBBLE_MALLOC='jemalloc': use one of default, tuned"):
        tune_host_allocator()


def test_train_refuses_a_bad_allocator_setting_before_any_work(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, **{ENV: "fast"})
    done = subprocess.run(
        [sys.executable, "-m", "nobubble", "train", "--model", "tiny", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "NOBUBBLE_MALLOC='fast': use one of default, tuned" in done.stderr
    assert not out.exists()


def test_bench_runtime_refuses_an_unknown_allocator():
    from nobubble.app.bench.runtime import RuntimeBench

    with pytest.raises(ValueError, match="--allocator 'jemalloc': use one of as-shipped"):
        RuntimeBench(model="tiny", schedules=("1f1b",), allocator="jemalloc")


def test_the_peak_sampler_names_what_ran_at_the_largest_resident_set():
    import time

    from nobubble.core.host_memory import PeakSampler, rss_bytes

    if rss_bytes() is None:
        pytest.skip("no /proc/self/statm here")
    doing = ["before"]
    before = rss_bytes()
    sampler = PeakSampler(lambda: doing[0], interval=0.001).start()
    doing[0] = "holding 64 MiB"
    block = bytearray(64 << 20)
    block[:: 1 << 12] = b"\x01" * len(block[:: 1 << 12])  # a byte in every page: resident
    deadline = time.monotonic() + 30  # the sampler's thread may wait for a busy CPU
    while sampler.peak < before + (60 << 20) and time.monotonic() < deadline:
        time.sleep(0.01)
    doing[0] = "after"
    del block
    time.sleep(0.05)
    peak, where = sampler.stop()
    assert where == "holding 64 MiB"
    assert peak >= before + (60 << 20)
