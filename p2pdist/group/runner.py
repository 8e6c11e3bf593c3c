"""Runner: how every collective runs (:meth:`Runner._run`): taking its channel, refusing
it when a rank it needs has left, bounding it by one watchdog timer per root group, and
turning what goes wrong into the error that names the cause. Mixed into
:class:`~p2pdist.group.core.GroupCore` (which sets every attribute declared here), on top
of :class:`~p2pdist.group.rejoin.Rejoining`."""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

import numpy as np

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    GroupBrokenError,
    MismatchError,
    P2PError,
    P2PTimeoutError,
    PeerTimeoutError,
    RemoteProtocolError,
)
from ..settings import check_seconds
from ..transport.mailbox import split_channel
from ..transport.relay_config import RelayState
from .calls import Reserving, foreign_loop_error
from .link import CollectiveLink
from .membership import CallFailure, Membership, RunningCall
from .rejoin import Rejoining

__all__ = ["Runner", "left_refusal"]

_UNSURE_GRACE_SHARE = 0.1
"""A collective whose timeout would name a rank that did start it waits this share of
its timeout more (at most :data:`_UNSURE_GRACE_MAX` seconds), once: see
:meth:`Runner._on_watchdog`."""
_UNSURE_GRACE_MAX = 5.0

T = TypeVar("T")

log = logging.getLogger(__name__)

_ATTRIBUTION_WINDOW = 0.25  # seconds a failing collective waits for other failure reports


_LEFT_REFUSALS: weakref.WeakKeyDictionary[BaseException, str] = weakref.WeakKeyDictionary()
"""The refusals :meth:`Runner._left_error` made, each with its first sentence (the ranks
that left, without the reasons it quotes)."""


def left_refusal(exc: BaseException) -> str | None:
    """``exc``'s first sentence when it is a collective's refusal for ranks that left the
    group, else None."""
    # (A built-in exception takes no weak reference: never one of ours anyway.)
    return _LEFT_REFUSALS.get(exc) if isinstance(exc, GroupBrokenError) else None


