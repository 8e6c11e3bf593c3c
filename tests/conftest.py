"""Fixtures shared by test modules: the TCP transport's connection pairs, over TLS and in
plaintext (tests/test_tcp_transport.py and tests/test_framed_robustness.py)."""

from __future__ import annotations

import functools

import pytest
from test_tcp_transport import tcp_pair
from transport_conformance import PairFactory


@pytest.fixture(params=[True, False], ids=["tls", "plain"])
def tls(request: pytest.FixtureRequest) -> bool:
    """Each test twice: over TLS and in authenticated plaintext."""
    return bool(request.param)


@pytest.fixture
def make_pair(tls: bool) -> PairFactory:
    """A factory of connected TCP connection pairs (a module may define its own, as the
    QUIC tests do)."""
    return functools.partial(tcp_pair, tls)
