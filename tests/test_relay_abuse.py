"""Clients that abuse the relay below what its protocol forwards: TLS key updates asked
for by a client that reads nothing (each answer is a TLS record the relay must send,
which no queue_bytes check saw, so the relay's memory grew without end; the client is
Python's ssl on a raw socket, with OpenSSL's SSL_key_update reached through ctypes,
skipped where that cannot be done safely), and floods of frames the relay parses and
ignores (which its rate limit did not see). In-process relay on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import hashlib
import logging
import socket
import ssl
import struct
import time
from typing import Any

import pytest
from relay_helpers import running_relay as running

from p2pdist.identity import SecretKey
from p2pdist.wire.relay import (
    MAX_BODY,
    PING_LEN,
    RelayFrameType,
    auth_message,
    encode_addressed,
    encode_frame,
    upgrade_request,
)
from relay.state import MIN_READ
from relay.testclient import RelayTestClient

TLS1_3_VERSION = 0x0304
MIN_QUEUE = MAX_BODY + 5  # the least queue_bytes (one frame)


def _libssl() -> Any:
    """The libssl that Python's ssl module is linked against (as loaded in this process)."""
    import _ssl

    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libssl" in line and _ssl.__file__ is not None:
                return ctypes.CDLL(line.split()[-1])
    return None


def _ssl_pointer(obj: ssl.SSLObject, lib: Any) -> int | None:
    """The ``SSL *`` behind ``obj`` (PySSLSocket: object head, socket, then the SSL
    pointer), or None unless OpenSSL confirms it is a TLS 1.3 session."""
    inner = obj._sslobj  # type: ignore[attr-defined]
    ptr = ctypes.c_void_p.from_address(id(inner) + 24).value
    if not ptr:
        return None
    lib.SSL_version.argtypes = [ctypes.c_void_p]
    return ptr if lib.SSL_version(ptr) == TLS1_3_VERSION else None


class RawTls:
    """A TLS client on a blocking loopback socket, through Python's ssl with memory BIOs
    (so the test decides what goes out in which record); the relay's pin is not checked
    (not what these tests are about)."""

    def __init__(self, port: int, *, small_receive_buffer: bool = False) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing)
        self.sock = socket.socket()
        if small_receive_buffer:  # the relay's answers pile up at its end sooner
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", port))
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self.outgoing.read())
                self.incoming.write(self.sock.recv(65536))
        self.flush()

    def flush(self) -> int:
        """Send what TLS has written; the bytes sent."""
        data = self.outgoing.read()
        self.sock.sendall(data)
        return len(data)

    def authenticate(self, port: int, key: SecretKey) -> None:
        """Upgrade (no records offered: TLS carries the frames) and authenticate."""
        cert = self.obj.getpeercert(binary_form=True)
        assert cert is not None
        self.obj.write(upgrade_request(f"127.0.0.1:{port}"))
        self.flush()
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += self.read(1)
        _, size = struct.unpack(">BI", self.read(5))
        challenge = self.read(size)[1:]  # (version byte, then the challenge)
        me = bytes(key.endpoint_id)
        proof = key.sign(auth_message(hashlib.sha256(cert).digest(), challenge, me))
        self.obj.write(encode_frame(RelayFrameType.AUTH, me + proof))
        self.flush()
        kind, size = struct.unpack(">BI", self.read(5))
        self.read(size)
        assert kind == RelayFrameType.AUTH_OK

    def read(self, n: int) -> bytes:
        """``n`` bytes of plaintext (blocking)."""
        got = b""
        while len(got) < n:
            try:
                got += self.obj.read(n - len(got))
            except ssl.SSLWantReadError:
                self.incoming.write(self.sock.recv(65536))
        return got


def _ask_key_updates_and_never_read(port: int, limit: int) -> int:
    """Complete TLS, upgrade and authenticate (TLS carries the frames: no records), then
    ask for key updates (30 at a time, an empty PONG frame between, as OpenSSL refuses
    more in a row) without ever reading; return the bytes sent before the relay dropped
    us (``limit`` if it never did)."""
    lib = _libssl()
    if lib is None:
        pytest.skip("libssl is not loaded in this process")
    tls = RawTls(port, small_receive_buffer=True)
    obj = tls.obj
    with tls.sock:
        tls.authenticate(port, SecretKey.from_seed("relay abuse tests", 2))
        ptr = _ssl_pointer(obj, lib)
        if ptr is None:
            pytest.skip("cannot reach OpenSSL's SSL object from Python's ssl here")
        lib.SSL_key_update.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.SSL_do_handshake.argtypes = [ctypes.c_void_p]
        sent = 0
        pong = encode_frame(RelayFrameType.PONG, b"")
        try:
            while sent < limit:
                for _ in range(30):
                    assert lib.SSL_key_update(ptr, 1) == 1  # 1: update_requested
                    lib.SSL_do_handshake(ptr)
                obj.write(pong)
                sent += tls.flush()
        except OSError:  # reset, or a broken pipe: dropped
            return sent
    return limit


