"""A collective takes its place in the call order when it is called, not when it starts.

Ranks pair their collectives by call id: the n-th call on one rank meets the n-th call on
every other. If the id were taken when the call's coroutine first runs, a call dropped
before it ran on one rank only (its task cancelled before its first step, as a
``TaskGroup`` does to its other tasks when one fails; its coroutine closed or never
awaited) would take no id there, and that rank's next call would meet the others'
dropped one: the same shape every training step, so wrong data and no error.

:func:`collective` therefore reserves the id when the method is called and wraps the
coroutine in a :class:`CollectiveCall`, which hands the id to the call when it starts.
A call that ends without having run (see :meth:`Reserving._skip`) leaves a gap: its
channel is retired here, and the others are told, so theirs fails at once naming this
rank instead of waiting for its timeout. Ranks that all drop the same call stay in step.
One exception: a call refused for its arguments (:class:`UsageError`, before it took its
id) gives its id back when no later call has taken one, so the call is as if never made
and a corrected retry takes its place, as before.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..errors import UsageError

__all__ = ["CollectiveCall", "Reserving", "collective"]

_T = TypeVar("_T")
_P = ParamSpec("_P")
_G = TypeVar("_G", bound="Reserving")


class Reserving:
    """The call-id bookkeeping :class:`CollectiveCall` needs of a group (GroupCore)."""

    _next_cid: int
    _pending: set[int]  # call ids reserved by calls that have not started yet
    _taking: int | None  # the id the call now starting reserved, until _run takes it

    def _reserve(self) -> int | None:
        """A call id for a collective called now, or None when it cannot run now (it
        will raise at its start) or needs no peer: it then takes none."""
        raise NotImplementedError

    def _skip(self, cid: int, why: str) -> None:
        """Call ``cid`` ended without running on this rank, for reason ``why``."""
        raise NotImplementedError

    def _release(self, cid: int) -> bool:
        """Give call id ``cid`` back if no call has taken a later one (then True)."""
        raise NotImplementedError

    def _skip_soon(self, cid: int, why: str) -> None:
        """:meth:`_skip` from a finalizer: on the event loop, not in the middle of
        whatever code dropped the last reference."""
        raise NotImplementedError


class CollectiveCall(Coroutine[Any, Any, _T]):
    """The coroutine of one collective call, holding its reserved call id.

    It drives the method's own coroutine and behaves as one (``await`` it, or pass it
    to ``asyncio.create_task`` or ``gather``). It sees the call start (its first step),
    and sees a call that ends without having run: thrown into or closed before its first
    step, garbage-collected unawaited, or failed before it took its id."""

    __slots__ = ("_cid", "_coro", "_group", "_started")

    def __init__(self, group: Reserving, cid: int, coro: Coroutine[Any, Any, _T]) -> None:
        self._group = group
        self._cid = cid
        self._coro = coro
        self._started = False

    def send(self, value: Any) -> Any:
        """Advance the call (the first step hands it its call id)."""
        if self._started:
            try:
                return self._coro.send(value)
            except BaseException as exc:
                self._settle(exc)
                raise
        self._started = True
        group = self._group
        outer = group._taking  # a call made inside another's first step
        group._taking = self._cid
        try:
            return self._coro.send(value)
        except BaseException as exc:
            self._settle(exc)
            raise
        finally:
            group._taking = outer

    def throw(self, *args: Any) -> Any:
        """Raise an exception in the call; before its first step, it never runs."""
        self._started = True  # before its first step, the method's code never runs
        try:
            return self._coro.throw(*args)
        except BaseException as exc:
            self._settle(exc)
            raise

    def close(self) -> None:
        """Close the call; before its first step, it never runs."""
        self._started = True
        self._coro.close()
        if self._cid in self._group._pending:
            self._group._skip(self._cid, "it was closed before it started")

    def __await__(self) -> Generator[Any, None, _T]:
        return self  # our send/throw drive the await

    def __next__(self) -> Any:
        return self.send(None)

    def __iter__(self) -> CollectiveCall[_T]:
        return self

    def __del__(self) -> None:
        if not self._started:  # never awaited (Python warns of the method's coroutine)
            self._started = True
            self._group._skip_soon(self._cid, "it was never awaited")

    def __repr__(self) -> str:
        return f"<CollectiveCall #{self._cid} {self._coro!r}>"

    def _settle(self, exc: BaseException) -> None:
        """The call ended with ``exc``: if it never took its id, it never ran."""
        if self._cid not in self._group._pending:
            return
        if isinstance(exc, UsageError) and self._group._release(self._cid):
            return  # refused for its arguments: as if never called (a retry takes its place)
        if isinstance(exc, asyncio.CancelledError):
            why = "it was cancelled before it started"
        elif isinstance(exc, StopIteration):
            why = "it returned without running"
        else:
            why = f"it failed before it started: {type(exc).__name__}: {str(exc)[:200]}"
        self._group._skip(self._cid, why)


def collective(
    method: Callable[Concatenate[_G, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[_G, _P], Coroutine[Any, Any, _T]]:
    """Make ``method`` (an ``async def`` collective of a group) take its call id when it
    is called (see the module's docstring). A group that cannot run it now, or has one
    rank, takes none: the plain coroutine is returned."""

    @functools.wraps(method)
    def call(self: _G, /, *args: _P.args, **kwargs: _P.kwargs) -> Coroutine[Any, Any, _T]:
        coro = method(self, *args, **kwargs)
        cid = self._reserve()
        if cid is None:
            return coro
        return CollectiveCall(self, cid, coro)

    return call
