"""Point-to-point messages stay matched in order per pair when a recv gives up: a recv that
ends (timeout, cancellation) before any of its message came gives its place back, so the
message is not lost; a message cut short by a timeout is dropped and the error says so."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest
from group_helpers import groups

from p2pdist import PeerTimeoutError
from p2pdist.errors import PeerError
from p2pdist.group import p2p
from p2pdist.transport.mailbox import SPACE_SHIFT
from p2pdist.wire.arrays import ArrayHeader


async def test_a_recv_that_timed_out_before_its_message_came_loses_nothing() -> None:
    async with groups(2, timeout=5.0) as (a, b):
        with pytest.raises(PeerTimeoutError, match="recv got no array"):
            await b.recv(0, timeout=0.1)
        await a.send(np.array([1.0]), 1)
        await a.send(np.array([2.0]), 1)
        assert (await b.recv(0)).tolist() == [1.0]  # the late message is the next one's
        assert (await b.recv(0)).tolist() == [2.0]
        await b.send(np.array([3.0]), 0)  # and both ways still pair up
        assert (await a.recv(1)).tolist() == [3.0]


async def test_a_cancelled_recv_gives_its_place_back() -> None:
    async with groups(2, timeout=5.0) as (a, b):
        waiting = asyncio.create_task(b.recv(0))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(TimeoutError):  # as the user's own wait_for would end it
            await asyncio.wait_for(b.recv(0), 0.05)
        await a.send(np.array([1.0]), 1)
        await a.send(np.array([2.0]), 1)
        assert (await b.recv(0)).tolist() == [1.0]
        assert (await b.recv(0)).tolist() == [2.0]


async def test_given_back_places_are_taken_smallest_first() -> None:
    """Two recvs wait; the first gives up, the second gets the first message; the next
    recv then takes the first one's place and gets the second message."""
    async with groups(2, timeout=5.0) as (a, b):
        first = asyncio.create_task(b.recv(0, timeout=0.1))
        second = asyncio.create_task(b.recv(0))
        with pytest.raises(PeerTimeoutError):
            await first
        await a.send(np.array([1.0]), 1)
        await a.send(np.array([2.0]), 1)
        assert (await asyncio.wait_for(second, 5)).tolist() == [2.0]
        assert (await b.recv(0)).tolist() == [1.0]


