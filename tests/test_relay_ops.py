"""What an operator following docs/relay.md runs into: the systemd unit as printed, the
tap file's mode and contents, allowlist edits and their logs, certificate key file
modes, the listening line and the health probe's target.

Every wait is bounded; nothing asserts on elapsed time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from relay_helpers import ipv6_loopback, self_signed_pem
from relay_helpers import running_relay as running

from p2pdist.identity import SecretKey
from p2pdist.wire.relay import (
    RelayFrameDecoder,
    RelayFrameType,
    RelayUrl,
    auth_message,
    cert_fingerprint,
    encode_frame,
    parse_challenge,
    upgrade_request,
    upgrade_response,
)
from p2pdist.wire.websocket import Opcode, WebSocketReader, client_key
from p2pdist.wire.websocket import frame as ws_frame
from p2pdist.wire.websocket import mask as ws_mask
from relay.access import Allowlist, AllowlistError
from relay.config import ConfigError
from relay.healthcheck import HOST_ENV
from relay.healthcheck import main as healthcheck
from relay.tap import AuthRedactor, FileTap, HeadSecretRedactor, read_tap
from relay.testclient import RelayRefused, RelayTestClient, _tls_open
from relay.tlsconfig import RelayTls

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "relay.md"
KEYS = [SecretKey.from_seed("relay ops tests seed", r) for r in range(6)]
TOKEN = "tok-secret-0123456789"


# ---- the systemd unit in docs/relay.md --------------------------------------------------


def systemd_unit() -> str:
    """The ``p2pdist-relay.service`` block of docs/relay.md, as printed there."""
    blocks = re.findall(r"```ini\n(.*?)```", DOCS.read_text(), re.S)
    units = [b for b in blocks if "[Service]" in b]
    assert len(units) == 1, "docs/relay.md should print exactly one systemd unit"
    return str(units[0])


def test_systemd_unit_directives_carry_no_trailing_comments() -> None:
    # systemd takes '#' as a comment only at the start of a line: after a directive it is
    # part of the value (LimitNOFILE= then fails to parse, Environment= sets junk).
    directives = 0
    for line in systemd_unit().splitlines():
        text = line.strip()
        if not text or text.startswith(("#", ";", "[")):
            continue
        name, sep, value = text.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z]+", name), f"not a directive: {line!r}"
        assert "#" not in value, f"systemd would take the comment as the value: {line!r}"
        directives += 1
    assert directives >= 10


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    unit = tmp_path / "p2pdist-relay.service"
    # The venv path of the docs does not exist here: point ExecStart at a real binary.
    unit.write_text(re.sub(r"ExecStart=\S+", "ExecStart=/bin/true", systemd_unit()))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if str(unit) in line or "p2pdist-relay.service" in line
    ]
    assert not problems, "\n".join(problems)


# ---- the tap ------------------------------------------------------------------------------


def test_tap_file_is_created_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        tap = FileTap(tmp_path / "tap.bin")
    finally:
        os.umask(old)
    tap.close()
    assert stat.S_IMODE((tmp_path / "tap.bin").stat().st_mode) == 0o600
    left = tmp_path / "old.bin"  # a tap file left from before, world-readable
    left.write_bytes(b"")
    left.chmod(0o644)
    FileTap(left).close()
    assert stat.S_IMODE(left.stat().st_mode) == 0o600


def _auth_stream(token: bytes, after: bytes = b"") -> tuple[bytes, int]:
    """A client's bytes: the upgrade, an AUTH carrying ``token``, then ``after``; and the
    offset of the token in them."""
    head = b"GET /relay HTTP/1.1\r\nHost: x\r\n\r\n"
    auth = encode_frame(RelayFrameType.AUTH, bytes(range(96)) + token)
    return head + auth + after, len(head) + 5 + 96


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 100, 4096])
def test_auth_redactor_blanks_the_token_across_any_split(chunk: int) -> None:
    ping = encode_frame(RelayFrameType.PING, b"12345678")
    auth2 = encode_frame(RelayFrameType.AUTH, b"\xff" * 96 + b"second-token")
    data, at = _auth_stream(TOKEN.encode(), ping + auth2)
    redact = AuthRedactor()
    out = b"".join(redact(data[i : i + chunk]) for i in range(0, len(data), chunk))
    assert len(out) == len(data)
    expected = bytearray(data)
    expected[at : at + len(TOKEN)] = bytes(len(TOKEN))
    second = len(expected) - len(b"second-token")
    expected[second:] = bytes(len(b"second-token"))
    assert out == bytes(expected)  # id, signature and other frames unchanged


def _ws_relay_stream(data: bytes) -> bytes:
    """The relay stream a client's WebSocket bytes carry (after the HTTP head), from
    BINARY or TEXT frames (the reader refuses TEXT: a text frame's bytes are unmasked
    here by hand)."""
    body, out = data[data.find(b"\r\n\r\n") + 4 :], bytearray()
    while body:
        size, at = body[1] & 0x7F, 2
        if size == 126:
            size, at = int.from_bytes(body[2:4], "big"), 4
        key, at = body[at : at + 4], at + 4
        if body[0] & 0x0F in (Opcode.BINARY, Opcode.TEXT, Opcode.CONTINUATION):
            out += ws_mask(body[at : at + size], key)
        body = body[at + size :]
    return bytes(out)


@pytest.mark.parametrize("opcode", [Opcode.BINARY, Opcode.TEXT])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 100, 4096])
def test_auth_redactor_blanks_the_token_in_websocket_frames_across_any_split(
    chunk: int, opcode: Opcode
) -> None:
    """A client without records speaks WebSocket: its AUTH is masked, and the mask key
    travels with it, so the tap held the token one XOR away. The redactor follows the
    WebSocket frames (a control frame between, AUTH cut across frames, a 16-bit length)
    and zeroes the masked token bytes; in TEXT frames too, which the relay refuses, but
    only after the read was tapped."""
    head = b"GET /relay HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n"
    auth = encode_frame(RelayFrameType.AUTH, bytes(range(96)) + TOKEN.encode())
    send = encode_frame(RelayFrameType.SEND, b"s" * 300)
    auth2 = encode_frame(RelayFrameType.AUTH, b"\xff" * 96 + b"second-token")
    relay_stream = auth + send + auth2
    pieces = [auth[:50], auth[50:110], auth[110:] + send, auth2]
    frames = [ws_frame(pieces[0], opcode, masked=True), ws_frame(b"ping", Opcode.PING, masked=True)]
    frames += [ws_frame(p, opcode, masked=True) for p in pieces[1:]]
    data = head + b"".join(frames)
    whole = AuthRedactor()(data)
    redact = AuthRedactor()
    out = b"".join(redact(data[i : i + chunk]) for i in range(0, len(data), chunk))
    assert out == whole and len(out) == len(data)
    seen = _ws_relay_stream(out)
    assert TOKEN.encode() not in out and TOKEN.encode() not in seen
    assert b"second-token" not in seen
    at, second = 5 + 96, len(relay_stream) - len(b"second-token")
    assert seen[:at] == relay_stream[:at]  # the rest as sent
    assert seen[at + len(TOKEN) : second] == relay_stream[at + len(TOKEN) : second]


async def test_the_tap_file_never_holds_the_token_of_a_websocket_session(tmp_path: Path) -> None:
    tap = tmp_path / "tap.bin"
    key = KEYS[0]
    async with running(token=TOKEN, tap=tap) as srv:
        url = RelayUrl.parse(srv.url)
        reader, writer, der = await _tls_open(url, None, 10.0)
        try:
            writer.write(upgrade_request(url.authority, websocket_key=client_key()))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 101"), head
            ws, frames = WebSocketReader(masked=False), RelayFrameDecoder()

            async def next_frame() -> tuple[RelayFrameType, bytes]:
                got: list[tuple[RelayFrameType, bytes]] = []
                while not got:
                    data = await asyncio.wait_for(reader.read(65536), 10)
                    assert data, "the relay closed"
                    for event in ws.feed(data):
                        got += frames.feed(bytes(event.payload))
                return got[0]

            kind, body = await next_frame()
            assert kind is RelayFrameType.CHALLENGE
            challenge, _ = parse_challenge(body)
            me = bytes(key.endpoint_id)
            sig = key.sign(auth_message(cert_fingerprint(der), challenge, me))
            auth = encode_frame(RelayFrameType.AUTH, me + sig + TOKEN.encode())
            writer.write(ws_frame(auth[:120], masked=True) + ws_frame(auth[120:], masked=True))
            assert (await next_frame())[0] is RelayFrameType.AUTH_OK
        finally:
            writer.close()
    streams = read_tap(tap)
    [inbound] = [data for (_, way), data in streams.items() if way == "in"]
    assert b"Upgrade: websocket" in inbound or b"upgrade: websocket" in inbound.lower()
    relay_stream = _ws_relay_stream(inbound)
    assert relay_stream[:1] == bytes([RelayFrameType.AUTH])
    assert TOKEN.encode() not in inbound and TOKEN.encode() not in relay_stream


def test_a_read_without_token_bytes_is_not_copied_and_a_closed_connection_is_forgotten(
    tmp_path: Path,
) -> None:
    ping = encode_frame(RelayFrameType.PING, b"12345678")
    data, at = _auth_stream(TOKEN.encode())
    redact = AuthRedactor()
    head_and_id = data[: at - 10]
    assert redact(head_and_id) is head_and_id  # no token byte in it: the same object
    rest = redact(data[at - 10 :])
    assert rest[10:] == bytes(len(TOKEN)) and rest[:10] == data[at - 10 : at]
    send = encode_frame(RelayFrameType.SEND, b"y" * 5000)
    for chunk in (ping, send[:3], send[3:100], send[100:], ping + send):
        assert redact(chunk) is chunk
    tap = FileTap(tmp_path / "tap.bin")
    tap(7, "in", data[: at + 2])  # the connection goes away in the middle of the token
    tap.forget(7)
    assert 7 not in tap._redactors
    tap(7, "in", data)  # a fresh redactor: a stream from its start
    tap.close()
    assert read_tap(tmp_path / "tap.bin")[(7, "in")][len(data[: at + 2]) :] == (
        data[:at] + bytes(len(TOKEN))
    )


async def test_the_tap_file_never_holds_the_token(tmp_path: Path) -> None:
    tap = tmp_path / "tap.bin"
    a, b = KEYS[0], KEYS[1]
    async with running(token=TOKEN, tap=tap) as srv:
        ca = await RelayTestClient.open(srv.url)
        await ca.authenticate(a, TOKEN)
        cb = await RelayTestClient.open(srv.url)
        await cb.authenticate(b, TOKEN)
        ca.send(b.endpoint_id, b"MARKER-TAP")
        assert (await asyncio.wait_for(cb.recv(), 30))[1] == b"MARKER-TAP"
        bad = await RelayTestClient.open(srv.url)
        with pytest.raises(RelayRefused):
            await bad.authenticate(KEYS[2], TOKEN[:-1] + "X")
        for c in (ca, cb, bad):
            await c.close()
    raw = tap.read_bytes()
    assert stat.S_IMODE(tap.stat().st_mode) == 0o600
    assert TOKEN[:-1].encode() not in raw
    assert b"MARKER-TAP" in raw  # still a tap of everything else
    ins = [v for (_, d), v in read_tap(tap).items() if d == "in"]
    assert len(ins) == 3
    for stream in ins:  # each AUTH frame is still there, its token zeroed
        assert b"\0" * len(TOKEN) in stream
    assert any(bytes(a.endpoint_id) in s for s in ins)  # the id is no secret


# ---- the allowlist ------------------------------------------------------------------------


def _ids(n: int, start: int = 0) -> list[str]:
    return [str(k.endpoint_id) for k in KEYS[start : start + n]]


def test_allowlist_with_a_utf8_bom_loads(tmp_path: Path) -> None:
    path = tmp_path / "allow.txt"
    path.write_bytes(("\n".join(_ids(2)) + "\n").encode("utf-8-sig"))
    allow = Allowlist(path)
    assert len(allow) == 2 and bytes(KEYS[0].endpoint_id) in allow


def _touch(path: Path, text: str, step: int) -> None:
    """Replace the file's text and move its mtime on (a reload sees it changed)."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + step * 1_000_000_000))


