"""Gradient bucketing: pack many small arrays into a few large all-reduces that run while
the caller goes on (the way data-parallel training overlaps communication with compute)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
import re
from collections.abc import Coroutine
from typing import Any

import numpy as np

from ..errors import GroupBrokenError, MismatchError, UsageError
from ..settings import check_int
from .buffers import is_plain_array, wire_form
from .compress import INT8_BLOCK, ErrorFeedback
from .devices import is_device_array, pack, pinned_array, ready_marker, unpack, wait_ready
from .group import Group
from .link import THIS_RANK
from .reducing import BUCKET_LAYOUT

__all__ = ["GradientBuckets"]


class GradientBuckets:
    """Reduce many arrays in buckets of about ``bucket_bytes``, in the background.

    Create with ``await GradientBuckets.create(group)``; on every rank ``add`` the same
    arrays in the same order, then ``await wait()``: every added array then holds its
    reduced value (in place). Buckets are reduced on a sub-group of their own, so their
    collectives never interleave with the caller's, and a bucket starts reducing as soon
    as it is full. Create the helper once and use it for every step: each ``create``
    takes one of the group's sub-group channel spaces for the group's lifetime (a group
    has 32511). :meth:`close` (or ``async with``) ends the sub-group.

    With ``error_feedback=True`` (and a ``wire_dtype``) every bucket keeps an
    :class:`ErrorFeedback` of its own: the k-th bucket of a step (counted from the last
    :meth:`wait`) uses the k-th feedback, so the same arrays must be added in the same
    order every step (a bucket whose arrays' shapes change raises :class:`UsageError` at once:
    that bucket's arrays are dropped, not reduced, and the next bucket takes its position,
    so the step can go on with the right arrays).

    :meth:`add` refuses at once, with :class:`UsageError`, an array that the bucket's
    all_reduce would refuse (a dtype that cannot travel, ``op="mean"`` on integers,
    ``max``/``min`` on complex, a non-floating array with a ``wire_dtype``, ...), so
    nothing is queued that can only fail later; the array is not queued and what was
    added before it is kept.

    Each bucket's all_reduce names the arrays it packs (their number and a digest of
    their shapes) and the step's last one how many the step added (a step that added
    nothing too), so ranks that added different arrays fail with a
    :class:`MismatchError` instead of reducing one array's elements with another's
    (same-shaped arrays in another order cannot be told apart); the error breaks the
    group as well. After an exception between :meth:`add` and :meth:`wait`,
    :meth:`discard` abandons the step.

    A bucket that fails for another reason (a peer lost, a timeout, the group broken or
    closed) fails every later bucket of the step as well: each bucket starts only after
    the one before it succeeded, and re-raises its error instead. The buckets before the
    failed one hold their reduced values; the failed bucket's arrays and every later
    bucket's keep the values they had when added (a bucket writes back only after its
    all_reduce succeeded). :meth:`wait` raises that error, with a note naming the first
    bucket not reduced and how many arrays were left. A bucket's all_reduce is called
    (takes its place in the call order) when the bucket is queued, so a bucket that
    fails on one rank before its all_reduce runs (packing out of memory, a GPU wait
    timed out) fails the others' at once, naming that rank, not at their timeout.
    Cancelling :meth:`wait` leaves the buckets reducing (cancelling them would break the
    group); the next :meth:`wait` waits for them.
    """

    def __init__(
        self,
        group: Group,
        *,
        bucket_bytes: int,
        op: str,
        error_feedback: bool = False,
        **reduce: Any,
    ) -> None:
        self._group = group
        self._bucket_bytes = bucket_bytes
        self._op = op
        self._reduce = reduce
        self._pending: list[np.ndarray] = []
        self._ready: list[Any] = []  # for the CuPy arrays pending: their ready_marker
        self._pending_bytes = 0
        self._dtype: np.dtype[Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._counts: list[int] = []  # arrays in each of self._tasks' buckets
        self._last: asyncio.Task[None] | None = None
        """The last bucket started, of this step or of one whose wait() still runs: the
        next bucket goes after it, so buckets reduce in the same order on every rank."""
        self._carried: list[tuple[list[asyncio.Task[None]], list[int]]] = []
        """Steps whose wait() was cancelled: the next wait() reports how they ended."""
        self._added: dict[int, Any] = {}
        """This step's arrays by id (held, so that an id is not reused within the step)."""
        self._feedback: list[ErrorFeedback] | None = [] if error_feedback else None
        self._shapes: list[list[tuple[int, ...]]] = []  # of each bucket's arrays, by position
        self._index = 0  # position of the next bucket in this step
        self._accepted: set[np.dtype[Any]] = set()  # dtypes that passed _check
        self._closed = False

    @classmethod
    async def create(
        cls, group: Group, *, bucket_bytes: int = 4 << 20, op: str = "mean", **reduce: Any
    ) -> GradientBuckets:
        """Buckets over a dedicated sub-group of ``group`` (collective: call on all ranks).

        ``reduce`` holds extra all_reduce keywords (``mode=``, ``wire_dtype=``, ...);
        ``error_feedback=True`` gives every bucket an :class:`ErrorFeedback` of its own
        (an ErrorFeedback object is refused: one object cannot serve several buckets).
        """
        bucket_bytes = check_int("bucket_bytes", bucket_bytes, 1)  # numpy's too, no bool
        unknown = sorted(set(reduce) - _REDUCE_KEYWORDS - {"error_feedback"})
        if unknown:
            raise UsageError(
                f"GradientBuckets.create() got {', '.join(map(repr, unknown))}: the all_reduce "
                f"keywords it passes on are {', '.join(sorted(_REDUCE_KEYWORDS))} (buckets are "
                "reduced in place, so there is no out=)"
            )
        feedback = reduce.pop("error_feedback", False)
        if feedback is None:
            feedback = False
        if not isinstance(feedback, bool):
            raise UsageError(
                "GradientBuckets keeps one ErrorFeedback per bucket: pass error_feedback=True, "
                f"not {type(feedback).__name__}"
            )
        if feedback and reduce.get("wire_dtype") is None:
            raise UsageError("error_feedback needs a wire_dtype")
        if reduce.get("timeout") is not None:
            group._seconds(reduce["timeout"])  # refused now, not at every bucket's wait()
        # The op, mode, wire_dtype and block, checked now as a float32 bucket would be
        # (every op takes float32), before the split takes a sub-group.
        _check_reduce(group, np.dtype(np.float32), op, reduce)
        sub = await group.split(0)
        assert sub is not None
        return cls(sub, bucket_bytes=bucket_bytes, op=op, error_feedback=feedback, **reduce)

    def add(self, array: np.ndarray) -> None:
        """Queue ``array`` (numpy or CuPy; writeable, C-contiguous) for reduction in place.

        An array the bucket's all_reduce cannot reduce is a :class:`UsageError` here,
        before anything is queued, and so is one added already in this step. What is
        reduced is the array's value when its bucket runs (after the buckets before it):
        do not write to it, nor add a view overlapping it, until :meth:`wait` returns."""
        self._check_open()
        on_device = is_device_array(array)
        if not (on_device or is_plain_array(array)):
            raise UsageError(
                f"add() needs a plain numpy or CuPy array, not a {type(array).__name__}"
            )
        if not array.flags.c_contiguous:
            raise UsageError("add() needs a C-contiguous array (it is reduced in place)")
        if not on_device and not array.flags.writeable:
            raise UsageError("add() needs a writeable array (it is reduced in place)")
        if id(array) in self._added:  # in another bucket it would be reduced twice
            raise UsageError("add() got an array added already in this step: add each once")
        dtype = self._check(array.dtype)
        if self._dtype is not None and dtype != self._dtype:
            try:
                self.flush()  # a bucket holds one dtype
            except UsageError as exc:
                # The refused bucket is the one before; it took no position, so this
                # array, which would start the next, waits for the right ones to come.
                exc.add_note(
                    f"{_NOTE}the array of this add() was not queued either: add the right "
                    "arrays, then it again"
                )
                raise
        self._dtype = dtype
        if on_device:  # the bucket copies it later, from another task and stream
            self._ready.append(ready_marker(array))
        self._pending.append(array)
        self._added[id(array)] = array
        self._pending_bytes += array.nbytes
        if self._pending_bytes >= self._bucket_bytes:
            self.flush()

    def _check(self, dtype: np.dtype[Any]) -> np.dtype[Any]:
        """``dtype``'s wire form, once the bucket's all_reduce would take it: the checks
        all_reduce makes before anything travels (as_array's dtype check, the op, and
        the wire_dtype and mode rules), run once per dtype."""
        wire = wire_form(dtype)  # what as_array checks; >f4 reduces as float32
        if wire in self._accepted:
            return wire
        _check_reduce(self._group, wire, self._op, self._reduce)
        self._accepted.add(wire)
        return wire

    def flush(self) -> None:
        """Start reducing what was added so far (the bucket need not be full)."""
        self._flush(last=False)

    def _flush(self, *, last: bool) -> None:
        """Start the bucket of what was added so far; ``last`` (from :meth:`wait`): it
        ends the step, and its call says how many arrays the step added, so that ranks
        that added different numbers fail with a MismatchError (without arrays pending,
        an empty bucket goes out to say so: a step of no arrays too, unless this wait()
        finishes an earlier step, see :meth:`_finishing`)."""
        added = len(self._added)
        if not self._pending and (not last or (not added and self._finishing())):
            return
        loop = asyncio.get_running_loop()  # none (a hook's thread): the arrays stay pending
        arrays, ready = self._pending, self._ready
        self._pending, self._ready, self._pending_bytes = [], [], 0
        # A bucket of the wrong shapes raises here: its arrays are dropped (left as they
        # were) and its position stays free, so the helper goes on as before the call.
        try:
            feedback = self._bucket_feedback([a.shape for a in arrays]) if arrays else None
        except UsageError:
            for a in arrays:  # not queued after all: they may be added again
                self._added.pop(id(a), None)
            raise
        layout = _layout(arrays, added if last else None)
        # In the wire dtype: a big-endian array joins its little-endian kin. Chosen now:
        # by the time the bucket runs, the next step may have added another dtype.
        dtype = wire_form(arrays[0].dtype) if arrays else self._dtype or np.dtype(np.float32)
        # Called now, the bucket's all_reduce takes its place in the call order now: if
        # the bucket fails before it runs (no memory for its buffer, packing failed, a
        # GPU wait timed out), that is thrown into it unstarted, and the others' fails at
        # once naming this rank.
        failed: MemoryError | None = None
        pinned = any(is_device_array(a) for a in arrays)  # GPU copies fill and empty it
        try:
            flat = _bucket_buffer(sum(a.size for a in arrays), dtype, pinned=pinned)
        except MemoryError as exc:  # the bucket fails as one whose packing failed does
            flat, failed = np.empty(0, dtype), exc
        call = self._group.all_reduce(
            flat, self._op, out=flat, error_feedback=feedback, **self._reduce
        )
        # After the last bucket started (this step's, or an earlier step's still running):
        # its failure fails this one only within a step.
        task = loop.create_task(
            self._reduce_bucket(
                call, flat, arrays, ready, self._last, bool(self._tasks), layout, failed
            )
        )
        task.add_done_callback(_retrieve)  # a step nobody waits for logs no "never retrieved"
        # Cancelled before its first step (close() soon after add()), the task never ran
        # _reduce_bucket, so nothing closed the call: Python warned it was never awaited.
        task.add_done_callback(functools.partial(_close_if_cancelled, call))
        self._tasks.append(task)
        self._counts.append(len(arrays))
        self._last = task

    def _finishing(self) -> bool:
        """Whether a wait() with nothing added finishes an earlier step instead of ending
        an empty one: a wait() for that step was cancelled (or the step discarded) and
        has not been waited for since. An empty step must still say so: a rank that had
        nothing to add while the others added would otherwise send nothing, and its next
        step's buckets would be reduced with the others' buckets of this one,
        same-shaped, without an error. Decided by the calls alone, never by whether
        buckets are still running: a second wait() while the first runs ended an empty
        step on a rank whose buckets were done and nothing on one whose were not, and
        the ranks' steps parted."""
        return bool(self._carried)

    def _bucket_feedback(self, shapes: list[tuple[int, ...]]) -> ErrorFeedback | None:
        """The next bucket's own ErrorFeedback (None without error feedback), for a bucket
        of arrays of ``shapes``: those of this position's bucket in earlier steps (the
        residual is kept element by element, so the same count in another layout would
        add one array's residual to another)."""
        if self._feedback is None:
            return None
        k = self._index
        if k == len(self._feedback):
            self._feedback.append(ErrorFeedback())
            self._shapes.append(shapes)
        elif self._shapes[k] != shapes:
            size, before = _elements(shapes), _elements(self._shapes[k])
            holds = (
                f"holds {size} elements, {before} in earlier steps"
                if size != before
                else f"packs arrays of shapes {_shapes_text(shapes)}, "
                f"{_shapes_text(self._shapes[k])} in earlier steps"
            )
            raise UsageError(
                f"bucket {k} {holds}: with error_feedback, add the same arrays in the same "
                "order every step"
            )
        self._index = k + 1  # only a bucket that goes out takes a position
        return self._feedback[k]

    async def _reduce_bucket(
        self,
        call: Coroutine[Any, Any, np.ndarray],
        flat: np.ndarray,
        arrays: list[np.ndarray],
        ready: list[Any],
        after: asyncio.Task[None] | None,
        same_step: bool,
        layout: str,
        failed: MemoryError | None,
    ) -> None:
        # The GPU waits are bounded as the bucket's all_reduce is (create's timeout=).
        seconds = self._group._seconds(self._reduce.get("timeout"))
        try:
            if failed is not None:
                raise failed
            if after is not None:  # buckets reduce in order on every rank
                if same_step:
                    await asyncio.shield(after)  # its failure is ours too
                elif not after.done():
                    # The last bucket of the step before (its wait() still runs, and says
                    # how it ended): after it, whatever happened to it.
                    await asyncio.wait([after])
            await wait_ready(ready, seconds)
            if arrays:
                await pack(arrays, flat, seconds)
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                call.throw(exc)  # it never runs: the others are told why
            raise
        BUCKET_LAYOUT.set(layout)  # in this task's own context: for its all_reduce only
        await call
        await unpack(flat, arrays, seconds)

    def discard(self) -> None:
        """Abandon this step (an exception between :meth:`add` and :meth:`wait`, say), on
        every rank as :meth:`add`: the arrays added but not in a started bucket yet are
        dropped, left as they are, and the next :meth:`add` starts a new step (without
        it they would join the next step's first bucket). Buckets already started go on
        (stopping one would break the group) and write their results back; the next
        :meth:`wait` waits for them first, and raises their failure if they failed."""
        self._check_open()
        self._pending, self._ready, self._pending_bytes = [], [], 0
        self._dtype = None
        self._index = 0
        self._added = {}
        if self._tasks:
            self._carried.append((self._tasks, self._counts))
            self._tasks, self._counts = [], []

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError("these GradientBuckets were closed: create new ones")

    async def close(self) -> None:
        """End the helper and its sub-group (collective, like ``Group.close`` of a
        sub-group). Arrays added since the last :meth:`wait` are not reduced: a bucket
        still running stops and its arrays keep the values they were added with."""
        self._closed = True
        self._pending, self._ready, self._pending_bytes = [], [], 0
        tasks, self._tasks, self._counts = self._tasks, [], []
        for carried, _ in self._carried:
            tasks += carried
        self._carried = []
        await self._group.close()  # fails the sub-group's calls still running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> GradientBuckets:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait(self) -> None:
        """Flush, then wait for every bucket; raises the first failure, with a note naming
        the first bucket not reduced (it and every later bucket were left as they were).
        The next :meth:`add` starts a new step (bucket positions count from 0 again),
        also when the last bucket was refused here (a UsageError for its shapes, raised once
        the step's other buckets are done). A cancelled wait() leaves the buckets
        reducing (cancelling them would break the group); the next wait() waits for them
        first, and raises their failure if they failed."""
        self._check_open()
        refused: UsageError | None = None
        try:
            self._flush(last=True)
        except UsageError as exc:
            refused = exc
        self._index = 0
        self._added = {}
        tasks, self._tasks, sizes = self._tasks, [], self._counts
        self._counts = []
        while self._carried:  # steps of cancelled wait() calls first, each reported once
            earlier = self._carried.pop(0)
            try:
                await self._settle(*earlier)
            except BaseException as exc:
                # This step's buckets are for the next wait() to report (and the earlier
                # step's again if this wait() was cancelled before it knew).
                later = [(tasks, sizes)] if tasks else []
                again = [earlier] if isinstance(exc, asyncio.CancelledError) else []
                self._carried[:0] = again + later
                raise
        last = self._last
        if not tasks and last is not None and not last.done():
            # Another wait() runs for the buckets started before ours: wait for them too
            # (returning now would hand back arrays not reduced yet).
            await asyncio.wait([last])
            if not last.cancelled() and (err := last.exception()) is not None:
                raise err
        if tasks:
            try:
                await self._settle(tasks, sizes)
            except asyncio.CancelledError:
                self._carried.append((tasks, sizes))  # the next wait() says how they ended
                raise
        if refused is not None:
            raise refused

    async def _settle(self, tasks: list[asyncio.Task[None]], sizes: list[int]) -> None:
        """Wait for one step's buckets; raise the first failure, noted. A failed bucket
        fails the later ones at once (they wait for it), so this returns as soon as the
        first failure is known. Shielded: a cancelled wait() (a timeout around it) must
        not cancel the reductions, which would break the group on every rank."""
        results = await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        for k, result in enumerate(results):
            if isinstance(result, BaseException):
                # The bucket of no arrays that may end a step is not counted as one.
                _note(result, k, sum(1 for n in sizes if n), sum(sizes[k:]))
                raise result


