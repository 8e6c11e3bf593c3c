"""QuicTransport: the conformance suite over UDP loopback and over an in-memory relay,
mutual authentication, hostile datagrams, dead peers, flow control, and the aioquic
internals the transport relies on (each checked on its own, so an aioquic upgrade that
changes one fails here by name)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import logging
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from aioquic import tls as aioquic_tls
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection as AioQuicConnection
from aioquic.quic.connection import QuicConnectionState
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, StreamDataReceived
from aioquic.quic.packet import QuicErrorCode
from aioquic.quic.recovery import QuicPacketRecovery
from aioquic.quic.stream import QuicStream
from fake_relay import FakeRelayHub
from relay_helpers import running_relay
from transport_conformance import (
    CHECKS,
    Pair,
    PairFactory,
    bounded,
    check_a_close_that_gives_up_is_a_lost_connection_to_the_peer,
    check_close_waits_for_a_slow_reader,
    check_offender_dropped,
    closing,
    ipv6_loopback_works,
    still_serving,
    wait_for_log,
    wait_until,
)

import p2pdist.transport.quic as quic_module
import relay.inbound as relay_inbound
from p2pdist.errors import (
    ConnectionBrokenError,
    P2PTimeoutError,
    PeerAuthenticationError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from p2pdist.identity import EndpointId, SecretKey
from p2pdist.tls import TlsIdentity, make_certificate
from p2pdist.transport import TransportConfig
from p2pdist.transport.paths import RelayRoute
from p2pdist.transport.punch import PunchConfig
from p2pdist.transport.quic import QuicConnection, QuicTransport
from p2pdist.transport.quic_core import (
    AIOQUIC_LOG,
    ALPN,
    MAX_PROBE_INTERVAL,
    UNPROVEN_WINDOW,
    PinnedQuicConnection,
    QuicConfig,
    quic_configuration,
)
from p2pdist.transport.relay_path import RelayConfig as RelayPathConfig
from p2pdist.transport.relay_path import RelayPath
from p2pdist.transport.reordering import ReorderingRecovery

SEED = "quic transport tests: a shared secret"
QUIC_LOG = "p2pdist.transport"
FAST = {"keepalive_interval": 0.2, "idle_timeout": 2.0}
"""A dead UDP peer sends no reset: only the keepalive can tell, so tests keep it short."""


def key(rank: int) -> SecretKey:
    return SecretKey.from_seed(SEED, rank)


def eid(rank: int) -> EndpointId:
    return key(rank).endpoint_id


def config(**kw: Any) -> TransportConfig:
    return TransportConfig(**{**FAST, **kw})


# ---- pairs ------------------------------------------------------------------------------------


def silence(conn: QuicConnection) -> None:
    """The connection stays open but sends nothing and reads nothing any more."""
    if conn._ka_timer is not None:
        conn._ka_timer.cancel()
    conn.datagram_received = lambda data, addr: None  # type: ignore[method-assign]
    conn._route = BlackHole(conn._route)  # type: ignore[assignment]


class BlackHole:
    """A route that swallows everything (wraps the real one for its attributes)."""

    def __init__(self, route: Any) -> None:
        self.kind, self.quic_addr, self.max_datagram = route.kind, route.quic_addr, 1200
        self.remote, self.up = route.remote, True

    def send(self, datagram: bytes, addr: Any) -> None:
        pass


def kill_udp(transport: QuicTransport) -> None:
    """Close the transport's UDP sockets under it, as a dying process would."""
    for sock in [transport._udp, *transport._dial_sockets.values()]:
        if sock is not None:
            sock.close()


@contextlib.asynccontextmanager
async def connected(
    client_t: QuicTransport, server_t: QuicTransport, addr: Any, kill: Callable[[], None]
) -> AsyncIterator[Pair]:
    """Connect ``client_t`` to ``server_t`` (closing both afterwards)."""
    async with closing(client_t, server_t):
        if addr == "listen":
            addr = await server_t.listen("127.0.0.1", 0)
        client = await bounded(client_t.connect(server_t.endpoint_id, addr), "connect")
        server = await bounded(server_t.accept(), "accept")
        silence_client = functools.partial(silence, client)
        yield Pair(client, server, client_t, server_t, kill, silence_client)


@contextlib.asynccontextmanager
async def direct_pair(**cfg: Any) -> AsyncIterator[Pair]:
    conf = config(**cfg)
    client_t, server_t = QuicTransport(key(0), conf), QuicTransport(key(1), conf)
    async with connected(client_t, server_t, "listen", lambda: kill_udp(client_t)) as p:
        assert isinstance(p.client, QuicConnection) and isinstance(p.server, QuicConnection)
        assert p.client.path_kind == p.server.path_kind == "direct"
        yield p


NO_PUNCH = PunchConfig(enabled=False)


@contextlib.asynccontextmanager
async def relay_pair(**cfg: Any) -> AsyncIterator[Pair]:
    """A pair through the in-memory relay that stays there (hole punching off)."""
    conf = config(**cfg)
    hub = FakeRelayHub()
    client_t = QuicTransport(key(0), conf, relay=hub.attach(eid(0)), punch=NO_PUNCH)
    server_t = QuicTransport(key(1), conf, relay=hub.attach(eid(1)), punch=NO_PUNCH)
    async with connected(client_t, server_t, None, lambda: hub.detach(eid(0))) as p:
        assert isinstance(p.client, QuicConnection) and isinstance(p.server, QuicConnection)
        assert p.client.path_kind == p.server.path_kind == "relay"
        assert p.client.remote_address == eid(1) and p.server.remote_address == eid(0)
        for t in (client_t, server_t):  # no UDP socket at all
            assert t._udp is None and not t._dial_sockets and t._punch_sock is None
        yield p


