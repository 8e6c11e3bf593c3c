"""The BBR congestion controller (p2pdist.transport.bbr), driven through real aioquic
connections (PinnedQuicConnection, as QuicTransport builds them) over a simulated path in
virtual time: a bottleneck of a given rate with a drop-tail queue, a propagation delay,
and random loss from a seeded generator. Every figure here is a property of the
controller on that model path (deterministic), not a timing of this machine."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from aioquic.quic.congestion.reno import RenoCongestionControl
from aioquic.quic.events import StreamDataReceived
from aioquic.quic.packet import QuicPacketType
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.tls import Epoch

from p2pdist.identity import SecretKey
from p2pdist.tls import make_certificate
from p2pdist.transport.bbr import (
    BbrCongestionControl,
    Phase,
    RatePacer,
)
from p2pdist.transport.quic_core import (
    BBR_MIN_RTT,
    PinnedQuicConnection,
    QuicConfig,
    quic_configuration,
)
from p2pdist.transport.reordering import ReorderingRecovery

MDS = 1452
CLIENT_ADDR = ("192.0.2.1", 4433)
SERVER_ADDR = ("192.0.2.2", 4433)
MAX_STEPS = 5_000_000
"""Bound on the simulation's steps (the longest test takes well under a million)."""


@dataclass
class Link:
    """One direction of the model path: a bottleneck of ``rate`` bytes/s behind a
    drop-tail queue of ``queue`` bytes, then ``delay`` seconds, losing ``loss`` of the
    datagrams at random."""

    rate: float
    queue: int
    delay: float
    loss: float
    rng: random.Random
    free_at: float = 0.0
    sent: int = 0
    dropped: int = 0
    in_transit: list[tuple[float, int, Any, bytes]] = field(default_factory=list)
    outage: tuple[float, float] | None = None
    """Seconds between which the link drops everything."""
    jitter: float = 0.0
    """Each datagram is delayed by up to this many seconds more, at random (uniformly),
    so later ones may overtake it: reordering, as netem's jitter makes it."""
    _seq: int = 0

    def send(self, data: bytes, now: float, tag: Any) -> None:
        self.sent += 1
        if self.outage is not None and self.outage[0] <= now < self.outage[1]:
            self.dropped += 1
            return
        start = max(now, self.free_at)
        if (start - now) * self.rate > self.queue:
            self.dropped += 1
            return
        self.free_at = start + len(data) / self.rate
        if self.rng.random() < self.loss:
            self.dropped += 1
            return
        self._seq += 1
        late = self.rng.uniform(0.0, self.jitter) if self.jitter else 0.0
        heapq.heappush(self.in_transit, (self.free_at + self.delay + late, self._seq, tag, data))

    def next_at(self) -> float:
        return self.in_transit[0][0] if self.in_transit else math.inf

    def due(self, now: float) -> list[tuple[Any, bytes]]:
        out = []
        while self.in_transit and self.in_transit[0][0] <= now:
            _, _, tag, data = heapq.heappop(self.in_transit)
            out.append((tag, data))
        return out


@dataclass
class Outcome:
    seconds: float
    """Virtual time from the first byte written to the last byte received."""
    loss: float
    """Share of the sender's datagrams the path dropped (queue or random)."""
    final_srtt: float
    cc: object
    """The sender's congestion controller at the end."""
    recovery: ReorderingRecovery
    """The sender's loss recovery at the end."""


def key(n: int) -> SecretKey:
    return SecretKey.from_seed("bbr-test-seed", n)


def connection(cc: str, *, client: bool, odcid: bytes | None = None) -> PinnedQuicConnection:
    """A connection as QuicTransport makes one for a direct path to another host."""
    k = key(0 if client else 1)
    qc = QuicConfig(congestion_control=cc)
    cc, bbr_from_rtt = qc.congestion_control_for(direct=True, loopback=False)
    cfg = quic_configuration(
        k,
        make_certificate(k),
        qc,
        is_client=client,
        max_datagram=MDS,
        idle_timeout=600,
        congestion_control=cc,
    )
    conn = PinnedQuicConnection(
        configuration=cfg, stream_window=qc.stream_window, original_destination_connection_id=odcid
    )
    conn.bbr_from_rtt = bbr_from_rtt
    conn.admit()
    return conn


