"""``python -m relay.healthcheck``: liveness probe of a relay on this host (Docker
HEALTHCHECK, systemd, monitoring). Exit status 0 when ``GET /health`` answers ``200 ok``.

It checks that the local process accepts TLS and answers HTTP; it does not authenticate
the relay (the certificate is not verified, and nothing secret is sent or trusted). With
``--url URL`` (e.g. the content of ``--url-file``) it verifies the relay as clients do:
the pin, or the certificate through the system CAs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys
from collections.abc import Sequence

from .testclient import http_get

__all__ = ["main"]

PORT_ENV = "P2PDIST_RELAY_HEALTH_PORT"


async def _probe_local(host: str, port: int, timeout: float) -> tuple[int, bytes]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # liveness only: nothing is trusted or sent
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
        try:
            writer.write(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            raw = await reader.read()
        finally:
            writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def main(argv: Sequence[str] | None = None) -> int:
    """Probe once; 0 healthy, 1 not."""
    p = argparse.ArgumentParser(prog="python -m relay.healthcheck", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get(PORT_ENV, "8443")))
    p.add_argument("--url", help="verify the relay as clients do (pin or CA)")
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    try:
        if args.url:
            status, text = asyncio.run(http_get(args.url, "/health", timeout=args.timeout))
            body = text.encode()
        else:
            status, body = asyncio.run(_probe_local(args.host, args.port, args.timeout))
    except (OSError, TimeoutError, ValueError, IndexError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    if status != 200 or body != b"ok":
        print(f"unhealthy: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
