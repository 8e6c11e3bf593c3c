"""CuPy (GPU) arrays in collectives: staged through host memory, results on the device.

A collective given a CuPy array copies it to page-locked host memory (``ndarray.get`` on
the array's device and the stream current when the call was made, queued after the work
there, so the values are the ones the caller's kernels wrote), runs the numpy collective
on the copy, and hands the result back on the device of the first CuPy array it was
given (or fills the CuPy ``out=``), on that stream. Every copy is queued without
blocking and finished by polling an event recorded after it, so the event loop goes on
meanwhile (the other collectives, the keepalives), and the call's timeout bounds the
wait: the result is on the device when the call returns, and the host buffer can go back
to the pool. The network is at most a few GB/s, well below a GPU's copy engines, so the
staging copies cost little next to the transfer; docs/collectives.md gives the measured
figures.

CuPy is imported only once a CUDA array has been seen: numpy users never pay for it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from ..errors import P2PTimeoutError, UsageError
from .calls import as_coroutine_function

__all__ = [
    "host_copy_async",
    "is_device_array",
    "on_host",
    "pack",
    "pinned_array",
    "ready_marker",
    "unpack",
    "wait_ready",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S")

_EVENT_SPIN = 0.0002
"""Seconds :func:`wait_ready` looks at a CUDA event at every turn of the event loop
(a small copy lands within this: a timed sleep costs a whole millisecond of epoll)."""
_EVENT_POLL = 0.0005
"""Seconds between looks at a CUDA event after :data:`_EVENT_SPIN`."""
_PINNED_MIN = 4096
"""Staging buffers are whole powers of two from this size up: CuPy's pinned pool keeps
freed blocks by size for ever, so a bounded set of sizes bounds what it keeps."""


def is_device_array(x: object) -> bool:
    """Whether ``x`` is a CuPy array (any object of a ``cupy`` type with the CUDA array
    interface)."""
    kind = type(x)
    module = kind.__module__
    return hasattr(kind, "__cuda_array_interface__") and (
        module == "cupy" or module.startswith("cupy.")
    )


def type_name(x: object) -> str:
    """``x``'s type as ``module.name`` (``cupy.ndarray``, ``torch.Tensor``)."""
    kind = type(x)
    return f"{kind.__module__}.{kind.__qualname__}"


def _cuda(x: object) -> bool:
    """Whether ``x`` offers the CUDA array interface (CuPy's or another library's)."""
    return hasattr(type(x), "__cuda_array_interface__")


def _refuse_foreign(x: object) -> None:
    """A CUDA array that is not CuPy's (a torch tensor, a Numba array) is refused with a
    way out, rather than read element by element through numpy."""
    if _cuda(x) and not is_device_array(x):
        raise UsageError(
            f"{type_name(x)} is a CUDA array but not a CuPy one: pass "
            "cupy.asarray(x) (no copy) or a numpy array"
        )


async def host_copy_async(x: Any, seconds: float) -> Any:
    """``x`` as it is, or for a CuPy array a numpy copy of its values (for calls that
    keep or send an array whole, such as federated updates), in ordinary host memory.
    The copy is queued on the array's device's current stream, after the work there,
    and waited for by polling (P2PTimeoutError after ``seconds``), so the event loop
    goes on meanwhile. Another library's CUDA array is a UsageError."""
    if not is_device_array(x):
        _refuse_foreign(x)
        return x
    staged = _pinned(x.shape, x.dtype)
    event = _queue_to_host(x, staged)
    await wait_ready([event], seconds, "the GPU copy of an update", [staged])
    return np.array(staged)  # out of page-locked memory: an update may be kept for long


def _queue_to_host(x: Any, out: np.ndarray, stream: Any = None) -> Any:
    """Queue the copy of CuPy array ``x`` into page-locked ``out`` on ``stream`` (None:
    its device's current stream), after the work there; the event after it."""
    with x.device:
        stream = stream or _cupy().cuda.get_current_stream()
        x.get(out=out, stream=stream, blocking=False)
        return stream.record()


def _cupy() -> Any:
    return importlib.import_module("cupy")


