"""The relay's in-place receive path: frames parsed straight from a scratch buffer that is
reused after every read (:class:`~p2pdist.wire.relay.RelayFrameSplitter`, the core fed
views, and the server's shared-buffer protocol), checked against the copying decoder on
any bytes split at any points, and checked to keep nothing of the scratch."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pdist import eventloop
from p2pdist.identity import SecretKey
from p2pdist.wire.relay import (
    MAX_DATAGRAM,
    RelayFrameDecoder,
    RelayFrameSplitter,
    RelayFrameType,
    RelayProtocolError,
    append_addressed,
    auth_message,
    encode_addressed,
    encode_frame,
    upgrade_request,
)
from relay.config import RelayConfig
from relay.server import RelayServer, _ClientConnection
from relay.state import CoreConfig, RelayCore
from relay.testclient import RelayTestClient

T = RelayFrameType
FP = bytes(range(32))
KEYS = [SecretKey.from_seed("relay in-place tests seed", r) for r in range(4)]
A, B, C = KEYS[:3]
MAX = 300  # max_body in the codec properties, so frames straddle reads often

_frame = st.builds(
    lambda kind, length, body: bytes([kind]) + length.to_bytes(4, "big") + body[:length],
    st.sampled_from([int(t) for t in T]),
    st.integers(0, MAX),
    st.binary(min_size=MAX, max_size=MAX),
)
_bad = st.builds(
    lambda kind, length, body: bytes([kind]) + length.to_bytes(4, "big") + body,
    st.sampled_from([int(t) for t in T] + [0, 0x05, 0x13, 0xFF]),
    st.one_of(st.integers(0, MAX + 2), st.integers(0, 2**32 - 1)),
    st.binary(max_size=MAX + 2),
)
_streams = st.one_of(
    st.lists(_frame, max_size=12).map(b"".join),
    st.lists(st.one_of(_frame, _bad), min_size=1, max_size=8).map(b"".join),
    st.binary(max_size=2000),
)


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def _reference(data: bytes, max_body: int) -> tuple[list[tuple[T, bytes]], bool]:
    """Every frame in ``data`` in front of the first bad header, and whether one exists."""
    dec = RelayFrameDecoder(max_body)
    out: list[tuple[T, bytes]] = []
    try:
        for i in range(len(data)):
            out += dec.feed(data[i : i + 1])
    except RelayProtocolError:
        return out, True
    return out, False


def _split_in_scratch(
    splitter: RelayFrameSplitter, scratch: bytearray, chunk: bytes
) -> list[tuple[T, bytes]]:
    """Receive ``chunk`` into ``scratch`` the way the server does, then clobber it."""
    scratch[: len(chunk)] = chunk
    try:
        with memoryview(scratch) as view:
            return [(k, bytes(b)) for k, b in splitter.frames(view[: len(chunk)])]
    finally:
        scratch[:] = b"\xaa" * len(scratch)


@settings(max_examples=400, deadline=None)
@given(data=_streams, cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_splitter_yields_what_the_decoder_yields(data: bytes, cuts: list[int]) -> None:
    chunks = _chunks(data, cuts)
    dec, splitter = RelayFrameDecoder(MAX), RelayFrameSplitter(MAX)
    scratch = bytearray(len(data) + 8)
    want: list[tuple[T, bytes]] = []
    got: list[tuple[T, bytes]] = []
    dec_failed = split_failed = None
    for i, chunk in enumerate(chunks):
        try:
            want += dec.feed(chunk)
        except RelayProtocolError:
            dec_failed = i
        try:
            scratch[: len(chunk)] = chunk
            with memoryview(scratch) as view:
                for kind, body in splitter.frames(view[: len(chunk)]):
                    got.append((kind, bytes(body)))
        except RelayProtocolError:
            split_failed = i
        scratch[:] = b"\xaa" * len(scratch)  # the next read overwrites the scratch
        assert dec_failed == split_failed
        if dec_failed is not None:
            break
        assert got == want
        assert splitter.pending == dec.pending
    reference, bad = _reference(data, MAX)
    assert bad == (dec_failed is not None)
    # On a bad header the decoder drops the good frames of that same read; the splitter
    # has handed them over already, in order, and nothing after the bad header.
    assert got == reference
    assert got[: len(want)] == want
    if split_failed is not None:
        with pytest.raises(RelayProtocolError):
            list(splitter.frames(b"\x20\0\0\0\x08" + bytes(8)))  # refused from now on


def test_splitter_lets_go_of_a_completed_frame() -> None:
    frame = encode_frame(T.PING, b"12345678")
    s = RelayFrameSplitter()
    for i in range(len(frame)):  # byte by byte: every header and body split point
        got = [(k, bytes(b)) for k, b in s.frames(frame[i : i + 1])]
        assert s.pending == (0 if i == len(frame) - 1 else i + 1)
    assert got == [(T.PING, b"12345678")]
    # A held body view does not stop the splitter from taking the next bytes.
    views = [b for _, b in s.frames(frame[:3])]
    views += [b for _, b in s.frames(frame[3:] + frame)]
    assert [bytes(v) for v in views] == [b"12345678"] * 2
    # Stopping early is allowed (the connection is being closed).
    for _ in s.frames(frame * 3):
        break


def test_splitter_with_a_bad_partial_header_fails_when_it_completes() -> None:
    s = RelayFrameSplitter(100)
    assert list(s.frames(b"\x10\0\0")) == []
    with pytest.raises(RelayProtocolError, match="exceeds 100"):
        list(s.frames(b"\x01\x00"))
    with pytest.raises(RelayProtocolError):
        list(s.frames(encode_frame(T.PING, bytes(8))))


@given(st.binary(max_size=3000))
def test_append_addressed_matches_encode_addressed(datagram: bytes) -> None:
    out = bytearray(b"prefix")
    append_addressed(out, T.RECV, bytes(A.endpoint_id), memoryview(datagram))
    assert bytes(out) == b"prefix" + encode_addressed(T.RECV, A.endpoint_id, datagram)
    with pytest.raises(ValueError):
        append_addressed(bytearray(), T.SEND, bytes(32), bytes(MAX_DATAGRAM + 1))


# ---- the core fed views of a reused scratch -------------------------------------------


class FakeLink:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytearray) -> None:
        assert not self.closed
        self.data += data

    def buffered(self) -> int:
        return 0

    def close(self) -> None:
        self.closed = True

    def secure(self, records: tuple[bytes, bytes] | None) -> None:
        self.records = records

    def pause(self, seconds: float) -> None:
        pass

    def frames(self) -> list[tuple[T, bytes]]:
        end = self.data.find(b"\r\n\r\n")
        return RelayFrameDecoder().feed(bytes(self.data[end + 4 :]))


def _auth(key: SecretKey) -> bytes:
    raw = bytes(key.endpoint_id)
    return encode_frame(T.AUTH, raw + key.sign(auth_message(FP, b"\x07" * 32, raw)))


def _core() -> RelayCore:
    return RelayCore(CoreConfig(queue_bytes=1 << 24), [FP], random_bytes=lambda n: b"\x07" * n)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(0, MAX_DATAGRAM), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=10),
)
def test_core_forwards_exactly_what_was_sent_from_a_reused_scratch(
    sizes: list[int], cuts: list[int]
) -> None:
    c = _core()
    links = {k: FakeLink() for k in (A, B)}
    sessions = {k: c.open(links[k], ("192.0.2.1", 1), 0.0) for k in (A, B)}
    for k in (A, B):
        c.receive(sessions[k], upgrade_request("relay.test") + _auth(k), 0.0)
    datagrams = [random.Random(n).randbytes(n) for n in sizes]
    stream = b"".join(encode_addressed(T.SEND, B.endpoint_id, d) for d in datagrams)
    stream += encode_frame(T.PING, b"pingpong")
    scratch = bytearray(len(stream))
    for chunk in _chunks(stream, cuts):
        scratch[: len(chunk)] = chunk
        with memoryview(scratch) as view:
            c.receive(sessions[A], view[: len(chunk)], 1.0)
        scratch[:] = b"\xaa" * len(scratch)
        scratch.append(0)  # resizable again: the core keeps no view of the scratch
        del scratch[-1]
    got = links[B].frames()[2:]  # after CHALLENGE and AUTH_OK
    assert got == [(T.RECV, bytes(A.endpoint_id) + d) for d in datagrams]
    assert links[A].frames()[2:] == [(T.PONG, b"pingpong")]
    assert sessions[A].splitter.pending == 0


# ---- the server glue: one scratch for every connection --------------------------------


class FakeTransport(asyncio.Transport):
    """Records writes; ``on_close`` runs inside close(), as asyncio's TLS flush does."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.data = bytearray()
        self.closing = False
        self.port = port
        self.on_close: Any = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("192.0.2.9", self.port) if name == "peername" else default

    def write(self, data: Any) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True
        if self.on_close is not None:
            self.on_close()

    def abort(self) -> None:
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0

    def frames(self) -> list[tuple[T, bytes]]:
        end = self.data.find(b"\r\n\r\n")
        return RelayFrameDecoder().feed(bytes(self.data[end + 4 :]))


