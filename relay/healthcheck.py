"""``python -m relay.healthcheck``: liveness probe of a relay on this host (Docker
HEALTHCHECK, systemd, monitoring). Exit status 0 when ``GET /health`` answers ``200 ok``.

It checks that the local process accepts TLS and answers HTTP; it does not authenticate
the relay (the certificate is not verified, and nothing secret is sent or trusted). With
``--url URL`` (e.g. the content of ``--url-file``) it verifies the relay as clients do:
the pin, or the certificate through the system CAs.

Without ``--url`` it probes ``127.0.0.1`` on port 8443; ``--host``/``--port``, or the
environment variables ``P2PDIST_RELAY_HEALTH_HOST``/``P2PDIST_RELAY_HEALTH_PORT`` (for a
Docker HEALTHCHECK), point it elsewhere, e.g. at a relay bound to one address only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from p2pdist.wire.relay import RelayUrl

from .testclient import http_get

__all__ = ["main"]

PORT_ENV = "P2PDIST_RELAY_HEALTH_PORT"
HOST_ENV = "P2PDIST_RELAY_HEALTH_HOST"


def main(argv: Sequence[str] | None = None) -> int:
    """Probe once; 0 healthy, 1 not."""
    p = argparse.ArgumentParser(prog="python -m relay.healthcheck", description=__doc__)
    p.add_argument(
        "--host",
        default=os.environ.get(HOST_ENV) or "127.0.0.1",
        help=f"the relay's host (default ${HOST_ENV}, else 127.0.0.1)",
    )
    # A string default: argparse converts it like a flag's value, so a bad variable is
    # a usage error, not a traceback (an empty one means the default port).
    p.add_argument(
        "--port",
        type=int,
        default=os.environ.get(PORT_ENV) or "8443",
        help=f"the relay's TLS port (default ${PORT_ENV}, else 8443)",
    )
    p.add_argument("--url", help="verify the relay as clients do (pin or CA)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # argparse's 2 is the "starting" status to Docker
        return 1 if exc.code else 0
    if args.timeout <= 0 or args.timeout != args.timeout:
        print(f"unhealthy: --timeout must be positive, got {args.timeout}", file=sys.stderr)
        return 1
    if not 1 <= args.port <= 65535:
        print(f"unhealthy: --port must be 1..65535, got {args.port}", file=sys.stderr)
        return 1
    if args.url is not None and not args.url.strip():
        # "$(cat /data/relay.url)" of a missing or empty file: checking no key at all
        # would report a relay healthy that clients cannot verify.
        print("unhealthy: --url is empty (is the relay's url-file written?)", file=sys.stderr)
        return 1
    # With --url the relay is verified as clients do; with --port nothing is.
    url = args.url or RelayUrl(args.host, args.port, None)
    try:
        status, body = asyncio.run(
            http_get(url, "/health", timeout=args.timeout, verify=bool(args.url))
        )
    except (OSError, TimeoutError, ValueError, IndexError, OverflowError) as exc:
        # str() of an ssl.SSLError made with a message alone is its args tuple
        text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
        why = text or type(exc).__name__  # a timeout has no text of its own
        if isinstance(exc, TimeoutError):
            why = f"no answer within {args.timeout:g} s"
        print(f"unhealthy: {why}", file=sys.stderr)
        return 1
    if status != 200 or body != "ok":
        print(f"unhealthy: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
