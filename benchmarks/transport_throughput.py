"""One-way throughput of one connection, to show what receiving in place buys.

Compares, between two processes on loopback, for the same message sizes:

* ``p2pdist``: :class:`p2pdist.TcpTransport` (BufferedProtocol: payloads are received
  straight into their own buffer), plaintext, TLS (``p2pdist-tls``: frames in AES-GCM
  records after the TLS handshake, the default) and TLS records all along
  (``p2pdist-tlsrec``, ``sealed_records=False``);
* ``streams``: the naive asyncio way, ``StreamReader.readexactly`` per message (bytes are
  copied through the stream's internal buffer);
* ``socket``: blocking ``sendall`` / ``recv_into`` into a preallocated buffer (the ceiling);
* ``tls-socket``: the same over a blocking ``ssl.SSLSocket`` with p2pdist's TLS 1.3
  identities (what a data path on worker threads could reach: ``SSLSocket`` releases the
  GIL while it encrypts, decrypts and waits).

``--both-ways`` makes each process send and receive at once, as every rank of a world-2
ring all-reduce does: a cell is the bytes of one direction over the time the slower
process needed to send and receive all of them. The blocking
kinds then run a sender thread and a receiver thread per process, on one connection per
direction (an ``SSLSocket`` is not to be used by two threads at once); that is the most a
worker-thread data path could get out of two processes on this machine.

Run: ``python benchmarks/transport_throughput.py [--mib 512] [--size-mib 8] [--both-ways]``
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
from _procs import children, wait_for

from p2pdist import SecretKey, TcpTransport, TransportConfig, eventloop
from p2pdist.launch import pick_free_ports
from p2pdist.tls import TlsIdentity

SEED = "transport-bench-seed-0123"
LOOP_KINDS = ("streams", "p2pdist-plain", "p2pdist-tls", "p2pdist-tlsrec")
"""Columns that run on an event loop (a ``+uv`` suffix runs them on uvloop)."""
KINDS = ("socket", "tls-socket", *LOOP_KINDS, *(f"{k}+uv" for k in LOOP_KINDS))


async def _p2pdist_connection(role: str, port: int, mode: str, q: Any) -> tuple[Any, Any]:
    """(transport, connection): "recv" listens (and says so on ``q``), "send" dials.
    ``mode``: "plain", "tls" (AES-GCM records after TLS) or "tlsrec" (TLS records)."""
    cfg = TransportConfig(tls=mode != "plain", sealed_records=mode != "tlsrec")
    server_key, client_key = SecretKey.from_seed(SEED, 0), SecretKey.from_seed(SEED, 1)
    if role == "recv":
        t = TcpTransport(server_key, cfg)
        await t.listen("127.0.0.1", port)
        q.put("listening")
        return t, await t.accept(timeout=30)
    t = TcpTransport(client_key, cfg)
    return t, await t.connect(server_key.endpoint_id, ("127.0.0.1", port))


async def _p2pdist_both(role: str, port: int, count: int, size: int, mode: str, q: Any) -> None:
    """Both ways at once over one connection: send ``count`` messages while receiving as many."""
    t, conn = await _p2pdist_connection(role, port, mode, q)
    payload = np.ones(size, np.uint8)

    async def send_all() -> None:
        for _ in range(count):
            await conn.send(1, payload)

    async def recv_all() -> None:
        for _ in range(count):
            await conn.recv(1, timeout=60)

    start = time.perf_counter()
    await asyncio.gather(send_all(), recv_all())
    q.put(count * size / (time.perf_counter() - start))
    await conn.send(2, b"done")  # neither side closes while the other still receives
    await conn.recv(2, timeout=60)
    await t.close()


async def _p2pdist(role: str, port: int, count: int, size: int, mode: str, q: Any) -> None:
    t, conn = await _p2pdist_connection(role, port, mode, q)
    if role == "recv":
        await conn.recv(1, timeout=30)
        start = time.perf_counter()
        for _ in range(count - 1):
            await conn.recv(1, timeout=30)
        q.put((count - 1) * size / (time.perf_counter() - start))
        await conn.send(2, b"done")
        await conn.recv(3, timeout=30)
    else:
        payload = np.ones(size, np.uint8)
        for _ in range(count):
            await conn.send(1, payload)
        await conn.recv(2, timeout=60)
        await conn.send(3, b"bye")
    await t.close()


async def _streams(role: str, port: int, count: int, size: int, q: Any) -> None:
    head = struct.Struct(">Q")
    if role == "recv":
        done = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            start = 0.0
            for i in range(count):
                (n,) = head.unpack(await reader.readexactly(8))
                await reader.readexactly(n)
                if i == 0:
                    start = time.perf_counter()
            q.put((count - 1) * size / (time.perf_counter() - start))
            writer.write(b"k")
            await writer.drain()
            writer.close()
            done.set_result(None)

        server = await asyncio.start_server(handle, "127.0.0.1", port)
        q.put("listening")
        await asyncio.wait_for(done, 120)
        server.close()
    else:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = np.ones(size, np.uint8)
        for _ in range(count):
            writer.write(head.pack(size))
            writer.write(payload.data)
            await writer.drain()
        await asyncio.wait_for(reader.read(1), 60)
        writer.close()


def _socket(role: str, port: int, count: int, size: int, q: Any, tls: bool = False) -> None:
    server = TlsIdentity(SecretKey.from_seed(SEED, 0))
    client = TlsIdentity(SecretKey.from_seed(SEED, 1))
    if role == "recv":
        with socket.create_server(("127.0.0.1", port)) as srv:
            q.put("listening")
            conn, _ = srv.accept()
            if tls:
                ctx = server.server_context(client.cert_der)
                conn = ctx.wrap_socket(conn, server_side=True)
            buf = np.empty(size, np.uint8)
            view = buf.data.cast("B")
            start = 0.0
            for i in range(count):
                _recv_exactly(conn, view)
                if i == 0:
                    start = time.perf_counter()
            q.put((count - 1) * size / (time.perf_counter() - start))
            conn.sendall(b"k")
            conn.close()
    else:
        with socket.create_connection(("127.0.0.1", port)) as raw:
            s = client.client_context().wrap_socket(raw) if tls else raw
            payload = np.ones(size, np.uint8)
            for _ in range(count):
                s.sendall(payload.data)
            s.recv(1)


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``conn``; ConnectionError when the peer closes first."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        got += n


def _socket_both(role: str, port: int, count: int, size: int, q: Any, tls: bool) -> None:
    """Both ways at once: a sender and a receiver thread, one blocking connection each way
    (``port`` carries "recv" -> "send" traffic, ``port + 1`` the other way)."""
    me = TlsIdentity(SecretKey.from_seed(SEED, 0 if role == "recv" else 1))
    peer = TlsIdentity(SecretKey.from_seed(SEED, 1 if role == "recv" else 0))
    socks: list[socket.socket] = []
    if role == "recv":
        servers = [socket.create_server(("127.0.0.1", p)) for p in (port, port + 1)]
        q.put("listening")
        for srv in servers:
            conn, _ = srv.accept()
            srv.close()
            ctx = me.server_context(peer.cert_der)
            socks.append(ctx.wrap_socket(conn, server_side=True) if tls else conn)
        out, inc = socks
    else:
        for p in (port, port + 1):
            raw = socket.create_connection(("127.0.0.1", p))
            socks.append(me.client_context().wrap_socket(raw) if tls else raw)
        inc, out = socks
    payload = np.ones(size, np.uint8)
    buf = np.empty(size, np.uint8)
    view = buf.data.cast("B")

    def send_all() -> None:
        for _ in range(count):
            out.sendall(payload.data)

    start = time.perf_counter()
    sender = threading.Thread(target=send_all)
    sender.start()
    for _ in range(count):
        _recv_exactly(inc, view)
    sender.join()
    q.put(count * size / (time.perf_counter() - start))
    out.sendall(b"k")  # we have all of theirs; close once they have all of ours
    inc.recv(1)
    for sk in socks:
        sk.close()


def _worker(
    kind: str, role: str, port: int, count: int, size: int, q: Any, both: bool = False
) -> None:
    kind, uv, _ = kind.partition("+uv")  # "+uv": the same on uvloop
    loop = "uvloop" if uv else "asyncio"
    if kind in ("socket", "tls-socket"):
        run = _socket_both if both else _socket
        run(role, port, count, size, q, tls=kind == "tls-socket")
    elif kind == "streams":
        eventloop.run(_streams(role, port, count, size, q), loop=loop)
    elif kind in ("p2pdist-plain", "p2pdist-tls", "p2pdist-tlsrec"):
        run_p2p = _p2pdist_both if both else _p2pdist
        mode = kind.removeprefix("p2pdist-")
        eventloop.run(run_p2p(role, port, count, size, mode, q), loop=loop)
    else:
        raise ValueError(f"unknown kind {kind!r}")


def measure(kind: str, total: int, size: int, both: bool = False) -> float:
    """Bytes per second received by one process from another (``both``: each process
    sends and receives ``total`` bytes at once; bytes of one direction over the time the
    slower process took for both)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, count = (
        _port_pair() if both else pick_free_ports("127.0.0.1", 1)[0],
        max(2, total // size),
    )
    args = (port, count, size, q, both)
    # a worker that hangs or dies is killed, never waited for without a bound
    with children(grace=60) as procs:
        procs.append(ctx.Process(target=_worker, args=(kind, "recv", *args), name="receiver"))
        procs[0].start()
        if (got := wait_for(q, procs, 60, f"{kind} receiver start")) != "listening":
            raise RuntimeError(f"{kind} receiver: {got!r} instead of 'listening'")
        procs.append(ctx.Process(target=_worker, args=(kind, "send", *args), name="sender"))
        procs[1].start()
        rates = [float(wait_for(q, procs, 300, f"{kind} rate")) for _ in range(2 if both else 1)]
        return min(rates)


def _port_pair() -> int:
    """A free port whose successor is free too (the blocking kinds use both)."""
    for _ in range(100):
        (port,) = pick_free_ports("127.0.0.1", 1)
        if port < 65535:
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="total MiB per measurement")
    ap.add_argument("--size-mib", type=float, nargs="+", default=[0.25, 8.0])
    kinds = ["socket", "tls-socket", "streams", "p2pdist-plain", "p2pdist-tls"]
    if eventloop.uvloop_available():
        kinds += ["p2pdist-plain+uv", "p2pdist-tls+uv"]
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=kinds,
        choices=KINDS,
        metavar="KIND",
        help=f"columns, of: {' '.join(KINDS)} (a '+uv' suffix runs on uvloop; default: "
        f"{' '.join(kinds)})",
    )
    ap.add_argument(
        "--both-ways",
        action="store_true",
        help="each process sends and receives at once (as a world-2 ring does)",
    )
    args = ap.parse_args()
    kinds = args.kinds
    if any(k.endswith("+uv") for k in kinds) and not eventloop.uvloop_available():
        ap.error('--kinds ...+uv: uvloop is not installed here (pip install "p2pdist[fast]")')
    if args.both_ways:  # streams: one-way only
        kinds = [k for k in kinds if not k.startswith("streams")]
    if args.both_ways:
        print("throughput of each direction, both at once, GB/s (loopback, 2 processes)")
    else:
        print("one-way throughput, GB/s (loopback, 2 processes)")
    print(f"{'message':>10} " + " ".join(f"{k:>14}" for k in kinds))
    for mib in args.size_mib:
        size = int(mib * (1 << 20))
        rates = [measure(k, args.mib << 20, size, args.both_ways) / 1e9 for k in kinds]
        print(f"{mib:>7g}MiB " + " ".join(f"{r:>14.2f}" for r in rates))


if __name__ == "__main__":
    main()
