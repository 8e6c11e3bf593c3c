"""p2pdist on uvloop: the transport conformance suite and a relay + QUIC group.

uvloop's transports are not subclasses of asyncio's, its TLS is its own (Cython) protocol
and its sockets are pseudo-sockets, so every transport runs the whole conformance suite on
it here. Each test starts its own uvloop loop (through :func:`p2pdist.eventloop.run`), so
nothing depends on the pytest-asyncio version. Skipped, with the reason, where uvloop is
not installed (``pip install -e ".[test]"`` installs it).
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import test_tcp_transport as tcp_tests
from relay_helpers import ROOT, RelayProcess
from test_quic_transport import PAIRS as QUIC_PAIRS
from test_tcp_transport import tcp_pair
from transport_conformance import CHECKS, PairFactory

from p2pdist import Group, GroupConfig, PunchConfig, eventloop
from p2pdist.errors import UsageError
from relay.config import ConfigError, RelayConfig

T = TypeVar("T")

needs_uvloop = pytest.mark.skipif(
    not eventloop.uvloop_available(), reason='uvloop is not installed (pip install "p2pdist[fast]")'
)

PAIRS: dict[str, PairFactory] = {
    "tcp-tls": functools.partial(tcp_pair, True),
    "tcp-plain": functools.partial(tcp_pair, False),
    **{f"quic-{name}": factory for name, factory in QUIC_PAIRS.items()},
}


def on_uvloop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a fresh uvloop loop, checking that it really is uvloop."""

    async def checked() -> T:
        assert eventloop.loop_name() == "uvloop", type(asyncio.get_running_loop())
        return await coro

    return eventloop.run(checked(), loop="uvloop")


@needs_uvloop
@pytest.mark.parametrize("tls", [False, True])
def test_a_receiver_reads_before_it_waits_on_uvloop(tls: bool) -> None:
    # TcpConnection._read_now reads uvloop's pseudo-socket through its own duplicate.
    on_uvloop(
        tcp_tests.test_a_message_that_has_arrived_is_taken_without_a_trip_through_the_loop(tls)
    )
    on_uvloop(tcp_tests.test_a_receiver_does_not_read_while_reading_is_paused())


@needs_uvloop
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIONREAD on a socket: Linux")
@pytest.mark.parametrize("receiver_first", [False, True], ids=["data-first", "receiver-first"])
def test_a_large_payload_goes_straight_into_its_place_on_uvloop(receiver_first: bool) -> None:
    # libuv reads on after a read that filled its buffer, and such a read that finds
    # nothing must not use up the decoder's peek.
    with pytest.MonkeyPatch.context() as mp:
        on_uvloop(
            tcp_tests.test_a_large_payload_after_a_large_payload_is_read_straight_into_its_place(
                mp, receiver_first
            )
        )


@needs_uvloop
@pytest.mark.parametrize("kind", sorted(PAIRS))
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_conformance_on_uvloop(check: Callable[[PairFactory], Awaitable[None]], kind: str) -> None:
    on_uvloop(check(PAIRS[kind]))


@needs_uvloop
def test_tcp_tls_on_uvloop_is_tls13_with_the_pinned_certificate() -> None:
    async def main() -> None:
        async with PAIRS["tcp-tls"]() as p:
            for conn in (p.client, p.server):
                sslobj = conn.tls_object  # type: ignore[attr-defined]
                assert sslobj is not None and sslobj.version() == "TLSv1.3"
                assert sslobj.getpeercert(binary_form=True)
            payload = np.arange(1 << 20, dtype=np.uint8)  # > one TLS record, > one read
            await p.client.send(3, payload)
            frame = await p.server.recv(3)
            assert bytes(frame.payload) == payload.tobytes()

    on_uvloop(main())


