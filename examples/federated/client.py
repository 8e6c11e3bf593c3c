"""One federated-learning client: trains softmax regression on its non-IID shard of the
digits data and submits model deltas to the coordinator. It only dials out.

    python -m examples.federated.client --coordinator ID --address HOST:PORT --index 0 --clients 6
    python -m examples.federated.client --coordinator ID --relay URL --index 0 --clients 6

``--index``/``--clients``/``--seed`` pick the shard (the same numbers on every machine
give the same split). Behaviour flags for the demo: ``--work S`` (simulated compute time
per round, seconds), ``--slow F`` (multiply it), ``--crash-round R`` (exit abruptly
after receiving round R's model: a disconnect mid-round), ``--leave-round R`` (leave
politely after submitting to round R), ``--attack scale|nan`` (a malicious client:
updates times ``--scale``, or NaN).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import numpy as np

from p2pdist import EndpointId, P2PError, SecretKey, TransportConfig, UsageError
from p2pdist.federated import FederatedClient, RoundTask
from p2pdist.identity import check_seed
from p2pdist.settings import env_token
from p2pdist.transport.tcp import parse_address
from p2pdist.wire.relay import RelayUrl

from . import IDLE_TIMEOUT
from .model import Split, load_digits, non_iid_shards, sgd

CLIENT_KEY_DOMAIN = "p2pdist-example-client:"
"""Prefixed to ``--key-seed``: a client's key never equals the coordinator's, which is
``SecretKey.from_seed(seed, 0)``, even when both are given the same seed."""


def client_key(seed: str, index: int) -> SecretKey:
    """Client ``index``'s key from ``--key-seed``, in a domain apart from the
    coordinator's."""
    return SecretKey.from_seed(CLIENT_KEY_DOMAIN + seed, index)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True, help="the coordinator's endpoint id")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", help="the coordinator's host:port (TCP)")
    where.add_argument("--relay", help="a relay URL (QUIC through the relay)")
    p.add_argument("--relay-token", help="relay access token (default: $P2PDIST_RELAY_TOKEN)")
    p.add_argument("--index", type=int, required=True, help="this client's shard, 0-based")
    p.add_argument("--clients", type=int, required=True, help="how many shards")
    p.add_argument("--seed", type=int, default=0, help="data split and training seed")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet non-IID concentration")
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    p.add_argument("--lr", type=float, default=0.5, help="local learning rate")
    p.add_argument("--work", type=float, default=0.05, help="simulated compute s/round")
    p.add_argument("--slow", type=float, default=1.0, help="multiply --work by this")
    p.add_argument("--crash-round", type=int, default=None)
    p.add_argument("--leave-round", type=int, default=None)
    p.add_argument("--attack", choices=["scale", "nan"], default=None)
    p.add_argument("--scale", type=float, default=1e6)
    p.add_argument(
        "--key-seed",
        default=None,
        help="derive this client's key from this seed and --index (a fixed endpoint id "
        "across restarts; the coordinator's --key-seed may be the same string: client "
        "keys are derived in a domain of their own)",
    )
    p.add_argument("--plaintext", action="store_true", help="TCP without TLS (trusted nets)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.clients < 1:
        p.error(f"--clients must be at least 1, got {args.clients}")
    if not 0 <= args.index < args.clients:
        p.error(f"--index must be in [0, --clients) = [0, {args.clients}), got {args.index}")
    if not args.alpha > 0:
        p.error(f"--alpha must be positive, got {args.alpha}")
    if args.key_seed is not None:
        try:  # the domain prefix would make any seed long enough: check the user's part
            check_seed(args.key_seed)
        except UsageError as exc:
            p.error(f"--key-seed: {exc}")
    checks = (
        ("--coordinator", EndpointId.parse, args.coordinator),
        ("--address", parse_address, args.address),
        ("--relay", RelayUrl.parse, args.relay),
    )
    for flag, parse, value in checks:
        if value is not None:
            try:  # one line now, not a traceback from inside the client
                parse(value)
            except UsageError as exc:
                p.error(f"{flag}: {exc}")
    if args.relay is not None and args.relay_token is None:
        try:  # the environment's, checked as the relay checks it (set but empty: refused)
            args.relay_token = env_token()
        except UsageError as exc:
            p.error(str(exc))
    return args


async def run(args: argparse.Namespace) -> int:
    """Connect, train and submit until the coordinator says stop."""
    train, _ = load_digits()
    try:
        shards = non_iid_shards(train.y, args.clients, alpha=args.alpha, seed=args.seed)
    except ValueError as exc:
        print(f"client {args.index}: {exc}", file=sys.stderr)
        return 2
    shard = shards[args.index]
    data = Split(train.x[shard], train.y[shard])
    key = client_key(args.key_seed, args.index) if args.key_seed is not None else None
    client = FederatedClient(
        args.coordinator,
        address=args.address,
        relay=args.relay,
        relay_token=args.relay_token,
        key=key,
        transport=TransportConfig(tls=not args.plaintext, idle_timeout=IDLE_TIMEOUT),
        name=f"client {args.index}",
    )
    task: RoundTask | None = await client.connect()
    print(f"client {args.index}: joined at round {task.round} with {len(data.y)} samples")
    try:
        while task is not None:
            if args.crash_round is not None and task.round >= args.crash_round:
                print(f"client {args.index}: crashing mid-round {task.round}", flush=True)
                os._exit(17)  # no goodbye, no cleanup: like a power cut
            new = sgd(task.model, data, epochs=args.epochs, lr=args.lr, seed=task.round)
            update = new - task.model
            await asyncio.sleep(args.work * args.slow)
            if args.attack == "scale":
                update = (update * args.scale).astype(np.float32)
            elif args.attack == "nan":
                update = np.full_like(update, np.nan)
            if not await client.submit(update, len(data.y), task.round):
                break  # the coordinator said stop while this client trained
            if args.leave_round is not None and task.round >= args.leave_round:
                print(f"client {args.index}: leaving after round {task.round}")
                break
            # No timeout: the next round may wait for clients started by hand (the
            # coordinator's --join-timeout); a dead coordinator ends it by idle_timeout.
            task = await client.next_round()
    finally:
        await client.close()
    if client.stop_error:
        print(f"client {args.index}: {client.stopped}", file=sys.stderr)
        return 1
    print(
        f"client {args.index}: done ({client.stopped or 'left'}); "
        f"{client.acks_received} verdicts, {client.acks_refused} refused"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return asyncio.run(run(args))
    except P2PError as exc:  # the coordinator out of reach, or gone without a word
        print(f"client {args.index}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
