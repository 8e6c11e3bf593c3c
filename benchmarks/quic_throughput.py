"""One-way throughput of QUIC between two processes on loopback, against its references.

Each row is one sender process and one receiver process; the receiver reports MB/s (10^6
bytes per second of payload). A bare row times from the first stream data to the last and
counts the bytes after the first event's; a p2pdist row times from the sender's "go"
message (every connection up) to the last message and counts every message's bytes.

* ``aioquic bare``: a minimal aioquic client and server (``aioquic.asyncio.connect`` /
  ``serve``) pushing one stream over UDP, with the same TLS and window settings: the
  ceiling of aioquic's packet machinery in this Python;
* ``p2pdist QUIC direct``: :class:`p2pdist.transport.quic.QuicTransport` over UDP;
* ``p2pdist QUIC relay``: the same through a relay (a local one this script starts, or
  the running one ``--relay URL`` names; ``--no-relay`` skips it), the relay sessions in
  AES-GCM records after the upgrade (the default; ``--relay-tls`` adds the same row with
  TLS throughout, ``RelayConfig(records=False)``, which also carries the relay frames in
  WebSocket frames, the framing a relay behind a TLS-terminating proxy uses);
* ``p2pdist TCP plain/TLS``: :class:`p2pdist.TcpTransport`, for reference;

then the variants tried to lift the QUIC ceiling (datagram size, receive window,
congestion controller, several connections per peer).

Every row runs on each event loop of ``--loop`` (default: asyncio and uvloop when uvloop
is installed), the loops interleaved run by run so that they see the same machine load;
the bare, direct and relay rows run back to back within each repeat (the ratios between
them compare runs of the same minute, and the relay/direct line also gives the median of
the per-repeat ratios), the other rows one after the other.
The relay row uses a relay process this script starts on 127.0.0.1 on the same loop as
the peers (``--relay URL`` uses a running relay instead; ``--no-relay`` skips the row).
``--mib`` must be a multiple of ``--msg-kib`` (the senders send whole messages).

Run: ``python benchmarks/quic_throughput.py [--mib 128] [--msg-kib 1024] [--loop asyncio uvloop]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import platform
import socket
import ssl
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from _loops import add_loop_argument, chosen_loops
from _procs import children, cpu_seconds, local_relay, wait_for
from aioquic.asyncio import QuicConnectionProtocol, connect, serve
from aioquic.quic.events import QuicEvent, StreamDataReceived

from p2pdist import SecretKey, TcpTransport, TransportConfig, eventloop
from p2pdist.launch import pick_free_ports
from p2pdist.tls import make_certificate
from p2pdist.transport.paths import SOCKET_BUFFER
from p2pdist.transport.punch import PunchConfig
from p2pdist.transport.quic import QuicTransport
from p2pdist.transport.quic_core import QuicConfig, quic_configuration

SEED = "quic-bench-seed-0123456789"
SERVER, CLIENT = SecretKey.from_seed(SEED, 0), SecretKey.from_seed(SEED, 1)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- bare aioquic -----------------------------------------------------------------------------


class _Sink(QuicConnectionProtocol):
    """Counts stream bytes; reports the rate once ``total`` arrived."""

    total = 0
    queue: Any = None
    finished: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.got = 0
        self.start = 0.0
        self._first = 0

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamDataReceived) and event.data:
            if self.got == 0:
                self.start = time.perf_counter()
            self.got += len(event.data)
            if self.got >= self.total:
                rate = (self.got - self._first) / (time.perf_counter() - self.start)
                self.queue.put(rate)
                self._quic.send_stream_data(event.stream_id, b"k", end_stream=True)
                self.transmit()
                self.finished.set()
            elif self.got == len(event.data):
                self._first = len(event.data)


async def _bare(role: str, port: int, total: int, size: int, qc: QuicConfig, q: Any) -> None:
    loop = asyncio.get_running_loop()
    if eventloop.loop_name(loop) == "uvloop":
        # aioquic's asyncio glue takes its clock from loop.time(), which counts whole
        # milliseconds on uvloop: give it time.monotonic, as p2pdist's QUIC does, so that
        # the bare row is not slowed by a coarse clock the p2pdist rows do not have.
        loop.time = time.monotonic  # type: ignore[method-assign]
    key = SERVER if role == "recv" else CLIENT
    cfg = quic_configuration(
        key,
        make_certificate(key),
        qc,
        is_client=role == "send",
        max_datagram=qc.loopback_datagram,
        idle_timeout=60,
        congestion_control=qc.congestion_control_for(direct=True, loopback=True)[0],
    )
    cfg.verify_mode = ssl.CERT_NONE
    if role == "recv":
        _Sink.total, _Sink.queue = total, q
        server = await serve("127.0.0.1", port, configuration=cfg, create_protocol=_Sink)
        _same_buffers(server._transport)  # as p2pdist's UDP sockets
        q.put("listening")
        _Sink.finished = asyncio.Event()
        await asyncio.wait_for(_Sink.finished.wait(), 300)
        await asyncio.sleep(0.2)  # let the answer leave
        server.close()
        return
    async with connect("127.0.0.1", port, configuration=cfg) as proto:
        _same_buffers(proto._transport)
        quic = proto._quic
        sid = quic.get_next_available_stream_id()
        payload = np.ones(size, np.uint8).tobytes()
        done = asyncio.get_running_loop().create_future()
        _Done.fut = done
        proto.quic_event_received = _Done.on_event  # type: ignore[method-assign]
        for _ in range(total // size):
            quic.send_stream_data(sid, payload)
        proto.transmit()
        await asyncio.wait_for(done, 300)


def _same_buffers(transport: Any) -> None:
    """Give a bare aioquic socket p2pdist's UDP buffer sizes: with the kernel's default
    (208 KiB here) the receiver drops datagrams that p2pdist's 4 MiB take, and the bare
    row would measure that, not aioquic."""
    sock = transport.get_extra_info("socket")
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


class _Done:
    fut: Any = None

    @staticmethod
    def on_event(event: QuicEvent) -> None:
        if isinstance(event, StreamDataReceived) and event.end_stream and not _Done.fut.done():
            _Done.fut.set_result(None)


# ---- p2pdist transports -----------------------------------------------------------------------


async def _p2pdist(
    role: str, kind: str, port: int, total: int, size: int, opts: dict[str, Any], q: Any
) -> None:
    nconn = int(opts.get("conns", 1))
    count = messages(total, size)
    per = [count // nconn + (i < count % nconn) for i in range(nconn)]  # messages per conn
    me = SERVER if role == "recv" else CLIENT
    if kind == "tcp":
        t: Any = TcpTransport(me, TransportConfig(tls=bool(opts["tls"])))
    else:
        relay = None
        if opts.get("relay"):
            from p2pdist.transport.relay_path import RelayConfig, RelayPath

            relay = RelayPath(
                me, opts["relay"], config=RelayConfig(records=opts.get("records", True))
            )
            await relay.wait_connected(30)
        # Through a relay, hole punching would move the peers to a direct path within
        # milliseconds on loopback: keep them on the relay, the path this row measures.
        punch = PunchConfig(enabled=relay is None)
        t = QuicTransport(me, relay=relay, quic=opts["quic"], punch=punch)
    address: Any = None if opts.get("relay") else ("127.0.0.1", port)
    if role == "recv":
        if address is not None:
            await t.listen("127.0.0.1", port)
        q.put("listening")
        conns = [await t.accept(timeout=60) for _ in range(nconn)]

        async def drain(c: Any, n: int) -> None:
            for _ in range(n):
                await c.recv(1, timeout=120)

        await asyncio.gather(*(c.recv(9, timeout=60) for c in conns))  # all connected
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(drain(c, n) for c, n in zip(conns, per, strict=True)))
        rate = count * size / (time.perf_counter() - start)
        cpu = time.process_time() - cpu
        if opts.get("relay"):
            info = t.paths()[CLIENT.endpoint_id]
            direct = sum(p.bytes_received for p in info.paths if p.kind == "direct")
            if info.kind != "relay" or direct:
                raise RuntimeError(f"the relay row left the relay: {info}")
        q.put({"rate": rate, "recv_cpu": cpu / (count * size)})
        for c in conns:
            await c.send(2, b"done")
            await c.recv(3, timeout=60)
    else:
        conns = [await t.connect(SERVER.endpoint_id, address) for _ in range(nconn)]
        for c in conns:
            await c.send(9, b"go")
        payload = np.ones(size, np.uint8)

        async def pump(c: Any, n: int) -> None:
            for _ in range(n):
                await c.send(1, payload)

        cpu = time.process_time()
        await asyncio.gather(*(pump(c, n) for c, n in zip(conns, per, strict=True)))
        for c in conns:  # "done" comes once everything arrived (in the receiver's order)
            await c.recv(2, timeout=120)
            await c.send(3, b"bye")
        q.put({"send_cpu": (time.process_time() - cpu) / (count * size)})
    await t.close()


def messages(total: int, size: int) -> int:
    """Messages of ``size`` bytes a p2pdist row sends for ``total`` bytes (two at least)."""
    return max(2, total // size)


def _worker(
    kind: str, role: str, port: int, total: int, size: int, opts: dict[str, Any], q: Any
) -> None:
    loop = opts.get("loop", "asyncio")
    if kind == "bare":
        eventloop.run(_bare(role, port, total, size, opts["quic"], q), loop=loop)
    else:
        eventloop.run(_p2pdist(role, kind, port, total, size, opts, q), loop=loop)


_CPU_KEYS = (("sender", "send_cpu"), ("receiver", "recv_cpu"), ("relay", "relay_cpu"))


def measure(kind: str, total: int, size: int, relay_pid: int = 0, **opts: Any) -> dict[str, float]:
    """Payload bytes per second received by one process from another ("rate"); for
    p2pdist kinds also CPU seconds per payload byte of the receiver ("recv_cpu"), the
    sender ("send_cpu") and, with ``relay_pid``, the relay process ("relay_cpu")."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = pick_free_ports("127.0.0.1", 1)[0] if kind == "tcp" else _free_udp_port()
    args = (port, total, size, opts, q)
    with children(grace=60) as procs:  # both are killed when the row fails
        procs.append(ctx.Process(target=_worker, args=(kind, "recv", *args), name="receiver"))
        procs[0].start()
        if (got := wait_for(q, procs, 60, "receiver start")) != "listening":
            raise RuntimeError(f"receiver: {got!r} instead of 'listening'")
        procs.append(ctx.Process(target=_worker, args=(kind, "send", *args), name="sender"))
        relay_cpu = cpu_seconds(relay_pid) if relay_pid else 0.0
        procs[1].start()
        got = wait_for(q, procs, 600, "rate")
        result = dict(got) if isinstance(got, dict) else {"rate": float(got)}
        if kind != "bare":
            result.update(wait_for(q, procs, 120, "sender CPU"))
        if relay_pid:  # the whole run, connection set-up included: slightly high
            moved = messages(total, size) * size  # what the senders send, as above
            result["relay_cpu"] = (cpu_seconds(relay_pid) - relay_cpu) / moved
        return result


