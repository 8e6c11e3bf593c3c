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
import contextlib
import functools
import inspect
from collections.abc import Callable, Coroutine, Generator, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..errors import UsageError
from .compress import ErrorFeedback

__all__ = [
    "CollectiveCall",
    "Reserving",
    "as_coroutine_function",
    "collective",
    "foreign_loop_error",
]

_T = TypeVar("_T")
_P = ParamSpec("_P")
_G = TypeVar("_G", bound="Reserving")
_F = TypeVar("_F", bound=Callable[..., Any])


class Reserving:
    """The call-id bookkeeping :class:`CollectiveCall` needs of a group (GroupCore)."""

    _next_cid: int
    _pending: dict[int, int]  # call id -> its holder's place in _call_order: reserved, not started
    _taking: int | None  # the id the call now starting reserved, until _run takes it
    _home_loop: asyncio.AbstractEventLoop | None  # the loop the group was started on
    _call_order: Iterator[int]
    """Numbers collective calls in the order they were made, shared by a group and its
    sub-groups (whose calls have ids of their own): the holder of a reserved id, and what
    timeouts compare to name the calls made earlier that have not started."""

    def _call_number(self) -> int:
        """The place in the call order of the call now taking its first steps (until
        ``_run`` takes its id), or -1 for a call that reserved none."""
        cid = self._taking
        return -1 if cid is None else self._pending.get(cid, -1)

    def _reserve(self) -> tuple[int, int] | None:
        """A call id for a collective called now and its place in ``_call_order`` (which
        holds the id); None at world 1, off the group's event loop, or when the group
        cannot run it now (it raises that at its start): the call then takes its id when
        it starts, as an unwrapped one."""
        raise NotImplementedError

    def _skip(self, cid: int, holder: int, why: str) -> None:
        """Call ``cid`` (if ``holder`` still holds it) ended without running on this
        rank, for reason ``why``."""
        raise NotImplementedError

    def _release(self, cid: int, holder: int) -> bool:
        """Give call id ``cid`` back if ``holder`` holds it and no call has taken a later
        one (then True)."""
        raise NotImplementedError

    def _give_back(self, cid: int, holder: int, why: str) -> None:
        """Give call id ``cid`` back (a call refused for its arguments), or skip it as
        :meth:`_skip` does when a later call was made already."""
        if not self._release(cid, holder):
            self._skip(cid, holder, why)


class CollectiveCall(Coroutine[Any, Any, _T]):
    """The coroutine of one collective call, holding its reserved call id.

    It drives the method's own coroutine and behaves as one (``await`` it, or pass it
    to ``asyncio.create_task`` or ``gather``; its name, frame and ``cr_*`` attributes are
    the method coroutine's). It sees the call start (its first step), and sees a call
    that ends without having run: thrown into or closed before its first step,
    garbage-collected unawaited, or failed before it took its id."""

    __slots__ = ("_cid", "_coro", "_group", "_holder", "_started", "_unrun")

    def __init__(
        self,
        group: Reserving,
        cid: int,
        holder: int,
        coro: Coroutine[Any, Any, _T],
        *,
        unrun: Callable[[], None] | None = None,
    ) -> None:
        self._group = group
        self._cid = cid
        self._holder = holder  # its place in the group's _call_order
        self._coro = coro
        self._started = False
        self._unrun = unrun  # called (on the group's loop) if the call ends unstarted

    def send(self, value: Any) -> Any:
        """Advance the call; until it has taken its reserved id, each step offers it."""
        self._started = True
        group = self._group
        if group._pending.get(self._cid) != self._holder:
            return self._coro.send(value)  # taken (or given up): nothing left to settle
        if not _on_home_loop(group):  # touch nothing of the group from this thread
            self._coro.close()
            refused = foreign_loop_error("a collective")
            self._settle(refused)
            raise refused
        # Offered at every step until taken, not only the first: a collective that
        # awaited something before its _run would otherwise take a fresh id.
        outer = group._taking  # a call made inside another's step
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
        self._ends_unstarted()  # before its first step, the method's code never runs
        try:
            return self._coro.throw(*args)
        except BaseException as exc:
            self._settle(exc)
            raise

    def close(self) -> None:
        """Close the call; before its first step, it never runs."""
        self._ends_unstarted()
        self._coro.close()
        self._settle(None)

    def __await__(self) -> Generator[Any, None, _T]:
        """Awaited in a coroutine: the steps until the call has taken its id go through
        :meth:`send` and :meth:`throw`; then the method's coroutine is awaited directly,
        with no Python call of ours per step (a task driving the call uses send)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = self.send(value) if error is None else self.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            taken = self._group._pending.get(self._cid) != self._holder
            value = error = None
            try:
                value = yield yielded
            except GeneratorExit:
                self.close()
                raise
            except BaseException as exc:  # thrown into the await (a cancellation, say)
                error = exc
                continue
            if taken and value is None:  # what the first step of the await sends
                return (yield from self._coro.__await__())

    def __next__(self) -> Any:
        return self.send(None)

    def __iter__(self) -> CollectiveCall[_T]:
        return self

    def _ends_unstarted(self) -> None:
        """Mark the call started; one ending before its first step never ran."""
        if not self._started:
            self._started = True
            if self._unrun is not None:
                self._unrun()

    def __del__(self) -> None:
        if self._started:
            return
        # Never awaited (Python warns of the method's coroutine). A finalizer runs in
        # whichever thread collected it: the skip goes to the group's loop.
        self._started = True
        group, cid, holder = self._group, self._cid, self._holder
        loop = group._home_loop
        try:
            if loop is None:
                raise RuntimeError("no loop")
            loop.call_soon_threadsafe(group._skip, cid, holder, "it was never awaited")
            if self._unrun is not None:
                loop.call_soon_threadsafe(self._unrun)
        except RuntimeError:  # its loop is closed: the group is gone, nobody to tell
            if group._pending.get(cid) == holder:
                del group._pending[cid]

    def __repr__(self) -> str:
        return f"<CollectiveCall #{self._cid} {self._coro!r}>"

    @property
    def __name__(self) -> str:  # what asyncio names a task's coroutine by
        return self._coro.__name__  # type: ignore[attr-defined, no-any-return]

    @property
    def cr_frame(self) -> Any:
        """The method coroutine's frame (for task stacks and reprs)."""
        return getattr(self._coro, "cr_frame", None)

    @property
    def cr_await(self) -> Any:
        """What the method coroutine awaits now."""
        return getattr(self._coro, "cr_await", None)

    @property
    def cr_running(self) -> bool:
        """Whether the method coroutine is running now."""
        return bool(getattr(self._coro, "cr_running", False))

    @property
    def cr_code(self) -> Any:
        """The method coroutine's code object."""
        return getattr(self._coro, "cr_code", None)

    def _settle(self, exc: BaseException | None) -> None:
        """The call ended with ``exc`` (None: closed): if it never took its id, it never
        ran. Settled on the group's loop (from another thread, soon: the group's state
        and connections belong to its loop)."""
        group = self._group
        if group._pending.get(self._cid) != self._holder:
            return
        if exc is None:
            why = "it was closed before it started"
        elif isinstance(exc, asyncio.CancelledError):
            why = "it was cancelled before it started"
        elif isinstance(exc, StopIteration):
            why = "it returned without running"
        else:
            why = f"it failed before it started: {type(exc).__name__}: {str(exc)[:200]}"
        # Refused for its arguments: as if never called (a retry takes its place).
        settle = group._give_back if isinstance(exc, UsageError) else group._skip
        if _on_home_loop(group):
            settle(self._cid, self._holder, why)
            return
        home = group._home_loop
        assert home is not None  # a group with no loop yet counts as on it
        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody to tell
            home.call_soon_threadsafe(settle, self._cid, self._holder, why)


