"""Who is in a group once formed: ranks that leave or are lost, and channel spaces
reserved for traffic beside the collectives; also the channels, the formation note and
the handling of accepted connections that forming and rejoining share. Mixed into
:class:`~p2pdist.group.core.GroupCore` (which sets every attribute declared here);
forming the group at start is :mod:`p2pdist.group.forming`'s job, and taking back ranks
that restart :mod:`p2pdist.group.rejoin`'s.

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
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from ..errors import (
    ConnectionBrokenError,
    GroupBrokenError,
    MismatchError,
    P2PError,
    PeerError,
    UsageError,
)
from ..identity import EndpointId
from ..transport.base import Address, Connection
from ..transport.mailbox import SPACE_SHIFT, split_channel
from ..transport.relay_path import RelayPath
from ..wire.relay import RelayUrl
from .config import GroupConfig
from .link import CollectiveLink
from .spaces import SpaceBook

if TYPE_CHECKING:
    from ..discovery import LanDiscovery

__all__ = ["CONTROL_CHANNEL", "FIRST_RESERVED_SPACE", "LAST_SPACE", "LEAVING_MAX", "Membership"]

log = logging.getLogger(__name__)
_FORMED_ALREADY = "its group has formed already"
"""Why a formed group refuses a member's new connection (the dialer dials again)."""

_CLOSED_EARLY_MAX = 1024
"""Sub-group close notices kept for sub-groups whose split has not returned here yet
(each split returns soon: the bound only stops a peer from growing the dict)."""
_UNMADE = "its split(color, key) that made this sub-group failed there"

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


_LEFT_BECAUSE = "its `async with` block raised"
"""How an explained goodbye (see :meth:`Membership._explained`) gives its reason."""
_START_FAILED = "its start failed after it said it was connected to every rank:"
"""How it gives the reason of a rank whose start failed after it said ready."""
LEAVING_MAX = 300
"""Longest reason a leaving notice carries (and a receiver keeps), characters."""


class RunningCall(NamedTuple):
    """A collective in flight, as the root group's watchdog and loss handling see it."""

    group: Membership
    channel: int
    deadline: float
    """When the watchdog ends it (loop time)."""
    link: CollectiveLink
    grace: float
    """How long past ``deadline`` it may still wait once, when the rank it waits on did
    start the call (``Runner._on_watchdog``); 0 once given."""


