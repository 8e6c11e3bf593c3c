"""Hole-punching probes are bound to the punching session, and what a peer (or anyone
replaying its probes) can make us remember or send is bounded: the review's replay and
growth findings, through the real codec and the sans-I/O :class:`PeerPaths`."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from p2pdist.identity import SecretKey
from p2pdist.transport.punch import (
    MAX_KNOWN,
    Action,
    PathChange,
    PeerPaths,
    Phase,
    PunchConfig,
    SendCandidates,
    SendPing,
    SendPong,
)
from p2pdist.wire.probe import (
    MAX_CANDIDATES,
    ProbeError,
    ProbeKind,
    decode_probe,
    encode_candidates,
    encode_ping,
    encode_pong,
    new_session,
    session_time,
)

SEED = "punching session tests"
KA, KB = SecretKey.from_seed(SEED, 0), SecretKey.from_seed(SEED, 1)
X = ("203.0.113.66", 4444)  # the attacker's address
A_ADDR, B_ADDR = ("198.51.100.1", 1000), ("198.51.100.2", 2000)


class Side:
    """One peer's punching state towards the other, fed through the real codec."""

    def __init__(self, key: SecretKey, peer: SecretKey, session: bytes) -> None:
        self.key, self.peer = key, peer
        self.paths = PeerPaths(PunchConfig(), session=session)

    def candidates(self, addrs: tuple[tuple[str, int], ...], *, reply: bool = False) -> bytes:
        """Our CANDIDATES message for the peer (what goes through the relay)."""
        pid = self.peer.endpoint_id
        return encode_candidates(
            self.key, pid, addrs, reply_wanted=reply, session=self.paths.session
        )

    def wire(self, act: SendPing | SendPong) -> bytes:
        """The datagram the glue sends for ``act``."""
        s = {"to_session": act.session, "from_session": self.paths.session}
        if isinstance(act, SendPing):
            return encode_ping(self.key, self.peer.endpoint_id, act.txid, **s)
        return encode_pong(self.key, self.peer.endpoint_id, act.txid, act.addr, **s)

    def receive(self, data: bytes, src: tuple[str, int] | None, now: float) -> list[Action]:
        """A probe for us, from ``src`` over UDP (None: through the relay)."""
        msg = decode_probe(data, self.key.endpoint_id)
        assert msg.sender == self.peer.endpoint_id
        if msg.kind is ProbeKind.CANDIDATES:
            return self.paths.on_candidates(
                msg.candidates, msg.reply_wanted, now, session=msg.from_session
            )
        assert src is not None
        s = {"to_session": msg.to_session, "from_session": msg.from_session}
        if msg.kind is ProbeKind.PING:
            return self.paths.on_ping(src, msg.txid, now, **s)
        return self.paths.on_pong(src, msg.txid, now, **s)


def connected_pair(t: float) -> tuple[Side, Side]:
    """A and B in a fresh session, candidates exchanged, both rounds failed (backoff)."""
    a, b = Side(KA, KB, b"A" * 15 + b"2"), Side(KB, KA, b"B" * 15 + b"2")
    a.paths.start(t)
    b.paths.start(t)
    a.receive(b.candidates((B_ADDR,)), None, t)
    b.receive(a.candidates((A_ADDR,)), None, t)
    for side in (a, b):
        side.paths.poll(t + 100.0)  # the round ends without a PONG
        assert side.paths.phase is Phase.BACKOFF
    return a, b


def only(acts: list[Action], kind: type[Any]) -> list[Any]:
    return [x for x in acts if isinstance(x, kind)]


