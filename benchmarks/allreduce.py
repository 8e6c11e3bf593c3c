"""All-reduce benchmark: p2pdist (TLS and plaintext) against torch.distributed Gloo and Open MPI.

Everything runs on 127.0.0.1 in the same invocation so the numbers are comparable:

* raw loopback TCP bandwidth (two processes, blocking sockets), one way and both ways
  at once;
* the exchange floor, when the smallest size is at most 64 KiB: that size swapped
  between two processes over loopback TCP and added in place, with blocking sockets and
  on each event loop, no library between (what a world-2 small all-reduce in Python
  cannot go under);
* for every world size, a p2pdist sweep per transport mode and a Gloo sweep, each in
  ``world`` fresh worker processes (``benchmarks/_allreduce_worker.py``).

Timing: per size, a few warm-up calls, a barrier, then timed calls (each backend's own
barrier before each call, untimed, lines the ranks up); each rank notes when it starts
each call and how long it takes, and a call's time runs from the last rank's start to the
last rank's end (every rank runs on this host: one clock); the tables show the median
over calls. The notes also give, for sizes up to 64 KiB and the barrier, the median of
each call's slowest rank, its wait for the others' start included. The
ratio columns are p2pdist's bus bandwidth over Gloo's, and in the barrier row Gloo's time
over p2pdist's: above 1, p2pdist is faster. The script exits with status 1 when anything
it ran failed (a backend's sweep, the TCP measurements, the exchange floor): the tables
then have holes, which the notes explain. A reference that is not there (torch, Open
MPI, or an Open MPI program that cannot be built) is skipped with a note instead.
``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n`` (the nccl-tests convention), in
GB/s (1e9 bytes per second). Sizes are bytes of float32 data. Both sides reduce in
place, as ``torch.distributed.all_reduce(t)`` always does: p2pdist is called as
``all_reduce(x, out=x)`` (``--out-of-place`` measures the call that returns a fresh array
instead); every rank refills its input before each call, outside the timer, with a
position-dependent pattern whose sums are exact small integers, and checks the whole
result of every timed call against the exact sum, outside the timer too (within a
tolerance for a wire that cannot carry it exactly: int8).

Every p2pdist mode runs on each event loop of ``--loop`` (default: asyncio and uvloop
when uvloop is installed; uvloop columns carry a ``+uv`` suffix), one loop right after the
other, so that they see the same machine load.

Usage::

    python benchmarks/allreduce.py [--world 2 4] [--sizes 4K 64K 1M 16M 64M] [--iters N]
                                   [--warmup N] [--rounds N] [--modes tls plaintext]
                                   [--loop asyncio uvloop] [--out-of-place] [--detail]
                                   [--arrays host|cuda]
                                   [--no-gloo] [--no-mpi] [--markdown]

(``-h`` lists the rest: ``--no-p2pdist``, ``--no-tcp``, ``--timeout``, ``--logdir``.)

Run it with an interpreter that has torch installed (``.bench-venv``) to get the Gloo
columns; without torch they are skipped with a note. Where ``mpicc`` and ``mpirun`` are
installed, Open MPI over TCP (``benchmarks/_mpi.py``) runs as a second reference, the
``ompi`` columns (``--no-mpi`` skips it).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _mpi
from _loops import add_loop_argument, chosen_loops

from p2pdist.launch import pick_free_ports

WORKER = Path(__file__).resolve().with_name("_allreduce_worker.py")
DEFAULT_SIZES = ["4K", "64K", "1M", "16M", "64M"]
DEFAULT_WORLDS = [2, 4]
DEFAULT_MODES = ["tls", "plaintext"]
BASE_MODES = [*DEFAULT_MODES, "tlsrec"]
"""``tlsrec``: TLS records all along (``sealed_records=False``), where ``tls`` moves to
AES-GCM records after the TLS handshake."""
VARIANTS: dict[str, dict[str, str]] = {
    "": {},
    "-det": {"mode": "deterministic"},
    "-f16": {"wire_dtype": "float16"},
    "-bf16": {"wire_dtype": "bfloat16"},
    "-int8": {"wire_dtype": "int8"},
    "-ring": {},
    "-pw": {},
}
"""Mode suffixes: how the all_reduce is called (deterministic, or a compressed wire), or
which algorithm large arrays take (``-ring``, ``-pw``: GroupConfig.algorithm "ring" or
"pairwise"; without either, "auto")."""
ALGORITHM_OF_VARIANT = {"-ring": "ring", "-pw": "pairwise"}
REFERENCES = ("gloo", "ompi")
"""Series names of the reference backends (every other series is a p2pdist mode)."""
LOOPS: dict[str, str] = {"asyncio": "", "uvloop": "+uv"}
"""Event loops and the suffix of their series names."""
TCP_TOTAL = 1 << 30
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


# --------------------------------------------------------------------------- helpers


def parse_size(text: str) -> int:
    """Parse ``4K``/``16M``/``1G``/``4096`` (binary units) into a byte count."""
    s = text.strip().upper()
    i = len(s)
    while i > 0 and not s[i - 1].isdigit():
        i -= 1
    if not s[:i].isdigit() or s[i:] not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 4K, 16M)")
    n = int(s[:i]) * _UNITS[s[i:]]
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} must be a positive multiple of 4")
    return n


def format_size(n: int) -> str:
    """Format a byte count with the largest exact binary unit (``64K``, ``16M``)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def default_iterations(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) iteration counts: many for small sizes, few for large ones."""
    if nbytes <= 16 << 10:
        return 20, 200
    if nbytes <= 256 << 10:
        return 10, 100
    if nbytes <= 4 << 20:
        return 5, 30
    if nbytes <= 32 << 20:
        return 3, 10
    return 2, 6


def free_ports(count: int) -> list[int]:
    """Reserve ``count`` distinct free TCP ports on 127.0.0.1 by binding port 0."""
    return pick_free_ports("127.0.0.1", count)


def torch_version() -> str | None:
    """Installed torch version, or None when torch is not importable."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch  # type: ignore[import-not-found,unused-ignore]
    except Exception:  # a broken install counts as absent
        return None
    return str(torch.__version__)