def _bucket_buffer(size: int, dtype: np.dtype[Any], *, pinned: bool = False) -> np.ndarray:
    """A bucket's flat host buffer (its pages are touched only when the bucket packs);
    ``pinned``: in page-locked memory, for a bucket holding CuPy arrays."""
    return pinned_array(size, dtype) if pinned else np.empty(size, dtype)


_LAYOUT = ", a bucket of "
"""How a bucket's call descriptor names what it packs (see :func:`_layout`)."""
_MISMATCH = re.compile(rf"but ({re.escape(THIS_RANK)}|rank \d+ \(\w+\)) called")
"""A call mismatch in an error's text (link.py's, as raised or as another rank told it)."""


def _layout(arrays: list[Any], step: int | None) -> str:
    """What a bucket packs, added to its all_reduce's descriptor: the number of arrays
    and a digest of their shapes in order (the dtype is the call's own), and for the
    last bucket of a step (``step``: the arrays the step added) that number too."""
    if not arrays:  # sent by wait() when the step's last add had started the last bucket
        return f"{_LAYOUT}no arrays ending a step of {_count(step or 0)}"
    shapes = repr([a.shape for a in arrays]).encode()
    digest = hashlib.blake2b(shapes, digest_size=4).hexdigest()
    what = f"{_LAYOUT}{_count(len(arrays))} #{digest}"
    return what if step is None else f"{what} ending a step of {_count(step)}"


