"""Sans-I/O wire codecs: frame header and decoder, array headers, handshake records, and
the relay frame and STUN parsers byte by byte (their other tests: test_relay_codec.py).

Parsers are tested whole, byte by byte, at random split points and with trailing garbage,
and fuzzed with hypothesis.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import struct
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pdist.wire import stun
from p2pdist.wire.arrays import WIRE_DTYPES, ArrayHeader, ArrayHeaderError, check_dtype
from p2pdist.wire.frames import (
    HEADER,
    PEEK_BYTES,
    VERSION,
    Frame,
    FrameDecoder,
    FrameError,
    FrameKind,
    FrameLimits,
    encode_header,
)
from p2pdist.wire.handshake import (
    MAGIC,
    MAX_RECORD,
    HandshakeError,
    RecordReader,
    auth_transcript,
    encode_record,
    get_bytes,
)
from p2pdist.wire.relay import (
    RelayFrameDecoder,
    RelayFrameType,
    RelayProtocolError,
    decode_addressed,
    encode_addressed,
    encode_frame,
)

U64_MAX = (1 << 64) - 1
SMALL = FrameLimits(max_meta=512, max_payload=1 << 16, direct_threshold=256)
"""Limits small enough that byte-by-byte and fuzz runs exercise the direct-payload path."""

FrameTuple = tuple[FrameKind, int, int, bytes, bytes, int]


def wire(
    kind: FrameKind = FrameKind.DATA,
    channel: int = 0,
    seq: int = 0,
    meta: bytes = b"",
    payload: bytes = b"",
    *,
    flags: int = 0,
    limits: FrameLimits | None = None,
) -> bytes:
    """A complete encoded frame."""
    header = encode_header(kind, channel, seq, meta, len(payload), flags=flags, limits=limits)
    return header + payload


def raw_header(
    version: int = VERSION,
    kind: int = FrameKind.DATA,
    flags: int = 0,
    meta_len: int = 0,
    channel: int = 0,
    seq: int = 0,
    payload_len: int = 0,
) -> bytes:
    """A header with any field values, bypassing encode_header's checks."""
    return HEADER.pack(version, kind, flags, meta_len, channel, seq, payload_len)


def as_tuple(f: Frame) -> FrameTuple:
    return (f.kind, f.channel, f.seq, f.meta, bytes(f.payload), f.flags)


def feed_whole(dec: FrameDecoder, data: bytes) -> list[Frame]:
    return dec.feed(data)


def feed_bytewise(dec: FrameDecoder, data: bytes) -> list[Frame]:
    out: list[Frame] = []
    for i in range(len(data)):
        out += dec.feed(data[i : i + 1])
    return out


def feed_chunks(dec: FrameDecoder, data: bytes, cuts: Iterable[int]) -> list[Frame]:
    out: list[Frame] = []
    points = [0, *sorted(set(cuts)), len(data)]
    for a, b in itertools.pairwise(points):
        out += dec.feed(data[a:b])
    return out


def feed_random(seed: int) -> Callable[[FrameDecoder, bytes], list[Frame]]:
    def feed(dec: FrameDecoder, data: bytes) -> list[Frame]:
        rng = random.Random(seed)
        cuts = [rng.randrange(len(data) + 1) for _ in range(rng.randrange(1, 40))]
        return feed_chunks(dec, data, cuts)

    return feed


def feed_in_steps(
    dec: FrameDecoder,
    data: bytes,
    chunks: list[int],
    out: list[Frame],
    peek: bool | list[bool] = False,
) -> None:
    """Drive the decoder the way asyncio.BufferedProtocol does: write ``data`` into its own
    buffers in steps of ``chunks`` (cycled; none: as much as each buffer takes), appending
    decoded frames to ``out`` as they come (so they survive a FrameError). With ``peek``,
    as the plaintext TCP reader does: it asks to peek, and reads again at once (not
    peeking) when the decoder says so; a list says per read whether to ask (cycled)."""
    peeks = peek if isinstance(peek, list) and peek else [bool(peek)]
    pos, i = 0, 0
    again = False
    while pos < len(data):
        buf = dec.get_buffer(peek=peeks[i % len(peeks)] and not again)
        assert buf.nbytes > 0, "get_buffer returned an empty buffer: the reader would spin"
        step = chunks[i % len(chunks)] if chunks else len(data)
        n = min(buf.nbytes, step, len(data) - pos)
        buf[:n] = data[pos : pos + n]
        pos, i = pos + n, i + 1
        out += dec.buffer_updated(n)
        again = dec.read_again


def feed_buffered(
    dec: FrameDecoder, data: bytes, chunk: int | None = None, peek: bool = False
) -> list[Frame]:
    """:func:`feed_in_steps` in steps of at most ``chunk`` bytes, returning the frames."""
    out: list[Frame] = []
    feed_in_steps(dec, data, [chunk] if chunk else [], out, peek)
    return out


FEEDERS: dict[str, Callable[[FrameDecoder, bytes], list[Frame]]] = {
    "whole": feed_whole,
    "random-splits-1": feed_random(1),
    "random-splits-2": feed_random(2),
    "buffered-7": lambda d, b: feed_buffered(d, b, 7),
    "buffered-4096": lambda d, b: feed_buffered(d, b, 4096),
    "peeking-4096": lambda d, b: feed_buffered(d, b, 4096, peek=True),
    "peeking-100": lambda d, b: feed_buffered(d, b, 100, peek=True),
}


def stream_of(frames: list[FrameTuple], limits: FrameLimits | None = None) -> bytes:
    return b"".join(wire(k, c, s, m, p, flags=fl, limits=limits) for k, c, s, m, p, fl in frames)


