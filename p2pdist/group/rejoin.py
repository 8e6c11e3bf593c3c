"""Taking ranks back after a crash: a rank that restarts with the same key rejoins
(``rejoin=True``) a group that runs with ``GroupConfig(on_peer_loss="leave")``. Mixed
into :class:`~p2pdist.group.core.GroupCore` on top of
:class:`~p2pdist.group.forming.Forming`.

The rank that comes back dials every rank (:meth:`Rejoining._rejoin_all`); each survivor
replaces the old connection with the new one (:meth:`Rejoining._take_back`) and answers
with a hello (the ranks it knows to be gone and its next collective id), and the rank is
a member again on the root group (sub-groups made before keep it as left: the restarted
process is not in them). Ranks that rejoin at the same time take each other back too,
keeping the connection the higher rank dialed; a second process for a rank whose
connection is still live is refused with the reason (docs/architecture.md section 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

import msgpack

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    MismatchError,
    P2PError,
    P2PTimeoutError,
    PeerAuthenticationError,
    RemoteProtocolError,
    UsageError,
)
from ..tasks import cancel_and_wait
from ..transport.base import Connection, is_identity_mismatch
from ..transport.dial import retry_pauses
from ..transport.mailbox import split_channel
from ..transport.quic import QuicTransport
from ..transport.tcp import TcpTransport
from ..wire.frames import Frame
from .forming import Forming, _read_note, check_terms, group_terms
from .membership import _FORM_CHANNEL, _FORMED_ALREADY, _HELLO_CHANNEL, _form_note, _remote

__all__ = ["Rejoining"]

log = logging.getLogger(__name__)

_REJOINING_HELLO = bytes(msgpack.packb({"rejoining": True, "left": [], "cid": 0}))
"""The hello of a rank that rejoins itself: it knows nothing of who is gone."""
_SILENT_KEEPALIVES = 3
"""A connection silent for this many keepalive intervals is taken for dead."""


class Rejoining(Forming):
    """Taking back ranks that restarted (on the survivors) and rejoining (on the rank
    that comes back)."""

    _rejoining: _Rejoin | None  # while this rank rejoins
    _kept_dials: dict[int, Connection]  # a rank that rejoined with us -> our dial it kept
    _broken: BaseException | None  # set by GroupCore: the group can no longer be used
    _rejoiners: dict[int, float]  # ranks taken back lately -> until when they may rejoin

    # ---- rejoining: the survivors -------------------------------------------------------

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
                self._dial_again_if_restarted(transport, rank)
            else:
                self._spawn(self._take_back(rank, conn))

    def _dial_again_if_restarted(self, transport: TcpTransport | QuicTransport, rank: int) -> None:
        """``rank``, lower, dialed us while we rejoin. If our reach for it has ended (its
        old process answered, or we gave up) and no live dial of ours to it is kept (a
        fellow rejoiner's late dial), it restarted meanwhile and waits for our dial:
        dial it again."""
        rejoin = self._rejoining
        if rejoin is None or rank in rejoin.reaching:
            return
        kept = self._kept_dials.get(rank)
        if kept is not None and kept is self._conns.get(rank) and self._is_live(kept):
            return
        rejoin.came[rank] = asyncio.get_running_loop().create_future()
        rejoin.reaching.add(rank)  # at once: a second dial must not start two reaches
        self._spawn(self._reach_again(transport, rank, rejoin))

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
        if not await self._wants_rejoin(rank, conn):
            return
        if self._closing:  # (close() breaks the group too: it is not broken for the rank)
            await conn.close()
            return
        if self._broken is not None:  # nothing it could run here would ever finish
            why = f"the group is broken ({self._broken}); restart every rank"
            self._turn_away(conn, why, rank=rank, noted=True)
            return
        loop = asyncio.get_running_loop()
        interval = self.config.transport.keepalive_interval
        deadline = loop.time() + (_SILENT_KEEPALIVES + 1) * interval
        while (old := self._conns.get(rank)) is not None and self._is_live(old):
            if loop.time() >= deadline:
                self._turn_away(
                    conn,
                    f"{label} is still connected from {_remote(old)} and not silent: "
                    f"two processes claim rank {rank}?",
                    rank=rank,
                    noted=True,  # _wants_rejoin sent the formation note already
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
        # This group's calls running with it cannot finish: its part would have to come
        # from the old process (a goodbye does not cancel them), but from now on they
        # would read the new connection, for a call its new process never runs. (Those of
        # sub-groups keep the old connection: they finish from it, or fail by themselves.)
        self._cancel_inflight(rank, taken_back=True)
        # Calls made while it was gone and not started yet cannot have its part: its new
        # process starts at our next call id (which counts them). They fail when they
        # start, naming it, instead of waiting for it on ids it never runs; the others
        # are told (while it is still left: not its new process), as their part of such
        # a call would wait for ours.
        for cid in self._pending:
            channel = self._call_channel(cid)
            if channel not in self._failed_calls:
                self._failed_calls[channel] = (rank, None)
                self._tell_call_failed(channel, rank)
        self._left.pop(rank, None)  # this group only: sub-groups made before keep it out
        self._leaving.pop(rank, None)  # what its old process said as it left
        self._p2p_sent.pop(rank, None)  # its new process counts its messages from 0
        self._p2p_received.pop(rank, None)
        self._p2p_given_back.pop(rank, None)
        self._kept_dials.pop(rank, None)
        self._adopt(rank, conn)
        rejoin = self._rejoining
        if rejoin is not None:  # we rejoin too: we have no word on who is gone yet
            meta = _REJOINING_HELLO
            rejoin.alive.add(rank)
            if not rejoin.came[rank].done():
                rejoin.came[rank].set_result(None)
        else:
            meta = bytes(msgpack.packb({"left": sorted(self._left), "cid": self._resume_cid()}))
            # Who leaves while it is still rejoining is told too (see _tell_rejoiners).
            self._rejoiners[rank] = asyncio.get_running_loop().time() + self.config.connect_timeout
        with contextlib.suppress(P2PError):
            conn.send_nowait(_HELLO_CHANNEL, meta=meta)
        log.info("%s rejoined the group", label)

    def _tell_rejoiners(self, gone: int) -> None:
        """``gone`` left or was lost: tell the ranks taken back lately, which may still be
        reaching everyone (they learned who is gone from our hello, before this), so they
        stop waiting for it (``{"gone": rank}`` on the control channel)."""
        now = asyncio.get_running_loop().time()
        self._rejoiners = {r: t for r, t in self._rejoiners.items() if t > now and r != gone}
        if self._rejoiners:
            self._send_control({"gone": gone}, [r for r in self._rejoiners if r in self._conns])

    def _on_gone_notice(self, gone: int, sender: int) -> None:
        """A survivor says ``gone`` left: while we rejoin, stop waiting for it."""
        rejoin = self._rejoining
        if rejoin is not None and gone != self._rank:
            rejoin.said_gone.setdefault(gone, sender)
            rejoin.said_by.setdefault(sender, set()).add(gone)
            rejoin.news.set()

    def _resume_cid(self) -> int:
        """The id of this group's next collective that can still run: calls another rank
        has told us failed (for want of a rank) are used up, though not started here."""
        spaced = [split_channel(c) for c in self._failed_calls]
        failed = [cid for space, cid in spaced if space == self._space]
        return max([self._next_cid, *(c + 1 for c in failed)])

    async def _wants_rejoin(self, rank: int, conn: Connection) -> bool:
        """Whether ``conn`` is a rejoin (its first word is ``rejoin``), bounded by
        ``connect_timeout``. A rank that restarted without ``rejoin=True`` dials to form
        a group and waits for a formation ``ok``: the ``refused`` note sent first (which a
        rejoiner drops) makes its start() fail at once, and it stays left here."""
        # A rank that left on purpose and dials to form a group is most likely forming
        # the group again in a loop, while this process has yet to close this one:
        # "formed" makes it dial again within its connect_timeout. One that was lost (a
        # crash, restarted without rejoin=True) learns the fix at once.
        gone = self._left.get(rank)
        again = isinstance(gone, ConnectionBrokenError) and gone.graceful
        if again:
            why = (
                f"{_FORMED_ALREADY} and {self.peer_label(rank)} left it: a new group can "
                "form once this process closes it (or rejoin it with rejoin=True)"
            )
        else:
            why = "the group has formed; restart this rank with rejoin=True"
        _form_note(conn, "refused", why, error="formed" if again else None)
        try:
            async with asyncio.timeout(self.config.connect_timeout):
                frame = await conn.recv(_HELLO_CHANNEL)
            conn.retire(_HELLO_CHANNEL)
            intent = msgpack.unpackb(frame.meta, raw=False)
            if isinstance(intent, dict) and intent.get("rejoin") is True:
                here = self.peer_label(self._rank)
                check_terms(
                    self.peer_label(rank),
                    here,
                    intent.get("terms"),
                    group_terms(self.config, self.size),
                )
                return True
        except MismatchError as exc:  # its settings differ from the group's
            self._turn_away(conn, str(exc), error="mismatch", rank=rank, noted=True)
            return False
        except Exception:  # it ended or stayed silent, or its word is no msgpack map
            pass
        self._turn_away(conn, why, rank=rank, noted=True, routine=again)
        return False

    # ---- rejoining: the rank that comes back --------------------------------------------

    async def _rejoin_all(
        self,
        transport: TcpTransport | QuicTransport,
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
        rejoin.reaching.update(others)  # before any accept: see _accept_rejoins
        tasks = {r: asyncio.create_task(self._reach(transport, r, rejoin)) for r in others}
        loop = asyncio.get_running_loop()
        grace = self.config.transport.keepalive_interval
        claims: dict[int, tuple[list[int], int]] = {}  # survivor -> (its gone, its cid)
        via: dict[int, Connection] = {}  # survivor -> the connection of its hello
        said = rejoin.said_gone
        doomed_at: dict[int, float] = {}  # a rank reported gone -> when we give up on it
        given_up: list[asyncio.Task[tuple[list[int], int, Connection] | None]] = []
        try:
            async with asyncio.timeout(timeout):
                while tasks:
                    wake = min(doomed_at.values(), default=None)
                    news = asyncio.ensure_future(rejoin.news.wait())  # a gone notice
                    try:
                        done, _ = await asyncio.wait(
                            [*tasks.values(), news],
                            timeout=None if wake is None else max(0.0, wake - loop.time()),
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    finally:
                        news.cancel()
                    rejoin.news.clear()
                    for r, task in list(tasks.items()):
                        if task not in done:
                            continue
                        del tasks[r]
                        heard = task.result()
                        if heard is not None:  # a survivor's hello (None: a fellow rejoiner)
                            claims[r] = heard[0], heard[1]
                            via[r] = heard[2]  # the connection it came on
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
        # Who each survivor said is gone (its hello, and every notice since). A survivor
        # lost since still has its say (it was true when said); one that restarted
        # meanwhile (taken back on a new connection) is a fellow rejoiner: no say.
        voters = {
            r: {*g, *rejoin.said_by.get(r, ())}
            for r, (g, _) in claims.items()
            if self._conns.get(r) in (None, via[r])
        }
        here = {
            r
            for r in voters
            if r not in self._left and (c := self._conns.get(r)) is not None and not c.closed
        }
        dropped = _cut_off(voters, here)
        for r in dropped:
            self._drop_cut_off(r, voters)
            here.discard(r)
        self._warn_disagreement(voters, here)
        me = self.peer_label(self._rank)
        said = {r: claims[r][1] for r in voters if r not in dropped}
        if not said:
            raise UsageError(f"{me}: rejoin=True needs at least one other rank still in the group")
        if len(set(said.values())) > 1:
            each = ", ".join(f"{self.peer_label(r)} {cid}" for r, cid in sorted(said.items()))
            log.warning("%s rejoining: survivors disagree on the next collective id (%s)", me, each)
        self._next_cid = max(said.values())
        if self._left:
            names = ", ".join(self.peer_label(r) for r in sorted(self._left))
            log.info("%s rejoined; %s gone", me, names)

    def _warn_disagreement(self, voters: dict[int, set[int]], here: set[int]) -> None:
        """Survivors still here that say one of them left, and were not outvoted (one
        against one, say): both are kept, and said so, since a collective with both may
        then time out."""
        pairs = [f"{a} says {b}" for a in sorted(here) for b in sorted(voters[a] & here)]
        if pairs:
            log.warning(
                "%s rejoined, but the survivors disagree on who left (%s): both kept; a "
                "collective with them may time out",
                self.peer_label(self._rank),
                "; ".join(pairs),
            )

    def _drop_cut_off(self, r: int, gone: dict[int, set[int]]) -> None:
        """Rank ``r`` answered as a survivor, but most other survivors say it left (it
        lives on, cut off from them): count it as left, as they do, and close our
        connection to it (not a loss: it is no member of ours)."""
        sayers = sorted(s for s, said in gone.items() if r in said and s != r)
        del gone[r]
        who = self.peer_label(sayers[0]) if sayers else "the others"
        self._left[r] = ConnectionBrokenError(
            self.peer_label(r),
            f"had left before this rank rejoined ({who} says, though it still answered: "
            "cut off from the others?)",
        )
        conn = self._conns.get(r)  # kept, closed: a send to it fails as to any rank gone
        if conn is not None:  # closed locally: no loss handling, no notices
            self._spawn(conn.close())

    async def _reach(
        self,
        transport: TcpTransport | QuicTransport,
        rank: int,
        rejoin: _Rejoin,
    ) -> tuple[list[int], int, Connection] | None:
        """Connect with ``rank``: ``(ranks gone, next cid, connection)`` from a survivor's
        hello, None for a rank that rejoins too. Of two rejoining ranks' dials both keep
        the higher rank's (as in formation): the lower one drops its own and waits for
        that one."""
        dial = asyncio.create_task(self._dial_hello(transport, rank, rejoin))
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
                return gone, cid, conn
            if rank < self._rank:  # it rejoins too, and kept our dial
                used = True
                self._adopt(rank, conn)
                self._kept_dials[rank] = conn
                return None
            await came  # it keeps its own dial to us (bounded by _rejoin_all's timeout)
            return None
        finally:
            rejoin.reaching.discard(rank)
            await cancel_and_wait([dial])
            if not used and dial.done() and not dial.cancelled() and dial.exception() is None:
                with contextlib.suppress(P2PError):
                    await dial.result()[0].close()

    async def _reach_again(
        self, transport: TcpTransport | QuicTransport, rank: int, rejoin: _Rejoin
    ) -> None:
        """Reach ``rank``, lower, that restarted while we rejoin, after our first reach
        for it ended (bounded by ``connect_timeout``): it rejoins too and keeps our dial,
        and is a member again, as the survivors take it back."""
        try:
            async with asyncio.timeout(self.config.connect_timeout):
                await self._reach(transport, rank, rejoin)
        except (P2PError, TimeoutError) as exc:
            log.info(
                "%s restarted while this rank rejoined; not reached: %s", self.peer_label(rank), exc
            )
            return
        self._left.pop(rank, None)

    async def _dial_hello(
        self,
        transport: TcpTransport | QuicTransport,
        rank: int,
        rejoin: _Rejoin,
    ) -> tuple[Connection, list[int], int | None]:
        """Connect to ``rank`` and read its hello: ``(connection, ranks gone, next cid)``,
        the cid None when ``rank`` rejoins too (its word on who is gone means nothing)."""
        label = self.peer_label(rank)
        pauses = retry_pauses()
        while True:
            try:
                conn = await self._dial(transport, rank)
            except PeerAuthenticationError as exc:
                if is_identity_mismatch(exc):  # another key than this seed gives it
                    hint = "do all ranks use the same seed and the same peers list, in rank order?"
                else:
                    hint = (
                        'a rank can rejoin only a group whose ranks run with on_peer_loss="leave"'
                    )
                raise PeerAuthenticationError(exc.peer, f"{exc.detail} ({hint})") from None
            marked = rank not in rejoin.alive  # (its own dial to us may have marked it)
            rejoin.alive.add(rank)  # it may have taken this connection: do not give up on it
            # The first word of a rejoin (a plain restart says none), with the settings
            # every rank must share, which the survivor checks.
            intent = {"rejoin": True, "terms": group_terms(self.config, self.size)}
            with contextlib.suppress(P2PError):
                conn.send_nowait(_HELLO_CHANNEL, meta=bytes(msgpack.packb(intent)))
            try:
                frame = await self._hello_or_forming(conn, label)
                break
            except (ConnectionBrokenError, ConnectionClosedError) as exc:
                # It died or closed before its hello: as a dial that failed. Dial again,
                # until a survivor reports it gone (_rejoin_all then gives it up) or the
                # rejoin's timeout; it is not alive for that meanwhile (unless something
                # else, its own dial to us, said it is).
                if marked:
                    rejoin.alive.discard(rank)
                with contextlib.suppress(ConnectionClosedError):
                    await conn.close()
                if self._closing:
                    raise
                if self.size == 2 and isinstance(exc, ConnectionBrokenError) and exc.graceful:
                    # The only other rank left on purpose: nobody can report it gone, and
                    # nobody is left to rejoin (dialed again, it held the rejoin for the
                    # whole timeout).
                    raise ConnectionBrokenError(
                        label,
                        f"{exc.detail} before it answered this rank's rejoin; no other "
                        "rank is left in the group to rejoin (start every rank afresh)",
                        graceful=True,
                    ) from None
                log.info("%s ended before its rejoin hello (%s); dialing again", label, exc)
                await asyncio.sleep(next(pauses))
            except BaseException:
                with contextlib.suppress(ConnectionClosedError):
                    await conn.close()
                raise
        try:
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
                if hello.get("error") == "mismatch":
                    raise MismatchError(label, f"refused this rank: {refused}")
                raise PeerAuthenticationError(label, f"refused this rank: {refused}")
        except BaseException:
            with contextlib.suppress(ConnectionClosedError):
                await conn.close()
            raise
        return conn, gone, cid

    async def _hello_or_forming(self, conn: Connection, label: str) -> Frame:
        """The peer's rejoin hello. A survivor first sends a formation ``refused`` note,
        meant for a rank restarted without rejoin=True: skipped. An ``ok`` note means the
        peer is still forming the group, where a rejoin is never answered: said at once
        (UsageError) instead of waiting out connect_timeout on both sides."""
        hello = asyncio.ensure_future(conn.recv(_HELLO_CHANNEL))
        try:
            while True:
                note = asyncio.ensure_future(conn.recv(_FORM_CHANNEL))
                try:
                    await asyncio.wait((hello, note), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    note.cancel()
                    await asyncio.gather(note, return_exceptions=True)
                if hello.done():
                    return hello.result()
                if note.cancelled() or note.exception() is not None:
                    return await hello  # the connection's end shows there too
                kind, _, _ = _read_note(label, note.result().meta)
                if kind == "ok":
                    raise UsageError(
                        f"{label} is still forming the group: rejoin=True is for a rank "
                        "that restarts into a group that has formed; start every rank "
                        "without it (or this one once the others have formed)"
                    )
        finally:
            conn.retire(_FORM_CHANNEL)
            if not hello.done():
                hello.cancel()
                await asyncio.gather(hello, return_exceptions=True)


def _cut_off(voters: dict[int, set[int]], here: set[int]) -> list[int]:
    """Survivors to disbelieve: of the ranks in ``here`` (answered a rejoin as
    survivors and still connected), those that a strict majority of the other survivors
    (``voters``: each one's word on who is gone, lost ones included) say left, at least
    half of the living among them included (the lost back the living up, never outvote
    them). The ranks with the largest share of such votes go together, each time
    counting only the survivors still believed, as long as each is said gone by a strict
    majority of the believed ranks outside that set: two ranks cut off at once both go,
    while one survivor's word against another's (or a tie) drops nobody, since hellos
    are snapshots taken at different moments."""
    believed = set(voters)
    out: list[int] = []
    while True:
        share: dict[int, Fraction] = {}
        for x in here & believed:
            others = believed - {x}
            says = sum(1 for o in others if x in voters[o])
            live = here & others  # the lost may back the living up, never outvote them
            live_says = sum(1 for o in live if x in voters[o])
            if 2 * says > len(others) and live_says and 2 * live_says >= len(live):
                share[x] = Fraction(says, len(others))
        if not share:
            return out
        top = max(share.values())
        tied = {x for x, f in share.items() if f == top}
        outside = believed - tied
        if not all(2 * sum(1 for o in outside if x in voters[o]) > len(outside) for x in tied):
            return out
        believed -= tied
        out += sorted(tied)


class _Rejoin:
    """A rejoin in progress: the ranks known to be alive (our dial reached them, or they
    dialed us), and for each rank whether its own dial to us was taken (it rejoins too,
    and is higher)."""

    def __init__(self, ranks: Iterable[int]) -> None:
        loop = asyncio.get_running_loop()
        self.alive: set[int] = set()
        self.came: dict[int, asyncio.Future[None]] = {r: loop.create_future() for r in ranks}
        self.reaching: set[int] = set()
        """Ranks our dial is reaching or about to (marked before its task runs): a lower
        one that dials us meanwhile keeps our dial."""
        self.said_by: dict[int, set[int]] = {}
        """A survivor -> every rank its notices said left (for the vote on who is cut off)."""
        self.said_gone: dict[int, int] = {}
        """A rank gone -> the survivor that said so (in its hello, or in a notice after)."""
        self.news = asyncio.Event()
        """Set when a survivor's notice adds to :attr:`said_gone`."""
