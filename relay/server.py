"""asyncio glue: the TLS listener, the STUN port, the tick timer and graceful shutdown.

Everything that decides anything lives in :class:`relay.state.RelayCore`; this module
only moves bytes between sockets and the core and tells it the time.

Every connection is a :class:`~p2pdist.transport.securestream.SecureStream` (TLS, then
AES-GCM records once the client's upgrade offers them) with a
:class:`~relay.connection._ClientConnection` on top (:mod:`relay.connection`, which tells
how received bytes are handled in place and how each connection is seen from TCP up).
The receive buffers are the server's: ciphertext lands in one buffer per TLS listener
and plaintext in :attr:`RelayServer.scratch`, both shared by all connections, so an idle
client holds no receive buffer of its own. The server aborts connections still in their
TLS handshake when it shuts down (one that finished its handshake later would otherwise
be served by a core that no longer ticks).

File descriptors: the listen backlog is small (:data:`BACKLOG`), the server counts the
client sockets it holds and closes a new one at once when that count reaches its
budget (the ``RLIMIT_NOFILE`` soft limit less the descriptors already open, the
backlog and a reserve), so it never runs out of descriptors itself; and
:class:`AcceptErrorLimiter` collapses asyncio's ``socket.accept() out of system
resource`` errors (logged once per backlog slot per retry) into one line per
:data:`ACCEPT_ERROR_INTERVAL` should they happen anyway (another process, ENFILE).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import resource
import socket
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from p2pdist.transport.paths import bind_udp
from p2pdist.transport.securestream import SecureStream
from p2pdist.wire.relay import RelayUrl, relay_name

from .access import WEAK_TOKEN_CHARS, AccessPolicy, Allowlist, AllowlistError
from .addresses import format_address
from .config import ConfigError, RelayConfig
from .connection import NESTED_READ as NESTED_READ
from .connection import _ClientConnection as _ClientConnection
from .limits import Every
from .logfmt import kv
from .metrics import Metrics
from .state import CoreConfig, RelayCore
from .stun_server import StunProtocol
from .tap import FileTap, Tap
from .tlsconfig import RelayTls, load_or_create_key

__all__ = ["AcceptErrorLimiter", "RelayServer", "fd_budget"]

log = logging.getLogger(__name__)

CLOSE_GRACE = 5.0
"""A closed connection whose peer does not read is aborted after this many seconds
(during a graceful shutdown: after :data:`SHUTDOWN_GRACE_SHARE` of ``drain_timeout``)."""
SHUTDOWN_GRACE_SHARE = 0.8
"""During a graceful shutdown, the close grace as a share of ``drain_timeout``: shorter,
so a client that does not read is aborted before the drain gives up on it (which would
log a warning)."""
BACKLOG = 511
"""The listen backlog (at most; less under a low file descriptor limit, see
:func:`fd_budget`). asyncio accepts up to this many connections per wake-up."""
FD_RESERVE = 32
"""Descriptors kept free for everything but client sockets (files, STUN, the loop)."""
ACCEPT_ERROR = "socket.accept() out of system resource"
ACCEPT_ERROR_INTERVAL = 5.0
"""At most one log line per this many seconds for :data:`ACCEPT_ERROR`."""
FD_WARN_INTERVAL = 5.0

PROXY_CERT_GRACE = 3600.0
"""With an http-port, seconds after a reload during which AUTH bound to the previous
certificate is still accepted: the reverse proxy may serve it until its own reload."""
CERT_CHECK_INTERVAL = 5.0
"""Seconds between looks (a stat each) at the certificate files in certificate mode: a
renewed certificate is taken up within this, without a SIGHUP."""
SCRATCH_SIZE = 256 * 1024
"""The receive buffer all client connections share: plaintext handed over per read."""
TLS_SLACK = 256 * 1024
"""Bytes queued towards a client beyond ``queue_bytes`` (record and TLS overhead, the
core's control frames) before TLS's own answers to it end the connection: a client that
asks for key updates and reads nothing (SecureStream's ``backlog_limit``)."""
EARLY_TLS_RECORDS = 64
"""Most TLS records a client may send before its upgrade is settled (a real one sends its
request head in one or two): one byte per record made each byte a pass through the
relay's Python, a core's worth from one attacker before it even authenticated."""
SMALL_READS_PER_RECORD = 1024
"""Most socket reads under 1 KiB in a row without a whole record (TLS or AES-GCM): a
record sent a byte per TCP segment costs a pass of Python per byte (charged to the
rate only once the record completes, so a client could end its connection before);
the largest record in segments of 536 bytes, the least MSS, needs 123."""
CIPHER_SCRATCH_SIZE = 256 * 1024
"""Where every connection's ciphertext lands from the socket (each copies what it keeps
at once: TLS into its memory BIO, records into its record buffer)."""


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - no /proc
        return 0


def fd_budget(soft_limit: int, in_use: int) -> tuple[int, int | None]:
    """The listen backlog and the most client sockets to hold (None: no limit) under a
    ``RLIMIT_NOFILE`` soft limit with ``in_use`` descriptors already open: the
    descriptors asyncio may accept in one go (the backlog) and a reserve stay free."""
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return BACKLOG, None
    backlog = min(BACKLOG, max(8, soft_limit // 8))
    return backlog, max(1, soft_limit - in_use - backlog - FD_RESERVE)


class AcceptErrorLimiter:
    """A loop exception handler that logs :data:`ACCEPT_ERROR` at most once per
    ``interval`` seconds (with how many it left out) and passes every other context on
    to ``previous`` (None: the loop's default handler)."""

    def __init__(
        self,
        previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None,
        interval: float = ACCEPT_ERROR_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.previous = previous
        self._every = Every(interval, clock)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_ERROR:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        skipped = self._every.skipped
        if self._every():
            self._every.skipped = 0
            log.error(
                kv(
                    "accept_failed",
                    error=context.get("exception"),
                    repeats_left_out=skipped,
                    hint="out of file descriptors or memory; raise 'ulimit -n' "
                    "(LimitNOFILE=) or lower max-clients",
                )
            )


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
        self._http_server: asyncio.Server | None = None
        self._stun: list[asyncio.DatagramTransport] = []  # one per address of the host
        self._stun_alt: list[asyncio.DatagramTransport] = []
        self._tick: asyncio.TimerHandle | None = None
        self.cert_check_interval = CERT_CHECK_INTERVAL
        """Seconds between looks at the certificate files (certificate mode)."""
        self._cert_check_at = 0.0
        self._closed = False
        self.port = 0
        self.http_port = 0
        """The bound plain HTTP port, for a reverse proxy (0: none)."""
        self.stun_port = 0
        self.stun_alt_port = 0
        self.url = ""
        self.tls: RelayTls | None = None
        self._core: RelayCore | None = None
        self.scratch = bytearray(SCRATCH_SIZE)
        """Where every client connection receives (see the module docstring)."""
        self.sockets_open = 0
        """Client sockets held now (from TCP accept on asyncio's loop)."""
        self.socket_budget: int | None = None
        """The most client sockets held at once (None: no limit); see :func:`fd_budget`."""
        self._backlog = BACKLOG
        self._fd_warn = Every(FD_WARN_INTERVAL, time.monotonic)
        self._dropped_warn = Every(FD_WARN_INTERVAL, time.monotonic)
        self._accept_errors: AcceptErrorLimiter | None = None

    @property
    def closing(self) -> bool:
        """True once :meth:`close` has begun."""
        return self._closed

    @property
    def close_grace(self) -> float:
        """Seconds a closed connection may take to flush before it is aborted."""
        return self.config.drain_timeout * SHUTDOWN_GRACE_SHARE if self._closed else CLOSE_GRACE

    def take_socket(self, peer: str | None = None) -> bool:
        """Count a new client socket (from address ``peer``, when known). At the budget
        the oldest connection waiting to authenticate makes room if it has waited a
        second (it is dropped at once: its socket closes on the loop's next pass; see
        ``RelayCore.evict_for_socket``); else False, counted as refused."""
        if self.socket_budget is not None and self.sockets_open >= self.socket_budget:
            evicted = self.core.evict_for_socket(asyncio.get_running_loop().time(), peer)
            if isinstance(evicted, _ClientConnection):
                evicted.abort()  # its socket closes on the loop's next pass
                self.sockets_open += 1
                return True
            self.core.metrics.fd_limit_refused_total += 1
            if self._fd_warn():
                log.warning(
                    kv(
                        "fd_limit_reached",
                        sockets=self.sockets_open,
                        refused_since_last=self._fd_warn.skipped + 1,
                        hint="new connections are closed at once; raise 'ulimit -n'",
                    )
                )
                self._fd_warn.skipped = 0
            return False
        self.sockets_open += 1
        return True

    def client_dropped(self, event: str, client: str, why: str) -> None:
        """A connection's stream dropped its client for a limit of its own (see
        ``SecureStream.dropped_for``): a WARNING, at most one per 5 s (a flood of them
        must not flood the log), with how many were left out."""
        if self._dropped_warn():
            skipped = self._dropped_warn.skipped
            self._dropped_warn.skipped = 0
            log.warning(kv(event, client=client, error=why, others_since_last=skipped))

    def release_socket(self) -> None:
        """A counted client socket is gone."""
        self.sockets_open -= 1

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
        if c.token is not None and len(c.token) < WEAK_TOKEN_CHARS:
            log.warning(
                kv(
                    "token_weak",
                    chars=len(c.token),
                    hint=f"clients can try tokens online; use {WEAK_TOKEN_CHARS}+ random "
                    "characters: python3 -c 'import secrets; print(secrets.token_urlsafe(24))'",
                )
            )
        metrics = Metrics()
        if self.tap is None and c.tap is not None:
            try:
                self._own_tap = FileTap(c.tap)
            except OSError as exc:
                raise ConfigError(f"cannot open tap file {c.tap}: {exc}") from None
            self.tap = self._own_tap
            log.warning(kv("tap_enabled", path=c.tap, hint="debug only: records all traffic"))
        self._plan_descriptors()
        # Listen without accepting until the core exists: the core's AUTH_OK advertises
        # the observation ports, which are only known once they are bound.
        try:
            self._server = await self._listen()
        except ConfigError:
            if self._own_tap is not None:
                self._own_tap.close()
            raise
        self.port = _url_port(self._server.sockets, c.url_host())
        try:
            await self._start_stun(metrics)
            await self._listen_http()
        except ConfigError:
            self._server.close()
            self._server = None  # it never started: close() logs no shutdown
            self._close_stun()
            if self._own_tap is not None:
                self._own_tap.close()
            raise
        own = c.proxy_certs == "own"  # clients dial a proxy with certificates of its own
        public = RelayUrl(c.url_host(), c.public_port or self.port, None if own else self.tls.pin)
        core_cfg = CoreConfig(
            max_clients=c.max_clients,
            max_clients_per_ip=c.max_clients_per_ip,
            max_unauthenticated=c.max_unauthenticated,
            max_unauthenticated_per_ip=c.max_unauthenticated_per_ip,
            rate=c.rate,
            burst=c.bucket,
            queue_bytes=c.queue_bytes,
            keepalive=c.keepalive,
            auth_timeout=c.auth_timeout,
            retry_after=c.retry_after,
            read_size=SCRATCH_SIZE,
            stun_ports=self.stun_ports,
            proxy_hops=c.proxy_hops,
            proof_name=relay_name(public.host, public.port) if own else None,
        )
        self._core = RelayCore(core_cfg, self.tls.fingerprints, access, metrics)
        if self.tls.cert_path is not None:
            self._core.refresh_certificate = self.check_certificate_files
        await self._server.start_serving()
        if self._http_server is not None:
            await self._http_server.start_serving()
        self.url = str(public)
        self._check_url_host()
        self._all_gone = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._accept_errors = AcceptErrorLimiter(loop.get_exception_handler())
        loop.set_exception_handler(self._accept_errors)
        self._schedule_tick()
        log.info(
            kv(
                "listening",
                url=self.url,
                bind=_bind_addresses(self._server.sockets),
                stun=self.stun_port or "off",
                stun_alt=self.stun_alt_port or "off",
                http=format_address(c.http_host, self.http_port) if self.http_port else "off",
                tls="pinned" if self.tls.pin else "certificate",
                proxy_certs=c.proxy_certs if self.http_port else "-",
                # The URL above is the balancer's; direct clients of the TLS port pin this.
                pin=self.tls.pin if own and self.tls.pin else "-",
                access=access.mode,
                max_clients=c.max_clients,
                max_clients_per_ip=c.max_clients_per_ip or "unlimited",
                socket_budget=self.socket_budget or "unlimited",
                rate=c.rate or "unlimited",
                queue_bytes=c.queue_bytes,
                keepalive=c.keepalive,
            )
        )

    def _plan_descriptors(self) -> None:
        """Backlog and socket budget from the file descriptor limit; warns when the
        budget cannot hold max-clients plus the connections waiting to authenticate."""
        c = self.config
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._backlog, self.socket_budget = fd_budget(soft, _open_fds())
        waiting = c.max_clients if c.max_unauthenticated is None else c.max_unauthenticated
        if self.socket_budget is not None and self.socket_budget < c.max_clients + waiting:
            log.warning(
                kv(
                    "rlimit_nofile_low",
                    soft=soft,
                    hard=hard,
                    socket_budget=self.socket_budget,
                    max_clients=c.max_clients,
                    max_unauthenticated=waiting,
                    hint="beyond the budget idle connections are evicted or new ones "
                    "closed; raise 'ulimit -n' (LimitNOFILE=) or lower max-clients",
                )
            )

    async def _listen(self) -> asyncio.Server:
        """Bind the TCP port without accepting yet (``start_serving`` follows)."""
        c = self.config
        assert self.tls is not None
        host = c.host or None
        shared = memoryview(bytearray(CIPHER_SCRATCH_SIZE))

        def factory() -> SecureStream:
            assert self.tls is not None
            conn = _ClientConnection(self)
            conn.stream = SecureStream(
                conn,
                self.tls.context,  # the current one: a reload replaces it
                server_side=True,
                handshake_timeout=c.auth_timeout,
                scratch=shared,
                # the core keeps what it queues within queue_bytes; TLS's own answers
                # (key updates) to a client that reads nothing must not grow past it
                backlog_limit=c.queue_bytes + TLS_SLACK,
                early_records=EARLY_TLS_RECORDS,
                small_reads_per_record=SMALL_READS_PER_RECORD,
            )
            return conn.stream

        return await self._bind(factory, host, c.port, f"{c.host}:{c.port}")

    async def _bind(
        self, factory: Callable[[], asyncio.BaseProtocol], host: str | None, port: int, what: str
    ) -> asyncio.Server:
        """A listening TCP server for ``factory``, not accepting yet; ConfigError naming
        ``what`` when the port cannot be bound."""
        try:
            return await asyncio.get_running_loop().create_server(
                factory, host, port, backlog=self._backlog, reuse_address=True, start_serving=False
            )
        except OSError as exc:
            raise ConfigError(f"cannot listen on {what}: {exc}") from None

    async def _listen_http(self) -> None:
        """Bind the plain HTTP port for a reverse proxy, if configured (not accepting
        yet): connections there are proxied sessions, without TLS or records."""
        c = self.config
        if c.http_port is None:
            return
        self._http_server = await self._bind(
            lambda: _ClientConnection(self, proxied=True),
            c.http_host,
            c.http_port,
            f"{format_address(c.http_host, c.http_port)} (http-port)",
        )
        self.http_port = int(self._http_server.sockets[0].getsockname()[1])

    @property
    def stun_ports(self) -> tuple[int, ...]:
        """The bound UDP observation ports (STUN first, then the alternate), as
        advertised in AUTH_OK; empty when STUN is off."""
        return tuple(p for p in (self.stun_port, self.stun_alt_port) if p)

    async def _bind_udp(self, metrics: Metrics, port: int) -> list[asyncio.DatagramTransport]:
        """An observation port on the TCP listener's addresses, the same port on each:
        ``--host ""`` (both families) binds one dual-stack socket, so IPv6 clients learn
        their address too; a name binds every address it resolves to (``localhost``:
        127.0.0.1 and ::1), an IPv6 one for IPv6 only, as the TCP listener does."""
        loop = asyncio.get_running_loop()
        host = self.config.host
        if not host:
            socks = [_dual_stack_udp(port)]
        else:
            infos = await loop.getaddrinfo(
                host, port, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE
            )
            socks = []
            try:
                for family, _, _, _, addr in dict.fromkeys(infos):
                    sock, _ = bind_udp(family, (addr[0], port, *addr[2:]), dual_stack=False)
                    socks.append(sock)
            except OSError:
                for sock in socks:
                    sock.close()
                raise
        transports: list[asyncio.DatagramTransport] = []
        for sock in socks:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: StunProtocol(metrics), sock=sock
            )
            transports.append(transport)
        return transports

    async def _start_stun(self, metrics: Metrics) -> None:
        """Bind the STUN port and the alternate observation port (see RelayConfig)."""
        c = self.config
        port = c.effective_stun_port(self.port)
        if not port:
            return
        host = c.host or "[::]"
        try:
            self._stun = await self._bind_udp(metrics, port)
        except OSError as exc:
            raise ConfigError(
                f"cannot bind STUN port {host}:{port} (UDP): {exc}; pass --stun-port N or 0"
            ) from None
        self.stun_port = int(self._stun[0].get_extra_info("sockname")[1])
        alt, explicit = c.effective_stun_alt_port(self.stun_port)
        if not alt:
            if self.stun_port >= 65535 and c.stun_alt_port is None:
                log.warning(kv("stun_alt_port_unavailable", port=65536, error="out of range"))
            return
        try:
            self._stun_alt = await self._bind_udp(metrics, alt)
        except OSError as exc:
            if explicit:
                self._close_stun()
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
        self.stun_alt_port = int(self._stun_alt[0].get_extra_info("sockname")[1])

    def _close_stun(self) -> None:
        """Close the observation ports' sockets (every address's)."""
        for udp in (*self._stun, *self._stun_alt):
            udp.close()

    def _schedule_tick(self) -> None:
        c = self.config
        interval = min(1.0, c.keepalive / 2, c.auth_timeout / 2)
        self._tick = asyncio.get_running_loop().call_later(interval, self._on_tick)

    def _on_tick(self) -> None:
        now = asyncio.get_running_loop().time()
        try:
            self.core.tick(now)
        except Exception:  # pragma: no cover - a bug must not stop the timeouts
            log.exception(kv("tick_failed"))
        try:
            if now >= self._cert_check_at:
                self._cert_check_at = now + self.cert_check_interval
                self.check_certificate_files(now)
        except Exception:  # pragma: no cover - nor the certificate checks
            log.exception(kv("certificate_check_failed"))
        if not self._closed:
            self._schedule_tick()

    def reload(self) -> None:
        """SIGHUP: re-read the allowlist and (certificate mode) the certificate files."""
        log.info(kv("reload"))
        now = asyncio.get_running_loop().time()
        self.core.access.reload(now)
        self._reload_certificate(now)

    def check_certificate_files(self, now: float) -> bool:
        """Certificate mode: reload the files if they changed (a renewal by certbot,
        Caddy, a cron job); True when the certificate did. The core also asks right
        before it refuses a proof as a bad signature (at most once a second), so a
        client of a proxy that renewed first is not refused for the poll's delay."""
        if self.tls is None or not self.tls.files_changed():
            return False
        log.info(kv("certificate_files_changed", path=self.tls.cert_path))
        return self._reload_certificate(now)

    def _reload_certificate(self, now: float) -> bool:
        """Re-read the certificate files (certificate mode); when the certificate changed,
        AUTH binds to the new one (and, for a grace, to the old one); True then."""
        if self.tls is None or not self.tls.reload():
            return False
        # The old certificate's fingerprint only for connections that handshook with it:
        # a handshake (up to auth_timeout), then AUTH (auth_timeout again); behind a
        # reverse proxy, also for as long as the proxy may go on serving it.
        self.core.set_cert_fingerprints(
            (self.tls.fingerprint,), self.tls.previous, now + self.previous_cert_grace
        )
        self._check_url_host()  # a renewal may have dropped the name
        return True

    def _check_url_host(self) -> None:
        """Warn when the certificate does not name the URL's host (clients refuse it);
        not with proxy-certs own, where the proxy's certificate is the one they see."""
        c = self.config
        if self.tls is None or c.proxy_certs == "own" or self.tls.covers(c.url_host()):
            return
        log.warning(
            kv(
                "url_host_not_in_certificate",
                host=c.url_host(),
                names=",".join(self.tls.names) or "none",
                hint="clients will refuse the certificate; set public-host to one of names",
            )
        )

    @property
    def previous_cert_grace(self) -> float:
        """Seconds after a certificate reload during which AUTH bound to the previous
        certificate is still accepted: 2 x auth-timeout, or with an http-port
        :data:`PROXY_CERT_GRACE` (the proxy in front reloads on its own schedule)."""
        if self.config.http_port is not None:
            return max(PROXY_CERT_GRACE, 2 * self.config.auth_timeout)
        return 2 * self.config.auth_timeout

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
        log.info(kv("shutdown", connections=len(self.connections) + len(self.handshaking)))
        self._server.close()
        if self._http_server is not None:
            self._http_server.close()
        for conn in list(self.handshaking):
            conn.abort_handshake()
        if self._tick is not None:
            self._tick.cancel()
        self._close_stun()
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
        loop = asyncio.get_running_loop()
        if self._accept_errors is not None and loop.get_exception_handler() is self._accept_errors:
            loop.set_exception_handler(self._accept_errors.previous)
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


def _url_port(sockets: Sequence[Any], url_host: str) -> int:
    """The port to print in the URL: that of the listening socket of the URL host's
    address family (``--host ""`` listens on IPv4 and IPv6, and with ``--port 0`` each
    family gets a port of its own)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(url_host).version == 6 else socket.AF_INET
    except ValueError:  # a host name: clients mostly reach IPv4
        family = socket.AF_INET
    for sock in sockets:
        if sock.family == family:
            return int(sock.getsockname()[1])
    return int(sockets[0].getsockname()[1])


def _bind_addresses(sockets: Sequence[Any]) -> str:
    """Every listening socket's address, comma-separated, for the ``listening`` line
    (``--host ""`` with ``--port 0`` gives each family a port of its own:
    ``0.0.0.0:37151,[::]:46005``)."""
    return ",".join(format_address(*sock.getsockname()[:2]) for sock in sockets)


def _dual_stack_udp(port: int) -> socket.socket:
    """A non-blocking UDP socket on ``port`` of every address of both families (``::``
    with IPV6_V6ONLY off), or of every IPv4 address where the host cannot do that."""
    try:
        sock, dual = bind_udp(socket.AF_INET6, ("::", port))
    except OSError as exc:  # IPv6 off in this kernel or container
        log.info(kv("stun_ipv4_only", port=port, error=exc))
    else:
        if dual:
            return sock
        sock.close()  # IPv6 only (OpenBSD): IPv4 clients would go unanswered
        log.info(kv("stun_ipv4_only", port=port, error="IPV6_V6ONLY cannot be cleared"))
    return bind_udp(socket.AF_INET, ("0.0.0.0", port))[0]
