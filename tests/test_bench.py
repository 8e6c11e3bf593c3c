"""The link profiler: the alpha-beta fit, in-process profiling and ``p2pdist bench``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
from group_helpers import groups

from p2pdist.group.profile import fit_alpha_beta


def test_fit_recovers_a_known_model() -> None:
    sizes = np.array([1 << k for k in range(0, 25, 2)], float)
    alpha, beta = 50e-6, 2e9
    noise = np.random.default_rng(0).normal(1, 0.02, sizes.size)
    a, b = fit_alpha_beta(sizes, (alpha + sizes / beta) * noise)
    assert abs(a - alpha) / alpha < 0.1
    assert abs(b - beta) / beta < 0.1


async def test_profile_links_covers_every_pair_and_agrees() -> None:
    async with groups(3) as gs:
        results = await asyncio.gather(*(g.profile_links(repeats=2) for g in gs))
        pairs = [(p.a, p.b) for p in results[0]]
        assert pairs == [(0, 1), (0, 2), (1, 2)]
        for other in results[1:]:
            assert [p.seconds for p in other] == [p.seconds for p in results[0]]
        for p in results[0]:
            assert all(t > 0 for t in p.seconds)
            assert p.alpha >= 0 and p.beta > 0


def test_bench_command_prints_the_model_and_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "links.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pdist.cli",
            "bench",
            "-n",
            "2",
            "--plaintext",
            "--repeats",
            "1",
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "alpha (us)" in proc.stdout and "0 - 1" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
