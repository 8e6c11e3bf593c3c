"""Rank 2 of a 3-rank group through a relay, as a process of its own.

Usage: python rejoin_worker.py first|back RELAY_URL
"first": form the group, run one all_reduce, print READY, then wait to be killed or
stopped. "back": the same rank restarted with ``rejoin=True``: take part in one
all_reduce and print its result as ``SUM <values>``, or ``ERROR <type>: <message>``.
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from p2pdist import Group, GroupConfig, P2PError, PunchConfig, TransportConfig

SEED = "rejoin-worker-seed-0123456789"


def config() -> GroupConfig:
    """The settings every rank of the test uses (the survivors too)."""
    return GroupConfig(
        timeout=30.0,
        connect_timeout=30.0,
        punch=PunchConfig(enabled=False),
        on_peer_loss="leave",
        transport=TransportConfig(keepalive_interval=0.2, idle_timeout=30.0),
    )


async def main(mode: str, relay: str) -> None:
    g = Group.from_seed(SEED, rank=2, world=3, relay=relay, config=config(), rejoin=mode == "back")
    try:
        async with g:
            out = await g.all_reduce(np.full(3, 3.0))
            if mode == "first":
                print("READY", flush=True)
                await asyncio.sleep(3600)
            print("SUM " + " ".join(f"{v:g}" for v in out), flush=True)
    except P2PError as exc:
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
