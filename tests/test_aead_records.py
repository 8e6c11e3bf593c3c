"""AES-256-GCM records after the TLS handshake (p2pdist/transport/aeadpipe.py): the record
codec on its own, and over real TCP connections: both ends agree to them, either end can
decline (TLS records then), the bytes on the wire carry no plaintext, and a record that
does not decrypt ends the connection naming the peer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import struct
from collections.abc import AsyncIterator

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand
from test_tcp_transport import eid, key, tcp_pair
from transport_conformance import bounded, closing

from p2pdist.errors import ConnectionBrokenError, PeerTimeoutError, RemoteProtocolError
from p2pdist.identity import SecretKey
from p2pdist.tls import TlsIdentity
from p2pdist.transport import TcpTransport, TransportConfig, aeadpipe, tcp_handshake
from p2pdist.transport import tcp as tcp_module
from p2pdist.transport.aeadpipe import MAX_RECORD, RECEIVE_BUFFER, TAG, AeadPipe, RecordError
from p2pdist.transport.tlspipe import TlsPipe
from p2pdist.wire.frames import FrameKind, encode_header
from p2pdist.wire.handshake import RecordReader, encode_record

A, B = os.urandom(32), os.urandom(32)


def pair() -> tuple[AeadPipe, AeadPipe]:
    """Two ends of one connection: each sends under its own secret."""
    return AeadPipe(A, B, dialer=True), AeadPipe(B, A, dialer=False)


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


def expected_records(secret: bytes, role: bytes, plaintexts: list[bytes], rekey: int) -> bytes:
    """The documented schedule (docs/protocol.md), written out on its own: key_0 from
    HKDF, the next key every ``rekey`` records, nonce = 4 zero bytes || counter."""
    info = b"p2pdist tcp records v1 aes-256-gcm " + role
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)
    out, seq = bytearray(), 0
    for p in plaintexts:
        if seq == rekey:
            update = b"p2pdist tcp records v1 key update"
            key = HKDFExpand(algorithm=hashes.SHA256(), length=32, info=update).derive(key)
            seq = 0
        header = struct.pack(">I", len(p) + TAG)
        out += header + AESGCM(key).encrypt(b"\0" * 4 + struct.pack(">Q", seq), p, header)
        seq += 1
    return bytes(out)


def test_records_follow_the_documented_key_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every record, across several key updates, is exactly what the documented schedule
    makes (so each (key, nonce) pair is used once), and the receiver takes them."""
    monkeypatch.setattr(aeadpipe, "REKEY_RECORDS", 3)
    tx, rx = pair()
    texts = [b"record %d" % i for i in range(10)]
    wire = b"".join(bytes(tx.encrypt(t)) for t in texts)
    assert wire == expected_records(A, b"dialer", texts, 3)
    rx.feed(wire)
    assert read_all(rx) == b"".join(texts)


