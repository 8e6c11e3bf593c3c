"""Failures: dead, silent and absent peers are named; late frames never leak; cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from group_helpers import groups, loopback_peers, slow_link, until_left

from p2pdist import ConnectionBrokenError, GroupBrokenError, P2PError, PeerTimeoutError
from p2pdist.group.core import _COLLECTIVE_SPACE
from p2pdist.transport.mailbox import SPACE_SHIFT

WORKER = Path(__file__).with_name("fault_worker.py")


def run_ranks(mode: str, world: int) -> list[subprocess.Popen[str]]:
    peers = ",".join(loopback_peers(world))
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(r), str(world), peers],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def survivors_output(procs: list[subprocess.Popen[str]]) -> list[str]:
    lines = []
    for p in procs[:-1]:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        lines.append([ln for ln in out.splitlines() if ln.startswith(("ERROR", "OK"))][-1])
    return lines


@pytest.mark.parametrize("world", [2, 4])
def test_killed_rank_is_named_by_every_survivor(world: int) -> None:
    procs = run_ranks("kill", world)
    try:
        lines = survivors_output(procs)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    victim = f"rank {world - 1} ("
    for line in lines:
        assert line.startswith("ERROR"), line
        assert victim in line, line


def test_silent_rank_is_named_by_every_survivor() -> None:
    procs = run_ranks("stop", 3)
    try:
        lines = survivors_output(procs)
    finally:
        for p in procs:
            with_pid = p.pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(with_pid, signal.SIGCONT)
            p.kill()
            p.wait(timeout=10)
    for line in lines:
        assert line.startswith("ERROR"), line
        assert "rank 2 (" in line, line


async def test_absent_rank_is_named_within_the_timeout() -> None:
    async with groups(3) as gs:
        calls = [g.all_reduce(np.ones(4), timeout=1.0) for g in gs[:2]]  # rank 2 never calls
        results = await asyncio.gather(*calls, return_exceptions=True)
        for res in results:
            assert isinstance(res, PeerTimeoutError), res
            assert "rank 2 (" in str(res)
        with pytest.raises(GroupBrokenError):
            await gs[0].all_reduce(np.ones(4))


async def test_a_ring_timeout_says_when_the_awaited_rank_did_start_the_call() -> None:
    """Rank 2 never calls a ring all-reduce: rank 0 waits for rank 2 and names it; rank 1
    waits for rank 0, which did start the call, and the error says so (it used to read
    as if rank 0 were the one missing)."""
    for first in (0, 1):  # the rank whose timeout runs out first (the other is told)
        async with groups(3, config={"algorithm": "ring"}) as gs:
            x = np.ones(1 << 20, np.float32)  # 4 MiB: the ring path
            calls = [
                g.all_reduce(x.copy(), timeout=0.5 if g.rank == first else 5.0) for g in gs[:2]
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            err = results[first]
            assert isinstance(err, PeerTimeoutError), results
            if first == 0:
                assert "rank 2 (" in str(err) and "did start" not in str(err)
            else:
                assert "rank 0 (" in str(err) and "it did start this call" in str(err)
                assert "timed out after 0.55 s" in str(err), err  # its grace: 0.05 s more
            assert isinstance(results[1 - first], GroupBrokenError), results


async def test_every_rank_of_a_ring_names_the_rank_that_never_called() -> None:
    """World 5, ring, equal timeouts: rank 3 never calls. Rank 4 waits for rank 3 itself;
    ranks 0-2 wait for neighbours that did start the call, so their timeouts give rank 4's
    a grace to run out first, and its abort names rank 3 on every rank (before, the first
    timeout to run out, rank 0's, named rank 4 to everyone)."""
    async with groups(5, config={"algorithm": "ring"}) as gs:
        x = np.ones(1 << 20, np.float32)  # 4 MiB: the ring path
        calls = [g.all_reduce(x.copy(), timeout=3.0) for g in gs if g.rank != 3]
        results = await asyncio.gather(*calls, return_exceptions=True)
    blamed = re.compile(r"rank 3 \(\w+\): all_reduce\(.*\) timed out after 3 s waiting for it$")
    assert isinstance(results[-1], PeerTimeoutError), results  # rank 4's own timeout
    for err in results:
        assert isinstance(err, PeerTimeoutError | GroupBrokenError), results
        assert blamed.search(str(err)), err


async def test_a_pairwise_timeout_names_the_rank_that_never_called() -> None:
    """The same with the pairwise exchange (world 3's default): every rank waits for rank
    2 itself, so whichever rank times out first names rank 2."""
    for first in (0, 1):
        async with groups(3, config={"algorithm": "pairwise"}) as gs:
            x = np.ones(1 << 20, np.float32)
            calls = [
                g.all_reduce(x.copy(), timeout=0.5 if g.rank == first else 5.0) for g in gs[:2]
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            err = results[first]
            assert isinstance(err, PeerTimeoutError), results
            assert "rank 2 (" in str(err) and "did start" not in str(err), err
            assert isinstance(results[1 - first], GroupBrokenError), results


async def test_late_frame_of_an_old_collective_is_dropped() -> None:
    async with groups(2) as gs:
        a, b = gs
        outs = await asyncio.gather(a.all_reduce(np.ones(3)), b.all_reduce(np.ones(3)))
        assert outs[0].tolist() == [2, 2, 2]
        conn = a.connection(1)
        old_channel = (_COLLECTIVE_SPACE << SPACE_SHIFT) | 0  # the finished collective
        junk = np.full(3, 1e9).tobytes()
        await conn.send(old_channel, junk, seq=0)
        await conn.send(old_channel, junk, seq=1)
        outs = await asyncio.gather(a.all_reduce(np.ones(3)), b.all_reduce(np.ones(3)))
        assert outs[1].tolist() == [2, 2, 2]
        await asyncio.gather(a.barrier(), b.barrier())
        assert b.connection(0).stats.dropped_stale >= 2


async def test_cancelled_collective_breaks_the_group_loudly() -> None:
    async with groups(2) as gs:
        a, b = gs
        task = asyncio.create_task(a.all_reduce(np.ones(1 << 20), timeout=10))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(GroupBrokenError, match="cancelled"):
            await a.all_reduce(np.ones(4))
        # the peer learns it from the abort notice instead of waiting for its timeout
        with pytest.raises(GroupBrokenError, match="rank 0"):
            await b.all_reduce(np.ones(1 << 20), timeout=10)


async def test_graceful_leave_blocks_collectives_but_not_other_pairs() -> None:
    async with groups(3) as gs:
        await gs[0].close()
        x = np.arange(5.0)
        await gs[1].send(x, 2)
        np.testing.assert_array_equal(await gs[2].recv(1, like=x), x)
        for g in gs[1:]:
            for _ in range(100):  # the goodbye arrives asynchronously (bounded wait)
                if g._left:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(GroupBrokenError, match=r"rank 0 .* left"):
                await g.all_reduce(x)
        with pytest.raises(ConnectionBrokenError, match="rank 0"):
            await gs[1].recv(0, timeout=2)


async def test_empty_collectives_retire_their_channels() -> None:
    async with groups(2) as gs:
        for _ in range(20):
            await asyncio.gather(*(g.all_reduce(np.empty(0)) for g in gs))
            await asyncio.gather(*(g.reduce_scatter(np.empty((0, 2))) for g in gs))
        retired = gs[0].connection(1)._mailbox._retired  # type: ignore[attr-defined]
        assert len(retired._runs[0][0]) == 1, "retired channels did not compact"


async def test_a_late_dial_after_formation_is_refused() -> None:
    from p2pdist import PeerAuthenticationError, SecretKey, TcpTransport, TransportConfig

    async with groups(2) as gs:
        host_port = gs[0]._addresses[0]  # type: ignore[index]
        late = TcpTransport(
            SecretKey.from_seed("test-seed-0123456789", 1), TransportConfig(tls=False)
        )
        try:
            with pytest.raises(PeerAuthenticationError, match="not allowed"):
                await late.connect(gs[0].endpoint_id, host_port)
        finally:
            await late.close()
        out = await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in gs))
        assert out[0].tolist() == [2.0, 2.0]


