"""Hole punching on loopback: the signed probe codec, the sans-I/O punching logic with a
hand-moved clock, and the transport moving a relayed QUIC connection to a direct path and
back without losing a byte. The NAT behaviour itself is proven in tests/test_nat_matrix.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import socket
import types
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_relay import FakeRelayHub
from hypothesis import given
from hypothesis import strategies as st
from relay_helpers import RelayProcess
from transport_conformance import bounded, closing, ipv6_loopback_works, wait_until

import p2pdist.transport.holepunch as holepunch_module
import p2pdist.transport.interfaces as interfaces_module
import p2pdist.transport.quic as quic_module
import p2pdist.wire.probe as probe_module
from p2pdist import Group, GroupConfig, PunchConfig
from p2pdist.identity import SecretKey
from p2pdist.transport import TransportConfig
from p2pdist.transport.paths import (
    MAX_PATH_COUNTERS,
    RelayRoute,
    UdpSocket,
    bind_host_for,
    worth_probing,
)
from p2pdist.transport.punch import (
    PathChange,
    PeerPaths,
    Phase,
    SendCandidates,
    SendPing,
    SendPong,
)
from p2pdist.transport.quic import QuicConnection, QuicTransport
from p2pdist.transport.quic_core import QuicConfig
from p2pdist.transport.relay_path import RelayPath
from p2pdist.wire.probe import (
    DatagramKind,
    ProbeError,
    ProbeKind,
    classify,
    decode_probe,
    encode_candidates,
    encode_ping,
    encode_pong,
)
from p2pdist.wire.stun import binding_request, binding_response

SEED = "hole punching tests: a shared secret"
A, B, C = (SecretKey.from_seed(SEED, r) for r in range(3))
FAST_PUNCH = PunchConfig(
    probe_interval=0.05, keepalive=0.2, path_timeout=0.8, retry_after=0.5, punch_timeout=2.0
)

# ---- the probe codec ------------------------------------------------------------------------


SA, SB = b"session of A \x00\x01\x02", b"session of B \x00\x01\x02"
ME, PEER = b"m" * 16, b"p" * 16  # the sessions of the PeerPaths under test and its peer
FROM_PEER = {"to_session": ME, "from_session": PEER}


def test_probes_round_trip_and_are_bound_to_sender_and_receiver() -> None:
    txid = bytes(range(12))
    ping = decode_probe(
        encode_ping(A, B.endpoint_id, txid, to_session=SB, from_session=SA), B.endpoint_id
    )
    assert (ping.kind, ping.sender, ping.txid) == (ProbeKind.PING, A.endpoint_id, txid)
    assert (ping.to_session, ping.from_session) == (SB, SA)
    there = ("10.0.0.2", 4242)
    pong = decode_probe(
        encode_pong(B, A.endpoint_id, txid, there, to_session=SA, from_session=SB),
        A.endpoint_id,
    )
    assert (pong.kind, pong.address, pong.txid) == (ProbeKind.PONG, there, txid)
    assert (pong.to_session, pong.from_session) == (SA, SB)
    v6 = decode_probe(
        encode_pong(B, A.endpoint_id, txid, ("::1", 9), to_session=SA, from_session=SB),
        A.endpoint_id,
    )
    assert v6.address == ("::1", 9)
    addrs = (("203.0.113.7", 1000), ("10.0.0.2", 2000), ("2001:db8::1", 3000))
    cands = decode_probe(
        encode_candidates(A, B.endpoint_id, addrs, reply_wanted=True, session=SA), B.endpoint_id
    )
    assert cands.candidates == addrs and cands.reply_wanted and cands.from_session == SA
    mapped = decode_probe(  # an IPv4-mapped address is the IPv4 peer our sockets report
        encode_candidates(
            A, B.endpoint_id, [("::ffff:198.51.100.9", 4000)], reply_wanted=False, session=SA
        ),
        B.endpoint_id,
    )
    assert mapped.candidates == (("198.51.100.9", 4000),)
    # a probe for B is worthless to C, and no byte of it can be changed
    data = encode_ping(A, B.endpoint_id, txid, to_session=SB, from_session=SA)
    with pytest.raises(ProbeError, match="signature"):
        decode_probe(data, C.endpoint_id)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        with pytest.raises(ProbeError):
            decode_probe(bytes(bad), B.endpoint_id)
    for cut in range(len(data)):
        with pytest.raises(ProbeError):
            decode_probe(data[:cut], B.endpoint_id)
    with pytest.raises(ProbeError):
        decode_probe(data + b"\x00", B.endpoint_id)


def test_pings_and_pongs_carry_signed_zero_padding_to_the_size_asked() -> None:
    txid = bytes(range(12))
    ping = encode_ping(A, B.endpoint_id, txid, to_session=SB, from_session=SA, pad_to=1452)
    assert len(ping) == 1452
    assert decode_probe(ping, B.endpoint_id).txid == txid
    there = ("10.0.0.2", 4242)
    pong = encode_pong(B, A.endpoint_id, txid, there, to_session=SA, from_session=SB, pad_to=900)
    assert len(pong) == 900 and decode_probe(pong, A.endpoint_id).address == there
    small = encode_ping(A, B.endpoint_id, txid, to_session=SB, from_session=SA, pad_to=10)
    assert small == encode_ping(A, B.endpoint_id, txid, to_session=SB, from_session=SA)
    # padding is zeros, under the signature: a non-zero byte there is refused even when
    # signed, and an unsigned change breaks the signature
    body = bytes(txid) + SB + SA + b"\x00" * 10 + b"\x01"
    with pytest.raises(ProbeError, match="trailing bytes in PING"):
        decode_probe(probe_module._seal(A, B.endpoint_id, ProbeKind.PING, body), B.endpoint_id)
    bad = bytearray(ping)
    bad[200] = 1
    with pytest.raises(ProbeError, match="signature"):
        decode_probe(bytes(bad), B.endpoint_id)


def test_one_socket_tells_quic_stun_and_probes_apart() -> None:
    ping = encode_ping(A, B.endpoint_id, bytes(12), to_session=SB, from_session=SA)
    assert classify(ping) is DatagramKind.PROBE
    assert classify(binding_request(bytes(12))) is DatagramKind.STUN
    assert classify(binding_response(bytes(12), "10.0.0.1", 5)) is DatagramKind.STUN
    assert classify(b"\xc0" + bytes(1199)) is DatagramKind.QUIC  # long header, fixed bit
    assert classify(b"\x40" + bytes(40)) is DatagramKind.QUIC  # short header
    assert classify(b"") is DatagramKind.GARBAGE
    assert classify(b"\x00garbage") is DatagramKind.GARBAGE


@given(st.binary(max_size=300))
def test_probe_decoder_only_ever_raises_probe_error(data: bytes) -> None:
    with contextlib.suppress(ProbeError):
        decode_probe(data, B.endpoint_id)


# ---- the sans-I/O logic, with a hand-moved clock --------------------------------------------


def counter() -> Any:
    n = iter(range(1, 1 << 30))
    return lambda: next(n).to_bytes(12, "big")


def pings(actions: list[Any]) -> list[SendPing]:
    return [a for a in actions if isinstance(a, SendPing)]


def test_a_round_probes_every_candidate_with_backoff_until_a_pong() -> None:
    cfg = PunchConfig(probe_interval=0.1, probe_interval_max=0.4, punch_timeout=2.0)
    p = PeerPaths(cfg, counter(), session=ME)
    assert p.start(0.0) == [SendCandidates(reply_wanted=True)]
    assert p.phase is Phase.PUNCHING
    x, y = ("203.0.113.5", 1000), ("10.0.0.2", 1000)
    first = p.on_candidates((x, y), reply_wanted=False, now=0.01, session=PEER)
    assert [a.addr for a in pings(first)] == [x, y]
    sent_at = [0.01]
    t = 0.01
    while len(sent_at) < 5:  # the gaps double up to the maximum
        nxt = p.next_deadline()
        assert nxt is not None
        t = nxt
        if pings(p.poll(t)):
            sent_at.append(t)
    gaps = [round(b - a, 6) for a, b in itertools.pairwise(sent_at)]
    assert gaps == [0.1, 0.2, 0.4, 0.4]
    # a PONG for an unknown transaction, or from elsewhere than asked, validates nothing
    assert p.on_pong(x, b"\xff" * 12, t, **FROM_PEER) == []
    last = pings(p.poll(p.next_deadline() or t))
    wrong = last[0].txid if last[0].addr == x else last[1].txid
    assert p.on_pong(y, wrong, t + 0.1, **FROM_PEER) == []
    ping_x = next(a for a in last if a.addr == x)
    change = p.on_pong(x, ping_x.txid, t + 0.2, **FROM_PEER)
    assert change and isinstance(change[0], PathChange) and change[0].new == x
    assert p.phase is Phase.DIRECT and p.current == x
    assert p.accepts(x) and not p.accepts(("198.51.100.1", 1))


def test_a_round_that_gets_no_pong_ends_and_retries_with_backoff() -> None:
    cfg = PunchConfig(punch_timeout=1.0, retry_after=5.0, retry_max=12.0)
    p = PeerPaths(cfg, counter(), session=ME)
    p.start(0.0)
    p.on_candidates((("203.0.113.5", 1000),), reply_wanted=False, now=0.0, session=PEER)
    t = 0.0
    while p.phase is Phase.PUNCHING:
        t = p.next_deadline() or t
        p.poll(t)
    assert p.phase is Phase.BACKOFF and t == pytest.approx(1.0)
    assert p.last_failure is not None and "no direct path" in p.last_failure
    starts = []
    for _ in range(3):
        t = p.next_deadline() or t
        acts = p.poll(t)
        assert SendCandidates(reply_wanted=True) in acts
        starts.append(t)
        while p.phase is Phase.PUNCHING:
            t = p.next_deadline() or t
            p.poll(t)
    gaps = [round(b - a, 6) for a, b in zip([1.0, *starts], starts, strict=False)]
    assert gaps == [5.0, 11.0, 13.0]  # retry_after, doubled, capped (+ the 1 s rounds)
    assert p.rounds == 4


def test_direct_path_keepalive_and_fallback_when_pongs_stop() -> None:
    cfg = PunchConfig(keepalive=1.0, path_timeout=3.0, retry_after=10.0)
    p = PeerPaths(cfg, counter(), session=ME)
    x = ("203.0.113.5", 1000)
    acts = p.on_ping(x, b"\x01" * 12, 0.0, **FROM_PEER)  # the peer punches us first
    assert acts[0] == SendPong(x, b"\x01" * 12, PEER)
    ping = pings(acts)[0]
    assert ping.addr == x  # its address became a (peer-reflexive) candidate
    p.on_pong(x, ping.txid, 0.05, **FROM_PEER)
    assert p.current == x
    t, keepalives = 0.05, []
    while True:
        t = p.next_deadline() or t
        acts = p.poll(t)
        if any(isinstance(a, PathChange) for a in acts):
            break
        keepalives += [round(t, 6) for a in pings(acts)]
    assert keepalives == [1.05, 2.05]
    assert t == pytest.approx(3.05)  # path_timeout after the last PONG
    change = next(a for a in acts if isinstance(a, PathChange))
    assert change.old == x and change.new is None and "silent" in change.reason
    assert p.phase is Phase.BACKOFF and p.current is None


def test_a_stalled_process_keeps_its_direct_path_and_pings_at_once() -> None:
    """Our own loop held for longer than path_timeout (a long computation between
    collectives): no keepalive went out, so the silence is ours. A PING from the peer
    read first, then the timer, send a keepalive and give it path_timeout - keepalive
    for its PONG, as on a loop that runs on time (it used to fall back to the relay and
    punch again); a path that stays silent after that still goes."""
    cfg = PunchConfig(keepalive=1.0, path_timeout=3.0, retry_after=10.0)
    p = PeerPaths(cfg, counter(), session=ME)
    x = ("203.0.113.5", 1000)
    first = pings(p.on_ping(x, b"\x01" * 12, 0.0, **FROM_PEER))[0]
    p.on_pong(x, first.txid, 0.0, **FROM_PEER)
    t = p.next_deadline() or 0.0
    for a in pings(p.poll(t)):  # one keepalive on time, answered
        p.on_pong(a.addr, a.txid, t + 0.01, **FROM_PEER)
    t += 10.0  # the loop was held for 10 s
    acts = p.on_ping(x, b"\x02" * 12, t, **FROM_PEER)  # the peer's, queued meanwhile
    acts += p.poll(t)  # then the timer
    assert not any(isinstance(a, PathChange) for a in acts), acts
    assert [a.addr for a in pings(acts)] == [x] and p.phase is Phase.DIRECT
    while not any(isinstance(a, PathChange) for a in acts):  # no answer this time
        t = p.next_deadline() or t
        acts = p.poll(t)
    assert t == pytest.approx(11.0 + 3.0 - 1.0) and p.phase is Phase.BACKOFF


def test_keepalive_pongs_keep_the_path() -> None:
    p = PeerPaths(PunchConfig(keepalive=1.0, path_timeout=3.0), counter(), session=ME)
    x = ("203.0.113.5", 1000)
    first = pings(p.on_ping(x, b"\x01" * 12, 0.0, **FROM_PEER))[0]
    p.on_pong(x, first.txid, 0.0, **FROM_PEER)
    t = 0.0
    for _ in range(20):
        t = p.next_deadline() or t
        for a in p.poll(t):
            assert not isinstance(a, PathChange)
            if isinstance(a, SendPing):
                p.on_pong(a.addr, a.txid, t + 0.01, **FROM_PEER)
    assert p.phase is Phase.DIRECT and t > 9.0


def test_a_state_that_never_sent_its_candidates_sends_them_with_any_list() -> None:
    """A restart() makes a new state and starts it from a task; the peer's reply to the
    old state's candidates (reply_wanted=False) can come first. The new state sends its
    own then: it did not, its start() found the round begun and sent nothing, and the
    peer, never told our new session, refused our PINGs until the next round (an
    audit)."""
    p = PeerPaths(PunchConfig(), counter(), session=ME)
    acts = p.on_candidates((("203.0.113.5", 1000),), reply_wanted=False, now=0.0, session=PEER)
    assert SendCandidates(False) in acts
    assert p.start(0.1) == []  # the round has begun; ours went out above
    assert SendCandidates(False) not in p.on_candidates(
        (), reply_wanted=False, now=0.2, session=PEER
    )


def test_candidates_are_answered_once_per_refresh_interval() -> None:
    p = PeerPaths(PunchConfig(candidate_refresh=1.0), counter(), session=ME)
    assert SendCandidates(False) in p.on_candidates((), reply_wanted=True, now=0.0, session=PEER)
    assert SendCandidates(False) not in p.on_candidates(
        (), reply_wanted=True, now=0.5, session=PEER
    )
    assert SendCandidates(False) in p.on_candidates((), reply_wanted=True, now=1.5, session=PEER)
    assert SendCandidates(False) not in p.on_candidates(
        (), reply_wanted=False, now=9.0, session=PEER
    )


def test_punch_config_is_checked() -> None:
    with pytest.raises(ValueError, match="path_timeout"):
        PunchConfig(keepalive=2.0, path_timeout=1.0)
    with pytest.raises(ValueError):
        PunchConfig(probe_interval=0)


def test_an_idle_timeout_shorter_than_the_fallback_to_the_relay_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A direct path that dies goes back to the relay after path_timeout without a pong:
    an idle_timeout that does not outlast that may end the connection with the path."""
    caplog.set_level(logging.WARNING, logger="p2pdist.transport.quic")
    relay = FakeRelayHub().attach(A.endpoint_id)
    short = TransportConfig(keepalive_interval=0.2, idle_timeout=1.5)
    punch = PunchConfig(keepalive=0.5, path_timeout=2.0)

    def warned() -> list[str]:
        found = [
            r.getMessage() for r in caplog.records if "falls back to the relay" in r.getMessage()
        ]
        caplog.clear()
        return found

    QuicTransport(A, short, relay=relay, punch=punch)
    (message,) = warned()
    assert "idle_timeout (1.5 s)" in message and "(2.5 s)" in message
    QuicTransport(A, short, relay=relay, punch=replace(punch, enabled=False))  # no punching
    QuicTransport(A, short, punch=punch)  # no relay to fall back to
    QuicTransport(A, TransportConfig(idle_timeout=3.0), relay=relay, punch=punch)
    assert warned() == []


