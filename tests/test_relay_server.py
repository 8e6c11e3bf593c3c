"""The relay server end to end on 127.0.0.1: in-process (:class:`relay.RelayServer`)
and as a real ``python -m relay`` subprocess, with the minimal client of
:mod:`relay.testclient` (TLS, upgrade, challenge/response, frames).

Every wait is bounded; nothing asserts on elapsed time."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import ipaddress
import logging
import os
import re
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relay_helpers import RelayProcess, ipv6_loopback
from relay_helpers import running_relay as running

from p2pdist.identity import SecretKey
from p2pdist.transport.relay_path import RelayConfig as RelayPathConfig
from p2pdist.transport.relay_path import RelayPath, parse_stun_ports
from p2pdist.wire.relay import (
    MAX_BODY,
    MAX_DATAGRAM,
    RelayFrameType,
    RelayUrl,
    auth_message,
    cert_fingerprint,
    decode_map,
    encode_addressed,
    encode_frame,
    upgrade_request,
)
from p2pdist.wire.stun import binding_request, new_transaction_id, parse_binding_response
from relay import RelayConfig, RelayServer
from relay.config import ConfigError
from relay.healthcheck import main as healthcheck
from relay.tap import read_tap
from relay.testclient import RelayRefused, RelayTestClient, client_context, http_get

ROOT = Path(__file__).resolve().parent.parent
T = RelayFrameType
KEYS = [SecretKey.from_seed("relay server tests seed", r) for r in range(8)]
A, B, C, D = KEYS[:4]


# ---- helpers ------------------------------------------------------------------------


async def joined(url: str, key: SecretKey, token: str = "", **kw: Any) -> RelayTestClient:
    client = await RelayTestClient.open(url, **kw)
    await client.authenticate(key, token)
    return client


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    """Poll ``check`` until it holds; fail after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not await check():  # noqa: ASYNC110 - polling a remote counter
            await asyncio.sleep(0.05)


def _admitted(url: str, key: SecretKey) -> Callable[[], Awaitable[bool]]:
    """A check for :func:`eventually`: ``key`` can authenticate now (the client is closed
    again)."""

    async def check() -> bool:
        try:
            client = await joined(url, key)
        except RelayRefused:
            return False
        await client.close()
        return True

    return check


def metric(text: str, name: str) -> int:
    m = re.search(rf"^{re.escape(name)} (\d+)$", text, re.M)
    assert m, f"{name} not in metrics"
    return int(m.group(1))


async def remote_metric(url: str, name: str) -> int:
    status, text = await http_get(url, "/metrics")
    assert status == 200
    return metric(text, name)


def dropped(reason: str) -> str:
    return f'p2pdist_relay_dropped_total{{reason="{reason}"}}'


def auth_failures(reason: str) -> str:
    return f'p2pdist_relay_auth_failures_total{{reason="{reason}"}}'


# ---- HTTP side, authentication, trust --------------------------------------------------


async def test_health_metrics_and_everything_else() -> None:
    async with running() as srv:
        assert await http_get(srv.url, "/health") == (200, "ok")
        status, text = await http_get(srv.url, "/metrics")
        assert status == 200 and metric(text, "p2pdist_relay_clients") == 0
        assert metric(text, dropped("queue_full")) == 0
        assert (await http_get(srv.url, "/"))[0] == 404
        assert (await http_get(srv.url, "/relay"))[0] == 400  # no Upgrade header


async def test_auth_ok_and_observed_address() -> None:
    async with running(keepalive=4.0) as srv:
        client = await RelayTestClient.open(srv.url)
        info = await client.authenticate(A)
        local = client.writer.get_extra_info("sockname")
        assert info["observed"] == f"{local[0]}:{local[1]}"
        assert info["max_datagram"] == MAX_DATAGRAM and info["keepalive"] == 4.0
        assert info["rate"] == 0
        _, text = await http_get(srv.url, "/metrics")
        assert metric(text, "p2pdist_relay_clients") == 1
        await client.close()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
async def test_ipv6_listener_url_observed_address_and_stun() -> None:
    async with running(host="::1", stun_port=None) as srv:
        assert srv.url.startswith(f"https://[::1]:{srv.port}/?pin=")
        client = await RelayTestClient.open(srv.url)
        info = await client.authenticate(A)
        local = client.writer.get_extra_info("sockname")
        assert info["observed"] == f"[::1]:{local[1]}"
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.bind(("::1", 0))
            sock.setblocking(False)
            txid = new_transaction_id()
            sock.sendto(binding_request(txid), ("::1", srv.stun_port))
            data = await asyncio.wait_for(loop.sock_recv(sock, 2048), 10)
            assert parse_binding_response(data, txid) == ("::1", sock.getsockname()[1])
        await client.close()


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
async def test_a_relay_on_both_families_observes_both() -> None:
    """``--host ""`` listens on IPv4 and IPv6: so do its observation ports (one
    dual-stack socket each), and each family's client sees its own address."""
    async with running(host="", stun_port=None) as srv:
        assert srv.stun_alt_port
        loop = asyncio.get_running_loop()
        for family, ip in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.bind((ip, 0))
                sock.setblocking(False)
                for port in srv.stun_ports:
                    txid = new_transaction_id()
                    sock.sendto(binding_request(txid), (ip, port))
                    data = await asyncio.wait_for(loop.sock_recv(sock, 2048), 10)
                    assert parse_binding_response(data, txid) == (ip, sock.getsockname()[1])
        assert srv.core.metrics.stun_requests_total == 4