async def test_a_lost_peer_error_adds_the_failures_reported_meanwhile() -> None:
    from p2pdist import Group

    g = Group.from_seed("test-seed-0123456789", rank=0, world=1)
    err = ConnectionBrokenError("rank 1 (abcdefghij)", "connection reset: by peer")
    assert err.detail == "connection reset: by peer"
    g._failure_log += [err, GroupBrokenError("rank 2 (klmnopqrst) aborted the group: boom")]
    out = await g._attribute(err)
    assert out.peer == err.peer
    assert str(out) == (
        "rank 1 (abcdefghij): connection reset: by peer; "
        "also: rank 2 (klmnopqrst) aborted the group: boom"
    )
    alone = ConnectionBrokenError("rank 3 (uvwxyz2345)", "gone")
    g._failure_log[:] = [alone]
    assert await g._attribute(alone) is alone  # nothing else reported: unchanged


async def test_a_rank_that_refuses_a_call_for_a_left_peer_tells_the_others() -> None:
    """on_peer_loss="break", world 3: ranks 0 and 1 begin a call, rank 0 closes, and rank
    2 refuses the call (rank 0 left) without a word: rank 1, which had rank 0's part,
    waited out its timeout for rank 2 and then blamed rank 0 as "silent". Now rank 2's
    refusal is a notice and rank 1 fails at once, naming rank 0 as gone."""
    async with groups(3, timeout=20) as gs:
        x = np.ones(1000, np.float32)
        t0 = asyncio.create_task(gs[0].all_reduce(x))
        t1 = asyncio.create_task(gs[1].all_reduce(x))
        await asyncio.sleep(0.2)
        await gs[0].close()
        await until_left(gs[1:], 0)
        told: list[int] = []
        tell = gs[2]._tell_call_failed
        gs[2]._tell_call_failed = lambda ch, r, **kw: (told.append(ch), tell(ch, r, **kw))  # type: ignore[method-assign,func-returns-value]
        for _ in range(5):  # a retry loop tells the others once, not at every attempt
            with pytest.raises(GroupBrokenError, match="left the group"):
                await gs[2].all_reduce(x)
        assert len(told) == 1, told
        with pytest.raises(P2PError) as info:
            await asyncio.wait_for(t1, 5)  # not the 20 s timeout
        assert "rank 0 (" in str(info.value) and "silent" not in str(info.value)
        with pytest.raises(GroupBrokenError):
            await t0


