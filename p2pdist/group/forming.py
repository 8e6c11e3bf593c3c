"""Forming a group: the mesh of connections each rank builds at start. Each rank dials
the lower ranks and accepts the higher ones, and they exchange the ``ok`` / ``ready`` /
``failed`` notes on the formation channel (with the settings every rank must share,
:func:`group_terms`); a second process that claims a rank is refused, a rank that
restarts while the group forms is waited for again, and a start that fails tells the
others why. Mixed into :class:`~p2pdist.group.core.GroupCore` on top of
:class:`~p2pdist.group.membership.Membership` (which has the connection helpers forming
shares with :mod:`p2pdist.group.rejoin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
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
    PeerTimeoutError,
    RemoteProtocolError,
)
from ..transport.base import NOT_ADMITTED, Connection, is_identity_mismatch
from ..transport.dial import dial_with_retry, retry_pauses, worth_retrying
from ..transport.paths import path_key
from ..transport.quic import QuicTransport
from ..transport.tcp import TLS_MISMATCH_HINT, TcpTransport
from .config import GroupConfig
from .membership import (
    _FORM_CHANNEL,
    _FORMED_ALREADY,
    CONTROL_CHANNEL,
    LEAVING_MAX,
    Membership,
    _form_note,
    _remote,
)

__all__ = ["Forming"]

log = logging.getLogger(__name__)

_REFUSED_FIRST_RETRY = 0.05
"""Seconds before dialing again a rank whose group formed already; doubles up to
:data:`_REFUSED_MAX_RETRY`."""
_REFUSED_MAX_RETRY = 1.0
_QUEUED_NOTE_WAIT = 1.0
"""Bound on reading a closed connection's queued formation note (it is there at once, or
the read fails at once with the connection's end: the bound is only a guard)."""
_NOTE_CHARS = 2000
"""Longest reason a formation ``failed`` note carries (it names ranks and addresses)."""


UNREACHED_NOTICE_S = 2.0
"""How long a rank that found a settings mismatch spends telling the lower ranks it had
not reached yet (they would otherwise wait out their connect_timeout)."""
FOUND_DIAL_BOUND = 2.0
"""Seconds a round of dials to a rank's announced addresses (raced) may take, in the first
round, before the network is asked again; doubled after each round it cut short, so a
path slower than that to connect and shake hands is reached in a later round."""


