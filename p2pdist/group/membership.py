"""Forming a group, and who is in it once formed: the mesh of connections each rank
builds at start (who dials whom, the ``ok`` / ``ready`` / ``failed`` notes on the
formation channel, refusing a second process that claims a rank), ranks that leave or
are lost, and channel spaces reserved for traffic beside the collectives. Mixed into
:class:`~p2pdist.group.core.GroupCore` (which sets every attribute declared here);
taking back ranks that restart is :mod:`p2pdist.group.rejoin`'s job.

Under ``GroupConfig(on_peer_loss="leave")`` a connection that ends without a goodbye
counts as the peer leaving; collectives that need it refuse to start, and running ones
fail naming it (:meth:`Membership._cancel_inflight`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Coroutine, Iterable
from typing import Any

import msgpack

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    GroupBrokenError,
    MismatchError,
    P2PError,
    P2PTimeoutError,
    PeerAuthenticationError,
    PeerError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import EndpointId
from ..transport.base import NOT_ADMITTED, Address, Connection
from ..transport.dial import dial_with_retry
from ..transport.mailbox import SPACE_SHIFT, split_channel
from ..transport.quic import QuicTransport
from ..transport.tcp import TLS_MISMATCH_HINT, TcpTransport
from ..wire.relay import RelayUrl
from .config import GroupConfig
from .link import CollectiveLink

__all__ = ["CONTROL_CHANNEL", "FIRST_RESERVED_SPACE", "LAST_SPACE", "Membership"]

log = logging.getLogger(__name__)
_REFUSED_FIRST_RETRY = 0.05
"""Seconds before dialing again a rank whose group formed already; doubles up to
:data:`_REFUSED_MAX_RETRY`."""
_REFUSED_MAX_RETRY = 1.0
_FORMED_ALREADY = "its group has formed already"
"""Why a formed group refuses a member's new connection (the dialer dials again)."""
_QUEUED_NOTE_WAIT = 1.0
"""Bound on reading a closed connection's queued formation note (it is there at once, or
the read fails at once with the connection's end: the bound is only a guard)."""
_NOTE_CHARS = 2000
"""Longest reason a formation ``failed`` note carries (it names ranks and addresses)."""

_CLOSED_EARLY_MAX = 1024
"""Sub-group close notices kept for sub-groups whose split has not returned here yet
(each split returns soon: the bound only stops a peer from growing the dict)."""

FIRST_RESERVED_SPACE = 0xFE00
"""``split`` hands out channel spaces below this; :meth:`Membership.reserve_channel_space`
those from here to :data:`LAST_SPACE`."""
LAST_SPACE = 0xFFFE  # 0xFFFF is the control channel's
_HELLO_SPACE = LAST_SPACE  # the group's own: a survivor's hello to a rank that rejoins
_HELLO_CHANNEL = _HELLO_SPACE << SPACE_SHIFT
_FORM_CHANNEL = _HELLO_CHANNEL + 1  # formation notes: ok, refused, ready, failed
CONTROL_CHANNEL = 0xFFFF << SPACE_SHIFT
"""Abort notices and failed-call notices (msgpack maps)."""
_FAILED_CALLS_MAX = 4096
"""Failed-call notices kept for calls not started here yet (each is dropped once that
call starts or is skipped here: the bound only stops a peer from growing the dict)."""
_WHY_CHARS = 300
"""Longest reason a skipped-call notice carries."""

CallFailure = tuple[int, str | None]
"""Why a rank's collective failed: the root rank it concerns, and, when that rank is
still here but did not run the call (see calls.py), why not; None: the rank left."""


