"""TcpTransport over real loopback sockets: the conformance suite in both modes, peer
authentication, malformed input from peers, and the sans-I/O keepalive and mailbox."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import secrets
import select
import socket
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from transport_conformance import (
    CHECKS,
    Pair,
    PairFactory,
    bounded,
    check_offender_dropped,
    closing,
    feed,
    still_serving,
    wait_for_log,
    wait_until,
)

from p2pdist.errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    PeerAuthenticationError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from p2pdist.identity import EndpointId, SecretKey
from p2pdist.tls import TlsIdentity
from p2pdist.transport import TcpTransport, TransportConfig
from p2pdist.transport import tcp as tcp_module
from p2pdist.transport.keepalive import Keepalive, KeepaliveAction
from p2pdist.transport.mailbox import (
    CHANNEL_OVERHEAD,
    FRAME_OVERHEAD,
    PAYLOAD_OVERHEAD,
    Mailbox,
    RetiredChannels,
)
from p2pdist.transport.tcp import TcpConnection, parse_address
from p2pdist.wire.frames import HEADER, PEEK_BYTES, VERSION, Frame, FrameKind, encode_header
from p2pdist.wire.handshake import MAGIC, RecordReader, auth_transcript, encode_record

SEED = "tcp transport tests: a shared secret"
TCP_LOG = "p2pdist.transport.tcp"


def key(rank: int) -> SecretKey:
    return SecretKey.from_seed(SEED, rank)


def eid(rank: int) -> EndpointId:
    return key(rank).endpoint_id


# ---- the conformance suite ------------------------------------------------------------------


def silence(conn: TcpConnection) -> None:
    """Stop the connection's keepalive timer and reading: it neither sends nor answers."""
    if conn._ka_timer is not None:
        conn._ka_timer.cancel()
    assert conn._transport is not None
    conn._transport.pause_reading()


def kill(conn: TcpConnection) -> None:
    """Drop the socket without a goodbye, as a crashing process would."""
    assert conn._transport is not None
    conn._transport.abort()


@contextlib.asynccontextmanager
async def tcp_pair(tls: bool, **config: Any) -> AsyncIterator[Pair]:
    cfg = TransportConfig(tls=tls, **config)
    client_t, server_t = TcpTransport(key(0), cfg), TcpTransport(key(1), cfg)
    async with closing(client_t, server_t):
        addr = await server_t.listen("127.0.0.1", 0)
        client = await bounded(client_t.connect(server_t.endpoint_id, addr), "connect")
        server = await bounded(server_t.accept(), "accept")
        assert client.encrypted is tls and server.encrypted is tls
        yield Pair(
            client,
            server,
            client_t,
            server_t,
            kill_client=functools.partial(kill, client),
            silence_client=functools.partial(silence, client),
        )


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
async def test_conformance(
    check: Callable[[PairFactory], Awaitable[None]], make_pair: PairFactory
) -> None:
    await check(make_pair)


async def test_tls_is_tls13(make_pair: PairFactory) -> None:
    async with make_pair() as p:
        assert isinstance(p.client, TcpConnection)
        sslobj = p.client.tls_object
        if p.client.encrypted:
            assert sslobj.version() == "TLSv1.3"
        else:
            assert sslobj is None


# ---- helpers for hand-written peers ------------------------------------------------------------


def config(tls: bool, **kw: Any) -> TransportConfig:
    return TransportConfig(tls=tls, **kw)


async def open_raw(addr: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A plain TCP connection to ``addr`` for a hand-written peer."""
    return await bounded(asyncio.open_connection(*addr), "a raw TCP connect")


async def read_record(reader: asyncio.StreamReader, rr: RecordReader) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        while (rec := rr.next_record()) is None:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("EOF before a whole record")
            rr.feed(data)
        return rec

    return await bounded(go(), "a handshake record")


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the other side sends until it closes (EOF or reset both count)."""
    got = b""

    async def go() -> None:
        nonlocal got
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                got += data

    await bounded(go(), "the other side closing the connection")
    return got


def hello(
    me: SecretKey | EndpointId, want: EndpointId, *, tls: bool, cert: bytes | None = None
) -> tuple[dict[str, Any], bytes]:
    """A ClientHello record (and its nonce) claiming to be ``me``."""
    claimed = me.endpoint_id if isinstance(me, SecretKey) else me
    nonce = secrets.token_bytes(32)
    rec: dict[str, Any] = {
        "mode": "tls" if tls else "plain",
        "id": bytes(claimed),
        "want": bytes(want),
        "nonce": nonce,
    }
    if tls:
        if cert is None:  # the real certificate of ``me``: public, anyone can present it
            assert isinstance(me, SecretKey), "pass cert= when claiming a bare id"
            cert = TlsIdentity(me).cert_der
        rec["cert"] = cert
    return rec, nonce


async def assert_still_serving(server: TcpTransport, addr: tuple[str, int], tls: bool) -> None:
    """A legitimate client can still connect, and it is the next connection accepted."""
    await still_serving(server, TcpTransport(key(9), config(tls)), addr)


@contextlib.asynccontextmanager
async def listening(
    tls: bool, rank: int = 1, **kw: Any
) -> AsyncIterator[tuple[TcpTransport, tuple[str, int]]]:
    server = TcpTransport(key(rank), config(tls), **kw)
    async with closing(server):
        yield server, await server.listen()


@contextlib.asynccontextmanager
async def fake_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[tuple[str, int]]:
    """A hand-written listener; ``handler`` plays the server side of the handshake."""
    tasks: list[asyncio.Task[Any]] = []

    async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        try:
            await handler(r, w)
        except (Exception, asyncio.CancelledError):
            pass  # the dialer under test hung up on us (that is the point), or the test ended
        finally:
            if w.transport is not None:
                w.transport.abort()

    srv = await asyncio.start_server(on_client, "127.0.0.1", 0)
    try:
        host, port = srv.sockets[0].getsockname()[:2]
        yield host, port
    finally:
        srv.close()
        for t in tasks:
            t.cancel()
        await bounded(asyncio.gather(*tasks), "the fake server's handlers ending")


async def refused_by_fake_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    want: EndpointId,
    *,
    tls: bool,
) -> PeerAuthenticationError:
    """Dial ``want`` at a :func:`fake_server` running ``handler``: the dial must be refused
    and leave no connection behind. Returns the error."""
    async with fake_server(handler) as addr:
        client = TcpTransport(key(0), config(tls))
        async with closing(client):
            with pytest.raises(PeerAuthenticationError) as info:
                await bounded(client.connect(want, addr), "connect")
            assert not client._connections
    return info.value


# ---- authentication ----------------------------------------------------------------------------


async def test_connect_to_wrong_identity_is_refused(tls: bool) -> None:
    """Dialing id A at an address where key B listens: refused, both ids in the message."""
    async with listening(tls, rank=1) as (server, addr):
        client = TcpTransport(key(0), config(tls))
        async with closing(client):
            with pytest.raises(PeerAuthenticationError) as info:
                await bounded(client.connect(eid(7), addr), "connect")
            msg = str(info.value)
            assert str(eid(7)) in msg and str(eid(1)) in msg
            assert info.value.peer == f"peer {eid(7).short()}"
        await assert_still_serving(server, addr, tls)


async def test_accept_from_refuses_unlisted_client(tls: bool) -> None:
    allowed = {eid(9)}
    async with listening(tls, accept_from=allowed.__contains__) as (server, addr):
        intruder = TcpTransport(key(0), config(tls))
        async with closing(intruder):
            with pytest.raises(PeerAuthenticationError, match="not allowed") as info:
                await bounded(intruder.connect(server.endpoint_id, addr), "connect")
            assert str(eid(0)) in str(info.value)
        await assert_still_serving(server, addr, tls)


async def test_client_claiming_id_with_another_cert_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ClientHello says "I am A" but carries B's certificate: refused before TLS."""
    caplog.set_level(logging.WARNING, logger=TCP_LOG)
    async with listening(True) as (server, addr):
        rec, _ = hello(eid(2), server.endpoint_id, tls=True, cert=TlsIdentity(key(3)).cert_der)
        reader, writer = await open_raw(addr)
        try:
            writer.write(encode_record(rec, first=True))
            reply = await read_record(reader, RecordReader())
            assert reply["ok"] is False
            assert "certificate key does not match" in reply["error"]
            await read_until_closed(reader)
        finally:
            writer.close()
        await wait_for_log(caplog, "refused", eid(2).short())
        await assert_still_serving(server, addr, True)


