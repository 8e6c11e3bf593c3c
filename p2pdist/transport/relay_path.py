"""The relay path: one authenticated session to the home relay that carries datagrams.

A :class:`RelayPath` keeps a session to the relay alive for as long as it runs:
it dials (TCP + TLS + HTTP upgrade, docs/protocol.md section 8), proves our endpoint
id, sends keepalives, and reconnects with exponential backoff and jitter when the
session breaks or the relay asks clients to reconnect. Datagrams are best effort: while
there is no session they are dropped and counted (QUIC above retransmits).

Its settings (:class:`RelayConfig`), the status it reports (:class:`RelayStatus`,
:class:`RelayState`) and its reconnect schedule (:class:`ReconnectBackoff`) live in
:mod:`.relay_config`, with no I/O, and are imported here too.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random as _random
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import replace

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    P2PError,
    P2PTimeoutError,
    PeerAuthenticationError,
    UsageError,
)
from ..identity import ID_LEN, EndpointId, SecretKey, endpoint_id_of
from ..tasks import cancel_and_wait
from ..tls import endpoint_id_of_cert
from ..wire.httpproxy import ProxyRefused, ProxyUrl
from ..wire.relay import (
    BAD_TOKEN_TEXT,
    CREDENTIAL_REFUSALS,
    MAX_DATAGRAM,
    MAX_RETRY_AFTER,
    MAX_TOKEN_BYTES,
    PING_LEN,
    REPLACED_TEXT,
    RelayFrame,
    RelayFrameType,
    RelayProtocolError,
    RelayUrl,
    append_addressed,
    cert_fingerprint,
    decode_map,
    encode_frame,
    parse_challenge,
    proof_message,
    upgrade_request,
)
from .aeadpipe import new_secret
from .base import IDENTITY_MISMATCH
from .happyeyeballs import connect_tcp, connection_on
from .paths import plain_ip
from .proxytunnel import open_tunnel
from .relay_config import (
    PROXY_ENV,
    ReconnectBackoff,
    RelayConfig,
    RelayState,
    RelayStatus,
    parse_stun_ports,
    relay_keepalive,
    relay_silence,
)
from .relay_session import RelaySessionProtocol, may_answer_ping
from .securestream import SecureStream
from .tlspipe import TLS_BACKLOG

__all__ = [
    "PROXY_ENV",
    "ReconnectBackoff",
    "RelayConfig",
    "RelayPath",
    "RelayState",
    "RelayStatus",
    "parse_stun_ports",
]

log = logging.getLogger(__name__)


class _Replaced(ConnectionBrokenError):
    """The relay closed our session for a newer one with our endpoint id."""


class _RefusedByRelay(PeerAuthenticationError):
    """The relay refused us, or is not the pinned relay, or the HTTP proxy refused the
    tunnel for credentials or policy (407, 403): what only a change to the relay or to
    this client's settings lets through. ``refusal`` names which (see
    ``RelayStatus.refusal``)."""

    def __init__(self, peer: str, detail: str, refusal: str) -> None:
        super().__init__(peer, detail)
        self.refusal = refusal


def _power_of_ten(n: int) -> bool:
    """Whether ``n`` is 1, 10, 100...: when a repeating event is logged again."""
    return n == int(10 ** (len(str(n)) - 1))


_SELF_SIGNED = (18, 19)
"""OpenSSL's X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT and SELF_SIGNED_CERT_IN_CHAIN: what a
pinned relay's certificate gives when dialed without its pin."""