def sample_frames(limits: FrameLimits, rng: random.Random) -> list[FrameTuple]:
    big = limits.direct_threshold * 3 + 17
    frames: list[FrameTuple] = [
        (FrameKind.DATA, 1, 0, b"", b"", 0),  # empty
        (FrameKind.DATA, 2, 5, b"meta", b"", 0),  # meta only
        (FrameKind.DATA, 3, 6, b"", rng.randbytes(10), 0),  # payload only
        (FrameKind.PING, 0, 0, b"", b"", 0),
        (FrameKind.DATA, U64_MAX, U64_MAX, b"m" * 40, rng.randbytes(big), 0xFFFF),  # large
        (FrameKind.DATA, 4, 1, b"", rng.randbytes(limits.direct_threshold), 0),  # threshold
        (FrameKind.DATA, 4, 2, b"", rng.randbytes(limits.direct_threshold + 1), 0),  # just over
        (FrameKind.PONG, 0, 0, b"", b"", 0),
        (FrameKind.DATA, 5, 0, rng.randbytes(limits.max_meta), rng.randbytes(big), 1),
        (FrameKind.GOODBYE, 0, 0, b"", b"", 0),
    ]
    frames += [(FrameKind.DATA, 7, i, b"x", rng.randbytes(i % 50), 0) for i in range(200)]
    return frames


# ---- header -----------------------------------------------------------------------------


def test_header_layout_is_pinned() -> None:
    got = encode_header(FrameKind.DATA, 0x0102030405060708, 9, b"ab", 0x10, flags=0x0A0B)
    expected = bytes.fromhex("01010a0b00000002010203040506070800000000000000090000000000000010")
    assert got == expected + b"ab"
    assert HEADER.size == 32


@pytest.mark.parametrize("kind", list(FrameKind), ids=lambda k: k.name)
def test_header_round_trip_every_kind(kind: FrameKind) -> None:
    meta, payload = (b"meta!", b"payload") if kind is FrameKind.DATA else (b"", b"")
    for channel, seq, flags in [(0, 0, 0), (1, 2, 3), (U64_MAX, U64_MAX, 0xFFFF)]:
        data = wire(kind, channel, seq, meta, payload, flags=flags)
        fields = HEADER.unpack_from(data)
        assert fields == (VERSION, kind, flags, len(meta), channel, seq, len(payload))
        (frame,) = FrameDecoder().feed(data)
        assert as_tuple(frame) == (kind, channel, seq, meta, payload, flags)
        assert frame.nbytes == len(meta) + len(payload)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"channel": -1}, "64 unsigned bits"),
        ({"channel": 1 << 64}, "64 unsigned bits"),
        ({"seq": -1}, "64 unsigned bits"),
        ({"seq": 1 << 64}, "64 unsigned bits"),
        ({"meta": b"x" * (SMALL.max_meta + 1)}, "meta"),
        ({"payload_len": SMALL.max_payload + 1}, "payload"),
        ({"payload_len": -1}, "payload_len"),
        ({"flags": 1 << 16}, "flags"),
        ({"flags": -1}, "flags"),
        ({"kind": FrameKind.PING, "meta": b"x"}, "PING"),
        ({"kind": FrameKind.PONG, "payload_len": 1}, "PONG"),
        ({"kind": FrameKind.GOODBYE, "meta": b"x"}, "GOODBYE"),
    ],
)
def test_encode_header_refuses(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"kind": FrameKind.DATA, "limits": SMALL, **kwargs}
    kind = args.pop("kind")
    with pytest.raises(ValueError, match=match):
        encode_header(kind, **args)


def test_encode_header_at_limits() -> None:
    h = encode_header(
        FrameKind.DATA, meta=b"x" * SMALL.max_meta, payload_len=SMALL.max_payload, limits=SMALL
    )
    assert len(h) == HEADER.size + SMALL.max_meta


# ---- decoder: splitting never changes the result -------------------------------------------


@pytest.mark.parametrize("limits", [SMALL, FrameLimits()], ids=["small-limits", "default"])
@pytest.mark.parametrize("feeder", list(FEEDERS), ids=list(FEEDERS))
def test_decoder_split_invariance(limits: FrameLimits, feeder: str) -> None:
    frames = sample_frames(limits, random.Random(7))
    data = stream_of(frames, limits)
    got = [as_tuple(f) for f in FEEDERS[feeder](FrameDecoder(limits), data)]
    assert got == frames


def test_decoder_byte_by_byte() -> None:
    frames = sample_frames(SMALL, random.Random(8))
    data = stream_of(frames, SMALL)
    dec = FrameDecoder(SMALL)
    got = [as_tuple(f) for f in feed_bytewise(dec, data)]
    assert got == frames
    assert not dec.mid_frame


def test_decoder_every_single_split_point() -> None:
    frames = [
        (FrameKind.DATA, 1, 0, b"ab", b"0123456789" * 40, 0),  # 400 > direct_threshold
        (FrameKind.DATA, 2, 1, b"", b"xyz", 0),
        (FrameKind.PING, 0, 0, b"", b"", 0),
    ]
    data = stream_of(frames, SMALL)
    for cut in range(len(data) + 1):
        got = [as_tuple(f) for f in feed_chunks(FrameDecoder(SMALL), data, [cut])]
        assert got == frames, cut


def test_decoder_many_frames_back_to_back() -> None:
    frames = [(FrameKind.DATA, i % 13, i, b"", i.to_bytes(4, "big"), 0) for i in range(5000)]
    got = [as_tuple(f) for f in FrameDecoder().feed(stream_of(frames))]
    assert got == frames


def test_decoder_small_scratch_is_enlarged() -> None:
    """A scratch buffer too small for the limits must not stop the decoder."""
    frames = sample_frames(SMALL, random.Random(9))
    dec = FrameDecoder(SMALL, scratch_size=16)
    assert [as_tuple(f) for f in feed_buffered(dec, stream_of(frames, SMALL))] == frames


def test_payloads_are_owned_and_writable() -> None:
    """A payload must not alias the decoder's scratch buffer: later input must not change
    it, and writing to it must not disturb other frames."""
    dec = FrameDecoder(SMALL)
    (first,) = dec.feed(wire(payload=b"A" * 100, limits=SMALL))
    (big,) = dec.feed(wire(payload=b"B" * 1000, limits=SMALL))
    later = dec.feed(wire(payload=b"C" * 100, limits=SMALL) * 50)
    assert bytes(first.payload) == b"A" * 100
    assert bytes(big.payload) == b"B" * 1000
    assert not first.payload.readonly and not big.payload.readonly
    first.payload[:3] = b"xyz"
    big.payload[:3] = b"xyz"
    assert all(bytes(f.payload) == b"C" * 100 for f in later)