def test_allowlist_shrinking_to_nothing_or_by_more_than_half_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "allow.txt"
    path.write_text("\n".join(_ids(5)) + "\n")
    allow = Allowlist(path)
    caplog.set_level(logging.INFO, logger="relay.access")

    _touch(path, "\n".join(_ids(3)) + "\n", 1)  # 5 -> 3: not more than half
    allow.refresh(10.0)
    assert len(allow) == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    _touch(path, _ids(1)[0] + "\n", 2)  # 3 -> 1: more than half gone
    allow.refresh(20.0)
    assert len(allow) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"allowlist_shrunk path={path} entries=1 previous=3"]

    caplog.clear()
    _touch(path, "", 3)  # an empty (or cut at a line) file is valid: everyone refused
    allow.refresh(30.0)
    assert len(allow) == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"allowlist_empty path={path} previous=1 ")


def test_a_bad_allowlist_is_logged_once_until_the_file_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "allow.txt"
    path.write_text("\n".join(_ids(2)) + "\n")
    allow = Allowlist(path)
    caplog.set_level(logging.INFO, logger="relay.access")

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]

    _touch(path, _ids(1)[0] + "\nbad\n", 1)
    for t in range(10, 20):  # one check a second, as authentications come in
        allow.refresh(float(t))
    assert len(errors()) == 1 and "got 3" in errors()[0] and len(allow) == 2
    allow.refresh(20.0, force=True)  # SIGHUP always tries, and says so
    assert len(errors()) == 2
    _touch(path, _ids(1)[0] + "\nworse\n", 2)  # a changed file, still bad: logged again
    allow.refresh(30.0)
    allow.refresh(40.0)
    assert len(errors()) == 3
    path.unlink()  # a missing file too, once
    allow.refresh(50.0)
    allow.refresh(60.0)
    assert len(errors()) == 4 and "cannot read allowlist" in errors()[-1]
    _touch(path, _ids(1)[0] + "\n", 3)  # fixed: loads, and a later break is logged again
    allow.refresh(70.0)
    assert len(allow) == 1
    _touch(path, "bad\n", 4)
    allow.refresh(80.0)
    assert len(errors()) == 5