async def test_a_huge_mode_is_refused_with_a_short_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stranger's ClientHello with an 8 KB ``mode``: quoting it made the refusal too
    large to encode, so the stranger got no answer and our log an ERROR traceback."""
    caplog.set_level(logging.WARNING, logger=TCP_LOG)
    async with listening(False) as (server, addr):
        rec, _ = hello(eid(2), server.endpoint_id, tls=False)
        rec["mode"] = [0] * 8000
        reader, writer = await open_raw(addr)
        try:
            writer.write(encode_record(rec, first=True))
            reply = await read_record(reader, RecordReader())
            assert reply["ok"] is False and "asked for ?" in reply["error"], reply
            await read_until_closed(reader)
        finally:
            writer.close()
        await wait_for_log(caplog, "refused", eid(2).short())
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        await assert_still_serving(server, addr, False)


async def test_client_claiming_id_without_its_key_fails_tls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ClientHello says "I am A" with A's (public) certificate, but the dialer only holds
    B's key: the TLS handshake cannot prove A and the server refuses the connection."""
    caplog.set_level(logging.WARNING, logger=TCP_LOG)
    async with listening(True) as (server, addr):
        rec, _ = hello(key(2), server.endpoint_id, tls=True)  # A's real certificate
        reader, writer = await open_raw(addr)
        try:
            writer.write(encode_record(rec, first=True))
            reply = await read_record(reader, RecordReader())
            assert reply["ok"] is True
            with contextlib.suppress(OSError):  # ssl.SSLError is an OSError
                # loop.start_tls, not StreamWriter.start_tls: the latter leaves a writer
                # whose __del__ fails when the peer hangs up mid-handshake (CPython 3.11).
                loop = asyncio.get_running_loop()
                await bounded(
                    loop.start_tls(
                        writer.transport,
                        writer.transport.get_protocol(),
                        TlsIdentity(key(3)).client_context(),
                    ),
                    "client TLS",
                )
                assert await read_until_closed(reader) == b""
        finally:
            writer.close()
        msg = await wait_for_log(caplog, "refused incoming connection", eid(2).short())
        assert "TLS handshake failed" in msg
        await assert_still_serving(server, addr, True)


def mangled_cert(how: str) -> bytes:
    der = bytearray(TlsIdentity(key(2)).cert_der)
    if how == "unknown-key-type":  # cryptography raises UnsupportedAlgorithm
        oid = bytes.fromhex("06032b6570")
        der[der.find(oid, der.find(oid) + 1) + 4] = 0x7F
    else:  # invalid UTF-8 in the subject: cryptography finds the key, OpenSSL refuses
        der[der.find(f"p2pdist {eid(2)}".encode()) + 5] = 0xFF
    return bytes(der)


@pytest.mark.parametrize("how", ["unknown-key-type", "bad-utf8-subject"])
async def test_client_hello_with_unusable_certificate_is_refused(how: str) -> None:
    """Certificates that cannot be used must be refused with an answer and a closed socket
    (both used to escape the handshake task and leave the socket open)."""
    async with listening(True) as (server, addr):
        rec, _ = hello(eid(2), server.endpoint_id, tls=True, cert=mangled_cert(how))
        reader, writer = await open_raw(addr)
        try:
            writer.write(encode_record(rec, first=True))
            reply = await read_record(reader, RecordReader())
            assert reply["ok"] is False and "certificate" in reply["error"]
            await read_until_closed(reader)
        finally:
            writer.close()
        await assert_still_serving(server, addr, True)


async def plain_client(
    addr: tuple[str, int],
    claimed: EndpointId,
    server_id: EndpointId,
    sign: Callable[[bytes, bytes], bytes],
    after_auth: bytes = b"",
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, RecordReader, bytes, bytes]:
    """Hand-written plaintext dialer: hello as ``claimed``, then the signature from
    ``sign(client_nonce, server_nonce)`` (plus ``after_auth`` bytes in the same write)."""
    rec, nonce = hello(claimed, server_id, tls=False)
    reader, writer = await open_raw(addr)
    writer.write(encode_record(rec, first=True))
    rr = RecordReader()
    reply = await read_record(reader, rr)
    assert reply["ok"] is True and reply["id"] == bytes(server_id)
    server_nonce = reply["nonce"]
    writer.write(encode_record({"sig": sign(nonce, server_nonce)}) + after_auth)
    return reader, writer, rr, nonce, server_nonce


async def test_plaintext_mutual_signatures_hand_written_client() -> None:
    """A dialer following the documented transcript is accepted, the server's signature
    verifies, and a frame sent in the same write as the Auth record is not lost."""
    a = key(2)
    async with listening(False) as (server, addr):
        me, them = bytes(a.endpoint_id), bytes(server.endpoint_id)
        first_frame = encode_header(FrameKind.DATA, 7, 3, b"m", 5) + b"early"
        reader, writer, rr, cn, sn = await plain_client(
            addr,
            a.endpoint_id,
            server.endpoint_id,
            lambda cn, sn: a.sign(auth_transcript(b"C", me, them, cn, sn)),
            after_auth=first_frame,
        )
        try:
            reply = await read_record(reader, rr)
            assert server.endpoint_id.verify(reply["sig"], auth_transcript(b"S", me, them, cn, sn))
            assert not server.endpoint_id.verify(
                reply["sig"], auth_transcript(b"C", me, them, cn, sn)
            )
            conn = await bounded(server.accept(), "accept")
            assert conn.peer_id == a.endpoint_id
            f = await bounded(conn.recv(7), "the early frame")
            assert (f.seq, f.meta, bytes(f.payload)) == (3, b"m", b"early")
        finally:
            writer.close()


@pytest.mark.parametrize("forgery", ["other-key", "reflected-role", "random", "swapped-nonces"])
async def test_plaintext_bad_client_signature_refused(
    forgery: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=TCP_LOG)
    a, b = key(2), key(3)
    async with listening(False) as (server, addr):
        me, them = bytes(a.endpoint_id), bytes(server.endpoint_id)

        def sign(cn: bytes, sn: bytes) -> bytes:
            if forgery == "other-key":  # claims A, holds B
                return b.sign(auth_transcript(b"C", me, them, cn, sn))
            if forgery == "reflected-role":  # A's key, but the server's role
                return a.sign(auth_transcript(b"S", me, them, cn, sn))
            if forgery == "swapped-nonces":
                return a.sign(auth_transcript(b"C", me, them, sn, cn))
            return secrets.token_bytes(64)

        reader, writer, *_ = await plain_client(addr, a.endpoint_id, server.endpoint_id, sign)
        try:
            assert await read_until_closed(reader) == b""  # no signature back
        finally:
            writer.close()
        await wait_for_log(caplog, "could not prove it holds the key", str(a.endpoint_id))
        await assert_still_serving(server, addr, False)


@pytest.mark.parametrize("forgery", ["random", "reflected-role", "other-key", "wrong-id"])
async def test_plaintext_bad_server_refused(forgery: str) -> None:
    """A listener that claims to be A but cannot sign as A is refused by the dialer."""
    a, b = key(2), key(3)
    claimed = b.endpoint_id if forgery == "wrong-id" else a.endpoint_id

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        rr = RecordReader(expect_magic=True)
        rec = await read_record(r, rr)
        sn = secrets.token_bytes(32)
        w.write(encode_record({"ok": True, "id": bytes(claimed), "nonce": sn}))
        await read_record(r, rr)
        cn, me, them = rec["nonce"], rec["id"], bytes(a.endpoint_id)
        sig = {
            "random": secrets.token_bytes(64),
            "reflected-role": a.sign(auth_transcript(b"C", me, them, cn, sn)),
            "other-key": b.sign(auth_transcript(b"S", me, them, cn, sn)),
            "wrong-id": b"\x00" * 64,
        }[forgery]
        w.write(encode_record({"sig": sig}))
        await r.read()

    err = await refused_by_fake_server(handler, a.endpoint_id, tls=False)
    if forgery == "wrong-id":
        assert str(a.endpoint_id) in str(err)
        assert str(b.endpoint_id) in str(err)
    else:
        assert "could not prove it holds the key" in str(err)


