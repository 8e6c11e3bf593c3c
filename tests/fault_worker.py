"""A rank process for failure tests: forms a group, then misbehaves as told.

Usage: python fault_worker.py MODE RANK WORLD PEERS  (PEERS comma-separated host:port)
MODE: "kill" - rank WORLD-1 SIGKILLs itself before the second all_reduce;
      "stop" - rank WORLD-1 SIGSTOPs itself (silent: no data, no keepalives).
Surviving ranks print one line "ERROR <type>: <message>" (or "OK") and exit 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import numpy as np

from p2pdist import Group, GroupConfig, P2PError, TransportConfig


async def main(mode: str, rank: int, world: int, peers: list[str]) -> None:
    cfg = GroupConfig(
        timeout=30.0,
        connect_timeout=30.0,
        transport=TransportConfig(tls=True, keepalive_interval=0.2, idle_timeout=4.0),
    )
    async with Group.from_seed(
        "fault-seed-0123456789", rank=rank, world=world, peers=peers, config=cfg
    ) as g:
        x = np.ones(1 << 20, np.float32)  # ring path
        try:
            # The victim may die while slower ranks still finish this first collective:
            # then that one fails, which must name the victim just the same.
            await g.all_reduce(x)
            print("READY", flush=True)
            if rank == world - 1:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif mode == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
            timeout = 30.0 if mode == "kill" else 6.0
            await g.all_reduce(x, timeout=timeout)
            print("OK", flush=True)
        except P2PError as exc:
            print(f"ERROR {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")))
