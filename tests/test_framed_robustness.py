"""The shared connection data path under stress: cancelled senders and closes, a peer
that leaves with our bytes unread, a byte pipe that stops taking bytes, close racing
connect, retired channels that do not start at 0, unauthenticated sockets, and the
interrupt error. Real sockets on 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import tracemalloc
from typing import Any

import pytest
from test_tcp_transport import config, key, tcp_pair
from transport_conformance import (
    PairFactory,
    bounded,
    check_a_close_that_gives_up_is_a_lost_connection_to_the_peer,
    check_cancelled_sender_leaves_others_waiting,
    check_close_waits_for_a_slow_reader,
    closing,
    wait_until,
)

from p2pdist.errors import ConnectionBrokenError, ConnectionClosedError, P2PError
from p2pdist.transport import TcpTransport, TransportConfig
from p2pdist.transport import tcp as tcp_module
from p2pdist.transport.framed import GOODBYE, FramedConnection
from p2pdist.transport.keepalive import Keepalive, KeepaliveAction
from p2pdist.transport.mailbox import SPACE_SHIFT, RetiredChannels
from p2pdist.transport.tcp import TcpConnection
from p2pdist.wire.frames import VERSION, FrameKind, FrameLimits, encode_header


async def passes(n: int = 5) -> None:
    """Let the event loop run ``n`` passes."""
    for _ in range(n):
        await asyncio.sleep(0)


# ---- 1. one cancelled sender must not cancel the others ---------------------------------


async def test_cancelled_sender_leaves_others_waiting(make_pair: PairFactory) -> None:
    await check_cancelled_sender_leaves_others_waiting(make_pair)


# ---- 2. a cancelled close() still closes the socket -------------------------------------


async def test_a_cancelled_close_still_drops_the_socket(tls: bool) -> None:
    async with tcp_pair(tls) as p:
        client, server = p.client, p.server
        assert isinstance(client, TcpConnection) and isinstance(server, TcpConnection)
        assert server._transport is not None
        server._transport.pause_reading()  # alive, but reads nothing: the flush cannot end
        client.send_nowait(1, bytes(32 << 20))
        closer = asyncio.create_task(client.close())
        await passes()
        assert not closer.done()  # waiting for the queued bytes to leave
        closer.cancel()  # the caller bounds its own close
        with pytest.raises(asyncio.CancelledError):
            await bounded(closer, "the cancelled close")
        # Dropped: not left open for as long as the peer does not read.
        await wait_until(lambda: client._lost.done(), "the socket dropped")
        assert client not in p.client_transport._connections  # type: ignore[attr-defined]


async def test_close_waits_for_a_slow_reader(tls: bool) -> None:
    await check_close_waits_for_a_slow_reader(functools.partial(tcp_pair, tls))


async def test_a_close_that_gives_up_is_a_lost_connection_to_the_peer(tls: bool) -> None:
    pair = functools.partial(tcp_pair, tls)
    await check_a_close_that_gives_up_is_a_lost_connection_to_the_peer(pair)


async def test_close_does_not_wait_for_strangers_or_a_peer_that_streams_on(tls: bool) -> None:
    """Closing waits for the peer's end only while it matters: a stranger's idle socket
    (a port scan, a health probe) held TcpTransport.close() for idle_timeout (30 s), and
    so did a peer that kept sending after our GOODBYE (its sends were queued for good:
    now they fail, the peer having left)."""
    cfg = config(tls, idle_timeout=60.0)
    server = TcpTransport(key(1), cfg)
    async with closing(server):
        addr = await server.listen("127.0.0.1", 0)
        stranger = socket.create_connection(addr)
        try:
            await passes(20)
            await bounded(server.close(), "close() with a stranger's idle socket", 5.0)
        finally:
            stranger.close()
    async with tcp_pair(tls, idle_timeout=60.0) as p:
        chunk = bytes(1 << 20)

        async def stream() -> None:
            while True:
                await p.server.send(1, chunk)

        streamer = asyncio.create_task(stream())
        await passes(20)
        await bounded(p.client.close(), "close() while the peer streams", 5.0)
        with pytest.raises(ConnectionBrokenError) as info:
            await bounded(streamer, "the streaming peer's send failing")
        assert info.value.graceful, info.value


# ---- 3. GOODBYE then a reset is a graceful leave ----------------------------------------


async def test_goodbye_then_reset_is_a_graceful_leave(tls: bool) -> None:
    async with tcp_pair(tls) as p:
        client, server = p.client, p.server
        assert isinstance(client, TcpConnection) and isinstance(server, TcpConnection)
        reports: list[BaseException | None] = []
        client.add_close_callback(reports.append)
        assert server._transport is not None
        server._transport.pause_reading()  # our last message stays unread over there
        client.send_nowait(1, b"x" * 1000)
        await passes()
        await bounded(server.close(), "the peer's close()")  # GOODBYE, then RST
        await wait_until(lambda: bool(reports), "the close callback")
        err = reports[0]
        assert isinstance(err, ConnectionBrokenError), err
        assert err.graceful, err
        assert "left" in str(err)


# ---- 4. the keepalive timer never re-arms in the past -----------------------------------


def test_keepalive_ping_that_could_not_be_sent_is_retried_an_interval_later() -> None:
    ka = Keepalive.start(1.0, 5.0, 0.0)
    assert ka.poll(1.0) is KeepaliveAction.PING
    # The glue could not send it (the pipe is closing): the next poll is not due now.
    assert ka.next_deadline() == pytest.approx(2.0)
    assert ka.poll(1.5) is KeepaliveAction.NONE
    assert ka.poll(2.0) is KeepaliveAction.PING
    ka.on_send(2.0)  # sent this time
    assert ka.next_deadline() == pytest.approx(3.0)
    # Silence still ends it at the idle timeout.
    assert ka.poll(4.9) is KeepaliveAction.PING
    assert ka.poll(5.0) is KeepaliveAction.DEAD


async def test_keepalive_timer_does_not_spin_while_the_pipe_is_not_writable(
    tls: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    original = FramedConnection._on_keepalive_timer

    def counting(self: FramedConnection) -> None:
        nonlocal calls
        calls += 1
        original(self)

    monkeypatch.setattr(FramedConnection, "_on_keepalive_timer", counting)
    async with tcp_pair(tls, keepalive_interval=0.05, idle_timeout=0.3) as p:
        client = p.client
        assert isinstance(client, TcpConnection)
        client._writable = lambda: False  # type: ignore[method-assign]  # closing, say
        pending = asyncio.create_task(client.recv(5))
        calls = 0
        # We cannot ping, and the peer's own timer is stopped: nothing arrives, and the
        # receiver fails at the idle timeout.
        p.server._ka_timer.cancel()  # type: ignore[attr-defined]
        with pytest.raises(ConnectionBrokenError, match="keepalive timeout"):
            await bounded(pending, "the receive failing at the idle timeout", 5.0)
        # About idle_timeout / interval polls (a few more on a slow machine), not a loop.
        assert calls < 40, f"{calls} keepalive timer calls"


# ---- 5. connect() racing close() ---------------------------------------------------------


@pytest.mark.parametrize("passes_before_close", [0, 1, 2, 3, 5, 8, 13])
async def test_connect_racing_close_never_returns_a_live_connection(
    tls: bool, passes_before_close: int
) -> None:
    cfg = config(tls)
    a, b = TcpTransport(key(0), cfg), TcpTransport(key(1), cfg)
    async with closing(a, b):
        addr = await b.listen("127.0.0.1", 0)
        dial = asyncio.create_task(a.connect(b.endpoint_id, addr))
        await passes(passes_before_close)
        await bounded(a.close(), "close()")
        try:
            conn = await bounded(dial, "connect() ending")
        except P2PError as exc:
            assert isinstance(exc, ConnectionClosedError | ConnectionBrokenError), exc
        else:
            pytest.fail(f"connect() returned {conn!r} from a closed transport")
        assert not a._connections


# ---- 6. retired channels that start at any counter stay compact -------------------------


def test_retired_channels_compact_from_any_first_counter() -> None:
    space = 2 << SPACE_SHIFT
    for start in (0, 1000, 7 << 40):
        r = RetiredChannels()
        tracemalloc.start()
        try:
            for c in range(start, start + 20_000):
                r.retire(space | c)
            grown, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert grown < 16 * 1024, f"{grown} bytes for 20000 in-order retires from {start}"
        assert space | start in r and space | (start + 19_999) in r
        assert space | (start + 20_000) not in r
        if start:
            assert space | (start - 1) not in r and space | 0 not in r  # never retired


def test_retired_channels_out_of_order_and_below_the_first() -> None:
    r = RetiredChannels()
    space = 5 << SPACE_SHIFT
    for c in [100, 102, 101, 98, 104, 99, 97]:
        r.retire(space | c)
    for c in range(97, 103):
        assert space | c in r
    assert space | 103 not in r and space | 96 not in r and space | 105 not in r
    assert space | 104 in r
    assert r.runs == 2
    r.retire(space | 103)  # fills the gap: one run again
    r.retire(space | 100)  # retired already: nothing changes
    assert r.runs == 1
    assert 100 not in r  # other spaces are separate
    r.retire(3)
    assert 3 in r and 2 not in r and r.runs == 2


# ---- 7. unauthenticated sockets: no big buffers, bounded in number ----------------------


async def test_an_unauthenticated_socket_holds_no_big_buffer() -> None:
    server_t = TcpTransport(key(1), TransportConfig(tls=False))
    async with closing(server_t):
        addr = await server_t.listen("127.0.0.1", 0)
        s = socket.create_connection(addr)
        try:
            await wait_until(lambda: bool(server_t._connections), "the incoming connection")
            (conn,) = server_t._connections
            assert len(conn._hs_buf) == 0 and len(conn._decoder._scratch) == 0
            s.sendall(b"P")  # the first byte: a small handshake buffer only
            await wait_until(lambda: bool(conn._hs_buf), "the handshake buffer")
            assert len(conn._hs_buf) <= 16 * 1024
            assert len(conn._decoder._scratch) == 0
        finally:
            s.close()


async def test_incoming_handshakes_are_capped_and_the_oldest_makes_way(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past max_pending_handshakes a new socket is closed at once (counted, logged),
    unless the oldest handshake (of the address holding the most) has waited long
    enough (_EVICT_AFTER, here 0.2 s): then that one makes way (counted too), so silent
    sockets cannot lock real peers out."""
    monkeypatch.setattr(tcp_module, "_EVICT_AFTER", 0.2)
    caplog.set_level(logging.DEBUG, logger="p2pdist.transport")
    cfg = TransportConfig(tls=False, max_pending_handshakes=2)
    server_t = TcpTransport(key(1), cfg)
    client_t = TcpTransport(key(0), cfg)
    async with closing(server_t, client_t):
        addr = await server_t.listen("127.0.0.1", 0)
        silent = [socket.create_connection(addr) for _ in range(2)]
        try:
            await wait_until(lambda: len(server_t._pending) == 2, "two handshakes")
            extra = socket.create_connection(addr)
            extra.setblocking(False)
            loop = asyncio.get_running_loop()
            # Closed at once: EOF (or a reset) instead of a handshake slot.
            with contextlib.closing(extra), contextlib.suppress(ConnectionResetError):
                assert await bounded(loop.sock_recv(extra, 1), "the refusal") == b""
            await wait_until(lambda: server_t.refused_handshakes == 1, "the refusal counted")
            assert len(server_t._pending) == 2
            said = [r.getMessage() for r in caplog.records if "max_pending" in r.getMessage()]
            assert said and said[0].startswith("2 incoming handshakes already"), said
            await asyncio.sleep(0.25)  # the silent ones are old now: a real peer gets in
            caplog.clear()
            conn = await bounded(client_t.connect(server_t.endpoint_id, addr), "connect")
            assert not conn.closed
            assert len(server_t._pending) == 1  # the oldest silent socket made way
            assert server_t.refused_handshakes == 2  # the eviction counts too
            # An eviction is not a timeout (it was logged as one: a PeerTimeoutError is
            # a TimeoutError), and the count is of the handshakes that were in progress.
            await asyncio.sleep(0.05)
            warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert not any("timed out" in m for m in warned), warned
        finally:
            for s in silent:
                s.close()
        await wait_until(lambda: not server_t._pending, "the slots freed")
        # A silent socket that leaves (a port probe, a health check) was warned of as a
        # "refused incoming connection": it now says so at debug level only.
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert not warned, warned
        assert any("went away during the handshake" in r.getMessage() for r in caplog.records)