async def test_tls_server_presenting_another_cert_refused() -> None:
    """A listener that answers the hello as A but runs TLS with B's certificate."""
    a, b = key(2), key(3)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        rec = await read_record(r, RecordReader(expect_magic=True))
        w.write(encode_record({"ok": True, "id": bytes(a.endpoint_id), "nonce": bytes(32)}))
        ctx = TlsIdentity(b).server_context(rec["cert"])
        loop = asyncio.get_running_loop()
        await loop.start_tls(w.transport, w.transport.get_protocol(), ctx, server_side=True)
        await r.read()

    err = await refused_by_fake_server(handler, a.endpoint_id, tls=True)
    assert f"expected {a.endpoint_id}, presented {b.endpoint_id}" in str(err)


@pytest.mark.parametrize(("client_tls", "server_tls"), [(True, False), (False, True)])
async def test_mode_mismatch_is_a_clear_error(client_tls: bool, server_tls: bool) -> None:
    async with listening(server_tls) as (server, addr):
        client = TcpTransport(key(0), config(client_tls))
        async with closing(client):
            with pytest.raises(PeerAuthenticationError) as info:
                await bounded(client.connect(server.endpoint_id, addr), "connect")
        mine, theirs = ("tls", "plain") if client_tls else ("plain", "tls")
        assert f"runs {theirs!r}" in str(info.value)
        assert f"asked for {mine!r}" in str(info.value)
        await assert_still_serving(server, addr, server_tls)


# ---- refusing strangers and bad handshakes ------------------------------------------------------


STRANGERS = {
    "http-get": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "tls-client-hello": bytes.fromhex("160301020001") + b"\x00" * 64,
    "ssh": b"SSH-2.0-OpenSSH_9.6\r\n",
    "future-version": b"P2PD\x02" + b"\x00" * 16,
    "oversized-record": MAGIC + (1 << 20).to_bytes(4, "big") + b"\x00" * 100,
    "not-a-map": MAGIC + (1).to_bytes(4, "big") + b"\x90",  # an empty msgpack array
    "missing-fields": encode_record({"mode": "plain", "id": bytes(32)}, first=True),
    "short-id": encode_record(
        {"mode": "plain", "id": b"x", "want": bytes(32), "nonce": bytes(32)}, first=True
    ),
    "silent": b"",
}


@pytest.mark.parametrize("name", list(STRANGERS))
async def test_non_p2pdist_client_refused_and_listener_keeps_accepting(
    name: str, tls: bool
) -> None:
    cfg = config(tls, handshake_timeout=0.5)
    server = TcpTransport(key(1), cfg)
    async with closing(server):
        addr = await server.listen()
        reader, writer = await open_raw(addr)
        try:
            writer.write(STRANGERS[name])
            got = await read_until_closed(reader)
            assert got == b"", got  # refused without a reply
        finally:
            writer.close()
        await assert_still_serving(server, addr, tls)


async def test_handshake_timeout_on_silent_listener() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()  # accepts, reads, never answers

    async with fake_server(handler) as addr:
        client = TcpTransport(key(0), config(True, handshake_timeout=0.3))
        async with closing(client):
            with pytest.raises(PeerTimeoutError) as info:
                await bounded(client.connect(eid(1), addr), "connect")
            assert isinstance(info.value, TimeoutError)
            assert eid(1).short() in str(info.value)
            assert not client._connections


async def test_connect_to_closed_port_names_peer() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    client = TcpTransport(key(0), config(False))
    async with closing(client):
        with pytest.raises(ConnectionBrokenError) as info:
            await bounded(client.connect(eid(1), ("127.0.0.1", port)), "connect")
        assert eid(1).short() in str(info.value) and str(port) in str(info.value)


async def test_a_close_while_listen_looks_up_the_address_leaves_no_port_bound() -> None:
    """close() while listen() awaits its address lookup: listen() raises that the
    transport is closed, and the port is free at once (the socket it bound after the
    lookup used to stay open, and the next listener there failed "address in use")."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    transport = TcpTransport(key(0), config(False))
    listening = asyncio.create_task(transport.listen("127.0.0.1", port))
    await asyncio.sleep(0)  # listen() now awaits getaddrinfo
    await bounded(transport.close(), "close")
    with pytest.raises(ConnectionClosedError, match="transport is closed"):
        await bounded(listening, "listen")
    again = TcpTransport(key(1), config(False))
    async with closing(again):
        assert (await again.listen("127.0.0.1", port))[1] == port


async def test_unreachable_host_is_a_connect_error_not_a_handshake_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """connect() failing with ETIMEDOUT (a TimeoutError in Python 3.11) is "cannot connect
    to host:port", not "handshake took over N s": only the handshake deadline is that."""

    async def unreachable(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.ETIMEDOUT, "Connection timed out")

    monkeypatch.setattr(asyncio.get_running_loop(), "sock_connect", unreachable)
    client = TcpTransport(key(0), config(False, handshake_timeout=30.0))
    async with closing(client):
        with pytest.raises(ConnectionBrokenError) as info:
            await bounded(client.connect(eid(1), ("192.0.2.1", 4000)), "connect")
    text = str(info.value)
    assert "cannot connect to 192.0.2.1:4000" in text and "timed out" in text
    assert eid(1).short() in text and "handshake" not in text
    assert not isinstance(info.value, TimeoutError) and not client._connections


# ---- who an incoming connection is, before and after it proves it --------------------------------


def rank_label(peer: EndpointId) -> str:
    return f"rank {8 if peer == eid(9) else 2} ({peer.short()})"


async def test_a_silent_incoming_connection_is_named_by_its_address(
    caplog: pytest.LogCaptureFixture, tls: bool
) -> None:
    caplog.set_level(logging.WARNING, logger=TCP_LOG)
    server = TcpTransport(key(1), config(tls, handshake_timeout=0.3), label_for=rank_label)
    async with closing(server):
        addr = await server.listen()
        reader, writer = await open_raw(addr)
        try:
            here = "{}:{}".format(*writer.get_extra_info("sockname")[:2])
            await read_until_closed(reader)
        finally:
            writer.close()
        msg = await wait_for_log(caplog, "incoming handshake timed out")
        assert msg.startswith(f"incoming {here}: ")


