"""QuicTransport and RelayPath under faults: an accept policy that raises on the relay
path, relayed datagrams whose handler raises, connect()/listen() racing close(), a relay
refusal seen by a late waiter, and incoming handshakes over the pending limit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fake_relay import FakeRelayHub
from relay_helpers import RelayProcess
from transport_conformance import bounded, closing, wait_until

import p2pdist.transport.quic as quic_module
from p2pdist.errors import (
    ConnectionClosedError,
    P2PTimeoutError,
    PeerAuthenticationError,
)
from p2pdist.identity import EndpointId, SecretKey
from p2pdist.tls import make_certificate
from p2pdist.transport import TransportConfig
from p2pdist.transport.paths import UdpSocket
from p2pdist.transport.punch import PunchConfig
from p2pdist.transport.quic import QuicTransport
from p2pdist.transport.quic_core import PinnedQuicConnection, QuicConfig, quic_configuration
from p2pdist.transport.relay_path import RelayConfig, RelayPath, RelayState

SEED = "quic fault tests: a shared secret 0123"
NO_PUNCH = PunchConfig(enabled=False)
FAST_RELAY = RelayConfig(connect_timeout=5.0, backoff_initial=0.05, backoff_max=0.5)


def key(rank: int) -> SecretKey:
    return SecretKey.from_seed(SEED, rank)


def eid(rank: int) -> EndpointId:
    return key(rank).endpoint_id


def config(**kw: Any) -> TransportConfig:
    return TransportConfig(**{"keepalive_interval": 0.2, "idle_timeout": 2.0, **kw})


def broken_policy(peer: EndpointId) -> bool:
    raise RuntimeError("policy db down")


# ---- an accept policy that raises, on the relay path -----------------------------------------


async def test_relay_accept_policy_that_raises_refuses_the_dialer_at_once() -> None:
    """As over UDP: the dialer is refused with the policy's failure (it used to escape
    from the relayed datagram's handler, and the dialer waited out its timeout)."""
    hub = FakeRelayHub()
    server = QuicTransport(
        key(1), config(), relay=hub.attach(eid(1)), accept_from=broken_policy, punch=NO_PUNCH
    )
    async with closing(server):
        for rank in (0, 2):  # and the server goes on answering
            dialer = QuicTransport(
                key(rank), config(handshake_timeout=30.0), relay=hub.attach(eid(rank))
            )
            async with closing(dialer):
                with pytest.raises(PeerAuthenticationError, match="accept policy failed") as info:
                    await bounded(dialer.connect(eid(1)), "the refusal", 10)
                assert "policy db down" in str(info.value)
        assert server.refused_incoming == 2


async def test_relay_accept_policy_that_raises_keeps_the_relay_session(tmp_path: Path) -> None:
    """Through a real relay: the refusal leaves our relay session up (it used to end it,
    reconnect, and end it again with every Initial of the dialer)."""
    with RelayProcess(tmp_path) as relay:
        ra = RelayPath(key(0), relay.url, config=FAST_RELAY)
        rb = RelayPath(key(1), relay.url, config=FAST_RELAY)
        await bounded(asyncio.gather(ra.wait_connected(10), rb.wait_connected(10)), "sessions")
        server = QuicTransport(
            key(1), config(), relay=rb, accept_from=broken_policy, punch=NO_PUNCH
        )
        client = QuicTransport(key(0), config(handshake_timeout=30.0), relay=ra, punch=NO_PUNCH)
        async with closing(client, server):
            with pytest.raises(PeerAuthenticationError, match="accept policy failed"):
                await bounded(client.connect(eid(1)), "the refusal", 10)
            status = rb.status
            assert status.connects == 1 and status.state is RelayState.CONNECTED
            assert status.handler_errors == 0


