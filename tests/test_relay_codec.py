"""Relay frame, HTTP upgrade, URL and STUN codecs: whole, byte by byte, and fuzzed."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pdist import SecretKey, UsageError
from p2pdist.wire import stun
from p2pdist.wire.relay import (
    MAX_BODY,
    RelayFrame,
    RelayFrameDecoder,
    RelayFrameReader,
    RelayFrameType,
    RelayProtocolError,
    RelayUrl,
    auth_message,
    challenge_body,
    decode_addressed,
    encode_addressed,
    encode_frame,
    name_auth_message,
    parse_challenge,
    parse_http_head,
    relay_name,
    upgrade_request,
    upgrade_response,
)

KEY = SecretKey.from_seed("relay-codec-seed-0123", 0)


def test_frames_round_trip_whole_and_byte_by_byte() -> None:
    frames = [
        (RelayFrameType.CHALLENGE, b"\x01" + bytes(32)),
        (RelayFrameType.SEND, bytes(KEY.endpoint_id) + b"datagram"),
        (RelayFrameType.PING, b"12345678"),
        (RelayFrameType.RECONNECT, b""),
        (RelayFrameType.RECV, bytes(32) + bytes(MAX_BODY - 32)),
    ]
    data = b"".join(encode_frame(k, b) for k, b in frames)
    assert RelayFrameDecoder().feed(data) == frames
    dec = RelayFrameDecoder()
    got = []
    for i in range(len(data)):
        got += dec.feed(data[i : i + 1])
    assert got == frames and dec.pending == 0


def test_frame_limits_and_garbage() -> None:
    with pytest.raises(ValueError):
        encode_frame(RelayFrameType.SEND, bytes(MAX_BODY + 1))
    with pytest.raises(RelayProtocolError, match="exceeds"):
        RelayFrameDecoder().feed(b"\x10" + (MAX_BODY + 1).to_bytes(4, "big"))
    good = encode_frame(RelayFrameType.PING, b"abcdefgh")
    with pytest.raises(RelayProtocolError, match="unknown relay frame type"):
        RelayFrameDecoder().feed(good + b"\xee\x00\x00\x00\x00")
    assert RelayFrameDecoder().feed(good[:-1]) == []  # truncated: waits for more


def test_addressed_frames() -> None:
    frame = encode_addressed(RelayFrameType.SEND, KEY.endpoint_id, b"xyz")
    ((kind, body),) = RelayFrameDecoder().feed(frame)
    assert kind is RelayFrameType.SEND
    assert decode_addressed(body) == (bytes(KEY.endpoint_id), b"xyz")
    with pytest.raises(RelayProtocolError):
        decode_addressed(b"short")


@given(st.binary(max_size=300), st.integers(min_value=1, max_value=50))
def test_decoder_never_raises_anything_but_protocol_errors(data: bytes, step: int) -> None:
    dec = RelayFrameDecoder()
    try:
        for i in range(0, len(data), step):
            for kind, body in dec.feed(data[i : i + step]):
                assert isinstance(kind, RelayFrameType) and len(body) <= MAX_BODY
    except RelayProtocolError:
        pass


def as_reader_frames(frames: list[tuple[RelayFrameType, bytes]]) -> list[RelayFrame]:
    """What RelayFrameReader gives for the decoder's (kind, body) pairs."""
    addressed = (RelayFrameType.SEND, RelayFrameType.RECV)
    return [
        RelayFrame(k, b[:32], b[32:]) if k in addressed else RelayFrame(k, b"", b)
        for k, b in frames
    ]


def receive_in_place(
    reader: RelayFrameReader, data: bytes, step: int, max_body: int = MAX_BODY
) -> list[RelayFrame]:
    """Deliver ``data`` as a BufferedProtocol transport would: into get_buffer(), at most
    ``step`` bytes per read."""
    got: list[RelayFrame] = []
    pos = 0
    while pos < len(data):
        room = reader.get_buffer()
        assert room.nbytes >= max_body + 5  # always room for a whole largest frame
        n = min(step, room.nbytes, len(data) - pos)
        room[:n] = data[pos : pos + n]
        pos += n
        got += reader.buffer_updated(n)
    return got