@dataclass
class _Flow:
    """One connection over the model path, and what its ends wrote and received."""

    client: PinnedQuicConnection
    server: PinnedQuicConnection
    up: int  # bytes the client sends
    down: int  # bytes the server sends
    writes: list[tuple[float, int]]  # the client's writes: (seconds after the handshake, bytes)
    heard: bool = False
    down_written: bool = False
    started: float | None = None
    received: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    done: dict[bool, float] = field(default_factory=dict)


def run_flows(
    cc: str,
    flows: list[tuple[int | list[tuple[float, int]], int]],
    *,
    rate: float,
    queue: int,
    rtt: float,
    loss: float = 0.0,
    seed: int = 1,
    limit: float = 600.0,
    outage: tuple[float, float] | None = None,
    jitter: float = 0.0,
) -> tuple[list[_Flow], Link]:
    """Connections, one per ``(client bytes, server bytes)``, over one model path (its
    two directions alike, shared by all), each handshake included; each end writes its
    bytes once the handshake is done (the client's may instead be a list of ``(seconds
    after the handshake, bytes)`` writes). ``outage``: both directions drop everything
    between these two times; ``jitter``: both directions reorder (see Link). Returns,
    when every byte arrived, the flows and the client-to-server link."""
    rng = random.Random(seed)
    up = Link(rate, queue, rtt / 2, loss, rng, outage=outage, jitter=jitter)
    down = Link(rate, queue, rtt / 2, loss, rng, outage=outage, jitter=jitter)
    state: list[_Flow] = []
    for c_bytes, s_bytes in flows:
        client = connection(cc, client=True)
        client.connect(SERVER_ADDR, now=0.0)
        server = connection(cc, client=False, odcid=client.original_destination_connection_id)
        writes = [(0.0, c_bytes)] if isinstance(c_bytes, int) else list(c_bytes)
        total = sum(n for _, n in writes)
        state.append(_Flow(client, server, total, s_bytes, writes))
    now, steps = 0.0, 0
    while now < limit:
        steps += 1
        assert steps < MAX_STEPS, f"no end after {steps} steps, at {now:.3f} s (virtual)"
        for f in state:
            if f.started is None and f.client._handshake_complete and f.server._handshake_complete:
                f.started = now
            while f.started is not None and f.writes and f.started + f.writes[0][0] <= now:
                _, nbytes = f.writes.pop(0)
                f.client.send_stream_data(0, bytes(nbytes), end_stream=not f.writes)
            if f.down and not f.down_written and 0 in f.server._streams:  # the client opened it
                f.down_written = True
                f.server.send_stream_data(0, bytes(f.down), end_stream=True)
            for data, _ in f.client.datagrams_to_send(now=now):
                up.send(data, now, f)
            if f.heard:  # else the server has no path to answer on yet
                for data, _ in f.server.datagrams_to_send(now=now):
                    down.send(data, now, f)
        if all(len(f.done) == (f.up > 0) + (f.down > 0) for f in state):
            return state, up
        timers = [
            t for f in state for t in (f.client.get_timer(), f.server.get_timer()) if t is not None
        ]
        timers += [f.started + f.writes[0][0] for f in state if f.started is not None and f.writes]
        nxt = min([up.next_at(), down.next_at(), *timers])
        assert nxt < math.inf, "stalled: " + ", ".join(
            f"flow {i} received {f.received} of {f.up} up, done {f.done}"
            for i, f in enumerate(state)
        )
        now = nxt if nxt > now else now + 1e-6  # a real clock moves on
        for link, to_server in ((up, True), (down, False)):
            for f, data in link.due(now):
                dst = f.server if to_server else f.client
                dst.receive_datagram(data, CLIENT_ADDR if to_server else SERVER_ADDR, now=now)
                f.heard = True
        for f in state:
            for conn in (f.client, f.server):
                timer = conn.get_timer()
                if timer is not None and timer <= now:
                    conn.handle_timer(now)
            for conn, from_client in ((f.server, True), (f.client, False)):
                while (event := conn.next_event()) is not None:
                    if isinstance(event, StreamDataReceived):
                        f.received[from_client] += len(event.data)
                        if event.end_stream:
                            f.done[from_client] = now
    raise AssertionError(f"not all delivered in {limit} s: {[f.received for f in state]}")