async def test_a_goodbye_right_after_an_abort_notice_still_names_the_cause() -> None:
    """A rank that failed for another's sake sends its abort notice, then the
    application closes it: both arrive together, the goodbye woke the waiting collective
    first, and its error named only the closer ("closed its connection (left)"), not
    the rank the notice named."""
    async with groups(2) as gs:
        t1 = asyncio.create_task(gs[1].all_reduce(np.ones(1000, np.float32)))
        await asyncio.sleep(0.2)  # rank 1 waits for rank 0's part
        cause = "rank 2 (zzzzzzzzzz): closed its connection (left)"
        conn = gs[1].connection(0)
        conn._set_reading(False)  # type: ignore[attr-defined]  # both in one read, later
        gs[0]._send_control({"abort": cause}, gs[0]._conns)
        closing = asyncio.create_task(gs[0].close())
        await asyncio.sleep(0.2)
        conn._set_reading(True)  # type: ignore[attr-defined]
        with pytest.raises(P2PError) as info:
            await asyncio.wait_for(t1, 10)
        assert cause in str(info.value)
        await asyncio.wait_for(closing, 10)


async def test_a_goodbye_yields_the_lead_to_a_rank_lost_without_one() -> None:
    """Rank 2 is killed; rank 0 fails for its sake and exits, and its goodbye wakes rank
    1's call first. Rank 1's error must lead with rank 2 (``peer``), not with rank 0,
    which only left (seen in 2 of 22 SIGKILL runs of a world-4 ring). The reports are
    put in place as the connections would; the rule under test is the attribution."""
    async with groups(3) as gs:
        g = gs[1]
        sub = await asyncio.gather(*(h.split(0) for h in gs))
        lost = ConnectionBrokenError(g.peer_label(2), "connection lost: connection reset")
        g._failure_log.append(lost)
        g._failure_log.append(GroupBrokenError(f"{g.peer_label(0)} aborted the group: {lost}"))
        goodbye = ConnectionBrokenError(
            g.peer_label(0), "closed its connection (left)", graceful=True
        )
        for where in (g, sub[1]):  # a sub-group reads its root's reports
            err = await where._attribute(goodbye)
            assert err.peer == g.peer_label(2) and not err.graceful, err
            assert str(err).startswith(f"{g.peer_label(2)}: connection lost"), err
            assert f"also: {g.peer_label(0)}: closed its connection (left)" in str(err), err
            assert "aborted the group" in str(err), err
        # A loss that leads already keeps its place.
        err = await g._attribute(lost)
        assert err.peer == g.peer_label(2) and "aborted the group" in str(err), err
        g._failure_log.clear()


