"""A model-based congestion controller for QUIC's direct paths (BBR, after Cardwell et
al., "BBR: Congestion-Based Congestion Control", ACM Queue 2016, and the IETF draft
draft-cardwell-iccrg-bbr-congestion-control), plugged into aioquic's loss recovery.

Why: aioquic ships Reno and CUBIC, which read every lost packet as congestion. On a
100 ms internet path that drops 0.5-2% of packets at random (wifi, a busy home router)
Reno held a window of 15-30 KB, about 200 KB/s, and a 1 MiB all-reduce took 4-16 s
where it took 0.23 s without loss. BBR sends at the bottleneck bandwidth it measures and
does not back off for loss it cannot tell from noise (figures: docs/quic.md 4).

The model, updated on every acknowledgement (all sans-I/O, ``now`` passed in):

* *Bottleneck bandwidth*: the largest delivery rate measured over the last
  :data:`BW_WINDOW_ROUNDS` round trips. A packet remembers, when sent, how much had been
  delivered and when; its acknowledgement gives one rate sample, over the longer of its
  send and acknowledgement intervals. Samples over less than the minimum RTT are dropped
  (acknowledgements bunched by the receiver's event loop would overstate the rate), and
  samples of packets sent while the application had nothing more to send
  (:meth:`BbrCongestionControl.on_app_limited`) may raise the estimate but never lower it.
* *Minimum RTT*: the least round trip seen; a value older than :data:`MIN_RTT_WINDOW`
  gives way to the next sample, and PROBE_RTT then looks for a lower one.
* The window is ``cwnd_gain`` times their product (the path's bandwidth-delay product),
  and the pacing rate (:class:`RatePacer`) ``pacing_gain`` times the bandwidth.

The phases, as BBR v1: STARTUP doubles the rate every round trip until the bandwidth
stops growing by 25% over three rounds; DRAIN empties the queue STARTUP built; PROBE_BW
cruises at the measured bandwidth, probing 25% above it one round in eight and draining
for the next; PROBE_RTT, when the minimum RTT went 10 s without a new low, holds half the
bandwidth-delay product (at the minimum RTT before it expired) in flight for 200 ms and a
whole round trip, so that flows sharing a bottleneck see it empty together (without it,
their queue and their minimum RTT grew each other without bound). A flow coming back
from an idle spell skips it: its first round trip already shows an empty queue. After
persistent congestion (an outage) the model starts over, and the outage's losses count
against no round. Departures from v1, each in the cautious direction:

* The window is twice the bandwidth-delay product in STARTUP too, as in BBR v3 (v1's
  2.89 overfilled queues shallower than that product), and PROBE_RTT keeps half of it,
  as in v2 (v1: four packets).
* A loss guard, after BBR v2: a round trip that lost over :data:`LOSS_GUARD` of what it
  sent (at least :data:`LOSS_GUARD_PACKETS` packets), or over :data:`QUEUE_LOSS_GUARD`
  while even its least RTT showed a standing queue, ends STARTUP and brings the
  bandwidth estimate down to the rate delivered in that round, but to no less than
  :data:`LOSS_BETA` of itself per round (not at all in a round the application left
  short of data): a full bottleneck queue brings the rate down within a few rounds,
  while random loss of a few percent does not. Both shares are counted above the
  path's *base loss* (:attr:`BbrCongestionControl.base_loss`: the share lost in the
  recent rounds that were neither congested nor queued), so that on a path losing
  10-20% at random an unlucky round of a little more neither ends STARTUP at a fraction
  of the link nor keeps cutting the estimate (v2's fixed thresholds do both). A policer
  (no queue) is caught only by the 15% branch; below that BBR keeps losing a few
  percent there (v1 has a long-term policer mode, not ported).

Register with aioquic under the name ``"bbr"`` by importing this module.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from aioquic.quic.congestion.base import (
    K_GRANULARITY,
    K_INITIAL_WINDOW,
    QuicCongestionControl,
    register_congestion_control,
)
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.quic.recovery import QuicPacketPacer

NAME = "bbr"
"""The name aioquic knows this controller by (``congestion_control_algorithm``)."""

HIGH_GAIN = 2.0 / math.log(2.0)
"""STARTUP's pacing gain (2/ln 2): doubles the delivery rate each round."""
DRAIN_GAIN = 1.0 / HIGH_GAIN
PROBE_GAINS = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
"""PROBE_BW's pacing gains, one per minimum RTT."""
CWND_GAIN = 2.0
"""The window: twice the bandwidth-delay product (room for delayed and bunched
acknowledgements)."""
BW_WINDOW_ROUNDS = 10
"""Round trips over which the bottleneck bandwidth is the largest rate sample."""
MIN_RTT_WINDOW = 10.0
"""Seconds without a new low after which the minimum RTT is measured again (PROBE_RTT)."""
PROBE_RTT_TIME = 0.2
"""How long PROBE_RTT holds its small window (and at least one round trip), seconds."""
PROBE_RTT_SHARE = 0.5
"""PROBE_RTT's window, as a share of the bandwidth-delay product."""
FULL_BW_GROWTH = 1.25
FULL_BW_ROUNDS = 3
"""STARTUP ends after this many rounds without FULL_BW_GROWTH in bandwidth."""
MIN_WINDOW_PACKETS = 4
LOSS_GUARD = 0.15
"""Share of a round's bytes lost above which the round counts as congested."""
LOSS_GUARD_PACKETS = 5
"""Fewest lost packets for that (fewer in a small round are noise)."""
QUEUE_LOSS_GUARD = 0.02
QUEUE_LOSS_PACKETS = 3
"""The same two, for a round whose least RTT shows a standing queue."""
QUEUE_RTT_SHARE = 0.125
QUEUE_RTT_FLOOR = 0.004
"""A round's least RTT shows a standing queue when it exceeds the minimum RTT by this
share of it, and by at least this many seconds (the event loops' own jitter)."""
LOSS_BETA = 0.7
"""The most a congested round may cut the bandwidth estimate to (as BBR v2's beta)."""
BASE_LOSS_MEMORY = 0.875
"""The path's base loss rate weighs each earlier round by this factor more per round
(about the last 8 rounds count)."""
BASE_LOSS_MAX = 0.3
"""The most base loss the guard looks past."""


