"""Bounded-staleness federated averaging, in two shapes (see docs/federated.md).

* Coordinator + clients: a :class:`Coordinator` runs the rounds; each
  :class:`FederatedClient` dials out to it (TCP, or QUIC through a relay) and never
  listens. Clients join and leave at will; a late joiner gets the current model and round.
* Decentralised: :class:`GroupAveraging` runs among the ranks of a
  :class:`~p2pdist.Group`; a leader rank keeps the round's clock and decides who took
  part, and every rank computes the same aggregate.

The rules (staleness, weighting, quorum, validation, robust aggregation) live in the
sans-I/O :class:`FederatedRounds` and :func:`aggregate`, configured by
:class:`FederatedConfig`.
"""

from .aggregate import Reason, aggregate, check_update, trim_count
from .client import Ack, FederatedClient, RoundTask
from .config import FederatedConfig
from .coordinator import Coordinator
from .decentral import GroupAveraging, GroupRound
from .rounds import (
    CloseReason,
    Contribution,
    FederatedRounds,
    Participant,
    Phase,
    RoundOutcome,
    Verdict,
)

__all__ = [
    "Ack",
    "CloseReason",
    "Contribution",
    "Coordinator",
    "FederatedClient",
    "FederatedConfig",
    "FederatedRounds",
    "GroupAveraging",
    "GroupRound",
    "Participant",
    "Phase",
    "Reason",
    "RoundOutcome",
    "RoundTask",
    "Verdict",
    "aggregate",
    "check_update",
    "trim_count",
]
