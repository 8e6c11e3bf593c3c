"""A TCP listener that serves or closes every socket it accepts.

asyncio's ``Server`` accepts a socket in one step of the loop and makes its transport in
a task that runs later. A server closed in between makes that task fail (CPython 3.11:
``Server._attach`` asserts that the server still listens), silently unless the loop is in
debug mode, and the accepted socket stays open, unserved, until garbage collection: the
peer that dialled waits out its whole handshake timeout. That happens when a group is
formed again on the same ports right after it closed (a soak test saw 10 s stalls about
once in a few hundred formations). Here each accepted socket is handed to a transport by
``loop.connect_accepted_socket``, which closes it on failure or cancellation, or closed
once the listener is.

The sockets are bound as ``loop.create_server`` binds them: one per address that
``getaddrinfo`` gives (``""`` is every interface), ``SO_REUSEADDR`` set, and IPv6 ones
IPv6-only so that an IPv4 one can share the port.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

from ..tasks import cancel_and_wait

__all__ = ["BACKLOG", "Listener"]

log = logging.getLogger(__name__)

BACKLOG = 100
"""Connections the kernel may hold before they are accepted (``create_server``'s)."""
_ACCEPT_RETRY = 0.1
"""Seconds to wait after an accept fails for want of resources (out of descriptors)."""


class Listener:
    """Listening sockets and their accept loops; see the module docstring."""

    def __init__(
        self, sockets: list[socket.socket], factory: Callable[[], asyncio.BaseProtocol]
    ) -> None:
        self._sockets = sockets
        self._factory = factory
        self._closed = False
        self._loops = [asyncio.create_task(self._accept_loop(s)) for s in sockets]

    @classmethod
    async def open(
        cls, host: str, port: int, factory: Callable[[], asyncio.BaseProtocol]
    ) -> Listener:
        """Bind ``host:port`` and start accepting; ``factory`` makes each connection's
        protocol. Raises OSError naming the address that could not be bound."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        sockets: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    sock.bind(address)
                except OSError as exc:
                    why = (exc.strerror or str(exc)).lower()
                    raise OSError(
                        exc.errno, f"error while attempting to bind on address {address!r}: {why}"
                    ) from None
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, f"no address to listen on for {host!r}")
        return cls(sockets, factory)

    @property
    def address(self) -> tuple[str, int]:
        """The first socket's bound (host, port)."""
        name = self._sockets[0].getsockname()
        return str(name[0]), int(name[1])

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if self._closed:
                    return
                # EMFILE and the like: the connection waits in the backlog meanwhile.
                log.warning("accept on %s failed: %s", sock.getsockname(), exc)
                await asyncio.sleep(_ACCEPT_RETRY)
                continue
            if self._closed:
                conn.close()
                return
            try:
                # Its transport closes the socket if it fails or is cancelled; closing it
                # here too covers a failure before there is a transport.
                await loop.connect_accepted_socket(self._factory, conn)
            except asyncio.CancelledError:  # the listener is closing
                conn.close()
                raise
            except Exception as exc:  # the peer reset it already, say: the next one
                log.debug("accepted connection dropped: %s", exc)
                conn.close()

    async def close(self) -> None:
        """Stop accepting and close the listening sockets; connections already handed
        to their transports are theirs to close."""
        if self._closed:
            return
        self._closed = True
        try:
            await cancel_and_wait(self._loops)
        finally:
            for sock in self._sockets:
                sock.close()