def test_a_ping_replayed_from_an_earlier_session_opens_and_redirects_nothing() -> None:
    # the attacker captured a PING from A to B in an earlier session
    old = Side(KA, KB, b"o" * 16)
    old_ping = encode_ping(
        KA, KB.endpoint_id, bytes(12), to_session=b"b" * 16, from_session=old.paths.session
    )
    t = 1000.0
    _a, b = connected_pair(t)
    # replayed to B from X: refused before it touches any state
    acts = b.receive(old_ping, X, t + 101)
    assert acts == [] and b.paths.stale_probes == 1
    assert not b.paths.accepts(X) and X not in b.paths._candidates
    assert b.paths.phase is Phase.BACKOFF  # nor does it cut the backoff short
    # so B never PINGs X, and the reviewer's chain (forward B's PING to A, A's PONG back
    # to B) has nothing to start from; even a PONG A made in the old session is refused
    old_pong = encode_pong(
        KA, KB.endpoint_id, bytes(12), X, to_session=b"b" * 16, from_session=old.paths.session
    )
    assert b.receive(old_pong, X, t + 102) == [] and b.paths.current is None


def test_a_pong_counts_only_for_a_pending_ping_of_this_session() -> None:
    t = 0.0
    a, b = connected_pair(t)
    acts = a.paths.on_candidates((B_ADDR,), False, t + 200, session=b.paths.session)
    ping = only(acts, SendPing)[0]
    assert ping.addr == B_ADDR and ping.session == b.paths.session
    # B answers with its session swapped for a stale one: signed, right txid, refused
    s = {"to_session": a.paths.session, "from_session": b"z" * 16}
    bad = encode_pong(KB, KA.endpoint_id, ping.txid, B_ADDR, **s)
    assert a.receive(bad, B_ADDR, t + 200.01) == [] and a.paths.stale_probes == 1
    s = {"to_session": b"z" * 16, "from_session": b.paths.session}
    bad = encode_pong(KB, KA.endpoint_id, ping.txid, B_ADDR, **s)
    assert a.receive(bad, B_ADDR, t + 200.01) == [] and a.paths.stale_probes == 2
    # a PONG of this session for a txid we never sent validates nothing either
    s = {"to_session": a.paths.session, "from_session": b.paths.session}
    stray = encode_pong(KB, KA.endpoint_id, b"\x07" * 12, B_ADDR, **s)
    assert a.receive(stray, B_ADDR, t + 200.01) == [] and a.paths.current is None
    # B's real answer (through its own PeerPaths) does
    pong = only(b.receive(a.wire(ping), A_ADDR, t + 200.01), SendPong)[0]
    change = a.receive(b.wire(pong), B_ADDR, t + 200.02)
    assert change == [change[0]] and isinstance(change[0], PathChange)
    assert a.paths.current == B_ADDR


def test_peers_in_the_same_session_still_punch_through_the_codec() -> None:
    a, b = Side(KA, KB, b"a" * 16), Side(KB, KA, b"b" * 16)
    assert a.paths.start(0.0) == [SendCandidates(reply_wanted=True)]
    b.paths.start(0.0)
    acts_b = b.receive(a.candidates((A_ADDR,), reply=True), None, 0.01)
    acts_a = a.receive(b.candidates((B_ADDR,)), None, 0.02)
    ping_b, ping_a = only(acts_b, SendPing)[0], only(acts_a, SendPing)[0]
    pong_a = only(a.receive(b.wire(ping_b), B_ADDR, 0.03), SendPong)[0]
    pong_b = only(b.receive(a.wire(ping_a), A_ADDR, 0.03), SendPong)[0]
    assert only(b.receive(a.wire(pong_a), A_ADDR, 0.04), PathChange)[0].new == A_ADDR
    assert only(a.receive(b.wire(pong_b), B_ADDR, 0.04), PathChange)[0].new == B_ADDR


def test_candidates_from_the_peer_replace_the_previous_list() -> None:
    # a window so short that every list's addresses are taken (the bound on new ones
    # per window is the test below)
    p = PeerPaths(PunchConfig(retry_after=0.0005), session=b"m" * 16)
    p.start(0.0)
    for i in range(1000):  # an authenticated peer sends 16 fresh addresses each time
        addrs = tuple((f"198.51.{i % 250}.{j + 1}", 1000 + i) for j in range(MAX_CANDIDATES))
        p.on_candidates(addrs, False, 0.001 * i, session=b"p" * 16)
    assert len(p._candidates) == MAX_CANDIDATES
    assert all(port == 1999 for _, port in p._candidates)  # the latest list
    assert len(only(p.poll(1.5), SendPing)) <= MAX_KNOWN


