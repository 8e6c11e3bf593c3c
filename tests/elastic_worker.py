"""A rank process for tests/test_federated_elastic.py: decentralised averaging while one
rank is killed.

Usage: python elastic_worker.py MODE RANK WORLD PEERS VICTIM [restarted]
MODE is the group's ``on_peer_loss`` ("leave" or "break"), or "rejoin" ("leave", and the
test restarts the victim with ``restarted``: it rejoins, and every rank runs until
three rounds after the first one the victim is in). Rank VICTIM SIGKILLs itself at the
start of round 1 (mid-round for the others, who may have sent theirs). Every survivor
prints one JSON line per round it finished, ``{"error": ...}`` if a step failed, and
finally ``{"all_reduce": ...}`` with the outcome of a full-group all_reduce.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

from p2pdist import Group, GroupConfig, P2PError, TransportConfig
from p2pdist.federated import FederatedConfig, GroupAveraging

ROUNDS = 4


def update_of(rank: int, rnd: int) -> np.ndarray:
    return np.random.default_rng([rank, rnd]).standard_normal(1000).astype(np.float32)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main(
    mode: str, rank: int, world: int, peers: list[str], victim: int, restarted: bool
) -> None:
    cfg = GroupConfig(
        timeout=60.0,
        connect_timeout=60.0,
        transport=TransportConfig(tls=True, keepalive_interval=0.5, idle_timeout=10.0),
        on_peer_loss="leave" if mode == "rejoin" else mode,
    )
    async with Group.from_seed(
        "elastic-seed-0123456789",
        rank=rank,
        world=world,
        peers=peers,
        config=cfg,
        rejoin=restarted,
    ) as g:
        fed = GroupAveraging(g, np.zeros(1000, np.float32), FederatedConfig(round_timeout=60.0))
        await fed.start()
        stop = None if mode == "rejoin" else ROUNDS
        give_up = time.monotonic() + 90.0  # seconds, not rounds: machines differ in speed
        while stop is None or fed.round < stop:
            rnd = fed.round
            if rank == victim and rnd == 1 and not restarted:
                os.kill(os.getpid(), signal.SIGKILL)
            if time.monotonic() > give_up:
                say(error="the victim was never taken back")
                break
            try:
                out = await fed.step(update_of(rank, rnd), 10 + rank)
            except P2PError as exc:
                say(error=f"{type(exc).__name__}: {exc}")
                break
            if mode == "rejoin":
                if stop is None and victim in out.participants and rnd > 0:
                    stop = rnd + 3
                await asyncio.sleep(0.05)  # rounds at a pace the restarted rank can join
            say(
                round=out.round,
                applied=out.applied,
                reason=out.reason,
                participants=list(out.participants),
                left=list(out.left),
                model=hashlib.sha256(fed.model.tobytes()).hexdigest(),
            )
        try:
            await g.all_reduce(np.ones(4), timeout=30)
            say(all_reduce="OK")
        except P2PError as exc:
            say(all_reduce=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    mode, rank, world, peers, victim = sys.argv[1:6]
    restarted = sys.argv[6:] == ["restarted"]
    asyncio.run(main(mode, int(rank), int(world), peers.split(","), int(victim), restarted))
