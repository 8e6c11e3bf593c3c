"""Decentralised averaging when ranks come and go: a restarted rank rejoining the rounds,
and a new leader taking over from a lost one (the plan is :mod:`.failover`'s). Mixed into
:class:`~.decentral.GroupAveraging`, which sets every attribute declared here.

Messages on channels of their own (round :data:`JOIN_ROUND` of the instance's space, a
round never reached, so the rounds never retire them):

* ``ready`` (a rejoining rank to every rank): take me back;
* ``welcome {r, l, last, in}`` + model (the leader to it): the model of round ``r``, the
  leader ``l``, the decision applied last and the ranks in the rounds from round ``r``
  on (``in``, the welcomed ones too; absent from older leaders); or ``request`` (a new
  leader to the ranks it waits for): a rank still waiting to be taken back answers it
  with a report of round -1;
* ``report {r, last}`` (a rank to the successor of a lost leader, once per connection);
  a rank still waiting to be taken back that receives one (it was chosen as successor)
  answers on the round's decision channel with ``decline {r}``: choose again.

Whose GroupAveraging runs: a rank that restarted comes back in the group on a new
connection, and its application may build and start its GroupAveraging much later;
until then nothing there reads these messages. So each rank remembers, per rank, the
connection behind which it knows that rank's averaging to run (``_running``): every
rank's at :meth:`start`, the ranks in the rounds at a welcome, the ranks a decision
names in ``joining`` (taken back at the next round), and a rank whose ``ready`` it
read. Only those are chosen to succeed a lost leader, and only those are
waited for by a successor (:mod:`.failover`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    ConnectionBrokenError,
    GroupBrokenError,
    MismatchError,
    P2PError,
    P2PTimeoutError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from ..tasks import cancel_and_wait
from ..transport.base import Connection
from .config import FederatedConfig
from .decision import OwnUpdate, Report, cid, decision_body, remembered, report_of
from .failover import Takeover, next_leader, plan_takeover
from .messages import DECISION, Message, decode, encode, round_channel
from .rounds import FederatedRounds

if TYPE_CHECKING:
    from ..group.group import Group

__all__ = ["JOIN_ROUND", "Recovery"]

log = logging.getLogger(__name__)

JOIN_ROUND = (1 << 46) - 1
"""The round whose channels carry rejoining and failover messages (never reached)."""
_READY, _WELCOME, _REPORT = 0, 1, 2
_AT_ONCE = 0.0
"""Seconds a look for a queued message waits: only what is here already is taken."""

Body = dict[str, Any]


class Recovery:
    """Rejoining and leader failover of :class:`~.decentral.GroupAveraging`."""

    group: Group
    config: FederatedConfig
    leader: int
    tag: int
    _model: np.ndarray
    _round: int
    _timeout: float
    _state: FederatedRounds | None
    _left: set[int]
    _ready: set[int]
    _ready_tasks: dict[int, asyncio.Task[None]]
    _last: Body | None
    _running: dict[int, Connection]  # rank -> the connection its averaging runs behind
    _asked: dict[int, Connection]  # rank -> the connection its ready came on (not welcomed)

    # ---- provided by GroupAveraging -------------------------------------------------------

    def _gone(self) -> set[int]:
        raise NotImplementedError

    def _conns(self) -> dict[int, Connection]:
        raise NotImplementedError

    def _retire(self, k: int) -> None:
        raise NotImplementedError

    def _open(self, k: int) -> None:
        raise NotImplementedError

    async def _lead(self, k: int, own: OwnUpdate | None) -> tuple[Body, np.ndarray | None]:
        raise NotImplementedError

    async def _follow(self, k: int, body: Body, own: OwnUpdate | None) -> np.ndarray | None:
        raise NotImplementedError

    def _send_decision(self, k: int, body: Body, ranks: list[int]) -> None:
        raise NotImplementedError

    # ---- channels ------------------------------------------------------------------------

    def _join_channel(self, kind: int) -> int:
        return round_channel(self.tag, JOIN_ROUND, kind)

    def _send(self, r: int, kind: int, meta: bytes, payload: Any = b"") -> bool:
        try:
            self.group.connection(r).send_nowait(self._join_channel(kind), payload, meta=meta)
        except P2PError as exc:
            log.info("%s: not sent: %s", self.group.peer_label(r), exc)
            return False
        return True

    # ---- the leader: taking ranks back ------------------------------------------------------

    def _listen_for_ready(self) -> None:
        """Read requests to be taken back from every rank still here (leader only); the
        ones this rank read before it led (:meth:`_hear_asks`) count as read now."""
        loop = asyncio.get_running_loop()
        for r in self._present():
            conn = self.group.connection(r)
            if self._asked.get(r) is conn and r in self._left:
                self._ready.add(r)
            task = self._ready_tasks.get(r)
            if task is None or task.done():
                self._ready_tasks[r] = loop.create_task(self._await_ready(r, conn))

    def _present(self) -> list[int]:
        """Ranks in the group now, this one aside (taking part in the rounds or not)."""
        gone = set(self.group.left)
        return [r for r in range(self.group.size) if r != self.group.rank and r not in gone]

    async def _await_ready(self, r: int, conn: Connection) -> None:
        with contextlib.suppress(P2PError):
            frame = await conn.recv(self._join_channel(_READY))
            if decode(frame, conn.label).kind == "ready":
                self._asked_by(r, conn)
                self._ready.add(r)

    def _welcome(self, r: int, k: int, members: list[int]) -> None:
        """Send rank ``r`` the model of round ``k`` and take it back into the rounds, whose
        ``members`` from round ``k`` on (``r`` among them) it learns too."""
        assert self._state is not None
        fields = {"r": k, "l": self.group.rank, "last": self._last, "in": members}
        meta, payload = encode("welcome", fields, self._model)
        if self._send(r, _WELCOME, meta, payload):
            log.info("round %d: %s rejoined the rounds", k, self.group.peer_label(r))
            self._left.discard(r)
            self._asked.pop(r, None)
            self._state.join(cid(r))

    # ---- whose averaging runs -----------------------------------------------------------

    def _know_running(self, ranks: Iterable[int]) -> None:
        """Note that the GroupAveraging of ``ranks`` runs, behind the connections this
        rank has to them now (a restarted process comes back on a new one)."""
        for r in ranks:
            if r != self.group.rank:
                with contextlib.suppress(UsageError):  # none: gone
                    self._running[r] = self.group.connection(r)

    def _asked_by(self, r: int, conn: Connection) -> None:
        """Rank ``r`` asked on ``conn`` to be taken back: its averaging runs there."""
        self._running[r] = conn
        self._asked[r] = conn

    def _runs(self, r: int) -> bool:
        """Whether rank ``r``'s GroupAveraging is known to run behind the connection this
        rank has to it now (so it answers a report: it leads, or declines). This rank's
        own does."""
        if r == self.group.rank:
            return True
        try:
            return self.group.connection(r) is self._running.get(r)
        except UsageError:  # no connection: gone
            return False

    async def _hear_asks(self) -> None:
        """Read the requests to be taken back already here from ranks not known to run
        (a restarted rank sends one to every rank in the group as its GroupAveraging
        starts; a rank taken back since is known from the decision that named it in
        ``joining``): each makes its sender known to run. Waits for none."""
        for r in self._present():
            if self._runs(r):
                continue
            try:  # what is queued comes at once; nothing else is waited for
                conn = self.group.connection(r)
                frame = await conn.recv(self._join_channel(_READY), timeout=_AT_ONCE)
                if decode(frame, conn.label).kind == "ready":
                    self._asked_by(r, conn)
            except P2PError:  # none yet (a timeout), gone, or malformed: not known to run
                continue

    # ---- a rank that rejoins ------------------------------------------------------------------

    async def _rejoin(self, seconds: float) -> None:
        """Ask every rank to take this (restarted) rank back; the leader answers with the
        model, the round id and its own rank. Bounded by ``seconds``."""
        ranks = self._present()
        if not ranks:
            raise UsageError("no other rank is left to rejoin")
        meta, _ = encode("ready")
        for r in ranks:
            self._send(r, _READY, meta)
        waits = {asyncio.ensure_future(self._await_welcome(r)): r for r in ranks}
        declines = [asyncio.ensure_future(self._decline_to_lead(r)) for r in ranks]
        welcome: tuple[int, Message] | None = None
        failed: list[str] = []  # ranks that went, or sent something malformed, meanwhile
        try:
            async with asyncio.timeout(seconds):
                while waits and welcome is None:
                    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        del waits[task]
                        error = task.exception()
                        if error is None:
                            welcome = task.result()
                        elif isinstance(error, P2PError):
                            failed.append(str(error))
                        else:
                            raise error
        except TimeoutError:
            me = self.group.peer_label(self.group.rank)
            also = f"; meanwhile: {'; '.join(failed)}" if failed else ""
            raise P2PTimeoutError(
                f"{me}: no rank took it back within {seconds:g} s (is a leader running, "
                f"and stepping? it answers when it opens a round){also}"
            ) from None
        finally:
            await cancel_and_wait([*waits, *declines])
        if welcome is None:
            raise GroupBrokenError(
                "every other rank went before taking this one back: " + "; ".join(failed)
            )
        self._adopt_welcome(*welcome)

    async def _await_welcome(self, r: int) -> tuple[int, Message]:
        """Rank ``r``'s welcome; answers a new leader's request for reports meanwhile."""
        conn = self.group.connection(r)
        while True:
            message = decode(await conn.recv(self._join_channel(_WELCOME)), conn.label)
            if message.kind == "welcome":
                return r, message
            if message.kind == "request":
                self._send(r, _REPORT, encode("report", {"r": -1})[0])

    async def _decline_to_lead(self, r: int) -> None:
        """Rank ``r`` chose this rank to succeed a lost leader (it read this rank's
        request, and this one is the lowest in the group whose averaging runs), but it
        is not taking part yet and has no model: answer its report, in place of the
        decision it waits for, that it must choose again without us."""
        conn = self.group.connection(r)
        with contextlib.suppress(P2PError):  # the connection ended: nothing to answer
            while True:
                frame = await conn.recv(self._join_channel(_REPORT))
                # Only the round matters here: a report whose last decision this rank
                # cannot check is still answered, so its sender does not wait in vain.
                try:
                    k = decode(frame, conn.label).get_int("r", conn.label, low=-1)
                except RemoteProtocolError as exc:  # one bad report; answer the next ones
                    log.warning("%s", exc)
                    continue
                if k >= 0:
                    meta, _ = encode("decline", {"r": k})
                    conn.send_nowait(round_channel(self.tag, k, DECISION), meta=meta)

    def _adopt_welcome(self, r: int, message: Message) -> None:
        label = self.group.peer_label(r)
        k = message.get_int("r", label)
        leader = message.get_int("l", label)
        model = message.need_array(label)
        if model.dtype != self._model.dtype or model.shape != self._model.shape:
            raise MismatchError(
                label,
                f"its model is {model.dtype}{list(model.shape)}, this rank's "
                f"{self._model.dtype}{list(self._model.shape)}",
            )
        last = message.fields.get("last")
        if k > 0:
            if not isinstance(last, dict):
                raise RemoteProtocolError(label, "welcome without the last decision")
            self._last = decision_body(Message("decision", last), label, k - 1, self.group.size)
        members = self._welcome_members(message, label, leader)
        self._model = np.array(model, copy=True, order="C")
        self.leader = leader
        self._know_running(members)
        for j in range(k):  # what the others sent for earlier rounds is of no use here
            self._retire(j)
        self._round = k
        log.info("taken back by %s at round %d", label, k)

    def _welcome_members(self, message: Message, label: str, leader: int) -> list[int]:
        """The ranks in the rounds from the welcome's round on: its ``in``, or, from a
        leader that does not send one, the ranks the last decision did not list as gone
        (and the leader), or every rank before the first decision."""
        size = self.group.size
        members = message.fields.get("in")
        if members is None:
            if self._last is None:
                return list(range(size))
            gone = set(self._last["left"])
            return [r for r in range(size) if r not in gone or r == leader]
        if not isinstance(members, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < size for r in members
        ):
            raise RemoteProtocolError(label, f"welcome: bad 'in' {members!r}")
        return members

    # ---- leader failover --------------------------------------------------------------------

    def _successor(self, passed: set[int]) -> int:
        """Pick the successor of the lost leader (the same on every remaining rank): the
        lowest rank still here whose averaging is known to run (a rank back in the group
        whose application has not started one yet could not answer), passing over
        ``passed``: the leaders lost and the ranks that declined since this rank last
        had a decision (each declines only while rejoining, so none is asked twice).
        Read what :meth:`_hear_asks` reads first."""
        lost = self.leader
        silent = {r for r in range(self.group.size) if not self._runs(r)}
        self.leader = next_leader(self.group.size, self._gone() | passed | silent)
        log.warning(
            "leader %s lost; %s leads now",
            self.group.peer_label(lost),
            self.group.peer_label(self.leader),
        )
        return self.leader

    def _report(self, k: int) -> None:
        """Tell the new leader where this rank stands: round ``k``, decision applied last."""
        self._send(self.leader, _REPORT, encode("report", {"r": k, "last": self._last})[0])

    async def _take_over(self, k: int, own: OwnUpdate | None) -> tuple[Body, np.ndarray | None]:
        """Lead from now on: gather the report of every rank whose averaging runs, adopt
        the decision someone applied (or decide round ``k`` anew), then run round ``k``
        (unless adopted) as the leader. The other ranks here are not in the rounds yet:
        they are taken back once they ask."""
        ranks = [r for r in self._present() if self._runs(r)]
        meta, _ = encode("request")
        for r in ranks:
            self._send(r, _WELCOME, meta)  # only a rank waiting to be taken back reads it
        reports = await self._reports(ranks)
        plan = plan_takeover(self.group.rank, Report(k, self._last), reports)
        self._become_leader(plan)
        if plan.adopt is not None:
            behind = [r for r in plan.behind if r != self.group.rank]
            self._send_decision(plan.lead_from - 1, plan.adopt, behind)
        if k < plan.lead_from:  # this rank is behind too: apply the adopted decision
            assert plan.adopt is not None
            return plan.adopt, await self._follow(k, plan.adopt, own)
        self._open(k)
        return await self._lead(k, own)

    def _become_leader(self, plan: Takeover) -> None:
        # What the lost leader remembered as aggregated (an update resent to this rank
        # must still count once) is the 'counted' of the newest decision applied in the
        # group: the adopted one, or else this rank's own last (every rank applied it).
        last = plan.adopt if plan.adopt is not None else self._last
        state = FederatedRounds(
            self._model.shape,
            self._model.dtype,
            self.config,
            first_round=plan.lead_from,
            label=lambda c: self.group.peer_label(int(c)),
            aggregated=remembered(last),
            # rounds that applied nothing left the model as it was rounds earlier: the
            # decision says since when (updates from then on are fresh for the quorum)
            model_from=None if last is None else int(last["since"]),
        )
        for r in plan.members:
            state.join(cid(r))
        self._state = state
        # Ranks waiting to be taken back are welcomed when a round opens after their
        # ready is read (its listeners start now): not at once, since the others' updates
        # for this round may have gone out before those ranks were back in the group.
        self._left = set(range(self.group.size)) - set(plan.members)
        waiting = ", ".join(self.group.peer_label(r) for r in plan.rejoining)
        log.warning(
            "%s took over as leader from round %d%s%s",
            self.group.peer_label(self.group.rank),
            plan.lead_from,
            " (adopting the last decision)" if plan.adopt is not None else "",
            f"; waiting to be taken back: {waiting}" if waiting else "",
        )

    async def _reports(self, ranks: list[int]) -> dict[int, Report]:
        """The report of each of ``ranks`` (a rank lost meanwhile is left out), each
        bounded by the decision timeout."""
        reports: dict[int, Report] = {}

        async def one(r: int) -> None:
            conn = self.group.connection(r)
            try:
                frame = await conn.recv(self._join_channel(_REPORT), timeout=self._timeout)
            except PeerTimeoutError:
                raise PeerTimeoutError(
                    conn.label, f"sent the new leader no report within {self._timeout:g} s"
                ) from None
            except (ConnectionBrokenError, RemoteProtocolError):
                return  # gone too
            reports[r] = report_of(decode(frame, conn.label), conn.label, self.group.size)

        await _all(one(r) for r in ranks)
        return reports


async def _all(calls: Any) -> None:
    """Run ``calls`` together; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        for task in asyncio.as_completed(tasks):
            await task
    finally:
        await cancel_and_wait(tasks)