def pinned_array(size: int, dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialised 1-D host array of ``size`` items in page-locked memory (for a
    buffer that GPU copies fill and empty without holding the event loop)."""
    return _pinned((size,), dtype)


def _pinned(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
    """An uninitialised host array in page-locked memory from CuPy's pinned pool (freed
    blocks go back to the pool and are reused): copies to and from the GPU run at the
    copy engines' speed there, where pageable memory takes several times longer."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    block = max(_PINNED_MIN, 1 << (nbytes - 1).bit_length()) if nbytes else _PINNED_MIN
    cp = _cupy()
    try:
        memory = cp.cuda.alloc_pinned_memory(block)
    except cp.cuda.runtime.CUDARuntimeError as exc:  # what CuPy's pinned pool raises
        if getattr(exc, "status", None) != _CUDA_ERROR_MEMORY_ALLOCATION:
            raise
        raise MemoryError(f"no page-locked memory for {block} bytes: {exc}") from exc
    return np.frombuffer(memory, dtype, count).reshape(shape)


_CUDA_ERROR_MEMORY_ALLOCATION = 2
"""cudaErrorMemoryAllocation: a cudaHostAlloc that found no memory."""


class _Staging:
    """One call's host copies, and the device (and stream) its results go back to."""

    def __init__(self) -> None:
        self.device: Any = None
        self.out: Any = None
        self.numpy_out: Any = None
        self.seconds = 0.0  # bound on each wait for the copies (the call's timeout)
        self._streams: dict[int, Any] = {}  # device id: its stream when the call began
        self._devices: dict[int, Any] = {}  # device id: the device
        self._copies: dict[int, np.ndarray] = {}  # id of a staged CuPy array: its copy
        self._queued: set[int] = set()  # devices whose stream has copies not waited for
        self._pinned: set[int] = set()  # ids of the page-locked host buffers made here

    def _see(self, x: Any) -> None:
        device = x.device
        if self.device is None:
            self.device = device
        if device.id not in self._streams:
            with device:
                self._streams[device.id] = _cupy().cuda.get_current_stream()
            self._devices[device.id] = device

    async def copied(self, keep: Sequence[np.ndarray]) -> None:
        """Wait (polled) until the copies queued so far have landed; ``keep``: the host
        buffers they read or write, held until then however the wait ends."""
        await wait_ready(self._recorded(), self.seconds, "the GPU copies of a collective", keep)

    def abandon(self, keep: Sequence[np.ndarray]) -> None:
        """Staging failed part way (a later argument refused, no memory for a result):
        the copies already queued keep ``keep``, their host buffers, until they land."""
        if self._queued:
            _hold_until_landed(self._recorded(), keep)

    def _recorded(self) -> list[Any]:
        """An event after the copies queued on each stream since the last call."""
        events = []
        for device_id in self._queued:
            with self._devices[device_id]:
                events.append(self._streams[device_id].record())
        self._queued.clear()
        return events

    def see_streams(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Note the current stream of each CuPy argument's device now, as the call is
        made: the call may run later (a task), when another stream is current."""
        for value in (*args, *kwargs.values()):
            for item in value if isinstance(value, list | tuple) else (value,):
                if is_device_array(item):
                    self._see(item)

    def host(self, x: Any) -> Any:
        """``x`` on the host when it is a CuPy array (a list or tuple: each item); other
        values as they are."""
        if is_device_array(x):
            staged = self._copies.get(id(x))
            if staged is not None:  # the same array again (all_to_all_v([d, d])): one copy
                return staged
            copy = _pinned(x.shape, x.dtype)
            # On the stream of the call's making: after the caller's kernels that write x
            # (the event after the copies is recorded when they are waited for).
            _queue_to_host(x, copy, self._streams[x.device.id])
            self._copies[id(x)] = copy
            self._pinned.add(id(copy))
            self._queued.add(x.device.id)
            return copy
        if isinstance(x, list | tuple) and any(_cuda(item) for item in x):
            return [self.host(item) for item in x]
        _refuse_foreign(x)
        return x

    def keyword(self, name: str, value: Any) -> Any:
        """A keyword argument on the host: ``out=`` and ``like=`` give only their shape
        and dtype (nothing is copied), the others as :meth:`host`."""
        if name == "out":
            return self.host_out(value)
        if name == "like" and is_device_array(value):
            return np.empty(value.shape, value.dtype)
        return self.host(value)

    def host_out(self, out: Any) -> Any:
        """A host buffer for a CuPy ``out=`` (which is filled after the call): the input's
        own host copy when ``out`` is the input, so the call runs in place there too."""
        if not is_device_array(out):
            _refuse_foreign(out)
            self.numpy_out = out
            return out
        if not out.flags.c_contiguous:
            raise UsageError("out must be a writeable C-contiguous array")
        self.out = out
        staged = self._copies.get(id(out))
        if staged is None:
            staged = _pinned(out.shape, out.dtype)
            self._pinned.add(id(staged))
        return staged

    def staged(self) -> list[np.ndarray]:
        """The host copies of the call's CuPy inputs."""
        return list(self._copies.values())

    async def back(self, result: Any) -> Any:
        """``result`` on the device (the CuPy ``out=`` filled, when one was given), the
        copies finished; a numpy ``out=`` is returned as it is."""
        sources: list[np.ndarray] = []
        try:
            placed = self._place(result, sources)
        except BaseException:  # (no device memory for a later item of a list result)
            self.abandon(sources)
            raise
        if sources:  # the host buffers are reused once this call returns: wait for them
            await self.copied(sources)
        return placed

    def _place(self, result: Any, sources: list[np.ndarray]) -> Any:
        """:meth:`back`'s copies, queued (their host buffers appended to ``sources``)."""
        if result is None or (self.numpy_out is not None and result is self.numpy_out):
            return result
        if isinstance(result, list):
            return [self._place(item, sources) for item in result]
        target = self.out
        device = target.device if target is not None else self.device
        if id(result) not in self._pinned:
            # From pageable memory a copy waits for the stream's earlier work first,
            # holding the loop: through page-locked memory it is only queued.
            pinned = _pinned(result.shape, result.dtype)
            pinned[...] = result
            result = pinned
        stream = self._streams[device.id]
        with device, stream:  # (allocated from that stream's pool: used in its order)
            if target is None:
                target = _cupy().empty(result.shape, result.dtype)
            target.set(result, stream=stream)  # queued on the stream
        sources.append(result)
        self._queued.add(device.id)
        return target


_PLAIN = frozenset({np.ndarray, str, int, float, bool, type(None)})
"""Argument types that are never CUDA arrays nor hold any: told apart by one set lookup,
since this check runs on every call (a failed ``hasattr`` costs far more)."""


def _holds_cuda(value: object) -> bool:
    return _cuda(value) or (isinstance(value, list | tuple) and any(map(_cuda, value)))


def _staged(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether any argument is a CUDA array or a list or tuple holding one (no CuPy
    import)."""
    for value in args:
        if type(value) not in _PLAIN and _holds_cuda(value):
            return True
    for value in kwargs.values():  # noqa: SIM110 (a loop: any() of a generator is slower)
        if type(value) not in _PLAIN and _holds_cuda(value):
            return True
    return False


def on_host(
    method: Callable[Concatenate[_S, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[_S, _P], Coroutine[Any, Any, _R]]:
    """Let a collective take CuPy arrays: they are copied to the host, the numpy
    collective runs, and its array results come back on the input's device (a CuPy
    ``out=`` is filled and returned). A call with no CUDA array is the method's own
    coroutine, with no layer added."""

    @functools.wraps(method)
    def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> Coroutine[Any, Any, _R]:
        if not _staged(args, kwargs):
            return method(self, *args, **kwargs)
        staging = _Staging()
        staging.see_streams(args, kwargs)  # the caller's streams when it made the call
        return _through_host(method, self, args, kwargs, staging)

    return as_coroutine_function(wrapper)


async def _through_host(
    method: Callable[..., Coroutine[Any, Any, _R]],
    group: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    staging: _Staging,
) -> _R:
    """Run ``method`` on host copies of the CUDA arrays among its arguments."""
    # The call's timeout bounds each wait for the copies (a bad one is refused now,
    # before any copy, as the collective would refuse it).
    staging.seconds = group._seconds(kwargs.get("timeout"))
    try:
        host_args = [staging.host(a) for a in args]
        host_kwargs = {k: staging.keyword(k, v) for k, v in kwargs.items()}
    except BaseException:
        staging.abandon(staging.staged())
        raise
    await staging.copied(staging.staged())
    result = await method(group, *host_args, **host_kwargs)
    return await staging.back(result)  # type: ignore[no-any-return]


def ready_marker(x: Any) -> Any:
    """An event on ``x``'s device, recorded on its current stream: once it has passed,
    ``x`` holds what the kernels queued before this call wrote (for a copy made later,
    from another task, on whatever stream is current then)."""
    with x.device:
        return _cupy().cuda.get_current_stream().record()


async def wait_ready(
    events: Sequence[Any],
    seconds: float,
    what: str = "the GPU work queued before add()",
    keep: Sequence[np.ndarray] = (),
) -> None:
    """Wait (polled, so the event loop goes on meanwhile: other collectives and buckets
    are in flight) until every CUDA event in ``events`` (:func:`ready_marker`'s, or one
    recorded after some copies) has passed; P2PTimeoutError naming ``what`` after
    ``seconds``. ``keep``: host buffers the GPU still reads or writes until then; if the
    wait ends first (a timeout, a cancellation) they are held until the events pass
    (back in the pinned pool meanwhile, another call's buffer would take a late copy)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(seconds):
            for event in events:
                # Polled: a CUDA event can call no one back on the loop. At every turn
                # of the loop at first (a small copy lands within microseconds), then
                # timed.
                spin_until = loop.time() + _EVENT_SPIN
                while not event.done:  # noqa: ASYNC110
                    await asyncio.sleep(0 if loop.time() < spin_until else _EVENT_POLL)
    except BaseException as exc:
        if keep:
            _hold_until_landed(events, keep)
        if isinstance(exc, TimeoutError):
            raise P2PTimeoutError(f"{what} did not finish within {seconds:g} s") from None
        raise
    finally:
        _forget_landed()


def _events_on(devices: Iterable[Any]) -> list[Any]:
    """An event after what is queued now on each device's current stream."""
    events = []
    for device in devices:
        with device:
            events.append(_cupy().cuda.get_current_stream().record())
    return events


def _hold_until_landed(events: Sequence[Any], keep: Sequence[np.ndarray]) -> None:
    """Keep ``keep`` (host buffers the GPU still reads or writes) out of CuPy's pinned
    pool until every event in ``events`` has passed: back in the pool, another call's
    buffer would take the late copy."""
    with _late_lock:
        _late.append((list(events), list(keep)))


def _forget_landed() -> None:
    """Let go of the held buffers whose copies have landed."""
    if not _late:  # (the common case: nothing held)
        return
    with _late_lock:
        _late[:] = [(late, held) for late, held in _late if not all(e.done for e in late)]


_late: list[tuple[list[Any], list[np.ndarray]]] = []
"""Host buffers of copies still running after their wait ended early, with their events
(looked at after each wait: groups on other threads' loops share it, under the lock)."""
_late_lock = threading.Lock()


async def pack(arrays: Sequence[Any], out: np.ndarray, seconds: float) -> None:
    """``arrays`` flattened into ``out``, a host array of their total size (cast to its
    dtype), page-locked (:func:`pinned_array`) when any is a CuPy array; CuPy arrays on
    one device are joined there first, so they cross to the host in one copy. The copies
    are queued on each device's current stream and waited for by polling
    (P2PTimeoutError after ``seconds``)."""
    if not any(is_device_array(a) for a in arrays):
        np.concatenate([a.reshape(-1) for a in arrays], out=out)
        return
    events: list[Any] = []
    devices = {a.device.id for a in arrays if is_device_array(a)}
    if len(devices) == 1 and all(is_device_array(a) for a in arrays):
        with arrays[0].device:
            joined = _cupy().concatenate([a.reshape(-1) for a in arrays])
            joined = joined.astype(out.dtype, copy=False)
        events.append(_queue_to_host(joined, out))  # on the current stream, after the join
        await wait_ready(events, seconds, "the GPU copies of a bucket", [out])
        return
    parts: list[np.ndarray] = []
    try:
        for a in arrays:
            if is_device_array(a):
                part = _pinned(a.shape, a.dtype)
                events.append(_queue_to_host(a, part))
                parts.append(part)
            else:
                parts.append(a)
    except BaseException:
        _hold_until_landed(events, parts)
        raise
    await wait_ready(events, seconds, "the GPU copies of a bucket", parts)
    np.concatenate([part.reshape(-1) for part in parts], out=out)


async def unpack(flat: np.ndarray, arrays: Sequence[Any], seconds: float) -> None:
    """Write consecutive pieces of ``flat`` back into ``arrays`` (in place), as
    :func:`pack` laid them out (``flat`` page-locked when any is a CuPy array); the
    device copies are queued on each device's current stream and finished when it
    returns (polled; P2PTimeoutError after ``seconds``)."""
    offset = 0
    on_device: dict[int, Any] = {}  # device id: flat's copy there
    try:
        for a in arrays:
            start, offset = offset, offset + a.size
            if not is_device_array(a):
                a[...] = flat[start:offset].reshape(a.shape)  # a strided array too (a cast)
                continue
            device = a.device
            with device:
                if device.id not in on_device:  # one copy to each device, then slices there
                    cp = _cupy()
                    whole = cp.empty(flat.shape, flat.dtype)
                    whole.set(flat, stream=cp.cuda.get_current_stream())  # queued
                    on_device[device.id] = whole
                a[...] = on_device[device.id][start:offset].reshape(a.shape)
    except BaseException:
        if on_device:
            _hold_until_landed(_events_on(w.device for w in on_device.values()), [flat])
        raise
    events = _events_on(w.device for w in on_device.values())
    await wait_ready(events, seconds, "the GPU copies of a bucket", [flat] if events else [])
