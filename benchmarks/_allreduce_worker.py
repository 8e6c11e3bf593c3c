"""Worker processes for ``benchmarks/allreduce.py``.

Each worker is started as ``python benchmarks/_allreduce_worker.py CONFIG_JSON`` by the
driver, runs one role, and writes a JSON result file named in the config. Roles:

``tcp-recv`` / ``tcp-send``
    Raw loopback TCP bandwidth with plain blocking sockets, one direction.
``gloo``
    One rank of a torch.distributed Gloo all-reduce sweep.
``p2pdist``
    One rank of a p2pdist ``Group.all_reduce`` sweep (TLS or plaintext), on asyncio's
    event loop or uvloop.

The all-reduce roles time every call with :func:`time.perf_counter` after a barrier and
report the per-size median; the driver takes the maximum over ranks.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

#: Chunk size for the raw TCP bandwidth measurement.
TCP_CHUNK = 4 << 20


BARRIER_ITERS = 200


def _expected_sum(world: int) -> float:
    """Value of every element after summing ``rank + 1`` over all ranks."""
    return world * (world + 1) / 2.0


def _check(values: np.ndarray[Any, Any], world: int, what: str) -> None:
    """Raise unless every element of ``values`` equals the expected all-reduce sum."""
    expected = _expected_sum(world)
    if values.size and not (float(values.min()) == expected and float(values.max()) == expected):
        raise AssertionError(
            f"{what}: wrong all-reduce result (min={values.min()}, max={values.max()},"
            f" expected {expected})"
        )


def _summary(times: list[float]) -> dict[str, float]:
    """Median/min/max of per-iteration times in seconds."""
    return {
        "median": statistics.median(times),
        "min": min(times),
        "max": max(times),
    }


# ----------------------------------------------------------------------------- TCP


def tcp_recv(cfg: dict[str, Any]) -> dict[str, Any]:
    """Accept one connection, receive ``total`` bytes, acknowledge with one byte."""
    total: int = cfg["total"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", cfg["port"]))
        srv.listen(1)
        srv.settimeout(cfg["timeout"])
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(cfg["timeout"])
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
    deadline = time.monotonic() + cfg["timeout"]
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", cfg["port"]), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with sock:
        sock.settimeout(cfg["timeout"])
        payload = memoryview(np.ones(TCP_CHUNK, dtype=np.uint8).tobytes())
        sent = 0
        t0 = time.perf_counter()
        while sent < total:
            n = min(TCP_CHUNK, total - sent)
            sock.sendall(payload[:n])
            sent += n
        if sock.recv(1) != b"k":
            raise ConnectionError("no acknowledgement from receiver")
        t1 = time.perf_counter()
    return {"bytes": sent, "seconds": t1 - t0}


# ----------------------------------------------------------------------------- Gloo


def gloo(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of the Gloo all-reduce sweep."""
    import torch  # type: ignore[import-not-found,unused-ignore]
    import torch.distributed as dist  # type: ignore[import-not-found,unused-ignore]

    rank: int = cfg["rank"]
    world: int = cfg["world"]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg["timeout"]),
    )
    results: list[dict[str, Any]] = []
    try:
        for nbytes, warmup, iters in zip(cfg["sizes"], cfg["warmup"], cfg["iters"], strict=True):
            t = torch.empty((nbytes // 4,), dtype=torch.float32)
            # Refill through numpy, on this thread: torch's own fill_ would wake its
            # OpenMP pool, whose spinning threads take CPU from the next all-reduce.
            x = t.numpy()
            for _ in range(warmup):
                x.fill(rank + 1)
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
            dist.barrier()
            times: list[float] = []
            cpu = 0.0
            for _ in range(iters):
                x.fill(rank + 1)  # outside the timer: every call sums the same data
                c0, t0 = time.process_time(), time.perf_counter()
                dist.all_reduce(t, op=dist.ReduceOp.SUM)  # in place, as torch always is
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
            _check(x, world, f"gloo {nbytes} B")
            results.append({"bytes": nbytes, "iters": iters, "cpu": cpu / iters, **_summary(times)})
            del t, x
        dist.barrier()
        barrier: list[float] = []
        for _ in range(BARRIER_ITERS):
            t0 = time.perf_counter()
            dist.barrier()
            barrier.append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    return {"results": results, "barrier": _summary(barrier)}


# -------------------------------------------------------------------------- p2pdist


async def _p2pdist_async(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of the p2pdist all-reduce sweep inside the event loop."""
    from p2pdist import Group
    from p2pdist.eventloop import loop_name

    if loop_name() != cfg.get("loop", "asyncio"):
        raise AssertionError(f"running on {loop_name()}, asked for {cfg.get('loop')}")
    rank: int = cfg["rank"]
    world: int = cfg["world"]
    g = Group.from_seed(cfg["seed"], rank=rank, world=world, peers=cfg["peers"], tls=cfg["tls"])
    kw: dict[str, Any] = cfg.get("reduce_kwargs", {})
    results: list[dict[str, Any]] = []
    async with g:
        for nbytes, warmup, iters in zip(cfg["sizes"], cfg["warmup"], cfg["iters"], strict=True):
            x = np.empty(nbytes // 4, dtype=np.float32)
            # In place by default, as Gloo's all_reduce(t); "out_of_place" measures the
            # call that returns a fresh array (its allocation and first touch included).
            out: np.ndarray[Any, Any] | None = None if cfg.get("out_of_place") else x
            for _ in range(warmup):
                x.fill(rank + 1)
                await g.all_reduce(x, op="sum", out=out, **kw)
            await g.barrier()
            times: list[float] = []
            cpu = 0.0
            for _ in range(iters):
                x.fill(rank + 1)  # outside the timer: every call sums the same data
                c0, t0 = time.process_time(), time.perf_counter()
                result = await g.all_reduce(x, op="sum", out=out, **kw)
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
            _check(np.asarray(result), world, f"p2pdist {nbytes} B")
            results.append({"bytes": nbytes, "iters": iters, "cpu": cpu / iters, **_summary(times)})
            del x, result
        await g.barrier()
        barrier: list[float] = []
        for _ in range(BARRIER_ITERS):
            t0 = time.perf_counter()
            await g.barrier()
            barrier.append(time.perf_counter() - t0)
    return {"results": results, "barrier": _summary(barrier)}


def p2pdist(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one rank of the p2pdist all-reduce sweep on ``cfg["loop"]`` (asyncio/uvloop)."""
    from p2pdist import eventloop

    return eventloop.run(_p2pdist_async(cfg), loop=cfg.get("loop", "asyncio"))


ROLES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "tcp-recv": tcp_recv,
    "tcp-send": tcp_send,
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
