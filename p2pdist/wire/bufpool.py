"""Reuse of large receive buffers (sans-I/O).

A decoder gives every large payload a buffer of its own, and the receiver keeps it as long
as it likes. Allocating a fresh one per message costs page faults whenever the allocator
has handed the previous one back to the kernel, which glibc does under some allocation
patterns (uvloop's, measured: 100-2000 faults per all-reduce call and half the
bandwidth at 1 MiB). :class:`BufferPool` keeps a few buffers and hands one out again
once nothing outside the pool refers to it any more: no view of it, no array made from
it, no frame holding it. CPython's reference count says when that is, exactly, because
every view of a buffer holds a reference to the array that owns it.
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["BufferPool"]


def _free_refs() -> int:
    """``sys.getrefcount`` of a kept array that nothing else refers to, measured the way
    :meth:`BufferPool.take` measures it: indexing the list, never binding the array to a
    local (a tracer reading ``f_locals`` on CPython 3.11-3.12 copies locals into a dict
    that holds a reference; measured here under a tracer and checked later without one,
    a busy buffer would look free). 2 on CPython 3.11-3.13: the list and the argument."""
    kept = [np.empty(1, dtype=np.uint8)]
    return sys.getrefcount(kept[0])


# Never above 2: a higher reading (an unusual interpreter) could only make a busy buffer
# look free, a lower one only makes the pool reuse less.
_FREE_REFS = min(_free_refs(), 2)


class BufferPool:
    """Buffers of power-of-two sizes, at most ``max_bytes`` of them kept in all. When a new
    buffer needs room, idle buffers of other sizes go first, then the oldest busy ones:
    a busy buffer the pool lets go stays its holder's (and is freed when the holder drops
    it), so neither message sizes that change nor a receiver that keeps what it got can
    leave the pool stuck."""

    def __init__(self, max_bytes: int = 4 << 20) -> None:
        self.max_bytes = max_bytes
        self._held = 0
        self._classes: dict[int, list[np.ndarray]] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers the pool keeps (free or in use)."""
        return self._held

    def take(self, nbytes: int) -> memoryview:
        """A writable view of exactly ``nbytes`` (> 0) bytes, in a buffer that nothing
        else refers to; it returns to the pool by itself when its last view is gone."""
        size = 1 << (nbytes - 1).bit_length()
        if size > self.max_bytes:  # never kept: exactly the size asked for
            return np.empty(nbytes, dtype=np.uint8).data
        kept = self._classes.setdefault(size, [])
        for i in range(len(kept)):
            if sys.getrefcount(kept[i]) <= _FREE_REFS:  # kept[i], never a local: see above
                return kept[i].data[:nbytes]
        self._make_room(size)
        kept.append(np.empty(size, dtype=np.uint8))
        self._held += size
        return kept[-1].data[:nbytes]

    def _make_room(self, size: int) -> None:
        """Let buffers go until ``size`` more bytes fit (``size <= max_bytes``): idle ones
        first, then busy ones, oldest first."""
        for busy_too in (False, True):
            for other, kept in self._classes.items():
                i = 0
                while i < len(kept) and self._held + size > self.max_bytes:
                    # kept[i], never a local: see _free_refs
                    if busy_too or sys.getrefcount(kept[i]) <= _FREE_REFS:
                        del kept[i]
                        self._held -= other
                    else:
                        i += 1