def _deliver(conn: _ClientConnection, data: bytes, server: RelayServer) -> None:
    """One read, the way a TLS transport hands it over; then nothing may hold the
    scratch (a resize would fail) and its old bytes are overwritten."""
    buf = conn.get_buffer(-1)
    assert len(data) <= len(buf), f"one read holds at most {len(buf)} bytes here"
    buf[: len(data)] = data
    del buf
    conn.buffer_updated(len(data))
    server.scratch.append(0)
    del server.scratch[-1]
    server.scratch[:] = b"\xbb" * len(server.scratch)


def _server(tap: Any = None) -> RelayServer:
    server = RelayServer(RelayConfig(host="127.0.0.1", port=0, stun_port=0), tap=tap)
    server._core = _core()
    return server


class FakeStream:
    """The SecureStream under a connection, as far as these tests go: TLS throughout."""

    records_in = 0
    small_reads_in = 0
    bytes_in = 0
    failure = None

    def keep_tls(self) -> None:
        pass


def _connect(server: RelayServer, port: int) -> tuple[_ClientConnection, FakeTransport]:
    conn, transport = _ClientConnection(server), FakeTransport(port)
    conn.stream = FakeStream()  # type: ignore[assignment]
    conn.connection_made(transport)
    return conn, transport


async def test_connections_share_one_scratch_and_keep_nothing_of_it() -> None:
    seen: list[bytes] = []
    server = _server(tap=lambda conn, direction, data: seen.append(data))
    (ca, _), (cb, tb) = _connect(server, 1), _connect(server, 2)
    assert ca.get_buffer(-1).obj is server.scratch and cb.get_buffer(-1).obj is server.scratch
    for conn, key in ((ca, A), (cb, B)):
        _deliver(conn, upgrade_request("relay.test"), server)
        _deliver(conn, _auth(key), server)
    big = bytes(range(256)) * 200
    frame = encode_addressed(T.SEND, B.endpoint_id, big)
    _deliver(ca, frame[:1000], server)  # a frame straddling three reads
    _deliver(ca, frame[1000:30000], server)
    _deliver(ca, frame[30000:] + encode_addressed(T.SEND, B.endpoint_id, b"small"), server)
    assert tb.frames()[2:] == [
        (T.RECV, bytes(A.endpoint_id) + big),
        (T.RECV, bytes(A.endpoint_id) + b"small"),
    ]
    assert b"".join(seen).count(big[:1000]) >= 2  # the tap got copies, in and out
    assert all(isinstance(x, bytes) for x in seen)
    assert ca.get_buffer(-1).obj is server.scratch  # nothing left behind turns reads private


