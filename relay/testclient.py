"""A minimal relay client on asyncio streams, for tests, benchmarks and smoke checks.

It speaks the protocol of docs/protocol.md section 8 step by step and lets a test break
any step (claim another id, corrupt the signature, send raw bytes). It is not the
production client (``p2pdist.transport.relay_path``): no reconnects, no keepalive task.

    client = await RelayTestClient.open("https://127.0.0.1:8443/?pin=...")
    info = await client.authenticate(SecretKey.generate())   # the AUTH_OK map
    client.send(other_id, b"datagram")
    src, data = await client.recv()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from typing import Any

from p2pdist.identity import EndpointId, SecretKey
from p2pdist.tls import endpoint_id_of_cert
from p2pdist.wire.relay import (
    RelayFrameDecoder,
    RelayFrameType,
    RelayProtocolError,
    RelayUrl,
    cert_fingerprint,
    decode_addressed,
    decode_map,
    encode_addressed,
    encode_frame,
    parse_challenge,
    proof_message,
    upgrade_request,
)

__all__ = ["RelayClosed", "RelayRefused", "RelayTestClient", "http_get"]


class RelayRefused(Exception):
    """The relay answered with ERROR; ``reason`` is its text, ``client`` names who was
    refused (short endpoint id) when known."""

    def __init__(self, reason: str, client: str | None = None) -> None:
        super().__init__(reason if client is None else f"{client}: {reason}")
        self.reason = reason
        self.client = client


class RelayClosed(ConnectionError):
    """The relay closed the connection."""


def client_context(url: RelayUrl, cafile: str | None = None) -> ssl.SSLContext:
    """TLS 1.3 context: CA-verified for a plain URL, key-pinned (checked after the
    handshake by :meth:`RelayTestClient.open`) for ``?pin=``."""
    if url.pin is None:
        ctx = ssl.create_default_context(cafile=cafile)
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the pin is checked right after the handshake
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def _unverified_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # liveness only: nothing is trusted or sent
    return ctx


def _presented_id(der: bytes) -> EndpointId | None:
    """The endpoint id of the relay's certificate; None when it is not an Ed25519 one."""
    try:
        return endpoint_id_of_cert(der)
    except ValueError:
        return None


async def _tls_open(
    url: RelayUrl, cafile: str | None, timeout: float, *, verify: bool = True
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    ctx = client_context(url, cafile) if verify else _unverified_context()
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(url.host, url.port, ssl=ctx, server_hostname=url.host),
        timeout,
    )
    sslobj = writer.get_extra_info("ssl_object")
    der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
    if not der:
        writer.close()
        raise ssl.SSLError("relay presented no certificate")
    if verify and url.pin is not None and _presented_id(der) != url.pin:
        writer.close()
        raise ssl.SSLError("relay key does not match the pin in its URL")
    return reader, writer, der


async def http_get(
    url: str | RelayUrl,
    path: str,
    *,
    cafile: str | None = None,
    timeout: float = 10.0,
    verify: bool = True,
) -> tuple[int, str]:
    """``GET path`` on the relay port: (status, body), all within ``timeout`` seconds.

    ``verify=False`` checks neither the pin nor the certificate (a liveness probe of a
    local process: nothing is trusted or sent)."""
    u = url if isinstance(url, RelayUrl) else RelayUrl.parse(url)
    async with asyncio.timeout(timeout):
        reader, writer, _ = await _tls_open(u, cafile, timeout, verify=verify)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {u.authority}\r\n\r\n".encode())
            raw = await reader.read()
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body.decode("utf-8")


def _deadline(timeout: float) -> float:
    return asyncio.get_running_loop().time() + timeout


def _left(deadline: float) -> float:
    """Seconds to ``deadline`` (0 still returns frames already received)."""
    return max(0.0, deadline - asyncio.get_running_loop().time())


