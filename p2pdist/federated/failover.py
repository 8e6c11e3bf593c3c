"""Leader failover of decentralised averaging, as pure functions (no I/O, no clock).

When the leader of :class:`~.decentral.GroupAveraging` is lost (its connection ended,
``GroupConfig(on_peer_loss="leave")``), every survivor picks the same successor, the
lowest-numbered rank still in the group whose GroupAveraging it knows to run
(:func:`next_leader`; a rank back in the group after a restart counts once its request
to be taken back has come), and sends it a :class:`~.decision.Report`: the round it is
in and the decision it applied last. A survivor notices the loss only when it waits for
a decision that is not in its mailbox, and everything the dead leader sent arrived
before the connection's end, so every report names the leader's last round ``m`` or the
one after, ``m + 1`` (having applied the decision of ``m``). The successor waits for the
report of every rank still here whose GroupAveraging it knows to run (the others are not
in the rounds: they are taken back once they ask), then (:func:`plan_takeover`):

* if any rank applied the decision of ``m``, that decision is **adopted**: the new leader
  sends it to the ranks still at ``m`` (and applies it itself if it is one of them);
  nobody can have applied another one, since there was only one leader for ``m``;
* otherwise nobody applied a decision for ``m`` (ranks that did and died do not matter),
  and the new leader decides ``m`` itself, from the updates in its mailbox.

It then leads from the first undecided round on, its state machine remembering what that
newest decision ``counted`` (per rank, the newest base round aggregated), so an update
resent across the failover is still refused as ``duplicate``. Reports go on a channel of
their own, one per connection to each successor, so no report is read twice.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import P2PError
from .decision import Report

__all__ = ["FailoverError", "Takeover", "next_leader", "plan_takeover"]


class FailoverError(P2PError):
    """The reports a new leader got cannot come from one leader's rounds."""


def next_leader(size: int, passed: Collection[int]) -> int:
    """The successor of a lost leader: the lowest rank not ``passed`` over (gone, lost
    as leader, declined, or not known to run its averaging)."""
    for r in range(size):
        if r not in passed:
            return r
    raise FailoverError("no rank is left to lead")


@dataclass(frozen=True, slots=True)
class Takeover:
    """What a new leader does."""

    adopt: dict[str, Any] | None
    """The decision of round ``lead_from - 1`` that some rank applied (to send to the
    ranks still at that round), or None."""
    behind: tuple[int, ...]
    """Ranks (this one included, if so) that still need the adopted decision."""
    lead_from: int
    """The first round the new leader decides itself."""
    rejoining: tuple[int, ...]
    """Ranks that rejoined and wait to be taken back (not members yet)."""
    members: tuple[int, ...]
    """Ranks taking part in the rounds from now on (the new leader and every rank whose
    report names a round); every other rank is not, until it is taken back."""


def plan_takeover(me: int, mine: Report, reports: Mapping[int, Report]) -> Takeover:
    """The plan of new leader ``me`` (whose own state is ``mine``) from the report of
    every other rank still in the group."""
    taking_part = {r: rep for r, rep in reports.items() if rep.round >= 0}
    taking_part[me] = mine
    rejoining = tuple(sorted(r for r, rep in reports.items() if rep.round < 0))
    lo = min(rep.round for rep in taking_part.values())
    hi = max(rep.round for rep in taking_part.values())
    if hi - lo > 1:
        where = ", ".join(f"rank {r} at {rep.round}" for r, rep in sorted(taking_part.items()))
        raise FailoverError(f"ranks are more than one round apart: {where}")
    members = tuple(sorted(taking_part))
    if hi == lo:
        return Takeover(None, (), lo, rejoining, members)
    held = {r: rep.last for r, rep in sorted(taking_part.items()) if rep.round == hi}
    silent = [r for r, d in held.items() if d is None]
    if silent:
        raise FailoverError(
            f"{_ranks(silent)} in round {hi} did not say how round {lo} was decided"
        )
    adopt = next(iter(held.values()))
    assert adopt is not None
    if any(d != adopt for d in held.values()):
        raise FailoverError(f"ranks applied different decisions for round {lo}: {_ranks(held)}")
    behind = tuple(sorted(r for r, rep in taking_part.items() if rep.round == lo))
    return Takeover(adopt, behind, hi, rejoining, members)


def _ranks(ranks: Collection[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)
