"""Dialing a name with several addresses: they are raced (RFC 8305), so one whose packets
are dropped does not hold the dial. The dropping address is a loopback listener whose
accept queue is full: Linux drops the SYNs it gets, as a broken IPv6 path would."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from relay_helpers import running_relay
from transport_conformance import bounded

from p2pdist.errors import PeerAuthenticationError, UsageError
from p2pdist.identity import SecretKey
from p2pdist.transport import TcpTransport, TransportConfig
from p2pdist.transport.dial import worth_retrying
from p2pdist.transport.happyeyeballs import connect_tcp, interleaved
from p2pdist.transport.relay_config import RelayConfig
from p2pdist.transport.relay_path import RelayPath

SILENT_HOST = "127.0.0.2"


@contextlib.contextmanager
def silent_listener(port: int = 0, host: str = SILENT_HOST) -> Iterator[int]:
    """A port on ``host`` that drops every SYN (its one-place accept queue is full)."""
    server = socket.socket()
    server.bind((host, port))
    server.listen(0)
    filler = socket.create_connection(server.getsockname(), timeout=5)
    try:
        yield server.getsockname()[1]
    finally:
        filler.close()
        server.close()


@contextlib.contextmanager
def sockets_opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[socket.socket]]:
    """Every socket made inside the block, in a list."""
    opened: list[socket.socket] = []
    real_socket = socket.socket

    def tracked(*args: Any, **kw: Any) -> socket.socket:
        sock = real_socket(*args, **kw)
        opened.append(sock)
        return sock

    monkeypatch.setattr(socket, "socket", tracked)
    try:
        yield opened
    finally:
        monkeypatch.setattr(socket, "socket", real_socket)


def name_resolving_to(monkeypatch: pytest.MonkeyPatch, name: str, hosts: list[str]) -> None:
    """Make the running loop resolve ``name`` to ``hosts`` (in that order)."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo

    async def getaddrinfo(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host != name:
            return await real(host, port, *args, **kw)
        infos = []
        for h in hosts:
            infos += await real(h, port, *args, **kw)
        return infos

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)


KEYS = [SecretKey.from_seed("happy eyeballs tests", r) for r in range(4)]
DIAL = TransportConfig(handshake_timeout=10)


@contextlib.asynccontextmanager
async def transports(*configs: TransportConfig) -> AsyncIterator[list[TcpTransport]]:
    """A TCP transport per config, of KEYS[0], KEYS[1], ...; closed at the end."""
    made = [TcpTransport(KEYS[i], cfg) for i, cfg in enumerate(configs)]
    try:
        yield made
    finally:
        await bounded(asyncio.gather(*(t.close() for t in made)), "close()")


def test_families_take_turns_starting_with_the_first() -> None:
    v6 = [(socket.AF_INET6, 1, 6, "", (f"::{i}", 80, 0, 0)) for i in range(1, 4)]
    v4 = [(socket.AF_INET, 1, 6, "", (f"10.0.0.{i}", 80)) for i in range(1, 3)]
    infos = [v6[0], v6[1], v6[1], v6[2], v4[0], v4[1], v4[0]]
    assert interleaved(infos) == [v6[0], v4[0], v6[1], v4[1], v6[2]]
    assert interleaved(v4 + v6)[:2] == [v4[0], v6[0]]


async def test_a_silent_first_address_does_not_hold_the_dial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    live = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = live.sockets[0].getsockname()[1]
    try:
        with silent_listener(port):
            name_resolving_to(monkeypatch, "two.test", [SILENT_HOST, "127.0.0.1"])
            start = time.monotonic()
            sock = await bounded(connect_tcp("two.test", port), "connect_tcp", seconds=5)
            took = time.monotonic() - start
            with sock:
                assert sock.getpeername() == ("127.0.0.1", port)
            # The second address starts 0.25 s after the first (not when it times out).
            assert took < 2.0, took
    finally:
        live.close()
        await live.wait_closed()


