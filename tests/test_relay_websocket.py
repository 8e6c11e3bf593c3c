"""WebSocket framing of relay sessions: the RFC 6455 codec, the relay core's WebSocket
upgrade and proxied sessions (fake links, hand-moved clock), the real client choosing
its framing, and a group through a real nginx that terminates TLS in front of a real
relay process and lets only WebSocket upgrades through."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relay_helpers import RelayProcess
from test_relay_core import FakeLink, auth_frame, core
from test_relay_server import _certificate
from transport_conformance import bounded

from p2pdist import (
    Group,
    GroupConfig,
    PeerAuthenticationError,
    PunchConfig,
    SecretKey,
)
from p2pdist.doctor import diagnose, render
from p2pdist.transport.relay_path import RelayConfig, RelayPath
from p2pdist.transport.relay_session import PONG_BACKLOG, RelaySessionProtocol
from p2pdist.wire.relay import (
    RECORDS_HEADER,
    RelayFrameDecoder,
    RelayFrameType,
    RelayProtocolError,
    RelayUrl,
    decode_map,
    encode_frame,
    name_auth_message,
    parse_http_head,
    relay_name,
    upgrade_request,
)
from p2pdist.wire.websocket import (
    Opcode,
    WebSocketError,
    WebSocketReader,
    accept_for,
    client_key,
    close_frame,
    echo_code,
    frame,
    mask,
    valid_key,
)
from relay.addresses import forwarded_ip
from relay.config import RelayConfig as ServerConfig
from relay.inbound import WS_BEFORE_AUTH
from relay.server import RelayServer
from relay.session import Phase

T = RelayFrameType
KEYS = [SecretKey.from_seed("relay websocket tests", r) for r in range(3)]


# ---- the codec --------------------------------------------------------------------------


def test_the_accept_value_of_rfc_6455_and_key_checks() -> None:
    assert accept_for("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # 1.3
    assert valid_key(client_key()) and client_key() != client_key()
    assert not valid_key("") and not valid_key("not base64!") and not valid_key("AAAA")


def test_mask_is_its_own_inverse_at_any_offset() -> None:
    data, key = os.urandom(1001), b"\x01\x02\x03\x04"
    whole = mask(data, key)
    assert whole != data and mask(whole, key) == data
    pieces = mask(data[:7], key) + mask(data[7:500], key, 7) + mask(data[500:], key, 500)
    assert pieces == whole


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.binary(max_size=300), max_size=8),
    st.lists(st.integers(1, 400), min_size=1, max_size=40),
    st.booleans(),
)
def test_any_chunking_reads_back_the_stream_and_the_control_frames(
    messages: list[bytes], cuts: list[int], masked: bool
) -> None:
    wire = b"".join(frame(m, masked=masked) for m in messages)
    wire += frame(b"ping!", Opcode.PING, masked=masked) + frame(b"tail", masked=masked)
    wire += close_frame(1000, "bye", masked=masked) + b"ignored after CLOSE"
    reader, events, pos, i = WebSocketReader(masked=masked), [], 0, 0
    while pos < len(wire):
        n = cuts[i % len(cuts)]
        events += reader.feed(wire[pos : pos + n])
        pos, i = pos + n, i + 1
    data = [e.payload for e in events if e.opcode is Opcode.BINARY]
    controls = [(e.opcode, e.payload) for e in events if e.opcode is not Opcode.BINARY]
    assert controls == [(Opcode.PING, b"ping!"), (Opcode.CLOSE, b"\x03\xe8bye")]
    before_ping = b"".join(data)[: sum(map(len, messages))]
    assert before_ping == b"".join(messages) and b"".join(data).endswith(b"tail")
    assert reader.closed


def test_a_huge_frame_streams_without_being_held() -> None:
    key = b"\x09\x08\x07\x06"
    head = struct.pack("!BBQ", 0x82, 0x80 | 127, 1 << 40) + key  # announces a terabyte
    reader = WebSocketReader(masked=True)
    [event] = reader.feed(head + mask(b"abcdef", key))
    assert event.payload == b"abcdef"
    [event] = reader.feed(mask(b"ghij", key, 6))
    assert event.payload == b"ghij"


@pytest.mark.parametrize(
    ("masked", "wire", "why"),
    [
        (True, frame(b"x", masked=False), "unmasked client frame"),
        (False, frame(b"x", masked=True), "masked server frame"),
        (False, frame(b"x", Opcode.TEXT, masked=False), "text frame"),
        (False, bytes([0xC2, 0]), "reserved bits"),
        (False, bytes([0x83, 0]), "unknown opcode"),
        (False, bytes([0x09, 0]), "fragmented or oversized control"),
        (False, bytes([0x89, 126, 0, 126]) + bytes(126), "fragmented or oversized control"),
        (False, bytes([0x80, 1, 0]), "continuation frame without"),
        (False, bytes([0x02, 1, 0, 0x82, 0]), "new message before"),
        (False, struct.pack("!BBQ", 0x82, 127, 1 << 63), "top bit"),
    ],
)
def test_framing_faults_are_errors(masked: bool, wire: bytes, why: str) -> None:
    with pytest.raises(WebSocketError, match=why):
        WebSocketReader(masked=masked).feed(wire)


def test_a_fragmented_message_is_one_stream() -> None:
    wire = bytes([0x02, 2]) + b"ab" + bytes([0x89, 1]) + b"p" + bytes([0x80, 2]) + b"cd"
    events = WebSocketReader(masked=False).feed(wire)
    assert [(e.opcode, e.payload) for e in events] == [
        (Opcode.BINARY, b"ab"),
        (Opcode.PING, b"p"),
        (Opcode.BINARY, b"cd"),
    ]


# ---- the relay core ---------------------------------------------------------------------


class WsLink(FakeLink):
    """A fake link that reads the relay's WebSocket frames back into relay frames."""

    def __init__(self) -> None:
        super().__init__()
        self.reader = WebSocketReader(masked=False)
        self.relay_frames = RelayFrameDecoder()
        self.controls: list[tuple[Opcode, bytes]] = []

    def head(self) -> tuple[str, dict[str, str]]:
        parsed = parse_http_head(self.data)
        assert parsed is not None, bytes(self.data[:80])
        head, used = parsed
        del self.data[:used]
        return " ".join(head.start_line), head.headers

    def ws_frames(self) -> list[tuple[RelayFrameType, bytes]]:
        out: list[tuple[RelayFrameType, bytes]] = []
        for event in self.reader.feed(bytes(self.data)):
            if event.opcode is Opcode.BINARY:
                out += self.relay_frames.feed(event.payload)
            else:
                self.controls.append((event.opcode, event.payload))
        self.data.clear()
        return out


