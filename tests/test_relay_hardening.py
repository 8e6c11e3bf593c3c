"""The relay under abuse and at its edges: connections that never finish TLS, a low file
descriptor limit, one source taking every client slot, half-closed clients, certificate
reloads that change the key type or outlive their grace, shutdown drains longer than
the close grace, and the small counting and configuration rules around them.

Relays run on 127.0.0.1 only (in-process, or ``python -m relay`` as a subprocess).
Every wait is bounded; nothing asserts on elapsed time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import resource
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from relay_helpers import ROOT, memory_handshake, read_relay_url, self_signed_pem
from test_relay_core import FP, A, B, C, FakeLink, auth_frame, core, join, only, upgrade
from test_relay_server import KEYS, eventually, joined, metric, running

from p2pdist.wire.relay import RelayFrameType, encode_addressed, upgrade_request
from relay.cli import load_config
from relay.config import TOKEN_ENV, ConfigError
from relay.logfmt import kv
from relay.server import (
    ACCEPT_ERROR,
    CLOSE_GRACE,
    FD_RESERVE,
    SHUTDOWN_GRACE_SHARE,
    AcceptErrorLimiter,
    RelayServer,
    fd_budget,
)
from relay.session import Phase
from relay.state import EVICT_AFTER, MAX_PREVIOUS_CERTS
from relay.testclient import RelayRefused, http_get
from relay.tlsconfig import RelayTls

T = RelayFrameType


# ---- 1. connections that never finish TLS count against the waiting caps --------------


async def _raw_connections(port: int, n: int) -> list[asyncio.StreamWriter]:
    """``n`` TCP connections to the relay that never send a byte."""
    writers = []
    for _ in range(n):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        writers.append(w)
    return writers


@pytest.mark.parametrize(
    ("caps", "reason"),
    [
        ({"max_unauthenticated_per_ip": 4}, "max_unauthenticated_per_ip"),
        ({"max_unauthenticated": 4}, "max_unauthenticated"),
    ],
)
async def test_connections_still_in_the_tls_handshake_are_capped(
    caps: dict[str, int], reason: str
) -> None:
    n = 20
    async with running(auth_timeout=30.0, **caps) as srv:
        raw = await _raw_connections(srv.port, n)
        m = srv.core.metrics

        async def seen() -> bool:
            return len(srv.handshaking) + m.refused[reason] + m.evicted[reason] >= n

        await eventually(seen, timeout=10)

        async def capped() -> bool:
            return len(srv.handshaking) <= 4

        # Before the fix all 20 sat in their handshake, counted by no cap.
        await eventually(capped, timeout=5)
        assert srv.core.unauthenticated <= 4
        assert m.refused[reason] + m.evicted[reason] >= n - 4
        await asyncio.sleep(EVICT_AFTER + 0.1)  # the idle ones may now be evicted
        assert await http_get(srv.url, "/health") == (200, "ok")
        client = await joined(srv.url, A)
        assert srv.core.clients == 1
        await client.close()
        for w in raw:
            w.close()


# ---- 2. file descriptors: budget, backlog, collapsed accept errors -------------------


def test_fd_budget_leaves_room_for_the_backlog_and_a_reserve() -> None:
    backlog, budget = fd_budget(128, 20)
    assert backlog == 16 and budget == 128 - 20 - 16 - FD_RESERVE
    backlog, budget = fd_budget(1 << 20, 20)
    assert backlog == 511 and budget is not None and budget > 1_000_000
    assert fd_budget(resource.RLIM_INFINITY, 20) == (511, None)


def test_accept_errors_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    passed: list[dict[str, Any]] = []
    limiter = AcceptErrorLimiter(lambda loop, ctx: passed.append(ctx), 5.0, lambda: now[0])
    loop = asyncio.new_event_loop()
    try:
        context = {"message": ACCEPT_ERROR, "exception": OSError(24, "Too many open files")}
        with caplog.at_level(logging.ERROR, logger="relay.server"):
            for i in range(4096):  # asyncio: one per backlog slot, every retry
                now[0] = i / 1000
                limiter(loop, context)
            assert len(caplog.records) == 1
            now[0] = 10.0
            limiter(loop, context)
        assert len(caplog.records) == 2
        assert "repeats_left_out=4095" in caplog.records[1].getMessage()
        limiter(loop, {"message": "something else"})
        assert passed == [{"message": "something else"}]
    finally:
        loop.close()


def _relay_with_nofile(tmp: Path, limit: int, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``python -m relay`` on 127.0.0.1 whose RLIMIT_NOFILE (soft and hard) is ``limit``."""

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    log = tmp / "relay.log"
    cmd = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0", *args]
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh, cwd=ROOT, preexec_fn=lower)
    return proc, log


