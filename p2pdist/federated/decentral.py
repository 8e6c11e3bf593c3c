"""Decentralised federated averaging among the ranks of a :class:`~p2pdist.Group`.

No coordinator process: every rank holds the model, trains, and sends its update to
every other rank. One rank, the *leader*, runs the round's clock
(:class:`~.rounds.FederatedRounds`): when the round is due (quorum, everyone, or the
deadline) it decides who took part and sends that decision (ranks, base rounds, sample
counts, weights) to all. Every rank then aggregates the updates named in the decision,
in the decision's order, with the same pure function: all ranks get the same bits, and
none waited for a rank that missed the deadline. See docs/federated.md.

Channels: round ``k`` uses channels of its own in a channel space the instance reserves
on the group (:func:`~.messages.round_channel`, :meth:`~p2pdist.Group.reserve_channel_space`),
retired by every rank when it finishes the round, so a late update of round ``k`` is
dropped on arrival and can never be read by round ``k + 1`` or by any collective (those
use other channel spaces, and ``split`` never hands out a reserved one).

Membership: a rank that leaves (closes its group) or, under
``GroupConfig(on_peer_loss="leave")``, is lost (killed, cut off) is dropped from the
rounds: the leader stops waiting for it, and the others still read the updates it sent
before it went (frames already delivered stay readable). A lost leader is replaced, and
a restarted rank is taken back (:mod:`.recovery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    ConnectionBrokenError,
    GroupBrokenError,
    MismatchError,
    P2PError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from ..group.buffers import as_array
from ..group.devices import host_copy_async
from ..settings import as_int, check_int, check_seconds
from ..tasks import cancel_and_wait
from ..transport.base import Connection
from ..wire.frames import Frame
from .aggregate import Reason, aggregate, apply_update, check_fits, check_model
from .config import FederatedConfig, config_or_default
from .decision import GroupRound, OwnUpdate, cid, decision_body, digest_async
from .leading import Leading
from .messages import DECISION, UPDATE, Message, decode, encode, round_channel, round_space
from .rounds import FederatedRounds

if TYPE_CHECKING:
    from ..group.group import Group

__all__ = ["GroupAveraging", "GroupRound"]

log = logging.getLogger(__name__)

_WARN_EVERY = 10
"""Rounds between two warnings that a carried update was replaced unaggregated."""
_AGAIN_WITHIN = 3
"""A second such replacement within this many rounds of the last one is warned about."""

_KINDS = (0, 1, 2, 3)  # every kind of a round's channels (all retired together)


class _LeaderLost(Exception):
    """The leader's connection ended before its decision arrived (``error`` says so)."""

    def __init__(self, error: ConnectionBrokenError) -> None:
        super().__init__(str(error))
        self.error = error


