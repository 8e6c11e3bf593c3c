"""The relay's sans-I/O core: authentication, the client registry, routing and limits.

:class:`RelayCore` is fed events by the asyncio glue (:mod:`relay.server`), always with
the current monotonic time: :meth:`~RelayCore.open`, :meth:`~RelayCore.receive`,
:meth:`~RelayCore.lost`, :meth:`~RelayCore.tick` and :meth:`~RelayCore.shutdown`. It
answers through each session's :class:`~relay.session.Link`. It never sleeps, never
awaits and never reads a clock, so tests move time by hand.

Input is parsed in place: :meth:`RelayCore.receive` may be given a view of a buffer
that the glue reuses as soon as the call returns (one scratch buffer for all
connections), so nothing here keeps a view of it: a frame's bytes that must outlive the
call are copied (a forwarded datagram exactly once, into the destination's batch; an
incomplete trailing frame into the session's :class:`~p2pdist.wire.relay.RelayFrameSplitter`).

Writes produced while handling one chunk of input are batched per destination in one
bytearray and handed to the links once, at the end of the call (fewer TLS records and
syscalls when a client sends many small datagrams at once).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from p2pdist.errors import UsageError
from p2pdist.identity import ID_LEN, EndpointId
from p2pdist.wire.relay import (
    BAD_SIGNATURE_TEXT,
    FRAME_HEADER,
    MALFORMED_AUTH_TEXT,
    MAX_BODY,
    MAX_DATAGRAM,
    PING_LEN,
    VERSION,
    RelayFrameType,
    RelayProtocolError,
    append_addressed,
    auth_message,
    encode_frame,
    encode_map,
    parse_http_head,
    upgrade_response,
)
from p2pdist.wire.websocket import Opcode, WebSocketError, WebSocketReader, echo_code
from p2pdist.wire.websocket import frame as ws_frame
from p2pdist.wire.websocket import header as ws_header

from .access import AccessPolicy, Refusal
from .config import MAX_TOKEN_BYTES
from .http import response, route
from .limits import TokenBucket
from .logfmt import kv
from .metrics import Metrics
from .session import Link, Phase, Session

__all__ = ["CoreConfig", "RelayCore"]

log = logging.getLogger(__name__)

SIG_LEN = 64
MAX_AUTH_BODY = ID_LEN + SIG_LEN + MAX_TOKEN_BYTES
"""The largest valid AUTH body; a longer frame before authentication is refused from
its header alone, so an unauthenticated connection never buffers more than this."""
REPLACED = "replaced by a newer connection from the same endpoint"
REFRESH_EVERY = 1.0
"""Seconds between looks at the certificate files that a bad signature may cause."""
MAX_PREVIOUS_CERTS = 4
"""Certificates served before reloads that AUTH may still name during their grace; the
ones that expire soonest give way first (each one costs a signature check on a bad
proof)."""
WS_BEFORE_AUTH = MAX_AUTH_BODY + 1024
"""The most WebSocket bytes a client may send before it is authenticated: one AUTH
frame and framing around it (a session that may still send nothing else must not
make the relay work for free)."""

BAD_SIGNATURE = Refusal("bad_signature", BAD_SIGNATURE_TEXT)
MALFORMED = Refusal("malformed", MALFORMED_AUTH_TEXT)
RELAY_FULL = Refusal("relay_full", "relay full")
PER_IP_FULL = Refusal("max_clients_per_ip", "too many clients from this address")
AUTH_TIMEOUT = Refusal("timeout", "authentication timed out")
SHUTTING_DOWN = Refusal("shutting_down", "relay shutting down")
EVICTED = "evicted: too many connections waiting to authenticate"
REFUSED = "too many connections waiting to authenticate; retry later"
EVICT_AFTER = 1.0
"""Seconds a connection must have waited to authenticate before a newer one may evict
it. A real client needs a round trip or two, so an older one is most likely idle (a
flood churns itself). When the cap is full of younger connections, newcomers are
refused instead: evicting the oldest then would close every connection just before it
authenticates, and a reconnect storm larger than the cap would never get through."""


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """The limits the core enforces (sizes in bytes, times in seconds)."""

    max_clients: int = 4096
    rate: int = 0
    burst: int = 1 << 20
    queue_bytes: int = 1 << 20
    keepalive: float = 15.0
    auth_timeout: float = 10.0
    retry_after: float = 1.0
    max_unauthenticated: int | None = None
    """Most connections in the TLS, HTTP or AUTH phase at once (None: ``max_clients``). Over
    the cap the oldest one still waiting is closed if it has waited :data:`EVICT_AFTER`
    (``evicted_total{reason="max_unauthenticated"}``), else the newcomer gets 503
    (``refused_total``)."""
    max_unauthenticated_per_ip: int = 64
    """Most of those from one source address (an IPv4 address, an IPv6 /64); over it
    the same rule among that source's connections
    (``evicted_total`` / ``refused_total{reason="max_unauthenticated_per_ip"}``)."""
    max_clients_per_ip: int = 0
    """Most authenticated clients from one source address (as above); 0: no cap. Over
    it AUTH is refused (``auth_failures_total{reason="max_clients_per_ip"}``)."""
    stun_ports: tuple[int, ...] = ()
    """Bound UDP observation ports (STUN, then the alternate), advertised in AUTH_OK."""
    proxy_hops: int = 1
    """Proxied sessions: the ``X-Forwarded-For`` entry this many from the end is the
    client's address (one per reverse proxy of ours in a row; at least 1)."""

    def __post_init__(self) -> None:
        if self.proxy_hops < 1:
            raise ValueError(f"proxy_hops must be at least 1, got {self.proxy_hops}")