def test_max_pending_handshakes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pending_handshakes"):
        TransportConfig(max_pending_handshakes=0)


# ---- 8. the interrupt error does not pile up tracebacks ---------------------------------


def depth(exc: BaseException) -> int:
    n, tb = 0, exc.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


async def test_interrupted_send_error_does_not_grow_its_traceback(tls: bool) -> None:
    async with tcp_pair(tls, write_buffer_high=1 << 16) as p:
        client, server = p.client, p.server
        assert isinstance(client, TcpConnection) and isinstance(server, TcpConnection)
        assert server._transport is not None
        server._transport.pause_reading()
        client.send_nowait(1, bytes(32 << 20))  # backed up: later sends must wait
        err = ConnectionBrokenError("rank 1", "group broken")
        client.interrupt(err)
        depths = []
        for _ in range(50):
            with pytest.raises(ConnectionBrokenError) as info:
                await client.send(2, b"")
            assert info.value is err
            depths.append(depth(err))
        assert depths[-1] == depths[0], depths[:3] + depths[-3:]
        p.kill_client()  # nothing to flush at teardown


async def test_many_real_peers_from_one_address_all_get_in() -> None:
    """100 dials at once from one address (ranks on one host, clients behind one NAT):
    all handshakes complete (a per-address cap had turned 36 of them away)."""
    cfg = TransportConfig(tls=True)
    server_t = TcpTransport(key(1), cfg)
    client_t = TcpTransport(key(0), cfg)
    async with closing(server_t, client_t):
        addr = await server_t.listen("127.0.0.1", 0)
        conns = await bounded(
            asyncio.gather(*(client_t.connect(server_t.endpoint_id, addr) for _ in range(100))),
            "100 dials",
        )
        assert all(not c.closed for c in conns)
        assert server_t.refused_handshakes == 0


