"""The entry point of ``p2pdist-relay`` and ``python -m relay``: it takes SIGTERM, SIGINT
and SIGHUP before anything else loads, then runs the relay (:mod:`relay.app`).

Loading the relay (numpy, cryptography, the configuration) takes a few hundred
milliseconds, and a signal in that time met its default action: a SIGHUP from a
certificate hook or ``systemctl reload`` during a restart killed the relay (exit 129,
which systemd's ``Restart=on-failure`` leaves down: an operator's trial). Now such a
signal is kept and acted on once the relay's own handlers are in: a SIGHUP reloads once
it listens, a SIGTERM or SIGINT stops it. Only the interpreter's own start, before this
module runs, is left uncovered. This module imports nothing but :mod:`signal`.
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["EarlySignals", "main"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class EarlySignals:
    """Keeps the stop and reload signals that come before the relay's handlers are in."""

    def __init__(self) -> None:
        self._taken: list[signal.Signals] = []
        self._before = {sig: signal.signal(sig, self._keep) for sig in _SIGNALS}

    def _keep(self, signum: int, frame: FrameType | None) -> None:
        self._taken.append(signal.Signals(signum))

    def release(self) -> None:
        """Put the handlers from before back where these are still in (the relay ended
        before it put its own in: a bad configuration)."""
        for sig, before in self._before.items():
            if before is not None and signal.getsignal(sig) == self._keep:
                signal.signal(sig, before)

    def take(self) -> list[signal.Signals]:
        """The signals kept so far, in order (call it once other handlers are in)."""
        taken, self._taken = self._taken, []
        return taken


def main() -> int:
    """Entry point of ``p2pdist-relay``."""
    early = EarlySignals()
    from .app import main as run_relay  # the slow part, with the signals taken

    try:
        return run_relay(early=early)
    finally:
        early.release()
