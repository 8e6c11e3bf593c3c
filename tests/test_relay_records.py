"""AES-GCM records on relay sessions (docs/protocol.md 8.2): the client's upgrade offers
them, the relay's 101 takes them, and from then on both directions move in records
instead of TLS. Either side can keep TLS; a malformed offer is refused; a record that
does not decrypt costs that client its connection and nothing else; on the wire, after
the upgrade, only records pass."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import struct

import pytest
from test_aead_records import tapped_proxy
from test_relay_core import FakeLink, core
from test_relay_server import eventually, running

from p2pdist import eventloop
from p2pdist.identity import SecretKey
from p2pdist.tls import TlsIdentity
from p2pdist.transport.aeadpipe import RECEIVE_BUFFER, AeadPipe, RecordError
from p2pdist.transport.relay_path import RelayConfig, RelayPath
from p2pdist.transport.securestream import SecureStream
from p2pdist.wire.relay import (
    RECORDS_HEADER,
    RECORDS_MAX,
    RelayProtocolError,
    RelayUrl,
    parse_http_head,
    records_key,
    upgrade_request,
)
from relay import http as relay_http

KEYS = [SecretKey.from_seed("relay records tests seed", r) for r in range(3)]
KEY = bytes(range(32))


# ---- the offer, on its own ----------------------------------------------------------------


def head(text: str) -> object:
    parsed = parse_http_head(text.encode("latin-1") + b"\r\n\r\n")
    assert parsed is not None
    return parsed[0]


def test_records_key_reads_an_offer_and_declines_what_it_does_not_know() -> None:
    h = head(f"GET /relay HTTP/1.1\r\n{RECORDS_HEADER}: aes-256-gcm; key={KEY.hex()}")
    assert records_key(h) == KEY  # type: ignore[arg-type]
    upper = head(f"GET /relay HTTP/1.1\r\n{RECORDS_HEADER}: AES-256-GCM ;key = {KEY.hex()}")
    assert records_key(upper) == KEY  # type: ignore[arg-type]
    assert records_key(head("GET /relay HTTP/1.1")) is None  # type: ignore[arg-type]
    other = head(f"GET /relay HTTP/1.1\r\n{RECORDS_HEADER}: chacha20; key={KEY.hex()}")
    assert records_key(other) is None  # type: ignore[arg-type]
    spaced = "01" + " " * 60 + "02"  # 64 characters, but 2 bytes as hex with spaces skipped
    for bad in (
        "aes-256-gcm",
        "aes-256-gcm; key=abc",
        f"aes-256-gcm; nonce={KEY.hex()}",
        f"aes-256-gcm; key={spaced}",
    ):
        with pytest.raises(RelayProtocolError, match="malformed"):
            records_key(head(f"GET /relay HTTP/1.1\r\n{RECORDS_HEADER}: {bad}"))  # type: ignore[arg-type]
    with pytest.raises(RelayProtocolError, match="malformed"):
        records_key(head(f"GET / HTTP/1.1\r\n{RECORDS_HEADER}: aes-256-gcm; key={'zz' * 32}"))  # type: ignore[arg-type]


def test_the_core_takes_an_offer_and_writes_the_101_before_the_switch() -> None:
    c = core()
    link = FakeLink()
    s = c.open(link, ("192.0.2.7", 4000), 0.0)
    c.receive(s, upgrade_request("relay.test", KEY), 0.0)
    # The core's random bytes are all 7s: the challenge, then the relay's record secret.
    mine = b"\x07" * 32
    assert link.records == (mine, KEY)
    text = bytes(link.data)
    assert text.startswith(b"HTTP/1.1 101 ")
    assert f"{RECORDS_HEADER}: aes-256-gcm; key={mine.hex()}".encode() in text


def test_the_core_keeps_tls_without_an_offer() -> None:
    c = core()
    link = FakeLink()
    s = c.open(link, ("192.0.2.7", 4000), 0.0)
    c.receive(s, upgrade_request("relay.test"), 0.0)
    assert link.records is None and RECORDS_HEADER.encode() not in bytes(link.data)


@pytest.mark.parametrize("extra", ["malformed", "trailing"])
def test_a_bad_offer_gets_400(extra: str) -> None:
    c = core()
    link = FakeLink()
    s = c.open(link, ("192.0.2.7", 4000), 0.0)
    if extra == "malformed":
        request = upgrade_request("relay.test").replace(
            b"\r\n\r\n", f"\r\n{RECORDS_HEADER}: aes-256-gcm; key=12\r\n\r\n".encode()
        )
    else:  # TLS data right behind an offer: records were to start there
        request = upgrade_request("relay.test", KEY) + b"\x10\x00\x00\x00\x01x"
    c.receive(s, request, 0.0)
    assert bytes(link.data).startswith(b"HTTP/1.1 400 ") and link.closed
    assert not hasattr(link, "records")


# ---- over real connections ------------------------------------------------------------------


async def _pair(
    url: str, records: bool = True
) -> tuple[RelayPath, RelayPath, asyncio.Queue[bytes]]:
    a = RelayPath(KEYS[0], url, config=RelayConfig(records=records))
    b = RelayPath(KEYS[1], url, config=RelayConfig(records=records))
    got: asyncio.Queue[bytes] = asyncio.Queue()
    b.on_datagram = lambda src, data: got.put_nowait(data)
    a.start()
    b.start()
    await a.wait_connected(10)
    await b.wait_connected(10)
    return a, b, got


async def test_a_relay_path_and_the_relay_agree_on_records() -> None:
    async with running() as srv:
        a, b, got = await _pair(srv.url)
        try:
            assert a.status.records == b.status.records == "aes-256-gcm"
            writer = a._writer
            assert writer is not None
            streams = [c.stream for c in srv.connections]
            assert [s.records for s in streams if s is not None] == ["aes-256-gcm"] * 2
            # The TLS sessions are let go on both ends once records carry the data.
            assert [s.extra_info("ssl_object") for s in streams if s is not None] == [None] * 2
            assert writer.get_extra_info("ssl_object") is None
            for size in (1, 1200, 16000, 65000):
                datagram = os.urandom(size)
                a.send(b.endpoint_id, datagram)
                assert await asyncio.wait_for(got.get(), 10) == datagram
            assert await a.ping() > 0
        finally:
            await a.close()
            await b.close()


async def test_a_busy_session_reads_in_large_pieces() -> None:
    """What piles up while the receiver is busy is taken in reads of up to 1 MiB (QUIC
    above then acknowledges and transmits once for ~64 datagrams, as from a UDP
    socket); an idle session keeps 128 KiB."""
    async with running(queue_bytes=1 << 24) as srv:
        a, b, got = await _pair(srv.url)
        try:
            stream = b._writer._stream  # type: ignore[union-attr]
            pipe = stream._records
            assert len(pipe._buf) == RECEIVE_BUFFER
            b._writer.pause_reading()  # type: ignore[union-attr]
            sent = [os.urandom(16000) for _ in range(200)]  # 3.2 MB: more than the kernel buffers
            for i, datagram in enumerate(sent):
                a.send(b.endpoint_id, datagram)
                if i % 20 == 19:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            b._writer.resume_reading()  # type: ignore[union-attr]
            assert [await asyncio.wait_for(got.get(), 10) for _ in sent] == sent
            assert len(pipe._buf) == 1 << 20
        finally:
            await a.close()
            await b.close()


async def _backed_up_small_writes() -> None:
    async with running(queue_bytes=1 << 24) as srv:
        a, b, got = await _pair(srv.url)
        try:
            b._writer.pause_reading()  # type: ignore[union-attr]
            # One small datagram per event-loop pass: the relay writes each in a record
            # of its own, and most of them wait behind a full socket.
            sent = [i.to_bytes(4, "big") * 250 for i in range(8000)]
            for datagram in sent:
                a.send(b.endpoint_id, datagram)
                await asyncio.sleep(0)
            await asyncio.sleep(0.3)
            b._writer.resume_reading()  # type: ignore[union-attr]
            assert [await asyncio.wait_for(got.get(), 10) for _ in sent] == sent
            assert b.status.connects == 1 and a.status.dropped == 0
        finally:
            await a.close()
            await b.close()


async def test_records_queued_behind_a_full_socket_arrive_whole() -> None:
    await _backed_up_small_writes()


@pytest.mark.skipif(not eventloop.uvloop_available(), reason="uvloop is not installed")
def test_records_queued_behind_a_full_socket_arrive_whole_on_uvloop() -> None:
    """uvloop queues a reference to what it could not send: every record written must
    be a buffer of its own, not the pipe's reused one."""
    eventloop.run(_backed_up_small_writes(), loop="uvloop")


