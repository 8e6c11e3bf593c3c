"""Rate limits with time passed in: a token bucket, the PEER_GONE throttle, and a
once-per-interval gate for log lines."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["MAX_PEER_GONE_ENTRIES", "Every", "PeerGoneThrottle", "TokenBucket"]

MAX_PEER_GONE_ENTRIES = 64
"""Destinations one sender's PEER_GONE throttle remembers at most."""


class Every:
    """True at most once per ``interval`` seconds of ``clock``; counts the rest
    (``skipped``, which the caller resets when it reports them)."""

    def __init__(self, interval: float, clock: Callable[[], float]) -> None:
        self._interval = interval
        self._clock = clock
        self._last = -math.inf
        self.skipped = 0

    def __call__(self) -> bool:
        now = self._clock()
        if now - self._last < self._interval:
            self.skipped += 1
            return False
        self._last = now
        return True


class TokenBucket:
    """``rate`` tokens (bytes) per second, holding at most ``burst``; starts full.

    ``rate`` 0 means unlimited: it never runs short.
    """

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate < 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate >= 0 and burst > 0, got {rate}, {burst}")
        self._rate = float(rate)
        self._burst = float(burst)
        self._tokens = float(burst)
        self._stamp = now

    def charge(self, n: int, now: float) -> None:
        """Spend ``n`` tokens whether or not there are that many (the bucket may go into
        debt, repaid by the refill before anything more is allowed)."""
        if self._rate:
            self._refill(now)
            self._tokens -= n

    def level(self, now: float) -> float:
        """Tokens held at ``now`` (negative: in debt; ``burst`` when unlimited)."""
        if self._rate:
            self._refill(now)
        return self._tokens

    def seconds_until(self, level: float, now: float) -> float:
        """Seconds until the bucket holds ``level`` tokens (at most ``burst``); 0 when it
        does already, or is unlimited."""
        if not self._rate:
            return 0.0
        self._refill(now)
        return max(0.0, (min(level, self._burst) - self._tokens) / self._rate)

    def _refill(self, now: float) -> None:
        elapsed = now - self._stamp
        if elapsed > 0:
            self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
            self._stamp = now

    def full_at(self) -> float:
        """When the bucket will be full again if nothing is taken (its last refill time
        when it is full already, or unlimited)."""
        if not self._rate:
            return self._stamp
        return self._stamp + (self._burst - self._tokens) / self._rate


class PeerGoneThrottle:
    """Allows one PEER_GONE per destination per ``interval`` seconds (for one sender).

    Remembers at most ``max_entries`` destinations (a few KiB at most); when full,
    entries older than the interval are forgotten, and if none are, the oldest half goes
    (a sender cycling through random ids then gets a few extra notices, never unbounded
    memory). :meth:`prune`, called from the core's tick, forgets only stale entries so an
    idle sender holds nothing.
    """

    __slots__ = ("_interval", "_last", "_max")

    def __init__(self, interval: float = 1.0, max_entries: int = MAX_PEER_GONE_ENTRIES) -> None:
        self._interval = interval
        self._max = max_entries
        self._last: dict[bytes, float] = {}

    def allow(self, dest: bytes, now: float) -> bool:
        """True when a PEER_GONE for ``dest`` may be sent now (and records it)."""
        last = self._last.get(dest)
        if last is not None and now - last < self._interval:
            return False
        if last is None and len(self._last) >= self._max:
            self._make_room(now)
        self._last[dest] = now
        return True

    def prune(self, now: float) -> None:
        """Forget destinations whose interval is over (and only those: a throttle full
        of fresh entries keeps them all, so no duplicate PEER_GONE goes out early)."""
        if self._last:
            self._last = {k: t for k, t in self._last.items() if now - t < self._interval}

    def _make_room(self, now: float) -> None:
        """Before recording a new destination in a full throttle: forget stale entries,
        and if none are, the oldest half."""
        self.prune(now)
        if len(self._last) >= self._max:
            keep = sorted(self._last.items(), key=lambda kv: kv[1])[len(self._last) // 2 :]
            self._last = dict(keep)

    def __len__(self) -> int:
        return len(self._last)
