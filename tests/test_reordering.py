"""Loss detection that adapts to reordering (p2pdist.transport.reordering), driven packet
by packet: which packets it declares lost, when its window widens and narrows, and what
a path change resets. (Whole transfers over a reordering model path: test_bbr.py.)"""

from __future__ import annotations

from aioquic.quic.congestion.cubic import CubicCongestionControl
from aioquic.quic.congestion.reno import RenoCongestionControl
from aioquic.quic.packet import QuicPacketType
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.quic.rangeset import RangeSet
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.tls import Epoch

from p2pdist.transport.reordering import CALM_EPISODES, MAX_WINDOW_STEPS, ReorderingRecovery

RTT = 0.1


class Sender:
    """A loss recovery and one packet space, with packets sent and ACKs received at
    chosen times."""

    def __init__(self, cc: str = "reno") -> None:
        self.recovery = ReorderingRecovery(
            congestion_control_algorithm=cc,
            initial_rtt=RTT,
            max_datagram_size=1200,
            peer_completed_address_validation=True,
            send_probe=lambda: None,
        )
        self.space = QuicPacketSpace(is_application_data=True)
        self.recovery.spaces = [self.space]
        self.recovery.handshake_confirmed = True
        self.next_number = 0
        self.lost: list[int] = []

    def send(self, count: int, now: float) -> list[int]:
        numbers = []
        for _ in range(count):
            packet = QuicSentPacket(
                epoch=Epoch.ONE_RTT,
                in_flight=True,
                is_ack_eliciting=True,
                is_crypto_packet=False,
                packet_number=self.next_number,
                packet_type=QuicPacketType.ONE_RTT,
                sent_time=now,
                sent_bytes=1200,
            )
            packet.delivery_handlers.append((self._delivered, (self.next_number,)))
            self.recovery.on_packet_sent(packet=packet, space=self.space)
            numbers.append(self.next_number)
            self.next_number += 1
        return numbers

    def _delivered(self, state: object, number: int) -> None:
        if getattr(state, "name", "") == "LOST":
            self.lost.append(number)

    def ack(self, ranges: list[tuple[int, int]], now: float) -> None:
        """Acknowledge packets ``start..stop - 1`` for each range."""
        acked = RangeSet()
        for start, stop in ranges:
            acked.add(start, stop)
        self.recovery.on_ack_received(ack_rangeset=acked, ack_delay=0.0, now=now, space=self.space)

    def timeout(self, now: float) -> None:
        self.recovery.on_loss_detection_timeout(now=now)


def test_in_order_the_packet_threshold_declares_losses_at_once() -> None:
    s = Sender()
    s.send(10, 0.0)
    s.ack([(0, 2), (5, 10)], RTT)  # 2, 3, 4 missing: 2 is 7 packets below the largest
    assert s.lost == [2, 3, 4] and not s.recovery.reordering  # aioquic's rule: 3 packets
    assert s.recovery.packets_lost == 3
    s.send(2, RTT)  # 10, 11
    s.recovery.reschedule_data(now=RTT + 0.01)  # a probe's early resend: no loss declared
    assert s.recovery.packets_lost == 3 and s.lost == [2, 3, 4, 10]


def test_a_late_packet_turns_loss_detection_to_time_only() -> None:
    s = Sender()
    s.send(10, 0.0)
    s.ack([(0, 1), (2, 10)], RTT)  # 1 is 8 below the largest: declared lost
    assert s.lost == [1]
    s.ack([(0, 10)], RTT + 0.005)  # ...and it came after all
    assert s.recovery.spurious_losses == 1 and s.recovery.window_steps == 1
    # From now on a gap is a loss only once a round trip and a quarter old.
    s.send(10, 0.2)
    s.ack([(15, 20)], 0.3)
    assert s.lost == [1]
    assert s.space.loss_time is not None
    assert abs(s.space.loss_time - (0.2 + 1.25 * s.recovery._rtt_smoothed)) < 1e-9
    s.timeout(s.space.loss_time)
    assert s.lost == [1, 10, 11, 12, 13, 14]