def ws_upgrade(
    c: object, *, proxied: bool = False, records: bytes | None = None, forwarded: str = ""
) -> tuple[object, WsLink, str]:
    from relay.state import RelayCore

    assert isinstance(c, RelayCore)
    link, key = WsLink(), client_key()
    s = c.open(link, ("127.0.0.1", 5000), 0.0, proxied=proxied)
    request = upgrade_request("relay.test", records, key)
    if forwarded:
        request = request[:-2] + f"X-Forwarded-For: {forwarded}\r\n\r\n".encode()
    c.receive(s, request, 0.0)
    return s, link, key


def ws_session(c: object, **kw: Any) -> tuple[Any, WsLink]:
    """A WebSocket session in the AUTH phase, its 101 and CHALLENGE read."""
    s, link, _ = ws_upgrade(c, **kw)
    link.head()
    assert [kind for kind, _ in link.ws_frames()] == [T.CHALLENGE]
    return s, link


def test_a_websocket_upgrade_without_records_speaks_websocket_frames() -> None:
    c = core()
    s, link, key = ws_upgrade(c)
    status, headers = link.head()
    assert status == "HTTP/1.1 101 Switching Protocols"
    assert headers["upgrade"] == "websocket"
    assert headers["sec-websocket-accept"] == accept_for(key)
    assert headers["sec-websocket-protocol"] == "p2pdist-relay"
    assert link.ws_frames() == [(T.CHALLENGE, b"\x01" + b"\x07" * 32)]
    # AUTH cut across three masked frames, each a run of the stream.
    auth = auth_frame(KEYS[0])
    wire = b"".join(frame(auth[i : i + 40], masked=True) for i in range(0, len(auth), 40))
    for i in range(0, len(wire), 17):
        c.receive(s, wire[i : i + 17], 0.0)
    [(kind, body)] = link.ws_frames()
    assert kind is T.AUTH_OK and decode_map(body)["observed"] == "127.0.0.1:5000"
    c.receive(s, frame(b"are you there", Opcode.PING, masked=True), 0.0)
    link.ws_frames()
    assert link.controls == [(Opcode.PONG, b"are you there")]
    assert c.metrics.websocket_upgrades_total == 1


def test_every_websocket_frame_is_charged_empty_and_joined_ones_too() -> None:
    """Empty masked binary frames (6 bytes) made no event and the data frames of one
    read made one, so a client sending them escaped the per-frame charge: a third of a
    core at --rate 1000000 (a fifth in PINGs of the same rate). Each frame header read
    is charged FRAME_CHARGE, as each relay frame is."""
    from relay.state import FRAME_CHARGE

    c = core(rate=1_000_000, burst=1 << 22)
    s, _ = ws_session(c)
    c.receive(s, frame(auth_frame(KEYS[0]), masked=True), 0.0)
    bucket = s.bucket
    assert bucket is not None
    before = bucket.level(0.0)
    empties = frame(b"", masked=True) * 100
    c.receive(s, empties, 0.0)
    assert before - bucket.level(0.0) == len(empties) + 100 * FRAME_CHARGE
    before = bucket.level(0.0)
    pong = encode_frame(T.PONG, b"p" * 8)
    pieces = frame(pong[:4], masked=True) + frame(pong[4:], masked=True)  # one relay frame
    c.receive(s, pieces, 0.0)
    assert before - bucket.level(0.0) == len(pieces) + 3 * FRAME_CHARGE


def test_on_the_tls_port_records_win_and_frames_stay_raw() -> None:
    c = core()
    _, link, key = ws_upgrade(c, records=b"\x05" * 32)
    _, headers = link.head()
    assert headers["sec-websocket-accept"] == accept_for(key) and "p2pdist-relay-records" in headers
    assert link.records is not None  # the glue moves the stream to records
    assert link.relay_frames.feed(bytes(link.data))[0][0] is T.CHALLENGE  # no WS header
    assert c.metrics.websocket_upgrades_total == 0


def test_an_unmasked_client_frame_closes_with_an_error_and_a_close_frame() -> None:
    c = core()
    s, link = ws_session(c)
    c.receive(s, frame(auth_frame(KEYS[0]), masked=False), 0.0)
    [(kind, body)] = link.ws_frames()
    assert kind is T.ERROR and b"unmasked client frame before AUTH" in body
    assert link.controls == [(Opcode.CLOSE, b"\x03\xea")] and link.closed  # 1002
    assert c.metrics.protocol_errors_total == 1


def test_a_client_close_frame_ends_the_session_and_is_answered() -> None:
    c = core()
    s, link = ws_session(c)
    c.receive(s, auth_frame_ws(KEYS[0]), 0.0)
    link.ws_frames()
    assert c.clients == 1
    c.receive(s, close_frame(1000, masked=True), 0.0)
    link.ws_frames()
    assert c.clients == 0 and link.closed and link.controls[-1] == (Opcode.CLOSE, b"\x03\xe8")
    before_auth, link = ws_session(c)  # a CLOSE before AUTH: counted as one that left
    c.receive(before_auth, close_frame(1000, masked=True), 0.0)
    assert link.closed and c.metrics.abandoned["auth"] == 1


