"""``p2pdist bench``: profile every link of N local ranks, or with ``--from-env`` of a
group spread over several hosts, print the alpha-beta model and write a PNG of bandwidth
against message size."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path

from . import eventloop
from .errors import P2PError, UsageError
from .group import Group
from .group.profile import DEFAULT_SIZES, LinkProfile, profile_links
from .launch import ENV_RANK, ENV_WORLD, LaunchConfig, launch
from .settings import decimal_int

__all__ = ["format_table", "main", "plot", "report", "unwritable"]

DEFAULT_PNG = "p2pdist-links.png"
PLOT_HINT = "pip install matplotlib, or the project's plot extra: pip install -e '.[plot]'"


def format_table(profiles: list[LinkProfile]) -> str:
    """The fitted model and measured bandwidth per link, as text."""
    largest = max(profiles[0].sizes) if profiles else DEFAULT_SIZES[-1]
    head = f"{_size_text(largest)} one-way (GB/s)"
    lines = [f"{'link':>8} {'alpha (us)':>11} {'beta (GB/s)':>12} {head:>22}"]
    for p in profiles:
        top = p.bandwidth()[p.sizes.index(largest)] / 1e9
        lines.append(
            f"{p.a:>3} - {p.b:<2} {p.alpha * 1e6:>11.1f} {p.beta / 1e9:>12.2f} {top:>22.2f}"
        )
    return "\n".join(lines)


def _size_text(nbytes: int) -> str:
    """``16 MiB``, ``4 KiB`` or ``100 B``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def plot(profiles: list[LinkProfile], path: Path) -> None:
    """Bandwidth against message size, one line per link (needs matplotlib)."""
    try:
        # A figure of its own, without pyplot: the caller's backend and figures (a
        # notebook's, say) are left as they are.
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"writing the plot needs matplotlib: {PLOT_HINT}") from None
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for p in profiles:
        (line,) = ax.plot(
            p.sizes, [b / 1e9 for b in p.bandwidth()], marker="o", label=f"{p.a}-{p.b}"
        )
        model = [m / t / 1e9 if (t := p.alpha + m / p.beta) > 0 else math.inf for m in p.sizes]
        ax.plot(p.sizes, model, linestyle="--", alpha=0.6, color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("one-way bandwidth (GB/s)")
    ax.set_title("p2pdist links: measured (points) and alpha-beta fit (dashed)")
    ax.grid(True, alpha=0.3)
    ax.legend(title="link")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")  # whatever the name ends in, as given


def unwritable(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (checked before a long run), or None."""
    where = path.parent
    if path.is_dir():
        return "is a directory"
    if not where.is_dir():
        return f"no directory {where}"
    if not os.access(where, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "not writable"
    return None


async def _worker(png: str, repeats: int) -> int:
    async with Group.from_env() as g:
        if g.size < 2:
            raise UsageError(f"{ENV_WORLD}=1: a group of one rank has no links to profile")
        profiles = await profile_links(g, repeats=repeats)
        return report(profiles, png) if g.rank == 0 else 0


def report(profiles: list[LinkProfile], png: str) -> int:
    """Print the table and write the plot to ``png`` (none when empty): the exit status,
    1 with a one-line error when the plot cannot be written after all (a full disk:
    what :func:`unwritable` cannot foresee)."""
    print(format_table(profiles), flush=True)
    if png:
        try:
            plot(profiles, Path(png))
        except OSError as exc:
            print(f"p2pdist bench: error: cannot write {png}: {exc}", file=sys.stderr)
            return 1
        print(f"plot written to {png}", flush=True)
    return 0


def _env_rank() -> int | None:
    """P2PDIST_RANK as Group.from_env reads it (None when unset or not an integer)."""
    try:
        return decimal_int(os.environ.get(ENV_RANK, ""))
    except ValueError:
        return None


def main(argv: list[str]) -> int:
    """Run the profiler on N local ranks (or, with ``--worker``, one rank of it)."""
    p = argparse.ArgumentParser(prog="p2pdist bench", description=__doc__.replace("``", ""))
    p.add_argument("-n", "--nprocs", type=int, default=None, help="local ranks (default 2)")
    p.add_argument("--plaintext", action="store_true", help="authenticated plaintext, no TLS")
    p.add_argument(
        "--png",
        default=None,
        help=f"plot file ('' for none; default {DEFAULT_PNG} when matplotlib is installed)",
    )
    p.add_argument("--repeats", type=int, default=5, help="ping-pongs per size (default 5)")
    p.add_argument(
        "--from-env",
        action="store_true",
        help="be one rank of a group described by P2PDIST_SEED, P2PDIST_RANK, P2PDIST_WORLD "
        "and P2PDIST_PEERS, P2PDIST_RELAY or P2PDIST_LAN=1 (run it on every host of a fleet); "
        "rank 0 prints the model and writes the plot",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # what -n starts
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    one_rank = args.worker or args.from_env
    if args.from_env and (args.plaintext or args.nprocs is not None):
        p.error("--from-env takes the group from P2PDIST_* (P2PDIST_TLS=0 for plaintext)")
    if args.nprocs is None:
        args.nprocs = 2
    if args.nprocs < 2 and not one_rank:
        p.error(f"-n must be at least 2 (links join two ranks), got {args.nprocs}")
    writes = not args.worker and (not args.from_env or _env_rank() == 0)  # rank 0 reports
    has_plot = importlib.util.find_spec("matplotlib") is not None
    if args.png is None:  # the default plot only where it can be drawn
        args.png = DEFAULT_PNG if has_plot else ""
        if not has_plot and writes:
            print(f"p2pdist bench: no plot ({PLOT_HINT})", file=sys.stderr)
    elif args.png and not has_plot and writes:  # asked for: say so before measuring
        p.error(f"--png needs matplotlib ({PLOT_HINT})")
    if args.png and writes:
        problem = unwritable(Path(args.png))
        if problem:
            p.error(f"--png {args.png}: {problem}")
    if one_rank:
        try:
            return eventloop.run(_worker(args.png, args.repeats))
        except P2PError as exc:
            if args.worker:  # a rank under launch: launch prefixes its lines with the rank
                print(f"[error] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            elif isinstance(exc, UsageError):  # --from-env: P2PDIST_* missing or wrong
                p.error(str(exc))
            else:
                print(f"p2pdist bench: error: {exc}", file=sys.stderr, flush=True)
            return 1
    png = str(Path(args.png).resolve()) if args.png else ""
    command = (
        sys.executable,
        "-m",
        "p2pdist.bench",
        "--worker",
        "--png",
        png,
        "--repeats",
        str(args.repeats),
    )
    try:
        cfg = LaunchConfig(command=command, nprocs=args.nprocs, tls=not args.plaintext)
    except UsageError as exc:
        p.error(str(exc))
    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