def test_a_packet_overtaken_before_its_loss_shows_reordering_too() -> None:
    s = Sender()
    s.send(10, 0.0)
    s.ack([(0, 3), (4, 6)], RTT)  # 3 is 2 below the largest: not lost yet
    s.ack([(0, 6)], RTT + 0.001)  # newly acknowledged below the largest: reordered
    assert s.lost == [] and s.recovery.window_steps == 1 and s.recovery.spurious_losses == 0


def test_the_window_widens_once_a_round_trip_up_to_one_round_trip_and_narrows_when_calm() -> None:
    s = Sender()
    now = 0.0

    def loss(*, spurious: bool = True) -> None:
        """A packet declared lost (9 later ones acknowledged), then, if ``spurious``,
        acknowledged after all."""
        nonlocal now
        first = s.send(10, now)[0]
        now += RTT
        s.ack([(first + 1, first + 10)], now)
        if s.space.loss_time is not None:  # time only: lost once it is old enough
            now = s.space.loss_time
            s.timeout(now)
        assert s.lost[-1] == first
        if spurious:
            s.ack([(first, first + 10)], now + 0.001)

    loss()
    loss()  # a round trip later: widened
    assert s.recovery.window_steps == 2
    first = s.send(12, now)[0]
    s.ack([(first + 11, first + 12)], now + 0.01)
    assert s.space.loss_time is not None
    now = s.space.loss_time
    s.timeout(now)
    assert s.lost[-11:] == list(range(first, first + 11))
    before = s.recovery.spurious_losses
    s.ack([(first, first + 5), (first + 11, first + 12)], now + 0.001)
    assert s.recovery.window_steps == 3
    s.ack([(first, first + 12)], now + 0.002)  # the same round trip: not widened again
    assert s.recovery.window_steps == 3 and s.recovery.spurious_losses == before + 11
    for _ in range(MAX_WINDOW_STEPS):
        now += 2 * RTT
        loss()
    assert s.recovery.window_steps == MAX_WINDOW_STEPS
    for _ in range(CALM_EPISODES - 1):  # real losses, none acknowledged later
        now += 2 * RTT
        loss(spurious=False)
    assert s.recovery.window_steps == MAX_WINDOW_STEPS
    now += 2 * RTT
    loss(spurious=False)
    assert s.recovery.window_steps == MAX_WINDOW_STEPS - 1


def test_a_new_path_starts_without_reordering_and_ignores_the_old_paths_packets() -> None:
    s = Sender()
    s.send(10, 0.0)
    s.ack([(0, 1), (2, 10)], RTT)
    s.ack([(0, 10)], RTT + 0.001)
    assert s.recovery.reordering
    old = s.send(5, 0.2)  # still in flight on the old path (the relay, say)
    s.recovery.new_path(s.next_number)
    assert not s.recovery.reordering
    new = s.send(5, 0.21)
    s.ack([(new[0], new[-1] + 1)], 0.25)  # the new, shorter path's ACKs come first
    s.ack([(old[0], new[-1] + 1)], 0.3)  # then the old path's packets: no reordering
    assert not s.recovery.reordering
    assert s.lost == [1, *old]  # lost by the count (before its ACK came): sent again


def test_a_packet_overtaken_then_a_spurious_loss_widen_once_in_a_round_trip() -> None:
    s = Sender()
    s.send(20, 0.0)
    s.ack([(0, 3), (4, 20)], RTT)  # 3 is declared lost (16 below the largest)...
    s.ack([(0, 1), (2, 20)], RTT + 0.001)  # ...and 1 was overtaken, found now: reordering
    assert s.recovery.window_steps == 1
    s.ack([(0, 20)], RTT + 0.002)  # 3 came after all: a spurious loss, the same round trip
    assert s.recovery.spurious_losses == 1 and s.recovery.window_steps == 1


def test_a_burst_of_losses_declared_a_few_at_a_time_is_one_episode() -> None:
    """Time declares the losses of a paced burst one packet per timer; they are one loss
    episode, not one each (the window would narrow after a single long burst)."""
    s = Sender()
    s.recovery.window_steps = 2
    for i in range(2 * CALM_EPISODES):
        s.send(1, i * 0.001)  # paced: a packet a millisecond
    last = s.next_number - 1
    s.ack([(last, last + 1)], 0.1)
    declared = 0
    while s.space.loss_time is not None and declared < 100:
        s.timeout(s.space.loss_time + 1e-9)  # (the clock moves on past the deadline)
        declared += 1
    assert s.lost == list(range(last)) and declared > CALM_EPISODES
    assert s.recovery.window_steps == 2


