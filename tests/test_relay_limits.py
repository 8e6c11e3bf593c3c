"""The relay core's limits on what clients can hold or get for free, with fake links and
a hand-moved clock: unauthenticated connections (frame size before AUTH, how many may
wait), token buckets across reconnects, the PEER_GONE throttle's memory, and
connections that arrive while the relay shuts down."""

from __future__ import annotations

import heapq
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from test_relay_core import A, B, C, FakeLink, auth_frame, core, join, upgrade

from p2pdist.identity import SecretKey
from p2pdist.wire.relay import (
    MAX_BODY,
    MAX_HTTP_HEAD,
    RelayFrameType,
    encode_addressed,
    encode_frame,
    upgrade_request,
)
from relay.addresses import source_of
from relay.cli import load_config
from relay.config import ConfigError, RelayConfig, from_mapping
from relay.inbound import MAX_AUTH_BODY, WS_BEFORE_AUTH
from relay.limits import MAX_PEER_GONE_ENTRIES, PeerGoneThrottle, TokenBucket
from relay.session import Phase, Session
from relay.state import EVICT_AFTER, FRAME_CHARGE, MIN_READ, CoreConfig, RelayCore

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


def test_a_large_frame_right_after_auth_in_the_same_read_is_accepted() -> None:
    # The pre-auth limit is the splitter's own, raised on AUTH_OK: a SEND longer than any
    # AUTH that arrives in the same read as the AUTH must pass.
    c = core()
    _, b_link = join(c, B)
    s, link = upgrade(c)
    big = b"x" * (MAX_AUTH_BODY * 4)
    c.receive(s, auth_frame(A) + encode_addressed(T.SEND, bytes(B.endpoint_id), big), 1.0)
    assert s.phase is Phase.ACTIVE and not link.closed
    assert (T.RECV, bytes(A.endpoint_id) + big) in b_link.frames()


def test_the_largest_valid_auth_still_passes() -> None:
    c = core()
    token = b"t" * (MAX_AUTH_BODY - 96)  # the longest token the config allows
    s, link = join(c, A, token=token)  # open access: the token is ignored
    assert s.phase is Phase.ACTIVE and link.frames()[-1][0] is T.AUTH_OK


def opened(c: RelayCore, ip: str, now: float = 0.0, port: int = 1) -> tuple[Session, FakeLink]:
    """A connection from ``ip`` that finished TLS and has sent nothing yet."""
    link = FakeLink()
    return c.open(link, (ip, port), now), link


def health(c: RelayCore, s: Session, link: FakeLink, path: str = "/health") -> bytes:
    c.receive(s, f"GET {path} HTTP/1.1\r\nHost: relay.test\r\n\r\n".encode(), 0.0)
    assert link.closed
    return link.http()


def test_a_new_connection_over_the_cap_evicts_the_oldest_waiting() -> None:
    c = core(max_clients=3)  # the cap defaults to max_clients
    assert c.max_unauthenticated == 3
    first, first_link = upgrade(c, 0.0)  # in AUTH: gets an ERROR when evicted
    second, second_link = opened(c, "192.0.2.8", 1.0)  # in the HTTP phase: gets a 503
    third, _ = opened(c, "192.0.2.9", 2.0)
    assert c.unauthenticated == 3
    fourth, fourth_link = opened(c, "192.0.2.10", 3.0)
    # Before the fix the newcomer was refused with 503 and the idle ones kept their place.
    assert fourth.phase is Phase.HTTP and not fourth_link.closed
    assert first.phase is Phase.CLOSED and first_link.closed
    assert first_link.frames() == [
        (T.ERROR, b"evicted: too many connections waiting to authenticate")
    ]
    assert second.phase is Phase.HTTP and third.phase is Phase.HTTP
    assert c.unauthenticated == 3
    opened(c, "192.0.2.11", 4.0)
    assert second.phase is Phase.CLOSED and second_link.http().startswith(b"HTTP/1.1 503 ")
    assert c.metrics.evicted == {
        "max_unauthenticated": 2,
        "max_unauthenticated_per_ip": 0,
        "socket_budget": 0,
    }
    text = c.metrics_text()
    assert '\np2pdist_relay_evicted_total{reason="max_unauthenticated"} 2\n' in text
    assert "\np2pdist_relay_unauthenticated 3\n" in text
    c.lost(first, 5.0)
    c.lost(second, 5.0)
    assert c.unauthenticated == 3 and c.connections == 3