RATE_QUEUE_SECONDS = 0.25
"""Under a relay's rate limit, queue at most this many seconds of the rate towards it
(at least :data:`MIN_RATE_QUEUE`, at most ``send_buffer``): the relay stops reading a
client over its rate, so a deeper queue only adds delay before QUIC sees a loss."""
MIN_RATE_QUEUE = 256 * 1024
REDIAL = 2.0
"""Seconds (times 1 to 1.5) after which an unanswered TCP dial to the relay starts afresh
with a new SYN, instead of the kernel's retransmissions 1, 3, 7 s... apart: a relay
back from an outage is reached within about this long (connect_tcp's ``redial``)."""
_SESSION_READ = 1 << 20
"""Ciphertext one read of the relay session may take. A receiver that drains about 64
QUIC datagrams per wake-up (as from a UDP socket) acknowledges and transmits once for
all of them; 128 KiB reads (8 datagrams) tripled the ACKs and transmit passes of a
bulk transfer through the relay (docs/performance.md)."""


class RelayPath:
    """Datagrams to and from peers through one relay, addressed by endpoint id.

    ``token``: the relay's shared token (None or ``""``: send none, as for an unset
    environment variable). ``random`` (a float in [0, 1), default
    :func:`random.random`) jitters reconnects."""

    def __init__(
        self,
        key: SecretKey,
        url: str | RelayUrl,
        *,
        token: str | None = None,
        config: RelayConfig | None = None,
        random: Callable[[], float] | None = None,
    ) -> None:
        self._key = key
        self.url = url if isinstance(url, RelayUrl) else RelayUrl.parse(url)
        if token is not None and not isinstance(token, str):
            raise UsageError(f"relay token must be a str, got {type(token).__name__}")
        self._token = token or ""
        try:
            size = len(self._token.encode())
        except UnicodeEncodeError:  # lone surrogates: undecodable bytes from the environment
            raise UsageError("relay token must be UTF-8 text") from None
        if size > MAX_TOKEN_BYTES:  # the relay could not read the AUTH frame
            raise UsageError(f"relay token must be at most {MAX_TOKEN_BYTES} bytes (UTF-8)")
        self.config = config or RelayConfig()
        self.proxy = self.config.chosen_proxy()
        """The proxy the relay connection is tunnelled through, or None."""
        self._backoff = ReconnectBackoff(
            self.config.backoff_initial, self.config.backoff_max, random or _random.random
        )
        self._authed_at: float | None = None
        self.on_datagram: Callable[[EndpointId, bytes], None] | None = None
        self.on_peer_gone: Callable[[EndpointId], None] | None = None
        self.on_datagram_size: Callable[[int], None] | None = None
        self.max_datagram = MAX_DATAGRAM
        self._told_datagram = MAX_DATAGRAM
        """The size ``on_datagram_size`` was last told (or the first one): a session that
        failed after AUTH_OK set another must not keep the transport from hearing it."""
        self._queue_cap = self.config.send_buffer
        """Bytes queued towards the relay beyond which datagrams are dropped (less than
        ``send_buffer`` under a rate limit: :data:`RATE_QUEUE_SECONDS`)."""
        self._status = RelayStatus(
            str(self.url),
            RelayState.CONNECTING,
            proxy=str(self.proxy) if self.proxy is not None else None,
        )
        self._observation_off = False
        """Whether the last AUTH_OK listed no observation port at all (an empty list)."""
        self._writer: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._refused = asyncio.Event()
        self._said_unreachable = False  # warned that the relay cannot be reached yet
        self._warned_refusal: str | None = None  # the refusal warned of last (once each)
        self._unanswered = 0.0
        """Seconds the last attempt's TCP dial went unanswered until it was given up."""
        self._closed = asyncio.Event()
        """Set by :meth:`close`: no session any more, and waiters stop waiting."""
        self._ping_sent: dict[bytes, float] = {}
        self._ping_waiters: dict[bytes, asyncio.Future[float]] = {}
        self._sent = self._received = self._dropped = self._bad_peer_ids = 0
        self._handler_errors = 0
        self._outbox = bytearray()
        """SEND frames queued in this event-loop pass (one TLS write each pass)."""
        self._outbox_count = 0
        self._cert_hash = b""
        self._bare_upgrade = False
        """Whether the next session asks for the bare ``Upgrade: p2pdist-relay``: after
        a 400 or 426 to the WebSocket handshake (an older relay), once; kept while the
        bare form gets its 101, dropped as soon as an attempt with it fails before."""

    # ---- public -------------------------------------------------------------------

    @property
    def endpoint_id(self) -> EndpointId:
        """Our endpoint id."""
        return self._key.endpoint_id

    @property
    def status(self) -> RelayStatus:
        """The session's current state and counters."""
        return replace(
            self._status,
            datagrams_sent=self._sent,
            datagrams_received=self._received,
            dropped=self._dropped,
            bad_peer_ids=self._bad_peer_ids,
            handler_errors=self._handler_errors,
        )

    def start(self) -> None:
        """Begin (and keep) the session in the background."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait_connected(self, timeout: float) -> None:
        """Wait until a session is up; the error names the last failure
        (ConnectionClosedError at once once :meth:`close` was called, or when it is)."""
        if self._closed.is_set():
            raise ConnectionClosedError(f"relay {self.url}: closed")
        self.start()
        # A refusal in the latest attempt is reported at once (it stays set until an
        # attempt ends otherwise); else wait for the next attempt's outcome.
        waits = [
            asyncio.ensure_future(e.wait()) for e in (self._connected, self._refused, self._closed)
        ]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when="FIRST_COMPLETED")
        finally:
            for w in waits:
                w.cancel()
        if self._connected.is_set():
            return
        if self._closed.is_set():
            raise ConnectionClosedError(f"relay {self.url}: closed")
        why = self._status.last_error or "no answer"
        if self._refused.is_set():
            raise PeerAuthenticationError(f"relay {self.url}", why)
        raise P2PTimeoutError(f"relay {self.url}: no session within {timeout:g} s ({why})")

    @property
    def observation_off(self) -> bool:
        """Whether the relay said it runs no UDP observation port (``--stun-port 0``)."""
        return self._observation_off

    async def observation_targets(self) -> list[tuple[str, int]]:
        """The relay's UDP observation ports as (address, port): the ports the relay
        advertised (before it did, or if it names none at all: its TCP port's number, the
        relay's default) at the relay host's first IPv4 address, then at its first IPv6
        one (where it has both, a dual-stack socket learns how each family sees it);
        empty when it runs none (:attr:`observation_off`) or when the relay's host does
        not resolve."""
        if self.observation_off:
            return []
        ports = self._status.stun_ports or (self.url.port,)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.url.host, None, type=socket.SOCK_DGRAM)
        except OSError as exc:
            log.info("relay %s: cannot resolve for address observation: %s", self.url, exc)
            return []
        ips: dict[int, str] = {}
        for family, *_, sockaddr in infos:
            if family in (socket.AF_INET, socket.AF_INET6):
                ips.setdefault(family, plain_ip(str(sockaddr[0])))
        hosts = [ips[f] for f in (socket.AF_INET, socket.AF_INET6) if f in ips]
        return [(ip, port) for ip in dict.fromkeys(hosts) for port in ports]

    def send(self, dst: EndpointId, datagram: bytes) -> None:
        """Send one datagram to ``dst`` through the relay (best effort)."""
        if len(datagram) > self.max_datagram:
            raise UsageError(f"datagram of {len(datagram)} bytes exceeds {self.max_datagram}")
        w = self._writer
        if (
            w is None
            or w.is_closing()
            or w.get_write_buffer_size() + len(self._outbox) > self._queue_cap
        ):
            self._dropped += 1
            return
        if not self._outbox:
            # Coalesce what is sent in one event-loop pass into one TLS write.
            asyncio.get_running_loop().call_soon(self._flush, w)
        append_addressed(self._outbox, RelayFrameType.SEND, bytes(dst), datagram)  # one copy
        self._outbox_count += 1
        self._sent += 1

    def _flush(self, writer: asyncio.Transport) -> None:
        frames, count = self._outbox, self._outbox_count
        self._outbox, self._outbox_count = bytearray(), 0
        if writer is self._writer and not writer.is_closing():
            writer.write(frames)
        else:  # the session ended in between: these were never sent after all
            self._dropped += count
            self._sent -= count

    async def close(self) -> None:
        """End the session and stop reconnecting."""
        self._closed.set()
        if self._task is not None:
            await cancel_and_wait([self._task])  # (its session's pings fail as it ends)
        self._set(state=RelayState.CLOSED)

    def _fail_pings(self, error: P2PError) -> None:
        """The session a :meth:`ping` waits on is gone: no PONG can come on it."""
        for fut in self._ping_waiters.values():
            if not fut.done():
                fut.set_exception(error)

    # ---- session loop -------------------------------------------------------------------

    def _set(self, **changes: object) -> None:
        self._status = replace(self._status, **changes)  # type: ignore[arg-type]

    async def _run(self) -> None:
        while not self._closed.is_set():
            self._set(state=RelayState.CONNECTING)
            self._authed_at = None
            retry_after: float | None = None
            self._unanswered = 0.0
            try:
                retry_after = await self._session()
            except PeerAuthenticationError as exc:
                # The relay refused us (or is not the pinned relay): tell waiters now;
                # keep retrying in the background (an allowlist may be reloaded).
                said = self._warned_refusal == exc.detail
                self._warned_refusal = exc.detail
                refusal = exc.refusal if isinstance(exc, _RefusedByRelay) else None
                # (the error names the relay)
                self._set(last_error=exc.detail, refusal=refusal)
                self._refused.set()
                # Warned once, not at every retry (str(exc) starts with "relay <url>: ").
                log.log(logging.INFO if said else logging.WARNING, "%s", exc)
            except _Replaced as exc:
                # Another connection authenticated our id. Not our own half-dead one: we
                # open a new session only after this one ended. Said at the 1st, 10th,
                # 100th... time: two processes with one key would take turns for ever.
                self._refused.clear()
                n = self._status.replaced + 1
                self._set(last_error=str(exc), replaced=n, refusal=None)
                level = logging.WARNING if _power_of_ten(n) else logging.INFO
                log.log(level, "%s (replaced %d time(s) so far)", exc, n)
                self._authed_at = None  # a replacement never resets the backoff
            except Exception as exc:  # any failure ends this session, never the loop
                self._refused.clear()  # the latest attempt was not refused
                msg = str(exc) or type(exc).__name__
                self._set(last_error=msg, refusal=None)
                why = msg.removeprefix(f"relay {self.url}: ")  # the line names the relay
                if self._authed_at is None and not self._said_unreachable:
                    # Said once, not at every retry: a caller waits (start() up to
                    # connect_timeout) with nothing else to tell it why.
                    self._said_unreachable = True
                    again = "reconnect" if self._status.connects else "connect"
                    log.warning("relay %s: cannot %s yet (%s); retrying", self.url, again, why)
                else:
                    log.info("relay %s: session ended: %s", self.url, why)
            finally:
                self._connected.clear()
                self._writer = None
                self._fail_pings(
                    ConnectionClosedError(f"relay {self.url}: closed")
                    if self._closed.is_set()
                    else ConnectionBrokenError(f"relay {self.url}", "the session ended")
                )
            if self._closed.is_set():
                break
            authed = self._authed_at
            lasted = None if authed is None else time.monotonic() - authed
            wait = self._backoff.next_wait(lasted=lasted, retry_after=retry_after)
            # An attempt whose TCP dial went unanswered until connect_timeout waited
            # already: that counts against the backoff, so a relay back from an outage
            # is dialed again soon, not up to backoff_max later. (Only then: a relay that
            # takes TCP but is too loaded to finish TLS keeps its clients' backoff.)
            wait = self._backoff.less(wait, self._unanswered)
            self._set(state=RelayState.BACKOFF)
            log.debug("relay %s: reconnecting in %.2f s", self.url, wait)
            await asyncio.sleep(wait)

    async def _open(self) -> RelaySessionProtocol:
        url = self.url
        if url.pin is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE  # the pin below is the verification
            server_hostname = None
        else:
            ctx = ssl.create_default_context()
            # As pinned (and as the relay's own server): a balancer in front must too.
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            server_hostname = url.host
        label = f"relay {url}"
        secret = new_secret() if self.config.records else None
        proto = RelaySessionProtocol(label, MAX_DATAGRAM + ID_LEN, records_secret=secret)

        def stream_factory() -> SecureStream:
            proto.stream = SecureStream(
                proto,
                ctx,
                server_side=False,
                server_hostname=server_hostname,
                handshake_timeout=self.config.connect_timeout,
                read_size=_SESSION_READ,
                # what send() queues, and TLS's own answers on top
                backlog_limit=self.config.send_buffer + TLS_BACKLOG,
            )
            return proto.stream

        stream: SecureStream | None = None
        try:
            if self.proxy is None:  # (the relay's name may have broken IPv6: raced)
                dialed = time.monotonic()
                try:
                    sock = await connect_tcp(url.host, url.port, redial=REDIAL)
                except asyncio.CancelledError:  # connect_timeout: nobody answered
                    self._unanswered = time.monotonic() - dialed
                    raise
            else:
                sock = await self._tunnel(self.proxy)
            _, stream = await connection_on(sock, stream_factory)
            await stream.handshake
        except BaseException as exc:
            if stream is not None:
                stream.abort()
            # Cancelled just as the handshake finished, the session would be told of the
            # abort, with an error nobody reads.
            proto.close()
            if not isinstance(exc, ssl.SSLCertVerificationError):
                raise
            # Not worth waiting out: retrying will not make the certificate trusted.
            hint = ""
            if exc.verify_code in _SELF_SIGNED:  # not an expired or misnamed certificate
                hint = (
                    "; if the relay uses its own pinned key, pass the whole URL from its "
                    "'relay url:' line, with ?pin=..."
                )
            raise PeerAuthenticationError(
                label, f"certificate not trusted: {exc.verify_message}{hint}"
            ) from None
        writer = proto.transport
        assert writer is not None  # connection_made ran when the handshake completed
        sslobj = writer.get_extra_info("ssl_object")
        der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
        if not der:
            proto.close()
            raise PeerAuthenticationError(f"relay {url}", "presented no certificate")
        if url.pin is not None:
            try:
                presented = endpoint_id_of_cert(der)
            except ValueError as exc:
                proto.close()
                raise PeerAuthenticationError(f"relay {url}", f"bad certificate: {exc}") from None
            if presented != url.pin:
                proto.close()
                raise _RefusedByRelay(
                    f"relay {url}",
                    f"{IDENTITY_MISMATCH}: expected {url.pin}, presented {presented}",
                    "pin_mismatch",
                )
        self._cert_hash = cert_fingerprint(der)
        return proto

    async def _tunnel(self, proxy: ProxyUrl) -> socket.socket:
        """A CONNECT tunnel to the relay through ``proxy``; a refusal for credentials or
        policy (407, 403) is reported to waiters at once, others are retried."""
        try:
            return await open_tunnel(proxy, self.url.host, self.url.port)
        except ProxyRefused as exc:
            what = f"proxy {proxy} refused the tunnel: {exc}"
            if exc.status in (403, 407):
                raise _RefusedByRelay(f"relay {self.url}", what, "proxy_refused") from None
            raise RelayProtocolError(what) from None
        except RelayProtocolError as exc:  # "answered CONNECT with 'SSH-2.0-...', not HTTP"
            raise RelayProtocolError(f"proxy {proxy} {exc}") from None
        except OSError as exc:
            raise ConnectionError(f"proxy {proxy}: {exc or type(exc).__name__}") from None

    async def _handshake(
        self, proto: RelaySessionProtocol, writer: asyncio.Transport
    ) -> tuple[float, float]:
        """Upgrade and authenticate; returns the PING interval and the silence after
        which the session counts as dead (:func:`~.relay_config.relay_silence`)."""
        bare = self._bare_upgrade
        if bare:
            proto.websocket_key = None
            # A one-off probe for a relay from before WebSocket framing: unless it gets
            # a 101, the next attempt is a WebSocket handshake again.
            self._bare_upgrade = False
        writer.write(upgrade_request(self.url.authority, proto.records_secret, proto.websocket_key))
        answer = await proto.upgrade_answer()
        if not proto.upgraded:
            status = " ".join(answer.start_line)
            if not bare and answer.start_line[1:2] in (["400"], ["426"]):
                # What a relay from before WebSocket framing answers the handshake.
                self._bare_upgrade = True
                status += "; trying the bare upgrade next, as an older relay may want"
            said = proto.refusal_text
            raise RelayProtocolError(
                f"relay refused the upgrade: {status}" + (f" ({said})" if said else "")
            )
        self._bare_upgrade = bare  # the form that worked, kept for the next sessions
        writer = proto.writer
        kind, _, body = await proto.next_frame()
        if kind is not RelayFrameType.CHALLENGE:
            raise RelayProtocolError(f"expected CHALLENGE, got {kind.name}")
        challenge, name_bound = parse_challenge(body)
        if name_bound and self.url.pin is not None:
            # Only a relay behind a proxy with certificates of its own asks for this; a
            # pinned URL reaches the relay's own TLS, where the certificate binds. Not
            # worth retrying: the relay that holds the pinned key asked it.
            raise PeerAuthenticationError(
                f"relay {self.url}",
                "asked for a proof bound to its name over a connection to its pinned key "
                "(a relay asks that only behind a proxy with certificates of its own)",
            )
        me = bytes(self.endpoint_id)
        message = proof_message(self.url, self._cert_hash, challenge, me, name_bound=name_bound)
        sig = self._key.sign(message)
        writer.write(encode_frame(RelayFrameType.AUTH, me + sig + self._token.encode()))
        kind, _, body = await proto.next_frame()
        if kind is RelayFrameType.ERROR:
            why = body.decode("utf-8", "replace")
            refusal = CREDENTIAL_REFUSALS.get(why)
            if refusal is not None:  # not let in: reported to waiters at once
                if why == BAD_TOKEN_TEXT:
                    why += (
                        " (the token sent is not the relay's)"
                        if self._token
                        else " (this relay needs a token and none was sent: pass "
                        "relay_token= (p2pdist doctor: --token), or set "
                        "P2PDIST_RELAY_TOKEN where Group.from_env or p2pdist doctor "
                        "reads it)"
                    )
                raise _RefusedByRelay(f"relay {self.url}", f"refused us: {why}", refusal)
            # A busy relay's answer (full, evicted, timed out, shutting down): this
            # attempt failed, the next one may not; waiters keep waiting.
            raise RelayProtocolError(f"relay turned us away for now: {why}")
        if kind is not RelayFrameType.AUTH_OK:
            raise RelayProtocolError(f"expected AUTH_OK, got {kind.name}")
        info = decode_map(body)
        max_dgram = info.get("max_datagram")
        # What this session's relay takes (docs/protocol.md: 65504 when it says no size
        # in range), not what an earlier session's relay took.
        if isinstance(max_dgram, int) and 1200 <= max_dgram <= MAX_DATAGRAM:
            self.max_datagram = max_dgram
        else:
            self.max_datagram = MAX_DATAGRAM
        keepalive = info.get("keepalive")
        interval = self.config.keepalive or relay_keepalive(keepalive)
        limits = {k: float(v) for k, v in info.items() if isinstance(v, int | float)}
        rate = limits.get("rate", 0.0)
        limited = math.isfinite(rate) and rate > 0  # (a relay may send anything)
        cap = max(MIN_RATE_QUEUE, int(rate * RATE_QUEUE_SECONDS)) if limited else math.inf
        silence = relay_silence(interval, keepalive, rate if limited else 0.0)
        self._queue_cap = int(min(self.config.send_buffer, cap))
        observed = info.get("observed")
        self._observation_off = info.get("stun_ports") == []
        self._set(
            state=RelayState.CONNECTED,
            observed=observed if isinstance(observed, str) else None,
            stun_ports=parse_stun_ports(info.get("stun_ports")),
            connects=self._status.connects + 1,
            last_error=None,
            refusal=None,
            limits=limits,
            records=writer.get_extra_info("records"),
            framing=proto.framing,
            proof="name" if name_bound else "certificate",
        )
        return interval, silence

    async def _session(self) -> float | None:
        """One session; returns the relay's retry_after when it asked us to reconnect."""
        # One bound for TCP, TLS, the upgrade and authentication together.
        deadline = asyncio.get_running_loop().time() + self.config.connect_timeout
        try:
            async with asyncio.timeout_at(deadline):
                proto = await self._open()
        except TimeoutError:
            via = f" (through proxy {self.proxy})" if self.proxy is not None else ""
            raise self._too_slow(f"TCP and TLS{via}") from None
        writer = proto.transport
        assert writer is not None  # connection_made ran before create_connection returned
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    interval, silence = await self._handshake(proto, writer)
            except TimeoutError:
                raise self._too_slow("the upgrade and authentication") from None
            writer = proto.writer
            self._writer = writer
            if self.max_datagram != self._told_datagram:
                self._tell_datagram_size()
            self._authed_at = time.monotonic()
            self._refused.clear()
            self._connected.set()
            self._said_unreachable = False
            self._warned_refusal = None
            log.info("relay %s: connected as %s", self.url, self.endpoint_id.short())
            proto.dispatch_to(lambda frame: self._handle(frame, writer))
            pinger = asyncio.get_running_loop().create_task(self._keepalive(writer, interval))
            try:
                return await self._watch(proto, silence)
            finally:
                pinger.cancel()
        finally:
            proto.close()

    def _tell_datagram_size(self) -> None:
        """Tell ``on_datagram_size`` that this session takes another datagram size than
        the last one (QUIC connections through us must build theirs to fit, or every
        full-size datagram would be refused here until they time out)."""
        hook = self.on_datagram_size
        self._told_datagram = self.max_datagram
        if hook is None:
            return
        try:
            hook(self.max_datagram)
        except Exception:
            log.exception("relay %s: error while adapting to its datagram size", self.url)

    def _too_slow(self, step: str) -> P2PTimeoutError:
        return P2PTimeoutError(
            f"relay {self.url}: {step} not done within connect_timeout "
            f"({self.config.connect_timeout:g} s)"
        )

    async def _keepalive(self, writer: asyncio.Transport, interval: float) -> None:
        while not writer.is_closing():
            await asyncio.sleep(interval)
            self._send_ping(writer)

    def _send_ping(self, writer: asyncio.Transport) -> bytes:
        now = time.monotonic()
        self._ping_sent = {k: t for k, t in self._ping_sent.items() if now - t < 60.0}
        nonce = _random.randbytes(8)
        self._ping_sent[nonce] = now
        writer.write(encode_frame(RelayFrameType.PING, nonce))
        return nonce

    async def ping(self, timeout: float = 5.0) -> float:
        """One round trip to the relay over the session (PING/PONG), seconds;
        ConnectionBrokenError when the session ends first (ConnectionClosedError on
        :meth:`close`), P2PTimeoutError when no PONG comes within ``timeout``."""
        w = self._writer
        if w is None or w.is_closing():
            raise ConnectionBrokenError(f"relay {self.url}", "no session")
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        nonce = self._send_ping(w)
        self._ping_waiters[nonce] = fut
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            raise P2PTimeoutError(f"relay {self.url}: no PONG within {timeout:g} s") from None
        finally:
            self._ping_waiters.pop(nonce, None)

    async def _watch(self, proto: RelaySessionProtocol, silence: float) -> float | None:
        """Until the session ends (frames are handled as they arrive): its retry-after,
        or its error; ConnectionBrokenError when the relay is silent for ``silence`` s."""
        loop = asyncio.get_running_loop()
        while not proto.done.done():
            left = proto.last_rx + silence - loop.time()
            if left <= 0:
                raise ConnectionBrokenError(f"relay {self.url}", f"silent for {silence:g} s")
            await asyncio.wait([proto.done], timeout=left)
        return proto.done.result()

    def _peer_id(self, raw: bytes) -> EndpointId | None:
        """The endpoint id a frame from the relay names; None (the frame is dropped and
        counted in :attr:`RelayStatus.bad_peer_ids`) when those bytes cannot be one. An
        honest relay only forwards from authenticated clients, so this is a hostile or
        broken relay, which must not end the session of everyone else's datagrams."""
        try:
            return endpoint_id_of(raw)
        except UsageError as exc:
            self._bad_peer_ids += 1
            if self._bad_peer_ids == 1:
                log.warning(
                    "relay %s sent a frame from an impossible endpoint id: %s", self.url, exc
                )
            return None

    def _handler_failed(self, what: str, peer: EndpointId) -> None:
        """Count a handler of ours that raised; log it with its traceback the 1st, 10th,
        100th... time (a handler that fails on every datagram must not flood the log)."""
        self._handler_errors += 1
        n = self._handler_errors
        if _power_of_ten(n):
            log.exception(
                "relay %s: error while handling %s %s (%d so far; the session goes on)",
                self.url,
                what,
                peer.short(),
                n,
            )

    def _handle(self, frame: RelayFrame, writer: asyncio.Transport) -> float | None:
        """Act on one frame from the relay; returns retry_after on RECONNECT."""
        kind, body = frame.kind, frame.body
        if kind is RelayFrameType.RECV:
            self._received += 1
            on_datagram = self.on_datagram
            if on_datagram is not None:
                src = self._peer_id(frame.peer)
                if src is not None:
                    try:
                        on_datagram(src, body)
                    except Exception:  # one datagram must never end everyone's session
                        self._handler_failed("a datagram relayed from", src)
        elif kind is RelayFrameType.PEER_GONE:
            on_peer_gone = self.on_peer_gone
            if len(body) == 32 and on_peer_gone is not None:
                gone = self._peer_id(body)
                if gone is not None:
                    try:
                        on_peer_gone(gone)
                    except Exception:
                        self._handler_failed("the relay's notice that it cannot reach", gone)
        elif kind is RelayFrameType.PING:
            if len(body) != PING_LEN:
                raise RelayProtocolError(f"PING of {len(body)} bytes (expected {PING_LEN})")
            if may_answer_ping(writer):
                writer.write(encode_frame(RelayFrameType.PONG, body))
        elif kind is RelayFrameType.PONG:
            sent = self._ping_sent.pop(body, None)
            if sent is not None:
                rtt = time.monotonic() - sent
                self._set(rtt=rtt)
                waiter = self._ping_waiters.pop(body, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(rtt)
        elif kind is RelayFrameType.RECONNECT:
            info = decode_map(body)
            after = info.get("retry_after", 0.5)
            reason = info.get("reason", "relay asked clients to reconnect")
            self._set(last_error=f"relay going away: {reason}")
            log.info("relay %s asks clients to reconnect: %s", self.url, reason)
            fine = isinstance(after, int | float)
            return max(0.0, min(float(after), MAX_RETRY_AFTER)) if fine else 0.5
        elif kind is RelayFrameType.ERROR:
            text = body.decode("utf-8", "replace") or "error"
            if text == REPLACED_TEXT:
                raise _Replaced(
                    f"relay {self.url}",
                    f"{text} (id {self.endpoint_id.short()}): another process uses this "
                    "endpoint key (the same seed and rank started twice?)",
                )
            raise ConnectionBrokenError(f"relay {self.url}", text)
        else:
            raise RelayProtocolError(f"unexpected {kind.name} from the relay")
        return None