async def test_probes_keep_coming_through_an_outage_so_the_peers_recover_when_it_ends() -> None:
    """Everything between the peers is lost for 9 s while a transfer fills the window:
    only probe timeouts send. aioquic doubled their interval without bound (16 s and
    more after such an outage, and the peer's as long), so the path came back but the
    peers stayed silent past the transport's idle_timeout (a user's trial: a 20 s outage
    broke every group). Probes now repeat at most MAX_PROBE_INTERVAL apart."""
    conf = config(idle_timeout=30.0, keepalive_interval=1.0)
    hub = FakeRelayHub()
    path = hub.attach(eid(0))
    client_t = QuicTransport(key(0), conf, relay=path, punch=NO_PUNCH)
    server_t = QuicTransport(key(1), conf, relay=hub.attach(eid(1)), punch=NO_PUNCH)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []
    forward = path.send

    def send(dst: EndpointId, datagram: bytes) -> None:
        sent_at.append(loop.time())
        forward(dst, datagram)

    path.send = send  # type: ignore[method-assign]
    async with connected(client_t, server_t, None, lambda: hub.detach(eid(0))) as p:
        await p.client.send(5, b"rtt")
        await bounded(p.server.recv(5), "a first message")
        hub.dropping = True
        outage = loop.time()
        payload = bytes(8 << 20)  # more than the congestion window: only probes go out
        sending = asyncio.create_task(p.client.send(6, payload))
        await asyncio.sleep(9.0)
        hub.dropping = False
        back = loop.time()
        frame = await asyncio.wait_for(p.server.recv(6), 30)
        arrived = loop.time()
        await asyncio.wait_for(sending, 10)
    assert frame.payload.nbytes == len(payload)
    during = [t for t in sent_at if outage + 3.0 <= t <= back]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert gaps and max(gaps) <= MAX_PROBE_INTERVAL + 1.0, gaps  # + the loop's slack
    # The first probe after the outage gets an answer, then the transfer goes on.
    assert arrived - back < MAX_PROBE_INTERVAL + 10.0, arrived - back


@contextlib.asynccontextmanager
async def real_relay_pair(**cfg: Any) -> AsyncIterator[Pair]:
    """A pair through a real relay server (in process: TLS, AES-GCM records, the relay's
    framing and limits) that stays there (hole punching off); the client dies by
    leaving the relay, as its process would."""
    conf = config(**cfg)
    fast = RelayPathConfig(connect_timeout=5.0, backoff_initial=0.05, backoff_max=0.5)
    async with running_relay() as relay:
        paths = [RelayPath(key(rank), relay.url, config=fast) for rank in (0, 1)]
        gone: list[asyncio.Task[None]] = []
        try:
            await bounded(asyncio.gather(*(p.wait_connected(10) for p in paths)), "sessions")
            client_t = QuicTransport(key(0), conf, relay=paths[0], punch=NO_PUNCH)
            server_t = QuicTransport(key(1), conf, relay=paths[1], punch=NO_PUNCH)

            def kill() -> None:
                gone.append(asyncio.ensure_future(paths[0].close()))

            async with connected(client_t, server_t, None, kill) as p:
                assert isinstance(p.client, QuicConnection) and isinstance(p.server, QuicConnection)
                assert p.client.path_kind == p.server.path_kind == "relay"
                yield p
        finally:
            await bounded(asyncio.gather(*gone, *(p.close() for p in paths)), "relay paths closed")


