"""Reaching the relay through an HTTP forward proxy (CONNECT): a real proxy on loopback in
front of a real relay process, the relay client and a whole group through it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from relay_helpers import RelayProcess
from transport_conformance import bounded, wait_until

from p2pdist import (
    Group,
    GroupConfig,
    PeerAuthenticationError,
    PunchConfig,
    SecretKey,
    TransportConfig,
    UsageError,
    eventloop,
)
from p2pdist.transport.proxytunnel import open_tunnel
from p2pdist.transport.relay_path import PROXY_ENV, RelayConfig, RelayPath, RelayState
from p2pdist.wire.httpproxy import ProxyRefused, ProxyUrl, connect_answer, connect_request
from p2pdist.wire.relay import RelayProtocolError, RelayUrl

FAST = RelayConfig(connect_timeout=5.0, backoff_initial=0.05, backoff_max=0.5)
MARKER = b"PROXY-PLAINTEXT-MARKER-51c2"


class ConnectProxy:
    """A forward proxy on 127.0.0.1 that serves CONNECT only: it checks Basic credentials
    when given some, answers ``status`` instead of tunnelling when set, and keeps what it
    saw (the targets asked for, every byte it carried)."""

    def __init__(
        self, *, credentials: tuple[str, str] | None = None, status: str | None = None
    ) -> None:
        self.credentials = credentials
        self.status = status
        self.targets: list[str] = []
        self.carried = bytearray()
        self.after_answer = b""  # bytes to send right after a 200 (a broken proxy)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        if self.credentials is None:
            return f"http://127.0.0.1:{port}"
        user, password = self.credentials
        return f"http://{user}:{password}@127.0.0.1:{port}"

    async def __aenter__(self) -> ConnectProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, target, _ = head[0].split(" ")
            headers = dict(line.split(": ", 1) for line in head[1:] if line)
            self.targets.append(target)
            assert headers.get("Host") == target, headers  # RFC 9112 3.2.3: the same authority
            if method != "CONNECT":
                writer.write(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
                return
            if self.credentials is not None:
                want = base64.b64encode(":".join(self.credentials).encode()).decode()
                if headers.get("Proxy-Authorization") != f"Basic {want}":
                    writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
                    return
            if self.status is not None:
                writer.write(f"HTTP/1.1 {self.status}\r\n\r\n".encode())
                return
            host, port = target.rsplit(":", 1)
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n" + self.after_answer)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                self.carried += data
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()


@contextlib.asynccontextmanager
async def proxy(**kw: object) -> AsyncIterator[ConnectProxy]:
    async with ConnectProxy(**kw) as p:  # type: ignore[arg-type]
        yield p


def key(i: int) -> SecretKey:
    return SecretKey.from_seed("relay-proxy-tests-0123", i)


# ---- the codec ------------------------------------------------------------------------


def test_proxy_urls_parse_and_never_show_their_password() -> None:
    p = ProxyUrl.parse("http://alice:s%3Acret@proxy.example:3128")
    assert (p.host, p.port, p.user, p.password) == ("proxy.example", 3128, "alice", "s:cret")
    assert str(p) == "http://proxy.example:3128"
    assert str(ProxyUrl.parse("http://[::1]:8080/")) == "http://[::1]:8080"
    for bad, why in [
        ("https://proxy:3128", "http://"),
        ("socks5://proxy:1080", "http://"),
        ("http://proxy", "needs a port"),
        ("http://:3128", "no host"),
        ("http://proxy:3128/path", "no path"),
        ("http://proxy:99999", "bad host or port"),
    ]:
        with pytest.raises(UsageError, match=why):
            ProxyUrl.parse(bad)
    for leaky in [
        "https://alice:hunter2@proxy:3128",
        "http://alice:hunter2@proxy:31x8",  # a typo in the port
        "http://alice:hunter2@[::1:3128",  # a bad IPv6 address
        "http://alice:hun/ter2@proxy:3128",  # a raw '/' in the password
        "http://alice:hunter2@@proxy:3128/x",  # a raw '@' in it
        "http://alice:hunter2@proxy",
    ]:
        with pytest.raises(UsageError) as info:
            ProxyUrl.parse(leaky)
        assert "hunter2" not in str(info.value) and "hun" not in str(info.value), info.value
    assert "hunter2" not in repr(ProxyUrl.parse("http://alice:hunter2@proxy:3128"))
    assert "hunter2" not in repr(RelayConfig(proxy="http://alice:hunter2@proxy:3128"))


def test_connect_request_and_answer() -> None:
    plain = ProxyUrl.parse("http://proxy:3128")
    assert connect_request(plain, "relay.example", 443) == (
        b"CONNECT relay.example:443 HTTP/1.1\r\nHost: relay.example:443\r\n\r\n"
    )
    authed = ProxyUrl.parse("http://u:p@proxy:3128")
    assert b"CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n" in connect_request(
        authed, "2001:db8::1", 8443
    )
    assert b"Proxy-Authorization: Basic dTpw\r\n" in connect_request(authed, "h", 1)
    ok = b"HTTP/1.1 200 Connection established\r\nVia: x\r\n\r\n"
    assert connect_answer(ok[:20]) is None  # more bytes needed
    assert connect_answer(ok) == len(ok)
    with pytest.raises(ProxyRefused) as refused:
        connect_answer(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
    assert refused.value.status == 407 and "Authentication" in str(refused.value)
    for bad in [
        b"SSH-2.0-OpenSSH_9.6 hello\r\n\r\n",
        "HTTP/1.1 \u00b200 x\r\n\r\n".encode("latin-1", "replace"),
        b"HTTP/1.1 2000 OK\r\n\r\n",
    ]:
        with pytest.raises(RelayProtocolError):
            connect_answer(bad)
    # interim answers are skipped, a reason is optional, a proxy's odd headers are its own
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200\r\nX Odd: y\r\n\r\n"
    assert connect_answer(interim) == len(interim)
    assert connect_answer(interim[:30]) is None
    bare = b"HTTP/1.1 100 Continue\n\nHTTP/1.1 200 OK\nVia: x\r\n\n"  # bare LFs, mixed
    assert connect_answer(bare) == len(bare)
    assert connect_answer(bare[:-1]) is None
    with pytest.raises(RelayProtocolError):
        connect_answer(b"\r\nHTTP/1.1 200 OK\r\n\r\n")  # no status line first
    with pytest.raises(RelayProtocolError, match="too large"):
        connect_answer(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 2000)
    idn = connect_request(plain, "b\u00fccher.example", 443)
    assert idn.startswith(b"CONNECT xn--bcher-kva.example:443 HTTP/1.1\r\n")


# ---- the tunnel, the relay client and a group through a real proxy ---------------------


async def test_a_proxy_answering_with_more_than_its_head_is_refused() -> None:
    async with proxy() as p:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        p.after_answer = b"\x16\x03\x01"  # bytes before we sent any: not the relay's
        try:
            with pytest.raises(RelayProtocolError, match="after its CONNECT answer"):
                await bounded(open_tunnel(ProxyUrl.parse(p.url), "127.0.0.1", port), "tunnel")
            p.after_answer = b""
            sock = await bounded(open_tunnel(ProxyUrl.parse(p.url), "127.0.0.1", port), "tunnel")
            sock.close()
            assert p.targets == [f"127.0.0.1:{port}"] * 2
        finally:
            server.close()


async def test_many_interim_answers_are_read_through_and_bounded() -> None:
    """A proxy may send 1xx heads before its 200 (RFC 9110 15.2): more than one head's
    worth of them is read through, and an endless stream of them is refused."""
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    count = 400  # 10 KB of interim heads: more than one head may be long
    held: list[asyncio.StreamWriter] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(interim * count + b"HTTP/1.1 200 OK\r\n\r\n")
        held.append(writer)  # stays open, as a tunnel does

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = ProxyUrl.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        sock = await bounded(open_tunnel(url, "relay.test", 443), "tunnel")
        sock.close()
        count = 2000  # 50 KB and counting
        with pytest.raises(RelayProtocolError, match="answered CONNECT with over 32768 bytes"):
            await bounded(open_tunnel(url, "relay.test", 443), "tunnel")
    finally:
        for writer in held:
            writer.close()
        server.close()


async def test_relay_clients_reach_each_other_through_the_proxy(tmp_path: Path) -> None:
    with RelayProcess(tmp_path) as relay:
        url = RelayUrl.parse(relay.url)
        async with proxy(credentials=("fleet", "pa ss:word")) as p:
            config = RelayConfig(
                connect_timeout=5.0, backoff_initial=0.05, backoff_max=0.5, proxy=p.url
            )
            a, b = RelayPath(key(0), relay.url, config=config), RelayPath(key(1), relay.url)
            got: asyncio.Queue[bytes] = asyncio.Queue()
            b.on_datagram = lambda src, data: got.put_nowait(data)
            try:
                await asyncio.gather(a.wait_connected(10), b.wait_connected(10))
                assert a.status.proxy == str(ProxyUrl.parse(p.url)) and b.status.proxy is None
                assert "pa ss" not in repr(a.status)
                for _ in range(50):  # best effort: resend until one arrives
                    a.send(b.endpoint_id, MARKER)
                    with contextlib.suppress(TimeoutError):
                        assert await asyncio.wait_for(got.get(), 0.2) == MARKER
                        break
                else:
                    raise AssertionError("nothing came through the proxy")
            finally:
                await bounded(asyncio.gather(a.close(), b.close()), "close()")
        assert p.targets == [f"{url.host}:{url.port}"]  # a only; b went direct
        assert len(p.carried) > 1000 and MARKER not in p.carried  # TLS and records only


async def _group_through_proxy(relay_url: str) -> ConnectProxy:
    cfg = GroupConfig(timeout=30.0, connect_timeout=30.0, punch=PunchConfig(enabled=False))
    async with proxy() as p:
        gs = [
            Group.from_seed(
                "proxy-group-seed-0123456789",
                rank=r,
                world=2,
                relay=relay_url,
                relay_proxy=p.url,
                config=cfg,
            )
            for r in range(2)
        ]
        try:
            await asyncio.gather(*(g.start() for g in gs))
            outs = await asyncio.gather(*(g.all_reduce(np.full(100_000, g.rank + 1.0)) for g in gs))
            np.testing.assert_array_equal(outs[1], np.full(100_000, 3.0))
            for g in gs:
                assert g.relay_status is not None and g.relay_status.proxy is not None
        finally:
            await asyncio.gather(*(g.close() for g in gs))
    return p


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_group_through_a_proxy_and_the_relay(tmp_path: Path, loop: str) -> None:
    if loop == "uvloop" and not eventloop.uvloop_available():
        pytest.skip('uvloop is not installed (pip install "p2pdist[fast]")')
    with RelayProcess(tmp_path) as relay:
        p = eventloop.run(_group_through_proxy(relay.url), loop=loop)
    assert len(p.targets) == 2 and len(p.carried) > 800_000


async def test_a_proxy_that_starts_refusing_is_named_in_the_groups_loss(tmp_path: Path) -> None:
    """The proxy in front of the relay starts refusing tunnels (its policy changed) and
    the tunnels open through it end: the relayed peers fall silent, and the loss names
    the proxy's refusal, not a relay that refuses this rank or cannot be reached."""
    fast = TransportConfig(keepalive_interval=0.2, idle_timeout=6.0)
    cfg = GroupConfig(
        timeout=20.0, connect_timeout=30.0, punch=PunchConfig(enabled=False), transport=fast
    )
    with RelayProcess(tmp_path) as relay:
        async with proxy() as p:
            seed = "proxy-group-seed-0123456789"
            gs = [
                Group.from_seed(
                    seed, rank=r, world=2, relay=relay.url, relay_proxy=p.url, config=cfg
                )
                for r in range(2)
            ]
            try:
                await asyncio.gather(*(g.start() for g in gs))
                await asyncio.gather(*(g.all_reduce(np.ones(10)) for g in gs))
                p.status = "403 Forbidden"
                for task in list(p._tasks):  # the tunnels open now end
                    task.cancel()
                for g in gs:
                    await wait_until(lambda g=g: g.broken is not None, "the loss", 30)
                    text = str(g.broken)
                    assert "the proxy to this rank's relay refuses the tunnel now" in text, text
                    assert "403 Forbidden" in text and "restarted with another key" not in text
            finally:
                await asyncio.gather(*(g.close() for g in gs))