async def test_an_unproven_hello_is_named_as_a_claim_from_its_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stranger says it is rank 2 but cannot prove it: the warning names where it came
    from and words rank 2 as its claim, so it does not appear to come from rank 2."""
    caplog.set_level(logging.WARNING, logger=TCP_LOG)
    async with listening(True, label_for=rank_label) as (server, addr):
        rec, _ = hello(eid(2), server.endpoint_id, tls=True, cert=TlsIdentity(key(3)).cert_der)
        reader, writer = await open_raw(addr)
        try:
            here = "{}:{}".format(*writer.get_extra_info("sockname")[:2])
            writer.write(encode_record(rec, first=True))
            assert (await read_record(reader, RecordReader()))["ok"] is False
            await read_until_closed(reader)
        finally:
            writer.close()
        msg = await wait_for_log(caplog, "refused incoming connection")
        claim = f"{here} claiming rank 2 ({eid(2).short()})"
        assert f"refused incoming connection: {claim}: refused:" in msg
        await assert_still_serving(server, addr, True)


async def test_a_claimed_id_is_no_path_until_proven() -> None:
    """A stranger's hello with rank 2's (public) certificate is accepted as a claim; until
    the TLS handshake proves it, paths() lists no path to rank 2."""
    async with listening(True, label_for=rank_label) as (server, addr):
        rec, _ = hello(key(2), server.endpoint_id, tls=True)
        reader, writer = await open_raw(addr)
        try:
            writer.write(encode_record(rec, first=True))
            assert (await read_record(reader, RecordReader()))["ok"] is True
            (conn,) = server._connections  # waiting for a TLS handshake that never comes
            assert conn._peer == eid(2) and "claiming rank 2" in conn.label
            assert server.paths() == {}
        finally:
            writer.close()


async def test_an_authenticated_incoming_connection_is_named_as_its_peer(tls: bool) -> None:
    async with listening(tls, label_for=rank_label) as (server, addr):
        client = TcpTransport(key(9), config(tls))
        async with closing(client):
            await bounded(client.connect(server.endpoint_id, addr), "connect")
            conn = await bounded(server.accept(), "accept")
            assert conn.label == f"rank 8 ({eid(9).short()})"
            info = server.paths()[eid(9)]
            assert info.transport == "tcp" and info.loss is None  # QUIC's only
            # Its round trip from the first segments on (the kernel's), not None until
            # the first keepalive answers, as a user following the README saw.
            if sys.platform.startswith("linux"):
                assert info.rtt is not None and 0 < info.rtt < 1.0, info


# ---- malformed frames after a good handshake -----------------------------------------------------


def bad_header(**fields: int) -> bytes:
    values = {"version": VERSION, "kind": 1, "flags": 0, "meta": 0, "ch": 0, "seq": 0, "pl": 0}
    values.update(fields)
    return HEADER.pack(*values.values())


MALFORMED = {
    "garbage": (b"\xff" * 64, False),
    "http": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False),
    "bad-version": (bad_header(version=7), False),
    "unknown-kind": (bad_header(kind=99), False),
    "oversized-meta": (bad_header(meta=64 * 1024 + 1), False),
    "oversized-payload": (bad_header(pl=(1 << 30) + 1), False),
    "ping-with-payload": (bad_header(kind=FrameKind.PING, pl=3) + b"abc", False),
    "truncated-header": (encode_header(FrameKind.DATA, 1, 0, b"", 10)[:20], True),
    "truncated-payload": (encode_header(FrameKind.DATA, 1, 0, b"m", 100) + b"m" + b"x" * 9, True),
    "truncated-large": (encode_header(FrameKind.DATA, 1, 0, b"", 1 << 20) + b"x" * 1000, True),
}


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_malformed_frames_close_only_that_connection(name: str, tls: bool) -> None:
    bad, then_eof = MALFORMED[name]
    async with tcp_pair(tls) as p:
        bystander_t = TcpTransport(key(2), config(tls))
        async with closing(bystander_t):
            addr = p.server_transport._server.address  # type: ignore[attr-defined]
            bystander = await bounded(bystander_t.connect(eid(1), addr), "second connect")
            bystander_srv = await bounded(p.server_transport.accept(), "second accept")

            raw = p.client._transport  # type: ignore[attr-defined]
            tls = p.client._tls  # type: ignore[attr-defined]
            raw.write(tls.encrypt(bad) if tls is not None else bad)  # inside TLS, if any
            if then_eof:
                if tls is not None:
                    raw.write(tls.close_notify())
                raw.write_eof()
                # A stream cut in a frame: what a peer that crashed mid-send leaves, a
                # lost connection rather than a protocol violation.
                bystanders = (bystander, bystander_srv)
                await check_offender_dropped(p, bystanders, error=ConnectionBrokenError)
                assert "middle of a frame" in str(p.server.end_error), p.server.end_error
            else:
                await check_offender_dropped(p, (bystander, bystander_srv))


async def test_frames_before_garbage_are_still_delivered() -> None:
    """Good frames that arrive in the same read as garbage are delivered before the
    protocol error (FrameError.frames)."""
    async with tcp_pair(False) as p:
        good = encode_header(FrameKind.DATA, 1, 0, b"", 5) + b"hello"
        p.client._transport.write(good + b"\xff" * 64)  # type: ignore[attr-defined]
        f = await bounded(p.server.recv(1), "the good frame")
        assert bytes(f.payload) == b"hello"
        with pytest.raises(RemoteProtocolError) as info:
            await bounded(p.server.recv(1), "the protocol error")
        assert eid(0).short() in str(info.value)


# ---- peers that die -----------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from p2pdist.identity import EndpointId, SecretKey
    from p2pdist.transport import TcpTransport, TransportConfig

    async def main():
        seed, server, host, port, tls = sys.argv[1:]
        t = TcpTransport(SecretKey.from_seed(seed, 5), TransportConfig(tls=tls == "1"))
        conn = await t.connect(EndpointId.parse(server), (host, int(port)))
        await conn.send(1, b"child ready")
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_killed_process_is_detected(tls: bool) -> None:
    """SIGKILL the peer's process: the survivor's pending recv fails naming it."""
    async with listening(tls) as (server, (host, port)):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, SEED, str(server.endpoint_id), host, str(port),
            "1" if tls else "0",
        )  # fmt: skip
        try:
            conn = await bounded(server.accept(), "the child connecting", 30)
            assert conn.peer_id == eid(5)
            assert bytes((await bounded(conn.recv(1), "hello")).payload) == b"child ready"
            pending = asyncio.create_task(conn.recv(1))
            await asyncio.sleep(0)
            proc.kill()
            with pytest.raises(ConnectionBrokenError) as info:
                await bounded(pending, "noticing the killed peer")
            assert eid(5).short() in str(info.value)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


@pytest.mark.parametrize("tls", [False, True])
async def test_backpressure_does_not_look_like_a_dead_peer(tls: bool) -> None:
    """While reading is paused because the application is not consuming, the peer's
    pings go unread: that silence must not count against the peer. With TLS, records
    already received wait in the TLS buffer while paused and are taken on resume."""
    cfg = {"keepalive_interval": 0.05, "idle_timeout": 0.3, "max_buffered": 1 << 20}
    async with tcp_pair(tls, **cfg) as p:

        async def sender() -> None:
            for i in range(16):
                await p.client.send(1, bytes(512 << 10), seq=i)

        task = asyncio.create_task(sender())
        try:
            await asyncio.sleep(1.0)  # the application is busy; both peers are alive
            for i in range(16):
                assert (await bounded(p.server.recv(1), "recv")).seq == i
            await bounded(task, "the sender finishing")
        finally:
            task.cancel()


async def test_a_corrupt_tls_record_closes_the_connection_naming_the_peer() -> None:
    """Bytes that are not a valid TLS record for this session (an attacker on the path,
    say) end the connection as broken, naming the peer; nothing escapes, and the peer
    learns it from our alert. (TLS records all along; tests/test_aead_records.py has
    the same for the AES-GCM records that follow TLS by default.)"""
    async with tcp_pair(True, sealed_records=False) as p:
        await p.client.send(1, b"before")
        assert bytes((await bounded(p.server.recv(1), "recv")).payload) == b"before"
        assert p.client._transport is not None
        p.client._transport.write(b"\x17\x03\x03\x00\x20" + os.urandom(32))  # app data
        with pytest.raises(ConnectionBrokenError, match=r"TLS error") as caught:
            await bounded(p.server.recv(1), "the server noticing")
        assert eid(0).short() in str(caught.value)
        assert caught.value.corrupt and not caught.value.graceful
        with pytest.raises(ConnectionBrokenError, match=r"TLS error: .*ALERT"):
            await bounded(p.client.recv(1), "the client reading the alert")


async def test_frames_before_a_corrupt_tls_record_are_still_delivered() -> None:
    """Records decrypted before a bad one in the same read were authentic: their frames
    come first, then the connection ends."""
    async with tcp_pair(True, sealed_records=False) as p:
        assert p.client._transport is not None and p.client._tls is not None
        good = p.client._tls.encrypt(encode_header(FrameKind.DATA, 1, 0, b"", 5) + b"hello")
        p.client._transport.write(good + b"\x17\x03\x03\x00\x20" + os.urandom(32))
        frame = await bounded(p.server.recv(1), "the good frame")
        assert bytes(frame.payload) == b"hello"
        with pytest.raises(ConnectionBrokenError, match=r"TLS error"):
            await bounded(p.server.recv(1), "the server noticing")


async def test_a_peer_close_notify_ends_the_connection_at_once() -> None:
    """TLS close_notify without GOODBYE (and with the socket left open): nothing more can
    be read, so the connection ends at once, not graceful, instead of buffering what
    follows undecrypted until the idle timeout."""
    async with tcp_pair(True, sealed_records=False) as p:
        await p.client.send(1, b"before")
        assert bytes((await bounded(p.server.recv(1), "recv")).payload) == b"before"
        assert p.client._transport is not None and p.client._tls is not None
        p.client._transport.write(p.client._tls.close_notify())
        p.client._transport.write(os.urandom(64 << 10))  # would pile up undecrypted
        with pytest.raises(ConnectionBrokenError) as caught:
            await bounded(p.server.recv(1), "the server ending the connection")
        assert not caught.value.graceful
        assert p.server._tls is not None and p.server._tls.buffered <= 256 << 10  # one read


async def test_only_refusals_count_as_refused_incoming_connections(tls: bool) -> None:
    """A dialer that connects and goes away at once (a port check) is not a refusal;
    one that asks for another endpoint id is, with the reason kept."""
    async with listening(tls) as (server, addr):
        _, writer = await open_raw(addr)
        writer.close()
        await still_serving(server, TcpTransport(key(9), config(tls)), addr)
        assert server.refused_incoming == 0, server.last_refusal
        stranger = TcpTransport(key(3), config(tls))
        async with closing(stranger):
            with pytest.raises(PeerAuthenticationError):
                await bounded(stranger.connect(eid(5), addr), "a dial for another id")
        await wait_until(lambda: server.refused_incoming == 1, "the refusal counted")
        assert server.last_refusal is not None and "identity mismatch" in server.last_refusal


# ---- misuse -----------------------------------------------------------------------------------


async def test_two_receivers_on_one_channel_is_usage_error() -> None:
    async with tcp_pair(False) as p:
        first = asyncio.create_task(p.server.recv(1))
        await asyncio.sleep(0)
        with pytest.raises(UsageError, match="two receivers"):
            await bounded(p.server.recv(1), "the second receiver failing")
        await p.client.send(1, b"x")
        assert bytes((await bounded(first, "recv")).payload) == b"x"


async def test_listen_twice_and_oversized_send() -> None:
    async with tcp_pair(False) as p:
        with pytest.raises(UsageError, match="already listening"):
            await p.server_transport.listen()
        with pytest.raises(UsageError, match="meta"):
            await p.client.send(1, b"", meta=b"x" * (64 * 1024 + 1))
        with pytest.raises(UsageError, match="64 unsigned bits"):
            await p.client.send(-1, b"")
        await p.client.send(1, b"still fine")
        assert bytes((await bounded(p.server.recv(1), "recv")).payload) == b"still fine"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("[::1]:443", ("::1", 443)),
        ("host.example:0", ("host.example", 0)),
        (("10.0.0.1", 9), ("10.0.0.1", 9)),
        (("10.0.0.1", np.uint16(9)), ("10.0.0.1", 9)),
        (("10.0.0.1", "9"), ("10.0.0.1", 9)),  # a port from a split string
    ],
)
def test_parse_address(text: Any, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected
    assert type(parse_address(text)[1]) is int


# not a str or a pair: these were AttributeError, TypeError or ValueError
_NOT_ADDRESSES = [45001, None, ("h",), ("h", "x"), ("h", 1.5), (1, 80), ("h", True)]


@pytest.mark.parametrize(
    "text",
    [
        *["", "host", "host:", ":80", "host:http", "h:70000", "[::1]", *_NOT_ADDRESSES],
        # what int() takes but no port is written as: signs, spaces, underscores, and
        # other scripts' digits (Arabic-Indic 80)
        *["h:+80", "h:8_0", "h: 80", "h:\u0668\u0660", ("h", "\u0668\u0660"), ("h", " 9")],
        # names getaddrinfo's IDNA encoding refuses (a raw UnicodeError from connect)
        *["a..b:80", ".:80", "x" * 64 + ".example:80"],
    ],
)
def test_parse_address_refuses(text: Any) -> None:
    with pytest.raises(UsageError):
        parse_address(text)


# ---- keepalive (sans-I/O, time moved by hand) ----------------------------------------------


def test_keepalive_pings_after_interval() -> None:
    ka = Keepalive.start(interval=1.0, idle_timeout=5.0, now=100.0)
    assert ka.poll(100.5) is KeepaliveAction.NONE
    assert ka.poll(101.0) is KeepaliveAction.PING
    ka.on_send(101.0)
    assert ka.poll(101.5) is KeepaliveAction.NONE
    ka.on_send(101.8)  # data counts as traffic: no ping needed
    assert ka.poll(102.5) is KeepaliveAction.NONE
    assert ka.poll(102.8) is KeepaliveAction.PING


def test_keepalive_dead_after_idle_timeout() -> None:
    ka = Keepalive.start(interval=1.0, idle_timeout=5.0, now=0.0)
    for step in range(1, 10):  # polls at 0.5 .. 4.5
        t = step / 2
        action = ka.poll(t)
        assert action is not KeepaliveAction.DEAD, t
        if action is KeepaliveAction.PING:
            ka.on_send(t)  # our own pings do not count as hearing from the peer
    assert ka.poll(4.99) is not KeepaliveAction.DEAD
    assert ka.poll(5.0) is KeepaliveAction.DEAD


def test_keepalive_receive_resets_idle() -> None:
    ka = Keepalive.start(interval=1.0, idle_timeout=5.0, now=0.0)
    for t in (1.0, 2.0, 3.0, 4.0):
        ka.poll(t)
    ka.on_receive(4.5)
    for t in (5.0, 6.0, 7.0, 8.0, 9.0):
        assert ka.poll(t) is not KeepaliveAction.DEAD
    assert ka.poll(9.5) is KeepaliveAction.DEAD


def test_keepalive_next_deadline() -> None:
    ka = Keepalive.start(interval=1.0, idle_timeout=5.0, now=10.0)
    assert ka.next_deadline() == 11.0
    ka.on_send(10.5)
    assert ka.next_deadline() == 11.5
    ka.on_send(20.0)
    ka.on_receive(12.0)
    assert ka.next_deadline() == 17.0  # the idle deadline comes first now


def test_keepalive_stall_grace() -> None:
    """When our own event loop was blocked, the peer's silence is not its fault."""
    ka = Keepalive.start(interval=1.0, idle_timeout=5.0, now=0.0)
    assert ka.poll(0.9) is KeepaliveAction.NONE
    # The loop was blocked for 20 s: far past the idle timeout, but we were not listening.
    assert ka.poll(20.0) is KeepaliveAction.PING
    ka.on_send(20.0)
    # Now the peer gets a fresh idle period (counted from one interval before the stall).
    t = 20.0
    while t < 23.5:
        t += 0.5
        assert ka.poll(t) is not KeepaliveAction.DEAD, t
        ka.on_send(t)
    assert ka.poll(24.0) is KeepaliveAction.DEAD