# ---- the transport ----------------------------------------------------------------------------


def transport_config() -> TransportConfig:
    return TransportConfig(keepalive_interval=0.2, idle_timeout=5.0)


@contextlib.asynccontextmanager
async def relayed_pair(
    punch: PunchConfig = FAST_PUNCH,
    quic: QuicConfig | None = None,
    cfg: TransportConfig | None = None,
    hub: FakeRelayHub | None = None,
) -> AsyncIterator[tuple[QuicTransport, QuicTransport, QuicConnection, QuicConnection]]:
    hub = hub or FakeRelayHub()
    cfg = cfg or transport_config()
    ta = QuicTransport(A, cfg, relay=hub.attach(A.endpoint_id), punch=punch, quic=quic)
    tb = QuicTransport(B, cfg, relay=hub.attach(B.endpoint_id), punch=punch, quic=quic)
    async with closing(ta, tb):
        ca = await bounded(ta.connect(B.endpoint_id, None), "connect")
        cb = await bounded(tb.accept(), "accept")
        assert isinstance(ca, QuicConnection) and isinstance(cb, QuicConnection)
        yield ta, tb, ca, cb


class UdpBlock:
    """Drops every datagram a UDP socket sends (a router that blocks UDP)."""

    def __init__(self, transport: QuicTransport) -> None:
        self.sock = transport._punch_sock
        assert self.sock is not None
        self.real = self.sock.send
        self.dropped = 0

    def __enter__(self) -> UdpBlock:
        def drop(data: bytes, addr: tuple[str, int]) -> None:
            self.dropped += 1

        self.sock.send = drop  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.send = self.real  # type: ignore[method-assign]


