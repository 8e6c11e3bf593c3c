"""The coordinator of the coordinator + clients shape (asyncio glue over FederatedRounds).

Clients only dial out: the coordinator listens on TCP, or is reached by endpoint id
through a relay (QUIC), and clients connect to it. Each client's connection carries one
channel each way (:data:`~.messages.CLIENT_CHANNEL`)::

    client -> coordinator   hello {name}            first message, once
                            submit {r, b, n} + update
                            bye {}                   leaving on purpose
    coordinator -> client   model {r, open, left} + model   on joining and at every round
                            ack {r, ok, why, round}  the verdict on one submission
                            stop {why, error}        training is over (error: the
                                                     coordinator stopped on an error)

Every message is matched to a round by its ids, never by when it arrives: the state
machine decides (accept, roll a straggler into the current round, drop, reject).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import numpy as np

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    P2PError,
    P2PTimeoutError,
    PeerError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import SHORT_LEN, EndpointId, SecretKey
from ..settings import check_int, check_seconds
from ..tasks import cancel_and_wait
from ..transport.base import Address, Connection, TransportConfig
from ..transport.quic import QuicTransport
from ..transport.tcp import TcpTransport, parse_address
from .aggregate import apply_update, check_fits, check_model
from .config import FederatedConfig, config_or_default
from .messages import CLIENT_CHANNEL, Message, decode, encode
from .net import open_transport, until_due
from .rounds import FederatedRounds, Phase, RoundOutcome

__all__ = ["Coordinator"]

log = logging.getLogger(__name__)

_HELLO_TIMEOUT = 10.0  # seconds a new connection has to say hello
STOP_AFTER_MODEL = 2.0
"""Seconds close() lets a model still waiting for room to a slow client go before the
stop (which would otherwise pass it)."""
_REPLACED = (
    "replaced by a newer connection with your key (the client restarted, or two clients "
    "share a key?)"
)
_WHY_LIMIT = 1000
"""Characters of an error's text a stop tells the clients (it must fit a frame's meta)."""


def _describe(exc: BaseException) -> str:
    """``Type: text`` of ``exc`` for the clients, bounded, whatever its ``__str__`` does."""
    try:
        text = str(exc)
    except Exception:
        text = "(no description)"
    return f"{type(exc).__name__}: {text}"[:_WHY_LIMIT]


_SAME_ID = (
    "this client's endpoint id is the coordinator's own (its key is the coordinator's: "
    "derive client keys from another seed than the coordinator's)"
)
ACKS_PER_ROUND = 8
"""Acks per client and round sent without waiting (an honest client submits once or
twice a round); past that, acks wait for the client to read (see ``_on_submit``)."""


def _client_label(client: EndpointId | str) -> str:
    """How logs and errors name a client (its endpoint id, or that id as text)."""
    return f"client {str(client)[:SHORT_LEN]}"  # as EndpointId.short()


@dataclass(eq=False)
class _Client:
    id: str
    label: str
    conn: Connection
    name: str = ""
    latest: tuple[bytes, memoryview] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    sender: asyncio.Task[None] | None = None
    stop_sent: bool = False
    """Whether close()'s stop went to it (its sender sends it after its models)."""
    ack_round: int = -1
    acks_in_round: int = 0