async def test_a_message_cut_short_by_a_timeout_is_dropped_and_the_error_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(p2p, "CHUNK", 8)  # an array of 3 float64 travels in 3 frames
    async with groups(2, timeout=5.0) as (a, b):
        arr = np.array([1.0, 2.0, 3.0])
        meta = msgpack.packb([ArrayHeader.of(arr).to_wire(), 3], use_bin_type=True)
        channel = (a._p2p_space << SPACE_SHIFT) | 0
        a._p2p_sent[1] = 1  # the sender's first message: only its first piece goes out
        await a._conns[1].send(channel, arr[:1].tobytes(), meta=meta, seq=0)
        with pytest.raises(PeerTimeoutError, match=r"1 of the 3 pieces .*dropped"):
            await b.recv(0, timeout=2.0)  # the first piece is here long before
        await a.send(np.array([4.0]), 1)
        assert (await b.recv(0)).tolist() == [4.0]  # the next message, in step


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_send_stopped_part_way_fails_the_recv_at_once(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A send that ends after some of its pieces tells the receiver (one more frame), so
    its recv fails at once naming the sender instead of waiting out its timeout."""
    monkeypatch.setattr(p2p, "CHUNK", 8)  # an array of 3 float64 travels in 3 frames
    async with groups(2, timeout=60.0) as (a, b):
        conn: Any = a._conns[1]
        stuck = asyncio.Event()
        drains = 0

        async def stall_before_the_third_piece() -> None:
            nonlocal drains
            drains += 1
            if drains == 3:  # two pieces went out; the pipe never drains for the third
                stuck.set()
                await asyncio.Event().wait()

        conn.drain = stall_before_the_third_piece
        sending = asyncio.ensure_future(
            a.send(np.array([1.0, 2.0, 3.0]), 1, timeout=0.5 if how == "timed out" else 60)
        )
        await stuck.wait()
        if how == "cancelled":
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
        else:
            with pytest.raises(PeerTimeoutError, match="2 of its 3 pieces went out"):
                await sending
        del conn.drain
        with pytest.raises(
            PeerError, match=r"stopped sending float64\[3\] after 2 of its 3"
        ) as err:
            await b.recv(0, timeout=60)
        assert err.value.peer == b.peer_label(0)
        await a.send(np.array([4.0]), 1)
        assert (await b.recv(0, timeout=5)).tolist() == [4.0]  # the next message, in step
        assert a.broken is None and b.broken is None


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_send_stopped_before_it_went_out_is_withdrawn_and_never_received(
    how: str,
) -> None:
    """A send that ends while the peer is not reading (its own timeout, or a cancellation
    such as wait_for's) delivered nothing: sent again, the message arrives once, in its
    place, and the receiver never sees the withdrawn one (real back-pressure: the
    receiver's connection stops reading until 64 MiB wait in the sender's buffers)."""
    async with groups(2, timeout=30.0) as (a, b):
        b_side: Any = b._conns[0]
        b_side._set_reading(False)
        size = 4 << 20  # 32 MiB of float64: more than the kernel's socket buffers hold
        # Handed over without waiting, since the pipe kept up; the next one must wait.
        await asyncio.wait_for(a.send(np.full(size, 1.0), 1), 5)
        second = np.full(size, 2.0)
        if how == "timed out":
            with pytest.raises(PeerTimeoutError, match=r"nothing went out.*sending it again"):
                await a.send(second, 1, timeout=0.2)
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(a.send(second, 1), 0.2)
        b_side._set_reading(True)
        await a.send(second, 1)  # the retry
        await a.send(np.array([4.0]), 1)
        for step in (1.0, 2.0):
            got = await b.recv(0, shape=(size,), dtype=np.float64)
            assert got[0] == got[-1] == step
        assert (await b.recv(0)).tolist() == [4.0]  # no duplicate before it
        with pytest.raises(PeerTimeoutError, match="recv got no array"):
            await b.recv(0, timeout=0.2)
        assert a.broken is None and b.broken is None


async def test_a_recv_waiting_when_a_message_is_withdrawn_gets_the_next_one() -> None:
    """The receiver already waits (its recv took the withdrawn message's place): it skips
    the withdrawal and returns the next message, within its own timeout."""
    async with groups(2, timeout=30.0) as (a, b):
        conn: Any = a._conns[1]
        waiting = asyncio.create_task(b.recv(0, timeout=10))

        async def never_drains() -> None:
            await asyncio.Event().wait()

        conn.drain = never_drains
        with pytest.raises(PeerTimeoutError, match="nothing went out"):
            await a.send(np.array([1.0]), 1, timeout=0.1)
        del conn.drain
        await a.send(np.array([2.0]), 1)
        assert (await waiting).tolist() == [2.0]


async def test_a_send_then_close_delivers_to_a_peer_busy_for_longer_than_the_flush_stall() -> None:
    """A send returns once its message is handed over; a close right after must still
    let it go while the peer is busy (here it reads nothing for 3 s, more than a
    connection's 2 s flush stall): the group gives it its timeout first."""
    async with groups(2, timeout=30.0) as (a, b):
        b_side: Any = b._conns[0]
        b_side._set_reading(False)
        size = 4 << 20  # 32 MiB: more than the socket buffers hold
        await asyncio.wait_for(a.send(np.full(size, 7.0), 1), 5)
        closing = asyncio.create_task(a.close())
        await asyncio.sleep(3.0)
        assert not closing.done()
        b_side._set_reading(True)
        got = await b.recv(0, shape=(size,), dtype=np.float64, timeout=20)
        assert got[0] == got[-1] == 7.0
        await asyncio.wait_for(closing, 20)


async def test_a_send_interrupted_by_a_broken_group_says_why_not_that_it_timed_out() -> None:
    """A collective's timeout breaks the group and interrupts every connection with its
    PeerTimeoutError (a TimeoutError too): the waiting send raised its own "did not go
    out within 30 s ... sending it again is safe" instead, after half a second."""
    async with groups(2, timeout=30.0) as (a, b):
        b._conns[0]._set_reading(False)  # type: ignore[attr-defined]
        await a.send(np.full(4 << 20, 1.0), 1)  # 32 MiB: the link is backed up
        sending = asyncio.create_task(a.send(np.full(10, 2.0), 1, timeout=30))
        await asyncio.sleep(0.05)
        with pytest.raises(PeerTimeoutError, match="barrier"):
            await a.barrier(timeout=0.5)  # rank 1 never joins
        with pytest.raises(PeerTimeoutError) as info:
            await asyncio.wait_for(sending, 10)
        assert "barrier" in str(info.value) and "sending it again" not in str(info.value)
