"""Run a grid of training runs: one process each, a few at a time, resumable.

Every run has a key, its readable name plus a hash of its resolved config and of the training
code (keys.py), and a directory ``OUT/runs/KEY``. A run whose ``summary.json`` exists is
finished and reused, and so is one kept in a pack in the runs folder (packs.py: it is unpacked
into its folder first); one with a checkpoint is resumed; a directory with neither (a run killed
before its first checkpoint) is started again. A changed setting or a changed training code
gives a new key, so an old run is never taken for a new one. Runs marked ``exclusive``
(wall-clock measurements) run alone, after the others.

Each run is ``nobubble train --config FILE`` in a fresh process forked from a server that has
imported torch and the trainer once (multiprocessing's forkserver): a run then starts without
the ~2.5 s a new interpreter spends importing torch and torch._dynamo, which was most of a quick
grid's time. ``ps`` shows such a run as ``multiprocessing.forkserver``. Its numbers are those of
a separate ``nobubble train`` (tests/test_experiments.py checks it bitwise). As with any
multiprocessing code, a script that calls ``run_grid`` needs ``if __name__ == "__main__":``
around it: each run's process imports the script that started the server (``nobubble
experiment`` and ``python -m`` are safe).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nobubble.app.experiments import keys, packs
from nobubble.core.errors import NobubbleError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    """One run of a grid: a readable name, its settings on top of the grid's base, and the
    labels the analysis selects it by."""

    name: str
    overrides: dict[str, Any]
    labels: dict[str, Any] = field(default_factory=dict)
    exclusive: bool = False


@dataclass
class RunOutcome:
    spec: RunSpec
    run_dir: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]


def _load(spec: RunSpec, run_dir: Path) -> RunOutcome:
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return RunOutcome(spec, run_dir, summary, [json.loads(x) for x in lines if x.strip()])


def run_key(spec: RunSpec, base: dict[str, Any], code: str | None = None) -> str:
    """The key (and folder name) of ``spec``'s run: ``NAME-HASH``, see keys.py."""
    config = keys.keyed_config(base, spec.overrides)
    return keys.run_key(spec.name, config, keys.code_version() if code is None else code)


# What the fork server imports once, so that each run's process starts with it in memory.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "nobubble.app.command",
    "nobubble.app.train.flags",
    "nobubble.app.train.trainer",
    "nobubble.app.experiments.runner",  # the child runs its code as it was when the server started
]


def _train_child(config_file: str, log_file: str, env: dict[str, str]) -> None:
    """In the forked process: ``nobubble train --config FILE``, its output in ``log_file``, with
    the caller's environment of now (the server's is that of its start).

    Ctrl-C raises KeyboardInterrupt here whatever this process inherited: ``stop_runs`` stops a
    run with SIGINT, and a grid started where SIGINT is ignored (``nohup ... &`` from a script:
    the shell ignores it for background jobs, and Python then leaves it ignored) would otherwise
    leave its runs to be killed after the grace period instead of stopping them."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env, TOKENIZERS_PARALLELISM="false")
    from nobubble.app.command import run_command, train_main

    try:
        status = run_command("train", lambda: train_main(["--config", config_file]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(status)


def train_in_child(config_file: Path, log_file: Path) -> int:
    """Run ``nobubble train --config CONFIG_FILE`` in a process of its own; its exit status.

    A killed run reports the negative signal number, as ``subprocess`` does. The run gets the
    current environment; what torch reads only when imported (``OMP_NUM_THREADS``, say) keeps
    the value it had when the first run of this process started the server.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    args = (str(config_file), str(log_file), dict(os.environ))
    child = context.Process(target=_train_child, args=args)
    with _LOCK:
        child.start()
        _LIVE.add(child)
    try:
        multiprocessing.connection.wait([child.sentinel])  # readable once it ended; reads nothing
    finally:
        # Reading a forkserver child's exit status is not thread-safe: another thread's start()
        # polls every live child, and two reads of one status leave one of them 255. Every read
        # happens under the lock.
        with _LOCK:
            child.join()
            _LIVE.discard(child)
    return int(child.exitcode if child.exitcode is not None else 1)