def test_large_payload_is_received_in_place() -> None:
    """Once the header of a large frame is in, the decoder offers the whole rest of the
    payload as one buffer, and that buffer becomes the frame's payload (no extra copy)."""
    payload = bytes(range(256)) * 40  # 10240 > direct_threshold
    data = wire(channel=3, meta=b"hdr", payload=payload, limits=SMALL)
    dec = FrameDecoder(SMALL)
    head = HEADER.size + 3 + 100
    assert dec.feed(data[:head]) == []
    assert dec.mid_frame
    buf = dec.get_buffer()
    assert buf.nbytes == len(payload) - 100
    buf[:] = data[head:]
    (frame,) = dec.buffer_updated(buf.nbytes)
    assert bytes(frame.payload) == payload
    assert frame.payload.obj is buf.obj
    assert not dec.mid_frame


def test_after_a_large_payload_a_peek_takes_the_next_header_alone() -> None:
    """Right after a large payload, a reader that peeks is offered room for a header
    only: the large payload behind it then goes straight to its place (it used to arrive
    in the scratch buffer, up to 256 KiB of it, and be copied there)."""
    first, second = bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 30
    data = wire(channel=1, payload=first, limits=SMALL)
    data += wire(channel=2, meta=b"m", payload=second, limits=SMALL)
    dec = FrameDecoder(SMALL)
    assert dec.get_buffer(peek=True).nbytes > PEEK_BYTES  # nothing large yet: full room
    dec.get_buffer(peek=True)[:100] = data[:100]
    assert dec.buffer_updated(100) == [] and not dec.read_again
    rest = dec.get_buffer(peek=True)  # the payload's own buffer
    end = len(first) + HEADER.size
    rest[:] = data[100:end]
    assert [bytes(f.payload) for f in dec.buffer_updated(rest.nbytes)] == [first]
    place = place_of(len(second))
    dec.expect(2, 0, place)
    peek = dec.get_buffer(peek=True)
    assert peek.nbytes == PEEK_BYTES
    peek[:] = data[end : end + PEEK_BYTES]
    assert dec.buffer_updated(PEEK_BYTES) == [] and dec.read_again
    copied = PEEK_BYTES - HEADER.size - 1
    direct = dec.get_buffer()
    assert direct.obj is place.obj and direct.nbytes == len(second) - copied
    direct[:] = data[end + PEEK_BYTES :]
    (frame,) = dec.buffer_updated(direct.nbytes)
    assert frame.payload is place and bytes(place) == second and frame.meta == b"m"
    assert not dec.read_again and dec.get_buffer(peek=True).nbytes == PEEK_BYTES


def test_no_peek_once_other_room_was_taken() -> None:
    """A read that did not peek right after a large payload (another reader of the same
    decoder) may leave bytes in the scratch buffer: a peek then would write over them,
    so none comes until the next large payload."""
    big = bytes(range(256)) * 40
    dec = FrameDecoder(SMALL)
    first = wire(channel=1, payload=big, limits=SMALL)
    assert dec.feed(first[:100]) == [] and len(dec.feed(first[100:])) == 1
    small = wire(channel=1, seq=1, payload=b"tail", limits=SMALL)
    room = dec.get_buffer()  # not a peek
    assert room.nbytes > PEEK_BYTES  # a reader that does not peek: unchanged
    room[:10] = small[:10]
    assert dec.buffer_updated(10) == []
    later = dec.get_buffer(peek=True)
    assert later.nbytes > PEEK_BYTES
    later[: len(small) - 10] = small[10:]
    (tail,) = dec.buffer_updated(len(small) - 10)
    assert bytes(tail.payload) == b"tail"


def test_a_peek_that_found_nothing_is_offered_again() -> None:
    """A read that got nothing (the receiver looked before it waited; uvloop's reader
    reads on after a read that filled its room) calls no buffer_updated: the next read
    must still peek, or the payload behind the header is copied after all."""
    big = bytes(range(256)) * 40
    dec = FrameDecoder(SMALL)
    first = wire(channel=1, payload=big, limits=SMALL)
    assert dec.feed(first[:100]) == [] and len(dec.feed(first[100:])) == 1
    assert dec.get_buffer(peek=True).nbytes == PEEK_BYTES  # nothing came
    assert dec.get_buffer(peek=True).nbytes == PEEK_BYTES


def test_a_peek_not_filled_asks_for_no_second_read() -> None:
    """A peek that took less than its room took all there was: no read at once."""
    big = bytes(range(256)) * 40
    dec = FrameDecoder(SMALL)
    first = wire(channel=1, payload=big, limits=SMALL)
    assert dec.feed(first[:100]) == []  # the rest goes to the payload's own buffer
    assert len(dec.feed(first[100:])) == 1
    small = wire(channel=1, seq=1, payload=b"tail", limits=SMALL)
    peek = dec.get_buffer(peek=True)
    assert peek.nbytes == PEEK_BYTES
    peek[: len(small)] = small
    (tail,) = dec.buffer_updated(len(small))
    assert bytes(tail.payload) == b"tail" and not dec.read_again
    assert dec.get_buffer(peek=True).nbytes > PEEK_BYTES  # one peek per large payload


# ---- landing places (FrameDecoder.expect) -------------------------------------------------


def place_of(n: int) -> memoryview:
    """A writable byte view of ``n`` bytes, filled with a marker."""
    return memoryview(bytearray(b"\xee" * n))


