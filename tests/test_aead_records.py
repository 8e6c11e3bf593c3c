"""AES-256-GCM records after the TLS handshake (p2pdist/transport/aeadpipe.py): the record
codec on its own, and over real TCP connections: both ends agree to them, either end can
decline (TLS records then), the bytes on the wire carry no plaintext, and a record that
does not decrypt ends the connection naming the peer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import AsyncIterator

import pytest
from test_tcp_transport import eid, key, tcp_pair
from transport_conformance import bounded, closing

from p2pdist.errors import ConnectionBrokenError
from p2pdist.transport import TcpTransport, TransportConfig, aeadpipe
from p2pdist.transport.aeadpipe import MAX_RECORD, TAG, AeadPipe, RecordError
from p2pdist.wire.frames import FrameKind, encode_header

A, B = os.urandom(32), os.urandom(32)


def pair() -> tuple[AeadPipe, AeadPipe]:
    """Two ends of one connection: each sends under its own secret."""
    return AeadPipe(A, B), AeadPipe(B, A)


def read_all(pipe: AeadPipe, size: int = 1 << 16) -> bytes:
    out = bytearray()
    buf = memoryview(bytearray(size))
    while pipe.readable:
        n = pipe.read_into(buf)
        out += buf[:n]
    return bytes(out)


# ---- the codec ---------------------------------------------------------------------------------


@pytest.mark.parametrize("read_size", [7, 1 << 16, 3 << 20])
def test_records_round_trip_whatever_the_sizes(read_size: int) -> None:
    """Parts of any size (empty, one byte, over MAX_RECORD) come out in order, fed a few
    bytes at a time or whole, read into buffers smaller or larger than a record."""
    tx, rx = pair()
    parts = [b"", b"x", os.urandom(1000), os.urandom(MAX_RECORD + 5), os.urandom(300_000)]
    wire = b"".join(bytes(tx.encrypt(p)) for p in parts)
    assert len(wire) == sum(map(len, parts)) + 5 * (TAG + 4)  # records: 0 + 1 + 1 + 2 + 1
    got = bytearray()
    for i in range(0, len(wire), 50_003):
        rx.feed(wire[i : i + 50_003])
        got += read_all(rx, read_size)
    assert bytes(got) == b"".join(parts)
    assert rx.buffered == 0 and not rx.readable


def test_one_encrypt_call_with_several_parts_is_several_records() -> None:
    tx, rx = pair()
    header, payload = b"h" * 16, os.urandom(5000)
    rx.feed(tx.encrypt(header, payload))
    first = memoryview(bytearray(16))
    assert rx.read_into(first) == 16 and bytes(first) == header  # a record per part
    assert read_all(rx) == payload


def test_a_partial_record_waits_for_the_rest() -> None:
    tx, rx = pair()
    wire = bytes(tx.encrypt(b"hello"))
    rx.feed(wire[:-1])
    assert not rx.readable and rx.read_into(memoryview(bytearray(10))) == 0
    rx.feed(wire[-1:])
    assert read_all(rx) == b"hello"


@pytest.mark.parametrize("damage", ["flip", "replay", "reorder", "reflect", "length"])
def test_a_record_that_is_not_the_next_authentic_one_breaks_the_stream(damage: str) -> None:
    tx, rx = pair()
    one, two = bytes(tx.encrypt(b"first")), bytes(tx.encrypt(b"second"))
    if damage == "flip":
        wire = one[:-3] + bytes([one[-3] ^ 1]) + one[-2:]
    elif damage == "replay":
        wire = one + one
    elif damage == "reorder":
        wire = two + one
    elif damage == "reflect":  # our own record sent back to us
        wire = bytes(rx.encrypt(b"mine"))
    else:  # the authenticated length changed, the record padded to match
        wire = struct.pack(">I", len(one) - 4 + 1) + one[4:] + b"\0"
    rx.feed(wire)
    buf = memoryview(bytearray(64))
    with pytest.raises(RecordError, match="does not decrypt"):
        while rx.readable:
            rx.read_into(buf)


@pytest.mark.parametrize("length", [0, TAG, MAX_RECORD + TAG + 1, 2**32 - 1])
def test_a_record_length_out_of_bounds_is_refused_before_waiting_for_it(length: int) -> None:
    _, rx = pair()
    rx.feed(struct.pack(">I", length))
    assert rx.readable  # so that the reader learns at once, not after 4 GiB
    with pytest.raises(RecordError, match="at most"):
        rx.read_into(memoryview(bytearray(64)))


def test_keys_move_on_every_rekey_records_on_both_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past REKEY_RECORDS records both ends move to the next key together; a record made
    under the old key after that point does not decrypt."""
    monkeypatch.setattr(aeadpipe, "REKEY_RECORDS", 3)
    tx, rx = pair()
    keys = []
    for i in range(10):
        rx.feed(tx.encrypt(b"%d" % i))
        assert read_all(rx) == b"%d" % i
        keys.append(tx._tx.key)
    assert len(set(keys)) == 4 and rx._rx.key == tx._tx.key  # keys 0..3 for 10 records
    stale, _ = pair()  # record 10 under key 0 instead of key 3 (whose record 1 it is)
    stale._tx.seq = 1
    rx.feed(stale.encrypt(b"late"))
    with pytest.raises(RecordError):
        rx.read_into(memoryview(bytearray(16)))