async def _stun_answers(ip: str, port: int) -> bool:
    """Whether a binding request to ``ip``:``port`` is answered within a second."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    loop = asyncio.get_running_loop()
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.bind((ip, 0))
        sock.setblocking(False)
        txid = new_transaction_id()
        sock.sendto(binding_request(txid), (ip, port))
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 2048), 1.0)
        except TimeoutError:
            return False
        return parse_binding_response(data, txid) == (ip, sock.getsockname()[1])


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
async def test_the_observation_ports_serve_the_addresses_the_tcp_listener_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--host ::`` listens for IPv6 only, and its STUN ports answered IPv4 too;
    ``--host localhost`` with both 127.0.0.1 and ::1 (as many systems resolve it, made
    so here) listens on both, and its STUN ports answered on the first only."""
    async with running(host="::", stun_port=None) as srv:
        for port in srv.stun_ports:
            assert await _stun_answers("::1", port)
            assert not await _stun_answers("127.0.0.1", port)
    resolve = socket.getaddrinfo

    def both(host: Any, port: Any, *args: Any, **kw: Any) -> Any:
        if host != "localhost":
            return resolve(host, port, *args, **kw)
        return resolve("127.0.0.1", port, *args, **kw) + resolve("::1", port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", both)
    async with running(host="localhost", stun_port=None) as srv:
        server = srv._server
        assert server is not None
        assert {sock.getsockname()[0] for sock in server.sockets} == {"127.0.0.1", "::1"}
        for port in srv.stun_ports:
            assert await _stun_answers("127.0.0.1", port)
            assert await _stun_answers("::1", port)


async def test_bad_signature_and_claiming_another_id_are_refused() -> None:
    async with running() as srv:
        forged = await RelayTestClient.open(srv.url)
        with pytest.raises(RelayRefused, match="bad signature"):
            await forged.authenticate(A, claim=bytes(B.endpoint_id))  # signed by A, claims B
        assert await forged.wait_closed() == []
        corrupt = await RelayTestClient.open(srv.url)
        body = bytearray(corrupt.auth_body(A))
        body[40] ^= 1
        corrupt.write_frame(T.AUTH, bytes(body))
        assert await corrupt.next_frame() == (T.ERROR, b"bad signature")
        assert srv.core.metrics.auth_failures["bad_signature"] == 2
        assert srv.core.clients == 0


async def test_client_refuses_a_relay_whose_key_is_not_the_pin() -> None:
    async with running() as srv:
        wrong = str(RelayUrl("127.0.0.1", srv.port, B.endpoint_id))
        with pytest.raises(ssl.SSLError, match="pin"):
            await RelayTestClient.open(wrong)


def _certificate(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 that the test trusts as its own CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay test")])
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)  # a private key readable by others is refused
    return cert_path, key_path


async def test_real_certificate_mode(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    async with running(cert=cert, cert_key=key) as srv:
        assert srv.url == f"https://127.0.0.1:{srv.port}/"
        a = await joined(srv.url, A, cafile=str(cert))
        b = await joined(srv.url, B, cafile=str(cert))
        a.send(B.endpoint_id, b"over a CA-verified relay")
        assert await b.recv() == (bytes(A.endpoint_id), b"over a CA-verified relay")
        with pytest.raises(ssl.SSLCertVerificationError):  # not trusted without the CA
            await RelayTestClient.open(srv.url)
        with pytest.raises(ssl.SSLError, match="pin"):  # an ECDSA certificate is no pin
            await RelayTestClient.open(str(RelayUrl("127.0.0.1", srv.port, A.endpoint_id)))
        srv.reload()  # same files: still works
        c = await joined(srv.url, C, cafile=str(cert))
        await c.close()


async def test_a_renewed_certificate_is_taken_up_without_a_signal(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    async with running(cert=cert, cert_key=key) as srv:
        srv.cert_check_interval = 0.05
        assert srv.tls is not None
        old = srv.tls.fingerprint
        a = await joined(srv.url, A, cafile=str(cert))
        renewed = tmp_path / "renewed"
        renewed.mkdir()
        new_cert, new_key = _certificate(renewed)
        (tmp_path / "old-ca.pem").write_bytes(cert.read_bytes())
        new_key.replace(key)  # as certbot does: new files in place, no SIGHUP
        new_cert.replace(cert)
        await eventually(_async_true(lambda: srv.tls is not None and srv.tls.fingerprint != old))
        b = await joined(srv.url, B, cafile=str(cert))  # the new certificate, trusted anew
        with pytest.raises(ssl.SSLCertVerificationError):  # the old CA no longer matches
            await RelayTestClient.open(srv.url, cafile=str(tmp_path / "old-ca.pem"))
        a.send(B.endpoint_id, b"across the renewal")
        assert await b.recv() == (bytes(A.endpoint_id), b"across the renewal")
        await a.close()
        await b.close()


def _async_true(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        return check()

    return run


# ---- access control -----------------------------------------------------------------


async def test_allowlist_is_enforced_and_reloaded_when_the_file_changes(tmp_path: Path) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text(f"# relay users\n{A.endpoint_id}\n")
    async with running(allowlist=allow) as srv:
        await joined(srv.url, A)
        with pytest.raises(RelayRefused, match="endpoint not allowed"):
            await joined(srv.url, B)
        allow.write_text(f"{A.endpoint_id}\n{B.endpoint_id}  # bob\n")
        await eventually(_admitted(srv.url, B))  # the file is checked at most once per second
        assert srv.core.metrics.auth_failures["not_allowed"] >= 1


async def test_sighup_reloads_the_allowlist(tmp_path: Path) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text(f"{A.endpoint_id}\n")
    st_before = allow.stat()
    with RelayProcess(tmp_path, "--allowlist", str(allow), "--stun-port", "0") as relay:
        with pytest.raises(RelayRefused, match="endpoint not allowed"):
            await joined(relay.url, C)
        # Same size, same inode, same mtime: only SIGHUP can notice the change.
        with allow.open("r+") as fh:
            fh.write(f"{C.endpoint_id}\n")
        os.utime(allow, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
        relay.proc.send_signal(signal.SIGHUP)
        await eventually(_admitted(relay.url, C))
        assert relay.stop()[0] == 0


async def test_token_mode_from_the_environment(tmp_path: Path) -> None:
    env = {"P2PDIST_RELAY_TOKEN": "open sesame"}
    with RelayProcess(tmp_path, "--stun-port", "0", env=env) as relay:
        for token in ("", "open sesam", "open sesame!"):
            with pytest.raises(RelayRefused, match="bad token"):
                await joined(relay.url, A, token)
        a = await joined(relay.url, A, "open sesame")
        assert await remote_metric(relay.url, auth_failures("bad_token")) == 3
        await a.close()
        log = relay.log.read_text()
        assert "open sesame" not in log
        assert "token_weak chars=11" in log  # 11 characters can be guessed online


# ---- forwarding ---------------------------------------------------------------------


async def test_forwarding_carries_the_source_id_and_exact_bytes() -> None:
    async with running() as srv:
        a, b = await joined(srv.url, A), await joined(srv.url, B)
        payloads = [b"", b"\x00", os.urandom(1200), os.urandom(MAX_DATAGRAM)]
        for p in payloads:
            a.send(B.endpoint_id, p)
        for p in payloads:
            assert await b.recv() == (bytes(A.endpoint_id), p)
        b.send(A.endpoint_id, b"back")
        assert await a.recv() == (bytes(B.endpoint_id), b"back")
        a.write_frame(T.PING, b"pingpong")
        assert await a.expect(T.PONG) == b"pingpong"


async def test_wait_closed_times_out_naming_the_client_while_the_connection_is_open() -> None:
    async with running() as srv:
        a = await joined(srv.url, A)
        with pytest.raises(TimeoutError, match=A.endpoint_id.short()):
            await a.wait_closed(timeout=0.2)
        a.write_frame(T.PING, b"stillup!")  # not closed: the session still answers
        assert await a.expect(T.PONG) == b"stillup!"
        await a.close()


async def test_unknown_destination_gets_peer_gone_and_is_counted() -> None:
    async with running() as srv:
        a = await joined(srv.url, A)
        a.send(D.endpoint_id, b"anyone there?")
        assert await a.next_frame() == (T.PEER_GONE, bytes(D.endpoint_id))
        _, text = await http_get(srv.url, "/metrics")
        assert metric(text, dropped("unknown_peer")) == 1
        assert metric(text, "p2pdist_relay_peer_gone_total") == 1


async def test_newest_connection_with_the_same_id_replaces_the_old() -> None:
    async with running() as srv:
        old = await joined(srv.url, A)
        new = await joined(srv.url, A)
        assert await old.wait_closed() == [
            (T.ERROR, b"replaced by a newer connection from the same endpoint")
        ]
        b = await joined(srv.url, B)
        b.send(A.endpoint_id, b"to the new one")
        assert await new.recv() == (bytes(B.endpoint_id), b"to the new one")
        assert srv.core.metrics.replaced_total == 1 and srv.core.clients == 2


async def test_max_clients() -> None:
    async with running(max_clients=2) as srv:
        kept = [await joined(srv.url, A), await joined(srv.url, B)]
        with pytest.raises(RelayRefused, match="relay full"):
            await joined(srv.url, C)
        kept.append(await joined(srv.url, A))  # replacing an id is not a new client
        assert srv.core.clients == 2


async def test_flooding_client_is_rate_limited_while_another_pair_keeps_flowing(
    tmp_path: Path,
) -> None:
    args = ("--stun-port", "0", "--rate", "200000", "--burst", "65536")
    with RelayProcess(tmp_path, *args) as relay:
        flooder, sink = await joined(relay.url, A), await joined(relay.url, B)
        a, b = await joined(relay.url, C), await joined(relay.url, D)
        stop = asyncio.Event()

        async def flood() -> None:
            payload = b"f" * 1000
            while not stop.is_set():
                for _ in range(32):
                    flooder.send(B.endpoint_id, payload)
                await flooder.drain()
                await asyncio.sleep(0)

        async def drain_sink() -> None:
            with contextlib.suppress(OSError, TimeoutError):
                while True:
                    await sink.next_frame(timeout=120)

        tasks = [asyncio.create_task(flood()), asyncio.create_task(drain_sink())]
        try:
            limited = "p2pdist_relay_rate_paused_total"  # read at its rate, not dropped
            await eventually(lambda: _above(relay.url, limited, 0))
            for i in range(40):  # a well-behaved pair keeps flowing meanwhile
                a.send(D.endpoint_id, f"ping {i}".encode())
                assert await b.recv() == (bytes(C.endpoint_id), f"ping {i}".encode())
                b.send(C.endpoint_id, f"pong {i}".encode())
                assert await a.recv() == (bytes(D.endpoint_id), f"pong {i}".encode())
            seen = await remote_metric(relay.url, limited)
            await eventually(lambda: _above(relay.url, limited, seen))  # still flooding
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert (await asyncio.to_thread(relay.stop))[0] == 0


async def test_reconnecting_with_sends_behind_auth_gets_no_more_than_the_rate() -> None:
    """A client that reconnected over and over, writing AUTH and 15 SENDs of 16 KB in
    one go each time, moved about 120x its --rate: the frames read with AUTH were never
    charged (the bucket was looked up before AUTH made the session active) and a read
    before AUTH took 256 KiB. Now that read is charged and reads before AUTH_OK hold
    one message, so what follows AUTH waits for the bucket of the id it proves."""
    rate = burst = 100_000
    async with running(rate=rate, burst=burst) as srv:
        sink = await joined(srv.url, B)
        got = 0

        async def count() -> None:
            nonlocal got
            with contextlib.suppress(OSError, TimeoutError):
                while True:
                    got += len((await sink.recv(timeout=30))[1])

        counter = asyncio.create_task(count())
        sends = b"".join(
            encode_addressed(RelayFrameType.SEND, bytes(B.endpoint_id), b"x" * 16000)
            for _ in range(15)
        )
        start = time.monotonic()
        connections = 0
        try:
            # 1.5 s of reconnects, and at least 10 of them however loaded the machine
            while time.monotonic() - start < 1.5 or (
                connections < 10 and time.monotonic() - start < 30
            ):
                a = await RelayTestClient.open(srv.url)
                a.send_raw(encode_frame(RelayFrameType.AUTH, a.auth_body(A)) + sends)
                await a.drain()
                await a.expect(RelayFrameType.AUTH_OK)
                a.writer.transport.abort()
                connections += 1
            elapsed = time.monotonic() - start
            await asyncio.sleep(0.5)  # what was let through arrives
        finally:
            counter.cancel()
            await asyncio.gather(counter, return_exceptions=True)
        assert connections >= 10
        assert got <= burst + rate * (elapsed + 0.5) + 16000, (got, connections)


async def _above(url: str, name: str, value: int) -> bool:
    return await remote_metric(url, name) > value


async def test_slow_reader_only_loses_its_own_datagrams() -> None:
    async with running(queue_bytes=128 * 1024, drain_timeout=0.5) as srv:
        a, slow = await joined(srv.url, A), await joined(srv.url, B)
        assert slow.endpoint == B.endpoint_id  # kept open, never read
        c, d = await joined(srv.url, C), await joined(srv.url, D)
        payload = b"s" * 16000

        async def until_dropped() -> None:  # ``slow`` never reads: its buffers fill up
            while srv.core.metrics.dropped["queue_full"] == 0:
                for _ in range(16):
                    a.send(B.endpoint_id, payload)
                await a.drain()

        await asyncio.wait_for(until_dropped(), 120)
        c.send(D.endpoint_id, b"unaffected")
        assert await d.recv() == (bytes(C.endpoint_id), b"unaffected")
        assert srv.core.client(B.endpoint_id) is not None  # dropped datagrams, not the client


# ---- misbehaving clients ------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\x99\x00\x00\x00\x00", b"unknown relay frame type"),
        (bytes([T.SEND]) + (MAX_BODY + 1).to_bytes(4, "big"), b"exceeds"),
        (encode_frame(T.SEND, b"too short"), b"shorter than an endpoint id"),
        (encode_frame(T.AUTH_OK, b""), b"unexpected AUTH_OK"),
    ],
)
async def test_bad_frames_close_only_that_client(raw: bytes, reason: bytes) -> None:
    async with running() as srv:
        bad, b = await joined(srv.url, A), await joined(srv.url, B)
        bad.send_raw(raw)
        [(kind, text)] = await bad.wait_closed()
        assert kind is T.ERROR and reason in text
        c = await joined(srv.url, C)
        c.send(B.endpoint_id, b"still here")
        assert await b.recv() == (bytes(C.endpoint_id), b"still here")
        assert srv.core.metrics.protocol_errors_total == 1


async def test_truncated_frame_then_eof_closes_quietly() -> None:
    async with running() as srv:
        bad = await joined(srv.url, A)
        bad.send_raw(encode_frame(T.SEND, bytes(B.endpoint_id) + b"x" * 100)[:50])
        await bad.close()
        await eventually(_no_clients(srv))
        b = await joined(srv.url, B)
        await b.close()


def _no_clients(srv: RelayServer) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return srv.core.clients == 0

    return check


@pytest.fixture(scope="module")
def shared_relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    """One relay subprocess for the property-based tests."""
    tmp = tmp_path_factory.mktemp("relay")
    with RelayProcess(tmp, "--stun-port", "0", "--auth-timeout", "5") as relay:
        yield relay
        assert relay.proc.poll() is None, "the relay died"
        assert relay.stop()[0] == 0


async def _probe(url: str) -> None:
    """The relay is up and forwards between two fresh, well-behaved clients."""
    a, b = await joined(url, KEYS[6]), await joined(url, KEYS[7])
    a.send(KEYS[7].endpoint_id, b"probe")
    assert await b.recv() == (bytes(KEYS[6].endpoint_id), b"probe")
    await asyncio.gather(a.close(), b.close())


async def _garbage(url: str, phase: str, data: bytes) -> None:
    u = RelayUrl.parse(url)
    if phase == "http":
        ctx = client_context(u)  # pinned URL: the pin is not checked for garbage
        _, writer = await asyncio.wait_for(asyncio.open_connection(u.host, u.port, ssl=ctx), 10)
        writer.write(data)
        await writer.drain()
        writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 5)
        return
    client = await RelayTestClient.open(url)
    if phase == "active":
        await client.authenticate(KEYS[5])
    client.send_raw(data)
    await client.drain()
    await client.close()


_frame_like = st.builds(
    lambda kind, length, body: bytes([kind]) + length.to_bytes(4, "big") + body,
    st.sampled_from([int(t) for t in T] + [0, 0x05, 0x13, 0xFF]),
    st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1)),
    st.binary(max_size=300),
)
_garbage_bytes = st.one_of(
    st.binary(max_size=4096),
    st.lists(_frame_like, min_size=1, max_size=8).map(b"".join),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_garbage_bytes, phase=st.sampled_from(["http", "auth"]))
