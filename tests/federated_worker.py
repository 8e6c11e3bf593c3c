"""A federated client process for the tests: ``python tests/federated_worker.py ID HOST:PORT
MODE``. MODE ``hang``: join, print ``got round R`` for the first model, then never
submit (the test kills it mid-round). MODE ``submit``: submit ones for every round."""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from p2pdist import TransportConfig
from p2pdist.federated import FederatedClient


async def main(coordinator: str, address: str, mode: str) -> None:
    client = FederatedClient(coordinator, address=address, transport=TransportConfig(tls=False))
    task = await client.connect()
    print(f"got round {task.round}", flush=True)
    if mode == "hang":
        await asyncio.sleep(3600)
    while task is not None:
        await client.submit(np.ones_like(task.model), 1, task.round)
        task = await client.next_round(timeout=60)
    await client.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