async def test_a_path_that_drops_full_size_datagrams_never_becomes_the_direct_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A path whose MTU is below QUIC's datagram size (a VPN: here every UDP datagram over
    1400 bytes is dropped, with QUIC sending 1452-byte ones): small PINGs used to validate
    it, and then every full-size packet was lost and the connection died of silence.
    PINGs are padded to the datagram size, so it never validates and the data flows
    through the relay."""
    real_send = UdpSocket.send
    dropped = 0

    def small_only(self: UdpSocket, data: bytes, addr: tuple[str, int]) -> None:
        nonlocal dropped
        if len(data) > 1400:
            dropped += 1
            return
        real_send(self, data, addr)

    monkeypatch.setattr(UdpSocket, "send", small_only)
    async with relayed_pair(quic=QuicConfig(loopback_datagram=1452)) as (ta, _tb, ca, cb):
        payload = os.urandom(1 << 20)
        await ca.send(5, payload)
        got = await bounded(cb.recv(5), "1 MiB through the relay")
        assert bytes(got.payload) == payload
        await asyncio.sleep(3 * FAST_PUNCH.probe_interval_max)  # rounds of padded PINGs
        assert dropped > 0  # they were sent, and lost
        assert ca.path_kind == cb.path_kind == "relay"
        assert ta.paths()[B.endpoint_id].kind == "relay"


async def test_a_path_change_starts_congestion_control_afresh_for_the_new_path() -> None:
    """RFC 9000 section 9.4: the relay path's window counted in 16 KiB datagrams; on a
    1452-byte direct path it must count in 1452-byte ones (it grew 11 times too fast)."""
    async with relayed_pair(quic=QuicConfig(loopback_datagram=1452)) as (_ta, _tb, ca, cb):
        await ca.send(1, os.urandom(1 << 20))  # some traffic through the relay first
        await bounded(cb.recv(1), "through the relay")
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct paths")
        for conn in (ca, cb):
            loss = conn._quic._loss
            assert loss._cc._max_datagram_size == loss._pacer._max_datagram_size == 1452
        payload = os.urandom(1 << 20)
        await ca.send(2, payload)
        assert bytes((await bounded(cb.recv(2), "direct")).payload) == payload


async def test_relayed_connection_moves_to_direct_and_reports_its_paths() -> None:
    async with relayed_pair() as (ta, _tb, ca, cb):
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct paths")
        payload = np.random.default_rng(1).bytes(3 << 20)
        await ca.send(5, payload)
        got = await bounded(cb.recv(5), "the payload")
        assert bytes(got.payload) == payload
        info = ta.paths()[B.endpoint_id]
        assert info.kind == "direct" and info.transport == "quic"
        assert info.remote.startswith("127.0.0.1:") and info.punching == "direct"
        assert info.rtt is not None and info.rtt > 0 and info.changes == 1
        by_kind = {s.kind: s for s in info.paths}
        assert by_kind["direct"].active and not by_kind["relay"].active
        assert by_kind["direct"].bytes_sent > len(payload)  # the payload went direct
        assert by_kind["relay"].bytes_sent < 100_000  # the relay carried the handshake only
        assert by_kind["direct"].rtt is not None
        # Loopback stays on Reno ("auto"), and nothing reorders there.
        assert info.loss is not None and info.loss.congestion_control == "reno"
        assert not info.loss.reordering and info.loss.spurious_losses == 0


LONG_IDLE = TransportConfig(keepalive_interval=0.2, idle_timeout=30.0)
"""An idle timeout past every fallback: a loss can only come from what a test does."""


async def test_a_close_just_after_the_direct_path_died_still_delivers() -> None:
    """The direct path dies unnoticed (UDP dropped, the relay up), then the sender sends
    and closes: the close gave up after 2 s (FLUSH_STALL), before hole punching fell back
    to the relay (path_timeout, 5 s), and aborted on the dead path, so the message was
    lost and the peer learned of the close 30 s later, by its keepalive (an audit). A
    close on a direct path now waits for that fallback, and its closing datagrams go
    through the relay too."""
    punch = replace(FAST_PUNCH, path_timeout=3.0, keepalive=0.5)  # falls back after 2-3.5 s
    async with relayed_pair(punch, cfg=LONG_IDLE) as (ta, tb, ca, cb):
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct paths")
        payload = os.urandom(1 << 20)
        with UdpBlock(ta), UdpBlock(tb):
            await ca.send(7, payload)
            await bounded(ca.close(), "the close", 20)
            got = await asyncio.wait_for(cb.recv(7), 10)  # long before the idle timeout
        assert bytes(got.payload) == payload
        assert ca.path_kind == "relay"


class DistantRelayHub(FakeRelayHub):
    """A relay 150 ms away each way (a relay in another region)."""

    def forward(self, src: Any, dst: Any, datagram: bytes) -> None:
        asyncio.get_running_loop().call_later(0.15, FakeRelayHub.forward, self, src, dst, datagram)


async def test_a_close_whose_path_fell_back_while_it_waited_still_delivers() -> None:
    """The direct path dies unnoticed, the sender sends and closes 1.2 s later, and the
    route falls back to the relay (at about 3 s) just before the close's stall check (2 s
    after it began): the relay was up, but the resent bytes had not been acked through
    it yet, so the close gave up ("closed with 262368 bytes undelivered") and the message
    was lost (an audit). A close that stalls just after a fallback waits as one on a
    direct path does."""
    punch = replace(FAST_PUNCH, path_timeout=3.0, keepalive=0.5)
    async with relayed_pair(punch, cfg=LONG_IDLE, hub=DistantRelayHub()) as (ta, tb, ca, cb):
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct paths")
        await asyncio.sleep(1.0)
        payload = os.urandom(256 << 10)
        with UdpBlock(ta), UdpBlock(tb):
            await asyncio.sleep(1.2)
            await ca.send(7, payload)
            await bounded(ca.close(), "the close", 20)
            got = await asyncio.wait_for(cb.recv(7), 10)
        assert bytes(got.payload) == payload
        assert ca.path_kind == "relay"
        # And directly: a stall just after the fallback gets the fallback's time.
        ca._fell_back_at = asyncio.get_running_loop().time() - 1.0
        assert ca._flush_stalled() == punch.path_timeout + punch.keepalive
        ca._fell_back_at = asyncio.get_running_loop().time() - 60.0
        assert ca._flush_stalled() == 0.0


async def test_only_a_fall_back_from_a_direct_path_counts_as_one_for_the_close() -> None:
    """A relayed connection whose datagrams shrink (a new relay session) changes its
    path too, but falls back from nothing: its close must not wait as after a fallback.
    A direct path that dies does count."""
    async with relayed_pair(PunchConfig(enabled=False)) as (ta, _tb, ca, _cb):
        assert ca.path_kind == "relay"
        ta._on_relay_datagram_size(1200)  # smaller than what the route builds now
        assert ca.route.relay_datagram == 1200  # type: ignore[union-attr]  # it resized
        assert ca._fell_back_at == -math.inf
    async with relayed_pair() as (ta, _tb, ca, _cb):
        await wait_until(lambda: ca.path_kind == "direct", "a direct path")
        ta._on_relay_datagram_size(1300)
        assert ca._fell_back_at == -math.inf
        ta._path_change(B.endpoint_id, None, None, "dead")
        assert ca.path_kind == "relay" and ca._fell_back_at > -math.inf
        fell_back_at = ca._fell_back_at
        await asyncio.sleep(0.01)
        ta._on_relay_datagram_size(1200)  # now on the relay: a resize moves no fallback
        assert ca.route.relay_datagram == 1200  # type: ignore[union-attr]
        assert ca._fell_back_at == fell_back_at


async def test_a_close_on_a_working_direct_path_does_not_wait_for_a_fallback() -> None:
    """The peer stops reading (its mailbox full) on a working direct path: its datagrams
    still come that way, so the close gives up after 2 s as before, not after the
    fallback's 6.5 s more (a reviewer: the first version waited for it whenever a flush
    stalled)."""
    punch = replace(FAST_PUNCH, path_timeout=5.0, keepalive=1.5)  # the defaults' fallback
    async with relayed_pair(punch, cfg=LONG_IDLE) as (_ta, _tb, ca, cb):
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct paths")
        cb._set_reading(False)  # it takes nothing more
        sending = asyncio.create_task(ca.send(7, bytes(96 << 20)))
        await asyncio.sleep(0.5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await bounded(ca.close(), "the close", 30)
        assert loop.time() - start < 5.0  # 2 s and a loaded host's slack; not 8.5 s
        assert ca.path_kind == "direct"
        sending.cancel()
        with contextlib.suppress(BaseException):
            await sending


def test_a_relayed_close_goes_both_ways_while_direct() -> None:
    """A closing connection's datagrams go direct and through the relay: the direct
    path may be dead, and the peer must learn of the close now, not at its timeout."""
    relay = FakeRelayHub().attach(A.endpoint_id)
    route = RelayRoute(relay, B.endpoint_id, 1200)
    sent: list[bytes] = []
    sock = types.SimpleNamespace(closed=False, send=lambda data, addr: sent.append(data))
    route.use_direct(sock, ("127.0.0.1", 9), 1200)  # type: ignore[arg-type]
    relayed: list[bytes] = []
    relay.send = lambda peer, data: relayed.append(data)  # type: ignore[method-assign]
    route.send(b"data", None)
    assert (sent, relayed) == ([b"data"], [])
    route.also_relay = True
    route.send(b"close", None)
    assert (sent, relayed) == ([b"data", b"close"], [b"close"])


async def test_direct_path_dies_traffic_returns_to_the_relay_then_punches_again() -> None:
    async with relayed_pair() as (ta, tb, ca, cb):
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct paths")
        payload = np.random.default_rng(2).bytes(8 << 20)
        with UdpBlock(ta) as block_a, UdpBlock(tb) as block_b:
            send = asyncio.create_task(ca.send(7, payload))  # in flight as the path dies
            got = await bounded(cb.recv(7), "the payload, via the relay")
            await bounded(send, "send")
            assert bytes(got.payload) == payload
            assert ca.path_kind == cb.path_kind == "relay"
            assert block_a.dropped and block_b.dropped
            info = ta.paths()[B.endpoint_id]
            assert info.kind == "relay" and info.punching in ("backoff", "punching")
            assert info.last_failure is not None and "silent" in info.last_failure
            assert info.loss is not None and info.loss.packets_lost > 0  # on the dead path
        # the network heals: the next round finds the direct path again
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct again")
        await ca.send(8, b"after")
        assert bytes((await bounded(cb.recv(8), "after")).payload) == b"after"
        assert ta.paths()[B.endpoint_id].changes == 3


async def test_forged_or_foreign_probes_never_make_a_path() -> None:
    hub = FakeRelayHub()
    punch = replace_punch(punch_timeout=0.5, retry_after=60.0)
    ta = QuicTransport(A, transport_config(), relay=hub.attach(A.endpoint_id), punch=punch)
    # B never punches (it has no UDP socket at all), so A can only stay on the relay
    off = PunchConfig(enabled=False)
    tb = QuicTransport(B, transport_config(), relay=hub.attach(B.endpoint_id), punch=off)
    async with closing(ta, tb):
        ca = await bounded(ta.connect(B.endpoint_id, None), "connect")
        await bounded(tb.accept(), "accept")
        await wait_until(lambda: ta._punch_sock is not None, "A's punching socket")
        sock_a = ta._punch_sock
        assert sock_a is not None and ta._puncher is not None
        puncher = ta._puncher
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            raw.bind(("127.0.0.1", 0))
            txid = bytes(12)
            ss = {"to_session": SA, "from_session": SB}
            forged = bytearray(encode_ping(B, A.endpoint_id, txid, **ss))
            forged[-1] ^= 1  # claims to be B, bad signature
            raw.sendto(bytes(forged), sock_a.local_address)
            raw.sendto(encode_ping(C, A.endpoint_id, txid, **ss), sock_a.local_address)  # stranger
            raw.sendto(encode_ping(B, C.endpoint_id, txid, **ss), sock_a.local_address)  # for C
            old_session = {"to_session": bytes(16), "from_session": SB}  # signed, but stale
            raw.sendto(encode_ping(B, A.endpoint_id, txid, **old_session), sock_a.local_address)
            await wait_until(lambda: puncher.bad_probes >= 4, "four refused probes")
            state = puncher.state(B.endpoint_id)
            assert state is not None and not state.accepts(raw.getsockname())
            assert state.stale_probes == 1  # counted once, before it reached the session
        await wait_until(lambda: state.phase is Phase.BACKOFF, "the round to give up")
        assert ca.path_kind == "relay" and state.last_failure is not None
        assert ta.paths()[B.endpoint_id].punching == "backoff"


def replace_punch(**kw: float) -> PunchConfig:
    from dataclasses import replace

    return replace(FAST_PUNCH, **kw)


async def test_punching_off_keeps_the_relay() -> None:
    async with relayed_pair(PunchConfig(enabled=False)) as (ta, _tb, ca, cb):
        await asyncio.sleep(0.3)
        assert ca.path_kind == cb.path_kind == "relay"
        assert ta._punch_sock is None and ta.paths()[B.endpoint_id].punching == "off"


# ---- a group through a real relay process --------------------------------------------------


async def test_group_through_a_real_relay_goes_direct_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="p2pdist.transport.holepunch")
    cfg = GroupConfig(timeout=30.0, connect_timeout=30.0, punch=FAST_PUNCH)
    with RelayProcess(tmp_path) as relay:
        gs = [Group.from_seed(SEED, rank=r, world=3, relay=relay.url, config=cfg) for r in range(3)]
        await asyncio.gather(*(g.start() for g in gs))
        try:

            def all_direct() -> bool:
                return all(i.kind == "direct" for g in gs for i in g.paths().values())

            await wait_until(all_direct, "every pair on a direct path")
            xs = [np.random.default_rng(r).standard_normal(300_000) for r in range(3)]
            outs = await asyncio.gather(*(g.all_reduce(xs[g.rank]) for g in gs))
            np.testing.assert_allclose(outs[1], np.sum(xs, axis=0), rtol=1e-9, atol=1e-12)
            assert len({o.tobytes() for o in outs}) == 1
            paths = gs[0].paths()
            assert sorted(paths) == [1, 2]
            for info in paths.values():
                assert info.remote.startswith("127.0.0.1:") and info.rtt is not None
                assert [s.kind for s in info.paths if s.active] == ["direct"]
            # the ring's bytes went over the direct paths (the relay carried handshakes)
            sent = {s.kind: 0 for s in paths[1].paths}
            for info in paths.values():
                for s in info.paths:
                    sent[s.kind] += s.bytes_sent
            assert sent["direct"] > 2_000_000 and sent["relay"] < 200_000
        finally:
            await asyncio.gather(*(g.close() for g in gs))
    changes = [r.getMessage() for r in caplog.records if "path relay -> direct" in r.message]
    assert len(changes) == 6  # one line per rank and peer


async def test_tcp_group_paths_are_direct_tcp() -> None:
    from group_helpers import groups

    async with groups(2) as gs:
        await asyncio.gather(*(g.all_reduce(np.ones(10)) for g in gs))
        info = gs[0].paths()[1]
        assert info.kind == "direct" and info.transport == "tcp"
        assert info.remote.startswith("127.0.0.1:") and info.paths[0].bytes_sent > 0


async def test_doctor_on_loopback_sees_udp_and_a_direct_path_to_a_peer(tmp_path: Path) -> None:
    from p2pdist.doctor import diagnose, render, serve

    with RelayProcess(tmp_path) as relay:
        ready = asyncio.Event()
        server = asyncio.create_task(serve(relay.url, key=B, ready=ready))
        try:
            await bounded(ready.wait(), "the doctor server")
            report = await diagnose(relay.url, key=A, peer=B.endpoint_id, timeout=5.0)
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
    assert report.relay_connected and report.relay_rtt is not None
    assert report.relay_records == "aes-256-gcm" and report.relay_framing == "raw"
    assert "connected (TLS, then aes-256-gcm records)" in render(report)
    assert report.udp and report.mapping == "none (public address)"  # loopback: no NAT
    assert len(report.observed) == 2 and report.observed[0] == report.local
    peer = report.peer
    assert peer is not None and peer.connected and peer.direct and peer.error is None
    assert peer.direct_after is not None and peer.transfer_mb_s is not None
    assert peer.loss is not None and peer.loss.congestion_control == "reno"  # loopback
    assert not peer.loss.reordering
    # timed from the dial (a relayed QUIC handshake), not from when connect() returned,
    # when the path was often direct already (it read a few microseconds)
    assert peer.direct_after > 0.001
    text = render(report)
    assert "NAT mapping  none (public address)" in text and "direct path after" in text
    assert "MB/s (reno, " in text


async def test_doctor_serving_with_json_prints_its_id_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``p2pdist doctor --serve --json`` printed the plain line, ignoring --json."""
    from p2pdist.doctor import serve

    with RelayProcess(tmp_path) as relay:
        ready = asyncio.Event()
        server = asyncio.create_task(serve(relay.url, key=B, ready=ready, as_json=True))
        try:
            await bounded(ready.wait(), "the doctor server")
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
    assert json.loads(capsys.readouterr().out) == {"serving": str(B.endpoint_id)}