def test_random_bytes_before_auth_never_hurt_the_relay(
    shared_relay: RelayProcess, data: bytes, phase: str
) -> None:
    async def scenario() -> None:
        await _garbage(shared_relay.url, phase, data)
        await _probe(shared_relay.url)

    asyncio.run(scenario())
    assert shared_relay.proc.poll() is None


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_garbage_bytes)
def test_random_bytes_after_auth_never_hurt_the_relay(
    shared_relay: RelayProcess, data: bytes
) -> None:
    async def scenario() -> None:
        await _garbage(shared_relay.url, "active", data)
        await _probe(shared_relay.url)

    asyncio.run(scenario())
    assert shared_relay.proc.poll() is None


_UNKNOWN_TYPES = sorted(set(range(256)) - {int(t) for t in T})
_good_frames = st.lists(
    st.one_of(
        st.binary(min_size=8, max_size=8).map(lambda b: encode_frame(T.PING, b)),
        st.binary(max_size=200).map(
            lambda b: encode_frame(T.SEND, bytes(KEYS[4].endpoint_id) + b)  # nobody: PEER_GONE
        ),
    ),
    max_size=5,
).map(b"".join)
_bad_frame = st.one_of(
    st.builds(  # a type the protocol does not have, with a body of any length
        lambda kind, body: bytes([kind]) + len(body).to_bytes(4, "big") + body,
        st.sampled_from(_UNKNOWN_TYPES),
        st.binary(max_size=300),
    ),
    st.integers(MAX_BODY + 1, 2**32 - 1).map(  # a head announcing an oversized body
        lambda n: bytes([T.SEND]) + n.to_bytes(4, "big")
    ),
    st.binary(max_size=31).map(lambda b: encode_frame(T.SEND, b)),  # no room for an id
    st.binary(max_size=64).map(lambda b: encode_frame(T.AUTH_OK, b)),  # a relay's frame
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(good=_good_frames, bad=_bad_frame, tail=st.binary(max_size=64))
def test_a_bad_frame_after_good_ones_closes_that_client(
    shared_relay: RelayProcess, good: bytes, bad: bytes, tail: bytes
) -> None:
    """Well-formed frames are served, then the first malformed one (whatever follows it)
    gets an ERROR and the connection closed by the relay, not by the client."""

    async def scenario() -> None:
        client = await RelayTestClient.open(shared_relay.url)
        await client.authenticate(KEYS[5])
        client.send_raw(good + bad + tail)
        await client.drain()
        seen = await client.wait_closed()
        assert seen and seen[-1][0] is T.ERROR, seen
        answers = [kind for kind, _ in seen[:-1]]
        assert set(answers) <= {T.PONG, T.PEER_GONE}, answers
        await _probe(shared_relay.url)

    asyncio.run(scenario())
    assert shared_relay.proc.poll() is None


# ---- liveness, STUN, shutdown, tap, CLI -------------------------------------------------


async def test_silent_client_is_dropped_after_three_keepalives() -> None:
    async with running(keepalive=0.2) as srv:
        silent = await joined(srv.url, A)
        frames = await silent.wait_closed(timeout=30)
        assert frames[-1][0] is T.ERROR and b"no traffic" in frames[-1][1]
        assert srv.core.metrics.keepalive_timeouts_total == 1


async def test_stun_binding_reports_the_observed_address() -> None:
    async with running(stun_port=None) as srv:  # the TCP port's number, over UDP
        assert srv.stun_port == srv.port
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.setblocking(False)
            txid = new_transaction_id()
            sock.sendto(b"not stun", ("127.0.0.1", srv.stun_port))  # ignored
            sock.sendto(binding_request(txid), ("127.0.0.1", srv.stun_port))
            data = await asyncio.wait_for(loop.sock_recv(sock, 2048), 10)
            assert parse_binding_response(data, txid) == sock.getsockname()
        assert srv.core.metrics.stun_requests_total == 1


def test_stun_requests_go_unanswered_while_replies_wait_for_the_uplink() -> None:
    """A full uplink (sendto would block): asyncio queues every reply, without bound, so
    past 64 KiB waiting a request is counted and left unanswered, and answered again
    once the replies have left."""
    from relay.metrics import Metrics
    from relay.stun_server import STUN_BACKLOG, StunProtocol

    class Uplink:
        def __init__(self) -> None:
            self.waiting = 0
            self.sent = 0

        def get_write_buffer_size(self) -> int:
            return self.waiting

        def sendto(self, data: bytes, addr: Any) -> None:
            self.sent += 1
            self.waiting += len(data)

    metrics, uplink = Metrics(), Uplink()
    stun = StunProtocol(metrics)
    stun.connection_made(uplink)  # type: ignore[arg-type]
    for _ in range(10_000):
        stun.datagram_received(binding_request(new_transaction_id()), ("192.0.2.7", 4000))
    assert uplink.waiting <= STUN_BACKLOG + 64  # one reply past the bound at most
    assert metrics.stun_requests_total == uplink.sent and uplink.sent < 10_000
    assert metrics.stun_dropped_total == 10_000 - uplink.sent
    uplink.waiting = 0  # the kernel took them
    stun.datagram_received(binding_request(new_transaction_id()), ("192.0.2.7", 4000))
    assert metrics.stun_requests_total == uplink.sent


async def _mapped(sock: socket.socket, port: int) -> tuple[str, int]:
    """The address the relay's observation port ``port`` saw ``sock`` at."""
    txid = new_transaction_id()
    sock.sendto(binding_request(txid), ("127.0.0.1", port))
    data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 2048), 10)
    return parse_binding_response(data, txid)