class Membership:
    """Forming, leaving, loss and channel-space reservations of a group."""

    config: GroupConfig
    _rank: int
    _ids: list[EndpointId]
    _rank_of: dict[EndpointId, int]
    _conns: dict[int, Connection]
    _left: dict[int, BaseException]  # by root rank
    _root_ranks: list[int]
    _descendants: weakref.WeakSet[Membership]
    _reserved: dict[int, str]
    _inflight: dict[asyncio.Task[Any], tuple[Membership, int, float]]  # (group, channel, deadline)
    _cancelled_by_loss: dict[asyncio.Task[Any], CallFailure]
    _cancelled_by_notice: set[asyncio.Task[Any]]  # of those, cancelled on another's word
    _expired: set[asyncio.Task[Any]]  # collectives the watchdog cancelled (overdue)
    _closed_calls: set[asyncio.Task[Any]]  # collectives a sub-group's close cancelled
    _last_loss: dict[int, BaseException]  # root: why each root rank was last lost or left
    _closed_by: dict[int, int]  # root rank that closed this sub-group -> its next cid then
    _closed_early: dict[int, list[tuple[int, int]]]  # root: notices before their split
    _parent: Membership | None  # the group this one was split from
    _failed_calls: dict[int, CallFailure]  # channel -> why another rank's call failed
    _p2p_sent: dict[int, int]
    _p2p_received: dict[int, int]
    _p2p_given_back: dict[int, list[int]]
    _next_cid: int
    _pending: dict[int, int]  # see calls.Reserving
    _space: int  # the channel space of this group's collectives
    _listeners: list[asyncio.Task[None]]
    _closing: bool
    _formed: bool
    _forming: _Formation | None  # root, while start() forms the group
    _rejoin: bool
    _failure_log: list[BaseException]
    _addresses: list[Address] | None
    _relay_url: RelayUrl | None

    # ---- provided by GroupCore ------------------------------------------------------------

    def peer_label(self, rank: int) -> str:
        """How errors name a rank."""
        raise NotImplementedError

    def _root(self) -> Membership:
        raise NotImplementedError

    def _break(self, error: BaseException, *, notify: bool = False) -> None:
        raise NotImplementedError

    async def _listen_control(self, rank: int, conn: Connection) -> None:
        raise NotImplementedError

    def _where(self, r: int) -> str:
        raise NotImplementedError

    def _skip(self, cid: int, holder: int, why: str) -> None:
        raise NotImplementedError

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        raise NotImplementedError

    async def close(self) -> None:
        """Close the group."""
        raise NotImplementedError

    # ---- public -----------------------------------------------------------------------------

    @property
    def left(self) -> dict[int, BaseException]:
        """Ranks that have left, each with the error that ended its connection: those that
        closed on purpose, and (under ``on_peer_loss="leave"``) those that were lost. A
        rank that rejoined is no longer listed (on the group it rejoined, not on sub-groups
        made before)."""
        return {r: self._left[rr] for r, rr in enumerate(self._root_ranks) if rr in self._left}

    @property
    def rejoined(self) -> bool:
        """Whether this rank joined a running group (``rejoin=True``) instead of forming it."""
        return self._rejoin

    def reserve_channel_space(self, space: int, owner: str) -> int:
        """Claim channel ``space`` (in ``0xFE00..0xFFFD``, which :meth:`split` never hands
        out) on this group's connections for ``owner`` (a name for error messages), and
        return it. Every rank must reserve the same space for the same traffic.

        A space is reserved for the life of the group and shared by its sub-groups (they
        share its connections): reserving one that is already taken raises
        :class:`UsageError` naming its owner, because its channels are retired as they
        are used and a second user would have its messages dropped."""
        if not isinstance(space, int) or not FIRST_RESERVED_SPACE <= space <= LAST_SPACE:
            raise UsageError(
                f"space must be in [{FIRST_RESERVED_SPACE:#x}, {LAST_SPACE - 1:#x}], got {space!r}"
            )
        root = self._root()
        taken = root._reserved.get(space)
        if taken is not None:
            raise UsageError(f"channel space {space:#x} is already reserved by {taken}")
        root._reserved[space] = owner
        return space

    # ---- loss -------------------------------------------------------------------------------

    def _watch(self, rank: int, conn: Connection) -> None:
        """Report the end of ``conn`` (while it is still ``rank``'s connection)."""

        def ended(error: BaseException | None) -> None:
            if self._conns.get(rank) is conn:
                self._on_connection_end(rank, error)

        if conn.closed:  # ended already (said goodbye as the group formed): now, not soon
            ended(conn.end_error)  # a call made at once must find the rank gone
            return
        conn.add_close_callback(ended)

    def _on_connection_end(self, rank: int, error: BaseException | None) -> None:
        if error is None or self._closing:
            return
        graceful = isinstance(error, ConnectionBrokenError) and error.graceful
        if graceful or self.config.on_peer_loss == "leave":
            # A peer that closes on purpose (or, by choice, one that is lost) is no failure
            # until someone still needs it: later collectives refuse to start, a receive
            # from it raises, the rest runs on.
            if graceful:
                log.info("%s left the group", self.peer_label(rank))
            else:
                why = error.detail if isinstance(error, PeerError) else error
                log.warning("%s was lost; it counts as left: %s", self.peer_label(rank), why)
            for group in [self, *self._descendants]:
                group._left.setdefault(rank, error)
            self._last_loss[rank] = error  # the cause, should it rejoin before calls fail
            self._tell_rejoiners(rank)
            if not graceful:
                # A rank that said goodbye finished what it was part of (what it sent is
                # still readable); one that was lost most likely did not.
                self._cancel_inflight(rank)
            return
        log.warning("%s: connection ended: %s", self.peer_label(rank), error)
        self._failure_log.append(error)
        self._break(error, notify=True)

    def _cancel_inflight(self, root_rank: int) -> None:
        """Fail every running collective of a group that has ``root_rank`` as a member:
        it can no longer finish, and its other ranks may wait on us, not on the lost one.
        ``GroupCore._run`` turns the cancellation into an error naming the lost rank."""
        for task, (group, _, _) in list(self._inflight.items()):
            if root_rank in group._root_ranks:
                self._cancel_for_loss(task, root_rank)

    def _tell_rejoiners(self, gone: int) -> None:
        """Overridden by Rejoining (the base class takes nobody back)."""

    def _split_from(self, group: Membership) -> list[Membership]:
        """(Root group) the sub-groups split from ``group``, at any depth."""
        out = []
        for g in self._descendants:
            a = g._parent
            while a is not None and a is not group:
                a = a._parent
            if a is group:
                out.append(g)
        return out

    def _on_subgroup_closed(self, space: int, next_cid: int, root_rank: int) -> None:
        """(Root group) ``root_rank`` closed its sub-group on channel space ``space``
        after taking part in its calls up to ``next_cid`` (not included). A notice for a
        sub-group whose split has not returned here yet is kept until it does."""
        for g in self._descendants:
            if g._space == space and root_rank in g._root_ranks:
                self._apply_closed(g, root_rank, next_cid)
                return
        early = self._closed_early
        if space in early or len(early) < _CLOSED_EARLY_MAX:
            early.setdefault(space, []).append((root_rank, next_cid))

    def _apply_closed(self, group: Membership, root_rank: int, next_cid: int) -> None:
        """(Root group) ``root_rank`` is gone from ``group`` from call ``next_cid`` on:
        those calls are refused (``_run``), and those running here fail at once naming
        it; the earlier ones have its part and finish."""
        group._closed_by[root_rank] = next_cid
        for task, (running, channel, _) in list(self._inflight.items()):
            if running is group and split_channel(channel)[1] >= next_cid:
                self._cancel_for_loss(task, root_rank, told=True)

    def _cancel_closed(self, group: Membership) -> None:
        """(Root group) fail the running collectives of ``group`` (a sub-group being
        closed) and of its sub-groups; ``_run`` turns each into GroupBrokenError."""
        closing = {group, *self._split_from(group)}
        for task, (running, channel, _) in list(self._inflight.items()):
            if running not in closing or task is asyncio.current_task() or task in self._expired:
                continue
            if task not in self._cancelled_by_loss and task not in self._closed_calls:
                running._tell_call_failed(channel, running._root_ranks[running._rank])
                self._closed_calls.add(task)
                task.cancel()

    def _cancel_for_loss(
        self,
        task: asyncio.Task[Any],
        root_rank: int,
        *,
        told: bool = False,
        why: str | None = None,
    ) -> None:
        """Cancel ``task`` for the loss of ``root_rank`` (or, with ``why``, because that
        rank did not run the call). ``told``: every member was sent the notice that made
        us cancel it, so ``_run`` need not tell them again."""
        if task is asyncio.current_task() or task in self._cancelled_by_loss:
            return  # a running task meets the connection's error itself
        if task in self._expired:
            return  # already cancelled as overdue: it fails with its timeout
        self._cancelled_by_loss[task] = (root_rank, why)
        if told:
            self._cancelled_by_notice.add(task)
        task.cancel()

    def _tell_call_failed(self, channel: int, root_rank: int, why: str | None = None) -> None:
        """Tell the others that our collective on ``channel`` failed because ``root_rank``
        left before sending us its part (or, with ``why``, that this rank, ``root_rank``,
        did not run it): theirs cannot finish either (they may be waiting on us), so they
        fail it at once instead of at their timeout."""
        # This group's members only: the call is theirs.
        members = [r for r in self._conns if self._root_ranks[r] not in self._left]
        body: dict[str, Any] = {"call": channel, "lost": root_rank}
        if why is not None:
            body["why"] = why[:_WHY_CHARS]
        self._send_control(body, members)

    def _send_control(self, body: dict[str, Any], ranks: Iterable[int]) -> None:
        """One control message to each of ``ranks`` (best effort: a connection that is
        already gone is skipped; its loss is reported on its own)."""
        meta = bytes(msgpack.packb(body, use_bin_type=True))
        for r in ranks:
            with contextlib.suppress(P2PError):
                self._conns[r].send_nowait(CONTROL_CHANNEL, meta=meta)

    def _on_call_failed(self, channel: int, root_rank: int, why: str | None = None) -> None:
        """Another rank's collective on ``channel`` failed for want of ``root_rank`` (or,
        with ``why``, rank ``root_rank`` did not run it)."""
        for task, (_, running, _) in list(self._inflight.items()):
            if running == channel:
                self._cancel_for_loss(task, root_rank, told=True, why=why)
                return
        if channel in self._failed_calls or self._is_past(channel):
            return
        if len(self._failed_calls) < _FAILED_CALLS_MAX:
            self._failed_calls[channel] = (root_rank, why)  # not started here: fail it then

    def _call_channel(self, cid: int) -> int:
        """The channel of this group's collective call ``cid``."""
        return (self._space << SPACE_SHIFT) | cid

    def _retire_everywhere(self, channel: int) -> None:
        """Retire ``channel`` on every connection: what the others send on it is dropped."""
        for conn in self._conns.values():
            conn.retire(channel)

    def _is_past(self, channel: int) -> bool:
        """Whether this rank's group of ``channel`` has already run, refused or skipped
        that call (one called but not started yet is not past)."""
        space, counter = split_channel(channel)
        for group in [self, *self._descendants]:
            if group._space == space:
                return counter < group._next_cid and counter not in group._pending
        return False

    def _gone_with(self, err: P2PError) -> int | None:
        """Under ``on_peer_loss="leave"``: the root rank whose leaving ended a connection
        with ``err`` (so a collective failing with it leaves the group usable), else None."""
        if self.config.on_peer_loss != "leave" or isinstance(err, MismatchError):
            return None
        root = self._root()
        for r, cause in self._left.items():
            if cause is err or (isinstance(err, PeerError) and err.peer == root.peer_label(r)):
                return r
        return None

    def _failure_error(self, failure: CallFailure, link: CollectiveLink) -> PeerError:
        """The error of a collective that failed for ``failure`` (a notice, or ours)."""
        root_rank, why = failure
        if why is None:
            return self._loss_error(root_rank, link)
        peer = self._root().peer_label(root_rank)
        return MismatchError(peer, f"did not run {link.explain()}: {why}")

    def _loss_error(self, root_rank: int, link: CollectiveLink) -> ConnectionBrokenError:
        """The error of a collective that needed ``root_rank``, which left or was lost."""
        cause = self._left.get(root_rank) or self._root()._last_loss.get(root_rank)
        why = cause.detail if isinstance(cause, PeerError) else cause
        if root_rank in self._closed_by:
            why = "it closed the sub-group"
        elif cause is None:
            why = "another rank's part of the call lacked it"
        return ConnectionBrokenError(
            self._root().peer_label(root_rank),
            f"left the group while {link.explain()} needed it ({why})",
        )

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background until the group closes (close() awaits it)."""
        self._listeners = [t for t in self._listeners if not t.done()]
        self._listeners.append(asyncio.create_task(work))

    # ---- forming --------------------------------------------------------------------------

    async def _form(self, transport: TcpTransport | QuicTransport) -> None:
        """Connect to every rank, bounded by ``connect_timeout``; closes on failure.

        Each rank dials the lower ranks and accepts the higher ones; an accepting rank
        answers ``ok`` (or ``refused``, with the reason, to a second live connection from
        one rank: two processes claim it). A rank connected to every other one tells
        each ``ready``, and formation ends when every rank has said ``ready`` on a
        connection that is still open. A rank whose start fails tells the others
        ``failed`` (why) before it closes, so they fail naming it instead of waiting;
        a connection that ends without a word is a rank that restarted, and is waited
        for again (the accepting side takes a new connection from a rank only once the
        old one has ended)."""
        form = _Formation(self._rank, self.size, group_terms(self.config, self.size))
        self._forming = form
        refused_before = transport.refused_incoming
        try:
            async with asyncio.timeout(self.config.connect_timeout):
                async with asyncio.TaskGroup() as tg:
                    accepting = tg.create_task(self._accept_forming(transport, form))
                    peers = [
                        tg.create_task(self._form_with(transport, r, form))
                        for r in range(self.size)
                        if r != self._rank
                    ]
                    await asyncio.wait(peers)
                    accepting.cancel()
                self._check_formed(form)
            self._forming = None  # formed: a close from now on is a rank that leaves
        except TimeoutError:
            not_in = [r for r in range(self.size) if r != self._rank and r not in form.joined]
            quiet = [r for r in form.joined if r not in form.ready]
            refused = transport.refused_incoming - refused_before
            last = transport.last_refusal or ""
            tls_differs = bool(refused) and TLS_MISMATCH_HINT in last
            why = []
            if not_in:
                names = ", ".join(f"{self.peer_label(r)} {self._where(r)}" for r in not_in)
                why.append(f"no connection to {names}")
                if self._relay_url is not None:
                    # Through a relay a rank with another seed has other ids: nobody
                    # refuses anything, the ranks just never meet.
                    why.append("is every rank running, with the same seed and relay?")
                higher = range(self._rank + 1, self.size)
                if higher and all(r in not_in for r in higher) and not tls_differs:
                    # No higher rank dialed us: they may be running without this rank.
                    why.append(
                        "if the others already formed a group without this rank, "
                        "restart it with rejoin=True"
                    )
            if quiet:
                names = ", ".join(self.peer_label(r) for r in sorted(quiet))
                why.append(f"{names} never said it was connected to every rank")
            for r, refusal in sorted(form.refusals.items()):
                if r in not_in:
                    why.append(_formed_refusal(self.peer_label(r), refusal, self._rank))
            if refused:
                hint = "" if tls_differs else ": a rank with another seed?"
                why.append(
                    f"{refused} incoming connection(s) refused meanwhile, the last ({last}){hint}"
                )
            took = f"forming the group took over {self.config.connect_timeout:g} s"
            # The others learn why too: one that times out a moment later would otherwise
            # raise our note alone, naming us and not the rank that is missing.
            note = "; ".join([took, *why])
            if len(note) > _NOTE_CHARS:  # a frame's meta is bounded: a huge world's list
                note = note[: _NOTE_CHARS - 1] + "…"
            await self._fail_forming(form, note)
            raise P2PTimeoutError(
                f"{self.peer_label(self._rank)}: {took}; " + "; ".join(why)
            ) from None
        except BaseExceptionGroup as group:
            first = _first_error(group)
            reason = str(first) if isinstance(first, Exception) else None
            await self._fail_forming(form, reason, first)
            raise first from None
        except BaseException as exc:
            # A cancelled start (Ctrl-C, an outer timeout) has no reason to give: it tells
            # only the ranks it said ready to that it stopped (_tell_start_stopped).
            await self._fail_forming(form, str(exc) if isinstance(exc, Exception) else None)
            raise

    async def _fail_forming(
        self, form: _Formation, why: str | None, error: BaseException | None = None
    ) -> None:
        """Tell every connected rank why our start failed, then close. (A start that was
        cancelled, ``why`` None, or a group closed while it starts tells the ranks it said
        ready to that its start stopped, and says only goodbye to the others: to them it
        is a rank that restarts, waited for within connect_timeout.) A settings mismatch
        is marked as one, so that every rank raises MismatchError."""
        conns = {id(c): c for c in [*self._conns.values(), *form.joined.values()]}
        kind = "mismatch" if isinstance(error, MismatchError) else None
        if self._closing or why is None:
            self._tell_start_stopped()
        else:
            for conn in conns.values():
                _form_note(conn, "failed", f"{self.peer_label(self._rank)}: {why}", error=kind)
        self._forming = None
        await self.close()

    def _tell_start_stopped(self) -> None:
        """(Root, on close or cancellation while start() forms the group) tell the ranks
        we said ``ready`` to that our start stopped: a goodbye alone after ``ready`` means
        a rank that formed and left at once (see :meth:`_check_formed`), and this one did
        not form. Those we did not say ``ready`` to see a rank that restarts, and wait."""
        form, self._forming = self._forming, None
        if form is None:
            return
        why = f"{self.peer_label(self._rank)}: its start was stopped (closed or cancelled)"
        for conn in form.told:
            _form_note(conn, "failed", why)

    def _check_formed(self, form: _Formation) -> None:
        """Every connection must be the one that said ``ready``, and still open, once
        formation ends (a rank that was lost or restarted meanwhile would otherwise only
        show up as "left" later). One that said ``ready`` and then goodbye formed the
        group on its side and left it at once (its ``async with`` body failed first): it
        is a member that left, as it would be a moment later."""
        for r in sorted(self._conns):
            conn = self._conns[r]
            left = _said_goodbye(conn)
            if conn is not form.ready.get(r) or (conn.closed and not left) or r in self._left:
                raise GroupBrokenError(
                    f"{self.peer_label(self._rank)}: the connection to {self.peer_label(r)} "
                    "ended while the group formed"
                )

    async def _dial(self, transport: TcpTransport | QuicTransport, r: int) -> Connection:
        # Bounded by start()'s connect_timeout, which names every rank still missing.
        address = None
        if isinstance(transport, TcpTransport):
            assert self._addresses is not None
            address = self._addresses[r]
        return await dial_with_retry(
            transport, self._ids[r], address, label=self.peer_label(r), timeout=None
        )

    async def _form_with(
        self, transport: TcpTransport | QuicTransport, r: int, form: _Formation
    ) -> None:
        """Connect with rank ``r`` until it says ``ready`` (again after a restart)."""
        label = self.peer_label(r)
        while True:
            if r < self._rank:
                try:
                    conn = await self._dial(transport, r)
                except PeerAuthenticationError as exc:
                    if _FORMED_ALREADY in exc.detail:
                        await form.refused_by(r, label, exc.detail)
                        continue
                    if "identity mismatch" in exc.detail:
                        # The process there holds another key than this seed gives rank r.
                        raise PeerAuthenticationError(
                            label,
                            f"{exc.detail}: the process {self._where(r)} is not the rank "
                            f"{r} this rank expects: do all ranks use the same seed and the "
                            "same peers list, in rank order?",
                        ) from None
                    if NOT_ADMITTED in exc.detail:
                        # A refusal of non-members: it has other ids for its ranks.
                        raise PeerAuthenticationError(
                            label,
                            f"{exc.detail}: the process {self._where(r)} does not count this "
                            "endpoint as a member of its group: do all ranks use the same "
                            "seed, world size and peers list?",
                        ) from None
                    raise
                self._conns[r] = conn
            else:
                conn = await form.inbox[r].get()
                _form_note(conn, "ok", terms=form.terms)
                form.join(r, conn)
            while True:
                try:
                    frame = await conn.recv(_FORM_CHANNEL)
                except (ConnectionBrokenError, ConnectionClosedError) as exc:
                    # Ended without a word: it restarted (or died); wait for it again.
                    log.info("%s: connection ended while forming (%s); waiting for it", label, exc)
                    form.leave(r, conn)
                    await conn.close()
                    break
                kind, why, note = _read_note(label, frame.meta)
                if kind == "refused" and note.get("error") == "formed" and r < self._rank:
                    await conn.close()
                    await form.refused_by(r, label, why)
                    break
                if kind == "ok" and r < self._rank:
                    check_terms(label, self.peer_label(self._rank), note.get("terms"), form.terms)
                    form.join(r, conn)
                elif kind == "ready":
                    here = self.peer_label(self._rank)
                    check_terms(label, here, note.get("terms"), form.terms)
                    form.said_ready(r, conn)
                    await self._watch_until_formed(r, conn, form)
                    conn.retire(_FORM_CHANNEL)
                    return
                else:
                    _raise_for_note(label, kind, why, note)

    async def _watch_until_formed(self, r: int, conn: Connection, form: _Formation) -> None:
        """After ``r`` said ready, keep reading its formation notes until every rank has
        said ready: a rank whose start fails later (it found a mismatch with a third
        rank, say) says ``failed``, which fails this formation at once instead of
        leaving it waiting for ranks that gave up. (A connection that ends is left to
        the end of formation, :meth:`_check_formed`, and a restarted process to
        :meth:`_accept_forming`, which tells it why it is refused.)"""
        label = self.peer_label(r)
        note_task = asyncio.ensure_future(conn.recv(_FORM_CHANNEL))
        formed = asyncio.ensure_future(form.all_ready.wait())
        try:
            await asyncio.wait((note_task, formed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (note_task, formed):
                task.cancel()
            await asyncio.gather(note_task, formed, return_exceptions=True)
        try:
            if note_task.done() and not note_task.cancelled():
                frame = note_task.result()
            elif conn.closed:  # a note sent before its goodbye is still queued: read it
                frame = await conn.recv(_FORM_CHANNEL, timeout=_QUEUED_NOTE_WAIT)
            else:
                return  # every rank said ready, and r has said nothing since
        except (
            ConnectionBrokenError,
            ConnectionClosedError,
            P2PTimeoutError,
            asyncio.CancelledError,
        ):
            return
        kind, why, note = _read_note(label, frame.meta)
        _raise_for_note(label, kind, why, note)

    async def _accept_forming(
        self, transport: TcpTransport | QuicTransport, form: _Formation
    ) -> None:
        """Hand each higher rank's connection to its :meth:`_form_with`; refuse a second
        live connection from one rank (two processes claim it) with the reason."""
        while True:
            conn = await transport.accept()
            r = self._rank_of[conn.peer_id]  # transport.accept_from admits members only
            label = self.peer_label(r)
            old = self._conns.get(r)
            why = None
            if r == self._rank:
                why = f"{label} is this process: two processes claim rank {r}?"
            elif r < self._rank:
                why = f"the group is forming, and {label} is dialed by higher ranks, not dialing"
            elif old is not None and not old.closed:
                where = _remote(old)
                why = f"{label} is already connected from {where}: two processes claim rank {r}?"
            elif r in form.ready and _said_goodbye(form.ready[r]):
                # It formed and left (see _check_formed): a new process of it is one
                # that comes after formation, told to dial again later ("formed").
                _form_note(conn, "refused", _FORMED_ALREADY, error="formed")
                self._turn_away(conn, _FORMED_ALREADY, rank=r, noted=True, routine=True)
                continue
            elif r in form.ready:
                # It said ready and then restarted: ranks may have formed with its old
                # process already, so this formation cannot take the new one.
                restarted = (
                    f"{label} restarted after it said it was connected to every rank; "
                    "start every rank again"
                )
                self._turn_away(conn, restarted)
                raise GroupBrokenError(f"{self.peer_label(self._rank)}: {restarted}")
            if why is not None:
                self._turn_away(conn, why)
                continue
            if old is not None:
                log.info("%s connected again (restarted while the group formed)", label)
            self._conns[r] = conn
            form.inbox[r].put_nowait(conn)

    # ---- connections: shared by forming and rejoining ------------------------------------

    def _accepts(self, eid: EndpointId) -> bool | str:
        """Group members, and only until the group has formed, unless lost ranks may come
        back (``on_peer_loss="leave"``): a member that dials afterwards is refused with
        :data:`_FORMED_ALREADY`, which makes a forming dialer dial again (see
        :meth:`_Formation.refused_by`); anyone else is refused outright."""
        if eid not in self._rank_of:
            return False
        return not self._formed or self.config.on_peer_loss == "leave" or _FORMED_ALREADY

    def _turn_away(
        self,
        conn: Connection,
        why: str,
        error: str | None = None,
        *,
        rank: int | None = None,
        noted: bool = False,
        routine: bool = False,
    ) -> None:
        """Tell a dialer (forming or rejoining) why it is refused, and close; ``error``
        ("mismatch") makes a rejoiner raise MismatchError. ``rank``: the dialer's, when
        known (the log names it); ``noted``: its formation ``refused`` note went already;
        ``routine``: expected, and asked again and again (logged at INFO, not WARNING)."""
        who = _remote(conn) if rank is None else f"{self.peer_label(rank)} ({_remote(conn)})"
        level = logging.INFO if routine else logging.WARNING
        log.log(
            level, "%s: refusing a connection from %s: %s", self.peer_label(self._rank), who, why
        )
        if not noted:
            _form_note(conn, "refused", why)
        refusal: dict[str, Any] = {"refused": why}
        if error is not None:
            refusal["error"] = error
        with contextlib.suppress(P2PError):
            conn.send_nowait(_HELLO_CHANNEL, meta=bytes(msgpack.packb(refusal)))
        self._spawn(conn.close())

    def _adopt(self, rank: int, conn: Connection) -> None:
        """Make ``conn`` (just formed) ``rank``'s connection: label, loss, abort notices."""
        self._conns[rank] = conn
        conn.label = self.peer_label(rank)
        self._watch(rank, conn)
        self._spawn(self._listen_control(rank, conn))