def test_a_malformed_allowlist_is_still_an_error_at_start(tmp_path: Path) -> None:
    path = tmp_path / "allow.txt"
    path.write_text("bad\n")
    with pytest.raises(AllowlistError, match=r"allow\.txt:1"):
        Allowlist(path)


# ---- certificate key file mode -----------------------------------------------------------


def _certificate(tmp: Path, key_mode: int) -> tuple[Path, Path]:
    cert_pem, key_pem = self_signed_pem("ops test")
    cert_path, key_path = tmp / "fullchain.pem", tmp / "privkey.pem"
    cert_path.write_bytes(cert_pem)
    key_path.write_bytes(key_pem)
    key_path.chmod(key_mode)
    return cert_path, key_path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_cert_key_readable_by_others_is_refused_like_key(tmp_path: Path, mode: int) -> None:
    cert, key = _certificate(tmp_path, mode)
    with pytest.raises(ConfigError) as info:
        RelayTls.from_files(cert, key)
    assert str(key) in str(info.value) and f"chmod 600 {key}" in str(info.value)
    assert f"{mode:04o}" in str(info.value)


def test_a_cert_key_turned_public_is_not_reloaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cert, key = _certificate(tmp_path, 0o600)
    tls = RelayTls.from_files(cert, key)
    _certificate(tmp_path, 0o644)  # a renewal copied with the wrong mode
    caplog.set_level(logging.INFO, logger="relay.tlsconfig")
    assert tls.reload() is False
    assert "certificate_reload_failed" in caplog.text and "chmod 600" in caplog.text
    key.chmod(0o600)
    assert tls.reload() is True