def median_run(runs: list[dict[str, float]]) -> tuple[float, dict[str, float]]:
    """The median of the runs' rates (the mean of the middle two for an even count) and
    the run whose rate is nearest to it (the one whose CPU figures are shown)."""
    rate = statistics.median(m["rate"] for m in runs)
    return rate, min(runs, key=lambda m: abs(m["rate"] - rate))


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB per measurement")
    ap.add_argument("--msg-kib", type=int, default=1024, help="message size, KiB")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row (the median is shown)")
    ap.add_argument("--relay", help="use this running relay for the relay row (any loop)")
    ap.add_argument("--no-relay", action="store_true", help="skip the relay row")
    ap.add_argument(
        "--relay-tls",
        action="store_true",
        help="also run the relay row with TLS throughout (no AES-GCM records after the "
        "upgrade, so the relay frames travel in WebSocket frames, as behind a reverse "
        "proxy), back to back with the others",
    )
    ap.add_argument("--quick", action="store_true", help="only the main rows")
    add_loop_argument(ap, "event loops to measure, interleaved")
    args = ap.parse_args()
    args.loops = chosen_loops(args.loops)
    total, size = args.mib << 20, args.msg_kib << 10
    if size <= 0 or total <= 0 or total % size:
        ap.error("--mib must be a positive multiple of --msg-kib (whole messages are sent)")
    base = QuicConfig()
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("aioquic bare (same settings)", "bare", {"quic": base}),
        ("p2pdist QUIC direct", "quic", {"quic": base}),
    ]
    if not args.no_relay:
        rows.append(("p2pdist QUIC relay", "quic", {"quic": base, "relay": args.relay or "local"}))
        if args.relay_tls:
            tls_only = {"quic": base, "relay": args.relay or "local", "records": False}
            rows.append(("p2pdist QUIC relay, TLS+WebSocket", "quic", tls_only))
    main_rows = len(rows)  # run back to back in each repeat (see below)
    rows += [
        ("p2pdist TCP plaintext", "tcp", {"tls": False}),
        ("p2pdist TCP TLS", "tcp", {"tls": True}),
    ]
    if not args.quick:
        for d in (1452, 4096, 8192):
            q = replace(base, loopback_datagram=d)
            rows.append((f"  aioquic bare, {d} B datagrams", "bare", {"quic": q}))
            rows.append((f"  QUIC direct, {d} B datagrams", "quic", {"quic": q}))
        for w in (4, 64):
            q = replace(base, stream_window=w << 20, connection_window=max(64, w) << 20)
            rows.append((f"  QUIC direct, {w} MiB stream window", "quic", {"quic": q}))
        q = replace(base, congestion_control="cubic")
        rows.append(("  QUIC direct, cubic", "quic", {"quic": q}))
        for n in (2, 4):
            rows.append((f"  QUIC direct, {n} connections", "quic", {"quic": base, "conns": n}))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.no_relay:
        relay_note = ""
    elif args.relay:
        relay_note = f"; relay: the running relay at {args.relay}"
    else:
        relay_note = (
            "; relay: a local relay process on the same loop as the peers "
            "(a third process on the same cores)"
        )
    print(
        f"command: python {' '.join(sys.argv)}\n"
        f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {load} at start\n"
        f"one-way throughput, MB/s, median of {args.repeat} (loopback, 2 processes, "
        f"{args.mib} MiB in {args.msg_kib} KiB messages; QUIC defaults: "
        f"{base.loopback_datagram} B datagrams, {base.stream_window >> 20} MiB stream window, "
        f"{base.congestion_control}); loops interleaved run by run, bare/direct/relay "
        f"back to back in each repeat; ratio: against bare "
        f"aioquic, same datagram size and loop{relay_note}",
        flush=True,
    )
    bare: dict[tuple[int, str], float] = {}
    per_run: dict[tuple[str, str], list[float]] = {}
    direct: dict[str, float] = {}
    relayed: dict[str, float] = {}
    relayed_tls: dict[str, float] = {}
    cpu_rows: dict[tuple[str, str], dict[str, float]] = {}
    tmp = tempfile.TemporaryDirectory(prefix="p2pdist-quic-bench-")
    with tmp, contextlib.ExitStack() as stack:
        relays: dict[str, tuple[str, int]] = {}
        if not args.no_relay:
            for loop in args.loops:
                relays[loop] = (
                    (args.relay, 0)
                    if args.relay
                    else stack.enter_context(local_relay(loop, Path(tmp.name)))
                )
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        failed: dict[str, Exception] = {}

        def run_once(name: str, kind: str, opts: dict[str, Any], loop: str) -> None:
            if name in failed:
                return
            o = {**opts, "loop": loop}
            if "relay" in o:
                o["relay"], o["relay_pid"] = relays[loop]
            try:
                runs.setdefault((name, loop), []).append(measure(kind, total, size, **o))
            except Exception as exc:  # one failing row must not hide the others
                failed[name] = exc

        # The rows the ratios compare (bare, direct, relay) run back to back within each
        # repeat, so that each ratio compares runs of the same minute; the others row by row.
        together = rows[:main_rows]
        for _ in range(args.repeat):
            for loop in args.loops:
                for name, kind, opts in together:
                    run_once(name, kind, opts, loop)
        for name, kind, opts in rows[main_rows:]:
            for _ in range(args.repeat):
                for loop in args.loops:
                    run_once(name, kind, opts, loop)
        for name, kind, opts in rows:
            if name in failed:
                print(f"{name:<40} failed: {failed[name]!r}", flush=True)
                continue
            for loop in args.loops:
                r = sorted(m["rate"] / 1e6 for m in runs[name, loop])
                rate, middle = median_run(runs[name, loop])
                rate /= 1e6
                if kind == "quic" and "conns" not in opts and opts["quic"] == base:
                    cpu_rows[name, loop] = middle
                dgram = opts["quic"].loopback_datagram if "quic" in opts else 0
                if kind == "bare":
                    bare[dgram, loop] = rate
                elif kind == "quic" and "conns" not in opts and opts["quic"] == base:
                    which, table = ("relay", relayed) if "relay" in opts else ("direct", direct)
                    if opts.get("records") is False:
                        which, table = "relay, TLS+WebSocket", relayed_tls
                    table[loop] = rate
                    per_run[which, loop] = [m["rate"] for m in runs[name, loop]]
                ref = bare.get((dgram, loop))
                ratio = f"  {rate / ref:5.2f}x bare" if ref and kind == "quic" else ""
                spread = f"  ({r[0]:.0f}..{r[-1]:.0f})"
                label = f"{name} [{loop}]"
                print(f"{label:<50} {rate:9.1f}{ratio}{spread}", flush=True)
    if cpu_rows:
        print(
            "CPU per MB moved (ms of CPU time per 10^6 payload bytes, from the run nearest "
            "the median; "
            "the relay's includes connection set-up):"
        )
        for (name, loop), m in cpu_rows.items():
            parts = [f"{who} {m[k] * 1e9:5.2f}" for who, k in _CPU_KEYS if k in m]
            print(f"  {name + f' [{loop}]':<48} " + "  ".join(parts), flush=True)
    for loop in args.loops:
        if loop in direct and loop in relayed:
            pairs = zip(per_run["relay", loop], per_run["direct", loop], strict=False)
            each = statistics.median(a / b for a, b in pairs)
            print(
                f"relay / direct QUIC [{loop}]: {relayed[loop] / direct[loop]:.2f}x; "
                f"median of the per-repeat ratios {each:.2f}x (bar: at least 0.6x)",
                flush=True,
            )
        if loop in direct and loop in relayed_tls:
            pairs = zip(
                per_run["relay, TLS+WebSocket", loop], per_run["direct", loop], strict=False
            )
            each = statistics.median(a / b for a, b in pairs)
            print(
                f"relay (TLS+WebSocket) / direct QUIC [{loop}]: "
                f"{relayed_tls[loop] / direct[loop]:.2f}x; median of the per-repeat ratios "
                f"{each:.2f}x",
                flush=True,
            )
    if len(args.loops) == 2:
        a, b = args.loops
        for what, table in (("direct", direct), ("relay", relayed)):
            if a in table and b in table:
                print(f"QUIC {what}: {b} / {a} = {table[b] / table[a]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