def test_authenticated_and_timed_out_connections_leave_the_count() -> None:
    c = core(max_clients=2)
    s1, _ = upgrade(c)
    s2, _ = opened(c, "192.0.2.8")
    c.receive(s1, auth_frame(A), 0.0)  # one authenticates: room for one more
    assert s1.phase is Phase.ACTIVE and c.unauthenticated == 1
    c.tick(100.0)  # the other times out: room for two
    assert s2.phase is Phase.CLOSED and c.unauthenticated == 0
    s4, _ = upgrade(c, 100.0)
    assert s4.phase is Phase.AUTH
    c.lost(s4, 100.5)
    assert c.unauthenticated == 0
    assert c.metrics.evicted["max_unauthenticated"] == 0


def test_a_real_client_authenticates_through_a_flood_of_idle_connections() -> None:
    c = core(max_clients=100, max_unauthenticated=50, max_unauthenticated_per_ip=1000)
    # one connection every 50 ms: the oldest of 50 waiting has waited 2.5 s
    flood = [opened(c, f"198.51.100.{i % 250}", i * 0.05, port=i) for i in range(500)]
    assert c.unauthenticated == 50
    # 48 more flood connections arrive while the client upgrades and authenticates.
    s, link = join_through(c, flood_more=lambda: flood.extend(more_flood(c, 24)))
    assert s.phase is Phase.ACTIVE and link.frames()[-1][0] is T.AUTH_OK
    # Each newcomer evicted a flooder that had waited at least EVICT_AFTER, or, once only
    # younger ones were left, was itself turned away.
    turned_away = (
        c.metrics.evicted["max_unauthenticated"] + c.metrics.refused["max_unauthenticated"]
    )
    assert turned_away == (500 - 50) + 1 + 48
    assert c.metrics.refused["max_unauthenticated"] > 0
    # Only the flood was churned; every flooder that is still open is still waiting.
    assert sum(f.phase is not Phase.CLOSED for f, _ in flood) == 49


def more_flood(c: RelayCore, n: int) -> list[tuple[Session, FakeLink]]:
    return [opened(c, f"203.0.113.{i % 250}", 25.0, port=i) for i in range(n)]


def join_through(c: RelayCore, flood_more: Callable[[], None]) -> tuple[Session, FakeLink]:
    """A client that connects, then sees ``flood_more`` connections arrive before its
    upgrade and again before its AUTH (fewer than the cap in all)."""
    link = FakeLink()
    s = c.open(link, ("192.0.2.7", 4000), 25.0)
    flood_more()
    c.receive(s, upgrade_request("relay.test"), 25.0)
    assert not link.closed and s.phase is Phase.AUTH
    flood_more()
    c.receive(s, auth_frame(A), 25.0)
    return s, link


def test_one_source_only_evicts_its_own_connections() -> None:
    c = core(max_clients=100, max_unauthenticated=50, max_unauthenticated_per_ip=8)
    other, other_link = opened(c, "192.0.2.8")
    flood = [opened(c, "198.51.100.1", i * 0.2, port=i) for i in range(1000)]
    assert other.phase is Phase.HTTP and not other_link.closed  # not churned by the flood
    assert c.unauthenticated == 1 + 8
    assert [f.phase is Phase.HTTP for f, _ in flood[-8:]] == [True] * 8
    assert all(f.phase is Phase.CLOSED for f, _ in flood[:-8])
    assert c.metrics.evicted == {
        "max_unauthenticated": 0,
        "max_unauthenticated_per_ip": 992,
        "socket_budget": 0,
    }
    c.receive(other, upgrade_request("relay.test"), 0.0)
    c.receive(other, auth_frame(A), 0.0)
    assert other.phase is Phase.ACTIVE


def test_an_ipv6_source_is_its_64() -> None:
    assert (
        source_of("2001:db8:1:2:aaaa::1")
        == source_of("2001:db8:1:2:bbbb::9")
        == ("2001:db8:1:2::/64")
    )
    assert source_of("2001:db8:1:3::1") != source_of("2001:db8:1:2::1")
    assert source_of("::ffff:192.0.2.1") == "192.0.2.1" == source_of("192.0.2.1")
    assert source_of("fe80::1%eth0") == "fe80::/64"
    assert source_of("?") == "?"
    c = core(max_unauthenticated_per_ip=2)
    conns = [opened(c, f"2001:db8:1:2::{i + 1:x}", float(i)) for i in range(3)]
    assert [s.phase for s, _ in conns] == [Phase.CLOSED, Phase.HTTP, Phase.HTTP]


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_are_answered_when_the_cap_is_full(path: str) -> None:
    c = core(max_clients=100, max_unauthenticated=4)
    flood = [opened(c, f"198.51.100.{i}") for i in range(4)]
    s, link = opened(c, "192.0.2.99", 5.0)  # the monitor: let in, the oldest flooder goes
    answer = health(c, s, link, path)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:60]
    assert flood[0][0].phase is Phase.CLOSED
    assert c.unauthenticated == 3  # served and closed at once
    assert c.metrics.http_requests_total == 1