def test_keepalive_short_delay_is_not_a_stall() -> None:
    ka = Keepalive.start(interval=1.0, idle_timeout=5.0, now=0.0)
    ka.poll(2.5)
    assert ka.poll(5.5) is KeepaliveAction.DEAD  # 3 s late is not > 3 intervals


def test_keepalive_paused_reading_is_not_silence() -> None:
    ka = Keepalive.start(interval=1.0, idle_timeout=5.0, now=0.0)
    ka.set_rx_paused(True, 1.0)
    for t in range(2, 30):
        assert ka.poll(float(t)) is not KeepaliveAction.DEAD, t
        ka.on_send(float(t))
    ka.set_rx_paused(False, 30.0)
    for t in (31.0, 32.0, 33.0, 34.0, 34.9):
        assert ka.poll(t) is not KeepaliveAction.DEAD
    assert ka.poll(35.0) is KeepaliveAction.DEAD


# ---- mailbox (sans-I/O apart from the futures) --------------------------------------------


def data_frame(channel: int, seq: int = 0, size: int = 10) -> Frame:
    return Frame(FrameKind.DATA, channel, seq, b"", memoryview(bytearray(size)))


class Flow:
    def __init__(self) -> None:
        self.events: list[str] = []

    def pause(self) -> None:
        self.events.append("pause")

    def resume(self) -> None:
        self.events.append("resume")


def mailbox(max_buffered: int = 1 << 20) -> tuple[Mailbox, Flow]:
    flow = Flow()
    return Mailbox(max_buffered, flow.pause, flow.resume, lambda: "rank 3 (abcdefghij)"), flow


async def test_mailbox_orders_per_channel_and_waits() -> None:
    mb, _ = mailbox()
    for i in range(3):
        mb.deliver(data_frame(1, i))
        mb.deliver(data_frame(2, i))
    assert [(await mb.get(2, 1)).seq for _ in range(3)] == [0, 1, 2]
    assert [(await mb.get(1, 1)).seq for _ in range(3)] == [0, 1, 2]
    waiter = asyncio.create_task(mb.get(4, None))
    await asyncio.sleep(0)
    assert not waiter.done()
    mb.deliver(data_frame(4, 9))
    assert (await bounded(waiter, "the waiter")).seq == 9


