"""Decisions of decentralised averaging: what every rank learns of a round
(:class:`GroupRound`), the decision message's checks, and the reports ranks send a new
leader (sans-I/O; see :mod:`.failover`)."""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import RemoteProtocolError
from .aggregate import Reason
from .messages import Message

__all__ = [
    "DIGEST_SIZE",
    "GroupRound",
    "OwnUpdate",
    "Report",
    "cid",
    "counted_of",
    "decision_body",
    "digest",
    "digest_async",
    "remembered",
    "report_of",
]

DIGEST_SIZE = 16
"""Bytes of an update's digest in a decision (BLAKE2b)."""


def cid(rank: int) -> str:
    """The client id of ``rank`` in the state machine (sorts in rank order)."""
    return f"{rank:06d}"


@dataclass(frozen=True, slots=True)
class GroupRound:
    """One round as every rank sees it (identical on all ranks but ``included``,
    ``carried`` and ``own_reason``)."""

    round: int
    applied: bool
    """True when the quorum was met and the aggregate was applied to the model."""
    reason: str
    """Why the leader closed the round (a :class:`~.rounds.CloseReason` value)."""
    participants: tuple[int, ...]
    """Ranks whose updates make up the aggregate, in aggregation order."""
    stale: int
    dropped: Mapping[str, int]
    """Drops the leader counted in this round, by reason."""
    rejected: Mapping[str, int]
    """Rejections the leader counted in this round, by reason."""
    included: bool
    """This rank's update is in the aggregate."""
    carried: bool
    """This rank's update missed the round (late, or no quorum) and, still within
    ``max_staleness``, will be sent again with the next :meth:`GroupAveraging.step`."""
    own_reason: str
    """Why this rank's update was refused or dropped (a Reason value), or ``""``."""
    aggregate: np.ndarray | None = field(repr=False)
    left: tuple[int, ...] = ()
    """Ranks gone (left, or lost under ``on_peer_loss="leave"``) when the leader closed
    the round, in rank order."""


@dataclass(slots=True)
class OwnUpdate:
    """This rank's update, as it was sent (or will be sent again when carried)."""

    update: np.ndarray
    num_samples: int
    base_round: int
    digest: bytes
    """:func:`digest` of ``update``, computed once (a carried update is named again)."""


def digest(update: np.ndarray) -> bytes:
    """The BLAKE2b digest (:data:`DIGEST_SIZE` bytes) of ``update``'s bytes in C order:
    the bytes every rank aggregates, named per participant in a decision."""
    data = np.ascontiguousarray(update).reshape(-1).view(np.uint8).data
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


HASH_OFF_LOOP = 1 << 20
"""Updates at least this big are hashed on a worker thread (hashlib releases the GIL),
about 1.5 ms per MB here, so the event loop goes on serving keepalives and other ranks."""


async def digest_async(update: np.ndarray) -> bytes:
    """:func:`digest`, off the event loop for updates of :data:`HASH_OFF_LOOP` or more."""
    if update.nbytes < HASH_OFF_LOOP:
        return digest(update)
    return await asyncio.to_thread(digest, update)


def _digest_of(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) != DIGEST_SIZE:
        raise ValueError(f"digest {value!r} is not {DIGEST_SIZE} bytes")
    return value


def decision_body(message: Message, label: str, k: int, size: int) -> dict[str, Any]:
    """Check the shape of a decision message of a group of ``size`` ranks;
    RemoteProtocolError (naming ``label``) if it is malformed."""
    f = message.fields
    if message.kind != "decision" or message.get_int("r", label) != k:
        raise RemoteProtocolError(label, f"expected the decision of round {k}")
    try:
        named = [(int(r), int(b), int(n), float(w), _digest_of(d)) for r, b, n, w, d in f["p"]]
        refused = [(int(r), str(Reason(why))) for r, why in f["refused"]]
        left = [int(r) for r in f["left"]]
        joining = [int(r) for r in f.get("joining", ())]  # absent from older leaders
        _check_ranks("participant", [r for r, *_ in named], size)
        _check_ranks("refused", [r for r, _ in refused], size)
        _check_ranks("left", left, size)
        _check_ranks("joining", joining, size)
        for r, b, n, w, _ in named:
            # (an update has a sample at least, and a weight above 0: config.discount)
            if not (0 <= b <= k and n >= 1 and math.isfinite(w) and w > 0):
                raise ValueError(f"participant {r}: base {b}, samples {n}, weight {w}")
        p = [list(entry) for entry in named]
        body = {
            "r": k,
            "ok": bool(f["ok"]),
            "why": str(f["why"]),
            "p": p,
            "refused": refused,
            "stale": int(f["stale"]),
            "dropped": {str(a): int(b) for a, b in dict(f["dropped"]).items()},
            "rejected": {str(a): int(b) for a, b in dict(f["rejected"]).items()},
            "cfg": [str(f["cfg"][0]), float(f["cfg"][1]), float(f["cfg"][2])],
            "left": left,
            "joining": joining,
            "counted": _counted(f["counted"], k, size),
            "since": _since(f, k),
        }
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise RemoteProtocolError(label, f"malformed decision: {exc!r}") from None
    return body