def _udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def test_second_observation_port_is_bound_answered_and_advertised() -> None:
    async with running(stun_port=None) as srv:  # the alternate port defaults to STUN + 1
        assert srv.stun_alt_port == srv.stun_port + 1
        assert srv.stun_ports == (srv.stun_port, srv.stun_alt_port)
        with _udp_socket() as sock:  # one local socket, both relay ports: same mapping
            assert await _mapped(sock, srv.stun_port) == sock.getsockname()
            assert await _mapped(sock, srv.stun_alt_port) == sock.getsockname()
        assert srv.core.metrics.stun_requests_total == 2
        client = await RelayTestClient.open(srv.url)
        info = await client.authenticate(A)
        assert info["stun_ports"] == [srv.stun_port, srv.stun_alt_port]
        await client.close()


def _port_pair() -> tuple[int, socket.socket]:
    """A free UDP port p, with p + 1 held by the returned socket."""
    for _ in range(50):
        held = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        held.bind(("127.0.0.1", 0))
        p = held.getsockname()[1] - 1
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.bind(("127.0.0.1", p))
        except OSError:
            held.close()
            continue
        return p, held
    raise AssertionError("no free UDP port pair")


async def test_default_alternate_port_taken_runs_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    p, held = _port_pair()
    with held:
        async with running(stun_port=p) as srv:
            assert (srv.stun_port, srv.stun_alt_port, srv.stun_ports) == (p, 0, (p,))
            info = await (await RelayTestClient.open(srv.url)).authenticate(A)
            assert info["stun_ports"] == [p]
        assert "stun_alt_port_unavailable" in caplog.text
        # Asked for explicitly, the same port is a startup error, like --stun-port.
        server = RelayServer(
            RelayConfig(host="127.0.0.1", port=0, stun_port=p, stun_alt_port=p + 1)
        )
        with pytest.raises(ConfigError, match="cannot bind STUN alternate port"):
            await server.start()
        await server.close()
        # ... and so is a taken STUN port, which the alternate port does not change.
        server = RelayServer(
            RelayConfig(host="127.0.0.1", port=0, stun_port=p + 1, stun_alt_port=0)
        )
        caplog.clear()
        caplog.set_level(logging.INFO, logger="relay")
        with pytest.raises(ConfigError, match="cannot bind STUN port"):
            await server.start()
        await server.close()
        # A relay that never started logs no shutdown (it logged "shutdown" and
        # "stopped" before its startup error, as if it had run).
        assert "shutdown" not in caplog.text and "stopped" not in caplog.text, caplog.text


