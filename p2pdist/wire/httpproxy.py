"""HTTP CONNECT through a forward proxy (RFC 9110 section 9.3.6), sans I/O.

A relay client behind a proxy that is the only way out (a corporate or campus network)
asks the proxy for a TCP tunnel to the relay, then runs TLS to the relay inside it. The
proxy sees only the relay's host and port and TLS records: the pin or certificate check
and the AUTH proof, which is bound to the relay's certificate, are end to end.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from ..errors import UsageError
from .relay import MAX_HTTP_HEAD, RelayProtocolError, ascii_host

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
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str) -> ProxyUrl:
        """Parse and validate; UsageError says what is wrong, never quoting credentials."""
        if not isinstance(url, str):
            raise UsageError(f"proxy URL must be a string, got {type(url).__name__}")
        shown = _redacted(url)
        try:
            parts = urlsplit(url.strip())
            port = parts.port
        except ValueError:  # urllib's message may quote part of the netloc
            raise UsageError(f"proxy URL {shown!r}: bad host or port") from None
        if parts.scheme != "http":
            # TLS to the proxy itself (https://) is not supported: the tunnel's content is
            # TLS to the relay anyway.
            raise UsageError(f"proxy URL must start with http://, got {shown!r}")
        if not parts.hostname:
            raise UsageError(f"proxy URL {shown!r} has no host")
        if port is None or port == 0:
            raise UsageError(f"proxy URL {shown!r} needs a port (http://host:3128)")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise UsageError(
                f"proxy URL {shown!r}: no path, query or fragment (percent-encode '/', '?' "
                "and '#' in a password)"
            )
        user = unquote(parts.username) if parts.username is not None else None
        password = unquote(parts.password) if parts.password is not None else None
        return cls(parts.hostname, port, user, password)

    def __str__(self) -> str:
        """The URL without its credentials (for logs and errors)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def _redacted(url: str) -> str:
    """``url`` with everything up to the last ``@`` after the scheme (where user and
    password are, whatever characters they hold) replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


def connect_request(proxy: ProxyUrl, host: str, port: int) -> bytes:
    """The CONNECT request for a tunnel to ``host:port``, with Basic credentials when the
    proxy URL carries them."""
    host = ascii_host(host)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
    if proxy.user is not None:
        secret = f"{proxy.user}:{proxy.password or ''}".encode()
        lines.append(f"Proxy-Authorization: Basic {base64.b64encode(secret).decode('ascii')}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_STATUS_LINE = re.compile(r"HTTP/1\.[0-9] ([0-9]{3})(?: (.*))?")


def _head_end(buf: bytes | bytearray, pos: int) -> int:
    """Where the head starting at ``pos`` ends (just past its empty line), or -1 while
    that line has not come. Lines end in CRLF or, as RFC 9112 2.2 lets a recipient
    accept, in a bare LF."""
    start, limit = pos, pos + MAX_HTTP_HEAD + 4
    while (nl := buf.find(b"\n", start, limit)) >= 0:
        if nl == start or (nl == start + 1 and buf[start] == 0x0D):  # an empty line
            return nl + 1
        start = nl + 1
    return -1


def connect_answer(buf: bytes | bytearray) -> int | None:
    """Check the proxy's answer at the start of ``buf``: None while it is incomplete, else
    the bytes it used (interim 1xx heads skipped, RFC 9110 15.2). ProxyRefused for a
    final status other than 2xx, RelayProtocolError for something that is not an HTTP
    answer. Only the status line is read: a proxy's headers are its own business."""
    pos = 0
    while True:
        end = _head_end(buf, pos)
        if end < 0:
            if len(buf) - pos > MAX_HTTP_HEAD:
                raise RelayProtocolError("answered CONNECT with a head too large")
            return None
        line = bytes(buf[pos : buf.find(b"\n", pos)]).rstrip(b"\r").decode("latin-1")
        match = _STATUS_LINE.fullmatch(line)
        if match is None:
            raise RelayProtocolError(f"answered CONNECT with {line[:80]!r}, not HTTP")
        status, pos = int(match.group(1)), end
        if 100 <= status < 200:
            continue
        if 200 <= status < 300:
            return pos
        raise ProxyRefused(status, match.group(2) or "")
