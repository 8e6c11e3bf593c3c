"""Dialing a name with several addresses (RFC 8305, "Happy Eyeballs"), on any event loop.

A relay published with an A and an AAAA record is reached by whichever address answers
first: the addresses are tried in turn, IPv6 and IPv4 interleaved, each starting
:data:`ATTEMPT_DELAY` after the one before (or as soon as it fails), and the first
connected socket wins. Tried one after another instead (asyncio's default, and uvloop
has no other), an address whose packets are silently dropped (a broken IPv6 path, which
is common) holds the dial until its caller's bound and the working address is never
reached, on every retry.
"""

from __future__ import annotations

import asyncio
import random as _random
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import UsageError
from .paths import path_key

_P = TypeVar("_P", bound=asyncio.BaseProtocol)

__all__ = ["ATTEMPT_DELAY", "connect_tcp", "connect_tcp_any", "connection_on", "interleaved"]

ATTEMPT_DELAY = 0.25
"""Seconds before the next address is tried while the ones before still wait (RFC 8305's
recommended "Connection Attempt Delay")."""

AddrInfo = tuple[int, int, int, str, Any]
"""One entry of ``getaddrinfo``: family, type, proto, canonname, sockaddr."""


def interleaved(infos: Sequence[AddrInfo]) -> list[AddrInfo]:
    """``infos`` without repeats, families taking turns (RFC 8305 section 4), starting
    with the family of the first one (the system's preference)."""
    by_family: dict[int, list[AddrInfo]] = {}
    seen: set[tuple[int, Any]] = set()
    for info in infos:
        key = (info[0], info[4])
        if key not in seen:
            seen.add(key)
            by_family.setdefault(info[0], []).append(info)
    queues = list(by_family.values())
    out: list[AddrInfo] = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


async def connect_tcp(
    host: str,
    port: int,
    *,
    delay: float = ATTEMPT_DELAY,
    redial: float | None = None,
    random: Callable[[], float] = _random.random,
) -> socket.socket:
    """A non-blocking TCP socket connected to ``host:port``: its addresses raced as the
    module docstring says. With ``redial``, an address unanswered for that long (times
    1 to 1.5, ``random`` jitters it) is dialed again on a new socket beside the old
    attempt (the one before that is dropped: two per address): a new SYN at once
    instead of the kernel's retransmission, 1, 3, 7, 15 s apart on many kernels, so a
    server that comes back (a relay after an outage) is reached within about
    ``redial``, while a dial whose answer takes longer than that (a slow path) still
    gets through.

    The caller bounds the wait (cancelling closes every socket opened here). When every
    address fails: that error if there was one address, or all of them refused, else
    an ``OSError`` listing each."""
    return await connect_tcp_any([(host, port)], delay=delay, redial=redial, random=random)


async def connect_tcp_any(
    endpoints: Sequence[tuple[str, int]],
    *,
    delay: float = ATTEMPT_DELAY,
    redial: float | None = None,
    random: Callable[[], float] = _random.random,
) -> socket.socket:
    """:func:`connect_tcp` for one peer known at several ``(host, port)`` endpoints (a
    rank that the local network announces on each of its interfaces): every address of
    every endpoint, in the order given, families taking turns, raced as one list."""
    if redial is not None and not redial > 0:
        raise UsageError(f"redial must be a positive number of seconds, got {redial!r}")
    if not endpoints:
        raise UsageError("no address to connect to")
    loop = asyncio.get_running_loop()
    found: list[AddrInfo] = []
    for host, port in endpoints:
        try:
            found += await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            if len(endpoints) == 1:
                raise
            continue  # (the others may resolve)
    infos = interleaved(found)
    if not infos:
        names = ", ".join(path_key(e) for e in endpoints)
        raise OSError(f"{names} resolve{'s' if len(endpoints) == 1 else ''} to no address")
    return await _race(infos, delay, redial, random)


async def _attempt(info: AddrInfo) -> socket.socket:
    family, kind, proto, _, addr = info
    sock = socket.socket(family, kind, proto)  # may fail too: a family the host lacks
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    return sock


async def _race(
    infos: list[AddrInfo], delay: float, redial: float | None, random: Callable[[], float]
) -> socket.socket:
    loop = asyncio.get_running_loop()
    waiting = list(infos)
    running: dict[asyncio.Task[socket.socket], AddrInfo] = {}
    stale_at: dict[asyncio.Task[socket.socket], float] = {}  # when to dial it again
    superseded: set[asyncio.Task[socket.socket]] = set()  # left running beside a newer one
    errors: list[tuple[AddrInfo, OSError]] = []
    winner: socket.socket | None = None

    def drop_older(info: AddrInfo) -> None:
        for older in [t for t in superseded if running.get(t) == info]:
            older.cancel()  # (its socket is closed as it ends)

    try:
        while waiting or running:
            if waiting:
                info = waiting.pop(0)
                task = asyncio.ensure_future(_attempt(info))
                running[task] = info
                if redial is not None:
                    stale_at[task] = loop.time() + redial * (1.0 + 0.5 * random())
            timeout = delay if waiting else None
            if stale_at and not waiting:
                timeout = max(0.0, min(stale_at.values()) - loop.time())
            done, _ = await asyncio.wait(
                running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                info = running.pop(task)
                stale_at.pop(task, None)
                if task.cancelled():  # superseded twice (below)
                    superseded.discard(task)
                    continue
                exc = task.exception()
                if exc is None:
                    winner = task.result()
                    return winner  # (another one done too is closed below)
                if task in superseded:
                    superseded.discard(task)
                    continue  # its newer attempt goes on
                if not isinstance(exc, OSError):
                    raise exc
                errors.append((info, exc))
                drop_older(info)  # the newest said no (refused, say): that is the answer
            now = loop.time()
            for task, at in list(stale_at.items()):
                if at <= now and not task.done():  # unanswered: a fresh SYN, at once
                    del stale_at[task]
                    info = running[task]
                    drop_older(info)
                    superseded.add(task)
                    waiting.append(info)
    finally:
        for task in running:
            # Each attempt closes its socket when cancelled; one that connected anyway
            # (it finished before the cancel reached it) is closed as it ends.
            task.cancel()
            task.add_done_callback(_close_if_connected)
        if running:
            try:
                await asyncio.wait(running)
            except BaseException:  # cancelled again meanwhile: the winner is lost too
                if winner is not None:
                    winner.close()
                raise
    if len(errors) == 1 or all(isinstance(e, ConnectionRefusedError) for _, e in errors):
        raise errors[0][1]
    raise OSError("; ".join(f"{path_key(info[4][:2])}: {e}" for info, e in errors))


def _close_if_connected(task: asyncio.Task[socket.socket]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


async def connection_on(
    sock: socket.socket, factory: Callable[[], _P]
) -> tuple[asyncio.Transport, _P]:
    """asyncio's ``create_connection`` on the connected ``sock`` (from :func:`connect_tcp`
    or a proxy tunnel), which is closed if that fails or is cancelled."""
    try:
        return await asyncio.get_running_loop().create_connection(factory, sock=sock)
    except BaseException:
        sock.close()
        raise
