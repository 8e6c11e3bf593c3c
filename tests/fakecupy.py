"""A stand-in for CuPy over numpy, for the test runs where no GPU is.

It has the parts of CuPy's API that p2pdist uses (the CUDA array interface, ``get`` and
``set``, device contexts, streams and events, pinned memory, ``asarray``, ``empty``,
``concatenate``) and refuses what CuPy refuses: an implicit conversion to numpy, a numpy
value assigned into it, ``set`` of another shape or dtype or into a non-contiguous
array. As on a GPU, ``set`` only queues its copy on a stream: it lands when the stream
is synchronised. It counts the copies between host and device.
tests/test_device_arrays.py runs the same tests on real CuPy where a GPU is.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

copies = {"to_host": 0, "to_device": 0, "from_pageable": 0}
made_streams: list[Stream] = []
"""Every stream made (the default ones and a test's own), for a test to drain."""
faults: list[str] = []
"""What a GPU would have done wrong: a queued copy whose page-locked host buffer was
freed (back in the pool) before it ran. Tests assert it stays empty."""


class Event:
    """A point in a stream: passed once the copies queued before it are done."""

    def __init__(self, stream: Stream) -> None:
        self._stream, self._upto = stream, len(stream.pending)
        self._asked = 0

    def synchronize(self) -> None:
        if self._stream.held:
            raise AssertionError("a blocking wait on a busy stream: it holds the event loop")
        self._stream.run(self._upto)

    @property
    def done(self) -> bool:
        """Whether the copies before it landed: the stand-in's 'GPU' runs them the second
        time it is asked (so a waiter polls at least once), not past a held kernel."""
        if self._stream._done >= self._upto:
            return True
        self._asked += 1
        if self._asked > 1:
            self._stream.run(self._upto)
        return False


class Stream:
    """A queue of host-to-device copies that run only when it is synchronised (or a
    blocking copy on it waits): a copy whose host buffer changes before then lands the
    changed values, as on a GPU."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, Any]] = []
        """Queued copies (target, source); a page-locked host end is held weakly, as
        the GPU does not keep it alive (see :data:`faults`)."""
        self._done = 0
        self.device_id = _current[-1].id
        made_streams.append(self)
        self.held = False
        """Busy with a long kernel (:meth:`hold`): its copies wait, and so would a
        blocking wait for it, which the stand-in refuses (it would hold the event loop)."""

    def hold(self) -> None:
        """Queue a long kernel: the stream is busy with it until :meth:`release` (what
        is queued after it waits, and so do the events recorded after it)."""
        self.held = True
        self.pending.append((_KERNEL, _KERNEL))

    def release(self) -> None:
        """The long kernel is done: what was queued behind it may run."""
        self.held = False

    @property
    def idle(self) -> bool:
        """Whether everything queued on it has run."""
        return self._done == len(self.pending)

    def run(self, upto: int | None = None) -> None:
        upto = len(self.pending) if upto is None else upto
        while self._done < upto:
            target, source = (_live(end) for end in self.pending[self._done])
            if target is _KERNEL:
                if self.held:
                    return  # the long kernel runs on: nothing after it yet
            elif target is None or source is None:
                faults.append("a queued copy ran after its page-locked buffer was freed")
            else:
                target[...] = source
            self._done += 1

    def synchronize(self) -> None:
        if self.held:
            raise AssertionError("a blocking wait on a busy stream: it holds the event loop")
        self.run()

    def record(self) -> Event:
        """An event after what is queued now (made on the current device, which must be
        the stream's, as CUDA requires)."""
        if _current[-1].id != self.device_id:
            raise RuntimeError(
                f"an event of device {_current[-1].id} recorded on a stream of device "
                f"{self.device_id}"
            )
        return Event(self)

    def __enter__(self) -> Stream:
        """Make it the current device's current stream, as CuPy's ``with stream:``."""
        _entered.append((_current[-1].id, self))
        return self

    def __exit__(self, *exc: object) -> None:
        _entered.pop()


class Device:
    """A device id and a context that makes it the current device."""

    def __init__(self, id: int = 0) -> None:
        self.id = id

    def __enter__(self) -> Device:
        _current.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _current.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id


_current = [Device(0)]
_streams: dict[int, Stream] = {}
_entered: list[tuple[int, Stream]] = []  # (device id, stream) of each ``with stream:``


def _get_current_stream() -> Stream:
    device = _current[-1].id
    for on, stream in reversed(_entered):
        if on == device:
            return stream
    if device not in _streams:
        _streams[device] = Stream()
    return _streams[device]


_KERNEL = object()
"""A queue entry standing for a long kernel (:meth:`Stream.hold`)."""


class PinnedBlock(bytearray):
    """Page-locked memory of the stand-in (a bytearray that can be referred to weakly)."""


def _alloc_pinned_memory(nbytes: int) -> PinnedBlock:
    return PinnedBlock(nbytes)


def _pinned(a: np.ndarray) -> bool:
    """Whether ``a`` lies in page-locked memory (its base chain ends in a PinnedBlock)."""
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, PinnedBlock)


def _host_end(a: np.ndarray) -> Any:
    """How a queued copy holds a host array: weakly when page-locked (CUDA keeps no
    reference: freed before the copy ran, it lands in the pool's next user)."""
    return weakref.ref(a) if _pinned(a) else a


def _live(end: Any) -> Any:
    return end() if isinstance(end, weakref.ref) else end


class _Cuda:
    Device = Device
    Stream = Stream
    alloc_pinned_memory = staticmethod(_alloc_pinned_memory)
    get_current_stream = staticmethod(_get_current_stream)


cuda = _Cuda()


class ndarray:
    """A 'device' array: numpy memory that numpy may not read implicitly."""

    def __init__(self, data: np.ndarray, device: Device) -> None:
        self._data = data
        self.device = device

    __module__ = "cupy"

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (0, False), "version": 3}

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed.")

    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    size = property(lambda self: self._data.size)
    ndim = property(lambda self: self._data.ndim)
    nbytes = property(lambda self: self._data.nbytes)
    flags = property(lambda self: self._data.flags)

    def get(
        self, stream: Stream | None = None, out: np.ndarray | None = None, blocking: bool = True
    ) -> np.ndarray:
        """The values on the host, after the work queued on ``stream``: waited for, or
        with ``blocking=False`` queued there (they land in ``out`` once it has run)."""
        stream = stream or _get_current_stream()
        if out is not None and (out.shape != self.shape or out.dtype != self.dtype):
            raise ValueError(f"cannot get {self.dtype}{self.shape} into {out.dtype}{out.shape}")
        copies["to_host"] += 1
        out = np.empty(self.shape, self.dtype) if out is None else out
        if blocking:
            stream.synchronize()  # as CuPy: after the queued work
            out[...] = self._data
        else:
            if not _pinned(out):  # CUDA: into pageable memory it returns once done
                raise AssertionError("an asynchronous copy into pageable memory: it blocks")
            stream.pending.append((_host_end(out), self._data))
        return out

    def set(self, arr: np.ndarray, stream: Stream | None = None) -> None:
        """Queue the copy on ``stream`` (as CuPy does): it lands when the stream is
        synchronised, with the host buffer's values of that moment."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("set() takes a numpy array")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"cannot set {arr.dtype}{arr.shape} into {self.dtype}{self.shape}")
        if not self._data.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        copies["to_device"] += 1
        if not _pinned(arr):  # CUDA waits for the stream's earlier work first
            copies["from_pageable"] += 1
        (stream or _get_current_stream()).pending.append((self._data, _host_end(arr)))

    def reshape(self, *shape: Any) -> ndarray:
        return ndarray(self._data.reshape(*shape), self.device)

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        return ndarray(self._data.astype(dtype, copy=copy), self.device)

    def __getitem__(self, key: Any) -> ndarray:
        return ndarray(self._data[key], self.device)

    def __setitem__(self, key: Any, value: Any) -> None:
        """A device copy: in order on the current stream (after what is queued there)."""
        if isinstance(value, np.ndarray):
            raise TypeError("Implicit conversion to a CuPy array is not allowed here.")
        source = value._data if isinstance(value, ndarray) else value
        stream = _get_current_stream()
        if stream.idle:
            self._data[key] = source
        else:
            stream.pending.append((self._data[key], np.asarray(source)))

    @property
    def T(self) -> ndarray:
        return ndarray(self._data.T, self.device)


def asarray(x: Any, dtype: Any = None) -> ndarray:
    """``x`` on the current device (copied there from the host)."""
    if isinstance(x, ndarray):
        return x if dtype is None else x.astype(dtype)
    copies["to_device"] += 1
    return ndarray(np.array(x, dtype=dtype), _current[-1])


def empty(shape: Any, dtype: Any = np.float64) -> ndarray:
    """An uninitialised array on the current device."""
    return ndarray(np.empty(shape, dtype), _current[-1])


def concatenate(arrays: list[ndarray]) -> ndarray:
    """The arrays joined, on the first one's device."""
    return ndarray(np.concatenate([a._data for a in arrays]), arrays[0].device)


def to_numpy(x: ndarray) -> np.ndarray:
    """The device memory as it is now, without waiting for queued copies."""
    return x._data.copy()