def test_a_reno_window_cut_for_losses_that_were_none_is_undone() -> None:
    """Reno halves its window for a loss; when every packet behind that cut is
    acknowledged after all, the window it had comes back (the losses of its recovery
    after it included). Until then, and for a cut with one real loss, the cut stands."""
    s = Sender()
    cc = s.recovery._cc
    assert isinstance(cc, RenoCongestionControl)
    s.send(20, 0.001)  # (Reno cuts only for packets sent after its last cut, at 0.0)
    s.ack([(0, 3), (7, 20)], RTT)  # 3..6 declared lost: the window is halved
    assert s.lost == [3, 4, 5, 6] and cc.ssthresh is not None
    cut = cc.congestion_window
    s.ack([(0, 6), (7, 20)], RTT + 0.001)  # 3, 4 and 5 came: 6 may still be lost
    assert cc.congestion_window == cut and s.recovery.undone == 0
    s.ack([(0, 20)], RTT + 0.002)  # ...and 6
    assert cc.congestion_window >= 2 * cut and cc.ssthresh is None  # back in slow start
    assert s.recovery.undone == 1
    s.send(10, 0.2)  # a real loss this time
    s.ack([(20, 21), (22, 30)], 0.3)
    assert s.space.loss_time is not None  # time only now: lost when old enough
    s.timeout(s.space.loss_time + 1e-9)
    assert s.lost[-1] == 21
    cut = cc.congestion_window
    s.send(10, 0.5)
    s.ack([(20, 21), (22, 40)], 0.6)  # later packets acknowledged, 21 never: no undo
    assert cc.congestion_window == cut and s.recovery.undone == 1


def test_a_real_loss_in_the_cuts_recovery_keeps_the_cut() -> None:
    """A later loss of the recovery the cut began (a packet sent before the cut), declared
    before the late acknowledgements of the cut's own losses, is real: no undo."""
    s = Sender()
    cc = s.recovery._cc
    s.send(20, 0.001)
    s.send(10, 0.05)
    s.ack([(0, 3), (7, 20)], RTT)  # 3..6 lost: the window is halved
    cut = cc.congestion_window
    s.ack([(0, 3), (7, 25), (26, 30)], 0.16)  # 25 missing: lost, in the same recovery
    assert 25 in s.lost
    s.ack([(0, 25), (26, 30)], 0.17)  # 3..6 came after all; 25 never
    assert cc.congestion_window == cut and s.recovery.undone == 0


def test_after_an_undo_a_real_loss_of_a_packet_sent_before_the_cut_cuts_again() -> None:
    """The undo ends the cut's recovery: a packet sent before the cut and lost for real
    afterwards is a congestion signal again (it fell inside the recovery period, which
    Reno ignores, while the window stood at its full size)."""
    s = Sender()
    cc = s.recovery._cc
    s.send(20, 0.001)
    s.send(10, 0.05)
    s.ack([(0, 3), (7, 20)], RTT)  # 3..6 lost: cut
    s.ack([(0, 20)], RTT + 0.001)  # all came: undone
    assert s.recovery.undone == 1
    window = cc.congestion_window
    s.ack([(0, 25), (26, 30)], 0.16)  # 25 missing, 26..29 acknowledged
    assert s.space.loss_time is not None  # time only since the spurious loss
    s.timeout(s.space.loss_time + 1e-9)
    assert 25 in s.lost and cc.congestion_window < window