async def test_a_relay_session_that_takes_smaller_datagrams_shrinks_relayed_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay session reconnects and the new AUTH_OK says 4000-byte datagrams (a relay
    restarted with another limit). The relay client refuses anything larger, and the
    connection built 16 KiB datagrams until it timed out: it now builds them to fit, and
    what was refused is resent. A later session's size goes back up, to at most the
    size the connection started with."""
    conf = config(idle_timeout=20.0)
    fast = RelayPathConfig(connect_timeout=5.0, backoff_initial=0.05, backoff_max=0.5)
    async with running_relay() as relay:
        paths = [RelayPath(key(rank), relay.url, config=fast) for rank in (0, 1)]
        try:
            await bounded(asyncio.gather(*(p.wait_connected(10) for p in paths)), "sessions")
            client_t = QuicTransport(key(0), conf, relay=paths[0], punch=NO_PUNCH)
            server_t = QuicTransport(key(1), conf, relay=paths[1], punch=NO_PUNCH)
            async with connected(client_t, server_t, None, lambda: None) as p:
                await p.client.send(1, bytes(1 << 20))
                assert (await bounded(p.server.recv(1), "before")).payload.nbytes == 1 << 20
                monkeypatch.setattr(relay_inbound, "MAX_DATAGRAM", 4000)
                writer = paths[0]._writer
                assert writer is not None
                writer.abort()  # the session drops; the client reconnects at once
                await wait_until(lambda: paths[0].max_datagram == 4000, "a new session")
                payload = random.randbytes(4 << 20)
                await p.client.send(2, payload)
                frame = await asyncio.wait_for(p.server.recv(2), 10)
                assert bytes(frame.payload) == payload
                route = p.client.route
                assert isinstance(route, RelayRoute) and route.max_datagram == 4000
                # A size out of range counts as 65504 (docs/protocol.md): back to 16 KiB.
                monkeypatch.setattr(relay_inbound, "MAX_DATAGRAM", 10)
                paths[0]._writer.abort()
                await wait_until(lambda: paths[0].max_datagram == 65504, "a third session")
                assert route.max_datagram == 16384
                await p.client.send(3, payload)
                assert bytes((await bounded(p.server.recv(3), "after")).payload) == payload
        finally:
            await bounded(asyncio.gather(*(p.close() for p in paths)), "relay paths closed")


def kill_punched(hub: FakeRelayHub, transport: QuicTransport) -> None:
    """The client dies: off the relay, and its punching socket closed."""
    hub.detach(transport.endpoint_id)
    if transport._punch_sock is not None:
        transport._punch_sock.close()


@contextlib.asynccontextmanager
async def punched_pair(**cfg: Any) -> AsyncIterator[Pair]:
    """A pair that met through the in-memory relay and moved to a direct UDP path."""
    conf = config(**cfg)
    hub = FakeRelayHub()
    client_t = QuicTransport(key(0), conf, relay=hub.attach(eid(0)))
    server_t = QuicTransport(key(1), conf, relay=hub.attach(eid(1)))
    kill = functools.partial(kill_punched, hub, client_t)
    async with connected(client_t, server_t, None, kill) as p:
        assert isinstance(p.client, QuicConnection) and isinstance(p.server, QuicConnection)
        client, server = p.client, p.server
        await wait_until(lambda: client.path_kind == server.path_kind == "direct", "a direct path")
        assert client.remote_address[0] == "127.0.0.1"  # type: ignore[index]
        yield p


PAIRS = {
    "direct": direct_pair,
    "relay": relay_pair,
    "real-relay": real_relay_pair,
    "punched": punched_pair,
}


@pytest.fixture(params=sorted(PAIRS))
def make_pair(request: pytest.FixtureRequest) -> PairFactory:
    return PAIRS[request.param]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
async def test_conformance(
    check: Callable[[PairFactory], Awaitable[None]], make_pair: PairFactory
) -> None:
    await check(make_pair)


async def test_close_waits_for_a_slow_reader() -> None:
    await check_close_waits_for_a_slow_reader(direct_pair)


async def test_a_close_that_gives_up_is_a_lost_connection_to_the_peer() -> None:
    err = await check_a_close_that_gives_up_is_a_lost_connection_to_the_peer(direct_pair)
    assert "closed by the peer: closed with" in str(err) and "undelivered" in str(err), err


# ---- authentication -------------------------------------------------------------------------


async def assert_still_serving(server: QuicTransport, addr: tuple[str, int]) -> None:
    """A legitimate client can still connect, and it is the next connection accepted."""
    await still_serving(server, QuicTransport(key(9), config()), addr)


@contextlib.asynccontextmanager
async def listening(rank: int = 1, **kw: Any) -> AsyncIterator[tuple[QuicTransport, Any]]:
    server = QuicTransport(key(rank), config(), **kw)
    async with closing(server):
        yield server, await server.listen()


async def test_tls13_alpn_and_cipher() -> None:
    async with direct_pair() as p:
        assert isinstance(p.client, QuicConnection) and isinstance(p.server, QuicConnection)
        assert p.client.encrypted and p.server.encrypted
        for conn in (p.client, p.server):
            ctx = conn._quic.tls
            assert ctx.alpn_negotiated == ALPN
            assert ctx.key_schedule is not None
            assert ctx.key_schedule.cipher_suite == aioquic_tls.CipherSuite.AES_128_GCM_SHA256


async def test_connect_to_wrong_identity_is_refused() -> None:
    """Dialing id A where key B listens: refused, both ids in the message."""
    async with listening(rank=1) as (server, addr):
        client = QuicTransport(key(0), config())
        async with closing(client):
            with pytest.raises(PeerAuthenticationError) as info:
                await bounded(client.connect(eid(7), addr), "connect")
            msg = str(info.value)
            assert str(eid(7)) in msg and str(eid(1)) in msg and "identity mismatch" in msg
            assert info.value.peer == f"peer {eid(7).short()}"
            assert not client._connections
        with pytest.raises(P2PTimeoutError):  # the server never accepted it
            await server.accept(timeout=0.2)
        await assert_still_serving(server, addr)


async def test_accept_from_refuses_unlisted_client(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=QUIC_LOG)  # the accept policy's refusals: INFO
    allowed = {eid(9)}
    async with listening(accept_from=allowed.__contains__) as (server, addr):
        intruder = QuicTransport(key(0), config())
        async with closing(intruder):
            with pytest.raises(PeerAuthenticationError, match="not allowed") as info:
                await bounded(intruder.connect(server.endpoint_id, addr), "connect")
            assert str(eid(0)) in str(info.value) and "refused us" in str(info.value)
        await wait_for_log(caplog, "refused incoming connection", eid(0).short())
        await assert_still_serving(server, addr)


async def test_an_accept_policy_that_raises_refuses_at_once() -> None:
    """An exception in the application's accept_from refuses that dialer (it used to
    escape into the datagram handler and leave the dialer waiting for its timeout)."""

    def broken(peer: EndpointId) -> bool:
        raise RuntimeError("policy db down")

    async with listening(accept_from=broken) as (server, addr):
        for attempt in range(2):  # and the listener goes on answering
            dialer = QuicTransport(key(2 * attempt), config(handshake_timeout=30.0))
            async with closing(dialer):
                with pytest.raises(PeerAuthenticationError, match="accept policy failed") as info:
                    await asyncio.wait_for(dialer.connect(server.endpoint_id, addr), 10)
                assert "policy db down" in str(info.value)


def patched_client_tls(monkeypatch: pytest.MonkeyPatch, certificate: Any, private_key: Any) -> None:
    """Make every client connection present ``certificate`` and sign with ``private_key``."""
    real = quic_configuration

    def fake(*args: Any, **kw: Any) -> QuicConfiguration:
        cfg = real(*args, **kw)
        if cfg.is_client:
            cfg.certificate, cfg.private_key = certificate, private_key
        return cfg

    monkeypatch.setattr(quic_module, "quic_configuration", fake)


async def test_client_without_certificate_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=QUIC_LOG)
    async with listening() as (server, addr):
        client = QuicTransport(key(0), config())
        patched_client_tls(monkeypatch, None, None)
        async with closing(client):
            with pytest.raises(PeerAuthenticationError, match="presented no certificate"):
                await bounded(client.connect(server.endpoint_id, addr), "connect")
        await wait_for_log(caplog, "refused incoming connection", "no certificate")
        monkeypatch.undo()
        await assert_still_serving(server, addr)


async def test_client_with_certificate_of_another_key_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The client presents key 3's (public) certificate but holds key 2: it cannot make
    the CertificateVerify signature, and the server's TLS refuses it."""
    caplog.set_level(logging.INFO, logger=QUIC_LOG)
    async with listening() as (server, addr):
        client = QuicTransport(key(2), config())
        patched_client_tls(monkeypatch, make_certificate(key(3)), key(2).private_key())
        async with closing(client):
            with pytest.raises(PeerAuthenticationError, match="TLS handshake failed"):
                await bounded(client.connect(server.endpoint_id, addr), "connect")
        await wait_for_log(caplog, "refused incoming connection", "TLS handshake failed")
        monkeypatch.undo()
        with pytest.raises(P2PTimeoutError):
            await server.accept(timeout=0.2)
        await assert_still_serving(server, addr)


