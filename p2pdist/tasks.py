"""Ending background tasks: one rule for every owner that closes (transports, groups,
federated coordinators and clients)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["STOP_TIMEOUT", "cancel_and_wait"]

log = logging.getLogger(__name__)


STOP_TIMEOUT = 5.0
"""Seconds :func:`cancel_and_wait` waits by default for cancelled tasks to end."""


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], *, timeout: float = STOP_TIMEOUT
) -> None:
    """Cancel ``tasks`` and wait until every one has ended, so none outlives its owner;
    what they raised is theirs and is dropped. ``timeout`` (seconds) bounds the wait for
    tasks that do not end when cancelled; those are logged by name. The wait goes on if
    we are cancelled (shielded), and our cancellation is raised after."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    if pending:
        waiting = asyncio.ensure_future(asyncio.wait(pending, timeout=timeout))
        try:
            await asyncio.shield(waiting)
        except asyncio.CancelledError:  # we were cancelled: finish the wait, then say so
            await waiting
            raise
        finally:
            if waiting.done() and not waiting.cancelled():
                _warn_stuck(waiting.result()[1], timeout)


def _warn_stuck(stuck: set[asyncio.Future[Any]], timeout: float) -> None:
    if stuck:
        names = ", ".join(map(repr, stuck))  # a task's repr names it and its coroutine
        log.warning("still running %g s after cancel: %s", timeout, names)