def _closed(s: Session) -> bool:
    # A function, so type checkers do not narrow ``s.phase`` across calls that change it.
    return s.phase is Phase.CLOSED


def unmap_ipv4(ip: str) -> str:
    """``::ffff:192.0.2.1`` (an IPv4 client of a dual-stack socket) -> ``192.0.2.1``."""
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def source_of(ip: str) -> str:
    """The source a waiting connection counts against: an IPv4 address, or the /64 of
    an IPv6 one (one host usually gets a whole /64). Unparsable strings stand alone."""
    ip = unmap_ipv4(ip)
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if addr.version == 6:
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


def forwarded_ip(header: str, hops: int = 1) -> str | None:
    """The address in the ``hops``-th entry from the end of an ``X-Forwarded-For``
    value (the last by default: the one the proxy next to us added; each further proxy
    of ours in a row adds one), as ``ip``, ``ip:port``, ``[v6]`` or ``[v6]:port``,
    IPv4-mapped shown as IPv4; None without a valid one there (also when the header
    has fewer entries: a proxy of ours did not append)."""
    if hops < 1:  # entries[-0] would be the first: the client's own word
        raise ValueError(f"hops must be at least 1, got {hops}")
    entries = header.split(",")  # bounded: the whole request head is
    if len(entries) < hops:
        return None
    last = entries[-hops].strip()
    if last.startswith("["):
        inside, bracket, port = last[1:].partition("]")
        if not bracket or (port and not (port[0] == ":" and port[1:].isdigit())):
            return None
        last = inside
    elif last.count(":") == 1:
        last, _, port = last.partition(":")
        if not port.isdigit():
            return None
    if "%" in last:  # a zone id names an interface of the proxy's host, not a client
        return None
    try:
        addr = ipaddress.ip_address(last)
    except ValueError:
        return None
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return str(mapped or addr)


def _ws_close_code(event: str) -> bytes:
    """The WebSocket close code (RFC 6455 7.4.1) the relay sends when it ends a session
    for ``event``: 1002 for a protocol error, 1001 when it is going away (shutdown,
    replaced, timed out), 1008 for a refusal, else 1000."""
    if event == "protocol_error":
        code = 1002
    elif event in ("reconnect_sent", "closed_for_shutdown", "keepalive_timeout", "replaced"):
        code = 1001
    elif event in ("auth_failed", "evicted", "refused"):
        code = 1008
    else:
        code = 1000
    return code.to_bytes(2, "big")


