"""Helpers that form real groups on loopback inside one event loop (or as processes)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

from p2pdist import ConnectionBrokenError, Group, GroupConfig, TransportConfig
from p2pdist.launch import pick_free_ports


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (all bound at once, then released)."""
    return pick_free_ports("127.0.0.1", n)


def loopback_peers(n: int) -> list[str]:
    """One free ``127.0.0.1:port`` address per rank."""
    return [f"127.0.0.1:{p}" for p in free_ports(n)]


@contextlib.asynccontextmanager
async def groups(
    n: int,
    *,
    tls: bool = False,
    seed: str = "test-seed-0123456789",
    timeout: float = 20.0,
    config: dict[str, Any] | None = None,
    **transport: Any,
) -> AsyncIterator[list[Group]]:
    """``n`` started groups, one per rank, all in this event loop over real sockets.

    ``config`` holds extra GroupConfig fields; other keywords are TransportConfig fields.
    """
    cfg = GroupConfig(
        timeout=timeout,
        connect_timeout=20.0,
        transport=TransportConfig(tls=tls, **transport),
        **(config or {}),
    )
    peers = loopback_peers(n)
    gs = [Group.from_seed(seed, rank=r, world=n, peers=peers, config=cfg) for r in range(n)]
    try:  # a rank that fails to form still closes the others
        await asyncio.gather(*(g.start() for g in gs))
        yield gs
    finally:
        await asyncio.gather(*(g.close() for g in gs), return_exceptions=True)


def crash(g: Group) -> None:
    """Drop every connection of ``g`` at once, without a goodbye (like SIGKILL): every
    socket is closed first, so the abort notices ``g`` would send as the first loss
    breaks it reach nobody, as a killed process sends none."""
    conns = list(g._conns.values())
    for conn in conns:
        transport = getattr(conn, "_transport", None)
        if transport is not None:
            transport.abort()  # the socket goes at once: nothing more leaves
    for conn in conns:
        conn.abort(ConnectionBrokenError(g.peer_label(g.rank), "simulated crash"))  # type: ignore[attr-defined]


async def until_left(gs: list[Group], rank: int, seconds: float = 30.0) -> None:
    """Wait (bounded by ``seconds``) until every group in ``gs`` has seen ``rank`` go."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not all(rank in g.left for g in gs):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"rank {rank}'s loss was not seen: {[sorted(g.left) for g in gs]}")
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def slow_link(g: Group, peer: int, seconds: float, *, space: int | None = None) -> Any:
    """Delay what ``g`` sends to rank ``peer`` by ``seconds``, in order (a far link); with
    ``space``, only collective messages on that channel space (control notices too go
    straight). Undone on exit."""
    from p2pdist.transport.mailbox import SPACE_SHIFT

    conn: Any = g._conns[peer]
    send, send_nowait = conn.send, conn.send_nowait
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bool, tuple[Any, ...], dict[str, Any]]] = asyncio.Queue()

    async def pump() -> None:
        while True:
            at, waits, args, kw = await queue.get()
            await asyncio.sleep(max(0.0, at - loop.time()))
            if waits:
                await send(*args, **kw)
            else:
                send_nowait(*args, **kw)

    def delayed(channel: int) -> bool:
        return space is None or channel >> SPACE_SHIFT == space

    async def slow_send(channel: int, payload: Any = b"", **kw: Any) -> None:
        if not delayed(channel):
            return await send(channel, payload, **kw)
        queue.put_nowait((loop.time() + seconds, True, (channel, bytes(payload)), kw))

    def slow_send_nowait(channel: int, payload: Any = b"", **kw: Any) -> None:
        if not delayed(channel):
            return send_nowait(channel, payload, **kw)
        queue.put_nowait((loop.time() + seconds, False, (channel, bytes(payload)), kw))

    task = asyncio.ensure_future(pump())
    conn.send, conn.send_nowait = slow_send, slow_send_nowait
    try:
        yield
    finally:
        conn.send, conn.send_nowait = send, send_nowait
        task.cancel()


def run_ranks(
    command: list[str], env: dict[str, str], world: int, timeout: float
) -> list[tuple[str, str]]:
    """Start ``command`` once per rank, with ``env`` plus P2PDIST_RANK, as separately
    started processes would be on a fleet; wait for all (bounded: past ``timeout``
    seconds every one is killed and the test fails); assert each exited 0; return each
    rank's (stdout, stderr)."""
    procs = [
        subprocess.Popen(
            command,
            env={**env, "P2PDIST_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout
    outs: list[tuple[str, str]] = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}: {err}"
    return outs
