"""Hole punching in the NAT lab: time to first byte (relayed), time to a direct path, and
all-reduce bandwidth on the direct path vs the relay. Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/nat_lab.py [--repeats 3] [--markdown]

Each run builds a fresh lab (tests/natlab.py), starts a relay in its "internet"
namespace and one rank of a two-rank group behind each NAT (tests/nat_worker.py with
``--bench``). "first byte" is the time from process start to a formed group plus its
first all-reduce, through the relay; "direct" is the time from then to a validated
direct path; "bus MB/s" is the all-reduce bus bandwidth of an 8 MiB float32 array on
the path in use (world 2: bus bandwidth = algorithm bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from natlab import NatLab, lab_unavailable  # noqa: E402

CASES = [("none", "none"), ("eim", "eim"), ("none", "symmetric"), ("eim", "symmetric")]


def run_case(a: str, b: str) -> list[dict[str, Any]]:
    worker = str(ROOT / "tests" / "nat_worker.py")
    with tempfile.TemporaryDirectory() as tmp, NatLab(a, b, workdir=Path(tmp)) as lab:
        url = lab.spawn_relay()
        procs = [
            lab.spawn(
                side,
                [sys.executable, worker, "--url", url, "--rank", str(r), "--bench"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for r, side in enumerate("ab")
        ]
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            events = {e["event"]: e for e in map(json.loads, out.splitlines())}
            results.append(events)
        return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    why = lab_unavailable()
    if why:
        print(f"cannot build the NAT lab: {why}", file=sys.stderr)
        return 2
    rows = []
    for a, b in CASES:
        first, direct, bw, kinds = [], [], [], set()
        for _ in range(args.repeats):
            res = run_case(a, b)
            first.append(max(r["formed"]["seconds"] for r in res))
            d = [r["direct"]["seconds"] for r in res]
            if all(x is not None for x in d):
                direct.append(max(d))
            bw.append(statistics.mean(r["done"]["bench_mb_s"] for r in res))
            kinds |= {r["done"]["bench_kind"] for r in res}
        rows.append(
            (
                f"{a}-{b}",
                f"{statistics.median(first) * 1000:.0f} ms",
                f"{statistics.median(direct) * 1000:.0f} ms" if direct else "never (relay)",
                "/".join(sorted(kinds)),
                f"{statistics.median(bw):.0f}",
            )
        )
    head = ("NATs", "first byte (relayed)", "direct path after", "path", "bus MB/s")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
        for row in [head, *rows]:
            print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