async def test_the_relay_refuses_to_start_with_a_public_cert_key(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        async with running(cert=cert, cert_key=key):
            pass  # pragma: no cover


# ---- the listening line and the health probe ---------------------------------------------


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
async def test_listening_line_brackets_an_ipv6_bind_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.server")
    async with running(host="::1") as srv:
        assert f" bind=[::1]:{srv.port} " in caplog.text


async def test_listening_line_shows_an_ipv4_bind_address_plainly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="relay.server")
    async with running() as srv:
        assert f" bind=127.0.0.1:{srv.port} " in caplog.text


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
async def test_listening_line_names_every_listening_socket(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--host ""`` with ``--port 0`` gives each family a port of its own: ``bind=``
    names both sockets, not the empty host with IPv4's port."""
    caplog.set_level(logging.INFO, logger="relay.server")
    async with running(host="") as srv:
        server = srv._server
        assert server is not None
        names = {sock.getsockname()[:2] for sock in server.sockets}
        assert {ip for ip, _ in names} == {"0.0.0.0", "::"}
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("listening ")]
        bind = re.search(r" bind=(\S+) ", line)
        assert bind is not None, line
        shown = bind.group(1).split(",")
        assert sorted(shown) == sorted(
            f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip, port in names
        )
        assert f"0.0.0.0:{srv.port}" in shown


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