@pytest.mark.parametrize("size", [0, 10, SMALL.direct_threshold, SMALL.direct_threshold * 3 + 1])
@pytest.mark.parametrize("feeder", list(FEEDERS), ids=list(FEEDERS))
def test_named_place_receives_the_payload(size: int, feeder: str) -> None:
    """A frame whose place was named lands there, small or large, however the bytes are
    split; the frame's payload is the place itself. Other frames are untouched."""
    rng = random.Random(size)
    payload = rng.randbytes(size)
    data = (
        wire(channel=9, seq=0, payload=b"before", limits=SMALL)
        + wire(channel=9, seq=1, meta=b"m", payload=payload, limits=SMALL)
        + wire(channel=9, seq=2, payload=b"after", limits=SMALL)
    )
    dec = FrameDecoder(SMALL)
    place = place_of(size)
    dec.expect(9, 1, place)
    frames = FEEDERS[feeder](dec, data)
    assert [bytes(f.payload) for f in frames] == [b"before", payload, b"after"]
    if size:
        assert frames[1].payload is place
    assert bytes(place) == payload
    assert frames[1].meta == b"m"


def test_place_of_another_size_or_frame_is_left_alone() -> None:
    """A place is a hint: a frame of another length is decoded as usual (the receiver
    reports the mismatch), and places for other channels or sequence numbers stay unused."""
    big = bytes(range(256)) * 20
    dec = FrameDecoder(SMALL)
    wrong, other_seq, other_channel = place_of(len(big) + 1), place_of(len(big)), place_of(10)
    dec.expect(1, 0, wrong)
    dec.expect(1, 5, other_seq)
    dec.expect(2, 0, other_channel)
    (frame,) = feed_buffered(dec, wire(channel=1, seq=0, payload=big, limits=SMALL), 333)
    assert bytes(frame.payload) == big and frame.payload is not wrong
    for unused in (wrong, other_seq, other_channel):
        assert set(bytes(unused)) == {0xEE}


def test_empty_frames_leave_places_alone() -> None:
    """A PING (channel 0, seq 0) or an empty DATA frame with a place's numbers must not
    use that place up: the message it was named for still lands there."""
    dec = FrameDecoder(SMALL)
    small, large = place_of(5), place_of(1000)
    dec.expect(0, 0, small)
    dec.expect(0, 1, large)
    data = wire(FrameKind.PING, limits=SMALL) + wire(channel=0, seq=1, limits=SMALL)
    data += wire(channel=0, seq=0, payload=b"hello", limits=SMALL)
    data += wire(channel=0, seq=1, payload=b"x" * 1000, limits=SMALL)
    frames = feed_buffered(dec, data, 100)
    assert [f.kind for f in frames] == [FrameKind.PING] + [FrameKind.DATA] * 3
    assert frames[2].payload is small and frames[3].payload is large


def test_frame_that_began_before_its_place_was_named_is_not_redirected() -> None:
    """Naming a place for a frame whose header was already parsed changes nothing."""
    payload = bytes(range(256)) * 40
    data = wire(channel=4, payload=payload, limits=SMALL)
    dec = FrameDecoder(SMALL)
    head = HEADER.size + 100
    assert dec.feed(data[:head]) == []
    place = place_of(len(payload))
    dec.expect(4, 0, place)
    (frame,) = dec.feed(data[head:])
    assert bytes(frame.payload) == payload and frame.payload is not place
    assert set(bytes(place)) == {0xEE}


def test_forget_stops_writes_into_the_place_mid_payload() -> None:
    """After ``forget(channel)`` (the collective ended), the rest of a payload that was
    being received into a caller's place goes elsewhere: the caller's memory keeps only
    what had arrived before."""
    payload = bytes(range(256)) * 40
    data = wire(channel=6, payload=payload, limits=SMALL)
    dec = FrameDecoder(SMALL)
    place = place_of(len(payload))
    dec.expect(6, 0, place)
    head = HEADER.size + 1000
    assert dec.feed(data[:head]) == []
    dec.forget(6)
    assert dec.mid_frame
    after = wire(channel=8, payload=b"next", limits=SMALL)
    assert feed_buffered(dec, data[head:] + after, 777)[0].payload == b"next"  # in step
    assert not dec.mid_frame and dec.landed == 1
    assert bytes(place[:1000]) == payload[:1000]
    assert set(bytes(place[1000:])) == {0xEE}
    # and a place forgotten before its frame came is never used
    dec.expect(6, 1, place_of(10))
    dec.forget(6)
    later = place_of(10)
    dec.expect(7, 0, later)
    dec.forget(6)  # forgetting one channel keeps the others
    (frame,) = dec.feed(wire(channel=7, payload=b"0123456789", limits=SMALL))
    assert frame.payload is later


def test_place_must_be_a_writable_byte_view() -> None:
    dec = FrameDecoder(SMALL)
    with pytest.raises(ValueError, match="writable, contiguous 1-D view of bytes"):
        dec.expect(1, 0, memoryview(b"read-only"))
    with pytest.raises(ValueError, match="writable, contiguous 1-D view of bytes"):
        dec.expect(1, 0, memoryview(np.zeros(4, np.float32)))
    with pytest.raises(ValueError, match="writable, contiguous 1-D view of bytes"):
        dec.expect(1, 0, np.zeros(8, np.uint8)[::2].data)  # a socket cannot read into it


def test_mid_frame_tracks_truncation() -> None:
    dec = FrameDecoder(SMALL)
    assert not dec.mid_frame
    small = wire(payload=b"12345", limits=SMALL)
    large = wire(payload=b"z" * 1000, limits=SMALL)
    for data in (small, large):
        for cut in (1, HEADER.size - 1, HEADER.size, len(data) - 1):
            assert dec.feed(data[:cut]) == []
            assert dec.mid_frame, cut
            assert len(dec.feed(data[cut:])) == 1
            assert not dec.mid_frame


# ---- decoder: malformed input ----------------------------------------------------------------


