"""All-reduce with a narrow wire format (float16, bfloat16, int8 with block scales):
encoded on the wire, accumulated in float32 at every hop (:mod:`.compress` holds the
codecs)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .algorithms import ring_steps
from .compress import WireCodec
from .linkops import Link, as_bytes, chunks, send_to_others

__all__ = [
    "compressed_direct_all_reduce",
    "compressed_gather_segments",
    "compressed_ring_all_reduce",
    "compressed_ring_reduce_scatter",
]


def _wire_chunk(codec: WireCodec, chunk: int) -> int:
    """Elements per ring message, so that a wire message has about as many bytes as a
    float32 chunk of ``chunk`` elements (a quarter or half of the bytes would double or
    quadruple the messages); a multiple of ``codec.align`` (int8 blocks)."""
    chunk = max(chunk, 4 * chunk * chunk // max(1, codec.nbytes(chunk)))
    return max(codec.align, chunk - chunk % codec.align)


async def compressed_ring_all_reduce(
    link: Link,
    work: np.ndarray,
    bounds: list[tuple[int, int]],
    codec: WireCodec,
    chunk: int,
    residual: np.ndarray | None = None,
) -> None:
    """Sum float32 ``work`` over ranks with a narrow wire format, in place.

    Reduce-scatter: every hop decodes the incoming partial sum and adds it in float32,
    then re-encodes (fresh int8 scales per hop, so partial sums never saturate). The owner
    then encodes its final segment once and those same bytes travel the all-gather ring;
    the owner keeps the decoded value too, so every rank ends with identical bits.

    ``chunk`` counts float32 elements; the ring widens it so that a wire message has about
    ``4 * chunk`` bytes. No full-size temporaries: chunks are encoded into one reused
    buffer (a send hands its bytes to the transport before it returns), received chunks
    are accumulated or decoded straight into ``work`` and forwarded as received. The
    reduce-scatter and all-gather steps are one run of :func:`ring_steps`, whose sends
    may run up to two chunks ahead of its receives (more on long round trips): the all-gather's
    first chunks leave while the last reduce-scatter step's later ones are still
    coming in, and no step waits for a chunk's trip round the ring.

    With ``residual`` (error feedback, in ``work``'s units), every encoding this rank
    makes of a partial or final sum adds what it lost to ``residual``: the next call's
    input carries it, so the long-run sum loses nothing to the hops either. The first
    hop's sends are left out: they carry this rank's own input, which
    :meth:`ErrorFeedback.apply` has already encoded and decoded (block-aligned, as
    here), so encoding it again loses nothing worth keeping. Chunks start at multiples
    of ``codec.align`` (int8 blocks), as the bounds must.
    """
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    encodings = _Encodings(codec, work, bounds, chunk, residual)
    chunk, encoded = encodings.chunk, encodings.encoded
    last = n - 2  # the last reduce-scatter step: it brings this rank's own segment
    steps = range(2 * (n - 1))  # step k sends segment (rank-k-1), takes (rank-k-2)
    sends = [chunks(*bounds[(r - k - 1) % n], chunk) for k in steps]
    recvs = [chunks(*bounds[(r - k - 2) % n], chunk) for k in steps]
    held: dict[tuple[int, int, int], memoryview] = {}  # all-gather chunks to forward

    async def send(k: int, a: int, b: int) -> None:
        if k <= last:  # a partial sum; k == 0 sends our input, which ErrorFeedback encoded
            await link.send(right, encoded(a, b, feed=k > 0))
        elif k == last + 1:  # our own segment, final: keep exactly what the others get
            await link.send(right, encoded(a, b, keep=True))
        else:
            await link.send(right, held.pop((k - 1, a, b)))

    async def receive(k: int, a: int, b: int) -> None:
        data = await link.recv(left, codec.nbytes(b - a))
        if k <= last:
            if b > a:
                codec.accumulate(data, work[a:b])
        else:
            codec.decode_into(data, work[a:b])
            if k < len(steps) - 1:  # forwarded by the next step
                held[(k, a, b)] = data
        del data

    # At least two chunks in flight: the all-gather's first chunks leave while the last
    # reduce-scatter step's later ones still come in (with one, every chunk of that step
    # cost a one-way trip on a path whose round trip is short but not nothing).
    await ring_steps(link, sends, recvs, send, receive, codec.nbytes(chunk), least=2)


async def compressed_ring_reduce_scatter(
    link: Link,
    work: np.ndarray,
    bounds: list[tuple[int, int]],
    codec: WireCodec,
    chunk: int,
    residual: np.ndarray | None = None,
) -> None:
    """Sum float32 ``work`` over ranks so that segment ``bounds[rank]`` holds the result,
    with a narrow wire format: step k sends segment (rank-k-1), encoded, to the right and
    accumulates segment (rank-k-2) from the left in float32. Every hop re-encodes the
    partial sum (fresh int8 scales, so it never saturates); our own segment is never
    encoded after its last contribution, so it keeps float32 precision. Segments may
    start anywhere: a chunk's int8 blocks start at the chunk.

    With ``residual`` (error feedback, in ``work``'s units), every encoding this rank
    makes adds what it lost to ``residual`` at that place, the first hop's (our input)
    included: :meth:`ErrorFeedback.begin` leaves the input unencoded. Our segment ends
    with the wire's range (float16: a sum of 65520 or more is inf), as all_reduce's,
    whose every piece is encoded once more."""
    encodings = _Encodings(codec, work, bounds, chunk, residual)
    await _reduce_scatter_steps(
        link,
        work,
        bounds,
        codec,
        encodings.chunk,
        link.size - 1,
        lambda _k, a, b: encodings.encoded(a, b),
    )
    a, b = bounds[link.rank]
    _clamp_to_wire_range(codec, work[a:b])  # as its encoding would make it: all_reduce's


class _Encodings:
    """A ring's encodings of ``work[a:b]`` into one reused wire buffer and, with a
    ``residual`` (error feedback), what each of them loses added to it."""

    def __init__(
        self,
        codec: WireCodec,
        work: np.ndarray,
        bounds: list[tuple[int, int]],
        chunk: int,
        residual: np.ndarray | None,
    ) -> None:
        self.chunk = _wire_chunk(codec, chunk)
        widest = min(self.chunk, max(b - a for a, b in bounds))
        self._codec, self._work, self._residual = codec, work, residual
        self._wire = np.empty(codec.nbytes(widest), np.uint8)
        self._lost = np.empty(widest if residual is not None else 0, np.float32)
        self._finite = np.empty(widest if residual is not None else 0, np.bool_)

    def encoded(self, a: int, b: int, *, keep: bool = False, feed: bool = True) -> memoryview:
        """The wire bytes of ``work[a:b]`` (valid until the next call); with ``keep``,
        ``work[a:b]`` then holds their decoded value; without ``feed``, the residual
        leaves this encoding out."""
        codec, work, residual = self._codec, self._work, self._residual
        buf = self._wire[: codec.nbytes(b - a)]
        if b <= a:
            return as_bytes(buf)
        codec.encode_into(work[a:b], buf)
        if feed and residual is not None:
            m = b - a
            lost, ok = self._lost[:m], self._finite[:m]
            _feed_back(codec, buf, work[a:b], lost, ok, residual[a:b], keep=keep)
        elif keep:
            codec.decode_into(buf, work[a:b])
        return as_bytes(buf)


async def compressed_gather_segments(
    link: Link, work: np.ndarray, bounds: list[tuple[int, int]], codec: WireCodec, dst: int
) -> None:
    """After a reduce-scatter, bring every rank's segment of float32 ``work`` to ``dst``,
    encoded once (one message per rank); ``dst`` decodes each into its place and keeps its
    own segment as it is (float32; the reduce-scatter gave it the wire's range)."""
    r = link.rank
    if r != dst:
        a, b = bounds[r]
        await link.send(dst, as_bytes(codec.encode(work[a:b])) if b > a else memoryview(b""))
        return
    for p, (a, b) in enumerate(bounds):
        if p != r:
            data = await link.recv(p, codec.nbytes(b - a))
            if b > a:
                codec.decode_into(data, work[a:b])
            del data


async def _reduce_scatter_steps(
    link: Link,
    work: np.ndarray,
    bounds: list[tuple[int, int]],
    codec: WireCodec,
    chunk: int,
    steps: int,
    encoded: Callable[[int, int, int], memoryview],
) -> None:
    """The first ``steps`` reduce-scatter steps of the ring (:func:`ring_steps`: sends
    run ahead of receives on long round trips): step k sends segment (rank-k-1) chunk by
    chunk as ``encoded(k, a, b)`` gives it (valid until the next call; a send hands its
    bytes over before it returns) and accumulates segment (rank-k-2) from the left in
    float32."""
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    sends = [chunks(*bounds[(r - k - 1) % n], chunk) for k in range(steps)]
    recvs = [chunks(*bounds[(r - k - 2) % n], chunk) for k in range(steps)]

    async def send(k: int, a: int, b: int) -> None:
        await link.send(right, encoded(k, a, b))

    async def receive(_k: int, a: int, b: int) -> None:
        data = await link.recv(left, codec.nbytes(b - a))
        if b > a:
            codec.accumulate(data, work[a:b])
        del data

    await ring_steps(link, sends, recvs, send, receive, codec.nbytes(chunk))


async def compressed_direct_all_reduce(link: Link, work: np.ndarray, codec: WireCodec) -> None:
    """One round: everyone sends ``encode(work)`` to everyone; everyone decodes all inputs
    (its own included) and sums them in rank order in float32, in place. A float16 sum
    that float16 cannot hold (|sum| >= 65520) becomes inf, as the ring's final encoding
    makes it, so both paths agree on the range. The sum is not rounded to the wire
    dtype again: that would add an error that error feedback cannot take back."""
    n, r = link.size, link.rank
    enc = codec.encode(work)
    payload = as_bytes(enc)
    await send_to_others(link, payload)
    for p in range(n):
        data = payload if p == r else await link.recv(p, len(payload))
        if p == 0:
            codec.decode_into(data, work)
        else:
            codec.accumulate(data, work)
    _clamp_to_wire_range(codec, work)


def _clamp_to_wire_range(codec: WireCodec, work: np.ndarray) -> None:
    """With a float16 wire, float32 ``work``'s values that float16 cannot hold
    (|value| >= 65520) set to inf of their sign, in place, as encoding them would."""
    if codec.name == "float16":
        over = np.abs(work) >= _F16_OVERFLOW
        if over.any():
            np.copyto(work, np.copysign(np.float32(np.inf), work), where=over)


def _feed_back(
    codec: WireCodec,
    buf: np.ndarray,
    sent: np.ndarray,
    scratch: np.ndarray,
    ok: np.ndarray,
    residual: np.ndarray,
    *,
    keep: bool = False,
) -> None:
    """``residual += sent - decode(buf)`` where that is finite (a non-finite sum costs
    that call's result, not every later one: see ErrorFeedback). ``scratch`` (float32)
    and ``ok`` (bool) are reused work arrays of ``sent``'s size.

    With ``keep``, ``sent`` ends holding ``decode(buf)``: the payload is decoded once
    (into ``scratch``), the difference is formed in ``sent`` itself, then the decoded
    values are copied over it.
    """
    codec.decode_into(buf, scratch)
    diff = sent if keep else scratch
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(sent, scratch, out=diff)
    if np.isfinite(diff, out=ok).all():
        residual += diff
    else:
        np.add(residual, diff, out=residual, where=ok)
    if keep:
        np.copyto(sent, scratch)


_F16_OVERFLOW = np.float32(65520.0)
"""float32 values of at least this magnitude round to an infinity in float16."""