class Phase(Enum):
    """BBR's state machine."""

    STARTUP = "startup"
    DRAIN = "drain"
    PROBE_BW = "probe_bw"
    PROBE_RTT = "probe_rtt"


@dataclass(slots=True)
class _Sent:
    """What a packet remembers from its send time, for its delivery rate sample."""

    delivered: int
    delivered_time: float
    first_sent_time: float
    app_limited: bool


class BbrCongestionControl(QuicCongestionControl):
    """BBR for aioquic (see the module docstring). ``pacing_rate`` (bytes/s, None until
    the first round trip) is what :class:`RatePacer` paces at."""

    def __init__(self, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._max_datagram_size = max_datagram_size
        self.pacing_rate: float | None = None
        self.phase = Phase.STARTUP
        self._pacing_gain = HIGH_GAIN
        # delivery accounting, of the packets this controller saw sent (a path change
        # hands over bytes_in_flight of packets it did not)
        self._sent: dict[int, _Sent] = {}  # id(packet) -> send-time state, while in flight
        self._own_in_flight = 0
        self._delivered = 0
        self._delivered_time = 0.0
        self._first_sent_time = 0.0
        self._app_limited_until = 0  # delivered count; 0 when not app-limited
        self._idle_restart = False  # sending again after an idle, app-limited spell
        # round trips
        self._round = 0
        self._next_round_delivered = 0
        self._round_lost = 0
        self._round_lost_packets = 0
        self._round_app_limited = False
        self._round_min_rtt = math.inf
        self._round_start_delivered = 0
        self._round_start_time = 0.0
        self._base_lost = 0.0  # bytes lost and sent in calm rounds, older ones fading
        self._base_sent = 0.0
        # model
        self._bw_samples: deque[tuple[int, float]] = deque()  # (round, rate), falling
        self._min_rtt = math.inf
        self._min_rtt_stamp = 0.0
        self._expired_min_rtt = math.inf  # the minimum a PROBE_RTT replaced
        self._full_bw = 0.0
        self._full_bw_rounds = 0
        self._filled_pipe = False
        self._cycle = 2
        self._cycle_stamp = 0.0
        # PROBE_RTT
        self._probe_rtt_due = False
        self._probe_rtt_done: float | None = None
        self._probe_rtt_round = 0
        self._prior_cwnd = 0

    # ---- the model ---------------------------------------------------------------------

    @property
    def bandwidth(self) -> float:
        """The bottleneck bandwidth estimate, bytes/s (0 before the first sample)."""
        samples = self._bw_samples
        return samples[0][1] if samples else 0.0

    @property
    def min_rtt(self) -> float | None:
        """The minimum RTT estimate, seconds (None before the first sample)."""
        return None if math.isinf(self._min_rtt) else self._min_rtt

    def _bdp(self) -> float:
        return self.bandwidth * self._min_rtt if self._bw_samples and self.min_rtt else 0.0

    # ---- aioquic's interface -----------------------------------------------------------

    def on_packet_sent(self, *, packet: QuicSentPacket) -> None:
        """Remember the delivery state for this packet's rate sample."""
        sent_time = packet.sent_time or 0.0
        if self._own_in_flight == 0:  # restarting from idle: no interval spans the gap
            self._first_sent_time = self._delivered_time = sent_time
            self._idle_restart = self._app_limited_until > 0
            if self._round_start_time == 0.0:
                self._round_start_time = sent_time
        self._sent[id(packet)] = _Sent(
            self._delivered,
            self._delivered_time,
            self._first_sent_time,
            self._app_limited_until > 0 or self.phase is Phase.PROBE_RTT,
        )
        self.bytes_in_flight += packet.sent_bytes
        self._own_in_flight += packet.sent_bytes

    def on_app_limited(self) -> None:
        """The sender stopped with room in the window and nothing held by pacing: it had
        nothing more to send. Rate samples until what is in flight now is delivered
        measure the application, not the path."""
        self._app_limited_until = max(self._delivered + self._own_in_flight, 1)

    def on_packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        """Count the delivery, take a rate sample, and update the model and window."""
        self.bytes_in_flight -= packet.sent_bytes
        sent = self._sent.pop(id(packet), None)
        if sent is None:  # sent before this controller took over (path change)
            return
        self._own_in_flight -= packet.sent_bytes
        self._delivered += packet.sent_bytes
        self._delivered_time = now
        self._first_sent_time = packet.sent_time or now
        if self._app_limited_until and self._delivered > self._app_limited_until:
            self._app_limited_until = 0
        round_start = sent.delivered >= self._next_round_delivered
        if round_start:
            self._end_round(now)
            self._next_round_delivered = self._delivered
        self._round_app_limited |= sent.app_limited
        self._sample(now, packet, sent)
        if round_start:
            self._check_full_pipe(sent.app_limited)
        self._advance(now)
        self._set_window(packet.sent_bytes)

    def on_packets_expired(self, *, packets: Iterable[QuicSentPacket]) -> None:
        """Forget packets of a discarded packet space (or resent by a probe)."""
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            if self._sent.pop(id(packet), None) is not None:
                self._own_in_flight -= packet.sent_bytes

    def on_packets_lost(self, *, now: float, packets: Iterable[QuicSentPacket]) -> None:
        """Count the loss towards the round's loss guard; the window does not shrink."""
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            if self._sent.pop(id(packet), None) is not None:
                self._own_in_flight -= packet.sent_bytes
                self._round_lost += packet.sent_bytes
                self._round_lost_packets += 1

    def on_persistent_congestion(self) -> None:
        """Everything was lost for several probe timeouts: the path may have changed, so
        start measuring it afresh (bandwidth and RTT) from the smallest window; packets
        still in flight are counted as another path's, and the round's losses (the
        outage's) against none."""
        self._bw_samples.clear()
        self._min_rtt = self._expired_min_rtt = math.inf
        self._probe_rtt_due = False
        self._probe_rtt_done = None
        self._prior_cwnd = 0
        self._sent.clear()
        self._own_in_flight = 0
        self._next_round_delivered = self._delivered
        self._start_round(0.0)
        self._base_lost = self._base_sent = 0.0
        self._full_bw = 0.0
        self._full_bw_rounds = 0
        self._filled_pipe = False
        self._enter(Phase.STARTUP)
        self.congestion_window = MIN_WINDOW_PACKETS * self._max_datagram_size
        self.pacing_rate = None

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        """Keep the minimum RTT; one older than MIN_RTT_WINDOW gives way to this sample,
        and PROBE_RTT is due."""
        rtt = max(rtt, K_GRANULARITY)  # aioquic passes the raw sample, which may be 0
        self._round_min_rtt = min(self._round_min_rtt, rtt)
        expired = now > self._min_rtt_stamp + MIN_RTT_WINDOW
        if rtt <= self._min_rtt or expired:
            # After an idle spell the queue had time to empty: this sample shows it, and
            # no PROBE_RTT is needed (as v1 and v2).
            if (
                expired
                and not math.isinf(self._min_rtt)
                and self.phase is not Phase.PROBE_RTT
                and not self._idle_restart
            ):
                self._probe_rtt_due = True
                self._expired_min_rtt = self._min_rtt
            self._min_rtt = rtt
            self._min_rtt_stamp = now
        self._idle_restart = False
        if self.pacing_rate is None:  # no bandwidth sample yet: pace the window
            self.pacing_rate = HIGH_GAIN * self.congestion_window / rtt

    def get_log_data(self) -> dict[str, Any]:
        """aioquic's qlog metrics, with the model."""
        data = super().get_log_data()
        data.update(bbr_phase=self.phase.value, bbr_bw=self.bandwidth)
        return data

    # ---- internals ---------------------------------------------------------------------

    def _sample(self, now: float, packet: QuicSentPacket, sent: _Sent) -> None:
        send_elapsed = (packet.sent_time or now) - sent.first_sent_time
        ack_elapsed = now - sent.delivered_time
        interval = max(send_elapsed, ack_elapsed)
        min_rtt = self.min_rtt
        if interval <= 0 or (min_rtt is not None and interval < min_rtt):
            return
        rate = (self._delivered - sent.delivered) / interval
        if sent.app_limited and rate < self.bandwidth:
            return
        self._add_bw_sample(rate)

    def _add_bw_sample(self, rate: float) -> None:
        samples = self._bw_samples
        while samples and samples[-1][1] <= rate:  # falling deque: a windowed max
            samples.pop()
        samples.append((self._round, rate))
        while samples[0][0] <= self._round - BW_WINDOW_ROUNDS:
            samples.popleft()

    def _end_round(self, now: float) -> None:
        """A round trip ended: apply the loss guard to it and start the next."""
        self._round += 1
        # A round the application left short of data measured the application, unless
        # it still had a bandwidth-delay product of its own in flight, and the model one
        # worth the name (a side that only sent ACKs knows nothing of the path).
        bdp = self._bdp()
        measured = not self._round_app_limited or (
            self._own_in_flight >= bdp >= K_INITIAL_WINDOW * self._max_datagram_size
        )
        congested = self._congested()
        if not congested and not self._queued():
            self._note_base_loss()
        if congested and self._bw_samples and measured:  # (no model: nothing to fix)
            elapsed = now - self._round_start_time
            delivered = self._delivered - self._round_start_delivered
            rate = delivered / elapsed if elapsed > 0 else 0.0  # (the floor below holds)
            if not self._round_app_limited:
                self._bw_samples.clear()
                self._add_bw_sample(max(rate, LOSS_BETA * self.bandwidth))
            if self.phase is Phase.STARTUP:
                self._filled_pipe = True
                self._enter(Phase.DRAIN)
        self._start_round(now)

    def _start_round(self, now: float) -> None:
        """A new round's counts, from ``now``."""
        self._round_lost = self._round_lost_packets = 0
        self._round_app_limited = False
        self._round_min_rtt = math.inf
        self._round_start_delivered = self._delivered
        self._round_start_time = now

    def _note_base_loss(self) -> None:
        """Count a round that was neither congested nor queued (a queue's overflow just
        under the guard's line is congestion all the same) towards the path's base
        loss rate."""
        sent = self._delivered - self._round_start_delivered + self._round_lost
        if sent > 0:
            memory = BASE_LOSS_MEMORY if self._base_sent else 0.0
            self._base_lost = self._base_lost * memory + self._round_lost
            self._base_sent = self._base_sent * memory + sent

    @property
    def base_loss(self) -> float:
        """The share of bytes the path loses in rounds that were neither congested nor
        showed a standing queue (random loss: wifi, a busy link), which the loss guard
        looks past (at most :data:`BASE_LOSS_MAX`)."""
        if not self._base_sent:
            return 0.0
        return min(self._base_lost / self._base_sent, BASE_LOSS_MAX)

    def _congested(self) -> bool:
        """Whether the round's losses look like congestion: many more than the path's
        base loss, or some more while even the round's least RTT shows a standing
        queue."""
        lost = self._round_lost_packets
        if lost < min(LOSS_GUARD_PACKETS, QUEUE_LOSS_PACKETS):
            return False
        acked = self._delivered - self._round_start_delivered
        share = self._round_lost / (acked + self._round_lost) - self.base_loss
        if lost >= LOSS_GUARD_PACKETS and share > LOSS_GUARD:
            return True
        return lost >= QUEUE_LOSS_PACKETS and share > QUEUE_LOSS_GUARD and self._queued()

    def _queued(self) -> bool:
        """Whether even the round's least RTT shows a queue at the bottleneck."""
        min_rtt, least = self.min_rtt, self._round_min_rtt
        return (
            min_rtt is not None
            and not math.isinf(least)
            and least > min_rtt + max(min_rtt * QUEUE_RTT_SHARE, QUEUE_RTT_FLOOR)
        )

    def _check_full_pipe(self, app_limited: bool) -> None:
        if self.phase is not Phase.STARTUP or app_limited:
            return
        bw = self.bandwidth
        if bw >= self._full_bw * FULL_BW_GROWTH:
            self._full_bw = bw
            self._full_bw_rounds = 0
            return
        self._full_bw_rounds += 1
        if self._full_bw_rounds >= FULL_BW_ROUNDS:
            self._filled_pipe = True
            self._enter(Phase.DRAIN)

    def _advance(self, now: float) -> None:
        if self._probe_rtt_due and self.phase is not Phase.PROBE_RTT:
            self._probe_rtt_due = False
            self._prior_cwnd = max(self._prior_cwnd, self.congestion_window)
            self._probe_rtt_done = None
            self._enter(Phase.PROBE_RTT, now)
        if self.phase is Phase.PROBE_RTT:
            self._probe_rtt(now)
        elif self.phase is Phase.DRAIN and self._own_in_flight <= self._bdp():
            self._enter(Phase.PROBE_BW, now)
        elif self.phase is Phase.PROBE_BW and self.min_rtt is not None:
            self._cycle_gain(now, self.min_rtt)
        bw = self.bandwidth
        if bw > 0 and self.pacing_rate is not None:  # else the first RTT sample sets it
            rate = self._pacing_gain * bw
            # STARTUP never slows down on a low sample; the other phases follow the model
            if self.phase is not Phase.STARTUP or rate > self.pacing_rate:
                self.pacing_rate = rate

    def _probe_rtt(self, now: float) -> None:
        """Hold the small window for PROBE_RTT_TIME and a round, then go back."""
        done = self._probe_rtt_done
        if done is None:
            if self._own_in_flight <= self._probe_rtt_window():
                self._probe_rtt_done = now + PROBE_RTT_TIME
                self._next_round_delivered = self._delivered  # a whole round from here
                self._probe_rtt_round = self._round
        elif now >= done and self._round > self._probe_rtt_round:
            self._min_rtt_stamp = now  # what PROBE_RTT saw is the minimum for a while
            self._expired_min_rtt = math.inf
            self.congestion_window = max(self.congestion_window, self._prior_cwnd)
            self._prior_cwnd = 0
            self._enter(Phase.PROBE_BW if self._filled_pipe else Phase.STARTUP, now)

    def _cycle_gain(self, now: float, min_rtt: float) -> None:
        gain = PROBE_GAINS[self._cycle]
        elapsed = now - self._cycle_stamp > min_rtt
        bdp = self._bdp()
        in_flight = self._own_in_flight
        if gain > 1.0:  # probe for a round, until the target is in flight or a loss
            done = elapsed and (in_flight >= gain * bdp or self._round_lost_packets > 0)
        elif gain < 1.0:  # drain until the queue is gone or a round passed
            done = elapsed or in_flight <= bdp
        else:
            done = elapsed
        if done:
            self._cycle = (self._cycle + 1) % len(PROBE_GAINS)
            self._cycle_stamp = now
            self._pacing_gain = PROBE_GAINS[self._cycle]

    def _probe_rtt_window(self) -> float:
        # From the minimum RTT before it expired, if lower: the sample that replaced it
        # may include the very queue PROBE_RTT is to drain.
        bdp = self.bandwidth * min(self._min_rtt, self._expired_min_rtt)
        if math.isinf(bdp) or math.isnan(bdp):
            bdp = 0.0
        return max(PROBE_RTT_SHARE * bdp, MIN_WINDOW_PACKETS * self._max_datagram_size)

    def _enter(self, phase: Phase, now: float = 0.0) -> None:
        self.phase = phase
        if phase is Phase.STARTUP:
            self._pacing_gain = HIGH_GAIN
        elif phase is Phase.DRAIN:
            self._pacing_gain = DRAIN_GAIN
        elif phase is Phase.PROBE_RTT:
            self._pacing_gain = 1.0
        else:
            self._cycle = 2
            self._cycle_stamp = now
            self._pacing_gain = PROBE_GAINS[self._cycle]

    def _set_window(self, acked: int) -> None:
        bdp = self._bdp()
        mds = self._max_datagram_size
        if bdp <= 0:  # no model yet: grow as slow start does
            self.congestion_window += acked
            return
        target = CWND_GAIN * bdp + 3 * mds  # + room for bunched packets
        if self._filled_pipe:
            self.congestion_window = int(min(self.congestion_window + acked, target))
        elif self.congestion_window < target or self._delivered < K_INITIAL_WINDOW * mds:
            self.congestion_window += acked
        if self.phase is Phase.PROBE_RTT:
            self.congestion_window = int(min(self.congestion_window, self._probe_rtt_window()))
        self.congestion_window = max(self.congestion_window, MIN_WINDOW_PACKETS * mds)


class RatePacer(QuicPacketPacer):
    """aioquic's pacer, pacing at the controller's ``pacing_rate`` when it has one, and
    charging every packet sent in full.

    aioquic paces at window / smoothed RTT (for BBR's window of twice the bandwidth-delay
    product, twice the measured bandwidth). Its pacer also lets a packet out on any
    credit at all and then rounds the credit down to zero rather than below it, so every
    wake-up between two pacing ticks (an ACK arriving) sent a packet for free; and
    aioquic sends whenever an ACK is due without asking the pacer. Together the sender
    ran well above the pacing rate, window-bound, and overflowed a shallow bottleneck
    queue (a third of the packets lost on a model path with a 2 MB/s link and a 64 KiB
    queue). Here a packet always costs its time: one sent without enough credit leaves a
    debt, up to :data:`MAX_DEBT_PACKETS` packets' time, that the next ones wait out."""

    def __init__(self, cc: BbrCongestionControl, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._cc = cc

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        """Pace at the model's rate; keep aioquic's burst allowance (a quarter window, at
        most 16 packets)."""
        rate = self._cc.pacing_rate
        if rate is None or rate <= 0:
            super().update_rate(congestion_window, smoothed_rtt)
            return
        super().update_rate(congestion_window, congestion_window / rate)

    def next_send_time(self, now: float) -> float | None:  # type: ignore[override]
        """None when a packet may go now, else when it may (the debt paid off)."""
        packet_time = self.packet_time
        if packet_time is None:
            return None
        self.update_bucket(now=now)
        if self.bucket_time > 0:
            return None
        return now + max(packet_time, -self.bucket_time)

    def update_after_send(self, now: float) -> None:
        """Charge a sent packet, paced or not."""
        packet_time = self.packet_time
        if packet_time is not None:
            self.update_bucket(now=now)
            debt = min(MAX_DEBT_PACKETS * packet_time, MAX_DEBT_TIME)
            self.bucket_time = max(self.bucket_time - packet_time, -debt)


MAX_DEBT_PACKETS = 32
MAX_DEBT_TIME = 0.005
"""Most sending time that unpaced packets may leave owing: 32 packets' worth, and at
most 5 ms (aioquic charges ACK-only packets too, and a side that only received sent
nothing else: at a low pacing rate its debt held back its next data for seconds)."""


register_congestion_control(NAME, BbrCongestionControl)
