"""Relay capacity: memory per client and forwarded datagrams per second.

Starts ``python -m relay`` as a subprocess on loopback, connects N authenticated clients
from ``--procs`` client processes (client k of process w is paired with client k of
process w+1), keeps light traffic flowing in every pair (one small datagram per client
per second), and reads the relay's RSS from /proc before and after. Then some pairs
blast small datagrams one way as fast as they can, and the relay's own counters
(``/metrics``) give the forwarded rate.

Run: ``python benchmarks/relay_capacity.py --clients 500 1000``
(``--blast-pairs``, ``--blast-seconds``, ``--size``, ``--procs``; ``-h`` for all).
``--client relaypath`` connects p2pdist's own client (``RelayPath``: TLS, then the
AES-GCM records every p2pdist client asks for) instead of the step-by-step test client
(TLS throughout).
Relay and clients share the machine, so on a 2-core box the clients' own TLS work
competes with the relay: the rate is a floor for a relay on its own host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _loops import add_loop_argument, chosen_loops  # noqa: E402
from _procs import cpu_seconds  # noqa: E402
from relay_helpers import read_relay_url  # noqa: E402

from p2pdist.identity import EndpointId, SecretKey  # noqa: E402
from p2pdist.transport.relay_path import RelayPath  # noqa: E402
from relay.testclient import RelayTestClient, http_get  # noqa: E402

SEED = "relay capacity benchmark seed"


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM in KiB."""
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v) for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M)}


LIGHT = b"l" * 100
"""The light-traffic datagram (blast datagrams start with b"b")."""


def _key(proc: int, index: int) -> SecretKey:
    return SecretKey.from_seed(SEED, proc * 1_000_000 + index)


# ---- worker process ------------------------------------------------------------------


class _PathClient:
    """A ``RelayPath`` (p2pdist's own client) with the test client's few calls used here."""

    def __init__(self, path: RelayPath) -> None:
        self.path = path

    def send(self, dest: EndpointId, datagram: bytes) -> None:
        self.path.send(dest, datagram)

    async def drain(self) -> None:
        await asyncio.sleep(0)  # RelayPath writes once per pass (and drops over its buffer)

    @property
    def sent(self) -> int:
        return self.path.status.datagrams_sent

    async def close(self) -> None:
        await self.path.close()


class Worker:
    """``count`` clients; client k talks to client k of process ``peer_proc``."""

    def __init__(self, url: str, proc: int, peer_proc: int, count: int, kind: str) -> None:
        self.url = url
        self.kind = kind
        self.keys = [_key(proc, k) for k in range(count)]
        self.peers = [_key(peer_proc, k).endpoint_id for k in range(count)]
        self.clients: list[Any] = []
        self.received = 0
        self.received_bytes = 0
        self.light_received = 0
        """Light-phase datagrams (told apart by their first byte, so that one the peer
        process sent before this process started its own light phase still counts)."""
        self.readers: list[asyncio.Task[None]] = []

    async def connect(self) -> float:
        sem = asyncio.Semaphore(32)

        async def one(key: SecretKey) -> RelayTestClient:
            async with sem:
                c = await RelayTestClient.open(self.url, timeout=60)
                await c.authenticate(key, timeout=60)
                return c

        async def path(key: SecretKey) -> _PathClient:
            async with sem:
                p = RelayPath(key, self.url)
                p.on_datagram = lambda _src, data: self._count(data)
                p.start()
                await p.wait_connected(60)
                return _PathClient(p)

        start = time.perf_counter()
        if self.kind == "relaypath":
            self.clients = list(await asyncio.gather(*(path(k) for k in self.keys)))
        else:
            self.clients = list(await asyncio.gather(*(one(k) for k in self.keys)))
            self.readers = [asyncio.create_task(self._read(c)) for c in self.clients]
        return time.perf_counter() - start

    def _count(self, data: bytes) -> None:
        self.received += 1
        self.received_bytes += len(data)
        if data[:1] == LIGHT[:1]:
            self.light_received += 1

    async def _read(self, c: RelayTestClient) -> None:
        try:
            while True:
                _, data = await c.recv(timeout=3600)
                self._count(data)
        except (OSError, TimeoutError, asyncio.CancelledError):
            return

    async def light(self, seconds: float) -> dict[str, Any]:
        """Every client sends one 100-byte datagram to its peer each second."""
        rounds = max(1, round(seconds))
        for _ in range(rounds):
            for c, peer in zip(self.clients, self.peers, strict=True):
                c.send(peer, LIGHT)
            await asyncio.sleep(1.0)
        await asyncio.sleep(1.0)  # the peer process may have started a little later
        return {"received": self.light_received, "sent": len(self.clients) * rounds}

    async def blast(self, pairs: int, seconds: float, size: int) -> dict[str, Any]:
        """The first ``pairs`` clients send ``size``-byte datagrams as fast as they can."""
        payload = b"b" * size
        sent = 0
        deadline = time.perf_counter() + seconds

        async def pump(c: Any, peer: Any) -> None:
            nonlocal sent
            frame_batch, calls = 64, 0
            first = c.sent if isinstance(c, _PathClient) else None
            while time.perf_counter() < deadline:
                for _ in range(frame_batch):
                    c.send(peer, payload)
                calls += frame_batch
                await c.drain()
            # A RelayPath drops what its send buffer cannot take: count what it took.
            sent += calls if first is None else c.sent - first

        start = time.perf_counter()
        await asyncio.gather(
            *(pump(c, p) for c, p in zip(self.clients[:pairs], self.peers[:pairs], strict=True))
        )
        return {"sent": sent, "seconds": time.perf_counter() - start}

    async def count(self, seconds: float) -> dict[str, Any]:
        before = self.received
        await asyncio.sleep(seconds)
        return {"received": self.received - before}

    async def close(self) -> None:
        for t in self.readers:
            t.cancel()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)


