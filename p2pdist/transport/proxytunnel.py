"""A TCP tunnel through an HTTP forward proxy (CONNECT), as a connected socket.

The relay client hands the socket to ``create_connection(sock=...)`` and runs TLS to the
relay inside it, exactly as over a direct connection. Works on any event loop that has
the ``sock_*`` methods (asyncio's and uvloop's).
"""

from __future__ import annotations

import asyncio
import socket

from ..wire.httpproxy import ProxyUrl, connect_answer, connect_request
from ..wire.relay import MAX_HTTP_HEAD, RelayProtocolError
from .happyeyeballs import connect_tcp

__all__ = ["open_tunnel"]


MAX_ANSWER = 4 * MAX_HTTP_HEAD
"""Most bytes a proxy's answer to CONNECT may take, interim 1xx heads included (each head
is bounded by MAX_HTTP_HEAD on its own)."""


async def open_tunnel(proxy: ProxyUrl, host: str, port: int) -> socket.socket:
    """A socket whose bytes reach ``host:port`` through ``proxy``. The caller bounds the
    wait. ``ProxyRefused`` when the proxy says no (its status kept), ``OSError`` when it
    cannot be reached or closes, ``RelayProtocolError`` for an answer that is not HTTP or
    has bytes after its head (the relay speaks only after our TLS ClientHello). The
    errors do not name the proxy: the caller does."""
    loop = asyncio.get_running_loop()
    sock = await connect_tcp(proxy.host, proxy.port)
    try:
        await loop.sock_sendall(sock, connect_request(proxy, host, port))
        answer = bytearray()
        while (used := connect_answer(answer)) is None:
            if len(answer) > MAX_ANSWER:  # interim 1xx heads without end
                raise RelayProtocolError(f"answered CONNECT with over {MAX_ANSWER} bytes")
            more = await loop.sock_recv(sock, MAX_HTTP_HEAD)
            if not more:
                raise ConnectionResetError("closed before answering CONNECT")
            answer += more
        if used != len(answer):
            raise RelayProtocolError("sent data after its CONNECT answer")
        return sock
    except BaseException:
        sock.close()
        raise