@contextlib.asynccontextmanager
async def _low_fd_relay(
    tmp: Path, limit: int
) -> AsyncIterator[tuple[str, int, list[socket.socket]]]:
    """A relay process whose descriptor limit is ``limit``: yields its URL, port and a
    list for the sockets the test opens (closed afterwards); checks the relay stayed up,
    stopped cleanly and logged no traceback."""
    proc, log = _relay_with_nofile(tmp, limit, "--stun-port", "0", "--auth-timeout", "30")
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        url = read_relay_url(proc.stdout)
        yield url, int(url.split(":")[2].split("/")[0]), socks
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    assert "Traceback" not in text, text[-2000:]
    assert proc.returncode == 0


async def test_a_flood_of_idle_connections_under_a_low_fd_limit(tmp_path: Path) -> None:
    async with _low_fd_relay(tmp_path, 128) as (url, port, socks):
        for _ in range(25):  # 200: more than the relay has descriptors
            for _ in range(8):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            # Paced only for speed: a full listen queue costs a 1 s SYN retransmit.
            await asyncio.sleep(0.02)
        await asyncio.sleep(EVICT_AFTER + 0.5)
        # Before the fix the relay ran out of descriptors: /health timed out and the log
        # grew by thousands of 'out of system resource' tracebacks a second.
        assert await asyncio.wait_for(http_get(url, "/health"), 10) == (200, "ok")
        client = await asyncio.wait_for(joined(url, A), 10)
        await client.close()
    text = (tmp_path / "relay.log").read_text()
    assert text.count(ACCEPT_ERROR) <= 1, text[-2000:]
    assert len(text) < 20_000, text[-2000:]
    assert "rlimit_nofile soft=128 hard=128" in text


async def test_idle_sockets_from_many_sources_cannot_spend_the_socket_budget(
    tmp_path: Path,
) -> None:
    """A socket budget below the caps on waiting connections (a 200-descriptor limit
    leaves about 130; max-unauthenticated is 4096): idle sockets from ten addresses,
    each under the per-source cap, filled it, and every new client and /health was
    closed at once until auth-timeout. Now the oldest idle one makes room."""
    async with _low_fd_relay(tmp_path, 200) as (url, port, socks):
        for _ in range(30):  # 300 sockets, 30 from each of 127.0.0.2 .. 127.0.0.11
            for source in range(2, 12):
                s = socket.socket()
                s.bind((f"127.0.0.{source}", 0))
                s.settimeout(10)
                s.connect(("127.0.0.1", port))
                socks.append(s)
            await asyncio.sleep(0.02)  # paced only for speed (a full listen queue)
        await asyncio.sleep(EVICT_AFTER + 0.5)
        assert await asyncio.wait_for(http_get(url, "/health"), 10) == (200, "ok")
        client = await asyncio.wait_for(joined(url, A), 10)
        await client.close()
        _, text = await asyncio.wait_for(http_get(url, "/metrics"), 10)
        assert metric(text, 'p2pdist_relay_evicted_total{reason="socket_budget"}') >= 1