class Forming(Membership):
    """Forming a group at start: dialing, accepting and the formation notes."""

    _forming: _Formation | None  # root, while start() forms the group

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
                if self._relay_url is not None and not any(r in form.refusals for r in not_in):
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
            replaced = self._relay_path.status.replaced if self._relay_path else 0
            if replaced:
                why.append(
                    f"the relay replaced this rank's session {replaced} time(s) with a newer "
                    f"connection from its endpoint id: two processes claim rank {self._rank}?"
                )
            if quiet:
                names = ", ".join(self.peer_label(r) for r in sorted(quiet))
                why.append(f"{names} never said it was connected to every rank")
            for r, refusal in sorted(form.refusals.items()):
                if r in not_in:
                    why.append(_formed_refusal(self.peer_label(r), refusal, self._rank))
            why += self._failed_dials(form, not_in)
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
            await self._fail_forming(transport, form, note)
            raise P2PTimeoutError(
                f"{self.peer_label(self._rank)}: {took}; " + "; ".join(why)
            ) from None
        except BaseExceptionGroup as group:
            first = _first_error(group)
            if self._closing and isinstance(first, P2PError):
                first = self._closed_while_starting()  # its closed transport failed it
            elif isinstance(first, PeerError):
                # Another rank gave up first (its note says why): what this rank knows of
                # the ranks still missing goes with it, a failed dial to one above all.
                missing = [r for r in range(self.size) if r != self._rank and r not in form.joined]
                first = _with_detail(first, self._failed_dials(form, missing))
            reason = str(first) if isinstance(first, Exception) else None
            await self._fail_forming(transport, form, reason, first)
            raise first from None
        except BaseException as exc:
            # A cancelled start (Ctrl-C, an outer timeout) has no reason to give: it tells
            # only the ranks it said ready to that it stopped (_tell_start_stopped).
            reason = str(exc) if isinstance(exc, Exception) else None
            await self._fail_forming(transport, form, reason)
            raise

    def _failed_dials(self, form: _Formation, missing: list[int]) -> list[str]:
        """The last failed dial to each rank in ``missing`` (one that refused this rank
        says so in its own words)."""
        return [
            f"the last dial to {self.peer_label(r)} failed: "
            + (error.detail if isinstance(error, PeerError) else str(error))
            for r, error in sorted(form.dial_errors.items())
            if r in missing and r not in form.refusals
        ]

    def _closed_while_starting(self) -> GroupBrokenError:
        """What start() raises when close() ran while it started."""
        return GroupBrokenError(
            f"{self.peer_label(self._rank)}: the group was closed while it started"
        )

    async def _fail_forming(
        self,
        transport: TcpTransport | QuicTransport,
        form: _Formation,
        why: str | None,
        error: BaseException | None = None,
    ) -> None:
        """Tell every connected rank why our start failed, then close. (A start that was
        cancelled, ``why`` None, or a group closed while it starts tells the ranks it said
        ready to that its start stopped, and says only goodbye to the others: to them it
        is a rank that restarts, waited for within connect_timeout.) A settings mismatch
        is marked as one, so that every rank raises MismatchError."""
        # And those that connected after the accept loop stopped: they wait for an ok,
        # and would take the goodbye alone for a restart, and dial again until their
        # connect_timeout, naming no connection instead of this reason.
        waiting = transport.take_accepted()
        conns = {id(c): c for c in [*self._conns.values(), *form.joined.values(), *waiting]}
        kind = "mismatch" if isinstance(error, MismatchError) else None
        if self._closing or why is None:
            self._tell_start_stopped()
        else:
            note = f"{self.peer_label(self._rank)}: {why}"
            for conn in conns.values():
                _form_note(conn, "failed", note, error=kind)
            _tell_start_failed(form.told, why)
            if kind is not None:
                await self._tell_unreached(transport, note, kind)
        self._forming = None
        await self.close()

    async def _tell_unreached(
        self, transport: TcpTransport | QuicTransport, note: str, kind: str
    ) -> None:
        """A settings mismatch found before this rank reached every lower rank (the
        others may have found it first and left): those it had not reached would wait
        out connect_timeout for it and name no reason. Dial them, briefly (at most
        :data:`UNREACHED_NOTICE_S` in all), to say why."""
        unreached = [r for r in range(self._rank) if r not in self._conns]

        async def tell(r: int) -> None:
            conn = await self._dial(transport, r)
            self._conns[r] = conn  # (close() says goodbye after the note)
            _form_note(conn, "failed", note, error=kind)

        if unreached:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(UNREACHED_NOTICE_S):
                    await asyncio.gather(*(tell(r) for r in unreached), return_exceptions=True)

    def _tell_start_stopped(self) -> None:
        """(Root, on close or cancellation while start() forms the group) tell the ranks
        we said ``ready`` to that our start stopped: a goodbye alone after ``ready`` means
        a rank that formed and left at once (see :meth:`_check_formed`), and this one did
        not form. Those we did not say ``ready`` to see a rank that restarts, and wait."""
        form, self._forming = self._forming, None
        if form is None:
            return
        form.stopped = True  # its tasks run on until the transport closes: say nothing more
        why = f"{self.peer_label(self._rank)}: its start was stopped (closed or cancelled)"
        for conn in form.told:
            _form_note(conn, "failed", why)
        _tell_start_failed(form.told, "it was closed or cancelled")

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
        if self._discovery is not None and isinstance(transport, TcpTransport):
            return await self._dial_found(transport, r)
        address = None
        if isinstance(transport, TcpTransport):
            assert self._addresses is not None
            address = self._addresses[r]
        form = self._forming
        return await dial_with_retry(
            transport,
            self._ids[r],
            address,
            label=self.peer_label(r),
            timeout=None,
            on_retry=None if form is None else functools.partial(form.dial_failed, r),
        )

    async def _dial_found(self, transport: TcpTransport, r: int) -> Connection:
        """Dial rank ``r`` at the addresses the local network gives for it, raced (the
        first to connect wins), asking the network again after each failed round (it may
        have restarted on another port); retried as :func:`dial_with_retry` does, and
        bounded the same way."""
        assert self._discovery is not None
        discovery, peer, label = self._discovery, self._ids[r], self.peer_label(r)
        pauses = retry_pauses()
        cap = FOUND_DIAL_BOUND
        rounds = 0
        while True:
            addresses = await discovery.lookup(peer)
            if addresses:
                # Each round starts the race at the next address: one that always wins
                # it and then hangs in its handshake cannot hold every round.
                k = rounds % len(addresses)
                addresses = addresses[k:] + addresses[:k]
                discovery.found[peer] = addresses  # (an error names where it dialed)
                # Addresses that drop what is sent to them (a VPN's, another network's)
                # must not hold the round for a whole handshake_timeout, even when they
                # are all that is known (an answer may carry only some of a rank's
                # addresses: the next round asks again); the cap doubles each round that
                # it cut short, for a path that is just slow.
                attempt = asyncio.timeout(cap)
                try:
                    async with attempt:
                        conn = await transport.connect_any(peer, addresses, label=label)
                    if (remote := conn.remote_address) is not None:
                        discovery.found[peer] = [path_key(remote)]  # the one that answered
                    return conn
                except P2PError as exc:
                    if not worth_retrying(exc):
                        raise
                    if self._forming is not None:
                        self._forming.dial_failed(r, exc)
                except TimeoutError:
                    if not attempt.expired():
                        raise
                    if self._forming is not None:
                        where = ", ".join(addresses)
                        why = f"no answer at {where} within {cap:g} s"
                        self._forming.dial_failed(r, PeerTimeoutError(label, why))
                    cap *= 2
                discovery.forget(peer)  # the next lookup asks the network, not the cache
                rounds += 1
            await asyncio.sleep(next(pauses))

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
                    if is_identity_mismatch(exc):
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
                form.dial_errors.pop(r, None)  # (a rank that leaves later is no failed dial)
                self._conns[r] = conn
            else:
                conn = await form.inbox[r].get()
                if form.stopped:
                    raise self._closed_while_starting()
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
                self._refuse_as_formed(conn, r)
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

    async def _refuse_late_dials(self, transport: TcpTransport | QuicTransport) -> None:
        """(Once formed, when lost ranks cannot come back) refuse, as formed already, a
        member's connection whose handshake was admitted while the group still formed but
        ended after it formed (a second process claiming a rank, a moment late): it is
        never left waiting for an ``ok``. Its dialer dials again, and is refused from now
        on in the handshake (see :meth:`_accepts`), until its connect_timeout says why."""
        while not self._closing:
            try:
                conn = await transport.accept()
            except P2PError:
                return  # the transport is closed
            self._refuse_as_formed(conn, self._rank_of.get(conn.peer_id))

    def _refuse_as_formed(self, conn: Connection, rank: int | None) -> None:
        """Refuse ``conn`` (from ``rank``) as a dial into a group that formed already: a
        ``refused`` note marked ``formed`` (its forming dialer dials again)."""
        _form_note(conn, "refused", _FORMED_ALREADY, error="formed")
        self._turn_away(conn, _FORMED_ALREADY, rank=rank, noted=True, routine=True)


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