class Coordinator:
    """Runs rounds of federated averaging for clients that dial in.

    ``model`` is the initial model (a real numeric array; updates must match its shape and
    dtype). ``key`` is the coordinator's identity (clients pin its endpoint id); a fresh
    one by default. ``accept`` decides which client endpoint ids may connect (all by
    default). Use as ``async with Coordinator(...) as c: await c.start(listen=...)``.
    """

    def __init__(
        self,
        model: np.ndarray,
        config: FederatedConfig | None = None,
        *,
        key: SecretKey | None = None,
        transport: TransportConfig | None = None,
        accept: Callable[[EndpointId], bool] | None = None,
    ) -> None:
        self.key = key or SecretKey.generate()
        self.config = config_or_default(config)
        self._model = check_model(model)
        self._state = FederatedRounds(
            self._model.shape,
            self._model.dtype,
            self.config,
            label=_client_label,
        )
        self._tconfig = transport or TransportConfig()
        check_fits(self._model, self._tconfig.limits.max_payload)
        self._accept = accept
        self._transport: TcpTransport | QuicTransport | None = None
        self._address: tuple[str, int] | None = None
        self._clients: dict[str, _Client] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._closed = False
        self._stop: tuple[bytes, memoryview] | None = None
        """The stop message once close() began."""
        self._announced = -1
        self._running_round = False
        self.protocol_errors = 0
        """Connections closed because the client broke the message protocol."""

    # ---- properties -------------------------------------------------------------------

    @property
    def endpoint_id(self) -> EndpointId:
        """The coordinator's endpoint id (clients dial it)."""
        return self.key.endpoint_id

    @property
    def address(self) -> tuple[str, int] | None:
        """The bound TCP (host, port), or None through a relay."""
        return self._address

    @property
    def model(self) -> np.ndarray:
        """The current model (a read-only view; it is replaced, never changed, per round)."""
        view = self._model.view()
        view.flags.writeable = False
        return view

    @property
    def round(self) -> int:
        """The open round's id, or the next round's between rounds."""
        return self._state.round

    @property
    def members(self) -> list[str]:
        """Endpoint ids (text) of the connected clients, sorted."""
        return sorted(self._state.members)

    @property
    def state(self) -> FederatedRounds:
        """The round state machine (for inspection: totals, submitted, phase)."""
        return self._state

    # ---- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.close()
        elif isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
            await self.close(f"the coordinator was interrupted ({type(exc).__name__})", error=True)
        else:
            await self.close(f"the coordinator failed: {_describe(exc)}", error=True)

    async def start(
        self,
        *,
        listen: Address | None = None,
        relay: str | None = None,
        relay_token: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Accept clients: on TCP at ``listen`` (``host:port``; port 0 picks one, see
        :attr:`address`), or through ``relay`` (a relay URL; bounded by ``timeout`` s)."""
        if self._transport is not None or self._closed:
            raise UsageError("the coordinator is already started (or closed)")
        if (listen is None) == (relay is None):
            raise UsageError("give exactly one of listen= (host:port) or relay= (a relay URL)")
        transport = await open_transport(
            self.key,
            self._tconfig,
            relay=relay,
            relay_token=relay_token,
            accept_from=self._accept,
            label_for=_client_label,
            timeout=timeout,
        )
        try:
            if listen is not None:
                host, port = parse_address(listen)
                try:
                    self._address = await transport.listen(host, port)
                except OSError as exc:  # not started: start() may be called again
                    raise UsageError(f"coordinator cannot listen on {host}:{port}: {exc}") from None
            if self._closed:  # close() ran while it started: it could not see transport
                raise ConnectionClosedError("coordinator: closed while it started")
        except BaseException:  # (a cancellation too) no listener or session left behind
            self._address = None
            await asyncio.shield(transport.close())
            raise
        self._transport = transport
        self._spawn(self._accept_loop(transport))

    async def close(self, why: str = "training is over", *, error: bool = False) -> None:
        """Tell every client to stop (``why``; ``error``: the coordinator gives up on an
        error, which clients see as :attr:`FederatedClient.stop_error`), close every
        connection, stop accepting; returns once every task the coordinator started has
        ended. Leaving ``async with`` on an exception closes with ``error=True`` and the
        exception in ``why``."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()  # wait_for_members and run_round give up (see _check_open)
        self._stop = encode("stop", {"why": why, "error": error})
        try:
            # Each client's sender sends the stop after the models it still has (one
            # waiting for room to a slow client, one posted just now): the stop must not
            # pass the last round's model. For a moment; then the stop goes at once.
            senders = []
            for client in list(self._clients.values()):
                client.ready.set()
                if client.sender is not None and not client.sender.done():
                    senders.append(client.sender)
            if senders:
                await asyncio.wait(senders, timeout=STOP_AFTER_MODEL)
            for client in list(self._clients.values()):  # (joined meanwhile too)
                self._say_stop(client)
        finally:  # whatever ends the wait: nothing is left running or listening
            await cancel_and_wait(self._tasks)  # senders too
            if self._transport is not None:
                await asyncio.shield(self._transport.close())

    def _say_stop(self, client: _Client) -> None:
        """Send ``client`` close()'s stop now, unless it went already."""
        if self._stop is None or client.stop_sent:
            return
        client.stop_sent = True
        meta, payload = self._stop
        with contextlib.suppress(P2PError):
            client.conn.send_nowait(CLIENT_CHANNEL, payload, meta=meta)

    # ---- rounds -------------------------------------------------------------------------

    def _check_open(self) -> None:
        """ConnectionClosedError once :meth:`close` ran: no client can come or send."""
        if self._closed:
            raise ConnectionClosedError("coordinator: closed while waiting")

    async def wait_for_members(self, count: int, timeout: float | None) -> None:
        """Wait until at least ``count`` clients are connected (P2PTimeoutError after
        ``timeout`` seconds; None waits for good; ConnectionClosedError once the
        coordinator is closed meanwhile)."""
        count = check_int("count", count, 0)
        if timeout is not None:
            timeout = check_seconds("timeout", timeout)
        try:
            async with asyncio.timeout(timeout):
                while len(self._state.members) < count:
                    self._check_open()
                    self._wake.clear()
                    await self._wake.wait()
        except TimeoutError:
            raise P2PTimeoutError(
                f"coordinator: {len(self._state.members)} of {count} clients "
                f"connected within {timeout:g} s"
            ) from None

    async def run_round(self) -> RoundOutcome:
        """Open a round (sending the model to every client unless it went out when the
        last round closed), collect updates until the round is due (quorum, everyone, or
        the deadline), apply the aggregate, send the new model with the next round's id,
        and return what happened. Never waits past the deadline for anyone. A cancelled
        call leaves the round open; the next call resumes it. A :meth:`close` meanwhile
        ends it with ConnectionClosedError."""
        if self._transport is None or self._closed:
            raise UsageError("start the coordinator first (and do not use it after close)")
        if self._running_round:
            raise UsageError("run_round() is already running: await it before the next")
        loop = asyncio.get_running_loop()
        state = self._state
        if state.phase is Phase.WAITING:
            state.open(loop.time())
            if self._announced != state.round:
                self._broadcast()
        self._running_round = True
        try:
            why = await until_due(state, self._wake, self._check_open)
        finally:
            self._running_round = False
        outcome = state.close(loop.time(), why)
        if outcome.aggregate is not None:
            self._model = apply_update(self._model, outcome.aggregate, self.config.server_lr)
        self._broadcast()  # the next round's model, at once: clients need not wait for it
        log.info(
            "round %d closed (%s): %d participants, %d stale, %d dropped, %d rejected",
            outcome.round,
            outcome.reason,
            len(outcome.participants),
            outcome.stale,
            outcome.num_dropped,
            outcome.num_rejected,
        )
        return outcome

    def _model_message(self) -> tuple[bytes, memoryview]:
        state = self._state
        loop = asyncio.get_running_loop()
        is_open = state.phase is Phase.OPEN
        left = (state.deadline or 0.0) - loop.time() if is_open else self.config.round_timeout
        return encode("model", {"r": state.round, "open": is_open, "left": left}, self._model)

    def _broadcast(self) -> None:
        self._announced = self._state.round
        message = self._model_message()
        for client in self._clients.values():
            self._post(client, message)

    # ---- clients ------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` as a task that :meth:`close` ends (and waits for)."""
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept_loop(self, transport: TcpTransport | QuicTransport) -> None:
        while True:
            try:
                conn = await transport.accept()
            except (ConnectionClosedError, asyncio.CancelledError):
                return
            except P2PError as exc:  # a failed handshake of one client; keep accepting
                log.info("coordinator: incoming connection failed: %s", exc)
                continue
            self._spawn(self._serve(conn))

    async def _serve(self, conn: Connection) -> None:
        """One client's life: hello, then submissions until it leaves or breaks."""
        cid = str(conn.peer_id)
        label = conn.label  # _client_label's: the transport's label_for gave it
        client: _Client | None = None
        try:
            async with asyncio.timeout(_HELLO_TIMEOUT):
                hello = decode(await conn.recv(CLIENT_CHANNEL), label)
            if hello.kind != "hello":
                raise RemoteProtocolError(label, f"sent {hello.kind!r} before hello")
            if conn.peer_id == self.endpoint_id:
                await self._refuse(conn, _SAME_ID)
                return
            old = self._clients.pop(cid, None)
            if old is not None:  # the same client again: the newer connection wins
                # A client that restarted (its old connection dead or silent) is routine;
                # a live old connection means two processes share a key.
                interval = self._transport.config.keepalive_interval if self._transport else 1.0
                quiet = old.conn.closed or old.conn.idle_for() > 2 * interval
                log.log(
                    logging.INFO if quiet else logging.WARNING,
                    "%s connected again; closing its old connection (%s)",
                    label,
                    _REPLACED,
                )
                self._forget(old)
                meta, payload = encode("stop", {"why": _REPLACED, "error": True})
                with contextlib.suppress(P2PError):  # an old connection that is dead
                    old.conn.send_nowait(CLIENT_CHANNEL, payload, meta=meta)
                self._spawn(old.conn.close())
            name = hello.fields.get("name")
            client = _Client(cid, label, conn, name if isinstance(name, str) else "")
            self._clients[cid] = client
            client.sender = self._spawn(self._sender(client))
            self._state.join(cid)
            self._post(client, self._model_message())  # a late joiner gets model + round id
            log.info("%s joined (%r); %d members", label, client.name, len(self._clients))
            self._wake.set()
            while True:
                message = decode(await conn.recv(CLIENT_CHANNEL), label)
                if message.kind == "submit":
                    await self._on_submit(client, message)
                elif message.kind == "abstain":  # it has no update for that round
                    self._state.abstain(client.id, message.get_int("r", label))
                    self._wake.set()
                elif message.kind == "bye":
                    log.info("%s left", label)
                    return
                else:
                    raise RemoteProtocolError(label, f"unexpected {message.kind!r} message")
        except RemoteProtocolError as exc:
            self.protocol_errors += 1
            log.warning("%s", exc)
        except TimeoutError:
            log.info("%s: no hello within %g s", label, _HELLO_TIMEOUT)
        except (PeerError, ConnectionClosedError) as exc:
            log.info("%s: gone: %s", label, exc)
        except Exception:  # nothing a client does may take the coordinator down
            log.exception("%s: unexpected error; dropping the client", label)
        finally:
            if client is not None and self._clients.get(cid) is client:
                del self._clients[cid]
                self._forget(client)
            with contextlib.suppress(Exception):
                await asyncio.shield(conn.close())

    async def _refuse(self, conn: Connection, why: str) -> None:
        """Tell a client that may not join why (a stop with error=true), then let the
        caller close its connection."""
        log.warning("%s refused: %s", conn.label, why)
        meta, payload = encode("stop", {"why": f"refused: {why}", "error": True})
        with contextlib.suppress(P2PError, TimeoutError):
            async with asyncio.timeout(_HELLO_TIMEOUT):
                await conn.send(CLIENT_CHANNEL, payload, meta=meta)

    def _forget(self, client: _Client) -> None:
        """Drop ``client`` (already out of ``_clients``) from the rounds."""
        if client.sender is not None:
            client.sender.cancel()
        self._state.leave(client.id)
        self._wake.set()

    async def _on_submit(self, client: _Client, message: Message) -> None:
        label = client.label
        round_id = message.get_int("r", label)
        base = message.get_int("b", label)
        update = message.need_array(label)
        now = asyncio.get_running_loop().time()
        verdict = self._state.submit(
            client.id, round_id, base, message.fields.get("n"), update, now
        )
        reply = {
            "r": round_id,
            "ok": verdict.accepted,
            "why": verdict.reason.value if verdict.reason else "",
            "round": self._state.round,
        }
        meta, payload = encode("ack", reply)
        self._wake.set()
        if client.ack_round != self._state.round:
            client.ack_round, client.acks_in_round = self._state.round, 0
        client.acks_in_round += 1
        if client.acks_in_round <= ACKS_PER_ROUND:
            # A client's first acks of a round never wait: behind a model that is still
            # draining to a slow but healthy client, waiting could outlast round_timeout.
            with contextlib.suppress(P2PError):
                client.conn.send_nowait(CLIENT_CHANNEL, payload, meta=meta)
            return
        # Past that, a client is submitting far more than it should. Its acks wait while
        # its send buffer is backed up, so a client that never reads them is no longer
        # read from either, and is dropped after round_timeout instead of its acks piling
        # up here.
        limit = self.config.round_timeout
        try:
            async with asyncio.timeout(limit):
                await client.conn.send(CLIENT_CHANNEL, payload, meta=meta)
        except TimeoutError:
            raise ConnectionBrokenError(
                label, f"took none of its acks for {limit:g} s; dropping it"
            ) from None
        except P2PError:
            pass  # the connection is gone: the receive loop finds out

    def _post(self, client: _Client, message: tuple[bytes, memoryview]) -> None:
        """Queue a model message; a client still busy receiving the last one gets only the
        newest (a slow link never holds more than one model in memory)."""
        client.latest = message
        client.ready.set()

    async def _sender(self, client: _Client) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                if client.latest is None and self._stop is None:
                    await client.ready.wait()
                client.ready.clear()
                if client.latest is None:
                    if self._stop is not None:  # after every model it had: close()
                        self._say_stop(client)
                        return
                    continue
                meta, payload = client.latest
                client.latest = None
                try:
                    async with asyncio.timeout(self.config.round_timeout):
                        await client.conn.send(CLIENT_CHANNEL, payload, meta=meta)
                except (TimeoutError, P2PError) as exc:
                    log.info("%s: could not send the model (%s); dropping it", client.label, exc)
                    self._spawn(client.conn.close())
                    return
