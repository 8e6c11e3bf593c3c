"""p2pdist-relay: the self-hosted relay server of p2pdist.

A relay forwards opaque datagrams between clients it has authenticated, addressed by
endpoint id (docs/protocol.md, section 8; operations in docs/relay.md). It never sees
plaintext: the peers encrypt end to end, and the relay only adds the sender's
authenticated id to what it forwards.

Layout (each module has one job):

* :mod:`relay.config`, :mod:`relay.cli` - the frozen configuration, TOML file and flags.
* :mod:`relay.state` - the sans-I/O core: sessions, authentication, routing, limits.
* :mod:`relay.inbound`, :mod:`relay.addresses`, :mod:`relay.session`, :mod:`relay.limits`,
  :mod:`relay.access`, :mod:`relay.metrics`, :mod:`relay.http` - the pieces the core is
  built from (no asyncio, time passed in).
* :mod:`relay.server` - thin asyncio glue: TLS listener, STUN port, timers, shutdown;
  :mod:`relay.connection` - the protocol of one client connection.
* :mod:`relay.entry` - the entry point (it takes the signals first), :mod:`relay.app` -
  the program, :mod:`relay.stopsignals` - how it takes SIGTERM, SIGINT and SIGHUP.
* :mod:`relay.tlsconfig` - the relay's certificate (pinned Ed25519 key, or a real one).
* TLS and AES-GCM records per connection: :mod:`p2pdist.transport.securestream`.
* :mod:`relay.stun_server` - the UDP port answering STUN Binding Requests.
* :mod:`relay.healthcheck` - ``python -m relay.healthcheck``, the liveness probe.
* :mod:`relay.tap` - debug tap of every byte the relay reads and writes on client links.
* :mod:`relay.testclient` - a minimal client for tests, benchmarks and smoke checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ConfigError, RelayConfig
    from .server import RelayServer

__all__ = ["ConfigError", "RelayConfig", "RelayServer"]


def __getattr__(name: str) -> object:
    # Loaded on first use, so that ``p2pdist-relay`` (relay.entry) takes its signals
    # before the slow imports.
    if name in ("ConfigError", "RelayConfig"):
        from . import config

        return getattr(config, name)
    if name == "RelayServer":
        from .server import RelayServer

        return RelayServer
    raise AttributeError(f"module 'relay' has no attribute {name!r}")
