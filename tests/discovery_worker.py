"""A rank process for tests/test_discovery.py: a group formed with neither peers= nor
relay=, the ranks finding each other on the local network (mDNS).

Usage: python discovery_worker.py SEED RANK WORLD [LISTEN [CONNECT_TIMEOUT [HANDSHAKE_TIMEOUT]]]
(SEED ``-``: ``Group.from_env()``, RANK and WORLD then only for the output)
Prints one JSON line: ``{"sum": [...], "dialed": {rank: host:port}}`` (the lower ranks,
which this rank dialed) after an all_reduce of ``rank + 1`` over the group, or
``{"error": type, "text": str}``.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from p2pdist import Group, GroupConfig, P2PError, TransportConfig


async def main(
    seed: str, rank: int, world: int, listen: str | None, wait: float, handshake: float | None
) -> None:
    shaking = {} if handshake is None else {"handshake_timeout": handshake}
    config = GroupConfig(connect_timeout=wait, timeout=30.0, transport=TransportConfig(**shaking))
    if seed == "-":
        group = Group.from_env(config=config)
    else:
        group = Group.from_seed(seed, rank=rank, world=world, listen=listen, config=config)
    try:
        async with group as g:
            total = await g.all_reduce(np.full(4, rank + 1.0))
            await g.barrier()  # nobody closes while another still reads its part
            found = g._discovery.found if g._discovery is not None else {}
            dialed = {r: found[g._ids[r]][0] for r in range(rank)}  # (it dials lower ranks)
            print(json.dumps({"sum": total.tolist(), "dialed": dialed}), flush=True)
    except P2PError as exc:
        print(json.dumps({"error": type(exc).__name__, "text": str(exc)}), flush=True)


if __name__ == "__main__":
    seed, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    listen = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    wait = float(sys.argv[5]) if len(sys.argv) > 5 else 30.0
    handshake = float(sys.argv[6]) if len(sys.argv) > 6 else None
    asyncio.run(asyncio.wait_for(main(seed, rank, world, listen, wait, handshake), 120))
