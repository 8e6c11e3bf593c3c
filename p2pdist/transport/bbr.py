"""A model-based congestion controller for QUIC's direct paths (BBR, after Cardwell et
al., "BBR: Congestion-Based Congestion Control", ACM Queue 2016, and the IETF draft
draft-cardwell-iccrg-bbr-congestion-control), plugged into aioquic's loss recovery.

Why: aioquic ships Reno and CUBIC, which read every lost packet as congestion. On a
100 ms internet path that drops 0.5-1% of packets at random (wifi, a busy home router)
they hold a window of 15-30 KB, about 200 KB/s, and a 1 MiB all-reduce took 4-9 s where
it took 0.23 s without loss. BBR sends at the bottleneck bandwidth it measures and does not
back off for loss it cannot tell from noise, so the same call takes (see
docs/nat-traversal.md 6 for the figures) a fraction of that.

The model, updated on every acknowledgement (all sans-I/O, ``now`` passed in):

* *Bottleneck bandwidth*: the largest delivery rate measured over the last
  :data:`BW_WINDOW_ROUNDS` round trips. A packet remembers, when sent, how much had been
  delivered and when; its acknowledgement gives one rate sample, over the longer of its
  send and acknowledgement intervals. Samples over less than the minimum RTT are dropped
  (acknowledgements bunched by the receiver's event loop would overstate the rate), and
  samples of packets sent while the application had nothing more to send
  (:meth:`BbrCongestionControl.on_app_limited`) may raise the estimate but never lower it.
* *Minimum RTT*: the least round trip seen over the last 10-20 s.
* The window is ``cwnd_gain`` times their product (the path's bandwidth-delay product),
  and the pacing rate (:class:`RatePacer`) ``pacing_gain`` times the bandwidth.

The phases: STARTUP doubles the rate every round trip until the bandwidth stops growing
by 25% over three rounds; DRAIN empties the queue STARTUP built; PROBE_BW then cruises at
the measured bandwidth, probing 25% above it one round in eight and draining for the
next. Two departures from BBR v1, both in the safe direction:

* No PROBE_RTT phase. The minimum RTT comes from a 10-20 s window instead; collectives
  leave idle gaps that show the empty-queue round trip, and pacing at the measured
  bandwidth keeps the standing queue small.
* A loss guard, after BBR v2: a round trip that loses over :data:`LOSS_GUARD` of what it
  sent (at least :data:`LOSS_GUARD_PACKETS` packets) resets the bandwidth estimate to
  the rate delivered in that round (and ends STARTUP), so a policer or a full bottleneck
  queue brings the rate down, while random loss of a few percent does not.

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
acknowledgements). STARTUP too, as in BBR v3: BBR v1's 2.89 there overfilled shallow
queues."""
BW_WINDOW_ROUNDS = 10
"""Round trips over which the bottleneck bandwidth is the largest rate sample."""
MIN_RTT_WINDOW = 10.0
"""Seconds after which the minimum RTT is taken afresh from the last window's samples."""
FULL_BW_GROWTH = 1.25
FULL_BW_ROUNDS = 3
"""STARTUP ends after this many rounds without FULL_BW_GROWTH in bandwidth."""
MIN_WINDOW_PACKETS = 4
LOSS_GUARD = 0.15
"""Fraction of a round's bytes lost above which the bandwidth estimate is reset."""
QUEUE_LOSS_GUARD = 0.02
"""The same, for a round whose least RTT shows a standing queue (see QUEUE_RTT_SHARE)."""
APP_LIMITED_BACKOFF = 0.85
"""A congested round in which the sender ran out of data delivered less than the path
carries: the bandwidth estimate then drops to this share of itself (or to the round's
rate, if higher)."""
QUEUE_RTT_SHARE = 0.125
QUEUE_RTT_FLOOR = 0.004
"""A round's least RTT shows a standing queue when it exceeds the minimum RTT by this
share of it, and by at least this many seconds (the event loops' own jitter)."""
LOSS_GUARD_PACKETS = 3
"""Fewest lost packets in a round for the loss guard to act (small rounds are noise)."""