def transfer(cc: str, nbytes: int, **path: Any) -> Outcome:
    """Send ``nbytes`` from a client to a server over the model path (see run_flows)."""
    (f,), up = run_flows(cc, [(nbytes, 0)], **path)
    assert f.started is not None and f.received[True] == nbytes
    return Outcome(
        seconds=f.done[True] - f.started,
        loss=up.dropped / up.sent,
        final_srtt=f.client._loss._rtt_smoothed,
        cc=f.client._loss._cc,
        recovery=f.client._loss,
    )


# ---- on model paths ---------------------------------------------------------------------


@pytest.mark.parametrize("loss", [0.005, 0.02])
def test_random_loss_does_not_collapse_the_rate(loss: float) -> None:
    """On a 100 ms path with 4 MB/s and random loss, BBR moves 4 MiB in a few round trips
    more than the lossless path takes, while Reno, which halves its window on each loss,
    takes several times as long (the trial this fixes: a 1 MiB all-reduce took 4-16 s
    over a direct path with 0.5-2% loss, against 0.23 s without)."""
    size = 4 << 20
    clean = transfer("bbr", size, rate=4e6, queue=400_000, rtt=0.1)
    bbr = transfer("bbr", size, rate=4e6, queue=400_000, rtt=0.1, loss=loss)
    reno = transfer("reno", size, rate=4e6, queue=400_000, rtt=0.1, loss=loss)
    assert isinstance(bbr.cc, BbrCongestionControl)
    assert bbr.seconds < clean.seconds * 1.6, (bbr, clean)
    assert reno.seconds > bbr.seconds * 2.5, (reno, bbr)


@pytest.mark.parametrize("loss", [0.1, 0.2])
def test_heavy_random_loss_neither_ends_startup_early_nor_keeps_cutting(loss: float) -> None:
    """A path that loses 10% or 20% at random (bad wifi): a round of STARTUP a little
    lossier than that tripped the loss guard (15% of a round) and left BBR at a tenth of
    the link, climbing back 25% per 8 rounds while more such rounds cut it again: 2 MiB
    took 3.1-4.9 s at 10% and 9-11 s at 20% over these seeds. The guard now counts loss
    above the path's base loss (what calm rounds lose): 1.3 s and 1.5-4.4 s."""
    runs = [
        transfer("bbr", 2 << 20, rate=4e6, queue=400_000, rtt=0.1, loss=loss, seed=seed)
        for seed in (1, 3, 4)
    ]
    times = sorted(r.seconds for r in runs)
    assert times[1] < 2.5, times  # the median
    for r in runs:
        cc = r.cc
        assert isinstance(cc, BbrCongestionControl)
        assert abs(cc.base_loss - loss) < 0.06, cc.base_loss


@pytest.mark.parametrize(
    ("cc", "jitter"),
    [("reno", 0.01), ("bbr", 0.01), ("reno", 0.03), ("bbr", 0.03), ("cubic", 0.03)],
)
def test_a_path_that_reorders_keeps_its_rate(cc: str, jitter: float) -> None:
    """Up to 10 or 30 ms of jitter on a 100 ms, 4 MB/s path: hundreds of packets overtake
    each other. aioquic's packet threshold (3) took each for a loss, and 4 MiB took 29 s
    on Reno and 5 s on BBR at 10 ms, 22 s on BBR at 30 ms, against 1.5 s in order. Once
    the path shows reordering only time declares a loss (ReorderingRecovery), after a
    round trip plus a window that widens with each spurious loss: 30 ms needs two steps
    of a quarter round trip. The losses before it widened cut Reno's window; once all
    turned out spurious it was undone (Reno took 5.1 s at 30 ms without that, 1.7 s with;
    Cubic, whose undo also restores its curve, 2.6 s without, 1.8 s with)."""
    size = 4 << 20
    clean = transfer(cc, size, rate=4e6, queue=400_000, rtt=0.1)
    out = transfer(cc, size, rate=4e6, queue=400_000, rtt=0.1, jitter=jitter)
    assert not clean.recovery.reordering  # in order: aioquic's thresholds throughout
    if cc != "bbr" and jitter > 0.025:
        assert out.recovery.undone >= 1  # the cuts before the window widened, undone
    assert out.recovery.window_steps >= (2 if jitter > 0.025 else 1), out.recovery.window_steps
    assert out.seconds < clean.seconds * (1.5 if jitter > 0.025 else 1.2), (out, clean)