async def test_observation_ports_off_and_explicit() -> None:
    async with running() as srv:  # stun_port=0: none at all
        assert srv.stun_ports == ()
        info = await (await RelayTestClient.open(srv.url)).authenticate(A)
        assert info["stun_ports"] == []
    async with running(stun_port=None, stun_alt_port=0) as srv:
        assert srv.stun_ports == (srv.port,)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as free:
        free.bind(("127.0.0.1", 0))
        alt = free.getsockname()[1]
    async with running(stun_port=None, stun_alt_port=alt) as srv:
        assert srv.stun_ports == (srv.port, alt)
        with _udp_socket() as sock:
            assert await _mapped(sock, alt) == sock.getsockname()


async def test_relay_path_status_carries_the_observation_ports() -> None:
    async with running(stun_port=None) as srv:
        path = RelayPath(A, srv.url, config=RelayPathConfig(connect_timeout=10.0))
        try:
            await path.wait_connected(10)
            assert path.status.stun_ports == srv.stun_ports and len(srv.stun_ports) == 2
        finally:
            await path.close()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([3478, 3479], (3478, 3479)),
        ([3478], (3478,)),
        ((3478, 3478), (3478,)),
        ([], ()),
        (None, ()),
        ("3478", ()),
        ([3478, "3479"], ()),
        ([0], ()),
        ([70000], ()),
        ([True], ()),
        ([1.5], ()),
        ({"a": 1}, ()),
        (list(range(1, 20)), ()),
    ],
)
def test_parse_stun_ports_ignores_malformed(value: object, expected: tuple[int, ...]) -> None:
    assert parse_stun_ports(value) == expected


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_graceful_shutdown_sends_reconnect_and_exits_0(tmp_path: Path, sig: int) -> None:
    with RelayProcess(tmp_path, "--stun-port", "0", "--retry-after", "2") as relay:
        a, b = await joined(relay.url, A), await joined(relay.url, B)
        pending = await RelayTestClient.open(relay.url)  # upgraded, not authenticated
        code, rest = await asyncio.to_thread(relay.stop, sig)  # clients keep reading
        for client in (a, b):
            frames = await client.wait_closed()
            assert frames[-1][0] is T.RECONNECT
            assert decode_map(frames[-1][1]) == {
                "reason": "relay shutting down",
                "retry_after": 2.0,
            }
        assert await pending.wait_closed() == []
        assert code == 0 and rest == ""  # the url line was the only stdout line
        log = relay.log.read_text()
        assert "shutdown" in log and "Traceback" not in log