class Runner(Rejoining, Reserving):
    """Running collectives: channels, the watchdog, refusals and failure errors."""

    _watchdog: asyncio.TimerHandle | None  # root only: see _run
    _watchdog_at: float

    # ---- provided by GroupCore ------------------------------------------------------------

    def _root(self) -> Runner:
        raise NotImplementedError

    def _check_usable(self, *, collective: bool = True) -> None:
        raise NotImplementedError

    # ---- call ids reserved when a collective is called (calls.py) ----------------------

    def _reserve(self) -> tuple[int, int] | None:
        if self.size == 1:
            return None
        try:
            if asyncio.get_running_loop() is not self._home_loop:
                return None  # made in another thread: it runs (and takes its id) on ours
            self._check_usable()
        except (RuntimeError, P2PError):  # RuntimeError: no loop running in this thread
            return None
        cid = self._next_cid
        self._next_cid += 1
        holder = self._pending[cid] = next(self._call_order)
        return cid, holder

    def _skip(self, cid: int, holder: int, why: str) -> None:
        """Call ``cid`` ended without running here: retire its channel (what the others
        send for it is dropped) and tell them, so theirs fails at once naming this rank
        (ranks that all skip it stay in step: their notices find it past)."""
        if self._pending.get(cid) != holder:
            return  # taken by its call, or skipped or given back already
        del self._pending[cid]
        channel = self._call_channel(cid)
        root = self._root()
        told = root._failed_calls.pop(channel, None) is not None  # theirs failed already
        self._retire_everywhere(channel)
        if told or root._closing:
            return
        try:
            self._check_usable(collective=False)
        except P2PError:
            return  # broken or closed: its calls are refused anyway
        log.info("collective call %d (channel space %#x) did not run: %s", cid, self._space, why)
        self._tell_call_failed(channel, self._root_ranks[self._rank], why)

    def _release(self, cid: int, holder: int) -> bool:
        if cid != self._next_cid - 1 or self._pending.get(cid) != holder:
            return False
        del self._pending[cid]
        self._next_cid = cid
        return True

    # ---- naming a failure -----------------------------------------------------------

    async def _attribute(self, err: ConnectionBrokenError) -> P2PError:
        """Wait briefly for other reports, so the error names the root cause too.

        When rank A dies, rank B may notice first, fail and exit; if B's own exit reaches
        us before A's, "B lost" alone would send the user after the wrong rank. Abort
        notices and other losses that arrive within the window are added to the message.
        When ``err`` is a goodbye (B closed on purpose, having failed), the error leads
        with what B most likely failed for: a connection lost without a goodbye (A; its
        ``peer`` is A), else a rank's abort notice (A cancelled its call, say: then the
        error is that notice's :class:`GroupBrokenError`). The group's broken state takes
        the same reason, so later calls name it too.
        """
        await asyncio.sleep(_ATTRIBUTION_WINDOW)
        root = self._root()  # a sub-group's connections are its root's: so are its reports
        # Breaking the group woke the control listeners with its error and ended them, so
        # a notice that came in the window is still queued, unread: read them all now.
        root._read_queued_notices()
        told = self._explained(err)  # a goodbye with its leaving notice's reason, if any
        lead: P2PError = told
        if err.graceful:
            lost = [
                e
                for e in root._failure_log
                if isinstance(e, ConnectionBrokenError) and e.peer != err.peer and not e.graceful
            ]
            notices = [e for e in root._failure_log if isinstance(e, GroupBrokenError)]
            lead = lost[0] if lost else notices[0] if notices else told
        # The loss as the group recorded it may say more (why the relayed peer fell
        # silent, say): that one leads, rather than coming after the bare one as "also".
        lead_text = str(lead)
        fuller = [
            f
            for f in root._failure_log
            if isinstance(f, type(lead)) and lead_text in str(f) and str(f) != lead_text
        ]
        if fuller:
            lead = fuller[0]
            lead_text = str(lead)
        # Each other report once, and none that the lead's text holds already (an abort
        # notice quotes the loss it was sent for).
        others: list[str] = []
        for text in [str(told)] * (lead is not told) + [str(f) for f in root._failure_log]:
            if text not in lead_text and text not in others:
                others.append(text)
        if not others:
            if lead is not err:
                self._rebreak(err, lead)
            return lead
        if isinstance(lead, ConnectionBrokenError):
            detail = f"{lead.detail}; also: " + "; ".join(others)
            attributed: P2PError = ConnectionBrokenError(
                lead.peer, detail, graceful=lead.graceful, corrupt=lead.corrupt
            )
        else:
            attributed = GroupBrokenError(f"{lead}; also: " + "; ".join(others))
        self._rebreak(err, attributed)
        return attributed

    def _read_queued_notices(self) -> None:
        """Act now on the notices queued on this group's connections: a control listener
        reads them only on its next step, and not at all once the group broke."""
        root = self._root()
        for r, conn in list(self._conns.items()):  # (a notice may change them)
            root._read_notices(self._root_ranks[r], conn)

    def _rebreak(self, err: BaseException, attributed: P2PError) -> None:
        """Where the group (and, for a sub-group, each ancestor it broke) is broken by
        ``err``, put ``attributed`` in its place: later calls name the same cause."""
        if self._broken is err:
            self._broken = attributed
        group, cause, told = self._parent, err, attributed
        while group is not None:
            broken = group._broken
            if not (isinstance(broken, GroupBrokenError) and broken.cause is cause):
                return
            group._broken = told = GroupBrokenError("a sub-group failed", told)
            group, cause = group._parent, broken

    def _left_error(self, left: dict[int, BaseException]) -> GroupBrokenError:
        """The refusal of a collective that needs the ranks of ``left`` (this group's
        numbering, as :attr:`left` gives), with why they left where known."""
        names = ", ".join(self.peer_label(r) for r in sorted(left))
        gone = f"collectives need every rank, but {names} left the group"
        root = self._root()  # what the root knows is by root rank
        roots = [(self.peer_label(r), self._root_ranks[r]) for r in sorted(left)]
        said = [f"{label}: {root._leaving[rr]}" for label, rr in roots if rr in root._leaving]
        why = f" ({'; '.join(said)})" if said else ""
        relay = next((hint for _, rr in roots if (hint := root._relay_down(rr))), "")
        alone = ""
        if self.config.on_peer_loss == "leave" and len(root._left) == root.size - 1:
            # What a rank paused or cut off past idle_timeout sees once it runs again.
            alone = (
                "; every other rank left: if they still run, they dropped this rank "
                "(paused or cut off for longer than idle_timeout?) and went on without "
                "it: start it again with rejoin=True to join them"
            )
        refusal = GroupBrokenError(f"{gone}{why}{relay}{alone}")
        _LEFT_REFUSALS[refusal] = gone
        return refusal

    def _broken_by_another(self, failure: BaseException, channel: int) -> bool:
        """Whether this group (or one it was split from) broke with ``failure``, the
        failure of a call other than the one on ``channel``."""
        group: Membership | None = self
        while group is not None:
            broken = group._broken
            while isinstance(broken, GroupBrokenError) and broken is not failure:
                broken = broken.cause  # (an ancestor's: "a sub-group failed: ...")
            if broken is failure:
                return group._broken_during not in (None, channel)
            group = group._parent
        return False

    def _refuse(self, channel: int, error: P2PError) -> NoReturn:
        """Refuse the collective on ``channel`` after it took its id: what the others
        sent for it is dropped, and ``error`` raised."""
        self._retire_everywhere(channel)
        raise error

    def _relay_down(self, r: int | None) -> str:
        """``"; this rank's relay session is ..."`` while rank ``r`` (of this group) is
        reached through the relay and the relay session is not connected (every relayed
        peer then goes silent: the relay, not they, may be why), else ``""``."""
        path = self._root()._relay_path
        conn = self._conns.get(r) if r is not None else None
        if path is None or conn is None or getattr(conn, "path_kind", None) != "relay":
            return ""
        status = path.status
        if status.state is RelayState.CONNECTED:
            return ""
        if status.refusal == "proxy_refused":
            return f"; the proxy to this rank's relay refuses the tunnel now ({status.last_error})"
        if status.refused:  # a relay that was fine when the group formed: what changed?
            return (
                f"; this rank's relay refuses it now ({status.last_error}): was the relay "
                "restarted with another key, token or allowlist?"
            )
        last = f", last error: {status.last_error}" if status.last_error else ""
        return f"; this rank's relay session is not connected ({status.state.value}{last})"

    def _most_silent(self) -> tuple[float, int] | None:
        """The peer (idle seconds, rank) heard from least recently, when that is longer
        than three keepalive intervals (it may be gone); a peer that left does not count."""
        silent = max(
            ((c.idle_for(), r) for r, c in self._conns.items() if not c.closed), default=None
        )
        quiet_limit = 3 * self.config.transport.keepalive_interval
        return silent if silent is not None and silent[0] > quiet_limit else None

    def _blame_unsure(self, link: CollectiveLink) -> bool:
        """Whether a timeout of ``link`` now would name a rank that did start the call
        (the one missing may be further along), with no silent peer to name instead."""
        q = link.waiting_on
        return q is not None and link.heard_from(q) and self._most_silent() is None

    def _timeout_error(self, link: CollectiveLink, seconds: float) -> P2PError:
        what = f"{link.explain()} timed out after {seconds:g} s"
        hint = self._unstarted_hint(link)
        silent = self._most_silent()
        if silent is not None:
            idle, r = silent
            extra = ""
            if link.waiting_on is not None and link.waiting_on != r:
                extra = f" (this rank was waiting for {self.peer_label(link.waiting_on)})"
            detail = f"{what}: silent for {idle:.1f} s{extra}{self._relay_down(r)}{hint}"
            return PeerTimeoutError(self.peer_label(r), detail)
        if link.waiting_on is not None:
            q = link.waiting_on
            if link.heard_from(q):  # in a ring, a rank further round may be the one late
                what += " waiting for it (it did start this call: one further along may not have)"
            else:
                what += " waiting for it"
            hint = self._paused_hint(q) + hint
            return PeerTimeoutError(self.peer_label(q), what + self._relay_down(q) + hint)
        return P2PTimeoutError(what + hint)

    def _paused_hint(self, waited_on: int) -> str:
        """Why messages may not come with every rank alive and sending: this rank's
        reading from a peer (``waited_on`` first) is paused, with messages for calls it
        has not come to, or not taken, ahead in the stream, or two ranks each wait in a
        send with reading paused (docs/architecture.md section 7)."""
        paused = [
            (r == waited_on, stats.buffered, r)
            for r, c in self._conns.items()
            if not c.closed and (stats := c.stats).reading_paused
        ]
        if not paused:
            return ""
        _, held, r = max(paused)
        amount = f"{held / 2**20:.1f} MiB" if held >= 2**20 else f"{held} bytes"
        return (
            f" (reading from {self.peer_label(r)} is paused: {amount} of its messages "
            "wait unread, for calls still sending or not come to yet; raise "
            "TransportConfig.max_buffered, or keep fewer calls, or messages not yet "
            "received, in flight at once)"
        )

    def _unstarted_hint(self, link: CollectiveLink) -> str:
        """Why a call may wait forever with every rank alive: this rank made earlier
        calls, on this group or on one sharing its connections (its parent, a sub-group),
        that have not started (coroutines awaited one by one, the later first), and the
        others wait in those before they come to this one."""
        root = self._root()
        here = elsewhere = 0
        for group in [root, *root._descendants]:
            earlier = sum(1 for made in group._pending.values() if made < link.made)
            if group is self:
                here = earlier
            else:
                elsewhere += earlier
        if not here + elsewhere:
            return ""
        where = f" ({elsewhere} of them on its parent group or a sub-group)" if elsewhere else ""
        return (
            f"; {self.peer_label(self._rank)} made {here + elsewhere} collective call(s) "
            f"before it that have not started{where}: calls run in the order they were "
            "made on every rank, so await them in that order, or start them as tasks and "
            "gather them"
        )

    # ---- running a collective -----------------------------------------------------------

    def _check_loop(self, what: str) -> asyncio.AbstractEventLoop:
        """The running event loop, if it is the group's own; else a :class:`UsageError`
        (the group's connections wake only their own loop: a call awaited on another
        would see its messages only when a timer woke the group's loop)."""
        loop = asyncio.get_running_loop()
        if loop is not self._home_loop and self._home_loop is not None:
            raise foreign_loop_error(what)
        return loop

    def _new_link(self, descriptor: bytes) -> CollectiveLink:
        cid = self._taking
        if cid is None:  # made now, as far as the order of calls goes
            cid = self._next_cid
            self._next_cid += 1
            made = next(self._call_order)
        else:  # the id the call reserved when it was called (calls.py)
            self._taking = None
            made = self._pending.pop(cid)
        return CollectiveLink(
            self._rank,
            self.size,
            self._call_channel(cid),
            descriptor,
            self._conns.__getitem__,
            made,
        )

    async def _run(
        self,
        descriptor: bytes,
        timeout: float | None,
        body: Callable[[CollectiveLink], Awaitable[T]],
    ) -> T:
        """Run ``body`` as the next collective (described by ``descriptor``), bounded by
        ``timeout``. The collective takes its channel only once every argument has been
        accepted, so a call refused here leaves this rank in step with the others.

        The bound is kept by the root group's watchdog (one timer for every collective in
        flight, see :meth:`_arm_watchdog`) instead of a timer armed and cancelled per call:
        an overdue collective's task is cancelled and the cancellation turned into the
        timeout error here, as ``asyncio.timeout`` would."""
        seconds = self._seconds(timeout)
        loop = self._check_loop("a collective")  # before it takes its call id
        link = self._new_link(descriptor)
        root = self._root()
        channel = link.channel
        if self._left and self.config.on_peer_loss == "leave" and (left := self.left):
            # Refused for want of a rank that left, but with its id used up: a rank that
            # started this call before it saw the loss used it (and fails it), so the next
            # collective of both runs on one channel. They are told at once (a notice).
            root._failed_calls.pop(channel, None)
            self._tell_call_failed(channel, self._root_ranks[min(left)])
            self._refuse(channel, self._left_error(left))
        if self._closed_by:  # members that closed this sub-group after earlier calls
            cid = split_channel(channel)[1]
            closers = [r for r, first in self._closed_by.items() if cid >= first]
            if closers:
                self._tell_call_failed(channel, min(closers))
                self._refuse(channel, self._loss_error(min(closers), link))
        if root._failed_calls:
            noticed = root._failed_calls.pop(channel, None)
            if noticed is not None:  # another rank's part of this call already failed
                self._refuse(channel, self._failure_error(noticed, link))
        if root._refused_from and (refused := root._refused_here(channel)) is not None:
            self._refuse(channel, self._failure_error(refused, link))  # refused there
        task = asyncio.current_task(loop)  # the loop given: no second lookup
        assert task is not None
        inflight = root._inflight
        outer = inflight.get(task)  # None unless a collective runs inside another
        deadline = loop.time() + seconds
        if outer is not None and outer.deadline < deadline:
            seconds -= deadline - outer.deadline  # the enclosing call's bound comes first
            deadline = outer.deadline
        grace = min(_UNSURE_GRACE_SHARE * seconds, _UNSURE_GRACE_MAX)
        inflight[task] = RunningCall(self, channel, deadline, link, grace)
        if deadline < root._watchdog_at:
            root._arm_watchdog(deadline)
        lost: CallFailure | None = None
        expired = closed = told = False
        granted = 0.0
        try:
            try:
                # IEEE arithmetic whatever the caller's np.errstate says: under "raise",
                # an overflow (inf, as Gloo gives) broke the group on every rank.
                with np.errstate(all="ignore"):
                    result = await body(link)
            finally:
                granted = grace - inflight[task].grace  # the grace given, if any
                if outer is None:
                    del inflight[task]
                else:  # (the grace given here counts as the enclosing call's too)
                    inflight[task] = outer._replace(grace=0.0) if granted else outer
                if root._cancelled_by_loss:
                    lost = root._cancelled_by_loss.pop(task, None)
                    told = task in root._cancelled_by_notice
                    root._cancelled_by_notice.discard(task)
                if root._expired:
                    expired = task in root._expired
                    root._expired.discard(task)
                if root._closed_calls:
                    closed = task in root._closed_calls
                    root._closed_calls.discard(task)
            # Done here; but a rank that gave this call up (its timeout ran out while this
            # rank's loop was held, say) has no result: fail it here too, rather than go
            # on with a result the others lack. Its abort may have come in with the last
            # messages, not yet read by the listener: read it now.
            if root._broken is None:  # (only this group's members can have given it up)
                self._read_queued_notices()
            if root._given_up and (notice := root._given_up.get(channel)) is not None:
                raise GroupBrokenError(
                    f"{link.explain()} finished on this rank, but too late: {notice}"
                )
            return result
        except asyncio.CancelledError:
            # A member was lost (on_peer_loss="leave"): not our doing, unless the caller
            # cancelled us too (then the cancellation goes on, as any other does).
            if lost is not None and task.uncancel() == 0:
                # Tell the others too (unless a notice to all of them made us cancel):
                # one that has not started this call yet must fail it as well, even if
                # the lost rank rejoins before it starts (it would then run the call
                # while we run the next one: out of step).
                if not told:
                    self._tell_call_failed(channel, *lost)
                raise self._failure_error(lost, link) from None
            if closed and task.uncancel() == 0:  # its sub-group was closed here
                raise GroupBrokenError(f"{link.explain()} failed: the group was closed") from None
            if expired and task.uncancel() == 0:  # the watchdog's: this call is overdue
                timeout_err = self._timeout_error(link, seconds + granted)
                self._break(timeout_err, notify=True, during=channel)
                raise timeout_err from None
            me = self.peer_label(self._rank)
            cancelled = GroupBrokenError(f"{link.explain()} was cancelled on {me}")
            self._break(cancelled, notify=True, during=channel)
            raise
        except (MismatchError, RemoteProtocolError, ConnectionBrokenError) as failure:
            if not isinstance(failure, ConnectionBrokenError) and self._broken_by_another(
                failure, channel
            ):
                # Another call's failure: breaking the group, it woke every wait on the
                # connections with its error, which names that call, not this one.
                raise GroupBrokenError(f"{link.explain()} failed", failure) from None
            err = failure
            if isinstance(failure, ConnectionBrokenError):  # a goodbye with its reason
                err = self._explained(failure)
            gone = self._gone_with(err)
            if gone is not None:
                self._tell_call_failed(channel, gone)
                raise self._loss_error(gone, link) from None
            self._break(err, notify=True, during=channel)
            if not isinstance(err, ConnectionBrokenError):
                raise
            # A goodbye too: a rank that failed for another's sake says so (an abort
            # notice) before it closes, but that notice may be handled after the end of
            # its connection woke us, or come later on another QUIC stream.
            raise await self._attribute(err) from err
        except P2PError as err:
            if isinstance(err, ConnectionClosedError) and root._closing:
                # This rank closed the group under the call (its connection to whichever
                # peer the call waited on says "closed locally": not that peer's doing).
                raise GroupBrokenError(f"{link.explain()} failed: the group was closed") from None
            # Tell the others why, unless this failure is itself someone's abort notice.
            self._break(err, notify=not isinstance(err, GroupBrokenError), during=channel)
            raise
        except Exception as err:
            # Not ours (MemoryError, an exception in a block, a codec's error):
            # this rank's part of the call is lost, so the others must not wait for it.
            me = self.peer_label(self._rank)
            kind = type(err).__name__
            broken = GroupBrokenError(f"{link.explain()} failed on {me} with {kind}", err)
            self._break(broken, notify=True, during=channel)
            raise broken from err
        finally:
            self._retire_everywhere(channel)

    def _arm_watchdog(self, deadline: float) -> None:
        """(Root group) fire :meth:`_on_watchdog` at ``deadline`` (earlier than now armed)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._watchdog = asyncio.get_running_loop().call_at(deadline, self._on_watchdog)
        self._watchdog_at = deadline

    def _on_watchdog(self) -> None:
        """(Root group) cancel every collective past its deadline (``_run`` makes that a
        timeout error) and wait for the next deadline of those still running.

        A collective waiting on a rank that did start it (in a ring, the one that did
        not is further round) first gets its grace: the rank next to the one missing,
        whose timeout names that one, then ends the call for everyone (an abort
        notice) with its better diagnosis, instead of this rank naming its neighbour."""
        self._watchdog, self._watchdog_at = None, math.inf
        now = asyncio.get_running_loop().time()
        upcoming = math.inf
        for task, call in list(self._inflight.items()):
            deadline = call.deadline
            if (
                deadline <= now
                and call.grace
                and task not in self._cancelled_by_loss
                and task not in self._expired
                and call.group._blame_unsure(call.link)
            ):
                deadline = now + call.grace
                self._inflight[task] = call._replace(deadline=deadline, grace=0.0)
            if deadline > now:
                upcoming = min(upcoming, deadline)
            elif task not in self._cancelled_by_loss and task not in self._expired:
                self._expired.add(task)
                task.cancel()
        if upcoming < math.inf:
            self._arm_watchdog(upcoming)

    def _seconds(self, timeout: float | None) -> float:
        if timeout is None:
            return self.config.timeout  # positive: GroupConfig checks it
        return check_seconds("timeout", timeout)

    def _check_call(self, timeout: float | None) -> None:
        """A collective's last argument check (its ``timeout``), then the group's state:
        a rank's own mistake is the error it gets, whatever the others did meanwhile
        (one that left over the same mistake breaks the group)."""
        self._seconds(timeout)
        self._check_usable()
