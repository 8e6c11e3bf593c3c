"""The mailbox charges every queued frame and channel, so frames without meta or payload
still count towards ``max_buffered`` and trigger backpressure."""

from __future__ import annotations

import asyncio

from p2pdist.transport.mailbox import CHANNEL_OVERHEAD, FRAME_OVERHEAD, Mailbox
from p2pdist.wire.frames import FrameDecoder, FrameKind, encode_header


def new_mailbox(max_buffered: int) -> tuple[Mailbox, list[str]]:
    events: list[str] = []
    mb = Mailbox(
        max_buffered,
        lambda: events.append("pause"),
        lambda: events.append("resume"),
        lambda: "rank 1 (abcdefghij)",
    )
    return mb, events


async def test_empty_frames_on_new_channels_count_and_pause() -> None:
    mb, events = new_mailbox(1 << 20)
    n = 2000
    wire = b"".join(encode_header(FrameKind.DATA, channel=i + 1) for i in range(n))
    for frame in FrameDecoder().feed(wire):
        assert frame.nbytes == 0
        mb.deliver(frame)
    assert mb.buffered == n * (FRAME_OVERHEAD + CHANNEL_OVERHEAD) > 1 << 20
    assert events == ["pause"]
    # taking them back releases exactly what was charged: the count returns to zero
    for i in range(n):
        assert (await mb.get(i + 1, 1.0)).channel == i + 1
    assert mb.buffered == 0 and events == ["pause", "resume"]


async def test_empty_frames_on_one_channel_count_and_retire_releases_them() -> None:
    mb, events = new_mailbox(100 * FRAME_OVERHEAD)
    wire = b"".join(encode_header(FrameKind.DATA, channel=7, seq=i) for i in range(200))
    for frame in FrameDecoder().feed(wire):
        mb.deliver(frame)
    assert mb.buffered == CHANNEL_OVERHEAD + 200 * FRAME_OVERHEAD
    assert events == ["pause"]
    mb.retire(7)
    assert mb.buffered == 0 and mb.dropped == 200 and events == ["pause", "resume"]
    await asyncio.sleep(0)


async def test_reading_does_not_pause_while_a_sender_waits_and_unpause_reads_on() -> None:
    """``may_pause`` says whether reading may pause (not while a sender of the endpoint
    waits for its peer: two ranks could each wait in a send while their reading paused);
    ``unpause`` resumes a paused mailbox, and the next frame over the limit pauses it
    again once pausing is allowed."""
    events: list[str] = []
    allowed = [False]
    mb = Mailbox(
        100 * FRAME_OVERHEAD,
        lambda: events.append("pause"),
        lambda: events.append("resume"),
        lambda: "rank 1 (abcdefghij)",
        may_pause=lambda: allowed[0],
    )
    wire = b"".join(encode_header(FrameKind.DATA, channel=7, seq=i) for i in range(300))
    frames = FrameDecoder().feed(wire)
    for frame in frames[:200]:
        mb.deliver(frame)
    assert events == [] and mb.buffered > 100 * FRAME_OVERHEAD  # a sender waits: read on
    allowed[0] = True
    mb.deliver(frames[200])
    assert events == ["pause"]
    mb.unpause()
    mb.unpause()  # (once)
    assert events == ["pause", "resume"]
    mb.deliver(frames[201])
    assert events == ["pause", "resume", "pause"]