GARBAGE = {
    "bad-version": (raw_header(version=2), "version 2"),
    "version-0": (raw_header(version=0), "version 0"),
    "unknown-kind": (raw_header(kind=9), "unknown frame kind 9"),
    "kind-0": (raw_header(kind=0), "unknown frame kind 0"),
    "text": (b"GET / HTTP/1.1\r\nHost: example\r\n\r\n", "version"),
    "meta-too-big": (raw_header(meta_len=SMALL.max_meta + 1), "meta"),
    "payload-too-big": (raw_header(payload_len=SMALL.max_payload + 1), "payload"),
    "payload-u64-max": (raw_header(payload_len=U64_MAX), "payload"),
    "meta-u32-max": (raw_header(meta_len=(1 << 32) - 1), "meta"),
    "ping-with-payload": (raw_header(kind=FrameKind.PING, payload_len=1) + b"x", "PING"),
    "ping-with-meta": (raw_header(kind=FrameKind.PING, meta_len=1) + b"x", "PING"),
    "pong-with-payload": (raw_header(kind=FrameKind.PONG, payload_len=4) + b"xxxx", "PONG"),
    "goodbye-with-meta": (raw_header(kind=FrameKind.GOODBYE, meta_len=2) + b"xx", "GOODBYE"),
}


@pytest.mark.parametrize("name", list(GARBAGE))
@pytest.mark.parametrize("feeder", ["whole", "bytewise", "buffered-7"])
def test_trailing_garbage_keeps_earlier_frames(name: str, feeder: str) -> None:
    bad, match = GARBAGE[name]
    good = [
        (FrameKind.DATA, 1, 0, b"m", b"p" * 10, 0),
        (FrameKind.DATA, 1, 1, b"", b"q" * 600, 0),  # direct path
        (FrameKind.PING, 0, 0, b"", b"", 0),
    ]
    data = stream_of(good, SMALL) + bad + b"\x00" * 64
    dec = FrameDecoder(SMALL)
    returned: list[Frame] = []  # what calls returned before the one that raised

    def run() -> None:
        if feeder == "whole":
            returned.extend(dec.feed(data))
        elif feeder == "bytewise":
            for i in range(len(data)):
                returned.extend(dec.feed(data[i : i + 1]))
        else:
            feed_in_steps(dec, data, [7], returned)

    with pytest.raises(FrameError, match=match) as info:
        run()
    delivered = [as_tuple(f) for f in returned + info.value.frames]
    assert delivered == good
    # The decoder stays failed: more input raises again and yields nothing.
    with pytest.raises(FrameError):
        dec.feed(wire(payload=b"ok", limits=SMALL))


@pytest.mark.parametrize("name", ["meta-too-big", "payload-too-big", "payload-u64-max"])
def test_oversized_frame_refused_at_header(name: str) -> None:
    """The limits are enforced as soon as the header arrives: no waiting for (or buffering
    of) a body the peer must not send."""
    bad, _ = GARBAGE[name]
    dec = FrameDecoder(SMALL)
    assert dec.feed(bad[: HEADER.size - 1]) == []
    with pytest.raises(FrameError, match="exceeds limit"):
        dec.feed(bad[HEADER.size - 1 : HEADER.size])


def test_bad_version_and_kind_refused_at_their_first_byte() -> None:
    """A stranger's short line is refused at once, without waiting for a whole header."""
    with pytest.raises(FrameError, match="version 71"):
        FrameDecoder().feed(b"G")
    dec = FrameDecoder()
    assert dec.feed(bytes([VERSION])) == []
    with pytest.raises(FrameError, match="unknown frame kind 9"):
        dec.feed(b"\x09")
    dec = FrameDecoder()
    (frame,) = dec.feed(wire(payload=b"ok") + bytes([VERSION, FrameKind.PONG]))
    assert bytes(frame.payload) == b"ok" and dec.mid_frame
    with pytest.raises(FrameError, match="version 0") as info:
        FrameDecoder().feed(wire(payload=b"ok") + b"\x00")
    assert [bytes(f.payload) for f in info.value.frames] == [b"ok"]


def test_default_limits_refuse_over_one_gib() -> None:
    dec = FrameDecoder()
    with pytest.raises(FrameError, match="exceeds limit") as info:
        dec.feed(raw_header(payload_len=(1 << 30) + 1))
    assert "this side's FrameLimits.max_payload" in str(info.value)
    dec = FrameDecoder()
    with pytest.raises(FrameError, match="exceeds limit"):
        dec.feed(raw_header(meta_len=64 * 1024 + 1))


# ---- decoder: properties (hypothesis) -----------------------------------------------------------

frame_tuples = st.one_of(
    st.tuples(
        st.just(FrameKind.DATA),
        st.integers(0, U64_MAX),
        st.integers(0, U64_MAX),
        st.binary(max_size=SMALL.max_meta),
        st.binary(max_size=3 * SMALL.direct_threshold),
        st.integers(0, 0xFFFF),
    ),
    st.tuples(
        st.sampled_from([FrameKind.PING, FrameKind.PONG, FrameKind.GOODBYE]),
        st.just(0),
        st.just(0),
        st.just(b""),
        st.just(b""),
        st.just(0),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(frame_tuples, max_size=12),
    chunks=st.lists(st.integers(1, 700)),
    peek=st.lists(st.booleans(), max_size=5),
)
def test_property_round_trip_under_any_chunking(
    frames: list[FrameTuple], chunks: list[int], peek: list[bool]
) -> None:
    """Any chunking, with reads that peek or not in any mix (the TCP reader peeks, the
    TLS one does not, and ``feed`` never does)."""
    data = stream_of(frames, SMALL)
    dec = FrameDecoder(SMALL)
    out: list[Frame] = []
    feed_in_steps(dec, data, chunks, out, peek)
    assert [as_tuple(f) for f in out] == frames
    assert not dec.mid_frame


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(frame_tuples, max_size=10),
    named=st.sets(st.integers(0, 9)),
    chunks=st.lists(st.integers(1, 700)),
    peek=st.lists(st.booleans(), max_size=5),
)
def test_property_places_never_change_what_is_decoded(
    frames: list[FrameTuple], named: set[int], chunks: list[int], peek: list[bool]
) -> None:
    """Naming places for any subset of frames (with any channel and seq) decodes the same
    frames under any chunking, and every named place of a matching frame holds its payload."""
    dec = FrameDecoder(SMALL)
    places: dict[int, memoryview] = {}
    seen: set[tuple[int, int]] = set()
    for i, (kind, channel, seq, _, payload, _) in enumerate(frames):
        if i in named and kind is FrameKind.DATA and payload and (channel, seq) not in seen:
            places[i] = place_of(len(payload))
            dec.expect(channel, seq, places[i])
        seen.add((channel, seq))
    out: list[Frame] = []
    feed_in_steps(dec, stream_of(frames, SMALL), chunks, out, peek)
    assert [as_tuple(f) for f in out] == frames
    for i, place in places.items():
        assert out[i].payload is place


