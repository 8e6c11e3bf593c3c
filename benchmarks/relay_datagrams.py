"""Datagrams through a relay, without QUIC: what the relay path itself costs.

One process sends ``--count`` datagrams to another through a local relay process
(``python -m relay`` on 127.0.0.1), both over :class:`p2pdist.transport.relay_path.RelayPath`,
as fast as the sender's session takes them (a datagram the sender's own session refuses
is retried after 1 ms and not counted as sent). Prints, per event loop and datagram size:
datagrams received of those sent (the rest the relay or the receiver dropped), the
receive rate, and CPU milliseconds per 10^6 payload bytes of the receiver and the relay.

Run: ``python benchmarks/relay_datagrams.py [--count 20000] [--sizes 1200 16000]``
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

from _loops import add_loop_argument, chosen_loops
from _procs import cpu_seconds, local_relay

from p2pdist import SecretKey, eventloop

SEED = "relay-datagrams-bench-0123"
END = b"E"  # first byte of the end markers; data datagrams start with b"x"


async def _run(role: str, url: str, count: int, size: int, q: Any) -> None:
    from p2pdist.transport.relay_path import RelayPath

    sender, receiver = SecretKey.from_seed(SEED, 0), SecretKey.from_seed(SEED, 1)
    path = RelayPath(sender if role == "send" else receiver, url)
    await path.wait_connected(30)
    if role == "send":
        q.put("connected")  # the relay's CPU is counted from here
        await asyncio.sleep(0.2)
    try:
        if role == "recv":
            await _receive(path, q)
        else:
            await _send(path, receiver, count, size, q)
    finally:
        await path.close()


async def _receive(path: Any, q: Any) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    got = [0, 0]  # datagrams, bytes
    start = [0.0, 0.0]  # wall, CPU at the first datagram
    last = [0.0, 0.0]  # wall, CPU at the last one (the end markers come 0.5 s later)

    def on_datagram(_src: Any, data: bytes) -> None:
        if data[:1] == END:
            if not done.done():
                done.set_result(None)
            return
        now = [time.perf_counter(), time.process_time()]
        if got[0] == 0:
            start[:] = now
        last[:] = now
        got[0] += 1
        got[1] += len(data)

    path.on_datagram = on_datagram
    q.put("ready")
    await asyncio.wait_for(done, 300)
    wall, cpu = last[0] - start[0], last[1] - start[1]
    rate = got[1] / wall if wall > 0 else 0.0
    q.put({"received": got[0], "rate": rate, "recv_cpu": cpu / max(1, got[1])})


async def _send(path: Any, to: SecretKey, count: int, size: int, q: Any) -> None:
    payload = b"x" * size
    sent = 0
    while sent < count:
        dropped = path.status.dropped
        path.send(to.endpoint_id, payload)
        if path.status.dropped > dropped:
            await asyncio.sleep(0.001)  # our own session is full: let it drain
            continue
        sent += 1
        if sent % 16 == 0:
            await asyncio.sleep(0)
    await asyncio.sleep(0.5)
    for _ in range(50):  # best effort: one of these arrives
        path.send(to.endpoint_id, END)
        await asyncio.sleep(0.01)
    q.put({"sent": sent})


def _worker(role: str, url: str, count: int, size: int, loop: str, q: Any) -> None:
    eventloop.run(_run(role, url, count, size, q), loop=loop)


def measure(url: str, relay_pid: int, count: int, size: int, loop: str) -> dict[str, float]:
    """One sender and one receiver process through the relay at ``url``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    recv = ctx.Process(target=_worker, args=("recv", url, count, size, loop, q))
    recv.start()
    procs = [recv]
    try:
        assert q.get(timeout=60) == "ready"
        send = ctx.Process(target=_worker, args=("send", url, count, size, loop, q))
        send.start()
        procs.append(send)
        assert q.get(timeout=60) == "connected"
        relay_cpu = cpu_seconds(relay_pid)
        result: dict[str, float] = {}
        for _ in range(2):
            result.update(q.get(timeout=300))
        result["relay_cpu"] = (cpu_seconds(relay_pid) - relay_cpu) / (count * size)
        return result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=20000, help="datagrams per measurement")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1200, 16000], help="bytes")
    add_loop_argument(ap, "event loops of the peers and the relay, each in turn")
    args = ap.parse_args()
    print(
        "datagrams through a local relay (3 processes on the same cores; CPU in ms per "
        "10^6 payload bytes; the relay's includes the sender's share of its work)"
    )
    print(f"{'loop':>8} {'size':>6} {'received':>15} {'MB/s':>7} {'receiver':>9} {'relay':>6}")
    with tempfile.TemporaryDirectory(prefix="p2pdist-relay-bench-") as tmp:
        for loop in chosen_loops(args.loops):
            with local_relay(loop, Path(tmp)) as (url, pid):
                for size in args.sizes:
                    m = measure(url, pid, args.count, size, loop)
                    got = f"{int(m['received'])}/{int(m['sent'])}"
                    print(
                        f"{loop:>8} {size:>6} {got:>15} {m['rate'] / 1e6:>7.0f} "
                        f"{m['recv_cpu'] * 1e9:>9.2f} {m['relay_cpu'] * 1e9:>6.2f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
