"""A federated-averaging client: dials the coordinator (directly or through a relay),
receives models, submits updates. It never listens on any port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

import numpy as np

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    P2PError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from ..group.devices import host_copy_async
from ..identity import EndpointId, SecretKey
from ..settings import check_int, check_seconds
from ..tasks import cancel_and_wait
from ..transport.base import Address, Connection, TransportConfig
from ..transport.dial import dial_with_retry
from ..transport.quic import QuicTransport
from ..transport.tcp import TcpTransport
from .messages import CLIENT_CHANNEL, Message, decode, encode
from .net import open_transport

__all__ = ["Ack", "FederatedClient", "RoundTask"]

log = logging.getLogger(__name__)

KEEP_ACKS = 1024
"""Verdicts a client keeps by default (the newest; they are counted all the same)."""
_STOP_GRACE = 5.0
"""Seconds a send that failed on a closed connection waits for the reader to read a
``stop`` the coordinator sent before closing it."""


@dataclass(frozen=True, slots=True)
class RoundTask:
    """A model the coordinator sent: train from it and submit with ``base_round=round``."""

    round: int
    model: np.ndarray = field(repr=False)
    """The model of round :attr:`round`, read only: train a copy
    (``train(task.model.copy())``) and submit the difference."""
    open: bool
    """Whether the round was open when the model was sent (a joiner between rounds gets
    the model of the round about to open)."""
    deadline: float
    """When the round closes at the latest, on this event loop's clock (``loop.time()``),
    when :attr:`open`; otherwise only an estimate, ``round_timeout`` after the model
    came: the round opens when the coordinator runs it (after its wait for members, say),
    and its own deadline counts from then."""


@dataclass(frozen=True, slots=True)
class Ack:
    """The coordinator's verdict on one submission."""

    round: int
    """The round the update was sent for."""
    accepted: bool
    reason: str
    """Why it did not count (a :class:`~.aggregate.Reason` value), or ``""``."""
    current_round: int
    """The coordinator's round when it decided."""


