"""Who is in a group: forming the mesh, ranks that leave or are lost, ranks that come
back, and channel spaces reserved for traffic beside the collectives. Mixed into
:class:`~p2pdist.group.core.GroupCore` (which sets every attribute declared here).

Under ``GroupConfig(on_peer_loss="leave")`` a connection that ends without a goodbye
counts as the peer leaving; collectives that need it refuse to start, and running ones
fail naming it (:meth:`Membership._cancel_inflight`). A rank that restarts with the same
key may then **rejoin** (``rejoin=True``): it dials every rank, each survivor replaces
the old connection with the new one and answers with a hello (the ranks it knows to be
gone and its next collective id), and the rank is a member again on the root group
(sub-groups made before keep it as left: the restarted process is not in them).
Ranks that rejoin at the same time take each other back too, keeping the connection the
higher rank dialed; a second process for a rank whose connection is still live is
refused with the reason (docs/architecture.md section 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable, Coroutine, Iterable
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
from ..tasks import cancel_and_wait
from ..transport.base import Address, Connection
from ..transport.dial import dial_with_retry
from ..transport.mailbox import SPACE_SHIFT
from ..transport.quic import QuicTransport
from ..transport.tcp import TcpTransport
from .config import GroupConfig
from .link import CollectiveLink

__all__ = ["CONTROL_CHANNEL", "FIRST_RESERVED_SPACE", "LAST_SPACE", "Membership"]

log = logging.getLogger(__name__)

FIRST_RESERVED_SPACE = 0xFE00
"""``split`` hands out channel spaces below this; :meth:`Membership.reserve_channel_space`
those from here to :data:`LAST_SPACE`."""
LAST_SPACE = 0xFFFE  # 0xFFFF is the control channel's
_HELLO_SPACE = LAST_SPACE  # the group's own: a survivor's hello to a rank that rejoins
_HELLO_CHANNEL = _HELLO_SPACE << SPACE_SHIFT
_FORM_CHANNEL = _HELLO_CHANNEL + 1  # formation notes: ok, refused, ready, failed
_REJOINING_HELLO = bytes(msgpack.packb({"rejoining": True, "left": [], "cid": 0}))
"""The hello of a rank that rejoins itself: it knows nothing of who is gone."""
_SILENT_KEEPALIVES = 3
"""A connection silent for this many keepalive intervals is taken for dead."""
CONTROL_CHANNEL = 0xFFFF << SPACE_SHIFT
"""Abort notices and failed-call notices (msgpack maps)."""


class Membership:
    """Leaving, loss, rejoining and channel-space reservations of a group."""

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
    _cancelled_by_loss: dict[asyncio.Task[Any], int]
    _expired: set[asyncio.Task[Any]]  # collectives the watchdog cancelled (overdue)
    _failed_calls: dict[int, int]  # channel -> the root rank another rank's call lacked
    _p2p_sent: dict[int, int]
    _p2p_received: dict[int, int]
    _next_cid: int
    _space: int  # the channel space of this group's collectives
    _listeners: list[asyncio.Task[None]]
    _closing: bool
    _formed: bool
    _rejoin: bool
    _rejoining: _Rejoin | None  # while this rank rejoins
    _kept_dials: dict[int, Connection]  # a rank that rejoined with us -> our dial it kept
    _failure_log: list[str]
    _addresses: list[Address] | None

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
            if not graceful:
                # A rank that said goodbye finished what it was part of (what it sent is
                # still readable); one that was lost most likely did not.
                self._cancel_inflight(rank)
            return
        log.warning("%s: connection ended: %s", self.peer_label(rank), error)
        self._failure_log.append(str(error))
        self._break(error, notify=True)

    def _cancel_inflight(self, root_rank: int) -> None:
        """Fail every running collective of a group that has ``root_rank`` as a member:
        it can no longer finish, and its other ranks may wait on us, not on the lost one.
        ``GroupCore._run`` turns the cancellation into an error naming the lost rank."""
        for task, (group, _, _) in list(self._inflight.items()):
            if root_rank in group._root_ranks:
                self._cancel_for_loss(task, root_rank)

    def _cancel_for_loss(self, task: asyncio.Task[Any], root_rank: int) -> None:
        if task is asyncio.current_task() or task in self._cancelled_by_loss:
            return  # a running task meets the connection's error itself
        if task in self._expired:
            return  # already cancelled as overdue: it fails with its timeout
        self._cancelled_by_loss[task] = root_rank
        task.cancel()

    def _tell_call_failed(self, channel: int, root_rank: int) -> None:
        """Tell the others that our collective on ``channel`` failed because ``root_rank``
        left before sending us its part: theirs cannot finish either (they may be waiting
        on us), so they fail it at once instead of at their timeout."""
        # This group's members only: the call is theirs.
        members = [r for r in self._conns if self._root_ranks[r] not in self._left]
        self._send_control({"call": channel, "lost": root_rank}, members)

    def _send_control(self, body: dict[str, Any], ranks: Iterable[int]) -> None:
        """One control message to each of ``ranks`` (best effort: a connection that is
        already gone is skipped; its loss is reported on its own)."""
        meta = bytes(msgpack.packb(body, use_bin_type=True))
        for r in ranks:
            with contextlib.suppress(P2PError):
                self._conns[r].send_nowait(CONTROL_CHANNEL, meta=meta)

    def _on_call_failed(self, channel: int, root_rank: int) -> None:
        """Another rank's collective on ``channel`` failed for want of ``root_rank``."""
        for task, (_, running, _) in list(self._inflight.items()):
            if running == channel:
                self._cancel_for_loss(task, root_rank)
                return
        if not self._is_past(channel):
            self._failed_calls[channel] = root_rank  # not started here yet: fail it at start

    def _is_past(self, channel: int) -> bool:
        """Whether this rank's group of ``channel`` has already run (or refused) that call."""
        space, counter = channel >> SPACE_SHIFT, channel & ((1 << SPACE_SHIFT) - 1)
        for group in [self, *self._descendants]:
            if group._space == space:
                return counter < group._next_cid
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

    def _loss_error(self, root_rank: int, link: CollectiveLink) -> ConnectionBrokenError:
        """The error of a collective that needed ``root_rank``, which left or was lost."""
        cause = self._left.get(root_rank)
        why = cause.detail if isinstance(cause, PeerError) else cause
        if cause is None:
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

    def _address_of(self, r: int) -> Address | None:
        return self._addresses[r] if self._addresses is not None else None

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
        form = _Formation(self._rank, self.size)
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
                self._check_formed()
        except TimeoutError:
            await self._fail_forming(form, "formation timed out")
            not_in = [r for r in range(self.size) if r != self._rank and r not in form.joined]
            quiet = [r for r in form.joined if r not in form.done]
            why = []
            if not_in:
                names = ", ".join(f"{self.peer_label(r)} {self._where(r)}" for r in not_in)
                why.append(f"no connection to {names}")
            if quiet:
                names = ", ".join(self.peer_label(r) for r in sorted(quiet))
                why.append(f"{names} never said it was connected to every rank")
            raise P2PTimeoutError(
                f"{self.peer_label(self._rank)}: forming the group took over "
                f"{self.config.connect_timeout:g} s; " + "; ".join(why)
            ) from None
        except BaseExceptionGroup as group:
            first = _first_error(group)
            await self._fail_forming(form, str(first))
            raise first from None
        except BaseException as exc:
            await self._fail_forming(form, str(exc))
            raise

    async def _fail_forming(self, form: _Formation, why: str) -> None:
        """Tell every connected rank why our start failed, then close. (A group closed
        while it starts says only goodbye: to the others that is a rank that restarts.)"""
        conns = {id(c): c for c in [*self._conns.values(), *form.joined.values()]}
        for conn in [] if self._closing else conns.values():
            _form_note(conn, "failed", f"{self.peer_label(self._rank)}: {why}")
        await self.close()

    def _check_formed(self) -> None:
        """Every connection must still be open once formation ends (a rank that closed
        or was lost meanwhile would otherwise only show up as "left" later)."""
        for r in sorted(self._conns):
            if self._conns[r].closed or r in self._left:
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
                    me = self._rank
                    raise PeerAuthenticationError(
                        label,
                        f"{exc.detail}: its group formed already, so another process has "
                        f"rank {me} (two processes claim rank {me}?) or this one restarted "
                        '(a rank can rejoin only a group that runs with on_peer_loss="leave")',
                    ) from None
                self._conns[r] = conn
            else:
                conn = await form.inbox[r].get()
                _form_note(conn, "ok")
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
                try:
                    note = msgpack.unpackb(frame.meta, raw=False)
                    kind, why = str(note["form"]), str(note.get("why", ""))
                except Exception as exc:  # msgpack's own exceptions, a missing key, a bad type
                    raise RemoteProtocolError(label, f"malformed formation note: {exc!r}") from None
                if kind == "ok" and r < self._rank:
                    form.join(r, conn)
                elif kind == "ready":
                    conn.retire(_FORM_CHANNEL)
                    form.done.add(r)
                    return
                elif kind == "refused":
                    raise PeerAuthenticationError(label, f"refused this rank's connection: {why}")
                elif kind == "failed":
                    raise ConnectionBrokenError(label, f"could not join the group ({why})")
                else:
                    raise RemoteProtocolError(label, f"unexpected formation note {kind!r}")

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
            if why is not None:
                self._turn_away(conn, why)
                continue
            if old is not None:
                log.info("%s connected again (restarted while the group formed)", label)
            self._conns[r] = conn
            form.inbox[r].put_nowait(conn)

    # ---- rejoining: the survivors -------------------------------------------------------

    def _accepts(self, eid: EndpointId) -> bool:
        """Group members, and only until the group has formed, unless lost ranks may come
        back (``on_peer_loss="leave"``): a rank that restarts and dials again is otherwise
        refused at once instead of joining a group that cannot take it."""
        return eid in self._rank_of and (not self._formed or self.config.on_peer_loss == "leave")

    def _turn_away(self, conn: Connection, why: str) -> None:
        """Tell a dialer (forming or rejoining) why it is refused, and close."""
        log.warning(
            "%s: refusing a connection from %s: %s", self.peer_label(self._rank), _remote(conn), why
        )
        _form_note(conn, "refused", why)
        with contextlib.suppress(P2PError):
            conn.send_nowait(_HELLO_CHANNEL, meta=bytes(msgpack.packb({"refused": why})))
        self._spawn(conn.close())

    def _adopt(self, rank: int, conn: Connection) -> None:
        """Make ``conn`` (just formed) ``rank``'s connection: label, loss, abort notices."""
        self._conns[rank] = conn
        conn.label = self.peer_label(rank)
        self._watch(rank, conn)
        self._spawn(self._listen_control(rank, conn))

    def _is_live(self, conn: Connection) -> bool:
        """Open, and heard from within ``3 x keepalive_interval`` (a live peer pings)."""
        silent = _SILENT_KEEPALIVES * self.config.transport.keepalive_interval
        return not conn.closed and conn.idle_for() < silent

    async def _accept_rejoins(self, transport: TcpTransport | QuicTransport) -> None:
        """Take back ranks that restarted: after formation (``on_peer_loss="leave"``), and
        on a rank that rejoins, from the start (another rank may rejoin at the same time)."""
        while not self._closing:
            try:
                conn = await transport.accept()
            except P2PError:
                return  # the transport is closed
            rank = self._rank_of.get(conn.peer_id)
            if rank is None or self._closing:
                await conn.close()
                continue
            if rank == self._rank:
                self._turn_away(conn, f"this is {self.peer_label(rank)}: two processes claim it?")
            elif self._keeps_own_dial(rank):
                # Two ranks rejoining at once dial each other; both keep the higher one's dial.
                with contextlib.suppress(P2PError):
                    conn.send_nowait(_HELLO_CHANNEL, meta=_REJOINING_HELLO)
                self._spawn(conn.close())
            else:
                self._spawn(self._take_back(rank, conn))

    def _keeps_own_dial(self, rank: int) -> bool:
        """Whether a connection ``rank`` dialed is the redundant one of two rejoining ranks:
        ``rank`` is lower and rejoins while we do, or it rejoined while we did and we keep
        the live connection we dialed to it."""
        rejoin = self._rejoining
        if rejoin is not None and rank < self._rank:
            rejoin.alive.add(rank)  # it listens: our own dial to it will be answered
            return True
        kept = self._kept_dials.get(rank)
        return kept is not None and self._conns.get(rank) is kept and self._is_live(kept)

    async def _take_back(self, rank: int, conn: Connection) -> None:
        """Make ``conn`` ``rank``'s connection and send it our hello; bounded. An old
        connection that is still live (open and not silent) after ``4 x keepalive_interval``
        means another process has the rank: the newcomer is refused with the reason."""
        label = self.peer_label(rank)
        loop = asyncio.get_running_loop()
        interval = self.config.transport.keepalive_interval
        deadline = loop.time() + (_SILENT_KEEPALIVES + 1) * interval
        while (old := self._conns.get(rank)) is not None and self._is_live(old):
            if loop.time() >= deadline:
                self._turn_away(
                    conn,
                    f"{label} is still connected from {_remote(old)} and not silent: "
                    f"two processes claim rank {rank}?",
                )
                return
            await asyncio.sleep(interval / 8)
        if self._closing:
            await conn.close()
            return
        if old is not None and not old.closed:
            # It restarted before we noticed it was gone: its old connection is dead.
            err = ConnectionBrokenError(label, "connected again (restarted); old connection lost")
            self._on_connection_end(rank, err)
            old.interrupt(err)
            self._spawn(old.close())
        self._left.pop(rank, None)  # this group only: sub-groups made before keep it out
        self._p2p_sent.pop(rank, None)  # its new process counts its messages from 0
        self._p2p_received.pop(rank, None)
        self._kept_dials.pop(rank, None)
        self._adopt(rank, conn)
        rejoin = self._rejoining
        if rejoin is not None:  # we rejoin too: we have no word on who is gone yet
            meta = _REJOINING_HELLO
            rejoin.alive.add(rank)
            if not rejoin.came[rank].done():
                rejoin.came[rank].set_result(None)
        else:
            meta = bytes(msgpack.packb({"left": sorted(self._left), "cid": self._next_cid}))
        with contextlib.suppress(P2PError):
            conn.send_nowait(_HELLO_CHANNEL, meta=meta)
        log.info("%s rejoined the group", label)

    # ---- rejoining: the rank that comes back --------------------------------------------

    async def _rejoin_all(
        self,
        transport: TcpTransport | QuicTransport,
        address_of: Callable[[int], Address | None],
        timeout: float,
    ) -> None:
        """Connect with every other rank, bounded by ``timeout``; a rank some survivor
        reports as gone is marked left instead of waited for, unless it is alive (our dial
        reached it, or it dialed us: it rejoins too), after a grace of one
        ``keepalive_interval`` for a dial that may be finishing its handshake."""
        others = [r for r in range(len(self._ids)) if r != self._rank]
        rejoin = _Rejoin(others)
        self._rejoining = rejoin
        self._spawn(self._accept_rejoins(transport))
        tasks = {
            r: asyncio.create_task(self._reach(transport, r, address_of(r), rejoin)) for r in others
        }
        loop = asyncio.get_running_loop()
        grace = self.config.transport.keepalive_interval
        cids: list[int] = []
        said: dict[int, int] = {}  # a rank gone -> the survivor that said so
        doomed_at: dict[int, float] = {}  # a rank reported gone -> when we give up on it
        given_up: list[asyncio.Task[tuple[list[int], int] | None]] = []
        try:
            async with asyncio.timeout(timeout):
                while tasks:
                    wake = min(doomed_at.values(), default=None)
                    done, _ = await asyncio.wait(
                        tasks.values(),
                        timeout=None if wake is None else max(0.0, wake - loop.time()),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    for r, task in list(tasks.items()):
                        if task not in done:
                            continue
                        del tasks[r]
                        heard = task.result()
                        if heard is not None:  # a survivor's hello (None: a fellow rejoiner)
                            cids.append(heard[1])
                            for d in heard[0]:
                                said.setdefault(d, r)
                    now = loop.time()
                    for d in [d for d in said if d in tasks and d not in rejoin.alive]:
                        if now < doomed_at.setdefault(d, now + grace):
                            continue
                        del doomed_at[d]
                        given_up.append(tasks.pop(d))
                        given_up[-1].cancel()
                        self._left[d] = ConnectionBrokenError(
                            self.peer_label(d),
                            f"had left before this rank rejoined ({self.peer_label(said[d])} says)",
                        )
                    for d in [d for d in doomed_at if d not in tasks or d in rejoin.alive]:
                        del doomed_at[d]
        except TimeoutError:
            missing = ", ".join(self.peer_label(r) for r in sorted(tasks))
            raise P2PTimeoutError(
                f"{self.peer_label(self._rank)}: rejoining took over {timeout:g} s; "
                f"no connection to {missing}"
            ) from None
        finally:
            self._rejoining = None
            await cancel_and_wait([*tasks.values(), *given_up], timeout=10.0)
        if not cids:
            raise UsageError("rejoin=True needs at least one other rank still in the group")
        if len(set(cids)) > 1:
            log.warning("survivors disagree on the next collective id: %s", sorted(set(cids)))
        self._next_cid = max(cids)
        if self._left:
            names = ", ".join(self.peer_label(r) for r in sorted(self._left))
            log.info("%s rejoined; %s gone", self.peer_label(self._rank), names)

    async def _reach(
        self,
        transport: TcpTransport | QuicTransport,
        rank: int,
        address: Address | None,
        rejoin: _Rejoin,
    ) -> tuple[list[int], int] | None:
        """Connect with ``rank``: ``(ranks gone, next cid)`` from a survivor's hello, None
        for a rank that rejoins too. Of two rejoining ranks' dials both keep the higher
        rank's (as in formation): the lower one drops its own and waits for that one."""
        dial = asyncio.create_task(self._dial_hello(transport, rank, address, rejoin))
        came = rejoin.came[rank]
        used = False
        try:
            either: list[asyncio.Future[Any]] = [dial, came]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if came.done():
                return None  # it dialed us (it is higher): _take_back adopted that one
            conn, gone, cid = dial.result()
            if cid is not None:
                used = True
                self._adopt(rank, conn)
                return gone, cid
            if rank < self._rank:  # it rejoins too, and kept our dial
                used = True
                self._adopt(rank, conn)
                self._kept_dials[rank] = conn
                return None
            await came  # it keeps its own dial to us (bounded by _rejoin_all's timeout)
            return None
        finally:
            await cancel_and_wait([dial])
            if not used and dial.done() and not dial.cancelled() and dial.exception() is None:
                with contextlib.suppress(P2PError):
                    await dial.result()[0].close()

    async def _dial_hello(
        self,
        transport: TcpTransport | QuicTransport,
        rank: int,
        address: Address | None,
        rejoin: _Rejoin,
    ) -> tuple[Connection, list[int], int | None]:
        """Connect to ``rank`` and read its hello: ``(connection, ranks gone, next cid)``,
        the cid None when ``rank`` rejoins too (its word on who is gone means nothing)."""
        label = self.peer_label(rank)
        try:
            conn = await dial_with_retry(
                transport, self._ids[rank], address, label=label, timeout=None
            )
        except PeerAuthenticationError as exc:
            raise PeerAuthenticationError(
                exc.peer,
                f"{exc.detail} (a rank can rejoin only a group whose ranks "
                'run with on_peer_loss="leave")',
            ) from None
        rejoin.alive.add(rank)  # it may have taken this connection: do not give up on it
        try:
            frame = await conn.recv(_HELLO_CHANNEL)
            conn.retire(_HELLO_CHANNEL)
            try:
                hello = msgpack.unpackb(frame.meta, raw=False)
                refused = hello.get("refused")
                if refused is None:
                    gone = [int(r) for r in hello["left"]]
                    cid = None if hello.get("rejoining") else int(hello["cid"])
            except Exception as exc:  # msgpack's own exceptions, a missing key, a bad type
                raise RemoteProtocolError(label, f"malformed rejoin hello: {exc!r}") from None
            if refused is not None:
                raise PeerAuthenticationError(label, f"refused this rank: {refused}")
        except BaseException:
            with contextlib.suppress(ConnectionClosedError):
                await conn.close()
            raise
        return conn, gone, cid


class _Rejoin:
    """A rejoin in progress: the ranks known to be alive (our dial reached them, or they
    dialed us), and for each rank whether its own dial to us was taken (it rejoins too,
    and is higher)."""

    def __init__(self, ranks: Iterable[int]) -> None:
        loop = asyncio.get_running_loop()
        self.alive: set[int] = set()
        self.came: dict[int, asyncio.Future[None]] = {r: loop.create_future() for r in ranks}


def _form_note(conn: Connection, kind: str, why: str = "") -> None:
    """Send one formation note (best effort: a connection already gone is skipped)."""
    with contextlib.suppress(P2PError):
        conn.send_nowait(_FORM_CHANNEL, meta=bytes(msgpack.packb({"form": kind, "why": why})))


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

    def __init__(self, rank: int, size: int) -> None:
        self.size = size
        self.inbox: dict[int, asyncio.Queue[Connection]] = {
            r: asyncio.Queue() for r in range(rank + 1, size)
        }
        self.joined: dict[int, Connection] = {}
        self.done: set[int] = set()
        self._told: list[Connection] = []  # connections told "ready"

    def join(self, r: int, conn: Connection) -> None:
        """``conn`` is ``r``'s accepted connection: once every rank has one, say ready."""
        self.joined[r] = conn
        if len(self.joined) == self.size - 1:
            for c in self.joined.values():
                if not any(c is t for t in self._told):
                    self._told.append(c)
                    _form_note(c, "ready")

    def leave(self, r: int, conn: Connection) -> None:
        """``conn`` ended before ``r`` said ready."""
        if self.joined.get(r) is conn:
            del self.joined[r]
