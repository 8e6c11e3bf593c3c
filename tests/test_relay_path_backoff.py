"""The relay client's reconnect delays: jittered, never zero after a RECONNECT notice,
and growing while sessions keep ending by RECONNECT soon after authentication."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

from p2pdist import SecretKey
from p2pdist.transport.relay_path import ReconnectBackoff, RelayConfig, RelayPath


def test_reconnect_notices_are_jittered_and_back_off() -> None:
    b = ReconnectBackoff(0.1, 10.0, random=lambda: 0.5)
    waits = [b.next_wait(lasted=0.01, retry_after=0.0) for _ in range(10)]
    # retry_after 0 is not taken at its word: the delay doubles up to the maximum
    assert waits == pytest.approx(
        [1.25 * d for d in (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)] + [12.5] * 3
    )
    # a long retry_after is honoured, and spread over [retry_after, 1.5 x retry_after)
    lo = ReconnectBackoff(0.1, 10.0, random=lambda: 0.0)
    hi = ReconnectBackoff(0.1, 10.0, random=lambda: 0.999)
    assert lo.next_wait(lasted=5.0, retry_after=2.0) == 2.0
    assert hi.next_wait(lasted=5.0, retry_after=2.0) == pytest.approx(2.999)
    # only a session that lasted 10 x the maximum after authenticating resets the delay
    assert b.next_wait(lasted=101.0, retry_after=0.0) == pytest.approx(0.125)
    assert b.next_wait(lasted=None, retry_after=None) == pytest.approx(0.1)  # failure: [0, 0.2)


def test_clients_told_to_reconnect_do_not_return_together() -> None:
    rng = itertools.count()
    spread = [
        ReconnectBackoff(0.1, 10.0, random=lambda: (next(rng) % 100) / 100).next_wait(
            lasted=30.0, retry_after=1.0
        )
        for _ in range(100)
    ]
    assert min(spread) == 1.0 and max(spread) > 1.49 and len(set(spread)) == 100


class ReconnectAtOnce(RelayPath):
    """A relay that answers every session with RECONNECT retry_after=0 at once; the
    client is closed after ``stop_after`` sessions, and its waits are recorded."""

    def __init__(self, *args: Any, stop_after: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sessions, self.stop_after = 0, stop_after
        self.waits: list[float] = []
        self.done = asyncio.Event()
        backoff = self._backoff
        real = backoff.next_wait

        def record(*, lasted: float | None, retry_after: float | None) -> float:
            wait = real(lasted=lasted, retry_after=retry_after)
            self.waits.append(wait)
            return wait

        backoff.next_wait = record  # type: ignore[method-assign]

    async def _session(self) -> float | None:
        self.sessions += 1
        if self.sessions >= self.stop_after:
            self._closed.set()  # what close() does first: no further reconnect
            self.done.set()
        self._authed_at = time.monotonic()
        return 0.0


async def test_a_relay_answering_reconnect_with_zero_is_not_hammered() -> None:
    cfg = RelayConfig(backoff_initial=0.01, backoff_max=0.04)
    path = ReconnectAtOnce(
        SecretKey.from_seed("relay backoff", 0),
        "https://127.0.0.1:9/?pin=" + str(SecretKey.from_seed("relay backoff", 1).endpoint_id),
        config=cfg,
        random=lambda: 0.0,
        stop_after=6,
    )
    path.start()
    try:
        await asyncio.wait_for(path.done.wait(), 10.0)
    finally:
        await path.close()
    # between the 6 sessions, waits of 0.01, 0.02, 0.04, 0.04, 0.04 (never 0, whatever
    # retry_after says): the relay is dialed ever more slowly, not thousands of times
    assert path.sessions == 6
    assert path.waits == pytest.approx([0.01, 0.02, 0.04, 0.04, 0.04])