def test_whole_records_waiting_while_reading_is_paused_get_room() -> None:
    """More whole records than the buffer holds (a paused reader): the buffer grows,
    nothing is lost."""
    tx, rx = pair()
    parts = [os.urandom(MAX_RECORD) for _ in range(5)]
    for p in parts:
        rx.feed(tx.encrypt(p))
    assert rx.buffered == 5 * (MAX_RECORD + TAG + 4)
    assert read_all(rx, 1 << 20) == b"".join(parts)


# ---- over TCP ---------------------------------------------------------------------------------


async def test_tls_connections_move_to_aes_gcm_records_by_default() -> None:
    async with tcp_pair(True) as p:
        assert p.client.record_protection == p.server.record_protection == "aes-256-gcm"
        assert p.client.tls_object is not None and p.client.tls_object.version() == "TLSv1.3"
        payload = os.urandom(3 << 20)
        await p.client.send(1, payload)
        await p.server.send(2, b"back")
        assert bytes((await bounded(p.server.recv(1), "big")).payload) == payload
        assert bytes((await bounded(p.client.recv(2), "small")).payload) == b"back"


@pytest.mark.parametrize("declines", ["client", "server"])
async def test_either_end_can_keep_tls_records(declines: str) -> None:
    """An end with sealed_records=False (or a version without them) neither offers nor
    accepts them: both ends stay on TLS records and still talk."""
    cfg = {"client": TransportConfig(sealed_records=False), "server": TransportConfig()}
    if declines == "server":
        cfg = {"client": TransportConfig(), "server": TransportConfig(sealed_records=False)}
    client_t, server_t = TcpTransport(key(0), cfg["client"]), TcpTransport(key(1), cfg["server"])
    async with closing(client_t, server_t):
        addr = await server_t.listen("127.0.0.1", 0)
        client = await bounded(client_t.connect(server_t.endpoint_id, addr), "connect")
        server = await bounded(server_t.accept(), "accept")
        assert client.record_protection == server.record_protection == "tls"  # type: ignore[attr-defined]
        await client.send(1, b"x" * 100_000)
        assert len((await bounded(server.recv(1), "recv")).payload) == 100_000


@contextlib.asynccontextmanager
async def tapped_proxy(target: tuple[str, int]) -> AsyncIterator[tuple[tuple[str, int], bytearray]]:
    """A loopback TCP proxy to ``target`` that records every byte it forwards."""
    seen = bytearray()

    async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(1 << 16):
                seen.extend(data)
                w.write(data)
                await w.drain()
        w.close()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        tr, tw = await asyncio.open_connection(*target)
        await asyncio.gather(pump(r, tw), pump(tr, w))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2], seen
    finally:
        server.close()


async def test_no_plaintext_crosses_the_wire() -> None:
    """A marker in the frames (small and large, both ways) never appears in the bytes
    between the peers; the same bytes do appear in plaintext mode (the tap works)."""
    marker = b"p2pdist-plaintext-marker-" + os.urandom(8).hex().encode()
    for tls, expect_seen in ((True, False), (False, True)):
        cfg = TransportConfig(tls=tls)
        client_t, server_t = TcpTransport(key(0), cfg), TcpTransport(key(1), cfg)
        async with closing(client_t, server_t):
            addr = await server_t.listen("127.0.0.1", 0)
            async with tapped_proxy(addr) as (via, seen):
                client = await bounded(client_t.connect(eid(1), via), "connect")
                server = await bounded(server_t.accept(), "accept")
                big = os.urandom(1 << 20) + marker + os.urandom(1 << 20)
                await client.send(1, marker)
                await client.send(1, big)
                await server.send(2, marker)
                assert bytes((await bounded(server.recv(1), "small")).payload) == marker
                assert bytes((await bounded(server.recv(1), "big")).payload) == big
                assert bytes((await bounded(client.recv(2), "back")).payload) == marker
                assert len(seen) > len(big)
                assert (marker in seen) is expect_seen


async def test_a_record_that_does_not_decrypt_ends_the_connection_naming_the_peer() -> None:
    """Frames in the records before the bad one are delivered, then the connection ends as
    broken on both ends, the reader's error naming the peer."""
    async with tcp_pair(True) as p:
        assert isinstance(p.client._tls, AeadPipe) and p.client._transport is not None
        good = p.client._tls.encrypt(encode_header(FrameKind.DATA, 1, 0, b"", 5) + b"hello")
        forged = bytes(AeadPipe(os.urandom(32), os.urandom(32)).encrypt(b"forged"))
        p.client._transport.write(bytes(good) + forged)
        assert bytes((await bounded(p.server.recv(1), "the good frame")).payload) == b"hello"
        with pytest.raises(ConnectionBrokenError, match=r"bad record: .*does not decrypt") as err:
            await bounded(p.server.recv(1), "the server noticing")
        assert eid(0).short() in str(err.value)
        with pytest.raises(ConnectionBrokenError):
            await bounded(p.client.recv(1), "the client learning the connection ended")