async def test_relay_source_must_match_certificate() -> None:
    """Through the relay, the server requires the certificate key to be the source id
    the relay authenticated: a client whose relay session is another id is refused."""
    hub = FakeRelayHub()
    server = QuicTransport(key(1), config(), relay=hub.attach(eid(1)))
    client = QuicTransport(key(0), config(), relay=hub.attach(eid(5)))  # relay says "5"
    async with closing(client, server):
        with pytest.raises(PeerAuthenticationError, match="the relay authenticated") as info:
            await bounded(client.connect(eid(1)), "connect")
        assert str(eid(5)) in str(info.value) and str(eid(0)) in str(info.value)


async def test_relay_peer_not_connected_fails_fast() -> None:
    hub = FakeRelayHub()
    client = QuicTransport(key(0), config(handshake_timeout=60), relay=hub.attach(eid(0)))
    async with closing(client):
        with pytest.raises(ConnectionBrokenError, match="not connected to the relay") as info:
            await bounded(client.connect(eid(1)), "connect")
        assert eid(1).short() in str(info.value)


async def test_dial_socket_failure_names_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    async def refuse(*args: Any) -> Any:
        raise OSError(97, "Address family not supported by protocol")

    t = QuicTransport(key(0), config())
    async with closing(t):
        monkeypatch.setattr(quic_module.UdpSocket, "open", refuse)
        with pytest.raises(ConnectionBrokenError, match="cannot open a UDP socket") as info:
            await bounded(t.connect(eid(1), ("127.0.0.1", 9), label="rank 1"), "connect")
        assert "rank 1" in str(info.value)


async def test_misuse() -> None:
    with pytest.raises(UsageError, match="QUIC always encrypts"):
        QuicTransport(key(0), TransportConfig(tls=False))
    t = QuicTransport(key(0), config())
    async with closing(t):
        with pytest.raises(UsageError, match="no relay"):
            await t.connect(eid(1))
        await t.listen()
        with pytest.raises(UsageError, match="already listening"):
            await t.listen()
    with pytest.raises(ValueError, match="1200"):
        QuicConfig(direct_datagram=1000)


# ---- hostile datagrams ---------------------------------------------------------------------


def garbage_datagrams() -> list[bytes]:
    """Random bytes, truncated headers, and fake Initials that decrypt to nothing."""
    rnd = random.Random(5)
    out = [b"", b"\x00", b"\xff" * 5, rnd.randbytes(40), rnd.randbytes(1400)]
    # Long-header Initial, version 1, plausible connection ids, random payload, padded.
    initial = bytes([0xC3]) + (1).to_bytes(4, "big") + b"\x08" + rnd.randbytes(8) + b"\x08"
    initial += rnd.randbytes(8) + b"\x00" + b"\x44\xd0" + rnd.randbytes(1300)
    out.append(initial)
    out.append(initial[:60])  # the same, cut short
    # Short header for a connection id nobody issued.
    out.append(bytes([0x40]) + rnd.randbytes(8) + rnd.randbytes(200))
    return out