class Membership:
    """Leaving, loss and channel-space reservations of a group."""

    config: GroupConfig
    _rank: int
    _ids: list[EndpointId]
    _rank_of: dict[EndpointId, int]
    _conns: dict[int, Connection]
    _left: dict[int, BaseException]  # by root rank
    _root_ranks: list[int]
    _descendants: weakref.WeakSet[Membership]
    _reserved: dict[int, str]
    _inflight: dict[asyncio.Task[Any], RunningCall]
    _cancelled_by_loss: dict[asyncio.Task[Any], CallFailure]
    _cancelled_by_notice: set[asyncio.Task[Any]]  # of those, cancelled on another's word
    _expired: set[asyncio.Task[Any]]  # collectives the watchdog cancelled (overdue)
    _closed_calls: set[asyncio.Task[Any]]  # collectives a sub-group's close cancelled
    _last_loss: dict[int, BaseException]  # root: why each root rank was last lost or left
    _leaving: dict[int, str]  # root: why a rank leaves ("its ... raised X"), as it said
    _closed_by: dict[int, int]  # root rank that closed this sub-group -> its next cid then
    _unmade: set[int]  # root ranks in _closed_by whose split of this sub-group failed
    _made_on: int | None  # the channel of the split that made this sub-group
    _closed_early: dict[int, list[tuple[int, int]]]  # root: notices before their split
    _parent: Membership | None  # the group this one was split from
    _broken: BaseException | None  # why the group can no longer be used (None: it can)
    _broken_during: int | None  # the call (channel) whose failure broke it, if one did
    _failed_calls: dict[int, CallFailure]  # channel -> why another rank's call failed
    _refused_from: dict[int, tuple[int, int]]  # root: space -> (first cid, left root rank)
    _p2p_sent: dict[int, int]
    _p2p_received: dict[int, int]
    _p2p_given_back: dict[int, list[int]]
    _next_cid: int
    _pending: dict[int, int]  # see calls.Reserving
    _space: int  # the channel space of this group's collectives
    _p2p_space: int  # and of its point-to-point messages
    _spaces: SpaceBook  # root only
    _listeners: list[asyncio.Task[None]]
    _closing: bool
    _formed: bool
    _rejoin: bool
    _failure_log: list[BaseException]
    _given_up: dict[int, GroupBrokenError]  # root: see GroupCore
    _addresses: list[Address] | None
    _discovery: LanDiscovery | None  # neither peers nor relay: ranks found on the LAN
    _relay_url: RelayUrl | None
    _relay_path: RelayPath | None

    # ---- provided by GroupCore ------------------------------------------------------------

    def peer_label(self, rank: int) -> str:
        """How errors name a rank."""
        raise NotImplementedError

    def _root(self) -> Membership:
        raise NotImplementedError

    def _break(
        self, error: BaseException, *, notify: bool = False, during: int | None = None
    ) -> None:
        raise NotImplementedError

    def _cut_p2p(self, root_rank: int | None) -> None:
        raise NotImplementedError

    async def _listen_control(self, rank: int, conn: Connection) -> None:
        raise NotImplementedError

    def _read_notices(self, rank: int, conn: Connection) -> None:
        """Act now on the notices from ``rank`` that have arrived on ``conn``."""
        raise NotImplementedError

    def _blame_unsure(self, link: CollectiveLink) -> bool:
        """Whether a timeout of ``link`` now would name a rank that did start it."""
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
            if self._conns.get(rank) is not conn:
                return
            # A goodbye ends the connection in the read that brought the frames just
            # before it: an abort notice among them waits for the control listener's
            # next step. Read first, so that a call starting now learns why the rank
            # left, not only that it did.
            self._read_notices(rank, conn)
            self._on_connection_end(rank, error)

        if conn.closed:  # ended already (said goodbye as the group formed): now, not soon
            ended(conn.end_error)  # a call made at once must find the rank gone
            return
        conn.add_close_callback(ended)

    def _relay_down(self, r: int | None) -> str:
        """A hint when rank ``r`` is reached through a relay session that is down (see
        :meth:`~p2pdist.group.runner.Runner._relay_down`), else ``""``."""
        raise NotImplementedError

    def _explained(self, error: ConnectionBrokenError) -> ConnectionBrokenError:
        """``error``, a rank's goodbye, with the reason its leaving notice gave (its
        program failed) when it sent one; else ``error`` itself."""
        root = self._root()
        said = [why for r, why in root._leaving.items() if root.peer_label(r) == error.peer]
        if not (said and error.graceful) or said[0] in error.detail:
            return error
        return ConnectionBrokenError(error.peer, f"{error.detail}: {said[0]}", graceful=True)

    def _on_connection_end(self, rank: int, error: BaseException | None) -> None:
        if error is None or self._closing:
            return
        if isinstance(error, ConnectionBrokenError):
            error = self._explained(error)
            relay = "" if error.graceful else self._relay_down(rank)
            if relay:  # silent because the relay is out of reach, not because it died
                error = ConnectionBrokenError(error.peer, error.detail + relay)
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

    def _cancel_inflight(self, root_rank: int, *, taken_back: bool = False) -> None:
        """Fail every running collective of a group that has ``root_rank`` as a member:
        it can no longer finish, and its other ranks may wait on us, not on the lost one.
        ``GroupCore._run`` turns the cancellation into an error naming the lost rank, and
        tells the other members. ``taken_back``: the rank is about to be taken back, so
        only this (root) group's calls, whose connection to it is replaced, and the
        other members are told here, not by ``_run`` later (its new process must not be
        told of calls it never ran)."""
        for task, (group, channel, *_) in list(self._inflight.items()):
            if taken_back and group is not self:
                continue
            if root_rank in group._root_ranks:
                if taken_back:
                    group._tell_call_failed(channel, root_rank)
                self._cancel_for_loss(task, root_rank, told=taken_back)

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
        if self._spaces.taken(space):
            return  # a sub-group this rank closed and let go of: nothing left to tell
        early = self._closed_early
        if space in early or len(early) < _CLOSED_EARLY_MAX:
            early.setdefault(space, []).append((root_rank, next_cid))

    def _apply_closed(self, group: Membership, root_rank: int, next_cid: int) -> None:
        """(Root group) ``root_rank`` is gone from ``group`` from call ``next_cid`` on:
        those calls are refused (``_run``), and those running here fail at once naming
        it; the earlier ones have its part and finish."""
        group._closed_by[root_rank] = next_cid
        for task, (running, channel, *_) in list(self._inflight.items()):
            if running is group and split_channel(channel)[1] >= next_cid:
                self._cancel_for_loss(task, root_rank, told=True)
        asyncio.get_running_loop().call_soon(group._cut_p2p, root_rank)

    def _cancel_closed(self, group: Membership) -> None:
        """(Root group) fail the running collectives of ``group`` (a sub-group being
        closed) and of its sub-groups; ``_run`` turns each into GroupBrokenError."""
        closing = {group, *self._split_from(group)}
        for task, (running, channel, *_) in list(self._inflight.items()):
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
        if task is asyncio.current_task():
            return  # a running task meets the connection's error itself
        if task in self._expired:
            return  # already cancelled as overdue: it fails with its timeout
        if told:  # (also for a task cancelled for the loss already: told, it tells no one)
            self._cancelled_by_notice.add(task)
        if task in self._cancelled_by_loss:
            return
        self._cancelled_by_loss[task] = (root_rank, why)
        task.cancel()

    def _tell_call_failed(
        self, channel: int, root_rank: int, why: str | None = None, *, onward: bool = False
    ) -> None:
        """Tell the others that our collective on ``channel`` failed because ``root_rank``
        left before sending us its part (or, with ``why``, that this rank, ``root_rank``,
        did not run it): theirs cannot finish either (they may be waiting on us), so they
        fail it at once instead of at their timeout. ``onward``: this rank refuses every
        later collective of the group too (a rank left under ``on_peer_loss="break"``), so
        theirs from ``channel`` on fail as well (a peer of an earlier version reads it as
        a notice of ``channel`` alone)."""
        # This group's members only: the call is theirs.
        members = [r for r in self._conns if self._root_ranks[r] not in self._left]
        body: dict[str, Any] = {"call": channel, "lost": root_rank}
        if why is not None:
            body["why"] = why[:_WHY_CHARS]
        if onward:
            body["onward"] = True
        self._send_control(body, members)

    def _send_control(self, body: dict[str, Any], ranks: Iterable[int]) -> None:
        """One control message to each of ``ranks`` (best effort: a connection that is
        already gone is skipped; its loss is reported on its own)."""
        meta = bytes(msgpack.packb(body, use_bin_type=True))
        for r in ranks:
            with contextlib.suppress(P2PError):
                self._conns[r].send_nowait(CONTROL_CHANNEL, meta=meta)

    def _on_call_failed(
        self,
        channel: int,
        root_rank: int,
        why: str | None,
        sender: int,
        *,
        onward: bool = False,
    ) -> None:
        """Another rank's (``sender``'s) collective on ``channel`` failed for want of
        ``root_rank`` (or, with ``why``, rank ``root_rank`` did not run it); ``onward``:
        and every later one of that group fails there too (see :meth:`_tell_call_failed`)."""
        made = next((g for g in self._descendants if g._made_on == channel), None)
        if made is not None:  # (rare: a search beats remembering every split)
            self._split_failed_there(made, sender)
            return
        if onward:
            self._refused_onward(channel, root_rank)
        for task, (_, running, *_) in list(self._inflight.items()):
            if running == channel:
                self._cancel_for_loss(task, root_rank, told=True, why=why)
                return
        if channel in self._failed_calls or self._is_past(channel):
            return
        if len(self._failed_calls) < _FAILED_CALLS_MAX:
            self._failed_calls[channel] = (root_rank, why)  # not started here: fail it then

    def _refused_onward(self, channel: int, root_rank: int) -> None:
        """(Root) a rank refuses every collective of ``channel``'s group from that call on,
        for want of ``root_rank``: ours running from there fail now, and ours starting
        later fail as they start (for good: such notices come under
        ``on_peer_loss="break"``, where no rank is taken back). Ours on ``channel``
        itself are left to the caller (a notice of that one call)."""
        space, first = split_channel(channel)
        known = self._refused_from.get(space)
        if known is None and len(self._refused_from) >= _FAILED_CALLS_MAX:
            return
        if known is None or first < known[0]:
            self._refused_from[space] = (first, root_rank)
        for task, (_, running, *_) in list(self._inflight.items()):
            running_space, cid = split_channel(running)
            if running_space == space and cid > first:
                self._cancel_for_loss(task, root_rank, told=True)

    def _refused_here(self, channel: int) -> CallFailure | None:
        """(Root) why the call on ``channel`` fails at once, if a rank refuses it (see
        :meth:`_refused_onward`)."""
        space, cid = split_channel(channel)
        known = self._refused_from.get(space)
        if known is None or cid < known[0]:
            return None
        return known[1], None

    def _split_failed_there(self, child: Membership, sender: int) -> None:
        """(Root group) the split that made ``child`` finished here, but failed on root
        rank ``sender`` (its part came in before it failed: a rank that closed the group
        under the split, or lost another member): ``sender`` has no such sub-group, so
        every call on ours, and on the sub-groups split from it, fails at once naming it
        instead of waiting for it until the timeout breaks the group."""
        if sender not in child._root_ranks:
            return  # a sub-group of another colour: it is whole
        for group in [child, *self._split_from(child)]:
            if sender in group._root_ranks and sender not in group._closed_by:
                group._unmade.add(sender)
                self._apply_closed(group, sender, 0)

    def _closed_reason(self, root_rank: int) -> str:
        """Why ``root_rank``, in :attr:`_closed_by`, is gone from this sub-group."""
        return _UNMADE if root_rank in self._unmade else "it closed the sub-group"

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
            why = self._closed_reason(root_rank)
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

    # ---- connections: shared by forming and rejoining ------------------------------------

    def _accepts(self, eid: EndpointId) -> bool | str:
        """Group members, and only until the group has formed, unless lost ranks may come
        back (``on_peer_loss="leave"``): a member that dials afterwards is refused with
        :data:`_FORMED_ALREADY`, which makes a forming dialer dial again (see
        :meth:`~p2pdist.group.forming._Formation.refused_by`); anyone else is refused outright."""
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


def _remote(conn: Connection) -> str:
    """Where ``conn``'s peer is, as ``ip:port`` when the transport knows."""
    addr = getattr(conn, "remote_address", None)
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "elsewhere"
