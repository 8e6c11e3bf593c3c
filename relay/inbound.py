"""What the relay core does with a client's bytes (sans-I/O): HTTP, relay frames, AUTH.

:class:`Inbound` is a mixin of :class:`relay.state.RelayCore`, which hands it each chunk
a session receives: first the HTTP request head (:func:`relay.http.route` decides:
upgrade, or answer and close), then relay frames, bare or inside WebSocket frames: AUTH
checked against the session's challenge, the certificate fingerprints and the access
policy, SEND forwarded into the destination's batch, PING answered. It answers only
through the core's batching and closing methods, and, like the rest of the core, keeps
no view of the buffer it is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from p2pdist.errors import UsageError
from p2pdist.identity import ID_LEN, EndpointId
from p2pdist.wire.relay import (
    BAD_SIGNATURE_TEXT,
    CREDENTIAL_REFUSALS,
    FRAME_HEADER,
    MALFORMED_AUTH_TEXT,
    MAX_BODY,
    MAX_DATAGRAM,
    MAX_HTTP_HEAD,
    MAX_TOKEN_BYTES,
    PING_LEN,
    REPLACED_TEXT,
    RelayFrameType,
    RelayProtocolError,
    append_addressed,
    auth_message,
    challenge_body,
    encode_frame,
    encode_map,
    name_auth_message,
    parse_http_head,
    upgrade_response,
)
from p2pdist.wire.websocket import Opcode, WebSocketReader, echo_code
from p2pdist.wire.websocket import frame as ws_frame

from .access import AccessPolicy, Refusal
from .addresses import forwarded_ip, source_of
from .http import response, route
from .limits import TokenBucket
from .logfmt import kv
from .metrics import Metrics
from .session import Phase, Session

if TYPE_CHECKING:
    from .state import CoreConfig

__all__ = ["Inbound"]

log = logging.getLogger("relay.state")
"""The core's logger (auth_ok, no_forwarded_address): one name for all its events."""

SIG_LEN = 64
MAX_AUTH_BODY = ID_LEN + SIG_LEN + MAX_TOKEN_BYTES
"""The largest valid AUTH body; a longer frame before authentication is refused from
its header alone, so an unauthenticated connection never buffers more than this."""
REFRESH_EVERY = 1.0
"""Seconds between looks at the certificate files that a bad signature may cause."""
WS_BEFORE_AUTH = MAX_AUTH_BODY + 1024
"""The most WebSocket bytes a client may send before it is authenticated: one AUTH
frame and framing around it (a session that may still send nothing else must not
make the relay work for free)."""
MAX_SHARES = 256
"""Senders whose share of one congested destination queue is tracked on their own at
most (about 17 KiB); the rest share one entry."""

BAD_SIGNATURE = Refusal(CREDENTIAL_REFUSALS[BAD_SIGNATURE_TEXT], BAD_SIGNATURE_TEXT)
MALFORMED = Refusal(CREDENTIAL_REFUSALS[MALFORMED_AUTH_TEXT], MALFORMED_AUTH_TEXT)
RELAY_FULL = Refusal("relay_full", "relay full")
PER_IP_FULL = Refusal("max_clients_per_ip", "too many clients from this address")


def _closed(s: Session) -> bool:
    # A function, so type checkers do not narrow ``s.phase`` across calls that change it.
    return s.phase is Phase.CLOSED