async def test_proxy_refusals_wrong_credentials_at_once_a_bad_gateway_retried(
    tmp_path: Path,
) -> None:
    with RelayProcess(tmp_path) as relay:
        async with proxy(credentials=("fleet", "right")) as p:
            wrong = p.url.replace(":right@", ":wrong@")
            path = RelayPath(
                key(2), relay.url, config=RelayConfig(connect_timeout=5.0, proxy=wrong)
            )
            try:
                with pytest.raises(PeerAuthenticationError, match="407 Proxy Authentication"):
                    await path.wait_connected(10)
                assert "wrong" not in str(path.status)
                # Told apart from a reachable relay that failed (doctor said "cannot reach
                # the relay"): only a change to the proxy settings helps.
                assert path.status.refused and path.status.refusal == "proxy_refused"
            finally:
                await path.close()
            g = Group.from_seed("s" * 20, rank=0, world=2, relay=relay.url, relay_proxy=wrong)
            with pytest.raises(PeerAuthenticationError, match=r"proxy http://127\.0\.0\.1:"):
                await g.start()
            await g.close()
        async with proxy(status="502 Bad Gateway") as p:
            path = RelayPath(
                key(3),
                relay.url,
                config=RelayConfig(
                    connect_timeout=5.0, backoff_initial=0.05, backoff_max=0.2, proxy=p.url
                ),
            )
            path.start()
            try:
                await wait_until(lambda: len(p.targets) >= 3, "three attempts through the proxy")
                assert path.status.state is not RelayState.CONNECTED
                assert "502 Bad Gateway" in (path.status.last_error or "")
            finally:
                await path.close()


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "answered CONNECT with 'SSH-2.0-OpenSSH_9.6', not HTTP"),
        (b"", ": closed before answering CONNECT"),
    ],
)
async def test_a_proxy_that_does_not_speak_http_is_named_once(answer: bytes, said: str) -> None:
    """A non-HTTP answer did not name the proxy at all, and one that closed named it
    twice ("proxy URL: proxy URL closed before answering CONNECT")."""

    async def odd(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        writer.close()

    server = await asyncio.start_server(odd, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    relay = f"https://127.0.0.1:9/?pin={key(6).endpoint_id}"  # never reached
    config = RelayConfig(connect_timeout=2.0, backoff_initial=0.05, backoff_max=0.2, proxy=url)
    path = RelayPath(key(7), relay, config=config)
    path.start()
    try:
        await wait_until(lambda: path.status.last_error is not None, "a failed attempt")
        error = path.status.last_error or ""
        assert f"proxy {url}{' ' if answer else ''}{said}" in error, error
        assert error.count("proxy ") == 1, error
    finally:
        await path.close()
        server.close()


async def test_the_proxy_comes_from_the_environment_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with RelayProcess(tmp_path) as relay:
        async with proxy() as p:
            monkeypatch.setenv(PROXY_ENV, p.url)
            via_env = RelayPath(key(4), relay.url, config=FAST)
            direct = RelayPath(key(5), relay.url, config=RelayConfig(proxy=""))
            try:
                await asyncio.gather(via_env.wait_connected(10), direct.wait_connected(10))
                assert via_env.status.proxy is not None and direct.status.proxy is None
                assert len(p.targets) == 1
            finally:
                await asyncio.gather(via_env.close(), direct.close())
            # Group.from_env reaches the relay through the proxy the environment names
            for name, value in [
                ("P2PDIST_SEED", "env-proxy-seed-0123456789"),
                ("P2PDIST_WORLD", "2"),
                ("P2PDIST_RELAY", relay.url),
            ]:
                monkeypatch.setenv(name, value)
            monkeypatch.delenv("P2PDIST_PEERS", raising=False)
            gs = []
            for rank in (0, 1):
                monkeypatch.setenv("P2PDIST_RANK", str(rank))
                gs.append(Group.from_env())
            try:
                await asyncio.gather(*(g.start() for g in gs))
                outs = await asyncio.gather(*(g.all_reduce(np.ones(3)) for g in gs))
                np.testing.assert_array_equal(outs[0], np.full(3, 2.0))
                assert len(p.targets) == 3  # via_env, then both ranks
            finally:
                await asyncio.gather(*(g.close() for g in gs))
            monkeypatch.setenv(PROXY_ENV, "socks5://nope:1")
            with pytest.raises(UsageError, match="http://"):
                RelayPath(key(6), relay.url)
            with pytest.raises(UsageError, match="http://"):  # when the group is made
                Group.from_env()
            Group.from_seed("s" * 20, rank=0, world=2, relay=relay.url, relay_proxy="")  # direct
    Group.from_seed("s" * 20, rank=0, world=2, peers=["127.0.0.1:1", "127.0.0.1:2"], relay_proxy="")
    with pytest.raises(UsageError, match="pass relay= too"):
        Group.from_seed(
            "s" * 20,
            rank=0,
            world=2,
            peers=["127.0.0.1:1", "127.0.0.1:2"],
            relay_proxy="http://127.0.0.1:3128",
        )
    with pytest.raises(UsageError, match="needs a port"):
        Group.from_seed("s" * 20, rank=0, world=2, relay="https://h:1/", relay_proxy="http://x")


async def test_doctor_says_it_went_through_the_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from p2pdist.doctor import diagnose, render

    with RelayProcess(tmp_path) as relay:
        async with proxy(credentials=("fleet", "secret-word")) as p:
            monkeypatch.setenv(PROXY_ENV, p.url)
            shown = str(ProxyUrl.parse(p.url))
            report = await diagnose(relay.url, key=key(7), timeout=5.0)
    text = render(report)
    assert report.relay_connected, text
    assert f"through proxy {shown}" in text
    assert "secret-word" not in text
