"""Keepalive timing (sans-I/O): when to ping and when a silent peer counts as dead."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Keepalive", "KeepaliveAction"]


class KeepaliveAction(enum.Enum):
    """What the glue must do after :meth:`Keepalive.poll`."""

    NONE = "none"
    PING = "ping"
    DEAD = "dead"


@dataclass
class Keepalive:
    """Tracks last send/receive times; ``now`` is always passed in (monotonic seconds)."""

    interval: float
    idle_timeout: float
    last_rx: float
    last_tx: float
    last_poll: float
    rx_paused: bool = False
    """True while we deliberately stopped reading from the peer (backpressure)."""
    last_ping_due: float = float("-inf")
    """When :meth:`poll` last asked for a PING. The glue may be unable to send it (the
    byte pipe is closing): the next one is then due an interval later, not at once."""

    @classmethod
    def start(cls, interval: float, idle_timeout: float, now: float) -> Keepalive:
        """A keepalive that starts counting at ``now``."""
        return cls(interval, idle_timeout, now, now, now)

    def on_receive(self, now: float) -> None:
        """Anything arrived from the peer."""
        self.last_rx = now

    def on_send(self, now: float) -> None:
        """We sent something (so no ping is needed for a while)."""
        self.last_tx = now

    def set_rx_paused(self, paused: bool, now: float) -> None:
        """We stopped (``True``) or resumed (``False``) reading from the peer.

        While we are not reading, the peer's pings and answers pile up unread, so its
        silence is our own doing: :meth:`poll` never declares it dead then, and the idle
        period starts afresh when reading resumes.
        """
        self.rx_paused = paused
        self.last_rx = max(self.last_rx, now)

    def poll(self, now: float) -> KeepaliveAction:
        """Decide what to do at ``now``.

        When our own polls were late by several intervals, this process was stalled
        (a long computation blocked the event loop), so the peer's silence is not
        evidence against it: give it a fresh idle period instead of declaring it dead.
        """
        stalled = now - self.last_poll > 3 * self.interval
        self.last_poll = now
        if stalled or self.rx_paused:
            self.last_rx = max(self.last_rx, now - self.interval)
        if now - self.last_rx >= self.idle_timeout:
            return KeepaliveAction.DEAD
        if now - max(self.last_tx, self.last_ping_due) >= self.interval:
            self.last_ping_due = now
            return KeepaliveAction.PING
        return KeepaliveAction.NONE

    def next_deadline(self) -> float:
        """When :meth:`poll` should be called next: after a poll that did not return
        DEAD, always later than that poll (a PING that could not be sent is retried an
        interval later), so a timer armed at it never fires in a loop."""
        ping_at = max(self.last_tx, self.last_ping_due) + self.interval
        return min(ping_at, self.last_rx + self.idle_timeout)