def test_a_record_replayed_at_a_key_update_does_not_decrypt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Record 0 sent again as record REKEY_RECORDS (the first under the next key)."""
    monkeypatch.setattr(aeadpipe, "REKEY_RECORDS", 4)
    tx, rx = pair()
    records = [bytes(tx.encrypt(b"rec%d" % i)) for i in range(4)]
    rx.feed(b"".join(records))
    assert read_all(rx) == b"rec0rec1rec2rec3"
    rx.feed(records[0])
    with pytest.raises(RecordError):
        rx.read_into(memoryview(bytearray(16)))


def test_a_record_that_does_not_decrypt_leaves_no_plaintext_in_the_landing_place() -> None:
    """AES-GCM is a stream cipher: flipped ciphertext bits flip the same plaintext bits,
    and decrypt_into writes before it checks. The place must not keep them."""
    tx, rx = pair()
    wire = bytearray(tx.encrypt(b"A" * 64))
    wire[10] ^= 0xFF
    rx.feed(wire)
    place = memoryview(bytearray(b"\x11" * 64))
    with pytest.raises(RecordError):
        rx.read_into(place)
    assert bytes(place) == bytes(64)


def test_equal_secrets_are_refused() -> None:
    with pytest.raises(RecordError, match="our own"):
        AeadPipe(A, A, dialer=True)


def tls_pipes() -> tuple[TlsPipe, TlsPipe]:
    """A dialer's and an acceptor's TLS sessions, handshaken in memory."""
    me = TlsIdentity(SecretKey.from_seed("aead-cutover", 0))
    them = TlsIdentity(SecretKey.from_seed("aead-cutover", 1))
    client = TlsPipe(me.client_context(), server_side=False)
    server = TlsPipe(them.server_context(me.cert_der), server_side=True)
    for _ in range(10):
        done = [client.handshake(), server.handshake()]
        server.feed(client.outgoing())
        client.feed(server.outgoing())
        if all(done):
            return client, server
    raise AssertionError("no TLS handshake in memory")


def test_records_right_behind_the_key_in_one_read_go_to_the_records() -> None:
    """The cut-over without a socket: the peer's key record and its first AES-GCM records
    arrive in one read. TLS hands out the key record and no byte more (no read-ahead),
    and the bytes after it are the records, whole."""
    client, server = tls_pipes()
    secret = os.urandom(32)
    records = AeadPipe(secret, os.urandom(32), dialer=False)
    first = bytes(records.encrypt(b"first frame")) + bytes(records.encrypt(b"second"))
    client.feed(server.encrypt(encode_record({"key": secret})) + first)
    reader, buf = RecordReader(), memoryview(bytearray(1024))
    while (rec := reader.next_record()) is None:
        got = client.read_into(buf)
        assert got
        reader.feed(buf[:got])
    assert rec == {"key": secret} and not len(reader) and not client.obj.pending()
    assert client.take_buffered() == first


def test_next_size_is_the_plaintext_of_the_next_whole_record() -> None:
    tx, rx = pair()
    wire = bytes(tx.encrypt(b"ab", os.urandom(5000)))
    rx.feed(wire[:10])
    assert rx.next_size == 0  # the first record is not here whole yet
    rx.feed(wire[10:30])
    assert rx.next_size == 2
    assert rx.read_into(memoryview(bytearray(2))) == 2
    assert rx.next_size == 0  # the second record is not here whole yet
    rx.feed(wire[30:])
    assert rx.next_size == 5000


def test_whole_records_waiting_while_reading_is_paused_get_room() -> None:
    """More whole records than the buffer holds (a paused reader): the buffer grows,
    nothing is lost."""
    tx, rx = pair()
    parts = [os.urandom(MAX_RECORD) for _ in range(5)]
    for p in parts:
        rx.feed(tx.encrypt(p))
    assert rx.buffered == 5 * (MAX_RECORD + TAG + 4)
    assert read_all(rx, 1 << 20) == b"".join(parts)


def test_fill_takes_every_whole_record_that_fits_in_one_call() -> None:
    """fill decrypts record after record into one buffer; a record larger than the room
    left waits (next_size names it) unless nothing came before it, and a partial record
    waits for the rest."""
    tx, rx = pair()
    small = [os.urandom(n) for n in (0, 1, 30, 17)]
    big = os.urandom(200)
    wire = b"".join(bytes(tx.encrypt(p)) for p in small) + bytes(tx.encrypt(big))
    wire += bytes(tx.encrypt(b"tail"))
    rx.feed(wire[:-3])
    buf = memoryview(bytearray(100))
    assert rx.fill(buf) == 48 and bytes(buf[:48]) == b"".join(small)
    assert rx.next_size == 200
    assert rx.fill(buf) == 100 and bytes(buf) == big[:100]  # nothing before it: in pieces
    assert rx.fill(buf) == 100 and bytes(buf) == big[100:]
    assert rx.fill(buf) == 0  # "tail" is not here whole yet
    rx.feed(wire[-3:])
    assert rx.fill(buf) == 4 and bytes(buf[:4]) == b"tail"
    assert rx.buffered == 0 and not rx.readable


@pytest.mark.parametrize("damage", ["flip", "length"])
def test_fill_hands_out_the_records_before_a_bad_one_then_raises(damage: str) -> None:
    tx, rx = pair()
    good = bytes(tx.encrypt(b"good")) + bytes(tx.encrypt(b"also good"))
    bad = bytearray(tx.encrypt(b"B" * 20))
    if damage == "flip":
        bad[8] ^= 0xFF
    else:
        bad[:4] = struct.pack(">I", MAX_RECORD + TAG + 1)
    rx.feed(good + bytes(bad))
    place = memoryview(bytearray(b"\x11" * 64))
    assert rx.fill(place) == 13 and bytes(place[:13]) == b"goodalso good"
    # The bad record's landing place is zeroed (decrypt_into wrote before it checked).
    landed = bytes(20) if damage == "flip" else b"\x11" * 20
    assert bytes(place[13:33]) == landed and bytes(place[33:]) == b"\x11" * 31
    assert rx.readable  # the bad record is still there: the reader learns at once
    with pytest.raises(RecordError):
        rx.fill(place)


@pytest.mark.parametrize("damage", ["drop", "swap"])
def test_fill_after_a_cut_or_reordered_record_never_goes_on(damage: str) -> None:
    """A genuine record in the wrong place (one before it cut, or two swapped) fails,
    and so does everything after it: the stream never resumes at a later record."""
    tx, rx = pair()
    records = [bytes(tx.encrypt(b"r%d" % i)) for i in range(4)]
    if damage == "drop":
        wire = records[0] + records[2] + records[3]
    else:
        wire = records[0] + records[2] + records[1] + records[3]
    rx.feed(wire)
    buf = memoryview(bytearray(64))
    assert rx.fill(buf) == 2 and bytes(buf[:2]) == b"r0"
    for _ in range(3):
        with pytest.raises(RecordError):
            rx.fill(buf)
        with pytest.raises(RecordError):
            rx.read_into(buf)


def test_a_lean_pipe_keeps_no_buffer_once_drained() -> None:
    """For servers with many idle connections: nothing held between records, a partial
    record kept until the rest comes."""
    tx = AeadPipe(A, B, dialer=True)
    rx = AeadPipe(B, A, dialer=False, lean=True)
    assert len(rx._buf) == 0
    wire = bytes(tx.encrypt(b"one")) + bytes(tx.encrypt(b"two"))
    buf = memoryview(bytearray(64))
    rx.feed(wire[:30])
    assert rx.fill(buf) == 3 and bytes(buf[:3]) == b"one" and rx.buffered == 30 - 23
    rx.feed(wire[30:])
    assert rx.fill(buf) == 3 and bytes(buf[:3]) == b"two"
    assert rx.buffered == 0 and len(rx._buf) == 0


def test_a_lean_pipe_fed_reads_that_end_inside_records_holds_just_what_waits() -> None:
    tx = AeadPipe(A, B, dialer=True)
    rx = AeadPipe(B, A, dialer=False, lean=True)
    sent = [os.urandom(16000) for _ in range(20)]
    wire = b"".join(bytes(tx.encrypt(p)) for p in sent)
    got = bytearray()
    buf = memoryview(bytearray(1 << 16))
    for at in range(0, len(wire), 37_000):  # every read ends inside a record
        rx.feed(wire[at : at + 37_000])
        assert len(rx._buf) == rx.buffered  # one copy of what waits: no growth
        while n := rx.fill(buf):
            got += buf[:n]
    assert bytes(got) == b"".join(sent) and len(rx._buf) == 0


@pytest.mark.parametrize("reader", ["fill", "read_into"])
def test_a_lean_pipe_keeps_only_the_unfinished_record_after_a_read(reader: str) -> None:
    """A read of many whole records that ends a few bytes into the next one keeps those
    few bytes, not the read's buffer (a relay client could otherwise pin a whole read's
    memory between bursts of PONGs, each burst ending inside a record)."""
    tx = AeadPipe(A, B, dialer=True)
    rx = AeadPipe(B, A, dialer=False, lean=True)
    wire = b"".join(bytes(tx.encrypt(b"x" * 1000)) for _ in range(250))
    last = bytes(tx.encrypt(b"y" * 1000))
    rx.feed(wire + last[:10])
    buf = memoryview(bytearray(1000 if reader == "read_into" else 1 << 18))
    total = 0
    while n := getattr(rx, reader)(buf):
        total += n
    assert total == 250 * 1000
    assert rx.buffered == 10 and len(rx._buf) == 10
    rx.feed(last[10:])
    assert rx.read_into(buf) == 1000 and bytes(buf[:1000]) == b"y" * 1000
    assert len(rx._buf) == 0


def test_fresh_output_survives_the_next_call() -> None:
    """For uvloop, whose transport queues a reference to what it could not send."""
    tx, rx = pair()
    first = tx.encrypt(b"a" * 1000, fresh=True)
    second = tx.encrypt(b"b" * 1000, fresh=True)
    reused = tx.encrypt(b"c" * 1000)
    assert first.obj is not second.obj and reused.obj not in (first.obj, second.obj)
    rx.feed(bytes(first) + bytes(second) + bytes(reused))
    assert read_all(rx) == b"a" * 1000 + b"b" * 1000 + b"c" * 1000


def test_max_record_bounds_what_is_sent_and_taken() -> None:
    tx = AeadPipe(A, B, dialer=True, max_record=100)
    rx = AeadPipe(B, A, dialer=False, max_record=100)
    wire = bytes(tx.encrypt(b"y" * 250))
    assert len(wire) == 250 + 3 * (TAG + 4)  # 100 + 100 + 50
    rx.feed(wire)
    assert read_all(rx) == b"y" * 250
    rx.feed(struct.pack(">I", 101 + TAG))  # refused before the rest comes
    assert rx.readable
    with pytest.raises(RecordError, match="at most 116"):
        rx.fill(memoryview(bytearray(64)))
    with pytest.raises(ValueError, match="1 to 100"):
        tx.seal(b"z" * 101)
    with pytest.raises(ValueError, match="max_record"):
        AeadPipe(A, B, dialer=True, max_record=MAX_RECORD + 1)


def land(pipe: AeadPipe, data: bytes) -> int:
    """One socket read: as much of ``data`` as the pipe offers room for."""
    room = pipe.get_buffer()
    n = min(room.nbytes, len(data))
    room[:n] = data[:n]
    pipe.buffer_updated(n)
    return n


def test_the_receive_buffer_grows_while_reads_fill_it() -> None:
    """A busy socket: every read takes all the room offered, so the buffer doubles up to
    ``receive_buffer`` (reads of up to 1 MiB); one that does not fill it stays."""
    tx = AeadPipe(A, B, dialer=True)
    rx = AeadPipe(B, A, dialer=False, receive_buffer=1 << 20)
    sent = [os.urandom(16000) for _ in range(200)]
    wire = b"".join(bytes(tx.encrypt(p)) for p in sent)
    assert rx.get_buffer().nbytes == RECEIVE_BUFFER  # an idle connection keeps 128 KiB
    reads, got, at = [], bytearray(), 0
    buf = memoryview(bytearray(1 << 16))
    while at < len(wire):
        n = land(rx, wire[at:])
        reads.append(n)
        at += n
        while k := rx.fill(buf):
            got += buf[:k]
    assert bytes(got) == b"".join(sent)
    # 128 KiB, then about 256 KiB, 512 KiB and 1 MiB (less a partial record kept), and
    # no further: the buffer doubled up to receive_buffer.
    assert reads[0] == RECEIVE_BUFFER and len(rx._buf) == 1 << 20
    for before, after, limit in zip(reads[:3], reads[1:4], (2, 4, 8), strict=True):
        assert after > before and limit * RECEIVE_BUFFER - 20_000 < after <= limit * RECEIVE_BUFFER
    assert max(reads) <= 1 << 20 and reads[4] > 1_000_000
    quiet = AeadPipe(B, A, dialer=False, receive_buffer=1 << 20)
    land(quiet, b"\0\0\0\x20" + bytes(10))  # a read that leaves room: no growth
    assert quiet.get_buffer().nbytes == RECEIVE_BUFFER - 14
    with pytest.raises(ValueError, match="receive_buffer"):
        AeadPipe(A, B, dialer=True, receive_buffer=RECEIVE_BUFFER - 1)


def test_a_lean_pipe_keeps_no_large_send_buffer() -> None:
    tx = AeadPipe(A, B, dialer=True, lean=True)
    rx = AeadPipe(B, A, dialer=False)
    big = os.urandom(300_000)
    rx.feed(tx.encrypt(big))
    assert len(tx._out) == 0  # made for that call only
    rx.feed(tx.encrypt(b"small"))
    assert 0 < len(tx._out) < 1024  # small ones reuse one buffer
    assert read_all(rx, 1 << 20) == big + b"small"


def test_records_under_another_protocol_name_do_not_decrypt_as_tcp_records() -> None:
    info = b"p2pdist relay records v1 aes-256-gcm"
    tx = AeadPipe(A, B, dialer=True, info=info)
    assert bytes(tx.encrypt(b"x")) != bytes(AeadPipe(A, B, dialer=True).encrypt(b"x"))
    rx = AeadPipe(B, A, dialer=False)
    rx.feed(tx.encrypt(b"hello"))
    with pytest.raises(RecordError):
        rx.fill(memoryview(bytearray(64)))
    with pytest.raises(ValueError):
        AeadPipe(A, B, dialer=True, info=b"no cipher named")


def test_seal_makes_the_record_encrypt_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """seal is encrypt of one part: the same bytes, record for record, across key
    updates; more than one record's worth is refused."""
    monkeypatch.setattr(aeadpipe, "REKEY_RECORDS", 3)
    sealer, encrypter = AeadPipe(A, B, dialer=True), AeadPipe(A, B, dialer=True)
    texts = [os.urandom(n) for n in (5, 70_000, 1, 2, 3, 4, MAX_RECORD)]
    sealed = [bytes(sealer.seal(t)) for t in texts]
    assert sealed == [bytes(encrypter.encrypt(t)) for t in texts]
    assert b"".join(sealed) == expected_records(A, b"dialer", texts, 3)
    for size in (0, MAX_RECORD + 1):  # no record, or more than one
        with pytest.raises(ValueError, match="1 to"):
            sealer.seal(bytes(size))