class RelayTestClient:
    """One connection to a relay, after the upgrade and the CHALLENGE."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cert_der: bytes
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.cert_der = cert_der
        self.challenge = b""
        self.url: RelayUrl | None = None
        """The URL dialed (set by :meth:`open`)."""
        self.name_bound = False
        """Whether AUTH binds the relay's name (a relay behind a proxy with certificates
        of its own asked for it), not the certificate."""
        self.endpoint: EndpointId | None = None
        self.auth_ok: dict[str, Any] = {}
        self._decoder = RelayFrameDecoder()
        self._frames: collections.deque[tuple[RelayFrameType, bytes]] = collections.deque()

    @classmethod
    async def open(
        cls, url: str, *, cafile: str | None = None, timeout: float = 10.0
    ) -> RelayTestClient:
        """TLS, the HTTP upgrade and the CHALLENGE frame."""
        u = RelayUrl.parse(url)
        reader, writer, der = await _tls_open(u, cafile, timeout)
        try:
            writer.write(upgrade_request(u.authority))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
            if not head.startswith(b"HTTP/1.1 101 "):
                raise RelayRefused(head.decode("latin-1").split("\r\n", 1)[0])
            client = cls(reader, writer, der)
            kind, body = await client.next_frame(timeout)
            if kind is not RelayFrameType.CHALLENGE:
                raise RelayRefused(f"expected CHALLENGE, got {kind.name}")
            try:
                client.challenge, name_bound = parse_challenge(body)
            except RelayProtocolError as exc:
                raise RelayRefused(str(exc)) from None
            if name_bound and u.pin is not None:  # as RelayPath: never for a pinned URL
                raise RelayRefused("name-bound challenge over a pinned connection")
            client.url, client.name_bound = u, name_bound
        except BaseException:
            writer.close()
            raise
        return client

    def auth_body(
        self, key: SecretKey, token: str | bytes = b"", *, claim: bytes | None = None
    ) -> bytes:
        """An AUTH body signed by ``key``; ``claim`` puts another id in it (a forgery)."""
        my_id = bytes(key.endpoint_id)
        claimed = my_id if claim is None else claim
        assert self.url is not None  # made by open()
        fingerprint = cert_fingerprint(self.cert_der)
        sig = key.sign(
            proof_message(
                self.url, fingerprint, self.challenge, claimed, name_bound=self.name_bound
            )
        )
        tok = token.encode("utf-8") if isinstance(token, str) else token
        return claimed + sig + tok

    async def authenticate(
        self,
        key: SecretKey,
        token: str | bytes = b"",
        *,
        claim: bytes | None = None,
        timeout: float = 10.0,
    ) -> dict[str, Any]:
        """Send AUTH and return the AUTH_OK map; RelayRefused with the ERROR text."""
        self.write_frame(RelayFrameType.AUTH, self.auth_body(key, token, claim=claim))
        kind, body = await self.next_frame(timeout)
        who = key.endpoint_id.short()
        if kind is RelayFrameType.ERROR:
            raise RelayRefused(body.decode("utf-8", "replace"), who)
        if kind is not RelayFrameType.AUTH_OK:
            raise RelayRefused(f"expected AUTH_OK, got {kind.name}", who)
        self.endpoint = key.endpoint_id
        self.auth_ok = decode_map(body)
        return self.auth_ok

    # ---- frames -----------------------------------------------------------------------

    def write_frame(self, kind: RelayFrameType, body: bytes = b"") -> None:
        """Send one frame."""
        self.writer.write(encode_frame(kind, body))

    def send(self, dest: EndpointId | bytes, datagram: bytes) -> None:
        """SEND ``datagram`` to ``dest``."""
        self.writer.write(encode_addressed(RelayFrameType.SEND, dest, datagram))

    def send_raw(self, data: bytes) -> None:
        """Write arbitrary bytes."""
        self.writer.write(data)

    async def drain(self) -> None:
        """Wait for the stream's write buffer to go below its high-water mark."""
        await self.writer.drain()

    @property
    def label(self) -> str:
        """The short endpoint id once authenticated, for error messages."""
        return self.endpoint.short() if self.endpoint is not None else "unauthenticated client"

    async def next_frame(self, timeout: float = 10.0) -> tuple[RelayFrameType, bytes]:
        """The next frame of any type; RelayClosed at EOF, TimeoutError after ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                while not self._frames:
                    data = await self.reader.read(256 * 1024)
                    if not data:
                        raise RelayClosed(f"{self.label}: relay closed the connection")
                    self._frames.extend(self._decoder.feed(data))
        except TimeoutError:
            raise TimeoutError(f"{self.label}: no frame from the relay in {timeout:g} s") from None
        return self._frames.popleft()

    async def recv(self, timeout: float = 10.0) -> tuple[bytes, bytes]:
        """The next RECV (source id, datagram) within ``timeout`` seconds, skipping PONG
        and PEER_GONE; RelayRefused on ERROR."""
        deadline = _deadline(timeout)
        while True:
            kind, body = await self.next_frame(_left(deadline))
            if kind is RelayFrameType.RECV:
                return decode_addressed(body)
            if kind is RelayFrameType.ERROR:
                raise RelayRefused(body.decode("utf-8", "replace"), self.label)

    async def expect(self, kind: RelayFrameType, timeout: float = 10.0) -> bytes:
        """Skip frames until one of ``kind`` arrives within ``timeout`` s; return its body."""
        deadline = _deadline(timeout)
        while True:
            got, body = await self.next_frame(_left(deadline))
            if got is kind:
                return body

    async def wait_closed(self, timeout: float = 10.0) -> list[tuple[RelayFrameType, bytes]]:
        """Read until the relay closes the connection; the frames seen on the way.
        TimeoutError when it is still open after ``timeout`` seconds."""
        deadline = _deadline(timeout)
        seen: list[tuple[RelayFrameType, bytes]] = []
        try:
            while True:
                seen.append(await self.next_frame(_left(deadline)))
        except TimeoutError:  # an OSError too, but the connection is still open
            raise
        except OSError:  # RelayClosed, resets, TLS errors
            return seen

    async def close(self) -> None:
        """Close our side (bounded)."""
        self.writer.close()
        with contextlib.suppress(TimeoutError, OSError):
            await asyncio.wait_for(self.writer.wait_closed(), 5.0)