async def test_a_call_started_right_after_a_goodbye_is_not_refused_as_left() -> None:
    """Rank 0 fails (its abort notice to all) and exits at once (its goodbye). Rank 2 read
    both in one go, and marked rank 0 as left in that read, before its control listener
    handled the notice: a call rank 2 started just then was refused with "rank 0 left
    the group", the reason lost (3 of 16 runs of a user's trial). The check is made
    where that call would have been, right after the goodbye's own handling."""
    async with groups(3, timeout=20) as gs:
        seen: list[BaseException | None] = []

        def call_now(error: BaseException | None) -> None:  # after the group's own callback
            try:
                gs[2]._check_usable()
                seen.append(None)
            except BaseException as exc:
                seen.append(exc)

        from_rank_0 = gs[2].connection(0)
        from_rank_0.add_close_callback(call_now)
        from_rank_0._set_reading(False)  # type: ignore[attr-defined]  # read both at once
        gs[0]._break(GroupBrokenError("rank 0 failed: a reason worth knowing"), notify=True)
        closing = asyncio.create_task(gs[0].close())
        await asyncio.sleep(0.1)  # the notice and the goodbye wait in rank 2's socket
        from_rank_0._set_reading(True)  # type: ignore[attr-defined]
        await asyncio.wait_for(closing, 10)
        for _ in range(100):
            if seen and gs[2].broken is not None:
                break
            await asyncio.sleep(0.02)
        assert seen and "left the group" not in str(seen[0]), seen
        assert "a reason worth knowing" in str(gs[2].broken), gs[2].broken
        with pytest.raises(GroupBrokenError, match="a reason worth knowing"):
            await gs[2].all_reduce(np.ones(3))


@pytest.mark.parametrize("when", ["between calls", "during a call"])
async def test_a_rank_whose_block_raised_tells_the_others_why_it_left(when: str) -> None:
    """Rank 2's ``async with`` body raises (a CUDA OOM, say). The others learned only
    "rank 2 closed its connection (left)" (a user's trial); its leaving notice now gives
    the exception, and every error about its leaving carries it."""
    async with groups(3, timeout=20) as gs:
        calls = []
        if when == "during a call":
            calls = [asyncio.create_task(g.all_reduce(np.ones(4))) for g in gs[:2]]
            await asyncio.sleep(0.1)  # both wait for rank 2's part
        oom = RuntimeError("CUDA out of memory (simulated)")
        await gs[2].__aexit__(RuntimeError, oom, None)  # what `async with` does
        if when == "between calls":
            await until_left(gs[:2], 2)
            calls = [asyncio.create_task(g.all_reduce(np.ones(4))) for g in gs[:2]]
        for res in await asyncio.gather(*calls, return_exceptions=True):
            assert isinstance(res, P2PError), res
            text = str(res)
            assert gs[0].peer_label(2) in text, text
            assert "`async with` block raised RuntimeError: CUDA out of memory" in text, text


async def test_every_call_in_flight_fails_at_once_when_a_rank_refuses_them_for_a_left_one() -> None:
    """Under on_peer_loss="break", ranks 0 and 2 run two collectives at once; rank 0
    closes the group in them, and rank 1 makes both calls after it saw rank 0 leave (so
    it refuses them). Only its first refusal was told: rank 2's second call waited its
    timeout, then blamed rank 1, alive, and broke the group (an audit). Rank 1 now
    says it refuses every call from the first on: both of rank 2's fail at once, naming
    rank 0, and the group is not broken."""
    async with groups(3, timeout=20) as gs:
        calls = [[asyncio.create_task(g.all_reduce(np.ones(4))) for _ in range(2)] for g in gs[::2]]
        await asyncio.sleep(0.2)  # ranks 0 and 2 wait for rank 1's parts
        await gs[0].close()
        await until_left(gs[1:], 0)
        for _ in range(2):
            with pytest.raises(GroupBrokenError, match=r"rank 0 .* left the group"):
                await gs[1].all_reduce(np.ones(4))
        outs = await asyncio.wait_for(asyncio.gather(*calls[1], return_exceptions=True), 10)
        for res in outs:
            assert isinstance(res, ConnectionBrokenError), res
            assert gs[2].peer_label(0) in str(res), res
        assert gs[1].broken is None and gs[2].broken is None
        for res in await asyncio.gather(*calls[0], return_exceptions=True):
            assert isinstance(res, GroupBrokenError), res  # closed under them