class Phase(Enum):
    """BBR's state machine."""

    STARTUP = "startup"
    DRAIN = "drain"
    PROBE_BW = "probe_bw"


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
        self._mds = max_datagram_size
        self.pacing_rate: float | None = None
        self.phase = Phase.STARTUP
        self._pacing_gain = HIGH_GAIN
        self._cwnd_gain = CWND_GAIN
        # delivery accounting
        self._sent: dict[int, _Sent] = {}  # id(packet) -> send-time state, while in flight
        self._delivered = 0
        self._delivered_time = 0.0
        self._first_sent_time = 0.0
        self._app_limited_until = 0  # delivered count; 0 when not app-limited
        # round trips
        self._round = 0
        self._next_round_delivered = 0
        self._round_acked = 0
        self._round_lost = 0
        self._round_lost_packets = 0
        self._round_app_limited = False
        self._round_min_rtt = math.inf
        self._round_start_delivered = 0
        self._round_start_time = 0.0
        # model
        self._bw_samples: deque[tuple[int, float]] = deque()  # (round, rate), max-filter
        self._last_rate = 0.0
        self._min_rtt = math.inf
        self._window_min_rtt = math.inf
        self._min_rtt_epoch: float | None = None
        self._full_bw = 0.0
        self._full_bw_rounds = 0
        self._cycle = 2
        self._cycle_stamp = 0.0

    # ---- the model ---------------------------------------------------------------------

    @property
    def bandwidth(self) -> float:
        """The bottleneck bandwidth estimate, bytes/s (0 before the first sample)."""
        return max((rate for _, rate in self._bw_samples), default=0.0)

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
        if self.bytes_in_flight == 0:  # restarting from idle: no interval spans the gap
            self._first_sent_time = self._delivered_time = sent_time
        self._sent[id(packet)] = _Sent(
            self._delivered,
            self._delivered_time,
            self._first_sent_time,
            self._app_limited_until > 0,
        )
        self.bytes_in_flight += packet.sent_bytes

    def on_app_limited(self) -> None:
        """The sender stopped with room in the window and nothing held by pacing: it had
        nothing more to send. Rate samples until what is in flight now is delivered
        measure the application, not the path."""
        self._app_limited_until = max(self._delivered + self.bytes_in_flight, 1)

    def on_packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        """Count the delivery, take a rate sample, and update the model and window."""
        self.bytes_in_flight -= packet.sent_bytes
        sent = self._sent.pop(id(packet), None)
        if sent is None:  # sent before this controller took over (path change)
            return
        self._delivered += packet.sent_bytes
        self._delivered_time = now
        self._first_sent_time = packet.sent_time or now
        self._round_acked += packet.sent_bytes
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
        """Forget packets of a discarded packet space."""
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            self._sent.pop(id(packet), None)

    def on_packets_lost(self, *, now: float, packets: Iterable[QuicSentPacket]) -> None:
        """Count the loss towards the round's loss guard; the window does not shrink."""
        for packet in packets:
            self.bytes_in_flight -= packet.sent_bytes
            if self._sent.pop(id(packet), None) is not None:
                self._round_lost += packet.sent_bytes
                self._round_lost_packets += 1

    def on_persistent_congestion(self) -> None:
        """Everything was lost for several probe timeouts: the path may have changed, so
        start measuring it afresh from the smallest window."""
        self._bw_samples.clear()
        self._full_bw = 0.0
        self._full_bw_rounds = 0
        self._enter(Phase.STARTUP)
        self.congestion_window = MIN_WINDOW_PACKETS * self._mds
        self.pacing_rate = None

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        """Keep the minimum RTT over a 10-20 s window."""
        rtt = max(rtt, K_GRANULARITY)  # aioquic passes the raw sample, which may be 0
        if self._min_rtt_epoch is None:
            self._min_rtt_epoch = now
        elif now - self._min_rtt_epoch > MIN_RTT_WINDOW and not math.isinf(self._window_min_rtt):
            self._min_rtt = self._window_min_rtt
            self._window_min_rtt = math.inf
            self._min_rtt_epoch = now
        self._window_min_rtt = min(self._window_min_rtt, rtt)
        self._round_min_rtt = min(self._round_min_rtt, rtt)
        self._min_rtt = min(self._min_rtt, rtt)
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
        self._last_rate = rate
        if sent.app_limited and rate < self.bandwidth:
            return
        samples = self._bw_samples
        while samples and samples[-1][1] <= rate:  # monotone deque: a windowed max
            samples.pop()
        samples.append((self._round, rate))
        while samples[0][0] <= self._round - BW_WINDOW_ROUNDS:
            samples.popleft()

    def _end_round(self, now: float) -> None:
        """A round trip ended: apply the loss guard to it and start the next."""
        self._round += 1
        if self._congested():
            elapsed = now - self._round_start_time
            delivered = self._delivered - self._round_start_delivered
            rate = delivered / elapsed if elapsed > 0 else self._last_rate
            if self._round_app_limited:  # the round's rate understates the path's
                rate = max(rate, APP_LIMITED_BACKOFF * self.bandwidth)
            if rate > 0:
                self._bw_samples.clear()
                self._bw_samples.append((self._round, rate))
            if self.phase is Phase.STARTUP:
                self._enter(Phase.DRAIN)
        elif self.phase is Phase.STARTUP and self._standing_queue():
            self._enter(Phase.DRAIN)  # the pipe is full: the queue grows (as HyStart)
        self._round_acked = self._round_lost = self._round_lost_packets = 0
        self._round_app_limited = False
        self._round_min_rtt = math.inf
        self._round_start_delivered = self._delivered
        self._round_start_time = now

    def _congested(self) -> bool:
        """Whether the round's losses look like congestion: many, or some while even the
        round's least RTT shows a standing queue."""
        if self._round_lost_packets < LOSS_GUARD_PACKETS:
            return False
        share = self._round_lost / (self._round_acked + self._round_lost)
        if share > LOSS_GUARD:
            return True
        return self._standing_queue() and share > QUEUE_LOSS_GUARD

    def _standing_queue(self) -> bool:
        """Whether even the round's least RTT shows a queue at the bottleneck."""
        min_rtt = self.min_rtt
        return min_rtt is not None and self._round_min_rtt > min_rtt + max(
            min_rtt * QUEUE_RTT_SHARE, QUEUE_RTT_FLOOR
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
            self._enter(Phase.DRAIN)

    def _advance(self, now: float) -> None:
        if self.phase is Phase.DRAIN and self.bytes_in_flight <= self._bdp():
            self._enter(Phase.PROBE_BW, now)
        elif self.phase is Phase.PROBE_BW and self.min_rtt is not None:
            gain = PROBE_GAINS[self._cycle]
            elapsed = now - self._cycle_stamp > self.min_rtt
            bdp = self._bdp()
            if gain > 1.0:  # probe for a round, until the target is in flight or a loss
                done = elapsed and (
                    self.bytes_in_flight >= gain * bdp or self._round_lost_packets > 0
                )
            elif gain < 1.0:  # drain until the queue is gone or a round passed
                done = elapsed or self.bytes_in_flight <= bdp
            else:
                done = elapsed
            if done:
                self._cycle = (self._cycle + 1) % len(PROBE_GAINS)
                self._cycle_stamp = now
                self._pacing_gain = PROBE_GAINS[self._cycle]
        bw = self.bandwidth
        if bw > 0 and self.pacing_rate is not None:  # else the first RTT sample sets it
            rate = self._pacing_gain * bw
            # STARTUP never slows down on a low sample; the other phases follow the model
            if self.phase is not Phase.STARTUP or rate > (self.pacing_rate or 0.0):
                self.pacing_rate = rate

    def _enter(self, phase: Phase, now: float = 0.0) -> None:
        self.phase = phase
        if phase is Phase.STARTUP:
            self._pacing_gain, self._cwnd_gain = HIGH_GAIN, CWND_GAIN
        elif phase is Phase.DRAIN:
            self._pacing_gain, self._cwnd_gain = DRAIN_GAIN, CWND_GAIN
        else:
            self._cycle = 2
            self._cycle_stamp = now
            self._pacing_gain, self._cwnd_gain = PROBE_GAINS[self._cycle], CWND_GAIN

    def _set_window(self, acked: int) -> None:
        bdp = self._bdp()
        floor = MIN_WINDOW_PACKETS * self._mds
        if bdp <= 0:  # no model yet: grow as slow start does
            self.congestion_window += acked
            return
        target = self._cwnd_gain * bdp + 3 * self._mds  # + room for bunched packets
        if self.phase is not Phase.STARTUP:
            self.congestion_window = int(min(self.congestion_window + acked, target))
        elif self.congestion_window < target or self._delivered < K_INITIAL_WINDOW * self._mds:
            self.congestion_window += acked
        self.congestion_window = max(self.congestion_window, floor)


class RatePacer(QuicPacketPacer):
    """aioquic's pacer, pacing at the controller's ``pacing_rate`` when it has one, and
    keeping account of the packets it did not hold back.

    aioquic paces at window / smoothed RTT (for BBR's window of twice the bandwidth-delay
    product, twice the measured bandwidth), and sends a packet whenever an ACK is due
    without asking the pacer: in an all-reduce, where data flows both ways, about every
    other packet. Its pacer forgets what those cost, so the sender ran at up to twice the
    pacing rate, window-bound, and overflowed a shallow bottleneck queue (a third of the
    packets lost in a lab with a 2 MB/s link and a 64 KiB queue). Here a packet sent
    without credit leaves a debt, up to :data:`MAX_DEBT_PACKETS` packets' time, that the
    next paced packets wait out."""

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
            self.bucket_time = max(self.bucket_time - packet_time, -MAX_DEBT_PACKETS * packet_time)


MAX_DEBT_PACKETS = 32
"""Most packets' worth of sending time that unpaced packets may leave owing."""


register_congestion_control(NAME, BbrCongestionControl)
