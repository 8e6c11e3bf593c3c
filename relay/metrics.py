"""Counters of the relay and their Prometheus text rendering (``GET /metrics``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AUTH_FAILURE_REASONS", "DROP_REASONS", "EVICT_REASONS", "REFUSE_REASONS", "Metrics"]

DROP_REASONS = ("queue_full", "queue_share", "unknown_peer")
"""Why datagrams were dropped: the destination's queue was full, or over half full and
the sender had added its share of it, or the destination is not connected (a client
over its rate is read more slowly instead: ``rate_paused_total``)."""
AUTH_FAILURE_REASONS = (
    "bad_signature",
    "bad_token",
    "not_allowed",
    "relay_full",
    "max_clients_per_ip",
    "malformed",
    "timeout",
    "shutting_down",
)
REFUSE_REASONS = ("max_unauthenticated", "max_unauthenticated_per_ip")
"""The cap that was full of young connections when a newcomer was turned away (503)."""
EVICT_REASONS = (*REFUSE_REASONS, "socket_budget")
"""The cap that was reached when a connection waiting to authenticate was evicted."""
SETUP_PHASES = ("tls", "http", "auth")
"""Where a connection that ended before it authenticated was: its TLS handshake, the
HTTP upgrade request, or the AUTH frame (``abandoned_total``)."""
PREFIX = "p2pdist_relay_"


def _counter(help_text: str) -> Any:
    """An integer counter exported under its field name (``PREFIX`` + name)."""
    return field(default=0, metadata={"help": help_text})


def _labelled(name: str, help_text: str, label: str = "reason") -> dict[str, str]:
    """Metadata of a counter with a ``label`` label, exported as ``name``."""
    return {"help": help_text, "name": name, "label": label}


def _per_reason(reasons: tuple[str, ...]) -> Callable[[], dict[str, int]]:
    """Default factory of a counter per reason: a fresh dict of zeros per instance.

    (Not ``field(**kwargs)`` from one helper: mypy's dataclass plugin cannot read unpacked
    ``field()`` arguments, and a helper returning ``field()`` trips ruff's RUF009.)"""
    return lambda: dict.fromkeys(reasons, 0)


@dataclass(slots=True)
class Metrics:
    """Plain integer counters; the core increments them, :meth:`render` exports them
    (each field's name and help text are the metric's)."""

    connections_total: int = _counter(
        "connections accepted (counted when TCP is accepted; one closed at once at the "
        "socket budget counts in fd_limit_refused_total instead)"
    )
    fd_limit_refused_total: int = _counter(
        "TCP connections closed at once because the relay was near its file descriptor limit"
    )
    auth_ok_total: int = _counter("clients authenticated")
    replaced_total: int = _counter("connections replaced by a newer one with the same id")
    bytes_in_total: int = _counter("bytes read from clients (after TLS)")
    bytes_out_total: int = _counter(
        "bytes written to clients (before TLS; WebSocket headers and controls included)"
    )
    datagrams_in_total: int = _counter("SEND frames received")
    datagrams_out_total: int = _counter("RECV frames queued to destinations")
    peer_gone_total: int = _counter("PEER_GONE frames queued to clients")
    protocol_errors_total: int = _counter("connections closed for breaking the protocol")
    keepalive_timeouts_total: int = _counter("clients dropped after 3 x keepalive of silence")
    websocket_upgrades_total: int = _counter(
        "upgrades that chose WebSocket framing (through a proxy, or without records)"
    )
    http_requests_total: int = _counter("plain HTTP requests answered (health, metrics, errors)")
    rate_paused_total: int = _counter(
        "times a client's reading was paused because it sent faster than its rate"
    )
    stun_requests_total: int = _counter("STUN binding requests answered")
    stun_dropped_total: int = _counter(
        "STUN binding requests left unanswered: replies already waiting for the uplink"
    )
    dropped: dict[str, int] = field(
        default_factory=_per_reason(DROP_REASONS),
        metadata=_labelled("dropped_total", "datagrams dropped, by reason"),
    )
    auth_failures: dict[str, int] = field(
        default_factory=_per_reason(AUTH_FAILURE_REASONS),
        metadata=_labelled("auth_failures_total", "refused authentications, by reason"),
    )
    refused: dict[str, int] = field(
        default_factory=_per_reason(REFUSE_REASONS),
        metadata=_labelled(
            "refused_total",
            "new connections answered 503 because the cap was full of connections that "
            "had waited less than a second to authenticate, by the cap that was reached",
        ),
    )
    abandoned: dict[str, int] = field(
        default_factory=_per_reason(SETUP_PHASES),
        metadata=_labelled(
            "abandoned_total",
            "connections that ended before authenticating, neither refused nor evicted: "
            "timed out, closed or reset by the client, a failed TLS handshake, or a limit "
            "of the stream before the upgrade, by the phase they were in",
            label="phase",
        ),
    )
    evicted: dict[str, int] = field(
        default_factory=_per_reason(EVICT_REASONS),
        metadata=_labelled(
            "evicted_total",
            "connections waiting to authenticate closed to make room for a newer one, "
            "by the cap that was reached",
        ),
    )

    def render(self, *, clients: int, connections: int, unauthenticated: int = 0) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out = [
            f"# HELP {PREFIX}clients authenticated clients connected now",
            f"# TYPE {PREFIX}clients gauge",
            f"{PREFIX}clients {clients}",
            # Not "connections": OpenMetrics readers take connections_total (the
            # counter) for that family too and refuse the pair.
            f"# HELP {PREFIX}open_connections open client connections (any phase)",
            f"# TYPE {PREFIX}open_connections gauge",
            f"{PREFIX}open_connections {connections}",
            f"# HELP {PREFIX}unauthenticated connections still in the TLS handshake, the "
            "HTTP upgrade or AUTH",
            f"# TYPE {PREFIX}unauthenticated gauge",
            f"{PREFIX}unauthenticated {unauthenticated}",
        ]
        for f in dataclasses.fields(self):
            name = PREFIX + f.metadata.get("name", f.name)
            out += [f"# HELP {name} {f.metadata['help']}", f"# TYPE {name} counter"]
            value = getattr(self, f.name)
            if isinstance(value, dict):
                label = f.metadata["label"]
                out += [f'{name}{{{label}="{r}"}} {n}' for r, n in value.items()]
            else:
                out.append(f"{name} {value}")
        return "\n".join(out) + "\n"