@pytest.mark.parametrize("side", ["client", "relay"])
async def test_either_side_can_keep_tls(side: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if side == "relay":  # a relay from before records: it does not know the header
        monkeypatch.setattr(relay_http, "records_key", lambda head: None)
    async with running() as srv:
        a, b, got = await _pair(srv.url, records=side != "client")
        try:
            assert a.status.records is None and b.status.records is None
            assert [c.stream.records for c in srv.connections if c.stream] == [None, None]
            assert all(c.stream.extra_info("ssl_object") for c in srv.connections if c.stream)
            a.send(b.endpoint_id, b"over TLS")
            assert await asyncio.wait_for(got.get(), 10) == b"over TLS"
        finally:
            await a.close()
            await b.close()


@pytest.mark.parametrize("bad", ["forged", "too long"])
async def test_a_bad_record_costs_only_that_client_its_connection(
    bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="relay")
    async with running() as srv:
        a, b, got = await _pair(srv.url)
        try:
            writer = a._writer
            assert writer is not None
            stream = writer._stream  # type: ignore[attr-defined]
            assert isinstance(stream, SecureStream) and stream.records == "aes-256-gcm"
            if bad == "forged":
                forged = AeadPipe(os.urandom(32), os.urandom(32), dialer=True).encrypt(b"x" * 40)
                stream.raw_transport().write(bytes(forged))
            else:  # announces more than RECORDS_MAX: dropped before the relay holds it
                stream.raw_transport().write(struct.pack(">I", RECORDS_MAX + 17) + b"x" * 100)

            async def reconnected() -> bool:
                return a.status.connects == 2 and a.status.state.value == "connected"

            await eventually(reconnected, timeout=20)
            assert b.status.connects == 1  # the other client never noticed
            # The relay's log says why it dropped the connection (it gave only the time).
            ends = [r.getMessage() for r in caplog.records if "disconnect" in r.getMessage()]
            assert any("error=" in e and "peer=" in e for e in ends), ends
            a.send(b.endpoint_id, b"after")
            assert await asyncio.wait_for(got.get(), 10) == b"after"
        finally:
            await a.close()
            await b.close()


def split_tls(data: bytes) -> tuple[list[int], bytes]:
    """The content types of the whole TLS records at the front of ``data``, and the rest
    (from the first bytes that are not a TLS record header: type, version 3.x, length)."""
    types, at = [], 0
    while at + 5 <= len(data) and data[at] in (20, 21, 22, 23) and data[at + 1] == 3:
        (length,) = struct.unpack_from(">H", data, at + 3)
        types.append(data[at])
        at += 5 + length
    return types, data[at:]


async def test_after_the_upgrade_only_records_cross_the_wire() -> None:
    marker = b"plaintext marker that must not be seen " * 10
    async with running() as srv:
        url = RelayUrl.parse(srv.url)
        async with tapped_proxy((url.host, url.port), upstream_only=True) as (addr, upstream):
            proxied = str(RelayUrl(url.host, addr[1], url.pin))
            a = RelayPath(KEYS[0], proxied)
            b = RelayPath(KEYS[1], srv.url)
            got: asyncio.Queue[bytes] = asyncio.Queue()
            b.on_datagram = lambda src, data: got.put_nowait(data)
            a.start()
            b.start()
            try:
                await a.wait_connected(10)
                await b.wait_connected(10)
                for _ in range(3):
                    a.send(b.endpoint_id, marker)
                    assert await asyncio.wait_for(got.get(), 10) == marker
            finally:
                await a.close()
                await b.close()
        data = bytes(upstream)
    assert marker[:24] not in data
    types, rest = split_tls(data)
    # ClientHello, then TLS 1.3's encrypted records (its Finished, the upgrade request):
    # no TLS record after those, only AES-GCM records (4-byte length + ciphertext).
    assert types[0] == 22 and types.count(23) <= 3, types
    records, at = 0, 0
    while at + 4 <= len(rest):
        (length,) = struct.unpack_from(">I", rest, at)
        assert 16 < length <= (1 << 20) + 16, (records, length)
        at += 4 + length
        records += 1
    assert records >= 4 and at == len(rest)  # AUTH, PINGs, the datagrams: all records


async def test_a_tls_handshake_that_never_comes_times_out() -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()  # never answers the ClientHello

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        app = asyncio.BufferedProtocol()
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        loop = asyncio.get_running_loop()
        _, stream = await loop.create_connection(
            lambda: SecureStream(app, ctx, server_side=False, handshake_timeout=0.3),
            "127.0.0.1",
            port,
        )
        with pytest.raises(TimeoutError, match=r"TLS handshake not done within 0\.3 s"):
            await asyncio.wait_for(stream.handshake, 10)
        await asyncio.sleep(0)
        assert stream.is_closing()
        with pytest.raises(RecordError, match="after the TLS handshake"):
            stream.start_records(
                os.urandom(32), os.urandom(32), dialer=True, info=b"x aes-256-gcm", max_record=99
            )
    finally:
        server.close()


class Collector(asyncio.BufferedProtocol):
    """An app protocol that keeps what it is handed and notes the end."""

    def __init__(self, pause_at_first: bool = False) -> None:
        self.pause_at_first = pause_at_first
        self.data = bytearray()
        self.buf = bytearray(1000)
        self.eof = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        self.data += self.buf[:nbytes]
        if self.pause_at_first and self.transport is not None:
            self.pause_at_first = False
            self.transport.pause_reading()  # the rest of what came waits in the stream

    def eof_received(self) -> None:
        if not self.eof.done():
            self.eof.set_result(bytes(self.data))


@pytest.mark.parametrize("records", [False, True])
async def test_a_paused_app_gets_the_rest_and_then_the_end_once_it_resumes(
    records: bool,
) -> None:
    """The peer sends and closes; the app pauses reading after the first piece: nothing
    more is handed over, nor the end, until it resumes; then every byte, then the end."""
    me = TlsIdentity(SecretKey.from_seed("securestream eof seed", 0))
    them = TlsIdentity(SecretKey.from_seed("securestream eof seed", 1))
    loop = asyncio.get_running_loop()
    server_app = Collector(pause_at_first=True)
    streams: list[SecureStream] = []

    def accept() -> SecureStream:
        streams.append(
            SecureStream(
                server_app, them.server_context(me.cert_der), server_side=True, handshake_timeout=10
            )
        )
        return streams[0]

    server = await loop.create_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client_app = Collector()
    try:
        _, client = await loop.create_connection(
            lambda: SecureStream(
                client_app, me.client_context(), server_side=False, handshake_timeout=10
            ),
            "127.0.0.1",
            port,
        )
        await asyncio.wait_for(client.handshake, 10)
        await eventually(lambda: _true(server_app.transport is not None), timeout=10)
        a, b = os.urandom(32), os.urandom(32)
        if records:
            client.start_records(a, b, dialer=True, info=b"t aes-256-gcm", max_record=1000)
            streams[0].start_records(b, a, dialer=False, info=b"t aes-256-gcm", max_record=1000)
        else:
            client.keep_tls()
            streams[0].keep_tls()
        assert server_app.transport is not None
        payload = os.urandom(50_000)
        client.write(payload)
        client.raw_transport().write_eof()  # a FIN right behind the data
        await eventually(lambda: _true(len(server_app.data) > 0), timeout=10)
        await asyncio.sleep(0.3)
        assert not server_app.eof.done() and len(server_app.data) < len(payload)
        server_app.transport.resume_reading()
        assert await asyncio.wait_for(server_app.eof, 10) == payload
    finally:
        server.close()


async def _true(value: bool) -> bool:
    return value
