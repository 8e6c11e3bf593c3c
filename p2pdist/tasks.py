"""Ending background tasks: one rule for every owner that closes (transports, groups,
federated coordinators and clients)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], *, timeout: float | None = None
) -> None:
    """Cancel ``tasks`` and wait until every one has ended, so none outlives its owner;
    what they raised is theirs and is dropped. ``timeout`` (seconds) bounds the wait for
    tasks that do not end when cancelled. The wait goes on if we are cancelled
    (shielded), and our cancellation is raised after."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.shield(asyncio.wait(pending, timeout=timeout))