class Inbound:
    """The input side of :class:`~relay.state.RelayCore`: the HTTP phase, then relay
    frames and AUTH. A mixin: the state and the methods it uses are RelayCore's,
    declared here for type checkers."""

    config: CoreConfig
    metrics: Metrics
    access: AccessPolicy
    refresh_certificate: Callable[[float], bool] | None
    _random: Callable[[int], bytes]
    _clients: dict[bytes, Session]
    _clients_by_source: dict[str, int]
    _buckets: dict[bytes, TokenBucket]
    _warned_forwarded: bool
    _refreshed_at: float

    if TYPE_CHECKING:

        def metrics_text(self) -> str: ...
        def cert_fingerprints(self, now: float) -> tuple[bytes, ...]: ...
        def _source_room(self, s: Session, source: str, now: float) -> bool: ...
        def _count_source(self, s: Session, source: str) -> None: ...
        def _batch(self, s: Session) -> bytearray: ...
        def _queue(self, s: Session, frame: bytes) -> None: ...
        def _write_batch(self, s: Session) -> None: ...
        def _send(self, s: Session, data: bytearray) -> None: ...
        def _has_room(self, s: Session, frame: bytes | bytearray) -> bool: ...
        def _control(self, s: Session, frame: bytes) -> None: ...
        def _refuse(self, s: Session, refusal: Refusal, **fields: object) -> None: ...
        def _stop_waiting(self, s: Session) -> None: ...
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
        ) -> None: ...

    # ---- HTTP phase -------------------------------------------------------------------

    def _http(self, s: Session, data: bytes | bytearray | memoryview, now: float) -> bytes:
        """Consume the request head; returns bytes that follow a completed upgrade."""
        # Only the new bytes are searched for the head's end: a client that sends its head
        # a byte per TLS record must not make each record rescan the whole head.
        start = max(0, len(s.http_buf) - 3)
        s.http_buf += data
        if s.http_buf.find(b"\r\n\r\n", start) < 0 and len(s.http_buf) <= MAX_HTTP_HEAD:
            return b""
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
        body = challenge_body(s.challenge, name_bound=self._bound_name(s) is not None)
        self._queue(s, encode_frame(RelayFrameType.CHALLENGE, body))
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
            s.frames_in += 1
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
        before = reader.frames
        events = reader.feed(data)
        s.frames_in += reader.frames - before  # every frame, empty ones and joined ones too
        for event in events:
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
                self._send(s, ws_frame(pong, Opcode.PONG, masked=False))

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
        size = FRAME_HEADER + len(body)
        queued = dest.queued()
        if queued + size > self.config.queue_bytes:
            m.dropped["queue_full"] += 1
            return
        share = self._fair_share(dest, s.raw_id, queued, size)
        if share is not None:  # over its share: the room left is the other senders'
            m.dropped[share] += 1
            return
        m.datagrams_out_total += 1
        append_addressed(self._batch(dest), RelayFrameType.RECV, s.raw_id, body[ID_LEN:])

    def _fair_share(self, dest: Session, sender: bytes, queued: int, size: int) -> str | None:
        """None when ``sender`` may add ``size`` bytes to ``dest``'s queue, which holds
        ``queued``; else the drop reason. Below half of ``queue_bytes`` anyone may. Above
        it (``dest`` reads slower than it is sent to) each sender may hold at most the
        upper half divided by one more than the senders seen since the queue last went
        below half: one sender flooding a slow reader cannot fill its queue and starve
        the others (a newcomer always finds room). A sender's holding is its part of what
        is above half now (its bytes added this episode, scaled by what the reader has
        taken since), so a lone sender may keep the queue three quarters full
        (``queue_full`` beyond, the rest being kept for others); one of several, its
        share (``queue_share``). Senders past :data:`MAX_SHARES` share one entry."""
        half = self.config.queue_bytes // 2
        shares = dest.shares
        if queued + size <= half:
            if shares:
                shares.clear()  # the queue drained: a new episode
                dest.shares_total = 0
            return None
        if sender not in shares and len(shares) >= MAX_SHARES:
            sender = b""  # one entry for all the rest: identities are free
        taken = shares.get(sender, 0)
        senders = len(shares) + (sender not in shares)
        total, above = dest.shares_total, max(0, queued - half)
        held = taken * above // total if total > above else taken
        if held + size > max(MAX_BODY + FRAME_HEADER, half // (senders + 1)):
            return "queue_share" if senders > 1 else "queue_full"
        shares[sender] = taken + size
        dest.shares_total = total + size
        return None

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
        if not self._proof_holds(s, eid, sig, raw_id, now):
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
            # (leaves its bucket in _buckets) The log names the connection taking over.
            fields: dict[str, object] = {"by": f"{s.label}/{eid.short()}", "by_peer": s.observed}
            self._close(old, "replaced", error=REPLACED_TEXT, fields=fields)
        s.phase = Phase.ACTIVE
        s.splitter.max_body = MAX_BODY  # until now at most MAX_AUTH_BODY (see RelayCore.open)
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

    def _bound_name(self, s: Session) -> bytes | None:
        """The relay name ``s``'s AUTH must be bound to instead of a certificate (a
        session through a proxy with certificates of its own), else None."""
        return self.config.proof_name if s.proxied else None

    def _proof_holds(
        self, s: Session, eid: EndpointId, sig: bytes, raw_id: bytes, now: float
    ) -> bool:
        """Whether ``sig`` proves ``eid`` bound to ``s``'s challenge and to the relay's
        name (:meth:`_bound_name`) or a certificate AUTH may name; before a no to the
        latter, the glue may look at the certificate files once a second (a renewal that
        the proxy in front took up before the relay's own poll)."""
        challenge = s.challenge
        name = self._bound_name(s)
        if name is not None:
            return eid.verify(sig, name_auth_message(name, challenge, raw_id))

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
