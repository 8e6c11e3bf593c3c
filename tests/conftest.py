"""Fixtures shared by test modules: the TCP transport's connection pairs, over TLS and in
plaintext (tests/test_tcp_transport.py and tests/test_framed_robustness.py); and which
modules share one pytest-xdist worker."""

from __future__ import annotations

import functools

import pytest
from test_tcp_transport import tcp_pair
from transport_conformance import PairFactory


@pytest.fixture(params=[True, False], ids=["tls", "plain"])
def tls(request: pytest.FixtureRequest) -> bool:
    """Each test twice: over TLS and in authenticated plaintext."""
    return bool(request.param)


@pytest.fixture(
    params=[(True, True), (True, False), (False, True)], ids=["tls", "tls-records", "plain"]
)
def make_pair(request: pytest.FixtureRequest) -> PairFactory:
    """A factory of connected TCP connection pairs (a module may define its own, as the
    QUIC tests do): TLS with AES-GCM records after it (the default), TLS records all
    along (``sealed_records=False``), and authenticated plaintext."""
    tls, sealed = request.param
    return functools.partial(tcp_pair, tls, sealed_records=sealed)


# Modules that build network namespaces (tests/natlab.py) or time throughput: with
# pytest-xdist (scripts/test.sh runs the suite on several workers) they all run on one
# worker, one after another, so that no two labs or benchmarks run at once.
_ONE_WORKER = {
    "test_benchmarks.py",
    "test_container.py",
    "test_discovery.py",
    "test_interfaces.py",
    "test_nat_matrix.py",
    "test_natlab.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the tests of :data:`_ONE_WORKER`'s modules in one xdist group."""
    for item in items:
        if item.path.name in _ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group("one-worker"))
