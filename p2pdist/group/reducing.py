"""Reducing: the collectives that reduce (all_reduce, reduce_scatter, reduce), with their
deterministic (rank-ordered) and compressed (narrow wire) paths and the argument checks
they share with :class:`~p2pdist.group.buckets.GradientBuckets`. The base of
:class:`~p2pdist.group.group.Group`, on :class:`~p2pdist.group.core.GroupCore`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import numpy as np

from ..errors import UsageError
from . import algorithms as alg
from .buffers import as_array, result_buffer
from .calls import collective
from .compress import (
    INT8_BLOCK,
    ErrorFeedback,
    WireCodec,
    WireDtype,
    check_block,
    divide_for_mean,
    make_codec,
    to_float32,
)
from .compressed_algorithms import (
    compressed_direct_all_reduce,
    compressed_gather_segments,
    compressed_ring_all_reduce,
    compressed_ring_reduce_scatter,
)
from .config import MODES, PAIRWISE_MAX_WORLD
from .core import GroupCore
from .devices import on_host
from .link import CollectiveLink, describe_call
from .linkops import split_bounds
from .ops import ReduceOp, reduce_op
from .ordered import ordered_all_reduce, ordered_reduce_scatter

__all__ = ["BUCKET_LAYOUT", "Reducing"]

BUCKET_LAYOUT: ContextVar[str] = ContextVar("p2pdist_bucket_layout", default="")
"""Set by :class:`~p2pdist.group.buckets.GradientBuckets` in a bucket's own task: which
arrays the flat array it reduces packs, added to that all_reduce's call descriptor, so
that ranks that packed different arrays (one skipped an ``add``) fail with a
MismatchError instead of reducing one array's elements with another's."""


class Reducing(GroupCore):
    """The reductions of a group (all_reduce, reduce_scatter and reduce), and the
    algorithm choices and ring/pairwise passes that every collective of
    :class:`~p2pdist.group.group.Group` shares."""

    # ---- the passes every collective shares ------------------------------------------

    def _direct(self, arr: np.ndarray) -> bool:
        """Whether reducing ``arr`` takes a one-round direct algorithm instead of the ring
        (small arrays, and arrays with fewer elements than ranks)."""
        return arr.nbytes <= self.config.small_bytes or arr.size < self.size

    def _chunk(self, dtype: np.dtype[Any]) -> int:
        """The ring and pipeline chunk, in elements of ``dtype``."""
        return max(1, self.config.chunk_bytes // dtype.itemsize)

    def _pairwise(self) -> bool:
        """Whether arrays above small_bytes take the pairwise exchange (else the ring)."""
        chosen = self.config.algorithm
        if chosen == "auto":  # at 2 ranks the two are the same exchange
            return 2 < self.size <= PAIRWISE_MAX_WORLD
        return chosen == "pairwise"

    async def _reduce_scatter_pass(
        self,
        lk: CollectiveLink,
        flat: np.ndarray,
        bounds: list[tuple[int, int]],
        rop: ReduceOp,
        chunk: int,
    ) -> None:
        """Segment ``bounds[rank]`` of ``flat`` reduced over all ranks, in place."""
        if self._pairwise():
            await alg.pairwise_reduce_scatter(lk, flat, bounds, rop, chunk)
        else:
            await alg.ring_reduce_scatter(lk, flat, bounds, rop, chunk)

    async def _all_gather_pass(
        self, lk: CollectiveLink, flat: np.ndarray, bounds: list[tuple[int, int]], chunk: int
    ) -> None:
        """Every rank's segment ``bounds[r]`` of ``flat`` filled in everywhere, in place."""
        if self._pairwise():
            await alg.pairwise_all_gather(lk, flat, bounds, chunk)
        else:
            await alg.ring_all_gather(lk, flat, bounds, chunk)

    def _alone(self) -> bool:
        """Whether this group has one rank, so that a collective needs no peer (its
        ``timeout`` was checked all the same, by :meth:`_check_call`)."""
        return self.size == 1

    # ---- the reductions -------------------------------------------------------------------

    async def _compressed(
        self,
        descriptor: bytes,
        arr: np.ndarray,
        work: np.ndarray,
        codec: WireCodec,
        prepare: Callable[[], np.ndarray],
        timeout: float | None,
        feedback: ErrorFeedback | None,
    ) -> np.ndarray:
        """all_reduce with a narrow wire format; float32 accumulation everywhere.
        ``prepare()`` gives the flat float32 values to reduce (for mean already divided by
        the world: :func:`_compressed_input`); it runs only once the call has its channel,
        so a call refused before it runs changes neither the input (in place) nor
        ``feedback``'s residual. With ``feedback``, what the ring's own encodings lose
        joins its residual too."""

        async def body(lk: CollectiveLink) -> np.ndarray:
            flat = prepare()
            residual = None if feedback is None else feedback.residual
            if self._direct(arr):
                await compressed_direct_all_reduce(lk, flat, codec)
            else:
                # Segments in whole int8 blocks: the first hop then re-encodes exactly
                # what error feedback already encoded (no new error).
                bounds = split_bounds(flat.size, self.size, codec.align)
                await compressed_ring_all_reduce(
                    lk, flat, bounds, codec, self._chunk(flat.dtype), residual
                )
            if not np.may_share_memory(work, flat):
                work.reshape(-1)[:] = flat  # under the call's errstate
            if feedback is not None:
                # The result as the caller gets it: a float32 sum past float16's range
                # is finite until it is cast to the caller's float16.
                feedback.settle(work)
            return work

        return await self._run(descriptor, timeout, body)

    def _deterministic(self, mode: str | None) -> bool:
        """Whether the call asks for deterministic mode (``mode``, else the group's)."""
        chosen = self.config.mode if mode is None else mode
        if chosen not in MODES:
            raise UsageError(f"mode must be one of {MODES}, got {chosen!r}")
        return chosen == "deterministic"

    def _ordered(self, mode: str | None, rop: ReduceOp, arr: np.ndarray) -> bool:
        """Whether this reduction takes the deterministic (rank-ordered float64) path."""
        return _takes_ordered_path(self._deterministic(mode), rop, arr.dtype)

    def _all_reduce_codec(
        self,
        arr: np.ndarray,
        op: str,
        mode: str | None,
        wire_dtype: WireDtype | None,
        block: int,
        error_feedback: ErrorFeedback | None,
    ) -> tuple[ReduceOp, bool, WireCodec | None]:
        """The checks all_reduce makes on its arguments before anything travels (the op
        for ``arr``'s dtype, the mode, the wire_dtype rules): the reduce op, whether it
        takes the deterministic path, and the wire codec or None. GradientBuckets runs
        them too, on an empty array of each dtype it is given."""
        rop = reduce_op(op, arr.dtype)
        ordered = self._ordered(mode, rop, arr)
        codec = None
        if wire_dtype is None:
            check_block(block)  # (make_codec checks it otherwise)
        if wire_dtype is not None or error_feedback is not None:
            deterministic = None if not ordered else "call" if mode is not None else "group"
            codec = _codec_for(wire_dtype, block, error_feedback, rop, arr, deterministic)
        return rop, ordered, codec

    @collective
    @on_host
    async def all_reduce(
        self,
        x: np.ndarray,
        op: str = "sum",
        *,
        out: np.ndarray | None = None,
        mode: str | None = None,
        wire_dtype: WireDtype | None = None,
        block: int = INT8_BLOCK,
        error_feedback: ErrorFeedback | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Elementwise reduction of ``x`` over all ranks; every rank gets the same bits.

        ``op`` is one of sum, mean (floating and complex dtypes), max, min, prod. The
        result is written to ``out`` when given (it may be ``x`` itself) and returned.
        ``mode`` (default ``config.mode``) "deterministic" makes floating sums, means and
        products equal to "reduce in rank order in float64, round once", whatever the
        timing; all ranks must pass the same mode (checked).

        ``wire_dtype`` ("float16", "bfloat16" or "int8" with one scale per ``block``
        elements, or their numpy types) compresses what travels for floating sum/mean;
        every hop accumulates in float32; mean divides by the world before encoding, so
        partial sums stay in the inputs' range (for sum with float16, every partial sum
        must fit float16, else it becomes inf: docs/collectives.md). ``error_feedback``
        (an :class:`ErrorFeedback`, one per tensor, one call at a time) carries this
        call's compression error into the next call's input.
        """
        arr = as_array(x)
        codec: WireCodec | None = None
        if wire_dtype is None and error_feedback is None and type(op) is str:
            # The usual call, planned once per distinct (op, mode, dtype, shape): its
            # checks and descriptor cost more than a small array's whole exchange.
            if block is not INT8_BLOCK:  # the default needs no check
                check_block(block)
            rop, ordered, descriptor = _plain_plan(
                op, self._deterministic(mode), arr.dtype, arr.shape, BUCKET_LAYOUT.get()
            )
        else:
            rop, ordered, codec = self._all_reduce_codec(
                arr, op, mode, wire_dtype, block, error_feedback
            )
            label = _op_label(op, self._deterministic(mode), codec, block)
            descriptor = describe_call(
                "all_reduce", label + BUCKET_LAYOUT.get(), arr.dtype.str, arr.shape
            )
        # In place (out is x) needs only the one check as_array has not made.
        in_place = out is arr and arr.flags.writeable
        work = arr if in_place else result_buffer(arr, arr.shape, arr.dtype, out)
        self._check_call(timeout)
        if self._alone():  # the identity, compressed or not: nothing travels
            if work is not arr:
                np.copyto(work, arr)
            return work
        if codec is not None:
            # mean divides before encoding (as NCCL does): partial sums then stay in the
            # inputs' range, which a float16 wire needs.
            divisor = self.size if rop.divide else 1
            wire_codec = codec

            def prepare() -> np.ndarray:
                if error_feedback is None and arr.dtype == np.float32:
                    # Reduce in the result buffer itself: one copy, as the plain path.
                    return _load_into(arr, divisor, work)
                return _compressed_input(arr, wire_codec, error_feedback, divisor)

            if error_feedback is None:
                return await self._compressed(descriptor, arr, work, codec, prepare, timeout, None)
            # Its turn with the feedback: after the calls made before it with it.
            seconds = self._seconds(timeout)
            async with error_feedback.turn(arr.size, self._call_number(), seconds) as left:
                self._check_usable()  # (it may have waited while the group broke)
                return await self._compressed(
                    descriptor, arr, work, codec, prepare, left, error_feedback
                )
        if not ordered and self._direct(arr):  # small: the latency path, no extra layer
            flat = work.reshape(-1)
            # In place (work is arr) needs a copy of the input, except at world 2.
            src = arr.reshape(-1) if work is not arr or self.size == 2 else flat.copy()

            async def direct(lk: CollectiveLink) -> np.ndarray:
                await alg.direct_all_reduce(lk, src, rop, flat)
                rop.finish(work, self.size)  # in the call: under its errstate too
                return work

            return await self._run(descriptor, timeout, direct)
        chunk = self._chunk(arr.dtype)

        async def body(lk: CollectiveLink) -> np.ndarray:
            flat = work.reshape(-1)
            if ordered:
                src = arr.reshape(-1) if work is not arr else flat.copy()
                if self._direct(arr):
                    await ordered_all_reduce(lk, src, rop, flat)
                    return work
                bounds = split_bounds(flat.size, self.size)
                a, b = bounds[self._rank]
                await ordered_reduce_scatter(lk, src, bounds, rop, chunk, flat[a:b])
                await self._all_gather_pass(lk, flat, bounds, chunk)
                return work  # ordered_reduce_scatter already divided for mean
            if work is not arr:
                np.copyto(work, arr)
            bounds = split_bounds(flat.size, self.size)
            await self._reduce_scatter_pass(lk, flat, bounds, rop, chunk)
            await self._all_gather_pass(lk, flat, bounds, chunk)
            rop.finish(work, self.size)
            return work

        return await self._run(descriptor, timeout, body)

    @collective
    @on_host
    async def reduce_scatter(
        self,
        x: np.ndarray,
        op: str = "sum",
        *,
        out: np.ndarray | None = None,
        mode: str | None = None,
        wire_dtype: WireDtype | None = None,
        block: int = INT8_BLOCK,
        error_feedback: ErrorFeedback | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Reduce ``x`` over all ranks and return this rank's piece of the result.

        The pieces split axis 0 the way ``numpy.array_split(result, size)`` does, so rank r
        gets ``array_split(reduced, size)[r]`` (pieces may be empty when the axis is short).
        ``mode`` as for :meth:`all_reduce`. ``wire_dtype`` and ``block`` compress floating
        sum/mean as :meth:`all_reduce` does (the ring, accumulating in float32 at every
        hop; a rank's own piece is never encoded after its last contribution).
        ``error_feedback`` (one :class:`ErrorFeedback` per tensor, as for all_reduce)
        carries what this rank's encodings lost into the next call's input.
        """
        arr = as_array(x)
        if arr.ndim == 0:
            raise UsageError("reduce_scatter needs an array with at least one dimension")
        rop, ordered, codec = self._all_reduce_codec(
            arr, op, mode, wire_dtype, block, error_feedback
        )
        rows = split_bounds(arr.shape[0], self.size)
        row_items = int(np.prod(arr.shape[1:], dtype=np.int64))
        bounds = [(a * row_items, b * row_items) for a, b in rows]
        r0, r1 = rows[self._rank]
        result = result_buffer(None, (r1 - r0, *arr.shape[1:]), arr.dtype, out)
        _check_own_piece(arr, r0, r1, result)
        self._check_call(timeout)
        if self._alone():
            np.copyto(result, arr[r0:r1])
            return result
        label = _op_label(op, self._deterministic(mode), codec, block)
        descriptor = describe_call("reduce_scatter", label, arr.dtype.str, arr.shape)
        chunk = self._chunk(arr.dtype)
        if codec is not None:
            wire_codec = codec
            feedback = error_feedback
            # mean divides before encoding, as all_reduce does: partial sums stay in range
            divisor = self.size if rop.divide else 1

            async def compressed(lk: CollectiveLink) -> np.ndarray:
                # Once the call has its channel: one refused changes no residual.
                if feedback is None:
                    work = _compressed_input(arr, wire_codec, None, divisor)
                    residual = None
                else:
                    work = feedback.begin(arr, divisor)
                    residual = feedback.residual
                await compressed_ring_reduce_scatter(
                    lk, work, bounds, wire_codec, self._chunk(work.dtype), residual
                )
                a, b = bounds[self._rank]
                result.reshape(-1)[:] = work[a:b]
                return result

            if feedback is None:
                return await self._run(descriptor, timeout, compressed)
            seconds = self._seconds(timeout)
            async with feedback.turn(arr.size, self._call_number(), seconds) as left:
                self._check_usable()  # (as all_reduce)
                return await self._run(descriptor, left, compressed)

        async def body(lk: CollectiveLink) -> np.ndarray:
            if ordered:
                await ordered_reduce_scatter(
                    lk, arr.reshape(-1), bounds, rop, chunk, result.reshape(-1)
                )
                return result
            if arr.nbytes <= self.config.small_bytes:
                await alg.direct_reduce_scatter(
                    lk, arr.reshape(-1), bounds, rop, result.reshape(-1)
                )
            else:
                flat = arr.reshape(-1).copy()
                await self._reduce_scatter_pass(lk, flat, bounds, rop, chunk)
                a, b = bounds[self._rank]
                np.copyto(result.reshape(-1), flat[a:b])
            rop.finish(result, self.size)
            return result

        return await self._run(descriptor, timeout, body)

    @collective
    @on_host
    async def reduce(
        self,
        x: np.ndarray,
        dst: int = 0,
        op: str = "sum",
        *,
        out: np.ndarray | None = None,
        mode: str | None = None,
        wire_dtype: WireDtype | None = None,
        block: int = INT8_BLOCK,
        timeout: float | None = None,
    ) -> np.ndarray | None:
        """Reduce ``x`` over all ranks onto rank ``dst``; returns the result there and None
        on the other ranks. ``mode`` as for :meth:`all_reduce`: "deterministic" gives
        exactly what ``all_reduce`` gives in that mode. ``wire_dtype`` and ``block``
        compress floating sum/mean as :meth:`reduce_scatter` does, then every rank sends
        its reduced piece to ``dst`` encoded once."""
        dst = self._check_rank(dst, "dst")
        arr = as_array(x)
        rop, ordered, codec = self._all_reduce_codec(arr, op, mode, wire_dtype, block, None)
        mine = self._rank == dst
        # out= is checked on every rank that passes one; only dst needs a buffer
        checked = result_buffer(arr, arr.shape, arr.dtype, out) if mine or out is not None else None
        result = checked if mine else None
        self._check_call(timeout)
        if self._alone():
            assert result is not None
            if result is not arr:
                np.copyto(result, arr)
            return result
        label = _op_label(op, self._deterministic(mode), codec, block)
        descriptor = describe_call("reduce", label, arr.dtype.str, arr.shape, dst)
        if codec is not None:
            wire_codec = codec
            divisor = self.size if rop.divide else 1
            bounds = split_bounds(arr.size, self.size)

            async def compressed(lk: CollectiveLink) -> np.ndarray | None:
                await alg.agree(lk)  # a rank that names another root is caught here
                # Once the call runs: one refused leaves out= (maybe the input) alone.
                if result is not None and arr.dtype == np.float32:
                    # dst reduces in its result buffer itself: one copy, as all_reduce does
                    work = _load_into(arr, divisor, result)
                else:
                    work = _compressed_input(arr, wire_codec, None, divisor)
                chunk = self._chunk(work.dtype)
                await compressed_ring_reduce_scatter(lk, work, bounds, wire_codec, chunk)
                await compressed_gather_segments(lk, work, bounds, wire_codec, dst)
                if result is not None and not np.may_share_memory(result, work):
                    result.reshape(-1)[:] = work
                return result

            return await self._run(descriptor, timeout, compressed)

        async def body(lk: CollectiveLink) -> np.ndarray | None:
            await alg.agree(lk)  # a rank that names another root is caught here
            if ordered:  # every rank folds its segment in rank order, then dst gathers
                src = arr.reshape(-1) if result is not arr else arr.reshape(-1).copy()
                flat = result.reshape(-1) if result is not None else np.empty_like(src)
                bounds = split_bounds(flat.size, self.size)
                a, b = bounds[self._rank]
                chunk = self._chunk(arr.dtype)
                await ordered_reduce_scatter(lk, src, bounds, rop, chunk, flat[a:b])
                await alg.gather_segments(lk, flat, bounds, dst)
                return result  # ordered_reduce_scatter already divided for mean
            if self._direct(arr):
                src = arr.reshape(-1) if result is not arr else arr.reshape(-1).copy()
                target = result.reshape(-1) if result is not None else None
                await alg.direct_reduce(lk, src, rop, dst, target)
            else:
                flat = arr.reshape(-1).copy()  # the ring works in place: spare the input
                bounds = split_bounds(flat.size, self.size)
                await self._reduce_scatter_pass(lk, flat, bounds, rop, self._chunk(arr.dtype))
                await alg.gather_segments(lk, flat, bounds, dst)
                if result is not None:
                    result.reshape(-1)[:] = flat
            if result is not None:
                rop.finish(result, self.size)
            return result

        return await self._run(descriptor, timeout, body)