# ---- 9. a peer that ended its side does not keep our socket -----------------------------


@pytest.mark.parametrize("end", ["eof", "goodbye"])
async def test_a_peer_that_ends_its_side_unread_bytes_queued_does_not_keep_our_socket(
    tls: bool, end: str
) -> None:
    """A peer that ends its side (a TCP EOF, or a GOODBYE) reads nothing of ours after
    it. With 16 MiB queued towards it, our socket was left to asyncio's close(), which
    waited for the queue to leave for as long as the peer kept its socket open; the
    transport had forgotten the connection, so its close() did not end it either."""
    async with tcp_pair(tls) as p:
        client, server = p.client, p.server
        assert isinstance(client, TcpConnection) and isinstance(server, TcpConnection)
        p.silence_client()  # the peer reads nothing and sends no keepalives
        server.send_nowait(1, bytes(16 << 20))
        await passes()
        assert client._transport is not None
        if end == "eof":
            client._transport.get_extra_info("socket").shutdown(socket.SHUT_WR)
        else:
            client._write(GOODBYE)
        await wait_until(lambda: server.end_error is not None, "our side seeing the peer's end")
        await wait_until(lambda: server._lost.done(), "our socket closed", 5.0)


# ---- 10. a second close() waits for the first -------------------------------------------


