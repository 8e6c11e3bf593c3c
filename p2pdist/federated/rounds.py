"""The round state machine of federated averaging (sans-I/O: time is passed in).

:class:`FederatedRounds` knows the members, the current round, and the valid updates
collected for it. It is fed ``join``/``leave``/``submit`` with the current time and says,
through :meth:`FederatedRounds.due`, when the round should close. :meth:`close` computes
the aggregate and opens nothing: the caller applies it and calls :meth:`open` again.
The coordinator and the decentralised leader both drive one.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import UsageError
from .aggregate import Reason, aggregate, check_update
from .config import FederatedConfig

__all__ = [
    "CloseReason",
    "Contribution",
    "FederatedRounds",
    "Participant",
    "Phase",
    "RoundOutcome",
    "Verdict",
]

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    """Where the state machine is."""

    WAITING = "waiting"
    """Between rounds: the last one closed, the next (``round``) has not opened."""
    OPEN = "open"
    """Round ``round`` collects updates until :meth:`FederatedRounds.due` says close."""


class CloseReason(enum.StrEnum):
    """Why a round closed."""

    QUORUM = "quorum"
    """Policy ``"quorum"`` and the quorum of valid fresh updates (from the current model)
    was in."""
    COMPLETE = "complete"
    """Every member of the round (those present at its opening and still here) has its
    part in: an update sent for the round, or one from the current model (after a round
    that closed at its deadline, also a late update), or an update sent for the round
    that was rejected (not finite, over the norm bound, the wrong dtype or shape...)."""
    DEADLINE = "deadline"
    """The round's deadline passed."""


@dataclass(frozen=True, slots=True)
class Contribution:
    """One accepted update waiting for its round to close."""

    client: str
    round: int
    """The round the client submitted it for (earlier than the current one: a straggler)."""
    base_round: int
    """The round whose model the update was computed from."""
    num_samples: int
    update: np.ndarray = field(repr=False)
    arrived: float
    """When it arrived (the caller's clock, seconds)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What :meth:`FederatedRounds.submit` did with a submission."""

    accepted: bool
    reason: Reason | None
    """Why it was refused (None when accepted)."""
    detail: str
    staleness: int
    """``round - base_round`` against the round it would count in."""
    carried: bool = False
    """Accepted, but submitted for an earlier round: a straggler rolled into this one."""


@dataclass(frozen=True, slots=True)
class Participant:
    """One update that went into a round's aggregate (or was carried on without one)."""

    client: str
    base_round: int
    num_samples: int
    staleness: int
    weight: float
    """``num_samples * d(staleness)`` (used by the weighted mean only)."""
    carried: bool
    """Submitted for an earlier round."""


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """What happened in one round."""

    round: int
    reason: CloseReason
    opened_at: float
    closed_at: float
    members: int
    """Members at the round's opening."""
    needed: int
    """The quorum as a count."""
    applied: bool
    """True when the round produced an aggregate (quorum met)."""
    participants: tuple[Participant, ...]
    """The updates in the aggregate, in aggregation order (sorted by client id); when the
    quorum was missed, the updates carried into the next round instead."""
    aggregate: np.ndarray | None = field(repr=False)
    """The combined update (not yet multiplied by ``server_lr``), or None."""
    dropped: Mapping[str, int]
    """Drops during the round, by :class:`Reason` value."""
    rejected: Mapping[str, int]
    """Rejections during the round, by :class:`Reason` value."""

    @property
    def stale(self) -> int:
        """Participants whose update was computed from an older round's model."""
        return sum(1 for p in self.participants if p.staleness > 0)

    @property
    def num_dropped(self) -> int:
        """Total drops."""
        return sum(self.dropped.values())

    @property
    def num_rejected(self) -> int:
        """Total rejections."""
        return sum(self.rejected.values())