def _form_note(
    conn: Connection,
    kind: str,
    why: str = "",
    terms: dict[str, Any] | None = None,
    error: str | None = None,
) -> None:
    """Send one formation note (best effort: a connection already gone is skipped)."""
    note: dict[str, Any] = {"form": kind, "why": why}
    if terms is not None:
        note["terms"] = terms
    if error is not None:
        note["error"] = error
    with contextlib.suppress(P2PError):
        conn.send_nowait(_FORM_CHANNEL, meta=bytes(msgpack.packb(note)))


def group_terms(config: GroupConfig, world: int) -> dict[str, Any]:
    """The settings every rank must share, sent with ``ok`` and ``ready``: the world
    size, the algorithms and their message sizes (``small_bytes``, ``chunk_bytes``,
    ``algorithm``: as set, not as ``"auto"`` resolves, since sub-groups resolve it for
    their own size), and ``on_peer_loss``, which decides whether a lost rank breaks the
    group or leaves it, as all ranks must see alike."""
    return {
        "world": world,
        "small_bytes": config.small_bytes,
        "chunk_bytes": config.chunk_bytes,
        "algorithm": config.algorithm,
        "on_peer_loss": config.on_peer_loss,
    }


def check_terms(label: str, me: str, theirs: object, ours: dict[str, Any]) -> None:
    """Raise :class:`MismatchError` naming ``label`` if its ``ready`` note's settings
    differ from ours (``me`` names this rank; a note without them is from a peer that
    predates the check)."""
    if theirs is None:
        return
    if not isinstance(theirs, dict):
        raise RemoteProtocolError(label, f"malformed formation terms: {theirs!r:.80}")
    differ = [
        f"{name} is {theirs.get(name)!r:.40} on {label}, {value!r} on {me}"
        for name, value in ours.items()
        if theirs.get(name) != value
    ]
    if differ:
        raise MismatchError(
            label,
            "settings differ: " + "; ".join(differ) + " (world and GroupConfig's "
            "small_bytes, chunk_bytes, algorithm and on_peer_loss must be equal on every "
            "rank)",
        )