def format_address(ip: str, port: int) -> str:
    """``ip:port``, ``[v6]:port``; IPv4-mapped IPv6 addresses are shown as IPv4."""
    ip = unmap_ipv4(ip)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class RelayCore:
    """Sessions, the registry of authenticated clients, and what to do with each frame."""

    def __init__(
        self,
        config: CoreConfig,
        cert_fingerprints: Iterable[bytes],
        access: AccessPolicy | None = None,
        metrics: Metrics | None = None,
        random_bytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        self.access = access if access is not None else AccessPolicy()
        self._fingerprints: tuple[bytes, ...] = ()
        self._previous: dict[bytes, float] = {}
        """Fingerprints served before a reload -> until when AUTH may still name them."""
        self.set_cert_fingerprints(cert_fingerprints)
        self._random = random_bytes
        self._sessions: set[Session] = set()
        self._clients: dict[bytes, Session] = {}
        self._waiting: dict[Session, str | None] = {}
        """Sessions in the TLS, HTTP or AUTH phase, oldest first, with the source they
        count against (None: proxied, no per-source cap)."""
        self._waiting_by_source: dict[str, dict[Session, None]] = {}
        """The same, per source (oldest first); no empty entries."""
        self._clients_by_source: dict[str, int] = {}
        """Authenticated clients per source; no zero entries."""
        self._buckets: dict[bytes, TokenBucket] = {}
        """Token buckets of ids whose session is gone, kept until they are full again
        (at most ``max_clients``), so reconnecting does not refill a bucket."""
        self._dirty: list[Session] = []
        self._warned_forwarded = False
        self.refresh_certificate: Callable[[float], bool] | None = None
        """Set by the glue in certificate mode: reloads changed certificate files (and
        calls :meth:`set_cert_fingerprints`), True when the certificate changed."""
        self._refreshed_at = -REFRESH_EVERY
        self._next_id = 0
        self._closing = False

    # ---- queries ----------------------------------------------------------------------

    @property
    def clients(self) -> int:
        """Authenticated clients now."""
        return len(self._clients)

    @property
    def connections(self) -> int:
        """Open sessions in any phase."""
        return len(self._sessions)

    def client(self, endpoint: EndpointId | bytes) -> Session | None:
        """The active session of ``endpoint``, if connected."""
        return self._clients.get(bytes(endpoint))

    @property
    def unauthenticated(self) -> int:
        """Open sessions still in the TLS handshake, the HTTP or the AUTH phase."""
        return len(self._waiting)

    @property
    def max_unauthenticated(self) -> int:
        """The cap on :attr:`unauthenticated` (``max_clients`` unless configured)."""
        c = self.config
        return c.max_clients if c.max_unauthenticated is None else c.max_unauthenticated

    def metrics_text(self) -> str:
        """The Prometheus page."""
        return self.metrics.render(
            clients=self.clients,
            connections=self.connections,
            unauthenticated=self.unauthenticated,
        )

    def set_cert_fingerprints(
        self,
        fingerprints: Iterable[bytes],
        previous: Iterable[bytes] = (),
        previous_until: float = 0.0,
    ) -> None:
        """SHA-256 of the certificate(s) clients see now and, after a certificate
        reload, of the one(s) served before it: those are accepted in AUTH only until
        ``previous_until`` (monotonic time; enough for a connection that handshook with
        the old certificate to authenticate), never after. Certificates retired by
        earlier reloads keep their own deadlines (two quick reloads do not cut the
        first one's grace short), up to :data:`MAX_PREVIOUS_CERTS` of them."""
        fps, old = tuple(fingerprints), tuple(previous)
        if not fps or any(len(f) != 32 for f in fps + old):
            raise ValueError("need at least one 32-byte certificate fingerprint")
        kept = {fp: until for fp, until in self._previous.items() if fp not in fps}
        for fp in old:
            if fp not in fps:
                kept[fp] = max(kept.get(fp, previous_until), previous_until)
        newest = sorted(kept, key=kept.__getitem__)[-MAX_PREVIOUS_CERTS:]
        self._fingerprints = fps
        self._previous = {fp: kept[fp] for fp in newest}

    def cert_fingerprints(self, now: float) -> tuple[bytes, ...]:
        """The fingerprints an AUTH may be bound to at ``now``: the current ones first."""
        if not self._previous:
            return self._fingerprints
        return self._fingerprints + tuple(fp for fp, until in self._previous.items() if now < until)

    # ---- events from the glue ---------------------------------------------------------

    def open(
        self,
        link: Link,
        peer: tuple[str, int],
        now: float,
        *,
        handshaking: bool = False,
        proxied: bool = False,
    ) -> Session:
        """A connection was accepted from ``peer``: a TLS connection, or with
        ``handshaking`` a TCP connection whose TLS handshake has only begun (then call
        :meth:`handshake_done` once it completes; until then it counts against the caps
        below like any connection waiting to authenticate, and is closed without an
        answer when refused or evicted). Once the relay is shutting down the session is
        answered 503 and closed at once (it is returned CLOSED).

        Otherwise, when ``max_unauthenticated`` connections (or
        ``max_unauthenticated_per_ip`` from the same source) are already waiting to
        authenticate, the oldest of them is closed to make room if it has waited
        :data:`EVICT_AFTER`, else the new one is answered 503 (see :meth:`_admit`). A
        real client needs a round trip or two, so a flood of idle connections churns
        itself instead of locking clients (and /health, /metrics) out, and a reconnect
        storm larger than the cap still gets through.

        ``proxied``: a connection to the plain HTTP port, from the TLS-terminating
        reverse proxy in front of the relay. Every such connection comes from the proxy,
        so the per-source cap on waiting connections does not apply to it (the proxy's
        own limits do); its source and observed address are taken from the proxy's
        ``X-Forwarded-For`` once the request head is read."""
        self._next_id += 1
        s = Session(self._next_id, link, format_address(*peer), now)
        s.source = source_of(peer[0])
        s.proxied = proxied
        if handshaking:
            s.phase = Phase.TLS
        s.splitter.max_body = MAX_AUTH_BODY  # refused from the header, never buffered
        self._sessions.add(s)
        self.metrics.connections_total += 1
        log.debug(kv("connect", conn=s.label, peer=s.observed))
        if self._closing:
            self.metrics.auth_failures[SHUTTING_DOWN.reason] += 1
            if s.phase is not Phase.TLS:
                self._queue(s, response(503, f"{SHUTTING_DOWN.message}\n"))
            self._close(s, "closed_for_shutdown", quiet=True)
        else:
            self._admit(s, None if proxied else s.source, now)
        return s

    def handshake_done(self, s: Session, now: float) -> None:
        """The TLS handshake of a session opened with ``handshaking`` completed: the
        HTTP phase begins, and ``auth_timeout`` starts again from ``now``."""
        if s.phase is Phase.TLS:
            s.phase = Phase.HTTP
            s.ready_at = now
            s.last_heard = now

    def _admit(self, s: Session, source: str | None, now: float) -> None:
        """Count ``s`` as waiting (against its ``source``'s cap too, unless None). Over
        a cap, the oldest waiting connection makes room if it has waited
        :data:`EVICT_AFTER`; otherwise ``s`` itself is refused (503)."""
        if source is not None and not self._source_room(s, source, now):
            return
        if not self._room(s, self._waiting, self.max_unauthenticated, "max_unauthenticated", now):
            return
        self._waiting[s] = None
        if source is not None:
            self._count_source(s, source)

    def _room(
        self,
        s: Session,
        waiting: dict[Session, Any] | None,
        cap: int,
        reason: str,
        now: float,
    ) -> bool:
        """Make room for ``s`` among ``waiting`` (oldest first) under ``cap``: evict the
        oldest while it has waited :data:`EVICT_AFTER`; else refuse ``s`` (False)."""
        while waiting and len(waiting) >= cap:
            oldest = next(iter(waiting))
            if now - oldest.opened_at < EVICT_AFTER:
                self._refuse_storm(s, reason)
                return False
            self._evict(oldest, reason, now)
        return True

    def _source_room(self, s: Session, source: str, now: float) -> bool:
        """:meth:`_room` under ``max_unauthenticated_per_ip`` among ``source``'s."""
        return self._room(
            s,
            self._waiting_by_source.get(source),
            self.config.max_unauthenticated_per_ip,
            "max_unauthenticated_per_ip",
            now,
        )

    def _count_source(self, s: Session, source: str) -> None:
        """``s`` (already waiting) counts against ``source``'s cap, in its place by age
        among that source's (a proxied session learns its source after others came)."""
        self._waiting[s] = source  # an existing key: its place is kept
        mine = self._waiting_by_source.setdefault(source, {})
        mine[s] = None
        if any(other.opened_at > s.opened_at for other in mine):
            self._waiting_by_source[source] = dict.fromkeys(sorted(mine, key=lambda w: w.opened_at))

    def evict_for_socket(self, now: float) -> Link | None:
        """The socket budget is spent and a new connection came: forget the oldest
        connection still waiting to authenticate if it has waited :data:`EVICT_AFTER`, as
        the caps on waiting connections do, so that idle sockets cannot lock real clients
        out when the budget is smaller than those caps. Returns its link, for the caller
        to drop at once (what :meth:`_evict` queued for it is not flushed: its socket must
        go now, not after a close grace, or a flood could push the relay past its
        descriptors); None: no room."""
        oldest = next(iter(self._waiting), None)
        if oldest is None or now - oldest.opened_at < EVICT_AFTER:
            return None
        self._evict(oldest, "socket_budget", now)
        return oldest.link

    def _refuse_storm(self, s: Session, reason: str) -> None:
        """Turn ``s`` away (503; still in its TLS handshake: closed at once): the cap
        ``reason`` is full of connections younger than :data:`EVICT_AFTER`, which are
        likely real clients about to authenticate."""
        self.metrics.refused[reason] += 1
        if s.phase is not Phase.TLS:
            self._queue(s, response(503, f"{REFUSED}\n"))
        self._close(s, "refused", quiet=True, fields={"reason": reason})

    def _evict(self, s: Session, reason: str, now: float) -> None:
        """Close a waiting connection to make room: at once in its TLS handshake, 503
        before the upgrade, ERROR after."""
        self.metrics.evicted[reason] += 1
        fields: dict[str, object] = {"reason": reason, "after": now - s.opened_at}
        if s.phase is Phase.TLS:
            self._close(s, "evicted", quiet=True, fields=fields)
        elif s.phase is Phase.HTTP:
            self._queue(s, response(503, f"{EVICTED}\n"))
            self._close(s, "evicted", quiet=True, fields=fields)
        else:
            self._close(s, "evicted", error=EVICTED, quiet=True, fields=fields)

    def receive(self, s: Session, data: bytes | bytearray | memoryview, now: float) -> None:
        """Bytes arrived from ``s``'s client. ``data`` is only read during the call (it
        may be a view of a buffer that is reused right after)."""
        if s.phase is Phase.CLOSED:
            return
        if s.phase is Phase.TLS:  # a glue that did not say so: bytes mean it is done
            self.handshake_done(s, now)
        s.last_heard = now
        self.metrics.bytes_in_total += memoryview(data).nbytes
        try:
            if s.phase is Phase.HTTP:
                data = self._http(s, data, now)
                if not data:
                    return
            if s.websocket is None:
                self._frames(s, data, now)
            else:
                self._websocket(s, s.websocket, data, now)
        except (RelayProtocolError, WebSocketError) as exc:
            self.metrics.protocol_errors_total += 1
            before = "" if s.phase is Phase.ACTIVE else " before AUTH"
            self._close(s, "protocol_error", error=f"{exc}{before}")
        finally:
            self.flush()

    def lost(self, s: Session, now: float) -> None:
        """The connection of ``s`` is gone (EOF, reset, or after our close)."""
        if s.phase is not Phase.CLOSED:
            level = logging.INFO if s.phase is Phase.ACTIVE else logging.DEBUG
            log.log(level, kv("disconnect", conn=s.label, after=now - s.opened_at))
            self._forget(s)
        self._sessions.discard(s)

    def eof(self, s: Session, now: float) -> None:
        """The client of ``s`` half-closed its connection (TLS close_notify or TCP FIN):
        it is gone for routing at once (peers get PEER_GONE), and its link is closed
        like any connection the relay closes (flushed, then aborted after a grace),
        even if bytes are still queued towards it."""
        fields: dict[str, object] = {"after": now - s.opened_at, "eof": True}
        self._close(s, "disconnect", quiet=s.phase is not Phase.ACTIVE, fields=fields)

    def tick(self, now: float) -> None:
        """Enforce the auth timeout and keepalive silence, and forget limiter state that
        has run out; call about once a second."""
        silence = 3 * self.config.keepalive
        for s in list(self._sessions):
            if s.phase is Phase.ACTIVE:
                s.peer_gone.prune(now)
                if now - s.last_heard > silence:
                    self.metrics.keepalive_timeouts_total += 1
                    self._close(
                        s, "keepalive_timeout", error=f"no traffic for {now - s.last_heard:.1f} s"
                    )
            elif s.phase is Phase.TLS:
                if now - s.opened_at > self.config.auth_timeout:
                    self._close(s, "tls_timeout", quiet=True)
            elif s.phase is not Phase.CLOSED and now - s.ready_at > self.config.auth_timeout:
                if s.phase is Phase.AUTH:
                    self._refuse(s, AUTH_TIMEOUT)
                else:
                    self._close(s, "http_timeout", quiet=True)
        if self._buckets:
            self._buckets = {k: b for k, b in self._buckets.items() if b.full_at() > now}
        if self._previous:
            self._previous = {fp: t for fp, t in self._previous.items() if now < t}
        self.flush()

    def shutdown(self, reason: str = "relay shutting down") -> None:
        """Send RECONNECT to every authenticated client and close every connection."""
        self._closing = True
        body = encode_map({"reason": reason, "retry_after": float(self.config.retry_after)})
        frame = encode_frame(RelayFrameType.RECONNECT, body)
        log.info(kv("reconnect_all", clients=len(self._clients), connections=len(self._sessions)))
        for s in list(self._sessions):
            if s.phase is Phase.ACTIVE:
                self._close(s, "reconnect_sent", frame=frame, quiet=True)
            elif s.phase is not Phase.CLOSED:
                self._close(s, "closed_for_shutdown", quiet=True)

    def flush(self) -> None:
        """Hand the batched frames to their links."""
        dirty, self._dirty = self._dirty, []
        for s in dirty:
            self._write_batch(s)

    # ---- HTTP phase -------------------------------------------------------------------

    def _http(self, s: Session, data: bytes | bytearray | memoryview, now: float) -> bytes:
        """Consume the request head; returns bytes that follow a completed upgrade."""
        s.http_buf += data
        try:
            parsed = parse_http_head(s.http_buf)
        except RelayProtocolError as exc:
            self.metrics.http_requests_total += 1
            self._queue(s, response(400, f"{exc}\n"))
            self._close(s, "bad_http", quiet=True, fields={"why": str(exc)[:80]})
            return b""
        if parsed is None:
            return b""
        head, used = parsed
        rest = bytes(s.http_buf[used:])
        s.http_buf = bytearray()
        decision = route(head, self.metrics_text)
        if not decision.upgrade:
            self.metrics.http_requests_total += 1
            self._queue(s, decision.response)
            path = head.start_line[1][:64] if len(head.start_line) > 1 else ""
            self._close(s, "http", quiet=True, fields={"status": decision.status, "path": path})
            return b""
        offer = None if s.proxied else decision.records  # through a proxy: WebSocket frames
        if offer is not None and rest:  # records start right after the request head
            self.metrics.http_requests_total += 1
            self._queue(s, response(400, "data after an upgrade request that offers records\n"))
            self._close(s, "bad_http", quiet=True, fields={"why": "data after records offer"})
            return b""
        if s.proxied:
            self._forwarded(s, head.header("x-forwarded-for"), now)
            if _closed(s):  # over the cap on waiting connections from that address
                return b""
        s.phase = Phase.AUTH
        s.challenge = self._random(32)
        key = decision.websocket_key
        if offer is None:
            self._queue(s, decision.response)
            self._write_batch(s)  # the 101 is the last the client gets outside its frames
            s.link.secure(None)
            if key is not None:
                self.metrics.websocket_upgrades_total += 1
                s.websocket = WebSocketReader(masked=True)
        else:
            mine = self._random(32)
            self._queue(s, upgrade_response(mine, websocket_key=key))
            self._write_batch(s)  # the 101 is the last the client gets in TLS
            s.link.secure((mine, offer))
        self._queue(s, encode_frame(RelayFrameType.CHALLENGE, bytes([VERSION]) + s.challenge))
        return rest

    def _forwarded(self, s: Session, header: str, now: float) -> None:
        """A proxied client's address: the last ``X-Forwarded-For`` entry, the one the
        proxy in front of us added (earlier ones are the client's word; with
        ``proxy_hops`` proxies of ours in a row, the one that many from the end), as an
        ip, or ``ip:port`` / ``[v6]:port`` as some proxies write it. With one, the session
        counts against that address's cap on waiting connections from now on (it may be
        refused, or evict an older one, as at accept). Without a valid one it keeps the
        proxy's address and no per-source cap (warned about once: the proxy should
        send the header)."""
        ip = forwarded_ip(header, self.config.proxy_hops)
        if ip is None:
            if not self._warned_forwarded:
                self._warned_forwarded = True
                log.warning(
                    kv(
                        "no_forwarded_address",
                        conn=s.label,
                        header=header[:80] or "missing",
                        proxy_hops=self.config.proxy_hops,
                        hint="every reverse proxy in front (proxy-hops of them) must append "
                        "to X-Forwarded-For; else per-address caps cannot tell its clients "
                        "apart",
                    )
                )
            return
        s.observed = ip
        s.source = source_of(ip)
        if self._source_room(s, s.source, now):
            self._count_source(s, s.source)

    # ---- frames -----------------------------------------------------------------------

    def _frames(self, s: Session, data: bytes | bytearray | memoryview, now: float) -> None:
        for kind, body in s.splitter.frames(data):
            self._frame(s, kind, body, now)
            if _closed(s):
                break

    def _websocket(
        self, s: Session, reader: WebSocketReader, data: bytes | bytearray | memoryview, now: float
    ) -> None:
        """Relay frames carried in WebSocket frames: data to :meth:`_frames`; PINGs get
        one PONG per read (the last one's bytes, as RFC 6455 5.5.3 allows), a CLOSE ends
        the session. Before AUTH_OK a client may send at most :data:`WS_BEFORE_AUTH`
        bytes, as a bare session may send one AUTH frame and nothing else."""
        if s.phase is not Phase.ACTIVE:
            s.ws_before_auth += memoryview(data).nbytes
            if s.ws_before_auth > WS_BEFORE_AUTH:
                raise RelayProtocolError(f"more than {WS_BEFORE_AUTH} WebSocket bytes")
        pong: bytes | bytearray | None = None
        for event in reader.feed(data):
            if event.opcode is Opcode.BINARY:
                self._frames(s, event.payload, now)
            elif event.opcode is Opcode.PING:
                pong = event.payload
            elif event.opcode is Opcode.CLOSE:
                code = echo_code(event.payload)
                self._close(s, "disconnect", quiet=s.phase is not Phase.ACTIVE, close_code=code)
            if _closed(s):
                return
        if pong is not None:
            self._write_batch(s)  # what came first goes first
            if self._has_room(s, pong):
                s.link.write(ws_frame(pong, Opcode.PONG, masked=False))

    def _frame(self, s: Session, kind: RelayFrameType, body: memoryview, now: float) -> None:
        # ``body`` is a view of the caller's buffer: valid during this call only.
        if kind is RelayFrameType.SEND and s.phase is Phase.ACTIVE:
            self._forward(s, body, now)
        elif s.phase is Phase.AUTH:
            if kind is not RelayFrameType.AUTH:
                raise RelayProtocolError(f"{kind.name} frame")  # " before AUTH" is added
            self._auth(s, body, now)
        elif kind is RelayFrameType.PING:
            if len(body) != PING_LEN:
                raise RelayProtocolError(f"PING of {len(body)} bytes (expected {PING_LEN})")
            self._control(s, encode_frame(RelayFrameType.PONG, body))
        elif kind is not RelayFrameType.PONG:
            raise RelayProtocolError(f"unexpected {kind.name} frame from a client")

    def _forward(self, s: Session, body: memoryview, now: float) -> None:
        m = self.metrics
        if len(body) < ID_LEN:  # a protocol error, not a datagram
            raise RelayProtocolError("SEND shorter than an endpoint id")
        m.datagrams_in_total += 1
        if s.bucket is not None and not s.bucket.take(len(body), now):
            m.dropped["rate_limited"] += 1
            return
        dest_id = bytes(body[:ID_LEN])
        dest = self._clients.get(dest_id)
        if dest is None:
            m.dropped["unknown_peer"] += 1  # the one reason this datagram is counted under
            # Room first: the throttle records only a PEER_GONE that is queued (and the
            # frame is built only then: a sender may go on sending to the gone peer).
            room = s.queued() + FRAME_HEADER + ID_LEN <= self.config.queue_bytes
            if room and s.peer_gone.allow(dest_id, now):
                m.peer_gone_total += 1
                self._queue(s, encode_frame(RelayFrameType.PEER_GONE, dest_id))
            return
        # Checked before the RECV frame is built: a slow reader's drops copy nothing.
        if dest.queued() + FRAME_HEADER + len(body) > self.config.queue_bytes:
            m.dropped["queue_full"] += 1
            return
        m.datagrams_out_total += 1
        append_addressed(self._batch(dest), RelayFrameType.RECV, s.raw_id, body[ID_LEN:])

    def _auth(self, s: Session, view: memoryview, now: float) -> None:
        if len(view) < ID_LEN + SIG_LEN:
            self._refuse(s, MALFORMED)
            return
        body = bytes(view)
        raw_id, sig, token = (
            body[:ID_LEN],
            body[ID_LEN : ID_LEN + SIG_LEN],
            body[ID_LEN + SIG_LEN :],
        )
        try:
            eid = EndpointId(raw_id)
        except UsageError:
            self._refuse(s, BAD_SIGNATURE)
            return
        if not self._proof_holds(eid, sig, s.challenge, raw_id, now):
            self._refuse(s, BAD_SIGNATURE, claimed=eid.short())
            return
        refusal = self.access.check(raw_id, token, now)
        if refusal is not None:
            self._refuse(s, refusal, claimed=eid.short())
            return
        old = self._clients.get(raw_id)
        if old is None and len(self._clients) >= self.config.max_clients:
            self._refuse(s, RELAY_FULL, claimed=eid.short())
            return
        per_ip = self.config.max_clients_per_ip
        if per_ip:
            mine = self._clients_by_source.get(s.source, 0)
            if old is not None and old.source == s.source:
                mine -= 1  # replaced below: the source keeps its count
            if mine >= per_ip:
                self._refuse(s, PER_IP_FULL, claimed=eid.short(), source=s.source)
                return
        if old is not None:
            self.metrics.replaced_total += 1
            self._close(old, "replaced", error=REPLACED)  # leaves its bucket in _buckets
        s.phase = Phase.ACTIVE
        s.splitter.max_body = MAX_BODY  # until now at most MAX_AUTH_BODY (see open)
        self._stop_waiting(s)
        s.endpoint = eid
        s.raw_id = raw_id
        if self.config.rate:
            # The bucket of an earlier session of this id, if it is not full yet: a
            # client that reconnects must not get a fresh burst each time.
            s.bucket = self._buckets.pop(raw_id, None) or TokenBucket(
                self.config.rate, self.config.burst, now
            )
        self._clients[raw_id] = s
        self._clients_by_source[s.source] = self._clients_by_source.get(s.source, 0) + 1
        self.metrics.auth_ok_total += 1
        self._queue(s, encode_frame(RelayFrameType.AUTH_OK, self._auth_ok_body(s)))
        log.info(kv("auth_ok", conn=s.label, peer=s.observed, clients=len(self._clients)))

    def _proof_holds(
        self, eid: EndpointId, sig: bytes, challenge: bytes, raw_id: bytes, now: float
    ) -> bool:
        """Whether ``sig`` proves ``eid`` bound to a certificate AUTH may name; before a
        no, the glue may look at the certificate files once a second (a renewal that
        the proxy in front took up before the relay's own poll)."""

        def holds() -> bool:
            return any(
                eid.verify(sig, auth_message(fp, challenge, raw_id))
                for fp in self.cert_fingerprints(now)
            )

        if holds():
            return True
        hook = self.refresh_certificate
        if hook is None or now - self._refreshed_at < REFRESH_EVERY:
            return False
        self._refreshed_at = now
        return hook(now) and holds()

    def _auth_ok_body(self, s: Session) -> bytes:
        c = self.config
        return encode_map(
            {
                "observed": s.observed,
                "max_datagram": MAX_DATAGRAM,
                "keepalive": float(c.keepalive),
                "rate": int(c.rate),
                "burst": int(c.burst),
                "stun_ports": list(c.stun_ports),
            }
        )

    # ---- output and closing -----------------------------------------------------------

    def _batch(self, s: Session) -> bytearray:
        """``s``'s batch of this call, to append frames to (flushed at the end of it)."""
        if not s.out:
            self._dirty.append(s)
        return s.out

    def _queue(self, s: Session, frame: bytes) -> None:
        self._batch(s).extend(frame)

    def _write_batch(self, s: Session) -> None:
        """Write what is batched for ``s`` in one piece (dropped if ``s`` is closed)."""
        if not s.out:
            return
        data, s.out = s.out, bytearray()  # the link keeps ``data``: never reused here
        if s.phase is not Phase.CLOSED:
            self.metrics.bytes_out_total += len(data)
            if s.websocket is not None:
                data[:0] = ws_header(len(data))  # one memmove, no copy of the batch
            s.link.write(data)

    def _has_room(self, s: Session, frame: bytes | bytearray) -> bool:
        """Whether ``frame`` fits in ``s``'s queue (``queue_bytes``)."""
        return s.queued() + len(frame) <= self.config.queue_bytes

    def _control(self, s: Session, frame: bytes) -> None:
        """PONG: dropped, like datagrams, when the client is not reading (not counted as
        a dropped datagram: the counter is the datagrams')."""
        if self._has_room(s, frame):
            self._queue(s, frame)

    def _refuse(self, s: Session, refusal: Refusal, **fields: object) -> None:
        self.metrics.auth_failures[refusal.reason] += 1
        busy = refusal in (RELAY_FULL, PER_IP_FULL, AUTH_TIMEOUT, SHUTTING_DOWN)
        self._close(
            s,
            "auth_failed",
            error=refusal.message,
            fields={"reason": refusal.reason, **fields},
            close_code=b"\x03\xf5" if busy else b"",  # 1013 try again later
        )

    def _close(
        self,
        s: Session,
        event: str,
        *,
        error: str | None = None,
        frame: bytes | None = None,
        quiet: bool = False,
        fields: dict[str, object] | None = None,
        close_code: bytes = b"",
    ) -> None:
        """Write what is batched for ``s`` plus a final ERROR/RECONNECT (and, on a
        WebSocket session, a CLOSE: ``close_code``, two bytes, else one for ``event``),
        then close it."""
        if s.phase is Phase.CLOSED:
            return
        if error is not None:
            frame = encode_frame(RelayFrameType.ERROR, error.encode("utf-8")[:1024])
        if frame is not None:
            s.out += frame
        self._write_batch(s)
        if s.websocket is not None:
            s.link.write(ws_frame(close_code or _ws_close_code(event), Opcode.CLOSE, masked=False))
        level = logging.DEBUG if quiet else logging.INFO
        log.log(level, kv(event, conn=s.label, peer=s.observed, error=error, **(fields or {})))
        self._forget(s)
        s.link.close()

    def _forget(self, s: Session) -> None:
        s.phase = Phase.CLOSED
        self._stop_waiting(s)
        if s.raw_id and self._clients.get(s.raw_id) is s:
            del self._clients[s.raw_id]
            left = self._clients_by_source.pop(s.source, 1) - 1
            if left:
                self._clients_by_source[s.source] = left
            if s.bucket is not None:
                self._keep_bucket(s.raw_id, s.bucket)

    def _stop_waiting(self, s: Session) -> None:
        """``s`` authenticated or closed: it no longer counts against the waiting caps."""
        if s not in self._waiting:
            return
        source = self._waiting.pop(s)
        if source is None:
            return
        mine = self._waiting_by_source[source]
        del mine[s]
        if not mine:
            del self._waiting_by_source[source]

    def _keep_bucket(self, raw_id: bytes, bucket: TokenBucket) -> None:
        """Remember a gone client's bucket until it is full (pruned by :meth:`tick`);
        at most ``max_clients`` of them, the oldest going first."""
        if raw_id not in self._buckets and len(self._buckets) >= self.config.max_clients:
            del self._buckets[next(iter(self._buckets))]
        self._buckets[raw_id] = bucket