def test_tls_fill_hands_out_the_records_before_a_corrupt_one_then_raises() -> None:
    client, server = tls_pipes()
    good = server.encrypt(b"one") + server.encrypt(b"and")
    bad = bytearray(server.encrypt(b"two"))
    bad[-5] ^= 0xFF
    client.feed(good + bytes(bad))
    buf = memoryview(bytearray(64))
    assert client.fill(buf) == 6 and bytes(buf[:6]) == b"oneand"
    assert client.readable  # the error waits for the next call
    with pytest.raises(ssl.SSLError):
        client.fill(buf)
    with pytest.raises(ssl.SSLError):
        client.fill(buf)  # and stays


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
async def tapped_proxy(
    target: tuple[str, int], *, upstream_only: bool = False
) -> AsyncIterator[tuple[tuple[str, int], bytearray]]:
    """A loopback TCP proxy to ``target`` that records every byte it forwards (with
    ``upstream_only``, only those towards ``target``)."""
    seen = bytearray()

    async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, record: bool) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(1 << 16):
                if record:
                    seen.extend(data)
                w.write(data)
                await w.drain()
        w.close()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        tr, tw = await asyncio.open_connection(*target)
        await asyncio.gather(pump(r, tw, True), pump(tr, w, not upstream_only))

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
                want = "aes-256-gcm" if tls else "none"
                assert client.record_protection == server.record_protection == want  # type: ignore[attr-defined]