def _with_detail(error: PeerError, more: list[str]) -> PeerError:
    """``error`` (a copy) with ``more`` added to its message."""
    if not more:
        return error
    longer = type(error).__new__(type(error))  # (its attributes, graceful..., kept)
    longer.__dict__.update(error.__dict__)
    longer.detail = "; ".join([error.detail, *more])
    longer.args = (f"{error.peer}: {longer.detail}",)
    return longer


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


def _tell_start_failed(told: set[Connection], why: str) -> None:
    """A leaving notice marked ``start`` (protocol.md 7) with ``why``, to the ranks this
    one said ready to: one that formed meanwhile no longer reads formation notes, so its
    ``failed`` note would be lost, and this rank only seen to leave without a reason."""
    meta = bytes(msgpack.packb({"leaving": why[:LEAVING_MAX], "start": True}))
    for conn in told:
        with contextlib.suppress(P2PError):
            conn.send_nowait(CONTROL_CHANNEL, meta=meta)


def _said_goodbye(conn: Connection) -> bool:
    """Whether the peer ended ``conn`` on purpose (a goodbye), not by a loss."""
    ended = conn.end_error
    return isinstance(ended, ConnectionBrokenError) and ended.graceful


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
        self.dial_errors: dict[int, BaseException] = {}
        """The last failed dial to each lower rank (retried until connect_timeout)."""
        self._refused_count: dict[int, int] = {}
        self.stopped = False
        """Its start was closed or cancelled: no more ``ok`` or ``ready`` notes."""

    def dial_failed(self, r: int, error: BaseException) -> None:
        """A dial to lower rank ``r`` failed with ``error`` (and is tried again)."""
        self.dial_errors[r] = error

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
        if len(self.joined) == self.size - 1 and not self.stopped:
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
