"""The federated-learning coordinator: runs rounds, evaluates the model on the held-out
digits after each one, prints the table, saves the accuracy plot.

    python -m examples.federated.coordinator --listen 0.0.0.0:7000 --clients 6
    python -m examples.federated.coordinator --relay URL --clients 6

It prints ``coordinator id: ID`` (what clients pass as ``--coordinator``) and, with
``--listen``, ``coordinator address: HOST:PORT``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from p2pdist import P2PError, SecretKey, TransportConfig, UsageError
from p2pdist.bench import unwritable
from p2pdist.federated import Coordinator, FederatedConfig
from p2pdist.identity import check_seed
from p2pdist.settings import env_token
from p2pdist.transport.tcp import parse_address
from p2pdist.wire.relay import RelayUrl

from . import IDLE_TIMEOUT
from .model import centralised_accuracy, evaluate, init_model, load_digits
from .report import Row, Table, plot


def quorum_arg(text: str) -> int | float:
    """``--quorum``: a fraction in (0, 1] of the members, or a whole count above 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if 0 < value <= 1:
        return value
    if value > 1 and value.is_integer():
        return int(value)
    raise argparse.ArgumentTypeError(
        f"{text}: give a fraction in (0, 1] of the members, or a whole count above 1"
    )


def add_coordinator_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by this program and ``run``."""
    p.add_argument("--rounds", type=int, default=30, help="rounds to run")
    p.add_argument("--clients", type=int, default=8, help="how many clients")
    p.add_argument(
        "--rule",
        choices=["mean", "median", "trimmed_mean"],
        default="mean",
        help="how the updates of a round are combined (median and trimmed_mean resist outliers)",
    )
    p.add_argument("--trim", type=float, default=0.2, help="trimmed_mean: cut per end")
    p.add_argument("--max-norm", type=float, default=10.0, help="0: no norm bound")
    p.add_argument("--round-timeout", type=float, default=0.25, help="seconds per round")
    p.add_argument(
        "--join-timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the clients before the first round (default 120)",
    )
    p.add_argument(
        "--policy",
        choices=["deadline", "quorum"],
        default="deadline",
        help="close a round at its timeout, or once a quorum of updates is in",
    )
    p.add_argument(
        "--quorum",
        type=quorum_arg,
        default=0.5,
        help="valid updates a round needs to apply an aggregate (and, with --policy quorum, "
        "fresh ones, from the current model, to close early). A value up to 1 is a "
        "FRACTION of the members at the round's opening, rounded up: 0.5 (default) is "
        "half, 1 is all of them (not one update, as FederatedConfig(quorum=1) would "
        "be). A whole number above 1 is a COUNT of updates: 2 is two.",
    )
    p.add_argument(
        "--max-staleness", type=int, default=2, help="rounds an update may lag and still count"
    )
    p.add_argument("--seed", type=int, default=0, help="initial model and baseline seed")
    p.add_argument("--epochs", type=int, default=1, help="client epochs per round")
    p.add_argument(
        "--png",
        default="federated_accuracy.png",
        help="accuracy plot file ('' for none, as p2pdist bench takes it)",
    )
    p.add_argument("--json", type=Path, default=None, help="write a summary here")
    p.add_argument("--plaintext", action="store_true", help="TCP without TLS (trusted nets)")
    p.add_argument("--verbose", action="store_true", help="log each round (INFO)")


def check_coordinator_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``p.error``: one line, exit 2) what would fail only later in the run: counts
    below 1, a relay URL that does not parse, settings FederatedConfig refuses, a plot
    file that cannot be written."""
    for flag in ("rounds", "clients", "epochs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if not 0 < args.join_timeout < float("inf"):
        p.error(f"--join-timeout must be a positive number of seconds, got {args.join_timeout}")
    if args.relay not in (None, "local"):
        try:
            RelayUrl.parse(args.relay)
        except UsageError as exc:
            p.error(f"--relay: {exc}")
        try:  # P2PDIST_RELAY_TOKEN set but empty: refused, as the relay refuses it
            env_token()
        except UsageError as exc:
            p.error(str(exc))
    if getattr(args, "listen", None) is not None:
        try:
            parse_address(args.listen)
        except UsageError as exc:
            p.error(f"--listen: {exc}")
    try:
        fed_config(args)
    except (UsageError, ValueError) as exc:
        p.error(str(exc))
    for flag in ("png", "json"):
        path = getattr(args, flag)
        if path and (problem := unwritable(Path(path))):  # --png '': no plot
            p.error(f"--{flag} {path}: {problem}")


def fed_config(args: argparse.Namespace) -> FederatedConfig:
    """The FederatedConfig the flags describe."""
    return FederatedConfig(
        round_timeout=args.round_timeout,
        policy=args.policy,
        quorum=args.quorum,  # a float up to 1 is a fraction, an int above 1 a count
        max_staleness=args.max_staleness,
        rule=args.rule,
        trim_fraction=args.trim,
        max_norm=args.max_norm or None,
    )


async def serve(
    args: argparse.Namespace,
    *,
    listen: str | None,
    relay: str | None,
    key: SecretKey,
    on_ready: Callable[[Coordinator], None] | None = None,
    wait_for: int | None = None,
) -> dict[str, object]:
    """Wait for ``wait_for`` (default ``args.clients``) clients, run ``args.rounds``
    rounds; returns the summary (also written to ``--json``)."""
    train, test = load_digits()
    model = init_model(args.seed)
    # A client that vanishes without a word over UDP (QUIC) is noticed after idle_timeout.
    transport = TransportConfig(tls=not args.plaintext, idle_timeout=IDLE_TIMEOUT)
    async with Coordinator(model, fed_config(args), key=key, transport=transport) as coord:
        await coord.start(listen=listen, relay=relay, relay_token=env_token() if relay else None)
        print(f"coordinator id: {coord.endpoint_id}", flush=True)
        if coord.address is not None:
            print(f"coordinator address: {coord.address[0]}:{coord.address[1]}", flush=True)
        if on_ready is not None:
            on_ready(coord)
        await coord.wait_for_members(
            args.clients if wait_for is None else wait_for, timeout=args.join_timeout
        )
        loss, acc = evaluate(coord.model, test)
        print(f"{len(coord.members)} clients; initial loss {loss:.4f}, accuracy {acc:.2%}\n")
        table = Table(args.rounds)
        for _ in range(args.rounds):
            outcome = await coord.run_round()
            table.add(Row.of(outcome, *evaluate(coord.model, test)))
        totals = dict(coord.state.totals)
    central = centralised_accuracy(train, test, args.rounds * args.epochs, seed=args.seed)
    final = table.rows[-1].accuracy
    print(
        f"\nfederated: {final:.2%} after {args.rounds} rounds "
        f"(rule {args.rule}); centralised, same data and {args.rounds * args.epochs} "
        f"epochs: {central:.2%}; gap {100 * (central - final):+.2f} points"
    )
    print(f"dropped and rejected over the run: {totals or 'none'}")
    if args.png:
        title = f"digits, {args.clients} non-IID clients, rule {args.rule}"
        plot(table.rows, central, Path(args.png), title)
        print(f"accuracy plot: {args.png}")
    summary: dict[str, object] = {
        "federated_accuracy": final,
        "centralised_accuracy": central,
        "rounds": [vars(r) for r in table.rows],
        "totals": totals,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", help="host:port to accept clients on (TCP)")
    where.add_argument("--relay", help="a relay URL to be reached through (QUIC)")
    p.add_argument("--key-seed", default=None, help="derive the coordinator key from a seed")
    add_coordinator_args(p)
    args = p.parse_args(argv)
    check_coordinator_args(p, args)
    if args.key_seed is not None:
        try:
            check_seed(args.key_seed)
        except UsageError as exc:
            p.error(f"--key-seed: {exc}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if not args.verbose:  # the table counts rejections; the log lines would clutter it
        logging.getLogger("p2pdist.federated").setLevel(logging.ERROR)
    seeded = args.key_seed is not None
    key = SecretKey.from_seed(args.key_seed, 0) if seeded else SecretKey.generate()
    try:
        asyncio.run(serve(args, listen=args.listen, relay=args.relay, key=key))
    except KeyboardInterrupt:  # Ctrl-C: the clients were told (stop, "interrupted")
        print("coordinator stopped", file=sys.stderr)
        return 130
    except P2PError as exc:  # no clients in time, a relay out of reach, a busy port
        # (the library's own messages may already say "coordinator: ")
        print(f"coordinator: error: {str(exc).removeprefix('coordinator: ')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
