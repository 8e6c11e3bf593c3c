"""A group formed through a real relay process: endpoint ids only, QUIC, no direct path
(hole punching is off here, so everything stays on the relay; tests/test_holepunch.py
covers the upgrade to a direct path)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import numpy as np
import pytest
from collective_tour import every_collective_at_once
from relay_helpers import RelayProcess
from transport_conformance import wait_until

from p2pdist import (
    ConnectionBrokenError,
    Group,
    GroupBrokenError,
    GroupConfig,
    P2PError,
    P2PTimeoutError,
    PunchConfig,
    TransportConfig,
)

SEED = "relay-group-seed-0123456789"
MARKER = b"PLAINTEXT-MARKER-7d1f0c"


def config(**kw: float) -> GroupConfig:
    return GroupConfig(
        timeout=kw.get("timeout", 30.0), connect_timeout=30.0, punch=PunchConfig(enabled=False)
    )


def assert_all_relayed(gs: list[Group]) -> None:
    """Every rank reaches every other through the relay, never directly."""
    for g in gs:
        for r in range(g.size):
            if r != g.rank:
                assert g.connection(r).path_kind == "relay"  # type: ignore[attr-defined]


async def form(url: str, world: int, **kw: float) -> list[Group]:
    gs = [
        Group.from_seed(SEED, rank=r, world=world, relay=url, config=config(**kw))
        for r in range(world)
    ]
    await asyncio.gather(*(g.start() for g in gs))
    return gs


async def test_group_of_three_through_the_relay_runs_every_collective(tmp_path: Path) -> None:
    tap = tmp_path / "tap.bin"
    with RelayProcess(tmp_path, "--tap", str(tap)) as relay:
        gs = await form(relay.url, 3)
        try:
            for g in gs:  # reached by endpoint id alone, and never directly
                assert g.relay_status is not None and g.relay_status.state.value == "connected"
            assert_all_relayed(gs)
            xs = [np.random.default_rng(r).standard_normal(50_000) for r in range(3)]
            outs = await asyncio.gather(*(g.all_reduce(xs[g.rank]) for g in gs))
            np.testing.assert_allclose(outs[0], np.sum(xs, axis=0), rtol=1e-12)
            assert len({o.tobytes() for o in outs}) == 1
            small = await asyncio.gather(*(g.all_reduce(np.array([g.rank]), "max") for g in gs))
            assert [int(s[0]) for s in small] == [2, 2, 2]
            pieces = await asyncio.gather(*(g.reduce_scatter(xs[g.rank]) for g in gs))
            for r, piece in enumerate(pieces):
                np.testing.assert_allclose(piece, np.array_split(np.sum(xs, 0), 3)[r], rtol=1e-12)
            gathered = await asyncio.gather(*(g.all_gather(xs[g.rank][:10]) for g in gs))
            np.testing.assert_array_equal(gathered[1], np.stack([x[:10] for x in xs]))
            bc = await asyncio.gather(*(g.broadcast(xs[g.rank], src=2) for g in gs))
            np.testing.assert_array_equal(bc[0], xs[2])
            await asyncio.gather(*(g.barrier() for g in gs))
            # a plaintext marker between peers must never show in what the relay handles
            marker = np.frombuffer(MARKER * 50, np.uint8)
            got = await asyncio.gather(gs[0].send(marker, 1), gs[1].recv(0, like=marker))
            assert bytes(got[1]) == MARKER * 50
            assert_all_relayed(gs)
        finally:
            await asyncio.gather(*(g.close() for g in gs))
    handled = tap.read_bytes()
    assert len(handled) > 1_000_000  # the tap saw the traffic ...
    assert MARKER not in handled  # ... and none of it was readable
    assert MARKER[:12] not in handled


async def test_relay_restart_mid_run_then_the_next_collective_succeeds(tmp_path: Path) -> None:
    keyfile = tmp_path / "relay.key"
    first = RelayProcess(tmp_path, "--key", str(keyfile))
    port = first.url.split(":")[2].split("/")[0]
    gs = await form(first.url, 3, timeout=20.0)
    try:
        ones = await asyncio.gather(*(g.all_reduce(np.ones(1000)) for g in gs))
        assert ones[0][0] == 3.0
        # a collective in flight while the relay goes away: completes or fails clearly
        inflight = [asyncio.create_task(g.all_reduce(np.ones(200_000), timeout=20)) for g in gs]
        await asyncio.to_thread(first.stop)
        with RelayProcess(tmp_path, "--key", str(keyfile), "--port", port):
            results = await asyncio.gather(*inflight, return_exceptions=True)
            for res in results:
                assert isinstance(res, np.ndarray | P2PError), res
            if all(isinstance(res, np.ndarray) for res in results):
                nxt = await asyncio.gather(*(g.all_reduce(np.full(7, 2.0)) for g in gs))
                np.testing.assert_array_equal(nxt[2], np.full(7, 6.0))
                for g in gs:
                    status = g.relay_status
                    assert status is not None and status.connects >= 2
            else:
                pytest.fail(f"in-flight collective failed instead of riding it out: {results}")
    finally:
        await asyncio.gather(*(g.close() for g in gs))
        first.__exit__()


async def test_the_whole_surface_at_once_through_the_relay(tmp_path: Path) -> None:
    with RelayProcess(tmp_path) as relay:
        gs = await form(relay.url, 3)
        try:
            await every_collective_at_once(gs)
            assert_all_relayed(gs)
        finally:
            await asyncio.gather(*(g.close() for g in gs))


async def test_a_relay_killed_mid_run_never_hangs_a_collective(tmp_path: Path) -> None:
    """SIGKILL: no reconnect notice, the clients only see the connection drop. A call in
    flight completes or fails with a P2PError within its timeout; once the relay is back
    on the same port and key, the next collective succeeds."""
    keyfile = tmp_path / "relay.key"
    first = RelayProcess(tmp_path, "--key", str(keyfile))
    port = first.url.split(":")[2].split("/")[0]
    gs = await form(first.url, 3, timeout=20.0)
    try:
        await asyncio.gather(*(g.all_reduce(np.ones(1000)) for g in gs))
        inflight = [asyncio.create_task(g.all_reduce(np.ones(2_000_000), timeout=15)) for g in gs]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in inflight), "the call must still be running at the kill"
        await asyncio.to_thread(first.stop, signal.SIGKILL)
        with RelayProcess(tmp_path, "--key", str(keyfile), "--port", port):
            # bounded here: a hang fails this line, not the test runner's timeout
            results = await asyncio.wait_for(asyncio.gather(*inflight, return_exceptions=True), 25)
            for res in results:
                assert isinstance(res, np.ndarray | P2PError), res
                if isinstance(res, np.ndarray):
                    np.testing.assert_array_equal(res, np.full(2_000_000, 3.0))
            if all(isinstance(res, np.ndarray) for res in results):
                nxt = await asyncio.gather(*(g.all_reduce(np.full(7, 2.0)) for g in gs))
                for got in nxt:
                    np.testing.assert_array_equal(got, np.full(7, 6.0))
            else:  # a failed call names what broke, and the group says it is unusable
                text = " ".join(str(r) for r in results if isinstance(r, P2PError))
                assert "rank" in text, text
                for g, res in zip(gs, results, strict=True):
                    if isinstance(res, P2PError):  # that rank's group is unusable now
                        assert g.broken is not None, res
    finally:
        await asyncio.gather(*(g.close() for g in gs))
        first.__exit__()


async def test_a_collective_timed_out_while_the_relay_is_down_says_so(tmp_path: Path) -> None:
    """The relay is gone and stays gone: every relayed peer falls silent at once, so the
    timeout error names this rank's relay session, not only the peer that went quiet
    first (which used to read as that rank's fault)."""
    relay = RelayProcess(tmp_path)
    gs = await form(relay.url, 2)
    try:
        await asyncio.gather(*(g.all_reduce(np.ones(10)) for g in gs))
        await asyncio.to_thread(relay.stop, signal.SIGKILL)
        for g in gs:
            await wait_until(
                lambda g=g: g.relay_status.state.value != "connected", "the session to drop"
            )
        results = await asyncio.gather(
            *(g.all_reduce(np.ones(10), timeout=2.0) for g in gs), return_exceptions=True
        )
        for res in results:
            assert isinstance(res, P2PTimeoutError), res
            assert "this rank's relay session is not connected" in str(res), res
    finally:
        await asyncio.gather(*(g.close() for g in gs))
        relay.__exit__()


@pytest.mark.parametrize("on_peer_loss", ["break", "leave"])
async def test_peers_lost_while_the_relay_is_down_are_not_blamed_alone(
    tmp_path: Path, on_peer_loss: str
) -> None:
    """The relay is gone (stopped, or restarted with another key): every relayed peer
    falls silent, and each connection ends at its keepalive timeout. The errors named
    only the peers, "silent for 30 s", and every rank blamed the others (a user's trial);
    now the loss itself records that this rank's relay session was down."""
    fast = TransportConfig(keepalive_interval=0.2, idle_timeout=2.0)
    cfg = GroupConfig(
        timeout=20.0,
        connect_timeout=30.0,
        punch=PunchConfig(enabled=False),
        transport=fast,
        on_peer_loss=on_peer_loss,
    )
    relay = RelayProcess(tmp_path)
    gs = [Group.from_seed(SEED, rank=r, world=2, relay=relay.url, config=cfg) for r in range(2)]
    await asyncio.gather(*(g.start() for g in gs))
    try:
        await asyncio.gather(*(g.all_reduce(np.ones(10)) for g in gs))
        await asyncio.to_thread(relay.stop, signal.SIGKILL)
        for g in gs:
            if on_peer_loss == "break":
                await wait_until(lambda g=g: g.broken is not None, "the loss", 20)
                assert "this rank's relay session is not connected" in str(g.broken), g.broken
            else:
                await wait_until(lambda g=g: bool(g.left), "the loss", 20)
                with pytest.raises(GroupBrokenError) as info:
                    await g.all_reduce(np.ones(10))
                assert "left the group" in str(info.value), info.value
                assert "this rank's relay session is not connected" in str(info.value)
    finally:
        await asyncio.gather(*(g.close() for g in gs))
        relay.__exit__()


async def test_a_second_process_with_a_rank_through_the_relay_is_named(tmp_path: Path) -> None:
    """A rank started twice: both hold its key, and the relay keeps whichever
    authenticated last, so the two take turns. The extra one's formation error says so
    (it used to give only the generic "same seed and relay?"), and the group formed
    before it still works once it is gone."""
    with RelayProcess(tmp_path) as relay:
        gs = await form(relay.url, 2)
        short = GroupConfig(connect_timeout=3.0, punch=PunchConfig(enabled=False))
        extra = Group.from_seed(SEED, rank=1, world=2, relay=relay.url, config=short)
        try:
            with pytest.raises(P2PTimeoutError, match="two processes claim rank 1"):
                await extra.start()
            assert extra.relay_status is not None and extra.relay_status.replaced >= 1
            await extra.close()
            outs = await asyncio.gather(*(g.all_reduce(np.ones(3), timeout=20) for g in gs))
            assert all(o.tolist() == [2.0] * 3 for o in outs)
        finally:
            await asyncio.gather(extra.close(), *(g.close() for g in gs))


async def test_a_restarted_rank_through_the_relay_is_told_the_group_formed(
    tmp_path: Path,
) -> None:
    """A rank that restarts (without rejoin) into a formed group is refused through the
    relay as over TCP, with the reason: its start fails saying the group formed already
    and what to do, instead of every handshake's packets being dropped as garbage until
    connect_timeout names only "no connection"."""
    with RelayProcess(tmp_path) as relay:
        gs = await form(relay.url, 2)
        await gs[1].close()
        short = GroupConfig(
            connect_timeout=4.0,
            punch=PunchConfig(enabled=False),
            transport=TransportConfig(handshake_timeout=1.0),
        )
        again = Group.from_seed(SEED, rank=1, world=2, relay=relay.url, config=short)
        try:
            with pytest.raises(
                P2PTimeoutError,
                match=r"refused this rank's connections until the end .*its group has formed "
                r"already.*rejoin=True",
            ) as caught:
                await again.start()
            assert "same seed and relay?" not in str(caught.value)
            transport = gs[0]._transport
            assert transport is not None and transport.refused_incoming >= 1
        finally:
            await asyncio.gather(again.close(), *(g.close() for g in gs))


async def test_a_peer_on_a_direct_path_is_not_blamed_on_a_relay_that_is_down(
    tmp_path: Path,
) -> None:
    """The relay is down but the peers went direct (punched on loopback): a collective
    that times out because the other rank never called it names that rank alone, not
    the relay session, which carries nothing between them."""
    fast = PunchConfig(probe_interval=0.05, keepalive=0.2, path_timeout=5.0, punch_timeout=2.0)
    cfg = GroupConfig(timeout=30.0, connect_timeout=30.0, punch=fast)
    relay = RelayProcess(tmp_path)
    gs = [Group.from_seed(SEED, rank=r, world=2, relay=relay.url, config=cfg) for r in range(2)]
    try:
        await asyncio.gather(*(g.start() for g in gs))
        await wait_until(
            lambda: all(i.kind == "direct" for g in gs for i in g.paths().values()), "direct"
        )
        await asyncio.to_thread(relay.stop, signal.SIGKILL)
        await wait_until(lambda: gs[0].relay_status.state.value != "connected", "the drop")
        with pytest.raises(P2PTimeoutError) as err:
            await gs[0].all_reduce(np.ones(10), timeout=1.0)  # rank 1 never calls it
        assert "rank 1" in str(err.value) and "relay session" not in str(err.value)
    finally:
        await asyncio.gather(*(g.close() for g in gs))
        relay.__exit__()


def test_from_env_with_a_relay_runs_the_hello_example(tmp_path: Path) -> None:
    import os
    import sys

    from group_helpers import run_ranks

    example = Path(__file__).resolve().parent.parent / "examples" / "allreduce_hello.py"
    with RelayProcess(tmp_path) as relay:
        env = {**os.environ, "P2PDIST_SEED": SEED, "P2PDIST_WORLD": "2", "P2PDIST_RELAY": relay.url}
        env.pop("P2PDIST_PEERS", None)
        outs = run_ranks([sys.executable, str(example)], env, 2, timeout=60)
    for out, _ in outs:
        assert "all_reduce sum = [3. 3. 3. 3.]" in out


async def test_a_relay_refusal_is_named_when_the_group_forms(tmp_path: Path) -> None:
    from p2pdist import PeerAuthenticationError

    with RelayProcess(tmp_path, "--token", "the-right-token") as relay:
        g = Group.from_seed(
            SEED, rank=0, world=2, relay=relay.url, relay_token="wrong", config=config()
        )
        with pytest.raises(PeerAuthenticationError, match=r"bad token \(the token sent is not"):
            await g.start()
        missing = Group.from_seed(SEED, rank=0, world=2, relay=relay.url, config=config())
        with pytest.raises(PeerAuthenticationError, match="needs a token and none was sent"):
            await missing.start()


async def test_a_rank_with_another_seed_through_the_relay_is_named_with_a_hint(
    tmp_path: Path,
) -> None:
    """Through a relay a rank with another seed refuses nothing (it has other ids, so
    the ranks never meet): the formation error asks about the seed instead of only
    saying the rank never connected."""
    with RelayProcess(tmp_path) as relay:
        short = GroupConfig(connect_timeout=2.0, punch=PunchConfig(enabled=False))
        gs = [
            Group.from_seed(seed, rank=r, world=2, relay=relay.url, config=short)
            for r, seed in enumerate((SEED, SEED + "-other"))
        ]
        try:
            errors = await asyncio.gather(*(g.start() for g in gs), return_exceptions=True)
        finally:
            await asyncio.gather(*(g.close() for g in gs))
        for r, err in enumerate(errors):
            assert isinstance(err, P2PTimeoutError), err
            assert f"no connection to rank {1 - r}" in str(err)
            assert "same seed and relay?" in str(err)


async def test_a_relay_restarted_under_another_key_is_named_as_the_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay comes back on its port without its key (a new pin): every session is
    refused ("identity mismatch"), the relayed peers fall silent, and the loss said
    "silent for 6 s (keepalive timeout)" first and the relay's refusal last, as a
    backoff's last error; the refusal was also warned at every retry (an operator's
    trial). Now the loss says the relay refuses this rank, and asks whether it was
    restarted with another key, token or allowlist; the refusal is warned once."""
    # idle_timeout 6 s: the client's backoff (up to 1.6 s here) and a refused attempt
    # come well before the peer is declared silent, on a loaded host too.
    fast = TransportConfig(keepalive_interval=0.2, idle_timeout=6.0)
    cfg = GroupConfig(
        timeout=20.0, connect_timeout=30.0, punch=PunchConfig(enabled=False), transport=fast
    )
    first = RelayProcess(tmp_path, "--key", str(tmp_path / "relay.key"))
    port = first.url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
    gs = [Group.from_seed(SEED, rank=r, world=2, relay=first.url, config=cfg) for r in range(2)]
    await asyncio.gather(*(g.start() for g in gs))
    second: RelayProcess | None = None
    try:
        await asyncio.gather(*(g.all_reduce(np.ones(10)) for g in gs))
        await asyncio.to_thread(first.stop, signal.SIGKILL)
        # An ephemeral key: another pin. (In a thread: the groups' loop must run on.)
        second = await asyncio.to_thread(RelayProcess, tmp_path, "--port", port)
        assert second.url != first.url
        for g in gs:
            await wait_until(lambda g=g: g.broken is not None, "the loss", 30)
            text = str(g.broken)
            assert "relay refuses it now" in text and "identity mismatch" in text, text
            assert "restarted with another key, token or allowlist" in text, text
        warned = [
            r
            for r in caplog.records
            if r.name.endswith("relay_path")
            and r.levelname == "WARNING"
            and "mismatch" in r.getMessage()
        ]
        assert len(warned) <= 2, [r.getMessage() for r in warned]  # once per rank
    finally:
        await asyncio.gather(*(g.close() for g in gs))
        first.__exit__()
        if second is not None:
            second.__exit__()


async def test_a_call_cut_by_a_relayed_loss_says_it_once_with_the_relays_state(
    tmp_path: Path,
) -> None:
    """A call in flight when the relay dies and the peer falls silent failed with "rank 1:
    silent for 2.0 s (keepalive timeout); also: rank 1: silent for 2.0 s (keepalive
    timeout); this rank's relay session is not connected (...)": the bare loss, then
    the group's record of it again (an operator's trial). Now the fuller one, once."""
    fast = TransportConfig(keepalive_interval=0.2, idle_timeout=2.0)
    cfg = GroupConfig(
        timeout=20.0, connect_timeout=30.0, punch=PunchConfig(enabled=False), transport=fast
    )
    relay = RelayProcess(tmp_path)
    gs = [Group.from_seed(SEED, rank=r, world=2, relay=relay.url, config=cfg) for r in range(2)]
    await asyncio.gather(*(g.start() for g in gs))
    try:
        await asyncio.gather(*(g.all_reduce(np.ones(10)) for g in gs))
        waiting = asyncio.create_task(gs[0].all_reduce(np.ones(10)))  # rank 1 never calls
        await asyncio.sleep(0.1)
        await asyncio.to_thread(relay.stop, signal.SIGKILL)
        with pytest.raises(ConnectionBrokenError) as info:
            await asyncio.wait_for(waiting, 20)
        text = str(info.value)
        assert text.count("keepalive timeout") == 1 and "also:" not in text, text
        assert "this rank's relay session is not connected" in text, text
    finally:
        await asyncio.gather(*(g.close() for g in gs))
        relay.__exit__()