def test_a_peer_naming_fresh_addresses_again_and_again_cannot_make_us_flood_them() -> None:
    """An authenticated peer may name any address (a third party's) in CANDIDATES: at
    most MAX_KNOWN new ones are taken (and get PINGs) in each retry_after window,
    whatever it sends and however a round starts; a list sent again in a later window is
    taken then."""
    cfg = PunchConfig(retry_after=15.0)
    p = PeerPaths(cfg, session=b"m" * 16)
    p.start(0.0)
    first_ping: dict[tuple[str, int], float] = {}

    def pings(acts: list[Any], t: float) -> None:
        for ping in only(acts, SendPing):
            first_ping.setdefault(ping.addr, t)

    def fresh(i: int) -> tuple[tuple[str, int], ...]:
        return tuple((f"198.51.{i % 250}.{j + 1}", 1000 + i) for j in range(MAX_CANDIDATES))

    t = 0.0
    for i in range(3000):  # 16 fresh addresses, 100 lists a second, over three windows
        t = i * 0.01
        pings(p.on_candidates(fresh(i), False, t, session=b"p" * 16), t)
        pings(p.poll(t), t)
    assert p.ignored_candidates == 3000 * MAX_CANDIDATES - 2 * MAX_KNOWN  # 2 windows: 0-30 s
    for w in range(3):  # without the bound: 16,000 new addresses in the first window
        assert sum(w * 15 <= when < (w + 1) * 15 for when in first_ping.values()) <= MAX_KNOWN
    pings(p.poll(40.0), 40.0)  # whatever round ran has ended
    again = fresh(2999)  # the latest list, sent again in a new window: taken now
    pings(p.on_candidates(again, False, 46.0, session=b"p" * 16), 46.0)
    pings(p.poll(46.0), 46.0)
    assert all(first_ping.get(a) == 46.0 for a in again)


