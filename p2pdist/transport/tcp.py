"""TCP transport: TLS 1.3 pinned to endpoint ids (default) or authenticated plaintext.

Thin asyncio glue around the sans-I/O pieces: :mod:`p2pdist.wire.handshake` for the
preamble (run by :class:`.tcp_handshake.TcpHandshake`, the handshake half of
:class:`TcpConnection`), and :class:`.framed.FramedConnection` (shared with QUIC) for
frames, keepalive, per-channel delivery and close. Received payloads land directly in
their own buffers (``asyncio.BufferedProtocol``), so bulk data is copied once by the
kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

from ..errors import (
    ConnectionBrokenError,
    ConnectionClosedError,
    P2PError,
    PeerAuthenticationError,
    PeerTimeoutError,
    RemoteProtocolError,
    UsageError,
)
from ..identity import EndpointId, SecretKey
from ..settings import as_int
from ..tasks import cancel_and_wait
from ..wire.handshake import RecordReader
from .aeadpipe import CIPHER, MAX_RECORD, AeadPipe, RecordError
from .base import Address, TransportConfig, is_identity_mismatch
from .framed import EndpointBase
from .happyeyeballs import connect_tcp_any, connection_on
from .listener import Listener
from .pathinfo import PathInfo, single_path
from .paths import path_key
from .tcp_handshake import _HANDSHAKE_BUFFER_PAUSE, TLS_MISMATCH_HINT, TcpHandshake
from .tlspipe import TLS_BACKLOG, TlsPipe

__all__ = ["TLS_MISMATCH_HINT", "TcpConnection", "TcpTransport", "parse_address"]

log = logging.getLogger(__name__)

_SMALL_WRITE = 64 * 1024
_TLS_SLICE = 256 * 1024
"""Plaintext encrypted and written at a time of a large payload, in TLS records (AES-GCM
records take :data:`~p2pdist.transport.aeadpipe.MAX_RECORD` at a time: one record each,
a quarter of the Python calls of 256 KiB; docs/performance.md)."""
_ASYNCIO_PLAIN_COPIES = sys.version_info < (3, 12)
_DISCARD = memoryview(bytearray(64 * 1024))
"""Where a closing connection reads what still comes (only to see the peer's end)."""

try:
    import fcntl
    import termios
except ImportError:  # pragma: no cover - not on this platform
    fcntl = termios = None  # type: ignore[assignment]


def kernel_unsent(sock: Any) -> int:
    """Bytes in ``sock``'s kernel send queue the peer has not acknowledged (Linux; 0
    where the platform cannot tell)."""
    if fcntl is None or sock is None:
        return 0
    try:  # TIOCOUTQ on a socket is SIOCOUTQ: sent or not, what the peer has not acked
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0])
    except (OSError, ValueError):
        return 0


_TCP_INFO_RTT = 68
_TCP_INFO_MIN_RTT = 148
"""Offsets of ``tcpi_rtt`` and ``tcpi_min_rtt`` (microseconds, u32) in Linux's
``struct tcp_info``."""
_NO_RTT = 0xFFFFFFFF
"""What ``tcpi_min_rtt`` holds before the first sample."""


def _tcp_info(sock: Any, size: int) -> bytes:
    """The first ``size`` bytes of Linux's ``struct tcp_info`` for ``sock`` (fewer on an
    older kernel); empty off Linux (other systems lay it out otherwise) or on error."""
    if sock is None or not sys.platform.startswith("linux") or not hasattr(socket, "TCP_INFO"):
        return b""
    try:
        info: bytes = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, size)
        return info
    except (OSError, ValueError):
        return b""


def kernel_rtt(sock: Any, *, least: bool = True) -> float | None:
    """The least round trip the kernel measured on TCP socket ``sock`` (its smoothed one
    on kernels that keep no least), or with ``least=False`` its smoothed one, seconds;
    None before the first sample, and off Linux."""
    info = _tcp_info(sock, _TCP_INFO_MIN_RTT + 4)
    for at in (_TCP_INFO_MIN_RTT, _TCP_INFO_RTT) if least else (_TCP_INFO_RTT,):
        if len(info) >= at + 4:
            (micros,) = struct.unpack_from("I", info, at)
            if micros and micros != _NO_RTT:
                return float(micros) / 1e6
    return None


_TCP_CLOSE_WAIT = 8
"""Linux's ``tcpi_state`` (the first byte of ``struct tcp_info``) once the peer's FIN
is in."""