def test_bytes_out_counts_every_byte_written_pongs_and_closes_too() -> None:
    """bytes_out_total left out WebSocket PONGs, CLOSEs and frame headers: a client
    pinging without end made the relay write bytes its metrics never showed."""
    c = core()
    s, link, _ = ws_upgrade(c)
    assert c.metrics.bytes_out_total == len(link.data)  # the 101 and the CHALLENGE
    written = len(link.data)
    link.head()
    link.ws_frames()
    write = link.write

    def counted(data: bytes) -> None:
        nonlocal written
        written += len(data)
        write(data)

    link.write = counted  # type: ignore[method-assign]
    c.receive(s, auth_frame_ws(KEYS[0]), 0.0)
    for _ in range(3):
        c.receive(s, frame(b"x" * 100, Opcode.PING, masked=True), 0.0)
    c.receive(s, close_frame(1000, masked=True), 0.0)
    link.ws_frames()
    assert [op for op, _ in link.controls] == [Opcode.PONG] * 3 + [Opcode.CLOSE]
    assert c.metrics.bytes_out_total == written


def auth_frame_ws(key: SecretKey) -> bytes:
    return frame(auth_frame(key), masked=True)


def test_proxied_sessions_decline_records_and_take_the_forwarded_address() -> None:
    c = core(max_clients_per_ip=1, max_unauthenticated_per_ip=1)
    forwarded = "10.9.9.9, 198.51.100.4"  # the first is the client's word, the last the proxy's
    s, link, _ = ws_upgrade(c, proxied=True, records=b"\x05" * 32, forwarded=forwarded)
    _, headers = link.head()
    assert "p2pdist-relay-records" not in headers  # through a proxy: WebSocket frames
    link.ws_frames()
    # Every proxied connection comes from the proxy: no per-source cap at accept, nor
    # for sessions whose proxy sent no address...
    waiting = [ws_upgrade(c, proxied=True)[0] for _ in range(3)]
    assert all(w.phase is Phase.AUTH for w in waiting)  # type: ignore[attr-defined]
    # ...but once the forwarded address is read, it counts as the source's.
    _, link3, _ = ws_upgrade(c, proxied=True, forwarded="198.51.100.4:5555")
    assert link3.http().startswith(b"HTTP/1.1 503 ") and link3.closed
    assert c.metrics.refused["max_unauthenticated_per_ip"] == 1
    c.receive(s, auth_frame_ws(KEYS[0]), 0.0)
    [(kind, body)] = link.ws_frames()
    assert kind is T.AUTH_OK and decode_map(body)["observed"] == "198.51.100.4"
    s2, link2 = ws_session(c, proxied=True, forwarded="[::ffff:198.51.100.4]:7")
    c.receive(s2, auth_frame_ws(KEYS[1]), 0.0)  # max-clients-per-ip counts the address
    [(kind, body)] = link2.ws_frames()
    assert kind is T.ERROR and body == b"too many clients from this address"


PROXY_NAME = relay_name("relay.example.com", 443)


def name_auth_ws(key: SecretKey, name: bytes = PROXY_NAME) -> bytes:
    """A WebSocket-framed AUTH whose proof is bound to the relay name ``name``."""
    raw = bytes(key.endpoint_id)
    sig = key.sign(name_auth_message(name, b"\x07" * 32, raw))
    return frame(encode_frame(T.AUTH, raw + sig), masked=True)


def test_behind_a_proxy_with_its_own_certificates_proofs_bind_the_relays_name() -> None:
    c = core(proof_name=PROXY_NAME)
    s, link, _ = ws_upgrade(c, proxied=True)
    link.head()
    assert link.ws_frames() == [(T.CHALLENGE, b"\x01" + b"\x07" * 32 + b"\x01")]
    c.receive(s, name_auth_ws(KEYS[0]), 0.0)
    [(kind, _)] = link.ws_frames()
    assert kind is T.AUTH_OK
    # Through that proxy a proof bound to the certificate, or to another name (another
    # relay's, or this host at another port), is refused.
    for bad in (
        auth_frame_ws(KEYS[1]),
        name_auth_ws(KEYS[1], relay_name("relay.example.com", 8443)),
        name_auth_ws(KEYS[1], relay_name("relay.example.net", 443)),
    ):
        s2, link2 = ws_session(c, proxied=True)
        c.receive(s2, bad, 0.0)
        [(kind, body)] = link2.ws_frames()
        assert (kind, body) == (T.ERROR, b"bad signature")
    assert c.metrics.auth_failures["bad_signature"] == 3
    # On the relay's own TLS port the certificate binds, as before: a name-bound proof
    # is refused there.
    for proof, answer in ((name_auth_ws(KEYS[1]), T.ERROR), (auth_frame_ws(KEYS[1]), T.AUTH_OK)):
        s3, link3, _ = ws_upgrade(c)
        link3.head()
        assert link3.ws_frames() == [(T.CHALLENGE, b"\x01" + b"\x07" * 32)]
        c.receive(s3, proof, 0.0)
        assert [kind for kind, _ in link3.ws_frames()] == [answer]


def test_without_proxy_certs_own_a_name_bound_proof_is_refused_through_the_proxy() -> None:
    """A middlebox that asks the client for a name-bound proof gets nothing the relay
    takes: only a relay told ``proxy-certs own`` does."""
    c = core()
    s, link = ws_session(c, proxied=True)
    c.receive(s, name_auth_ws(KEYS[0]), 0.0)
    assert link.ws_frames() == [(T.ERROR, b"bad signature")]


@pytest.mark.parametrize(
    "public_host", ["Relay.Example.COM", "bücher.example", "relay.example.com.", "2001:DB8:0::1"]
)
async def test_the_relay_binds_the_name_of_the_url_it_prints(public_host: str) -> None:
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        stun_port=0,
        http_port=0,
        proxy_certs="own",
        public_host=public_host,
        public_port=443,
    )
    async with RelayServer(config) as srv:
        url = RelayUrl.parse(srv.url)
        assert url.pin is None  # the balancer's URL: its certificate, through the CAs
        assert srv.core.config.proof_name == relay_name(url.host, url.port)  # as clients do