async def test_garbage_datagrams_do_not_hurt(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    async with direct_pair() as p:
        server_t = p.server_transport
        assert isinstance(server_t, QuicTransport) and server_t._udp is not None
        addr = server_t._udp.local_address
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            for _ in range(3):
                for d in garbage_datagrams():
                    raw.sendto(d, addr)
            # Also aim garbage at the existing connection's own ids, from a stranger.
            quic = p.server._quic  # type: ignore[attr-defined]
            raw.sendto(bytes([0x40]) + quic.host_cid + b"\x00" * 100, addr)
        await wait_until(lambda: server_t.garbage >= 20, "the garbage being counted")
        for src, dst in ((p.client, p.server), (p.server, p.client)):
            await src.send(3, b"unaffected")
            assert bytes((await bounded(dst.recv(3), "recv")).payload) == b"unaffected"
        assert not server_t._handshaking  # nothing half-open was kept for the fake Initials
        assert len(server_t._connections) == 1
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors
        await assert_still_serving(server_t, addr)


async def test_relayed_garbage_and_a_strangers_packets_are_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Through the relay, garbage (an empty datagram too) and a short-header packet that
    names the live connection's id but comes from another endpoint id are counted as
    garbage: the connection never sees them, nothing is logged as an error."""
    caplog.set_level(logging.ERROR)
    async with relay_pair() as p:
        server_t = p.server_transport
        assert isinstance(server_t, QuicTransport) and server_t._relay is not None
        quic = p.server._quic  # type: ignore[attr-defined]
        stranger = bytes([0x40]) + quic.host_cid + b"\x00" * 100
        deliver = server_t._on_relay_datagram
        for d in [*garbage_datagrams(), stranger]:
            deliver(eid(7), d)
        assert server_t.garbage == len(garbage_datagrams()) + 1
        for src, dst in ((p.client, p.server), (p.server, p.client)):
            await src.send(3, b"unaffected")
            assert bytes((await bounded(dst.recv(3), "recv")).payload) == b"unaffected"
        assert len(server_t._connections) == 1
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors


async def test_unexpected_stream_is_a_protocol_error() -> None:
    """A peer that opens a second QUIC stream breaks the protocol (it may open none but
    stream 0): that connection ends with RemoteProtocolError naming it, the peer learns
    why."""
    async with direct_pair() as p:
        client = p.client
        assert isinstance(client, QuicConnection)
        client._quic._remote_max_streams_bidi = 2  # ignore the one stream we were given
        client._quic.write(4, b"x")
        client._schedule_transmit()
        with pytest.raises(RemoteProtocolError, match="Too many streams open") as info:
            await bounded(p.server.recv(1), "the protocol error")
        assert eid(0).short() in str(info.value)
        with pytest.raises(ConnectionBrokenError, match="Too many streams open") as broken:
            await bounded(client.recv(1), "the offender learning it was dropped")
        assert eid(1).short() in str(broken.value)


async def test_malformed_frame_closes_only_that_connection() -> None:
    async with direct_pair() as p:
        bystander_t = QuicTransport(key(2), config())
        async with closing(bystander_t):
            server_t = p.server_transport
            assert isinstance(server_t, QuicTransport) and server_t._udp is not None
            addr = server_t._udp.local_address
            bystander = await bounded(bystander_t.connect(eid(1), addr), "second connect")
            bystander_srv = await bounded(server_t.accept(), "second accept")
            assert isinstance(p.client, QuicConnection)
            p.client._write(b"\x09" + b"\x00" * 31)  # frame version 9
            await check_offender_dropped(p, (bystander, bystander_srv), "version 9")


async def test_a_failure_while_handling_received_frames_closes_only_that_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception from handling decoded frames (e.g. a PONG write on a stream the peer
    reset) closes the connection naming the peer; it used to escape the receive path."""
    async with direct_pair() as p:
        assert isinstance(p.server, QuicConnection)

        def broken(frames: object) -> None:
            raise RuntimeError("Cannot send data after the stream was reset")

        monkeypatch.setattr(p.server, "_on_frames", broken)
        loop = asyncio.get_running_loop()
        escaped: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, ctx: escaped.append(ctx))
        try:
            await p.client.send(5, b"hello")
            with pytest.raises(RemoteProtocolError, match="could not process received data"):
                await bounded(p.server.recv(5), "the failure")
        finally:
            loop.set_exception_handler(None)
        assert not escaped


# ---- dead peers, flow control -------------------------------------------------------------------


async def test_peer_whose_socket_closed_is_detected() -> None:
    """Close the peer's UDP socket (no goodbye, no CONNECTION_CLOSE): the survivor's
    pending recv fails within the keepalive idle timeout, naming it."""
    async with direct_pair(keepalive_interval=0.05, idle_timeout=0.5) as p:
        pending = asyncio.create_task(p.server.recv(1))
        await asyncio.sleep(0)
        p.kill_client()
        with pytest.raises(ConnectionBrokenError, match="keepalive timeout") as info:
            await bounded(pending, "noticing the dead peer")
        assert eid(0).short() in str(info.value)


