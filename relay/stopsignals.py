"""How the relay takes SIGTERM, SIGINT and SIGHUP.

Two ways, one callback: ``LoopSignals`` puts the event loop's own handlers in for a
relay run inside someone else's process (the defaults come back when it closes);
``ProcessSignals`` serves ``p2pdist-relay``, whose process ends with the relay, and
leaves the signals ignored when it closes. It installs its handlers with
``signal.signal`` rather than through the loop because the loop cannot hand a signal
over to SIG_IGN without a gap: removing one of its handlers puts the default action back
before anything can put SIG_IGN in, and a signal in that moment killed the process
(exit 129 or 143 after a clean stop; about 1 run in 40 with the signal sent as
"stopped" was logged). Switching one Python handler for SIG_IGN is a single sigaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from collections.abc import Callable
from types import FrameType

__all__ = ["SIGNALS", "LoopSignals", "ProcessSignals"]

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

OnSignal = Callable[[signal.Signals], None]


class LoopSignals:
    """The running loop's handlers call ``on_signal``; ``close`` puts the defaults back."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_signal: OnSignal) -> None:
        self._loop = loop
        for sig in SIGNALS:
            loop.add_signal_handler(sig, functools.partial(on_signal, sig))

    def close(self) -> None:
        """Remove the handlers: each signal's default action is back."""
        for sig in SIGNALS:
            self._loop.remove_signal_handler(sig)


class ProcessSignals:
    """Process-wide handlers that pass each signal to ``on_signal`` on the loop; after
    ``close`` the signals are ignored until the process ends. Main thread only, as
    ``signal.signal`` is.

    The handler runs on the main thread, the loop's, between two bytecodes: it only
    queues ``on_signal``. A signal that arrives while the loop waits interrupts the
    wait (the kernel gives a process's signal to its main thread first), and the
    handler's wake-up ends it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_signal: OnSignal) -> None:
        self._loop: asyncio.AbstractEventLoop | None = loop
        self._on_signal = on_signal
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(self._deliver, signal.Signals(signum))

    def _deliver(self, sig: signal.Signals) -> None:
        if self._loop is not None:  # not closed since the signal came
            self._on_signal(sig)

    def close(self) -> None:
        """From now on the signals are ignored: each switch is one sigaction, with no
        moment in between where the default action could kill the process."""
        self._loop = None
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