async def _relay_group(url: str, world: int) -> None:
    cfg = GroupConfig(timeout=30.0, connect_timeout=30.0, punch=PunchConfig(enabled=False))
    seed = "uvloop-relay-group-seed-0123456789"
    gs = [Group.from_seed(seed, rank=r, world=world, relay=url, config=cfg) for r in range(world)]
    await asyncio.gather(*(g.start() for g in gs))
    try:
        for g in gs:
            for r in range(world):
                if r != g.rank:
                    assert g.connection(r).path_kind == "relay"  # type: ignore[attr-defined]
        xs = [np.random.default_rng(r).standard_normal(100_000) for r in range(world)]
        outs = await asyncio.gather(*(g.all_reduce(xs[g.rank]) for g in gs))
        np.testing.assert_allclose(outs[0], np.sum(xs, axis=0), rtol=1e-12, atol=1e-12)
        assert len({o.tobytes() for o in outs}) == 1
        small = await asyncio.gather(*(g.all_reduce(np.array([g.rank]), "max") for g in gs))
        assert [int(s[0]) for s in small] == [world - 1] * world
        await asyncio.gather(*(g.barrier() for g in gs))
    finally:
        await asyncio.gather(*(g.close() for g in gs))


@needs_uvloop
@pytest.mark.parametrize("relay_loop", ["uvloop", "asyncio"])
def test_group_through_a_relay_on_uvloop(tmp_path: Path, relay_loop: str) -> None:
    """Clients on uvloop, through a relay process on uvloop or on asyncio's loop."""
    with RelayProcess(tmp_path, "--loop", relay_loop) as relay:
        on_uvloop(_relay_group(relay.url, 3))
    assert f"event_loop loop={relay_loop}" in relay.log.read_text()


# ---- choosing the loop ------------------------------------------------------------------


def test_resolve_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(eventloop.LOOP_ENV, raising=False)
    auto = "uvloop" if eventloop.uvloop_available() else "asyncio"
    assert eventloop.resolve_loop() == "asyncio"  # the measured-faster default
    assert eventloop.resolve_loop("auto") == auto
    assert eventloop.resolve_loop("asyncio") == "asyncio"
    monkeypatch.setenv(eventloop.LOOP_ENV, "auto")
    assert eventloop.resolve_loop() == auto
    monkeypatch.setenv(eventloop.LOOP_ENV, "asyncio")
    assert eventloop.resolve_loop("auto") == auto  # an explicit choice beats the environment
    with pytest.raises(UsageError, match="one of auto, asyncio, uvloop"):
        eventloop.resolve_loop("tokio")
    monkeypatch.setenv(eventloop.LOOP_ENV, " ASYNCIO\n")  # as a shell or a file may give it
    assert eventloop.resolve_loop() == "asyncio"


def test_the_loop_flag_takes_any_case_as_the_environment_does() -> None:
    from p2pdist.cli import build_parser

    args = build_parser().parse_args(["--loop", "AsyncIO", "demo"])
    assert args.loop == "asyncio"


def test_run_uses_the_chosen_loop_and_leaves_the_policy_alone() -> None:
    policy = asyncio.get_event_loop_policy()

    async def name() -> str:
        return eventloop.loop_name()

    assert eventloop.run(name(), loop="asyncio") == "asyncio"
    if eventloop.uvloop_available():
        assert eventloop.run(name(), loop="uvloop") == "uvloop"
    assert asyncio.get_event_loop_policy() is policy


def test_uvloop_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    assert eventloop.resolve_loop("auto") == "asyncio"

    async def never() -> None:
        raise AssertionError("must not run")

    with pytest.raises(UsageError, match=r"p2pdist\[fast\]"):
        eventloop.run(never(), loop="uvloop")


def test_relay_config_takes_a_loop() -> None:
    assert RelayConfig().loop is None
    assert RelayConfig(loop="asyncio").loop == "asyncio"
    with pytest.raises(ConfigError, match="loop must be one of"):
        RelayConfig(loop="trio")


def test_cli_loop_flag_reaches_the_subcommand() -> None:
    """``p2pdist --loop asyncio`` sets $P2PDIST_LOOP for the subcommand and its children."""
    code = (
        "import os, sys; from p2pdist import cli; "
        "cli._passthrough = lambda m: (lambda a, e: print(os.environ['P2PDIST_LOOP']) or 0); "
        "sys.exit(cli.main(['--loop', 'asyncio', 'doctor', '--relay', 'x']))"
    )
    env = {k: v for k, v in os.environ.items() if k != eventloop.LOOP_ENV}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "asyncio"
