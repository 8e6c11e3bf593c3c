"""Incoming handshakes' deadline timers die with the handshake: close() (or the
handshake ending) cancels them, so they keep no connection alive."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection as AioQuicConnection
from transport_conformance import wait_until

from p2pdist.identity import SecretKey
from p2pdist.transport import TransportConfig
from p2pdist.transport.quic import QuicTransport
from p2pdist.transport.quic_core import ALPN


async def test_close_cancels_the_deadline_of_a_half_open_handshake() -> None:
    server = QuicTransport(
        SecretKey.from_seed("handshake timers", 1), TransportConfig(handshake_timeout=600.0)
    )
    host, port = await server.listen()
    try:
        # a client that sends its first Initial and then nothing (a half-open handshake)
        client = AioQuicConnection(
            configuration=QuicConfiguration(is_client=True, alpn_protocols=[ALPN])
        )
        client.connect((host, port), now=0.0)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            for data, _ in client.datagrams_to_send(now=0.0):
                raw.sendto(data, (host, port))
            await wait_until(lambda: bool(server._handshaking), "the server to start a handshake")
            conn = next(iter(server._handshaking))
            timer = server._handshaking[conn]
            ref = weakref.ref(conn)
            del conn
    finally:
        await asyncio.wait_for(server.close(), 10)
    assert timer.cancelled() and not server._handshaking
    gc.collect()
    assert ref() is None  # the 600 s timer no longer holds the connection
