"""The HTTP/1.1 side of the relay port (sans-I/O): the upgrade, /health and /metrics.

:func:`route` looks at one parsed request head and decides: switch to relay frames
(``101``, to a WebSocket handshake or to ``Upgrade: p2pdist-relay``), or answer and
close (``200`` / ``400`` / ``404``). Nothing here reads sockets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from p2pdist.wire.relay import (
    UPGRADE_PATH,
    UPGRADE_TOKEN,
    VERSION,
    WEBSOCKET_VERSION,
    HttpHead,
    RelayProtocolError,
    records_key,
    upgrade_response,
)
from p2pdist.wire.websocket import valid_key

__all__ = ["HttpDecision", "response", "route"]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    426: "Upgrade Required",
    503: "Service Unavailable",
}
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class HttpDecision:
    """What to do with a request: ``upgrade`` to relay frames, or answer and close.
    ``records``: the client's record secret when its upgrade offers AES-GCM records
    (the 101 that takes them is the core's to write: it carries the relay's secret)."""

    upgrade: bool
    status: int
    response: bytes
    records: bytes | None = None
    websocket_key: str | None = None
    """The client's ``Sec-WebSocket-Key`` when the upgrade is a WebSocket handshake."""


def response(
    status: int,
    body: str,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    headers: str = "",
) -> bytes:
    """A complete ``Connection: close`` response (for HEAD, ``head_only``: the same head,
    without the body); ``headers``: more header lines, each ending in CRLF."""
    data = body.encode("utf-8")
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
        f"Cache-Control: no-store\r\n{headers}Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + (b"" if head_only else data)


def _tokens(value: str) -> set[str]:
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def _websocket_key(head: HttpHead) -> str | HttpDecision:
    """The key of a valid WebSocket handshake for the relay's subprotocol, or the 400."""
    key = head.header("sec-websocket-key")
    if not valid_key(key):
        return HttpDecision(False, 400, response(400, "bad or missing Sec-WebSocket-Key\n"))
    if head.header("sec-websocket-version") != str(WEBSOCKET_VERSION):
        # RFC 6455 4.2.2: 426 naming the version this side speaks.
        return HttpDecision(
            False,
            426,
            response(
                426,
                f"expected Sec-WebSocket-Version: {WEBSOCKET_VERSION}\n",
                headers=f"Sec-WebSocket-Version: {WEBSOCKET_VERSION}\r\n",
            ),
        )
    if UPGRADE_TOKEN not in _tokens(head.header("sec-websocket-protocol")):
        return HttpDecision(
            False, 400, response(400, f"expected Sec-WebSocket-Protocol: {UPGRADE_TOKEN}\n")
        )
    return key


def _upgrade(head: HttpHead) -> HttpDecision:
    upgrades = _tokens(head.header("upgrade"))
    if not upgrades & {UPGRADE_TOKEN, "websocket"} or "upgrade" not in _tokens(
        head.header("connection")
    ):
        return HttpDecision(
            False, 400, response(400, f"expected Upgrade: {UPGRADE_TOKEN} or websocket\n")
        )
    key: str | None = None
    if UPGRADE_TOKEN not in upgrades:
        checked = _websocket_key(head)
        if isinstance(checked, HttpDecision):
            return checked
        key = checked
    version = head.header("p2pdist-relay-version")
    if version and version != str(VERSION):
        return HttpDecision(
            False, 400, response(400, f"unsupported relay protocol version {version[:16]!r}\n")
        )
    try:
        offer = records_key(head)
    except RelayProtocolError as exc:
        return HttpDecision(False, 400, response(400, f"{exc}\n"))
    return HttpDecision(True, 101, upgrade_response(websocket_key=key), offer, key)


def route(head: HttpHead, metrics_text: Callable[[], str]) -> HttpDecision:
    """Decide on one request; ``metrics_text`` is only called for ``GET /metrics``."""
    line = head.start_line
    if len(line) != 3 or not line[2].startswith("HTTP/1."):
        return HttpDecision(False, 400, response(400, "malformed request line\n"))
    method, target = line[0], line[1]
    path = target.split("?", 1)[0]
    if method not in ("GET", "HEAD"):  # HEAD: what some load balancers probe with
        return HttpDecision(False, 400, response(400, "only GET and HEAD are supported\n"))
    bare = method == "HEAD"
    if path == UPGRADE_PATH and not bare:
        return _upgrade(head)
    if path == "/health":
        return HttpDecision(False, 200, response(200, "ok", head_only=bare))
    if path == "/metrics":
        text = metrics_text()
        return HttpDecision(False, 200, response(200, text, METRICS_TYPE, head_only=bare))
    return HttpDecision(False, 404, response(404, "not found\n", head_only=bare))