async def test_a_relayed_datagram_whose_handler_raises_does_not_end_the_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="p2pdist.transport.relay_path")
    with RelayProcess(tmp_path) as relay:
        a = RelayPath(key(0), relay.url, config=FAST_RELAY)
        b = RelayPath(key(1), relay.url, config=FAST_RELAY)
        try:
            await bounded(asyncio.gather(a.wait_connected(10), b.wait_connected(10)), "sessions")
            got: asyncio.Queue[bytes] = asyncio.Queue()

            def handler(src: EndpointId, data: bytes) -> None:
                if data == b"boom":
                    raise RuntimeError("handler bug")
                got.put_nowait(data)

            b.on_datagram = handler
            a.send(b.endpoint_id, b"boom")
            await wait_until(lambda: b.status.handler_errors >= 1, "the handler's failure")
            for _ in range(100):  # best effort: resend until one arrives
                a.send(b.endpoint_id, b"still here")
                try:
                    assert await asyncio.wait_for(got.get(), 0.2) == b"still here"
                    break
                except TimeoutError:
                    continue
            else:
                pytest.fail("no datagram after the failing one")
            assert b.status.connects == 1 and b.status.state is RelayState.CONNECTED
            assert any("handler bug" in (r.exc_text or "") for r in caplog.records)
        finally:
            await bounded(asyncio.gather(a.close(), b.close()), "close()")


# ---- connect() / listen() racing close() -----------------------------------------------------