_VALUE = r'(?:"(?:[^"\\]|\\.)*"|[^ "=]+)'
"""A log value: bare, or quoted with backslash escapes (relay/logfmt.py)."""
_LOG_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) relay(?:\.\w+)* "
    rf"([a-z_]+)((?: [a-z_0-9]+={_VALUE})*)$"
)
_FIELD = re.compile(rf" ([a-z_0-9]+)=({_VALUE})")


async def test_the_log_is_one_structured_event_a_line_with_short_connection_ids(
    tmp_path: Path,
) -> None:
    """What docs/relay.md "Logs" promises an operator's log shipper: every stderr line is
    ``time level logger event key=value ...``; connections are named ``c<n>`` before
    authentication and ``c<n>/<first 10 characters of the endpoint id>`` after, a refusal
    names the id claimed, and the token never appears."""
    token = "log-test-token-4f7c2a9e"
    with RelayProcess(tmp_path, "--stun-port", "0", env={"P2PDIST_RELAY_TOKEN": token}) as relay:
        a = await joined(relay.url, A, token)
        with pytest.raises(RelayRefused, match="token"):
            await joined(relay.url, B, token + "x")
        again = await joined(relay.url, A, token)  # replaces the first
        assert await a.wait_closed()
        code, _ = await asyncio.to_thread(relay.stop)
        await again.wait_closed()
    assert code == 0
    lines = relay.log.read_text().splitlines()
    assert lines and token not in "\n".join(lines)
    events: dict[str, list[dict[str, str]]] = {}
    for line in lines:
        match = _LOG_LINE.match(line)
        assert match, f"not a structured log line: {line!r}"
        fields = dict(_FIELD.findall(match.group(3)))
        events.setdefault(match.group(2), []).append(fields)
    short_a, short_b = A.endpoint_id.short(), B.endpoint_id.short()
    oks = [f["conn"] for f in events["auth_ok"]]
    assert len(oks) == 2 and all(re.fullmatch(rf"c\d+/{short_a}", c) for c in oks), oks
    [refused] = events["auth_failed"]
    assert re.fullmatch(r"c\d+", refused["conn"]), refused  # not authenticated: no id
    assert refused["claimed"] == short_b and refused["reason"] == "bad_token"
    assert [f["conn"] for f in events["replaced"]] == oks[:1]
    assert events["replaced"][0]["by"] == oks[1]  # and which connection took over
    for event in ("listening", "shutdown", "reconnect_all", "stopped"):
        assert event in events, sorted(events)