@pytest.mark.parametrize(
    ("header", "ip"),
    [
        ("198.51.100.4", "198.51.100.4"),
        ("10.0.0.1, 198.51.100.4:4711", "198.51.100.4"),
        ("2001:db8::1", "2001:db8::1"),
        ("[2001:db8::1]:4711", "2001:db8::1"),
        ("::ffff:192.0.2.1", "192.0.2.1"),
        ("", None),
        ("unknown", None),
        ("198.51.100.4, _hidden", None),
    ],
)
def test_forwarded_addresses(header: str, ip: str | None) -> None:
    assert forwarded_ip(header) == ip


@pytest.mark.parametrize(
    ("header", "hops", "ip"),
    [
        ("203.0.113.7, 10.0.0.2", 2, "203.0.113.7"),  # load balancer, then nginx
        ("6.6.6.6, 203.0.113.7, 10.0.0.2", 2, "203.0.113.7"),  # the first: the client's word
        ("[2001:db8::7]:9, 10.0.0.3, 10.0.0.2", 3, "2001:db8::7"),
        ("10.0.0.2", 2, None),  # fewer entries than proxies: one of them did not append
        ("", 2, None),
    ],
)
def test_forwarded_addresses_behind_several_proxies(header: str, hops: int, ip: str | None) -> None:
    assert forwarded_ip(header, hops) == ip


def test_a_header_on_several_lines_is_one_list() -> None:
    head, _ = parse_http_head(
        b"GET / HTTP/1.1\r\nX-Forwarded-For: 6.6.6.6\r\nHost: r\r\n"
        b"x-forwarded-for: 203.0.113.7, 10.0.0.2\r\n\r\n"
    )
    assert head.header("x-forwarded-for") == "6.6.6.6, 203.0.113.7, 10.0.0.2"
    # A single value the protocol reads is refused when repeated, never joined.
    for name in ("Host", "Sec-WebSocket-Version", "P2pdist-Relay-Version", RECORDS_HEADER):
        with pytest.raises(RelayProtocolError, match="repeated HTTP header"):
            parse_http_head(f"GET / HTTP/1.1\r\n{name}: 1\r\n{name}: 1\r\n\r\n".encode())
    with pytest.raises(ValueError, match="hops must be at least 1"):
        forwarded_ip("6.6.6.6, 203.0.113.7", 0)  # entries[-0] would be the client's own
    with pytest.raises(ValueError, match="proxy_hops must be at least 1"):
        core(proxy_hops=0)


def test_proxy_hops_picks_the_client_behind_a_chain_of_proxies() -> None:
    c = core(max_unauthenticated_per_ip=1, proxy_hops=2)
    s, link = ws_session(c, proxied=True, forwarded="6.6.6.6, 203.0.113.7, 10.0.0.2")
    c.receive(s, auth_frame_ws(KEYS[0]), 0.0)
    [(kind, body)] = link.ws_frames()
    assert kind is T.AUTH_OK and decode_map(body)["observed"] == "203.0.113.7"
    # Two clients behind the same balancer are two sources, not the balancer's one.
    ws_session(c, proxied=True, forwarded="198.51.100.8, 10.0.0.2")
    _, again, _ = ws_upgrade(c, proxied=True, forwarded="198.51.100.8, 10.0.0.2")
    assert again.http().startswith(b"HTTP/1.1 503 ")  # that client's cap, not everyone's


def test_before_auth_a_client_may_send_little_and_gets_one_pong_per_read() -> None:
    c = core()
    s, link = ws_session(c)
    pings = frame(b"", Opcode.PING, masked=True) * 100  # 600 bytes in one read
    c.receive(s, pings, 0.0)
    link.ws_frames()
    assert link.controls == [(Opcode.PONG, b"")]
    empty = frame(b"", masked=True)
    for _ in range(WS_BEFORE_AUTH // len(empty) + 1):
        c.receive(s, empty, 0.0)
        if link.closed:
            break
    [(kind, body)] = link.ws_frames()
    assert kind is T.ERROR and body.startswith(b"more than") and link.closed


def test_bad_websocket_handshakes_get_400() -> None:
    c = core()
    for headers, why in [
        ("Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n", b"Sec-WebSocket-Key"),
        (
            f"Upgrade: websocket\r\nSec-WebSocket-Key: {client_key()}\r\n"
            "Sec-WebSocket-Version: 8\r\nSec-WebSocket-Protocol: p2pdist-relay\r\n",
            b"Sec-WebSocket-Version: 13",
        ),
        (
            f"Upgrade: websocket\r\nSec-WebSocket-Key: {client_key()}\r\n"
            "Sec-WebSocket-Version: 13\r\n",
            b"Sec-WebSocket-Protocol: p2pdist-relay",
        ),
    ]:
        link = FakeLink()
        s = c.open(link, ("127.0.0.1", 1), 0.0)
        request = f"GET /relay HTTP/1.1\r\nHost: r\r\nConnection: Upgrade\r\n{headers}\r\n"
        c.receive(s, request.encode(), 0.0)
        status = b"HTTP/1.1 426 " if b"Version" in why else b"HTTP/1.1 400 "
        assert link.http().startswith(status) and why in link.http(), link.http()


def test_http_port_settings_are_checked() -> None:
    from relay.config import ConfigError

    with pytest.raises(ConfigError, match="http-port needs cert"):
        ServerConfig(http_port=8080)
    pem = Path("/nonexistent/cert.pem")
    with pytest.raises(ConfigError, match="http-port must differ from port"):
        ServerConfig(http_port=8443, cert=pem, cert_key=pem)
    with pytest.raises(ConfigError, match="http-host must be an IP address"):
        ServerConfig(http_port=8080, http_host="proxy.local", cert=pem, cert_key=pem)
    assert ServerConfig(http_port=0, cert=pem, cert_key=pem).http_host == "127.0.0.1"
    with pytest.raises(ConfigError, match=r"public-port must be a port number 1\.\.65535"):
        ServerConfig(public_port=0)
    with pytest.raises(ConfigError, match=r"proxy-hops must be 1\.\.16, got 0"):
        ServerConfig(http_port=0, cert=pem, cert_key=pem, proxy_hops=0)
    with pytest.raises(ConfigError, match="proxy-hops is for the http-port"):
        ServerConfig(proxy_hops=2)
    # Settings that mean nothing without another were taken without a word (an audit).
    with pytest.raises(ConfigError, match="http-host is for the http-port"):
        ServerConfig(http_host="10.1.2.3")
    with pytest.raises(
        ConfigError,
        match=r"burst is the rate's bucket and rate is 0 .*: set a rate, or leave burst out",
    ):
        ServerConfig(burst=1 << 21)
    assert ServerConfig(rate=1_000_000, burst=1 << 21).burst == 1 << 21
    assert ServerConfig(http_port=0, cert=pem, cert_key=pem, proxy_hops=2).proxy_hops == 2
    # A proxy with certificates of its own: the relay needs no certificate files, but
    # the name clients dial.
    own = {"http_port": 0, "proxy_certs": "own", "public_host": "relay.example.com"}
    assert ServerConfig(**own, public_port=443).cert is None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="set public-host and public-port to the proxy's"):
        ServerConfig(**own)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="proxy-certs is for the http-port"):
        ServerConfig(proxy_certs="own", public_host="r.example", public_port=443)
    with pytest.raises(ConfigError, match="proxy-certs must be relay or own, got 'theirs'"):
        ServerConfig(http_port=0, cert=pem, cert_key=pem, proxy_certs="theirs")