def test_a_path_change_starts_loss_detection_over() -> None:
    """The connection tells its loss recovery of a new path: no reordering seen there
    yet, and nothing to see in the old path's packets."""
    conn = connection("reno", client=True)
    recovery = conn._loss
    assert isinstance(recovery, ReorderingRecovery)
    recovery.window_steps = 3
    conn._packet_number = 57
    conn.path_changed(MDS, 1.0, "reno")
    assert not recovery.reordering and recovery._first_number == 57


def test_a_shallow_bottleneck_queue_sees_little_loss() -> None:
    """A 2 MB/s bottleneck with a 64 KiB queue (a third of the path's bandwidth-delay
    product): BBR fills the link and loses few packets. Before its pacer kept account of
    the packets that ACKs sent unpaced, and before its loss guard, a third were lost."""
    out = transfer("bbr", 8 << 20, rate=2e6, queue=65536, rtt=0.1)
    ideal = (8 << 20) / 2e6
    assert out.loss < 0.05, out  # nearly all in STARTUP's last round, once per path
    assert out.seconds < ideal * 1.4, out


def test_a_deep_bottleneck_queue_is_not_filled() -> None:
    """A 2 MB/s bottleneck with a 1 MB queue (half a second): Reno fills it, and the
    round trip grows towards 600 ms; BBR paces at the bottleneck's rate and keeps the
    queue short, at no cost in throughput."""
    bbr = transfer("bbr", 4 << 20, rate=2e6, queue=1_000_000, rtt=0.1)
    reno = transfer("reno", 4 << 20, rate=2e6, queue=1_000_000, rtt=0.1)
    assert bbr.final_srtt < 0.2 < reno.final_srtt, (bbr, reno)
    assert bbr.seconds < reno.seconds * 1.1, (bbr, reno)


def test_the_model_measures_the_path() -> None:
    """After a bulk transfer the model holds the bottleneck's rate and the path's RTT."""
    out = transfer("bbr", 4 << 20, rate=2e6, queue=200_000, rtt=0.05)
    cc = out.cc
    assert isinstance(cc, BbrCongestionControl)
    assert cc.phase is Phase.PROBE_BW
    payload = 2e6 * 1400 / 1452  # what a 1452-byte datagram carries of the link
    assert payload * 0.8 < cc.bandwidth < 2e6 * 1.15, cc.bandwidth
    assert cc.min_rtt is not None and 0.05 <= cc.min_rtt < 0.06


def test_flows_sharing_a_bottleneck_keep_the_minimum_rtt() -> None:
    """Two flows through one bottleneck never see it empty on their own: each window of
    twice the bandwidth-delay product keeps a queue for the other. Without PROBE_RTT the
    minimum RTT, taken afresh every 10 s from samples that include that queue, grew with
    it (0.05 s to 0.39 s here, and on without bound); PROBE_RTT drains the queue so that
    both measure the path's."""
    flows, _ = run_flows("bbr", [(8 << 20, 0), (8 << 20, 0)], rate=5e5, queue=1_000_000, rtt=0.05)
    for f in flows:
        cc = f.client._loss._cc
        assert isinstance(cc, BbrCongestionControl) and cc.min_rtt is not None
        assert cc.min_rtt < 0.06, cc.min_rtt
    # (A precondition, not the claim: the run spans three 10 s min-RTT windows.)
    assert max(f.done[True] - (f.started or 0.0) for f in flows) > 25


def test_data_both_ways_fills_both_directions() -> None:
    """An all-reduce sends both ways at once; each direction's ACKs queue behind the
    other's data, which lengthens the round trip the later direction's STARTUP sees and
    leaves its window (twice the bandwidth-delay product at the minimum RTT) short for a
    while. Both directions finish within a quarter of Reno's time (about 15% later here;
    docs/quic.md 4)."""
    bbr, _ = run_flows("bbr", [(4 << 20, 4 << 20)], rate=2e6, queue=200_000, rtt=0.1)
    reno, _ = run_flows("reno", [(4 << 20, 4 << 20)], rate=2e6, queue=200_000, rtt=0.1)
    (b,), (r,) = bbr, reno
    assert b.started is not None and r.started is not None
    slowest = max(b.done.values()) - b.started
    assert slowest < (max(r.done.values()) - r.started) * 1.25, (b.done, r.done)


