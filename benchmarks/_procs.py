"""Helpers the benchmarks share: a local relay process, a process's CPU time, and child
processes that are waited for in short slices and never left running."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from relay_helpers import read_relay_url  # noqa: E402

RELAY_CMD = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0"]
RELAY_CMD += ["--stun-port", "0", "--log-level", "warning"]


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far (Linux /proc): the scheduler's
    nanosecond count summed over its live threads (the relay's: its loop, and executor
    threads that stay), else user + system in clock ticks (10 ms: too coarse for a short
    run, where a few ticks are a third of the figure)."""
    try:
        stats = Path(f"/proc/{pid}/task").glob("*/schedstat")
        return sum(int(stat.read_text().split()[0]) for stat in stats) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def local_relay(loop: str, workdir: Path) -> Iterator[tuple[str, int]]:
    """A ``python -m relay`` process on 127.0.0.1 running on ``loop``; yields its URL and
    process id (at most 30 s for the URL; the process is stopped on exit, bounded)."""
    log = workdir / f"relay-{loop}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [*RELAY_CMD, "--loop", loop],
            stdout=subprocess.PIPE,
            stderr=fh,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
        )
    try:
        assert proc.stdout is not None
        try:
            url = read_relay_url(proc.stdout)
        except ValueError as exc:
            raise RuntimeError(f"relay on {loop}: {exc}: {log.read_text()[-2000:]}") from None
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextlib.contextmanager
def children(grace: float) -> Iterator[list[Any]]:
    """A list for the caller to put the ``multiprocessing`` processes it starts in; on exit
    each is joined (up to ``grace`` seconds, none when the block raised) and killed if it
    is still alive."""
    procs: list[Any] = []
    ok = False
    try:
        yield procs
        ok = True
    finally:
        for p in procs:
            p.join(timeout=grace if ok else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def wait_for(q: Any, procs: list[Any], timeout: float, what: str) -> Any:
    """The next item on the queue ``q``, waited for in short slices: RuntimeError as soon
    as one of ``procs`` has died (non-zero exit status) or all have exited without it,
    TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            raise RuntimeError(f"{what}: {dead[0].name} exited with status {dead[0].exitcode}")
        if all(p.exitcode is not None for p in procs):
            try:  # what a process put before it exited is in the pipe by now
                return q.get(timeout=1)
            except queue.Empty:
                raise RuntimeError(f"{what}: every process exited without it") from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: nothing within {timeout:g} s")