async def test_a_record_that_does_not_decrypt_ends_the_connection_naming_the_peer() -> None:
    """Frames in the records before the bad one are delivered, then the connection ends as
    broken on both ends, the reader's error naming the peer."""
    async with tcp_pair(True) as p:
        assert isinstance(p.client._tls, AeadPipe) and p.client._transport is not None
        good = p.client._tls.encrypt(encode_header(FrameKind.DATA, 1, 0, b"", 5) + b"hello")
        forged = bytes(AeadPipe(os.urandom(32), os.urandom(32), dialer=True).encrypt(b"forged"))
        p.client._transport.write(bytes(good) + forged)
        assert bytes((await bounded(p.server.recv(1), "the good frame")).payload) == b"hello"
        with pytest.raises(ConnectionBrokenError, match=r"bad record: .*does not decrypt") as err:
            await bounded(p.server.recv(1), "the server noticing")
        assert eid(0).short() in str(err.value) and err.value.corrupt
        with pytest.raises(ConnectionBrokenError) as theirs:
            await bounded(p.client.recv(1), "the client learning the connection ended")
        assert not theirs.value.corrupt  # its stream was fine: the peer went away


async def test_a_record_cut_out_in_transit_ends_the_connection() -> None:
    """Three frames sent, the middle record removed on the way: the first is delivered,
    then the connection ends; the third is never delivered after the gap."""
    async with tcp_pair(True) as p:
        tx = p.client._tls
        assert isinstance(tx, AeadPipe) and p.client._transport is not None
        frames = [encode_header(FrameKind.DATA, 1, 0, b"", 2) + m for m in (b"m0", b"m1", b"m2")]
        records = [bytes(tx.encrypt(f)) for f in frames]
        p.client._transport.write(records[0] + records[2])
        assert bytes((await bounded(p.server.recv(1), "the first frame")).payload) == b"m0"
        with pytest.raises(ConnectionBrokenError, match="bad record"):
            await bounded(p.server.recv(1), "the server noticing the gap")


