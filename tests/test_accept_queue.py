"""The accept queue is bounded: authenticated connections that wait for accept() are
at most ``max_accept_queue``, past which a dialer is refused "accept queue full" (a
passing state, which dial_with_retry retries), and a waiting connection reads nothing
from its peer. Before, one admitted peer could park any number of connections on a
transport that does not accept, each buffering up to max_buffered (an audit: 300
connections, 20 MB)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from transport_conformance import bounded, closing

from p2pdist.errors import PeerAuthenticationError
from p2pdist.identity import SecretKey
from p2pdist.transport import QuicTransport, TcpTransport, TransportConfig
from p2pdist.transport.dial import dial_with_retry

SEED = "accept queue tests"


def key(rank: int) -> SecretKey:
    return SecretKey.from_seed(SEED, rank)


def transports(kind: str, n: int, **cfg: Any) -> list[Any]:
    config = TransportConfig(**cfg)
    make = TcpTransport if kind == "tcp" else QuicTransport
    return [make(key(r), config) for r in range(n)]


@pytest.mark.parametrize("kind", ["tcp", "quic"])
async def test_max_accept_queue_bounds_every_peer_together(kind: str) -> None:
    server, a, b = transports(kind, 3, max_accept_queue=3)
    async with closing(server, a, b):
        addr = await server.listen("127.0.0.1", 0)
        for dialer in (a, a, b):
            await bounded(dialer.connect(server.endpoint_id, addr), "dial")
        with pytest.raises(PeerAuthenticationError, match=r"3 connections \(max_accept_queue\)"):
            await bounded(b.connect(server.endpoint_id, addr), "the fourth")
        assert len(server.take_accepted()) == 3
        await bounded(b.connect(server.endpoint_id, addr), "after the queue was taken")


@pytest.mark.parametrize("kind", ["tcp", "quic"])
async def test_a_burst_of_dials_to_an_accepting_transport_all_get_through(kind: str) -> None:
    """A full queue is a passing state: 24 dials at once against a queue of 2 that the
    application drains all succeed through dial_with_retry (a review: refused at once,
    as an authentication failure, 21 of 40 QUIC dials failed)."""
    server, dialer = transports(kind, 2, max_accept_queue=2)
    async with closing(server, dialer):
        addr = await server.listen("127.0.0.1", 0)
        taken: list[Any] = []

        async def accepting() -> None:
            while True:
                taken.append(await server.accept())
                await asyncio.sleep(0.01)  # the application's own work between accepts

        loop_task = asyncio.create_task(accepting())
        try:
            dials = [
                dial_with_retry(dialer, server.endpoint_id, addr, label="server", timeout=30)
                for _ in range(24)
            ]
            conns = await bounded(asyncio.gather(*dials), "24 dials", seconds=40)
        finally:
            loop_task.cancel()
        assert len(conns) == 24
        await asyncio.sleep(0.1)
        assert len(taken) + len(server.take_accepted()) == 24


@pytest.mark.parametrize("kind", ["tcp", "quic"])
async def test_a_waiting_connection_reads_nothing_until_accepted(kind: str) -> None:
    server, dialer = transports(kind, 2)
    async with closing(server, dialer):
        addr = await server.listen("127.0.0.1", 0)
        conn = await bounded(dialer.connect(server.endpoint_id, addr), "dial")
        payload = np.random.default_rng(0).integers(0, 255, 16 << 20, np.uint8)
        sending = asyncio.create_task(conn.send(1, payload))
        await asyncio.sleep(1.0)
        waiting = server._accepted._queue._queue[0]  # (the one waiting: not handed out)
        assert waiting.stats.buffered == 0, waiting.stats
        accepted = await bounded(server.accept(), "accept")
        assert accepted is waiting
        frame = await bounded(accepted.recv(1), "the message")
        assert bytes(frame.payload) == payload.tobytes()
        await bounded(sending, "the send")
