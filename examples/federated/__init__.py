"""Federated learning on the digits data: coordinator, clients, and a one-command run."""

IDLE_TIMEOUT = 8.0
"""The transport's ``idle_timeout`` in the example, seconds: a client that vanishes without
a word over QUIC is noticed this soon (30 s by default). It stays above hole punching's
fallback to the relay (``path_timeout`` + ``keepalive``, 6.5 s), so that a direct path
that dies falls back to the relay instead of ending the connection."""