class CountingAead:
    """An AEAD that counts the records decrypted into a temporary (``decrypt``) rather
    than into the caller's buffer (``decrypt_into``)."""

    def __init__(self, inner: AESGCM) -> None:
        self.inner, self.temporaries = inner, 0

    def decrypt_into(self, *args: object) -> None:
        self.inner.decrypt_into(*args)  # type: ignore[arg-type]

    def decrypt(self, *args: object) -> bytes:
        self.temporaries += 1
        return self.inner.decrypt(*args)  # type: ignore[arg-type]


async def test_a_bulk_record_behind_its_header_decrypts_straight_into_the_payload() -> None:
    """A large frame's header record and its 1 MiB payload record both whole in the
    buffer at once: the header goes to the decoder first, so the payload record is
    decrypted into the payload's own place, not into a temporary that is then copied."""
    async with tcp_pair(True) as p:
        sender, receiver = p.client._tls, p.server._tls
        assert isinstance(sender, AeadPipe) and isinstance(receiver, AeadPipe)
        counting = CountingAead(receiver._rx.aead)
        receiver._rx.aead = counting  # type: ignore[assignment]
        payload = os.urandom(MAX_RECORD)
        header = encode_header(FrameKind.DATA, 1, 0, b"", len(payload))
        receiver.feed(sender.encrypt(header, payload))  # two records, both whole
        p.server._tls_receive()
        assert bytes((await bounded(p.server.recv(1), "the frame")).payload) == payload
        assert counting.temporaries == 0