async def test_healthcheck_host_comes_from_the_environment() -> None:
    async with running() as srv:
        port = str(RelayUrl.parse(srv.url).port)
        # The relay listens on 127.0.0.1 only: another loopback address finds nothing.
        with _env(HOST_ENV, "127.0.0.2"):
            assert await asyncio.to_thread(healthcheck, ["--port", port, "--timeout", "5"]) == 1
        with _env(HOST_ENV, "127.0.0.1"):
            assert await asyncio.to_thread(healthcheck, ["--port", port]) == 0
        with _env(HOST_ENV, "127.0.0.2"):  # --host wins over the environment
            assert (
                await asyncio.to_thread(healthcheck, ["--host", "127.0.0.1", "--port", port]) == 0
            )


async def test_a_connection_that_fails_its_tls_handshake_is_logged_with_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain-HTTP health check sent to the TLS port was logged as a bare "disconnect
    after=0.000", no reason given (an audit): the TLS error is now part of the line."""
    caplog.set_level(logging.DEBUG, logger="relay.state")
    async with running() as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: relay\r\n\r\n")
        await asyncio.wait_for(reader.read(), 10)  # the relay closes it
        writer.close()

        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "disconnect" in r.getMessage()]

        for _ in range(100):
            if said():
                break
            await asyncio.sleep(0.05)
    assert said() and "error=" in said()[0] and "http request" in said()[0].lower(), said()


@pytest.mark.parametrize("port", ["99999", "-1", "0", "65536"])
def test_healthcheck_refuses_a_port_out_of_range_in_one_line(
    port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An out-of-range port printed an OverflowError traceback (an audit): Docker's
    health log gets one "unhealthy:" line instead."""
    assert healthcheck(["--port", port, "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("unhealthy: --port must be 1..65535") and "Traceback" not in err


@pytest.mark.parametrize("chunk", [1, 2, 5, 33, 4096])
def test_the_tap_never_holds_the_record_secrets_of_either_head(tmp_path: Path, chunk: int) -> None:
    """With the record secrets (in clear in both heads) and a capture of the TCP stream,
    the AUTH travelling in records decrypts: the tap held them, and so the token."""
    mine, theirs = bytes(range(32)), bytes(range(100, 132))
    upgrade, answer = upgrade_request("relay.test", mine), upgrade_response(theirs)
    data, _ = _auth_stream(TOKEN.encode())
    inbound, outbound = upgrade + data[data.index(b"\r\n\r\n") + 4 :], answer + b"frames"
    tap = FileTap(tmp_path / "tap.bin")
    for way, stream in (("in", inbound), ("out", outbound)):
        for i in range(0, len(stream), chunk):
            tap(3, way, stream[i : i + chunk])
    tap.close()
    got = read_tap(tmp_path / "tap.bin")
    assert len(got[(3, "in")]) == len(inbound) and len(got[(3, "out")]) == len(outbound)
    for way, secret in (("in", mine), ("out", theirs)):
        assert secret.hex()[:8].encode() not in got[(3, way)]  # not a digit of it kept
    assert TOKEN.encode() not in got[(3, "in")]  # (the AUTH is still followed after it)
    assert got[(3, "out")].endswith(b"\r\n\r\nframes")  # after the head: as it was
    unchanged = b"GET /relay HTTP/1.1\r\nHost: x\r\n\r\n"
    assert HeadSecretRedactor()(unchanged) is unchanged  # no secret: not copied
