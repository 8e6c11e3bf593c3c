"""One rank of a two-rank group in the NAT lab (run inside a host namespace).

``python tests/nat_worker.py --url URL --rank R [--fallback] [--bench] [--outage S]`` forms a group
through the relay, reports on stdout, one JSON object per line:

* ``formed``: seconds from start to a formed group and a first all-reduce (relayed);
* ``direct``: seconds from formation to a direct path (or ``null`` after ``--wait``);
* with ``--fallback``: waits for a ``go`` line on stdin, runs one all-reduce, says
  ``started`` and runs more while the test blocks UDP at a router; then reports the
  path again;
* with ``--bench``: all-reduce bus bandwidth on the path in use;
* with ``--outage S``: waits for ``go``, runs one all-reduce, says ``started`` and runs
  more for S seconds while the test cuts a side off (all traffic) and back;
* ``done``: correctness of every all-reduce against the value both ranks can compute,
  the final path (:class:`p2pdist.PathInfo` as a dict) and the observed addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

from p2pdist import Group, GroupConfig, PunchConfig

SEED = "nat lab worker seed 0123456789"
PUNCH = PunchConfig(keepalive=0.5, path_timeout=2.0, punch_timeout=3.0, retry_after=60.0)


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, default=str), flush=True)


def data(rank: int, n: int, step: int) -> np.ndarray:
    return np.random.default_rng([rank, n, step]).standard_normal(n)


async def check(g: Group, n: int, step: int) -> bool:
    out = await g.all_reduce(data(g.rank, n, step))
    want = data(0, n, step) + data(1, n, step)
    return bool(np.array_equal(out, want))


def path_dict(g: Group) -> dict[str, Any]:
    info = g.paths()[1 - g.rank]
    d = dataclasses.asdict(info)
    d["peer"] = str(info.peer)
    return d


async def bench(g: Group, nbytes: int, reps: int) -> float:
    x = np.ones(nbytes // 4, np.float32)
    await g.all_reduce(x)
    await g.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        await g.all_reduce(x)
    dt = (time.perf_counter() - t0) / reps
    return nbytes / dt / 1e6  # bus bandwidth at world 2 = algbw x 2(n-1)/n = algbw


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--wait", type=float, default=4.0, help="seconds to wait for a direct path")
    ap.add_argument("--fallback", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument(
        "--outage", type=float, default=0.0, help="after 'go', all-reduce for this many s"
    )
    args = ap.parse_args()
    t0 = time.monotonic()
    cfg = GroupConfig(timeout=45.0, connect_timeout=30.0, punch=PUNCH)
    async with Group.from_seed(SEED, rank=args.rank, world=2, relay=args.url, config=cfg) as g:
        ok = [await check(g, 1000, 0)]
        formed = time.monotonic()
        say("formed", seconds=formed - t0, path=g.paths()[1 - g.rank].kind)
        direct_after = None
        while time.monotonic() - formed < args.wait:
            if g.paths()[1 - g.rank].kind == "direct":
                direct_after = time.monotonic() - formed
                break
            await asyncio.sleep(0.01)
        say("direct", seconds=direct_after)
        await g.barrier()
        for step, n in enumerate([1, 4097, 200_000], start=1):
            ok.append(await check(g, n, step))
        result: dict[str, Any] = {}
        if args.bench:
            result["bench_kind"] = g.paths()[1 - g.rank].kind
            result["bench_mb_s"] = await bench(g, 8 << 20, 5)
        if args.fallback:
            line = await asyncio.to_thread(sys.stdin.readline)
            assert line.strip() == "go", line
            kinds = []
            for step in range(10, 40):
                ok.append(await check(g, 250_000, step))
                kinds.append(g.paths()[1 - g.rank].kind)
                if step == 10:
                    # Said after the first all-reduce, not before: that one (the first
                    # after an idle wait, in slow start) can take longer than the test
                    # waits before it blocks UDP, and then finishes on the relay.
                    say("started")
            result["kinds"] = kinds
        if args.outage:
            line = await asyncio.to_thread(sys.stdin.readline)
            assert line.strip() == "go", line
            ok.append(await check(g, 250_000, 100))
            say("started")
            end, step, slowest = time.monotonic() + args.outage, 101, 0.0
            while True:
                began = time.monotonic()
                ok.append(await check(g, 250_000, step))
                slowest, step = max(slowest, time.monotonic() - began), step + 1
                over = np.array([float(time.monotonic() >= end)])
                if (await g.all_reduce(over, op="max"))[0]:  # both stop after the same step
                    break
            result["slowest"] = slowest
            result["relay_connects"] = g.relay_status.connects if g.relay_status else None
        puncher = g._transport._puncher  # type: ignore[union-attr]
        obs = puncher.observation if puncher is not None else None
        result["observed"] = [list(m) for _, m in obs.mapped] if obs else []
        result["path"] = path_dict(g)
        await g.barrier()  # both ranks took their snapshot before either closes
        say("done", ok=ok, **result)


if __name__ == "__main__":
    asyncio.run(main())
