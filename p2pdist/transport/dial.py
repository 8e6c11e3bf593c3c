"""Dialing a peer that may not be listening yet: retry with backoff, bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

from ..errors import (
    ConnectionBrokenError,
    P2PError,
    PeerAuthenticationError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import EndpointId
from .base import ACCEPT_QUEUE_FULL, Address, Connection
from .quic import QuicTransport
from .tcp import TcpTransport

__all__ = ["dial_with_retry", "retry_pauses", "worth_retrying"]

log = logging.getLogger(__name__)


def worth_retrying(exc: BaseException) -> bool:
    """Whether a dial that failed with ``exc`` is retried: a refusal, a reset or a
    handshake timeout (a peer still starting up) and a full accept queue (a busy one),
    never an authentication failure."""
    if isinstance(exc, PeerAuthenticationError):
        return ACCEPT_QUEUE_FULL in exc.detail  # (full: busy, not refused)
    return isinstance(exc, ConnectionBrokenError | PeerTimeoutError | RemoteProtocolError)


FIRST_RETRY = 0.02
"""Seconds before the first retry; doubles up to :data:`MAX_RETRY`."""
MAX_RETRY = 0.5


def retry_pauses() -> Iterator[float]:
    """Seconds to wait before each retry of a dial: :data:`FIRST_RETRY`, doubling up to
    :data:`MAX_RETRY`."""
    delay = FIRST_RETRY
    while True:
        yield delay
        delay = min(delay * 2, MAX_RETRY)


async def dial_with_retry(
    transport: TcpTransport | QuicTransport,
    peer: EndpointId,
    address: Address | None,
    *,
    label: str,
    timeout: float | None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> Connection:
    """Connect to ``peer`` at ``address`` (QUIC: through the relay when None), retrying
    refusals, resets and handshake timeouts with exponential backoff (a peer that is
    still starting up), and a full accept queue (a busy one), never an authentication
    failure. ``timeout`` bounds the whole attempt (:class:`PeerTimeoutError` naming
    ``label`` and the last error); None leaves the bound to the caller, whom
    ``on_retry`` tells each error retried."""
    if address is None and not isinstance(transport, QuicTransport):
        raise UsageError(f"{label}: TCP needs a host:port")
    pauses = retry_pauses()
    last: BaseException | None = None
    bound = asyncio.timeout(timeout) if timeout is not None else contextlib.nullcontext()
    try:
        async with bound:
            while True:
                try:
                    if isinstance(transport, QuicTransport):
                        return await transport.connect(peer, address, label=label)
                    assert address is not None
                    return await transport.connect(peer, address, label=label)
                except P2PError as exc:
                    if not worth_retrying(exc):
                        raise
                    last = exc
                log.debug("dial %s: %s; retrying", label, last)
                if on_retry is not None:
                    on_retry(last)
                await asyncio.sleep(next(pauses))
    except TimeoutError:
        if timeout is None:
            raise
        raise PeerTimeoutError(
            label, f"no connection within {timeout:g} s (last error: {last})"
        ) from None
