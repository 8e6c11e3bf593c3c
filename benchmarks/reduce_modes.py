"""All-reduce modes A/B: plain, deterministic and compressed, interleaved in one run.

On a small shared machine the load changes from second to second, so timing one mode after
the other (as ``benchmarks/allreduce.py`` does) can make any mode look faster or slower
than another. Here every rank runs all modes in turn, round after round, in the same
processes and on the same connections (loopback TCP, plaintext or ``--tls``), and the
table reports per mode the time of one call (each rank's median over all its timed calls,
of every round, after one untimed call per mode and round, into a result buffer of the
mode's own; the slowest rank's median is shown), bus bandwidth, the ratio to the first
mode of ``--modes`` (plain float32 by default), and each rank's median CPU time per call
(process time: on a saturated machine the better guide to what a quiet one would show).
The event loop is asyncio unless ``P2PDIST_LOOP`` says otherwise; the table names it.

    python benchmarks/reduce_modes.py --world 2 --mib 16 64
    python benchmarks/reduce_modes.py --world 4 --mib 64 --modes plain det --rounds 5
    python benchmarks/reduce_modes.py --tls --modes plain bf16 int8
    sudo python benchmarks/reduce_modes.py --rate 1gbit 100mbit --mib 16

``--rate`` runs the ranks on a shaped LAN instead of loopback: each rank in its own
network namespace, its link limited to that rate each way (``tc`` token bucket; root,
``ip`` and ``tc`` needed), which is where compressed wires are meant to pay off.

Inputs are Gaussian float32 (seeded per rank); ``busbw = bytes/time * 2(n-1)/n``. After
the last round every rank checks each mode's last result (kept until then: a check between
modes would leave the links idle, and a shaped link's token bucket refilled, before the
next mode's calls) against the float64 sum of all ranks' inputs (it regenerates the
others'), and the run fails when one is wrong: ``det``
must equal that sum rounded once to float32; ``plain`` must be within float32 rounding of
it (an n-term float32 sum in any order); a compressed mode must be within a loose relative
bound (``LOOSE``, several times the documented errors) and further from it than float32
rounding (else its wire dtype was not used).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from p2pdist import eventloop

MODES: dict[str, dict[str, Any]] = {
    "plain": {},
    "det": {"mode": "deterministic"},
    "bf16": {"wire_dtype": "bfloat16"},
    "int8": {"wire_dtype": "int8"},
    "f16": {"wire_dtype": "float16"},
}
LOOSE = {"bf16": 5e-2, "int8": 1e-1, "f16": 1e-2}
"""Compressed modes: the largest error allowed, relative to the largest |sum| (the tested
bounds of docs/collectives.md, worlds 2-4: bfloat16 2e-2, int8 3e-2, float16 2e-3)."""
SEED = "reduce-modes-benchmark-seed"
SHAPED_PORT = 29400
"""Every rank's port on a shaped LAN (each rank has an address of its own there)."""


def parse_rate(text: str) -> int:
    """``"1gbit"``, ``"100mbit"``, ``"2.5gbit"`` -> bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg])bit", text.strip().lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"rate must look like 100mbit or 1gbit, got {text!r}")
    return int(float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


def _rate_text(bits: int) -> str:
    return f"{bits / 1e9:g} Gbit/s" if bits >= 10**9 else f"{bits / 1e6:g} Mbit/s"


def _input(rank: int, n: int) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s input: ``n`` seeded Gaussian float32 values."""
    return np.random.default_rng(rank).standard_normal(n).astype(np.float32)


