"""A TCP listener that serves or closes every socket it accepts.

asyncio's ``Server`` accepts a socket in one step of the loop and makes its transport in
a task that runs later. A server closed in between makes that task fail (CPython 3.11:
``Server._attach`` asserts that the server still listens), silently unless the loop is in
debug mode, and the accepted socket stays open, unserved, until garbage collection: the
peer that dialled waits out its whole handshake timeout. That happens when a group is
formed again on the same ports right after it closed (a soak test saw 10 s stalls about
once in a few hundred formations). Here each accepted socket is handed to a transport by
``loop.connect_accepted_socket``, which closes it on failure or cancellation, or closed
once the listener is. Sockets are taken by a reader callback, as the Server takes them,
not by an awaited ``loop.sock_accept``: a task cancelled just after its accept completed
would lose the accepted socket with the result.

The sockets are bound as ``loop.create_server`` binds them: one per address that
``getaddrinfo`` gives (``""`` is every interface), ``SO_REUSEADDR`` set, and IPv6 ones
IPv6-only so that an IPv4 one can share the port.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from collections.abc import Callable

from ..tasks import cancel_and_wait

__all__ = ["BACKLOG", "Listener"]

log = logging.getLogger(__name__)

BACKLOG = 100
"""Connections the kernel may hold before they are accepted (``create_server``'s)."""
_ACCEPT_RETRY = 0.1
"""Seconds to stop accepting after an accept fails for want of resources (out of
descriptors)."""
_WARN_INTERVAL = 10.0
"""Seconds between two warnings about failing accepts."""
_HANDOVER_WAIT = 2.0
"""Seconds :meth:`Listener.close` lets sockets accepted already reach their transports."""


class Listener:
    """Listening sockets, accepting while the loop runs; see the module docstring."""

    def __init__(
        self, sockets: list[socket.socket], factory: Callable[[], asyncio.BaseProtocol]
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._sockets = sockets
        self._factory = factory
        self._closed = False
        self._serving: set[asyncio.Task[None]] = set()
        """Accepted sockets being handed to their transports."""
        self._warned_at = -_WARN_INTERVAL
        for sock in sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

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
                try:
                    sock = socket.socket(family, kind, proto)
                except OSError:  # a family this kernel lacks (IPv6 off): as create_server
                    continue
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

    def _accept(self, sock: socket.socket) -> None:
        """The listening socket is readable: take what waits, as asyncio's Server does,
        but each socket taken is ours until a transport has it."""
        for _ in range(BACKLOG):
            if self._closed:
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                # EMFILE and the like: what waits stays in the backlog meanwhile.
                now = self._loop.time()
                if now - self._warned_at >= _WARN_INTERVAL:
                    self._warned_at = now
                    log.warning("accept on %s failed: %s", sock.getsockname(), exc)
                self._loop.remove_reader(sock.fileno())
                self._loop.call_later(_ACCEPT_RETRY, self._resume, sock)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._serve(conn))
            self._serving.add(task)
            # A task cancelled before it ran (close()) never closes the socket itself.
            task.add_done_callback(functools.partial(self._served, conn=conn))

    def _resume(self, sock: socket.socket) -> None:
        if not self._closed:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    async def _serve(self, conn: socket.socket) -> None:
        # Its transport closes the socket if it fails or is cancelled.
        await self._loop.connect_accepted_socket(self._factory, conn)

    def _served(self, task: asyncio.Task[None], *, conn: socket.socket) -> None:
        self._serving.discard(task)
        if task.cancelled() or task.exception() is not None:
            if not task.cancelled():
                log.debug("accepted connection dropped: %s", task.exception())
            conn.close()

    async def close(self) -> None:
        """Stop accepting and close the listening sockets; the sockets accepted already
        are handed to their transports (the protocol sees its owner closed) or closed."""
        if self._closed:
            return
        self._closed = True
        for sock in self._sockets:
            self._loop.remove_reader(sock.fileno())
            sock.close()
        # Let each hand-over finish (a few loop steps; the protocol then sees its owner
        # closed and ends the connection) instead of cancelling it: uvloop, cancelled
        # there, never calls connection_lost, and what the protocol holds stays open.
        if self._serving:
            await asyncio.wait(set(self._serving), timeout=_HANDOVER_WAIT)
        await cancel_and_wait(self._serving, timeout=_HANDOVER_WAIT)