def test_replayed_pings_from_many_sources_are_bounded_and_keep_the_backoff() -> None:
    cfg = PunchConfig(retry_after=15.0)
    me, peer = b"m" * 16, b"p" * 16
    p = PeerPaths(cfg, session=me)
    p.start(0.0)
    p.on_candidates((B_ADDR,), False, 0.0, session=peer)
    p.poll(100.0)  # the first round fails: backoff until 115
    assert p.phase is Phase.BACKOFF and p.rounds == 1
    sent = pongs = 0
    sources = ((f"192.0.2.{i % 250 + 1}", 1024 + i // 250) for i in itertools.count())
    for i in range(20_000):  # one PING of this session, replayed from a new source each time
        t = 100.0 + i * 0.0001
        acts = p.on_ping(next(sources), b"\x01" * 12, t, to_session=me, from_session=peer)
        sent += len(only(acts, SendPing))
        pongs += len(only(acts, SendPong))
        sent += len(only(p.poll(t), SendPing))
    assert len(p._heard) <= MAX_KNOWN and len(p._candidates) <= MAX_KNOWN
    assert p.rounds == 2  # one early round for all of them, not one per replay
    # PINGs: only to the addresses this round may learn (16 new ones), with the usual
    # backoff; without the bounds every replay added a candidate and a PING
    assert len(p._candidates) == 1 + MAX_CANDIDATES and sent < 10 * MAX_KNOWN
    # and only those addresses get a PONG: we are no reflector for the rest
    assert pongs == MAX_CANDIDATES and p.excess_pings == 20_000 - MAX_CANDIDATES
    p.poll(107.0)  # the early round ends (punch_timeout 6 s)
    assert p.phase is Phase.BACKOFF
    # within retry_after of the early round, replays do not start another one
    acts = p.on_ping(("192.0.2.9", 9), b"\x02" * 12, 110.0, to_session=me, from_session=peer)
    assert p.phase is Phase.BACKOFF and not only(acts, SendPing) and p.rounds == 2


def test_the_validated_path_is_never_forgotten_for_newer_sources() -> None:
    me, peer = b"m" * 16, b"p" * 16
    p = PeerPaths(PunchConfig(), session=me)
    ping = only(p.on_candidates((B_ADDR,), False, 0.0, session=peer), SendPing)[0]
    p.on_pong(B_ADDR, ping.txid, 0.01, to_session=me, from_session=peer)
    assert p.current == B_ADDR
    for i in range(5 * MAX_KNOWN):
        p.on_ping((f"192.0.2.{i + 1}", 7), b"\x01" * 12, 0.02, to_session=me, from_session=peer)
    assert p.accepts(B_ADDR) and len(p._heard) <= 1 + MAX_CANDIDATES
    assert p.phase is Phase.DIRECT and p.current == B_ADDR


def test_addresses_heard_from_stay_bounded_over_many_rounds() -> None:
    me, peer = b"m" * 16, b"p" * 16
    p = PeerPaths(PunchConfig(retry_after=15.0, retry_max=15.0), session=me)
    p.start(0.0)
    p.on_candidates((B_ADDR,), False, 0.0, session=peer)
    sources = ((f"192.0.2.{i % 250 + 1}", 1024 + i // 250) for i in itertools.count())
    t = 0.0
    for _ in range(10):  # ten rounds, each learning its 16 new addresses
        for _ in range(100):
            p.on_ping(next(sources), b"\x01" * 12, t, to_session=me, from_session=peer)
        t = (p.next_deadline() or t) + 16.0
        p.poll(t)
        assert len(p._heard) <= MAX_KNOWN and len(p._candidates) <= MAX_KNOWN
    assert p.rounds >= 10 and len(p._heard) == MAX_KNOWN


def direct(p: PeerPaths, me: bytes, peer: bytes, t: float) -> None:
    """Bring ``p`` to a direct path to B_ADDR at ``t`` (candidates, PING, PONG)."""
    ping = only(p.on_candidates((B_ADDR,), False, t, session=peer), SendPing)[0]
    p.on_pong(B_ADDR, ping.txid, t + 0.01, to_session=me, from_session=peer)
    assert p.current == B_ADDR and p.phase is Phase.DIRECT


def keep_alive(p: PeerPaths, me: bytes, peer: bytes, t: float) -> None:
    """Poll at ``t`` and answer every keepalive PING at once (the peer stays on B_ADDR)."""
    for ping in only(p.poll(t), SendPing):
        p.on_pong(ping.addr, ping.txid, t, to_session=me, from_session=peer)


def test_what_the_peer_sends_from_is_forgotten_when_its_session_changes() -> None:
    me, old, new = b"m" * 16, b"p" * 16, b"q" * 16
    p = PeerPaths(PunchConfig(), session=me)
    direct(p, me, old, 0.0)
    # under the old session the peer was heard from X too (a PING, answered)
    assert only(p.on_ping(X, b"\x01" * 12, 0.1, to_session=me, from_session=old), SendPong)
    assert p.accepts(X) and X in p._candidates
    # a keepalive PING of the old session is waiting for its PONG
    assert only(p.poll(1.6), SendPing) and p._pending
    # the peer starts a new session: X was learned under the old one
    p.on_candidates((B_ADDR,), False, 1.7, session=new)
    assert not p.accepts(X) and X not in p._candidates and X not in p.paths
    assert p.peer_session == new and p.session_changes == 1
    assert p._pending == {}  # PONGs to PINGs of the old session validate nothing
    # the direct path in use stays (its keepalives now carry the new session)
    assert p.accepts(B_ADDR) and list(p.paths) == [B_ADDR] and p.current == B_ADDR
    ping = only(p.poll(3.2), SendPing)[0]
    assert ping.addr == B_ADDR and ping.session == new
    # a PING of the new session from X is a peer-reflexive address like any other
    assert only(p.on_ping(X, b"\x02" * 12, 3.3, to_session=me, from_session=new), SendPong)
    assert p.accepts(X)


def test_direct_paths_and_heard_from_stay_bounded_under_new_candidate_lists() -> None:
    me, peer = b"m" * 16, b"p" * 16
    # a window so short that every list's addresses are probed at once
    p = PeerPaths(PunchConfig(retry_after=0.0005), session=me)
    p.start(0.0)
    pings: list[SendPing] = []
    for i in range(100):  # an authenticated peer sends 16 fresh addresses each time
        addrs = tuple((f"198.51.{i}.{j + 1}", 1000 + j) for j in range(MAX_CANDIDATES))
        pings += only(p.on_candidates(addrs, False, 0.001 * i, session=peer), SendPing)
    assert len(pings) == 100 * MAX_CANDIDATES
    for ping in pings:  # and answers every PING, from where it was sent
        p.on_pong(ping.addr, ping.txid, 0.2, to_session=me, from_session=peer)
        assert len(p.paths) <= MAX_KNOWN and len(p._heard) <= MAX_KNOWN
    assert p.current is not None and p.accepts(p.current) and p.current in p.paths
    assert set(p.paths) <= set(p._heard)
    for i in range(100):  # and the same across session changes (each one newer)
        s = (session_time(peer) + 1 + i).to_bytes(8, "big") + bytes(8)
        acts = p.on_candidates(((f"203.0.113.{i}", 1),), False, 1.0 + i, session=s)
        for ping in only(acts, SendPing) + only(p.poll(1.0 + i), SendPing):
            p.on_pong(ping.addr, ping.txid, 1.0 + i, to_session=me, from_session=s)
        assert len(p.paths) <= MAX_KNOWN and len(p._heard) <= MAX_KNOWN
        assert len(p._pending) <= MAX_KNOWN


def test_a_nat_rebound_ping_is_answered_within_one_window_while_direct() -> None:
    cfg = PunchConfig(retry_after=15.0)
    me, peer = b"m" * 16, b"p" * 16
    p = PeerPaths(cfg, session=me)
    direct(p, me, peer, 0.0)
    # a symmetric NAT on the peer's side: its PINGs came from 16 per-destination ports
    for i in range(MAX_CANDIDATES):
        acts = p.on_ping(
            ("192.0.2.7", 4000 + i), b"\x01" * 12, 1.0, to_session=me, from_session=peer
        )
        assert only(acts, SendPong)
    t = 1.0
    while t < 10.0:  # the direct path stays up (keepalives answered)
        t += 0.5
        keep_alive(p, me, peer, t)
    assert p.phase is Phase.DIRECT
    # within the window a PING from a new port is one too many (a replay, most likely)
    rebound = ("192.0.2.7", 5555)
    kw = {"to_session": me, "from_session": peer}
    assert not only(p.on_ping(rebound, b"\x02" * 12, t, **kw), SendPong)
    assert p.excess_pings == 1
    while t < 16.0:
        t += 0.5
        keep_alive(p, me, peer, t)
    # a window later the NAT-rebound port is answered at once, though no round started
    assert p.phase is Phase.DIRECT and p.rounds == 1
    assert only(p.on_ping(rebound, b"\x03" * 12, t, **kw), SendPong)
    assert p.accepts(rebound)


def test_replays_get_at_most_a_windows_allowance_of_pongs_per_window() -> None:
    cfg = PunchConfig(retry_after=15.0, retry_max=15.0)
    me, peer = b"m" * 16, b"p" * 16
    p = PeerPaths(cfg, session=me)
    p.start(0.0)
    p.on_candidates((B_ADDR,), False, 0.0, session=peer)
    sources = ((f"192.0.2.{i % 250 + 1}", 1024 + i // 250) for i in itertools.count())
    pongs = 0
    for i in range(10_000):  # 100 s of replays from a new source every 10 ms
        t = i * 0.01
        acts = p.on_ping(next(sources), b"\x01" * 12, t, to_session=me, from_session=peer)
        pongs += len(only(acts, SendPong))
        p.poll(t)
        assert len(p._heard) <= MAX_KNOWN and len(p._candidates) <= MAX_KNOWN
    windows = -(-100 // 15)  # 0-15, 15-30, ..., 90-100
    assert pongs == windows * MAX_CANDIDATES


def test_one_session_length_check_for_the_codec_and_the_session() -> None:
    good, bad = b"s" * 16, b"s" * 15
    with pytest.raises(ProbeError, match="a session is 16 bytes"):
        PeerPaths(PunchConfig(), session=bad)
    assert PeerPaths(PunchConfig(), session=good).session == good
    for to_session, from_session in ((bad, good), (good, bad)):
        with pytest.raises(ProbeError, match="a session is 16 bytes"):
            encode_ping(
                KA, KB.endpoint_id, b"t" * 12, to_session=to_session, from_session=from_session
            )
        with pytest.raises(ProbeError, match="a session is 16 bytes"):
            encode_pong(
                KA, KB.endpoint_id, b"t" * 12, X, to_session=to_session, from_session=from_session
            )
    with pytest.raises(ProbeError, match="a session is 16 bytes"):
        encode_candidates(KA, KB.endpoint_id, [], reply_wanted=False, session=bad)


def test_a_replayed_candidates_list_of_an_older_session_is_refused() -> None:
    """The relay can deliver an old, validly signed CANDIDATES again: a session older than
    the peer's current one (sessions carry their creation time) is refused and counted,
    so a direct path of the current session stays (it used to be reset to the old
    session: both sides then refused each other's probes and fell back to the relay)."""
    me = new_session(1_000)
    old, cur = new_session(2_000), new_session(3_000)
    p = PeerPaths(PunchConfig(), session=me)
    p.start(0.0)
    ping = only(p.on_candidates((B_ADDR,), False, 0.0, session=cur), SendPing)[0]
    p.on_pong(B_ADDR, ping.txid, 0.01, to_session=me, from_session=cur)
    assert p.phase is Phase.DIRECT and p.current == B_ADDR
    assert p.on_candidates((B_ADDR,), False, 1.0, session=old) == []
    assert p.stale_candidates == 1 and p.peer_session == cur and p.session_changes == 0
    assert p.phase is Phase.DIRECT and p.current == B_ADDR
    newer = new_session(4_000)  # a later session of the peer is still taken
    p.on_candidates((B_ADDR,), False, 2.0, session=newer)
    assert p.peer_session == newer and p.session_changes == 1


def test_a_path_that_keeps_dying_soon_after_validating_backs_off() -> None:
    """A path that validates, then goes silent, again and again (a middlebox passing the
    small probes but not bulk UDP): the waits between rounds double up to retry_max
    (the validation used to reset them, so it flapped every retry_after forever); one
    that lasted retry_max starts them afresh."""
    cfg = PunchConfig(retry_after=15.0, retry_max=60.0)
    me, peer = new_session(1), new_session(2)
    p = PeerPaths(cfg, session=me)
    p.start(0.0)
    t = 0.0
    acts = p.on_candidates((B_ADDR,), False, t, session=peer)
    fell_back: list[float] = []
    validated: list[float] = []
    for _ in range(5):
        pings = only(acts, SendPing) or only(p.poll(t), SendPing)
        p.on_pong(pings[0].addr, pings[0].txid, t + 0.01, to_session=me, from_session=peer)
        assert p.phase is Phase.DIRECT
        validated.append(t)
        while p.phase is Phase.DIRECT:
            deadline = p.next_deadline()
            assert deadline is not None
            t = deadline
            p.poll(t)
        fell_back.append(t)
        deadline = p.next_deadline()
        assert deadline is not None
        t = deadline
        acts = p.poll(t) + p.on_candidates((B_ADDR,), False, t, session=peer)
    waits = [round(v - f, 1) for f, v in zip(fell_back, validated[1:], strict=False)]
    assert waits == [15.0, 30.0, 60.0, 60.0], waits