def test_a_sender_that_runs_out_of_data_keeps_its_bandwidth_estimate() -> None:
    """After a bulk transfer the application trickles small messages: the connection
    tells BBR it had nothing more to send (PinnedQuicConnection.datagrams_to_send), so the
    trickle's low delivery rate does not replace the path's bandwidth in the model."""
    writes = [(0.0, 2 << 20)] + [(2.0 + 0.1 * i, 1000) for i in range(30)]
    (f,), _ = run_flows("bbr", [(writes, 0)], rate=2e6, queue=200_000, rtt=0.05)
    cc = f.client._loss._cc
    assert isinstance(cc, BbrCongestionControl)
    assert cc.bandwidth > 0.8 * 2e6 * 1400 / 1452, cc.bandwidth


def test_after_an_outage_the_path_is_measured_afresh() -> None:
    """Two seconds of total loss (persistent congestion): BBR starts over from a small
    window, and the outage's losses do not count against the new STARTUP's first round
    (they did: the loss guard then took the first round's trickle, 1% of the link, for
    the path's bandwidth and ended STARTUP, and the transfer needed 3.5 s to recover)."""
    (f,), _ = run_flows("bbr", [(30 << 20, 0)], rate=4e6, queue=400_000, rtt=0.1, outage=(3, 5))
    assert f.started is not None
    took = f.done[True] - f.started
    ideal = (30 << 20) / (4e6 * 1400 / 1452) + 2.0
    assert took < ideal + 1.5, (took, ideal)


