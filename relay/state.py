"""The relay's sans-I/O core: authentication, the client registry, routing and limits.

:class:`RelayCore` is fed events by the asyncio glue (:mod:`relay.server`), always with
the current monotonic time: :meth:`~RelayCore.open`, :meth:`~RelayCore.receive`,
:meth:`~RelayCore.lost`, :meth:`~RelayCore.tick` and :meth:`~RelayCore.shutdown`. It
answers through each session's :class:`~relay.session.Link`. It never sleeps, never
awaits and never reads a clock, so tests move time by hand. What it does with the
bytes a client sends (the HTTP phase, relay frames, AUTH) lives in the mixin
:class:`relay.inbound.Inbound`; client addresses are read by :mod:`relay.addresses`.

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

import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from p2pdist.identity import EndpointId
from p2pdist.wire.relay import (
    MAX_HTTP_HEAD,
    MIN_READ,
    RelayFrameType,
    RelayProtocolError,
    encode_frame,
    encode_map,
)
from p2pdist.wire.websocket import Opcode, WebSocketError
from p2pdist.wire.websocket import frame as ws_frame
from p2pdist.wire.websocket import header as ws_header

from .access import AccessPolicy, Refusal
from .addresses import format_address, source_of
from .http import response
from .inbound import (
    MAX_AUTH_BODY,
    PER_IP_FULL,
    REFRESH_EVERY,
    RELAY_FULL,
    WS_BEFORE_AUTH,
    Inbound,
)
from .limits import Every, TokenBucket
from .logfmt import kv
from .metrics import Metrics
from .session import Link, Phase, Session

__all__ = ["CoreConfig", "RelayCore"]

log = logging.getLogger(__name__)

MAX_PREVIOUS_CERTS = 4
"""Certificates served before reloads that AUTH may still name during their grace; the
ones that expire soonest give way first (each one costs a signature check on a bad
proof)."""

AUTH_TIMEOUT = Refusal("timeout", "authentication timed out")
_ABANDONING = frozenset({"disconnect", "tls_timeout", "http_timeout"})
"""The close events of a connection that may end before it authenticated without a
refusal: the client went away, or timed out before its request (``abandoned_total``)."""
SHUTTING_DOWN = Refusal("shutting_down", "relay shutting down")
EVICTED = "evicted: too many connections waiting to authenticate"
REFUSED = "too many connections waiting to authenticate; retry later"
EVICT_AFTER = 1.0
"""Seconds a connection must have waited to authenticate before a newer one may evict
it. A real client needs a round trip or two, so an older one is most likely idle (a
flood churns itself). When the cap is full of younger connections, newcomers are
refused instead: evicting the oldest then would close every connection just before it
authenticates, and a reconnect storm larger than the cap would never get through."""
REFUSAL_LOG_EVERY = 5.0
"""Seconds between INFO lines of one kind (event and reason) for connections refused or
failed before AUTH_OK (the rest at DEBUG, counted in the next line of that kind): a
stream of cheap connections must not flood the log, nor hide another kind's first line
(a real client refused by the allowlist among a scanner's garbage); /metrics counts
every one."""


READ_CHARGE = 256
"""Bytes of a client's rate each socket read shorter than 1 KiB
(``p2pdist.transport.securestream.SMALL_READ``) costs on top of its bytes: a read of
a part of a record is a pass of Python too (a client sending each record a byte per
TCP segment, TCP_NODELAY, took 86% of a core within ``--rate 12500000``, at 4 us a
byte). Longer reads, full TCP segments and more, cost their bytes alone."""
RECORD_CHARGE = 256
"""Bytes of a client's rate each record it sends costs on top of its bytes: 1.6% of a
full 16 KiB TLS record, less for AES-GCM records; a client sending a byte per record is
read at about rate / 256 records a second."""
FRAME_CHARGE = 64
"""Bytes of a client's rate each relay or WebSocket frame it sends costs on top of its
bytes: 0.4% of a 16 KiB datagram, about the size of a QUIC ACK; empty PONGs, 5 bytes
each, were read at about 1.5 us of CPU apiece, so a rate of 1 MB/s in them took a
third of a core."""


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
    read_size: int = 256 * 1024
    """The most bytes the glue hands :meth:`RelayCore.receive` at once (a rate-limited
    client's reads are smaller: :meth:`RelayCore.read_allowance`)."""
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
    proof_name: bytes | None = None
    """Proxied sessions: None, their AUTH binds the relay's certificate, as on the TLS
    port; else this relay name (:func:`~p2pdist.wire.relay.relay_name`), which their AUTH
    binds instead (a proxy with certificates of its own, ``proxy-certs own``)."""

    def __post_init__(self) -> None:
        if self.proxy_hops < 1:
            raise ValueError(f"proxy_hops must be at least 1, got {self.proxy_hops}")


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


class RelayCore(Inbound):
    """Sessions, the registry of authenticated clients, and what to do with each frame
    (reading the HTTP phase, frames and AUTH: :class:`~relay.inbound.Inbound`)."""

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
        self._now = 0.0
        """The time of the last receive or tick (at most about a second behind: tick
        runs every second): the clock of the log's rate limit, which _close has not."""
        self._refusal_lines: dict[tuple[str, object], Every] = {}
        """Per (event, reason) before AUTH_OK: the gate of its INFO lines."""

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

    def evict_for_socket(self, now: float, peer: str | None = None) -> Link | None:
        """The socket budget is spent and a new connection came (from address ``peer``,
        when known): forget the oldest connection still waiting to authenticate if it has
        waited :data:`EVICT_AFTER`, as the caps on waiting connections do, so that idle
        sockets cannot lock real clients out when the budget is smaller than those caps.
        A newcomer whose source already has ``max_unauthenticated_per_ip`` connections
        waiting (it would be refused anyway) makes room only among its own source's:
        one source never evicts another's. Returns the evicted link, for the caller to
        drop at once (what :meth:`_evict` queued for it is not flushed: its socket must
        go now, not after a close grace, or a flood could push the relay past its
        descriptors); None: no room."""
        waiting: dict[Session, Any] = self._waiting
        if peer is not None:
            own = self._waiting_by_source.get(source_of(peer))
            if own and len(own) >= self.config.max_unauthenticated_per_ip:
                waiting = own
        oldest = next(iter(waiting), None)
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

    def receive(
        self,
        s: Session,
        data: bytes | bytearray | memoryview,
        now: float,
        records: int = 0,
        reads: int = 0,
        *,
        wire_bytes: int | None = None,
    ) -> None:
        """Bytes arrived from ``s``'s client, in ``records`` TLS or AES-GCM records, with
        ``reads`` socket reads under 1 KiB since the last call (each 0 when the glue does
        not know), which took ``wire_bytes`` bytes of the socket since the last call
        (ciphertext, padding and records without plaintext included; None when the glue
        does not know, then ``data``'s size is charged instead). ``data``
        is only read during the call (it may be a view of a buffer that is reused right
        after)."""
        if s.phase is Phase.CLOSED:
            return
        self._now = now
        if s.phase is Phase.TLS:  # a glue that did not say so: bytes mean it is done
            self.handshake_done(s, now)
        s.last_heard = now
        nbytes = memoryview(data).nbytes
        self.metrics.bytes_in_total += nbytes
        frames_before = s.frames_in
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
        bucket = s.bucket  # None before AUTH_OK, or with no rate
        if bucket is not None:
            # Every byte the socket carried, where the glue knows it (TLS's padding, empty
            # records and key updates carry no plaintext but cost their reads: a record
            # of one byte padded to 16 KiB was charged 257; one read's plaintext may come
            # in several calls, the first has its bytes), and more per small socket
            # read, record and frame: each costs a pass of Python whatever its size (one
            # byte per record, empty frames, or a record sent a byte per TCP segment,
            # took a core). Charged even if this read closed the session: the bucket
            # outlives it (see _keep_bucket). The read that carried AUTH is charged
            # whole, AUTH included: frames written behind it (a reconnecting client's,
            # into an inherited bucket) are not free.
            frames = s.frames_in - frames_before
            extra = reads * READ_CHARGE + records * RECORD_CHARGE + frames * FRAME_CHARGE
            carried = nbytes if wire_bytes is None else wire_bytes
            bucket.charge(carried + extra, now)
            if s.phase is Phase.ACTIVE:
                self._pace(s, now)

    def read_allowance(self, s: Session, now: float) -> int:
        """How many bytes the glue may read from ``s``'s client now: what its bucket
        holds (at least :data:`MIN_READ`, at most ``read_size``), so a client is read at
        about its rate, whatever frames it sends; before AUTH_OK no more than the
        phase's one message (:data:`MAX_HTTP_HEAD`, or an AUTH frame in a WebSocket
        frame), so frames written behind AUTH wait for the bucket of the id it proves."""
        if s.phase is not Phase.ACTIVE:
            most = WS_BEFORE_AUTH if s.phase is Phase.AUTH else MAX_HTTP_HEAD
            return min(self.config.read_size, most)
        bucket = s.bucket
        if bucket is None:
            return self.config.read_size
        return int(max(MIN_READ, min(self.config.read_size, bucket.level(now))))

    def _pace(self, s: Session, now: float) -> None:
        """Stop reading from ``s`` while its bucket holds less than :data:`MIN_READ`
        (for at most the keepalive, so its PINGs are still read in time): a client that
        sends faster than its rate is held back by TCP, instead of having the relay read
        and parse everything (and drop its datagrams)."""
        bucket = s.bucket
        assert bucket is not None
        wait = bucket.seconds_until(MIN_READ, now)
        if wait > 0:
            self.metrics.rate_paused_total += 1
            s.link.pause(min(wait, self.config.keepalive))

    def lost(self, s: Session, now: float, error: str | None = None) -> None:
        """The connection of ``s`` is gone (EOF, reset, or after our close); ``error``:
        why, when the glue knows (a TLS failure, a record that did not decrypt)."""
        if s.phase is not Phase.CLOSED:
            level = logging.INFO if s.phase is Phase.ACTIVE else logging.DEBUG
            self._count_abandoned(s)
            fields = {"peer": s.observed, "after": now - s.opened_at, "error": error}
            log.log(level, kv("disconnect", conn=s.label, **fields))
            self._forget(s)
        self._sessions.discard(s)

    def eof(self, s: Session, now: float) -> None:
        """The client of ``s`` half-closed its connection (TLS close_notify or TCP FIN):
        it is gone for routing at once (peers get PEER_GONE), and its link is closed
        like any connection the relay closes (flushed, then aborted after a grace),
        even if bytes are still queued towards it."""
        fields: dict[str, object] = {"after": now - s.opened_at, "eof": True}
        self._close(s, "disconnect", quiet=s.phase is not Phase.ACTIVE, fields=fields)

    def _count_abandoned(self, s: Session) -> None:
        """``s`` ends before it authenticated, not by a refusal or an eviction (the
        client went away, or timed out before its request: :data:`_ABANDONING`)."""
        if s.phase in (Phase.TLS, Phase.HTTP, Phase.AUTH):
            self.metrics.abandoned[s.phase.value] += 1

    def tick(self, now: float) -> None:
        """Enforce the auth timeout and keepalive silence, and forget limiter state that
        has run out; call about once a second."""
        self._now = now
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
            if s.websocket is not None:
                data[:0] = ws_header(len(data))  # one memmove, no copy of the batch
            self._send(s, data)

    def _send(self, s: Session, data: bytearray) -> None:
        """Write ``data`` to ``s``'s link, counted in ``bytes_out_total`` (every byte the
        relay writes goes through here: batches, WebSocket PONGs and CLOSEs)."""
        self.metrics.bytes_out_total += len(data)
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
        if event in _ABANDONING:
            self._count_abandoned(s)
        if error is not None:
            frame = encode_frame(RelayFrameType.ERROR, error.encode("utf-8")[:1024])
        if frame is not None:
            s.out += frame
        self._write_batch(s)
        if s.websocket is not None:
            self._send(s, ws_frame(close_code or _ws_close_code(event), Opcode.CLOSE, masked=False))
        level = logging.DEBUG if quiet else logging.INFO
        extra = dict(fields or {})
        if level == logging.INFO and s.phase is not Phase.ACTIVE:
            # Before AUTH_OK: at most one line of each kind per REFUSAL_LOG_EVERY, saying
            # how many were left out since (a flood of bad tokens or garbage costs its
            # sender a connection each, and must not cost the relay's disk a line each).
            kind = (event, extra.get("reason"))
            gate = self._refusal_lines.get(kind)
            if gate is None:
                gate = self._refusal_lines[kind] = Every(REFUSAL_LOG_EVERY, lambda: self._now)
            skipped = gate.skipped
            if not gate():
                level = logging.DEBUG
            elif skipped:
                gate.skipped = 0
                extra["others_since_last"] = skipped
        log.log(level, kv(event, conn=s.label, peer=s.observed, error=error, **extra))
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
