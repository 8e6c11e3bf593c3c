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
        """Dial the lower ranks and accept the higher ones (bounded); closes on failure."""
        try:
            async with asyncio.timeout(self.config.connect_timeout), asyncio.TaskGroup() as tg:
                tg.create_task(self._accept_higher(transport))
                for r in range(self._rank):
                    tg.create_task(self._dial(transport, r))
        except TimeoutError:
            missing = [r for r in range(self.size) if r != self._rank and r not in self._conns]
            await self.close()
            where = ", ".join(f"{self.peer_label(r)} {self._where(r)}" for r in missing)
            raise P2PTimeoutError(
                f"{self.peer_label(self._rank)}: forming the group took over "
                f"{self.config.connect_timeout:g} s; no connection to {where}"
            ) from None
        except BaseExceptionGroup as group:
            await self.close()
            first = group.exceptions[0]
            raise first from None
        except BaseException:
            await self.close()
            raise

    async def _dial(self, transport: TcpTransport | QuicTransport, r: int) -> None:
        # Bounded by start()'s connect_timeout, which names every rank still missing.
        address = None
        if isinstance(transport, TcpTransport):
            assert self._addresses is not None
            address = self._addresses[r]
        self._conns[r] = await dial_with_retry(
            transport, self._ids[r], address, label=self.peer_label(r), timeout=None
        )

    async def _accept_higher(self, transport: TcpTransport | QuicTransport) -> None:
        want = set(range(self._rank + 1, self.size))
        while want:
            conn = await transport.accept()
            r = self._rank_of[conn.peer_id]
            if r not in want:
                log.warning("%s: unexpected extra connection; closing it", self.peer_label(r))
                await conn.close()
                continue
            self._conns[r] = conn
            want.discard(r)

    # ---- rejoining: the survivors -------------------------------------------------------

    def _accepts(self, eid: EndpointId) -> bool:
        """Group members, and only until the group has formed, unless lost ranks may come
        back (``on_peer_loss="leave"``): a rank that restarts and dials again is otherwise
        refused at once instead of joining a group that cannot take it."""
        return eid in self._rank_of and (not self._formed or self.config.on_peer_loss == "leave")

    def _adopt(self, rank: int, conn: Connection) -> None:
        """Make ``conn`` (just formed) ``rank``'s connection: label, loss, abort notices."""
        self._conns[rank] = conn
        conn.label = self.peer_label(rank)
        self._watch(rank, conn)
        self._spawn(self._listen_control(rank, conn))

    async def _accept_rejoins(self, transport: TcpTransport | QuicTransport) -> None:
        """After formation (``on_peer_loss="leave"``): take back ranks that restarted."""
        while not self._closing:
            try:
                conn = await transport.accept()
            except P2PError:
                return  # the transport is closed
            rank = self._rank_of.get(conn.peer_id)
            if rank is None or rank == self._rank or self._closing:
                await conn.close()
                continue
            self._take_back(rank, conn)

    def _take_back(self, rank: int, conn: Connection) -> None:
        label = self.peer_label(rank)
        old = self._conns.get(rank)
        if old is not None and not old.closed:
            # It restarted before we noticed it was gone: its old connection is dead.
            err = ConnectionBrokenError(label, "connected again (restarted); old connection lost")
            self._on_connection_end(rank, err)
            old.interrupt(err)
            self._spawn(old.close())
        self._left.pop(rank, None)  # this group only: sub-groups made before keep it out
        self._p2p_sent.pop(rank, None)  # its new process counts its messages from 0
        self._p2p_received.pop(rank, None)
        self._adopt(rank, conn)
        hello = {"left": sorted(self._left), "cid": self._next_cid}
        with contextlib.suppress(P2PError):
            conn.send_nowait(_HELLO_CHANNEL, meta=bytes(msgpack.packb(hello)))
        log.info("%s rejoined the group", label)

    # ---- rejoining: the rank that comes back --------------------------------------------

    async def _rejoin_all(
        self,
        transport: TcpTransport | QuicTransport,
        address_of: Callable[[int], Address | None],
        timeout: float,
    ) -> None:
        """Dial every other rank, bounded by ``timeout``; a rank some survivor reports as
        gone is marked left instead of waited for."""
        dials = {
            r: asyncio.create_task(self._dial_hello(transport, r, address_of(r)))
            for r in range(len(self._ids))
            if r != self._rank
        }
        cids: list[int] = []
        said: dict[int, int] = {}  # a rank gone -> the survivor that said so
        given_up: list[asyncio.Task[tuple[Connection, list[int], int]]] = []
        try:
            async with asyncio.timeout(timeout):
                while dials:
                    done, _ = await asyncio.wait(
                        dials.values(), return_when=asyncio.FIRST_COMPLETED
                    )
                    for r, task in list(dials.items()):
                        if task not in done:
                            continue
                        del dials[r]
                        try:
                            conn, gone, cid = task.result()
                        except PeerAuthenticationError as exc:
                            raise PeerAuthenticationError(
                                exc.peer,
                                f"{exc.detail} (a rank can rejoin only a group whose ranks "
                                'run with on_peer_loss="leave")',
                            ) from None
                        self._adopt(r, conn)
                        cids.append(cid)
                        for d in gone:
                            said.setdefault(d, r)
                    # Ranks a survivor knows to be gone are not waited for, unless our dial
                    # reached one already (a live connection beats a report: it may have
                    # rejoined too, and that survivor not taken it back yet).
                    for d in [d for d in said if d in dials]:
                        given_up.append(dials.pop(d))
                        given_up[-1].cancel()
                        self._left[d] = ConnectionBrokenError(
                            self.peer_label(d),
                            f"had left before this rank rejoined ({self.peer_label(said[d])} says)",
                        )
        except TimeoutError:
            missing = ", ".join(self.peer_label(r) for r in sorted(dials))
            raise P2PTimeoutError(
                f"{self.peer_label(self._rank)}: rejoining took over {timeout:g} s; "
                f"no connection to {missing}"
            ) from None
        finally:
            # A dial cancelled with a connection in hand closes it.
            await cancel_and_wait([*dials.values(), *given_up], timeout=10.0)
        if not cids:
            raise UsageError("rejoin=True needs at least one other rank still in the group")
        if len(set(cids)) > 1:
            log.warning("survivors disagree on the next collective id: %s", sorted(set(cids)))
        self._next_cid = max(cids)
        if self._left:
            names = ", ".join(self.peer_label(r) for r in sorted(self._left))
            log.info("%s rejoined; %s gone", self.peer_label(self._rank), names)

    async def _dial_hello(
        self, transport: TcpTransport | QuicTransport, rank: int, address: Address | None
    ) -> tuple[Connection, list[int], int]:
        """Connect to ``rank`` and read its hello: ``(connection, ranks gone, next cid)``."""
        label = self.peer_label(rank)
        conn = await dial_with_retry(transport, self._ids[rank], address, label=label, timeout=None)
        try:
            frame = await conn.recv(_HELLO_CHANNEL)
            conn.retire(_HELLO_CHANNEL)
            try:
                hello = msgpack.unpackb(frame.meta, raw=False)
                gone = [int(r) for r in hello["left"]]
                cid = int(hello["cid"])
            except Exception as exc:  # msgpack's own exceptions, a missing key, a bad type
                raise RemoteProtocolError(label, f"malformed rejoin hello: {exc!r}") from None
        except BaseException:
            with contextlib.suppress(ConnectionClosedError):
                await conn.close()
            raise
        return conn, gone, cid
