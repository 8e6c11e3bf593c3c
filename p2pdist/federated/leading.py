"""The leader's side of decentralised averaging (:class:`~.decentral.GroupAveraging`):
opening a round, reading every rank's update into the state machine as it comes,
closing the round and sending its decision. Mixed into ``GroupAveraging``, which sets
every attribute declared here."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from ..errors import P2PError, RemoteProtocolError, UsageError
from ..transport.base import Connection
from .decision import OwnUpdate, cid, counted_of, digest_async
from .messages import DECISION, UPDATE, Message, decode, encode, round_channel
from .net import until_due
from .recovery import Recovery
from .rounds import Phase, Verdict

__all__ = ["Leading"]

log = logging.getLogger(f"{__package__}.decentral")  # all of GroupAveraging under one name


class Leading(Recovery):
    """The leader's part of :class:`~.decentral.GroupAveraging` (and, through
    :class:`~.recovery.Recovery`, rejoining and failover)."""

    _collectors: list[asyncio.Task[None]]
    _wake: asyncio.Event
    _refused: dict[int, str]
    _digests: dict[int, bytes]

    # ---- provided by GroupAveraging -------------------------------------------------------

    def _check_group(self) -> None:
        raise NotImplementedError

    def _settings(self) -> list[Any]:
        raise NotImplementedError

    # ---- leading a round ------------------------------------------------------------------

    def _open(self, k: int) -> None:
        """Open round ``k`` (the model is round ``k``'s): drop the ranks gone, take back
        those that rejoined and asked (they get the model and ``k``; the round does not
        wait for them), and read everyone's updates as they come."""
        assert self._state is not None
        loop = asyncio.get_running_loop()
        gone = set(self.group.left)
        for r in gone:
            self._left.add(r)
            self._state.leave(cid(r))
        self._state.open(loop.time())
        back = self._coming_back()
        away = self._gone() - set(back)
        members = [r for r in range(self.group.size) if r not in away]
        for r in back:
            self._welcome(r, k, members)
        self._ready.clear()
        self._stop_collectors()
        self._refused = {}
        self._digests = {}
        for r, conn in self._conns().items():
            self._collectors.append(loop.create_task(self._collect(k, r, conn)))
        self._listen_for_ready()

    def _coming_back(self) -> list[int]:
        """The ranks the next round this leader opens takes back: not in the rounds nor
        gone, and their request read (a member's is stale). A decision names them, and
        the next round opens right after it is sent (nothing awaited in between), so
        every rank that applies the decision knows they are back in the rounds."""
        return sorted((self._ready - set(self.group.left)) & self._left)

    def _stop_collectors(self) -> None:
        for task in self._collectors:
            task.cancel()
        self._collectors = []

    def _check_collectors(self) -> None:
        """Raise what ended a reader of updates other than its connection (a bug: the
        round would otherwise wait for that rank until its deadline)."""
        for task in self._collectors:
            if task.done() and not task.cancelled():
                error = task.exception()
                if error is not None:
                    raise error

    def _check_leading(self) -> None:
        self._check_group()
        self._check_collectors()

    async def _collect(self, k: int, r: int, conn: Connection) -> None:
        """Feed rank ``r``'s updates for round ``k`` to the state machine as they come."""
        assert self._state is not None
        label = self.group.peer_label(r)
        channel = round_channel(self.tag, k, UPDATE)
        malformed = 0
        try:
            while True:
                frame = await conn.recv(channel)
                try:
                    message = decode(frame, label)
                    if (
                        message.kind not in ("update", "abstain")
                        or message.get_int("r", label) != k
                    ):
                        raise RemoteProtocolError(label, f"not an update for round {k}")
                    if message.kind == "abstain":  # it has none: its part is in
                        self._state.abstain(cid(r), k)
                    else:
                        await self._submit(k, r, message, label)
                except RemoteProtocolError as exc:
                    # One warning per rank and round (the rest at DEBUG): a rank sending
                    # garbage in a loop must not flood the log.
                    malformed += 1
                    level = logging.WARNING if malformed == 1 else logging.DEBUG
                    log.log(level, "round %d: ignored a malformed update: %s", k, exc)
                self._wake.set()
        except P2PError as exc:
            # The connection ended. Unless that broke the group (step() then raises it),
            # the rank has left, or was lost under on_peer_loss="leave": stop waiting.
            if self.group.broken is None:
                log.warning("round %d: %s is gone: %s", k, label, exc)
                self._left.add(r)
                self._state.leave(cid(r))
        finally:
            self._wake.set()  # whatever ended this reader, the leader looks again

    async def _submit(self, k: int, r: int, message: Message, label: str) -> None:
        """Offer rank ``r``'s update (``message``, sent for round ``k``) to the round."""
        assert self._state is not None
        update = message.need_array(label)
        # Hashed before submit (off the loop when big), so nothing runs between
        # acceptance and noting its digest: the round cannot close on an accepted update
        # the decision could not name. Only a model-shaped update can be accepted, so
        # only those are hashed.
        model = self._model
        fits = update.shape == model.shape and update.dtype == model.dtype
        hashed = await digest_async(update) if fits else b""
        now = asyncio.get_running_loop().time()
        base, samples = message.get_int("b", label), message.fields.get("n")
        verdict = self._state.submit(cid(r), k, base, samples, update, now)
        self._note(r, verdict, hashed)

    async def _lead(
        self, k: int, own: OwnUpdate | None
    ) -> tuple[dict[str, Any], np.ndarray | None]:
        state = self._state
        assert state is not None and state.phase is Phase.OPEN and state.round == k
        loop = asyncio.get_running_loop()
        me = cid(self.group.rank)
        if own is not None:
            verdict = state.submit(me, k, own.base_round, own.num_samples, own.update, loop.time())
            self._note(self.group.rank, verdict, own.digest)
        else:
            state.abstain(me, k)
        why = await until_due(state, self._wake, self._check_leading)
        self._check_leading()
        outcome = state.close(loop.time(), why)
        self._stop_collectors()
        if not outcome.applied:
            state.take_pending()  # their owners send them again (carried)
        body: dict[str, Any] = {
            "r": k,
            "ok": outcome.applied,
            "why": outcome.reason.value,
            "p": [
                [int(p.client), p.base_round, p.num_samples, p.weight, self._digests[int(p.client)]]
                for p in outcome.participants
            ],
            "refused": sorted(self._refused.items()),
            "stale": outcome.stale,
            "dropped": dict(outcome.dropped),
            "rejected": dict(outcome.rejected),
            "cfg": self._settings(),
            "left": sorted(self._gone()),
            "joining": self._coming_back(),  # their averaging runs: recovery.py
            "counted": counted_of(state.aggregated),  # survives a failover: recovery.py
            "since": state.model_from,  # the same (a successor's quorum counts from it)
        }
        self._send_decision(k, body, list(self._conns()))
        return body, outcome.aggregate

    def _note(self, r: int, verdict: Verdict, hashed: bytes) -> None:
        """Remember what the state machine did with rank ``r``'s update: the digest of an
        accepted one (for the decision), the first refusal of the round (the others are
        only counted, by the state machine: a decision names at most one per rank)."""
        if verdict.accepted:
            self._digests[r] = hashed
        elif verdict.reason is not None:
            self._refused.setdefault(r, verdict.reason.value)

    def _send_decision(self, k: int, body: dict[str, Any], ranks: list[int]) -> None:
        """Send round ``k``'s decision to ``ranks`` (never waits). A decision too big for
        a frame fails the leader's step (UsageError) before anything is sent: the
        followers would otherwise wait for it in vain."""
        meta, _ = encode("decision", body)
        limit = self.group.config.transport.limits.max_meta
        if len(meta) > limit:
            raise UsageError(
                f"{self.group.peer_label(self.group.rank)}: the decision of round {k} is "
                f"{len(meta)} bytes, over the frame meta limit of {limit} "
                f"({len(body['p'])} participants, {len(body['refused'])} refusals); "
                "raise TransportConfig.limits.max_meta on every rank"
            )
        channel = round_channel(self.tag, k, DECISION)
        for r in ranks:
            try:
                self.group.connection(r).send_nowait(channel, meta=meta)
            except P2PError as exc:
                log.info("%s: decision not sent: %s", self.group.peer_label(r), exc)