_LIVE: set[Any] = set()  # the runs' processes now running
_LOCK = threading.Lock()
STOP_GRACE_S = 10.0


def stop_runs() -> None:
    """Interrupt every run still going, as Ctrl-C would (a dist run's launcher then stops its
    ranks); what is left after ``STOP_GRACE_S`` is killed. Each resumes from its checkpoint."""
    with _LOCK:
        children = list(_LIVE)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    pending = {child.sentinel: child for child in children}
    while pending and (left := deadline - time.monotonic()) > 0:
        for ended in multiprocessing.connection.wait(list(pending), timeout=left):
            pending.pop(ended)
    for child in pending.values():
        child.kill()  # a signal, no read of its status (the thread that started it reads it)


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM raises SystemExit in the main thread, so a stopped grid can stop its runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_one(
    spec: RunSpec, key: str, code: str, base: dict[str, Any], runs_dir: Path
) -> RunOutcome:
    run_dir = runs_dir / key
    if (run_dir / "summary.json").exists() or packs.unpack_run(runs_dir, key):
        return _load(spec, run_dir)
    config = {**base, **spec.overrides, "progress": False}
    if (run_dir / "checkpoint" / "manifest.json").exists():
        config.update(resume=str(run_dir), out=None)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # never checkpointed: start again
        config.update(out=str(run_dir), resume=None)
    runs_dir.mkdir(parents=True, exist_ok=True)
    config_file = runs_dir / f".{key}.json"
    config_file.write_text(json.dumps(config))
    log_file = runs_dir / f"{key}.log"
    status = train_in_child(config_file, log_file)
    if status != 0:
        tail = log_file.read_text().splitlines()[-5:]
        raise NobubbleError(
            f"run {key} failed (status {status}); its log {log_file} ends with:\n" + "\n".join(tail)
        )
    config_file.unlink()
    (run_dir / "key.json").write_text(  # what the key's hash covers, for the record
        json.dumps({"config": keys.keyed_config(base, spec.overrides), "code": code}, indent=1)
    )
    # The run is finished (summary.json exists): its checkpoint only served resuming it.
    shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)
    return _load(spec, run_dir)


def run_grid(
    specs: Iterable[RunSpec],
    base: dict[str, Any],
    runs_dir: Path,
    jobs: int = 2,
    progress: bool = True,
    desc: str = "runs",
) -> dict[str, RunOutcome]:
    """Run (or reuse) every spec in ``runs_dir/KEY``; ``jobs`` at a time, exclusive ones alone.

    Experiments share one runs folder, so a run that two experiments need (same name, same
    settings, same code: same key) runs once. Outcomes are keyed by run name.
    """
    from tqdm import tqdm

    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(
            f"duplicate run names in the grid: {sorted(n for n in names if names.count(n) > 1)}"
        )
    code = keys.code_version()
    key = {s.name: run_key(s, base, code) for s in specs}
    outcomes: dict[str, RunOutcome] = {}
    shared = [s for s in specs if not s.exclusive]
    alone = [s for s in specs if s.exclusive]
    bar = tqdm(total=len(specs), desc=desc, unit="run", disable=not progress)
    t0 = time.perf_counter()
    with _sigterm_as_exit(), ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(_run_one, s, key[s.name], code, base, runs_dir) for s in shared]
        try:  # a failed run, Ctrl-C or SIGTERM: start nothing more and stop what runs
            for future in as_completed(futures):
                outcome = future.result()
                outcomes[outcome.spec.name] = outcome
                bar.set_postfix_str(outcome.spec.name)
                bar.update(1)
            for spec in alone:
                outcomes[spec.name] = _run_one(spec, key[spec.name], code, base, runs_dir)
                bar.set_postfix_str(spec.name)
                bar.update(1)
        except BaseException:
            for future in futures:
                future.cancel()
            stop_runs()
            raise
    bar.close()
    log.info("%s: %d runs ready in %.0f s", desc, len(specs), time.perf_counter() - t0)
    return outcomes
