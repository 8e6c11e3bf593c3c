"""Link profiling: time each pair of ranks and fit the alpha-beta model
``t(m) = alpha + m / beta`` (latency plus bytes over bandwidth)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

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
        return [m / t if t > 0 else 0.0 for m, t in zip(self.sizes, self.seconds, strict=True)]


def fit_alpha_beta(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """Least-squares fit of ``t = alpha + m / beta``, weighted so that small messages
    (which decide alpha) count as much as large ones (which decide beta)."""
    weights = 1.0 / np.maximum(seconds, 1e-9)
    slope, alpha = np.polyfit(sizes, seconds, 1, w=weights)
    return max(float(alpha), 0.0), (1.0 / slope if slope > 0 else float("inf"))


async def profile_links(
    group: Group, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5
) -> list[LinkProfile]:
    """Ping-pong every pair of ranks in turn (collective: call on all ranks).

    Every rank returns the same list (rank 0's measurements are shared with all).
    """
    n, me = group.size, group.rank
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
                            await group.send(buf, other)
                            await group.recv(other, out=buf)
                        else:
                            await group.recv(other, out=buf)
                            await group.send(buf, other)
                        samples.append((time.perf_counter() - t0) / 2)
                    times[i] = float(np.median(samples[1:]))  # the first one warms up
            times = await group.broadcast(times, src=a)
            alpha, beta = fit_alpha_beta(np.array(sizes, float), times)
            results.append(LinkProfile(a, b, tuple(sizes), tuple(times.tolist()), alpha, beta))
            await group.barrier()
    return results