def peer_has_ended(sock: Any) -> bool:
    """Whether TCP socket ``sock`` holds the peer's end of the stream (its FIN), read or
    not (Linux; False where the platform cannot tell)."""
    info = _tcp_info(sock, 1)
    return bool(info) and info[0] == _TCP_CLOSE_WAIT


def _write_keeps_reference(transport: asyncio.BaseTransport) -> bool:
    """Whether ``transport.write(memoryview)`` may keep a reference to the part of the
    buffer it could not send at once (so the caller must not change it afterwards).

    asyncio's plain socket transport copies the unsent rest before 3.12 and queues a
    reference from 3.12 on; uvloop's always queues a reference. (TLS connections hand
    the transport fresh ciphertext, which nobody changes.)
    """
    return not (_ASYNCIO_PLAIN_COPIES and type(transport).__module__.startswith("asyncio"))


_CAN_READ_NOW = hasattr(os, "readv")
"""Whether :meth:`TcpConnection._read_now` can read the socket's descriptor itself."""


def _recv_into(fd: int, buf: memoryview) -> int:
    """Read what non-blocking ``fd`` holds into ``buf``: the bytes read (0 at its end);
    BlockingIOError when nothing is there. No duplicate descriptor, no socket object."""
    return os.readv(fd, (buf,))


_HANDSHAKE_READ = 16 * 1024
"""Bytes read per socket read during the handshake (its records are a few KiB)."""
_EVICT_AFTER = 1.0
"""Seconds an incoming handshake must have waited before a newer one may evict it when
the handshake slots are full (a real handshake takes milliseconds)."""


def _port_text(text: str) -> int | None:
    """A port written in ASCII digits only (``int()`` would also take " 80", "+80",
    "8_0" and other scripts' digits), or None."""
    return int(text) if text.isascii() and text.isdigit() else None


def _without(
    endpoints: list[tuple[str, int]], answered: tuple[str, int] | None
) -> list[tuple[str, int]]:
    """``endpoints`` less the one (an IP literal) that ``answered`` came from."""
    if answered is None:
        return endpoints
    ip, port = ipaddress.ip_address(answered[0]), answered[1]

    def same(endpoint: tuple[str, int]) -> bool:
        try:
            return endpoint[1] == port and ipaddress.ip_address(endpoint[0]) == ip
        except ValueError:  # a name: not the one that answered, as far as we know
            return False

    return [e for e in endpoints if not same(e)]