async def test_a_client_asking_key_updates_without_reading_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="relay.server")
    async with running(queue_bytes=MIN_QUEUE) as srv:
        # the relay may queue MIN_QUEUE + TLS_SLACK (about 320 KiB) beyond the kernel's
        # socket buffers (a few MiB): 32 MiB sent is far beyond
        limit = 32 << 20
        sent = await asyncio.to_thread(_ask_key_updates_and_never_read, srv.port, limit)
        assert sent < limit, "the relay kept answering a client that reads nothing"
        assert any("client_not_reading" in r.getMessage() for r in caplog.records)
        async with asyncio.timeout(10):  # (the core hears of the loss in a later pass)
            while srv.core.clients:  # noqa: ASYNC110 - polling the core's own count
                await asyncio.sleep(0.01)


async def test_a_client_flooding_frames_the_relay_ignores_is_held_to_its_rate() -> None:
    """PONG frames cost the relay a parse each and forward nothing; its rate limit only
    charged SEND bodies, so a client sending them as fast as it could had the relay
    read and parse megabytes a second (a core) at any rate setting. Every byte is
    charged now, reads are at most what the bucket holds, and reading a client over its
    rate pauses: the relay reads what the rate allows, and the client stays connected."""
    rate, burst = 50_000, MAX_BODY + 5
    async with running(rate=rate, burst=burst) as srv:
        flooder = await RelayTestClient.open(srv.url)
        await flooder.authenticate(SecretKey.from_seed("relay abuse tests", 0))
        pongs = encode_frame(RelayFrameType.PONG, b"p" * PING_LEN) * 1000
        loop = asyncio.get_running_loop()
        metrics = srv.core.metrics
        start, read_before = loop.time(), metrics.bytes_in_total
        while loop.time() - start < 2.0:
            flooder.send_raw(pongs)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(flooder.drain(), 0.1)
        took = loop.time() - start
        read = metrics.bytes_in_total - read_before
        # the burst, the rate, and a read of MIN_READ when the bucket held less (twice)
        assert read <= burst + rate * took + 2 * MIN_READ, (read, took)
        assert metrics.rate_paused_total > 0 and srv.core.clients == 1
        flooder.writer.transport.abort()


def _send_head_a_byte_per_record(port: int, records: int) -> None:
    """Complete TLS, send ``records`` one-byte TLS records of a request head, then wait
    (at most 30 s) until the relay closes the connection."""
    tls = RawTls(port)
    with tls.sock:
        head = b"GET /relay HTTP/1.1\r\nX-Padding: " + b"a" * 6000
        with contextlib.suppress(OSError):  # reset once the relay gave up: that is all
            for i in range(records):
                tls.obj.write(head[i : i + 1])
                tls.flush()
            while tls.sock.recv(65536):
                pass