@pytest.mark.parametrize("server_host", ["127.0.0.1", "::"])
async def test_a_peer_dialed_at_its_ipv4_mapped_address_is_reached(server_host: str) -> None:
    """``[::ffff:127.0.0.1]:port`` names an IPv4 peer: the dial goes out as IPv4 and the
    peer's answers (which our sockets report as 127.0.0.1) reach the connection. A
    listener on ``::`` (dual-stack) serves IPv4 dialers, and its own dials to IPv4
    peers leave from that one socket."""
    if server_host == "::" and not ipv6_loopback_works():
        pytest.skip("no IPv6 on this host")
    conf = config()
    client_t, server_t = QuicTransport(key(0), conf), QuicTransport(key(1), conf)
    async with closing(client_t, server_t):
        _, port = await server_t.listen(server_host, 0)
        dial = client_t.connect(eid(1), f"[::ffff:127.0.0.1]:{port}")
        client = await bounded(dial, "connect")
        server = await bounded(server_t.accept(), "accept")
        for src, dst in ((client, server), (server, client)):
            await src.send(3, b"both ways")
            assert bytes((await bounded(dst.recv(3), "recv")).payload) == b"both ways"
        assert client.remote_address == ("127.0.0.1", port)
        assert server.remote_address[0] == "127.0.0.1"  # type: ignore[index]
        if server_host == "::":
            back_t = QuicTransport(key(2), conf)
            async with closing(back_t):
                _, back_port = await back_t.listen("127.0.0.1", 0)
                out = await bounded(server_t.connect(eid(2), ("127.0.0.1", back_port)), "dial")
                await bounded(back_t.accept(), "accept")
                assert server_t._dial_sockets == {}  # the dual-stack listener carried it
                assert out.remote_address == ("127.0.0.1", back_port)


async def test_backpressure_stops_the_sender_and_is_not_death() -> None:
    """A receiver that does not consume stops granting flow-control credit: the sender's
    send() waits instead of filling memory, and the pause is not taken for a dead peer."""
    cfg = {"keepalive_interval": 0.05, "idle_timeout": 0.3, "max_buffered": 1 << 20}
    quic = QuicConfig(stream_window=256 << 10, connection_window=1 << 20)
    conf = config(**cfg, write_buffer_high=512 << 10)
    client_t = QuicTransport(key(0), conf, quic=quic)
    server_t = QuicTransport(key(1), conf, quic=quic)
    async with closing(client_t, server_t):
        addr = await server_t.listen()
        client = await bounded(client_t.connect(eid(1), addr), "connect")
        server = await bounded(server_t.accept(), "accept")
        sent = 0

        async def sender() -> None:
            nonlocal sent
            for i in range(32):
                await client.send(1, bytes(256 << 10), seq=i)
                sent += 1

        task = asyncio.create_task(sender())
        try:
            await asyncio.sleep(1.0)  # the application is busy; both peers are alive
            assert not task.done()  # 8 MiB cannot fit in 1 MiB + window + send buffer
            assert server._mailbox.buffered <= (1 << 20) + (768 << 10)
            for i in range(32):
                assert (await bounded(server.recv(1), "recv")).seq == i
            await bounded(task, "the sender finishing")
            assert not client.closed and not server.closed
        finally:
            task.cancel()


# ---- the aioquic internals we rely on (sans-I/O: time is passed in) --------------------------


ADDR = ("192.0.2.1", 4433)


def pump(a: AioQuicConnection, b: AioQuicConnection, now: float) -> None:
    """Move datagrams between two in-memory QUIC connections until both are quiet."""
    for _ in range(200):
        moved = False
        for src, dst in ((a, b), (b, a)):
            for data, _ in src.datagrams_to_send(now=now):
                dst.receive_datagram(data, ADDR, now=now)
                moved = True
        if not moved:
            return
    raise AssertionError("the connections never went quiet")


def sans_io_pair(
    server_cls: type[AioQuicConnection] = PinnedQuicConnection, *, admit: bool = True
) -> tuple[Any, Any]:
    """A handshaken client (PinnedQuicConnection) and server (``server_cls``), in memory;
    with ``admit``, both admitted, as the glue admits a peer whose certificate checks out."""
    qc = QuicConfig(stream_window=128 << 10, connection_window=1 << 20)

    def cfg(rank: int, client: bool) -> QuicConfiguration:
        k = key(rank)
        return quic_configuration(
            k,
            make_certificate(k),
            qc,
            is_client=client,
            max_datagram=1400,
            idle_timeout=60,
            congestion_control="reno",
        )

    client = PinnedQuicConnection(configuration=cfg(0, True), stream_window=qc.stream_window)
    client.connect(ADDR, now=0.0)
    odcid = client.original_destination_connection_id
    server: Any
    if server_cls is PinnedQuicConnection:
        server = PinnedQuicConnection(
            configuration=cfg(1, False),
            stream_window=qc.stream_window,
            original_destination_connection_id=odcid,
        )
    else:
        server = server_cls(configuration=cfg(1, False), original_destination_connection_id=odcid)
    pump(client, server, 0.0)
    for conn in (client, server) if admit else ():
        if isinstance(conn, PinnedQuicConnection):
            conn.admit()
    return client, server


def test_aioquic_internals_exist() -> None:
    """The private names PinnedQuicConnection uses (quic_core.py docstring)."""
    ctx = aioquic_tls.Context(is_client=False)
    assert ctx._request_client_certificate is False
    assert ctx._peer_certificate is None
    for name in ("_initialize", "_write_stream_limits", "_on_max_stream_data_delivery"):
        assert callable(getattr(AioQuicConnection, name))
    stream = QuicStream(stream_id=0, max_stream_data_local=10, max_stream_data_remote=10)
    assert stream.max_stream_data_local_sent == 10
    assert stream.receiver.starting_offset() == 0
    assert stream.sender.highest_offset == 0 and stream.sender.is_finished is False
    assert QuicConnectionState.DRAINING and QuicConnectionState.FIRSTFLIGHT
    # ReorderingRecovery: made with the arguments aioquic's QuicConnection passes its own
    # recovery (the connection replaces that one), and overriding methods it calls.
    made = inspect.signature(QuicPacketRecovery.__init__).parameters
    assert set(made) == {
        "self",
        "congestion_control_algorithm",
        "initial_rtt",
        "max_datagram_size",
        "peer_completed_address_validation",
        "send_probe",
        "logger",
        "quic_logger",
    }
    for name in ("_detect_loss", "_on_packets_lost", "_in_persistent_congestion"):
        assert callable(getattr(QuicPacketRecovery, name))
    for name, params in (
        ("on_ack_received", {"self", "ack_rangeset", "ack_delay", "now", "space"}),
        ("discard_space", {"self", "space"}),
        ("_detect_loss", {"self", "now", "space"}),
    ):
        assert set(inspect.signature(getattr(QuicPacketRecovery, name)).parameters) == params
    assert "congestion_event" in inspect.signature(QuicPacketRecovery._on_packets_lost).parameters
    client, _ = sans_io_pair()
    assert type(client._loss) is ReorderingRecovery