async def test_doctor_on_a_relay_without_observation_does_not_blame_udp(tmp_path: Path) -> None:
    """A relay run with --stun-port 0 advertises no observation port: the client probed
    the relay's TCP port number over UDP instead, and the doctor reported UDP blocked."""
    from p2pdist.doctor import diagnose, render

    with RelayProcess(tmp_path, "--stun-port", "0") as relay:
        report = await diagnose(relay.url, key=A, timeout=5.0)
    assert report.relay_connected and report.observation_off and not report.observed
    text = render(report)
    assert "BLOCKED" not in text and "address observation off" in text
    assert "UDP is blocked" not in report.verdict()


def test_doctor_says_a_refusal_once(tmp_path: Path) -> None:
    """`p2pdist doctor` against a relay that refuses us: the reason came twice, as the
    library's warning on stderr and in the report; now in the report alone."""
    import subprocess
    import sys

    with RelayProcess(tmp_path, "--stun-port", "0", "--token", "right") as relay:
        proc = subprocess.run(
            [sys.executable, "-m", "p2pdist.cli", "doctor", "--relay", relay.url,
             "--token", "wrong", "--timeout", "5"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert proc.returncode == 1
    assert (proc.stdout + proc.stderr).count("bad token") == 1, proc.stdout + proc.stderr


async def test_doctor_against_a_relay_that_stops_answering_does_not_blame_udp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session comes up, then the relay answers no PING: the report said
    "connected", UDP "BLOCKED" (never tested), and exit 0 (an audit). It now says the
    relay stopped answering, and main() exits 1."""
    from p2pdist.doctor import diagnose, main, render
    from p2pdist.errors import P2PTimeoutError
    from p2pdist.transport.relay_path import RelayPath

    async def no_pong(self: RelayPath, timeout: float = 5.0) -> float:
        raise P2PTimeoutError(f"relay {self.url}: no PONG within {timeout:g} s")

    monkeypatch.setattr(RelayPath, "ping", no_pong)
    with RelayProcess(tmp_path) as relay:
        report = await diagnose(relay.url, key=A, timeout=2.0)
        assert report.relay_reached and not report.relay_connected
        assert report.relay_error == "no PONG within 2 s"
        text = render(report)
        assert "UDP is blocked" not in text and "BLOCKED" not in text
        assert "STOPPED ANSWERING (no PONG within 2 s)" in text
        assert "stopped answering once its session was up" in report.verdict()
        library = logging.getLogger("p2pdist")
        level = library.level
        try:  # (main() quiets the library's own logging, for its process's lifetime)
            rc = await asyncio.to_thread(main, ["--relay", relay.url, "--timeout", "2"])
        finally:
            library.setLevel(level)
    assert rc == 1


async def test_doctor_names_an_unreachable_relay() -> None:
    from p2pdist.doctor import diagnose, render

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"https://127.0.0.1:{port}/?pin={C.endpoint_id}"
    report = await diagnose(url, timeout=1.0)
    assert not report.relay_connected and report.relay_error
    assert "cannot reach the relay" in render(report)
    assert render(report).count(url) == 1  # the relay is named once


async def test_a_peer_that_restarts_with_the_same_key_is_not_sent_to_its_old_address() -> None:
    hub = FakeRelayHub()
    cfg = replace(transport_config(), idle_timeout=10.0)  # outlasts the path_timeout
    punch = replace_punch(keepalive=1.0, path_timeout=5.0)  # a dead path would take 5 s
    ta = QuicTransport(A, cfg, relay=hub.attach(A.endpoint_id), punch=punch)
    tb = QuicTransport(B, cfg, relay=hub.attach(B.endpoint_id), punch=punch)
    tb2 = None
    try:
        old_b = await bounded(tb.connect(A.endpoint_id, None), "connect")
        old_a = await bounded(ta.accept(), "accept")
        await wait_until(lambda: old_a.path_kind == old_b.path_kind == "direct", "direct")
        # B crashes: its socket and relay session vanish without a goodbye ...
        hub.detach(B.endpoint_id)
        assert tb._punch_sock is not None
        tb._punch_sock.close()
        # ... and comes back at once, same key, new socket: A still has the old path
        tb2 = QuicTransport(B, cfg, relay=hub.attach(B.endpoint_id), punch=punch)
        new_b = await bounded(tb2.connect(A.endpoint_id, None), "reconnect", 3.0)
        new_a = await bounded(ta.accept(), "accept again", 3.0)
        await new_b.send(3, b"hello again")
        got = await bounded(new_a.recv(3), "a message on the new connection", 2.0)
        assert bytes(got.payload) == b"hello again"
        await wait_until(lambda: new_a.path_kind == new_b.path_kind == "direct", "direct")
        assert new_a.remote_address == new_b.route.direct[0].local_address  # type: ignore[union-attr]
    finally:
        for t in (ta, tb, tb2):
            if t is not None:
                await t.close()


def test_mapping_behaviour_reads_the_nat_type_off_the_answers() -> None:
    from p2pdist.transport.observe import mapping_behaviour

    a, b = ("203.0.113.10", 1000), ("203.0.113.10", 1001)
    assert mapping_behaviour([a, a]) == "endpoint-independent"
    assert mapping_behaviour([a, b]) == "endpoint-dependent"
    assert mapping_behaviour([None, None]) == "no UDP"
    assert mapping_behaviour([a, None]) == "unknown"  # one answer tells nothing
    assert mapping_behaviour([]) == "unknown"  # a relay without observation ports
    assert mapping_behaviour([a, a], own={a, b}) == "none (public address)"
    assert mapping_behaviour([a, a], own={b}) == "endpoint-independent"


async def test_stun_probe_resends_only_while_an_answer_can_still_count() -> None:
    from p2pdist.transport.observe import FIRST_RETRY, StunProbe

    targets = [("192.0.2.1", 3478), ("192.0.2.1", 3479)]
    probe = StunProbe(targets)
    loop = asyncio.get_running_loop()
    sent: list[tuple[float, tuple[str, int]]] = []
    timeout = 2.5 * FIRST_RETRY  # room for the first request and one resend
    deadline = loop.time() + timeout
    answers = await bounded(
        probe.run(lambda data, addr: sent.append((loop.time(), addr)), timeout), "probe"
    )
    assert answers == [None, None]
    # (the probe takes its deadline a moment after ours: 1 ms of slack)
    assert all(t < deadline + 1e-3 for t, _ in sent), "a request went out after the deadline"
    assert 1 <= len(sent) // len(targets) <= 2 and len(sent) % len(targets) == 0
    assert {addr for _, addr in sent} == set(targets)


async def test_stun_probe_gives_ipv6_a_grace_once_ipv4_is_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay whose name has an IPv6 address its observation ports do not answer on:
    once the IPv4 ports answered, IPv6 gets FAMILY_GRACE, not the whole timeout (which
    would hold up every observation); an answer within the grace still counts. IPv4,
    the mapping most peers need, is never cut short because IPv6 was quicker."""
    from p2pdist.transport import observe
    from p2pdist.transport.observe import FAMILY_GRACE, StunProbe
    from p2pdist.wire.stun import binding_response

    targets = [("192.0.2.1", 3478), ("192.0.2.1", 3479), ("2001:db8::1", 3478)]
    loop = asyncio.get_running_loop()

    def answering(
        probe: StunProbe, v4_after: float, v6_after: float | None
    ) -> Callable[[bytes, Any], None]:
        def send(data: bytes, addr: tuple[str, int]) -> None:
            reply = binding_response(bytes(data[8:20]), "198.51.100.7", 4000)
            after = v6_after if ":" in addr[0] else v4_after
            if after is not None:
                loop.call_later(after, probe.on_datagram, reply)

        return send

    probe = StunProbe(targets)
    start = loop.time()
    answers = await bounded(probe.run(answering(probe, 0.0, None), 10.0), "probe")
    took = loop.time() - start
    assert answers[:2] == [("198.51.100.7", 4000)] * 2 and answers[2] is None
    # Far below the whole 10 s timeout (what it waited before), whatever a loaded
    # machine's stalls add to the grace.
    assert FAMILY_GRACE * 0.9 <= took < 5.0, took

    # An IPv6 answer 0.1 s in is taken as it comes, not at the grace's end (a longer
    # grace here, so that a stall cannot pass for waiting it out).
    monkeypatch.setattr(observe, "FAMILY_GRACE", 3.0)
    probe = StunProbe(targets)
    start = loop.time()
    answers = await bounded(probe.run(answering(probe, 0.0, 0.1), 10.0), "probe")
    assert all(a == ("198.51.100.7", 4000) for a in answers)
    assert loop.time() - start < 3.0

    # A relay with IPv6 lookup addresses only: an answer ends the probe as it comes (it
    # waited for the next resend, 0.1, 0.3 or 0.7 s in, since no IPv4 answer would come
    # to wake it: an audit). A long first resend, so that a stall cannot pass for it.
    monkeypatch.setattr(observe, "FIRST_RETRY", 5.0)
    probe = StunProbe(targets[2:])
    start = loop.time()
    answers = await bounded(probe.run(answering(probe, 0.0, 0.05), 10.0), "probe")
    assert answers == [("198.51.100.7", 4000)]
    assert loop.time() - start < 3.0
    monkeypatch.undo()

    probe = StunProbe(targets)  # IPv6 at once, IPv4 slower than the grace: still waited for
    answers = await bounded(probe.run(answering(probe, FAMILY_GRACE + 0.1, 0.0), 10.0), "probe")
    assert all(a == ("198.51.100.7", 4000) for a in answers)


async def test_quic_dialed_at_an_address_reports_one_direct_path() -> None:
    ta, tb = QuicTransport(A, transport_config()), QuicTransport(B, transport_config())
    async with closing(ta, tb):
        addr = await tb.listen("127.0.0.1", 0)
        ca = await bounded(ta.connect(B.endpoint_id, addr), "connect")
        await bounded(tb.accept(), "accept")
        await ca.send(1, b"x" * 1000)
        info = ta.paths()[B.endpoint_id]
        want = ("direct", "quic", f"127.0.0.1:{addr[1]}")
        assert (info.kind, info.transport, info.remote) == want
        assert info.punching == "off" and len(info.paths) == 1
        assert info.paths[0].active and info.paths[0].bytes_sent > 1000


# ---- where the punching socket binds (resolution is patched: no network is touched) ----------


def fake_resolution(monkeypatch: pytest.MonkeyPatch, answers: dict[str, str | None]) -> list[str]:
    """Resolve each host in ``answers`` to its addresses (comma-separated, IPv4 or IPv6;
    None: it does not resolve); other hosts as usual. Every UdpSocket.open in the
    transport binds 127.0.0.1 whatever it asked for; returns the hosts it asked for."""
    loop = asyncio.get_running_loop()
    real_resolve = loop.getaddrinfo

    async def resolve(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host in answers:
            ips = answers[host]
            if ips is None:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [
                (
                    socket.AF_INET6 if ":" in ip else socket.AF_INET,
                    socket.SOCK_DGRAM,
                    17,
                    "",
                    (ip, port or 0, 0, 0) if ":" in ip else (ip, port or 0),
                )
                for ip in ips.split(",")
            ]
        return await real_resolve(host, port, *args, **kw)

    monkeypatch.setattr(loop, "getaddrinfo", resolve)
    asked: list[str] = []
    real_open = quic_module.UdpSocket.open

    async def open_loopback(host: str, port: int, on_datagram: Any) -> Any:
        asked.append(host)
        return await real_open("127.0.0.1", port, on_datagram)

    monkeypatch.setattr(quic_module.UdpSocket, "open", open_loopback)
    return asked


def relay_at(host: str) -> RelayPath:
    """A RelayPath to ``host`` that is never started."""
    return RelayPath(A, f"https://{host}:443/?pin={C.endpoint_id}")


async def test_punch_socket_for_a_relay_without_ipv4_binds_every_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay's name has only an IPv6 address: its observation ports are asked there,
    and the punching socket binds every interface (it used to bind 127.0.0.1, and
    announce loopback candidates no remote peer could ever reach)."""
    asked = fake_resolution(monkeypatch, {"relay6.example": "2001:db8::1"})
    t = QuicTransport(A, transport_config(), relay=relay_at("relay6.example"))
    async with closing(t):
        assert await relay_at("relay6.example").observation_targets() == [("2001:db8::1", 443)]
        await t._open_punch_socket()
        # dual-stack first (IPv6 too); the fake socket on 127.0.0.1 is not, so 0.0.0.0
        assert asked == (["::", "0.0.0.0"] if socket.has_ipv6 else ["0.0.0.0"])


async def test_observation_targets_are_the_first_address_of_each_family(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_resolution(
        monkeypatch,
        {
            "both.example": "2001:db8::1,192.0.2.1,192.0.2.2,2001:db8::2",
            "mapped.example": "::ffff:192.0.2.7",
            "gone.example": None,
        },
    )
    both = relay_at("both.example")
    both._status = replace(both.status, stun_ports=(3478, 3479))
    assert await both.observation_targets() == [
        ("192.0.2.1", 3478),
        ("192.0.2.1", 3479),
        ("2001:db8::1", 3478),
        ("2001:db8::1", 3479),
    ]
    assert await relay_at("mapped.example").observation_targets() == [("192.0.2.7", 443)]
    assert await relay_at("gone.example").observation_targets() == []


def test_a_socket_for_observation_binds_loopback_only_for_a_loopback_relay() -> None:
    assert bind_host_for([]) is None  # None: every interface, dual-stack where possible
    assert bind_host_for([("127.0.0.1", 3478)]) == "127.0.0.1"
    assert bind_host_for([("::1", 3478)]) == "::1"
    assert bind_host_for([("127.0.0.1", 3478), ("::1", 3478)]) == "127.0.0.1"
    assert bind_host_for([("127.0.0.1", 3478), ("192.0.2.1", 3478)]) is None
    assert bind_host_for([("::1", 3478), ("2001:db8::1", 3478)]) is None


async def test_a_relay_on_loopback_still_punches_on_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = fake_resolution(monkeypatch, {"localhost": "127.0.0.1"})
    t = QuicTransport(A, transport_config(), relay=relay_at("localhost"))
    async with closing(t):
        await t._open_punch_socket()
        assert asked == ["127.0.0.1"]


async def test_a_loopback_listener_does_not_punch_towards_a_remote_relay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Listening on 127.0.0.1 with a relay elsewhere: its socket cannot punch, so punching
    is off (said why), instead of announcing 127.0.0.1 candidates that never work."""
    fake_resolution(monkeypatch, {"relay.example": "192.0.2.7"})
    t = QuicTransport(A, transport_config(), relay=relay_at("relay.example"))
    async with closing(t):
        await t.listen("127.0.0.1", 0)
        with pytest.raises(holepunch_module.PunchingUnavailable, match=r"bound to 127\.0\.0\.1"):
            await t._open_punch_socket()


async def test_punching_turns_off_once_when_no_socket_can_punch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """open_socket says no socket can punch: every peer stays on the relay, nothing is sent
    for punching, and the reason is logged once (not once per peer or per round)."""
    caplog.set_level(logging.WARNING, logger="p2pdist.transport.holepunch")
    hub = FakeRelayHub()
    relay = hub.attach(A.endpoint_id)
    opened = 0

    async def no_socket() -> Any:
        nonlocal opened
        opened += 1
        raise holepunch_module.PunchingUnavailable("the listening socket is bound to 127.0.0.1")

    async def no_targets() -> list[tuple[str, int]]:
        return []

    puncher = holepunch_module.HolePuncher(
        A,
        relay,
        FAST_PUNCH,
        open_socket=no_socket,
        stun_targets=no_targets,
        on_change=lambda *a: pytest.fail("no path may change"),
        label_for=lambda p: p.short(),
    )
    try:
        puncher.watch(B.endpoint_id)
        puncher.watch(C.endpoint_id)
        await wait_until(lambda: puncher.off is not None, "punching to turn off")
        await asyncio.sleep(0.2)  # a few probe intervals: nothing more may happen
        puncher.watch(B.endpoint_id)
        assert puncher.state(B.endpoint_id) is None and puncher.state(C.endpoint_id) is None
        assert relay.sent == 0 and opened <= 2
        off = [r for r in caplog.records if "hole punching is off" in r.getMessage()]
        assert len(off) == 1 and "127.0.0.1" in off[0].getMessage()
    finally:
        await puncher.close()


def _unbound_puncher(
    host: str = "0.0.0.0", dual_stack: bool = False
) -> holepunch_module.HolePuncher:
    """A puncher whose socket is bound to every interface (as far as candidates() can
    tell: ``host``, dual-stack or not) and whose relay has one observation port,
    198.51.100.1:3478."""

    class Unbound:
        local_address = (host, 40001)
        closed = False

    Unbound.dual_stack = dual_stack  # type: ignore[attr-defined]

    async def open_socket() -> Any:
        return Unbound()

    async def targets() -> list[tuple[str, int]]:
        return [("198.51.100.1", 3478)]

    return holepunch_module.HolePuncher(
        A,
        FakeRelayHub().attach(A.endpoint_id),
        FAST_PUNCH,
        open_socket=open_socket,
        stun_targets=targets,
        on_change=lambda *a: None,
        label_for=lambda p: p.short(),
    )


@pytest.mark.parametrize("dual_stack", [True, False])
async def test_a_socket_on_every_ipv6_interface_offers_ipv6_candidates_before_ipv4(
    monkeypatch: pytest.MonkeyPatch, dual_stack: bool
) -> None:
    """Bound to ``::``: the IPv6 interface addresses come after the observed address
    and before the IPv4 ones (behind a NAT those only work on the same LAN); an
    IPv6-only socket offers no IPv4 address it could not reach."""
    monkeypatch.setattr(holepunch_module, "interface_addresses", lambda: ["10.0.0.2"])
    monkeypatch.setattr(holepunch_module, "interface_addresses6", lambda: ["2001:db8:a::2"])
    puncher = _unbound_puncher("::", dual_stack)
    try:
        seen = (("198.51.100.1", 3478), ("203.0.113.7", 40000))
        now = asyncio.get_running_loop().time()
        puncher._observation = holepunch_module.Observation((seen,), now)
        found = await puncher.candidates()
        v4 = [("10.0.0.2", 40001)] if dual_stack else []
        assert found == [("203.0.113.7", 40000), ("2001:db8:a::2", 40001), *v4]
    finally:
        await puncher.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
async def test_candidates_our_socket_cannot_send_to_are_not_probed(host: str) -> None:
    """An IPv4-only punching socket (a host without IPv6, or a listener on 0.0.0.0)
    keeps a peer's IPv6 candidates out of its state: every PING to them would fail,
    and they would use up the allowance for new candidates. A dual-stack one keeps all."""
    if host == "::" and not ipv6_loopback_works():
        pytest.skip("no IPv6 on this host")
    puncher = _unbound_puncher()
    sock = await UdpSocket.open(host, 0, lambda *a: None)
    try:
        puncher._sock = sock
        puncher._peers[B.endpoint_id] = holepunch_module._Peer(B.endpoint_id, PeerPaths(FAST_PUNCH))
        addrs = [("2001:db8:b::2", 4000), ("198.51.100.9", 4000)]
        puncher.on_relay_probe(
            B.endpoint_id,
            encode_candidates(B, A.endpoint_id, addrs, reply_wanted=False, session=SB),
        )
        paths = puncher.state(B.endpoint_id)
        assert paths is not None
        want = addrs if sock.dual_stack else addrs[1:]
        assert list(paths._candidates) == want
        assert puncher.bad_probes == 0
    finally:
        await puncher.close()
        sock.close()


@pytest.mark.parametrize("where", ["elsewhere", "socket on loopback", "relay on loopback"])
async def test_candidates_no_peer_can_be_at_are_not_probed(where: str) -> None:
    """A peer's candidates that are unspecified, multicast or broadcast, and loopback
    ones unless the peer is on this host (our socket is on loopback, or the relay saw it
    on loopback), are never PINGed: an authenticated peer could make us send probes to
    our own host's ports (0.0.0.0 and 127.0.0.1 reach this host) or to every host of our
    LAN (224.0.0.1), and only the address family was checked (an audit). IPv4
    link-local addresses are probed (two hosts cabled together without DHCP have
    nothing else: a review)."""
    puncher = _unbound_puncher()
    sock = await UdpSocket.open(
        "127.0.0.1" if where == "socket on loopback" else "0.0.0.0", 0, lambda *a: None
    )
    try:
        puncher._sock = sock
        if where == "relay on loopback":  # its observation port saw us at loopback
            now = asyncio.get_running_loop().time()
            seen = (("127.0.0.1", 3478), ("127.0.0.1", 40001))
            puncher._observation = holepunch_module.Observation((seen,), now)
        puncher._peers[B.endpoint_id] = holepunch_module._Peer(B.endpoint_id, PeerPaths(FAST_PUNCH))
        junk = ["0.0.0.0", "224.0.0.1", "255.255.255.255", "127.0.0.1"]
        addrs = [(h, 4000) for h in [*junk, "169.254.3.4", "198.51.100.9", "10.0.0.7"]]
        puncher.on_relay_probe(
            B.endpoint_id,
            encode_candidates(B, A.endpoint_id, addrs, reply_wanted=False, session=SB),
        )
        paths = puncher.state(B.endpoint_id)
        assert paths is not None
        kept = [("169.254.3.4", 4000), ("198.51.100.9", 4000), ("10.0.0.7", 4000)]
        if where != "elsewhere":  # a peer on this host, met through a relay on loopback
            kept = [("127.0.0.1", 4000), *kept]
        assert list(paths._candidates) == kept
    finally:
        await puncher.close()
        sock.close()


@pytest.mark.parametrize(
    ("host", "on_loopback", "probed"),
    [
        ("::", False, False),
        ("ff02::1", False, False),
        ("fe80::1", False, False),  # IPv6 link-local: needs the interface's scope
        ("169.254.3.4", False, True),  # IPv4 link-local: routed on its link
        ("::ffff:127.0.0.1", False, False),  # IPv4-mapped: judged as the IPv4 address
        ("::ffff:127.0.0.1", True, True),
        ("::1", True, True),
        ("2001:db8::5", False, True),
        ("::ffff:198.51.100.9", False, True),
        ("not an address", False, False),
    ],
)
def test_which_candidate_addresses_are_probed(host: str, on_loopback: bool, probed: bool) -> None:
    assert worth_probing(host, on_loopback) is probed


async def test_this_hosts_loopback_addresses_are_not_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loopback reaches this host only; 169.254/16 (an adapter without DHCP, avahi's)
    reaches its link, and is offered (listed last by interface_addresses())."""
    listed = ["10.0.0.2", "192.0.2.9", "127.0.0.1", "169.254.7.7"]
    monkeypatch.setattr(holepunch_module, "interface_addresses", lambda: listed)
    puncher = _unbound_puncher()
    try:
        puncher._observation = holepunch_module.Observation((), asyncio.get_running_loop().time())
        found = await puncher.candidates()
        assert found == [(h, 40001) for h in ("10.0.0.2", "192.0.2.9", "169.254.7.7")]
    finally:
        await puncher.close()


def test_ipv6_interface_addresses_are_the_usable_global_ones(tmp_path: Path) -> None:
    """/proc/net/if_inet6 rows: loopback, link-local, tentative, deprecated and failed
    addresses are left out; a temporary (privacy) address comes first."""
    rows = [
        ("00000000000000000000000000000001", "10", "80", "lo"),  # loopback (host scope)
        ("fe800000000000000000000000000001", "20", "80", "eth0"),  # link-local
        ("20010db8000a00000000000000000002", "00", "80", "eth0"),  # global, permanent
        ("20010db8000a00000000000000000003", "00", "40", "eth0"),  # tentative
        ("20010db8000a00000000000000000004", "00", "20", "eth0"),  # deprecated
        ("20010db8000a00000000000000000005", "00", "08", "eth0"),  # DAD failed
        ("20010db8000a000000000000000000aa", "00", "01", "eth0"),  # temporary
        ("fd000000000000000000000000000002", "00", "82", "eth1"),  # ULA, nodad
    ]
    table = tmp_path / "if_inet6"
    table.write_text("".join(f"{a} 02 40 {sc} {fl} {dev}\n" for a, sc, fl, dev in rows) + "bad\n")
    found = interfaces_module.interface_addresses6(str(table))
    assert found == ["2001:db8:a::aa", "2001:db8:a::2", "fd00::2"]
    assert interfaces_module.interface_addresses6(str(tmp_path / "none")) == []


async def test_a_dual_stack_socket_shows_ipv4_peers_by_their_plain_address() -> None:
    """``::`` binds one socket for both families: an IPv4 peer is ``127.0.0.1`` both
    ways (never ``::ffff:127.0.0.1``, which would not match its candidate), an IPv6 one
    ``::1``."""
    if not ipv6_loopback_works():
        pytest.skip("no IPv6 on this host")
    got: list[tuple[bytes, tuple[str, int]]] = []
    dual = await UdpSocket.open("::", 0, lambda s, d, a: got.append((d, a)))
    v4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    v6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        assert dual.dual_stack and dual.family == socket.AF_INET6
        port = dual.local_address[1]
        v4.bind(("127.0.0.1", 0))
        v6.bind(("::1", 0))
        v4.sendto(b"four", ("127.0.0.1", port))
        v6.sendto(b"six", ("::1", port))
        await wait_until(lambda: len(got) == 2, "both datagrams")
        assert sorted(got) == sorted(
            [(b"four", v4.getsockname()), (b"six", tuple(v6.getsockname()[:2]))]
        )
        dual.send(b"back", v4.getsockname())
        v4.settimeout(5.0)
        assert v4.recvfrom(100) == (b"back", ("127.0.0.1", port))
        dual.send(b"back six", ("::1", v6.getsockname()[1]))
        v6.settimeout(5.0)
        data, addr = v6.recvfrom(100)
        assert (data, addr[:2]) == (b"back six", ("::1", port))
    finally:
        dual.close()
        v4.close()
        v6.close()


async def test_every_interface_is_ipv4_where_the_host_has_no_ipv6(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel or container without IPv6: the dual-stack socket cannot be had, and
    ``open_any`` binds ``0.0.0.0`` instead (punching goes on over IPv4)."""
    real_open = UdpSocket.open.__func__  # type: ignore[attr-defined]
    asked: list[str] = []

    async def no_ipv6(cls: Any, host: str, port: int, on_datagram: Any) -> Any:
        asked.append(host)
        if ":" in host:
            raise OSError(97, "Address family not supported by protocol")
        return await real_open(cls, host, port, on_datagram)

    monkeypatch.setattr(UdpSocket, "open", classmethod(no_ipv6))
    monkeypatch.setattr(socket, "has_ipv6", True)
    sock = await UdpSocket.open_any(0, lambda *a: None)
    try:
        assert sock.local_address[0] == "0.0.0.0" and not sock.dual_stack
        assert asked == ["::", "0.0.0.0"]
    finally:
        sock.close()


async def test_observed_addresses_come_first_among_the_candidates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host with more interface addresses than MAX_CANDIDATES (Docker or Kubernetes
    bridges): the observed address, the only one that works across a NAT, is still sent
    (it came last and was cut off)."""
    many = [f"172.{17 + i}.0.1" for i in range(holepunch_module.MAX_CANDIDATES + 1)]
    monkeypatch.setattr(holepunch_module, "interface_addresses", lambda: many)

    puncher = _unbound_puncher()
    try:
        seen = (("198.51.100.1", 3478), ("203.0.113.7", 40000))
        now = asyncio.get_running_loop().time()
        puncher._observation = holepunch_module.Observation((seen,), now)
        found = await puncher.candidates()
        assert len(found) == holepunch_module.MAX_CANDIDATES
        assert found[0] == ("203.0.113.7", 40000)
        assert found[1] == ("172.17.0.1", 40001)
    finally:
        await puncher.close()


async def test_a_direct_path_that_dies_makes_the_next_round_observe_again() -> None:
    """A NAT that rebinds our port (a conntrack flush, a router reboot) kills the direct
    path; the retry rounds offered the cached observation, our old port, for up to a
    minute, and failed (the NAT lab took two minutes to get back to direct)."""

    puncher = _unbound_puncher()
    asked: list[float] = []

    async def observe_now() -> holepunch_module.Observation:
        now = asyncio.get_running_loop().time()
        asked.append(now)
        seen = (("198.51.100.1", 3478), ("203.0.113.7", 40000 + len(asked)))
        puncher._observation = holepunch_module.Observation((seen,), now)  # as _observe does
        return puncher._observation

    puncher._observe = observe_now  # type: ignore[method-assign]
    try:
        first = await puncher.observe()
        assert await puncher.observe() is first and len(asked) == 1  # cached
        old = ("203.0.113.7", 40001)
        peer = types.SimpleNamespace(peer=B.endpoint_id)
        puncher._change(peer, PathChange(old, None, "direct path silent for 5.0 s"))  # type: ignore[arg-type]
        again = await puncher.observe()
        assert again is not None and len(asked) == 2
        assert again.addresses == [("203.0.113.7", 40002)]
    finally:
        await puncher.close()


# ---- a direct path whose socket closed ---------------------------------------------------------


class CountingRelay:
    max_datagram = 16384

    def __init__(self) -> None:
        self.got = 0

    def send(self, dst: Any, datagram: bytes) -> None:
        self.got += 1


async def test_a_route_whose_direct_socket_closed_says_relay() -> None:
    """Datagrams fall back to the relay, and kind, remote, size and the per-path counters
    say so (they used to say direct, counting relayed datagrams under the ip:port)."""
    relay = CountingRelay()
    route = RelayRoute(relay, B.endpoint_id, 16384)  # type: ignore[arg-type]
    sock = await UdpSocket.open("127.0.0.1", 0, lambda *a: None)
    direct = ("127.0.0.1", 9)
    route.use_direct(sock, direct, 1452)
    assert (route.kind, route.remote, route.max_datagram) == ("direct", direct, 1452)
    sock.close()
    assert (route.kind, route.remote, route.max_datagram) == ("relay", B.endpoint_id, 16384)
    assert route.direct_addr is None
    for _ in range(3):
        route.send(b"x" * 100, None)
    assert relay.got == 3 and route.sent[None] == [3, 300] and route.sent[direct] == [0, 0]
    assert route.direct is None and route.changes == 2


async def test_per_path_counters_stay_bounded_on_a_long_relayed_connection() -> None:
    """A peer met at ever new addresses (a NAT that keeps rebinding) does not grow the
    route's counters: past MAX_PATH_COUNTERS the oldest are summed into ``earlier``."""
    route = RelayRoute(CountingRelay(), B.endpoint_id, 16384)  # type: ignore[arg-type]
    sock = await UdpSocket.open("127.0.0.1", 0, lambda *a: None)
    try:
        for port in range(1000, 1000 + 3 * MAX_PATH_COUNTERS):
            route.use_direct(sock, ("127.0.0.1", port), 1452)
            route.send(b"x" * 10, None)
            route.count_received(20, ("127.0.0.1", port))
        last = ("127.0.0.1", 999 + 3 * MAX_PATH_COUNTERS)
        assert len(route.sent) == MAX_PATH_COUNTERS + 1 and None in route.sent
        assert len(route.received) == MAX_PATH_COUNTERS  # none came by the relay
        assert route.sent[last] == [1, 10] and route.direct_addr == last  # the one in use
        forgotten = 2 * MAX_PATH_COUNTERS
        assert route.earlier == [forgotten, 10 * forgotten, forgotten, 20 * forgotten]
        total = sum(n for n, _ in route.sent.values()) + route.earlier[0]
        assert total == 3 * MAX_PATH_COUNTERS  # nothing lost from the totals
    finally:
        sock.close()


async def test_paths_say_relay_once_the_direct_socket_closed() -> None:
    async with relayed_pair() as (ta, _tb, ca, cb):
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct paths")
        assert ta._punch_sock is not None
        ta._punch_sock.close()
        info = ta.paths()[B.endpoint_id]
        assert info.kind == "relay" and info.remote.startswith("relay")
        assert ca.path_kind == "relay" and ca.remote_address == B.endpoint_id
        assert [s.kind for s in info.paths if s.active] == ["relay"]


async def test_a_connection_whose_direct_socket_closed_falls_back_as_from_a_dead_path() -> None:
    """The punching socket closes under a direct connection: its route sent through the
    relay, but QUIC went on building datagrams for the direct path under that path's
    congestion control, and a close did not wait as after a fallback (it was never
    stamped). The connection now falls back as when hole punching declares a path dead."""
    async with relayed_pair() as (ta, _tb, ca, cb):
        await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct paths")
        route = ca.route
        assert isinstance(route, RelayRoute) and ta._punch_sock is not None
        direct_controller = ca._quic._loss._cc
        ta._punch_sock.close()
        await ca.send(7, b"after the socket closed")
        got = await asyncio.wait_for(cb.recv(7), 10)
        assert bytes(got.payload) == b"after the socket closed"
        assert route.direct is None and ca._fell_back_at > -math.inf
        assert ca._quic._loss._cc is not direct_controller  # the relay's, afresh
        assert ca._quic._max_datagram_size == route.relay_datagram


async def test_peers_of_a_relay_on_ipv6_loopback_punch_from_ipv6_loopback() -> None:
    """A relay on [::1]: the punching socket was bound to 127.0.0.1 whatever the relay's
    family, so a peer listening on ::1 never went direct (each side dropped the other's
    candidates as unreachable: an audit). It binds ::1 there now."""
    if not ipv6_loopback_works():
        pytest.skip("no IPv6 on this host")
    from relay_helpers import running_relay

    cfg = TransportConfig(keepalive_interval=0.5, idle_timeout=10.0)
    async with running_relay(host="::1") as server:
        paths = [RelayPath(key, server.url) for key in (A, B)]
        try:
            await asyncio.gather(*(p.wait_connected(10) for p in paths))
            ta = QuicTransport(A, cfg, relay=paths[0], punch=FAST_PUNCH)
            tb = QuicTransport(B, cfg, relay=paths[1], punch=FAST_PUNCH)
            async with closing(ta, tb):
                await ta.listen("::1", 0)
                ca = await bounded(ta.connect(B.endpoint_id, None), "connect")
                cb = await bounded(tb.accept(), "accept")
                await wait_until(lambda: ca.path_kind == cb.path_kind == "direct", "direct")
                assert ":" in ca.remote_address[0] and ":" in cb.remote_address[0]  # type: ignore[index]
        finally:
            await asyncio.gather(*(p.close() for p in paths))


@pytest.mark.parametrize(
    ("ip", "port"), [("198.51.100.7", 0), ("0.0.0.0", 4000), ("224.0.0.1", 4000)]
)
def test_an_observation_answer_naming_an_impossible_address_is_no_answer(
    ip: str, port: int
) -> None:
    """An answer saying we are at port 0 (or at no address) was taken, and then every
    CANDIDATES message failed to encode until the observation expired (a minute): an
    audit. It is ignored; a real answer for the same target still counts."""
    from p2pdist.transport.observe import StunProbe
    from p2pdist.wire.stun import binding_response

    probe = StunProbe([("192.0.2.1", 3478)])
    (txid,) = probe._txids
    assert not probe.on_datagram(binding_response(txid, ip, port))
    assert probe.answers == [None]
    assert probe.on_datagram(binding_response(txid, "198.51.100.7", 4000))
    assert probe.answers == [("198.51.100.7", 4000)]
