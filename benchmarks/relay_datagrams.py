"""Datagrams through a relay, without QUIC: what the relay path itself costs.

One process sends ``--count`` datagrams to another through a local relay process
(``python -m relay`` on 127.0.0.1), both over :class:`p2pdist.transport.relay_path.RelayPath`,
as fast as the sender's session takes them: in batches of 16, reading the session's
counters once per batch (a datagram the sender's own session refuses, its buffer being
full, is not counted as sent, and the sender waits 1 ms before the next batch). Prints, per
event loop and datagram size: datagrams received of those sent (the rest the relay or the
receiver dropped), the receive rate (bytes of the datagrams after the first over the time
from the first to the last), and CPU milliseconds per 10^6 payload bytes of the receiver
(over the same bytes and time) and of the relay (per 10^6 bytes that arrived).

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
from _procs import children, cpu_seconds, local_relay, wait_for

from p2pdist import SecretKey, eventloop

SEED = "relay-datagrams-bench-0123"
END = b"E"  # first byte of the end markers; data datagrams start with b"x"
BATCH = 16
"""Datagrams sent between two reads of the session's counters (and two loop passes)."""


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
    first = [0]  # bytes of the first datagram: it arrives at the start of the timed span
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
            first[0] = len(data)
        last[:] = now
        got[0] += 1
        got[1] += len(data)

    path.on_datagram = on_datagram
    q.put("ready")
    await asyncio.wait_for(done, 300)
    wall, cpu = last[0] - start[0], last[1] - start[1]
    timed = got[1] - first[0]  # bytes that arrived within (start, last]
    rate = timed / wall if wall > 0 else 0.0
    q.put({"received": got[0], "rate": rate, "recv_cpu": cpu / max(1, timed)})


async def _send(path: Any, to: SecretKey, count: int, size: int, q: Any) -> None:
    payload = b"x" * size
    # ``status`` builds a new snapshot (microseconds, a datagram's whole budget): read it
    # once per batch. Within a batch nothing is flushed (that happens in a loop pass), so
    # once the session refuses a datagram it refuses the rest of the batch too.
    before = path.status.datagrams_sent
    sent = 0
    while sent < count:
        batch = min(BATCH, count - sent)
        for _ in range(batch):
            path.send(to.endpoint_id, payload)
        accepted = path.status.datagrams_sent - before - sent
        sent += accepted
        await asyncio.sleep(0.001 if accepted < batch else 0)  # refused: let it drain
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
    with children(grace=30) as procs:
        for role, says in (("recv", "ready"), ("send", "connected")):
            procs.append(
                ctx.Process(target=_worker, args=(role, url, count, size, loop, q), name=role)
            )
            procs[-1].start()
            if (got := wait_for(q, procs, 60, f"{role} start")) != says:
                raise RuntimeError(f"{role}: {got!r} instead of {says!r}")
        relay_cpu = cpu_seconds(relay_pid)
        result: dict[str, float] = {}
        for _ in range(2):
            result.update(wait_for(q, procs, 300, "results"))
        # Per byte that arrived (the relay's work on datagrams dropped on the way is a
        # cost of the ones delivered).
        arrived = max(1, int(result.get("received", count))) * size
        result["relay_cpu"] = (cpu_seconds(relay_pid) - relay_cpu) / arrived
        return result


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