# ---- the real client ----------------------------------------------------------------------


async def test_the_client_takes_records_on_the_tls_port_and_websocket_without_them(
    tmp_path: Path,
) -> None:
    config = ServerConfig(host="127.0.0.1", port=0, stun_port=0)
    async with RelayServer(config) as srv:
        fast = RelayPath(KEYS[0], srv.url)
        plain = RelayPath(KEYS[1], srv.url, config=RelayConfig(records=False))
        got: asyncio.Queue[bytes] = asyncio.Queue()
        plain.on_datagram = lambda src, data: got.put_nowait(data)
        try:
            await asyncio.gather(fast.wait_connected(10), plain.wait_connected(10))
            assert fast.status.framing == "raw" and fast.status.records == "aes-256-gcm"
            assert plain.status.framing == "websocket" and plain.status.records is None
            for _ in range(50):
                fast.send(plain.endpoint_id, b"x" * 60_000)
                try:
                    assert await asyncio.wait_for(got.get(), 0.2) == b"x" * 60_000
                    break
                except TimeoutError:
                    continue
            else:
                raise AssertionError("nothing arrived over WebSocket framing")
            assert await plain.ping() > 0
        finally:
            await bounded(asyncio.gather(fast.close(), plain.close()), "close()")
        assert srv.core.metrics.websocket_upgrades_total == 1


# ---- through a real reverse proxy (nginx) ---------------------------------------------------

NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
)

NGINX_CONF = """
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {tmp}/nginx-access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.3;
        location /relay {{
            # As a CDN or cloud load balancer: WebSocket upgrades only.
            if ($http_upgrade != "websocket") {{ return 403; }}
            proxy_pass http://127.0.0.1:{next_port};
            proxy_bind 127.0.0.2;  # so that the relay can tell the proxy from its clients
            {WEBSOCKET_PASS}
        }}
        location / {{ proxy_pass http://127.0.0.1:{http_port}; }}
    }}
    {inner}
}}
"""
WEBSOCKET_PASS = """proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection "upgrade";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_read_timeout 1h;
            proxy_buffering off;"""
NGINX_INNER = """server {{
        # A second proxy of ours, plain HTTP, behind the first: it sees the first one's
        # address (127.0.0.2) and appends it to X-Forwarded-For.
        listen 127.0.0.1:{inner_port};
        location / {{
            proxy_pass http://127.0.0.1:{http_port};
            proxy_bind 127.0.0.3;
            {WEBSOCKET_PASS}
        }}
    }}"""


def _nginx_conf(tmp: Path, cert: Path, key: Path, port: int, http_port: int, hops: int) -> str:
    """One TLS-terminating proxy in front of the relay's http-port, or with ``hops`` 2
    a second one between them."""
    inner_port = _free_port() if hops == 2 else None
    inner = (
        NGINX_INNER.format(
            inner_port=inner_port, http_port=http_port, WEBSOCKET_PASS=WEBSOCKET_PASS
        )
        if inner_port
        else ""
    )
    return NGINX_CONF.format(
        tmp=tmp,
        port=port,
        cert=cert,
        key=key,
        http_port=http_port,
        next_port=inner_port or http_port,
        WEBSOCKET_PASS=WEBSOCKET_PASS,
        inner=inner,
    )