async def test_a_refused_call_reserved_earlier_spares_the_calls_run_after_it() -> None:
    """Rank 1 reserved call 0, ran call 1 (a broadcast it sends, slow to reach rank 2),
    then saw rank 0 leave and started call 0, refused. Its notice said it refuses every
    call from call 0 on, so rank 2 failed call 1, which rank 1 had run (a reviewer): now
    call 0 alone is told, and every call from the first one not reserved on."""
    async with groups(3, timeout=20) as gs:
        a, b, c = gs
        told: list[tuple[int, dict[str, Any]]] = []
        tell = b._tell_call_failed
        b._tell_call_failed = lambda ch, r, *rest, **kw: (  # type: ignore[method-assign,func-returns-value]
            told.append((ch, kw)),
            tell(ch, r, *rest, **kw),
        )
        first = [g.all_reduce(np.ones(4)) for g in gs]  # call 0: reserved, not started
        with slow_link(b, 2, 1.5, space=0):  # rank 1's collective data reach rank 2 late
            later = [asyncio.create_task(g.broadcast(np.arange(4.0), src=1)) for g in (a, c)]
            await b.broadcast(np.arange(4.0), src=1)  # call 1 runs on rank 1
            await asyncio.wait_for(later[0], 10)
            first[0].close()
            await a.close()
            await until_left([b], 0)
            with pytest.raises(GroupBrokenError, match="left the group"):
                await asyncio.wait_for(first[1], 10)  # call 0 starts now: refused
            np.testing.assert_array_equal(await asyncio.wait_for(later[1], 10), np.arange(4.0))
        first[2].close()
        assert [kw for _, kw in told] == [{}, {"onward": True}], told
        assert told[1][0] == told[0][0] + 2  # from the first call not reserved (2) on


async def test_a_call_started_after_a_rank_refused_every_call_from_there_fails_at_once() -> None:
    """The notice that a rank refuses every call from one on can come before this rank
    learns why (the left rank's goodbye comes on another connection): a call started
    in between fails at once instead of waiting for the refusing rank's part."""
    async with groups(3, timeout=20) as gs:
        g = gs[2]
        first = g._call_channel(g._next_cid)
        g._on_call_failed(first, 0, None, sender=1, onward=True)  # as rank 1 says
        for _ in range(2):
            with pytest.raises(ConnectionBrokenError, match=re.escape(g.peer_label(0))):
                await asyncio.wait_for(g.all_reduce(np.ones(4)), 10)
        assert g._refused_here(g._call_channel(g._next_cid)) is not None
        assert g._refused_here(first - 1) is None  # earlier calls are not refused


async def test_a_rank_that_fails_over_a_left_rank_does_not_retell_its_reason() -> None:
    """Rank 2's block raises; rank 3's next collective is refused for it, and rank 3's
    block raises that refusal, which quotes rank 2's reason. Rank 3's leaving notice
    sent that whole text: rank 0's error then quoted rank 2's reason twice, nested (and
    four ranks that failed alike nested it three deep)."""
    async with groups(4, timeout=20) as gs:
        boom = RuntimeError("boom (simulated)")
        await gs[2].__aexit__(RuntimeError, boom, None)
        await until_left([gs[3]], 2)
        with pytest.raises(GroupBrokenError) as info:
            await gs[3].all_reduce(np.ones(3))
        await gs[3].__aexit__(GroupBrokenError, info.value, None)
        await until_left([gs[0]], 3)
        with pytest.raises(GroupBrokenError) as told:
            await gs[0].all_reduce(np.ones(3))
        text = str(told.value)
        assert text.count("boom (simulated)") == 1, text
        said = f"{gs[0].peer_label(3)}: its `async with` block raised GroupBrokenError: "
        assert f"{said}collectives need every rank, but {gs[0].peer_label(2)} left" in text, text