def reference(world: int, n: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The float64 sum of every rank's input in rank order, and the bound of float32
    rounding in an n-term sum in any order (``(n-1) * 2^-24 * sum |x|``, 1% margin)."""
    total = np.zeros(n, np.float64)
    magnitude = np.zeros(n, np.float64)
    for r in range(world):
        x = _input(r, n)
        total += x
        magnitude += np.abs(x)
    return total, (magnitude * ((world - 1) * 2.0**-24 * 1.01)).astype(np.float32)


def check(mode: str, got: np.ndarray[Any, Any], ref: Any, fold: Any) -> str | None:
    """Why ``got``, a result of ``mode``, is wrong (None when it is right); ``ref`` and
    ``fold`` come from :func:`reference`."""
    if mode == "det":
        ok = np.array_equal(got, ref.astype(np.float32))
        return None if ok else "not the float64 rank-order sum rounded once"
    err = np.abs(got - ref)
    within_fold = bool(np.all(err <= fold))
    if mode == "plain":
        return None if within_fold else f"off by up to {err.max():.3g}, beyond float32 rounding"
    rel = float(err.max() / np.abs(ref).max())
    if rel > LOOSE[mode]:
        return f"relative error {rel:.2e} above {LOOSE[mode]:g}"
    return "as exact as float32: the wire dtype was not used" if within_fold else None


async def _rank(cfg: dict[str, Any]) -> dict[str, Any]:
    from p2pdist import Group

    rank, world, peers = cfg["rank"], cfg["world"], cfg["peers"]
    n = cfg["nbytes"] // 4
    x = _input(rank, n)
    last: dict[str, np.ndarray[Any, Any]] = {}  # each mode's last result of the last round
    wall: dict[str, list[float]] = {m: [] for m in cfg["modes"]}
    cpu: dict[str, list[float]] = {m: [] for m in cfg["modes"]}
    # Each mode's result goes to a buffer of its own, made once: a fresh result per call
    # (its allocation and page faults, about 10-25% of a plain 64 MiB call) would add the
    # same cost to every mode and pull their ratios towards 1.
    outs = {m: np.empty_like(x) for m in cfg["modes"]}
    group = Group.from_seed(SEED, rank=rank, world=world, peers=peers, tls=cfg["tls"])
    async with group as g:
        for rnd in range(cfg["rounds"] + 1):  # round 0 warms up
            for mode in cfg["modes"]:
                out, kw = outs[mode], MODES[mode]
                await g.barrier()
                await g.all_reduce(x, out=out, **kw)  # untimed: the first after a switch
                for _ in range(cfg["iters"]):
                    t0, c0 = time.perf_counter(), time.process_time()
                    await g.all_reduce(x, out=out, **kw)
                    if rnd:
                        wall[mode].append(time.perf_counter() - t0)
                        cpu[mode].append(time.process_time() - c0)
                if rnd == cfg["rounds"]:  # kept for the check after the last round
                    last[mode] = out
        await g.barrier()
    ref, fold = reference(world, n)
    for mode, got in last.items():
        if why := check(mode, got, ref, fold):
            raise AssertionError(f"rank {rank}, {mode}: wrong result: {why}")
    return {
        "wall": {m: statistics.median(v) for m, v in wall.items()},
        "cpu": {m: statistics.median(v) for m, v in cpu.items()},
        "loop": eventloop.loop_name(),
    }


@contextlib.contextmanager
def _hosts(world: int, rate: int | None) -> Iterator[tuple[list[str], list[list[str]]]]:
    """Every rank's ``host:port`` and command prefix: loopback, or a shaped LAN."""
    if rate is None:
        from p2pdist.launch import pick_free_ports

        ports = pick_free_ports("127.0.0.1", world)
        yield [f"127.0.0.1:{p}" for p in ports], [[] for _ in range(world)]
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from natlab import ShapedLan

    with ShapedLan(world, rate) as lan:
        yield (
            [f"{lan.ip(r)}:{SHAPED_PORT}" for r in range(world)],
            [lan.exec_prefix(r) for r in range(world)],
        )


def _run_size(args: argparse.Namespace, world: int, mib: float, rate: int | None) -> None:
    with _hosts(world, rate) as (peers, prefixes):
        _run_ranks(args, world, mib, rate, peers, prefixes)


def _wait_all(procs: list[subprocess.Popen[str]], timeout: float) -> None:
    """Until every rank has exited, waited for in short slices: a rank that fails ends
    the wait at once, whichever rank it is (waiting for the ranks in turn waited out the
    timeout on rank 0 when a later one had died)."""
    deadline = time.monotonic() + timeout
    while True:
        for r, p in enumerate(procs):
            if p.poll():  # its traceback went to stderr
                raise SystemExit(f"reduce_modes: rank {r} failed (exit status {p.returncode})")
        if all(p.returncode == 0 for p in procs):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"reduce_modes: the ranks took over {timeout:g} s")
        time.sleep(0.1)