def p2pdist_group_error() -> str | None:
    """None when ``from p2pdist import Group`` works, else the reason it does not."""
    proc = subprocess.run(
        [sys.executable, "-c", "from p2pdist import Group"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def aead_speed(seconds: float = 0.3) -> float:
    """One core's AES-256-GCM encryption rate in GB/s on 64 KiB records (cryptography, as
    TLS-mode connections use it): TLS results are bounded by it as plaintext's are by
    loopback TCP, and it differs between hosts far more than memory bandwidth does."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, record, nonce = AESGCM(bytes(32)), bytes(1 << 16), bytes(12)
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(16):
            aead.encrypt(nonce, record, None)
        done += 16 * len(record)
    return done / elapsed / 1e9


# ------------------------------------------------------------------------ launching


class LaunchError(RuntimeError):
    """A group of worker processes failed or ran past its timeout."""


def launch(
    configs: list[dict[str, Any]], timeout: float, workdir: Path, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Start one worker per config, wait (bounded) for all, return their results.

    If any worker exits non-zero or the group runs past ``timeout`` seconds, all
    remaining workers are killed and :class:`LaunchError` carries the stderr tail.
    """
    procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    child_env = {**os.environ, **(env or {})}
    try:
        for i, cfg in enumerate(configs):
            tag = f"{cfg['role']}-{time.monotonic_ns()}-rank{i}"
            result = workdir / f"{tag}.json"
            log = workdir / f"{tag}.log"
            cfg = {**cfg, "result": str(result), "timeout": timeout}
            with log.open("wb") as fh:
                p = subprocess.Popen(
                    [sys.executable, str(WORKER), json.dumps(cfg)],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=child_env,
                )
            procs.append((p, result, log))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p, _, _ in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Give the other ranks a moment to fail on their own so that their
                # errors (often the root cause) land in their logs too.
                grace = time.monotonic() + 2.0
                while time.monotonic() < grace and any(p.poll() is None for p, _, _ in procs):
                    time.sleep(0.05)
                codes = [p.poll() for p, _, _ in procs]
                lines = [
                    f"rank {j} exit {c}: {_last_line(procs[j][2])}"
                    for j, c in enumerate(codes)
                    if c not in (None, 0)
                ]
                i = failed[0]
                raise LaunchError(
                    f"{configs[i]['role']}: " + "; ".join(lines) + "\n" + _tail(procs[i][2])
                )
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                stuck = [i for i, c in enumerate(codes) if c is None]
                raise LaunchError(
                    f"{configs[0]['role']}: timed out after {timeout:.0f}s waiting for"
                    f" ranks {stuck}\n" + _tail(procs[stuck[0]][2])
                )
            time.sleep(0.05)
        return [json.loads(result.read_text()) for _, result, _ in procs]
    finally:
        for p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def _last_line(path: Path) -> str:
    """Last non-empty line of a worker log (usually the exception message)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return text[-1] if text else "(empty log)"


def _tail(path: Path, lines: int = 25) -> str:
    """Last ``lines`` lines of a worker log, indented."""
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()[-lines:]
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in text) or "    (empty log)"


# --------------------------------------------------------------------------- running


@dataclass
class Point:
    """Result for one size: the median over calls of each call's time from the last rank's
    start to the last rank's end, seconds."""

    nbytes: int
    seconds: float
    world: int
    cpu: float | None = None
    """Process CPU seconds per call, max over ranks (None: not reported)."""
    spread: tuple[float, float] | None = None
    """The least and the greatest ``seconds`` over the rounds this point is the median of."""
    slowest: float | None = None
    """The median over calls of each call's slowest rank (its wait for the others to start
    included), seconds (None: not reported)."""

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth in GB/s."""
        return self.nbytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        """Bus bandwidth in GB/s (nccl-tests all-reduce convention)."""
        return self.algbw * 2 * (self.world - 1) / self.world


@dataclass
class Series:
    """One backend/mode at one world size: points by size, or why there are none."""

    name: str
    points: dict[int, Point] = field(default_factory=dict)
    error: str | None = None
    barrier: float | None = None
    """Barrier time, seconds, measured as :attr:`Point.seconds` is."""
    barrier_slowest: float | None = None
    """Barrier time as :attr:`Point.slowest` measures it."""


def median_of_rounds(rounds: list[Series]) -> Series:
    """One series from the same backend's rounds: per size, the median over rounds of
    the latency and of the CPU per call; failed if any round failed."""
    merged = Series(rounds[0].name)
    assert all(s.name == merged.name for s in rounds), [s.name for s in rounds]
    failed = [s.error for s in rounds if s.error]
    if failed:
        merged.error = failed[0]
        return merged
    for nbytes, first in rounds[0].points.items():
        points = [s.points[nbytes] for s in rounds]
        merged.points[nbytes] = Point(
            nbytes,
            statistics.median(p.seconds for p in points),
            first.world,
            _median_or_none([p.cpu for p in points]),
            (min(p.seconds for p in points), max(p.seconds for p in points)),
            _median_or_none([p.slowest for p in points]),
        )
    merged.barrier = _median_or_none([s.barrier for s in rounds])
    merged.barrier_slowest = _median_or_none([s.barrier_slowest for s in rounds])
    return merged


def _median_or_none(values: list[float | None]) -> float | None:
    """The median, or None when any round did not report the value."""
    return None if None in values else statistics.median(v for v in values if v is not None)


SPREAD_MAX_BYTES = 64 * 1024
"""Sizes up to this get their spread over rounds printed: latency-bound calls, whose
times (Gloo's most: 0.1 to 2.6 ms at 4 KiB on the 2-core host, by where the scheduler
put its ranks) can differ from round to round by more than the bar they are held to."""


def _per_small_size(
    sizes: list[int], series: list[Series], cell: Callable[[Point], str | None]
) -> list[str]:
    """``"4K: plaintext <cell>, gloo <cell>"`` per latency-bound size, for each series
    whose point there gives a cell."""
    parts: list[str] = []
    for nbytes in (n for n in sizes if n <= SPREAD_MAX_BYTES):
        cells = [
            f"{s.name} {text}"
            for s in series
            if (p := s.points.get(nbytes)) is not None and (text := cell(p)) is not None
        ]
        if cells:
            parts.append(f"{format_size(nbytes)}: " + ", ".join(cells))
    return parts


def small_spread(sizes: list[int], series: list[Series]) -> str:
    """``"4K: plaintext 40-52 us, gloo 137-2108 us; ..."`` for the latency-bound sizes."""

    def spread(p: Point) -> str | None:
        return None if p.spread is None else f"{p.spread[0] * 1e6:.0f}-{p.spread[1] * 1e6:.0f} us"

    return "; ".join(_per_small_size(sizes, series, spread))


def slowest_line(sizes: list[int], series: list[Series]) -> str:
    """The latency-bound sizes and the barrier measured by each call's slowest rank:
    ``"4K: plaintext 61 us, gloo 480 us; barrier: plaintext 52 us, gloo 250 us"``."""

    def slowest(p: Point) -> str | None:
        return None if p.slowest is None else f"{p.slowest * 1e6:.0f} us"

    parts = _per_small_size(sizes, series, slowest)
    barriers = [
        f"{s.name} {s.barrier_slowest * 1e6:.0f} us"
        for s in series
        if s.barrier_slowest is not None
    ]
    if barriers:
        parts.append("barrier: " + ", ".join(barriers))
    return "; ".join(parts)


def mpi_series(world: int, data: dict[str, Any]) -> Series:
    """The Open MPI sweep's result (its ranks' calls already lined up) as a series."""
    series = Series("ompi")
    for r in data["results"]:
        n = int(r["bytes"])
        slowest = float(r["slowest"])
        series.points[n] = Point(n, float(r["median"]), world, float(r["cpu"]), slowest=slowest)
    series.barrier = float(data["barrier"]["median"])
    series.barrier_slowest = float(data["barrier"]["slowest"])
    return series


def measure_tcp(workdir: Path, timeout: float) -> float:
    """Raw loopback TCP bandwidth in GB/s (sender-side time incl. final ack)."""
    (port,) = free_ports(1)
    base = {"port": port, "total": TCP_TOTAL}
    _recv, send = launch(
        [{**base, "role": "tcp-recv"}, {**base, "role": "tcp-send"}], timeout, workdir
    )
    return float(send["bytes"]) / float(send["seconds"]) / 1e9


def measure_tcp_both_ways(workdir: Path, timeout: float) -> float:
    """Raw loopback TCP bandwidth in GB/s each way, with both ways busy at once (half of
    ``TCP_TOTAL`` each way, a sending thread and a receiving one per end): the limit of a
    world-2 ring, whose ranks send and receive together on the same cores."""
    (port,) = free_ports(1)
    base = {"role": "tcp-duplex", "port": port, "total": TCP_TOTAL // 2}
    ends = launch([{**base, "side": 0}, {**base, "side": 1}], timeout, workdir)
    return float(ends[0]["bytes"]) / max(float(e["seconds"]) for e in ends) / 1e9


EXCHANGE_ITERS = 5000


def measure_exchange(workdir: Path, timeout: float, size: int, loop: str) -> float:
    """The floor under a small world-2 all-reduce in Python, in seconds: two processes
    swap ``size`` bytes over loopback TCP and add them in place, with no library between
    (``loop``: "blocking" sockets, or an event loop); the greater of the two medians."""
    (port,) = free_ports(1)
    base = {"role": "exchange", "port": port, "size": size, "iters": EXCHANGE_ITERS, "loop": loop}
    results = launch([{**base, "side": 0}, {**base, "side": 1}], timeout, workdir)
    return max(float(r["median"]) for r in results)


def exchange_line(workdir: Path, timeout: float, size: int, loops: list[str]) -> tuple[str, bool]:
    """The floor, measured on blocking sockets and on each event loop, as one line, and
    whether any of those measurements failed."""
    parts = []
    failed = False
    for loop in ["blocking", *loops]:
        try:
            parts.append(f"{loop} {measure_exchange(workdir, timeout, size, loop) * 1e6:.1f} us")
        except LaunchError as exc:
            parts.append(f"{loop} FAILED ({str(exc).splitlines()[0]})")
            failed = True
    line = (
        f"exchange floor ({format_size(size)} each way between two processes over loopback "
        f"TCP, then an in-place add: a world-2 small all-reduce in Python with no library "
        f"between): {', '.join(parts)}"
    )
    return line, failed


def last_start_to_last_end(per_rank: list[dict[str, Any]]) -> float:
    """The median over calls of the time from the last rank's start of a call to the last
    rank's end of it: the call from the moment every rank is in it. ``per_rank[r]`` has
    rank r's ``starts`` and ``times`` of each call; every rank runs on this host, so their
    clocks are one (CLOCK_MONOTONIC)."""
    starts = zip(*(r["starts"] for r in per_rank), strict=True)
    ends = zip(
        *([s + t for s, t in zip(r["starts"], r["times"], strict=True)] for r in per_rank),
        strict=True,
    )
    return statistics.median(max(e) - max(s) for s, e in zip(starts, ends, strict=True))


def slowest_rank_median(per_rank: list[dict[str, Any]]) -> float:
    """The median over calls of each call's slowest rank, its own time from its start to
    its end: a rank that starts before the others waits for them, so this counts how far
    apart the barrier before each call let the ranks go. (The greatest of the ranks'
    medians, which the tables showed until 2026-12-08, counts that wait only in part:
    the rank that waits longest changes from call to call.)"""
    calls = zip(*(r["times"] for r in per_rank), strict=True)
    return statistics.median(max(float(t) for t in call) for call in calls)


def run_series(
    name: str,
    role: str,
    world: int,
    sizes: list[int],
    warmup: list[int],
    iters: list[int],
    workdir: Path,
    timeout: float,
    extra: dict[str, Any],
    env: dict[str, str] | None = None,
) -> Series:
    """Run one all-reduce sweep in ``world`` processes and reduce it over ranks."""
    series = Series(name)
    configs = [
        {
            "role": role,
            "rank": r,
            "world": world,
            "sizes": sizes,
            "warmup": warmup,
            "iters": iters,
            **extra,
        }
        for r in range(world)
    ]
    t0 = time.monotonic()
    try:
        results = launch(configs, timeout, workdir, env)
    except LaunchError as exc:
        series.error = str(exc)
        print(f"  {name} world={world}: FAILED\n{exc}", file=sys.stderr, flush=True)
        return series
    try:
        for i, nbytes in enumerate(sizes):
            per_rank = [r["results"][i] for r in results]
            cpus = [c.get("cpu") for c in per_rank]
            cpu = max(float(c) for c in cpus) if None not in cpus else None
            seconds = last_start_to_last_end(per_rank)
            series.points[nbytes] = Point(
                nbytes, seconds, world, cpu, slowest=slowest_rank_median(per_rank)
            )
        if all("barrier" in r for r in results):
            barriers = [r["barrier"] for r in results]
            series.barrier = last_start_to_last_end(barriers)
            series.barrier_slowest = slowest_rank_median(barriers)
    except (KeyError, IndexError, ValueError, TypeError) as exc:  # a result not as written
        series.points.clear()
        series.error = f"unreadable worker result: {exc!r}"
        print(f"  {name} world={world}: FAILED\n{series.error}", file=sys.stderr, flush=True)
        return series
    print(
        f"  {name} world={world}: done in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True
    )
    return series


# -------------------------------------------------------------------------- printing


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.0f}"


def _lat(p: Point | None) -> str:
    return _us(p.seconds if p else None)


def _bw(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_table(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    """Render a right-aligned text table or a GitHub markdown table."""
    if markdown:
        out = [
            "| " + " | ".join(headers) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|",
        ]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(out)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def world_table(
    sizes: list[int],
    modes: list[Series],
    gloo: Series | None,
    markdown: bool,
    others: list[Series] | None = None,
) -> str:
    """Table for one world size: latency/busbw per backend (p2pdist modes, then Gloo and
    the ``others`` references) plus p2pdist/gloo ratios."""
    shown = [*modes, *([gloo] if gloo is not None else []), *(others or [])]
    headers = ["size"]
    for s in shown:
        headers += [f"{s.name} lat (us)", f"{s.name} busbw"]
    if gloo is not None:
        headers += [f"{s.name}/gloo" for s in modes]
    rows = []
    for n in sizes:
        row = [format_size(n)]
        for s in shown:
            p = s.points.get(n)
            row += [_lat(p), _bw(p.busbw if p else None)]
        if gloo is not None:
            gp = gloo.points.get(n)
            for s in modes:
                p = s.points.get(n)
                row.append("-" if p is None or gp is None else f"{p.busbw / gp.busbw:.2f}")
        rows.append(row)
    row = ["barrier"]
    for s in shown:
        row += [_us(s.barrier), ""]
    if gloo is not None:
        row += [
            "-" if s.barrier is None or gloo.barrier is None else f"{gloo.barrier / s.barrier:.2f}"
            for s in modes
        ]
    rows.append(row)
    return render_table(headers, rows, markdown)


def detail_table(sizes: list[int], series: list[Series], markdown: bool) -> str:
    """Per-backend table with latency, algbw, busbw and CPU per call for every size."""
    headers = ["backend", "size", "lat (us)", "algbw GB/s", "busbw GB/s", "cpu/rank (us)"]
    rows = []
    for s in series:
        for n in sizes:
            p = s.points.get(n)
            rows.append(
                [
                    s.name,
                    format_size(n),
                    _lat(p),
                    _bw(p.algbw if p else None),
                    _bw(p.busbw if p else None),
                    f"{p.cpu * 1e6:,.0f}" if p and p.cpu is not None else "-",
                ]
            )
    return render_table(headers, rows, markdown)


# ------------------------------------------------------------------------------ main


def run_round(
    args: argparse.Namespace,
    world: int,
    sizes: list[int],
    warmup: list[int],
    iters: list[int],
    workdir: Path,
    run_p2p: bool,
    run_gloo: bool,
    loops: list[str],
    mpi_binary: Path | None = None,
    start: int = 0,
) -> list[Series]:
    """Every p2pdist mode on every loop, Gloo, and Open MPI (with ``mpi_binary``), once
    each at ``world``; returned in that order, but run from the ``start``-th on (round
    robin), so that over rounds no backend always runs first or last while the host's
    speed drifts."""

    def sweep(
        name: str, role: str, extra: dict[str, Any], env: dict[str, str] | None = None
    ) -> Series:
        # Ports are picked as the sweep starts, not when the round is planned: minutes of
        # other sweeps' connections in between could take a port picked early.
        if role == "p2pdist":
            extra = {**extra, "peers": [f"127.0.0.1:{p}" for p in free_ports(world)]}
        elif role == "gloo":
            (port,) = free_ports(1)
            extra = {**extra, "port": port}
        return run_series(
            name, role, world, sizes, warmup, iters, workdir, args.timeout, extra, env
        )

    jobs: list[Callable[[], Series]] = []
    if run_p2p:
        seed = secrets.token_hex(32)
        for mode, loop in [(m, lp) for m in args.modes for lp in loops]:
            variant = mode[mode.find("-") :] if "-" in mode else ""
            extra = {
                "seed": seed,
                "tls": mode.startswith("tls"),
                "sealed_records": not mode.startswith("tlsrec"),
                "loop": loop,
                "out_of_place": args.out_of_place,
                "reduce_kwargs": VARIANTS[variant],
                "algorithm": ALGORITHM_OF_VARIANT.get(variant, "auto"),
                "arrays": args.arrays,
            }
            jobs.append(functools.partial(sweep, mode + LOOPS[loop], "p2pdist", extra))
    if run_gloo:
        gloo_cfg = {"arrays": args.arrays}
        gloo_env = {"GLOO_SOCKET_IFNAME": "lo"}
        jobs.append(functools.partial(sweep, "gloo", "gloo", gloo_cfg, env=gloo_env))
    if mpi_binary is not None and args.arrays == "host":
        plan = (mpi_binary, world, sizes, warmup, iters, workdir, args.timeout)
        jobs.append(functools.partial(_mpi_sweep, *plan))
    done: dict[int, Series] = {}
    for i in [(start + k) % len(jobs) for k in range(len(jobs))]:
        done[i] = jobs[i]()
    return [done[i] for i in range(len(jobs))]


def _mpi_sweep(
    binary: Path,
    world: int,
    sizes: list[int],
    warmup: list[int],
    iters: list[int],
    workdir: Path,
    timeout: float,
) -> Series:
    t0 = time.monotonic()
    plan = zip(sizes, warmup, iters, strict=True)
    try:
        data = _mpi.sweep(binary, world, plan, workdir, timeout)
    except (_mpi.MpiError, KeyError, ValueError) as exc:
        print(f"  ompi world={world}: FAILED\n{exc}", file=sys.stderr, flush=True)
        return Series("ompi", error=str(exc))
    print(f"  ompi world={world}: done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return mpi_series(world, data)


def source_commit() -> str:
    """`` (commit abc1234)`` of the checkout this script runs from, ``+`` when its tree has
    changes, or nothing outside a git checkout: the package version alone does not say
    which code a table measured."""
    git = ["git", "-C", str(Path(__file__).resolve().parent)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    if head.returncode != 0 or not head.stdout.strip():
        return ""
    changed = "+" if dirty.returncode == 0 and dirty.stdout.strip() else ""
    return f" (commit {head.stdout.strip()}{changed})"


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--world", type=int, nargs="+", default=DEFAULT_WORLDS, help="world sizes (default: 2 4)"
    )
    ap.add_argument(
        "--sizes",
        type=parse_size,
        nargs="+",
        default=[parse_size(s) for s in DEFAULT_SIZES],
        help="message sizes in bytes of float32 data (default: 4K 64K 1M 16M 64M)",
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed iterations for every size (default: per size, 200 down to 6)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up iterations for every size (default: per size, 20 down to 2)",
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=[f"{m}{v}" for m in BASE_MODES for v in VARIANTS],
        default=DEFAULT_MODES,
        help="p2pdist modes (default: tls plaintext; tlsrec = TLS records all along instead "
        "of AES-GCM records after the TLS handshake); suffix -det = deterministic, "
        "-f16/-bf16/-int8 = compressed wire, -ring/-pw = GroupConfig.algorithm ring/pairwise "
        "(default auto)",
    )
    add_loop_argument(ap, "event loops for p2pdist, each mode run on each")
    ap.add_argument(
        "--out-of-place",
        action="store_true",
        help="p2pdist calls return a fresh array (default: in place, out=x, as Gloo's)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every backend this many times, in turn (each round starting with the next "
        "one), and report the median over rounds of each cell, and the least and greatest "
        "times of sizes up to 64K (for a machine whose speed drifts; default 1)",
    )
    ap.add_argument(
        "--arrays",
        choices=["host", "cuda"],
        default="host",
        help="where the arrays live: host (numpy; torch CPU tensors for Gloo) or cuda "
        "(CuPy arrays for p2pdist, torch CUDA tensors for Gloo; each call's time then "
        "includes the copies between GPU and host, and Open MPI is skipped)",
    )
    ap.add_argument("--no-gloo", action="store_true", help="skip the torch Gloo reference")
    ap.add_argument("--no-mpi", action="store_true", help="skip the Open MPI (over TCP) reference")
    ap.add_argument("--no-p2pdist", action="store_true", help="skip p2pdist (baselines only)")
    ap.add_argument("--no-tcp", action="store_true", help="skip the raw TCP measurement")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    ap.add_argument(
        "--detail",
        action="store_true",
        help="also print per-backend tables with algbw and process CPU per call (max over ranks)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds allowed for each group of worker processes (default 300)",
    )
    ap.add_argument(
        "--logdir",
        type=Path,
        default=None,
        help="keep worker logs and result files in this folder (default: a temporary one)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the tables; returns the process exit status."""
    args = build_parser().parse_args(argv)
    import numpy as np

    sizes: list[int] = sorted(set(args.sizes))
    plan = [default_iterations(n) for n in sizes]
    warmup = [args.warmup if args.warmup is not None else w for w, _ in plan]
    iters = [args.iters if args.iters is not None else i for _, i in plan]
    if min(iters) < 1 or min(warmup) < 0 or args.rounds < 1:
        print("--iters and --rounds must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if args.arrays == "cuda" and not args.no_p2pdist and importlib.util.find_spec("cupy") is None:
        print(
            "--arrays cuda needs CuPy for p2pdist's arrays: pip install 'p2pdist[gpu]' "
            "(or pass --no-p2pdist)",
            file=sys.stderr,
        )
        return 2

    tv = torch_version()
    p2p_version = "?"
    try:
        from importlib.metadata import version

        p2p_version = version("p2pdist")
    except Exception:
        pass
    p2p_version += source_commit()
    notes: list[str] = []
    run_gloo = not args.no_gloo
    if run_gloo and tv is None:
        run_gloo = False
        notes.append(
            "gloo: skipped (torch is not importable in this interpreter; "
            "use .bench-venv/bin/python)"
        )
    mpi_note = None if args.no_mpi else _mpi.missing()
    if mpi_note is not None:
        notes.append(f"ompi: skipped ({mpi_note})")
    run_p2p = not args.no_p2pdist
    if run_p2p:
        err = p2pdist_group_error()
        if err is not None:
            run_p2p = False
            notes.append(f"p2pdist: skipped (`from p2pdist import Group` fails: {err})")

    cmd = (
        shlex.join(["python", *sys.argv])
        if argv is None
        else shlex.join(["python", "benchmarks/allreduce.py", *argv])
    )
    machine = (
        f"machine: {os.cpu_count()} CPUs ({cpu_model()}), "
        f"Python {platform.python_version()}, numpy {np.__version__}, "
        f"torch {tv or 'n/a'}, p2pdist {p2p_version}, {platform.system()} "
        f"{platform.release()}"
    )
    if hasattr(os, "getloadavg"):
        machine += ", load average {:.2f} {:.2f} {:.2f} at start".format(*os.getloadavg())
    loops = chosen_loops(args.loops)
    if args.loops is None and "uvloop" not in loops:
        notes.append('uvloop: skipped (not installed; pip install "p2pdist[fast]")')
    names = [f"{lp} ({LOOPS[lp] or 'no suffix'})" for lp in loops]
    machine += f"; event loops: {', '.join(names)}"
    out: list[str] = []
    failures: list[str] = []  # what ran and failed: the tables are then incomplete
    t_start = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="p2pdist-bench-") as tmp:
        workdir = Path(tmp)
        if args.logdir is not None:
            workdir = args.logdir
            workdir.mkdir(parents=True, exist_ok=True)
        tcp_line = "loopback TCP: skipped"
        if not args.no_tcp:
            print("measuring loopback TCP ...", file=sys.stderr, flush=True)
            try:
                gbps = measure_tcp(workdir, args.timeout)
                tcp_line = (
                    f"loopback TCP (1 stream, blocking sockets, 4 MiB sends, "
                    f"{TCP_TOTAL >> 30} GiB one way): {gbps:.2f} GB/s"
                )
            except LaunchError as exc:
                tcp_line = f"loopback TCP: FAILED ({exc})"
                failures.append("the loopback TCP measurement")
            try:
                both = measure_tcp_both_ways(workdir, args.timeout)
                tcp_line += (
                    f"; both ways at once ({TCP_TOTAL >> 21} MiB each way, a sending and a "
                    f"receiving thread per end): {both:.2f} GB/s each way"
                )
            except LaunchError as exc:
                tcp_line += f"; both ways at once: FAILED ({str(exc).splitlines()[0]})"
                failures.append("the loopback TCP measurement both ways")
        if run_p2p and any(m.startswith("tls") for m in args.modes):
            tcp_line += (
                f"; AES-256-GCM (one core, 64 KiB records, what tls mode encrypts with): "
                f"{aead_speed():.2f} GB/s"
            )
        floor_line = None
        if not args.no_tcp and sizes[0] <= SPREAD_MAX_BYTES:
            print("measuring the exchange floor ...", file=sys.stderr, flush=True)
            floor_line, floor_failed = exchange_line(workdir, args.timeout, sizes[0], loops)
            if floor_failed:
                failures.append("the exchange floor")

        mpi_binary: Path | None = None
        if not args.no_mpi and mpi_note is None:
            try:
                mpi_binary = _mpi.build(workdir)
                machine += f"; reference: {_mpi.version()} over TCP (ompi)"
            except (_mpi.MpiError, OSError, subprocess.SubprocessError) as exc:
                notes.append(f"ompi: skipped ({str(exc).splitlines()[0]})")
        tables: list[str] = []
        for world in args.world:
            if world < 2:
                print(f"skipping world {world} (< 2)", file=sys.stderr)
                continue
            plan = (args, world, sizes, warmup, iters, workdir, run_p2p, run_gloo, loops)
            rounds = [run_round(*plan, mpi_binary, start=r) for r in range(args.rounds)]
            all_series = [median_of_rounds(list(r)) for r in zip(*rounds, strict=True)]
            refs = {s.name: s for s in all_series if s.name in REFERENCES}
            mode_series = [s for s in all_series if s.name not in REFERENCES]
            gloo_series = refs.get("gloo")
            others = [refs["ompi"]] if "ompi" in refs else []
            title = f"#### world {world}\n\n" if args.markdown else f"== world {world} ==\n"
            table = world_table(sizes, mode_series, gloo_series, args.markdown, others)
            tables.append(title + table)
            if args.detail:
                tables.append(detail_table(sizes, all_series, args.markdown))
            for s in all_series:
                if s.error:
                    notes.append(f"{s.name} world={world}: failed ({s.error.splitlines()[0]})")
                    failures.append(f"{s.name} at world {world}")
            if args.rounds > 1 and (spread := small_spread(sizes, all_series)):
                notes.append(f"world {world}, least-greatest over the rounds: {spread}")
            if slowest := slowest_line(sizes, all_series):
                notes.append(f"world {world}, each call's slowest rank: {slowest}")

    out.append(f"command: {cmd}")
    out.append(machine)
    out.append(tcp_line)
    if floor_line is not None:
        out.append(floor_line)
    out.append(
        "timing: per size, warm-up then barrier then timed calls; latency = median over "
        "calls of the time from the last rank's start to the last rank's end (one clock: "
        "every rank on this host; the notes give each call's slowest rank too, its wait "
        "for the others' start included); "
        "busbw = bytes/time * 2(n-1)/n, GB/s = 1e9 B/s, bytes of float32 data (a "
        "compressed mode's wire carries fewer); "
        "ratios: p2pdist's busbw over Gloo's, barrier: Gloo's time over p2pdist's; "
        "input refilled before each call and every result checked, outside the timer; "
        + (
            "p2pdist out of place (a fresh result array per call), Gloo in place"
            if args.out_of_place
            else "both in place (p2pdist all_reduce(x, out=x), Gloo all_reduce(t))"
        )
        + (
            "; arrays on the GPU (p2pdist: CuPy, Gloo: torch CUDA tensors), each timed "
            "call ending when the device has the result"
            if args.arrays == "cuda"
            else ""
        )
        + (
            f"; {args.rounds} rounds, the backends in turn (each round starting with the "
            "next one), each cell the median over rounds"
            if args.rounds > 1
            else ""
        )
        + (
            "; Open MPI: MPI_Allreduce(MPI_IN_PLACE), TCP only (btl tcp,self on lo)"
            if mpi_binary is not None
            else ""
        )
    )
    out.append(
        "iterations (warm-up/timed): "
        + ", ".join(
            f"{format_size(n)} {w}/{i}" for n, w, i in zip(sizes, warmup, iters, strict=True)
        )
    )
    out += [f"note: {n}" for n in notes]
    sep = "\n\n"
    print(("  \n" if args.markdown else "\n").join(out) + sep + sep.join(tables), flush=True)
    print(f"\n(total wall time {time.monotonic() - t_start:.0f}s)", file=sys.stderr)
    if failures:
        print(f"FAILED: {', '.join(failures)} (see the notes)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
