"""The link profiler: the alpha-beta fit, in-process profiling and ``p2pdist bench``."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from group_helpers import groups, slow_link

from p2pdist import UsageError
from p2pdist.bench import format_table, plot
from p2pdist.group.profile import LinkProfile, fit_alpha_beta, profile_links


def test_fit_recovers_a_known_model() -> None:
    sizes = np.array([1 << k for k in range(0, 25, 2)], float)
    alpha, beta = 50e-6, 2e9
    noise = np.random.default_rng(0).normal(1, 0.02, sizes.size)
    a, b = fit_alpha_beta(sizes, (alpha + sizes / beta) * noise)
    assert abs(a - alpha) / alpha < 0.1
    assert abs(b - beta) / beta < 0.1


def test_fit_takes_bandwidth_from_large_messages_and_latency_from_small_ones() -> None:
    # As on loopback: mid-size messages move at cache speed (2.3 GB/s), the largest at
    # 0.8 GB/s. One line weighted by relative error through every size let the many
    # small points decide beta: 1.83 GB/s, 2.3x what the largest message measured.
    sizes = np.array([1 << k for k in range(0, 25, 2)], float)
    seconds = 40e-6 + sizes / 2.3e9
    large = sizes >= 4 << 20
    seconds[large] = 40e-6 + sizes[large] / 0.8e9
    a, b = fit_alpha_beta(sizes, seconds)
    measured = sizes[-1] / seconds[-1]
    assert abs(b - measured) / measured < 0.1
    assert a == pytest.approx(40e-6, rel=0.1)


@pytest.mark.parametrize(("index", "factor"), [(-1, 2.0), (-1, 0.5), (-2, 3.0)])
def test_one_slow_or_fast_large_message_does_not_set_the_bandwidth(
    index: int, factor: float
) -> None:
    """A least-squares line through the larger sizes was the largest one's alone: one
    run of it twice as slow halved beta (0.79 GB/s for 1.6)."""
    sizes = np.array([1 << k for k in range(0, 25, 2)], float)
    seconds = 200e-6 + sizes / 1.6e9
    seconds[index] *= factor
    a, b = fit_alpha_beta(sizes, seconds)
    assert b == pytest.approx(1.6e9, rel=0.05) and a == pytest.approx(200e-6, rel=0.05)


def test_fit_and_profile_refuse_what_cannot_be_fitted() -> None:
    with pytest.raises(UsageError, match="two different sizes"):
        fit_alpha_beta(np.array([1024.0, 1024.0]), np.array([1e-5, 1e-5]))
    a, b = fit_alpha_beta(np.array([1.0, 2.0]), np.array([1e-5, 1e-5]))  # flat: no cost/byte
    assert a == pytest.approx(1e-5) and b == float("inf")
    # repeated sizes: one point per size (a half of repeats of one size fitted no slope)
    for sizes in ([8, 1 << 20, 1 << 20], [8, 8, 1 << 20, 1 << 20]):
        m = np.array(sizes, float)
        a, b = fit_alpha_beta(m, 2e-5 + m / 1e9)
        assert b == pytest.approx(1e9, rel=1e-6) and a == pytest.approx(2e-5, rel=1e-3)


def test_noise_in_few_large_sizes_does_not_make_the_bandwidth_infinite() -> None:
    """Sizes given by the caller, three of them: the larger half's one slope came out
    negative (2 MiB timed faster than 1 MiB) and the fit said beta = inf, a model that
    put 2 MiB at 60 us against the 650 measured. The slopes between all the sizes give
    it then; times that are flat everywhere still mean no cost per byte."""
    sizes = np.array([1024.0, 1 << 20, 2 << 20])
    a, b = fit_alpha_beta(sizes, np.array([60e-6, 700e-6, 650e-6]))
    assert 1e9 < b < 1e10 and a == pytest.approx(60e-6, rel=0.1)
    assert fit_alpha_beta(np.array([1 << 20, 4 << 20]), np.array([600e-6, 590e-6]))[1] > 1e9
    assert fit_alpha_beta(sizes, np.array([5e-5, 5e-5, 5e-5]))[1] == float("inf")


def test_sizes_may_be_numpy_integers_and_not_bools() -> None:
    from p2pdist.group.profile import profile_links as fn

    async def refused(sizes: tuple[object, ...]) -> str:
        with pytest.raises(UsageError, match="sizes") as info:
            await fn(None, sizes=sizes)  # type: ignore[arg-type]
        return str(info.value)

    assert asyncio.run(refused((True, 1024)))
    assert asyncio.run(refused((np.int64(4), 4.0)))


async def test_profile_links_takes_numpy_sizes() -> None:
    async with groups(2) as gs:
        sizes = (np.int64(16), np.int64(1024))
        results = await asyncio.gather(*(profile_links(g, sizes=sizes, repeats=1) for g in gs))
    assert all(r[0].sizes == (16, 1024) and type(r[0].sizes[0]) is int for r in results)


def test_the_plot_leaves_the_callers_matplotlib_alone(tmp_path: Path) -> None:
    """It switched the process to the Agg backend (a notebook's inline plots broke)
    and left a pyplot figure open each time the save failed."""
    import matplotlib
    import matplotlib.pyplot as plt

    sizes, seconds = (1 << 10, 1 << 20), (1e-5, 1e-3)
    profiles = [LinkProfile(0, 1, sizes, seconds, *fit_alpha_beta(np.array(sizes), seconds))]
    backend = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        with pytest.raises(OSError):
            plot(profiles, tmp_path / "missing" / "links.png")
        plot(profiles, tmp_path / "links.png")
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == []
    finally:
        matplotlib.use(backend)


def test_a_plot_that_cannot_be_written_is_one_line_and_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A write that fails after the measurement (a full disk, /proc as root: what
    unwritable() cannot foresee) printed a traceback; it is one line, the table kept."""
    from p2pdist import bench

    def full(profiles: object, path: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "plot", full)
    sizes, seconds = (1 << 10, 1 << 20), (1e-5, 1e-3)
    profiles = [LinkProfile(0, 1, sizes, seconds, *fit_alpha_beta(np.array(sizes), seconds))]
    assert bench.report(profiles, "links.png") == 1
    out, err = capsys.readouterr()
    assert "0 - 1" in out
    assert err.strip().splitlines() == [
        "p2pdist bench: error: cannot write links.png: [Errno 28] No space left on device"
    ]
    assert bench.report(profiles, "") == 0


@pytest.mark.parametrize(
    "kwargs", [{"repeats": 0}, {"repeats": -1}, {"repeats": True}, {"sizes": (4096,)}]
)
async def test_profile_links_refuses_bad_arguments(kwargs: dict[str, object]) -> None:
    async with groups(2) as gs:
        for g in gs:
            with pytest.raises(UsageError):
                await profile_links(g, **kwargs)  # type: ignore[arg-type]


async def test_profile_links_covers_every_pair_and_agrees() -> None:
    async with groups(3) as gs:
        # (a numpy integer is a count, as in sizes)
        results = await asyncio.gather(*(g.profile_links(repeats=np.int64(2)) for g in gs))
        pairs = [(p.a, p.b) for p in results[0]]
        assert pairs == [(0, 1), (0, 2), (1, 2)]
        for other in results[1:]:
            assert [p.seconds for p in other] == [p.seconds for p in results[0]]
        for p in results[0]:
            assert all(t > 0 for t in p.seconds)
            # real timings: 16 MiB takes longer than 1 byte, and the fit has a finite cost
            # per byte that puts the largest message's time within a factor 10 of it
            assert p.sizes[0] == 1 and p.sizes[-1] == 16 << 20
            assert p.seconds[-1] > 10 * p.seconds[0], p.seconds
            assert p.alpha >= 0 and 0 < p.beta < math.inf, p
            predicted = p.alpha + p.sizes[-1] / p.beta
            assert p.seconds[-1] / 10 < predicted < 10 * p.seconds[-1], (predicted, p)


async def test_profile_links_bystanders_wait_out_a_pair_slower_than_one_timeout() -> None:
    """``timeout`` bounds each message: the rank outside a pair waits for the pair's
    whole measurement, which takes far longer than one message (it used to time out
    after one message's bound, blame the pair and break the group)."""
    async with groups(3, timeout=30) as gs:
        # Every message far below the bound (an 8 ms link delay against 1 s, which a
        # loaded machine's stall does not reach), every pair's measurement above it:
        # 2 x 2 x 41 messages, over 1.3 s.
        sizes, repeats, bound = (1, 2), 40, 1.0
        start = time.perf_counter()
        with contextlib.ExitStack() as slow:
            for g in gs:
                for peer in range(3):
                    if peer != g.rank:
                        slow.enter_context(slow_link(g, peer, 0.008))
            results = await asyncio.gather(
                *(profile_links(g, sizes, repeats, timeout=bound) for g in gs)
            )
        assert time.perf_counter() - start > 3 * bound  # each pair took longer than `bound`
        assert [(p.a, p.b) for p in results[2]] == [(0, 1), (0, 2), (1, 2)]
        total = await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in gs))
        np.testing.assert_array_equal(total[0], [3.0, 3.0])


