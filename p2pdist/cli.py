"""The ``p2pdist`` command line: ``launch``, ``keygen``, ``id``, ``demo``, ``bench``, ``doctor``.

``--loop asyncio|uvloop|auto`` (before the subcommand) picks the event loop of the
commands that run one, and of the processes they start (through ``$P2PDIST_LOOP``).

Every :class:`~p2pdist.errors.P2PError` that reaches the top is printed as
``p2pdist: error: <message>`` and the exit status is 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import secrets
import stat
import sys
from collections.abc import Callable, Sequence

from . import __version__
from .errors import KeyFileError, P2PError, UsageError
from .eventloop import LOOP_CHOICES, LOOP_ENV, resolve_loop
from .identity import SecretKey, iter_endpoint_ids
from .launch import LaunchConfig, launch
from .launch_output import discard_output

__all__ = ["build_parser", "main"]

_Handler = Callable[[argparse.Namespace, list[str]], int]


def _cmd_launch(args: argparse.Namespace, extra: list[str]) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    cfg = LaunchConfig(
        command=tuple(command),
        nprocs=args.nprocs,
        host=args.host,
        tls=not args.plaintext,
        seed=args.seed,
    )
    return launch(cfg)


def _write_pem_to_stdout(key: SecretKey) -> None:
    """Write the key's PEM to stdout, never to a terminal; tighten a file's mode to 0600."""
    fd = sys.stdout.fileno()
    if os.isatty(fd):
        raise UsageError(
            "refusing to print a secret key to a terminal; "
            "use --out FILE or redirect stdout (p2pdist keygen > key.pem)"
        )
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        os.fchmod(fd, 0o600)
    sys.stdout.flush()
    sys.stdout.buffer.write(key.to_pem())
    sys.stdout.buffer.flush()


def _cmd_keygen(args: argparse.Namespace, extra: list[str]) -> int:
    if args.seed:
        if args.out is not None or args.force:
            raise UsageError("keygen --seed takes neither --out nor --force")
        print(secrets.token_hex(32))  # hex: never starts with "-", safe as a CLI argument
        return 0
    key = SecretKey.generate()
    if args.out is not None:
        if not args.out:
            raise UsageError("--out needs a file name")
        if not args.force and os.path.lexists(args.out):
            raise KeyFileError(f"{args.out} exists; pass --force to replace it")
        key.save(args.out, overwrite=args.force)
        print(key.endpoint_id)
    else:
        _write_pem_to_stdout(key)
        print(f"endpoint id: {key.endpoint_id}", file=sys.stderr)
    return 0


def _cmd_id(args: argparse.Namespace, extra: list[str]) -> int:
    if args.seed is not None:
        if args.file is not None:
            raise UsageError("id takes either FILE or --seed/--world, not both")
        if args.world is None:
            raise UsageError("id --seed needs --world N")
        if args.world < 1:
            raise UsageError(f"--world must be >= 1, got {args.world}")
        # Each line as it is derived: a huge world streams.
        for rank, eid in enumerate(iter_endpoint_ids(args.seed, args.world)):
            # An allowlist file's line: the id, then a comment the relay ignores.
            print(f"{eid}  # rank {rank}" if args.allowlist else f"{rank} {eid}")
        return 0
    if args.world is not None:
        raise UsageError("--world only makes sense with --seed")
    if args.file is None:
        raise UsageError("id needs a key FILE, or --seed SEED --world N")
    eid = SecretKey.load(args.file).endpoint_id
    # The file's name in the comment, on its one line (a newline in it would start an
    # allowlist line of its own).
    name = "".join(c if c.isprintable() else "?" for c in args.file)
    print(f"{eid}  # {name}" if args.allowlist else eid)
    return 0


def _passthrough(module: str) -> _Handler:
    def run(args: argparse.Namespace, extra: list[str]) -> int:
        # Imported lazily: these pull in the whole group stack.
        entry: Callable[[list[str]], int] = importlib.import_module(module).main
        return entry(extra)

    return run


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "launch",
        help="run N local ranks of a command",
        description="Run N local ranks of CMD, each with P2PDIST_SEED/RANK/WORLD/PEERS/TLS set.",
        usage="%(prog)s -n N [--host HOST] [--plaintext] [--seed SEED] -- CMD [ARGS...]",
    )
    p.add_argument("-n", "--nprocs", type=int, required=True, metavar="N", help="number of ranks")
    p.add_argument("--host", default="127.0.0.1", help="address the ranks listen on")
    p.add_argument("--plaintext", action="store_true", help="set P2PDIST_TLS=0 (no TLS)")
    p.add_argument("--seed", default=None, help="group seed (default: a fresh random one)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after '--'")
    p.set_defaults(handler=_cmd_launch, subparser=p)


def _add_keygen(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "keygen",
        help="generate a secret key (or a group seed with --seed)",
        description="Generate an Ed25519 secret key. With --out it is saved with mode 0600 "
        "and its endpoint id printed; otherwise the PEM goes to stdout (never a terminal) "
        "and the endpoint id to stderr.",
    )
    p.add_argument("--out", default=None, metavar="FILE", help="write the key to FILE (0600)")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    p.add_argument("--seed", action="store_true", help="print a random group seed instead")
    p.set_defaults(handler=_cmd_keygen, subparser=p)


def _add_id(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "id",
        help="print the endpoint id of a key file, or of each rank of a seed",
        description="Print the endpoint id of key FILE, or with --seed/--world each "
        "rank's endpoint id as 'RANK ID'. With --allowlist, print lines for a relay's "
        "allowlist file instead ('ID  # rank RANK', or 'ID  # FILE').",
    )
    p.add_argument("file", nargs="?", default=None, metavar="FILE", help="a key file")
    p.add_argument("--seed", default=None, help="group seed")
    p.add_argument("--world", type=int, default=None, metavar="N", help="number of ranks")
    p.add_argument(
        "--allowlist",
        action="store_true",
        help="print allowlist lines: append them to the relay's --allowlist FILE",
    )
    p.set_defaults(handler=_cmd_id, subparser=p)


def _add_passthrough(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    module: str,
    help: str,
    usage: str,
) -> None:
    p = sub.add_parser(name, help=help, add_help=False, usage=usage)
    p.set_defaults(handler=_passthrough(module), passthrough=True)


_LOOP_COMMANDS = frozenset({"demo", "bench", "doctor"})
"""The subcommands that run an event loop (and start ranks that do)."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="p2pdist", description="Peer-to-peer collectives over authenticated transports."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--loop",
        type=str.lower,  # as $P2PDIST_LOOP is read
        choices=LOOP_CHOICES,
        default=None,
        help="event loop of demo, bench, doctor and the ranks they start: auto (uvloop when "
        f"installed), asyncio or uvloop (default: ${LOOP_ENV}, else asyncio)",
    )
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    _add_launch(sub)
    _add_keygen(sub)
    _add_id(sub)
    _add_passthrough(
        sub,
        "demo",
        "p2pdist.demo",
        "run the local demo (see: p2pdist demo --help)",
        "%(prog)s [-n 4] [--plaintext] [--steps 30]",
    )
    _add_passthrough(
        sub,
        "bench",
        "p2pdist.bench",
        "profile the links of N local ranks: alpha-beta fit and a PNG plot",
        "%(prog)s [-n 2 | --from-env] [--plaintext] [--png FILE] [--repeats 5]",
    )
    _add_passthrough(
        sub,
        "doctor",
        "p2pdist.doctor",
        "check the network: relay, UDP, NAT mapping, direct path to a peer",
        "%(prog)s --relay URL [--peer ID | --serve] [--key FILE] [--token T] [--json] "
        "[--timeout S]",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``p2pdist`` console script; returns the exit status."""
    parser = build_parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if extra and not getattr(args, "passthrough", False):
        # Said by the subcommand's own parser (its usage line), not the top-level one's.
        getattr(args, "subparser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    handler: _Handler = args.handler
    try:
        if args.loop is not None:
            resolve_loop(args.loop)  # fail now when uvloop is asked for but missing
            os.environ[LOOP_ENV] = args.loop  # the subcommand and the processes it starts
        elif args.subcommand in _LOOP_COMMANDS:
            resolve_loop()  # a bad $P2PDIST_LOOP: one line now, not one per rank later
        return handler(args, extra)
    except P2PError as exc:
        print(f"p2pdist: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `p2pdist demo | head`: the reader went away, as for SIGPIPE
        discard_output(sys.stdout)
        return 141


if __name__ == "__main__":
    sys.exit(main())