class GroupAveraging(Leading):
    """Bounded-staleness federated averaging among the ranks of ``group``.

    Every rank builds one with the same ``model`` shape and dtype and the same
    ``config``, calls :meth:`start` (a broadcast of the leader's model, so all begin
    equal), then :meth:`step` once per round. ``tag`` (0..255) tells apart several
    instances on one group. ``decision_timeout`` (seconds, default the group's timeout)
    bounds a rank's wait for the leader's decision beyond the round's own
    ``round_timeout``, and its wait for an update the decision names. The instance
    reserves channel space ``ROUND_SPACE + tag`` on the group for good
    (:meth:`~p2pdist.Group.reserve_channel_space`): a second instance with the same tag
    on the group or its sub-groups is refused.

    Under ``GroupConfig(on_peer_loss="leave")`` a rank that is lost counts as having
    left: the rounds go on with the others. When the lost rank is the leader, the lowest
    remaining rank whose averaging runs takes over (``failover=True``; with False every
    rank's :meth:`step` fails naming the leader instead). A :meth:`step` that fails (an
    update named in the decision never arrived, a timeout) leaves this rank out of step:
    later calls raise :class:`GroupBrokenError` with that first error.
    """

    def __init__(
        self,
        group: Group,
        model: np.ndarray,
        config: FederatedConfig | None = None,
        *,
        leader: int = 0,
        tag: int = 0,
        decision_timeout: float | None = None,
        failover: bool = True,
    ) -> None:
        leader_rank = as_int(leader)
        if leader_rank is None or not 0 <= leader_rank < group.size:
            raise UsageError(f"leader must be a rank in [0, {group.size}), got {leader!r}")
        space = round_space(tag)  # checks the tag
        # Every other check first: a refused instance must not hold the tag for good.
        self.config = config_or_default(config)
        self._model = check_model(model)
        check_fits(self._model, group.config.transport.limits.max_payload)
        self._timeout = (
            group.config.timeout
            if decision_timeout is None
            else check_seconds("decision_timeout", decision_timeout)
        )
        group.reserve_channel_space(space, f"GroupAveraging(tag={tag})")
        self.group = group
        self.leader = leader_rank
        self.tag = tag
        self._round = 0
        self._own: OwnUpdate | None = None
        self._started = False
        self._stepping = False
        self._state: FederatedRounds | None = None
        self._collectors: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._left: set[int] = set()
        self._refused: dict[int, str] = {}  # leader: each rank's first refusal this round
        self._digests: dict[int, bytes] = {}  # leader: each rank's accepted update, hashed
        self._failed: BaseException | None = None
        self._ready: set[int] = set()  # leader: ranks back in the group, asking to rejoin
        self._ready_tasks: dict[int, asyncio.Task[None]] = {}
        self._last: dict[str, Any] | None = None  # the decision applied last
        self._running: dict[int, Connection] = {}  # see recovery.py: whose averaging runs
        self._asked: dict[int, Connection] = {}  # ready heard, not yet taken back
        self.failover = failover
        """Whether the ranks choose a new leader when theirs is lost (else they fail)."""
        self.local_drops = 0
        """This rank's own updates it stopped carrying because they grew too stale."""
        self.carried_replaced = 0
        """This rank's carried updates replaced by a fresh one before any round took them
        (each one a contribution lost: see :meth:`step`)."""
        self._warned_replaced = -_WARN_EVERY  # the round of the last such warning
        self._replaced_in = -_AGAIN_WITHIN - 1  # round of the last replaced carried update
        self._carried_unapplied = False
        """Whether our carried update is carried because its round applied nothing (a
        missed quorum: every update was carried), not because it came late."""

    @property
    def model(self) -> np.ndarray:
        """This rank's model (bit-identical on every rank after the same rounds): a
        read-only view, replaced (never changed) by each applied round. Train a copy
        (``train(fed.model.copy())``): writing into it raises numpy's ValueError
        ("assignment destination is read-only") instead of leaving a zero delta."""
        view = self._model.view()
        view.flags.writeable = False
        return view

    @property
    def round(self) -> int:
        """The round the next :meth:`step` takes part in."""
        return self._round

    @property
    def is_leader(self) -> bool:
        """Whether this rank runs the rounds' clock."""
        return self.group.rank == self.leader

    async def start(self, *, timeout: float | None = None) -> None:
        """Make every rank's model the leader's (a broadcast: every rank must call it)
        and open round 0.

        On a group that rejoined (``Group.from_seed(..., rejoin=True)``, this rank was
        lost and restarted), start() instead asks every rank to take this rank back and
        waits (at most ``timeout``, default ``decision_timeout``) for the current model,
        round id and leader, which the leader sends when it opens its next round."""
        if self._started:
            raise UsageError("already started")
        self._started = True
        if self.group.rejoined:
            await self._rejoin(timeout or self._timeout)
            return
        self._model = np.array(
            await self.group.broadcast(self._model, src=self.leader, timeout=timeout), order="C"
        )
        self._know_running(self._present())  # every rank starts it (a broadcast)
        if self.is_leader:
            state = FederatedRounds(
                self._model.shape,
                self._model.dtype,
                self.config,
                label=lambda cid: self.group.peer_label(int(cid)),
            )
            for r in range(self.group.size):
                state.join(cid(r))
            self._state = state
            self._open(0)

    async def close(self) -> None:
        """Stop this rank's background readers and wait for them to end (the group stays
        open)."""
        tasks = [*self._collectors, *self._ready_tasks.values()]
        self._stop_collectors()
        self._ready_tasks.clear()
        await cancel_and_wait(tasks)

    async def step(
        self,
        update: np.ndarray | None,
        num_samples: int | None = None,
        *,
        base_round: int | None = None,
    ) -> GroupRound:
        """Take part in round :attr:`round`: contribute ``update`` (the model delta trained
        from round ``base_round``'s model, default :attr:`round`, on ``num_samples``
        samples), or, with None, the update carried from an earlier round (if any), then
        wait for the round's decision, aggregate, and apply it to :attr:`model`.

        ``num_samples`` (at least 1; the weight of ``update`` in the mean) is required
        with an update; a bad argument is a :class:`UsageError` before anything is sent.
        A CuPy ``update`` is copied to the host first (the model stays numpy).

        A rank that calls late still gets the round's result: its update is carried to
        the next round (within ``max_staleness``) instead of blocking anyone."""
        if not self._started:
            raise UsageError("call start() first")
        if self._failed is not None:
            raise GroupBrokenError("this rank's averaging is out of step", self._failed)
        if self._stepping:
            raise UsageError("step() is already running on this rank: await it before the next")
        self._stepping = True
        try:
            return await self._step(update, num_samples, base_round)
        finally:
            self._stepping = False

    async def _step(
        self, update: np.ndarray | None, num_samples: int | None, base_round: int | None
    ) -> GroupRound:
        k = self._round
        if update is not None:
            samples = check_int("num_samples", num_samples, 1)  # None too: required
            base = k if base_round is None else check_int("base_round", base_round, 0)
            if base > k:
                raise UsageError(
                    f"base_round {base} is after the round now open ({k}): an update is "
                    "computed from the model of this round or an earlier one"
                )
            # A CuPy update: its values, on the host (polled: the loop goes on).
            sent = as_array(await host_copy_async(update, self._timeout))
            if self._own is not None:  # carried from an earlier round, never aggregated
                self._replacing_carried(k, self._own)
            self._own = OwnUpdate(sent, samples, base, await digest_async(sent))
        own = self._own
        dropped_here = own is not None and k - own.base_round > self.config.max_staleness
        if dropped_here:
            self._own, own = None, None
            self.local_drops += 1
        try:
            self._contribute(k, own)
            if self.is_leader:
                body, agg = await self._lead(k, own)
            else:
                body, agg = await self._as_follower(k, own)
        except BaseException as exc:
            self._failed = exc
            raise
        finally:
            self._retire(k)
        self._round = k + 1
        self._last = body
        self._know_running(body["joining"])  # taken back at the next round
        applied = bool(body["ok"])
        ranks = tuple(int(p[0]) for p in body["p"])
        me = self.group.rank
        refused = {int(r): str(why) for r, why in body["refused"]}
        included = applied and me in ranks
        own_reason = refused.get(me, "") or (Reason.TOO_STALE.value if dropped_here else "")
        carried = False
        if own is not None and not included:
            if own_reason and (
                Reason(own_reason).is_rejection
                or own_reason in (Reason.DUPLICATE, Reason.TOO_STALE)
            ):
                self._own = None  # refused for good: rejected, resent or too stale
            elif k + 1 - own.base_round <= self.config.max_staleness:
                carried = True
                self._carried_unapplied = not applied
            else:
                self._own = None
                self.local_drops += 1
        elif included:
            self._own = None
        if agg is not None:
            self._model = apply_update(self._model, agg, self.config.server_lr)
        if self.is_leader:
            self._open(k + 1)
        return GroupRound(
            k,
            applied,
            str(body["why"]),
            ranks if applied else (),
            int(body["stale"]),
            dict(body["dropped"]),
            dict(body["rejected"]),
            included,
            carried,
            own_reason,
            agg,
            tuple(body["left"]),
        )

    def _replacing_carried(self, k: int, own: OwnUpdate) -> None:
        """A fresh update replaces the one carried since round ``own.base_round``'s
        round, unaggregated: a rank slower than round_timeout that always does this never
        contributes. Say so (unless it is carried because its round applied nothing, a
        missed quorum) when it happens twice within ``_AGAIN_WITHIN`` rounds (once is
        the first round of a rank that joined or rejoined, which that round does not wait
        for, or a hiccup; a rank late every other round loses half its updates), at most
        once per ``_WARN_EVERY`` rounds."""
        self.carried_replaced += 1
        if self._carried_unapplied:  # its round missed its quorum: nobody was late
            return
        again, self._replaced_in = k - self._replaced_in <= _AGAIN_WITHIN, k
        if not again or k - self._warned_replaced < _WARN_EVERY:
            return
        self._warned_replaced = k
        log.warning(
            "rank %d: round %d: a fresh update replaces this rank's update of round %d, "
            "which no round aggregated, again (%d so far): this rank is "
            "slower than round_timeout "
            "(%g s) and may never contribute; send the carried update first "
            "('if result.carried: await fed.step(None)'), or raise round_timeout",
            self.group.rank,
            k,
            own.base_round,
            self.carried_replaced,
            self.config.round_timeout,
        )

    # ---- every rank -----------------------------------------------------------------------

    def _settings(self) -> list[Any]:
        """The aggregation settings every rank must share (the leader sends its own)."""
        return [self.config.rule, self.config.trim_fraction, self.config.server_lr]

    def _check_group(self) -> None:
        if self.group.broken is not None:
            raise GroupBrokenError("the group is broken", self.group.broken)

    def _gone(self) -> set[int]:
        """Ranks that left or were lost, as far as this rank knows."""
        return self._left | set(self.group.left)

    def _conns(self) -> dict[int, Connection]:
        """Connections to the ranks still here."""
        out = {}
        gone = self._gone()
        for r in range(self.group.size):
            if r != self.group.rank and r not in gone:
                with contextlib.suppress(UsageError):
                    out[r] = self.group.connection(r)
        return out

    def _retire(self, k: int) -> None:
        """Drop round ``k``'s frames, queued and to come, on every connection."""
        for r in range(self.group.size):
            if r == self.group.rank:
                continue
            with contextlib.suppress(UsageError):
                conn = self.group.connection(r)
                for kind in _KINDS:
                    conn.retire(round_channel(self.tag, k, kind))

    def _contribute(self, k: int, own: OwnUpdate | None) -> None:
        """Send our update to every rank, the leader last (so whoever the leader counts
        has, in all likelihood, already reached the others), or, with none, tell the
        leader that this rank has none for round ``k``, so the round does not wait for
        it until its deadline (a leader chosen after a failover is told in turn). Never
        waits."""
        channel = round_channel(self.tag, k, UPDATE)
        conns = self._conns()
        if own is None:
            conns = {r: c for r, c in conns.items() if r == self.leader}
            meta, payload = encode("abstain", {"r": k})
        else:
            meta, payload = encode(
                "update", {"r": k, "b": own.base_round, "n": own.num_samples}, own.update
            )
        order = [r for r in conns if r != self.leader] + [r for r in conns if r == self.leader]
        for r in order:
            try:
                conns[r].send_nowait(channel, payload, meta=meta)
            except P2PError as exc:
                log.info("%s: update not sent: %s", self.group.peer_label(r), exc)

    # ---- followers --------------------------------------------------------------------------

    async def _as_follower(
        self, k: int, own: OwnUpdate | None
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        """Round ``k``'s decision and aggregate; when the leader is lost, its successor's
        (or, if this rank is the successor, take over)."""
        passed: set[int] = set()  # leaders lost, and ranks that declined, in this wait
        while True:
            try:
                body = await self._decision(k, successor=bool(passed))
            except _LeaderLost as lost:
                if not self.failover:
                    raise lost.error from None
                passed.add(self.leader)
                await self._hear_asks()  # who restarted and runs its averaging again
                if self._successor(passed) == self.group.rank:
                    return await self._take_over(k, own)
                self._report(k)
                if own is None:  # tell the new leader too that this rank has none
                    self._contribute(k, None)
                continue
            return body, await self._follow(k, body, own)

    async def _decision(self, k: int, *, successor: bool = False) -> dict[str, Any]:
        """Round ``k``'s decision from the leader (``successor``: one chosen in place of
        a lost leader during this wait)."""
        label = self.group.peer_label(self.leader)
        conn = self.group.connection(self.leader)
        # The leader may rightly wait out the round's deadline before it decides: the
        # wait covers the round, then decision_timeout (a wait shorter than the round
        # failed followers whose updates counted, out of step for good).
        wait = self.config.round_timeout + self._timeout
        try:
            frame = await conn.recv(round_channel(self.tag, k, DECISION), timeout=wait)
        except PeerTimeoutError:
            why = f"no decision for round {k} from the leader within {wait:g} s"
            if successor:
                why = (
                    f"chosen to lead after a lost leader, sent no decision for round {k} "
                    f"within {wait:g} s"
                )
            raise PeerTimeoutError(label, why) from None
        except (ConnectionBrokenError, RemoteProtocolError) as exc:
            self._check_group()  # a broken group names its own cause
            raise _LeaderLost(
                ConnectionBrokenError(
                    label,
                    f"the leader went before sending the decision of round {k}: {exc.detail}",
                )
            ) from None
        message = decode(frame, label)
        if message.kind == "decline":  # it is rejoining (recovery.py): choose again
            raise _LeaderLost(
                ConnectionBrokenError(label, f"is rejoining and cannot lead round {k}")
            )
        body = decision_body(message, label, k, self.group.size)
        mine = self._settings()
        if body["cfg"] != mine:
            raise MismatchError(label, f"leader aggregates with {body['cfg']}, this rank {mine}")
        return body

    async def _follow(
        self, k: int, body: dict[str, Any], own: OwnUpdate | None
    ) -> np.ndarray | None:
        if not body["ok"]:
            return None
        channel = round_channel(self.tag, k, UPDATE)
        updates, weights = [], []
        named: list[tuple[str, np.ndarray, bytes]] = []  # (sender, update, its digest)
        for rank, base, n, weight, hashed in body["p"]:
            if rank == self.group.rank:
                if (
                    own is None
                    or own.base_round != base
                    or own.num_samples != n
                    or own.digest != hashed
                ):
                    raise MismatchError(
                        self.group.peer_label(self.leader),
                        f"decision of round {k} names an update this rank did not send",
                    )
                updates.append(own.update)
            else:
                label = self.group.peer_label(rank)
                frame = await self._named_update(k, rank, label, channel)
                update = self._check_named(k, decode(frame, label), label, base, n)
                named.append((label, update, hashed))
                updates.append(update)
            weights.append(weight)
        # Every named update received and checked, hash them all at once (hashlib lets
        # the GIL go, so large updates hash on several threads).
        digests = await asyncio.gather(*(digest_async(update) for _, update, _ in named))
        for (label, _, hashed), got in zip(named, digests, strict=True):
            if got != hashed:
                raise MismatchError(
                    label,
                    f"its update of round {k} is not the one the leader aggregated "
                    "(it sent different bytes to different ranks)",
                )
        return aggregate(
            updates, weights, self.config.rule, self.config.trim_fraction, self._model.dtype
        )

    def _check_named(self, k: int, got: Message, label: str, base: int, n: int) -> np.ndarray:
        """The array of ``got``, the update the decision of round ``k`` names as
        ``(base, n)``; MismatchError naming its sender when it is not that one (it sent
        the leader something else). Its digest is checked by the caller, with the others'."""
        if (got.get_int("r", label), got.get_int("b", label), got.fields.get("n")) != (k, base, n):
            raise MismatchError(label, f"its update differs from round {k}'s decision")
        update = got.need_array(label)
        model = self._model
        if update.dtype != model.dtype or update.shape != model.shape:
            raise MismatchError(
                label,
                f"its update of round {k} is {update.dtype}{list(update.shape)}, the model "
                f"{model.dtype}{list(model.shape)} (the leader accepted another one)",
            )
        return update

    async def _named_update(self, k: int, rank: int, label: str, channel: int) -> Frame:
        """Rank ``rank``'s update for round ``k``, which the decision names. It was sent
        to us before the leader, so it is normally here already, even when ``rank`` has
        gone since (what was delivered stays readable)."""
        try:
            return await self.group.connection(rank).recv(channel, timeout=self._timeout)
        except PeerTimeoutError:
            raise PeerTimeoutError(
                label,
                f"round {k}'s decision names its update, which did not reach this rank "
                f"within {self._timeout:g} s",
            ) from None
        except (ConnectionBrokenError, RemoteProtocolError) as exc:
            self._check_group()  # a broken group names its own cause
            raise ConnectionBrokenError(
                label,
                f"round {k}'s decision names its update, which never reached this rank "
                f"before it went ({exc.detail})",
            ) from None