def _read_note(label: str, meta: bytes) -> tuple[str, str, dict[str, Any]]:
    """A formation note from ``label``: (kind, why, the whole note)."""
    try:
        note = msgpack.unpackb(meta, raw=False)
        return str(note["form"]), str(note.get("why", "")), note
    except Exception as exc:  # msgpack's own exceptions, a missing key, a bad type
        raise RemoteProtocolError(label, f"malformed formation note: {exc!r}") from None


def _raise_for_note(label: str, kind: str, why: str, note: dict[str, Any]) -> None:
    """Raise what a formation note other than ``ok``/``ready`` from ``label`` means."""
    if kind == "refused":
        raise PeerAuthenticationError(label, f"refused this rank's connection: {why}")
    if kind == "failed":
        if note.get("error") == "mismatch":
            raise MismatchError(label, f"could not join the group ({why})")
        raise ConnectionBrokenError(label, f"could not join the group ({why})")
    raise RemoteProtocolError(label, f"unexpected formation note {kind!r}")


def _formed_refusal(label: str, refusal: str, me: int) -> str:
    """Why ``label`` kept refusing this rank (``me``) while it formed."""
    return (
        f"{label} refused this rank's connections until the end ({refusal}), so another "
        f"process has rank {me} (two processes claim rank {me}?), or this rank restarted "
        '(a rank can rejoin only a group that runs with on_peer_loss="leave", with '
        "rejoin=True), or that process kept an earlier group open for longer than "
        "connect_timeout"
    )