def _since(f: dict[str, Any], k: int) -> int:
    """The first round whose model is current after decision ``k`` (``k + 1`` when it
    applied an aggregate). A leader before 2026-12-07 sent none: then ``k`` for a round
    that applied nothing, which may be later than the truth after several such rounds
    (its successor then counts fewer updates fresh, as it did)."""
    ok = bool(f["ok"])
    since = int(f["since"]) if "since" in f else k + 1 if ok else k
    if not (0 <= since <= k + 1) or (ok and since != k + 1):
        raise ValueError(
            f"since {since} after round {k} ({'applied' if ok else 'nothing applied'})"
        )
    return since


def _check_ranks(what: str, ranks: list[int], size: int) -> None:
    """ValueError unless ``ranks`` are distinct ranks of a group of ``size``: a decision
    naming a rank twice, or one outside the group, would make followers wait for an
    update that never comes."""
    if len(set(ranks)) != len(ranks) or not all(0 <= r < size for r in ranks):
        raise ValueError(f"{what} ranks {ranks[:8]!r} are not distinct ranks in [0, {size})")


def _counted(value: Any, k: int, size: int) -> list[list[int]]:
    """The ``counted`` field of the decision of round ``k``: ``[rank, base_round]`` pairs,
    strictly increasing ranks in ``[0, size)`` (so at most ``size`` of them), bases in
    ``[0, k]``; ValueError otherwise."""
    if not isinstance(value, list):
        raise ValueError(f"'counted' is not a list: {type(value).__name__}")
    if len(value) > size:
        raise ValueError(f"'counted' names {len(value)} ranks, the group has {size}")
    out: list[list[int]] = []
    for item in value:
        if not isinstance(item, list) or len(item) != 2 or not all(map(_is_int, item)):
            raise ValueError(f"'counted' entry {item!r} is not [rank, base_round]")
        rank, base = item
        if not 0 <= rank < size:
            raise ValueError(f"'counted' names rank {rank}, not in [0, {size})")
        if out and rank <= out[-1][0]:
            raise ValueError(f"'counted' ranks are not increasing at rank {rank}")
        if not 0 <= base <= k:
            raise ValueError(f"'counted' base round {base} of rank {rank} is not in [0, {k}]")
        out.append([rank, base])
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def counted_of(aggregated: Mapping[str, int]) -> list[list[int]]:
    """The ``counted`` field of a decision from the leader's state machine's
    :attr:`~.rounds.FederatedRounds.aggregated` (client ids are :func:`cid` of ranks)."""
    return sorted([int(c), base] for c, base in aggregated.items())


def remembered(last: Mapping[str, Any] | None) -> dict[str, int]:
    """What a new leader's state machine starts remembering: the ``counted`` of the last
    decision applied in the group (nothing before the first)."""
    if last is None:
        return {}
    return {cid(rank): base for rank, base in last["counted"]}


@dataclass(frozen=True, slots=True)
class Report:
    """What a rank tells a new leader: the round it is in (it has no decision for it
    yet) and the decision it applied last (the previous round's; None before any), or,
    with ``round`` -1, that it is rejoining and not yet taking part."""

    round: int
    last: dict[str, Any] | None


def report_of(message: Message, label: str, size: int) -> Report:
    """Parse a report message of a group of ``size`` ranks; RemoteProtocolError (naming
    ``label``) if malformed."""
    if message.kind != "report":
        raise RemoteProtocolError(label, f"expected a report, got {message.kind!r}")
    k = message.get_int("r", label, low=-1)
    last = message.fields.get("last")
    if last is None or k <= 0:
        return Report(k, None)
    if not isinstance(last, dict):
        raise RemoteProtocolError(label, "report: malformed last decision")
    return Report(k, decision_body(Message("decision", last), label, k - 1, size))
