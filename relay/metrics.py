"""Counters of the relay and their Prometheus text rendering (``GET /metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AUTH_FAILURE_REASONS", "DROP_REASONS", "Metrics"]

DROP_REASONS = ("rate_limited", "queue_full", "unknown_peer")
AUTH_FAILURE_REASONS = (
    "bad_signature",
    "bad_token",
    "not_allowed",
    "relay_full",
    "malformed",
    "timeout",
    "shutting_down",
)
PREFIX = "p2pdist_relay_"

# name (without prefix), type, help
_SCALARS: tuple[tuple[str, str, str], ...] = (
    ("connections_total", "counter", "TLS connections accepted"),
    ("auth_ok_total", "counter", "clients authenticated"),
    ("replaced_total", "counter", "connections replaced by a newer one with the same id"),
    ("bytes_in_total", "counter", "bytes read from clients (after TLS)"),
    ("bytes_out_total", "counter", "bytes written to clients (before TLS)"),
    ("datagrams_in_total", "counter", "SEND frames received"),
    ("datagrams_out_total", "counter", "RECV frames queued to destinations"),
    ("peer_gone_total", "counter", "PEER_GONE frames sent"),
    ("protocol_errors_total", "counter", "connections closed for breaking the protocol"),
    ("keepalive_timeouts_total", "counter", "clients dropped after 3 x keepalive of silence"),
    ("http_requests_total", "counter", "plain HTTP requests answered (health, metrics, errors)"),
    ("stun_requests_total", "counter", "STUN binding requests answered"),
)


@dataclass(slots=True)
class Metrics:
    """Plain integer counters; the core increments them, :meth:`render` exports them."""

    connections_total: int = 0
    auth_ok_total: int = 0
    replaced_total: int = 0
    bytes_in_total: int = 0
    bytes_out_total: int = 0
    datagrams_in_total: int = 0
    datagrams_out_total: int = 0
    peer_gone_total: int = 0
    protocol_errors_total: int = 0
    keepalive_timeouts_total: int = 0
    http_requests_total: int = 0
    stun_requests_total: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    auth_failures: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(AUTH_FAILURE_REASONS, 0)
    )

    def render(self, *, clients: int, connections: int) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        out = [
            f"# HELP {PREFIX}clients authenticated clients connected now",
            f"# TYPE {PREFIX}clients gauge",
            f"{PREFIX}clients {clients}",
            f"# HELP {PREFIX}connections open client connections (any phase)",
            f"# TYPE {PREFIX}connections gauge",
            f"{PREFIX}connections {connections}",
        ]
        for name, kind, help_text in _SCALARS:
            out += [
                f"# HELP {PREFIX}{name} {help_text}",
                f"# TYPE {PREFIX}{name} {kind}",
                f"{PREFIX}{name} {getattr(self, name)}",
            ]
        for name, help_text, values in (
            ("dropped_total", "datagrams dropped, by reason", self.dropped),
            ("auth_failures_total", "refused authentications, by reason", self.auth_failures),
        ):
            out += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} counter"]
            out += [f'{PREFIX}{name}{{reason="{r}"}} {n}' for r, n in values.items()]
        return "\n".join(out) + "\n"
