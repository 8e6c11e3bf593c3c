"""Gradient bucketing: pack many small arrays into a few large all-reduces that run while
the caller goes on (the way data-parallel training overlaps communication with compute)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from ..errors import UsageError
from .group import Group

__all__ = ["GradientBuckets"]


class GradientBuckets:
    """Reduce many arrays in buckets of about ``bucket_bytes``, in the background.

    Create with ``await GradientBuckets.create(group)``; on every rank ``add`` the same
    arrays in the same order, then ``await wait()``: every added array then holds its
    reduced value (in place). Buckets are reduced on a sub-group of their own, so their
    collectives never interleave with the caller's, and a bucket starts reducing as soon
    as it is full.
    """

    def __init__(self, group: Group, *, bucket_bytes: int, op: str, **reduce: Any) -> None:
        self._group = group
        self._bucket_bytes = bucket_bytes
        self._op = op
        self._reduce = reduce
        self._pending: list[np.ndarray] = []
        self._pending_bytes = 0
        self._dtype: np.dtype[Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def create(
        cls, group: Group, *, bucket_bytes: int = 4 << 20, op: str = "mean", **reduce: Any
    ) -> GradientBuckets:
        """Buckets over a dedicated sub-group of ``group`` (collective: call on all ranks).

        ``reduce`` holds extra all_reduce keywords (``mode=``, ``wire_dtype=``, ...).
        """
        if bucket_bytes < 1:
            raise UsageError(f"bucket_bytes must be positive, got {bucket_bytes}")
        sub = await group.split(0)
        assert sub is not None
        return cls(sub, bucket_bytes=bucket_bytes, op=op, **reduce)

    def add(self, array: np.ndarray) -> None:
        """Queue ``array`` (writeable, C-contiguous) for reduction in place."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise UsageError("add() needs a C-contiguous numpy array (it is reduced in place)")
        if not array.flags.writeable:
            raise UsageError("add() needs a writeable array (it is reduced in place)")
        if self._dtype is not None and array.dtype != self._dtype:
            self.flush()  # a bucket holds one dtype
        self._dtype = array.dtype
        self._pending.append(array)
        self._pending_bytes += array.nbytes
        if self._pending_bytes >= self._bucket_bytes:
            self.flush()

    def flush(self) -> None:
        """Start reducing what was added so far (the bucket need not be full)."""
        if not self._pending:
            return
        arrays, self._pending, self._pending_bytes = self._pending, [], 0
        previous = self._tasks[-1] if self._tasks else None
        self._tasks.append(
            asyncio.get_running_loop().create_task(self._reduce_bucket(arrays, previous))
        )

    async def _reduce_bucket(
        self, arrays: list[np.ndarray], previous: asyncio.Task[None] | None
    ) -> None:
        if previous is not None:
            await asyncio.shield(previous)  # buckets reduce in order on every rank
        flat = np.concatenate([a.reshape(-1) for a in arrays])
        await self._group.all_reduce(flat, self._op, out=flat, **self._reduce)
        offset = 0
        for a in arrays:
            a.reshape(-1)[:] = flat[offset : offset + a.size]
            offset += a.size

    async def wait(self) -> None:
        """Flush, then wait for every bucket; raises the first failure."""
        self.flush()
        tasks, self._tasks = self._tasks, []
        if tasks:
            await asyncio.gather(*tasks)