def test_an_undo_restores_the_recovery_period_before_the_cut_and_the_pacing_rate() -> None:
    """A real cut, then a spurious one, undone: the first cut's recovery period is the
    one in force again (a loss of a packet sent before it does not cut, one sent after
    it does), and the pacer paces at the restored window again."""
    s = Sender()
    cc = s.recovery._cc
    s.send(10, 0.01)  # 0..9
    s.ack([(0, 1), (5, 10)], RTT)  # 1..4 lost for real: the first cut, at 0.1
    first_start = cc._congestion_recovery_start_time
    s.send(10, 0.05 + RTT)  # 10..19, after the first cut
    s.send(10, 0.15 + RTT)  # 20..29
    s.ack([(0, 1), (5, 12), (16, 30)], 0.2 + RTT)  # 12..15 lost: the second cut
    assert cc._congestion_recovery_start_time > first_start
    slow = s.recovery._pacer.packet_time
    s.ack([(0, 1), (5, 30)], 0.2 + RTT + 0.001)  # 12..15 came: the second cut undone
    assert s.recovery.undone == 1
    assert cc._congestion_recovery_start_time == first_start
    assert slow is not None and s.recovery._pacer.packet_time is not None
    assert s.recovery._pacer.packet_time < slow


def test_a_cubic_window_cut_for_losses_that_were_none_is_undone_curve_and_all() -> None:
    """Cubic's cut changes more than the window: W_max (lowered further by fast
    convergence), the slow-start threshold, and, on the next ACK, a new epoch of its
    curve and Reno-friendly estimate. Undone, all of it comes back, so the window grows
    on along the curve it was on; a real loss afterwards cuts again."""
    s = Sender("cubic")
    cc = s.recovery._cc
    assert isinstance(cc, CubicCongestionControl)
    s.send(40, 0.001)  # 0..39
    s.ack([(0, 10), (11, 20)], RTT)  # 10 declared lost: the first cut, a real one
    assert s.lost == [10]
    s.ack([(0, 10), (11, 40)], RTT + 0.001)  # congestion avoidance: a new epoch
    s.send(16, RTT + 0.002)  # 40..55, within the window
    s.ack([(40, 44)], 2 * RTT)
    names = ("ssthresh", "_W_max", "K", "_cwnd_epoch", "_t_epoch", "_first_slow_start")
    before = {name: getattr(cc, name) for name in names}
    estimate = cc._W_est
    window = cc.congestion_window
    s.ack([(40, 44), (45, 50)], 2 * RTT + 0.001)  # 44 declared lost: the second cut
    assert s.lost == [10, 44]
    assert cc.congestion_window < window and cc.ssthresh != before["ssthresh"]
    s.ack([(40, 44), (45, 53)], 3 * RTT)  # an ACK in the cut's recovery: a new epoch
    assert cc._t_epoch != before["_t_epoch"] and cc._W_max != before["_W_max"]
    s.ack([(40, 53)], 3 * RTT + 0.001)  # 44 came after all: undone
    assert s.recovery.undone == 1
    assert cc.congestion_window >= window
    assert {name: getattr(cc, name) for name in names} == before  # the same curve
    assert cc._W_est >= estimate  # (the ACK that cut also grew it first)
    assert cc._starting_congestion_avoidance is False
    s.send(10, 0.5)  # 56..65; a real loss cuts again
    s.ack([(53, 57), (58, 66)], 0.6)
    assert s.space.loss_time is not None  # time only since the spurious loss
    s.timeout(s.space.loss_time + 1e-9)
    assert 57 in s.lost and cc.congestion_window < window


def test_a_cubic_cut_is_not_undone_once_cubic_started_over() -> None:
    """Cubic starts over (its idle reset after 2 s without ACKs) between a cut and the
    late ACKs that show the cut spurious: restoring the window and curve from before the
    cut would undo the reset instead. The undo is dropped."""
    s = Sender("cubic")
    cc = s.recovery._cc
    assert isinstance(cc, CubicCongestionControl)
    s.send(40, 0.001)
    s.ack([(0, 10), (11, 20)], RTT)  # 10 declared lost: a cut
    assert cc.ssthresh is not None
    s.send(1, 2.5)  # 2.4 s after the last ACK: Cubic resets
    assert cc.ssthresh is None
    reset_window = cc.congestion_window
    s.ack([(0, 40)], 2.6)  # 10 came after all
    assert s.recovery.undone == 0 and s.recovery._undo is None
    assert cc.congestion_window >= reset_window and cc.ssthresh is None