async def test_mailbox_timeout_names_peer_and_channel() -> None:
    mb, _ = mailbox()
    with pytest.raises(PeerTimeoutError, match=r"rank 3 \(abcdefghij\).*0x2a"):
        await mb.get(42, 0.01)
    mb.deliver(data_frame(42))  # a later frame is still received after the timeout
    assert (await mb.get(42, 1)).channel == 42


async def test_mailbox_fail_wakes_waiters_after_queued_frames() -> None:
    mb, _ = mailbox()
    mb.deliver(data_frame(1, 0))
    waiter = asyncio.create_task(mb.get(2, None))
    await asyncio.sleep(0)
    err = ConnectionBrokenError("rank 3", "gone")
    mb.fail(err)
    mb.fail(ConnectionClosedError("second error is ignored"))
    with pytest.raises(ConnectionBrokenError):
        await bounded(waiter, "the failed waiter")
    assert (await mb.get(1, 1)).seq == 0
    with pytest.raises(ConnectionBrokenError):
        await mb.get(1, 1)


async def test_mailbox_backpressure_pauses_and_resumes_once() -> None:
    cost = 30 + FRAME_OVERHEAD + PAYLOAD_OVERHEAD  # one 30-byte frame, as the mailbox counts it
    mb, flow = mailbox(max_buffered=2 * (CHANNEL_OVERHEAD + cost) + cost)
    for i in range(10):
        mb.deliver(data_frame(1, i, size=30))
    assert flow.events == ["pause"]
    assert mb.buffered == CHANNEL_OVERHEAD + 10 * cost
    for _ in range(8):
        await mb.get(1, 1)
    assert mb.buffered == CHANNEL_OVERHEAD + 2 * cost
    assert flow.events == ["pause"]  # still above half the limit
    await mb.get(1, 1)
    assert mb.buffered == CHANNEL_OVERHEAD + cost
    assert flow.events == ["pause", "resume"]
    mb.deliver(data_frame(1, 10, size=30))
    assert flow.events == ["pause", "resume"]  # 2 frames are under the limit again


async def test_mailbox_retire_drops_and_counts() -> None:
    mb, flow = mailbox(max_buffered=2 * (CHANNEL_OVERHEAD + FRAME_OVERHEAD + PAYLOAD_OVERHEAD + 10))
    for i in range(4):
        mb.deliver(data_frame(5, i, size=20))
    mb.deliver(data_frame(6, 0))
    mb.retire(5)
    assert mb.dropped == 4
    assert flow.events == ["pause", "resume"]  # dropping frees the buffer
    mb.deliver(data_frame(5, 9))
    assert mb.dropped == 5
    assert (await mb.get(6, 1)).channel == 6
    with pytest.raises(PeerTimeoutError):
        await mb.get(5, 0.01)


def test_retired_channels_compact_floor() -> None:
    r = RetiredChannels()
    space = 3 << 48
    for c in [2, 0, 1, 5]:
        r.retire(space | c)
    assert all(space | c in r for c in (0, 1, 2, 5))
    assert space | 3 not in r and space | 4 not in r and space | 6 not in r
    assert 2 not in r and (4 << 48) | 0 not in r  # other spaces are separate
    for c in range(3, 1000):
        r.retire(space | c)
    assert r.runs == 1  # compact after in-order retires
    r.retire(space | 10)  # retired already: nothing to remember
    assert r.runs == 1
    assert space | 999 in r and space | 1000 not in r


async def test_dial_with_retry_waits_for_a_late_listener_and_bounds_a_missing_one() -> None:
    from p2pdist.transport.dial import dial_with_retry

    with socket.socket() as s:  # a free port, not listening yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = TcpTransport(SecretKey.generate(), TransportConfig())
    b_key = SecretKey.generate()
    b = TcpTransport(b_key, TransportConfig())
    try:
        with pytest.raises(PeerTimeoutError, match=r"rank 1 \(x\): no connection within 0.3 s"):
            await dial_with_retry(
                a, b_key.endpoint_id, f"127.0.0.1:{port}", label="rank 1 (x)", timeout=0.3
            )
        dialing = asyncio.create_task(
            dial_with_retry(a, b_key.endpoint_id, f"127.0.0.1:{port}", label="b", timeout=10.0)
        )
        await asyncio.sleep(0.2)  # b starts listening only now
        await b.listen("127.0.0.1", port)
        conn = await bounded(dialing, "the retried dial")
        assert conn.peer_id == b_key.endpoint_id
        with pytest.raises(UsageError, match="TCP needs a host:port"):
            await dial_with_retry(a, b_key.endpoint_id, None, label="b", timeout=1.0)
    finally:
        await a.close()
        await b.close()


