"""Collectives on CuPy arrays: real groups over loopback, results on the device.

Every test runs twice: on tests/fakecupy.py (numpy memory behind CuPy's interface, so the
staging logic runs everywhere, CI included) and on real CuPy where a GPU is (skipped, with
the reason, elsewhere).
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import fakecupy
import numpy as np
import pytest
from group_helpers import groups
from transport_conformance import bounded

from p2pdist import GradientBuckets, P2PError, P2PTimeoutError, UsageError
from p2pdist.group import devices as devices_module


def _real_cupy() -> ModuleType | None:
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy  # type: ignore[no-any-return, unused-ignore]
    except Exception:
        return None


@pytest.fixture(params=["fake", "cupy"])
def xp(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The array module: the stand-in (as ``cupy`` in sys.modules), or real CuPy."""
    if request.param == "fake":
        monkeypatch.setitem(sys.modules, "cupy", fakecupy)
        yield fakecupy
        return
    cupy = _real_cupy()
    if cupy is None:
        pytest.skip("CuPy with a CUDA device is not available here")
    yield cupy


@pytest.fixture(autouse=True)
def no_late_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test ends with no copy held back and, on the stand-in, none that ran into
    a freed page-locked buffer (a GPU would have written another call's memory)."""
    monkeypatch.setattr(fakecupy, "faults", [])
    monkeypatch.setattr(devices_module, "_late", [])
    yield
    for stream in list(fakecupy.made_streams):  # the default ones and a test's own
        stream.release()
        stream.synchronize()
    devices_module._forget_landed()
    assert devices_module._late == []
    assert fakecupy.faults == []


def host(a: Any) -> np.ndarray:
    """A device array's values on the host."""
    assert type(a).__module__ == "cupy" or type(a).__module__.startswith("cupy."), type(a)
    return np.asarray(a.get())


def inputs(n: int, shape: tuple[int, ...], dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


async def test_all_reduce_returns_device_arrays(xp: Any) -> None:
    xs = inputs(3, (5, 40_000))  # above small_bytes: the ring
    small = inputs(3, (17,))  # the direct path
    async with groups(3) as gs:
        dev = [xp.asarray(x) for x in xs]
        out = await asyncio.gather(*(g.all_reduce(d) for g, d in zip(gs, dev, strict=True)))
        for r in out:
            np.testing.assert_allclose(host(r), sum(xs), rtol=1e-5, atol=1e-5)
        # out= the input itself: filled in place, and returned
        sdev = [xp.asarray(x) for x in small]
        got = await asyncio.gather(
            *(g.all_reduce(d, "max", out=d) for g, d in zip(gs, sdev, strict=True))
        )
        for d, r in zip(sdev, got, strict=True):
            assert r is d
            np.testing.assert_array_equal(host(d), np.maximum.reduce(small))
        mean = await asyncio.gather(
            *(g.all_reduce(d, "mean", mode="deterministic") for g, d in zip(gs, dev, strict=True))
        )
        ref = (xs[0].astype(np.float64) + xs[1] + xs[2]) / 3
        for r in mean:
            np.testing.assert_array_equal(host(r), ref.astype(np.float32))


async def test_compressed_all_reduce_on_device(xp: Any) -> None:
    xs = inputs(2, (300_000,))
    async with groups(2) as gs:
        dev = [xp.asarray(x) for x in xs]
        out = await asyncio.gather(
            *(g.all_reduce(d, wire_dtype="bfloat16") for g, d in zip(gs, dev, strict=True))
        )
    ref = xs[0] + xs[1]
    for r in out:
        err = np.linalg.norm(host(r) - ref) / np.linalg.norm(ref)
        assert err < 1e-2, err


async def test_rooted_and_gathering_collectives(xp: Any) -> None:
    xs = inputs(3, (4, 6))
    async with groups(3) as gs:
        dev = [xp.asarray(x) for x in xs]
        gathered = await asyncio.gather(*(g.all_gather(d) for g, d in zip(gs, dev, strict=True)))
        for r in gathered:
            np.testing.assert_array_equal(host(r), np.stack(xs))
        bcast = await asyncio.gather(*(g.broadcast(d, src=1) for g, d in zip(gs, dev, strict=True)))
        for r in bcast:
            np.testing.assert_array_equal(host(r), xs[1])
        reduced = await asyncio.gather(*(g.reduce(d, dst=2) for g, d in zip(gs, dev, strict=True)))
        assert reduced[0] is None and reduced[1] is None
        np.testing.assert_allclose(host(reduced[2]), sum(xs), rtol=1e-6)
        at_root = await asyncio.gather(*(g.gather(d, dst=0) for g, d in zip(gs, dev, strict=True)))
        np.testing.assert_array_equal(host(at_root[0]), np.stack(xs))
        assert at_root[1] is None
        rs = await asyncio.gather(*(g.reduce_scatter(xp.asarray(np.stack(xs))) for g in gs))
        for rank, r in enumerate(rs):  # every rank passed the same stack: 3 times it
            np.testing.assert_allclose(host(r), 3 * np.stack(xs)[rank : rank + 1], rtol=1e-5)


async def test_scatter_and_all_to_all(xp: Any) -> None:
    rows = np.arange(3 * 5, dtype=np.int64).reshape(3, 5)
    async with groups(3) as gs:
        like = xp.asarray(np.zeros(5, np.int64))
        got = await asyncio.gather(
            gs[0].scatter(xp.asarray(rows), src=0),
            *(g.scatter(None, src=0, like=like) for g in gs[1:]),
        )
        for rank, r in enumerate(got):
            np.testing.assert_array_equal(host(r), rows[rank])
        mats = [xp.asarray(rows + 100 * r) for r in range(3)]
        a2a = await asyncio.gather(*(g.all_to_all(m) for g, m in zip(gs, mats, strict=True)))
        for rank, r in enumerate(a2a):
            np.testing.assert_array_equal(
                host(r), np.stack([rows[rank] + 100 * p for p in range(3)])
            )
        # all_to_all_v: rank r sends p rows of r to rank p (zero rows to rank 0)
        sends = [[xp.asarray(np.full((p, 2), r, np.float32)) for p in range(3)] for r in range(3)]
        a2av = await asyncio.gather(*(g.all_to_all_v(s) for g, s in zip(gs, sends, strict=True)))
        for rank, parts in enumerate(a2av):
            assert len(parts) == 3
            for p, part in enumerate(parts):
                np.testing.assert_array_equal(host(part), np.full((rank, 2), p, np.float32))
        # A generator of device pieces is not staged (only lists and tuples are): said so.
        with pytest.raises(UsageError, match="as a list or tuple"):
            await gs[0].all_to_all_v(iter(sends[0]))


async def test_send_recv_with_device_buffers(xp: Any) -> None:
    x = np.linspace(0, 1, 1000, dtype=np.float32).reshape(10, 100)
    async with groups(2) as gs:
        dev = xp.asarray(x)
        _, got = await asyncio.gather(gs[0].send(dev, 1), gs[1].recv(0, like=dev))
        np.testing.assert_array_equal(host(got), x)
        out = xp.asarray(np.zeros_like(x))
        _, filled = await asyncio.gather(gs[0].send(dev, 1), gs[1].recv(0, out=out))
        assert filled is out
        np.testing.assert_array_equal(host(out), x)


async def test_gradient_buckets_reduce_device_arrays_in_place(xp: Any) -> None:
    shapes = [(3, 4), (1000,), (7,), (20, 20)]
    async with groups(2) as gs:
        grads = [[xp.asarray(np.full(s, r + 1, np.float32)) for s in shapes] for r in range(2)]
        host_grad = [[np.full(shapes[0], 10, np.float32)] for _ in range(2)]

        async def step(g: Any, arrays: list[Any], extra: list[np.ndarray]) -> None:
            async with await GradientBuckets.create(g, bucket_bytes=2048, op="sum") as b:
                for a in arrays:
                    b.add(a)
                for a in extra:  # numpy and CuPy arrays in one bucket
                    b.add(a)
                await b.wait()

        await asyncio.gather(*(step(g, a, h) for g, a, h in zip(gs, grads, host_grad, strict=True)))
    for arrays in grads:
        for a, s in zip(arrays, shapes, strict=True):
            np.testing.assert_array_equal(host(a), np.full(s, 3, np.float32))
    for (h,) in host_grad:
        np.testing.assert_array_equal(h, np.full(shapes[0], 20, np.float32))


async def test_bad_device_arguments_are_refused(xp: Any) -> None:
    async with groups(2) as gs:
        strided = xp.asarray(np.zeros((4, 4), np.float32)).T
        with pytest.raises(UsageError, match="C-contiguous"):
            await gs[0].all_reduce(xp.asarray(np.zeros((4, 4), np.float32)), out=strided)

        class Tensor:  # a CUDA array of another library
            @property
            def __cuda_array_interface__(self) -> dict[str, Any]:
                return {}

        with pytest.raises(UsageError, match="not a CuPy one"):
            await gs[0].all_reduce(Tensor())  # type: ignore[arg-type]
        # the refused calls sent nothing: the group still works
        ones = [xp.asarray(np.ones(3, np.float32)) for _ in gs]
        out = await asyncio.gather(*(g.all_reduce(o) for g, o in zip(gs, ones, strict=True)))
        for r in out:
            np.testing.assert_array_equal(host(r), np.full(3, 2, np.float32))


async def test_in_place_call_copies_once_each_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """all_reduce(x, out=x) on the device: one copy to the host, the reduction in place
    there, one copy back (counted by the stand-in)."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    xs = inputs(2, (100_000,))
    async with groups(2) as gs:
        dev = [fakecupy.asarray(x) for x in xs]
        counts = {"to_host": 0, "to_device": 0, "from_pageable": 0}
        monkeypatch.setattr(fakecupy, "copies", counts)
        await asyncio.gather(*(g.all_reduce(d, out=d) for g, d in zip(gs, dev, strict=True)))
        assert fakecupy.copies == {"to_host": 2, "to_device": 2, "from_pageable": 0}
        for d in dev:  # already on the device (the queued copy waited for), not pending
            np.testing.assert_allclose(fakecupy.to_numpy(d), xs[0] + xs[1], rtol=1e-6)
        fresh = await asyncio.gather(*(g.broadcast(d) for g, d in zip(gs, dev, strict=True)))
        # A new result goes through page-locked memory too: a copy from pageable memory
        # waits for the stream's earlier work before it is queued, holding the loop.
        assert fakecupy.copies == {"to_host": 4, "to_device": 4, "from_pageable": 0}
    for r in (*dev, *fresh):
        np.testing.assert_allclose(host(r), xs[0] + xs[1], rtol=1e-6)


async def test_back_to_back_calls_keep_their_results(xp: Any) -> None:
    """Each call's result has landed before the next call reuses the staging memory
    (pinned blocks of one size come back from the pool at once)."""
    n = 1 << 20
    async with groups(2) as gs:
        bufs = [xp.asarray(np.zeros(n, np.float32)) for _ in range(6)]
        for i, buf in enumerate(bufs):
            src = xp.asarray(np.full(n, float(i), np.float32))
            await asyncio.gather(gs[0].send(src, 1), gs[1].recv(0, out=buf))
        for i, buf in enumerate(bufs):
            np.testing.assert_array_equal(host(buf), np.full(n, float(i), np.float32))


async def test_numpy_out_device_results_and_plain_recv(xp: Any) -> None:
    """A numpy out= with a CuPy input is filled and returned as it is; a recv with
    neither like= nor out= gives numpy (nothing says where the result should live)."""
    xs = inputs(2, (50,))
    async with groups(2) as gs:
        dev = [xp.asarray(x) for x in xs]
        outs = [np.empty(50, np.float32) for _ in gs]
        got = await asyncio.gather(
            *(g.all_reduce(d, out=o) for g, d, o in zip(gs, dev, outs, strict=True))
        )
        for o, r in zip(outs, got, strict=True):
            assert r is o
            np.testing.assert_allclose(o, xs[0] + xs[1], rtol=1e-6)
        _, plain = await asyncio.gather(gs[0].send(dev[0], 1), gs[1].recv(0))
        assert isinstance(plain, np.ndarray)
        np.testing.assert_array_equal(plain, xs[0])


async def test_results_go_to_the_inputs_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An input on device 1 (device 0 current) gets its result on device 1, and a CuPy
    out= on another device is filled there (the stand-in has any number of devices)."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    xs = inputs(2, (64,))
    async with groups(2) as gs:
        with fakecupy.cuda.Device(1):
            dev = [fakecupy.asarray(x) for x in xs]
        got = await asyncio.gather(*(g.all_reduce(d) for g, d in zip(gs, dev, strict=True)))
        assert all(r.device.id == 1 for r in got)
        with fakecupy.cuda.Device(2):
            outs = [fakecupy.empty(64, np.float32) for _ in gs]
        filled = await asyncio.gather(
            *(g.all_reduce(d, out=o) for g, d, o in zip(gs, dev, outs, strict=True))
        )
    for r in (*got, *filled):
        np.testing.assert_allclose(fakecupy.to_numpy(r), xs[0] + xs[1], rtol=1e-6)
    assert [r.device.id for r in filled] == [2, 2]


async def test_buckets_read_arrays_as_queued_when_added(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gradient whose last write is still queued on the caller's stream when it is
    added is read after that write (the bucket waits for the point of add(), not for
    whatever stream is current when it runs)."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    async with groups(2) as gs:
        grads = [fakecupy.empty(1000, np.float32) for _ in gs]

        async def step(g: Any, grad: Any, value: float) -> None:
            async with await GradientBuckets.create(g, bucket_bytes=1 << 20, op="sum") as b:
                grad.set(np.full(1000, value, np.float32))  # queued, not landed yet
                b.add(grad)
                await b.wait()

        await asyncio.gather(
            *(step(g, a, r + 1.0) for r, (g, a) in enumerate(zip(gs, grads, strict=True)))
        )
    for grad in grads:
        np.testing.assert_array_equal(fakecupy.to_numpy(grad), np.full(1000, 3, np.float32))


async def test_a_call_waits_on_the_stream_current_when_it_was_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collective made inside ``with stream:`` as a task and awaited after the block:
    its input was read on whatever stream was current when the task first ran, before
    the caller's queued write to it landed (0 where the sum is 3: an audit). The
    streams are those current when the call was made, as docs/collectives.md says."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    async with groups(2) as gs:
        xs = [fakecupy.empty(8, np.float32) for _ in gs]
        calls = []
        for r, (g, x) in enumerate(zip(gs, xs, strict=True)):
            with fakecupy.Stream() as stream:  # the caller's own stream
                x.set(np.full(8, r + 1, np.float32), stream=stream)  # queued on it
                calls.append(asyncio.ensure_future(g.all_reduce(x)))
        outs = await asyncio.gather(*calls)
    for out in outs:
        np.testing.assert_array_equal(fakecupy.to_numpy(out), np.full(8, 3, np.float32))


def test_numpy_calls_do_not_stage() -> None:
    """A numpy call is passed straight through: no CuPy import, no copies."""
    from p2pdist.group.devices import _staged

    assert not _staged((np.zeros(3), "sum"), {"out": None, "timeout": 1.0})
    assert not _staged(([np.zeros(3)],), {})
    assert _staged(([np.zeros(3), fakecupy.asarray(np.zeros(3))],), {})


async def test_a_federated_client_submits_a_device_update(xp: Any) -> None:
    from p2pdist import TransportConfig
    from p2pdist.federated import Coordinator, FederatedClient, FederatedConfig

    plain = TransportConfig(tls=False)
    config = FederatedConfig(round_timeout=30.0)
    async with Coordinator(np.zeros(6, np.float32), config, transport=plain) as c:
        await c.start(listen="127.0.0.1:0")
        assert c.address is not None
        where = f"{c.address[0]}:{c.address[1]}"
        client = FederatedClient(c.endpoint_id, address=where, transport=plain)
        await client.connect()
        run = asyncio.create_task(c.run_round())
        update = xp.asarray(np.arange(6, dtype=np.float32))
        assert await client.submit(update, 5, 0)
        assert (await client.wait_ack(1, timeout=10)).accepted
        out = await run
        np.testing.assert_array_equal(out.aggregate, np.arange(6, dtype=np.float32))
        await client.close()


async def test_host_copy_refuses_another_librarys_cuda_array() -> None:
    from p2pdist.group.devices import host_copy_async

    class Foreign:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {"shape": (1,), "typestr": "<f4"}

    with pytest.raises(UsageError, match=r"cupy\.asarray"):
        await host_copy_async(Foreign(), 5.0)
    x = np.ones(3)
    assert await host_copy_async(x, 5.0) is x


async def test_an_update_copied_off_the_gpu_leaves_the_event_loop_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A federated update's copy to the host was a blocking get: polled now, bounded."""
    from p2pdist.group.devices import host_copy_async

    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    update = fakecupy.asarray(np.arange(6, dtype=np.float32))
    stream = fakecupy.cuda.get_current_stream()
    stream.hold()
    try:
        with pytest.raises(P2PTimeoutError, match="the GPU copy of an update did not finish"):
            await host_copy_async(update, 0.2)
        copying = asyncio.ensure_future(host_copy_async(update, 30.0))
        await asyncio.sleep(0.05)
        assert not copying.done()
    finally:
        stream.release()
    got = await bounded(copying, "the copy")
    assert type(got) is np.ndarray and np.array_equal(got, np.arange(6, dtype=np.float32))


async def test_group_averaging_takes_device_updates(xp: Any) -> None:
    from group_helpers import groups

    from p2pdist.federated import FederatedConfig, GroupAveraging

    async with groups(2) as gs:
        feds = [
            GroupAveraging(g, np.zeros(4, np.float32), FederatedConfig(round_timeout=10.0))
            for g in gs
        ]
        await asyncio.gather(*(f.start() for f in feds))
        updates = [np.full(4, 1.0, np.float32), np.full(4, 4.0, np.float32)]
        outs = await asyncio.gather(
            *(f.step(xp.asarray(updates[f.group.rank]), 1 + 2 * f.group.rank) for f in feds)
        )
        assert all(o.applied for o in outs)
        for f in feds:  # weights 1 and 3: (1 + 12) / 4
            np.testing.assert_array_equal(f.model, np.full(4, 3.25, np.float32))


async def test_unpack_writes_into_strided_host_arrays() -> None:
    """unpack wrote a host array through reshape(-1), a copy for a strided array: the
    values were lost without an error (GradientBuckets refuses those; unpack alone not)."""
    from p2pdist.group.devices import pack, unpack

    base = np.zeros((4, 6), np.float32)
    strided, plain = base[:, :3], np.zeros(5, np.float32)  # rows with gaps: no flat view
    flat = np.arange(strided.size + plain.size, dtype=np.float32)
    await unpack(flat, [strided, plain], 5.0)
    assert np.array_equal(strided.ravel(), flat[:12]) and np.array_equal(plain, flat[12:])
    again = np.empty_like(flat)
    await pack([strided, plain], again, 5.0)
    assert np.array_equal(again, flat)


async def test_device_copies_leave_the_event_loop_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging copies waited for the caller's stream with the event loop held (a
    blocking get, then synchronize): a long kernel stalled every other collective and
    keepalive of the rank. They are queued and polled now; the stand-in's held stream
    refuses a blocking wait, as it would hold the loop."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    xs = inputs(2, (50_000,))
    stream = fakecupy.cuda.get_current_stream()
    async with groups(2) as gs:
        dev = [fakecupy.asarray(x) for x in xs]
        stream.hold()  # a long kernel on the caller's stream
        try:
            calls = [
                asyncio.ensure_future(g.all_reduce(d, out=d)) for g, d in zip(gs, dev, strict=True)
            ]
            await asyncio.sleep(0.2)  # the loop goes on meanwhile; the calls wait
            assert not any(c.done() for c in calls), [c for c in calls if c.done()]
        finally:
            stream.release()
        await bounded(asyncio.gather(*calls), "the calls, once the kernel is done")
        for d in dev:
            np.testing.assert_allclose(fakecupy.to_numpy(d), xs[0] + xs[1], rtol=1e-6)


async def test_gpu_work_that_does_not_finish_times_out_and_the_group_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """timeout= bounds the wait for the copies (it did not: a blocking wait); a call
    that gave up before its collective began leaves the group usable."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    xs = inputs(2, (100,))
    stream = fakecupy.cuda.get_current_stream()
    async with groups(2) as gs:
        dev = [fakecupy.asarray(x) for x in xs]
        stream.hold()
        try:
            late = await asyncio.gather(
                *(g.all_reduce(d, timeout=0.3) for g, d in zip(gs, dev, strict=True)),
                return_exceptions=True,
            )
        finally:
            stream.release()
        for err in late:
            assert isinstance(err, P2PTimeoutError), err
            assert "the GPU copies of a collective did not finish within 0.3 s" in str(err)
        # The staging buffers the late copies write stay out of the pinned pool until
        # those copies have landed (the fixture checks they did, into live buffers).
        assert len(devices_module._late) == 2
        again = await asyncio.gather(*(g.all_reduce(d) for g, d in zip(gs, dev, strict=True)))
        assert devices_module._late == []
        for r in again:
            np.testing.assert_allclose(host(r), xs[0] + xs[1], rtol=1e-6)


async def test_bucket_copies_leave_the_event_loop_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """GradientBuckets' pack and unpack copies ran on the current stream with blocking
    waits: polled now, as the wait for the point of add() was."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    stream = fakecupy.cuda.get_current_stream()
    async with groups(2) as gs:
        grads = [fakecupy.asarray(np.full(1000, r + 1.0, np.float32)) for r in range(2)]
        bs = await asyncio.gather(*(GradientBuckets.create(g, op="sum") for g in gs))
        stream.hold()
        try:
            for b, grad in zip(bs, grads, strict=True):
                b.add(grad)  # after the long kernel: the bucket waits for it
            waits = [asyncio.ensure_future(b.wait()) for b in bs]
            await asyncio.sleep(0.2)
            assert not any(w.done() for w in waits)
        finally:
            stream.release()
        await bounded(asyncio.gather(*waits), "the buckets, once the stream is free")
        for b in bs:
            await b.close()
    for grad in grads:
        np.testing.assert_array_equal(fakecupy.to_numpy(grad), np.full(1000, 3, np.float32))


async def test_a_cancelled_or_refused_call_keeps_its_buffers_until_its_copies_land(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a timed-out wait held its page-locked buffers: a call cancelled while its
    copies were queued, or one refusing a later argument after queueing an earlier
    one's copy, let them go back to CuPy's pool with the GPU still writing them (the
    next call's staging would take that late copy)."""

    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    monkeypatch.setattr(fakecupy, "faults", [])
    xs = inputs(2, (1000,))
    stream = fakecupy.cuda.get_current_stream()

    class Foreign:
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {"shape": (1000,), "typestr": "<f4"}

    async with groups(2) as gs:
        dev = [fakecupy.asarray(x) for x in xs]
        stream.hold()
        try:
            first, second = (
                asyncio.ensure_future(g.all_reduce(d)) for g, d in zip(gs, dev, strict=True)
            )
            await asyncio.sleep(0.05)
            first.cancel()
            await asyncio.wait([first])
            del first  # the task, and with it its frames: only _late may hold the buffers
            with pytest.raises(UsageError, match=r"cupy\.asarray"):  # x's copy was queued
                await gs[0].all_reduce(dev[0], out=Foreign())
            gc.collect()
        finally:
            stream.release()
        stream.synchronize()
        assert fakecupy.faults == []
        # The other rank's call goes on once its copy lands, and is told of the gap.
        with pytest.raises(P2PError, match="cancelled before it started"):
            await bounded(second, "rank 1's call")
        again = await asyncio.gather(*(g.all_reduce(d) for g, d in zip(gs, dev, strict=True)))
        for r in again:
            np.testing.assert_allclose(host(r), xs[0] + xs[1], rtol=1e-6)


async def test_bucket_copies_that_fail_part_way_keep_their_buffers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pack and unpack queue copies array by array: one failing after others were
    queued (no page-locked memory, a device copy refused) keeps the queued copies'
    buffers until they land (the fixture checks no copy ran into a freed one)."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    stream = fakecupy.cuda.get_current_stream()
    arrays = [fakecupy.asarray(np.full(100, i, np.float32)) for i in range(3)]
    mixed = [arrays[0], np.ones(5, np.float32), arrays[1]]  # the path copying each array
    pinned, made = devices_module._pinned, []

    def second_fails(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        made.append(shape)
        if len(made) == 2:
            raise MemoryError("no page-locked memory")
        return pinned(shape, dtype)

    stream.hold()
    with monkeypatch.context() as m:
        m.setattr(devices_module, "_pinned", second_fails)
        out = devices_module.pinned_array(205, np.dtype(np.float32))
        with pytest.raises(MemoryError):
            await devices_module.pack(mixed, out, 5.0)
    flat = devices_module.pinned_array(300, np.dtype(np.float32))
    flat[...] = 7.0

    def refused(self: Any, key: Any, value: Any) -> None:
        raise ValueError("a device copy refused")

    with monkeypatch.context() as m:
        m.setattr(fakecupy.ndarray, "__setitem__", refused)
        with pytest.raises(ValueError, match="refused"):
            await devices_module.unpack(flat, arrays, 5.0)
    del flat
    gc.collect()
    stream.release()


async def test_the_same_array_twice_is_staged_once_and_its_buffer_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """all_to_all_v([d, d]) made two copies of d, and the first one's buffer was not among
    the call's: a wait that ended early let it go back to the pool with its copy queued
    (the fixture checks no copy ran into a freed buffer)."""
    monkeypatch.setitem(sys.modules, "cupy", fakecupy)
    stream = fakecupy.cuda.get_current_stream()
    async with groups(2) as gs:
        dev = fakecupy.asarray(np.arange(4, dtype=np.float32))
        counts = {"to_host": 0, "to_device": 0, "from_pageable": 0}
        monkeypatch.setattr(fakecupy, "copies", counts)
        stream.hold()
        try:
            late = await asyncio.gather(
                *(g.all_to_all_v([dev, dev], timeout=0.3) for g in gs), return_exceptions=True
            )
        finally:
            stream.release()
        assert all(isinstance(err, P2PTimeoutError) for err in late), late
        assert counts["to_host"] == 2  # one copy per rank, not two
        gc.collect()
