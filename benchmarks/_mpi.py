"""Open MPI over TCP as a reference for ``benchmarks/allreduce.py``.

``mpi_allreduce.c`` (next to this file) is compiled with ``mpicc`` into the run's work
folder and started with ``mpirun``, restricted to the TCP transport on loopback
(``--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo``: no shared memory, so
it moves bytes the way p2pdist and Gloo do). Open MPI keeps its defaults otherwise,
including polling while it waits (it yields instead when oversubscribed). It is never a
p2pdist dependency: ``apt-get install openmpi-bin libopenmpi-dev`` where benchmarks run
(scripts/test.sh does so as root, for the benchmark test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().with_name("mpi_allreduce.c")
TCP_ONLY = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]


class MpiError(RuntimeError):
    """Building or running the Open MPI reference failed."""


def missing() -> str | None:
    """Why the reference cannot run here (None when ``mpicc`` and ``mpirun`` are found)."""
    absent = [tool for tool in ("mpicc", "mpirun") if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not found (apt-get install openmpi-bin libopenmpi-dev)"
    return None


def version() -> str:
    """``Open MPI 4.1.4``, or what ``mpirun --version`` says first."""
    proc = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30)
    first = (proc.stdout or proc.stderr).strip().splitlines()
    line = first[0] if first else "unknown"
    return line.replace("mpirun (Open MPI)", "Open MPI").strip()


def build(workdir: Path) -> Path:
    """Compile the sweep program into ``workdir``; its path."""
    binary = workdir / "mpi_allreduce"
    proc = subprocess.run(
        ["mpicc", "-O2", "-o", str(binary), str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise MpiError(f"mpicc failed:\n{proc.stderr[-2000:]}")
    return binary


def sweep(
    binary: Path, world: int, plan: Iterable[tuple[int, int, int]], workdir: Path, timeout: float
) -> dict[str, Any]:
    """One sweep in ``world`` processes, per ``(bytes, warm-up calls, timed calls)`` of
    ``plan``: ``{"results": [{"bytes", "median", "slowest", "cpu"}, ...], "barrier":
    {"median", "slowest"}}`` in seconds: the medians over calls of the time from the last
    rank's start to the last rank's end and of each call's slowest rank, and the maximum
    over ranks of the CPU time per call."""
    result = workdir / f"mpi-world{world}-{time.monotonic_ns()}.json"
    specs = [f"{n}:{w}:{i}" for n, w, i in plan]
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(world), *TCP_ONLY]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    try:
        proc = subprocess.run(
            [*cmd, str(binary), str(result), *specs],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise MpiError(f"mpirun ran past {timeout:.0f} s") from None
    if proc.returncode != 0 or not result.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise MpiError(f"mpirun exit {proc.returncode}:\n" + "\n".join(tail))
    data: dict[str, Any] = json.loads(result.read_text())
    return data
