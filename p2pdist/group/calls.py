"""Collective calls that never ran: telling a skipped call from a made one.

A collective takes its place in the group's call order when its coroutine first runs.
A task cancelled before that (``task.cancel()`` right after ``create_task``,
``wait_for(..., 0)``, a ``TaskGroup`` cancelling siblings that had not started), or a
coroutine dropped without being awaited, made no call on this rank while the others
made theirs: this rank's next call would pair with the others' skipped one, and with the
same shape and op nothing could tell them apart (silently wrong data). So every
collective is recorded when it is called (:func:`collective`), marked when it starts,
and the next collective to start on the group looks for records that ended unstarted
(:func:`skipped_call`): the group is then broken, naming the call, as a cancellation
of a running collective breaks it.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["CallRecord", "collective", "skipped_call"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class CallRecord:
    """One collective call: its name, whether its coroutine started, and the coroutine
    (weakly: a dropped one must be collected)."""

    __slots__ = ("coro", "name", "started")

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False
        self.coro: weakref.ReferenceType[Coroutine[Any, Any, Any]] | None = None

    def never_ran(self) -> bool:
        """Whether the call ended (cancelled, closed, collected) without starting."""
        if self.started:
            return False
        coro = self.coro() if self.coro is not None else None
        return coro is None or inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


class _Tracks(Protocol):
    _calls_made: list[CallRecord]


_S = TypeVar("_S", bound=_Tracks)


def collective(
    method: Callable[Concatenate[_S, _P], Awaitable[_R]],
) -> Callable[Concatenate[_S, _P], Coroutine[Any, Any, _R]]:
    """Record every call of the collective ``method`` when it is made (see the module
    doc); what it returns is a coroutine, as an ``async def`` gives."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> Coroutine[Any, Any, _R]:
        record = CallRecord(name)
        coro = _run(record, method, self, args, kwargs)
        record.coro = weakref.ref(coro)
        self._calls_made.append(record)
        return coro

    return wrapper


async def _run(
    record: CallRecord,
    method: Callable[..., Awaitable[_R]],
    owner: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> _R:
    record.started = True
    return await method(owner, *args, **kwargs)


def skipped_call(made: list[CallRecord]) -> CallRecord | None:
    """The first recorded call that ended without starting, if any; forgets the calls
    that started (``made`` keeps only those still pending)."""
    skipped = next((r for r in made if r.never_ran()), None)
    made[:] = [r for r in made if not r.started and not r.never_ran()]
    return skipped
