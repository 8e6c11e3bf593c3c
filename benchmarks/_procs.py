"""Helpers the relay benchmarks share: a local relay process and a process's CPU time."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from relay_helpers import read_relay_url  # noqa: E402

RELAY_CMD = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0"]
RELAY_CMD += ["--stun-port", "0", "--log-level", "warning"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (Linux /proc)."""
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
