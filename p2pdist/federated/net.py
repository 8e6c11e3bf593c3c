"""asyncio glue shared by the coordinator, its clients and GroupAveraging: opening
transports and waiting for a round to be due (dialing: p2pdist.transport.dial)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ..identity import EndpointId, SecretKey
from ..transport.base import TransportConfig
from ..transport.quic import QuicTransport
from ..transport.relay_path import RelayPath
from ..transport.tcp import TcpTransport
from .rounds import CloseReason, FederatedRounds

__all__ = ["open_transport", "until_due"]

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
