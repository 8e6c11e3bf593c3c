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