async def _worker_main(url: str, proc: int, peer_proc: int, count: int, kind: str) -> None:
    _raise_nofile()
    w = Worker(url, proc, peer_proc, count, kind)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"connected_in": await w.connect()})
    while line := (await reader.readline()).decode().split():
        cmd, args = line[0], [float(a) for a in line[1:]]
        if cmd == "light":
            reply(await w.light(args[0]))
        elif cmd == "blast":
            reply(await w.blast(int(args[0]), args[1], int(args[2])))
        elif cmd == "count":
            reply(await w.count(args[0]))
        elif cmd == "quit":
            break
    await w.close()
    reply({"bye": True})


# ---- coordinator ---------------------------------------------------------------------


class Proc:
    def __init__(self, args: list[str]) -> None:
        self.p = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )

    def tell(self, cmd: str) -> None:
        """Send a command; :meth:`ask` (without one) reads its reply later."""
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()

    def ask(self, cmd: str | None = None) -> dict[str, Any]:
        assert self.p.stdout is not None
        if cmd is not None:
            self.tell(cmd)
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.p.wait()})")
        result: dict[str, Any] = json.loads(line)
        return result


def _metric(text: str, name: str) -> int:
    m = re.search(rf"^{re.escape(name)} (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


def _metrics(url: str) -> str:
    return asyncio.run(http_get(url, "/metrics"))[1]


def run_one(n: int, args: argparse.Namespace, loop: str = "asyncio") -> dict[str, Any]:
    relay = subprocess.Popen(
        [
            sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0",
            "--stun-port", "0", "--max-clients", str(n + 16), "--log-level", "error",
            "--keepalive", "60", "--loop", loop,
        ],
        stdout=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    workers: list[Proc] = []
    try:
        assert relay.stdout is not None
        url = read_relay_url(relay.stdout)
        time.sleep(0.5)
        base = _proc_status(relay.pid)
        per = n // args.procs
        for k in range(args.procs):
            workers.append(
                Proc([sys.executable, __file__, "--worker", url, str(k), str((k + 1) % args.procs),
                      str(per), args.client])
            )  # fmt: skip
        connect_s = max(w.ask()["connected_in"] for w in workers)
        clients = _metric(_metrics(url), "p2pdist_relay_clients")
        for w in workers:
            w.tell(f"light {args.light_seconds}")
        light = [w.ask() for w in workers]
        loaded = _proc_status(relay.pid)
        before = _metrics(url)
        cpu0 = cpu_seconds(relay.pid)
        t0 = time.perf_counter()
        workers[1 % args.procs].tell(f"count {args.blast_seconds + 1}")
        blast = workers[0].ask(f"blast {args.blast_pairs} {args.blast_seconds} {args.size}")
        elapsed = time.perf_counter() - t0
        after = _metrics(url)  # then the CPU: it includes the work on what "after" counts
        cpu = cpu_seconds(relay.pid) - cpu0
        counted = workers[1 % args.procs].ask()
        out = _metric(after, "p2pdist_relay_datagrams_out_total") - _metric(
            before, "p2pdist_relay_datagrams_out_total"
        )
        drops = {
            r: _metric(after, f'p2pdist_relay_dropped_total{{reason="{r}"}}')
            - _metric(before, f'p2pdist_relay_dropped_total{{reason="{r}"}}')
            for r in ("queue_full", "unknown_peer")
        }
        peak = _proc_status(relay.pid)
        for w in workers:
            w.ask("quit")
            w.p.wait(30)
        return {
            "clients": clients,
            "connect_s": connect_s,
            "rss_base_kib": base["VmRSS"],
            "rss_loaded_kib": loaded["VmRSS"],
            "rss_per_client_kib": (loaded["VmRSS"] - base["VmRSS"]) / max(clients, 1),
            "light_received": sum(x["received"] for x in light),
            "light_sent": sum(x["sent"] for x in light),
            "blast_sent": blast["sent"],
            "forwarded": out,
            "forwarded_per_s": out / elapsed,
            "relay_cpu_share": cpu / elapsed,
            "forwarded_per_cpu_s": out / max(cpu, 1e-9),
            "received": counted["received"],
            "drops": drops,
            "hwm_kib": peak["VmHWM"],
        }
    finally:  # on success the workers have quit already; on an error none is left behind
        for w in workers:
            _stop(w.p, 5)
        _stop(relay, 30)


def _stop(p: subprocess.Popen[Any], wait: float) -> None:
    """Terminate ``p``; kill it when it has not exited within ``wait`` seconds."""
    if p.poll() is None:
        p.terminate()
    try:
        p.wait(wait)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[500, 1000])
    p.add_argument("--procs", type=int, default=2, help="client processes (at least 2)")
    p.add_argument("--light-seconds", type=float, default=3)
    p.add_argument("--blast-pairs", type=int, default=4)
    p.add_argument("--blast-seconds", type=float, default=5)
    p.add_argument("--size", type=int, default=200, help="blast datagram bytes")
    p.add_argument(
        "--client",
        choices=("test", "relaypath"),
        default="test",
        help="the clients: relay/testclient.py (TLS throughout) or p2pdist's RelayPath "
        "(TLS, then AES-GCM records)",
    )
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    add_loop_argument(p, "the relay's event loop, each measured in turn")
    args = p.parse_args()
    args.loops = chosen_loops(args.loops)
    if args.procs < 2:  # the blast and its count must come from different processes
        p.error("--procs must be at least 2")
    if args.worker:
        url, proc, peer, count, kind = args.worker
        asyncio.run(_worker_main(url, int(proc), int(peer), int(count), kind))
        return
    _raise_nofile()
    print(
        f"relay capacity on {os.cpu_count()} CPUs (relay and clients share them); clients: "
        + ("RelayPath, AES-GCM records" if args.client == "relaypath" else "test client, TLS")
    )
    hdr = (
        f"{'loop':>8} {'clients':>8} {'connect s':>9} {'RSS base':>9} {'RSS load':>9} "
        f"{'KiB/client':>10} "
        f"{'light rx/tx':>11} {'fwd dgram/s':>11} {'relay CPU':>9} {'fwd/CPU-s':>9} {'size':>5} "
        f"{'pairs':>5} {'queue_full':>10}"
    )
    print(hdr)
    for n, loop in [(n, lp) for n in args.clients for lp in args.loops]:
        r = run_one(n, args, loop)
        print(
            f"{loop:>8} {r['clients']:>8} {r['connect_s']:>9.1f} "
            f"{r['rss_base_kib'] / 1024:>7.1f}Mi "
            f"{r['rss_loaded_kib'] / 1024:>7.1f}Mi {r['rss_per_client_kib']:>10.1f} "
            f"{r['light_received']:>5}/{r['light_sent']:<5} {r['forwarded_per_s']:>11.0f} "
            f"{r['relay_cpu_share']:>9.0%} {r['forwarded_per_cpu_s']:>9.0f} {args.size:>5} "
            f"{args.blast_pairs:>5} {r['drops']['queue_full']:>10}",
            flush=True,
        )
        print("  " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