def test_a_burst_after_a_long_pause_does_not_probe_the_rtt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After more than 10 s idle the minimum RTT is due again, but the first sample
    already shows an empty queue: the burst goes out at the full window, not PROBE_RTT's
    half (before: 0.45 s for this 1 MiB instead of 0.34 s)."""
    entered: list[Phase] = []
    enter = BbrCongestionControl._enter

    def spy(self: BbrCongestionControl, phase: Phase, *args: Any) -> None:
        entered.append(phase)
        enter(self, phase, *args)

    monkeypatch.setattr(BbrCongestionControl, "_enter", spy)
    writes = [(0.0, 1 << 20), (15.0, 1 << 20)]
    (f,), _ = run_flows("bbr", [(writes, 0)], rate=4e6, queue=400_000, rtt=0.1)
    cc = f.client._loss._cc
    assert isinstance(cc, BbrCongestionControl)
    assert f.started is not None
    took = f.done[True] - (f.started + 15.0)
    assert took < 0.4, took
    assert cc.phase is not Phase.PROBE_RTT
    assert Phase.PROBE_RTT not in entered, entered


@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_a_side_that_only_received_sends_at_once_when_its_turn_comes(loss: float) -> None:
    """The server sends 8 MiB, then the client, which sent only ACKs so far, sends
    1 MiB back (a broadcast after a ring pass). The client's controller never measured
    the path: its ACK trickle must not stand for the path's bandwidth (it did: the
    pacer, charged for the ACKs, always held a debt, so the app-limited hook never fired,
    STARTUP ended at 9 KB/s, and the reply took 10 s, or 7 s at 5% loss, not 0.8)."""
    writes = [(0.0, 1), (12.0, 1 << 20)]
    (f,), _ = run_flows("bbr", [(writes, 8 << 20)], rate=4e6, queue=400_000, rtt=0.1, loss=loss)
    assert f.started is not None
    reply = f.done[True] - (f.started + 12.0)
    assert reply < 1.5, reply


# ---- the controller alone ---------------------------------------------------------------


def sent(number: int, at: float, size: int = MDS) -> QuicSentPacket:
    return QuicSentPacket(
        epoch=Epoch.ONE_RTT,
        in_flight=True,
        is_ack_eliciting=True,
        is_crypto_packet=False,
        packet_number=number,
        packet_type=QuicPacketType.ONE_RTT,
        sent_time=at,
        sent_bytes=size,
    )


def drive(
    cc: BbrCongestionControl,
    packets: int,
    rate: float,
    rtt: float,
    start: float,
    *,
    app_limited: bool = False,
) -> float:
    """Send ``packets`` packets at ``rate`` bytes/s, each acknowledged ``rtt`` after it
    was sent (sends and acknowledgements interleaved in time order); ``app_limited``: the
    sender says before each that it had nothing more (as PinnedQuicConnection does)."""
    gap = MDS / rate
    events = []
    for i in range(packets):
        t = start + i * gap
        p = sent(i, t)
        events += [(t, 0, i, p), (t + rtt, 1, i, p)]
    for t, kind, _, p in sorted(events, key=lambda e: e[:3]):
        if kind == 0:
            if app_limited:
                cc.on_app_limited()
            cc.on_packet_sent(packet=p)
        else:
            cc.on_packet_acked(now=t, packet=p)
            cc.on_rtt_measurement(now=t, rtt=rtt)
    return start + packets * gap + rtt


def test_samples_while_app_limited_do_not_lower_the_estimate() -> None:
    """Packets sent while the sender had nothing more to send measure the application:
    they may raise the bandwidth estimate, never lower it."""
    cc = BbrCongestionControl(max_datagram_size=MDS)
    t = drive(cc, 400, 2e6, 0.05, 0.0)
    high = cc.bandwidth
    assert high > 1e6
    t = drive(cc, 400, 2e5, 0.05, t, app_limited=True)  # a trickle, 40 round trips
    assert cc.bandwidth == pytest.approx(high)
    drive(cc, 400, 2e5, 0.05, t)  # the same rate with more to send: the path slowed
    assert cc.bandwidth == pytest.approx(2e5, rel=0.05)


def test_persistent_congestion_starts_measuring_afresh() -> None:
    """Every packet lost for several probe timeouts: the path may be another one; the
    model is dropped and the window goes to its floor."""
    cc = BbrCongestionControl(max_datagram_size=MDS)
    drive(cc, 400, 2e6, 0.05, 0.0)
    cc.on_persistent_congestion()
    assert cc.bandwidth == 0.0 and cc.min_rtt is None and cc.phase is Phase.STARTUP
    assert cc.congestion_window == 4 * MDS and cc.pacing_rate is None


def test_a_zero_rtt_sample_is_taken_as_the_clock_granularity() -> None:
    """aioquic passes the raw RTT sample, which a fast path (or a coarse clock) can make
    0; the model takes 1 ms instead of dividing by it."""
    cc = BbrCongestionControl(max_datagram_size=MDS)
    cc.on_rtt_measurement(now=0.0, rtt=0.0)
    assert cc.min_rtt == 0.001 and cc.pacing_rate is not None and cc.pacing_rate > 0


def test_lost_and_expired_packets_leave_the_flight() -> None:
    cc = BbrCongestionControl(max_datagram_size=MDS)
    packets = [sent(i, 0.0) for i in range(3)]
    for p in packets:
        cc.on_packet_sent(packet=p)
    cc.on_packets_lost(now=0.2, packets=packets[:1])
    cc.on_packets_expired(packets=packets[1:])
    assert cc.bytes_in_flight == 0 and not cc._sent
    assert cc.get_log_data()["bbr_phase"] == "startup"


def test_the_rate_pacer_paces_at_the_models_rate_and_remembers_unpaced_packets() -> None:
    """The pacer's interval is the datagram size over the model's rate; a packet sent
    with no credit (aioquic sends one whenever an ACK is due) makes the next wait."""
    cc = BbrCongestionControl(max_datagram_size=MDS)
    cc.pacing_rate = 1e6
    pacer = RatePacer(cc, max_datagram_size=MDS)
    pacer.update_rate(congestion_window=100 * MDS, smoothed_rtt=0.05)
    assert pacer.packet_time == pytest.approx(MDS / 1e6)
    now = 1.0
    while pacer.next_send_time(now) is None:  # spend the burst allowance
        pacer.update_after_send(now)
    for _ in range(3):  # three unpaced packets (ACKs were due)
        pacer.update_after_send(now)
    wait = pacer.next_send_time(now)
    assert wait is not None and wait - now >= 3 * MDS / 1e6
    for _ in range(100):  # the debt stops at 5 ms (aioquic charges ACK-only packets too)
        pacer.update_after_send(now)
    wait = pacer.next_send_time(now)
    assert wait is not None and wait - now == pytest.approx(0.005)


# ---- which controller a path gets -------------------------------------------------------


def test_auto_starts_on_reno_and_moves_direct_paths_to_bbr_by_their_rtt() -> None:
    qc = QuicConfig()
    assert qc.congestion_control == "auto"
    assert qc.congestion_control_for(direct=True, loopback=False) == ("reno", BBR_MIN_RTT)
    assert qc.congestion_control_for(direct=False, loopback=False) == ("reno", None)
    assert qc.congestion_control_for(direct=True, loopback=True) == ("reno", None)
    for name in ("reno", "cubic", "bbr"):
        choice = QuicConfig(congestion_control=name).congestion_control_for(
            direct=True, loopback=False
        )
        assert choice == (name, None)
    with pytest.raises(ValueError, match="congestion_control must be one of"):
        QuicConfig(congestion_control="vegas")


@pytest.mark.parametrize(
    ("rtt", "expected"), [(0.05, BbrCongestionControl), (0.002, RenoCongestionControl)]
)
def test_auto_runs_bbr_on_internet_round_trips_and_reno_on_a_lan(
    rtt: float, expected: type
) -> None:
    """A direct path under "auto" starts on Reno and takes BBR once its first round trip
    is measured at BBR_MIN_RTT or more: between two namespaces with no added delay BBR
    took 2-3 times Reno's time (the event loops swamp sub-millisecond round trips)."""
    out = transfer("auto", 1 << 20, rate=4e6, queue=400_000, rtt=rtt)
    assert type(out.cc) is expected