def test_a_cap_full_of_young_connections_refuses_the_newcomer() -> None:
    c = core(max_clients=100, max_unauthenticated=3)
    young = [opened(c, f"198.51.100.{i}", i * 0.1) for i in range(3)]
    s, link = opened(c, "192.0.2.99", 0.5)  # the oldest has waited 0.5 s: likely real
    assert s.phase is Phase.CLOSED and link.http().startswith(b"HTTP/1.1 503 ")
    assert all(y.phase is Phase.HTTP for y, _ in young)
    assert c.metrics.refused == {"max_unauthenticated": 1, "max_unauthenticated_per_ip": 0}
    assert '\np2pdist_relay_refused_total{reason="max_unauthenticated"} 1\n' in c.metrics_text()
    late, _ = opened(c, "192.0.2.100", 1.0 + EVICT_AFTER)  # now the oldest has waited long
    assert late.phase is Phase.HTTP and young[0][0].phase is Phase.CLOSED
    assert c.metrics.evicted["max_unauthenticated"] == 1


@pytest.mark.parametrize("per_ip", [True, False])
def test_a_reconnect_storm_larger_than_the_cap_still_gets_everyone_in(per_ip: bool) -> None:
    """200 clients behind one address reconnect at once (a relay restart); each needs
    0.2 s from connecting to AUTH, and retries 50 ms after being turned away. Evicting
    the oldest waiting connection always would close each one just before it
    authenticates, and nobody would ever get in."""
    cap = {"max_unauthenticated_per_ip": 16} if per_ip else {"max_unauthenticated": 16}
    c = core(max_clients=1000, **cap)
    keys = [SecretKey.from_seed("reconnect storm seed", i) for i in range(200)]
    events: list[tuple[float, int, str, int]] = [(0.001 * i, i, "open", i) for i in range(200)]
    sessions: dict[int, tuple[Session, FakeLink]] = {}
    joined: dict[int, float] = {}
    seq = 200
    while events and len(joined) < len(keys):
        now, _, what, i = heapq.heappop(events)
        assert now < 120.0, f"{len(joined)} of {len(keys)} in after 120 s"
        if what == "open":
            sessions[i] = opened(c, "198.51.100.7", now, port=1000 + seq)
            step = "upgrade"
        else:
            s = sessions[i][0]
            if s.phase is not Phase.CLOSED:
                data = upgrade_request("relay.test") if what == "upgrade" else auth_frame(keys[i])
                c.receive(s, data, now)
            step = "auth" if what == "upgrade" else "done"
        s = sessions[i][0]
        seq += 1
        if s.phase is Phase.CLOSED:
            heapq.heappush(events, (now + 0.05, seq, "open", i))
        elif step == "done":
            assert s.phase is Phase.ACTIVE
            joined[i] = now
        else:
            heapq.heappush(events, (now + 0.1, seq, step, i))
    assert len(joined) == len(keys)
    assert c.metrics.refused["max_unauthenticated_per_ip" if per_ip else "max_unauthenticated"]


def test_the_caps_on_waiting_connections_are_configurable() -> None:
    c = core(max_clients=100, max_unauthenticated=1)
    first, link = upgrade(c)
    assert opened(c, "192.0.2.9", 2.0)[0].phase is Phase.HTTP and link.closed
    assert first.phase is Phase.CLOSED and c.unauthenticated == 1


# ---- token buckets across reconnects ------------------------------------------------


SEND_BIG = encode_addressed(T.SEND, B.endpoint_id, BIG)  # one whole bucket


def test_a_replacing_session_inherits_the_bucket() -> None:
    c = core(rate=MAX_BODY, burst=MAX_BODY)  # one big SEND per second
    join(c, B)
    sa, _ = join(c, A, now=1.0)
    c.receive(sa, SEND_BIG, 1.0)
    for i in range(5):  # reconnecting does not buy a fresh burst
        sa, _ = join(c, A, now=1.0 + i / 100)
        c.receive(sa, SEND_BIG, 1.0 + i / 100)
    assert c.metrics.replaced_total == 5 and c.metrics.datagrams_out_total == 6
    bucket = sa.bucket
    assert bucket is not None and bucket.level(1.05) < -4 * len(SEND_BIG)  # in debt
    assert c.read_allowance(sa, 1.05) == MIN_READ
    assert bucket.level(10.0) == MAX_BODY  # the rate still refills


