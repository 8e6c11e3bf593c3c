"""Loss detection that adapts to reordering (aioquic's recovery, RACK's lesson).

aioquic declares a packet lost once a packet sent 3 later is acknowledged, or once it
is 9/8 of a round trip old while a later one is acknowledged (RFC 9002 6.1). Internet
paths reorder: a few milliseconds of jitter on a path moving thousands of packets a
second puts hundreds of packets between two that left in order. Each is then "lost",
sent again, and the congestion controller backs off for a loss that never happened: on
a model path of 100 ms and 4 MB/s, 10 ms of jitter made a 4 MiB transfer take 29 s on
Reno and 5 s on BBR, against 1.5 s in order (tests/test_bbr.py).

:class:`ReorderingRecovery` keeps aioquic's thresholds until the path shows that it
reorders, then does what TCP's RACK (RFC 8985) does:

* **Reordering seen** (a packet acknowledged newly while a later one already was, or an
  acknowledgement for a packet already declared lost, a *spurious* loss): the packet
  threshold is dropped, and only time declares a packet lost, once it is a round trip
  plus a reordering window old (a quarter of a round trip to start with).
* **Each spurious loss** (at most one per round trip) widens the window by a quarter of
  a round trip, up to a whole one: the path reorders by more than the window.
* **16 loss episodes without a spurious one** narrow it by a step again (never below
  the first), so a path that stopped reordering detects real losses sooner again. An
  episode starts with a loss of a packet sent after the last episode began (the losses
  of one burst, declared a few at a time, are one), as a recovery period does.

Declared-lost packet numbers are remembered (the latest :data:`REMEMBERED_LOSSES` per
packet space) so that their late acknowledgements can be recognised; aioquic forgets a
packet once it is declared lost. A Reno or Cubic window cut whose losses all turn out
spurious (those of its recovery declared after it included) is undone: the window and
the state the cut changed come back (the slow-start threshold and recovery period, and
Cubic's curve: its W_max, epoch and Reno-friendly estimate), so the window grows on as
if the cut had not been, and a later loss of a packet sent since that recovery period
began cuts again. A cut replaced by another before its undo stays (the undo of the later
one restores the window between them). BBR's model is left as it is (it hardly reacts
to loss).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass

from aioquic.quic.congestion.base import QuicCongestionControl
from aioquic.quic.congestion.cubic import CubicCongestionControl
from aioquic.quic.congestion.reno import RenoCongestionControl
from aioquic.quic.packet_builder import QuicSentPacket
from aioquic.quic.rangeset import RangeSet
from aioquic.quic.recovery import (
    K_PACKET_THRESHOLD,
    K_TIME_THRESHOLD,
    QuicPacketRecovery,
    QuicPacketSpace,
)

__all__ = ["MAX_WINDOW_STEPS", "REMEMBERED_LOSSES", "ReorderingRecovery"]

WINDOW_STEP = 0.25
"""The reordering window grows by this share of the round trip per step (as RACK's by
min_RTT / 4; here of the round trip aioquic's time threshold uses, the larger of the
latest and the smoothed)."""
MAX_WINDOW_STEPS = 4
"""At most this many steps: a window of one round trip, a loss declared after two."""
CALM_EPISODES = 16
"""Loss episodes without a spurious loss after which the window narrows by a step."""
REMEMBERED_LOSSES = 4096
"""Declared-lost packet numbers kept per packet space to recognise late acknowledgements."""


_CUT_STATE: dict[type[QuicCongestionControl], tuple[str, ...]] = {
    RenoCongestionControl: ("ssthresh", "_congestion_recovery_start_time"),
    CubicCongestionControl: (
        "ssthresh",
        "_congestion_recovery_start_time",
        "_W_max",
        "_first_slow_start",
        "_starting_congestion_avoidance",
        "K",
        "_W_est",
        "_cwnd_epoch",
        "_t_epoch",
    ),
}
"""Per controller that cuts its window on loss, the attributes besides the window that a
cut changes (at once, or on the next ACK, as Cubic's new epoch): what an undo restores.
The recovery period's start among them: undone, the cut's recovery ends (a later loss of
a packet sent before the cut then counts, and cuts again)."""


@dataclass(slots=True)
class _Undo:
    """A window cut that may be undone: the window and state before it, and the packets
    (space, number) whose loss it answered (and losses of the same recovery after it) not
    yet acknowledged."""

    cc: QuicCongestionControl
    window: int
    state: dict[str, object]
    outstanding: set[tuple[QuicPacketSpace, int]]


def _cut_state(cc: QuicCongestionControl) -> dict[str, object] | None:
    """What an undo of a cut by ``cc`` restores, as it is now (None: ``cc`` does not cut
    its window on loss)."""
    for klass in type(cc).__mro__:
        names = _CUT_STATE.get(klass)
        if names is not None:
            return {name: getattr(cc, name) for name in names}
    return None


class ReorderingRecovery(QuicPacketRecovery):
    """aioquic's loss recovery with a reordering window (see the module docstring)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.window_steps = 0
        """0: aioquic's thresholds (no reordering seen); else the reordering window in
        quarters of a round trip, and no packet threshold."""
        self.packets_lost = 0
        """Packets declared lost (a probe's early resend, which declares no loss, aside)."""
        self.spurious_losses = 0
        """Acknowledgements that came for packets already declared lost."""
        self._calm = 0
        self._episode_start = float("-inf")
        self._widened_at = float("-inf")
        self.undone = 0
        """Window cuts undone: every loss behind them turned out spurious."""
        self._undo: _Undo | None = None
        self._first_number = 0
        """Packets numbered below this were sent on an earlier path."""
        self._lost: dict[QuicPacketSpace, list[int]] = {}
        """Per space, the packet numbers declared lost, ascending (losses are declared in
        packet number order)."""

    def new_path(self, first_number: int) -> None:
        """Datagrams take another path from packet ``first_number`` on: the probe-timeout
        backoff and the RTT estimate start afresh (RFC 9000 9.4: the old path's RTT is
        another route's; what was lost there is resent promptly), and so does reordering,
        which takes nothing from packets sent before (those on the old path may arrive
        after the new path's, which is no reordering of the new path)."""
        self._pto_count = 0
        self._rtt_initialized = False
        self._rtt_first_sample_time = 0.0
        self._rtt_latest = 0.0
        self._rtt_min = math.inf
        self._rtt_smoothed = 0.0
        self._rtt_variance = 0.0
        self.window_steps = 0
        self._calm = 0
        self._lost.clear()
        self._undo = None
        self._first_number = first_number

    @property
    def reordering(self) -> bool:
        """Whether the path has shown reordering (loss is then declared by time only)."""
        return self.window_steps > 0

    # ---- aioquic overrides ----------------------------------------------------------------

    def on_ack_received(
        self, *, ack_rangeset: RangeSet, ack_delay: float, now: float, space: QuicPacketSpace
    ) -> None:
        """Look for reordering in the acknowledgement, then let aioquic handle it."""
        lost = self._lost.get(space)
        if lost and self._acks_any(ack_rangeset, lost):
            self._spurious(ack_rangeset, lost, space, now)
        elif not self.window_steps and self._acks_below(ack_rangeset, space):
            self.window_steps = 1
            self._widened_at = now
        super().on_ack_received(
            ack_rangeset=ack_rangeset, ack_delay=ack_delay, now=now, space=space
        )

    def _detect_loss(self, *, now: float, space: QuicPacketSpace) -> None:
        """RFC 9002 6.1 with this path's thresholds: by packet count only until the path
        reorders, by time (a round trip plus the reordering window) always."""
        rtt = (
            max(self._rtt_latest, self._rtt_smoothed)
            if self._rtt_initialized
            else self._rtt_initial
        )
        steps = self.window_steps
        loss_delay = rtt * (1 + steps * WINDOW_STEP if steps else K_TIME_THRESHOLD)
        largest = space.largest_acked_packet
        by_count = largest - K_PACKET_THRESHOLD if not steps else -1
        sent_before = now - loss_delay
        lost: list[QuicSentPacket] = []
        space.loss_time = None
        for number, packet in space.sent_packets.items():
            if number > largest:
                break
            sent = packet.sent_time
            assert sent is not None  # set as it was sent
            if number <= by_count or sent <= sent_before:
                lost.append(packet)
            else:  # the first one not lost yet: the next loss check is due when it is
                space.loss_time = sent + loss_delay
                break
        self._on_packets_lost(
            now=now,
            packets=lost,
            persistent_congestion=self._in_persistent_congestion(packets=lost),
            space=space,
        )

    def _on_packets_lost(
        self,
        *,
        congestion_event: bool = True,
        now: float,
        packets: Iterable[QuicSentPacket],
        persistent_congestion: bool = False,
        space: QuicPacketSpace,
    ) -> None:
        """aioquic's, remembering a loss episode's packets (not a probe's early resend,
        which declares no loss) and the window cut it may cause."""
        packets = list(packets)
        declared = congestion_event and bool(packets)
        if declared:
            self._remember(packets, space, now)
        cc = self._cc
        window, before = cc.congestion_window, _cut_state(cc)
        super()._on_packets_lost(
            congestion_event=congestion_event,
            now=now,
            packets=packets,
            persistent_congestion=persistent_congestion,
            space=space,
        )
        if not declared:
            return
        numbers = {(space, p.packet_number) for p in packets}
        if before is None or persistent_congestion:
            self._undo = None
        elif cc.congestion_window < window:  # this loss cut the window
            self._undo = _Undo(cc, window, before, numbers)
        elif self._undo is not None:  # the same recovery: undone only if all are spurious
            self._undo.outstanding |= numbers

    def _remember(self, packets: list[QuicSentPacket], space: QuicPacketSpace, now: float) -> None:
        """Count declared losses, keep their numbers (for late ACKs), and count an
        episode, narrowing the window after enough calm ones."""
        self.packets_lost += len(packets)
        lost = self._lost.setdefault(space, [])
        first = self._first_number  # an earlier path's late packets show nothing
        lost.extend(p.packet_number for p in packets if p.packet_number >= first)
        del lost[:-REMEMBERED_LOSSES]
        sent = packets[0].sent_time
        if sent is not None and sent > self._episode_start:
            # A new episode: the first loss sent after the last one began, as a
            # congestion controller's recovery period (the losses of one burst,
            # declared a few at a time, are one).
            self._episode_start = now
            self._calm += 1
            if self._calm >= CALM_EPISODES and self.window_steps > 1:
                self.window_steps -= 1
                self._calm = 0

    def discard_space(self, space: QuicPacketSpace) -> None:
        """Forget the space's lost packets with it."""
        self._lost.pop(space, None)
        super().discard_space(space)

    # ---- internals ------------------------------------------------------------------------

    @staticmethod
    def _acks_any(ack_rangeset: RangeSet, lost: list[int]) -> bool:
        for r in ack_rangeset:
            i = bisect.bisect_left(lost, r.start)
            if i < len(lost) and lost[i] < r.stop:
                return True
        return False

    def _spurious(
        self, ack_rangeset: RangeSet, lost: list[int], space: QuicPacketSpace, now: float
    ) -> None:
        """Packets declared lost were acknowledged after all: forget them, and widen the
        reordering window (at most once a round trip)."""
        undo = self._undo
        for r in ack_rangeset:
            i, j = bisect.bisect_left(lost, r.start), bisect.bisect_left(lost, r.stop)
            self.spurious_losses += j - i
            if undo is not None:
                undo.outstanding.difference_update((space, n) for n in lost[i:j])
            del lost[i:j]
        if undo is not None and not undo.outstanding and undo.cc is self._cc:
            self._take_back(undo)
        self._calm = 0
        rtt = self._rtt_smoothed if self._rtt_initialized else self._rtt_initial
        if not self.window_steps:
            self.window_steps = 1
            self._widened_at = now
        elif self.window_steps < MAX_WINDOW_STEPS and now - self._widened_at >= rtt:
            self.window_steps += 1
            self._widened_at = now

    def _take_back(self, undo: _Undo) -> None:
        """Every loss that cut the window was none: the window and the state the cut
        changed come back, and the pacer paces at that window; unless the controller
        started over since (Cubic's idle reset: no slow-start threshold), which the old
        state would revert."""
        self._undo = None
        cc = undo.cc
        if cc.ssthresh is None:
            return
        cc.congestion_window = max(cc.congestion_window, undo.window)
        for name, value in undo.state.items():
            setattr(cc, name, value)
        self._pacer.update_rate(
            congestion_window=cc.congestion_window, smoothed_rtt=self._rtt_smoothed
        )
        self.undone += 1

    def _acks_below(self, ack_rangeset: RangeSet, space: QuicPacketSpace) -> bool:
        """Whether the acknowledgement newly covers a packet sent on this path before one
        already acknowledged (one still waiting in ``sent_packets`` below the largest)."""
        largest = space.largest_acked_packet
        below = [r for r in ack_rangeset if r.start < largest and r.stop > self._first_number]
        if not below or not space.sent_packets:
            return False
        numbers = list(space.sent_packets)  # ascending, as aioquic keeps them
        for r in below:
            i = bisect.bisect_left(numbers, max(r.start, self._first_number))
            if i < len(numbers) and numbers[i] < min(r.stop, largest):
                return True
        return False
