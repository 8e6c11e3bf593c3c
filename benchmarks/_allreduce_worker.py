"""Worker processes for ``benchmarks/allreduce.py``.

Each worker is started as ``python benchmarks/_allreduce_worker.py CONFIG_JSON`` by the
driver, runs one role, and writes a JSON result file named in the config. Roles:

``tcp-recv`` / ``tcp-send``
    Raw loopback TCP bandwidth with plain blocking sockets, one direction.
``tcp-duplex``
    The same both ways at once: each end sends from a thread while it receives.
``exchange``
    The floor under a small world-2 all-reduce in Python: two processes swap ``size``
    bytes over one loopback TCP connection and add what they receive in place, with
    blocking sockets or on an event loop, and no library in between.
``gloo``
    One rank of a torch.distributed Gloo all-reduce sweep.
``p2pdist``
    One rank of a p2pdist ``Group.all_reduce`` sweep (TLS or plaintext), on asyncio's
    event loop or uvloop.

The all-reduce roles note when each call starts and how long it takes
(:func:`time.perf_counter`, after a barrier); the driver lines the ranks' calls up.
Before every call, outside the timer, rank r refills its input with ``base + r + 1``
(``base``: 0..12 repeating, so that every sum is a small integer, exact in float32,
float16 and bfloat16 while it stays within their integer range; an odd period, so that a
chunk summed into or returned at the wrong place, whose offsets are multiples of 2^k
elements, changes the result); after every timed call, outside the timer, it checks the
whole result against the exact sum (within :data:`LOOSE` where the wire cannot carry it
exactly: int8, or sums beyond a 16-bit wire's exact integers). An untimed barrier then
lines the ranks up before the next timed call: a rank that finished its check early
would otherwise start its timer while the others still refill and check, and time their
work as its wait.
"""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

#: Chunk size for the raw TCP bandwidth measurement.
TCP_CHUNK = 4 << 20


BARRIER_ITERS = 200


PERIOD = 13
"""The input pattern's period: ``base[k] = k % PERIOD`` (odd: see the module docstring)."""
EXACT_UP_TO = {"float16": 2048, "bfloat16": 256}
"""Wire dtypes and the largest integer up to which they hold every integer exactly."""
LOOSE = 5e-2
"""Largest error of an inexact (compressed) sum, relative to the largest expected value."""


def base_pattern(n: int) -> np.ndarray[Any, Any]:
    """``n`` float32 values 0, 1, ..., PERIOD-1, 0, 1, ...: rank r sums ``base + r + 1``."""
    return (np.arange(n) % PERIOD).astype(np.float32)