async def _then(coro: Coroutine[Any, Any, _T], ended: Callable[[], None]) -> _T:
    """``coro``'s result, calling ``ended`` once it has ended, however."""
    try:
        return await coro
    finally:
        ended()


def _on_home_loop(group: Reserving) -> bool:
    """Whether this thread runs the group's event loop (or the group has none yet)."""
    home = group._home_loop
    if home is None:
        return True
    try:
        return asyncio.get_running_loop() is home
    except RuntimeError:  # no loop running in this thread
        return False


def foreign_loop_error(what: str) -> UsageError:
    """The error of ``what`` (a collective, send, recv) awaited on another event loop."""
    return UsageError(
        f"{what} was awaited on another event loop than the group's (the one start() "
        "ran on): run it on that loop, or from another thread submit it with "
        "asyncio.run_coroutine_threadsafe(coro, loop)"
    )


def as_coroutine_function(fn: _F) -> _F:
    """Mark ``fn``, a plain function that returns a coroutine, as a coroutine function
    for ``inspect`` (3.12+), ``asyncio.iscoroutinefunction`` and ``unittest.mock``."""
    mark = getattr(inspect, "markcoroutinefunction", None)  # Python 3.12+
    if mark is not None:
        return mark(fn)  # type: ignore[no-any-return]
    marker = getattr(asyncio.coroutines, "_is_coroutine", None)  # what 3.11 looks for
    if marker is not None:
        fn._is_coroutine = marker  # type: ignore[attr-defined]
    return fn


def collective(
    method: Callable[Concatenate[_G, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[_G, _P], Coroutine[Any, Any, _T]]:
    """Make ``method`` (an ``async def`` collective of a group) take its call id when it
    is called (see the module's docstring). A group that cannot run it now, or has one
    rank, takes none: the plain coroutine is returned."""

    @functools.wraps(method)
    def call(self: _G, /, *args: _P.args, **kwargs: _P.kwargs) -> Coroutine[Any, Any, _T]:
        coro = method(self, *args, **kwargs)
        # The group holds the call's number, not the call: its finalizer is a skip.
        reserved = self._reserve()
        if reserved is None:
            return coro
        feedback = kwargs.get("error_feedback")
        if not isinstance(feedback, ErrorFeedback):
            return CollectiveCall(self, *reserved, coro)
        # Its turn with the feedback comes in call order (compress.py), and ends with
        # the call, whether it ran or not.
        order = reserved[1]
        feedback.take_ticket(order)
        ended = functools.partial(feedback.end, order)
        wrapped = _then(coro, ended)
        wrapped.__qualname__ = coro.__qualname__  # type: ignore[attr-defined]  # (warnings)

        def unrun() -> None:
            ended()
            coro.close()  # never started: closed, as the call is

        return CollectiveCall(self, *reserved, wrapped, unrun=unrun)

    return as_coroutine_function(call)
