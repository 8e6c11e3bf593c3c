"""RelaySessionProtocol driven directly, as asyncio's TLS layer would drive it.

The real relay exercises it end to end (test_relay_path.py, test_group_relay.py); these
pin down the orderings a real relay produces only by chance: frames in the same read as
the upgrade answer, frames queued before the handler is set, a bad frame, a lost
connection while the handshake waits, a handler that ends the session.
"""

from __future__ import annotations

import asyncio

import pytest
from transport_conformance import feed

from p2pdist import ConnectionBrokenError, SecretKey
from p2pdist.transport.relay_path import RelayPath
from p2pdist.transport.relay_session import PONG_BACKLOG, RelaySessionProtocol
from p2pdist.wire.relay import (
    MAX_BODY,
    RelayFrame,
    RelayFrameType,
    RelayProtocolError,
    encode_addressed,
    encode_frame,
    upgrade_response,
)


class FakeTransport(asyncio.Transport):
    """Records how the protocol ended the connection, and what it wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: str | None = None
        self.written = bytearray()
        self.backlog = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return self.backlog

    def is_closing(self) -> bool:
        return self.ended is not None

    def close(self) -> None:
        self.ended = self.ended or "close"

    def abort(self) -> None:
        self.ended = self.ended or "abort"


def connected() -> tuple[RelaySessionProtocol, FakeTransport]:
    proto, transport = RelaySessionProtocol("relay test", MAX_BODY), FakeTransport()
    proto.connection_made(transport)
    return proto, transport


ANSWER = upgrade_response()
CHALLENGE = encode_frame(RelayFrameType.CHALLENGE, b"\x01" + bytes(32))


async def test_frames_in_the_same_read_as_the_upgrade_answer() -> None:
    proto, _ = connected()
    src = bytes(range(32))
    feed(proto, ANSWER + CHALLENGE + encode_addressed(RelayFrameType.RECV, src, b"hi"))
    assert (await asyncio.wait_for(proto.upgrade_answer(), 1)).start_line[1] == "101"
    assert await asyncio.wait_for(proto.next_frame(), 1) == RelayFrame(
        RelayFrameType.CHALLENGE, b"", b"\x01" + bytes(32)
    )
    seen: list[RelayFrame] = []
    proto.dispatch_to(lambda f: seen.append(f))  # queued frames first
    assert seen == [RelayFrame(RelayFrameType.RECV, src, b"hi")]
    feed(proto, encode_frame(RelayFrameType.PING, b"12345678"))
    assert seen[-1] == RelayFrame(RelayFrameType.PING, b"", b"12345678")
    assert not proto.done.done()


async def test_an_answer_split_across_reads_and_a_waiting_handshake() -> None:
    proto, _ = connected()
    waiting = asyncio.ensure_future(proto.upgrade_answer())
    await asyncio.sleep(0)
    for i in range(len(ANSWER)):
        feed(proto, ANSWER[i : i + 1])
    assert (await asyncio.wait_for(waiting, 1)).start_line[1] == "101"
    frame = asyncio.ensure_future(proto.next_frame())
    await asyncio.sleep(0)
    feed(proto, CHALLENGE[:3])
    await asyncio.sleep(0)
    assert not frame.done()
    feed(proto, CHALLENGE[3:])
    assert (await asyncio.wait_for(frame, 1)).kind is RelayFrameType.CHALLENGE


async def test_a_bad_frame_ends_the_session_and_aborts() -> None:
    proto, transport = connected()
    feed(proto, ANSWER)
    await asyncio.wait_for(proto.upgrade_answer(), 1)
    proto.dispatch_to(lambda f: None)
    feed(proto, b"\xee\x00\x00\x00\x00")
    with pytest.raises(RelayProtocolError, match="unknown relay frame type"):
        await asyncio.wait_for(proto.done, 1)
    assert transport.ended == "abort"


async def test_a_lost_connection_fails_the_waiting_handshake_with_the_relay_named() -> None:
    proto, _ = connected()
    feed(proto, ANSWER)
    waiting = asyncio.ensure_future(proto.next_frame())
    await asyncio.sleep(0)
    proto.connection_lost(ConnectionResetError("reset by peer"))
    with pytest.raises(ConnectionBrokenError, match=r"relay test.*reset by peer"):
        await asyncio.wait_for(waiting, 1)
    with pytest.raises(ConnectionBrokenError):  # and so does the next wait
        await asyncio.wait_for(proto.next_frame(), 1)


async def test_a_handler_ends_the_session_with_a_retry_after_or_an_error() -> None:
    proto, transport = connected()
    feed(proto, ANSWER)
    await asyncio.wait_for(proto.upgrade_answer(), 1)
    seen: list[RelayFrame] = []

    def handler(frame: RelayFrame) -> float | None:
        seen.append(frame)
        return 2.5 if frame.kind is RelayFrameType.RECONNECT else None

    proto.dispatch_to(handler)
    ping = encode_frame(RelayFrameType.PING, b"12345678")
    feed(proto, ping + encode_frame(RelayFrameType.RECONNECT) + ping)
    assert await asyncio.wait_for(proto.done, 1) == 2.5 and transport.ended == "close"
    assert [f.kind for f in seen] == [RelayFrameType.PING, RelayFrameType.RECONNECT]

    proto, transport = connected()
    feed(proto, ANSWER)

    def refuse(frame: RelayFrame) -> float | None:
        raise ConnectionBrokenError("relay test", "told us to go")

    proto.dispatch_to(refuse)
    feed(proto, ping)
    with pytest.raises(ConnectionBrokenError, match="told us to go"):
        await asyncio.wait_for(proto.done, 1)
    assert transport.ended == "abort"


def test_relay_pings_are_answered_unless_malformed_or_the_relay_does_not_read() -> None:
    path = RelayPath(SecretKey.from_seed("relay session tests", 0), "https://127.0.0.1:9/")
    writer = FakeTransport()
    ping = RelayFrame(RelayFrameType.PING, b"", b"12345678")
    path._handle(ping, writer)
    assert writer.written == encode_frame(RelayFrameType.PONG, b"12345678")
    writer.written.clear()
    writer.backlog = PONG_BACKLOG + 1  # the relay is not reading: no PONG piles up
    for _ in range(100):
        path._handle(ping, writer)
    assert not writer.written
    with pytest.raises(RelayProtocolError, match="PING of 65000 bytes"):
        path._handle(RelayFrame(RelayFrameType.PING, b"", bytes(65_000)), writer)
