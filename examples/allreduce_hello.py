"""Hello, all_reduce: every rank contributes ``rank + 1`` and all get the sum.

Run two ranks on this machine (the launcher sets P2PDIST_SEED/RANK/WORLD/PEERS/TLS)::

    p2pdist launch -n 2 -- python examples/allreduce_hello.py
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from p2pdist import Group, P2PError


async def main() -> None:
    """Join the group described by the environment and sum one small array."""
    async with Group.from_env() as g:
        x = np.full(4, g.rank + 1, dtype=np.float32)
        total = await g.all_reduce(x, op="sum")
        expected = g.size * (g.size + 1) / 2
        assert np.all(total == expected), total
        print(f"hello from {g.peer_label(g.rank)} of {g.size}: all_reduce sum = {total}")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except P2PError as exc:  # not started by the launcher, a relay that refused us, ...
        sys.exit(f"allreduce_hello: {exc}")
