"""The relay's sans-I/O pieces with fake links and a hand-moved clock: the core
(authentication, routing, limits, timeouts, shutdown), HTTP routing, token bucket,
PEER_GONE throttle, allowlist, metrics, configuration and the tap file format."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from p2pdist.identity import EndpointId, SecretKey
from p2pdist.wire.relay import (
    MAX_BODY,
    MAX_DATAGRAM,
    REPLACED_TEXT,
    RelayFrameDecoder,
    RelayFrameType,
    auth_message,
    decode_map,
    encode_addressed,
    encode_frame,
    upgrade_request,
)
from relay.access import AccessPolicy, Allowlist, AllowlistError, parse_allowlist
from relay.addresses import format_address, unmap_ipv4
from relay.cli import load_config
from relay.config import DEFAULT_BURST, ConfigError, RelayConfig, from_mapping
from relay.limits import PeerGoneThrottle, TokenBucket
from relay.metrics import AUTH_FAILURE_REASONS, DROP_REASONS, Metrics
from relay.session import Phase, Session
from relay.state import (
    FRAME_CHARGE,
    MIN_READ,
    READ_CHARGE,
    RECORD_CHARGE,
    CoreConfig,
    RelayCore,
)
from relay.tap import FileTap, read_tap

FP = bytes(range(32))  # the fingerprint of "the relay's certificate" in these tests
T = RelayFrameType


class FakeLink:
    """Records what the core writes; ``backlog`` pretends bytes are stuck in the socket."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self.backlog = 0
        self.pauses: list[float] = []
        self._decoder = RelayFrameDecoder()
        self._head_done = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.data += data

    def buffered(self) -> int:
        return self.backlog

    def close(self) -> None:
        self.closed = True

    def secure(self, records: tuple[bytes, bytes] | None) -> None:
        self.records = records

    def pause(self, seconds: float) -> None:
        self.pauses.append(seconds)

    def http(self) -> bytes:
        return bytes(self.data)

    def frames(self) -> list[tuple[RelayFrameType, bytes]]:
        """Frames written since the last call (after the 101 head)."""
        if not self._head_done:
            end = self.data.find(b"\r\n\r\n")
            assert self.data.startswith(b"HTTP/1.1 101 "), bytes(self.data[:80])
            del self.data[: end + 4]
            self._head_done = True
        out = self._decoder.feed(bytes(self.data))
        self.data.clear()
        return out


def core(**kw: object) -> RelayCore:
    cfg = CoreConfig(**kw)  # type: ignore[arg-type]
    return RelayCore(cfg, [FP], random_bytes=lambda n: b"\x07" * n)


def upgrade(c: RelayCore, now: float = 0.0) -> tuple[Session, FakeLink]:
    link = FakeLink()
    s = c.open(link, ("192.0.2.7", 4000), now)
    c.receive(s, upgrade_request("relay.test"), now)
    [(kind, body)] = link.frames()
    assert kind is T.CHALLENGE and body == b"\x01" + b"\x07" * 32
    return s, link


def auth_frame(
    key: SecretKey, *, claim: bytes | None = None, fp: bytes = FP, token: bytes = b""
) -> bytes:
    raw = bytes(key.endpoint_id) if claim is None else claim
    sig = key.sign(auth_message(fp, b"\x07" * 32, raw))
    return encode_frame(T.AUTH, raw + sig + token)


def join(c: RelayCore, key: SecretKey, *, now: float = 0.0, **kw: Any) -> tuple[Session, FakeLink]:
    s, link = upgrade(c, now)
    c.receive(s, auth_frame(key, **kw), now)
    return s, link


def only(link: FakeLink) -> tuple[RelayFrameType, bytes]:
    frames = link.frames()
    assert len(frames) == 1, frames
    return frames[0]


A, B, C = (SecretKey.from_seed("relay core tests seed", r) for r in range(3))


# ---- authentication -----------------------------------------------------------------


def test_auth_ok_advertises_limits_and_observed_address() -> None:
    c = core(rate=100_000, burst=MAX_BODY, keepalive=7.5)
    s, link = join(c, A)
    kind, body = only(link)
    assert kind is T.AUTH_OK
    assert decode_map(body) == {
        "observed": "192.0.2.7:4000",
        "max_datagram": MAX_DATAGRAM,
        "keepalive": 7.5,
        "rate": 100_000,
        "burst": MAX_BODY,
        "stun_ports": [],
    }
    assert s.phase is Phase.ACTIVE and c.client(A.endpoint_id) is s and c.clients == 1
    assert c.metrics.auth_ok_total == 1


def test_auth_ok_advertises_the_observation_ports() -> None:
    _, link = join(core(stun_ports=(3478, 3479)), A)
    kind, body = only(link)
    assert kind is T.AUTH_OK and decode_map(body)["stun_ports"] == [3478, 3479]


@pytest.mark.parametrize(
    ("kwargs", "reason", "message"),
    [
        ({"claim": bytes(B.endpoint_id)}, "bad_signature", "bad signature"),
        ({"fp": bytes(32)}, "bad_signature", "bad signature"),  # proof made for another relay
        ({"claim": b"\xff" * 32}, "bad_signature", "bad signature"),  # not a curve point
    ],
)
def test_auth_refusals(kwargs: dict[str, Any], reason: str, message: str) -> None:
    c = core()
    s, link = join(c, A, **kwargs)
    assert only(link) == (T.ERROR, message.encode())
    assert link.closed and s.phase is Phase.CLOSED and c.clients == 0
    assert c.metrics.auth_failures[reason] == 1


def test_short_auth_is_malformed() -> None:
    c = core()
    s, link = upgrade(c)
    c.receive(s, encode_frame(T.AUTH, b"x" * 95), 0.0)
    assert only(link) == (T.ERROR, b"malformed AUTH") and link.closed
    assert c.metrics.auth_failures["malformed"] == 1


