"""Per-connection inbox: frames queued by channel, waiters, retired channels, backpressure."""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import Callable

from ..errors import PeerTimeoutError, UsageError
from ..wire.frames import Frame

__all__ = [
    "CHANNEL_OVERHEAD",
    "FRAME_OVERHEAD",
    "PAYLOAD_OVERHEAD",
    "STALLED_FACTOR",
    "Mailbox",
    "RetiredChannels",
    "split_channel",
]

SPACE_SHIFT = 48
"""Channels are ``space << 48 | counter``; counters retire roughly in order per space."""
FRAME_OVERHEAD = 256
"""Bytes charged for each queued frame on top of its meta and payload (the frame tuple,
its buffers' headers, the queue slot: about 130 bytes in CPython 3.11, rounded up), so
that frames without meta or payload still count towards ``max_buffered``."""
PAYLOAD_OVERHEAD = 320
"""Bytes charged on top for a frame with a payload of its own (a view on a buffer of its
own: about 300 bytes in CPython 3.11 as traced, rounded up): a stream of tiny frames
held twice what it was charged."""
CHANNEL_OVERHEAD = 1024
"""Bytes charged for each channel that has frames queued (its deque and dict entry:
about 780 bytes in CPython 3.11, rounded up)."""
STALLED_FACTOR = 4
"""While a sender of this end waits for its peer to read (``Mailbox(stalled=...)``),
reading pauses at this many times ``max_buffered`` (2 GiB at the default): two ranks that
each wait in a send with reading paused wait for good, and a group of many collectives
in flight at once comes there (1,300 all-reduces of 2 MiB held about 830 MiB a
connection). Not without bound: a slow peer would otherwise let every other peer's
sends pile up here."""


_COUNTER = (1 << SPACE_SHIFT) - 1


def split_channel(channel: int) -> tuple[int, int]:
    """``(space, counter)`` of a channel id: ``space << SPACE_SHIFT | counter``."""
    return channel >> SPACE_SHIFT, channel & _COUNTER


class RetiredChannels:
    """Remembers retired channels compactly: per space, the runs of consecutive retired
    counters, wherever they start.

    Memory is one run per gap between retired counters, so it stays small when channels
    retire roughly in order, from counter 0 or from any other (a rank that rejoins a
    group resumes at the survivors' collective id, not at 0).
    """

    def __init__(self) -> None:
        self._runs: dict[int, tuple[list[int], list[int]]] = {}
        """space -> (starts, ends): sorted, disjoint, non-touching runs ``[start, end)``."""

    @property
    def runs(self) -> int:
        """How many runs are remembered, over all spaces (what the memory grows with)."""
        return sum(len(starts) for starts, _ in self._runs.values())

    def retire(self, channel: int) -> None:
        """Mark ``channel`` retired."""
        space, counter = split_channel(channel)
        runs = self._runs.get(space)
        if runs is None:
            self._runs[space] = ([counter], [counter + 1])
            return
        starts, ends = runs
        if ends[-1] == counter:  # in order: the usual case
            ends[-1] = counter + 1
            return
        i = bisect.bisect_right(starts, counter)  # runs before i start at or below it
        if i and ends[i - 1] > counter:
            return  # retired already
        join_left = i > 0 and ends[i - 1] == counter
        join_right = i < len(starts) and starts[i] == counter + 1
        if join_left and join_right:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        elif join_left:
            ends[i - 1] = counter + 1
        elif join_right:
            starts[i] = counter
        else:
            starts.insert(i, counter)
            ends.insert(i, counter + 1)

    def retire_space(self, space: int) -> None:
        """Mark every channel of ``space`` retired, those to come too."""
        self._runs[space] = ([0], [_COUNTER + 1])

    def __contains__(self, channel: int) -> bool:
        space, counter = split_channel(channel)
        runs = self._runs.get(space)
        if runs is None:
            return False
        starts, ends = runs
        if counter >= ends[-1]:  # newer than every retired one: the usual case
            return False
        i = bisect.bisect_right(starts, counter)
        return i > 0 and counter < ends[i - 1]


def _charge(frame: Frame) -> int:
    """What ``frame`` counts towards ``max_buffered``: its meta and payload and
    :data:`FRAME_OVERHEAD` (and :data:`PAYLOAD_OVERHEAD` for a payload of its own), but
    not a payload received into the receiver's own place."""
    payload = 0 if frame.placed else frame.payload.nbytes
    own = PAYLOAD_OVERHEAD if payload else 0
    return len(frame.meta) + payload + own + FRAME_OVERHEAD