async def test_profile_links_leaves_the_callers_messages_alone() -> None:
    """A message rank 0 sent before profiling, not yet received by rank 1, is still the
    one rank 1's next recv returns (the profiler used to take it as its own ping, and
    fail with a MismatchError on one rank and a timeout on the other)."""
    async with groups(2, timeout=10) as gs:
        mine = np.arange(3, dtype=np.float32)
        await gs[0].send(mine, 1)
        await asyncio.gather(*(g.profile_links(repeats=1, timeout=5) for g in gs))
        np.testing.assert_array_equal(await gs[1].recv(0, timeout=5), mine)
        got = await asyncio.gather(gs[1].send(mine * 2, 0), gs[0].recv(1, timeout=5))
        np.testing.assert_array_equal(got[1], mine * 2)


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


def test_bench_asks_for_matplotlib_before_measuring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from p2pdist import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    launched: list[object] = []
    monkeypatch.setattr(bench, "launch", lambda cfg: launched.append(cfg) or 0)
    with pytest.raises(SystemExit) as info:  # an explicit plot: refused before any rank runs
        bench.main(["--png", "links.png"])
    assert info.value.code == 2 and not launched
    assert "plot extra" in capsys.readouterr().err
    assert bench.main([]) == 0  # the default plot is skipped, with a note
    assert "no plot" in capsys.readouterr().err
    (cfg,) = launched
    assert cfg.command[cfg.command.index("--png") + 1] == ""  # type: ignore[attr-defined]