@contextlib.contextmanager
def _nginx(tmp: Path, conf: str, port: int) -> Iterator[None]:
    """nginx with ``conf``, listening on ``port``, until the block ends."""
    assert NGINX is not None
    path = tmp / "nginx.conf"
    path.write_text(conf)
    nginx = subprocess.Popen(
        [NGINX, "-c", str(path), "-p", str(tmp), "-e", str(tmp / "nginx-error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_listening(port, nginx, tmp / "nginx-error.log")
        yield
    finally:
        nginx.send_signal(signal.SIGQUIT)
        try:
            nginx.wait(10)
        except subprocess.TimeoutExpired:
            nginx.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"nginx exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("nginx did not listen within 20 s")


async def _group_through(url: str) -> list[str]:
    cfg = GroupConfig(timeout=30.0, connect_timeout=30.0, punch=PunchConfig(enabled=False))
    gs = [
        Group.from_seed("websocket-proxy-seed-0123", rank=r, world=3, relay=url, config=cfg)
        for r in range(3)
    ]
    try:
        await asyncio.gather(*(g.start() for g in gs))
        outs = await asyncio.gather(*(g.all_reduce(np.full(300_000, g.rank + 1.0)) for g in gs))
        for out in outs:
            np.testing.assert_array_equal(out, np.full(300_000, 6.0))
        await asyncio.gather(*(g.barrier() for g in gs))
        return [
            f"{g.relay_status.framing} {g.relay_status.proof} {g.relay_status.observed}"
            for g in gs
            if g.relay_status is not None
        ]
    finally:
        await asyncio.gather(*(g.close() for g in gs))


def _get(ctx: ssl.SSLContext, port: int, path: str, request: bytes | None = None) -> bytes:
    """A GET through TLS to 127.0.0.1:``port``: the whole response (for ``request``
    instead, which may keep the connection open: the response's head)."""
    with (
        socket.create_connection(("127.0.0.1", port), 10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(
            request or f"GET {path} HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n".encode()
        )
        page = b""
        while (chunk := tls.recv(65536)) and not (request and b"\r\n\r\n" in page + chunk):
            page += chunk
    return page + chunk


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (CI installs nginx-light)")
@pytest.mark.parametrize("hops", [1, 2])
def test_a_group_through_nginx_terminating_tls_in_front_of_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hops: int
) -> None:
    cert, key = _certificate(tmp_path)  # for 127.0.0.1, its own CA
    port, http_port = _free_port(), _free_port()
    conf = _nginx_conf(tmp_path, cert, key, port, http_port, hops)
    with (
        RelayProcess(
            tmp_path,
            *("--cert", str(cert), "--cert-key", str(key)),
            *("--http-port", str(http_port), "--public-port", str(port)),
            *("--proxy-hops", str(hops)),
        ) as relay,
        _nginx(tmp_path, conf, port),
    ):
        assert relay.url == f"https://127.0.0.1:{port}/"  # the proxy's: what clients dial
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust the proxy's certificate
        framings = asyncio.run(_group_through(relay.url))
        # The relay saw each client's address in X-Forwarded-For (no port: nginx's
        # peer port would follow a colon), not the proxy's (127.0.0.2, or 127.0.0.3
        # for the second one); behind two proxies the entry before the second one's
        # (127.0.0.2). The proofs are bound to the certificate, which is the relay's.
        assert framings == ["websocket certificate 127.0.0.1"] * 3
        if hops == 2:
            return
        report = asyncio.run(diagnose(f"https://127.0.0.1:{port}/", key=KEYS[0], timeout=5.0))
        assert report.relay_connected and report.relay_framing == "websocket"
        assert "connected (TLS, WebSocket frames)" in render(report), render(report)
        ctx = ssl.create_default_context(cafile=str(cert))
        # The proxy lets only WebSocket upgrades through, as CDNs and load balancers do.
        refused = _get(ctx, port, "/relay", upgrade_request("127.0.0.1"))
        assert refused.startswith(b"HTTP/1.1 403 "), refused[:100]
        page = _get(ctx, port, "/metrics")
        assert b"p2pdist_relay_websocket_upgrades_total 4" in page  # 3 ranks, the doctor
        assert b"p2pdist_relay_datagrams_out_total 0" not in page


@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (CI installs nginx-light)")
@pytest.mark.parametrize("proxy_certs", ["own", "relay"])
def test_a_proxy_with_certificates_of_its_own_needs_proofs_bound_to_the_relays_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proxy_certs: str
) -> None:
    """As a managed load balancer or CDN: the proxy serves a certificate the relay never
    sees. With ``--proxy-certs own`` (and no certificate files at all: the relay's own TLS
    port is pinned) the group forms; without it every proof is refused."""
    (tmp_path / "proxy").mkdir()
    (tmp_path / "relay").mkdir()
    cert, key = _certificate(tmp_path / "proxy")
    port, http_port = _free_port(), _free_port()
    if proxy_certs == "own":
        mode: tuple[str, ...] = ("--proxy-certs", "own", "--public-host", "127.0.0.1")
    else:  # the relay has a certificate, another one than the proxy's
        relay_cert, relay_key = _certificate(tmp_path / "relay")
        mode = ("--cert", str(relay_cert), "--cert-key", str(relay_key))
    with (
        RelayProcess(
            tmp_path, *mode, "--http-port", str(http_port), "--public-port", str(port)
        ) as relay,
        _nginx(tmp_path, _nginx_conf(tmp_path, cert, key, port, http_port, 1), port),
    ):
        assert relay.url == f"https://127.0.0.1:{port}/"  # no pin: the proxy's certificate
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        if proxy_certs == "relay":
            with pytest.raises(PeerAuthenticationError, match="refused us: bad signature"):
                asyncio.run(_group_through(relay.url))
            return
        assert asyncio.run(_group_through(relay.url)) == ["websocket name 127.0.0.1"] * 3
        report = asyncio.run(diagnose(relay.url, key=KEYS[0], timeout=5.0))
        assert report.relay_proof == "name"
        assert "WebSocket frames, proof bound to the relay's name" in render(report)
    assert "proxy_certs=own" in relay.log.read_text()


async def test_the_http_port_also_serves_raw_upgrades_bound_to_the_certificate(
    tmp_path: Path,
) -> None:
    cert, key = _certificate(tmp_path)
    config = ServerConfig(
        host="127.0.0.1", port=0, stun_port=0, cert=cert, cert_key=key, http_port=0
    )
    async with RelayServer(config) as srv:
        assert srv.http_port
        assert srv.previous_cert_grace == 3600.0  # the proxy reloads when it does
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.http_port)
        try:
            writer.write(upgrade_request("r"))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 101 ") and b"Upgrade: p2pdist-relay" in head
            decoder = RelayFrameDecoder()
            frames: list[tuple[RelayFrameType, bytes]] = []
            while not frames:
                frames = decoder.feed(await asyncio.wait_for(reader.read(4096), 10))
            assert frames[0][0] is T.CHALLENGE
            challenge = frames[0][1][1:]
            from p2pdist.wire.relay import auth_message
            from relay.tlsconfig import RelayTls

            fp = RelayTls.from_files(cert, key).fingerprint
            me = bytes(KEYS[2].endpoint_id)
            writer.write(encode_frame(T.AUTH, me + KEYS[2].sign(auth_message(fp, challenge, me))))
            frames = []
            while not frames:
                frames = decoder.feed(await asyncio.wait_for(reader.read(4096), 10))
            assert frames[0][0] is T.AUTH_OK
        finally:
            writer.close()


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 64))
def test_garbage_after_a_websocket_upgrade_closes_only_that_client(junk: bytes, cut: int) -> None:
    c = core()
    s, _, _ = ws_upgrade(c)
    other, other_link, _ = ws_upgrade(c)
    for i in range(0, len(junk), cut):
        c.receive(s, junk[i : i + cut], 0.0)  # never raises: the session ends or goes on
    c.receive(other, auth_frame_ws(KEYS[1]), 0.0)
    other_link.head()
    assert [k for k, _ in other_link.ws_frames()] == [T.CHALLENGE, T.AUTH_OK]
    assert s.phase in (Phase.AUTH, Phase.CLOSED)  # type: ignore[attr-defined]