def _check_own_piece(arr: np.ndarray, r0: int, r1: int, result: np.ndarray) -> None:
    """reduce_scatter's ``out`` may be this rank's own piece of the input (in place, as
    NCCL allows), ``arr[r0:r1]``, but may not overlap the input anywhere else."""
    if not np.shares_memory(result, arr):
        return
    own = arr[r0:r1]
    same = own.__array_interface__["data"][0] == result.__array_interface__["data"][0]
    if not same:  # result_buffer checked the shape, dtype and C order already
        raise UsageError(f"out overlaps the input other than as this rank's own piece x[{r0}:{r1}]")


def _takes_ordered_path(deterministic: bool, rop: ReduceOp, dtype: np.dtype[Any]) -> bool:
    """Whether a reduction takes the deterministic (rank-ordered float64) path: every
    floating one. (Integer arithmetic gives the same bits in any order already; float
    max and min give the same value, but which of -0 and +0, or of two NaNs, comes out
    depends on the order, and so on the algorithm.)"""
    return deterministic and dtype.kind in "fc"


@functools.lru_cache(maxsize=1024)
def _plain_plan(
    op: str, deterministic: bool, dtype: np.dtype[Any], shape: tuple[int, ...], layout: str
) -> tuple[ReduceOp, bool, bytes]:
    """An uncompressed all_reduce's reduce op, whether it takes the ordered path, and its
    call descriptor (``layout``: :data:`BUCKET_LAYOUT`'s value). A bad op raises, and
    nothing is remembered."""
    rop = reduce_op(op, dtype)
    label = _op_label(op, deterministic) + layout
    descriptor = describe_call("all_reduce", label, dtype.str, shape)
    return rop, _takes_ordered_path(deterministic, rop, dtype), descriptor