def _said_goodbye(conn: Connection) -> bool:
    """Whether the peer ended ``conn`` on purpose (a goodbye), not by a loss."""
    ended = conn.end_error
    return isinstance(ended, ConnectionBrokenError) and ended.graceful


def _remote(conn: Connection) -> str:
    """Where ``conn``'s peer is, as ``ip:port`` when the transport knows."""
    addr = getattr(conn, "remote_address", None)
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "elsewhere"


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error that failed a formation: the first that is not a cancellation."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


class _Formation:
    """One formation's state: each rank's connection once it is accepted, and the ranks
    that said ``ready``."""

    def __init__(self, rank: int, size: int, terms: dict[str, Any]) -> None:
        self.size = size
        self.terms = terms
        self.inbox: dict[int, asyncio.Queue[Connection]] = {
            r: asyncio.Queue() for r in range(rank + 1, size)
        }
        self.joined: dict[int, Connection] = {}
        self.ready: dict[int, Connection] = {}  # the connection each rank said ready on
        self.all_ready = asyncio.Event()
        self.told: set[Connection] = set()  # told "ready" (connections hash by identity)
        self.refusals: dict[int, str] = {}
        """The last refusal from each lower rank whose group had formed already."""
        self._refused_count: dict[int, int] = {}

    async def refused_by(self, r: int, label: str, why: str) -> None:
        """Lower rank ``r`` refused us because its group has formed: most likely the
        process there has not closed its previous group yet (a program that forms the
        group again in a loop, where that rank lags a moment). Wait a little, growing, so
        that the caller dials again; formation's connect_timeout bounds it all, and its
        error then says why (:func:`_formed_refusal`)."""
        tries = self._refused_count.get(r, 0)
        self._refused_count[r] = tries + 1
        if not tries:
            log.info("%s refused us (its group formed already): dialing again", label)
        self.refusals[r] = why
        await asyncio.sleep(min(_REFUSED_FIRST_RETRY * 2**tries, _REFUSED_MAX_RETRY))

    def join(self, r: int, conn: Connection) -> None:
        """``conn`` is ``r``'s accepted connection: once every rank has one, say ready."""
        self.joined[r] = conn
        self.refusals.pop(r, None)
        if len(self.joined) == self.size - 1:
            for c in self.joined.values():
                if c not in self.told:
                    self.told.add(c)
                    _form_note(c, "ready", terms=self.terms)

    def said_ready(self, r: int, conn: Connection) -> None:
        """``r`` said ready on ``conn``; once every rank has, formation is done."""
        self.ready[r] = conn
        if len(self.ready) == self.size - 1:
            self.all_ready.set()

    def leave(self, r: int, conn: Connection) -> None:
        """``conn`` ended before ``r`` said ready."""
        if self.joined.get(r) is conn:
            del self.joined[r]
