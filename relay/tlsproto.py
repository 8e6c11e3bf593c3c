"""Server-side TLS for many mostly idle connections: asyncio's own TLS protocol with one
receive buffer for all connections.

``asyncio.sslproto.SSLProtocol`` gives every connection a 256 KiB receive buffer
(``max_size``), allocated and zero-filled up front: about 256 KiB of RSS per client, the
bulk of a relay's memory. The socket transport fills that buffer and calls the
protocol's ``buffer_updated``, which copies the ciphertext into the TLS object before
it returns, so the buffer is free again as soon as each read is handled: this subclass
gives every connection of one listener the same :data:`SHARED_READ` bytes (created
with the factory) and is otherwise asyncio's code path unchanged: the listener is
created without ``ssl=`` and each raw connection gets this protocol, which wraps the
relay's protocol exactly as ``loop.create_server(ssl=...)`` would. Should asyncio's
internals stop matching, a connection keeps a private buffer of :data:`READ_BUFFER`
bytes (two full TLS records) instead.

``SSLProtocol`` is not public API. When it is missing or its constructor differs,
:func:`tls_protocol_factory` returns None and the caller falls back to ``ssl=``. It
also returns None on a loop that is not asyncio's own (uvloop): uvloop's TLS protocol
(Cython, much faster than asyncio's pure-Python one) allocates its 256 KiB read buffer
with ``malloc`` and never zero-fills it, so pages that mostly idle connections never read
into are never resident.

An app protocol that implements :class:`RawTransportWatcher` is also told about the TCP
transport under the TLS layer: when it is made (before the handshake, so a server can
abort connections still handshaking when it shuts down) and when it is lost (whether
or not the handshake completed), and it may read that transport's write buffer size.
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["READ_BUFFER", "SHARED_READ", "RawTransportWatcher", "tls_protocol_factory"]

READ_BUFFER = 32 * 1024
SHARED_READ = 256 * 1024

try:
    from asyncio.sslproto import SSLProtocol as _SSLProtocol
except ImportError:  # pragma: no cover - other Python implementations
    _SSLProtocol = None  # type: ignore[assignment,misc]


@runtime_checkable
class RawTransportWatcher(Protocol):
    """Optional hooks of an app protocol served through :func:`tls_protocol_factory`."""

    def raw_connection_made(self, transport: asyncio.Transport) -> None:
        """The TCP connection under TLS is up; the handshake has just started."""

    def raw_connection_lost(self) -> None:
        """The TCP connection is gone, handshake done or not (the app's own
        connection_lost, if it was connected, is called soon after)."""


_EXPECTED = ["loop", "app_protocol", "sslcontext", "waiter", "server_side"]


def _compatible() -> bool:
    if _SSLProtocol is None or not hasattr(_SSLProtocol, "max_size"):
        return False
    try:
        params = list(inspect.signature(_SSLProtocol.__init__).parameters)[1:]
    except (TypeError, ValueError):  # pragma: no cover
        return False
    return params[: len(_EXPECTED)] == _EXPECTED and "ssl_shutdown_timeout" in params


if _SSLProtocol is not None:

    class _SharedBufferSSLProtocol(_SSLProtocol):
        max_size = READ_BUFFER  # the private buffer the base class makes (then dropped)

        def __init__(
            self, shared: memoryview, watcher: RawTransportWatcher | None, *args: Any, **kwargs: Any
        ) -> None:
            super().__init__(*args, **kwargs)
            self._watcher = watcher
            if isinstance(getattr(self, "_ssl_buffer_view", None), memoryview):
                # The base class's get_buffer returns _ssl_buffer_view (never growing it:
                # max_size is below the shared buffer's size), and buffer_updated reads
                # the bytes from it.
                self._ssl_buffer = self._ssl_buffer_view = shared

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if self._watcher is not None:
                self._watcher.raw_connection_made(transport)  # type: ignore[arg-type]

        def connection_lost(self, exc: BaseException | None) -> None:
            super().connection_lost(exc)
            if self._watcher is not None:
                self._watcher.raw_connection_lost()


def tls_protocol_factory(
    app_factory: Callable[[], asyncio.BaseProtocol],
    context: ssl.SSLContext,
    *,
    handshake_timeout: float,
    shutdown_timeout: float,
) -> Callable[[], asyncio.BaseProtocol] | None:
    """A protocol factory for a plain ``create_server`` that terminates TLS with small
    buffers, or None when this Python's asyncio does not allow it or the running loop is
    not asyncio's (call it inside the loop that will serve)."""
    if not _compatible() or not isinstance(asyncio.get_running_loop(), asyncio.BaseEventLoop):
        return None

    # typeshed is stricter than asyncio here (waiter may be None, timeouts are floats).
    options: dict[str, Any] = {
        "waiter": None,
        "server_side": True,
        "ssl_handshake_timeout": handshake_timeout,
        "ssl_shutdown_timeout": shutdown_timeout,
    }

    shared = memoryview(bytearray(SHARED_READ))

    def factory() -> asyncio.BaseProtocol:
        app = app_factory()
        watcher = app if isinstance(app, RawTransportWatcher) else None
        return _SharedBufferSSLProtocol(
            shared, watcher, asyncio.get_running_loop(), app, context, **options
        )

    return factory