def _op_label(
    op: str, deterministic: bool, codec: WireCodec | None = None, block: int = INT8_BLOCK
) -> str:
    """The op as the call descriptor names it: the mode asked for is part of the call, so
    ranks that disagree on it fail with a MismatchError, even where both modes would run
    the same path (integers); so is the wire format, with the block for int8 only (the
    one wire with blocks: others must not differ in an unused one). A deterministic max
    or min says ``:rank-ordered`` too: before 2026-12-06 a float one ran the fast path,
    and a rank of that version must not pair with one of this."""
    if codec is not None:  # never with deterministic: _codec_for refuses the pair
        return f"{op}@{codec.name}" + (f"/{block}" if codec.name == "int8" else "")
    if not deterministic:
        return op
    return f"{op}:deterministic:rank-ordered" if op in ("max", "min") else f"{op}:deterministic"


def _load_into(arr: np.ndarray, divisor: int, buf: np.ndarray) -> np.ndarray:
    """Float32 ``arr`` divided by ``divisor`` (the world for mean, else 1) written into
    ``buf`` (nothing to copy when ``buf`` is ``arr``); returns ``buf`` flat."""
    if divisor != 1:
        divide_for_mean(arr, divisor, buf)
    elif buf is not arr:
        np.copyto(buf, arr)
    return buf.reshape(-1)


