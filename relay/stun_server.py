"""The relay's UDP address-observation port: answers STUN Binding Requests
(RFC 8489) with the address each request came from. Everything else is ignored."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from p2pdist.wire.stun import StunError, binding_response, parse_binding_request

from .addresses import unmap_ipv4
from .logfmt import kv
from .metrics import Metrics

__all__ = ["StunProtocol"]

log = logging.getLogger(__name__)

STUN_BACKLOG = 64 * 1024
"""Bytes of replies the kernel has not taken yet beyond which a request goes unanswered
(counted): asyncio keeps every reply it could not send at once, without bound, and
requests are cheap to send (and to spoof) while the uplink is full."""


class StunProtocol(asyncio.DatagramProtocol):
    """Stateless: one response datagram (32 or 44 bytes) per valid request."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            txid = parse_binding_request(data)
        except StunError:
            return
        if self._transport is None:
            return
        if self._backlog() > STUN_BACKLOG:
            self._metrics.stun_dropped_total += 1
            return
        ip, port = unmap_ipv4(str(addr[0])), int(addr[1])
        try:
            self._transport.sendto(binding_response(txid, ip, port), addr)
        except (OSError, ValueError) as exc:  # pragma: no cover - kernel-side trouble
            log.debug(kv("stun_send_failed", to=f"{ip}:{port}", error=exc))
            return
        self._metrics.stun_requests_total += 1

    def _backlog(self) -> int:
        """Bytes of replies asyncio holds for the kernel (its datagram transports have
        the method, though asyncio.DatagramTransport does not declare it)."""
        size = getattr(self._transport, "get_write_buffer_size", None)
        return int(size()) if size is not None else 0

    def error_received(self, exc: Exception) -> None:
        log.debug(kv("stun_error", error=exc))
