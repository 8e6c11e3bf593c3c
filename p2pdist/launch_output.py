"""The launcher's own output: its stdout and stderr, written by a thread.

``p2pdist launch`` echoes every rank's lines. Written from the event loop, a blocked
output (a paused terminal, a pipe nobody reads) blocked the loop, and the launcher could
act on no signal until the output moved. :class:`OutputWriter` writes from a thread of
its own instead, one for both streams: they are often one pipe (``2>&1 | tee log``),
where a write over PIPE_BUF is not atomic, and two writers would tear each other's lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import select
import threading
from collections.abc import Callable
from typing import BinaryIO, TextIO

__all__ = ["OutputWriter", "discard_output"]


def discard_output(out: BinaryIO | TextIO) -> None:
    """Send what is still written to ``out`` to /dev/null, quietly: its reader went away
    (a BrokenPipeError, and at exit Python's own flush would print another)."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, out.fileno())
        finally:
            os.close(null)


_Item = tuple[BinaryIO, bytes, "asyncio.Future[None] | None"]


class OutputWriter:
    """Writes to the launcher's outputs from one thread, in the order asked: the event
    loop goes on while an output is blocked. ``broken`` is called (on the loop) when an
    output's reader has gone away; what is written to that output afterwards goes
    nowhere. Made on the running loop."""

    def __init__(self, broken: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._broken = broken
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        # A daemon: one blocked in a write must not keep the launcher from exiting.
        self._thread = threading.Thread(target=self._serve, name="launch-output", daemon=True)
        self._thread.start()

    async def write(self, out: BinaryIO, data: bytes) -> None:
        """Write ``data`` to ``out``; return once it is written (or dropped)."""
        written = self._loop.create_future()
        self._queue.put((out, data, written))
        await written

    def post(self, out: BinaryIO, data: bytes) -> None:
        """Write ``data`` to ``out`` after what is queued, without waiting for it."""
        self._queue.put((out, data, None))

    def close(self, timeout: float) -> None:
        """Write what is queued, waiting up to ``timeout`` seconds; then leave the rest."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            out, data, written = item
            self._write(out, data)
            if written is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    self._loop.call_soon_threadsafe(_resolve, written)

    def _write(self, out: BinaryIO, data: bytes) -> None:
        try:
            try:
                fd = out.fileno()
            except (OSError, ValueError):  # not a file (a test's capture): its own write
                out.write(data)
                out.flush()
            else:
                _write_all(fd, data)
        except BrokenPipeError:  # `launch ... | head`: whoever read our output is gone
            discard_output(out)
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._broken)
        except (OSError, ValueError):  # the terminal hung up (EIO; SIGHUP stops the ranks)
            pass


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``, as a blocking write would: a parent may have left
    our stdout non-blocking (some CI runners do), and then a reader that lags a moment
    made the write fail with EAGAIN, and the lines were lost."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select.select([], [fd], [], 1.0)  # until there is room (or a second: again)


def _resolve(written: asyncio.Future[None]) -> None:
    if not written.done():  # (its waiter may have been cancelled)
        written.set_result(None)
