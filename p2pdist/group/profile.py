"""Link profiling: time each pair of ranks and fit the alpha-beta model
``t(m) = alpha + m / beta`` (latency plus bytes over bandwidth)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from ..settings import as_int
from .group import Group

__all__ = ["DEFAULT_SIZES", "LinkProfile", "fit_alpha_beta", "profile_links"]

DEFAULT_SIZES = tuple(1 << k for k in range(0, 25, 2))  # 1 B .. 16 MiB


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """One link's measurements and fitted model."""

    a: int
    b: int
    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    """Median one-way time per size (half a round trip)."""
    alpha: float
    """Latency, seconds."""
    beta: float
    """Bandwidth, bytes per second."""

    def bandwidth(self) -> list[float]:
        """Measured bytes per second per size."""
        return [
            m / t if t > 0 else float("inf") for m, t in zip(self.sizes, self.seconds, strict=True)
        ]


def fit_alpha_beta(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """Fit ``t = alpha + m / beta`` (alpha >= 0): beta from the larger half of the sizes,
    where bandwidth decides the time, then alpha from the smaller half given that beta,
    where latency does. One least-squares line through all of them lets either end's
    noise skew the other (a link's small messages are not on the large ones' line).
    The slope is the median of the slopes between every two of the larger sizes
    (Theil-Sen): a least-squares line there is the largest size's alone, so one slow or
    fast run of it (a repeats=1 profile) set the bandwidth. Where noise makes that
    median no cost per byte at all (few sizes in the larger half), the slopes between
    every two of all the sizes give it; the bandwidth is infinite only where those say
    so too (times that do not grow with the size)."""
    sizes, seconds = np.asarray(sizes, float), np.asarray(seconds, float)
    if sizes.shape != seconds.shape or np.unique(sizes).size < 2:
        raise UsageError("the alpha-beta fit needs times for at least two different sizes")
    # one point per distinct size (the median of its times): the halves below are
    # taken by position, and repeated sizes would otherwise fill one half alone
    m = np.unique(sizes)
    t = np.array([np.median(seconds[sizes == size]) for size in m])
    n = m.size

    def theil_sen(points: range) -> float:
        return float(
            np.median([(t[j] - t[i]) / (m[j] - m[i]) for i in points for j in points if j > i])
        )

    def measurable(slope: float) -> bool:
        return bool(slope * m[-1] > 1e-9 * max(float(t[-1]), 1e-12))

    slope = theil_sen(range(n - max(2, n // 2), n))
    if not measurable(slope):
        slope = theil_sen(range(n))
        if not measurable(slope):  # no measurable cost per byte
            slope = 0.0
    small = slice(0, max(1, n // 2))
    alpha = float(np.median(t[small] - m[small] * slope))
    return max(alpha, 0.0), (1.0 / slope if slope > 0 else float("inf"))


async def profile_links(
    group: Group,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    repeats: int = 5,
    *,
    timeout: float | None = None,
) -> list[LinkProfile]:
    """Ping-pong every pair of ranks in turn (collective: call on all ranks).

    Every rank returns the same list (each pair's lower rank shares its timings).
    ``timeout`` (default: the group's) bounds each message; ranks not in the pair being
    measured wait up to that times the pair's message count. ``sizes`` are measured in
    increasing order, each once (a plot joins them in that order).

    Each call splits off a sub-group of everyone for its messages, and a root group has
    32,511 sub-groups in all (``split``): a job may profile that many times.
    """
    checked = as_int(repeats)  # numpy's integers too, as for sizes; no bool
    if checked is None or checked < 1:
        raise UsageError(f"repeats must be a positive int, got {repeats!r}")
    repeats = checked
    ints = [as_int(m) for m in sizes]
    if len(set(ints)) < 2 or any(m is None or m < 1 for m in ints):
        raise UsageError(f"sizes must be at least two different positive ints, got {sizes!r}")
    sizes = tuple(sorted({m for m in ints if m is not None}))
    # On a sub-group of everyone: its messages have channels of their own, so point to
    # point messages of the caller's still in flight are neither taken nor disturbed.
    own = await group.split(0, timeout=timeout)
    assert own is not None
    try:
        return await _profile(own, sizes, repeats, timeout)
    finally:
        await own.close()


async def _profile(
    group: Group, sizes: tuple[int, ...], repeats: int, timeout: float | None
) -> list[LinkProfile]:
    n, me = group.size, group.rank
    # The other ranks wait in the broadcast while a pair measures: up to 2 (repeats + 1)
    # messages per size, each bounded by `timeout`. Bounding their wait by one message's
    # timeout made them give up on a healthy pair (and the group with it).
    per_message = group.config.timeout if timeout is None else timeout
    pair_bound = per_message * (2 * (repeats + 1) * len(sizes) + 1)
    results: list[LinkProfile] = []
    for a in range(n):
        for b in range(a + 1, n):
            times = np.zeros(len(sizes))
            if me in (a, b):
                other = b if me == a else a
                for i, m in enumerate(sizes):
                    buf = np.zeros(m, np.uint8)
                    samples = []
                    for _ in range(repeats + 1):
                        t0 = time.perf_counter()
                        if me == a:
                            await group.send(buf, other, timeout=timeout)
                            await group.recv(other, out=buf, timeout=timeout)
                        else:
                            await group.recv(other, out=buf, timeout=timeout)
                            await group.send(buf, other, timeout=timeout)
                        samples.append((time.perf_counter() - t0) / 2)
                    times[i] = float(np.median(samples[1:]))  # the first one warms up
            times = await group.broadcast(times, src=a, timeout=pair_bound)
            alpha, beta = fit_alpha_beta(np.array(sizes, float), times)
            results.append(LinkProfile(a, b, tuple(sizes), tuple(times.tolist()), alpha, beta))
            await group.barrier(timeout=timeout)
    return results
