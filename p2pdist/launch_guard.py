"""Stop a launch's ranks when the launcher dies without doing so itself.

The ranks of ``p2pdist launch`` run in sessions of their own (so that each can be torn
down as a process group), so nothing stops them when the launcher is killed with
SIGKILL or by the OOM killer. The launcher therefore starts this guard, as
``python -I -S launch_guard.py GRACE_S`` in a session of its own, with its standard
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
import sys
import time
from collections.abc import Iterable

__all__ = ["Watch", "main", "stop_groups"]

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


def _signal(groups: Iterable[int], sig: int) -> set[int]:
    """Signal every group; return those that still exist."""
    left: set[int] = set()
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        left.add(pgid)
    return left


def stop_groups(groups: set[int], grace_s: float) -> set[int]:
    """SIGTERM to ``groups``, up to ``grace_s`` seconds for them to empty, then SIGKILL
    to what is left; return the groups that were still there for SIGKILL."""
    left = _signal(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        left = _signal(left, 0)
    return _signal(left, signal.SIGKILL)


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