def test_a_peer_can_open_no_stream_but_stream_0() -> None:
    """Stream 0 is the only one: a frame on any other stream ends the connection at once
    (aioquic would store data past a gap on each of 256 streams, padding the gap with real
    memory: a few bytes at offset window-1 would pin the whole window each)."""
    client, server = sans_io_pair()
    assert server._local_max_streams_bidi.value == 1 and server._local_max_streams_uni.value == 0
    assert client._local_max_streams_bidi.value == 0 and client._local_max_streams_uni.value == 0
    client._remote_max_streams_bidi = 1000  # a peer that ignores what we advertised
    stream = client._get_or_create_stream_for_send(4)
    stream.sender._buffer_start = stream.sender._buffer_stop = (128 << 10) - 1
    client.send_stream_data(4, b"x")
    pump(client, server, 1.0)
    ending = server._close_event  # what the connection is closing with (aioquic's)
    assert isinstance(ending, ConnectionTerminated), ending
    assert ending.error_code == QuicErrorCode.STREAM_LIMIT_ERROR, ending
    assert 4 not in server._streams or not server._streams[4].receiver._buffer


def test_a_peer_not_yet_admitted_may_send_only_a_small_window() -> None:
    """Until the glue admits the peer (its certificate checked), stream 0 takes data no
    further than UNPROVEN_WINDOW ahead: a stranger that writes past a gap with its
    Finished pins that much, not a whole window (aioquic pads the gap with memory).
    Admitted peers get the whole window as it slides (test_receive_window_slides...)."""
    client, server = sans_io_pair(admit=False)
    stream = client._get_or_create_stream_for_send(0)
    stream.max_stream_data_remote = 1 << 20  # a peer that ignores the credit it was given
    stream.sender._buffer_start = stream.sender._buffer_stop = UNPROVEN_WINDOW + 1000
    client.send_stream_data(0, b"x")
    pump(client, server, 1.0)
    ending = server._close_event
    assert isinstance(ending, ConnectionTerminated), ending
    assert ending.error_code == QuicErrorCode.FLOW_CONTROL_ERROR, ending
    assert server.stream_window == UNPROVEN_WINDOW
    server.admit()
    assert server.stream_window == 128 << 10


def test_aioquic_connection_log_is_ours_and_never_warns(caplog: pytest.LogCaptureFixture) -> None:
    """aioquic warns of every peer protocol error (a stranger's late Initial included),
    which Python prints on stderr when nothing configured logging; the connection logs
    under p2pdist's name at INFO instead (quic_core.py docstring, item 6)."""
    assert "self._logger.warning(exc)" in inspect.getsource(AioQuicConnection.receive_datagram)
    _, server = sans_io_pair()
    with caplog.at_level(logging.DEBUG, logger=AIOQUIC_LOG.name):
        server._logger.warning("Error: 10, reason: Packet contains no CRYPTO frame")
        server._logger.error("Could not find a common protocol version")
    assert [(r.name, r.levelno) for r in caplog.records] == [(AIOQUIC_LOG.name, logging.INFO)] * 2
    assert caplog.records[0].getMessage().startswith("[")  # the connection id, as aioquic's
    assert server._loss._logger is server._logger


def test_server_requests_and_verifies_client_certificate() -> None:
    client, server = sans_io_pair()
    assert any(isinstance(e, HandshakeCompleted) for e in iter(server.next_event, None))
    assert server.peer_certificate_der() == TlsIdentity(key(0)).cert_der
    assert client.peer_certificate_der() == TlsIdentity(key(1)).cert_der
    # Without the flag (plain aioquic), the server never learns who the client is: this
    # is what the _initialize override changes.
    _, plain = sans_io_pair(AioQuicConnection)
    assert plain.tls._peer_certificate is None


def test_receive_window_slides_and_pauses() -> None:
    client, server = sans_io_pair()
    client.write(0, bytes(1 << 20))
    now = 0.0
    for _ in range(200):  # the receiver consumes everything it gets: all 1 MiB arrives
        now += 0.01
        client.handle_timer(now)
        pump(client, server, now)
    got = sum(
        len(e.data) for e in iter(server.next_event, None) if isinstance(e, StreamDataReceived)
    )
    assert got == 1 << 20 and client.unsent(0) == 0
    server.receive_paused = True
    client.write(0, bytes(1 << 20))
    for _ in range(200):
        now += 0.01
        client.handle_timer(now)
        pump(client, server, now)
    # Paused: at most one window (plus the step not yet granted) beyond the last credit.
    assert client.unsent(0) >= (1 << 20) - 2 * server.stream_window
    server.receive_paused = False
    for _ in range(400):
        now += 0.01
        client.handle_timer(now)
        pump(client, server, now)
    assert client.unsent(0) == 0 and not client.send_acked(0)  # no FIN sent yet