def test_frames_behind_auth_in_its_read_are_charged_and_reads_before_auth_are_small() -> None:
    """The read that carries AUTH is charged whole and paces the client at once, and a
    read before AUTH_OK holds one message: an HTTP head, then an AUTH frame (in a
    WebSocket frame). Frames a reconnecting client wrote behind its AUTH were forwarded
    free (up to 256 KiB a connection, about 120x --rate through reconnects)."""
    c = core(rate=MAX_BODY, burst=MAX_BODY)
    join(c, B)
    fresh = c.open(FakeLink(), ("192.0.2.8", 4000), 0.5)
    assert c.read_allowance(fresh, 0.5) == MAX_HTTP_HEAD
    s, link = upgrade(c, 1.0)
    assert s.phase is Phase.AUTH and c.read_allowance(s, 1.0) == WS_BEFORE_AUTH
    c.receive(s, auth_frame(A) + SEND_BIG * 2, 1.0)
    bucket = s.bucket
    assert bucket is not None and bucket.level(1.0) < -len(SEND_BIG)  # charged, in debt
    assert link.pauses and c.metrics.rate_paused_total == 1  # and paced at once


def test_a_gone_clients_bucket_is_kept_until_it_is_full_again() -> None:
    c = core(rate=MAX_BODY, burst=MAX_BODY)
    join(c, B)
    sa, _ = join(c, A, now=1.0)
    c.receive(sa, SEND_BIG, 1.0)
    c.lost(sa, 1.1)  # disconnect, reconnect at once: still empty
    sa, _ = join(c, A, now=1.2)
    assert sa.bucket is not None and sa.bucket.level(1.2) < MAX_BODY / 4
    full = sa.bucket.full_at()
    c.lost(sa, 1.3)
    c.tick(full - 0.1)  # not yet full: kept
    assert len(c._buckets) == 1
    c.tick(full + 0.01)  # full: forgotten
    assert not c._buckets
    sa, _ = join(c, A, now=full + 0.02)
    fresh = MAX_BODY - len(auth_frame(A)) - FRAME_CHARGE  # less the read that carried AUTH
    assert sa.bucket is not None and sa.bucket.level(full + 0.02) == fresh  # a fresh one


def test_kept_buckets_are_bounded_by_max_clients() -> None:
    c = core(rate=1000, burst=MAX_BODY, max_clients=2)
    for key in (A, B, C):
        s, _ = join(c, key)
        c.lost(s, 0.0)
    assert len(c._buckets) == 2 and bytes(A.endpoint_id) not in c._buckets


def test_token_bucket_full_at() -> None:
    b = TokenBucket(rate=100, burst=200, now=1.0)
    assert b.full_at() == 1.0
    b.charge(150, 2.0)
    assert b.full_at() == 3.5


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


def test_peer_gone_prune_keeps_a_full_throttle_of_fresh_entries() -> None:
    # prune() (the core's tick) forgets only stale entries; halving a full throttle is
    # allow()'s way to make room, not the tick's (it let duplicate PEER_GONEs out early).
    t = PeerGoneThrottle(interval=1.0, max_entries=4)
    dests = [bytes([i]) for i in range(4)]
    assert all(t.allow(d, 0.0) for d in dests)
    t.prune(0.5)
    assert len(t) == 4 and not any(t.allow(d, 0.5) for d in dests)
    assert t.allow(b"new", 0.6) and len(t) == 3  # full of fresh ones: the oldest half goes


def test_a_sender_full_of_unknown_destinations_gets_no_duplicate_peer_gone() -> None:
    c = core()
    sa, _ = join(c, A)
    dests = [i.to_bytes(32, "big") for i in range(MAX_PEER_GONE_ENTRIES)]
    for d in dests:
        c.receive(sa, encode_addressed(T.SEND, d, b"x"), 1.0)
    sent = c.metrics.peer_gone_total
    c.tick(1.5)
    for d in dests:
        c.receive(sa, encode_addressed(T.SEND, d, b"x"), 1.6)
    assert c.metrics.peer_gone_total == sent


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
    toml.write_text("max-clients = 50\nmax-unauthenticated = 7\nmax-unauthenticated-per-ip = 5\n")
    cfg = load_config(["--config", str(toml)], environ={})
    assert (cfg.max_unauthenticated, cfg.max_unauthenticated_per_ip) == (7, 5)
    assert load_config(["--max-unauthenticated", "3"], environ={}).max_unauthenticated == 3
    per_ip = load_config(["--max-unauthenticated-per-ip", "9"], environ={})
    assert per_ip.max_unauthenticated_per_ip == 9
    assert RelayConfig().max_unauthenticated is None  # the core then uses max_clients
    assert RelayConfig().max_unauthenticated_per_ip == CoreConfig().max_unauthenticated_per_ip
    with pytest.raises(ConfigError, match="max-unauthenticated must be >= 1"):
        from_mapping({"max_unauthenticated": 0})
    with pytest.raises(ConfigError, match="max-unauthenticated-per-ip must be >= 1"):
        from_mapping({"max_unauthenticated_per_ip": 0})
