"""``p2pdist demo``: a self-checking tour of the library on one machine.

``p2pdist demo [-n 4] [--plaintext] [--steps 30]`` starts ``n`` ranks as separate
processes through the launcher (:mod:`p2pdist.launch`), all on 127.0.0.1 with no outside
server. Each rank runs this module with ``--worker`` and

1. checks the core collectives against numpy (all_reduce with every op on several dtypes and
   shapes, including a non-contiguous input, an array smaller than the world, an empty
   array and arrays large enough for the ring path; reduce_scatter, all_gather,
   broadcast, barrier, and send/recv around the ring). Rank ``r``'s inputs come from
   ``numpy.random.default_rng(seed + r)``, so every rank can compute every reference;
2. trains a linear regression by data-parallel SGD, each rank on its own shard, with the
   gradients averaged by ``all_reduce(op="mean")``, and shows that the final parameters
   are bitwise identical on all ranks (while local-only training disagrees);
3. measures the latency of a small all_reduce and the bandwidth of a large one.

Rank 0 prints the table; every rank prints one summary line. The exit status is non-zero
when any check failed on any rank.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from . import eventloop
from .errors import P2PError, UsageError
from .group import Group, GroupConfig
from .launch import LaunchConfig, launch

__all__ = ["CheckResult", "main", "run_checks", "train_sgd"]

_NAME = 46  # width of the check-name column
_FLOAT_OPS = ("sum", "mean", "max", "min", "prod")
_INT_OPS = ("sum", "max", "min", "prod")
_REDUCE: dict[str, np.ufunc] = {
    "sum": np.add,
    "mean": np.add,
    "max": np.maximum,
    "min": np.minimum,
    "prod": np.multiply,
}

Maker = Callable[[np.random.Generator], np.ndarray]
"""Makes one rank's input for a check from that rank's generator."""
T = TypeVar("T")


@dataclass(frozen=True)
class CheckResult:
    """One check: its name, whether it passed, a detail and how long the call took."""

    name: str
    ok: bool
    detail: str = ""
    seconds: float | None = None

    def line(self) -> str:
        """The table row, e.g. ``[check] all_reduce sum float32[5,7]  ok  0.4 ms``."""
        status = "ok" if self.ok else "FAIL"
        took = "" if self.seconds is None else f"{self.seconds * 1e3:7.1f} ms"
        return f"[check] {self.name:<{_NAME}} {status:<4} {took:>10}  {self.detail}".rstrip()


async def _timed(call: Awaitable[T]) -> tuple[T, float]:
    """What ``call`` returns, and how many seconds it took."""
    t0 = time.perf_counter()
    result = await call
    return result, time.perf_counter() - t0


def _describe(a: np.ndarray) -> str:
    return f"{a.dtype}[{','.join(str(s) for s in a.shape)}]"


def _random(
    dtype: Any, shape: tuple[int, ...], *, op: str = "sum", noncontig: bool = False
) -> Maker:
    """A maker of random arrays suited to ``op`` (products stay near 1 or small)."""
    dt = np.dtype(dtype)
    full = (*shape[:-1], 2 * shape[-1]) if noncontig else shape

    def make(rng: np.random.Generator) -> np.ndarray:
        if dt.kind == "f":
            if op == "prod":
                a = rng.uniform(0.5, 1.5, full).astype(dt)
            else:
                a = rng.standard_normal(full, dtype=np.float64).astype(dt)
        else:
            a = rng.integers(-3, 4, full) if op == "prod" else rng.integers(-1000, 1000, full)
            a = a.astype(dt)
        return a[..., ::2] if noncontig else a

    return make


def _reference(op: str, inputs: Sequence[np.ndarray]) -> tuple[np.ndarray, float]:
    """The reduction of ``inputs`` and the largest rounding error a correct one may have.

    Integers and max/min are exact (integer sum/prod wrap identically in any order);
    floating sums and products are computed in float64 with an error bound for ``dtype``.
    """
    stack = np.stack(inputs)
    dtype = stack.dtype
    n = len(inputs)
    if op in ("max", "min") or dtype.kind != "f":
        return _REDUCE[op].reduce(stack, axis=0, dtype=dtype), 0.0
    wide = stack.astype(np.float64)
    want = _REDUCE[op].reduce(wide, axis=0)
    if op == "mean":
        want = want / n
    if not want.size:
        return want, 0.0
    if op == "prod":
        scale = float(np.max(np.abs(want)))
    else:
        scale = float(np.max(np.sum(np.abs(wide), axis=0)))
    return want, 4 * n * float(np.finfo(dtype).eps) * max(scale, 1e-30)


def _compare(got: np.ndarray, want: np.ndarray, dtype: np.dtype[Any], bound: float) -> str:
    """An empty string when ``got`` matches ``want`` within ``bound``, else the reason."""
    if got.dtype != dtype or got.shape != want.shape:
        return f"got {_describe(got)}, expected {dtype}[{','.join(map(str, want.shape))}]"
    if bound == 0.0:
        return "" if np.array_equal(got, want) else "values differ"
    err = float(np.max(np.abs(got.astype(np.float64) - want))) if got.size else 0.0
    return "" if err <= bound else f"max error {err:.3g} > bound {bound:.3g}"


class Checker:
    """Runs the collective checks of one rank and records their results."""

    def __init__(self, g: Group, seed: int, *, corrupt: bool = False) -> None:
        self.g = g
        self.rngs = [np.random.default_rng(seed + r) for r in range(g.size)]
        self.results: list[CheckResult] = []
        self.corrupt = corrupt
        """Feed a wrong input to the first all_reduce (to test that failures are caught)."""

    def draw(self, make: Maker) -> list[np.ndarray]:
        """Every rank's input for the next check (same sequence on every rank)."""
        return [make(rng) for rng in self.rngs]

    def record(self, name: str, problem: str, seconds: float, detail: str = "") -> None:
        """Store a result; rank 0 prints every row, other ranks only failures."""
        res = CheckResult(name, not problem, problem or detail, seconds)
        self.results.append(res)
        if self.g.rank == 0 or not res.ok:
            print(res.line(), flush=True)

    async def _agree(self, got: np.ndarray) -> str:
        """Whether every rank holds the same bytes as ``got`` (via all_gather)."""
        stacked = await self.g.all_gather(got)
        same = all(stacked[r].tobytes() == got.tobytes() for r in range(self.g.size))
        return "" if same else "ranks hold different bits"

    async def all_reduce(self, op: str, make: Maker, note: str = "") -> None:
        """all_reduce(op) of random inputs against numpy, plus cross-rank bit agreement."""
        inputs = self.draw(make)
        mine = inputs[self.g.rank]
        if self.corrupt:
            self.corrupt = False
            mine = mine + 1
        before = mine.copy()
        got, seconds = await _timed(self.g.all_reduce(mine, op=op))
        want, bound = _reference(op, inputs)
        problem = _compare(got, want, mine.dtype, bound)
        if not problem and not np.array_equal(mine, before):
            problem = "the input was modified"
        problem = problem or await self._agree(got)
        name = f"all_reduce {op} {_describe(mine)}{note}"
        self.record(name, problem, seconds, "bitwise equal on all ranks")

    async def reduce_scatter(self, op: str, make: Maker, note: str = "") -> None:
        """reduce_scatter(op) against ``array_split(reduced, size)[rank]``."""
        inputs = self.draw(make)
        mine = inputs[self.g.rank]
        got, seconds = await _timed(self.g.reduce_scatter(mine, op=op))
        full, bound = _reference(op, inputs)
        want = np.array_split(full, self.g.size, axis=0)[self.g.rank]
        problem = _compare(got, want, mine.dtype, bound)
        name = f"reduce_scatter {op} {_describe(mine)}{note}"
        self.record(name, problem, seconds, f"this rank's piece {_describe(got)}")

    async def all_gather(self, make: Maker, note: str = "") -> None:
        """all_gather against ``np.stack`` of every rank's input (exact)."""
        inputs = self.draw(make)
        mine = inputs[self.g.rank]
        got, seconds = await _timed(self.g.all_gather(mine))
        problem = _compare(got, np.stack(inputs), mine.dtype, 0.0)
        self.record(f"all_gather {_describe(mine)}{note}", problem, seconds)

    async def broadcast(self, make: Maker, src: int, note: str = "") -> None:
        """broadcast from ``src`` (exact)."""
        inputs = self.draw(make)
        mine = inputs[self.g.rank]
        got, seconds = await _timed(self.g.broadcast(mine, src=src))
        problem = _compare(got, inputs[src], mine.dtype, 0.0)
        self.record(f"broadcast src={src} {_describe(mine)}{note}", problem, seconds)

    async def barrier(self) -> None:
        """A barrier returns on every rank."""
        _, seconds = await _timed(self.g.barrier())
        self.record("barrier", "", seconds)

    async def ring_send_recv(self, make: Maker, how: str) -> None:
        """Each rank sends to ``rank + 1`` and receives from ``rank - 1`` (exact)."""
        inputs = self.draw(make)
        g = self.g
        mine = inputs[g.rank]
        dst, src = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        expect = inputs[src]
        out = np.empty_like(expect)
        if how == "like":
            receive = g.recv(src, like=expect)
        elif how == "out":
            receive = g.recv(src, out=out)
        else:
            receive = g.recv(src, shape=expect.shape, dtype=expect.dtype)
        (_, got), seconds = await _timed(asyncio.gather(g.send(mine, dst), receive))
        problem = _compare(got, expect, expect.dtype, 0.0)
        if how == "out" and got is not out:
            problem = problem or "recv(out=) did not return out"
        self.record(f"send/recv ring {_describe(mine)} ({how}=)", problem, seconds)