def test_quic_config_is_frozen_and_replaceable() -> None:
    qc = replace(QuicConfig(), stream_window=1 << 20)
    assert qc.stream_window == 1 << 20
    with pytest.raises(ValueError, match="stream_window"):
        QuicConfig(stream_window=1 << 20, connection_window=1 << 19)


async def test_the_path_rtt_is_quics_least_not_a_late_keepalive() -> None:
    """Collectives size how far their sends run ahead by ``path_rtt``: QUIC's least round
    trip on the current path, known from the handshake on, untouched by one keepalive
    answer that a peer's blocked event loop held up."""
    async with direct_pair() as p:
        assert isinstance(p.client, QuicConnection)
        p.client.stats.rtt = 1.5  # as a late PONG leaves it
        rtt = p.client.path_rtt
        assert rtt is not None and 0 < rtt < 0.05, rtt


# ---- dialing by name and at the wildcard address ---------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
async def test_dialing_the_wildcard_address_listen_returned_reaches_this_host(host: str) -> None:
    """listen("0.0.0.0") returns ("0.0.0.0", port); TCP connects to it (this host), QUIC
    timed out: the answer came from 127.0.0.1 and aioquic's client drops it."""
    if host == "::" and not ipv6_loopback_works():
        pytest.skip("no IPv6 loopback on this host")
    server, client = QuicTransport(key(1), config()), QuicTransport(key(0), config())
    async with closing(client, server):
        addr = await server.listen(host, 0)
        assert addr[0] == host
        conn = await bounded(client.connect(eid(1), addr), "connect to the wildcard address")
        accepted = await bounded(server.accept(), "accept")
        await conn.send(1, b"hi")
        assert bytes((await bounded(accepted.recv(1), "recv")).payload) == b"hi"


async def test_a_name_is_dialed_at_the_address_of_our_listening_family(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The name "localhost" resolves to ::1 first on many hosts (/etc/hosts), where the peer
    listens on 127.0.0.1: the dial went to ::1 only and timed out."""
    server, client = QuicTransport(key(1), config()), QuicTransport(key(0), config())
    async with closing(client, server):
        port = (await server.listen("127.0.0.1", 0))[1]
        await client.listen("127.0.0.1", 0)
        real = asyncio.get_running_loop().getaddrinfo

        async def v6_first(host: Any, *args: Any, **kw: Any) -> Any:
            if host != "peer.test":
                return await real(host, *args, **kw)
            six = (socket.AF_INET6, socket.SOCK_DGRAM, 17, "", ("::1", port, 0, 0))
            return [six, (socket.AF_INET, socket.SOCK_DGRAM, 17, "", ("127.0.0.1", port))]

        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", v6_first)
        conn = await bounded(client.connect(eid(1), ("peer.test", port)), "connect by name")
        assert conn.remote_address == ("127.0.0.1", port)


async def test_a_name_lookup_counts_towards_the_handshake_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DNS server that does not answer held QUIC's connect for the resolver's own
    timeouts (10 s against a 2 s handshake_timeout); TCP's connect bounds both."""
    client = QuicTransport(key(0), config(handshake_timeout=0.5))
    async with closing(client):

        async def silent_dns(*args: Any, **kw: Any) -> Any:
            await asyncio.sleep(3600)

        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", silent_dns)
        with pytest.raises(PeerTimeoutError, match=r"looking up peer\.test:4433 took over 0\.5 s"):
            await bounded(client.connect(eid(1), ("peer.test", 4433)), "connect", 5.0)


async def test_transport_close_waits_for_a_connection_its_user_is_closing() -> None:
    """The user closes a connection with 48 MiB queued, and the transport right after:
    the transport forgot the connection (its close had begun), so it did not wait for it
    and closed the UDP socket under it. The message never arrived, and the peer learnt of
    the end only at its idle_timeout."""
    sender, receiver = QuicTransport(key(0), config()), QuicTransport(key(1), config())
    async with closing(sender, receiver):
        addr = await receiver.listen("127.0.0.1", 0)
        conn = await bounded(sender.connect(eid(1), addr), "connect")
        accepted = await bounded(receiver.accept(), "accept")
        data = random.randbytes(48 << 20)
        conn.send_nowait(1, data)
        user_close = asyncio.create_task(conn.close())
        await asyncio.sleep(0)
        await bounded(sender.close(), "the transport's close")
        assert user_close.done()
        frame = await bounded(accepted.recv(1), "the message")
        assert bytes(frame.payload) == data
        with pytest.raises(ConnectionBrokenError, match="left") as info:
            await bounded(accepted.recv(1), "the end")
        assert info.value.graceful


async def test_a_connection_dialed_at_an_address_reports_its_datagrams() -> None:
    """paths() of a QUIC connection dialed at an address gave its frame counters as the
    path's datagrams (one 4 MiB frame: "1 datagram"), unlike a punched path's, which
    counts real datagrams (an audit)."""
    async with direct_pair() as p:
        await p.client.send(1, bytes(1 << 20))
        await bounded(p.server.recv(1), "1 MiB")
        client_t = p.client_transport
        assert isinstance(client_t, QuicTransport)
        (stats,) = client_t.paths()[key(1).endpoint_id].paths
        assert stats.datagrams_sent > 10 and stats.bytes_sent > 1 << 20, stats
        assert stats.datagrams_received > 0 and stats.bytes_received > 0, stats  # its ACKs
