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
import socket
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
    queues ``on_signal``. A signal taken by another thread (numpy's OpenBLAS starts
    some at import), or one that comes just before the loop starts to wait, does not
    interrupt that wait: so a wake-up fd, which the loop reads, ends it (asyncio's loop
    sets none unless it owns the handlers; uvloop's own is kept)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_signal: OnSignal) -> None:
        self._loop: asyncio.AbstractEventLoop | None = loop
        self._on_signal = on_signal
        self._wakeup = _WakeupSocket.install(loop)
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
        if self._wakeup is not None:
            self._wakeup.close()
            self._wakeup = None


class _WakeupSocket:
    """A socket pair whose write end is the process's signal wake-up fd and whose read
    end the loop watches, so a signal ends the loop's wait whichever thread took it."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        self._loop = loop
        self._read, self._write = pair

    @classmethod
    def install(cls, loop: asyncio.AbstractEventLoop) -> _WakeupSocket | None:
        """Install one, unless the loop has a wake-up fd of its own (uvloop): None."""
        pair = socket.socketpair()
        for sock in pair:
            sock.setblocking(False)
        before = signal.set_wakeup_fd(pair[1].fileno(), warn_on_full_buffer=False)
        if before != -1:
            signal.set_wakeup_fd(before)
            for sock in pair:
                sock.close()
            return None
        wakeup = cls(loop, pair)
        loop.add_reader(pair[0].fileno(), wakeup._drain)
        return wakeup

    def _drain(self) -> None:
        # Only the wake-up matters: the handlers themselves run between bytecodes.
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            while self._read.recv(4096):
                pass

    def close(self) -> None:
        """Stop being the wake-up fd, and close the pair."""
        signal.set_wakeup_fd(-1)
        self._loop.remove_reader(self._read.fileno())
        self._read.close()
        self._write.close()