def decode_or_frame_error(data: bytes, chunks: list[int]) -> list[Frame]:
    """Feed ``data``; the only exception allowed out is FrameError, and every call must
    make progress (a non-empty buffer), so the decoder can never spin."""
    dec = FrameDecoder(SMALL)
    out: list[Frame] = []
    with contextlib.suppress(FrameError):
        feed_in_steps(dec, data, chunks, out)
    return out


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=2000), chunks=st.lists(st.integers(1, 300), max_size=8))
def test_property_random_bytes_only_frame_error(data: bytes, chunks: list[int]) -> None:
    for f in decode_or_frame_error(data, chunks):  # whatever was decoded respects the limits
        assert len(f.meta) <= SMALL.max_meta and f.payload.nbytes <= SMALL.max_payload


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(frame_tuples, min_size=1, max_size=6),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4),
    chunks=st.lists(st.integers(1, 300), max_size=8),
)
def test_property_mutated_streams_only_frame_error(
    frames: list[FrameTuple], flips: list[tuple[int, int]], chunks: list[int]
) -> None:
    data = bytearray(stream_of(frames, SMALL))
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    got = decode_or_frame_error(bytes(data), chunks)
    for f in got:  # whatever was decoded respects the limits
        assert len(f.meta) <= SMALL.max_meta and f.payload.nbytes <= SMALL.max_payload


# ---- ArrayHeader ----------------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4, 5), (2, 0, 3)], ids=str)
def test_array_header_round_trip(code: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.random(shape) * 100).astype(np.dtype("<" + code))
    header = ArrayHeader.of(arr)
    assert header.shape == shape
    assert header.nbytes == arr.nbytes
    wire_form = msgpack.unpackb(msgpack.packb(header.to_wire()), raw=False)
    back = ArrayHeader.from_wire(wire_form)
    assert back == header
    view = back.view(memoryview(arr.tobytes()))
    assert view.dtype == arr.dtype and view.shape == arr.shape
    assert np.array_equal(view, arr)


def test_array_header_view_is_zero_copy() -> None:
    header = ArrayHeader.from_wire(["<f4", [2, 3]])
    buf = bytearray(24)
    view = header.view(memoryview(buf))
    buf[:4] = np.float32(1.5).tobytes()
    assert view[0, 0] == 1.5


@pytest.mark.parametrize("delta", [-1, 1, -24])
def test_array_header_view_checks_byte_count(delta: int) -> None:
    header = ArrayHeader.from_wire(["<f4", [2, 3]])
    with pytest.raises(ArrayHeaderError, match="does not match float32"):
        header.view(memoryview(bytes(24 + delta)))


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype(object),
        np.dtype("V8"),
        np.dtype([("a", "<i4"), ("b", "<f8")]),
        np.dtype("U4"),
        np.dtype("S4"),
        np.dtype("M8[ns]"),
        np.dtype("m8[s]"),
        np.dtype("f8,f8"),
    ],
    ids=str,
)
def test_refused_dtypes(dtype: np.dtype[Any]) -> None:
    with pytest.raises(ArrayHeaderError, match="cannot travel"):
        check_dtype(dtype)
    with pytest.raises(ArrayHeaderError):
        ArrayHeader.of(np.zeros(2, dtype=dtype))


