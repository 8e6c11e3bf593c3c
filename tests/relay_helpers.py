"""Running a real relay process for tests (``python -m relay`` on 127.0.0.1)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class RelayProcess:
    """``python -m relay`` on 127.0.0.1, any free port; logs go to a file."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = tmp / f"relay-{os.getpid()}-{id(self)}.log"
        self._log_fh = self.log.open("wb")
        cmd = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self._log_fh,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.url = self._read_url()

    def _read_url(self, timeout: float = 30.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().decode() if ready else ""
        if not line.startswith("relay url: "):
            self.proc.kill()
            raise AssertionError(f"no url line ({line!r}); log:\n{self.log.read_text()}")
        return line[len("relay url: ") :].strip()

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        """Signal, wait (bounded), and return (exit status, remaining stdout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=30)
        self._log_fh.close()
        return self.proc.returncode, out.decode()

    def __enter__(self) -> RelayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop(signal.SIGKILL)
        self._log_fh.close()
