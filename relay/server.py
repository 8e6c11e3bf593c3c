"""asyncio glue: the TLS listener, the STUN port, the tick timer and graceful shutdown.

Everything that decides anything lives in :class:`relay.state.RelayCore`; this module
only moves bytes between sockets and the core and tells it the time.

Received bytes are handled in place: every client connection is a
``BufferedProtocol`` whose :meth:`~_ClientConnection.get_buffer` returns the same
scratch buffer, owned by the server. The TLS layer decrypts into it and calls
``buffer_updated`` right away, on the one event loop thread, and the core is done with
those bytes when that call returns (it copies what it keeps), so one buffer serves every
connection and an idle client holds no receive buffer of its own.

One exception: closing a connection makes the TLS layer flush it, and that may read
what it still holds straight into ``get_buffer``, synchronously, even while the core
parses another client's bytes from the scratch (an endpoint that reconnects replaces its
old session). So a connection that is closing reads into a buffer of its own, and the
bytes being parsed are never overwritten.

On asyncio's own loop (:mod:`relay.tlsproto`) each connection also sees the TCP
transport under TLS: the server aborts connections still in their TLS handshake when it
shuts down (one that finished its handshake later would otherwise be served by a core
that no longer ticks), and :meth:`_ClientConnection.buffered` counts that transport's
write buffer too, so ``queue_bytes`` bounds everything queued towards a client.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import cast

from p2pdist.wire.relay import RelayUrl

from .access import AccessPolicy, Allowlist, AllowlistError
from .config import ConfigError, RelayConfig
from .logfmt import kv
from .metrics import Metrics
from .session import Session
from .state import CoreConfig, RelayCore, format_address
from .stun_server import StunProtocol
from .tap import FileTap, Tap
from .tlsconfig import RelayTls, load_or_create_key
from .tlsproto import tls_protocol_factory

__all__ = ["RelayServer"]

log = logging.getLogger(__name__)

CLOSE_GRACE = 5.0
"""A closed connection whose peer does not read is aborted after this many seconds."""
TLS_SHUTDOWN_SHARE = 0.8
"""The TLS layer's shutdown timeout, as a share of ``drain_timeout``: shorter, so a
client that does not read is aborted by TLS before the drain gives up on it."""

SCRATCH_SIZE = 256 * 1024
"""The receive buffer all client connections share: plaintext handed over per read."""
NESTED_READ = 16 * 1024
"""Least size of the private receive buffer of a connection that is closing (its last
reads may come while another connection's read is being handled)."""


class _ClientConnection(asyncio.BufferedProtocol):
    """One accepted TLS connection: feeds the core and implements its Link."""

    def __init__(self, server: RelayServer) -> None:
        self._server = server
        self._core = server.core
        self._loop = asyncio.get_running_loop()
        self._tap = server.tap
        self._buffer: bytearray | None = None
        self._transport: asyncio.Transport | None = None
        self._raw: asyncio.Transport | None = None
        self._session: Session | None = None
        self._abort: asyncio.TimerHandle | None = None

    # ---- relay.tlsproto.RawTransportWatcher -------------------------------------------

    def raw_connection_made(self, transport: asyncio.Transport) -> None:
        """TCP is up, the TLS handshake starts (not called on uvloop)."""
        self._raw = transport
        if self._server.closing:
            transport.abort()
        else:
            self._server.handshaking.add(self)

    def raw_connection_lost(self) -> None:
        """TCP is gone, the handshake done or not."""
        self._server.handshaking.discard(self)

    def abort_handshake(self) -> None:
        """Drop the TCP connection of a handshake that has not completed."""
        if self._raw is not None and self._transport is None:
            self._raw.abort()

    # ---- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername") or ("?", 0)
        self._server.handshaking.discard(self)
        self._server.connections.add(self)
        self._session = self._core.open(self, (str(peer[0]), int(peer[1])), self._loop.time())

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._transport is not None and self._transport.is_closing():
            # May be nested in another connection's receive: see the module doc.
            self._buffer = bytearray(max(sizehint, NESTED_READ))
        else:
            self._buffer = self._server.scratch
        return memoryview(self._buffer)

    def buffer_updated(self, nbytes: int) -> None:
        buffer, self._buffer = self._buffer, None
        if self._session is None or buffer is None:
            return
        try:
            with memoryview(buffer) as whole, whole[:nbytes] as data:
                if self._tap is not None:
                    self._tap(self._session.conn_id, "in", bytes(data))
                self._core.receive(self._session, data, self._loop.time())
        except Exception:  # pragma: no cover - a bug costs this connection, not the relay
            log.exception(kv("receive_failed", conn=self._session.label))
            self.abort()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._abort is not None:
            self._abort.cancel()
            self._abort = None
        if self._session is not None:
            self._core.lost(self._session, self._loop.time())
            if self._server._own_tap is not None:
                self._server._own_tap.forget(self._session.conn_id)
        self._server.connection_gone(self)

    # ---- Link -------------------------------------------------------------------------

    def write(self, data: bytearray) -> None:
        """Queue ``data`` on the TLS transport (which may keep it: it is ours no more)."""
        if self._transport is None or self._transport.is_closing():
            return
        if self._tap is not None and self._session is not None:
            self._tap(self._session.conn_id, "out", bytes(data))
        self._transport.write(data)

    def buffered(self) -> int:
        """Plaintext and ciphertext not yet handed to the kernel: the TLS layer's buffers
        and (where known, see the module doc) the TCP transport's."""
        if self._transport is None:
            return 0
        raw = 0 if self._raw is None else self._raw.get_write_buffer_size()
        return self._transport.get_write_buffer_size() + raw

    def close(self) -> None:
        """Flush and close; abort if the peer does not take the bytes within CLOSE_GRACE."""
        if self._transport is None or self._transport.is_closing():
            return
        self._transport.close()
        self._abort = self._loop.call_later(CLOSE_GRACE, self.abort)

    def abort(self) -> None:
        """Drop the connection now."""
        if self._transport is not None:
            self._transport.abort()


class RelayServer:
    """A running relay: ``await start()``, then ``url``; ``await close()`` to shut down
    gracefully (RECONNECT to every client, bounded drain). Also an async context manager.

    ``tap`` (tests, debugging) sees every byte read from or written to client
    connections after TLS; ``config.tap`` writes the same to a file.
    """

    def __init__(self, config: RelayConfig, *, tap: Tap | None = None) -> None:
        self.config = config
        self.tap: Tap | None = tap
        self._own_tap: FileTap | None = None
        self.connections: set[_ClientConnection] = set()
        """Connections whose TLS handshake is done."""
        self.handshaking: set[_ClientConnection] = set()
        """Connections still in their TLS handshake (asyncio's loop only)."""
        self._all_gone: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._stun: asyncio.DatagramTransport | None = None
        self._stun_alt: asyncio.DatagramTransport | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._closed = False
        self.port = 0
        self.stun_port = 0
        self.stun_alt_port = 0
        self.url = ""
        self.tls: RelayTls | None = None
        self._core: RelayCore | None = None
        self.scratch = bytearray(SCRATCH_SIZE)
        """Where every client connection receives (see the module docstring)."""

    @property
    def closing(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._closed

    @property
    def core(self) -> RelayCore:
        """The sans-I/O core (after :meth:`start`)."""
        if self._core is None:
            raise RuntimeError("RelayServer.start() has not run")
        return self._core

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Load keys and lists, bind the ports and start serving; ConfigError if unable."""
        c = self.config
        if c.cert is not None and c.cert_key is not None:
            self.tls = RelayTls.from_files(c.cert, c.cert_key)
        else:
            self.tls = RelayTls.pinned(load_or_create_key(c.key))
        try:
            allowlist = Allowlist(c.allowlist) if c.allowlist is not None else None
        except AllowlistError as exc:
            raise ConfigError(str(exc)) from None
        access = AccessPolicy(allowlist, c.token)
        metrics = Metrics()
        if self.tap is None and c.tap is not None:
            self._own_tap = FileTap(c.tap)
            self.tap = self._own_tap
            log.warning(kv("tap_enabled", path=c.tap, hint="debug only: records all traffic"))
        # Listen without accepting until the core exists: the core's AUTH_OK advertises
        # the observation ports, which are only known once they are bound.
        self._server = await self._listen()
        self.port = int(self._server.sockets[0].getsockname()[1])
        try:
            await self._start_stun(metrics)
        except ConfigError:
            self._server.close()
            raise
        core_cfg = CoreConfig(
            max_clients=c.max_clients,
            max_unauthenticated=c.max_unauthenticated,
            max_unauthenticated_per_ip=c.max_unauthenticated_per_ip,
            rate=c.rate,
            burst=c.burst,
            queue_bytes=c.queue_bytes,
            keepalive=c.keepalive,
            auth_timeout=c.auth_timeout,
            retry_after=c.retry_after,
            stun_ports=self.stun_ports,
        )
        self._core = RelayCore(core_cfg, self.tls.fingerprints, access, metrics)
        await self._server.start_serving()
        self.url = str(RelayUrl(c.url_host(), self.port, self.tls.pin))
        self._all_gone = asyncio.Event()
        self._schedule_tick()
        log.info(
            kv(
                "listening",
                url=self.url,
                bind=format_address(c.host, self.port),
                stun=self.stun_port or "off",
                stun_alt=self.stun_alt_port or "off",
                tls="pinned" if self.tls.pin else "certificate",
                access=access.mode,
                max_clients=c.max_clients,
                rate=c.rate or "unlimited",
                queue_bytes=c.queue_bytes,
                keepalive=c.keepalive,
            )
        )

    async def _listen(self) -> asyncio.Server:
        """Bind the TCP port without accepting yet (``start_serving`` follows)."""
        c = self.config
        assert self.tls is not None
        loop = asyncio.get_running_loop()
        host = c.host or None
        app_factory = lambda: _ClientConnection(self)  # noqa: E731
        small = tls_protocol_factory(
            app_factory,
            self.tls.context,
            handshake_timeout=c.auth_timeout,
            shutdown_timeout=c.drain_timeout * TLS_SHUTDOWN_SHARE,
        )
        try:
            if small is not None:
                return await loop.create_server(
                    small,
                    host,
                    c.port,
                    backlog=4096,
                    reuse_address=True,
                    start_serving=False,
                )
            return await loop.create_server(  # uvloop, or no usable SSLProtocol
                app_factory,
                host,
                c.port,
                ssl=self.tls.context,
                ssl_handshake_timeout=c.auth_timeout,
                ssl_shutdown_timeout=c.drain_timeout * TLS_SHUTDOWN_SHARE,
                backlog=4096,
                reuse_address=True,
                start_serving=False,
            )
        except OSError as exc:
            raise ConfigError(f"cannot listen on {c.host}:{c.port}: {exc}") from None

    @property
    def stun_ports(self) -> tuple[int, ...]:
        """The bound UDP observation ports (STUN first, then the alternate), as
        advertised in AUTH_OK; empty when STUN is off."""
        return tuple(p for p in (self.stun_port, self.stun_alt_port) if p)

    async def _bind_udp(self, metrics: Metrics, port: int) -> asyncio.DatagramTransport:
        loop = asyncio.get_running_loop()
        host = self.config.host or "0.0.0.0"
        transport, _ = await loop.create_datagram_endpoint(
            lambda: StunProtocol(metrics), local_addr=(host, port)
        )
        return transport

    async def _start_stun(self, metrics: Metrics) -> None:
        """Bind the STUN port and the alternate observation port (see RelayConfig)."""
        c = self.config
        port = c.effective_stun_port(self.port)
        if not port:
            return
        host = c.host or "0.0.0.0"
        try:
            self._stun = await self._bind_udp(metrics, port)
        except OSError as exc:
            raise ConfigError(
                f"cannot bind STUN port {host}:{port} (UDP): {exc}; pass --stun-port N or 0"
            ) from None
        self.stun_port = int(self._stun.get_extra_info("sockname")[1])
        alt, explicit = c.effective_stun_alt_port(self.stun_port)
        if not alt:
            if self.stun_port >= 65535 and c.stun_alt_port is None:
                log.warning(kv("stun_alt_port_unavailable", port=65536, error="out of range"))
            return
        try:
            self._stun_alt = await self._bind_udp(metrics, alt)
        except OSError as exc:
            if explicit:
                self._stun.close()
                raise ConfigError(
                    f"cannot bind STUN alternate port {host}:{alt} (UDP): {exc}; "
                    "pass --stun-alt-port N or 0"
                ) from None
            log.warning(
                kv(
                    "stun_alt_port_unavailable",
                    port=alt,
                    error=exc,
                    hint="clients cannot tell NAT mapping types; pass --stun-alt-port N",
                )
            )
            return
        self.stun_alt_port = int(self._stun_alt.get_extra_info("sockname")[1])

    def _schedule_tick(self) -> None:
        c = self.config
        interval = min(1.0, c.keepalive / 2, c.auth_timeout / 2)
        self._tick = asyncio.get_running_loop().call_later(interval, self._on_tick)

    def _on_tick(self) -> None:
        try:
            self.core.tick(asyncio.get_running_loop().time())
        except Exception:  # pragma: no cover - a bug must not stop the timeouts
            log.exception(kv("tick_failed"))
        if not self._closed:
            self._schedule_tick()

    def reload(self) -> None:
        """SIGHUP: re-read the allowlist and (certificate mode) the certificate files."""
        log.info(kv("reload"))
        self.core.access.reload(asyncio.get_running_loop().time())
        if self.tls is not None and self.tls.reload():
            self.core.set_cert_fingerprints(self.tls.fingerprints)

    def connection_gone(self, conn: _ClientConnection) -> None:
        """Called by a connection once it is lost."""
        self.connections.discard(conn)
        if not self.connections and self._all_gone is not None:
            self._all_gone.set()

    async def close(self) -> None:
        """Graceful shutdown: stop accepting, drop handshakes in progress, RECONNECT
        everyone, drain (bounded), close."""
        if self._closed:
            return
        self._closed = True
        if self._server is None:  # never started (or failed to)
            if self._own_tap is not None:
                self._own_tap.close()
            return
        log.info(kv("shutdown", connections=len(self.connections)))
        self._server.close()
        for conn in list(self.handshaking):
            conn.abort_handshake()
        if self._tick is not None:
            self._tick.cancel()
        for udp in (self._stun, self._stun_alt):
            if udp is not None:
                udp.close()
        if self._core is not None:
            self._core.shutdown()
        if self.connections and self._all_gone is not None:
            self._all_gone.clear()
            try:
                await asyncio.wait_for(self._all_gone.wait(), self.config.drain_timeout)
            except TimeoutError:
                if self.connections:  # not when the last one went just now
                    log.warning(kv("drain_timeout", left=len(self.connections)))
        for conn in list(self.connections):
            conn.abort()
        for _ in range(3):  # let connection_lost callbacks run
            await asyncio.sleep(0)
        if self._own_tap is not None:
            self._own_tap.close()
        log.info(kv("stopped"))

    async def __aenter__(self) -> RelayServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        clients = self._core.clients if self._core is not None else 0
        return f"RelayServer({self.url or 'not started'}, clients={clients})"