class Gate:
    """Holds every call of an async function until :meth:`open` (and notes the calls)."""

    def __init__(self, real: Callable[..., Awaitable[Any]]) -> None:
        self.real = real
        self.entered = asyncio.Event()
        self._open = asyncio.Event()
        self.results: list[Any] = []

    async def __call__(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        await self._open.wait()
        result = await self.real(*args, **kw)
        self.results.append(result)
        return result

    def open(self) -> None:
        self._open.set()

    async def close_during(self, t: QuicTransport, call: Awaitable[Any], what: str) -> None:
        """Run ``call`` until it enters the gate, close ``t`` there, let the call go on:
        it must raise ConnectionClosedError, what a closed transport raises."""
        task = asyncio.ensure_future(call)
        await bounded(self.entered.wait(), f"{what} entering the gate")
        await bounded(t.close(), "close()")
        self.open()
        with pytest.raises(ConnectionClosedError):
            await bounded(task, what)


async def test_connect_racing_close_opens_no_socket_and_returns_no_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() runs while connect() opens its dial socket: connect raises what a closed
    transport raises, and the socket it opened is closed (it used to return a live
    connection on the closed transport, over a socket nobody would close)."""
    server = QuicTransport(key(1), config())
    async with closing(server):
        addr = await server.listen("127.0.0.1", 0)
        client = QuicTransport(key(0), config())  # not listening: dials from a dial socket
        gate = Gate(UdpSocket.open)
        monkeypatch.setattr(quic_module.UdpSocket, "open", gate)
        await gate.close_during(client, client.connect(eid(1), addr), "connect()")
        assert [s.closed for s in gate.results] == [True]
        assert not client._connections and not client._live
        with pytest.raises(P2PTimeoutError):  # nothing reached the server
            await server.accept(timeout=0.2)


async def test_a_listening_dialer_racing_close_raises_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() runs while connect() resolves the address: ConnectionClosedError (it used
    to be ConnectionBrokenError from getsockname on the closed listening socket)."""
    server = QuicTransport(key(1), config())
    async with closing(server):
        addr = await server.listen("127.0.0.1", 0)
        client = QuicTransport(key(0), config())
        await client.listen("127.0.0.1", 0)
        loop = asyncio.get_running_loop()
        gate = Gate(loop.getaddrinfo)
        monkeypatch.setattr(loop, "getaddrinfo", gate)
        await gate.close_during(client, client.connect(eid(1), addr), "connect()")
        assert not client._connections and not client._live and not client._dial_sockets


async def test_listen_racing_close_closes_its_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    t = QuicTransport(key(0), config())
    gate = Gate(UdpSocket.open)
    monkeypatch.setattr(quic_module.UdpSocket, "open", gate)
    await gate.close_during(t, t.listen("127.0.0.1", 0), "listen()")
    assert [s.closed for s in gate.results] == [True]


# ---- a relay refusal seen by a waiter that comes later ----------------------------------------


async def test_wait_connected_reports_an_earlier_refusal_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A caller that arrives after the relay refused us learns so at once (it used to wait
    out the reconnect backoff and get P2PTimeoutError), and the log names the relay once."""
    caplog.set_level(logging.WARNING, logger="p2pdist.transport.relay_path")
    with RelayProcess(tmp_path, "--token", "secret") as relay:
        slow = RelayConfig(connect_timeout=5.0, backoff_initial=30.0, backoff_max=60.0)
        p = RelayPath(key(0), relay.url, token="wrong", config=slow, random=lambda: 0.9)
        try:
            with pytest.raises(PeerAuthenticationError, match="refused us"):
                await p.wait_connected(10)
            with pytest.raises(PeerAuthenticationError, match="refused us"):
                await p.wait_connected(5)  # the next attempt is 27 s away
        finally:
            await bounded(p.close(), "close()")
        refusals = [r.getMessage() for r in caplog.records if "refused us" in r.getMessage()]
        assert refusals and all(m.count(str(p.url)) == 1 for m in refusals), refusals


async def test_a_session_after_a_refusal_clears_it(tmp_path: Path) -> None:
    with RelayProcess(tmp_path, "--token", "secret") as relay:
        p = RelayPath(key(0), relay.url, token="wrong", config=FAST_RELAY)
        try:
            with pytest.raises(PeerAuthenticationError):
                await p.wait_connected(10)
            p._token = "secret"  # as if the relay's allowlist had been reloaded
            await wait_until(lambda: p.status.state is RelayState.CONNECTED, "a session")
            await p.wait_connected(1)
            relay.stop()
            await wait_until(lambda: p.status.state is not RelayState.CONNECTED, "the loss")
            with pytest.raises(P2PTimeoutError):  # not the refusal of long ago
                await p.wait_connected(0.3)
        finally:
            await bounded(p.close(), "close()")


# ---- incoming handshakes over the pending limit ------------------------------------------------


def client_initial(rank: int) -> bytes:
    """The first datagram of a real QUIC client (an Initial that decrypts), which then
    never answers: its handshake stays pending on the server."""
    k = key(rank)
    cfg = quic_configuration(
        k,
        make_certificate(k),
        QuicConfig(),
        is_client=True,
        max_datagram=1400,
        idle_timeout=60,
        congestion_control="reno",
    )
    conn = PinnedQuicConnection(configuration=cfg, stream_window=1 << 20)
    conn.connect(("127.0.0.1", 9), now=0.0)
    (data, _), *_ = conn.datagrams_to_send(now=0.0)
    return data


async def test_handshakes_over_the_limit_are_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="p2pdist.transport.framed")  # EndpointBase
    server = QuicTransport(
        key(1), config(handshake_timeout=30.0), quic=QuicConfig(max_pending_handshakes=1)
    )
    async with closing(server):
        addr = await server.listen("127.0.0.1", 0)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            raw.sendto(client_initial(5), addr)
            await wait_until(lambda: len(server._handshaking) == 1, "a pending handshake")
            raw.sendto(client_initial(6), addr)
            await wait_until(lambda: server.refused_handshakes == 1, "the drop counted")
            raw.sendto(client_initial(7), addr)
            await wait_until(lambda: server.refused_handshakes == 2, "the second drop")
        assert len(server._handshaking) == 1 and server.garbage == 0
        warnings = [r for r in caplog.records if "max_pending_handshakes" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


async def test_an_incoming_handshake_that_times_out_names_where_it_came_from(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As TCP does: a stranger that never finishes its handshake is named by its
    ip:port (it was "incoming peer", with nothing to go on)."""
    caplog.set_level(logging.WARNING, logger="p2pdist.transport.quic_conn")
    server = QuicTransport(key(1), config(handshake_timeout=0.3))
    async with closing(server):
        addr = await server.listen("127.0.0.1", 0)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            raw.bind(("127.0.0.1", 0))
            raw.sendto(client_initial(5), addr)
            where = f"127.0.0.1:{raw.getsockname()[1]}"
            await wait_until(
                lambda: any("handshake timed out" in r.getMessage() for r in caplog.records),
                "the handshake to time out",
            )
            await asyncio.sleep(0.3)  # anything sent at the expiry has arrived by now
            raw.setblocking(False)
            sent_back = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    sent_back += len(raw.recv(65536))
        (record,) = [r for r in caplog.records if "handshake timed out" in r.getMessage()]
        assert f"incoming {where}" in record.getMessage()
        # A source that never answered (maybe spoofed) gets at most 3x what it sent: the
        # expiry used to send a CONNECTION_CLOSE past that budget (3,770 B for 1,200).
        assert sent_back <= 3 * len(client_initial(5)), sent_back
