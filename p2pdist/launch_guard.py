"""Stop a launch's ranks when the launcher dies without doing so itself; and which of
the ranks' process groups are alive (for the launcher and the guard alike).

The ranks of ``p2pdist launch`` run in sessions of their own (so that each can be torn
down as a process group), so nothing stops them when the launcher is killed with
SIGKILL or by the OOM killer. The launcher therefore starts this guard (:class:`Guard`),
as ``python -I -S launch_guard.py GRACE_S`` in a session of its own, with its standard
input a pipe from the launcher, and tells it, a line each:

* ``+PGID``: a rank's process group to stop if the launcher dies;
* ``-PGID``: a group the launcher saw empty (its id may be reused: forget it);
* ``done``: the launcher has torn every group down itself.

When its input ends without ``done`` (the launcher is gone: the kernel closed the
pipe's other end), the guard sends SIGTERM to every group, waits up to ``GRACE_S``
seconds for them to empty, then sends SIGKILL to what is left, and exits.

Standard library only, and run by its path: importing the package (numpy) would cost
a second of start-up for a process that mostly waits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

__all__ = ["Guard", "Watch", "live_groups", "main", "stop_groups"]

_POLL_S = 0.05


class Watch:
    """The groups to stop, kept from the launcher's lines (sans-I/O)."""

    def __init__(self) -> None:
        self.groups: set[int] = set()
        """Process groups to stop should the launcher die."""
        self.done = False
        """Whether the launcher said it tore everything down itself."""

    def feed(self, line: bytes) -> None:
        """Take one line from the launcher (a line that means nothing is ignored)."""
        line = line.strip()
        if line == b"done":
            self.done = True
            return
        try:
            pgid = int(line[1:])
        except ValueError:
            return
        if pgid <= 1:  # killpg(0) or (1) would not mean a rank's group
            return
        if line[:1] == b"+":
            self.groups.add(pgid)
        elif line[:1] == b"-":
            self.groups.discard(pgid)


def live_groups(pgids: set[int]) -> set[int]:
    """The process groups among ``pgids`` that have a process that is not a zombie. (A
    launcher that is PID 1 or a subreaper inherits a rank's dead background children,
    and asyncio reaps only the ranks: their zombies would keep a group "alive" forever;
    so would an init slow to reap orphans the guard signalled.) A group whose leader
    runs is alive at the cost of one small read; /proc is scanned once, for all the
    others."""
    alive: set[int] = set()
    unsure: set[int] = set()
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            continue
        leader = _state_and_group(f"/proc/{pgid}/stat")
        if leader is not None and leader[0] != b"Z" and leader[1] == pgid:
            alive.add(pgid)
        else:
            unsure.add(pgid)
    if not unsure:
        return alive
    try:
        entries = [e.path for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:  # no /proc (macOS): zombies count as alive
        return alive | unsure
    for path in entries:
        member = _state_and_group(f"{path}/stat")
        if member is not None and member[1] in unsure and member[0] != b"Z":
            alive.add(member[1])
    return alive


def _state_and_group(stat_path: str) -> tuple[bytes, int] | None:
    """A process's state letter and process group from its /proc stat file (None if it
    is gone or there is no /proc)."""
    try:
        with open(stat_path, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)"
        return fields[0], int(fields[2])  # state, ppid, pgrp, ...
    except (OSError, IndexError, ValueError):
        return None


def _signal(groups: Iterable[int], sig: int) -> None:
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def stop_groups(groups: set[int], grace_s: float) -> set[int]:
    """SIGTERM to ``groups``, up to ``grace_s`` seconds for them to empty, then SIGKILL
    to what is left; return the groups that were still there for SIGKILL."""
    left = live_groups(groups)
    _signal(left, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        left = live_groups(left)
    _signal(left, signal.SIGKILL)
    return left


class Guard:
    """The launcher's side: starts the guard (this file, by path) and tells it the
    ranks' groups. Without it (it could not start, or was killed) the launch goes on;
    ``say`` tells the user so once."""

    def __init__(self, grace_s: float, say: Callable[[str], None]) -> None:
        self._say = say
        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), repr(grace_s)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's signals are for the launcher
            )
        except OSError as exc:
            say(f"cannot start the guard that stops the ranks if the launcher is killed: {exc}")
            self._proc = None

    def _tell(self, line: str) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
        except (OSError, ValueError):  # the guard is gone: go on without it
            self._say("the guard that stops the ranks if the launcher is killed has exited")
            self._end(proc)

    def watch(self, pgid: int) -> None:
        """Stop group ``pgid`` should the launcher die."""
        self._tell(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        """Group ``pgid`` is empty: its id may be reused."""
        self._tell(f"-{pgid}")

    def done(self) -> None:
        """Every group is torn down: let the guard go."""
        self._tell("done")
        if self._proc is not None:
            self._end(self._proc)

    def _end(self, proc: subprocess.Popen[bytes]) -> None:
        """Close our end and reap the guard (killed if it does not exit at once)."""
        self._proc = None
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"p2pdist launch: {message}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """Read the launcher's lines from standard input until it ends; stop the groups then,
    unless the launcher said ``done``."""
    grace_s = float(argv[1]) if len(argv) > 1 else 3.0
    # A terminal's Ctrl-C or hangup goes to the launcher, which tears down and says done.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    watch = Watch()
    for line in sys.stdin.buffer:
        watch.feed(line)
        if watch.done:
            return 0
    if watch.groups:
        _say(f"the launcher is gone (killed?); stopping {len(watch.groups)} rank group(s)")
        if stop_groups(watch.groups, grace_s):
            _say(f"rank groups still there after {grace_s:g} s; sent SIGKILL")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