async def test_a_sub_group_names_the_reason_of_the_rank_that_left_it() -> None:
    """A sub-group of root ranks 0 and 2: its rank 1 is root rank 2. Reasons are kept by
    root rank; the sub-group looked them up by its own numbers (a review found it gave
    rank 1's reason for rank 2)."""
    async with groups(3, timeout=20) as gs:
        subs = await asyncio.gather(*(g.split(c) for g, c in zip(gs, [0, None, 0], strict=True)))
        sub = subs[0]
        assert sub is not None
        await gs[1].__aexit__(RuntimeError, RuntimeError("ONE"), None)
        await until_left(gs[:1], 1)
        await gs[2].__aexit__(RuntimeError, RuntimeError("TWO"), None)
        await until_left(gs[:1], 2)
        with pytest.raises(GroupBrokenError) as info:
            await sub.all_reduce(np.ones(3))
        text = str(info.value)
        assert "raised RuntimeError: TWO" in text and "ONE" not in text, text


async def test_a_reason_that_cannot_be_sent_as_it_is_still_leaves_cleanly() -> None:
    """An exception whose text holds a lone surrogate (a file name that is not UTF-8) or
    whose ``__str__`` raises: the notice failed to encode inside ``__aexit__``, which
    then raised instead of closing (a review found it)."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no text")

    name = os.fsdecode(b"/data/shard-\xff.bin")
    for exc in (OSError(f"cannot read {name}"), Unprintable()):
        async with groups(2, timeout=20) as gs:
            await gs[1].__aexit__(type(exc), exc, None)
            assert gs[1]._closing
            await until_left(gs[:1], 1)
            with pytest.raises(GroupBrokenError, match=type(exc).__name__):
                await gs[0].all_reduce(np.ones(3))


async def test_an_attributed_error_does_not_repeat_what_its_lead_quotes() -> None:
    """Rank 2 raised in its ``async with`` and left; rank 0 failed for it and sent an
    abort quoting rank 2's goodbye. Rank 1's error read "rank 0 aborted the group: rank 2
    (...): closed its connection (left); also: rank 2 (...): closed its connection
    (left)" (a user's trial): the goodbye is said once."""
    async with groups(3) as gs:
        g = gs[1]
        goodbye = ConnectionBrokenError(
            g.peer_label(2), "closed its connection (left)", graceful=True
        )
        g._failure_log.append(goodbye)
        notice = GroupBrokenError(f"{g.peer_label(0)} aborted the group: {goodbye}")
        g._failure_log.append(notice)
        err = await g._attribute(goodbye)
        assert str(err) == str(notice), err
        g._failure_log.clear()


@pytest.mark.parametrize("where", ["group", "sub-group"])
async def test_a_goodbye_yields_the_lead_to_an_abort_notice(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """World 3: rank 0 cancels its call; rank 2 fails for rank 0's notice and closes, and
    its goodbye reaches rank 1 before rank 0's notice does. Rank 1's error, and the
    broken state its later calls report (on a sub-group's root too), must lead with rank
    0's notice, not with rank 2, which only left (seen in about 1 of 15 runs of a user's
    trial)."""
    from p2pdist.group import runner

    # The notice is let in 0.1 s into the 0.25 s window: under a loaded CI run it came
    # after the window closed (the error then led with rank 2's leaving, as it should
    # when no notice comes in time), once at 0.25 s and once at 1 s, behind the 32 MiB
    # queued before it. The window's length is not what is tested.
    monkeypatch.setattr(runner, "_ATTRIBUTION_WINDOW", 3.0)
    async with groups(3, timeout=20) as gs:
        used = gs if where == "group" else await asyncio.gather(*(g.split(0) for g in gs))
        x = np.ones(8 << 20, np.float32)  # 32 MiB: still in flight when rank 0 cancels
        tasks = [asyncio.create_task(g.all_reduce(x)) for g in used]
        await asyncio.sleep(0.02)
        from_rank_0 = gs[1].connection(0)
        from_rank_0._set_reading(False)  # type: ignore[attr-defined]  # its notice waits
        tasks[0].cancel()
        with pytest.raises(GroupBrokenError, match="was cancelled on rank 0"):
            await asyncio.wait_for(tasks[2], 10)
        await gs[2].close()
        await asyncio.sleep(0.1)  # rank 1 has the goodbye; its attribution window is open
        from_rank_0._set_reading(True)  # type: ignore[attr-defined]
        with pytest.raises(GroupBrokenError) as info:
            await asyncio.wait_for(tasks[1], 10)
        lead = f"{gs[1].peer_label(0)} aborted the group: all_reduce(float32[8388608], op='sum') "
        assert str(info.value).startswith(lead + "was cancelled on rank 0"), info.value
        # Rank 2's leaving comes after, when rank 1 learnt of it first; on a loaded machine
        # rank 1 may have rank 0's notice first after all (about 1 run in 8 under a full
        # test run, before and after 2026-12-06), and then rank 2's leaving is no news.
        also = f"also: {gs[1].peer_label(2)}: closed its connection (left)"
        first = also in str(info.value)
        for group in {id(g): g for g in (used[1], gs[1])}.values():
            with pytest.raises(GroupBrokenError) as later:
                await group.barrier()
            text = str(later.value)
            assert lead + "was cancelled on rank 0" in text, text
            if first:
                assert text.index("was cancelled on rank 0") < text.index("closed its connection")
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]