def test_table_and_plot_take_the_largest_size_and_survive_zero_times(tmp_path: Path) -> None:
    """The table's last column is the largest size measured, whatever order the sizes
    came in (it showed the last one given); a link timed at 0 s (fit: alpha 0, beta
    inf) plots instead of dividing by zero."""
    sizes, seconds = (1 << 20, 1), (1e-3, 1e-5)
    alpha, beta = fit_alpha_beta(np.array(sizes, float), np.array(seconds))
    table = format_table([LinkProfile(0, 1, sizes, seconds, alpha, beta)])
    assert "1 MiB one-way" in table
    assert table.splitlines()[1].split()[-1] == f"{(1 << 20) / 1e-3 / 1e9:.2f}"
    zero = fit_alpha_beta(np.array(sizes, float), np.zeros(2))
    assert zero == (0.0, float("inf"))
    plot([LinkProfile(0, 1, sizes, (0.0, 0.0), *zero)], tmp_path / "links.png")
    assert (tmp_path / "links.png").stat().st_size > 0


@pytest.mark.parametrize("name", ["links.txt", "links"])
def test_the_plot_is_a_png_at_exactly_the_path_given(tmp_path: Path, name: str) -> None:
    """matplotlib picks the format from the name: "links.txt" raised (after the whole
    measurement) and "links" was written as "links.png" while the path given was
    reported. The plot is a PNG at the path given, whatever the name ends in."""
    sizes, seconds = (1 << 10, 1 << 20), (1e-5, 1e-3)
    fit = fit_alpha_beta(np.array(sizes, float), np.array(seconds))
    plot([LinkProfile(0, 1, sizes, seconds, *fit)], tmp_path / name)
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_bench_from_env_profiles_a_group_whose_ranks_were_started_apart(tmp_path: Path) -> None:
    """As on a fleet: each rank started on its own with P2PDIST_* set, rank 0 reports."""
    import os

    from group_helpers import loopback_peers, run_ranks

    png = tmp_path / "fleet.png"
    base = {
        **os.environ,
        "P2PDIST_SEED": "bench-from-env-seed-0123456789",
        "P2PDIST_WORLD": "2",
        "P2PDIST_PEERS": ",".join(loopback_peers(2)),
        "P2PDIST_TLS": "0",
    }
    base.pop("P2PDIST_RELAY", None)
    cmd = [sys.executable, "-m", "p2pdist.cli", "bench", "--from-env", "--repeats", "1"]
    outs = run_ranks([*cmd, "--png", str(png)], base, 2, timeout=120)
    assert "alpha (us)" in outs[0][0] and "0 - 1" in outs[0][0]
    assert outs[1][0] == ""  # only rank 0 reports
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_from_env_refuses_what_the_environment_decides() -> None:
    from p2pdist.bench import main

    for extra in (["--plaintext"], ["-n", "3"]):
        with pytest.raises(SystemExit) as info:
            main(["--from-env", *extra])
        assert info.value.code == 2


def test_bench_from_env_without_the_environment_is_a_usage_error() -> None:
    """It printed ``[error] UsageError: ...`` and exit 1, unlike every other usage error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PDIST_")}
    cmd = [sys.executable, "-m", "p2pdist.cli", "bench", "--from-env", "--png", ""]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "p2pdist bench: error: " in proc.stderr and "P2PDIST_RANK" in proc.stderr
    assert "[error]" not in proc.stderr and "Traceback" not in proc.stderr


def test_bench_from_env_refuses_a_group_of_one(tmp_path: Path) -> None:
    """P2PDIST_WORLD=1 printed a table without rows, wrote an empty plot and exited 0,
    where ``-n 1`` is refused: a group of one has no links."""
    from group_helpers import loopback_peers

    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PDIST_")}
    env |= {
        "P2PDIST_SEED": "bench-from-env-seed-0123456789",
        "P2PDIST_RANK": "0",
        "P2PDIST_WORLD": "1",
        "P2PDIST_PEERS": loopback_peers(1)[0],
    }
    png = tmp_path / "one.png"
    cmd = [sys.executable, "-m", "p2pdist.cli", "bench", "--from-env", "--png", str(png)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "a group of one rank has no links to profile" in proc.stderr
    assert not png.exists()


async def test_profile_links_measures_sizes_in_increasing_order() -> None:
    """Sizes given out of order were kept so, and the plot joined them in that order
    (a zigzag; the fit sorted them): an audit. They are measured sorted, each once."""
    async with groups(2, timeout=10) as gs:
        results = await asyncio.gather(
            *(profile_links(g, (4096, 1, 64, 4096), 1, timeout=5) for g in gs)
        )
    assert results[0][0].sizes == (1, 64, 4096)