def _count(n: int) -> str:
    return "1 array" if n == 1 else f"{n} arrays"


def _elements(shapes: list[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def _shapes_text(shapes: list[tuple[int, ...]]) -> str:
    text = ", ".join(map(str, shapes))
    return f"{text[:80]}..." if len(text) > 80 else text


def _close_if_cancelled(call: Coroutine[Any, Any, Any], task: asyncio.Task[None]) -> None:
    """Close a cancelled bucket's call (a no-op if it had run: it ended with the task)."""
    if task.cancelled():
        call.close()


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a bucket's failure as seen (wait() raises it; without a wait() it stays
    silent, as the group's own error says what happened)."""
    if not task.cancelled():
        task.exception()


_NOTE = "GradientBuckets: "
_REDUCE_KEYWORDS = frozenset({"mode", "wire_dtype", "block", "timeout"})


def _note(err: BaseException, k: int, buckets: int, arrays: int) -> None:
    """Say which buckets a failure left unreduced (the group may raise one stored error
    again and again: an earlier note of ours is replaced, not piled up)."""
    notes = getattr(err, "__notes__", None)
    if notes is not None:
        notes[:] = [n for n in notes if not (isinstance(n, str) and n.startswith(_NOTE))]
    if _packed_differently(err):
        which = (
            f"bucket {k} of {buckets} in this step"
            if k < buckets
            else f"the end of this step (after its {buckets} buckets)"
        )
        err.add_note(
            f"{_NOTE}{which} did not match another rank's (a rank skipped an add, or "
            "added arrays in another order or number): no result of this step can be "
            "trusted"
        )
        return
    if k >= buckets:
        err.add_note(f"{_NOTE}the step's {buckets} buckets were reduced; its end failed")
        return
    err.add_note(
        f"{_NOTE}bucket {k} of {buckets} in this step failed; it and the {buckets - k - 1} "
        f"after it were not reduced ({arrays} arrays keep the values they were added with); "
        f"the {k} before it were"
    )


def _packed_differently(err: BaseException) -> bool:
    """Whether ``err`` is the ranks' buckets not matching: a MismatchError between two
    bucket calls here, or on another rank (a GroupBrokenError that carries its text)."""
    text = str(err)
    return (
        isinstance(err, MismatchError | GroupBrokenError)
        and _LAYOUT in text
        and _MISMATCH.search(text) is not None  # link.py's, here or told by another rank
    )


def _check_reduce(group: Group, dtype: np.dtype[Any], op: str, reduce: dict[str, Any]) -> None:
    """What the bucket's all_reduce checks before anything travels, for arrays of
    ``dtype`` (``reduce``: the all_reduce keywords; each bucket's own ErrorFeedback is
    made with the wire_dtype, so none is passed)."""
    group._all_reduce_codec(
        np.empty(0, dtype),
        op,
        reduce.get("mode"),
        reduce.get("wire_dtype"),
        reduce.get("block", INT8_BLOCK),
        None,
    )