def silent_client(url: str, key: SecretKey) -> ssl.SSLSocket:
    """An authenticated client that then never reads (a blocking socket nobody drains):
    the relay's graceful shutdown waits for it up to the drain timeout."""
    u = RelayUrl.parse(url)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the test's own relay
    sock = ctx.wrap_socket(socket.create_connection((u.host, u.port), timeout=10))
    der = sock.getpeercert(True)
    assert der is not None
    sock.sendall(upgrade_request(u.host))
    got = b""
    while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < 38:
        got += sock.recv(4096)
    challenge = got.split(b"\r\n\r\n", 1)[1][6:38]
    me = bytes(key.endpoint_id)
    proof = key.sign(auth_message(cert_fingerprint(der), challenge, me))
    sock.sendall(encode_frame(RelayFrameType.AUTH, me + proof))
    return sock


@pytest.mark.parametrize("second", [signal.SIGHUP, signal.SIGTERM], ids=["HUP", "TERM"])
def test_a_signal_during_the_drain_does_not_kill_the_relay(tmp_path: Path, second: int) -> None:
    """A reload (SIGHUP) or a second stop signal while the relay drains used to take the
    default action (the handlers were gone): killed mid-drain, a non-zero exit."""
    with RelayProcess(tmp_path, "--stun-port", "0", "--drain-timeout", "2") as relay:
        sock = silent_client(relay.url, A)
        try:
            time.sleep(0.3)  # authenticated
            relay.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            relay.proc.send_signal(second)
            code, _ = relay.stop()
        finally:
            sock.close()
        assert code == 0
        assert relay.log.read_text().rstrip().endswith("stopped")


@pytest.mark.parametrize(
    "second", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=["HUP", "TERM", "INT"]
)
def test_a_signal_after_the_drain_does_not_kill_the_relay(tmp_path: Path, second: int) -> None:
    """Between the end of the drain ("stopped") and the process's exit the loop shuts
    down; a signal there (a reload hook's SIGHUP right after a stop) took the default
    action: exit 129, 143 or 130 after a clean stop."""
    with RelayProcess(tmp_path, "--stun-port", "0") as relay:
        relay.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not relay.log.read_text().rstrip().endswith("stopped"):
            assert time.monotonic() < deadline and relay.proc.poll() is None
            time.sleep(0.001)
        # Sent at once: the teardown after "stopped" takes 0.1-0.2 s. With the loop's
        # handlers given way to SIG_IGN one at a time, a signal here took the default
        # action in about 1 run in 40 (the moment between a handler's removal and
        # SIG_IGN); the relay's own handlers now switch to SIG_IGN in one step.
        assert relay.proc.poll() is None, "exited before the second signal: proves nothing"
        relay.proc.send_signal(second)
        # Waited for, not stopped: stop() would send a third signal to a process still
        # tearing down on a loaded machine, and prove nothing about the second.
        code = relay.proc.wait(timeout=30)
        relay.stop()
        assert code == 0


