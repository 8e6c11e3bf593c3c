"""cancel_and_wait: every wait is bounded, and a task that outlives it is named."""

from __future__ import annotations

import asyncio
import logging

import pytest

from p2pdist.tasks import cancel_and_wait


async def test_a_task_that_ignores_cancel_is_waited_for_boundedly_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # swallows every cancel until released

    async def polite() -> None:
        await asyncio.sleep(3600)

    a = asyncio.create_task(stubborn(), name="stubborn-sender")
    b = asyncio.create_task(polite(), name="polite-reader")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="p2pdist.tasks"):
        async with asyncio.timeout(5):
            await cancel_and_wait([a, b], timeout=0.1)
    assert b.cancelled() and not a.done()
    assert "stubborn-sender" in caplog.text and "polite-reader" not in caplog.text
    release.set()
    await asyncio.wait_for(a, 1)


async def test_a_cancelled_owner_still_waits_for_its_tasks_to_end() -> None:
    """Cancelling the caller of cancel_and_wait does not cut the wait short: its tasks
    have ended by the time its own cancellation is raised."""
    cleaned = asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.2)  # cleanup that takes a while after the cancel
            cleaned.set()

    task = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0)
    owner = asyncio.create_task(cancel_and_wait([task], timeout=5))
    await asyncio.sleep(0.05)  # the owner is waiting now
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(owner, 5)
    assert task.done() and cleaned.is_set()