def rtt_sample(conn: PinnedQuicConnection, rtt: float, now: float) -> None:
    """Record one round-trip sample as aioquic's recovery does for an ACK at ``now``."""
    loss = conn._loss
    if not loss._rtt_initialized:
        loss._rtt_initialized, loss._rtt_first_sample_time = True, now
    loss._rtt_min = min(loss._rtt_min, rtt)


def test_auto_after_a_path_change_decides_on_the_new_paths_round_trips() -> None:
    # Hole punching moves a relayed connection to a direct path: the first ACKs there can
    # be for packets sent through the relay, with the relay's round trip.
    lan = connection("auto", client=True)
    lan.connect(SERVER_ADDR, now=9.9)
    lan.path_changed(MDS, 10.0, "reno", BBR_MIN_RTT)
    rtt_sample(lan, 0.06, 10.01)  # an ACK of a packet that went through the relay
    lan.datagrams_to_send(10.02)
    assert lan.bbr_from_rtt == BBR_MIN_RTT, "decided on the relay's round trip"
    rtt_sample(lan, 0.0008, 10.03)  # the direct path's own
    lan.datagrams_to_send(10.03)
    assert isinstance(lan._loss._cc, RenoCongestionControl)
    assert lan.bbr_from_rtt is None

    wan = connection("auto", client=True)
    wan.connect(SERVER_ADDR, now=9.9)
    wan.path_changed(MDS, 10.0, "reno", BBR_MIN_RTT)
    rtt_sample(wan, 0.06, 10.01)
    rtt_sample(wan, 0.04, 10.03)
    wan.datagrams_to_send(10.04)
    assert isinstance(wan._loss._cc, RenoCongestionControl)  # not a round trip since 10.01
    wan.datagrams_to_send(10.051)
    assert isinstance(wan._loss._cc, BbrCongestionControl)
    assert wan.bbr_from_rtt is None


def test_a_path_change_installs_that_paths_controller_and_pacer() -> None:
    conn = connection("reno", client=True)
    assert isinstance(conn._loss._cc, RenoCongestionControl)
    conn.path_changed(MDS, 1.0, "bbr")
    assert isinstance(conn._loss._cc, BbrCongestionControl)
    assert isinstance(conn._loss._pacer, RatePacer)
    conn.path_changed(16384, 2.0, "reno")
    assert isinstance(conn._loss._cc, RenoCongestionControl)
    assert type(conn._loss._pacer) is QuicPacketPacer
    fresh = connection("bbr", client=True)
    assert isinstance(fresh._loss._pacer, RatePacer)
