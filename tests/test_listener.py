"""The TCP listener serves or closes every socket it accepts (transport/listener.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, ClassVar

import pytest

from p2pdist.transport.listener import Listener


class _Served(asyncio.Protocol):
    made: ClassVar[list[asyncio.BaseTransport]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _Served.made.append(transport)


async def _eof_or_reset(reader: asyncio.StreamReader) -> bytes:
    with contextlib.suppress(ConnectionResetError):
        return await asyncio.wait_for(reader.read(), 5)
    return b""


async def test_a_listener_closed_between_accept_and_transport_closes_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncio's Server, closed in that window, left the accepted socket open and unserved
    until garbage collection: the dialler waited out its whole handshake timeout (10 s
    stalls when a group formed again on the same ports right after closing)."""
    loop = asyncio.get_running_loop()
    real = loop.connect_accepted_socket
    entered = asyncio.Event()

    async def held_open(factory: Any, sock: socket.socket, **kw: Any) -> Any:
        entered.set()
        await asyncio.Event().wait()  # the window, held open until the listener closes
        return await real(factory, sock, **kw)

    monkeypatch.setattr(loop, "connect_accepted_socket", held_open)
    listener = await Listener.open("127.0.0.1", 0, _Served)
    reader, writer = await asyncio.open_connection(*listener.address)
    try:
        await asyncio.wait_for(entered.wait(), 5)
        await listener.close()
        assert await _eof_or_reset(reader) == b""  # closed at once, not left open
    finally:
        writer.close()


async def test_a_listener_serves_what_it_accepts_and_refuses_once_closed() -> None:
    _Served.made.clear()
    listener = await Listener.open("127.0.0.1", 0, _Served)
    host, port = listener.address
    reader, writer = await asyncio.open_connection(host, port)
    for _ in range(500):
        if _Served.made:
            break
        await asyncio.sleep(0.01)
    assert len(_Served.made) == 1
    await listener.close()
    with pytest.raises(OSError):
        await asyncio.open_connection(host, port)
    for transport in _Served.made:
        transport.close()
    assert await _eof_or_reset(reader) == b""
    writer.close()


async def test_a_listener_on_a_taken_port_names_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=r"error while attempting to bind on address.*in use"):
            await Listener.open("127.0.0.1", port, _Served)


async def test_a_listener_closed_right_after_dials_leaves_no_dialler_waiting() -> None:
    """Close at every point of an accept: each dialled socket is served or closed, so
    every dialler reads its end at once (a served one is closed by its protocol)."""
    for rounds in range(40):
        _Served.made.clear()
        listener = await Listener.open("127.0.0.1", 0, _Served)
        dials = [asyncio.open_connection(*listener.address) for _ in range(3)]
        pairs = await asyncio.gather(*dials)
        for _ in range(rounds % 4):  # let the accepts get that far
            await asyncio.sleep(0)
        await listener.close()
        for transport in _Served.made:
            transport.close()
        for reader, writer in pairs:
            assert await _eof_or_reset(reader) == b""
            writer.close()