async def test_tap_sees_every_byte_the_relay_handles(tmp_path: Path) -> None:
    seen: dict[tuple[int, str], bytearray] = {}

    def tap(conn: int, direction: str, data: bytes) -> None:
        seen.setdefault((conn, direction), bytearray()).extend(data)

    async with running(tap_object=tap) as srv:
        a, b = await joined(srv.url, A), await joined(srv.url, B)
        a.send(B.endpoint_id, b"MARKER-1234")
        await b.recv()
    ins = [bytes(v) for (_, d), v in seen.items() if d == "in"]
    outs = [bytes(v) for (_, d), v in seen.items() if d == "out"]
    assert any(b"MARKER-1234" in x for x in ins) and any(b"MARKER-1234" in x for x in outs)
    assert any(x.startswith(b"GET /relay HTTP/1.1\r\n") for x in ins)

    tap_file = tmp_path / "tap.bin"
    with RelayProcess(tmp_path, "--stun-port", "0", "--tap", str(tap_file)) as relay:
        a, b = await joined(relay.url, A), await joined(relay.url, B)
        a.send(B.endpoint_id, b"MARKER-5678")
        await b.recv()
        assert (await asyncio.to_thread(relay.stop))[0] == 0
    streams = read_tap(str(tap_file))  # the name given to --tap, as docs/relay.md shows
    assert sum(b"MARKER-5678" in v for v in streams.values()) == 2  # in from A, out to B


def test_cli_key_file_is_created_private_and_keeps_the_pin(tmp_path: Path) -> None:
    key, url_file = tmp_path / "relay.key", tmp_path / "relay.url"
    args = ("--key", str(key), "--stun-port", "0", "--url-file", str(url_file))
    with RelayProcess(tmp_path, *args) as first:
        url1 = first.url
        assert url_file.read_text() == url1 + "\n"
        port = str(RelayUrl.parse(url1).port)
        assert healthcheck(["--url", url1]) == 0 and healthcheck(["--port", port]) == 0
        wrong = str(RelayUrl("127.0.0.1", int(port), B.endpoint_id))
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert healthcheck(["--url", wrong]) == 1
        # the message itself, not the repr of ssl.SSLError's args tuple
        assert err.getvalue() == "unhealthy: relay key does not match the pin in its URL\n"
        for empty in ("", " \n"):  # "$(cat relay.url)" of a missing file checked nothing
            with contextlib.redirect_stderr(io.StringIO()) as err:
                assert healthcheck(["--url", empty, "--port", port]) == 1
            assert "--url is empty" in err.getvalue()
        assert first.stop()[0] == 0
    assert not url_file.exists()  # a stopped relay's URL is not left for scripts to dial
    assert healthcheck(["--port", port, "--timeout", "5"]) == 1
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert RelayUrl.parse(url1).pin == SecretKey.load(key).endpoint_id
    with RelayProcess(tmp_path, "--key", str(key), "--stun-port", "0") as second:
        assert RelayUrl.parse(second.url).pin == RelayUrl.parse(url1).pin
        assert second.stop()[0] == 0


def test_a_dual_stack_relay_prints_a_url_it_answers_on(tmp_path: Path) -> None:
    """``--host ""`` listens on IPv4 and IPv6; with ``--port 0`` each family got its own
    port, and the URL (127.0.0.1) took the IPv6 socket's: nobody answered there."""
    with RelayProcess(tmp_path, "--host", "", "--port", "0", "--stun-port", "0") as relay:
        url = RelayUrl.parse(relay.url)
        assert url.host == "127.0.0.1"
        assert healthcheck(["--url", relay.url]) == 0
        assert relay.stop()[0] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rate", "1000", "--burst", "1000"], "burst must be at least"),
        (["--cert", "x.pem"], "cert and cert-key"),
        (["--allowlist", "/nonexistent/allow"], "cannot read allowlist"),
        (["--config", "/nonexistent.toml"], "does not exist"),
        (["--max-clients", "zero"], "integer"),
        (["--stun-port", "0", "--stun-alt-port", "3479"], "stun-alt-port needs"),
    ],
)
def test_cli_configuration_errors_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "p2pdist-relay: error:" in proc.stderr and message in proc.stderr


async def test_connections_share_one_read_buffer() -> None:
    """Every client connection's stream reads ciphertext into the same buffer, and the
    relay's protocol receives plaintext into the server's one scratch: no connection
    holds a receive buffer of its own."""
    async with running() as srv:
        a, b = await joined(srv.url, A), await joined(srv.url, B)
        a.send(B.endpoint_id, b"x" * 40000)
        assert await b.recv() == (bytes(A.endpoint_id), b"x" * 40000)
        conns = list(srv.connections)
        assert len(conns) == 2
        assert {c.get_buffer(-1).obj is srv.scratch for c in conns} == {True}
        views = [c.stream.get_buffer(-1) for c in conns if c.stream is not None]
        assert len(views) == 2 and views[0].obj is views[1].obj
        await a.close()
        await b.close()