def test_refusals_before_auth_are_logged_at_most_once_per_5_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each connection refused or failed before AUTH_OK wrote an INFO line, so a stream of
    cheap connections with a bad token or garbage filled the log (an audit). One line per
    REFUSAL_LOG_EVERY seconds now, the next saying how many it left out; /metrics counts
    every one."""
    c = core()
    caplog.set_level(logging.DEBUG, logger="relay")

    def refuse(now: float) -> None:
        s, _ = upgrade(c, now)
        c.receive(s, encode_frame(T.AUTH, b"x" * 95), now)

    for now in (0.0, 1.0, 2.0, 5.5):
        refuse(now)
    s, _ = upgrade(c, 6.0)  # another kind (a frame before AUTH) has a line of its own
    c.receive(s, encode_frame(T.PING, b"\0" * 8), 6.0)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    failed = [m for m in info if "auth_failed" in m]
    assert len(failed) == 2, info
    assert "others_since_last" not in failed[0] and "others_since_last=2" in failed[1]
    assert c.metrics.auth_failures["malformed"] == 4
    assert len([m for m in info if "protocol_error" in m]) == 1, info


@pytest.mark.parametrize("kind", [T.SEND, T.PING, T.AUTH_OK, T.RECV])
def test_any_frame_but_auth_first_closes(kind: RelayFrameType) -> None:
    c = core()
    s, link = upgrade(c)
    c.receive(s, encode_frame(kind, b"\0" * 40), 0.0)
    [(err, text)] = link.frames()
    assert err is T.ERROR and b"before AUTH" in text and link.closed
    assert text.count(b"before AUTH") == 1, text  # it said "... before AUTH before AUTH"
    assert c.metrics.protocol_errors_total == 1


def test_token_and_allowlist(tmp_path: Path) -> None:
    path = tmp_path / "allow"
    path.write_text(f"# who may\n{A.endpoint_id}  # alice\n\n")
    c = core()
    c.access = AccessPolicy(Allowlist(path), "s3cret")
    for key, token, expect in [
        (A, b"", b"bad token"),
        (A, b"s3cre", b"bad token"),
        (B, b"s3cret", b"endpoint not allowed"),
        (A, b"s3cret", None),
    ]:
        _s, link = join(c, key, token=token)
        kind, body = only(link)
        assert (kind, body) == ((T.AUTH_OK, body) if expect is None else (T.ERROR, expect))
    assert c.metrics.auth_failures["bad_token"] == 2
    assert c.metrics.auth_failures["not_allowed"] == 1


def test_allowlist_reloads_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "allow"
    path.write_text(f"{A.endpoint_id}\n")
    allow = Allowlist(path, check_interval=1.0)
    policy = AccessPolicy(allow)
    assert policy.check(bytes(B.endpoint_id), b"", 0.0) is not None
    path.write_text(f"{A.endpoint_id}\n{B.endpoint_id}\n")
    # Checked at most once per interval: still the old list within the second ...
    assert policy.check(bytes(B.endpoint_id), b"", 0.5) is not None
    # ... and the new one after it.
    assert policy.check(bytes(B.endpoint_id), b"", 1.5) is None
    # A broken edit keeps the last good list.
    path.write_text("not an id\n")
    assert policy.check(bytes(B.endpoint_id), b"", 3.0) is None
    # SIGHUP (force) reloads even when size, mtime and inode look unchanged.
    st = path.stat()
    path.write_text(f"{C.endpoint_id}\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    policy.reload(3.1)
    assert policy.check(bytes(C.endpoint_id), b"", 3.2) is None


def test_access_mode_names_an_empty_allowlist(tmp_path: Path) -> None:
    path = tmp_path / "allow"
    path.write_text("# nobody yet\n")
    assert AccessPolicy().mode == "open"
    assert AccessPolicy(Allowlist(path)).mode == "allowlist"  # empty, yet refuses everyone
    assert AccessPolicy(Allowlist(path), "t").mode == "allowlist+token"
    assert AccessPolicy(None, "t").mode == "token"
    assert AccessPolicy(Allowlist(path)).check(bytes(A.endpoint_id), b"", 0.0) is not None


def test_an_unlisted_endpoint_cannot_test_tokens(tmp_path: Path) -> None:
    """allowlist+token: the token was checked first, so an unlisted endpoint learnt from
    "bad token" against "not allowed" whether a token it guessed was right."""
    path = tmp_path / "allow"
    path.write_text(f"{A.endpoint_id}\n")
    policy = AccessPolicy(Allowlist(path), "right")
    unlisted = bytes(B.endpoint_id)
    assert policy.check(unlisted, b"wrong", 0.0) == policy.check(unlisted, b"right", 0.0)
    assert policy.check(bytes(A.endpoint_id), b"wrong", 0.0) is not None
    assert policy.check(bytes(A.endpoint_id), b"right", 0.0) is None


def test_parse_allowlist_names_the_bad_line() -> None:
    assert parse_allowlist(f"# c\n\n{A.endpoint_id} # x\n", "f") == {bytes(A.endpoint_id)}
    with pytest.raises(AllowlistError, match="f:2"):
        parse_allowlist(f"{A.endpoint_id}\nnope\n", "f")


# ---- routing ------------------------------------------------------------------------


def test_forward_carries_authenticated_source_and_exact_bytes() -> None:
    c = core()
    sa, la = join(c, A)
    _sb, lb = join(c, B)
    la.frames(), lb.frames()
    payloads = [b"", b"x", bytes(range(256)) * 3, b"\xab" * MAX_DATAGRAM]
    c.receive(sa, b"".join(encode_addressed(T.SEND, B.endpoint_id, p) for p in payloads), 1.0)
    got = lb.frames()
    assert got == [(T.RECV, bytes(A.endpoint_id) + p) for p in payloads]
    assert c.metrics.datagrams_in_total == c.metrics.datagrams_out_total == 4
    assert la.frames() == []


def test_unknown_destination_gets_peer_gone_once_per_second() -> None:
    c = core()
    sa, la = join(c, A)
    la.frames()
    gone = bytes(C.endpoint_id)
    for now in (1.0, 1.5, 1.99):
        c.receive(sa, encode_addressed(T.SEND, gone, b"x"), now)
    assert la.frames() == [(T.PEER_GONE, gone)]
    c.receive(sa, encode_addressed(T.SEND, gone, b"x"), 2.0)
    assert la.frames() == [(T.PEER_GONE, gone)]
    assert c.metrics.dropped["unknown_peer"] == 4 and c.metrics.peer_gone_total == 2


def test_a_client_over_its_rate_is_read_at_its_rate_whatever_it_sends() -> None:
    """Every byte read is charged: PONGs (parsed and ignored) as much as SENDs. A client
    used to cost the relay a core with them while its rate limit, on SEND bodies only,
    saw nothing. Reads are at most what the bucket holds (at least MIN_READ), and
    reading pauses while it holds less than MIN_READ (at most a keepalive)."""
    rate, burst = 1_000_000, MAX_BODY * 8
    c = core(rate=rate, burst=burst, read_size=4 * MAX_BODY, keepalive=5.0)
    sa, la = join(c, A)
    assert c.read_allowance(sa, 0.0) == 4 * MAX_BODY  # a full bucket: a whole read
    pong = encode_frame(T.PONG, b"p" * 8)
    flood = pong * (burst // len(pong))  # the whole burst in PONGs
    c.receive(sa, flood, 0.0)
    assert len(la.pauses) == 1 and c.metrics.rate_paused_total == 1
    debt = len(flood) - burst + len(flood) // len(pong) * FRAME_CHARGE  # (and per frame)
    debt += len(auth_frame(A)) + FRAME_CHARGE  # the read that carried AUTH is charged too
    assert la.pauses[0] == pytest.approx((MIN_READ + debt) / rate)
    assert c.read_allowance(sa, 0.0) == MIN_READ  # when read again: a little at a time
    assert c.read_allowance(sa, 5.0) == 4 * MAX_BODY  # refilled
    c.receive(sa, flood * 20, 6.0)  # far in debt: paused a keepalive at most
    assert la.pauses[-1] == 5.0
    _, lb = join(c, B)  # another client's bucket is its own
    assert c.read_allowance(c.client(B.endpoint_id), 6.0) == 4 * MAX_BODY and lb.pauses == []


def test_each_record_a_client_sends_costs_it_more_than_its_bytes() -> None:
    """A record costs the relay a pass of Python whatever its size: one byte per record
    took most of a core within any --rate. Records are charged RECORD_CHARGE each."""
    c = core(rate=1_000_000, burst=MAX_BODY * 8)
    sa, _ = join(c, A)
    bucket = sa.bucket
    assert bucket is not None
    before = bucket.level(0.0)
    c.receive(sa, encode_frame(T.PONG, b"p" * 8), 0.0, records=13)
    assert before - bucket.level(0.0) == 13 + 13 * RECORD_CHARGE + FRAME_CHARGE


def test_a_client_is_charged_for_what_its_socket_carried_not_its_plaintext() -> None:
    """TLS records padded far past their content, empty records and key updates carry
    little or no plaintext but cost the relay their reads and decryption: a one-byte
    record padded to 16 KiB was charged 257 (an audit). The glue gives the ciphertext
    bytes read since its last call, which are charged in place of the plaintext's; a
    read whose plaintext comes in several calls is charged once."""
    c = core(rate=1_000_000, burst=MAX_BODY * 8)
    sa, _ = join(c, A)
    bucket = sa.bucket
    assert bucket is not None
    pong = encode_frame(T.PONG, b"p" * 8)
    before = bucket.level(0.0)
    c.receive(sa, pong, 0.0, records=1, wire_bytes=16_405)
    assert before - bucket.level(0.0) == 16_405 + RECORD_CHARGE + FRAME_CHARGE
    before = bucket.level(0.0)
    c.receive(sa, pong, 0.0, wire_bytes=0)  # the rest of that read's plaintext
    assert before - bucket.level(0.0) == FRAME_CHARGE
    before = bucket.level(0.0)
    c.receive(sa, pong, 0.0)  # a glue that does not know: the plaintext's size
    assert before - bucket.level(0.0) == len(pong) + FRAME_CHARGE


def test_each_socket_read_costs_a_client_more_than_its_bytes() -> None:
    """A record sent a byte per TCP segment (TCP_NODELAY) is read a byte at a time, each
    read a pass of Python: at 4 us a byte it took 86% of a core within --rate 12500000
    (an audit). The reads since the last call are charged READ_CHARGE each."""
    c = core(rate=1_000_000, burst=MAX_BODY * 8)
    sa, _ = join(c, A)
    bucket = sa.bucket
    assert bucket is not None
    before = bucket.level(0.0)
    c.receive(sa, encode_frame(T.PONG, b"p" * 8), 0.0, records=1, reads=40)
    assert before - bucket.level(0.0) == 13 + RECORD_CHARGE + FRAME_CHARGE + 40 * READ_CHARGE
    assert READ_CHARGE >= 256


def test_each_frame_a_client_sends_costs_it_more_than_its_bytes() -> None:
    """Empty PONGs, 5 bytes each, cost the relay about 1.5 us apiece: at --rate 1000000
    they took a third of a core. Each frame is charged FRAME_CHARGE on top."""
    c = core(rate=1_000_000, burst=MAX_BODY * 8)
    sa, _ = join(c, A)
    assert sa.bucket is not None
    before = sa.bucket.level(0.0)
    c.receive(sa, encode_frame(T.PONG, b"") * 100, 0.0)
    assert before - sa.bucket.level(0.0) == 100 * (5 + FRAME_CHARGE) and FRAME_CHARGE >= 64


def test_a_client_over_its_rate_loses_no_datagram() -> None:
    """The rate holds a client back (its reads), it no longer drops its SENDs."""
    c = core(rate=MAX_BODY, burst=MAX_BODY)
    sa, la = join(c, A)
    _, lb = join(c, B)
    lb.frames()
    big = b"z" * (MAX_BODY // 2 - 32)  # SEND body = half the bucket
    for _ in range(3):
        c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, big), 0.0)
    assert len(lb.frames()) == 3 and c.metrics.dropped == dict.fromkeys(DROP_REASONS, 0)
    assert la.pauses and c.read_allowance(sa, 0.0) == MIN_READ


def test_queue_full_drops_for_a_slow_reader_only() -> None:
    c = core(queue_bytes=MAX_BODY + 5)
    sa, _la = join(c, A)
    _sb, lb = join(c, B)
    _sc, lc = join(c, C)
    lb.frames(), lc.frames()
    lb.backlog = MAX_BODY  # B is not reading
    c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, b"x" * 100), 1.0)
    c.receive(sa, encode_addressed(T.SEND, C.endpoint_id, b"y" * 100), 1.0)
    assert lb.frames() == [] and c.metrics.dropped["queue_full"] == 1
    assert lc.frames() == [(T.RECV, bytes(A.endpoint_id) + b"y" * 100)]
    # Frames batched within one receive count towards the bound too.
    lb.backlog = 0
    burst = encode_addressed(T.SEND, B.endpoint_id, b"w" * 40_000)
    c.receive(sa, burst * 3, 2.0)
    assert len(lb.frames()) == 1 and c.metrics.dropped["queue_full"] == 3


def test_a_sender_flooding_a_slow_reader_leaves_room_for_the_others() -> None:
    """B reads slower than A floods it: A's datagrams used to fill B's whole queue, so
    C's to B were all dropped (a security review: 37 of 117 got through). Over half
    full, each sender adds at most its share; a newcomer always finds room."""
    queue = 8 * MAX_BODY
    c = core(queue_bytes=queue)
    sa, _ = join(c, A)
    _, lb = join(c, B)
    sc, _ = join(c, C)
    lb.frames()
    flood = encode_addressed(T.SEND, B.endpoint_id, b"f" * 8000)
    for _ in range(2 * queue // len(flood)):  # B reads nothing meanwhile
        c.receive(sa, flood, 1.0)
        lb.backlog += sum(5 + len(body) for _, body in lb.frames())  # waits in B's socket
    assert 0.7 * queue < lb.backlog <= 0.75 * queue + len(flood)  # A alone: 3/4, no more
    assert c.metrics.dropped["queue_full"] > 0 and c.metrics.dropped["queue_share"] == 0
    for i in range(5):  # C's datagrams still get in, and A's still not
        c.receive(sc, encode_addressed(T.SEND, B.endpoint_id, b"c%d" % i * 100), 1.0)
        c.receive(sa, flood, 1.0)
    got = lb.frames()
    assert [f[1][:32] for f in got] == [bytes(C.endpoint_id)] * 5
    assert c.metrics.dropped["queue_share"] == 5
    lb.backlog = 0  # B caught up: a new episode, A may fill it again
    c.receive(sa, flood, 2.0)
    assert len(lb.frames()) == 1 and not c.client(B.endpoint_id).shares


def test_senders_past_the_tracked_ones_share_one_entry() -> None:
    """Identities are free: once MAX_SHARES senders are tracked, every further one shares
    one entry. (Untracked, a 257th sender was never capped, and flooded the others out
    as before the shares: a review of the change.)"""
    from relay.inbound import MAX_SHARES

    queue = 8 * MAX_BODY
    c = core(queue_bytes=queue)
    join(c, B)
    dest = c.client(B.endpoint_id)
    assert dest is not None
    queued = queue // 2 + 1  # over half: shares apply
    for i in range(MAX_SHARES):  # one datagram each, then silent
        assert c._fair_share(dest, i.to_bytes(32, "big"), queued, 100) is None
        queued += 100
    admitted = 0
    for _ in range(100):  # a flooder past the table, the reader taking nothing
        if c._fair_share(dest, b"F" * 32, queued, 8000) is None:
            admitted += 1
            queued += 8000
    assert admitted * 8000 <= max(MAX_BODY + 5, queue // 2 // (MAX_SHARES + 2)) + 8000
    assert len(dest.shares) == MAX_SHARES + 1 and b"" in dest.shares


def test_counters_count_datagrams_only() -> None:
    """A PONG dropped for a full queue is not a dropped datagram, and a SEND too short to
    name a peer is a protocol error, not a datagram received."""
    c = core(queue_bytes=MAX_BODY + 5)
    sa, la = join(c, A)
    la.frames()
    la.backlog = MAX_BODY  # A is not reading: its PONG has no room
    c.receive(sa, encode_frame(T.PING, b"12345678"), 1.0)
    assert la.frames() == [] and sum(c.metrics.dropped.values()) == 0
    c.receive(sa, encode_frame(T.SEND, b"short"), 1.0)
    assert c.metrics.datagrams_in_total == 0 and la.closed


def test_ping_pong_and_protocol_errors_after_auth() -> None:
    c = core()
    sa, la = join(c, A)
    la.frames()
    c.receive(sa, encode_frame(T.PING, b"12345678"), 1.0)
    assert la.frames() == [(T.PONG, b"12345678")]
    c.receive(sa, encode_frame(T.PONG, b"12345678"), 1.0)  # ignored
    assert la.frames() == []
    c.receive(sa, encode_frame(T.PING, b"123"), 1.0)
    [(kind, text)] = la.frames()
    assert kind is T.ERROR and b"PING" in text and la.closed and c.clients == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"\x99\0\0\0\0",  # unknown type
        bytes([T.SEND]) + (MAX_BODY + 1).to_bytes(4, "big"),  # oversized
        encode_frame(T.SEND, b"short"),  # SEND without a full id
        encode_frame(T.AUTH, b"\0" * 96),  # a second AUTH
        encode_frame(T.CHALLENGE, b"\0" * 33),  # relay-to-client type
    ],
)
def test_bad_frames_after_auth_close_only_that_client(raw: bytes) -> None:
    c = core()
    sa, la = join(c, A)
    sb, lb = join(c, B)
    la.frames(), lb.frames()
    c.receive(sa, raw, 1.0)
    assert la.frames()[-1][0] is T.ERROR and la.closed and sa.phase is Phase.CLOSED
    assert c.client(B.endpoint_id) is sb and not lb.closed
    c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, b"late"), 1.0)  # ignored
    assert lb.frames() == [] and c.metrics.protocol_errors_total == 1


# ---- lifecycle ----------------------------------------------------------------------


def test_newest_connection_with_the_same_id_wins() -> None:
    c = core(max_clients=1)
    old, lold = join(c, A)
    lold.frames()
    new, lnew = join(c, A, now=1.0)  # allowed although the relay is full
    assert lold.frames() == [(T.ERROR, REPLACED_TEXT.encode())] and lold.closed
    assert only(lnew)[0] is T.AUTH_OK and c.client(A.endpoint_id) is new
    c.lost(old, 2.0)  # the old connection's late close must not unregister the new one
    assert c.client(A.endpoint_id) is new and c.metrics.replaced_total == 1


def test_max_clients() -> None:
    c = core(max_clients=2)
    join(c, A), join(c, B)
    _s, link = join(c, C)
    assert only(link) == (T.ERROR, b"relay full") and c.metrics.auth_failures["relay_full"] == 1
    assert c.clients == 2


def test_auth_timeout_and_keepalive_silence() -> None:
    c = core(keepalive=10.0, auth_timeout=5.0)
    _pending, lp = upgrade(c, now=0.0)
    raw_link = FakeLink()
    http_only = c.open(raw_link, ("::ffff:192.0.2.9", 1), 0.0)
    _sa, la = join(c, A, now=0.0)
    sb, lb = join(c, B, now=0.0)
    c.tick(4.9)
    assert not lp.closed and not raw_link.closed
    c.tick(5.1)
    assert lp.frames() == [(T.ERROR, b"authentication timed out")] and lp.closed
    assert raw_link.closed and raw_link.data == b"" and http_only.phase is Phase.CLOSED
    c.receive(sb, encode_frame(T.PING, b"\0" * 8), 20.0)  # B keeps talking, A is silent
    c.tick(30.1)
    assert la.closed and not lb.closed and c.clients == 1
    assert c.metrics.keepalive_timeouts_total == 1 and c.metrics.auth_failures["timeout"] == 1


def test_connections_that_end_before_authenticating_are_counted_by_phase() -> None:
    """A handshake or an upgrade request that never came ended at DEBUG only, in no
    metric: a slow-loris flood showed as connections_total alone."""
    c = core(auth_timeout=5.0)
    handshaking = c.open(FakeLink(), ("192.0.2.1", 1), 0.0, handshaking=True)
    silent = c.open(FakeLink(), ("192.0.2.2", 1), 0.0)  # TLS done, no request
    gone, _ = upgrade(c)  # the upgrade, then the client leaves before AUTH
    half_closed, _ = upgrade(c)
    scraped = c.open(FakeLink(), ("192.0.2.3", 1), 0.0)
    c.receive(scraped, b"GET /metrics HTTP/1.1\r\nHost: relay.test\r\n\r\n", 0.0)
    c.lost(gone, 1.0, "connection reset")
    c.eof(half_closed, 1.0)
    c.tick(5.1)
    assert handshaking.phase is silent.phase is Phase.CLOSED
    assert c.metrics.abandoned == {"tls": 1, "http": 1, "auth": 2}
    assert c.metrics.auth_failures["timeout"] == 0  # none waited for AUTH that long
    c.lost(handshaking, 5.2)  # the link's own end, after the relay closed it: once
    assert sum(c.metrics.abandoned.values()) == 4
    assert 'p2pdist_relay_abandoned_total{phase="auth"} 2' in c.metrics_text()


def test_shutdown_sends_reconnect_and_refuses_new_auth() -> None:
    c = core(retry_after=2.5)
    _sa, la = join(c, A)
    _pending, lp = upgrade(c)
    la.frames()
    c.shutdown()
    [(kind, body)] = la.frames()
    assert kind is T.RECONNECT and decode_map(body) == {
        "reason": "relay shutting down",
        "retry_after": 2.5,
    }
    assert la.closed and lp.closed and c.clients == 0
    link = FakeLink()  # a connection that completes its TLS handshake only now
    assert c.open(link, ("192.0.2.7", 1), 0.0).phase is Phase.CLOSED and link.closed
    assert link.http().startswith(b"HTTP/1.1 503 ")


# ---- HTTP ---------------------------------------------------------------------------


def http(c: RelayCore, request: bytes) -> tuple[bytes, FakeLink]:
    link = FakeLink()
    s = c.open(link, ("127.0.0.1", 1), 0.0)
    c.receive(s, request, 0.0)
    assert link.closed or s.phase is Phase.HTTP
    return link.http(), link


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),
        (b"GET /nope HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /relay HTTP/1.1\r\n\r\n", b"400"),
        (b"GET /relay HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),  # no Upgrade
        (upgrade_request("x").replace(b"Version: 1", b"Version: 9"), b"400"),
        (b"garbage\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", b"400"),
        (b"GET /" + b"a" * 9000, b"400"),  # head too large
    ],
)
def test_http_answers(request_bytes: bytes, status: bytes) -> None:
    out, link = http(core(), request_bytes)
    assert out.split(b" ")[1] == status and link.closed


def test_head_requests_get_the_head_alone() -> None:
    """Load balancers probe with HEAD: it was a 400."""
    for path in (b"/health", b"/metrics"):
        get, _ = http(core(), b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        head, link = http(core(), b"HEAD " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert head.split(b" ")[1] == b"200" and link.closed
        assert head.endswith(b"\r\n\r\n") and get.startswith(head.split(b"Content-Length")[0])
    out, _ = http(core(), upgrade_request("x").replace(b"GET ", b"HEAD ", 1))
    assert out.split(b" ")[1] == b"404"  # no upgrade on HEAD


def test_http_head_may_arrive_in_pieces() -> None:
    c = core()
    link = FakeLink()
    s = c.open(link, ("127.0.0.1", 1), 0.0)
    for byte in upgrade_request("x"):
        c.receive(s, bytes([byte]), 0.0)
    assert link.frames()[0][0] is T.CHALLENGE


def test_metrics_page_lists_every_metric() -> None:
    c = core()
    join(c, A)
    out, _ = http(c, b"GET /metrics HTTP/1.1\r\n\r\n")
    text = out.decode()
    assert "Content-Type: text/plain; version=0.0.4" in text
    assert "\np2pdist_relay_clients 1\n" in text
    for name in (
        "open_connections", "connections_total", "auth_ok_total", "replaced_total",
        "bytes_in_total", "bytes_out_total", "datagrams_in_total", "datagrams_out_total",
        "peer_gone_total", "protocol_errors_total", "keepalive_timeouts_total",
        "http_requests_total", "stun_requests_total", "stun_dropped_total",
    ):  # fmt: skip
        assert f"# TYPE p2pdist_relay_{name} " in text
    for reason in DROP_REASONS:
        assert f'p2pdist_relay_dropped_total{{reason="{reason}"}} 0' in text
    for reason in AUTH_FAILURE_REASONS:
        assert f'p2pdist_relay_auth_failures_total{{reason="{reason}"}} 0' in text
    assert Metrics().render(clients=0, connections=0).endswith("\n")
    # No two families an OpenMetrics reader folds into one (a gauge "x" and "x_total").
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    bare = [f.removesuffix("_total") for f in families]
    assert len(set(bare)) == len(bare), families


# ---- small pieces -------------------------------------------------------------------


def test_token_bucket() -> None:
    b = TokenBucket(rate=100, burst=200, now=0.0)
    b.charge(150, 0.0)
    assert b.level(0.0) == 50 and b.seconds_until(100, 0.0) == 0.5
    b.charge(250, 0.0)  # into debt
    assert b.level(0.0) == -200 and b.seconds_until(0, 0.0) == 2.0
    assert b.level(1.0) == -100
    assert b.level(100.0) == 200 and b.seconds_until(1000, 100.0) == 0  # at most the burst
    unlimited = TokenBucket(0, 1, 0.0)
    unlimited.charge(10**9, 0.0)
    assert unlimited.seconds_until(10**9, 0.0) == 0  # rate 0: unlimited
    with pytest.raises(ValueError):
        TokenBucket(-1, 10, 0.0)


def test_peer_gone_throttle_is_bounded() -> None:
    t = PeerGoneThrottle(interval=1.0, max_entries=8)
    assert t.allow(b"a", 0.0) and not t.allow(b"a", 0.9) and t.allow(b"a", 1.0)
    for i in range(100):
        assert t.allow(i.to_bytes(4, "big"), 5.0)
    assert len(t) <= 8


def test_format_address() -> None:
    assert format_address("192.0.2.1", 5) == "192.0.2.1:5"
    assert format_address("2001:db8::1", 5) == "[2001:db8::1]:5"
    assert format_address("::ffff:192.0.2.1", 5) == "192.0.2.1:5"
    assert unmap_ipv4("::ffff:192.0.2.1") == "192.0.2.1"  # what STUN answers, too
    assert unmap_ipv4("::ffff:c000:201") == "::ffff:c000:201"  # no dotted quad: left alone
    assert unmap_ipv4("2001:db8::1") == "2001:db8::1"


def test_tap_file_round_trip(tmp_path: Path) -> None:
    tap = FileTap(tmp_path / "tap")
    tap(1, "in", b"MAR")
    tap(2, "out", b"zz")
    tap(1, "in", b"KER")
    tap(1, "out", b"o")
    tap.close()
    tap(1, "in", b"ignored after close")
    assert read_tap(tmp_path / "tap") == {(1, "in"): b"MARKER", (2, "out"): b"zz", (1, "out"): b"o"}


# ---- configuration ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"port": 70000}, "port"),
        ({"host": "relay.example.com"}, "IP address"),
        ({"cert": "c.pem"}, "together"),
        ({"cert": "c.pem", "cert_key": "k.pem", "key": "r.key"}, "exclude"),
        ({"rate": 1000, "burst": 1000}, "burst must be at least"),
        ({"queue_bytes": 1000}, "queue-bytes"),
        ({"keepalive": 0}, "keepalive"),
        ({"keepalive": "nan"}, "keepalive"),
        ({"keepalive": 1e-6}, "keepalive must be at least"),  # busied a core, served nobody
        ({"auth_timeout": 1e-6}, "auth-timeout must be at least"),
        ({"keepalive": 1e9}, "keepalive must be at most"),  # dead clients held slots for good
        ({"public_host": "a@b"}, "public-host"),  # a URL with a user part: clients refuse it
        ({"public_host": "a\\b"}, "public-host"),
        ({"max_clients": 0}, "max-clients"),
        ({"token": ""}, "token"),
        ({"log_level": "loud"}, "log-level"),
        ({"max_clients": "many"}, "integer"),
        ({"max_clients": True}, "integer"),
        ({"public_host": "a/b"}, "public-host"),
        ({"public_host": "relay.example.com:9443"}, "must not include a port"),
        ({"public_host": "[::1]:9443"}, "must not include a port"),
        ({"public_host": "[2001:db8::1]"}, "without brackets"),
        ({"public_host": "fe80::1%eth0"}, "zone id"),
        ({"public_host": "relay;example.com"}, "not a host name"),  # the URL clients refuse
        ({"public_host": "relay,b"}, "not a host name"),
        ({"public_host": "0.0.0.0"}, "an address to bind, not one clients can dial"),
        ({"public_host": "::"}, "an address to bind, not one clients can dial"),
        ({"public_host": "999.1.1.1"}, "give an IPv4 address as four numbers"),
        ({"public_host": "1.2.3.4.5"}, "give an IPv4 address as four numbers"),
        ({"public_host": "1.2.3.4."}, "without the trailing dot"),
        ({"public_host": "0\u30020\u30020\u30020"}, "not one clients can dial"),  # IDNA dots
        ({"public_host": "::ffff:0.0.0.0"}, "not one clients can dial"),
        ({"public_host": "relay..example.com"}, "empty label"),
        ({"public_host": ".example.com"}, "empty label"),
        ({"retry_after": 61}, "retry-after must be at most 60"),  # clients wait 60 s at most
        ({"url_file": "/nonexistent-dir/relay.url"}, "no directory"),  # caught after binding
        ({"url_file": "."}, "url-file must name a file"),  # crashed after binding the ports
        ({"url_file": "/"}, "url-file must name a file"),
        ({"stun_alt_port": 70000}, "stun-alt-port must be a port"),
        ({"stun_port": 0, "stun_alt_port": 3479}, "stun-alt-port needs"),
        ({"stun_port": 3478, "stun_alt_port": 3478}, "must differ"),
        ({"port": 8443, "stun_alt_port": 8443}, "must differ"),
    ],
)
def test_config_validation(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(values)


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_bytes(b"\xef\xbb\xbfport = 9000\n")  # as some editors save UTF-8
    assert load_config(["--config", str(cfg)], environ={}).port == 9000


def test_a_token_in_a_config_file_others_can_read_is_warned_about(tmp_path: Path) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_text('token = "a-long-random-token-0123"\n')
    for mode, warned in ((0o644, True), (0o600, False)):
        cfg.chmod(mode)
        warnings: list[str] = []
        load_config(["--config", str(cfg)], environ={}, warnings=warnings)
        assert bool(warnings) is warned, warnings
        assert all(w.startswith("token_file_readable ") and "mode=644" in w for w in warnings)
    cfg.write_text("port = 9000\n")  # no token: nothing to say
    cfg.chmod(0o644)
    warnings = []
    load_config(["--config", str(cfg)], environ={}, warnings=warnings)
    assert warnings == []


def test_the_relay_says_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    from p2pdist import __version__

    with pytest.raises(SystemExit) as done:
        load_config(["--version"], environ={})
    assert done.value.code == 0 and capsys.readouterr().out == f"p2pdist-relay {__version__}\n"


def test_config_file_flags_and_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        'port = 9000\nmax-clients = 10\nallowlist = "allow.txt"\nqueue_bytes = 200000\n'
        'token = "from-file"\nkeepalive = 5\n'
    )
    c = load_config(["--config", str(cfg), "--max-clients", "20"], environ={})
    assert (c.port, c.max_clients, c.queue_bytes, c.keepalive) == (9000, 20, 200000, 5.0)
    assert c.allowlist == tmp_path / "allow.txt" and c.token == "from-file"
    env = {"P2PDIST_RELAY_TOKEN": "from-env"}
    assert load_config(["--config", str(cfg)], environ=env).token == "from-env"
    assert load_config(["--config", str(cfg), "--token", "flag"], environ=env).token == "flag"
    assert "from-file" not in repr(load_config(["--config", str(cfg)], environ={}))
    assert load_config([], environ={}) == RelayConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [("nope = 1\n", "unknown setting 'nope'"), ("port = [\n", "not valid TOML"),
     ("port = 1\nport_ = 2\n", "unknown"), ("max-clients = 1\nmax_clients = 2\n", "twice"),
     ('port = "8443"\n', "port must be an integer, got '8443'"),
     ('keepalive = "5"\n', "keepalive must be a number, got '5'")],
)  # fmt: skip
def test_config_file_errors(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", str(cfg)], environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["--config", str(tmp_path / "missing.toml")], environ={})


@pytest.mark.parametrize("value", ["12345678901234567890123", "1234567.25", '["s3cr3t-part"]'])
def test_a_token_of_the_wrong_type_is_not_printed_in_the_error(tmp_path: Path, value: str) -> None:
    """A token written without quotes (a number) was echoed in the error, which reaches
    the terminal and the journal."""
    cfg = tmp_path / "relay.toml"
    cfg.write_text(f"token = {value}\n")
    with pytest.raises(ConfigError, match="token must be a string, got a ") as info:
        load_config(["--config", str(cfg)], environ={})
    assert "1234567" not in str(info.value) and "s3cr3t" not in str(info.value)


def test_a_bad_value_is_blamed_on_where_it_came_from(tmp_path: Path) -> None:
    """A value the file gave is named as the file's; the same value from a flag is not,
    and a flag that replaces the file's out-of-range value leaves nothing to blame."""
    kind = tmp_path / "kind.toml"
    kind.write_text('port = "abc"\n')
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(kind))}: port must"):
        load_config(["--config", str(kind), "--port", "0"], environ={})
    limit = tmp_path / "limit.toml"
    limit.write_text("max-clients = -5\n")
    with pytest.raises(ConfigError, match=r"^config file .*: max-clients must be >= 1"):
        load_config(["--config", str(limit)], environ={})
    with pytest.raises(ConfigError, match=r"^max-clients must be >= 1"):
        load_config(["--max-clients", "-5"], environ={})
    assert load_config(["--config", str(limit), "--max-clients", "5"], environ={}).max_clients == 5
    brackets = tmp_path / "brackets.toml"  # a message of the form "public-host: ..."
    brackets.write_text('public-host = "[::1]"\n')
    with pytest.raises(ConfigError, match=r"^config file .*: public-host: give an IPv6"):
        load_config(["--config", str(brackets)], environ={})