async def test_a_request_head_a_byte_per_tls_record_is_cut_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each TLS record before the upgrade is settled goes through the relay's Python on
    its own: a client sending its head one byte per record cost the relay a core
    (7 us a record, 8 KiB of head per connection, then the next connection). A real
    client needs one or two records; the relay reads 64 and drops the client at the
    65th, saying so."""
    caplog.set_level(logging.WARNING, logger="relay.server")
    async with running() as srv:
        await asyncio.to_thread(_send_head_a_byte_per_record, srv.port, 200)
        assert srv.core.metrics.bytes_in_total == 64  # one byte a record, 64 records
        assert any("early_records" in r.getMessage() for r in caplog.records)
        client = await RelayTestClient.open(srv.url)  # others still get in
        await client.authenticate(SecretKey.from_seed("relay abuse tests", 1))
        await client.close()


async def test_a_replaced_connection_with_a_full_queue_is_aborted_not_flushed() -> None:
    """A client that never reads, its queue filled by another, is replaced by a newer
    connection with its id, again and again: each old connection, holding its queue,
    used to stay open for the 5 s close grace outside every cap (0.7 MiB each, found by
    an audit). With more than 64 KiB queued, the relay gives it half a second."""
    from relay.connection import CLOSE_BUSY_GRACE, CLOSE_FLUSH_MAX
    from relay.session import Phase

    x_key, y_key = (SecretKey.from_seed("relay abuse tests", i) for i in (5, 6))
    async with running() as srv:
        y = await RelayTestClient.open(srv.url)
        await y.authenticate(y_key)
        kept = []
        for _ in range(3):
            x = await RelayTestClient.open(srv.url)
            kept.append(x)
            x.writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await x.authenticate(x_key)  # replaces the one before, whose queue is full
            session = srv.core.client(x_key.endpoint_id)
            assert session is not None
            for _ in range(400):  # fill its queue: it never reads
                if session.queued() > 4 * CLOSE_FLUSH_MAX:
                    break
                for _ in range(16):
                    y.send(x_key.endpoint_id, b"z" * 60000)
                await y.drain()
                await asyncio.sleep(0.01)
            assert session.queued() > 4 * CLOSE_FLUSH_MAX
        await asyncio.sleep(CLOSE_BUSY_GRACE + 0.5)
        closed = [c for c in srv.connections if c._session.phase is Phase.CLOSED]
        assert sum(c.buffered() for c in closed) <= len(closed) * CLOSE_FLUSH_MAX, [
            c.buffered() for c in closed
        ]
        for client in [*kept, y]:
            client.writer.transport.abort()


def _pong_a_byte_per_segment(port: int, seconds: float) -> None:
    """Authenticate, then send whole PONG records, each a byte per TCP segment
    (TCP_NODELAY, a pause between bytes so that the relay reads each on its own), for
    ``seconds``."""
    tls = RawTls(port)
    with tls.sock:
        tls.authenticate(port, SecretKey.from_seed("relay abuse tests", 4))
        tls.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls.sock.settimeout(0.2)
        pong = encode_frame(RelayFrameType.PONG, b"p" * PING_LEN)
        end = time.monotonic() + seconds
        with contextlib.suppress(OSError):
            while time.monotonic() < end:
                tls.obj.write(pong)
                for byte in tls.outgoing.read():
                    if time.monotonic() >= end:
                        break
                    with contextlib.suppress(TimeoutError):  # (once the relay stops reading)
                        tls.sock.send(bytes([byte]))
                    time.sleep(0.0003)


def _one_record_a_byte_per_segment(port: int, size: int) -> int:
    """Authenticate, then send one TLS record of a ``size``-byte SEND a byte per TCP
    segment until the relay ends the connection; the bytes sent."""
    tls = RawTls(port)
    sent = 0
    with tls.sock:
        tls.authenticate(port, SecretKey.from_seed("relay abuse tests", 7))
        tls.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nobody = bytes(SecretKey.from_seed("relay abuse tests", 8).endpoint_id)
        tls.obj.write(encode_addressed(RelayFrameType.SEND, nobody, b"s" * size))
        with contextlib.suppress(OSError):
            for byte in tls.outgoing.read():
                tls.sock.send(bytes([byte]))
                sent += 1
                time.sleep(0.0003)
    return sent


async def test_a_record_sent_a_byte_per_segment_is_cut_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reads of a record still unfinished are charged only once it completes: a
    client could send the largest record a byte per segment (a pass of Python each)
    and leave before its last byte. The relay drops a client after 1024 reads under
    1 KiB without a whole record (a real one needs at most 123), saying so."""
    from relay.server import SMALL_READS_PER_RECORD

    caplog.set_level(logging.WARNING, logger="relay.server")
    async with running() as srv:
        sent = await asyncio.to_thread(_one_record_a_byte_per_segment, srv.port, 8000)
        assert sent < 8000 and sent < 2 * SMALL_READS_PER_RECORD, sent
        assert any("small_reads" in r.getMessage() for r in caplog.records)
        client = await RelayTestClient.open(srv.url)  # others still get in
        await client.authenticate(SecretKey.from_seed("relay abuse tests", 9))
        await client.close()


async def test_a_client_sending_records_a_byte_per_segment_is_charged_for_its_reads() -> None:
    """Whole records, each sent a byte per TCP segment: every byte is a socket read of
    the relay, a pass of Python (86% of a core within --rate 12500000, found by an
    audit), while the bytes and records charged stayed far below the rate. Each read
    now costs READ_CHARGE, so such a client is paused at its rate (it never was)."""
    rate, burst = 50_000, MAX_BODY + 5
    async with running(rate=rate, burst=burst) as srv:
        await asyncio.to_thread(_pong_a_byte_per_segment, srv.port, 4.0)
        assert srv.core.metrics.rate_paused_total > 0


def _pong_a_byte_per_record(port: int, seconds: float) -> None:
    """Authenticate, then send PONG frames a byte per TLS record for ``seconds``."""
    tls = RawTls(port)
    with tls.sock:
        tls.authenticate(port, SecretKey.from_seed("relay abuse tests", 3))
        pong = encode_frame(RelayFrameType.PONG, b"p" * PING_LEN)
        tls.sock.settimeout(0.2)
        end = time.monotonic() + seconds
        with contextlib.suppress(OSError):
            while time.monotonic() < end:
                for byte in pong:
                    tls.obj.write(bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    tls.flush()  # (blocks once the relay stops reading: it should)


async def test_a_client_sending_a_byte_per_record_is_charged_for_its_records() -> None:
    """After the upgrade too, each record costs the relay a pass of Python: one byte per
    record took two thirds of a core within --rate 250000 (a review of the rate change).
    Each record now costs RECORD_CHARGE bytes of the rate on top of its own."""
    rate, burst = 50_000, MAX_BODY + 5
    async with running(rate=rate, burst=burst) as srv:
        metrics = srv.core.metrics
        await asyncio.to_thread(_pong_a_byte_per_record, srv.port, 4.0)
        # bytes read after AUTH: about (burst + rate * 4 s) / (RECORD_CHARGE + 1) records
        # of a byte, plus the one read that took the bucket into debt (it pauses a
        # keepalive then); without the charge, the rate's 265 KB
        upgrade = len(upgrade_request(f"127.0.0.1:{srv.port}")) + 5 + 32 + 64  # + AUTH
        after_auth = metrics.bytes_in_total - upgrade
        assert after_auth < burst + MIN_READ, after_auth
        assert metrics.rate_paused_total > 0
