"""Coordinator + clients over real sockets (TCP on 127.0.0.1, and QUIC through a real
relay): rounds, late joiners, slow clients under both policies, a NaN update, a client
process killed mid-round, a client that breaks the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from relay_helpers import RelayProcess
from transport_conformance import wait_until

from p2pdist import (
    ConnectionBrokenError,
    ConnectionClosedError,
    P2PError,
    P2PTimeoutError,
    PeerAuthenticationError,
    PeerTimeoutError,
    SecretKey,
    TransportConfig,
    UsageError,
)
from p2pdist.federated import (
    CloseReason,
    Coordinator,
    FederatedClient,
    FederatedConfig,
    Phase,
)
from p2pdist.federated.coordinator import _Client
from p2pdist.federated.messages import CLIENT_CHANNEL, decode, encode
from p2pdist.federated.net import open_transport
from p2pdist.transport.dial import dial_with_retry
from p2pdist.wire.frames import Frame, FrameKind

PLAIN = TransportConfig(tls=False)
HERE = Path(__file__).resolve().parent


@asynccontextmanager
async def coordinator(
    model: np.ndarray, *, tls: bool = False, **cfg: object
) -> AsyncIterator[Coordinator]:
    config = FederatedConfig(**cfg)  # type: ignore[arg-type]
    async with Coordinator(model, config, transport=TransportConfig(tls=tls)) as c:
        await c.start(listen="127.0.0.1:0")
        yield c


def client_of(c: Coordinator, *, tls: bool = False, name: str = "") -> FederatedClient:
    assert c.address is not None
    host, port = c.address
    return FederatedClient(
        c.endpoint_id, address=f"{host}:{port}", transport=TransportConfig(tls=tls), name=name
    )


async def test_rounds_weighted_mean_and_late_joiner_gets_model_and_round_id() -> None:
    model = np.zeros(8, np.float32)
    async with coordinator(model, tls=True, round_timeout=30.0) as c:
        a, b = client_of(c, tls=True), client_of(c, tls=True)
        ta, tb = await a.connect(), await b.connect()
        assert ta.round == tb.round == 0 and not ta.open
        np.testing.assert_array_equal(ta.model, model)
        assert not ta.model.flags.writeable  # read only: training in place fails loudly
        for r in range(2):
            run = asyncio.create_task(c.run_round())
            await a.submit(np.full(8, 1.0, np.float32), 10, r)
            await b.submit(np.full(8, 4.0, np.float32), 30, r)
            out = await run
            assert out.reason is CloseReason.COMPLETE and out.round == r
            np.testing.assert_array_equal(out.aggregate, np.full(8, 3.25, np.float32))
            ta = await a.next_round(timeout=10)  # type: ignore[assignment]
            assert ta is not None and ta.round == r + 1
        np.testing.assert_array_equal(c.model, np.full(8, 6.5, np.float32))
        late = client_of(c, tls=True)
        task = await late.connect()  # joins between rounds 1 and 2
        assert task.round == 2 == c.round
        np.testing.assert_array_equal(task.model, c.model)
        run = asyncio.create_task(c.run_round())
        await wait_until(lambda: c.state.phase is Phase.OPEN, "round open")
        late2 = client_of(c, tls=True)
        task2 = await late2.connect()  # joins mid-round: current model and round id
        assert task2.round == 2 and task2.open and task2.deadline > 0
        for cl in (a, b, late):
            await cl.submit(np.zeros(8, np.float32), 1, 2)
        out = await run  # the mid-round joiner was not waited for
        assert out.reason is CloseReason.COMPLETE and out.members == 3
        assert (await a.wait_ack(3)).accepted
        for cl in (a, b, late, late2):
            await cl.close()


async def test_quorum_policy_closes_without_the_slow_client_and_carries_its_update() -> None:
    async with coordinator(
        np.zeros(4, np.float32), policy="quorum", quorum=2, round_timeout=30.0, max_staleness=1
    ) as c:
        a, b, slow = client_of(c), client_of(c), client_of(c)
        for cl in (a, b, slow):
            await cl.connect()
        run = asyncio.create_task(c.run_round())
        await a.submit(np.full(4, 1.0, np.float32), 10, 0)
        await b.submit(np.full(4, 1.0, np.float32), 10, 0)
        out0 = await run
        assert out0.reason is CloseReason.QUORUM and len(out0.participants) == 2
        # the slow client's update for round 0 arrives after round 0 closed
        await slow.submit(np.full(4, 8.0, np.float32), 20, 0, round_id=0)
        ack = await slow.wait_ack(1)
        assert ack.accepted and ack.round == 0 and ack.current_round == 1
        run = asyncio.create_task(c.run_round())
        await a.submit(np.full(4, 2.0, np.float32), 10, 1)
        assert (await a.wait_ack(2)).accepted  # its second verdict: round 1's
        await asyncio.sleep(0.2)
        # two updates in, but the carried one does not make round 1's quorum
        assert not run.done()
        await b.submit(np.full(4, 2.0, np.float32), 10, 1)
        out1 = await run
        assert out1.reason is CloseReason.QUORUM and out1.stale == 1
        by = {p.client: p for p in out1.participants}
        ps = by[str(slow.endpoint_id)]
        assert ps.carried and ps.staleness == 1 and ps.weight == 20 * 2**-0.5
        want = (2 * 10 * 2.0 + ps.weight * 8.0) / (2 * 10 + ps.weight)
        np.testing.assert_allclose(out1.aggregate, np.full(4, want, np.float32), rtol=1e-6)
        for cl in (a, b, slow):
            await cl.close()


async def test_deadline_policy_waits_for_the_deadline_then_drops_the_too_stale() -> None:
    async with coordinator(
        np.zeros(4, np.float32), policy="deadline", round_timeout=0.5, max_staleness=0
    ) as c:
        a, slow = client_of(c), client_of(c)
        await a.connect()
        await slow.connect()
        run = asyncio.create_task(c.run_round())
        await a.submit(np.full(4, 1.0, np.float32), 10, 0)
        out = await run
        assert out.reason is CloseReason.DEADLINE and out.members == 2
        assert [p.client for p in out.participants] == [str(a.endpoint_id)]
        await slow.submit(np.full(4, 9.0, np.float32), 10, 0, round_id=0)
        ack = await slow.wait_ack(1)
        assert not ack.accepted and ack.reason == "too_stale"
        assert c.state.totals["too_stale"] == 1
        for cl in (a, slow):
            await cl.close()


async def test_nan_update_is_rejected_and_the_round_goes_on() -> None:
    async with coordinator(np.zeros(4, np.float32), round_timeout=30.0) as c:
        good, bad = client_of(c), client_of(c)
        await good.connect()
        await bad.connect()
        run = asyncio.create_task(c.run_round())
        await bad.submit(np.array([1, np.nan, 0, 0], np.float32), 10, 0)
        ack = await bad.wait_ack(1)
        assert not ack.accepted and ack.reason == "nonfinite"
        await bad.close()  # it leaves; the round does not wait for it
        await good.submit(np.full(4, 0.5, np.float32), 10, 0)
        out = await run
        assert out.rejected == {"nonfinite": 1} and out.applied
        np.testing.assert_array_equal(c.model, np.full(4, 0.5, np.float32))
        await good.close()


async def test_a_client_with_no_update_abstains_and_the_round_does_not_wait_for_it() -> None:
    """A client that trained nothing this round says so (``abstain``): the round closes
    complete once the others are in, not at its 60 s deadline, and the next round waits
    for it again."""
    async with coordinator(np.zeros(4, np.float32), round_timeout=60.0) as c:
        a, idle = client_of(c), client_of(c)
        await a.connect()
        await idle.connect()
        assert await idle.abstain(0)  # (may come before the round opens: it counts then)
        run = asyncio.create_task(c.run_round())
        await a.submit(np.full(4, 2.0, np.float32), 10, 0)
        out = await asyncio.wait_for(run, 20)
        assert out.reason is CloseReason.COMPLETE and out.members == 2
        assert [p.client for p in out.participants] == [str(a.endpoint_id)]
        run = asyncio.create_task(c.run_round())
        await a.submit(np.full(4, 2.0, np.float32), 10, 1)
        await asyncio.sleep(0.3)
        assert not run.done()  # round 1 waits for the idle client again
        assert await idle.abstain(1)
        out = await asyncio.wait_for(run, 20)
        assert out.reason is CloseReason.COMPLETE and out.round == 1
        with pytest.raises(UsageError):
            await idle.abstain(-1)
        for cl in (a, idle):
            await cl.close()


async def test_submit_takes_numpy_integers_and_refuses_bad_counts_before_sending() -> None:
    """A count from numpy (``mask.sum()``) is sent as the int it is; a negative base
    round or a count below 1 is the caller's error, raised here (the coordinator used to
    drop the connection on the first and reject the update on the second)."""
    async with coordinator(np.zeros(4, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        await a.connect()
        run = asyncio.create_task(c.run_round())
        for bad in ({"num_samples": 0}, {"base_round": -1}, {"num_samples": 2.5}):
            args: dict[str, Any] = {"num_samples": 3, "base_round": 0, **bad}
            with pytest.raises(UsageError, match=next(iter(bad))):
                await a.submit(np.ones(4, np.float32), **args)
        with pytest.raises(UsageError, match="round_id"):
            await a.submit(np.ones(4, np.float32), 3, 0, round_id=-1)
        for big in ({"num_samples": 2**70}, {"base_round": 2**64}):  # OverflowError before
            args = {"num_samples": 3, "base_round": 0, **big}
            with pytest.raises(UsageError, match=next(iter(big))):
                await a.submit(np.ones(4, np.float32), **args)
        with pytest.raises(UsageError, match="round_id"):
            await a.submit(np.ones(4, np.float32), 3, 0, round_id=2**64)
        with pytest.raises(UsageError, match="timeout"):
            await a.submit(np.ones(4, np.float32), 3, 0, timeout="1")  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="count"):
            await a.wait_ack("1")  # type: ignore[arg-type]
        assert await a.submit(np.ones(4, np.float32), np.int64(3), np.int64(0))
        assert (await a.wait_ack(1)).accepted
        out = await run
        assert out.applied and c.protocol_errors == 0
        await a.close()


async def test_client_process_killed_mid_round_does_not_block_the_round() -> None:
    async with coordinator(np.zeros(4, np.float32), round_timeout=60.0) as c:
        assert c.address is not None
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HERE / "federated_worker.py"),
            str(c.endpoint_id),
            f"{c.address[0]}:{c.address[1]}",
            "hang",
        )
        try:
            a = client_of(c)
            await a.connect()
            await c.wait_for_members(2, timeout=30)
            run = asyncio.create_task(c.run_round())
            await wait_until(lambda: c.state.phase is Phase.OPEN, "round open")
            await a.submit(np.ones(4, np.float32), 5, 0)
            await a.wait_ack(1)
            assert c.state.due(0.0) is None  # still waiting for the hanging client
            proc.kill()  # SIGKILL mid-round: no goodbye
            out = await asyncio.wait_for(run, 30)  # far below the 60 s deadline
            assert out.reason is CloseReason.COMPLETE and out.members == 2
            assert len(c.members) == 1 and len(out.participants) == 1
            # the next round goes on with who is left
            run = asyncio.create_task(c.run_round())
            assert (await a.next_round(timeout=10)) is not None
            await a.submit(np.ones(4, np.float32), 5, 1)
            assert (await run).reason is CloseReason.COMPLETE
            await a.close()
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def test_client_breaking_the_protocol_is_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with coordinator(np.zeros(4, np.float32), round_timeout=30.0) as c:
        good, rogue = client_of(c), client_of(c)
        await good.connect()
        await rogue.connect()
        await c.wait_for_members(2, timeout=10)
        conn = rogue._conn
        assert conn is not None
        conn.send_nowait(CLIENT_CHANNEL, b"\x00" * 8, meta=b"\xc1 not msgpack")
        await wait_until(
            lambda: c.protocol_errors == 1 and len(c.members) == 1, "rogue client dropped"
        )
        named = f"client {rogue.endpoint_id.short()}: undecodable message"
        assert any(named in r.getMessage() for r in caplog.records), caplog.text
        run = asyncio.create_task(c.run_round())
        await good.submit(np.ones(4, np.float32), 1, 0)
        assert (await run).reason is CloseReason.COMPLETE
        await good.close()
        await rogue.close()


async def test_clients_reach_the_coordinator_through_a_relay(tmp_path: Path) -> None:
    with RelayProcess(tmp_path) as relay:
        async with Coordinator(np.zeros(16, np.float32), FederatedConfig(round_timeout=30)) as c:
            await c.start(relay=relay.url)
            clients = [FederatedClient(c.endpoint_id, relay=relay.url) for _ in range(2)]
            for cl in clients:
                await cl.connect()
            assert c.address is None
            run = asyncio.create_task(c.run_round())
            for i, cl in enumerate(clients):
                await cl.submit(np.full(16, float(i), np.float32), 1, 0)
            out = await run
            assert out.reason is CloseReason.COMPLETE
            np.testing.assert_array_equal(c.model, np.full(16, 0.5, np.float32))
            # nobody gave an address: the clients dialed the coordinator's endpoint id
            # through the relay (QUIC may then move to a direct path on its own)
            for cl in clients:
                await cl.close()


async def test_a_client_killed_and_restarted_with_its_key_through_a_relay_is_back_at_once(
    tmp_path: Path,
) -> None:
    """SIGKILL, then the same key again at once, through a relay: the relay replaces the
    dead session and the coordinator the dead connection (there was a known issue: it
    was seen not to get through for seconds, so the example restarted crashed clients
    under a new identity, which the coordinator counted as a member too many until the
    dead connection timed out)."""
    seed = "federated restart through a relay"
    me = str(SecretKey.from_seed(seed, 0).endpoint_id)
    # The coordinator takes a silent peer for dead only after 60 s: a client counted
    # once below was replaced, never timed out.
    patient = TransportConfig(idle_timeout=60.0)
    with RelayProcess(tmp_path) as relay:
        async with Coordinator(
            np.zeros(16, np.float32), FederatedConfig(round_timeout=30), transport=patient
        ) as c:
            await c.start(relay=relay.url)
            for _ in range(2):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(HERE / "federated_worker.py"),
                    str(c.endpoint_id),
                    relay.url,
                    "hang",
                    seed,
                    stdout=asyncio.subprocess.PIPE,
                )
                try:
                    assert proc.stdout is not None
                    started = await asyncio.wait_for(proc.stdout.readline(), 60.0)
                    assert started == b"started\n", started
                    # at once: well within the 60 s the dead connection takes to time out
                    line = await asyncio.wait_for(proc.stdout.readline(), 20.0)
                    assert line.startswith(b"got round"), line
                    assert c.members == [me]  # its dead connection replaced by this one
                finally:
                    proc.kill()  # no goodbye
                    await proc.wait()


async def test_wrong_coordinator_key_is_refused() -> None:
    async with coordinator(np.zeros(2, np.float32)) as c:
        assert c.address is not None
        other = Coordinator(np.zeros(2, np.float32))
        impostor = FederatedClient(
            other.endpoint_id,
            address=f"{c.address[0]}:{c.address[1]}",
            transport=PLAIN,
            connect_timeout=5,
        )
        with pytest.raises(PeerAuthenticationError, match="identity mismatch"):
            await impostor.connect()


async def test_client_timeouts_name_the_coordinator() -> None:
    async with coordinator(np.zeros(2, np.float32)) as c:
        cl = client_of(c)
        await cl.connect()
        short = c.endpoint_id.short()
        with pytest.raises(PeerTimeoutError, match=f"coordinator {short}: no verdict within"):
            await cl.wait_ack(1, timeout=0.05)
        with pytest.raises(PeerTimeoutError, match=f"coordinator {short}: no new round within"):
            await cl.next_round(timeout=0.05)
        await cl.close()


async def test_close_waits_for_every_task_it_started() -> None:
    """close() waits for its tasks itself, not by luck while the transport closes (taken
    away here, and closed after)."""
    async with coordinator(np.zeros(2, np.float32)) as c:
        a, b = client_of(c), client_of(c)
        await a.connect()
        await b.connect()
        await c.wait_for_members(2, timeout=10)
        reader = b._reader
        assert reader is not None and not reader.done()
        transport, b._transport = b._transport, None
        await b.close()
        assert reader.done()
        assert transport is not None
        await transport.close()
        await wait_until(lambda: len(c.members) == 1, "b left")
        tasks = [*c._tasks, *(cl.sender for cl in c._clients.values() if cl.sender)]
        assert len(tasks) >= 3  # the accept loop, a's serve loop and its sender
        own, c._transport = c._transport, None
        await c.close()
        assert all(t.done() for t in tasks)
        assert own is not None
        await own.close()
        assert await a.next_round(timeout=10) is None and a.stopped == "training is over"
        await a.close()


async def test_a_client_told_to_stop_before_any_model_closes_on_connect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with coordinator(np.zeros(2, np.float32)) as c:
        cl = client_of(c)

        async def stopped(timeout: float | None, *, after_stop: bool) -> None:
            cl.stopped = "training is over"  # the stop came before any model

        monkeypatch.setattr(cl, "_next_task", stopped)
        with pytest.raises(ConnectionClosedError, match="stopped: training is over"):
            await cl.connect()
        assert cl._conn is None and cl._reader is not None and cl._reader.done()
        await wait_until(lambda: not c.members, "the client's connection closed")


async def test_a_coordinator_that_cannot_listen_may_start_again() -> None:
    async with coordinator(np.zeros(2, np.float32)) as c:
        assert c.address is not None
        taken = f"{c.address[0]}:{c.address[1]}"
        async with Coordinator(np.zeros(2, np.float32), transport=PLAIN) as other:
            with pytest.raises(UsageError, match=f"cannot listen on {taken}"):
                await other.start(listen=taken)
            await other.start(listen="127.0.0.1:0")
            assert other.address is not None and other.address != c.address


async def test_the_same_client_again_replaces_its_old_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with coordinator(np.zeros(2, np.float32), round_timeout=30.0) as c:
        assert c.address is not None
        old = client_of(c)
        await old.connect()
        new = FederatedClient(
            c.endpoint_id, address=f"{c.address[0]}:{c.address[1]}", transport=PLAIN, key=old.key
        )
        with caplog.at_level(logging.WARNING, logger="p2pdist.federated.coordinator"):
            await new.connect()
        # the old connection is told why before it is closed
        assert await old.next_round(timeout=10) is None
        assert old.stop_error
        assert old.stopped == (
            "replaced by a newer connection with your key (the client restarted, or two clients "
            "share a key?)"
        )
        assert any("two clients share a key?" in r.getMessage() for r in caplog.records)
        assert await old.submit(np.ones(2, np.float32), 1, 0) is False
        assert c.members == [str(old.endpoint_id)]
        run = asyncio.create_task(c.run_round())
        await new.submit(np.ones(2, np.float32), 1, 0)
        out = await run
        assert out.reason is CloseReason.COMPLETE and out.members == 1
        await old.close()
        await new.close()


async def test_a_client_resending_an_aggregated_update_is_told_duplicate() -> None:
    async with coordinator(np.zeros(4, np.float32), round_timeout=30.0) as c:
        a, b = client_of(c), client_of(c)
        await a.connect()
        await b.connect()
        run = asyncio.create_task(c.run_round())
        await a.submit(np.full(4, 1.0, np.float32), 10, 0)
        await b.submit(np.full(4, 3.0, np.float32), 10, 0)
        out0 = await run
        assert out0.applied and len(out0.participants) == 2
        assert await a.next_round(timeout=10) is not None  # round 1's model
        # a sends its round-0 update again (a retry after a lost ack): with the round it
        # sent it for, then with the newest round it has heard of (1)
        await a.submit(np.full(4, 1.0, np.float32), 10, 0, round_id=0)
        await a.submit(np.full(4, 1.0, np.float32), 10, 0)
        for n in (2, 3):
            ack = await a.wait_ack(n)
            assert not ack.accepted and ack.reason == "duplicate", ack
        await a.close()  # what it sent before leaving would still count if accepted
        await wait_until(lambda: c.members == [str(b.endpoint_id)], "a left")
        run = asyncio.create_task(c.run_round())
        await b.submit(np.full(4, 5.0, np.float32), 10, 1)
        out1 = await run
        assert [p.client for p in out1.participants] == [str(b.endpoint_id)]
        assert out1.dropped == {"duplicate": 2}
        np.testing.assert_array_equal(out1.aggregate, np.full(4, 5.0, np.float32))
        np.testing.assert_array_equal(c.model, np.full(4, 7.0, np.float32))
        await b.close()


async def test_a_client_keeps_the_newest_verdicts_and_counts_them_all() -> None:
    async with coordinator(np.zeros(4, np.float32), round_timeout=30.0) as c:
        assert c.address is not None
        host, port = c.address
        a = FederatedClient(
            c.endpoint_id,
            address=f"{host}:{port}",
            transport=TransportConfig(tls=False),
            keep_acks=2,
        )
        await a.connect()
        run = asyncio.create_task(c.run_round())
        await a.submit(np.full(4, 1.0, np.float32), 10, 0)
        assert (await run).applied
        for _ in range(2):  # sent again: told duplicate
            await a.submit(np.full(4, 1.0, np.float32), 10, 0, round_id=0)
        assert not (await a.wait_ack(3)).accepted
        assert (a.acks_received, a.acks_refused, len(a.acks)) == (3, 2, 2)
        assert [ack.reason for ack in a.acks] == ["duplicate", "duplicate"]
        assert (await a.wait_ack(2)).reason == "duplicate"
        with pytest.raises(UsageError, match="verdict 1 is no longer kept: 3 arrived"):
            await a.wait_ack(1)
        await a.close()
    with pytest.raises(UsageError, match="keep_acks"):
        FederatedClient(c.endpoint_id, address="127.0.0.1:1", keep_acks=0)


async def test_closing_the_coordinator_ends_its_waits() -> None:
    async with coordinator(np.zeros(4, np.float32), round_timeout=60.0) as c:
        members = asyncio.create_task(c.wait_for_members(2, timeout=None))
        a = client_of(c)
        await a.connect()
        rounds = asyncio.create_task(c.run_round())  # one client of two: waits the 60 s
        await asyncio.sleep(0.2)
        assert not members.done() and not rounds.done()
        await c.close()
        for waiting in (members, rounds):
            with pytest.raises(ConnectionClosedError, match="coordinator: closed"):
                await asyncio.wait_for(waiting, 5)
        await a.close()


async def test_a_client_that_never_reads_its_acks_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The rogue submits (wrong shapes) without reading: its mailbox fills, its transport
    # stops reading, and the coordinator's acks back up. The coordinator must stop
    # reading it too and drop it after round_timeout, not queue acks without bound.
    caplog.set_level(logging.INFO, logger="p2pdist.federated.coordinator")
    config = FederatedConfig(round_timeout=1.0)
    tight = TransportConfig(tls=False, write_buffer_high=16 * 1024)
    async with Coordinator(np.zeros(4, np.float32), config, transport=tight) as c:
        await c.start(listen="127.0.0.1:0")
        assert c.address is not None
        host, port = c.address
        t = await open_transport(
            SecretKey.generate(),
            TransportConfig(tls=False, max_buffered=16 * 1024),
            relay=None,
            relay_token=None,
            accept_from=lambda e: False,
            label_for=None,
            timeout=5,
        )
        try:
            conn = await dial_with_retry(t, c.endpoint_id, f"{host}:{port}", label="r", timeout=5)
            meta, payload = encode("hello", {"name": "rogue"})
            await conn.send(CLIENT_CHANNEL, payload, meta=meta)
            await c.wait_for_members(1, timeout=10)
            meta, payload = encode("submit", {"r": 0, "b": 0, "n": 1}, np.zeros(1, np.float32))
            sent = 0
            with contextlib.suppress(P2PError):  # once dropped, sending fails
                while c.members and sent < 2_000_000:
                    conn.send_nowait(CLIENT_CHANNEL, payload, meta=meta)
                    sent += 1
                    if sent % 1000 == 0:
                        await asyncio.sleep(0)
            await wait_until(lambda: not c.members, "rogue dropped", seconds=10)
            assert any("took none of its acks" in r.getMessage() for r in caplog.records)
        finally:
            await t.close()


class _SlowReader:
    """A connection with framed's send semantics (the frame is queued whole, then the
    sender waits while writing is paused) whose peer reads ``rate`` bytes a second."""

    HIGH, LOW = 64, 16

    def __init__(self, rate: float) -> None:
        self.buffered, self.paused, self.rate = 0.0, False, rate
        self._drained: asyncio.Future[None] | None = None

    def send_nowait(self, channel: int, payload: Any, *, meta: bytes = b"") -> None:
        self.buffered += len(payload) + len(meta)
        self.paused = self.paused or self.buffered > self.HIGH

    async def send(self, channel: int, payload: Any, *, meta: bytes = b"") -> None:
        self.send_nowait(channel, payload, meta=meta)
        while self.paused:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    async def read(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.buffered = max(0.0, self.buffered - self.rate * 0.01)
            if self.paused and self.buffered <= self.LOW:
                self.paused = False
                if self._drained is not None and not self._drained.done():
                    self._drained.set_result(None)

    async def close(self) -> None:
        pass


async def test_a_slow_client_still_gets_its_ack_while_models_keep_draining() -> None:
    """Rounds close faster than a model drains to this (healthy, reading) client: its
    one ack of a round must not queue behind the models until round_timeout drops it."""
    async with coordinator(np.zeros(4, np.float32), round_timeout=1.0) as c:
        conn = _SlowReader(rate=1000)  # a 600-byte model takes 0.6 s
        client = _Client("slow", "client slow", conn)  # type: ignore[arg-type]
        tasks = [asyncio.create_task(conn.read()), asyncio.create_task(c._sender(client))]

        async def rounds_close() -> None:
            while True:
                client.latest = (b"m", memoryview(bytes(600)))
                client.ready.set()
                await asyncio.sleep(0.5)

        tasks.append(asyncio.create_task(rounds_close()))
        try:
            await asyncio.sleep(0.1)
            c._state.join("slow")
            c._state.open(asyncio.get_running_loop().time())
            meta, payload = encode("submit", {"r": c._state.round, "b": 0, "n": 1}, np.ones(4))
            frame = Frame(FrameKind.DATA, CLIENT_CHANNEL, 0, meta, memoryview(bytearray(payload)))
            submit = decode(frame, "slow")
            await asyncio.wait_for(c._on_submit(client, submit), 0.5)  # dropped after 1 s before
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_task_model_trained_in_place_fails_at_once() -> None:
    # A train() that updates its argument in place would give a zero delta, silently:
    # the model is read only, so it fails at once instead.
    async with coordinator(np.zeros(8, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        task = await a.connect()
        with pytest.raises(ValueError, match="read-only"):
            task.model -= 0.5 * np.ones(8, np.float32)
        assert a.latest is not None and not a.latest.model.flags.writeable
        np.testing.assert_array_equal(task.model, np.zeros(8, np.float32))
        delta = (task.model.copy() - 0.5) - task.model  # a copy trains fine
        np.testing.assert_array_equal(delta, np.full(8, -0.5, np.float32))
        await a.close()


async def test_submit_after_the_coordinator_stopped_returns_false() -> None:
    # A client still training when the coordinator stops: its submit() is not a
    # ConnectionBrokenError but "not taken: training is over".
    async with coordinator(np.zeros(2, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        task = await a.connect()
        await c.close()  # while the client "trains"
        await wait_until(lambda: a.stopped is not None, "the stop read")
        assert await a.submit(np.ones(2, np.float32), 1, task.round) is False
        assert a.stopped == "training is over"
        assert await a.next_round(timeout=10) is None
        with pytest.raises(ConnectionClosedError, match="stopped: training is over"):
            await a.wait_ack(1, timeout=10)
        await a.close()


async def test_a_coordinator_closed_while_it_starts_accepts_nobody() -> None:
    """close() while start() still opens its listener: start() raises that it was
    closed, and nothing listens (it used to install the transport and accept clients
    after close(), which then waited for a stop that never came)."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    c = Coordinator(np.zeros(2, np.float32), transport=PLAIN)
    starting = asyncio.create_task(c.start(listen=f"127.0.0.1:{port}"))
    await asyncio.sleep(0)  # start() awaits the listener's address lookup
    await asyncio.wait_for(c.close(), 5)
    with pytest.raises(ConnectionClosedError, match="closed while it started"):
        await asyncio.wait_for(starting, 5)
    assert c.address is None and not c._tasks
    with socket.socket() as s:  # nothing listens there any more
        assert s.connect_ex(("127.0.0.1", port)) != 0


