"""The ``--loop`` option that the benchmarks share: which event loops to measure."""

from __future__ import annotations

import argparse
import sys

from p2pdist.eventloop import uvloop_available

LOOP_NAMES = ("asyncio", "uvloop")


def default_loops() -> list[str]:
    """asyncio, and uvloop when it is installed."""
    return ["asyncio", "uvloop"] if uvloop_available() else ["asyncio"]


def add_loop_argument(ap: argparse.ArgumentParser, what: str) -> None:
    """``--loop``/``--loops`` into ``args.loops`` (None when not given; see
    :func:`chosen_loops`). ``what`` starts the help text."""
    ap.add_argument(
        "--loop",
        "--loops",
        dest="loops",
        nargs="+",
        choices=LOOP_NAMES,
        default=None,
        help=f"{what} (default: {' '.join(default_loops())})",
    )


def chosen_loops(loops: list[str] | None) -> list[str]:
    """``args.loops``, or :func:`default_loops` when not given. Exits with status 2 and
    a message when uvloop is asked for but not installed."""
    if loops is None:
        return default_loops()
    if "uvloop" in loops and not uvloop_available():
        print(
            '--loop uvloop: uvloop is not installed here (pip install "p2pdist[fast]")',
            file=sys.stderr,
        )
        raise SystemExit(2)
    return loops
