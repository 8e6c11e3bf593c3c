"""A federated client process for the tests: ``python tests/federated_worker.py ID WHERE
hang [KEY_SEED]``: print ``started``, join the coordinator ``ID`` at ``WHERE``
(``host:port``, plaintext TCP, or a relay URL), print ``got round R`` for the first
model, then never submit (the test kills it mid-round). ``KEY_SEED``: a fixed key (the
same endpoint id each start)."""

from __future__ import annotations

import asyncio
import sys

from p2pdist import SecretKey, TransportConfig
from p2pdist.federated import FederatedClient


async def main(coordinator: str, where: str, mode: str, key_seed: str | None = None) -> None:
    key = SecretKey.from_seed(key_seed, 0) if key_seed else None
    if where.startswith("https://"):
        client = FederatedClient(coordinator, relay=where, key=key)
    else:
        client = FederatedClient(
            coordinator, address=where, transport=TransportConfig(tls=False), key=key
        )
    print("started", flush=True)  # imports done: what follows is the connection
    if mode != "hang":
        raise SystemExit(f"unknown mode {mode!r}")
    task = await client.connect()
    print(f"got round {task.round}", flush=True)
    await asyncio.sleep(3600)  # until the test kills this process


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