async def test_evictions_at_the_socket_budget_do_not_push_the_relay_past_it() -> None:
    """Idle clients that complete TLS and then say nothing, in waves a second apart:
    each eviction closed gracefully (a 503, then up to the 5 s close grace), so every
    wave added its own sockets and the relay held three times its budget."""
    async with running(auth_timeout=30.0) as server:
        server.socket_budget = 10
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE

        def idle_tls(source: str) -> ssl.SSLSocket:
            raw = socket.socket()
            raw.bind((source, 0))
            raw.settimeout(10)
            raw.connect(("127.0.0.1", server.port))
            return ctx.wrap_socket(raw)  # the handshake completes; nothing more is read

        held: list[ssl.SSLSocket] = []
        try:
            for _ in range(4):
                for i in range(10):
                    held.append(await asyncio.to_thread(idle_tls, f"127.0.0.{2 + i}"))
                await asyncio.sleep(0.2)  # evicted sockets are gone within a loop pass
                assert server.sockets_open <= server.socket_budget
                await asyncio.sleep(EVICT_AFTER)
            assert server.core.metrics.evicted["socket_budget"] >= 20
            assert server.core.metrics.fd_limit_refused_total == 0
        finally:
            for s in held:
                s.close()


# ---- 3 and 9. certificate reloads ----------------------------------------------------


def _served(server: ssl.SSLContext, hostname: str | None) -> bytes:
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    der = memory_handshake(client, server, hostname=hostname).getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).digest()


def _write(crt: Path, key: Path, pair: tuple[bytes, bytes]) -> None:
    crt.write_bytes(pair[0])
    key.write_bytes(pair[1])
    key.chmod(0o600)


@pytest.mark.parametrize("order", ["ecdsa_to_rsa", "rsa_to_ecdsa"])
def test_a_reload_to_another_key_type_serves_the_new_certificate(
    tmp_path: Path, order: str
) -> None:
    ecdsa = self_signed_pem("ecdsa")
    rsa_ = self_signed_pem("rsa", rsa.generate_private_key(65537, 2048))
    first, second = (ecdsa, rsa_) if order == "ecdsa_to_rsa" else (rsa_, ecdsa)
    crt, key = tmp_path / "c.pem", tmp_path / "k.pem"
    _write(crt, key, first)
    tls = RelayTls.from_files(crt, key)
    old = tls.fingerprint
    _write(crt, key, second)
    assert tls.reload() is True
    for hostname in (None, "relay.test"):  # with and without SNI
        # Before the fix OpenSSL kept serving the old certificate (one per key type).
        assert _served(tls.context, hostname) == tls.fingerprint != old
    again = self_signed_pem("again", rsa.generate_private_key(65537, 2048))  # and back again
    _write(crt, key, again)
    assert tls.reload() is True
    assert _served(tls.context, None) == tls.fingerprint
    assert tls.fingerprints[1:] == (tls.previous[0],) and old not in tls.fingerprints


