"""asyncio glue shared by the coordinator, its clients and GroupAveraging: opening
transports, dialing, and waiting for a round to be due."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ..errors import (
    ConnectionBrokenError,
    PeerAuthenticationError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import EndpointId, SecretKey
from ..transport.base import Address, Connection, TransportConfig
from ..transport.quic import QuicTransport
from ..transport.relay_path import RelayPath
from ..transport.tcp import TcpTransport
from .rounds import CloseReason, FederatedRounds

__all__ = ["dial", "open_transport", "until_due"]

log = logging.getLogger(__name__)


async def open_transport(
    key: SecretKey,
    config: TransportConfig,
    *,
    relay: str | None,
    relay_token: str | None,
    accept_from: Callable[[EndpointId], bool] | None,
    label_for: Callable[[EndpointId], str] | None,
    timeout: float,
) -> TcpTransport | QuicTransport:
    """QUIC over a session to ``relay`` (waits at most ``timeout`` s for it), or TCP."""
    if relay is None:
        return TcpTransport(key, config, accept_from=accept_from, label_for=label_for)
    path = RelayPath(key, relay, token=relay_token)
    quic = QuicTransport(key, config, accept_from=accept_from, label_for=label_for, relay=path)
    try:
        await path.wait_connected(timeout)
    except BaseException:
        await quic.close()
        raise
    return quic


async def dial(
    transport: TcpTransport | QuicTransport,
    peer: EndpointId,
    address: Address | None,
    label: str,
    timeout: float,
) -> Connection:
    """Connect to ``peer`` (at ``address``, or through the relay when None), retrying
    refusals and timeouts with backoff for at most ``timeout`` seconds."""
    if address is None and not isinstance(transport, QuicTransport):
        raise UsageError(f"{label}: TCP needs a host:port")
    delay = 0.02
    last: BaseException | None = None
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    if isinstance(transport, QuicTransport):
                        return await transport.connect(peer, address, label=label)
                    assert address is not None
                    return await transport.connect(peer, address, label=label)
                except PeerAuthenticationError:
                    raise
                except (ConnectionBrokenError, PeerTimeoutError, RemoteProtocolError) as exc:
                    last = exc
                    log.debug("dial %s: %s; retrying", label, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
    except TimeoutError:
        raise PeerTimeoutError(
            label, f"no connection within {timeout:g} s (last error: {last})"
        ) from None


async def until_due(
    state: FederatedRounds, wake: asyncio.Event, check: Callable[[], None] | None = None
) -> CloseReason:
    """Wait until ``state``'s open round is due, re-checking whenever ``wake`` is set (by
    whoever fed the state machine) and at the round's deadline at the latest, on the
    loop's clock. ``check`` runs before each wait and may raise to give up."""
    loop = asyncio.get_running_loop()
    deadline = state.deadline
    assert deadline is not None
    while (why := state.due(loop.time())) is None:
        if check is not None:
            check()
        wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await wake.wait()
    return why
