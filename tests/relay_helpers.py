"""Running a real relay for tests: a process (``python -m relay`` on 127.0.0.1) or an
in-process :class:`~relay.RelayServer` (:func:`running_relay`)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from relay import RelayConfig, RelayServer

ROOT = Path(__file__).resolve().parent.parent
URL_LINE = "relay url: "


@contextlib.asynccontextmanager
async def running_relay(*, tap_object: Any = None, **overrides: Any) -> AsyncIterator[RelayServer]:
    """An in-process relay on 127.0.0.1, STUN off unless asked for (``overrides``:
    RelayConfig fields; ``tap_object``: a Tap to hand the server), closed (bounded) at
    the end."""
    values: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "stun_port": 0}
    values.update(overrides)
    server = RelayServer(RelayConfig(**values), tap=tap_object)
    await server.start()
    try:
        yield server
    finally:
        await asyncio.wait_for(server.close(), 30)


def read_relay_url(stdout: IO[bytes], timeout: float = 30.0) -> str:
    """The URL from a starting relay's one stdout line ``relay url: URL``, waiting at most
    ``timeout`` seconds; ValueError saying what came instead."""
    ready, _, _ = select.select([stdout], [], [], timeout)
    line = stdout.readline().decode() if ready else ""
    if not line.startswith(URL_LINE):
        raise ValueError(f"relay printed no url line within {timeout:g} s (got {line!r})")
    return line[len(URL_LINE) :].strip()


class RelayProcess:
    """``python -m relay`` on 127.0.0.1, any free port; logs go to a file."""

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = tmp / f"relay-{os.getpid()}-{id(self)}.log"
        self._log_fh = self.log.open("wb")
        cmd = [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self._log_fh,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.url = self._read_url()

    def _read_url(self) -> str:
        assert self.proc.stdout is not None
        try:
            return read_relay_url(self.proc.stdout)
        except ValueError as exc:
            self.proc.kill()
            raise AssertionError(f"{exc}; log:\n{self.log.read_text()}") from None

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        """Signal, wait (bounded), and return (exit status, remaining stdout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=30)
        self._log_fh.close()
        return self.proc.returncode, out.decode()

    def __enter__(self) -> RelayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop(signal.SIGKILL)
        self._log_fh.close()


def ipv6_loopback() -> bool:
    """Whether this machine can bind ``::1`` (some CI containers have no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def self_signed_pem(
    name: str,
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | None = None,
    sans: list[x509.GeneralName] | None = None,
    valid_days: tuple[float, float] = (-1, 90),
) -> tuple[bytes, bytes]:
    """A self-signed certificate (PEM) and its key (PEM); ``key`` defaults to a fresh
    ECDSA P-256 key; ``sans``: its subjectAltName entries, if any; ``valid_days``: from
    when until when it is valid, in days from now."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"relay {name}")])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + datetime.timedelta(days=valid_days[0]))
        .not_valid_after(now + datetime.timedelta(days=valid_days[1]))
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(key, hashes.SHA256())
    pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return pem, key_pem


def memory_handshake(
    client: ssl.SSLContext, server: ssl.SSLContext, hostname: str | None = None
) -> ssl.SSLObject:
    """A TLS handshake between two contexts in memory, without sockets: the client's
    SSLObject once both sides completed it and (TLS 1.3) the client has read the server's
    verdict on its certificate. ssl.SSLError when either side refuses; AssertionError
    when it does not finish."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_side=False, server_hostname=hostname)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(10):
        for name, side in (("c", c), ("s", s)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            # TLS 1.3: the server's verdict on a client certificate reaches the client
            # with its first read.
            with contextlib.suppress(ssl.SSLWantReadError):
                c.read(1)
            return c
    raise AssertionError("the in-memory TLS handshake did not finish")