@pytest.mark.parametrize("step", [1, 7, 4096, 70_000, 1 << 20])
def test_reader_receives_in_place_what_the_decoder_parses(step: int) -> None:
    frames = [
        (RelayFrameType.CHALLENGE, b"\x01" + bytes(32)),
        (RelayFrameType.RECV, bytes(KEY.endpoint_id) + b"datagram"),
        (RelayFrameType.PING, b"12345678"),
        (RelayFrameType.RECONNECT, b""),
        *[(RelayFrameType.RECV, bytes([i]) * 32 + bytes([i]) * (MAX_BODY - 32)) for i in range(5)],
        (RelayFrameType.RECV, bytes(32)),  # an empty datagram
    ]
    data = b"".join(encode_frame(k, b) for k, b in frames)
    reader = RelayFrameReader(capacity=1024)  # grows to two largest frames, no more
    assert receive_in_place(reader, data, step) == as_reader_frames(frames)
    assert reader.pending == 0
    assert RelayFrameReader().feed(data) == as_reader_frames(frames)


def test_reader_refuses_bad_frames_and_stays_refusing() -> None:
    short = encode_frame(RelayFrameType.RECV, b"too short for an id")
    with pytest.raises(RelayProtocolError, match="shorter than an endpoint id"):
        RelayFrameReader().feed(short)
    reader = RelayFrameReader(max_body=100)
    with pytest.raises(RelayProtocolError, match="exceeds"):
        reader.feed(encode_frame(RelayFrameType.PING, bytes(101)))
    with pytest.raises(RelayProtocolError):  # the connection is bad: nothing more parses
        reader.feed(encode_frame(RelayFrameType.PING, b"12345678"))


@given(st.binary(max_size=400), st.integers(min_value=1, max_value=60))
def test_reader_and_decoder_agree_on_any_bytes(data: bytes, step: int) -> None:
    dec, reader = RelayFrameDecoder(max_body=300), RelayFrameReader(max_body=300, capacity=1)
    want: list[tuple[RelayFrameType, bytes]] = []
    got: list[RelayFrame] = []
    dec_error = reader_error = None
    try:
        for i in range(0, len(data), step):
            want += dec.feed(data[i : i + step])
    except RelayProtocolError as exc:
        dec_error = exc
    try:
        got = receive_in_place(reader, data, step, max_body=300)
    except RelayProtocolError as exc:
        reader_error = exc
    addressed = (RelayFrameType.SEND, RelayFrameType.RECV)
    if dec_error is None and any(k in addressed and len(b) < 32 for k, b in want):
        assert reader_error is not None  # the reader also checks the id's length
        return
    assert (dec_error is None) == (reader_error is None)
    if reader_error is None:
        assert got == as_reader_frames(want)


def test_auth_message_binds_everything() -> None:
    base = auth_message(b"h" * 32, b"c" * 32, b"i" * 32)
    assert base != auth_message(b"H" * 32, b"c" * 32, b"i" * 32)
    assert base != auth_message(b"h" * 32, b"C" * 32, b"i" * 32)
    assert base != auth_message(b"h" * 32, b"c" * 32, b"I" * 32)
    with pytest.raises(ValueError):
        auth_message(b"short", b"c" * 32, b"i" * 32)


def test_a_name_bound_proof_binds_everything_and_never_reads_as_a_certificate_bound_one() -> None:
    name = relay_name("relay.example.com", 443)
    base = name_auth_message(name, b"c" * 32, b"i" * 32)
    assert base != name_auth_message(relay_name("relay.example.com", 8443), b"c" * 32, b"i" * 32)
    assert base != name_auth_message(name, b"C" * 32, b"i" * 32)
    assert base != name_auth_message(name, b"c" * 32, b"I" * 32)
    # The name's length is written: no name can end where a longer one's bytes go on.
    assert base[27:29] == len(name).to_bytes(2, "big") and base[29:50] == name
    # Another context string: no certificate-bound message is a name-bound one.
    assert not base.startswith(auth_message(b"h" * 32, b"c" * 32, b"i" * 32)[:22])
    for bad in ((b"", b"c" * 32, b"i" * 32), (name, b"c" * 31, b"i" * 32), (name, b"c" * 32, b"i")):
        with pytest.raises(ValueError):
            name_auth_message(*bad)