def test_burst_without_rate_is_refused_even_at_its_default_value(tmp_path: Path) -> None:
    """``--burst 1048576`` without ``--rate`` was taken: equal to the default, the
    config could not tell it was given, and the operator's bucket silently did nothing."""
    default = str(DEFAULT_BURST)  # (the value burst takes when not given)
    with pytest.raises(ConfigError, match=r"^burst is the rate's bucket"):
        load_config(["--burst", default], environ={})
    cfg = tmp_path / "relay.toml"
    cfg.write_text(f"burst = {default}\n")
    with pytest.raises(ConfigError, match=r"^config file .*: burst is the rate's bucket"):
        load_config(["--config", str(cfg)], environ={})
    assert load_config(["--config", str(cfg), "--rate", "1000000"], environ={}).rate == 1000000
    assert load_config([], environ={}).burst == RelayConfig().burst


def test_stun_alt_port_defaults_and_config_file(tmp_path: Path) -> None:
    assert RelayConfig().effective_stun_alt_port(8443) == (8444, False)
    assert RelayConfig().effective_stun_alt_port(0) == (0, False)  # STUN off: none
    assert RelayConfig().effective_stun_alt_port(65535) == (0, False)  # no port 65536
    assert RelayConfig(stun_alt_port=0).effective_stun_alt_port(8443) == (0, True)
    assert RelayConfig(stun_alt_port=9000).effective_stun_alt_port(8443) == (9000, True)
    cfg = tmp_path / "relay.toml"
    cfg.write_text("stun-port = 3478\nstun-alt-port = 3480\n")
    c = load_config(["--config", str(cfg)], environ={})
    assert (c.stun_port, c.stun_alt_port) == (3478, 3480)
    assert (
        load_config(["--config", str(cfg), "--stun-alt-port", "0"], environ={}).stun_alt_port == 0
    )