class FederatedClient:
    """One client of a :class:`~.coordinator.Coordinator`.

    ``coordinator`` is its endpoint id (pinned: a different key is refused). Give
    ``address`` (``host:port``, TCP) or ``relay`` (a relay URL: QUIC through the relay, by
    endpoint id alone). ``key`` is this client's identity (fresh by default); ``name`` is
    a free-form label for the coordinator's logs. ``keep_acks`` bounds how many verdicts
    :attr:`acks` keeps (the newest); :attr:`acks_received` and :attr:`acks_refused` count
    them all.
    """

    def __init__(
        self,
        coordinator: EndpointId | str,
        *,
        address: Address | None = None,
        relay: str | None = None,
        relay_token: str | None = None,
        key: SecretKey | None = None,
        transport: TransportConfig | None = None,
        connect_timeout: float = 30.0,
        name: str = "",
        keep_acks: int = KEEP_ACKS,
    ) -> None:
        if (address is None) == (relay is None):
            raise UsageError("give exactly one of address= (host:port) or relay= (a relay URL)")
        self.coordinator = (
            coordinator if isinstance(coordinator, EndpointId) else EndpointId.parse(coordinator)
        )
        self._label = f"coordinator {self.coordinator.short()}"
        self.key = key or SecretKey.generate()
        self.name = name
        self._address = address
        self._relay = relay
        self._relay_token = relay_token
        self._tconfig = transport or TransportConfig()
        self._connect_timeout = connect_timeout
        self._transport: TcpTransport | QuicTransport | None = None
        self._conn: Connection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._latest: RoundTask | None = None
        self._returned = -1
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._closed = False
        self.acks: deque[Ack] = deque(maxlen=check_int("keep_acks", keep_acks, 1))
        """The newest verdicts received (at most ``keep_acks``), oldest first: a client
        that submits for days holds a bounded history."""
        self.acks_received = 0
        """Verdicts received in all."""
        self.acks_refused = 0
        """Of those, how many did not count (``accepted`` False)."""
        self.stopped: str | None = None
        """The coordinator's reason once it said stop ("training is over" at a normal
        end)."""
        self.stop_error = False
        """True when the coordinator stopped because it failed (an exception ended its
        ``async with``, or it was interrupted); :attr:`stopped` then says what happened.
        Training did not finish."""

    @property
    def endpoint_id(self) -> EndpointId:
        """This client's endpoint id."""
        return self.key.endpoint_id

    @property
    def latest(self) -> RoundTask | None:
        """The newest model received."""
        return self._latest

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> RoundTask:
        """Dial the coordinator (retrying for ``connect_timeout`` s), say hello and return
        the current model and round id. A connect that failed may be tried again; a
        closed client may not (make a new one: the same key keeps its identity)."""
        if self._closed:
            raise UsageError(
                "this client was closed: make a new FederatedClient (the same key keeps "
                "its identity)"
            )
        if self._transport is not None:
            raise UsageError("already connected")
        # What a failed connect() before this one left (kept until now, for the caller).
        self._error, self.stopped, self.stop_error = None, None, False
        self._latest, self._returned = None, -1  # (a model its cancelled wait had got)
        self._changed.clear()
        label = self._label
        self._transport = await open_transport(
            self.key,
            self._tconfig,
            relay=self._relay,
            relay_token=self._relay_token,
            accept_from=lambda _eid: False,  # a client never accepts connections
            label_for=None,
            timeout=self._connect_timeout,
        )
        try:
            if self._closed:  # close() ran while the transport opened: it could not see it
                raise ConnectionClosedError(f"{label}: the client was closed while it connected")
            conn = await dial_with_retry(
                self._transport,
                self.coordinator,
                self._address,
                label=label,
                timeout=self._connect_timeout,
            )
            self._conn = conn
            meta, payload = encode("hello", {"name": self.name})
            await conn.send(CLIENT_CHANNEL, payload, meta=meta)
            self._reader = asyncio.get_running_loop().create_task(self._read(conn))
            # The first model, even when a stop followed it (submit() then says so).
            task = await self._next_task(self._connect_timeout, after_stop=True)
            if task is None:  # told to stop before any model: do not keep the transport
                raise ConnectionClosedError(f"{label} stopped: {self.stopped}")
        except BaseException:
            await self._end_session()  # (and connect() may be tried again: see above)
            raise
        return task

    async def next_round(self, *, timeout: float | None = None) -> RoundTask | None:
        """The newest model newer than the last one returned (rounds a slow client missed
        are skipped), or None once the coordinator has said stop."""
        return await self._next_task(timeout, after_stop=False)

    async def _next_task(self, timeout: float | None, *, after_stop: bool) -> RoundTask | None:
        """:meth:`next_round`; ``after_stop``: a model that came before the stop too."""
        await self._wait_until(
            lambda: self._has_new_round() or self.stopped is not None, timeout, "no new round"
        )
        latest = self._latest
        fresh = after_stop or self.stopped is None
        if fresh and latest is not None and latest.round > self._returned:
            self._returned = latest.round
            return latest
        return None

    async def submit(
        self,
        update: np.ndarray,
        num_samples: int,
        base_round: int,
        *,
        round_id: int | None = None,
        timeout: float = 30.0,
    ) -> bool:
        """Send ``update`` (the model delta trained from round ``base_round``'s model, on
        ``num_samples`` samples) for round ``round_id`` (default: ``base_round``, the
        round it was trained for; one that arrives after that round closed is carried,
        and the next round still waits for this client's update for it). Name a later
        round to make an old update this client's part of that round. The verdict
        arrives later in :attr:`acks`. A CuPy
        ``update`` is copied to the host first (after the work queued on its stream).

        Returns True once sent, or False, sending nothing, when the coordinator has said
        stop (training is over, or it failed: see :attr:`stopped` and
        :attr:`stop_error`), also when the stop arrives
        while the update is being sent and the coordinator has closed the connection.
        Other connection errors raise."""
        num_samples = check_int("num_samples", num_samples, 1)
        base_round = check_int("base_round", base_round, 0)
        if round_id is not None:
            round_id = check_int("round_id", round_id, 0)
        timeout = check_seconds("timeout", timeout)
        if self.stopped is not None:
            return False
        if round_id is None:
            round_id = base_round
        message = encode(
            "submit",
            {"r": round_id, "b": base_round, "n": num_samples},
            np.asarray(await host_copy_async(update, timeout)),
        )
        return await self._send(message, timeout, "update")

    async def abstain(self, round_id: int, *, timeout: float = 30.0) -> bool:
        """Tell the coordinator that this client has no update for round ``round_id``
        (it trained nothing this round): the round does not wait for it until its
        deadline, and closes ``complete`` once the other members are in. No verdict
        comes back. An update submitted for the round afterwards still counts.

        Returns True once sent, or False, sending nothing, when the coordinator has said
        stop (as :meth:`submit`). A coordinator of p2pdist 0.1.0 before this message
        existed drops the client (an unexpected message)."""
        round_id = check_int("round_id", round_id, 0)
        timeout = check_seconds("timeout", timeout)
        if self.stopped is not None:
            return False
        return await self._send(encode("abstain", {"r": round_id}), timeout, "abstention")

    async def _send(self, message: tuple[bytes, memoryview], timeout: float, what: str) -> bool:
        """Send ``message`` to the coordinator within ``timeout``: True once sent, False
        when a failed send came from the coordinator's stop."""
        conn = self._need_conn()
        meta, payload = message
        try:
            async with asyncio.timeout(timeout):
                await conn.send(CLIENT_CHANNEL, payload, meta=meta)
        except TimeoutError:
            raise PeerTimeoutError(self._label, f"{what} not sent within {timeout:g} s") from None
        except (ConnectionBrokenError, ConnectionClosedError):
            if await self._stopped_meanwhile():
                return False
            raise
        return True

    async def _stopped_meanwhile(self) -> bool:
        """After a failed send: whether the coordinator said stop before it closed the
        connection (the reader may not have read the stop yet; it ends soon either way:
        the stop comes before the end of the stream)."""
        reader = self._reader
        if self.stopped is None and reader is not None and not reader.done():
            await asyncio.wait({reader}, timeout=_STOP_GRACE)
        return self.stopped is not None

    async def wait_ack(self, count: int, *, timeout: float = 30.0) -> Ack:
        """Wait until ``count`` verdicts have arrived; returns the ``count``-th (counting
        from 1 over all verdicts). Once the coordinator has said stop and no more can
        come, raises ConnectionClosedError with its reason; UsageError when that verdict
        is older than the ``keep_acks`` newest, which are all that is kept."""
        count = check_int("count", count, 1)
        await self._wait_until(
            lambda: self.acks_received >= count or self.stopped is not None,
            timeout,
            "no verdict",
        )
        if self.acks_received < count:
            raise ConnectionClosedError(f"{self._label} stopped: {self.stopped}")
        index = count - 1 - (self.acks_received - len(self.acks))
        if index < 0:
            raise UsageError(
                f"verdict {count} is no longer kept: {self.acks_received} arrived and only "
                f"the newest {self.acks.maxlen} are (keep_acks)"
            )
        return self.acks[index]

    async def close(self) -> None:
        """Say bye (leaving on purpose) and close; returns once the reader has ended."""
        self._closed = True
        await self._end_session()

    async def _end_session(self) -> None:
        # Taken first: a cancellation below must not leave it to say "already connected".
        conn, self._conn = self._conn, None
        transport, self._transport = self._transport, None
        try:
            if conn is not None and not conn.closed:
                meta, payload = encode("bye")
                with contextlib.suppress(P2PError):
                    conn.send_nowait(CLIENT_CHANNEL, payload, meta=meta)
            if self._reader is not None:
                await cancel_and_wait([self._reader])
            if self._error is None:
                self._error = ConnectionClosedError("the client was closed")
            self._changed.set()
        finally:
            if transport is not None:
                await asyncio.shield(transport.close())

    def _has_new_round(self) -> bool:
        return self._latest is not None and self._latest.round > self._returned

    async def _wait_until(
        self, ready: Callable[[], bool], timeout: float | None, what: str
    ) -> None:
        """Wait for ``ready()`` (re-checked whenever the reader got a message); raises the
        reader's error, or PeerTimeoutError naming the coordinator after ``timeout`` s."""
        if timeout is not None:
            timeout = check_seconds("timeout", timeout)
        try:
            async with asyncio.timeout(timeout):
                while not ready():
                    if self._error is not None:
                        raise self._error
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise PeerTimeoutError(self._label, f"{what} within {timeout:g} s") from None

    def _need_conn(self) -> Connection:
        if self._conn is None:
            raise UsageError("not connected: call connect() first")
        if self._error is not None:
            raise self._error
        return self._conn

    async def _read(self, conn: Connection) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                message = decode(await conn.recv(CLIENT_CHANNEL), conn.label)
                self._on_message(message, conn.label, loop.time())
                self._changed.set()
                if self.stopped is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, ConnectionBrokenError | ConnectionClosedError):
                log.warning("%s: %s", conn.label, exc)
            self._error = exc
            self._changed.set()
            if isinstance(exc, RemoteProtocolError):
                await conn.close()

    def _on_message(self, message: Message, label: str, now: float) -> None:
        if message.kind == "model":
            is_open = bool(message.fields.get("open"))
            model = message.need_array(label)  # a view of the frame's own buffer: no copy
            model.flags.writeable = False  # training in place would leave a zero delta
            task = RoundTask(
                message.get_int("r", label),
                model,
                is_open,
                now + max(0.0, message.get_float("left", label)),
            )
            if self._latest is None or task.round >= self._latest.round:
                self._latest = task
        elif message.kind == "ack":
            why = message.fields.get("why")
            ack = Ack(
                message.get_int("r", label),
                bool(message.fields.get("ok")),
                why if isinstance(why, str) else "",
                message.get_int("round", label),
            )
            self.acks.append(ack)
            self.acks_received += 1
            self.acks_refused += not ack.accepted
        elif message.kind == "stop":
            why = message.fields.get("why")
            self.stop_error = message.fields.get("error") is True
            self.stopped = why if isinstance(why, str) else "stopped"
        else:
            raise RemoteProtocolError(label, f"unexpected {message.kind!r} message")