async def test_a_peer_that_never_sends_its_record_key_times_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The acceptor finishes TLS and then says nothing: the dialer's connect fails within
    its handshake timeout, naming the peer."""
    real = tcp_module.TcpConnection._seal_records

    async def stall_on_accept(self: tcp_module.TcpConnection) -> None:
        if self._server_side:
            await asyncio.Event().wait()
        await real(self)

    monkeypatch.setattr(tcp_module.TcpConnection, "_seal_records", stall_on_accept)
    cfg = TransportConfig(handshake_timeout=1.0)
    client_t, server_t = TcpTransport(key(0), cfg), TcpTransport(key(1), cfg)
    async with closing(client_t, server_t):
        addr = await server_t.listen("127.0.0.1", 0)
        with pytest.raises(PeerTimeoutError) as err:
            await bounded(client_t.connect(eid(1), addr), "connect", 5.0)
        assert eid(1).short() in str(err.value)


async def test_a_peer_that_sends_our_own_secret_back_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = os.urandom(32)
    monkeypatch.setattr(tcp_handshake, "new_secret", lambda: secret)
    client_t, server_t = TcpTransport(key(0)), TcpTransport(key(1))
    async with closing(client_t, server_t):
        addr = await server_t.listen("127.0.0.1", 0)
        with pytest.raises((RemoteProtocolError, ConnectionBrokenError)):
            await bounded(client_t.connect(eid(1), addr), "connect", 5.0)


def _ask_key_updates_and_never_read(port: int, server_id: bytes, limit: int) -> int:
    """A dialer that leaves sealed records out (so TLS records carry the frames), then asks
    for TLS key updates without ever reading; returns what it sent before it was dropped
    (or ``limit``)."""
    import ctypes
    import secrets
    import socket

    from test_relay_abuse import _libssl, _ssl_pointer

    from p2pdist.wire.handshake import RecordReader

    k = SecretKey.generate()
    ident = TlsIdentity(k)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    hello = {
        "mode": "tls",
        "id": bytes(k.endpoint_id),
        "want": server_id,
        "nonce": secrets.token_bytes(32),
        "cert": ident.cert_der,
    }
    s.sendall(encode_record(hello, first=True))
    reader = RecordReader()
    while (rec := reader.next_record()) is None:
        reader.feed(s.recv(65536))
    assert rec["ok"], rec
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ident.client_context().wrap_bio(incoming, outgoing, server_side=False)
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            s.sendall(outgoing.read())
            incoming.write(s.recv(65536))
    s.sendall(outgoing.read())
    lib = _libssl()
    pointer = _ssl_pointer(obj, lib)
    lib.SSL_key_update.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.SSL_do_handshake.argtypes = [ctypes.c_void_p]
    ping = encode_header(FrameKind.PING, seq=1)
    sent = 0
    s.settimeout(10)
    try:
        while sent < limit:
            for _ in range(30):
                assert lib.SSL_key_update(pointer, 1) == 1  # SSL_KEY_UPDATE_REQUESTED
                lib.SSL_do_handshake(pointer)
            obj.write(ping)
            data = outgoing.read()
            s.sendall(data)
            sent += len(data)
    except OSError:
        pass
    finally:
        s.close()
    return sent


async def test_a_peer_asking_key_updates_without_reading_is_dropped() -> None:
    """Each TLS key update request makes TLS queue an answer, and nothing bounded them:
    a peer that forces TLS records (offers no sealed records), asks for key updates and
    reads nothing grew our write buffer by about a byte per byte it sent (an audit:
    55 MB for 64 MB). It is dropped once write_buffer_high plus 4 MiB are queued."""
    cfg = TransportConfig(write_buffer_high=1 << 20)
    server = TcpTransport(key(1), cfg)
    async with closing(server):
        _, port = await server.listen("127.0.0.1", 0)
        limit = 48 << 20  # far beyond 5 MiB and the kernel's buffers
        attack = asyncio.create_task(
            asyncio.to_thread(
                _ask_key_updates_and_never_read, port, bytes(server.endpoint_id), limit
            )
        )
        conn = await bounded(server.accept(), "accept")
        sent = await asyncio.wait_for(attack, 60)
        assert sent < limit, "it kept answering a peer that reads nothing"
        with pytest.raises(ConnectionBrokenError, match="reads nothing of what TLS"):
            await bounded(conn.recv(1), "the drop")


async def test_a_stream_cut_inside_a_record_ends_in_the_middle_of_a_frame() -> None:
    """Half a record, then EOF: plaintext said "ended in the middle of a frame" as
    protocol.md section 2 does, records said only "connection lost" (the partial frame
    sat undecrypted in the record buffer: an audit)."""
    async with tcp_pair(True) as p:
        assert isinstance(p.client._tls, AeadPipe) and p.client._transport is not None
        frame = encode_header(FrameKind.DATA, 3, 0, b"", 1000) + b"z" * 1000
        record = bytes(p.client._tls.encrypt(frame))
        p.client._transport.write(record[: len(record) // 2])
        await asyncio.sleep(0.1)
        p.client._transport.write_eof()
        with pytest.raises(ConnectionBrokenError, match="in the middle of a frame"):
            await bounded(p.server.recv(3), "the cut")