async def test_a_second_close_waits_for_the_first(tls: bool) -> None:
    """A close() while another close() let queued bytes go returned at once, the socket
    still open: its caller took the connection (or transport) for closed."""
    for what in ("connection", "transport"):
        async with tcp_pair(tls) as p:
            client, server = p.client, p.server
            assert isinstance(client, TcpConnection) and isinstance(server, TcpConnection)
            assert server._transport is not None
            server._transport.pause_reading()
            client.send_nowait(1, bytes(16 << 20))
            closing_target = client if what == "connection" else p.client_transport
            first = asyncio.create_task(closing_target.close())
            await passes()
            assert not first.done()  # the queued bytes hold it
            second = asyncio.create_task(closing_target.close())
            await passes()
            assert not second.done(), what
            server._transport.resume_reading()
            await bounded(second, f"the second close of the {what}")
            assert client._lost.done(), what
            await bounded(first, f"the first close of the {what}")


# ---- 11. keepalive round trips ----------------------------------------------------------


async def test_round_trip_time_is_not_timed_from_a_ping_left_unanswered(tls: bool) -> None:
    """A peer whose writes back up answers no PING (on purpose); the next PONG was then
    timed from the first unanswered PING, and stats.rtt read over a second on loopback."""
    async with tcp_pair(tls, keepalive_interval=0.1, idle_timeout=10.0) as p:
        client, server = p.client, p.server
        assert isinstance(server, TcpConnection)
        await wait_until(lambda: client.stats.rtt is not None, "a first round trip")
        server._write_paused = True  # as pause_writing: its PONGs are skipped
        await asyncio.sleep(1.0)
        server._write_paused = False
        before = client.stats.rtt
        await wait_until(lambda: client.stats.rtt != before, "a round trip after", every=0)
        rtt = client.stats.rtt  # the first sample after
        assert rtt is not None and rtt < 0.5, rtt