@pytest.mark.parametrize(
    ("host", "port", "name"),
    [
        ("Relay.Example.COM", 443, b"relay.example.com:443"),
        ("127.0.0.1", 8443, b"127.0.0.1:8443"),
        ("2001:DB8:0:0::1", 443, b"[2001:db8::1]:443"),
    ],
)
def test_relay_names_are_written_one_way(host: str, port: int, name: bytes) -> None:
    assert relay_name(host, port) == name
    url = RelayUrl.parse(f"https://{'[' + host + ']' if ':' in host else host}:{port}/")
    assert relay_name(url.host, url.port) == name  # as the client computes it


def test_challenges_ask_for_either_binding_and_nothing_else() -> None:
    c = bytes(range(32))
    assert challenge_body(c) == b"\x01" + c
    assert parse_challenge(challenge_body(c)) == (c, False)
    assert challenge_body(c, name_bound=True) == b"\x01" + c + b"\x01"
    assert parse_challenge(challenge_body(c, name_bound=True)) == (c, True)
    for bad in (b"\x02" + c, b"\x01" + c[:31], b"\x01" + c + b"\x00", b"\x01" + c + b"\x02", b""):
        with pytest.raises(RelayProtocolError, match="version-1 challenge"):
            parse_challenge(bad)


def test_http_upgrade_heads() -> None:
    req = upgrade_request("relay.example")
    parsed = parse_http_head(req + b"\x01\x02")
    assert parsed is not None
    head, used = parsed
    assert used == len(req)
    assert head.start_line[:2] == ["GET", "/relay"]
    assert head.header("Upgrade") == "p2pdist-relay"
    resp = parse_http_head(upgrade_response())
    assert resp is not None and resp[0].start_line[1] == "101"
    assert parse_http_head(req[:-2]) is None
    with pytest.raises(RelayProtocolError, match="too large"):
        parse_http_head(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 2000)
    with pytest.raises(RelayProtocolError):
        parse_http_head(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")
    # What a proxy in front of the relay may read otherwise (RFC 9112 section 5): refused.
    for bad in [
        b"Connection : Upgrade",  # whitespace before the colon
        b"Upgrade: p2pdist-relay\r\n Upgrade: nope",  # an obsolete line continuation
        b"Upgrade: p2pdist-relay\r\nUpgrade: websocket",  # the upgrade named twice
        # RFC 9112 5.5: a bare LF, a bare CR or a NUL in a line (a proxy that ends lines
        # at a bare LF would read a second Upgrade or X-Forwarded-For line)
        b"X-A: 1\nUpgrade: evil\r\nUpgrade: p2pdist-relay",
        b"X-Forwarded-For: 192.0.2.1\nX-Forwarded-For: 198.51.100.6",
        b"X-A: 1\rUpgrade: evil",
        b"X-A: 1\x00",
    ]:
        with pytest.raises(RelayProtocolError):
            parse_http_head(b"GET /relay HTTP/1.1\r\nHost: x\r\n" + bad + b"\r\n\r\n")


def test_relay_urls() -> None:
    eid = KEY.endpoint_id
    url = RelayUrl.parse(f"https://127.0.0.1:8443/?pin={eid}")
    assert (url.host, url.port, url.pin) == ("127.0.0.1", 8443, eid)
    assert RelayUrl.parse(str(url)) == url
    plain = RelayUrl.parse("https://relay.example.com")
    assert (plain.port, plain.pin) == (443, None)
    v6 = RelayUrl.parse(f"https://[::1]:9/?pin={eid}")
    assert v6.host == "::1" and RelayUrl.parse(str(v6)) == v6
    idn = RelayUrl.parse("https://b\u00fccher.example:8443/")  # TLS, DNS and Host: IDNA
    assert idn.host == "xn--bcher-kva.example" and idn.authority == "xn--bcher-kva.example:8443"
    assert b"Host: xn--bcher-kva.example:8443\r\n" in upgrade_request(idn.authority)
    for bad in [
        "http://x",
        "https://",
        "https://x:99999",
        "https://x/?pin=abc",
        "https://x/?token=1",
        f"https://x/?pin={eid}&pin={eid}",
        # Empty values, userinfo, a path, port 0, a zone id: refused, not silently dropped
        # (an empty pin used to mean no pin: the system CAs instead of the key asked for).
        "https://x/?pin=",
        "https://x/?pin",
        "https://x/?foo=",
        f"https://x/?pin=&pin={eid}",
        f"https://x/?pin={eid}&foo=",
        "https://x:0/",
        "https://user:secret@x/",
        "https://x/path",
        "https://x/#frag",
        "https://[fe80::1%25eth0]/",
        # A name in brackets (what a relay printed for --public-host name:port): urlsplit
        # raises ValueError, which reached the user as a traceback.
        "https://[localhost:9443]:8443/",
        "https://[nothost]/",
        "https://a b/",  # no host name has a space (the upgrade's Host line would break)
        "https://a\u2028b/",
    ]:
        with pytest.raises(UsageError):
            RelayUrl.parse(bad)


def test_frames_before_bad_bytes_in_one_read_come_with_the_error() -> None:
    """A relay's ERROR right before bytes that break the protocol, in the same read: the
    reader hands the ERROR over with its RelayProtocolError (it was lost, and with it
    the reason the relay gave)."""
    reader = RelayFrameReader(1 << 16)
    with pytest.raises(RelayProtocolError, match="0x99") as info:
        reader.feed(encode_frame(RelayFrameType.ERROR, b"bad token") + b"\x99\0\0\0\0")
    assert [(f.kind, f.body) for f in info.value.frames] == [(RelayFrameType.ERROR, b"bad token")]
    with pytest.raises(RelayProtocolError):  # and it stays failed
        reader.feed(encode_frame(RelayFrameType.PING, b"12345678"))


def test_stun_binding_round_trip_and_rejections() -> None:
    txid = stun.new_transaction_id()
    req = stun.binding_request(txid)
    assert len(req) == 20 and stun.parse_binding_request(req) == txid
    for ip, port in [("203.0.113.7", 40000), ("2001:db8::1", 1)]:
        resp = stun.binding_response(txid, ip, port)
        assert stun.parse_binding_response(resp, txid) == (ip, port)
    resp = stun.binding_response(txid, "198.51.100.1", 5)
    with pytest.raises(stun.StunError, match="another transaction"):
        stun.parse_binding_response(resp, stun.new_transaction_id())
    with pytest.raises(stun.StunError):
        stun.parse_binding_request(resp)  # a response is not a request
    with pytest.raises(stun.StunError):
        stun.parse_binding_request(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(stun.StunError):
        stun.parse_binding_request(req + b"junk")  # length field disagrees


@given(st.binary(max_size=200))
def test_stun_parsers_only_raise_stun_errors(data: bytes) -> None:
    txid = bytes(12)
    for parse in (stun.parse_binding_request, lambda d: stun.parse_binding_response(d, txid)):
        with contextlib.suppress(stun.StunError):
            parse(data)


def test_relay_reader_feed_keeps_good_frames_of_earlier_buffers_with_its_error() -> None:
    """A feed larger than the reader's buffer goes in several fills: an error in a later
    fill came without the frames of the earlier ones."""
    reader = RelayFrameReader(MAX_BODY)
    good = [encode_frame(RelayFrameType.PING, bytes(MAX_BODY - 1)) for _ in range(6)]
    data = b"".join(good) + encode_frame(RelayFrameType.ERROR, b"why") + b"\x99\0\0\0\0"
    assert len(data) > len(reader.get_buffer())
    with pytest.raises(RelayProtocolError, match="unknown relay frame type") as caught:
        reader.feed(data)
    kinds = [frame.kind for frame in caught.value.frames]
    assert kinds == [RelayFrameType.PING] * 6 + [RelayFrameType.ERROR]