def expected_sum(base: np.ndarray[Any, Any], world: int) -> np.ndarray[Any, Any]:
    """The exact all-reduce sum of ``base + r + 1`` over ranks r = 0..world-1."""
    return (base * world + world * (world + 1) // 2).astype(np.float32)


def tolerance(world: int, reduce_kwargs: dict[str, Any]) -> float:
    """0 when the sum must be exact (plain, deterministic, a 16-bit wire whose integers
    hold every partial sum), else :data:`LOOSE`."""
    wire = reduce_kwargs.get("wire_dtype")
    largest = (PERIOD - 1) * world + world * (world + 1) // 2
    return 0.0 if wire is None or largest <= EXACT_UP_TO.get(wire, 0) else LOOSE


def check(got: np.ndarray[Any, Any], expected: np.ndarray[Any, Any], tol: float, what: str) -> None:
    """Raise unless ``got`` equals ``expected`` (within ``tol`` times its largest value)."""
    if tol == 0:
        if np.array_equal(got, expected):
            return
        bad = int(np.argmax(got != expected))
    else:
        err = np.abs(got - expected)
        bad = int(np.argmax(err))
        if err[bad] <= tol * float(expected.max()):
            return
    raise AssertionError(
        f"{what}: wrong all-reduce result at element {bad} of {got.size}: {got.flat[bad]}, "
        f"expected {expected.flat[bad]}" + (f" (tolerance {tol:g} relative)" if tol else "")
    )


def _summary(starts: list[float], times: list[float]) -> dict[str, Any]:
    """When this rank started each timed call (``time.perf_counter``, which is
    CLOCK_MONOTONIC on Linux: one clock for every process on the host) and how long it
    took, in seconds, in call order (the parent lines the ranks' calls up)."""
    return {"starts": starts, "times": times}


# ----------------------------------------------------------------------------- TCP


def _accept_one(cfg: dict[str, Any]) -> socket.socket:
    """The one connection to 127.0.0.1:``cfg["port"]`` (bounded by ``cfg["timeout"]``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", cfg["port"]))
        srv.listen(1)
        srv.settimeout(cfg["timeout"])
        conn, _ = srv.accept()
    conn.settimeout(cfg["timeout"])
    return conn


def _dial(cfg: dict[str, Any]) -> socket.socket:
    """A connection to 127.0.0.1:``cfg["port"]``, dialed again until the other side
    listens (bounded by ``cfg["timeout"]``)."""
    deadline = time.monotonic() + cfg["timeout"]
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", cfg["port"]), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.settimeout(cfg["timeout"])
    return sock


def tcp_recv(cfg: dict[str, Any]) -> dict[str, Any]:
    """Accept one connection, receive ``total`` bytes, acknowledge with one byte."""
    total: int = cfg["total"]
    with _accept_one(cfg) as conn:
        buf = bytearray(TCP_CHUNK)
        view = memoryview(buf)
        got = 0
        t0 = 0.0
        while got < total:
            n = conn.recv_into(view, min(TCP_CHUNK, total - got))
            if n == 0:
                raise ConnectionError(f"sender closed after {got} of {total} bytes")
            if got == 0:
                t0 = time.perf_counter()
            got += n
        t1 = time.perf_counter()
        conn.sendall(b"k")
    return {"bytes": got, "seconds": t1 - t0}


def tcp_send(cfg: dict[str, Any]) -> dict[str, Any]:
    """Connect, send ``total`` bytes in large chunks, wait for the one-byte ack."""
    total: int = cfg["total"]
    with _dial(cfg) as sock:
        t0 = time.perf_counter()
        sent = _send_total(sock, total)
        if sock.recv(1) != b"k":
            raise ConnectionError("no acknowledgement from receiver")
        t1 = time.perf_counter()
    return {"bytes": sent, "seconds": t1 - t0}


def _send_total(sock: socket.socket, total: int) -> int:
    """Send ``total`` bytes in ``TCP_CHUNK`` writes; returns ``total``."""
    payload = memoryview(np.ones(TCP_CHUNK, dtype=np.uint8).tobytes())
    sent = 0
    while sent < total:
        n = min(TCP_CHUNK, total - sent)
        sock.sendall(payload[:n])
        sent += n
    return sent


def tcp_duplex(cfg: dict[str, Any]) -> dict[str, Any]:
    """One end of a connection that carries ``total`` bytes each way at once (side 0
    listens, side 1 dials): a thread sends (a blocking ``sendall`` lets go of the GIL)
    while this one receives, as a world-2 ring's rank does; one byte each way first, so
    both ends start together."""
    import threading

    total: int = cfg["total"]
    with _accept_one(cfg) if cfg["side"] == 0 else _dial(cfg) as sock:
        sock.sendall(b"s")
        if sock.recv(1) != b"s":
            raise ConnectionError("no start byte from the other side")
        failed: list[BaseException] = []

        def send() -> None:
            try:
                _send_total(sock, total)
            except BaseException as exc:  # (raised again below, on the main thread)
                failed.append(exc)

        view = memoryview(bytearray(TCP_CHUNK))
        t0 = time.perf_counter()
        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = 0
        try:
            while got < total:
                n = sock.recv_into(view, min(TCP_CHUNK, total - got))
                if n == 0:
                    raise ConnectionError(f"the other side closed after {got} of {total} bytes")
                got += n
        except BaseException:
            sock.shutdown(socket.SHUT_RDWR)  # the sender's sendall ends too
            sender.join(timeout=5)
            if failed:  # its error came first: the receive failed for it
                raise failed[0] from None
            raise
        sender.join()
        t1 = time.perf_counter()
        if failed:
            raise failed[0]
    return {"bytes": got, "seconds": t1 - t0}


def _exchange_socket(cfg: dict[str, Any]) -> socket.socket:
    """Side 0 listens on ``cfg["port"]`` and side 1 dials it; TCP_NODELAY, as p2pdist."""
    sock = _accept_one(cfg) if cfg["side"] == 0 else _dial(cfg)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _exchange_timed(n: int, iters: int, run: Callable[[int], list[float]]) -> dict[str, Any]:
    """``run(k)`` makes k exchanges and returns each one's time: ``iters`` of them to warm
    up, then ``iters`` timed; their median (the driver takes the greater side's)."""
    run(iters)
    return {"bytes": n, "median": statistics.median(run(iters))}


def _blocking_steps(sock: socket.socket, n: int) -> Callable[[int], list[float]]:
    x = np.ones(n // 4, np.float32)
    got = np.empty_like(x)
    out, into = memoryview(x).cast("B"), memoryview(got).cast("B")

    def steps(k: int) -> list[float]:
        times = []
        for _ in range(k):
            t0 = time.perf_counter()
            sock.sendall(out)
            have = 0
            while have < n:
                m = sock.recv_into(into[have:])
                if m == 0:
                    raise ConnectionError("the other side closed")
                have += m
            np.add(x, got, out=x)
            times.append(time.perf_counter() - t0)
            x.fill(1)
        return times

    return steps


async def _async_steps(
    cfg: dict[str, Any],
) -> Callable[[int], Coroutine[Any, Any, list[float]]]:
    import asyncio

    n: int = cfg["size"]
    loop = asyncio.get_running_loop()

    class Inbox(asyncio.BufferedProtocol):
        """Received bytes in one buffer; ``whole`` is set once ``n`` of them wait."""

        def __init__(self) -> None:
            # The peer sends its next message as soon as it has ours: up to two wait.
            self.buf = bytearray(4 * n)
            self.start = self.end = 0
            self.whole: asyncio.Future[None] | None = None

        def get_buffer(self, sizehint: int) -> memoryview:
            if len(self.buf) - self.end < n:  # keep room for a whole message
                waiting = self.end - self.start
                self.buf[:waiting] = self.buf[self.start : self.end]
                self.start, self.end = 0, waiting
            return memoryview(self.buf)[self.end :]

        def buffer_updated(self, nbytes: int) -> None:
            self.end += nbytes
            if self.end - self.start >= n and self.whole is not None and not self.whole.done():
                self.whole.set_result(None)

    sock = _exchange_socket(cfg)
    sock.setblocking(False)
    transport, inbox = await loop.connect_accepted_socket(Inbox, sock)
    x = np.ones(n // 4, np.float32)
    out = memoryview(x).cast("B")

    async def steps(k: int) -> list[float]:
        times = []
        for _ in range(k):
            t0 = time.perf_counter()
            transport.write(out)
            if inbox.end - inbox.start < n:
                # Read what has come before waiting for the loop to say so, as p2pdist does.
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    if m := sock.recv_into(inbox.get_buffer(-1)):
                        inbox.buffer_updated(m)
            if inbox.end - inbox.start < n:
                inbox.whole = loop.create_future()
                await asyncio.wait_for(inbox.whole, cfg["timeout"])
            got = np.frombuffer(inbox.buf, np.float32, n // 4, inbox.start)
            np.add(x, got, out=x)
            times.append(time.perf_counter() - t0)
            inbox.start += n
            x.fill(1)
        return times

    return steps


def exchange(cfg: dict[str, Any]) -> dict[str, Any]:
    """One side of the floor measurement: ``cfg["loop"]`` is "blocking", or the event
    loop to run on (asyncio, uvloop)."""
    n, iters = cfg["size"], cfg["iters"]
    if cfg["loop"] == "blocking":
        with _exchange_socket(cfg) as sock:
            return _exchange_timed(n, iters, _blocking_steps(sock, n))
    from p2pdist import eventloop

    loop = eventloop.loop_factory(cfg["loop"])()
    try:
        steps = loop.run_until_complete(_async_steps(cfg))
        return _exchange_timed(n, iters, lambda k: loop.run_until_complete(steps(k)))
    finally:
        loop.close()


# ----------------------------------------------------------------------------- Gloo


def _refill_torch(base: Any, offset: Any, x: Any, t: Any, dev: Any) -> None:
    """Rank input ``base + offset`` into ``x`` (``t``'s memory), then onto the GPU tensor
    ``dev`` when it is not ``t`` itself."""
    np.add(base, offset, out=x)
    if dev is not t:
        import torch  # type: ignore[import-not-found,unused-ignore]

        dev.copy_(t)
        torch.cuda.synchronize()


def _refill_cupy(base: Any, offset: Any, x: Any, arr: Any, cp: Any) -> None:
    """Rank input ``base + offset`` into ``x``, then into the CuPy array ``arr`` (when
    ``cp``, the CuPy module, is given)."""
    np.add(base, offset, out=x)
    if cp is not None:
        arr.set(x)
        cp.cuda.get_current_stream().synchronize()


def gloo(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of the Gloo all-reduce sweep."""
    import torch  # type: ignore[import-not-found,unused-ignore]
    import torch.distributed as dist  # type: ignore[import-not-found,unused-ignore]

    rank: int = cfg["rank"]
    offset = np.float32(rank + 1)  # rank r's input: base + r + 1
    world: int = cfg["world"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg["timeout"]),
    )
    on_gpu = cfg.get("arrays") == "cuda"
    results: list[dict[str, Any]] = []
    try:
        for nbytes, warmup, iters in zip(cfg["sizes"], cfg["warmup"], cfg["iters"], strict=True):
            t = torch.empty((nbytes // 4,), dtype=torch.float32)
            # Refill through numpy, on this thread: torch's own ops would wake its
            # OpenMP pool, whose spinning threads take CPU from the next all-reduce.
            x = t.numpy()
            base = base_pattern(x.size)
            expected = expected_sum(base, world)
            dev = t.cuda() if on_gpu else t
            for _ in range(warmup):
                _refill_torch(base, offset, x, t, dev)
                dist.all_reduce(dev, op=dist.ReduceOp.SUM)
            dist.barrier()
            starts: list[float] = []
            times: list[float] = []
            cpu = 0.0
            for _ in range(iters):
                _refill_torch(base, offset, x, t, dev)  # outside the timer: the same sums
                dist.barrier()  # every rank's refill and last check done (untimed)
                c0, t0 = time.process_time(), time.perf_counter()
                starts.append(t0)
                dist.all_reduce(dev, op=dist.ReduceOp.SUM)  # in place, as torch always is
                if on_gpu:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
                check(dev.cpu().numpy() if on_gpu else x, expected, 0.0, f"gloo {nbytes} B")
            summary = _summary(starts, times)
            results.append({"bytes": nbytes, "iters": iters, "cpu": cpu / iters, **summary})
            del t, x, base, expected
        dist.barrier()
        barrier_starts: list[float] = []
        barrier: list[float] = []
        for _ in range(BARRIER_ITERS):
            t0 = time.perf_counter()
            dist.barrier()
            barrier_starts.append(t0)
            barrier.append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    return {"results": results, "barrier": _summary(barrier_starts, barrier)}


# -------------------------------------------------------------------------- p2pdist


async def _p2pdist_async(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of the p2pdist all-reduce sweep inside the event loop."""
    from p2pdist import Group, GroupConfig
    from p2pdist.eventloop import loop_name
    from p2pdist.transport import TransportConfig

    if loop_name() != cfg.get("loop", "asyncio"):
        raise AssertionError(f"running on {loop_name()}, asked for {cfg.get('loop')}")
    rank: int = cfg["rank"]
    offset = np.float32(rank + 1)  # rank r's input: base + r + 1
    world: int = cfg["world"]
    transport = TransportConfig(sealed_records=cfg.get("sealed_records", True))
    g = Group.from_seed(
        cfg["seed"],
        rank=rank,
        world=world,
        peers=cfg["peers"],
        tls=cfg["tls"],
        config=GroupConfig(transport=transport, algorithm=cfg.get("algorithm", "auto")),
    )
    kw: dict[str, Any] = cfg.get("reduce_kwargs", {})
    tol = tolerance(world, kw)
    cp: Any = None
    if cfg.get("arrays") == "cuda":
        import cupy as cp  # type: ignore[import-not-found,unused-ignore,no-redef]
    results: list[dict[str, Any]] = []
    async with g:
        for nbytes, warmup, iters in zip(cfg["sizes"], cfg["warmup"], cfg["iters"], strict=True):
            x = np.empty(nbytes // 4, dtype=np.float32)
            base = base_pattern(x.size)
            expected = expected_sum(base, world)
            # In place by default, as Gloo's all_reduce(t); "out_of_place" measures the
            # call that returns a fresh array (its allocation and first touch included).
            arr: Any = cp.asarray(x) if cp is not None else x
            out: Any = None if cfg.get("out_of_place") else arr
            for _ in range(warmup):
                _refill_cupy(base, offset, x, arr, cp)
                await g.all_reduce(arr, op="sum", out=out, **kw)
            await g.barrier()
            starts: list[float] = []
            times: list[float] = []
            cpu = 0.0
            for _ in range(iters):
                _refill_cupy(base, offset, x, arr, cp)  # outside the timer: the same sums
                await g.barrier()  # every rank's refill and last check done (untimed)
                c0, t0 = time.process_time(), time.perf_counter()
                starts.append(t0)
                result = await g.all_reduce(arr, op="sum", out=out, **kw)
                if cp is not None:
                    cp.cuda.get_current_stream().synchronize()
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
                if out is not None and result is not out:
                    raise AssertionError(f"p2pdist {nbytes} B: all_reduce(x, out=x) not in place")
                got = result.get() if cp is not None else np.asarray(result)
                check(got, expected, tol, f"p2pdist {nbytes} B")
            summary = _summary(starts, times)
            results.append({"bytes": nbytes, "iters": iters, "cpu": cpu / iters, **summary})
            del x, arr, out, result, base, expected
        await g.barrier()
        barrier_starts: list[float] = []
        barrier: list[float] = []
        for _ in range(BARRIER_ITERS):
            t0 = time.perf_counter()
            await g.barrier()
            barrier_starts.append(t0)
            barrier.append(time.perf_counter() - t0)
    return {"results": results, "barrier": _summary(barrier_starts, barrier)}


def p2pdist(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of the p2pdist all-reduce sweep on ``cfg["loop"]`` (asyncio/uvloop)."""
    from p2pdist import eventloop

    return eventloop.run(_p2pdist_async(cfg), loop=cfg.get("loop", "asyncio"))


ROLES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "tcp-recv": tcp_recv,
    "tcp-send": tcp_send,
    "tcp-duplex": tcp_duplex,
    "exchange": exchange,
    "gloo": gloo,
    "p2pdist": p2pdist,
}


def main(argv: list[str]) -> int:
    """Entry point: ``_allreduce_worker.py CONFIG_JSON``."""
    cfg: dict[str, Any] = json.loads(argv[1])
    result = ROLES[cfg["role"]](cfg)
    tmp = Path(cfg["result"] + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(cfg["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