async def test_round_trip_longer_than_the_keepalive_interval_is_not_read_short(
    tls: bool,
) -> None:
    """Each PONG takes 0.25 s, PINGs go every 0.1 s: a PONG answering an older PING was
    taken for the answer to the newest and stats.rtt read 0.05 s, the round trip modulo
    the interval (an audit). A PING now carries its number, its PONG echoes it."""
    async with tcp_pair(tls, keepalive_interval=0.1, idle_timeout=10.0) as p:
        client, server = p.client, p.server
        assert isinstance(server, TcpConnection)
        loop = asyncio.get_running_loop()
        write = server._write

        def slow_pongs(data: Any) -> None:
            if bytes(data[:2]) == bytes([VERSION, FrameKind.PONG]):
                loop.call_later(0.25, write, data)
            else:
                write(data)

        server._write = slow_pongs  # type: ignore[method-assign]
        samples: list[float] = []
        last = client.stats.rtt

        def sampled() -> bool:
            nonlocal last
            if client.stats.rtt != last:
                last = client.stats.rtt
                assert last is not None
                samples.append(last)
            return len(samples) >= 8

        await wait_until(sampled, "round trips", every=0)
        assert all(0.2 <= s < 1.0 for s in samples[2:]), samples


async def test_a_pong_that_names_no_ping_is_still_timed(tls: bool) -> None:
    """A peer of before 2026-12-06 answers every PING with a PONG whose seq is 0: it is
    timed from the one PING out, as before."""
    async with tcp_pair(tls, keepalive_interval=0.1, idle_timeout=10.0) as p:
        client, server = p.client, p.server
        assert isinstance(server, TcpConnection)
        write = server._write
        plain = encode_header(FrameKind.PONG)

        def unnamed_pongs(data: Any) -> None:
            named = bytes(data[:2]) == bytes([VERSION, FrameKind.PONG])
            write(plain if named else data)

        server._write = unnamed_pongs  # type: ignore[method-assign]
        client.stats.rtt = None
        await wait_until(lambda: client.stats.rtt is not None, "a round trip")
        assert client.stats.rtt is not None and client.stats.rtt < 0.5


# ---- 12. a meta larger than a record ----------------------------------------------------


async def test_a_meta_larger_than_one_record_is_sent(tls: bool) -> None:
    """FrameLimits allows a meta over 1 MiB; with AES-GCM records a small frame went as
    one record, which takes at most 1 MiB: send() raised a bare ValueError."""
    limits = FrameLimits(max_meta=4 << 20)
    async with tcp_pair(tls, limits=limits) as p:
        await p.client.send(1, b"x" * 10, meta=b"m" * (2 << 20))
        frame = await bounded(p.server.recv(1), "the frame")
        assert len(frame.meta) == 2 << 20 and bytes(frame.payload) == b"x" * 10


# ---- 13. a paused receiver keeps what a closed peer sent --------------------------------


async def test_a_paused_receiver_keeps_the_frames_of_a_peer_that_closed(tls: bool) -> None:
    """The receiver's reading is paused (its queue is over max_buffered) while the
    sender closes: the sender has everything acknowledged, waits its grace and closes
    its socket. The receiver's next keepalive PING drew the sender's reset, its write
    failed, and asyncio closed the receiver's socket with the last frames and the
    GOODBYE unread in it: 7 of 12 frames arrived, and a broken pipe instead of a leave."""
    async with tcp_pair(tls, max_buffered=64 * 1024, keepalive_interval=0.2) as p:
        for i in range(12):
            await p.client.send(1, bytes([i]) * (16 << 10), seq=i)
        await bounded(p.client.close(), "the sender's close")
        await asyncio.sleep(1.0)  # five keepalive intervals, the receiver still paused
        # A message (or a group's notice) for the peer that left draws the same reset.
        with pytest.raises(ConnectionBrokenError, match="closed the connection"):
            await p.server.send(2, b"too late")
        await asyncio.sleep(0.2)
        for i in range(12):
            frame = await bounded(p.server.recv(1), f"frame {i}")
            assert frame.seq == i and bytes(frame.payload[:1]) == bytes([i])
        await wait_until(lambda: p.server.end_error is not None, "the sender's leave")
        err = p.server.end_error
        assert isinstance(err, ConnectionBrokenError) and err.graceful, err
