"""BufferPool: large receive buffers are handed out again only once nothing refers to them."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np

from p2pdist.wire.bufpool import BufferPool
from p2pdist.wire.frames import HEADER, FrameDecoder, FrameKind, FrameLimits, encode_header

LIMITS = FrameLimits(max_meta=512, max_payload=1 << 20, direct_threshold=256)


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def test_take_gives_exactly_the_size_asked_for_writable() -> None:
    pool = BufferPool()
    for n in (1, 1000, 4096, 70_000):
        view = pool.take(n)
        assert view.nbytes == n and not view.readonly and view.format == "B"
        view[:] = b"\x01" * n


def test_a_buffer_comes_back_only_when_nothing_refers_to_it() -> None:
    pool = BufferPool()
    first = pool.take(5000)
    where = address(first)
    kept = np.frombuffer(first, np.uint8)  # an array made from it keeps it busy
    del first
    second = pool.take(5000)
    assert address(second) != where
    second_at = address(second)
    del kept
    gc.collect()
    third = pool.take(6000)  # same power-of-two class (8 KiB): the first buffer again
    assert address(third) == where
    part = third[10:20]  # a slice of a view keeps it busy as well
    del third
    fourth = pool.take(5000)  # ``second`` and ``part`` hold the two kept buffers
    assert address(fourth) not in (where, second_at)
    assert address(second) == second_at and part.nbytes == 10


def test_pool_keeps_at_most_max_bytes() -> None:
    pool = BufferPool(max_bytes=3 * 4096)
    views = [pool.take(4096) for _ in range(5)]  # all busy at once
    assert pool.held_bytes == 3 * 4096
    assert len({address(v) for v in views}) == 5  # no two share memory
    newest = {address(v) for v in views[2:]}  # the pool let the two oldest go
    del views
    again = [pool.take(4096) for _ in range(3)]
    assert pool.held_bytes == 3 * 4096
    assert len({address(v) for v in again}) == 3
    assert {address(v) for v in again} == newest


def test_a_receiver_that_keeps_its_buffers_does_not_stop_the_pool() -> None:
    """Buffers a receiver holds on to (a ``recv`` result is a view of one) are let go by
    the pool, oldest first, and stay intact; the pool goes on handing out buffers it
    keeps, so the next messages still reuse memory."""
    pool = BufferPool(max_bytes=2 * 4096)
    held = [pool.take(4096) for _ in range(4)]  # the receiver keeps all of them
    for i, v in enumerate(held):
        v[:] = bytes([i]) * 4096
    assert pool.held_bytes == 2 * 4096
    later = pool.take(4096)
    where = address(later)
    del later
    assert address(pool.take(4096)) == where  # kept and handed out again
    assert [bytes(v[:1]) for v in held] == [b"\x00", b"\x01", b"\x02", b"\x03"]


def test_a_new_size_takes_the_room_of_idle_buffers_of_another() -> None:
    """Message sizes that change (plain and compressed rings taking turns) do not leave
    the pool full of the first size: idle buffers of another size make room before any
    busy one is let go."""
    pool = BufferPool(max_bytes=4 * 4096)
    big = [pool.take(8192) for _ in range(2)]  # full: two 8 KiB buffers
    busy = big[0]
    del big  # the second one is idle now
    small = pool.take(3000)  # it makes room for a kept 4 KiB buffer
    assert small.obj.nbytes == 4096 and pool.held_bytes == 8192 + 4096
    where = address(small)
    del small
    assert address(pool.take(3000)) == where  # kept, so handed out again
    fill = [pool.take(3000) for _ in range(2)]  # 8 + 4 + 4 KiB: full again
    assert pool.held_bytes == 4 * 4096
    del fill  # two idle 4 KiB buffers
    second = pool.take(6000)  # they make room for a second 8 KiB buffer; ``busy`` stays
    assert second.obj.nbytes == 8192 and pool.held_bytes == 2 * 8192
    assert address(second) != address(busy)
    again = address(second)
    del second
    assert address(pool.take(6000)) == again  # kept
    held = pool.take(6000)
    lone = pool.take(3000)  # nothing idle: the oldest busy buffer (``busy``) is let go
    assert lone.obj.nbytes == 4096 and pool.held_bytes == 8192 + 4096
    assert address(busy) != address(held)
    busy[:4] = b"kept"
    del lone
    assert address(pool.take(3000)) not in (address(busy), address(held))
    assert bytes(busy[:4]) == b"kept"  # still the holder's, untouched


def frame_bytes(payload: bytes, seq: int) -> bytes:
    header = encode_header(FrameKind.DATA, 1, seq, b"", len(payload), limits=LIMITS)
    return header + payload


def test_decoder_reuses_a_payload_buffer_once_the_receiver_let_it_go() -> None:
    """A received large payload that the receiver still holds is never overwritten by
    the next one; once dropped, its buffer receives a later payload (no fresh pages)."""
    dec = FrameDecoder(LIMITS)
    head = HEADER.size + 10  # header and a little payload in the first read, the rest in place
    a, b, c = (bytes([i]) * 50_000 for i in (1, 2, 3))
    dec.feed(frame_bytes(a, 0)[:head])
    (fa,) = dec.feed(frame_bytes(a, 0)[head:])
    dec.feed(frame_bytes(b, 1)[:head])
    (fb,) = dec.feed(frame_bytes(b, 1)[head:])
    assert bytes(fa.payload) == a and bytes(fb.payload) == b
    assert address(fa.payload) != address(fb.payload)
    where = address(fa.payload)
    del fa
    dec.feed(frame_bytes(c, 2)[:head])
    (fc,) = dec.feed(frame_bytes(c, 2)[head:])
    assert bytes(fc.payload) == c and address(fc.payload) == where
    assert bytes(fb.payload) == b


def test_buffers_the_pool_does_not_keep_are_exactly_the_size_asked_for() -> None:
    """A buffer beyond ``max_bytes`` is not rounded up: a caller that keeps it (a received
    array) holds no more memory than it asked for."""
    pool = BufferPool(max_bytes=8192)
    kept = pool.take(5000)
    extra = pool.take(9000)  # over max_bytes once rounded up: never kept
    assert kept.obj.nbytes == 8192 and extra.obj.nbytes == 9000
    assert pool.held_bytes == 8192
    assert 16384 not in pool._classes  # no empty size class left behind


def test_a_tracer_does_not_change_the_free_count() -> None:
    """The free count is measured the same with a tracer that reads ``f_locals`` (pdb,
    debugpy) as without one: on CPython 3.11-3.12 such a tracer copies a frame's locals
    into a dict that holds references, which made a count taken from a loop variable one
    too high, so that a busy buffer could later look free. Run in a fresh interpreter so
    that the tracer cannot disturb this one."""
    script = """
import sys
from p2pdist.wire import bufpool
def tracer(frame, event, arg):
    frame.f_locals
    return tracer
plain = bufpool._free_refs()
sys.settrace(tracer)
traced = bufpool._free_refs()
sys.settrace(None)
print(plain, traced, bufpool._FREE_REFS)
"""
    run = [sys.executable, "-c", script]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plain, traced, used = proc.stdout.split()
    assert plain == traced == used, proc.stdout + proc.stderr