async def test_a_client_closed_while_it_connects_ends_unconnected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() while connect() still opens its transport (a relay session, say): connect()
    raises that the client was closed, and the transport it opened is closed too (it
    used to be kept, and the client connected after its close)."""
    from p2pdist.federated import client as client_module

    real, opened, gate, entered = client_module.open_transport, [], asyncio.Event(), asyncio.Event()

    async def slow_open(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await asyncio.wait_for(gate.wait(), 10)
        opened.append(await real(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(client_module, "open_transport", slow_open)
    async with coordinator(np.zeros(2, np.float32)) as c:
        cl = client_of(c)
        connecting = asyncio.create_task(cl.connect())
        await asyncio.wait_for(entered.wait(), 10)  # connect() waits for its transport
        await asyncio.wait_for(cl.close(), 5)
        gate.set()
        with pytest.raises(ConnectionClosedError, match="closed while it connected"):
            await asyncio.wait_for(connecting, 10)
        assert cl._transport is None and opened and opened[0]._closed
        await asyncio.sleep(0.2)
        assert c.members == []


async def test_the_last_model_sent_before_the_stop_is_not_a_new_round() -> None:
    """The last round's close sends its model, then close() says stop: next_round()
    returns None, as documented, not a task for a round that will never run (it used
    to return it, and the client trained a wasted round)."""
    async with coordinator(np.zeros(2, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        task = await a.connect()
        run = asyncio.create_task(c.run_round())
        assert await a.submit(np.ones(2, np.float32), 1, task.round)
        await asyncio.wait_for(run, 10)
        await wait_until(lambda: a.latest is not None and a.latest.round == 1, "round 1 model")
        await c.close()
        await wait_until(lambda: a.stopped is not None, "the stop read")
        assert await a.next_round(timeout=10) is None
        await a.close()


async def test_the_stop_does_not_pass_a_model_still_waiting_for_room() -> None:
    """The coordinator's pipe to a slow client is backed up (paused by hand here) when
    the last rounds' models are posted. close() has the client's sender send the stop
    after them, not past them (send_nowait went ahead of the waiting sender, which
    close() then cancelled: the client never got the model)."""
    async with coordinator(np.zeros(4, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        await a.connect()
        (client,) = c._clients.values()
        conn = client.conn
        conn._write_paused = True  # type: ignore[attr-defined]
        # Round 7's model: its sender waits in line with it. Round 8's: posted behind
        # it, in no line yet (the stop went before it, a review found, when close()
        # only waited for the line).
        for r in (7, 8):
            c._post(client, encode("model", {"r": r, "open": False, "left": 30.0}, np.ones(4)))
            await asyncio.sleep(0.1)

        async def drains() -> None:
            await asyncio.sleep(0.5)
            conn._resume_writing()  # type: ignore[attr-defined]

        draining = asyncio.create_task(drains())
        await c.close()
        await draining
        await wait_until(lambda: a.stopped is not None, "the stop read")
        assert a.latest is not None and a.latest.round == 8, a.latest
        await a.close()


async def test_a_close_cut_short_while_the_stop_waits_still_closes_everything() -> None:
    """close() waits (up to STOP_AFTER_MODEL) for a model still waiting for room to go
    before the stop; a close cancelled in that wait (a caller's timeout) left the tasks
    running and the port listening, and a second close() returned at once (a review)."""
    async with coordinator(np.zeros(4, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        await a.connect()
        (client,) = c._clients.values()
        client.conn._write_paused = True  # type: ignore[attr-defined]  # backed up for good
        c._post(client, encode("model", {"r": 8, "open": False, "left": 30.0}, np.ones(4)))
        await asyncio.sleep(0.1)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await c.close()
        assert not c._tasks, c._tasks
        assert c._transport is not None and c._transport._closed  # type: ignore[attr-defined]
        await a.close()


async def test_a_client_joining_while_close_waits_for_a_model_is_told_to_stop() -> None:
    """close() waits (up to STOP_AFTER_MODEL) for a slow client's model; a client that
    joins in that wait is taken in as any late joiner (it gets the model) and is told to
    stop with the others, not left connected nor cut off without a word."""
    async with coordinator(np.zeros(4, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        await a.connect()
        (client,) = c._clients.values()
        client.conn._write_paused = True  # type: ignore[attr-defined]
        c._post(client, encode("model", {"r": 8, "open": False, "left": 30.0}, np.ones(4)))
        await asyncio.sleep(0.1)
        closing = asyncio.create_task(c.close("done for today"))
        await asyncio.sleep(0.1)
        assert not closing.done()  # in its wait for a's model
        b = client_of(c)
        await asyncio.wait_for(b.connect(), 10)
        await wait_until(lambda: b.stopped is not None, "the joiner's stop")
        assert b.stopped == "done for today" and b.latest is not None
        client.conn._resume_writing()  # type: ignore[attr-defined]
        await asyncio.wait_for(closing, 10)
        await wait_until(lambda: a.stopped is not None, "the slow client's stop")
        assert a.stopped == "done for today" and a.latest is not None and a.latest.round == 8
        await asyncio.gather(a.close(), b.close())


async def test_a_client_whose_connect_failed_may_connect_again_and_a_closed_one_says_why() -> None:
    """The coordinator is not up at the first connect(), which times out: a second
    connect() on the same client works once it is (it used to say "already
    connected"); a client closed on purpose says to make a new one."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    model = np.zeros(2, np.float32)
    async with Coordinator(model, FederatedConfig(), transport=PLAIN) as c:
        cl = FederatedClient(
            c.endpoint_id, address=f"127.0.0.1:{port}", transport=PLAIN, connect_timeout=0.5
        )
        with pytest.raises(PeerTimeoutError):
            await cl.connect()
        await c.start(listen=f"127.0.0.1:{port}")
        cl._connect_timeout = 10.0
        task = await cl.connect()
        assert task.round == 0 and c.members == [str(cl.endpoint_id)]
        await cl.close()
        with pytest.raises(UsageError, match="this client was closed: make a new"):
            await cl.connect()


async def test_submit_racing_the_stop_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    # The coordinator stops and closes while the update is being sent, before this
    # client's reader has read the stop: the failed send waits for it.
    async with coordinator(np.zeros(2, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        task = await a.connect()
        conn = a._conn
        assert conn is not None

        closing: list[asyncio.Task[None]] = []

        async def send(*args: Any, **kwargs: Any) -> None:
            closing.append(asyncio.create_task(c.close()))  # the stop goes out after this
            raise ConnectionBrokenError(conn.label, "closed its connection (left)")

        monkeypatch.setattr(conn, "send", send)
        assert await a.submit(np.ones(2, np.float32), 1, task.round) is False
        assert a.stopped == "training is over"
        await asyncio.wait_for(closing[0], 10)
        await a.close()


async def test_submit_on_a_broken_connection_without_a_stop_still_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with coordinator(np.zeros(2, np.float32), round_timeout=30.0) as c:
        a = client_of(c)
        task = await a.connect()
        conn = a._conn
        assert conn is not None

        async def send(*args: Any, **kwargs: Any) -> None:
            await c._clients[str(a.endpoint_id)].conn.close()  # no stop: a real break
            raise ConnectionBrokenError(conn.label, "reset")

        monkeypatch.setattr(conn, "send", send)
        with pytest.raises(ConnectionBrokenError, match="reset"):
            await a.submit(np.ones(2, np.float32), 1, task.round, timeout=10)
        await a.close()


async def test_a_coordinator_that_fails_tells_its_clients_it_failed() -> None:
    model = np.zeros(2, np.float32)
    a: FederatedClient | None = None
    with pytest.raises(P2PTimeoutError):
        async with Coordinator(model, transport=PLAIN) as c:
            await c.start(listen="127.0.0.1:0")
            a = client_of(c)
            await a.connect()
            await c.wait_for_members(2, timeout=0.2)  # 1 of 2: gives up
    assert a is not None
    assert await a.next_round(timeout=10) is None
    assert a.stop_error
    assert a.stopped is not None and "the coordinator failed: P2PTimeoutError" in a.stopped
    assert "1 of 2 clients connected" in a.stopped
    await a.close()
    # a normal end is not an error
    async with coordinator(model) as c:
        b = client_of(c)
        await b.connect()
    assert await b.next_round(timeout=10) is None
    assert b.stopped == "training is over" and not b.stop_error
    await b.close()


async def test_a_cancelled_coordinator_tells_its_clients_it_was_interrupted() -> None:
    got: list[FederatedClient] = []

    async def serve() -> None:
        async with coordinator(np.zeros(2, np.float32)) as c:
            got.append(client_of(c))
            await got[0].connect()
            await asyncio.sleep(60)  # Ctrl-C arrives

    task = asyncio.create_task(serve())
    await wait_until(lambda: bool(got) and got[0].latest is not None, "client connected")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert await got[0].next_round(timeout=10) is None
    assert (
        got[0].stop_error and got[0].stopped == "the coordinator was interrupted (CancelledError)"
    )
    await got[0].close()


async def test_a_client_with_the_coordinators_own_key_is_refused(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with coordinator(np.zeros(2, np.float32)) as c:
        assert c.address is not None
        address = f"{c.address[0]}:{c.address[1]}"
        twin = FederatedClient(c.endpoint_id, address=address, transport=PLAIN, key=c.key)
        # Its transport refuses to dial its own endpoint id, at once and without a
        # connection.
        with pytest.raises(UsageError, match="own endpoint id"):
            await twin.connect()
        assert c.members == []
        # A client whose transport did dial (another implementation, an older p2pdist)
        # is refused by the coordinator, as before.
        from p2pdist.transport.framed import EndpointBase

        monkeypatch.setattr(EndpointBase, "_check_not_self", lambda *args: None)
        twin = FederatedClient(c.endpoint_id, address=address, transport=PLAIN, key=c.key)
        with (
            caplog.at_level(logging.WARNING, logger="p2pdist.federated.coordinator"),
            pytest.raises(ConnectionClosedError, match=r"refused: .*coordinator's own"),
        ):
            await twin.connect()
        assert twin.stop_error and c.members == []
        assert any("coordinator's own" in r.getMessage() for r in caplog.records)
        monkeypatch.undo()
        other = client_of(c)  # others still join
        await other.connect()
        assert c.members == [str(other.endpoint_id)]
        await other.close()


async def test_coordinator_usage_errors_and_a_second_run_round_at_once() -> None:
    """A dict config, an int listen address and string counts failed with
    AttributeError/TypeError; a second run_round() while one ran never returned and
    spun a core on the old round's deadline."""
    with pytest.raises(UsageError, match="config must be a FederatedConfig"):
        Coordinator(np.zeros(4, np.float32), {"rule": "mean"})  # type: ignore[arg-type]
    async with Coordinator(np.zeros(4, np.float32), transport=PLAIN) as bare:
        with pytest.raises(UsageError, match="address must be"):
            await bare.start(listen=45001)  # type: ignore[arg-type]
    async with coordinator(np.zeros(4, np.float32), round_timeout=1.0) as c:
        with pytest.raises(UsageError, match="count"):
            await c.wait_for_members("2", 1)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="timeout"):
            await c.wait_for_members(1, float("nan"))
        await asyncio.wait_for(c.wait_for_members(0, None), 10)  # None: no bound
        first = asyncio.create_task(c.run_round())
        await asyncio.sleep(0)
        with pytest.raises(UsageError, match="already running"):
            await asyncio.wait_for(c.run_round(), 10)
        assert (await asyncio.wait_for(first, 10)).round == 0
        assert (await asyncio.wait_for(c.run_round(), 10)).round == 1