async def test_a_renewal_that_drops_the_urls_name_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The certificate's names were read at start only: a renewal to a certificate that
    no longer names public-host (clients then refuse it) went without a word."""
    from cryptography import x509

    def named(host: str) -> tuple[bytes, bytes]:
        return self_signed_pem(host, sans=[x509.DNSName(host)])

    crt, key = tmp_path / "c.pem", tmp_path / "k.pem"
    _write(crt, key, named("relay.test"))
    caplog.set_level(logging.INFO, logger="relay")
    async with running(cert=crt, cert_key=key, public_host="relay.test") as srv:
        assert "url_host_not_in_certificate" not in caplog.text
        _write(crt, key, named("other.test"))
        assert srv.check_certificate_files(asyncio.get_running_loop().time()) is True
        assert srv.tls is not None and srv.tls.names == ("other.test",)
        warned = [r.getMessage() for r in caplog.records if "url_host_not" in r.getMessage()]
        assert len(warned) == 1 and "names=other.test" in warned[0]


def test_the_previous_certificate_is_accepted_only_for_a_grace() -> None:
    new_fp = bytes(range(1, 33))
    c = core()
    s, link = upgrade(c, now=0.0)
    c.set_cert_fingerprints([new_fp], [FP], previous_until=10.0)
    c.receive(s, auth_frame(A, fp=FP), 9.0)  # handshook with the old certificate
    assert only(link)[0] is T.AUTH_OK
    s, link = upgrade(c, now=11.0)
    c.receive(s, auth_frame(B, fp=FP), 11.0)  # the grace is over
    assert only(link) == (T.ERROR, b"bad signature")
    s, link = upgrade(c, now=11.0)
    c.receive(s, auth_frame(B, fp=new_fp), 11.0)
    assert only(link)[0] is T.AUTH_OK
    c.tick(12.0)
    assert c.cert_fingerprints(0.0) == (new_fp,)  # forgotten once expired


def test_two_quick_reloads_keep_the_first_certificates_grace() -> None:
    second, third = bytes(range(1, 33)), bytes(range(2, 34))
    c = core()
    c.set_cert_fingerprints([second], [FP], previous_until=10.0)
    c.set_cert_fingerprints([third], [second], previous_until=12.0)  # before FP's ran out
    assert c.cert_fingerprints(9.0) == (third, FP, second)
    s, link = upgrade(c, now=9.0)
    c.receive(s, auth_frame(A, fp=FP), 9.0)  # handshook two certificates ago
    assert only(link)[0] is T.AUTH_OK
    c.tick(10.5)
    assert c.cert_fingerprints(10.5) == (third, second)  # each on its own deadline
    c.set_cert_fingerprints([second], [third], previous_until=20.0)  # rolled back
    assert c.cert_fingerprints(11.0) == (second, third)
    c.tick(20.0)
    assert c.cert_fingerprints(0.0) == (second,)


def test_the_previous_certificates_are_bounded() -> None:
    c = core()
    fps = [bytes([i]) * 32 for i in range(1, 10)]
    current = FP
    for i, fp in enumerate(fps):  # nine reloads within one grace
        c.set_cert_fingerprints([fp], [current], previous_until=100.0 + i)
        current = fp
    kept = c.cert_fingerprints(0.0)
    assert kept[0] == fps[-1] and len(kept) == 1 + MAX_PREVIOUS_CERTS
    assert set(kept[1:]) == set(fps[-1 - MAX_PREVIOUS_CERTS : -1])  # the longest graces


async def test_reload_bounds_the_previous_certificate_by_the_auth_timeout(
    tmp_path: Path,
) -> None:
    crt, key = tmp_path / "c.pem", tmp_path / "k.pem"
    _write(crt, key, self_signed_pem("a"))
    async with running(cert=crt, cert_key=key, auth_timeout=4.0) as srv:
        assert srv.tls is not None
        old = srv.tls.fingerprint
        _write(crt, key, self_signed_pem("b"))
        now = asyncio.get_running_loop().time()
        srv.reload()
        new = srv.tls.fingerprint
        assert srv.core.cert_fingerprints(now) == (new, old)
        _write(crt, key, self_signed_pem("c"))  # a second renewal within the grace
        srv.reload()
        newest = srv.tls.fingerprint
        assert srv.core.cert_fingerprints(now) == (newest, old, new)
        assert srv.core.cert_fingerprints(now + 2 * 4.0 + 0.5) == (newest,)


# ---- 4. per-source cap on authenticated clients -------------------------------------


def test_max_clients_per_ip_in_the_core() -> None:
    c = core(max_clients_per_ip=2)
    join(c, A)
    join(c, B)
    _, link = join(c, C)  # a third client from the same address (192.0.2.7)
    assert only(link) == (T.ERROR, b"too many clients from this address")
    assert c.metrics.auth_failures["max_clients_per_ip"] == 1
    _, link = join(c, A)  # replacing an id is not a new client
    assert only(link)[0] is T.AUTH_OK
    other = FakeLink()
    s = c.open(other, ("198.51.100.1", 5), 0.0)  # another address has its own share
    c.receive(s, upgrade_request("relay.test"), 0.0)
    other.frames()
    c.receive(s, auth_frame(C), 0.0)
    assert only(other)[0] is T.AUTH_OK and c.clients == 3
    text = c.metrics_text()
    assert 'p2pdist_relay_auth_failures_total{reason="max_clients_per_ip"} 1' in text


def test_max_clients_per_ip_from_flags_and_file(tmp_path: Path) -> None:
    assert load_config([]).max_clients_per_ip == 0  # default: no cap
    assert load_config(["--max-clients-per-ip", "8"]).max_clients_per_ip == 8
    toml = tmp_path / "relay.toml"
    toml.write_text("max-clients-per-ip = 3\n")
    assert load_config(["--config", str(toml)]).max_clients_per_ip == 3
    with pytest.raises(ConfigError, match="max-clients-per-ip must be >= 0"):
        load_config(["--max-clients-per-ip", "-1"])


async def test_one_source_cannot_take_every_client_slot() -> None:
    async with running(max_clients=10, max_clients_per_ip=2) as srv:
        kept = [await joined(srv.url, KEYS[0]), await joined(srv.url, KEYS[1])]
        with pytest.raises(RelayRefused, match="too many clients from this address"):
            await joined(srv.url, KEYS[2])
        await kept[0].close()

        async def room() -> bool:
            return srv.core.clients == 1

        await eventually(room, timeout=10)
        kept.append(await joined(srv.url, KEYS[2]))
        for k in kept[1:]:
            await k.close()


# ---- 5. a client that half-closes is gone at once -----------------------------------


@pytest.mark.parametrize("how", ["fin", "close_notify"])
async def test_a_half_closed_client_with_a_full_queue_is_gone_at_once(how: str) -> None:
    async with running(keepalive=60.0, queue_bytes=256 * 1024) as srv:
        a, b = await joined(srv.url, A), await joined(srv.url, B)
        # B stops reading TCP (under its TLS layer, which would otherwise go on reading
        # to find the relay's close_notify): its queue fills up.
        b.writer.transport._ssl_protocol._transport.pause_reading()  # type: ignore[attr-defined]

        async def full() -> bool:
            for _ in range(8):
                a.send(B.endpoint_id, b"x" * 30000)
            await a.drain()
            return srv.core.metrics.dropped["queue_full"] > 0

        await eventually(full, timeout=20)
        [conn] = [
            c for c in srv.connections if c._session and c._session.raw_id == bytes(B.endpoint_id)
        ]
        if how == "fin":
            b.writer.get_extra_info("socket").shutdown(socket.SHUT_WR)
        else:
            b.writer.close()  # TLS close_notify; B still does not read

        async def gone() -> bool:
            return srv.core.client(B.endpoint_id) is None

        # Before the fix B stayed 'connected' for 3 x keepalive (180 s here).
        await eventually(gone, timeout=10)
        assert conn._abort is not None or conn not in srv.connections  # aborted in time
        a.send(B.endpoint_id, b"anyone?")
        while (frame := await a.next_frame())[0] is not T.PEER_GONE:
            assert frame[0] is T.RECV
        assert frame == (T.PEER_GONE, bytes(B.endpoint_id))
        b.writer.transport.abort()
        await a.close()


def test_eof_in_the_core_forgets_the_client_and_closes_the_link() -> None:
    c = core()
    s, link = join(c, A)
    c.eof(s, 1.0)
    assert s.phase is Phase.CLOSED and link.closed and c.client(A.endpoint_id) is None


# ---- 6. an empty token in the environment -------------------------------------------


def test_an_empty_token_in_the_environment_is_an_error() -> None:
    with pytest.raises(ConfigError, match="token must not be empty"):
        load_config([], environ={TOKEN_ENV: ""})
    with pytest.raises(ConfigError, match="token must not be empty"):
        load_config(["--token", ""], environ={})
    assert load_config(["--token", "x"], environ={TOKEN_ENV: ""}).token == "x"  # flags win
    assert load_config([], environ={}).token is None


# ---- 7. a PEER_GONE that does not fit is neither sent nor counted -------------------


def test_a_peer_gone_dropped_for_a_full_queue_is_not_counted() -> None:
    c = core()
    s, link = join(c, A)
    link.frames()
    link.backlog = 1 << 20  # A itself is not reading: its queue is full
    nobody = b"\x42" * 32
    c.receive(s, encode_addressed(T.SEND, nobody, b"x"), 1.0)
    m = c.metrics
    assert m.peer_gone_total == 0 and link.frames() == []
    assert m.dropped == {"queue_full": 0, "queue_share": 0, "unknown_peer": 1}
    link.backlog = 0  # reading again, within the throttle's second: PEER_GONE now
    c.receive(s, encode_addressed(T.SEND, nobody, b"x"), 1.1)
    assert only(link) == (T.PEER_GONE, nobody) and m.peer_gone_total == 1


# ---- 8. an unwritable tap file ------------------------------------------------------


def test_an_unwritable_tap_file_is_a_configuration_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0"),
            *("--stun-port", "0", "--tap", str(tmp_path / "missing" / "tap.bin")),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert "p2pdist-relay: error: cannot open tap file" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- 10. shutdown honours drain_timeout ---------------------------------------------


async def test_shutdown_closes_wait_for_the_drain_timeout_not_the_close_grace() -> None:
    drain = CLOSE_GRACE * 6
    async with running(drain_timeout=drain, queue_bytes=4 << 20) as srv:
        a, b = await joined(srv.url, A), await joined(srv.url, B)
        b.writer.transport.pause_reading()  # never reads again: the relay's bytes pile up
        [conn] = [
            c for c in srv.connections if c._session and c._session.raw_id == bytes(B.endpoint_id)
        ]

        async def backed_up() -> bool:
            for _ in range(8):
                a.send(B.endpoint_id, b"x" * 30000)
            await a.drain()
            return conn.buffered() > 0  # the kernel's buffers are full: closing must wait

        await eventually(backed_up, timeout=20)
        loop = asyncio.get_running_loop()
        closing = asyncio.create_task(srv.close())

        async def armed() -> bool:
            return conn._abort is not None

        await eventually(armed, timeout=10)
        assert conn._abort is not None
        # Before the fix the connection was aborted after CLOSE_GRACE whatever the drain.
        assert conn._abort.when() - loop.time() > CLOSE_GRACE + 1
        b.writer.transport.abort()
        await asyncio.wait_for(closing, drain)
        assert not srv.connections


def test_close_grace_follows_the_drain_timeout_only_while_shutting_down() -> None:
    srv = RelayServer(load_config(["--drain-timeout", "20"]))
    assert srv.close_grace == CLOSE_GRACE
    srv._closed = True
    assert srv.close_grace == 20.0 * SHUTDOWN_GRACE_SHARE


def test_an_unwritable_url_file_names_itself_not_a_temporary_file(tmp_path: Path) -> None:
    def relay(url_file: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                *(sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0"),
                *("--stun-port", "0", "--key", str(tmp_path / "relay.key")),
                *("--url-file", str(url_file)),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )

    missing = tmp_path / "missing" / "url"  # refused before the relay binds its ports
    proc = relay(missing)
    assert proc.returncode == 2, proc.stderr
    assert f"url-file {str(missing)!r}: no directory" in proc.stderr
    assert "listening" not in proc.stderr and "Traceback" not in proc.stderr
    if not Path("/proc/self").is_dir():  # (Linux's proc file system)
        return
    unwritable = Path("/proc/p2pdist-url")  # a directory no one creates files in, root too
    proc = relay(unwritable)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot write url-file {unwritable}: " in proc.stderr
    assert ".tmp" not in proc.stderr and "Traceback" not in proc.stderr


def test_log_values_cannot_forge_a_line() -> None:
    """Client-controlled text (a request path) in a log value: a CR or LF cannot start a
    line of its own, and quotes cannot end the value early."""
    line = kv("http", path='/x\r\nauth_ok id=forged "q"', n=3, tab="a\tb")
    assert "\r" not in line and "\n" not in line and "\t" not in line
    assert line == r'http path="/x\x0d\nauth_ok id=forged \"q\"" n=3 tab="a\x09b"'
    assert kv("http", path="/a\u2028b") == r'http path="/a\u2028b"'  # a line separator too