def test_a_bfloat16_array_is_refused_with_the_ways_to_send_it() -> None:
    """ml_dtypes' bfloat16 is numeric, but not a numpy dtype the wire carries: the error
    says what to do instead (reduce float32 with a bfloat16 wire, or move the bits)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(ArrayHeaderError, match="cannot travel") as info:
        check_dtype(np.dtype(ml_dtypes.bfloat16))
    assert "wire_dtype='bfloat16'" in str(info.value) and "view(np.uint16)" in str(info.value)


def test_big_endian_and_non_contiguous_arrays_refused() -> None:
    """The header always says little-endian C order, so bytes in any other layout would be
    reinterpreted on the other side."""
    with pytest.raises(ArrayHeaderError, match="big-endian"):
        ArrayHeader.of(np.arange(4, dtype=">i4"))
    with pytest.raises(ArrayHeaderError, match="C-contiguous"):
        ArrayHeader.of(np.arange(12, dtype="<i4").reshape(3, 4).T)
    assert check_dtype(np.dtype(">f8")) == np.dtype("<f8")


@pytest.mark.parametrize(
    "obj",
    [
        None,
        "f4",
        ["<f4"],
        ["<f4", [1], 1],
        [1, [1]],
        ["<O", [1]],
        ["O", [1]],
        ["|V8", [1]],
        ["V8", [1]],
        ["<M8[ns]", [1]],
        ["<U1", [1]],
        ["", [1]],
        ["<<f4", [1]],
        ["<>f4", [1]],
        ["=<f4", [1]],
        ["<f4" + " " * 8, [1]],
        ["<f4", "12"],
        ["<f4", [-1]],
        ["<f4", [1.5]],
        ["<f4", [True]],
        ["<f4", ["3"]],
        ["<f4", [None]],
        ["<f4", [1] * 33],
        ["<f4", [1 << 63]],
        ["<f4", [1 << 40, 1 << 40]],  # 2**82 bytes
        ["<u1", [1 << 62, 1 << 62, 4]],  # product overflows int64
        ["<f4", [0, 1 << 62]],  # empty, but numpy cannot even shape it
        {"dtype": "<f4", "shape": [1]},
    ],
    ids=repr,
)
def test_array_header_from_wire_refuses(obj: Any) -> None:
    with pytest.raises(ArrayHeaderError):
        ArrayHeader.from_wire(obj)


def test_array_header_accepts_32_dims_and_describe() -> None:
    h = ArrayHeader.from_wire(["<i2", [1] * 32])
    assert h.nbytes == 2
    assert ArrayHeader.from_wire(["f4", [4, 3]]).describe() == "float32[4, 3]"


# ---- handshake records ----------------------------------------------------------------------


def body_record(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


HELLO = {"mode": "tls", "id": b"\x01" * 32, "want": b"\x02" * 32, "nonce": b"\x03" * 32}


def test_record_round_trip_byte_by_byte() -> None:
    data = encode_record(HELLO, first=True) + encode_record({"sig": b"s" * 64})
    assert data.startswith(MAGIC)
    reader = RecordReader(expect_magic=True)
    got: list[dict[str, Any]] = []
    for i in range(len(data)):
        reader.feed(data[i : i + 1])
        while (rec := reader.next_record()) is not None:
            got.append(rec)
    assert got == [HELLO, {"sig": b"s" * 64}]
    assert reader.leftover() == b""


@pytest.mark.parametrize(
    ("garbage", "match"),
    [
        (struct.pack(">I", MAX_RECORD + 1), "exceeds"),
        (body_record(b"\xc1"), "undecodable"),
        (body_record(msgpack.packb([1])), "must be a map"),
    ],
    ids=["oversized", "undecodable", "not-a-map"],
)
def test_record_trailing_garbage_byte_by_byte(garbage: bytes, match: str) -> None:
    """Good records are delivered as their last byte arrives; the garbage after them is
    refused as soon as it is decisive (a whole length, or a whole body)."""
    records = [HELLO, {"sig": b"s" * 64}]
    encoded = [encode_record(HELLO, first=True), encode_record(records[1])]
    ends = list(itertools.accumulate(map(len, encoded)))
    data = b"".join(encoded) + garbage
    reader = RecordReader(expect_magic=True)
    got: list[dict[str, Any]] = []
    with pytest.raises(HandshakeError, match=match):
        for i in range(len(data)):
            reader.feed(data[i : i + 1])
            while (rec := reader.next_record()) is not None:
                got.append(rec)
            assert len(got) == sum(end <= i + 1 for end in ends)  # no record early or late
    assert got == records
    assert i == len(data) - 1  # refused on the garbage's last byte, not earlier


def test_record_leftover_keeps_following_bytes() -> None:
    frames = wire(channel=1, payload=b"early frame")
    reader = RecordReader()
    reader.feed(encode_record({"ok": True}) + frames)
    assert reader.next_record() == {"ok": True}
    assert reader.leftover() == frames
    assert len(reader) == 0


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "not a p2pdist peer"),
        (b"G", "not a p2pdist peer"),  # refused at the first byte
        (b"P2PX\x01", "not a p2pdist peer"),
        (b"\x16\x03\x01\x02\x00", "not a p2pdist peer"),  # a TLS ClientHello
        (b"P2PD\x02" + b"\x00" * 8, "unsupported handshake version 2"),
        (b"P2PD\x00", "unsupported handshake version 0"),
    ],
)
def test_record_magic_check(data: bytes, match: str) -> None:
    reader = RecordReader(expect_magic=True)
    reader.feed(data)
    with pytest.raises(HandshakeError, match=match):
        reader.next_record()


def test_record_magic_prefix_waits() -> None:
    reader = RecordReader(expect_magic=True)
    for i in range(1, len(MAGIC)):
        reader.feed(MAGIC[i - 1 : i])
        assert reader.next_record() is None


def test_oversized_record_refused_before_body() -> None:
    reader = RecordReader(expect_magic=True)
    reader.feed(MAGIC + struct.pack(">I", MAX_RECORD + 1))
    with pytest.raises(HandshakeError, match="exceeds"):
        reader.next_record()
    with pytest.raises(ValueError, match="too large"):
        encode_record({"x": b"y" * MAX_RECORD})


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (msgpack.packb([1, 2, 3]), "must be a map"),
        (msgpack.packb("text"), "must be a map"),
        (msgpack.packb(None), "must be a map"),
        (b"", "undecodable"),
        (b"\xc1", "undecodable"),  # never-used msgpack byte
        (b"\x81\xa1a", "undecodable"),  # truncated map
        (msgpack.packb({"a": 1}) + b"\x00", "undecodable"),  # extra data
        (msgpack.packb({1: 2}), "undecodable"),  # non-string key
        (b"\xdd\xff\xff\xff\xff", "undecodable"),  # array claiming 4G items
    ],
)
def test_bad_record_bodies(body: bytes, match: str) -> None:
    reader = RecordReader()
    reader.feed(body_record(body))
    with pytest.raises(HandshakeError, match=match):
        reader.next_record()


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), magic=st.booleans())
def test_property_record_reader_only_handshake_error(data: bytes, magic: bool) -> None:
    reader = RecordReader(expect_magic=magic)
    reader.feed(data)
    try:
        for _ in range(len(data) + 1):
            rec = reader.next_record()
            if rec is None:
                break
            assert isinstance(rec, dict)
    except HandshakeError:
        pass


def test_get_bytes() -> None:
    assert get_bytes(HELLO, "id", 32) == b"\x01" * 32
    assert get_bytes({"x": b""}, "x") == b""
    for rec, key in [(HELLO, "missing"), ({"id": "text"}, "id"), ({"id": b"\x00" * 31}, "id")]:
        with pytest.raises(HandshakeError, match=repr(key)):
            get_bytes(rec, key, 32)


def test_auth_transcript_binds_role_and_every_field() -> None:
    fields = [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32, b"\x04" * 32]
    client = auth_transcript(b"C", *fields)
    server = auth_transcript(b"S", *fields)
    assert client != server
    assert auth_transcript(b"C", *fields) == client
    for i in range(4):
        changed = list(fields)
        changed[i] = b"\xff" * 32
        assert auth_transcript(b"C", *changed) != client
    # Swapping the ids (a reflected connection) changes the transcript too.
    assert auth_transcript(b"C", fields[1], fields[0], fields[2], fields[3]) != client


# ---- relay frames and STUN: byte by byte, with trailing garbage -------------------------------


RELAY_FRAMES = [
    (RelayFrameType.CHALLENGE, b"\x01" + bytes(range(32))),
    (RelayFrameType.PING, b"12345678"),
    (RelayFrameType.RECONNECT, b""),
    (RelayFrameType.RECV, b"\x07" * 32 + b"datagram"),
]


@pytest.mark.parametrize(
    ("garbage", "match"),
    [
        (b"\xee\x00\x00\x00\x00", "unknown relay frame type 0xee"),
        (b"\x00\x00\x00\x00\x00", "unknown relay frame type 0x0"),
        (bytes([RelayFrameType.SEND]) + (1 << 20).to_bytes(4, "big"), "exceeds"),
    ],
    ids=["unknown-type", "type-0", "oversized"],
)
def test_relay_decoder_trailing_garbage_byte_by_byte(garbage: bytes, match: str) -> None:
    """Every good frame comes out as its last byte arrives; the garbage header after them
    is refused as soon as it is whole, before any of its body."""
    ends = list(itertools.accumulate(len(encode_frame(k, b)) for k, b in RELAY_FRAMES))
    data = b"".join(encode_frame(k, b) for k, b in RELAY_FRAMES) + garbage + b"\x00" * 64
    dec = RelayFrameDecoder()
    got: list[tuple[RelayFrameType, bytes]] = []
    with pytest.raises(RelayProtocolError, match=match):
        for i in range(len(data)):
            got += dec.feed(data[i : i + 1])
            assert len(got) == sum(end <= i + 1 for end in ends)  # no frame early or late
    assert got == RELAY_FRAMES
    assert i == len(data) - 64 - 1  # the garbage header's last byte


def test_relay_decoder_error_carries_the_frames_before_the_garbage() -> None:
    """A relay's ERROR and then garbage in one read: the ERROR was lost with the error."""
    dec = RelayFrameDecoder()
    error = encode_frame(RelayFrameType.ERROR, b"why I close you")
    with pytest.raises(RelayProtocolError, match="unknown relay frame type") as caught:
        dec.feed(error + b"\x99\0\0\0\0")
    assert caught.value.frames == [(RelayFrameType.ERROR, b"", b"why I close you")]
    with pytest.raises(RelayProtocolError, match="unknown relay frame type"):
        dec.feed(error)  # and it refuses everything after
    assert dec.pending == 0
    short = encode_frame(RelayFrameType.SEND, b"abc")  # (this decoder checks no ids)
    assert RelayFrameDecoder().feed(short) == [(RelayFrameType.SEND, b"abc")]
    with pytest.raises(RelayProtocolError, match="unknown relay frame type") as caught:
        RelayFrameDecoder().feed(short + b"\x99\0\0\0\0")
    assert caught.value.frames == [(RelayFrameType.SEND, b"", b"abc")]


