"""The relay core's limits on what clients can hold or get for free, with fake links and
a hand-moved clock: unauthenticated connections (frame size before AUTH, how many may
wait), token buckets across reconnects, the PEER_GONE throttle's memory, and
connections that arrive while the relay shuts down."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from test_relay_core import A, B, C, FakeLink, auth_frame, core, join, upgrade

from p2pdist.wire.relay import (
    MAX_BODY,
    RelayFrameType,
    encode_addressed,
    encode_frame,
    upgrade_request,
)
from relay.cli import load_config
from relay.config import ConfigError, RelayConfig, from_mapping
from relay.limits import MAX_PEER_GONE_ENTRIES, PeerGoneThrottle, TokenBucket
from relay.session import Phase
from relay.state import MAX_AUTH_BODY, RelayCore

T = RelayFrameType
BIG = b"z" * (MAX_BODY - 32)  # a SEND body of MAX_BODY bytes: one whole bucket below


# ---- before authentication ----------------------------------------------------------


def test_a_frame_longer_than_any_auth_is_refused_from_its_header() -> None:
    c = core()
    s, link = upgrade(c)
    # The header alone, then a little of the body: refused before the body is buffered.
    c.receive(s, struct.pack(">BI", T.AUTH.value, MAX_AUTH_BODY + 1), 1.0)
    assert link.closed and s.phase is Phase.CLOSED and s.splitter.pending == 0
    assert c.metrics.protocol_errors_total == 1
    [(kind, body)] = link.frames()
    assert kind is T.ERROR and b"before AUTH" in body


def test_the_header_check_works_when_the_header_comes_in_pieces() -> None:
    c = core()
    link = FakeLink()
    s = c.open(link, ("192.0.2.7", 4000), 0.0)
    head = struct.pack(">BI", T.SEND.value, MAX_BODY)
    c.receive(s, upgrade_request("relay.test") + head[:2], 0.0)  # with the upgrade
    assert s.phase is Phase.AUTH
    c.receive(s, head[2:4], 0.0)
    assert not link.closed
    c.receive(s, head[4:] + b"\0" * 1000, 0.0)
    assert link.closed and s.splitter.pending <= len(head)  # the header, never the body


def test_the_largest_valid_auth_still_passes() -> None:
    c = core()
    token = b"t" * (MAX_AUTH_BODY - 96)  # the longest token the config allows
    s, link = join(c, A, token=token)  # open access: the token is ignored
    assert s.phase is Phase.ACTIVE and link.frames()[-1][0] is T.AUTH_OK


def test_connections_waiting_to_authenticate_are_capped() -> None:
    c = core(max_clients=2)  # the cap defaults to max_clients
    assert c.max_unauthenticated == 2
    s1, _ = upgrade(c)
    s2 = c.open(FakeLink(), ("192.0.2.8", 1), 0.0)  # still in the HTTP phase
    refused = FakeLink()
    s3 = c.open(refused, ("192.0.2.9", 1), 0.0)
    assert s3.phase is Phase.CLOSED and refused.closed
    assert refused.http().startswith(b"HTTP/1.1 503 ")
    assert c.metrics.connections_refused_total == 1 and c.unauthenticated == 2
    assert "\np2pdist_relay_unauthenticated 2\n" in c.metrics_text()
    c.receive(s1, auth_frame(A), 0.0)  # one authenticates: room for one more
    assert s1.phase is Phase.ACTIVE and c.unauthenticated == 1
    c.tick(100.0)  # the other times out: room for two
    assert s2.phase is Phase.CLOSED and c.unauthenticated == 0
    s4, _ = upgrade(c, 100.0)
    assert s4.phase is Phase.AUTH
    c.lost(s4, 100.5)
    assert c.unauthenticated == 0


def test_the_cap_on_waiting_connections_is_configurable() -> None:
    c = core(max_clients=100, max_unauthenticated=1)
    upgrade(c)
    link = FakeLink()
    assert c.open(link, ("192.0.2.9", 1), 0.0).phase is Phase.CLOSED and link.closed


# ---- token buckets across reconnects ------------------------------------------------


def forwarded(c: RelayCore) -> tuple[int, int]:
    return c.metrics.datagrams_out_total, c.metrics.dropped["rate_limited"]


def test_a_replacing_session_inherits_the_bucket() -> None:
    c = core(rate=MAX_BODY, burst=MAX_BODY)  # one big SEND per second
    join(c, B)
    sa, _ = join(c, A, now=1.0)
    c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, BIG), 1.0)
    assert forwarded(c) == (1, 0)
    for i in range(5):  # reconnecting does not buy a fresh burst
        sa, _ = join(c, A, now=1.0 + i / 100)
        c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, BIG), 1.0 + i / 100)
    assert forwarded(c) == (1, 5) and c.metrics.replaced_total == 5
    c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, BIG), 2.0)  # the rate still refills
    assert forwarded(c) == (2, 5)


def test_a_gone_clients_bucket_is_kept_until_it_is_full_again() -> None:
    c = core(rate=MAX_BODY, burst=MAX_BODY)
    join(c, B)
    sa, _ = join(c, A, now=1.0)
    c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, BIG), 1.0)
    c.lost(sa, 1.1)  # disconnect, reconnect at once: still empty
    sa, _ = join(c, A, now=1.2)
    c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, BIG), 1.2)
    assert forwarded(c) == (1, 1)
    c.lost(sa, 1.3)
    c.tick(1.5)  # not yet full: kept
    assert len(c._buckets) == 1
    c.tick(2.01)  # burst / rate after the last take: full, forgotten
    assert not c._buckets
    sa, _ = join(c, A, now=2.02)
    c.receive(sa, encode_addressed(T.SEND, B.endpoint_id, BIG), 2.02)
    assert forwarded(c) == (2, 1)


def test_kept_buckets_are_bounded_by_max_clients() -> None:
    c = core(rate=1000, burst=MAX_BODY, max_clients=2)
    for key in (A, B, C):
        s, _ = join(c, key)
        c.lost(s, 0.0)
    assert len(c._buckets) == 2 and bytes(A.endpoint_id) not in c._buckets


def test_token_bucket_full_at() -> None:
    b = TokenBucket(rate=100, burst=200, now=1.0)
    assert b.full_at() == 1.0
    assert b.take(150, 2.0) and b.full_at() == 3.5


# ---- PEER_GONE throttle -------------------------------------------------------------


def test_peer_gone_throttle_is_small_and_pruned_on_tick() -> None:
    c = core()
    sa, _ = join(c, A)
    for i in range(1000):
        c.receive(sa, encode_addressed(T.SEND, i.to_bytes(32, "big"), b"x"), 1.0)
    assert 0 < len(sa.peer_gone) <= MAX_PEER_GONE_ENTRIES <= 64
    c.tick(1.5)
    assert len(sa.peer_gone) > 0  # within the interval: remembered
    c.tick(2.5)
    assert len(sa.peer_gone) == 0


def test_peer_gone_throttle_prune() -> None:
    t = PeerGoneThrottle(interval=1.0)
    assert t.allow(b"a", 0.0) and t.allow(b"b", 0.5)
    t.prune(1.2)
    assert len(t) == 1 and not t.allow(b"b", 1.2) and t.allow(b"a", 1.2)


# ---- shutdown -----------------------------------------------------------------------


def test_a_connection_opened_after_shutdown_is_closed_at_once() -> None:
    c = core()
    c.shutdown()
    link = FakeLink()
    s = c.open(link, ("192.0.2.7", 4000), 0.0)
    assert s.phase is Phase.CLOSED and link.closed
    assert link.http().startswith(b"HTTP/1.1 503 ") and b"relay shutting down" in link.http()
    assert c.metrics.auth_failures["shutting_down"] == 1 and c.unauthenticated == 0
    c.receive(s, upgrade_request("relay.test") + encode_frame(T.PING, b"\0" * 8), 0.1)
    assert link.http().count(b"HTTP/1.1") == 1  # nothing more: no 101, no CHALLENGE
    c.lost(s, 0.2)
    assert c.connections == 0


def test_max_unauthenticated_setting(tmp_path: Path) -> None:
    toml = tmp_path / "relay.toml"
    toml.write_text("max-clients = 50\nmax-unauthenticated = 7\n")
    assert load_config(["--config", str(toml)], environ={}).max_unauthenticated == 7
    assert load_config(["--max-unauthenticated", "3"], environ={}).max_unauthenticated == 3
    assert RelayConfig().max_unauthenticated is None  # the core then uses max_clients
    with pytest.raises(ConfigError, match="max-unauthenticated must be >= 1"):
        from_mapping({"max_unauthenticated": 0})