class Mailbox:
    """Holds received frames until a receiver asks for their channel."""

    def __init__(
        self,
        max_buffered: int,
        pause: Callable[[], None],
        resume: Callable[[], None],
        label: Callable[[], str],
        *,
        poll: Callable[[], None] | None = None,
        stalled: Callable[[], bool] | None = None,
    ) -> None:
        """``pause``/``resume``: stop and restart reading (backpressure); ``label``: the
        peer, for errors; ``poll``: delivers what has arrived and not yet been reported
        (called once by :meth:`get` before it waits); ``stalled``: whether a sender of
        this end waits for its peer to read (the limit is then :data:`STALLED_FACTOR`
        times ``max_buffered``, see :meth:`relax`)."""
        self._poll = poll
        self._stalled = stalled
        self._queues: dict[int, deque[Frame]] = {}
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._retired = RetiredChannels()
        self._error: BaseException | None = None
        self._buffered = 0
        self._max = max_buffered
        self._paused = False
        self._pause, self._resume, self._label = pause, resume, label
        self.dropped = 0

    @property
    def buffered(self) -> int:
        """Bytes held for receivers that have not asked yet: meta and payload (not a
        payload received into the receiver's own place), plus :data:`FRAME_OVERHEAD` per
        frame (and :data:`PAYLOAD_OVERHEAD` per payload of its own) and
        :data:`CHANNEL_OVERHEAD` per channel."""
        return self._buffered

    def deliver(self, frame: Frame) -> None:
        """Queue a frame (or drop it when its channel is retired)."""
        ch = frame.channel
        if ch in self._retired:
            self.dropped += 1
            return
        q = self._queues.get(ch)
        if q is None:
            q = self._queues[ch] = deque()
            self._buffered += CHANNEL_OVERHEAD
        q.append(frame)
        self._buffered += _charge(frame)
        # (The limit is max_buffered or more: past that only is it worth a look.)
        if self._buffered > self._max and not self._paused and self._buffered > self._limit():
            self._paused = True
            self._pause()
        w = self._waiters.pop(ch, None)
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def paused(self) -> bool:
        """Whether reading is paused."""
        return self._paused

    def relax(self) -> None:
        """Read on if reading is paused below the limit as it is now (a sender of this
        end has begun to wait: the limit is higher while it does)."""
        if self._paused and self._buffered <= self._limit():
            self._paused = False
            self._resume()

    def _limit(self) -> int:
        """Bytes queued at which reading pauses: ``max_buffered``; twice that while a
        receiver waits for a channel with nothing queued (its frame may be behind the
        others in the stream: pausing then would stall it for good); and
        :data:`STALLED_FACTOR` times it while a sender of this end waits for its peer to
        read (two ends each waiting in a send, each with reading paused by frames of its
        own calls that are still sending, would wait for good)."""
        if self._stalled is not None and self._stalled():
            return STALLED_FACTOR * self._max
        return 2 * self._max if self._waiters else self._max

    def fail(self, error: BaseException) -> None:
        """No more frames will come: wake every waiter with ``error`` (queued ones stay)."""
        if self._error is None:
            self._error = error
        for w in self._waiters.values():
            if not w.done():
                w.set_result(None)
        self._waiters.clear()

    def take(self, channel: int) -> Frame | None:
        """The next frame of ``channel`` if one is queued, else None (never waits; frames
        that came before a failure stay readable)."""
        q = self._queues.get(channel)
        if not q:
            return None
        frame = q.popleft()
        self._buffered -= _charge(frame)
        if not q:
            del self._queues[channel]
            self._buffered -= CHANNEL_OVERHEAD
        if self._paused and self._buffered <= self._max // 2:
            self._paused = False
            self._resume()
        return frame

    async def get(self, channel: int, timeout: float | None) -> Frame:
        """Wait (at most ``timeout`` seconds) for the next frame on ``channel``."""
        if (
            channel not in self._queues
            and self._poll is not None
            and self._error is None
            and channel not in self._waiters
        ):
            self._poll()  # it may be here, unread: no wait for the loop then
        if channel in self._queues:  # the common case of small collectives: already here
            frame = self.take(channel)
            if frame is not None:
                return frame
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if channel in self._queues:
                frame = self.take(channel)
                if frame is not None:
                    return frame
            if self._error is not None:
                raise self._error.with_traceback(None)
            if channel in self._waiters:
                raise UsageError(f"{self._label()}: two receivers on channel {channel:#x}")
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters[channel] = fut
            if self._paused and self._buffered <= self._limit():
                self._paused = False  # read on (up to the limit): our frame may be next
                self._resume()
            try:
                if deadline is None:  # no timer to arm and cancel
                    await fut
                    continue
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await fut
            except TimeoutError:
                why = f"no message on channel {channel:#x} within {timeout:g} s"
                if self._paused:  # ours may have come, behind frames nobody reads
                    why += (
                        f" (reading is paused: {self._buffered} bytes of frames for other "
                        f"channels wait unread, over the limit of {self._limit()})"
                    )
                raise PeerTimeoutError(self._label(), why) from None
            finally:
                if self._waiters.get(channel) is fut:
                    del self._waiters[channel]

    def retire(self, channel: int) -> None:
        """Drop queued frames of ``channel`` and every later one."""
        self._retired.retire(channel)
        self._drop_queued(channel)

    def retire_space(self, space: int) -> None:
        """Drop the queued and every later frame of any channel in ``space``."""
        self._retired.retire_space(space)
        for channel in [ch for ch in self._queues if split_channel(ch)[0] == space]:
            self._drop_queued(channel)

    def _drop_queued(self, channel: int) -> None:
        if channel in self._queues:
            while self.take(channel) is not None:
                self.dropped += 1