def _run_ranks(
    args: argparse.Namespace,
    world: int,
    mib: float,
    rate: int | None,
    peers: list[str],
    prefixes: list[list[str]],
) -> None:
    nbytes = int(mib * 2**20)
    procs: list[subprocess.Popen[str]] = []
    with contextlib.ExitStack() as stack:
        outputs = []
        for r in range(world):
            cfg = {
                "rank": r,
                "world": world,
                "peers": peers,
                "nbytes": nbytes,
                "rounds": args.rounds,
                "iters": args.iters or max(2, int(128 // mib)),
                "modes": args.modes,
                "tls": args.tls,
            }
            cmd = [*prefixes[r], sys.executable, __file__, "--worker", json.dumps(cfg)]
            # a file, not a pipe: a rank waited for in slices never blocks on a full pipe
            outputs.append(stack.enter_context(tempfile.TemporaryFile("w+")))
            procs.append(subprocess.Popen(cmd, stdout=outputs[-1], text=True))
        try:
            _wait_all(procs, args.timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        outs = []
        for f in outputs:
            f.seek(0)
            outs.append(json.loads(f.read()))
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    link = "TLS" if args.tls else "plaintext"
    where = "loopback" if rate is None else f"links shaped to {_rate_text(rate)} each way"
    print(
        f"world {world}, {mib:g} MiB float32, {link}, {where}, {outs[0]['loop']} event loop, "
        f"load average {load} after the run"
    )
    first = f"vs {args.modes[0]}"
    print(f"  {'mode':6s} {'time (ms)':>10s} {'busbw GB/s':>11s} {first:>9s}  cpu/rank (ms)")
    base = max(o["wall"][args.modes[0]] for o in outs)
    for m in args.modes:
        t = max(o["wall"][m] for o in outs)
        bus = nbytes / t * 2 * (world - 1) / world / 1e9
        cpus = "/".join(f"{o['cpu'][m] * 1e3:.1f}" for o in outs)
        print(f"  {m:6s} {t * 1e3:10.2f} {bus:11.3f} {t / base:8.2f}x  {cpus}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(eventloop.run(_rank(json.loads(sys.argv[2])))))  # P2PDIST_LOOP applies
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2], help="world sizes")
    ap.add_argument("--mib", type=float, nargs="+", default=[16, 64], help="sizes in MiB")
    ap.add_argument(
        "--modes", nargs="+", default=list(MODES), choices=list(MODES), help="first = baseline"
    )
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds over all modes")
    ap.add_argument("--iters", type=int, default=0, help="calls per mode per round")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per world and size")
    ap.add_argument("--tls", action="store_true", help="TLS connections (default plaintext)")
    ap.add_argument(
        "--rate",
        type=parse_rate,
        nargs="+",
        default=[None],
        metavar="RATE",
        help="run on a LAN of namespaces with every link shaped to RATE each way "
        "(e.g. 1gbit 100mbit; needs root, ip and tc); default loopback",
    )
    args = ap.parse_args()
    if min(args.world) < 2:
        ap.error(f"--world sizes must be at least 2 (a reduction needs peers), got {args.world}")
    if not all(0 < mib < float("inf") for mib in args.mib):
        ap.error(f"--mib sizes must be positive, got {args.mib}")
    if args.rounds < 1 or args.iters < 0:
        ap.error("--rounds must be at least 1 and --iters at least 0 (0: chosen per size)")
    if not 0 < args.timeout < float("inf"):
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.rate != [None] and os.geteuid() != 0:
        ap.error("--rate needs root (network namespaces and tc)")
    print(f"command: python benchmarks/reduce_modes.py {' '.join(sys.argv[1:])}")
    for rate in args.rate:
        for world in args.world:
            for mib in args.mib:
                _run_size(args, world, mib, rate)


if __name__ == "__main__":
    main()
