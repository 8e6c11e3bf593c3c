"""A federated client process for the tests: ``python tests/federated_worker.py ID HOST:PORT
hang``: join, print ``got round R`` for the first model, then never submit (the test
kills it mid-round)."""

from __future__ import annotations

import asyncio
import sys

from p2pdist import TransportConfig
from p2pdist.federated import FederatedClient


async def main(coordinator: str, address: str, mode: str) -> None:
    client = FederatedClient(coordinator, address=address, transport=TransportConfig(tls=False))
    if mode != "hang":
        raise SystemExit(f"unknown mode {mode!r}")
    task = await client.connect()
    print(f"got round {task.round}", flush=True)
    await asyncio.sleep(3600)  # until the test kills this process


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