async def test_every_address_failing_names_each(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as closed_port:
        closed_port.bind(("127.0.0.1", 0))
        port = closed_port.getsockname()[1]  # nothing listens there once closed
    name_resolving_to(monkeypatch, "two.test", ["127.0.0.1", "127.0.0.3"])
    with pytest.raises(ConnectionRefusedError):  # every one refused: a refusal
        await bounded(connect_tcp("two.test", port), "connect_tcp")

    async def unreachable(sock: socket.socket, addr: Any) -> None:
        if addr[0] == "127.0.0.3":
            raise OSError(113, "No route to host")
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(asyncio.get_running_loop(), "sock_connect", unreachable)
    with pytest.raises(OSError) as info:
        await bounded(connect_tcp("two.test", port), "connect_tcp")
    text = str(info.value)
    assert f"127.0.0.1:{port}: [Errno 111]" in text and f"127.0.0.3:{port}: [Errno 113]" in text


async def test_a_cancelled_dial_leaves_no_socket_open(monkeypatch: pytest.MonkeyPatch) -> None:
    with silent_listener() as port, silent_listener(port, host="127.0.0.3"):
        name_resolving_to(monkeypatch, "two.test", [SILENT_HOST, "127.0.0.3"])
        with sockets_opened(monkeypatch) as opened, pytest.raises(TimeoutError):
            await asyncio.wait_for(connect_tcp("two.test", port), 0.4)
        assert opened and all(s.fileno() == -1 for s in opened)


async def test_the_relay_client_reaches_a_relay_whose_first_address_is_silent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay published under a name with a broken address first (an AAAA record over a
    path that drops packets): the client tried it alone until connect_timeout, on every
    attempt, and never connected (an audit). Now the second address answers at once."""
    async with running_relay() as relay:
        parts = urlsplit(relay.url)
        port = parts.port
        assert port is not None
        with silent_listener(port):
            name_resolving_to(monkeypatch, "relay.test", [SILENT_HOST, "127.0.0.1"])
            url = parts._replace(netloc=f"relay.test:{port}").geturl()
            path = RelayPath(SecretKey.generate(), url, config=RelayConfig(connect_timeout=10))
            try:
                start = time.monotonic()
                await path.wait_connected(5)
                assert time.monotonic() - start < 3.0
            finally:
                await bounded(path.close(), "close()")


async def test_a_peer_dialed_by_name_is_reached_past_a_silent_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with transports(DIAL, DIAL) as (client, server):
        _, port = await server.listen("127.0.0.1", 0)
        with silent_listener(port):
            name_resolving_to(monkeypatch, "peer.test", [SILENT_HOST, "127.0.0.1"])
            start = time.monotonic()
            conn = await bounded(client.connect(KEYS[1].endpoint_id, ("peer.test", port)), "dial")
            assert time.monotonic() - start < 3.0
            await conn.send(1, b"hello")
            accepted = await bounded(server.accept(), "accept")
            assert bytes((await bounded(accepted.recv(1), "recv")).payload) == b"hello"


async def test_a_peer_known_at_several_addresses_is_reached_at_the_one_that_answers() -> None:
    """``connect_any``: a rank announced on several interfaces, the first of which drops
    what is sent to it. The addresses are raced, so the dial does not wait out the
    silent one (it did, one address after another, for a bound each: a CI run); the
    connection is to the address that answered; an empty list is a usage error."""
    async with transports(DIAL, DIAL) as (client, server):
        _, port = await server.listen("127.0.0.1", 0)
        with silent_listener(port):
            start = time.monotonic()
            addresses = [f"{SILENT_HOST}:{port}", ("127.0.0.1", port)]
            conn = await bounded(client.connect_any(KEYS[1].endpoint_id, addresses), "dial")
            assert time.monotonic() - start < 3.0
            assert conn.remote_address == ("127.0.0.1", port)
            with pytest.raises(UsageError, match="no address"):
                await client.connect_any(KEYS[1].endpoint_id, [])


async def test_an_address_that_answers_as_someone_else_is_dropped_and_the_rest_raced() -> None:
    """``connect_any``: the first address answers as another endpoint (an address gone
    stale, or this host's own): the dial goes on at the others instead of failing, and
    fails naming the mismatch only when every address answered so."""
    async with transports(DIAL, DIAL, DIAL) as (client, right, other):
        _, good = await right.listen("127.0.0.1", 0)
        _, stale = await other.listen("127.0.0.1", 0)
        addresses = [f"127.0.0.1:{stale}", f"127.0.0.1:{good}"]
        conn = await bounded(client.connect_any(KEYS[1].endpoint_id, addresses), "dial")
        assert conn.remote_address == ("127.0.0.1", good)
        with pytest.raises(PeerAuthenticationError, match="identity"):
            await bounded(client.connect_any(KEYS[1].endpoint_id, addresses[:1]), "dial")

        # Garbage first (another service now on that port): dropped too (a review: only
        # an identity refusal was, and every round's race was won by the same address).
        async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"SSH-2.0-OpenSSH_9.6\r\n" * 100)
            await writer.drain()
            await reader.read(1 << 16)
            writer.close()

        other_service = await asyncio.start_server(garbage, "127.0.0.1", 0)
        wrong = other_service.sockets[0].getsockname()[1]
        try:
            mixed = [f"127.0.0.1:{wrong}", f"127.0.0.1:{good}"]
            conn = await bounded(client.connect_any(KEYS[1].endpoint_id, mixed), "dial")
            assert conn.remote_address == ("127.0.0.1", good)
        finally:
            other_service.close()


async def test_the_peers_own_refusal_outranks_a_stale_addresss_mismatch() -> None:
    """A stale address answers as another endpoint and the right one refuses (its
    accept queue is full): the error is the refusal, which is worth retrying, not the
    mismatch, which is not, whichever answered first (a review)."""
    full = TransportConfig(handshake_timeout=10, max_accept_queue=1)
    async with transports(DIAL, full, DIAL, DIAL) as (client, right, other, filler):
        _, good = await right.listen("127.0.0.1", 0)
        _, stale = await other.listen("127.0.0.1", 0)
        await bounded(filler.connect(KEYS[1].endpoint_id, ("127.0.0.1", good)), "filler")
        await asyncio.sleep(0.1)  # (its connection waits in the accept queue)
        for addresses in (
            [f"127.0.0.1:{stale}", f"127.0.0.1:{good}"],
            [f"127.0.0.1:{good}", f"127.0.0.1:{stale}"],
        ):
            with pytest.raises(PeerAuthenticationError) as info:
                await bounded(client.connect_any(KEYS[1].endpoint_id, addresses), "dial")
            assert "identity mismatch" not in str(info.value), info.value
            assert worth_retrying(info.value), info.value
        # The rest kept silent until the deadline: the refusal still (it was a bare
        # "handshake took over N s" naming the address that had refused: a review).
        with silent_listener(good) as silent:
            quick = TcpTransport(KEYS[0], TransportConfig(handshake_timeout=1.5))
            try:
                addresses = [f"127.0.0.1:{good}", f"{SILENT_HOST}:{silent}"]
                with pytest.raises(PeerAuthenticationError, match="accept queue full"):
                    await bounded(quick.connect_any(KEYS[1].endpoint_id, addresses), "dial")
            finally:
                await bounded(quick.close(), "close()")


async def test_an_unanswered_dial_starts_afresh_with_a_new_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``redial``, a dial nobody answers is replaced by a new one (a new SYN at once,
    not the kernel's retransmission seconds later), and the old socket is closed."""
    with silent_listener() as port:
        with sockets_opened(monkeypatch) as opened:
            dial = connect_tcp(SILENT_HOST, port, redial=0.3, random=lambda: 0.0)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(dial, 1.45)
        assert len(opened) >= 3, opened  # at 0, 0.3, 0.6, 0.9 and 1.2 s (a loaded host: fewer)
        assert all(s.fileno() == -1 for s in opened)


async def test_a_dial_answered_later_than_redial_still_gets_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A path whose SYN-ACK takes 0.5 s, against a redial of 0.3 s: the older attempt
    goes on beside the newer one and connects (a review: replacing it at every redial,
    no attempt ever lived long enough to connect)."""
    live = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = live.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    real = loop.sock_connect

    async def slow_path(sock: socket.socket, addr: Any) -> None:
        await asyncio.sleep(0.5)
        await real(sock, addr)

    monkeypatch.setattr(loop, "sock_connect", slow_path)
    try:
        dial = connect_tcp("127.0.0.1", port, redial=0.3, random=lambda: 0.0)
        with await bounded(dial, "a slow dial", seconds=5):
            pass
    finally:
        live.close()
        await live.wait_closed()


async def test_a_refusal_of_the_newest_attempt_ends_the_dial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first attempt hangs, the redial is refused (the host is back, its server not
    yet): that is the answer, at once, not after the hanging attempt's next SYN or the
    caller's bound (a review). And a redial that is not a positive time is refused."""
    calls = 0

    async def first_hangs(sock: socket.socket, addr: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(100)
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(asyncio.get_running_loop(), "sock_connect", first_hangs)
    with pytest.raises(ConnectionRefusedError):
        await bounded(connect_tcp("127.0.0.1", 9, redial=0.2, random=lambda: 0.0), "dial", 3)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(UsageError, match="redial"):
            await connect_tcp("127.0.0.1", 9, redial=bad)


async def dials_of_a_relay_path(
    monkeypatch: pytest.MonkeyPatch, port: int, host: str, seconds: float
) -> list[float]:
    """When a RelayPath to ``host:port`` (connect_timeout 2 s, backoff 4 s, whose wait
    draws 0.99 and whose floor draws 0) began each attempt, over ``seconds``."""
    from p2pdist.transport import relay_path as relay_path_module

    dials: list[float] = []
    real = relay_path_module.connect_tcp

    async def counted(*args: Any, **kw: Any) -> socket.socket:
        dials.append(time.monotonic())
        return await real(*args, **kw)

    monkeypatch.setattr(relay_path_module, "connect_tcp", counted)
    pin = SecretKey.from_seed("happy eyeballs tests", 9).endpoint_id
    draws = itertools.cycle([0.99, 0.0])  # the backoff's wait, then the credit's floor
    path = RelayPath(
        SecretKey.generate(),
        f"https://{host}:{port}/?pin={pin}",
        config=RelayConfig(connect_timeout=2.0, backoff_initial=4.0, backoff_max=4.0),
        random=lambda: next(draws),
    )
    path.start()
    try:
        await asyncio.sleep(seconds)
    finally:
        await bounded(path.close(), "close()")
    return [d - dials[0] for d in dials]


async def test_a_relay_dial_that_went_unanswered_counts_against_the_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay's address drops SYNs; each attempt gives up after connect_timeout (2 s).
    The backoff's wait (3.96 s) came on top of it, so a relay back from an outage was
    dialed again only up to backoff_max later: the dial's own time now counts against
    it (the second dial 3.96 s after the first, not 5.96)."""
    with silent_listener() as port:
        dials = await dials_of_a_relay_path(monkeypatch, port, SILENT_HOST, 5.0)
    assert len(dials) >= 2 and dials[1] < 5.0, dials


async def test_a_relay_too_loaded_to_answer_tls_keeps_the_whole_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relay that takes TCP but never finishes TLS (overloaded) is not an unanswered
    dial: its clients keep the whole backoff and its jitter, not a redial in step with
    every other client (a review of the change above)."""
    kept: list[asyncio.StreamWriter] = []  # (a writer let go of closes its connection)
    server = await asyncio.start_server(lambda r, w: kept.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        dials = await dials_of_a_relay_path(monkeypatch, port, "127.0.0.1", 6.5)
    finally:
        server.close()
    assert len(dials) >= 2 and dials[1] > 5.5, dials