def parse_address(address: Address) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or ``(host, port)`` -> (host, port); anything
    else is a UsageError."""
    port: int | None
    if isinstance(address, tuple) and len(address) == 2:
        host, raw = address
        port = _port_text(raw) if isinstance(raw, str) else as_int(raw)
    elif isinstance(address, str):
        text = address.strip()
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]:")
            port_text = rest if sep else ""
        else:
            host, _, port_text = text.rpartition(":")
        port = _port_text(port_text)
    else:
        raise UsageError(f"address must be 'host:port' or (host, port), got {address!r}")
    if not isinstance(host, str) or not host or port is None or not 0 <= port <= 65535:
        raise UsageError(f"address {address!r} is not host:port")
    if ":" not in host:  # (an IPv6 literal is no name)
        try:  # what getaddrinfo will do with a name: an empty or overlong label fails
            host.encode("idna")
        except UnicodeError as exc:
            raise UsageError(f"address {address!r} is not host:port: {exc}") from None
    return host, port


class TcpConnection(TcpHandshake, asyncio.BufferedProtocol):
    """One TCP connection to one authenticated peer (also its asyncio protocol)."""

    def __init__(
        self, owner: TcpTransport, *, server_side: bool, expected: EndpointId | None = None
    ) -> None:
        super().__init__(
            owner.config,
            label=f"peer {expected.short()}" if expected else "incoming connection",
            peer=expected,
            on_finish=owner._forget,
            stalls=owner.send_stalls,
        )
        self._owner = owner
        self._server_side = server_side
        self._expected = expected
        self._transport: asyncio.Transport | None = None
        self._write_copy = True
        """Whether borrowed bytes must be copied before the transport queues them (see
        :func:`_write_keeps_reference` and :meth:`_write_borrowed`)."""
        self._tls: TlsPipe | AeadPipe | None = None
        """What protects the socket's bytes in TLS mode: TLS from its handshake on, then
        (when both ends offer it) AES-GCM records under keys agreed inside TLS."""
        self._tls_said = 0
        """Bytes TLS sent by itself while our write buffer stayed above its high mark."""
        self._ssl: ssl.SSLObject | None = None
        self._rx_paused = False
        self._closing = False
        """Closed locally: what still comes is read and dropped until the peer ends too."""
        self._direct: socket.socket | None = None
        """A duplicate of the socket, to send borrowed bytes the kernel takes at once, and
        a large frame's header with its payload in one call (:meth:`_write_pair`)."""
        self._fd: int | None = None
        """The socket's file descriptor while it is open, for :meth:`_read_now`."""
        # Handshake phase state.
        self._hs_buf = bytearray()
        """Where handshake bytes land; allocated when the first bytes come, not when the
        socket is accepted (a silent socket costs no buffer)."""
        self._hs_reader = RecordReader(expect_magic=server_side)
        self._hs_wakeup: asyncio.Future[None] | None = None
        self._lost = self._loop.create_future()

    @property
    def remote_address(self) -> tuple[str, int] | None:
        """The peer's (ip, port) (None before the socket is connected)."""
        name = self._transport.get_extra_info("peername") if self._transport else None
        return (str(name[0]), int(name[1])) if name else None

    @property
    def path_rtt(self) -> float | None:
        """The kernel's least round trip on this TCP connection (Linux; measured from
        the first segments on, and not delayed by either end's event loop), else the
        keepalive's."""
        rtt = kernel_rtt(self._socket())
        return rtt if rtt is not None else super().path_rtt

    @property
    def smoothed_rtt(self) -> float | None:
        """The kernel's smoothed round trip on this TCP connection (Linux), else the
        keepalive's last one (None before either has a sample)."""
        rtt = kernel_rtt(self._socket(), least=False)
        return rtt if rtt is not None else self._stats.rtt

    def _socket(self) -> Any:
        return self._transport.get_extra_info("socket") if self._transport else None

    def _remote_text(self) -> str:
        """The peer's ``ip:port`` (``[ip]:port`` for IPv6), for labels."""
        addr = self.remote_address
        return path_key(addr) if addr is not None else "an unknown address"

    @property
    def encrypted(self) -> bool:
        """True when TLS protects this connection."""
        return self._tls is not None and self._tls.handshake_done

    @property
    def tls_object(self) -> ssl.SSLObject | None:
        """The connection's ``ssl.SSLObject`` (TLS version, peer certificate), or None."""
        return self._ssl

    @property
    def record_protection(self) -> str:
        """What protects the frames: ``"aes-256-gcm"`` (records under keys agreed in
        TLS), ``"tls"`` (TLS records) or ``"none"`` (plaintext mode, or not yet)."""
        if isinstance(self._tls, AeadPipe):
            return CIPHER
        return "tls" if self.encrypted else "none"

    # ---- FramedConnection hooks ----------------------------------------------------------

    def _write(self, data: bytes) -> None:
        assert self._transport is not None
        if self._rx_paused and self._peer_ended_unread():
            return  # a control frame for a peer that has closed (see _peer_ended_unread)
        if self._tls is None:
            self._transport.write(data)
            return
        with contextlib.suppress(P2PError):  # control frames: the failure ends the connection
            self._write_sealed(self._tls, data)

    def _write_sealed(self, tls: TlsPipe | AeadPipe, *parts: bytes | memoryview) -> None:
        """Encrypt ``parts`` and write them; a TLS session that can no longer send (it
        was shut down, or failed) ends the connection, and the error is raised."""
        try:
            data = tls.encrypt(*parts)
        except ssl.SSLError as exc:
            err = ConnectionBrokenError(self.label, f"TLS cannot send: {exc}")
            self.abort(err)
            raise err from None
        if isinstance(data, memoryview):  # AeadPipe's buffer, reused by its next call
            self._write_borrowed(data)
        else:
            assert self._transport is not None
            self._transport.write(data)

    def _write_borrowed(self, data: memoryview) -> None:
        """Write bytes that will change once we return (the caller's array, a reused
        buffer): the transport must not keep a reference to them."""
        t = self._transport
        assert t is not None
        if not self._write_copy:
            t.write(data)  # the transport copies what the kernel does not take at once
            return
        # The transport would queue a reference to what it cannot send at once. Do what
        # asyncio's own transport did before 3.12: send what the kernel takes now (only
        # when nothing is queued, so the order holds) and give the transport a copy of the
        # rest only.
        sent = self._send_now(data)
        if sent < data.nbytes:
            t.write(data[sent:].tobytes())

    def _write_frame(self, header: bytes, payload: memoryview) -> None:
        t = self._transport
        assert t is not None
        if self._rx_paused and self._peer_ended_unread():
            raise ConnectionBrokenError(
                self.label, "it closed the connection (its last messages are still unread here)"
            )
        tls = self._tls
        if payload.nbytes <= _SMALL_WRITE:
            data = b"".join((header, payload)) if payload.nbytes else header  # one copy
            if isinstance(tls, AeadPipe) and len(data) <= MAX_RECORD:
                self._write_borrowed(tls.seal(data))  # one record
            elif tls is not None:
                self._write_sealed(tls, data)  # one record (more for a meta over 1 MiB)
            else:
                t.write(data)
        elif tls is not None:
            # Encrypt and send slice by slice, so each slice is still in cache when it is
            # encrypted and its ciphertext when it is sent (one 8 MiB write would make
            # three passes over memory), and most slices go to the kernel unqueued.
            # The header goes out with the first slice: one write, no lone tiny segment.
            step = _TLS_SLICE if isinstance(tls, TlsPipe) else MAX_RECORD
            self._write_sealed(tls, header, payload[:step])
            for i in range(step, payload.nbytes, step):
                self._write_sealed(tls, payload[i : i + step])
        else:
            self._write_pair(header, payload)

    def _send_now(self, *parts: bytes | memoryview) -> int:
        """Send what the kernel takes at once of ``parts`` through our own handle on the
        socket, only while the transport has nothing queued (so the order holds): the
        bytes sent, 0 when none. A socket error ends the connection and is raised, as
        the transport's own write would have reported it."""
        d, t = self._direct, self._transport
        if d is None or t is None or t.is_closing() or t.get_write_buffer_size():
            return 0
        try:
            return d.sendmsg(parts) if len(parts) > 1 else d.send(parts[0])
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:  # a reset: say so (the transport's next write says EPIPE)
            err = self._end_of_stream_error(str(exc))
            self.abort(err)
            raise err from None

    def _write_pair(self, header: bytes, payload: memoryview) -> None:
        """A large plaintext frame: its header and payload in one ``sendmsg`` when
        nothing is queued. Two writes would send the header as a segment of its own
        (TCP_NODELAY) and could wake the peer for it alone: a system call, a loop turn
        and a read more per frame on both ends."""
        t = self._transport
        assert t is not None
        sent = self._send_now(header, payload)
        if sent < len(header):
            t.write(header[sent:])
            self._write_borrowed(payload)
        elif sent < len(header) + payload.nbytes:  # the rest as any borrowed bytes
            self._write_borrowed(payload[sent - len(header) :])

    def _writable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def _peer_ended_unread(self) -> bool:
        # The peer closed, and its FIN waits behind what our paused reading left unread:
        # anything we write (a keepalive PING, a group's notice, a message) only draws its
        # kernel's reset, and a write after that fails and makes asyncio close our socket
        # with the peer's last frames, its GOODBYE too, still unread in it.
        if not self._rx_paused or self._transport is None:
            return False
        return peer_has_ended(self._transport.get_extra_info("socket"))

    def _set_reading(self, on: bool) -> None:
        self._rx_paused = not on
        if self._transport is not None and not self._transport.is_closing():
            if on:
                self._transport.resume_reading()
            else:
                self._transport.pause_reading()
        if on and self._tls is not None and self._tls.readable:
            # Records that came before the pause wait in the TLS buffer: take them now
            # (not from inside the receive call that resumed us).
            self._loop.call_soon(self._tls_receive)

    async def _shutdown(self) -> None:
        t = self._transport
        if t is None:
            return
        if self._tls is not None and self._tls.handshake_done and not t.is_closing():
            with contextlib.suppress(Exception):  # best effort: GOODBYE said it already
                t.write(self._tls.close_notify())
        self._closing = True
        if self._handshaking:
            # Not a peer yet (a stranger, a port scan): nothing of ours to deliver, so a
            # reply stuck behind a peer that does not read is dropped, not waited for.
            if t.get_write_buffer_size():
                t.abort()
            else:
                t.close()
            return
        if not t.is_closing() and t.can_write_eof():
            # Half-close and read on (dropping it) until the peer closes too: a socket
            # closed with bytes unread (the peer's keepalive PINGs, say) answers them with
            # a reset, and a reset makes the peer's kernel drop what it has not yet read
            # of ours.
            t.write_eof()  # after the queued bytes
            t.resume_reading()
        else:
            t.close()  # after the queued bytes
        sock = t.get_extra_info("socket")
        left = await self._await_flush(
            self._lost, lambda: t.get_write_buffer_size() + kernel_unsent(sock)
        )
        if left:
            # Drop what is still queued (the peer is not reading it), or the socket stays
            # open for as long as the peer wants. (Cancelled: FramedConnection.close drops.)
            t.abort()
        elif left is not None:
            t.close()  # the peer has it all, but has not ended its side: close ours

    def _drop(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def _on_goodbye(self) -> None:
        # Our sends fail from now on, and our side ends too, which ends the peer's close.
        self._finish(self._end_of_stream_error(None))
        self._close_after_peer_end()

    def _close_after_peer_end(self) -> None:
        """Close the socket once the peer ended its side (GOODBYE, EOF, close_notify).
        The peer reads nothing more (it drops what comes while it closes), so what we
        still have queued is dropped: asyncio's close would wait for it to leave, for as
        long as the peer keeps its socket open."""
        t = self._transport
        if t is None or t.is_closing():
            return
        if t.get_write_buffer_size():
            t.abort()
        else:
            t.close()

    # ---- asyncio protocol callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports do not subclass asyncio's classes.
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        self._write_copy = _write_keeps_reference(transport)
        transport.set_write_buffer_limits(high=self._cfg.write_buffer_high)
        sock = transport.get_extra_info("socket")
        if sock is not None and (self._write_copy or not self._cfg.tls):
            with contextlib.suppress(OSError, ValueError):
                # Our own handle on the same (non-blocking) socket, for _write_frame (not
                # needed for TLS where the transport copies); closed in connection_lost.
                self._direct = socket.socket(fileno=os.dup(sock.fileno()))
                self._direct.setblocking(False)
        if sock is not None and _CAN_READ_NOW:
            with contextlib.suppress(OSError, ValueError):
                self._fd = sock.fileno()  # valid while the transport reads (_read_now)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._server_side:
            # Until the handshake proves who it is, a dialer is only where it dials from.
            self.label = f"incoming {self._remote_text()}"
            self._owner._on_incoming(self)

    _READS_EARLY = _CAN_READ_NOW

    def _read_now(self) -> None:
        """Read what the socket holds now, as the event loop would once it reports the
        socket readable: a receiver about to wait for a message that has arrived takes it
        at once, without a trip through the loop (a 4 KiB all_reduce spent some 20 us of
        its 110 on that trip). The loop's own read of the same bytes then finds nothing
        (it expects that); the end of the stream is left to it."""
        if self._can_read_now() and not self._decoder.mid_frame:
            # Not mid-frame: a large payload coming in, a piece of it now is no gain.
            self._read_into(self.get_buffer(-1))

    def _can_read_now(self) -> bool:
        """Whether :meth:`_read_into` may read the socket itself now."""
        t = self._transport
        if self._fd is None or t is None or self._handshaking or self._closing:
            return False
        # Not while paused (by us or anyone); not once the transport closes, which is also
        # what keeps fd ours: the transport closes it only after it stopped reading.
        return self._error is None and t.is_reading()

    def _read_into(self, buf: memoryview) -> None:
        """One read of the socket into ``buf``, handled as the event loop's would be; the
        end of the stream is left to the loop's own read."""
        assert self._fd is not None
        try:
            n = _recv_into(self._fd, buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # what the loop's read would have reported
            self.abort(self._end_of_stream_error(str(exc)))
            return
        if n:
            self.buffer_updated(n)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._closing:
            return _DISCARD
        if self._handshaking:
            if not self._hs_buf:
                self._hs_buf = bytearray(_HANDSHAKE_READ)
            return memoryview(self._hs_buf)
        if self._tls is not None:
            return self._tls.get_buffer()
        return self._decoder.get_buffer(peek=self._fd is not None)

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        if self._handshaking:
            received = memoryview(self._hs_buf)[:nbytes]
            if self._tls is not None:
                self._tls.feed(received)
                buffered = self._tls.buffered
            else:
                self._hs_reader.feed(received)
                buffered = len(self._hs_reader)
            if buffered > _HANDSHAKE_BUFFER_PAUSE and self._transport is not None:
                self._transport.pause_reading()
            self._wake_handshake()
            return
        if self._tls is not None:
            self._tls.buffer_updated(nbytes)
            if self._keepalive is not None:  # any byte is life, a record's first ones too
                self._keepalive.on_receive(self._loop.time())
            self._tls_receive()
            return
        self._decode(self._decoder.buffer_updated, nbytes)
        if self._decoder.read_again and self._can_read_now():
            # A peek took the header after a large payload: its payload, if that is
            # large too, goes straight to its place (FrameDecoder.get_buffer).
            self._read_into(self._decoder.get_buffer())

    def _mid_frame(self) -> bool:
        """Inside a frame also when part of a record is here, not decrypted yet (a
        frame's bytes in it, or the next one's)."""
        tls = self._tls
        return super()._mid_frame() or (tls is not None and tls.buffered > 0)

    def _flush_tls(self) -> None:
        """Send what TLS has to say by itself (handshake messages, alerts, key update
        answers). A peer that makes it say more and more while it reads nothing (it asks
        for key updates) is dropped once TLS said :data:`~.tlspipe.TLS_BACKLOG` bytes
        while our write buffer stayed above ``write_buffer_high``: that buffer must stay
        bounded (our own frames there, a bulk send's, do not count)."""
        assert self._tls is not None
        out = self._tls.outgoing()
        transport = self._transport
        if out and transport is not None and not transport.is_closing():
            if transport.get_write_buffer_size() <= self._cfg.write_buffer_high:
                self._tls_said = 0  # the peer reads: what TLS said before has left
            transport.write(out)
            self._tls_said += len(out)
            if self._tls_said > TLS_BACKLOG and self._error is None:
                queued = transport.get_write_buffer_size()
                err = ConnectionBrokenError(
                    self.label,
                    f"it reads nothing of what TLS must send it ({queued} bytes queued): dropped",
                )
                log.warning("%s", err)
                self.abort(err)

    def _tls_receive(self) -> None:
        """Decrypt the records received so far straight into the frame decoder's buffers
        (a payload lands in its own buffer), until none is whole or reading is paused."""
        tls = self._tls
        assert tls is not None
        while self._error is None and not self._rx_paused:
            # Fill the decoder's buffer with as many records as are here before telling
            # it: one decoder pass per buffer, not per 16 KiB record. A record larger
            # than the room left (a bulk payload after its header's record) waits: the
            # decoder, told what came so far, then offers the payload's own place, and
            # it decrypts straight there.
            try:
                n = tls.fill(self._decoder.get_buffer())
            except (ssl.SSLError, RecordError) as exc:
                # A record that does not decrypt (corrupted or forged in transit: not
                # necessarily the peer's doing), or the peer's fatal alert: the byte
                # stream is broken, as when the socket fails. The records before it were
                # authentic: fill handed their frames (a GOODBYE, say) out first.
                self._flush_tls()  # our alert, best effort: tells the peer why
                what = "TLS error" if isinstance(exc, ssl.SSLError) else "bad record"
                err = ConnectionBrokenError(
                    self.label, f"connection lost: {what}: {exc}", corrupt=True
                )
                log.warning("%s", err)
                self.abort(err)
                return
            if not n:
                break
            self._decode(self._decoder.buffer_updated, n)
        self._flush_tls()  # a key update's answer, say
        if tls.closed_by_peer and self._transport is not None:
            # close_notify: nothing more can be read, and whatever follows would only pile
            # up undecrypted: end as on a TCP EOF (graceful only after GOODBYE).
            self._close_after_peer_end()
        elif not self._rx_paused and tls.stuck and self._error is None:
            self._protocol_error("TLS data that cannot be decrypted is piling up")

    def eof_received(self) -> bool | None:
        # Ended now (not once our queued bytes have left: a send would queue on for good).
        self._finish(self._end_of_stream_error(None))
        self._close_after_peer_end()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fd = None
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if not self._lost.done():
            self._lost.set_result(None)
        if self._ka_timer is not None:
            self._ka_timer.cancel()
        self._finish(self._end_of_stream_error(str(exc) if exc else None))
        self._wake_handshake()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._resume_writing()


class TcpTransport(EndpointBase[TcpConnection]):
    """Authenticated TCP transport (TLS 1.3 unless ``config.tls`` is False)."""

    def __init__(
        self,
        key: SecretKey,
        config: TransportConfig | None = None,
        *,
        accept_from: Callable[[EndpointId], bool | str] | None = None,
        label_for: Callable[[EndpointId], str] | None = None,
    ) -> None:
        super().__init__(key, config, accept_from, label_for)
        self._server: Listener | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._pending: dict[TcpConnection, tuple[float, str]] = {}
        """Incoming connections still handshaking: (loop time accepted, source ip)."""

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Start accepting connections; returns the bound (host, port)."""
        self._check_not_closed()
        if self._server is not None:
            raise UsageError("already listening")
        server = await Listener.open(host, port, lambda: TcpConnection(self, server_side=True))
        if self._closed or self._server is not None:
            # Closed (or listening) while the address was looked up: close() could not
            # see this server, and it would keep the port bound.
            await server.close()
            self._check_not_closed()
            raise UsageError("already listening")
        self._server = server
        return server.address

    async def connect(
        self, peer: EndpointId, address: Address, *, label: str | None = None
    ) -> TcpConnection:
        """Dial ``address`` and authenticate the other end as ``peer``."""
        return await self.connect_any(peer, [address], label=label)

    async def connect_any(
        self, peer: EndpointId, addresses: Sequence[Address], *, label: str | None = None
    ) -> TcpConnection:
        """Dial ``peer``, known at each of ``addresses`` (in order of preference): their
        TCP connects are raced (each starting a moment after the one before, as a name's
        addresses are), and the first that connects is authenticated as ``peer``. An IP
        address whose handshake fails (gone stale and answering as someone else, or with
        garbage, or resetting) is dropped and the others raced again (a host name's
        addresses stand or fall together: discovery gives IP addresses), within the same
        handshake_timeout. When all fail, the error is the last one that is not an
        identity mismatch (it came from the peer itself: a full accept queue, a refusal),
        else the first mismatch."""
        name = label or self.label_for(peer)
        self._check_not_closed()
        if not addresses:
            raise UsageError(f"{name}: no address to dial")
        try:
            endpoints = [parse_address(a) for a in addresses]
        except UsageError as exc:
            raise UsageError(f"{name}: {exc}") from None
        self._check_not_self(peer, name)
        where = ", ".join(path_key(e) for e in endpoints)
        conn: TcpConnection | None = None
        deadline = asyncio.timeout(self.config.handshake_timeout)
        mismatch: P2PError | None = None  # the first address that answered as another
        said: P2PError | None = None  # the last handshake that failed otherwise
        try:
            async with deadline:
                while True:
                    # (Addresses are raced: one whose packets are dropped must not hold
                    # the dial until the deadline.)
                    sock = await connect_tcp_any(endpoints)
                    _, conn = await connection_on(
                        sock, lambda: TcpConnection(self, server_side=False, expected=peer)
                    )
                    conn.label = name
                    self._check_not_closed()  # closed meanwhile: close() could not see it
                    self._connections.add(conn)
                    try:
                        await conn.client_handshake()
                        break
                    except P2PError as exc:
                        if isinstance(exc, ConnectionClosedError):
                            raise  # closed here: no address will do
                        if not is_identity_mismatch(exc):
                            said = exc
                        elif mismatch is None:
                            mismatch = exc
                        rest = _without(endpoints, conn.remote_address)
                        if not rest or len(rest) == len(endpoints):
                            raise (said or mismatch or exc) from None
                        conn.abort(exc)
                        conn, endpoints = None, rest
                self._check_not_closed()  # never hand out a live conn of a closed transport
        except OSError as exc:  # TimeoutError is one, and so is an ETIMEDOUT from connect
            if deadline.expired():
                if conn is not None:
                    conn.abort(PeerTimeoutError(name, "handshake timed out"))
                if said is not None:  # the peer's own word, before the others kept silent
                    raise said from None
                raise PeerTimeoutError(
                    name, f"handshake with {where} took over {self.config.handshake_timeout} s"
                ) from None
            if isinstance(exc, P2PError):  # a P2PTimeoutError, already naming the peer
                if conn is not None:
                    conn.abort(exc)
                raise
            why = str(exc)
            if isinstance(exc, ConnectionRefusedError):  # asyncio says "Connect call failed"
                why = "connection refused (nothing listens there: not started yet, or gone?)"
            err = ConnectionBrokenError(name, f"cannot connect to {where}: {why}")
            if conn is not None:
                conn.abort(err)
            raise err from None
        except BaseException as exc:
            if conn is not None:
                conn.abort(exc if isinstance(exc, P2PError) else ConnectionClosedError("cancelled"))
            raise
        return conn

    def paths(self) -> dict[EndpointId, PathInfo]:
        """How each connected peer is reached: one direct TCP path each, with its frame
        counters and its smoothed round trip (see :class:`~.pathinfo.PathInfo`)."""
        out: dict[EndpointId, PathInfo] = {}
        for conn in sorted(self._connections, key=lambda c: c.closed):  # open ones first
            if conn._peer is None or conn._handshaking or conn._peer in out:
                continue  # a handshaking peer's id is only claimed
            addr = conn.remote_address
            remote = path_key(addr) if addr is not None else "?"
            out[conn._peer] = single_path(conn._peer, remote, conn.stats, conn.smoothed_rtt, "tcp")
        return out

    def _on_incoming(self, conn: TcpConnection) -> None:
        if self._closed:
            conn.abort(ConnectionClosedError("transport is closed"))
            return
        now = asyncio.get_running_loop().time()
        address = conn.remote_address
        source = address[0] if address is not None else "?"
        if not self._make_room(now):
            conn.abort(ConnectionClosedError(f"{conn.label}: too many incoming handshakes"))
            self._note_handshake_slots_full(
                len(self._pending),
                f"closing new connections at once, the last from {conn._remote_text()}",
            )
            return
        self._pending[conn] = (now, source)
        self._connections.add(conn)
        task = asyncio.get_running_loop().create_task(self._serve_handshake(conn))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    def _make_room(self, now: float) -> bool:
        """Whether a new handshake may start while ``max_pending_handshakes`` are in
        progress: the oldest handshake of the source holding the most makes way if it
        has waited :data:`_EVICT_AFTER` seconds (a real one takes milliseconds, so it is
        silent sockets that go; counted in ``refused_handshakes``), else the new one is
        turned away. (No cap per source below that: many real peers may share an
        address, on one host or behind one NAT, and dial at once.)"""
        if len(self._pending) < self.config.max_pending_handshakes:
            return True
        held: dict[str, int] = {}
        for _, src in self._pending.values():
            held[src] = held.get(src, 0) + 1
        heaviest = max(held, key=held.__getitem__)
        oldest = min(
            (c for c, (_, src) in self._pending.items() if src == heaviest),
            key=lambda c: self._pending[c][0],
        )
        if now - self._pending[oldest][0] < _EVICT_AFTER:
            return False
        full = len(self._pending)
        del self._pending[oldest]
        oldest.abort(PeerTimeoutError(oldest.label, "handshake evicted for a newer connection"))
        self._note_handshake_slots_full(full, "evicting the oldest silent ones")
        return True

    async def _serve_handshake(self, conn: TcpConnection) -> None:
        try:
            async with asyncio.timeout(self.config.handshake_timeout) as bound:
                await conn.server_handshake()
        except TimeoutError as exc:
            if bound.expired():
                conn.abort(PeerTimeoutError(conn.label, "handshake timed out"))
                log.warning("%s: incoming handshake timed out", conn.label)
            else:  # evicted by _make_room, which warned (its error is a PeerTimeoutError)
                log.debug("%s: %s", conn.label, exc)
            return
        except P2PError as exc:
            conn.abort(exc)
            if isinstance(exc, ConnectionBrokenError) and not exc.corrupt:
                # Nothing was refused: the dialer left. Before its hello that is most
                # often a port probe or a health check, not worth more than a debug line.
                level = logging.DEBUG if conn._peer is None else logging.INFO
                log.log(
                    level, "%s: the dialer went away during the handshake (%s)", conn.label, exc
                )
                return
            if isinstance(exc, PeerAuthenticationError):
                self._note_refusal(exc)
            else:  # a broken handshake: the dialer's doing, or its network's
                log.warning("refused incoming connection: %s", exc)
            return
        except Exception as exc:  # never leave a half-open socket behind
            log.exception("%s: incoming handshake failed", conn.label)
            conn.abort(RemoteProtocolError(conn.label, f"handshake failed: {exc!r}"))
            return
        finally:
            self._pending.pop(conn, None)
        if self._closed:
            conn.abort(ConnectionClosedError("transport is closed"))
            return
        self._accepted.put(conn)

    async def _shutdown(self) -> None:
        """Close: stop listening and close every connection (bounded)."""
        if self._server is not None:
            await self._server.close()
        await cancel_and_wait(self._handshakes, timeout=2.0)
        await self._close_all()