@pytest.mark.parametrize("datagram", [b"", b"x", bytearray(b"abc"), memoryview(b"view")])
def test_relay_addressed_frame_layout(datagram: bytes | bytearray | memoryview) -> None:
    peer = bytes(range(32))
    frame = encode_addressed(RelayFrameType.SEND, peer, datagram)
    body = peer + bytes(datagram)
    assert frame == bytes([RelayFrameType.SEND]) + len(body).to_bytes(4, "big") + body
    assert frame == encode_frame(RelayFrameType.SEND, body)
    ((kind, got),) = RelayFrameDecoder().feed(frame)
    assert kind is RelayFrameType.SEND and decode_addressed(got) == (peer, bytes(datagram))
    with pytest.raises(ValueError, match="exceeds"):
        encode_addressed(RelayFrameType.SEND, peer, bytes(64 * 1024 - 31))


# RFC 5769 section 2.2 and 2.3: sample Binding responses (SOFTWARE, XOR-MAPPED-ADDRESS,
# MESSAGE-INTEGRITY, FINGERPRINT), transaction id b7e7a701bc34d686fa87dfae.
RFC5769_TXID = bytes.fromhex("b7e7a701bc34d686fa87dfae")
RFC5769_V4 = bytes.fromhex(
    "0101003c2112a442b7e7a701bc34d686fa87dfae8022000b7465737420766563746f7220"
    "002000080001a147e112a643000800142b91f599fd9e90c38c7489f92af9ba53f06be7d7"
    "80280004c07d4c96"
)
RFC5769_V4_ADDR = ("192.0.2.1", 32853)
RFC5769_V6_ADDR = ("2001:db8:1234:5678:11:2233:4455:6677", 32853)
RFC5769_V6_XOR_ATTR = bytes.fromhex("002000140002a1470113a9faa5d3f179bc25f4b5bed2b9d9")


def test_stun_matches_rfc5769_vectors() -> None:
    """Parsing a standard server's answer (unknown attributes, padding) and the bytes we
    write, against the RFC's test vectors rather than our own round trip."""
    assert stun.parse_binding_response(RFC5769_V4, RFC5769_TXID) == RFC5769_V4_ADDR
    v4 = stun.binding_response(RFC5769_TXID, *RFC5769_V4_ADDR)
    assert v4[20:] == RFC5769_V4[36:48]  # our response is just the XOR-MAPPED-ADDRESS
    v6 = stun.binding_response(RFC5769_TXID, *RFC5769_V6_ADDR)
    assert v6[20:] == RFC5769_V6_XOR_ATTR
    assert stun.parse_binding_response(v6, RFC5769_TXID) == RFC5769_V6_ADDR


def test_stun_every_truncation_and_trailing_garbage_refused() -> None:
    request = stun.binding_request(RFC5769_TXID)
    for cut in range(len(RFC5769_V4)):
        with pytest.raises(stun.StunError):
            stun.parse_binding_response(RFC5769_V4[:cut], RFC5769_TXID)
    for cut in range(len(request)):
        with pytest.raises(stun.StunError):
            stun.parse_binding_request(request[:cut])
    for extra in (b"\x00", b"\x00" * 4, b"\x00\x20\x00\x00"):
        with pytest.raises(stun.StunError, match="length"):
            stun.parse_binding_response(RFC5769_V4 + extra, RFC5769_TXID)
        with pytest.raises(stun.StunError, match="length"):
            stun.parse_binding_request(request + extra)