class _Sink(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.data += data

    aborted = closed = False
    backlog = 0

    def get_write_buffer_size(self) -> int:
        return self.backlog

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True


def _session_after_101(key: str | None = None) -> tuple[RelaySessionProtocol, _Sink]:
    """A client session on a sink, fed the relay's WebSocket 101 (accepting ``key``,
    default the session's own)."""
    proto = RelaySessionProtocol("relay test", 70_000)
    sink = _Sink()
    proto.connection_made(sink)
    assert proto.websocket_key is not None
    answer = (
        "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        f"Sec-WebSocket-Accept: {accept_for(key or proto.websocket_key)}\r\n"
        "Sec-WebSocket-Protocol: p2pdist-relay\r\n\r\n"
    ).encode()
    buf = proto.get_buffer(len(answer))
    buf[: len(answer)] = answer
    proto.buffer_updated(len(answer))
    return proto, sink


async def test_the_client_answers_pings_and_ends_on_close() -> None:
    proto = RelaySessionProtocol("relay test", 70_000)
    sink = _Sink()
    proto.connection_made(sink)

    def receive(data: bytes) -> None:
        buf = proto.get_buffer(len(data))
        buf[: len(data)] = data
        proto.buffer_updated(len(data))

    assert proto.websocket_key is not None
    answer = (
        "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        f"Sec-WebSocket-Accept: {accept_for(proto.websocket_key)}\r\n"
        "Sec-WebSocket-Protocol: p2pdist-relay\r\n\r\n"
    ).encode()
    challenge = encode_frame(T.CHALLENGE, b"\x01" + bytes(32))
    receive(answer + frame(challenge[:10], masked=False))  # a relay frame cut in two
    receive(frame(challenge[10:], masked=False) + frame(b"hb", Opcode.PING, masked=False))
    assert proto.framing == "websocket"
    kind, _, body = await asyncio.wait_for(proto.next_frame(), 5)
    assert (kind, bytes(body)) == (T.CHALLENGE, b"\x01" + bytes(32))
    [pong] = WebSocketReader(masked=True).feed(bytes(sink.data))
    assert (pong.opcode, pong.payload) == (Opcode.PONG, b"hb")  # masked, as a client must
    proto.writer.write(b"relay bytes")
    [data] = WebSocketReader(masked=True).feed(bytes(sink.data[len(frame(b"hb", masked=True)) :]))
    assert data.payload == b"relay bytes"
    reconnect = encode_frame(T.RECONNECT, b"\x80")
    proto.dispatch_to(lambda f: 0.25 if f[0] is T.RECONNECT else None)
    sent = len(sink.data)
    receive(frame(reconnect, masked=False) + close_frame(1001, masked=False))
    assert proto.done.result() == 0.25  # the RECONNECT before the CLOSE says how it ended
    [echo] = WebSocketReader(masked=True).feed(bytes(sink.data[sent:]))
    assert (echo.opcode, echo.payload) == (Opcode.CLOSE, b"\x03\xe9") and not sink.aborted


async def test_the_client_leaves_pings_unanswered_while_the_relay_does_not_read() -> None:
    proto, sink = _session_after_101()
    sink.backlog = PONG_BACKLOG + 1  # our writes pile up: the relay is not reading
    for _ in range(100):
        buf = proto.get_buffer(-1)
        ping = frame(bytes(125), Opcode.PING, masked=False)
        buf[: len(ping)] = ping
        proto.buffer_updated(len(ping))
    assert not sink.data  # no PONG piles up behind them
    sink.backlog = 0
    buf = proto.get_buffer(-1)
    buf[: len(ping)] = ping
    proto.buffer_updated(len(ping))
    [pong] = WebSocketReader(masked=True).feed(bytes(sink.data))
    assert (pong.opcode, pong.payload) == (Opcode.PONG, bytes(125))


async def test_the_client_says_close_when_it_ends_the_session() -> None:
    proto, sink = _session_after_101()
    proto.close()
    [event] = WebSocketReader(masked=True).feed(bytes(sink.data))
    assert (event.opcode, event.payload) == (Opcode.CLOSE, b"\x03\xe8") and sink.closed


async def test_a_wrong_accept_value_is_a_protocol_error() -> None:
    proto, _ = _session_after_101(client_key())
    with pytest.raises(Exception, match="Sec-WebSocket-Accept does not answer our key"):
        await asyncio.wait_for(proto.done, 5)


async def _connect_once() -> tuple[Any, Any]:
    """Start an in-process relay, connect a RelayPath to it (fast retries, within 10 s):
    its status once connected, and the relay's metrics."""
    async with RelayServer(ServerConfig(host="127.0.0.1", port=0, stun_port=0)) as srv:
        path = RelayPath(
            KEYS[0], srv.url, config=RelayConfig(backoff_initial=0.05, backoff_max=0.1)
        )
        try:
            await path.wait_connected(10)
            return path.status, srv.core.metrics
        finally:
            await bounded(path.close(), "close()")


async def test_a_pinned_client_never_signs_a_proof_bound_to_a_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a relay behind a proxy with certificates of its own may ask for a name-bound
    proof; over a connection to a pinned key (the relay's own TLS) the client refuses."""
    from relay.inbound import Inbound

    monkeypatch.setattr(Inbound, "_bound_name", lambda self, s: b"127.0.0.1:1")
    async with RelayServer(ServerConfig(host="127.0.0.1", port=0, stun_port=0)) as srv:
        assert "?pin=" in srv.url
        path = RelayPath(
            KEYS[0], srv.url, config=RelayConfig(backoff_initial=0.05, backoff_max=0.1)
        )
        try:
            with pytest.raises(PeerAuthenticationError, match="asked for a proof bound to its"):
                await path.wait_connected(10.0)  # at once: not worth waiting out
            assert srv.core.metrics.auth_ok_total == 0
        finally:
            await bounded(path.close(), "close()")


async def test_a_relay_from_before_websocket_framing_gets_the_bare_upgrade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relay.http as relay_http

    def old_relay(head: object) -> relay_http.HttpDecision:  # what d2d06f0 answered
        return relay_http.HttpDecision(
            False, 400, relay_http.response(400, "expected Upgrade: p2pdist-relay\n")
        )

    monkeypatch.setattr(relay_http, "_websocket_key", old_relay)
    status, metrics = await _connect_once()
    assert status.framing == "raw" and status.records == "aes-256-gcm"
    assert status.connects == 1 and metrics.http_requests_total == 1


async def test_only_an_old_relays_answer_switches_to_the_bare_upgrade_and_only_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relay.inbound as relay_inbound

    seen: list[str] = []
    answers = iter(
        [
            (429, "slow down\n"),  # not an old relay's answer: the next is WebSocket again
            (400, "expected Upgrade: p2pdist-relay\n"),  # an old relay's: bare next
            (502, "bad gateway\n"),  # the bare probe failed: WebSocket again
        ]
    )
    real = relay_inbound.route

    def route(head: Any, metrics: Any) -> Any:
        seen.append(head.header("upgrade"))
        answer = next(answers, None)
        if answer is None:
            return real(head, metrics)
        from relay.http import HttpDecision, response

        return HttpDecision(False, answer[0], response(answer[0], answer[1]))

    monkeypatch.setattr(relay_inbound, "route", route)
    await _connect_once()
    assert seen == ["websocket", "websocket", "p2pdist-relay", "websocket"]


def test_a_proxied_session_keeps_its_age_when_its_address_is_read() -> None:
    c = core(max_unauthenticated=2)
    a_link, b_link = WsLink(), FakeLink()
    a = c.open(a_link, ("127.0.0.1", 1), 0.0, proxied=True)  # the proxy's connection
    c.open(b_link, ("192.0.2.1", 2), 4.5)
    request = upgrade_request("relay.test", None, client_key())[:-2]
    c.receive(a, request + b"X-Forwarded-For: 198.51.100.9\r\n\r\n", 5.0)
    assert a.phase is Phase.AUTH
    c.open(FakeLink(), ("192.0.2.2", 3), 5.0)  # over the cap: a, waiting 5 s, makes room
    assert a_link.closed and not b_link.closed
    assert c.metrics.evicted["max_unauthenticated"] == 1


@pytest.mark.parametrize(
    ("payload", "echo"),
    [
        (b"", b"\x03\xe8"),
        (b"\x03", b"\x03\xea"),
        (b"\x03\xe9going away", b"\x03\xe9"),
        (b"\x03\xed", b"\x03\xea"),  # 1005 must not be sent
        (b"\x0f\xa0", b"\x0f\xa0"),  # 4000: an application's code
        (b"\x03\xf5", b"\x03\xf5"),  # 1013, try again later: what a full relay sends
        (b"\x03\xf4", b"\x03\xf4"),  # 1012 and 1014 are registered too
        (b"\x03\xf6", b"\x03\xf6"),
    ],
)
def test_close_codes_echoed(payload: bytes, echo: bytes) -> None:
    assert echo_code(payload) == echo


async def test_the_client_says_close_after_a_reconnect() -> None:
    proto, sink = _session_after_101()
    proto.dispatch_to(lambda f: 0.5 if f[0] is T.RECONNECT else None)
    data = frame(encode_frame(T.RECONNECT, b"\x80"), masked=False)
    buf = proto.get_buffer(len(data))
    buf[: len(data)] = data
    proto.buffer_updated(len(data))
    assert proto.done.result() == 0.5
    [event] = WebSocketReader(masked=True).feed(bytes(sink.data))
    assert (event.opcode, event.payload) == (Opcode.CLOSE, b"\x03\xe8") and sink.closed


def test_a_framing_error_keeps_what_came_before_it() -> None:
    """The data frames read before bad bytes in the same feed were dropped with the
    error: a relay's ERROR just before them never told why."""
    error = encode_frame(T.ERROR, b"why I close you")
    with pytest.raises(WebSocketError, match="opcode") as caught:
        WebSocketReader(masked=False).feed(frame(error, masked=False) + bytes([0x83, 0]))
    [event] = caught.value.events
    assert (event.opcode, event.payload) == (Opcode.BINARY, error)


async def test_the_client_reads_the_relays_last_frame_before_bad_framing() -> None:
    proto, _ = _session_after_101()
    proto.dispatch_to(lambda f: 0.5 if f[0] is T.RECONNECT else None)
    data = frame(encode_frame(T.RECONNECT, b"\x80"), masked=False) + bytes([0x83, 0])
    buf = proto.get_buffer(len(data))
    buf[: len(data)] = data
    proto.buffer_updated(len(data))
    assert proto.done.result() == 0.5  # the RECONNECT counts, though garbage followed


async def test_a_verified_relay_url_needs_tls_1_3_as_a_pinned_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/security.md says the link to the relay is TLS 1.3: a pinned URL asked for it,
    but a CA-verified one took the system's default, TLS 1.2 (a balancer or middlebox in
    front of the relay could hold the session to it)."""
    import threading

    cert, key = _certificate(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.maximum_version = ssl.TLSVersion.TLSv1_2
    server.load_cert_chain(cert, key)
    outcomes: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)

        def serve() -> None:
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(10)
                    try:
                        with server.wrap_socket(conn, server_side=True) as tls:
                            outcomes.append(f"handshake done: {tls.version()}")
                    except ssl.SSLError as exc:
                        outcomes.append(f"refused: {exc.reason}")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        port = listener.getsockname()[1]
        report = await diagnose(f"https://127.0.0.1:{port}/", key=KEYS[0], timeout=3.0)
        thread.join(10)
    assert not report.relay_connected
    assert outcomes and outcomes[0].startswith("refused"), outcomes