def test_url_host() -> None:
    assert RelayConfig().url_host() == "127.0.0.1"
    assert RelayConfig(host="10.0.0.5").url_host() == "10.0.0.5"
    assert RelayConfig(host="::").url_host() == "::1"
    assert RelayConfig(public_host="relay.example.com").url_host() == "relay.example.com"


def test_endpoint_ids_in_fixture_are_distinct() -> None:
    assert len({A.endpoint_id, B.endpoint_id, C.endpoint_id}) == 3
    assert isinstance(A.endpoint_id, EndpointId)


def test_a_bad_signature_first_looks_at_the_certificate_files_once_a_second() -> None:
    renewed = bytes(range(1, 33))
    c = core()
    looks: list[float] = []

    def refresh(now: float) -> bool:
        looks.append(now)
        if len(looks) == 1:
            c.set_cert_fingerprints([renewed], [FP], now + 20)
            return True
        return False

    c.refresh_certificate = refresh
    s, link = upgrade(c, 5.0)
    c.receive(s, auth_frame(A, fp=renewed), 5.0)  # the proxy renewed before the relay
    assert only(link)[0] is T.AUTH_OK and looks == [5.0]
    s, link = upgrade(c, 5.5)
    c.receive(s, auth_frame(B, fp=bytes(32)), 5.5)  # within the second: no second look
    assert only(link) == (T.ERROR, b"bad signature") and looks == [5.0]
    s, link = upgrade(c, 6.5)
    c.receive(s, auth_frame(C, fp=bytes(32)), 6.5)
    assert only(link) == (T.ERROR, b"bad signature") and looks == [5.0, 6.5]


def test_a_newcomer_at_its_sources_cap_evicts_only_its_own_for_the_socket_budget() -> None:
    """At the socket budget a new connection made room by evicting the oldest waiting
    connection of any source, before the core refused it for its own source's cap: a
    source at its cap kept closing other sources' slow handshakes (an audit). It now
    evicts among its own source's only; a source under its cap evicts the oldest."""
    c = core(max_unauthenticated_per_ip=2)
    other = c.open(FakeLink(), ("198.51.100.1", 1000), 0.0, handshaking=True)
    mine = [c.open(FakeLink(), ("192.0.2.9", 2000 + i), 0.5, handshaking=True) for i in (0, 1)]
    assert c.evict_for_socket(0.9, "192.0.2.9") is None  # none of its own has waited 1 s
    evicted = c.evict_for_socket(2.0, "192.0.2.9")
    assert evicted is mine[0].link and other.phase is Phase.TLS
    assert c.evict_for_socket(2.0, "203.0.113.4") is other.link  # under its cap: the oldest