async def run_checks(g: Group, seed: int, *, corrupt: bool = False) -> list[CheckResult]:
    """Check the core collectives of ``g`` against numpy; return this rank's results.

    ``corrupt=True`` makes this rank contribute a wrong input to the first all_reduce, so
    that check fails on every rank (a test of the checking itself).
    """
    c = Checker(g, seed, corrupt=corrupt)
    n = g.size
    f32, f64, i32, i64 = np.float32, np.float64, np.int32, np.int64
    for op in _FLOAT_OPS:
        await c.all_reduce(op, _random(f32, (5, 7), op=op))
        await c.all_reduce(op, _random(f64, (33,), op=op))
    for op in _INT_OPS:
        await c.all_reduce(op, _random(i32, (4, 3), op=op))
        await c.all_reduce(op, _random(i64, (9,), op=op))
    await c.all_reduce("sum", _random(f32, (6, 4), noncontig=True), " non-contiguous")
    small = max(1, n - 1)
    await c.all_reduce("sum", _random(f64, (small,)), " < world" if small < n else "")
    await c.all_reduce("max", _random(i64, (small,)), " < world" if small < n else "")
    await c.all_reduce("sum", _random(f32, (0,)), " empty")
    await c.all_reduce("mean", _random(f32, (0, 3)), " empty")
    await c.all_reduce("sum", _random(f32, (70_001,)), " ring")
    await c.all_reduce("mean", _random(f64, (150, 101)), " ring")
    await c.all_reduce("max", _random(i64, (20_000,)), " ring")
    await c.all_reduce("sum", _random(f32, (1 << 22,)), " ring, multi-chunk")
    await c.reduce_scatter("sum", _random(f32, (3 * n + 1, 5)))
    await c.reduce_scatter("max", _random(i32, (small, 2)), " rows < world" if small < n else "")
    await c.reduce_scatter("mean", _random(f64, (0, 4)), " empty")
    await c.reduce_scatter("sum", _random(f32, (1000, 37)), " ring")
    await c.all_gather(_random(f32, (3, 4)))
    await c.all_gather(_random(i64, (0,)), " empty")
    await c.all_gather(_random(f32, (40, 30), noncontig=True), " non-contiguous")
    await c.all_gather(_random(f64, (20_000,)), " ring")
    await c.broadcast(_random(f64, (2, 3)), src=0)
    await c.broadcast(_random(i32, (1000,)), src=n - 1)
    await c.broadcast(_random(f32, (0, 2)), src=n // 2, note=" empty")
    await c.broadcast(_random(f64, (300_000,)), src=n // 2, note=" chain")
    await c.barrier()
    if n > 1:
        await c.ring_send_recv(_random(f32, (3, 5)), "like")
        await c.ring_send_recv(_random(i64, (0,)), "shape")
        await c.ring_send_recv(_random(f64, (400_000,)), "out")
    return c.results


@dataclass(frozen=True)
class SgdResult:
    """What the data-parallel run ended with (as seen by this rank)."""

    losses: list[float]
    spread: float
    bitwise_equal: bool
    distance: float
    local_spread: float
    seconds: float


async def train_sgd(g: Group, seed: int, steps: int, *, dim: int = 16) -> SgdResult:
    """Data-parallel SGD on y = X w* + noise, each rank on its own shard.

    Gradients are averaged with ``all_reduce(op="mean")``; alongside, a local-only model
    is trained without any reduction (the guard: its weights must differ across ranks).
    """
    w_star = np.random.default_rng([seed, 0]).standard_normal(dim).astype(np.float32)
    rng = np.random.default_rng([seed, 1, g.rank])  # a different shard per rank
    shift = rng.normal(0.0, 0.1, dim)  # and slightly different feature statistics
    x = (rng.standard_normal((256, dim)) + shift).astype(np.float32)
    y = x @ w_star + np.float32(0.1) * rng.standard_normal(256).astype(np.float32)
    lr = np.float32(0.5)
    w = np.zeros(dim, np.float32)
    w_local = np.zeros(dim, np.float32)
    losses: list[float] = []
    if g.rank == 0:
        print(
            f"[sgd] linear regression, {dim} features, {len(y)} samples on each of {g.size} "
            f"ranks (different shards), lr {lr}, gradients all_reduce(op='mean')",
            flush=True,
        )
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        resid = x @ w - y
        grad = x.T @ resid / np.float32(len(y))
        local = np.array([0.5 * np.mean(resid * resid)], np.float32)
        loss = float((await g.all_reduce(local, op="mean"))[0])
        w -= lr * await g.all_reduce(grad, op="mean")
        w_local -= lr * (x.T @ (x @ w_local - y) / np.float32(len(y)))
        losses.append(loss)
        if g.rank == 0:
            print(f"[sgd] step {step:3d}/{steps}  global loss {loss:.6f}", flush=True)
    seconds = time.perf_counter() - t0
    every = await g.all_gather(w)
    locals_ = await g.all_gather(w_local)
    return SgdResult(
        losses=losses,
        spread=float(np.max(np.abs(every - every[0]))),
        bitwise_equal=all(every[r].tobytes() == w.tobytes() for r in range(g.size)),
        distance=float(np.linalg.norm(w - w_star)),
        local_spread=float(np.max(np.abs(locals_ - locals_[0]))),
        seconds=seconds,
    )


async def measure(g: Group, bench_mib: int) -> tuple[float, float, bool]:
    """Median seconds of a 4-byte all_reduce, of a ``bench_mib`` MiB one, and whether the
    large one summed correctly."""
    tiny = np.ones(1, np.float32)
    for _ in range(5):
        await g.all_reduce(tiny)
    await g.barrier()
    small_times = []
    for _ in range(50):
        t0 = time.perf_counter()
        await g.all_reduce(tiny)
        small_times.append(time.perf_counter() - t0)
    big = np.full((bench_mib << 20) // 4, g.rank + 1, np.float32)
    out = np.empty_like(big)
    await g.all_reduce(big, out=out)  # warm-up
    await g.barrier()
    big_times = []
    for _ in range(3):
        t0 = time.perf_counter()
        await g.all_reduce(big, out=out)
        big_times.append(time.perf_counter() - t0)
    correct = bool(np.all(out == np.float32(g.size * (g.size + 1) // 2)))
    return statistics.median(small_times), statistics.median(big_times), correct


def _sent_bytes(g: Group) -> int:
    return sum(g.connection(r).stats.bytes_sent for r in range(g.size) if r != g.rank)


async def _worker(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    g = Group.from_env(config=GroupConfig(timeout=60.0, connect_timeout=60.0))
    async with g:
        n, rank = g.size, g.rank
        t_formed = time.perf_counter() - t_start
        if rank == 0:
            mode = "TLS 1.3" if g.config.transport.tls else "authenticated plaintext"
            print(f"[group] {n} ranks formed in {t_formed:.2f} s ({mode})", flush=True)
        results = await run_checks(g, args.seed, corrupt=rank == args.corrupt_rank)
        failed = sum(not r.ok for r in results)
        sgd = await train_sgd(g, args.seed, args.steps)
        sgd_checks = [
            ("sgd parameters bitwise identical", sgd.bitwise_equal and sgd.spread == 0.0),
            ("sgd loss decreased", len(sgd.losses) < 2 or sgd.losses[-1] < sgd.losses[0]),
            ("sgd guard: local-only weights differ", n == 1 or sgd.local_spread > 0.0),
        ]
        for name, ok in sgd_checks:
            if rank == 0 or not ok:
                print(CheckResult(name, ok).line(), flush=True)
        failed += sum(not ok for _, ok in sgd_checks)
        if rank == 0:
            print(
                f"[sgd] parameter agreement: max |w_rank - w_0| = {sgd.spread:g} over {n} ranks"
                f" (bitwise identical: {'yes' if sgd.bitwise_equal else 'NO'})",
                flush=True,
            )
            print(
                f"[sgd] distance to w*: {sgd.distance:.4f}; {args.steps} steps in "
                f"{sgd.seconds * 1e3:.0f} ms",
                flush=True,
            )
            print(
                f"[sgd] guard: without all_reduce the ranks' weights differ by up to "
                f"{sgd.local_spread:.4g}",
                flush=True,
            )
        small_s, big_s, big_ok = await measure(g, args.bench_mib)
        failed += not big_ok
        total_failed = int((await g.all_reduce(np.array([failed], np.int64)))[0])
        checks = len(results) + len(sgd_checks) + 1
        if rank == 0:
            nbytes = args.bench_mib << 20
            algbw = nbytes / big_s / 1e9
            busbw = algbw * 2 * (n - 1) / n
            print(
                f"[time] all_reduce float32[1] latency: median {small_s * 1e6:.0f} us", flush=True
            )
            print(
                f"[time] all_reduce {args.bench_mib} MiB: median {big_s * 1e3:.1f} ms, "
                f"algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s"
                f"{'' if big_ok else ' (WRONG RESULT)'}"
            )
            print(f"[time] total {time.perf_counter() - t_start:.2f} s on rank 0", flush=True)
        verdict = "all ok" if not total_failed else f"{total_failed} FAILED across ranks"
        print(
            f"[summary] {g.peer_label(rank)}: {checks - failed}/{checks} checks ok here, "
            f"{verdict}; sent {_sent_bytes(g) / 2**20:.1f} MiB",
            flush=True,
        )
    return 1 if total_failed else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="p2pdist demo",
        description="Run N local ranks that check the core collectives against numpy, train a "
        "data-parallel linear model, and time all_reduce (127.0.0.1 only).",
    )
    p.add_argument("-n", "--nprocs", type=int, default=4, metavar="N", help="ranks (default 4)")
    p.add_argument("--plaintext", action="store_true", help="authenticated plaintext, no TLS")
    p.add_argument("--steps", type=int, default=30, help="SGD steps (default 30)")
    p.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    p.add_argument(
        "--bench-mib", type=int, default=16, help="bandwidth test size in MiB (default 16)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # Testing the demo itself: this rank feeds a wrong input to one check.
    p.add_argument("--corrupt-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    """Run the demo (or, with ``--worker``, one rank of it); return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.bench_mib < 1 or args.seed < 0:
        parser.error("--steps and --bench-mib must be >= 1, --seed >= 0")
    if args.worker:
        try:
            return eventloop.run(_worker(args))
        except P2PError as exc:
            print(f"[error] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
    command = [sys.executable, "-m", "p2pdist.demo", "--worker", "--steps", str(args.steps)]
    command += ["--seed", str(args.seed), "--bench-mib", str(args.bench_mib)]
    command += ["--corrupt-rank", str(args.corrupt_rank)]
    try:
        cfg = LaunchConfig(command=tuple(command), nprocs=args.nprocs, tls=not args.plaintext)
    except UsageError as exc:
        parser.error(str(exc))
    mode = "plaintext" if args.plaintext else "TLS"
    loop = eventloop.resolve_loop()  # the ranks inherit $P2PDIST_LOOP
    print(f"p2pdist demo: {args.nprocs} ranks on 127.0.0.1 ({mode}, {loop} loop)", flush=True)
    t0 = time.perf_counter()
    status = launch(cfg)
    took = time.perf_counter() - t0
    verdict = "ok" if status == 0 else f"FAILED (exit status {status})"
    print(f"p2pdist demo: {verdict} in {took:.1f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
