"""HTTP CONNECT through a forward proxy (RFC 9110 section 9.3.6), sans I/O.

A relay client behind a proxy that is the only way out (a corporate or campus network)
asks the proxy for a TCP tunnel to the relay, then runs TLS to the relay inside it. The
proxy sees only the relay's host and port and TLS records: the pin or certificate check
and the AUTH proof, which is bound to the relay's certificate, are end to end.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from ..errors import UsageError
from .relay import RelayProtocolError, parse_http_head

__all__ = ["ProxyRefused", "ProxyUrl", "connect_answer", "connect_request"]


class ProxyRefused(ValueError):
    """The proxy answered CONNECT with a status other than 2xx."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}".strip())
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ProxyUrl:
    """``http://[user:password@]host:port``: a forward proxy that tunnels with CONNECT."""

    host: str
    port: int
    user: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> ProxyUrl:
        """Parse and validate; UsageError says what is wrong."""
        if not isinstance(url, str):
            raise UsageError(f"proxy URL must be a string, got {type(url).__name__}")
        try:
            parts = urlsplit(url.strip())
            port = parts.port
        except ValueError as exc:
            raise UsageError(f"proxy URL {url!r}: {exc}") from None
        if parts.scheme != "http":
            # TLS to the proxy itself (https://) is not supported: the tunnel's content is
            # TLS to the relay anyway.
            raise UsageError(f"proxy URL must start with http://, got {_redacted(url)!r}")
        if not parts.hostname:
            raise UsageError(f"proxy URL {_redacted(url)!r} has no host")
        if port is None or port == 0:
            raise UsageError(f"proxy URL {_redacted(url)!r} needs a port (http://host:3128)")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise UsageError(f"proxy URL {_redacted(url)!r}: no path, query or fragment")
        user = unquote(parts.username) if parts.username is not None else None
        password = unquote(parts.password) if parts.password is not None else None
        return cls(parts.hostname, port, user, password)

    def __str__(self) -> str:
        """The URL without its credentials (for logs and errors)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def _redacted(url: str) -> str:
    """``url`` with any user:password part replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    at = rest.find("@", 0, rest.find("/") if "/" in rest else len(rest))
    return f"{scheme}{sep}***@{rest[at + 1 :]}" if sep and at >= 0 else url


def connect_request(proxy: ProxyUrl, host: str, port: int) -> bytes:
    """The CONNECT request for a tunnel to ``host:port``, with Basic credentials when the
    proxy URL carries them."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
    if proxy.user is not None:
        secret = f"{proxy.user}:{proxy.password or ''}".encode()
        lines.append(f"Proxy-Authorization: Basic {base64.b64encode(secret).decode('ascii')}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def connect_answer(buf: bytes | bytearray) -> int | None:
    """Check the proxy's answer at the start of ``buf``: None while its head is still
    incomplete, else the bytes the head used. ProxyRefused for a non-2xx status,
    RelayProtocolError for something that is not an HTTP answer."""
    parsed = parse_http_head(buf)
    if parsed is None:
        return None
    head, used = parsed
    version, status_text = head.start_line[0], head.start_line[1]
    if not version.startswith("HTTP/1.") or not status_text.isdigit():
        raise RelayProtocolError(f"proxy answered {' '.join(head.start_line)[:80]!r}")
    status = int(status_text)
    if not 200 <= status < 300:
        reason = head.start_line[2] if len(head.start_line) > 2 else ""
        raise ProxyRefused(status, reason)
    return used