def test_a_label_for_that_raises_falls_back_to_the_short_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The application's label_for runs inside the receive path of both transports: if it
    raises, the peer is named by its short id and the error is logged, not raised."""

    def broken(peer: EndpointId) -> str:
        raise RuntimeError("label service down")

    t = TcpTransport(SecretKey.generate(), TransportConfig(), label_for=broken)
    peer = SecretKey.generate().endpoint_id
    assert t.label_for(peer) == f"peer {peer.short()}"
    assert "label_for failed" in caplog.text


async def test_a_peer_that_pings_and_never_reads_cannot_grow_our_write_buffer() -> None:
    """Every PING used to be answered, even while our writes backed up: a member that
    pings and never reads grew our write buffer without bound (past write_buffer_high)."""
    ping = encode_header(FrameKind.PING, seq=1)
    high = 256 * 1024
    cfg = TransportConfig(tls=False, write_buffer_high=high)
    a, b = TcpTransport(key(0), cfg), TcpTransport(key(1), cfg)
    async with closing(a, b):
        addr = await b.listen("127.0.0.1", 0)
        ca = await bounded(a.connect(eid(1), addr), "connect")
        cb = await bounded(b.accept(), "accept")
        ca._transport.pause_reading()  # type: ignore[attr-defined]  # it never reads
        for _ in range(6):
            for _ in range(50_000):
                ca._write(ping)  # type: ignore[attr-defined]
            await asyncio.sleep(0.2)
        assert cb._transport.get_write_buffer_size() <= 2 * high  # type: ignore[attr-defined]
        assert not cb.closed


@pytest.mark.parametrize("tls", [False, True])
async def test_concurrent_senders_to_a_backed_up_pipe_take_turns(tls: bool) -> None:
    """32 tasks each send 1 MiB on one connection whose peer has stopped reading: each
    handed its whole frame over before waiting, so the write buffer grew by a frame per
    sender (124 MiB against an 8 MiB mark: an audit). They now wait their turn first:
    the buffer stays within the mark and one frame, and once the peer reads again every
    message arrives, in the order the sends were called. Keepalive PINGs are not queued
    behind a backed-up pipe either (one per interval grew it while the peer read nothing)."""
    high = 1 << 20
    cfg = {"write_buffer_high": high, "keepalive_interval": 0.05, "idle_timeout": 60.0}
    async with tcp_pair(tls, **cfg) as p:
        p.server._set_reading(False)  # type: ignore[attr-defined]  # reads nothing more
        payloads = [bytes([i]) * (1 << 20) for i in range(32)]
        sends = [asyncio.create_task(p.client.send(1, x, seq=i)) for i, x in enumerate(payloads)]
        await asyncio.sleep(0.5)
        transport = p.client._transport  # type: ignore[attr-defined]
        assert p.client._write_paused  # type: ignore[attr-defined]
        before = transport.get_write_buffer_size()
        assert before <= high + (1 << 20) + 64 * 1024, before  # (record and frame headers)
        await asyncio.sleep(0.5)  # ten keepalive intervals
        assert transport.get_write_buffer_size() == before
        assert sum(t.done() for t in sends) < 8
        p.server._set_reading(True)  # type: ignore[attr-defined]
        for i, x in enumerate(payloads):
            got = await bounded(p.server.recv(1), f"message {i}")
            assert got.seq == i and bytes(got.payload) == x
        await bounded(asyncio.gather(*sends), "the sends")


async def test_no_keepalive_ping_while_writing_is_paused() -> None:
    """A PING per keepalive interval went into a write buffer the peer was not taking
    (the bytes already queued keep the peer's timer fed); once writing resumes, so do
    the PINGs."""
    async with tcp_pair(False, keepalive_interval=0.05, idle_timeout=60.0) as p:
        conn = p.client

        async def pinged_after(number: int) -> bool:
            for _ in range(1000):  # up to 10 s
                if conn._ping_number > number:  # type: ignore[attr-defined]
                    return True
                await asyncio.sleep(0.01)
            return False

        assert await pinged_after(0)  # the timer runs
        conn._write_paused = True  # type: ignore[attr-defined]
        paused_at = conn._ping_number  # type: ignore[attr-defined]
        await asyncio.sleep(0.4)  # eight intervals
        assert conn._ping_number == paused_at  # type: ignore[attr-defined]
        conn._resume_writing()  # type: ignore[attr-defined]
        assert await pinged_after(paused_at)


async def test_the_line_of_senders_survives_cancels_and_ends() -> None:
    """The senders' line (writing paused by hand here, the peer reading): a head that is
    cancelled hands over nothing and the next goes on; drain() waits behind the line;
    a sender that has handed its frame over waits for the pipe only, not for the line
    (it waited for every sender behind it: a review); an interrupt, and the end of the
    connection, reach every sender in line."""
    async with tcp_pair(False, write_buffer_high=64 * 1024) as p:
        conn = p.client
        conn._write_paused = True  # type: ignore[attr-defined]
        first = asyncio.create_task(conn.send(1, b"first", seq=0))
        second = asyncio.create_task(conn.send(1, b"second", seq=1))
        drained = asyncio.create_task(conn.drain())
        await asyncio.sleep(0.05)
        assert not (first.done() or second.done() or drained.done())
        first.cancel()
        await asyncio.sleep(0.05)
        assert first.cancelled() and not second.done()
        conn._resume_writing()  # type: ignore[attr-defined]
        await bounded(asyncio.gather(second, drained), "the line")
        got = await bounded(p.server.recv(1), "the second message")
        assert bytes(got.payload) == b"second" and got.seq == 1  # the first never went

        # Handed over, waiting for the pipe: it goes on when the pipe drains, even while
        # a sender in line hands over a frame that backs the pipe up again.
        p.server._set_reading(False)  # type: ignore[attr-defined]
        conn._write_paused = True  # type: ignore[attr-defined]
        handed = asyncio.create_task(conn._drain(in_line=False))  # type: ignore[attr-defined]
        # More than the kernel ever takes unread (send buffer up to tcp_wmem's 4 MiB and
        # the peer's receive buffer: 4 MiB alone was taken whole on a host at times).
        big = asyncio.create_task(conn.send(2, bytes(64 << 20)))
        await asyncio.sleep(0.05)
        conn._resume_writing()  # type: ignore[attr-defined]
        await bounded(handed, "the sender that had handed its frame over")
        await asyncio.sleep(0.2)
        assert not big.done() and conn._write_paused  # type: ignore[attr-defined]

        # Everyone in line hears of an interrupt, and of the end.
        waiting = [asyncio.create_task(conn.send(3, b"x", seq=i)) for i in range(3)]
        await asyncio.sleep(0.05)
        conn.interrupt(ConnectionBrokenError("test", "interrupted"))
        for task in [big, *waiting]:
            with pytest.raises(ConnectionBrokenError, match="interrupted"):
                await bounded(task, "an interrupted sender")


@pytest.mark.parametrize(("chunks", "arrives"), [(6, True), (16, False)])
async def test_a_receiver_waiting_behind_frames_nobody_reads(chunks: int, arrives: bool) -> None:
    """max_buffered (1 MiB) of frames for channel 1 that nobody reads, then a frame for
    channel 2, which a receiver waits for: reading paused at the limit and the wait
    stalled until its timeout, whatever came next. Now a waiter lets reading go on up
    to twice the limit (1.5 MiB here: it arrives), and past that its timeout says why."""
    cfg = TransportConfig(tls=False, max_buffered=1 << 20)
    a, b = TcpTransport(key(0), cfg), TcpTransport(key(1), cfg)
    async with closing(a, b):
        addr = await b.listen("127.0.0.1", 0)
        ca = await bounded(a.connect(eid(1), addr), "connect")
        cb = await bounded(b.accept(), "accept")

        async def sender() -> None:
            for i in range(chunks):
                await ca.send(1, bytes(256 << 10), seq=i)
            await ca.send(2, b"hello")

        sending = asyncio.create_task(sender())
        if arrives:
            assert bytes((await cb.recv(2, timeout=5.0)).payload) == b"hello"
        else:
            with pytest.raises(PeerTimeoutError, match="reading is paused"):
                await cb.recv(2, timeout=1.0)
        for i in range(chunks):  # reading the others lets the rest in
            assert (await cb.recv(1, timeout=5.0)).seq == i
        if not arrives:
            assert bytes((await cb.recv(2, timeout=5.0)).payload) == b"hello"
        await bounded(sending, "the sender")


async def test_a_record_arriving_slowly_counts_as_life() -> None:
    """Over TLS (AES-GCM records), a large record that trickles in for longer than
    ``idle_timeout`` keeps the connection alive: every byte counts as life, not only
    whole records (a bulk message on a slow link was declared silent and aborted).
    White-box: the sender is frozen and one 900 KB record is fed to the receiver."""
    from p2pdist.wire.frames import encode_data_header

    cfg = TransportConfig(keepalive_interval=0.25, idle_timeout=1.0)
    ta, tb = TcpTransport(SecretKey.generate(), cfg), TcpTransport(SecretKey.generate(), cfg)
    try:
        host, port = await tb.listen("127.0.0.1", 0)
        ca: Any = await ta.connect(tb.endpoint_id, (host, port))
        cb: Any = await tb.accept(timeout=5)
        assert cb.record_protection == "aes-256-gcm"
        ca._ka_timer.cancel()  # only the bytes fed below reach cb
        ca._keepalive = None
        ca._transport.pause_reading()
        payload = bytes(900_000)
        header = encode_data_header(9, 0, b"", len(payload), cfg.limits)
        wire = bytes(ca._tls.encrypt(header + payload))  # one record
        step = len(wire) // 25  # 25 pieces, one every 0.1 s: 2.5 s in all
        for i in range(0, len(wire), step):
            assert not cb.closed, f"aborted after {i} of {len(wire)} bytes: {cb._error}"
            feed(cb, wire[i : i + step])
            await asyncio.sleep(0.1)
        frame = await cb.recv(9, timeout=5)
        assert frame.payload.nbytes == len(payload)
    finally:
        await ta.close()
        await tb.close()


# ---- a receiver reads what has arrived before it waits (TcpConnection._read_now) ---------


def arrived(conn: TcpConnection) -> None:
    """Block (the event loop does not run) until ``conn``'s socket has bytes to read."""
    assert conn._fd is not None
    readable, _, _ = select.select([conn._fd], [], [], 10)
    assert readable, "nothing arrived within 10 s"


def first_step(coro: Any) -> Any:
    """Run ``coro``'s first step: its result if it finished there, else fail."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    pytest.fail("the receive waited for the event loop")


@pytest.mark.parametrize("tls", [False, True])
async def test_a_message_that_has_arrived_is_taken_without_a_trip_through_the_loop(
    tls: bool,
) -> None:
    async with tcp_pair(tls) as p:
        p.client.send_nowait(7, b"already here", seq=0)
        arrived(p.server)
        frame = first_step(p.server.recv(7))
        assert bytes(frame.payload) == b"already here"
        # The loop's own read of those bytes then finds none; the stream goes on.
        await asyncio.sleep(0.01)
        await p.client.send(8, b"next")
        assert bytes((await bounded(p.server.recv(8), "recv")).payload) == b"next"
        assert not p.server.closed


async def test_a_receiver_does_not_read_while_reading_is_paused() -> None:
    async with tcp_pair(False) as p:
        assert p.server._transport is not None
        p.server._transport.pause_reading()  # as backpressure (or silence()) does
        p.client.send_nowait(7, b"held back", seq=0)
        arrived(p.server)
        waiting = asyncio.ensure_future(p.server.recv(7))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        p.server._transport.resume_reading()
        assert bytes((await bounded(waiting, "recv")).payload) == b"held back"


async def test_a_socket_error_on_the_early_read_ends_the_connection_naming_the_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def resetting(fd: int, buf: memoryview) -> int:
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    async with tcp_pair(False) as p:
        monkeypatch.setattr(tcp_module, "_recv_into", resetting)
        with pytest.raises(ConnectionBrokenError, match="Connection reset by peer") as info:
            await bounded(p.server.recv(7), "recv")
        assert eid(0).short() in str(info.value)
        assert p.server.closed


async def waiting_bytes(conn: TcpConnection, nbytes: int) -> None:
    """Let the loop run until ``conn``'s socket holds ``nbytes`` unread bytes."""
    import fcntl
    import termios

    assert conn._fd is not None
    for _ in range(1000):
        held = int.from_bytes(fcntl.ioctl(conn._fd, termios.FIONREAD, bytes(4)), sys.byteorder)
        if held >= nbytes:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"only {held} of {nbytes} bytes arrived within 10 s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIONREAD on a socket: Linux")
