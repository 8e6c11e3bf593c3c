"""The Group: the collectives, on top of :class:`~p2pdist.group.reducing.Reducing` (the
reductions: all_reduce, reduce_scatter, reduce, and the ring/pairwise passes every
collective shares), itself on :class:`~p2pdist.group.core.GroupCore`."""

from __future__ import annotations

import random as _random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UsageError
from ..settings import as_int
from . import algorithms as alg
from .buffers import as_array, mismatch, result_buffer, wire_form
from .calls import collective
from .devices import is_device_array, on_host
from .link import CollectiveLink, describe_call
from .membership import FIRST_RESERVED_SPACE
from .reducing import Reducing
from .spaces import SpaceBook

if TYPE_CHECKING:
    from .profile import LinkProfile

__all__ = ["Group"]

_SPLIT_ATTEMPTS = 16
"""Rounds a split may take to agree on a channel space (more than one only while other
splits run at once on the same ranks)."""


class Group(Reducing):
    """A fixed set of ranks that run collectives together.

    Build one with :meth:`from_seed` or :meth:`from_env` and use it as an async context
    manager. A group of size 1 needs no network and every collective is the identity.
    All ranks must issue collectives in the same order (as with MPI or torch.distributed);
    a different call on another rank is detected and raised as :class:`MismatchError`.
    """

    # ---- collectives ------------------------------------------------------------------

    @collective
    @on_host
    async def all_gather(
        self, x: np.ndarray, *, out: np.ndarray | None = None, timeout: float | None = None
    ) -> np.ndarray:
        """Every rank's ``x`` stacked in rank order: shape ``(size, *x.shape)``.

        All ranks must pass the same dtype and shape (checked).
        """
        arr = as_array(x)
        result = result_buffer(None, (self.size, *arr.shape), arr.dtype, out)
        _check_row_of_out(arr, result)
        self._check_call(timeout)
        if self._alone():
            result[0] = arr
            return result
        descriptor = describe_call("all_gather", "", arr.dtype.str, arr.shape)

        async def body(lk: CollectiveLink) -> np.ndarray:
            if arr.nbytes <= self.config.small_bytes:
                await alg.direct_all_gather(lk, arr, result)
            else:
                flat = result.reshape(-1)
                bounds = [(p * arr.size, (p + 1) * arr.size) for p in range(self.size)]
                result[self._rank] = arr
                await self._all_gather_pass(lk, flat, bounds, self._chunk(arr.dtype))
            return result

        return await self._run(descriptor, timeout, body)

    @collective
    @on_host
    async def broadcast(
        self,
        x: np.ndarray,
        src: int = 0,
        *,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Rank ``src``'s ``x`` on every rank. Other ranks' ``x`` gives the expected dtype and
        shape (checked against ``src``'s)."""
        src = self._check_rank(src, "src")
        if x is None:
            needs = "the array to send" if self._rank == src else f"an array like rank {src}'s"
            raise UsageError(
                f"broadcast needs x on every rank: {needs} (the other ranks' x gives the "
                "shape and dtype expected)"
            )
        arr = as_array(x)
        work = result_buffer(arr, arr.shape, arr.dtype, out)
        self._check_call(timeout)  # a call refused for its timeout leaves out= alone
        if self._rank == src and work is not arr:
            np.copyto(work, arr)
        if self.size == 1:
            return work
        descriptor = describe_call("broadcast", "", arr.dtype.str, arr.shape, src)

        async def body(lk: CollectiveLink) -> np.ndarray:
            await alg.agree(lk)  # a rank that names another root is caught here
            flat = work.reshape(-1)
            if arr.nbytes <= self.config.small_bytes:
                await alg.direct_broadcast(lk, flat, src)
            else:
                await alg.chain_broadcast(lk, flat, src, self._chunk(arr.dtype))
            return work

        return await self._run(descriptor, timeout, body)

    @collective
    async def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank has entered the barrier."""
        self._check_call(timeout)
        if not self._alone():
            await self._run(describe_call("barrier", "", "", ()), timeout, alg.barrier)

    @collective
    @on_host
    async def gather(
        self,
        x: np.ndarray,
        dst: int = 0,
        *,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> np.ndarray | None:
        """Every rank's ``x`` stacked on rank ``dst`` (shape ``(size, *x.shape)``); None on
        the other ranks. All ranks pass the same dtype and shape (checked)."""
        dst = self._check_rank(dst, "dst")
        arr = as_array(x)
        mine = self._rank == dst
        # out= is checked on every rank that passes one (as reduce does); only dst needs it
        checked = None
        if mine or out is not None:
            checked = result_buffer(None, (self.size, *arr.shape), arr.dtype, out)
            _check_row_of_out(arr, checked)
        result = checked if mine else None
        self._check_call(timeout)
        if self._alone():
            assert result is not None
            result[0] = arr
            return result

        async def body(lk: CollectiveLink) -> np.ndarray | None:
            await alg.agree(lk)  # a rank that names another root is caught here
            await alg.gather_to(lk, arr, dst, result)
            return result

        descriptor = describe_call("gather", "", arr.dtype.str, arr.shape, dst)
        return await self._run(descriptor, timeout, body)

    @collective
    @on_host
    async def scatter(
        self,
        xs: np.ndarray | None,
        src: int = 0,
        *,
        like: np.ndarray | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Rank ``src`` passes ``xs`` of shape ``(size, *item)``; every rank gets
        ``xs[rank]``. Other ranks pass ``xs=None`` and say what they expect with ``like``
        or ``out`` (an ``item``-shaped array), or pass an ``xs`` of the right shape."""
        src = self._check_rank(src, "src")
        if self._rank == src:
            if xs is None:
                raise UsageError(f"rank {src} is the scatter source and must pass xs")
            blocks = _scatter_rows(xs, self.size)
            dtype, item = blocks.dtype, blocks.shape[1:]
            if like is not None:  # not needed here, but a like= that disagrees is a mistake
                _check_like_row(as_array(like), blocks[0])
        else:
            ref: Any = _scatter_rows(xs, self.size)[0] if xs is not None else None
            if like is not None:
                like = as_array(like)
                if ref is not None:
                    _check_like_row(like, ref)
                ref = like  # and out, if given, must match it (checked below)
            if ref is None:
                ref = out
            if ref is None:
                raise UsageError("scatter on a non-source rank needs like=, out= or xs")
            blocks, dtype, item = None, as_array(ref).dtype, tuple(np.shape(ref))
        # On the source, out may not share memory with the rows it sends from.
        result = result_buffer(blocks, item, dtype, out)
        self._check_call(timeout)
        if self._alone():
            assert blocks is not None
            result[...] = blocks[0]
            return result

        async def body(lk: CollectiveLink) -> np.ndarray:
            await alg.agree(lk)  # a rank that names another root is caught here
            await alg.scatter_from(lk, blocks, src, result)
            return result

        descriptor = describe_call("scatter", "", dtype.str, item, src)
        return await self._run(descriptor, timeout, body)

    @collective
    @on_host
    async def all_to_all(
        self, x: np.ndarray, *, out: np.ndarray | None = None, timeout: float | None = None
    ) -> np.ndarray:
        """``x`` has shape ``(size, *item)``; rank r sends ``x[p]`` to rank p and returns
        the array whose row p is what rank p sent to r."""
        arr = as_array(x)
        if arr.ndim == 0 or arr.shape[0] != self.size:
            raise UsageError(f"all_to_all needs {self.size} rows (one per rank), got {arr.shape}")
        result = result_buffer(arr, arr.shape, arr.dtype, out)
        self._check_call(timeout)
        if self._alone():
            if result is not arr:
                np.copyto(result, arr)
            return result
        src = arr if result is not arr else arr.copy()

        async def body(lk: CollectiveLink) -> np.ndarray:
            await alg.all_to_all(lk, src, result)
            return result

        descriptor = describe_call("all_to_all", "", arr.dtype.str, arr.shape)
        return await self._run(descriptor, timeout, body)

    @collective
    @on_host
    async def all_to_all_v(
        self, xs: Iterable[np.ndarray], *, timeout: float | None = None
    ) -> list[np.ndarray]:
        """Variable-size all-to-all: ``xs[p]`` (up to 2**40 rows, zero allowed, same dtype
        and row shape everywhere) goes to rank p; returns ``[what rank p sent us, ...]``."""
        try:  # any iterable (on_host stages CuPy pieces from a list or tuple only)
            pieces = list(xs)
        except TypeError:
            raise UsageError(
                f"all_to_all_v needs a sequence of {self.size} arrays, got {type(xs).__name__}"
            ) from None
        if len(pieces) != self.size:
            raise UsageError(
                f"all_to_all_v needs {self.size} arrays (one per rank), got {len(pieces)}"
            )
        if not isinstance(xs, list | tuple) and any(is_device_array(x) for x in pieces):
            raise UsageError("all_to_all_v: pass CuPy pieces as a list or tuple")
        parts = [as_array(x) for x in pieces]
        first = parts[0]
        if first.ndim == 0:
            raise UsageError("all_to_all_v arrays need at least one dimension (rows)")
        row_shape = first.shape[1:]
        for i, part in enumerate(parts):
            if part.ndim == 0 or part.dtype != first.dtype or part.shape[1:] != row_shape:
                raise UsageError(
                    f"all_to_all_v: xs[{i}] is {part.dtype}{list(part.shape)}, xs[0] is "
                    f"{first.dtype}{list(first.shape)}; dtype and row shape must agree"
                )
            if len(part) > alg.MAX_ALL_TO_ALL_V_ROWS:  # (the receiver refuses more)
                raise UsageError(
                    f"all_to_all_v: xs[{i}] has {len(part)} rows, over the "
                    f"{alg.MAX_ALL_TO_ALL_V_ROWS} (2**40) a piece may have"
                )
        self._check_call(timeout)
        if self._alone():
            return [parts[0].copy()]

        async def body(lk: CollectiveLink) -> list[np.ndarray]:
            return await alg.all_to_all_v(
                lk, parts, row_shape, first.dtype, self.config.max_message_bytes
            )

        descriptor = describe_call("all_to_all_v", "", first.dtype.str, (-1, *row_shape))
        return await self._run(descriptor, timeout, body)

    @collective
    async def split(
        self, color: int | None, key: int = 0, *, timeout: float | None = None
    ) -> Group | None:
        """Split into sub-groups (as MLX's ``split``): ranks passing the same ``color`` form
        one group, ordered by ``(key, rank)``; ``color=None`` opts out (returns None).

        Collective over this group. A sub-group shares this group's connections on channel
        spaces of its own, so its collectives can run beside the parent's; a failure in
        either breaks the connections both use. A space is never used again, even after
        its sub-group closed: a group makes at most 32,511 sub-groups in its life, so
        split once and keep the sub-groups (docs/collectives.md).
        """
        if color is not None:
            checked = as_int(color)
            if checked is None or not 0 <= checked < 1 << 63:  # they travel as int64
                raise UsageError(f"color must be a non-negative int or None, got {color!r}")
            color = checked
        checked_key = as_int(key)
        if checked_key is None or not -(1 << 63) <= checked_key < 1 << 63:
            raise UsageError(f"key must be an int (64-bit), got {key!r}")
        key = checked_key
        book = self._root()._spaces
        token = object()  # this split, in the book
        self._check_call(timeout)
        try:
            if self._alone():
                outcome = await self._split_rounds(None, color, key, book, token)
            else:
                # One collective however many rounds it takes (one channel, its messages
                # in order): a split then holds one place in the call order, as any other
                # call, whatever runs beside it (its rounds as calls of their own could
                # pair with another split's, or with a collective started in between).
                descriptor = describe_call("split", "", "<i8", (3,))
                outcome = await self._run(
                    descriptor, timeout, lambda lk: self._split_rounds(lk, color, key, book, token)
                )
        finally:
            book.release(token)
        if isinstance(outcome, UsageError):  # every rank came to it: the group is fine
            raise outcome
        return outcome

    async def _split_rounds(
        self,
        lk: CollectiveLink | None,
        color: int | None,
        key: int,
        book: SpaceBook,
        token: object,
    ) -> Group | UsageError | None:
        """The rounds of :meth:`split` over ``lk`` (None at world 1): propose a channel
        space, every rank's proposal in, each colour claims the largest of its members';
        confirm; again, higher, while a concurrent split holds one of them. A failure that
        every rank reaches alike is returned, not raised (raised inside the collective,
        it would break the group)."""
        proposal = book.propose(token)
        for attempt in range(_SPLIT_ATTEMPTS):
            mine = np.array([-1 if color is None else color, key, proposal], np.int64)
            table = await self._split_exchange(lk, mine)
            # Each colour takes the largest proposal among its members (see spaces.py).
            chosen: dict[int, int] = {}
            for c, _, p in table.tolist():
                if c >= 0:
                    chosen[c] = max(chosen.get(c, p), p)
            top = int(table[:, 2].max())  # the same on every rank, whatever its colour
            if top + 1 >= FIRST_RESERVED_SPACE:
                return UsageError(
                    f"too many sub-groups: channel spaces up to {FIRST_RESERVED_SPACE - 1:#x} "
                    f"are used up (those from {FIRST_RESERVED_SPACE:#x} are reserved, see "
                    "reserve_channel_space)"
                )
            held = color is None or book.claim(chosen[color], token)
            confirm = await self._split_exchange(lk, np.array([held], np.int64))
            if confirm.all():
                if color is None:
                    return None
                book.commit(chosen[color], token)
                members = sorted(
                    (r for r in range(self.size) if table[r, 0] == color),
                    key=lambda r: (int(table[r, 1]), r),
                )
                child = self._child(members, chosen[color])
                if lk is not None:  # should another member's split fail after all
                    child._made_on = lk.channel
                return child
            # A concurrent split here holds a space one of these wanted: again, higher
            # (a random step, so two such splits do not keep meeting on one space).
            book.release(token)
            proposal = book.propose(token, top + 2 + 2 * _random.randrange(attempt + 1))
        return UsageError(
            f"split found no free channel space in {_SPLIT_ATTEMPTS} rounds "
            "(too many splits running at once?)"
        )

    async def _split_exchange(self, lk: CollectiveLink | None, row: np.ndarray) -> np.ndarray:
        """Every rank's ``row`` (int64) for one round of :meth:`split`, in rank order."""
        result = np.empty((self.size, *row.shape), np.int64)
        if lk is None:
            result[0] = row
        else:
            await alg.direct_all_gather(lk, row, result)
        return result

    async def profile_links(
        self, repeats: int = 5, *, timeout: float | None = None
    ) -> list[LinkProfile]:
        """Time every pair of ranks and fit ``t = alpha + bytes / beta`` per link
        (collective; every rank gets the same list; ``timeout`` bounds each message and
        exchange of it). ``p2pdist.bench.format_table(profiles)`` renders them as text and
        ``p2pdist.bench.plot(profiles, path)`` as a PNG; ``p2pdist bench`` does both, for
        local ranks or (``--from-env``) a group spread over hosts."""
        from .profile import profile_links

        return await profile_links(self, repeats=repeats, timeout=timeout)


def _check_row_of_out(arr: np.ndarray, result: np.ndarray) -> None:
    """all_gather's and gather's ``out`` may hold the input as one of its rows (in place,
    as NCCL's all-gather: the input goes out before anything lands), but may not overlap
    it in any other way."""
    if not np.shares_memory(result, arr):
        return
    offset = arr.__array_interface__["data"][0] - result.__array_interface__["data"][0]
    row = arr.nbytes
    if not (
        arr.flags.c_contiguous and row and offset % row == 0 and 0 <= offset // row < len(result)
    ):
        raise UsageError("out overlaps the input other than as one whole row of out")


def _check_like_row(like: np.ndarray, row: np.ndarray) -> None:
    """UsageError unless scatter's ``like`` has the dtype and shape of a row of ``xs``."""
    if mismatch(wire_form(like.dtype), like.shape, wire_form(row.dtype), row.shape):
        raise UsageError(
            f"like is {like.dtype}{list(like.shape)}, but a row of xs is "
            f"{row.dtype}{list(row.shape)}"
        )


def _scatter_rows(xs: Any, size: int) -> np.ndarray:
    """``xs`` as the ``(size, *item)`` array scatter sends from; UsageError otherwise."""
    try:
        blocks = as_array(xs)
    except ValueError as exc:  # ragged lists; UsageError (a ValueError) passes as it is
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"scatter xs must be one array of rows: {exc}") from None
    if blocks.ndim == 0 or blocks.shape[0] != size:
        raise UsageError(f"scatter needs xs with {size} rows (one per rank), got {blocks.shape}")
    return blocks