async def test_a_notice_that_comes_after_the_break_is_read_for_the_attribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1's group broke on rank 2's goodbye; the break wakes its control listeners
    with its error, which ends them. Rank 0's abort notice then came, in the attribution
    window, and stayed queued, unread: the error named rank 2 alone (the test above saw
    that in about 1 run of 12 under CI load and on an idle machine alike). The window now
    ends by reading the notices queued on every connection."""
    from p2pdist.group import runner
    from p2pdist.group.membership import CONTROL_CHANNEL

    monkeypatch.setattr(runner, "_ATTRIBUTION_WINDOW", 0.05)
    async with groups(3) as gs:
        g = gs[1]
        goodbye = ConnectionBrokenError(
            g.peer_label(2), "closed its connection (left)", graceful=True
        )
        g._break(goodbye)
        await asyncio.sleep(0.05)  # the listeners have woken to the break and ended
        gs[0]._break(GroupBrokenError("all_reduce(...) was cancelled on rank 0"), notify=True)
        queued = g.connection(0)._mailbox._queues  # type: ignore[attr-defined]
        for _ in range(500):
            if CONTROL_CHANNEL in queued:  # here, and no listener takes it
                break
            await asyncio.sleep(0.01)
        assert CONTROL_CHANNEL in queued
        err = await g._attribute(goodbye)
        assert isinstance(err, GroupBrokenError), err
        assert str(err).startswith(f"{g.peer_label(0)} aborted the group: all_reduce("), err
        assert str(err).endswith("; also: " + str(goodbye)), err
        with pytest.raises(GroupBrokenError, match="was cancelled on rank 0"):
            await g.barrier()  # the broken state names it too


async def test_a_call_the_others_gave_up_fails_where_it_finishes_late() -> None:
    """Rank 2's event loop is held (its reading stands still) past the others' timeout:
    they give the call up and say so. When rank 2 runs again its call found their parts
    there and returned the result, which they lack (a user's trial: a rank blocked in
    numpy saved a state the others never reached). It fails there too now."""
    async with groups(3, timeout=20) as gs:
        held = [c._transport for c in gs[2]._conns.values()]  # type: ignore[attr-defined]
        for t in held:
            t.pause_reading()
        x = np.ones(3)
        gave_up = await asyncio.gather(
            *(g.all_reduce(x, timeout=0.5) for g in gs[:2]), return_exceptions=True
        )
        assert all(isinstance(e, PeerTimeoutError) for e in gave_up), gave_up
        await asyncio.sleep(0.2)  # their aborts wait unread in rank 2's sockets
        for t in held:
            t.resume_reading()
        # At once, as a loop that runs again finds the call next: its reads take the
        # parts and the aborts behind them.
        with pytest.raises(GroupBrokenError, match="finished on this rank, but too late") as info:
            await gs[2].all_reduce(x)
        assert "timed out" in str(info.value) and gs[2].peer_label(2) in str(info.value)
