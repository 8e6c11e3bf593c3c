"""Codec micro-benchmark: GB/s of every float32 <-> wire conversion route, per wire dtype.

Backs the choice of conversion routes in ``p2pdist/group/compress.py`` with a table from
this machine. GB/s counts float32 bytes (4 per element) on both sides, so every column
compares directly with a link's bandwidth and with a float32 memcpy/add. Each cell is the
best of ``--repeat`` timings of ``--iters`` calls on one chunk of ``--n`` elements
(Gaussian data; 1 MiB of float32 by default: half the ring's 2 MiB chunk of float32,
a quarter of its work per chunk on a 16-bit wire, whose chunks hold 2 MiB of wire bytes).

    python benchmarks/codecs.py [--n 262144] [--repeat 7] [--iters 20] [--markdown]

Routes:
  encode    float32 -> wire bytes, into a preallocated buffer
  decode    wire bytes -> float32, into a preallocated array
  accumulate  acc += decode(wire), the reduce-scatter hop (no full-size temporary)
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from p2pdist.group.compress import make_codec
from p2pdist.group.halfcast import HalfScratch, decode_f16, encode_f16

BF16 = np.dtype(ml_dtypes.bfloat16)


def best_seconds(fn: Callable[[], object], repeat: int, iters: int) -> float:
    """Best mean seconds per call over ``repeat`` runs of ``iters`` calls."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def routes(x: np.ndarray) -> list[tuple[str, str, dict[str, Callable[[], object]], bool]]:
    """(wire dtype, route, {operation: call}, chosen by compress.py) for every route."""
    n = x.size
    acc = np.zeros(n, np.float32)
    out = np.empty(n, np.float32)
    h16 = np.empty(n, np.uint16)
    b16 = np.empty(n, BF16)
    scratch = HalfScratch()
    f16_enc = x.astype(np.float16)
    bf_enc = x.astype(BF16)
    tmp = np.empty(n, np.float32)

    def f16_bits_acc() -> None:
        decode_f16(f16_enc.view(np.uint16), tmp, scratch)
        np.add(acc, tmp, out=acc)

    def bf16_decode_add() -> None:
        np.copyto(tmp, bf_enc)
        np.add(acc, tmp, out=acc)

    rows: list[tuple[str, str, dict[str, Callable[[], object]], bool]] = [
        (
            "float32",
            "memcpy / add (reference)",
            {
                "encode": lambda: np.copyto(out, x),
                "decode": lambda: np.copyto(out, x),
                "accumulate": lambda: np.add(acc, x, out=acc),
            },
            False,
        ),
        (
            "float16",
            "numpy cast",
            {
                "encode": lambda: np.copyto(f16_enc, x, casting="unsafe"),
                "decode": lambda: np.copyto(out, f16_enc),
                "accumulate": lambda: np.add(acc, f16_enc, out=acc),
            },
            False,
        ),
        (
            "float16",
            "halfcast bit route",
            {
                "encode": lambda: encode_f16(x, h16, scratch),
                "decode": lambda: decode_f16(f16_enc.view(np.uint16), out, scratch),
                "accumulate": f16_bits_acc,
            },
            True,
        ),
        (
            "bfloat16",
            "ml_dtypes astype (new array)",
            {
                "encode": lambda: x.astype(BF16),
                "decode": lambda: bf_enc.astype(np.float32),
                "accumulate": bf16_decode_add,
            },
            False,
        ),
        (
            "bfloat16",
            "ml_dtypes into buffers",
            {
                "encode": lambda: np.copyto(b16, x, casting="unsafe"),
                "decode": lambda: np.copyto(out, bf_enc),
                "accumulate": lambda: np.add(acc, bf_enc, out=acc),
            },
            True,
        ),
    ]
    for block in (64, 256, 4096):
        codec = make_codec("int8", block)
        wire = codec.encode(x)
        rows.append(
            (
                "int8",
                f"block {block}",
                {
                    "encode": lambda c=codec, w=wire: c.encode_into(x, w),
                    "decode": lambda c=codec, w=wire: c.decode_into(w, out),
                    "accumulate": lambda c=codec, w=wire: c.accumulate(w, acc),
                },
                block == 256,
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--n", type=int, default=1 << 18, help="float32 elements per call (default 262144: 1 MiB)"
    )
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per cell (best kept)")
    ap.add_argument("--iters", type=int, default=20, help="calls per timed run")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args()
    for flag in ("n", "repeat", "iters"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    x = np.random.default_rng(0).standard_normal(args.n).astype(np.float32)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(
        f"machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}, numpy {np.__version__}, "
        f"ml_dtypes {ml_dtypes.__version__}, load average {load} at start"
    )
    print(
        f"GB/s of float32 (4 B/element), best of {args.repeat} x {args.iters} calls on "
        f"{args.n} elements; * = the route compress.py uses"
    )
    ops = ("encode", "decode", "accumulate")
    header = ["wire", "route", *[f"{op} GB/s" for op in ops]]
    table: list[list[str]] = []
    for wire, route, calls, chosen in routes(x):
        cells = [
            f"{x.nbytes / best_seconds(calls[op], args.repeat, args.iters) / 1e9:.2f}" for op in ops
        ]
        table.append([wire, route + (" *" if chosen else ""), *cells])
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|---|---|" + "---:|" * len(ops))
        for row in table:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        cells = [
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells))


if __name__ == "__main__":
    main()