def _codec_for(
    wire_dtype: WireDtype | None,
    block: int,
    feedback: ErrorFeedback | None,
    rop: ReduceOp,
    arr: np.ndarray,
    deterministic: str | None,
) -> WireCodec | None:
    """The wire codec of a compressed all_reduce, or None; checks the combination.
    ``deterministic``: None, or who asked for deterministic mode ("call" or "group",
    the group's default), which cannot be combined with a wire_dtype."""
    if feedback is not None and not isinstance(feedback, ErrorFeedback):
        raise UsageError(
            "error_feedback must be an ErrorFeedback (one per tensor, kept across calls), "
            f"not {type(feedback).__name__}"
        )
    if wire_dtype is None:
        if feedback is not None:
            raise UsageError("error_feedback needs a wire_dtype")
        return None
    codec = make_codec(wire_dtype, block)
    if arr.dtype.kind != "f" or rop.name not in ("sum", "mean"):
        raise UsageError(
            f"wire_dtype compresses floating sum/mean only, not op={rop.name!r} on {arr.dtype}"
        )
    if deterministic == "call":
        raise UsageError("mode='deterministic' cannot be combined with a wire_dtype")
    if deterministic == "group":
        raise UsageError(
            "this group's default mode is 'deterministic' (GroupConfig.mode), which cannot "
            "be combined with a wire_dtype: pass mode='fast' to this call to compress it"
        )
    return codec


def _compressed_input(
    arr: np.ndarray, codec: WireCodec, feedback: ErrorFeedback | None, divisor: int
) -> np.ndarray:
    """The float32 values a compressed all_reduce starts from (a copy: it works in place),
    divided by ``divisor`` (the world for mean, else 1)."""
    if feedback is not None:
        return feedback.apply(arr, codec, divisor)
    flat = to_float32(arr)
    if divisor != 1:
        divide_for_mean(flat, divisor, flat)
    return flat