@pytest.mark.parametrize("receiver_first", [False, True], ids=["data-first", "receiver-first"])
async def test_a_large_payload_after_a_large_payload_is_read_straight_into_its_place(
    monkeypatch: pytest.MonkeyPatch, receiver_first: bool
) -> None:
    """After a large payload the reader takes the next header alone (a peek) and reads
    the payload behind it at once, into the place named for it: that payload used to come
    into the scratch buffer with its header (up to 256 KiB) and be copied into place.
    Whether it is all there when the receiver asks, or the receiver waits first (its
    look before it waits finds nothing: the peek must survive that)."""
    async with tcp_pair(False) as p:
        rng = np.random.default_rng(5)
        first, second = rng.bytes(300 << 10), rng.bytes(100 << 10)  # both above 64 KiB
        await p.client.send(7, first, seq=0)
        assert bytes((await bounded(p.server.recv(7), "recv")).payload) == first
        place = memoryview(bytearray(len(second)))
        p.server.expect(7, 1, place)
        reads: list[memoryview] = []

        def recording(fd: int, buf: memoryview) -> int:
            reads.append(buf)
            return os.readv(fd, (buf,))

        rest = len(second) - (PEEK_BYTES - HEADER.size)
        assert p.server._transport is not None
        if receiver_first:
            monkeypatch.setattr(tcp_module, "_recv_into", recording)
            receiving = asyncio.ensure_future(p.server.recv(7))
            await asyncio.sleep(0.05)  # it looked (nothing there) and waits
            assert not receiving.done()
            await p.client.send(7, second, seq=1)
            frame = await bounded(receiving, "recv")
            # The loop's read took the peek; ours read the rest into place at once.
            assert (True, rest) in [(r.obj is place.obj, r.nbytes) for r in reads]
        else:
            p.server._transport.pause_reading()
            await p.client.send(7, second, seq=1)
            await waiting_bytes(p.server, HEADER.size + len(second))
            monkeypatch.setattr(tcp_module, "_recv_into", recording)
            p.server._transport.resume_reading()
            frame = await bounded(p.server.recv(7), "recv")
            # The peek (the receiver's own read, before it waits), then the rest.
            seen = [(r.obj is place.obj, r.nbytes) for r in reads]
            assert seen[:2] == [(False, PEEK_BYTES), (True, rest)]
        assert frame.payload is place and bytes(place) == second


async def test_a_second_receiver_on_a_channel_is_refused_even_with_its_message_unread() -> None:
    async with tcp_pair(False) as p:
        first = asyncio.ensure_future(p.server.recv(7))
        await asyncio.sleep(0.05)  # waiting on channel 7
        p.client.send_nowait(7, b"for the first", seq=0)
        arrived(p.server)
        with pytest.raises(UsageError, match="two receivers"):
            first_step(p.server.recv(7))
        assert bytes((await bounded(first, "the first receiver")).payload) == b"for the first"


async def test_an_interrupted_connection_does_not_read_for_a_receiver() -> None:
    async with tcp_pair(False) as p:
        p.server.interrupt(RuntimeError("the group broke"))
        p.client.send_nowait(7, b"late", seq=0)
        arrived(p.server)
        with pytest.raises(RuntimeError, match="the group broke"):
            first_step(p.server.recv(7))


def test_kernel_rtt_is_none_before_the_first_sample_and_small_on_loopback() -> None:
    """An unconnected (or not yet measured) socket's tcpi_min_rtt is ~0U, which read as
    a 4295 s round trip; a loopback exchange gives microseconds (Linux only)."""
    import socket
    import sys

    from p2pdist.transport.tcp import kernel_rtt

    assert kernel_rtt(None) is None
    with socket.socket() as fresh:
        assert kernel_rtt(fresh) is None
    if not sys.platform.startswith("linux"):
        return
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                client.sendall(b"x")
                assert accepted.recv(1) == b"x"
                accepted.sendall(b"y")
                assert client.recv(1) == b"y"
                rtt = kernel_rtt(client)
                assert rtt is not None and 0 < rtt < 0.01, rtt


async def test_a_dial_to_a_bad_address_names_the_peer() -> None:
    """connect() raised the address error before naming the peer, and a name that IDNA
    refuses (an empty or overlong label) came out as a raw UnicodeError, not a
    P2PError: an audit."""
    t = TcpTransport(SecretKey.from_seed("bad address seed", 0))
    try:
        for bad in ("a..b:80", "x" * 64 + ".example:80", "nohost"):
            with pytest.raises(UsageError, match=r"^rank 1 \(.*is not host:port"):
                await t.connect(eid(1), bad, label=f"rank 1 ({eid(1).short()})")
    finally:
        await t.close()


class _TakesAtMost:
    """Stands in for a connection's own handle on its socket: records each ``sendmsg``
    and lets the kernel take at most ``limit`` bytes of it (None: all it will)."""

    def __init__(self, sock: socket.socket, limit: int | None) -> None:
        self.sock, self.limit = sock, limit
        self.calls: list[list[int]] = []

    def sendmsg(self, buffers: Any) -> int:
        parts = [memoryview(b).cast("B") for b in buffers]
        self.calls.append([p.nbytes for p in parts])
        if self.limit is None:
            return self.sock.sendmsg(parts)
        return self.sock.send(b"".join(parts)[: self.limit])

    def send(self, data: Any) -> int:
        return self.sock.send(data)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("limit", [None, 0, 5, HEADER.size, HEADER.size + 1000])
async def test_a_large_plaintext_frame_goes_out_with_its_header(limit: int | None) -> None:
    """A large plaintext frame's header used to be written alone, then its payload: with
    TCP_NODELAY a lone segment, and a wake-up of the peer for it. Header and payload now
    go in one sendmsg while nothing is queued; what the kernel does not take (none of it,
    part of the header, part of the payload) follows through the transport, in order."""
    async with tcp_pair(False) as p:
        conn: Any = p.client
        handle = _TakesAtMost(conn._direct, limit)
        conn._direct = handle
        payloads = [np.arange(i, i + (1 << 18), dtype=np.uint32).tobytes() for i in range(3)]
        for i, x in enumerate(payloads):
            await bounded(p.client.send(1, x, seq=i), f"send {i}")
        for i, x in enumerate(payloads):
            got = await bounded(p.server.recv(1), f"message {i}")
            assert got.seq == i and bytes(got.payload) == x
        assert handle.calls, "no frame went out through sendmsg"
        assert all(len(c) == 2 and c[1] == 1 << 20 for c in handle.calls), handle.calls


async def test_a_reset_met_by_the_combined_send_is_named_as_a_reset() -> None:
    """The sendmsg that takes a large frame with its header meets a reset: the send
    fails and the connection ends naming the reset (the transport's next write would
    have said only "broken pipe"); a socket that takes nothing now is no error."""

    class Resets(_TakesAtMost):
        def sendmsg(self, buffers: Any) -> int:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    async with tcp_pair(False) as p:
        conn: Any = p.client
        conn._direct = Resets(conn._direct, None)
        with pytest.raises(ConnectionBrokenError, match="reset by peer") as info:
            await bounded(p.client.send(1, bytes(1 << 20), seq=0), "send")
        assert eid(1).short() in str(info.value)  # the error names the peer
        assert p.client.closed


async def test_a_full_socket_sends_the_large_frame_through_the_transport() -> None:
    class Full(_TakesAtMost):
        def sendmsg(self, buffers: Any) -> int:
            self.calls.append([])
            raise BlockingIOError(errno.EAGAIN, "try again")

    async with tcp_pair(False) as p:
        conn: Any = p.client
        handle = conn._direct = Full(conn._direct, None)
        x = bytes(range(256)) * 4096
        await bounded(p.client.send(1, x, seq=0), "send")
        got = await bounded(p.server.recv(1), "message")
        assert bytes(got.payload) == x and handle.calls == [[]]