class FederatedRounds:
    """Members, round ids and the updates collected for the current round.

    ``shape`` and ``dtype`` are the model's: every update must match them. ``label``
    turns a client id into the name logs use (default: the id itself). ``aggregated``
    seeds what :attr:`aggregated` remembers (a new leader takes it from the last
    decision, so an update resent across a failover still counts once).
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        config: FederatedConfig | None = None,
        *,
        first_round: int = 0,
        label: Callable[[str], str] | None = None,
        aggregated: Mapping[str, int] | None = None,
        model_from: int | None = None,
    ) -> None:
        if first_round < 0:
            raise UsageError("round ids start at 0 or later")
        self.shape = tuple(int(s) for s in shape)
        self.dtype: np.dtype[Any] = np.dtype(dtype)
        self.config = config or FederatedConfig()
        self._label = label or str
        self.round = first_round
        """The open round's id, or (between rounds) the id the next round will have."""
        self._model_from = first_round if model_from is None else min(model_from, first_round)
        """The first round whose model is the current one (rounds that applied nothing
        since left it unchanged): an update from it or later is fresh for the quorum."""
        self._after_deadline = False
        """Whether the last round closed at its deadline (see :meth:`_has_part`)."""
        self.phase = Phase.WAITING
        self.members: set[str] = set()
        self.totals: Counter[str] = Counter()
        """Every drop and rejection since construction, by reason."""
        self._pending: dict[str, Contribution] = {}
        self._aggregated: dict[str, int] = {str(c): int(b) for c, b in (aggregated or {}).items()}
        """Per client, the newest ``base_round`` of its updates in an applied aggregate.
        Kept only while a submission from that base or earlier could still pass the
        staleness bound, so it holds at most one int per recent participant."""
        self._forget_aggregated()
        self._expected: set[str] = set()
        self._without_update: set[str] = set()
        """Clients that answered the open round without a valid update: the one they sent
        for it was rejected, or they said they have none (:meth:`abstain`). Their part is
        in, so the round does not wait for them until its deadline (an update that comes
        before it closes still counts)."""
        self._logged: set[str] = set()
        """Clients whose refusal this round was logged at WARNING/INFO (later ones: DEBUG,
        so a client submitting garbage in a loop cannot flood the log)."""
        self._opened_at = 0.0
        self._deadline: float | None = None
        self._needed = 1
        self._members_at_open = 0
        self._dropped: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()

    # ---- membership -------------------------------------------------------------------

    def join(self, client: str) -> None:
        """Add a member. One that joins mid-round may submit to this round, but the round
        does not wait for it (it counts from the next round on)."""
        self.members.add(client)

    def leave(self, client: str) -> None:
        """Remove a member (it left or its connection broke). The open round stops
        waiting for it; an update it already submitted still counts."""
        self.members.discard(client)
        self._expected.discard(client)

    # ---- the round --------------------------------------------------------------------

    @property
    def deadline(self) -> float | None:
        """When the open round closes at the latest (None between rounds)."""
        return self._deadline

    @property
    def needed(self) -> int:
        """The open round's quorum, as a count."""
        return self._needed

    @property
    def model_from(self) -> int:
        """The first round whose model is the current one (later rounds applied nothing):
        an update computed from it or a later round is fresh for the quorum."""
        return self._model_from

    @property
    def aggregated(self) -> dict[str, int]:
        """Per client, the newest ``base_round`` of its updates in an applied aggregate,
        sorted by client (a copy): a submission from that base or an earlier one is a
        ``duplicate``. A base is forgotten once the staleness bound alone refuses it."""
        return dict(sorted(self._aggregated.items()))

    @property
    def submitted(self) -> list[str]:
        """Clients with an accepted update in the current round, sorted."""
        return sorted(self._pending)

    def open(self, now: float) -> float:
        """Open round ``round`` at time ``now``; returns its deadline."""
        if self.phase is Phase.OPEN:
            raise UsageError(f"round {self.round} is already open")
        self.phase = Phase.OPEN
        self._opened_at = now
        self._deadline = now + self.config.round_timeout
        self._expected = set(self.members)
        self._members_at_open = len(self._expected)
        self._needed = self.config.needed(self._members_at_open)
        # Carried updates that this round may no longer count go now, not at its close:
        # else they made the round look complete (or quorate) and close applying nothing.
        self._drop_too_stale()
        return self._deadline

    def submit(
        self,
        client: str,
        round_id: int,
        base_round: int,
        num_samples: Any,
        update: np.ndarray,
        now: float,
    ) -> Verdict:
        """Offer ``client``'s update, sent for round ``round_id`` and computed from the
        model of ``base_round``. It counts in the current round (a straggler's, sent for an
        earlier round, too) when it is valid and not too stale, and no update of the
        client's from ``base_round`` or a later base is already in an applied aggregate
        (a resent update counts once: ``duplicate``; but a carried update sent again for
        the open round becomes the client's part of it, as :meth:`due` counts parts)."""
        target = self.round
        staleness = target - base_round
        if round_id > target:
            return self._refuse(client, Reason.FUTURE, f"sent for round {round_id}", staleness)
        if base_round > round_id or base_round < 0:
            return self._refuse(
                client, Reason.TOO_STALE, f"base round {base_round} is not <= {round_id}", 0
            )
        if staleness > self.config.max_staleness:
            why = f"staleness {staleness} > max_staleness {self.config.max_staleness}"
            return self._refuse(client, Reason.TOO_STALE, why, staleness)
        done = self._aggregated.get(client)
        if done is not None and base_round <= done:
            why = f"already aggregated its update of base round {done}"
            return self._refuse(client, Reason.DUPLICATE, why, staleness)
        problem = check_update(update, num_samples, self.shape, self.dtype, self.config)
        if problem is not None:
            if round_id == target:
                self._without_update.add(client)
            return self._refuse(client, problem[0], problem[1], staleness)
        old = self._pending.get(client)
        if old is not None:
            # The carried update sent again for this round: now the client's part of it.
            resent = base_round == old.base_round and round_id == target > old.round
            if base_round <= old.base_round and not resent:
                why = f"already has an update from base round {old.base_round}"
                return self._refuse(client, Reason.DUPLICATE, why, staleness)
            if not resent:
                self._count(Reason.SUPERSEDED)
                log.info(
                    "round %d: %s's update of base %d superseded",
                    target,
                    self._label(client),
                    old.base_round,
                )
        self._pending[client] = Contribution(
            client, round_id, base_round, int(num_samples), update, now
        )
        return Verdict(True, None, "", staleness, carried=round_id < target)

    def abstain(self, client: str, round_id: int) -> bool:
        """``client`` has no update for round ``round_id`` (none trained, or the one it
        had is too stale to send): when that is the open round (or, between rounds, the
        next), its part is in, so the round does not wait for it. Returns whether it
        counted (False for another round: an earlier round's word says nothing of this
        one)."""
        if round_id != self.round:
            return False
        self._without_update.add(client)
        return True

    def due(self, now: float) -> CloseReason | None:
        """Why the open round should close at ``now``, or None to keep collecting."""
        if self.phase is not Phase.OPEN:
            return None
        # The quorum counts fresh updates only (from the current model: this round's, or
        # an earlier round's when the rounds since applied nothing, as after a missed
        # quorum). A straggler's update is aggregated with them, but counted, it closed
        # rounds before the fresh updates came, which then arrived late in turn: every
        # update stale, round after round (53% accuracy in the example, against 94%
        # with the deadline policy).
        if self.config.policy == "quorum":
            since = self._model_from
            fresh = sum(1 for u in self._pending.values() if u.base_round >= since)
            if fresh >= self._needed:
                return CloseReason.QUORUM
        # Complete once every member it opened with has submitted or left, and the
        # updates in meet the quorum: with fewer (none, or too few after losses), closing
        # would apply nothing and carry them into a round that is complete as it opens;
        # a member that joins before the deadline may still bring what is missing.
        # A member's part is an update it sent for this round (a carried one it sends
        # again too) or one from the current model. A late update for an earlier round
        # is not (unless the last round closed at its deadline: _has_part): counted, a
        # client that was late once (a joiner's first update) was one round stale for
        # good, each round closing before its fresh update came.
        if (
            self._members_at_open
            and len(self._pending) >= self._needed
            and all(self._has_part(c) for c in self._expected)
        ):
            return CloseReason.COMPLETE
        assert self._deadline is not None
        if now >= self._deadline:
            return CloseReason.DEADLINE
        return None

    def _has_part(self, client: str) -> bool:
        """Whether ``client`` has its part of the open round in (see :meth:`due`). After
        a round that closed at its deadline, a late update counts too, whichever earlier
        round it was sent for: its sender is slower than round_timeout (after its late
        update it trains from the round still open, so the next one is two rounds
        late), and waiting for its next update would take every round to the deadline
        (about every other round completes instead, as before). An update sent for this
        round and rejected is the client's part too: waiting for another would hold
        every round to its deadline while the client keeps sending bad ones; so is its
        word that it has none (:meth:`abstain`)."""
        if client in self._without_update:  # rejected, or it has none (whatever it carries)
            return True
        u = self._pending.get(client)
        if u is None:
            return False
        if u.round == self.round or u.base_round >= self._model_from:
            return True
        return self._after_deadline

    def close(self, now: float, reason: CloseReason | None = None) -> RoundOutcome:
        """Close the open round: aggregate when the quorum is met (else carry the updates
        into the next round), advance ``round`` and return what happened."""
        if self.phase is not Phase.OPEN:
            raise UsageError("no round is open")
        why = reason or self.due(now) or CloseReason.DEADLINE
        cfg = self.config
        entries = [self._pending[c] for c in sorted(self._pending)]
        participants = tuple(
            Participant(
                c.client,
                c.base_round,
                c.num_samples,
                self.round - c.base_round,
                c.num_samples * cfg.staleness_factor(self.round - c.base_round),
                c.round < self.round,
            )
            for c in entries
        )
        applied = bool(entries) and len(entries) >= self._needed
        agg = None
        if applied:
            agg = aggregate(
                [c.update for c in entries],
                [p.weight for p in participants],
                cfg.rule,
                cfg.trim_fraction,
                self.dtype,
            )
            for c in entries:
                self._aggregated[c.client] = max(c.base_round, self._aggregated.get(c.client, -1))
            self._pending.clear()
        outcome = RoundOutcome(
            self.round,
            why,
            self._opened_at,
            now,
            self._members_at_open,
            self._needed,
            applied,
            participants,
            agg,
            dict(self._dropped),
            dict(self._rejected),
        )
        if applied:
            self._model_from = self.round + 1
        self._after_deadline = why is CloseReason.DEADLINE
        self.round += 1
        self._forget_aggregated()
        self.phase = Phase.WAITING
        self._deadline = None
        self._expected = set()
        self._without_update.clear()
        self._dropped, self._rejected = Counter(), Counter()
        self._logged.clear()
        return outcome

    def take_pending(self) -> list[Contribution]:
        """Remove and return the updates waiting for the next round (those a round that
        missed its quorum carried on), for a caller that resubmits them itself."""
        pending = [self._pending[c] for c in sorted(self._pending)]
        self._pending.clear()
        return pending

    # ---- helpers ----------------------------------------------------------------------

    def _drop_too_stale(self) -> None:
        """Drop (and count) the carried updates the open round may no longer count."""
        for client, c in sorted(self._pending.items()):
            if self.round - c.base_round > self.config.max_staleness:  # carried too long
                del self._pending[client]
                self._count(Reason.TOO_STALE)

    def _forget_aggregated(self) -> None:
        """Forget the aggregated bases that the staleness bound alone now refuses (at or
        below them, ``round - base_round > max_staleness``)."""
        floor = self.round - self.config.max_staleness
        stale = [c for c, base in self._aggregated.items() if base < floor]
        for c in stale:
            del self._aggregated[c]

    def _count(self, reason: Reason) -> None:
        (self._rejected if reason.is_rejection else self._dropped)[reason.value] += 1
        self.totals[reason.value] += 1

    def _refuse(self, client: str, reason: Reason, detail: str, staleness: int) -> Verdict:
        self._count(reason)
        level = logging.WARNING if reason.is_rejection else logging.INFO
        if client in self._logged:
            level = logging.DEBUG
        self._logged.add(client)
        verb = "rejected" if reason.is_rejection else "dropped"
        log.log(
            level, "round %d: %s update from %s: %s", self.round, verb, self._label(client), detail
        )
        return Verdict(False, reason, detail, staleness)