async def test_a_close_that_reads_during_another_receive_does_not_touch_the_scratch() -> None:
    server = _server()
    (cx, tx), (cc, tc), (cy, _) = (_connect(server, p) for p in (1, 2, 3))
    for conn, key in ((cx, A), (cc, C)):
        _deliver(conn, upgrade_request("relay.test"), server)
        _deliver(conn, _auth(key), server)
    nested: list[bool] = []

    def flush_on_close() -> None:  # asyncio's TLS reads what it holds while closing
        buf = cx.get_buffer(-1)
        nested.append(buf.obj is server.scratch)
        garbage = encode_addressed(T.SEND, C.endpoint_id, b"from the old session") * 50
        buf[: len(garbage)] = garbage
        del buf
        cx.buffer_updated(len(garbage))

    tx.on_close = flush_on_close
    _deliver(cy, upgrade_request("relay.test"), server)
    # AUTH as A (replacing cx, whose close reads) and a datagram, in one read (small:
    # a read before AUTH_OK holds about 2 KiB).
    _deliver(cy, _auth(A) + encode_addressed(T.SEND, C.endpoint_id, b"Y" * 1500), server)
    assert tc.frames()[2:] == [(T.RECV, bytes(A.endpoint_id) + b"Y" * 1500)]
    assert nested == [False]
    assert (T.ERROR, b"replaced by a newer connection from the same endpoint") in tx.frames()


# ---- a real relay on both loops: every size, every split -------------------------------


async def _round_trip_many_sizes() -> None:
    server = RelayServer(RelayConfig(host="127.0.0.1", port=0, stun_port=0, queue_bytes=1 << 24))
    await server.start()
    try:
        a = await RelayTestClient.open(server.url)
        await a.authenticate(A)
        b = await RelayTestClient.open(server.url)
        await b.authenticate(B)
        rng = random.Random(7)
        sizes = [0, 1, 31, 1200, 16000, 16384 - 37, 16384, MAX_DATAGRAM] + [
            rng.randrange(MAX_DATAGRAM + 1) for _ in range(40)
        ]
        datagrams = [rng.randbytes(n) for n in sizes]
        for d in datagrams:
            a.send(B.endpoint_id, d)
        await asyncio.wait_for(a.drain(), 30)
        for d in datagrams:
            assert await b.recv() == (bytes(A.endpoint_id), d)
        await a.close()
        await b.close()
    finally:
        await asyncio.wait_for(server.close(), 30)


async def test_datagrams_of_every_size_arrive_whole_on_asyncio() -> None:
    await _round_trip_many_sizes()


@pytest.mark.skipif(not eventloop.uvloop_available(), reason="uvloop is not installed")
def test_datagrams_of_every_size_arrive_whole_on_uvloop() -> None:
    eventloop.run(_round_trip_many_sizes(), loop="uvloop")
