"""The arithmetic of the benchmarks in benchmarks/ (no network, no worker processes but
one that exits at once): bandwidth, sizes, medians, and the checks of all-reduce results.

The benchmark scripts import each other as top-level modules (they run as
``python benchmarks/<script>``), so their folder goes on ``sys.path`` here.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _allreduce_worker as worker
import quic_throughput
import reduce_modes
from _procs import wait_for
from allreduce import (
    Point,
    Series,
    last_start_to_last_end,
    median_of_rounds,
    parse_size,
    slowest_rank_median,
)


def test_busbw_follows_the_nccl_tests_convention() -> None:
    # 2 MB in 1 ms: algbw 2 GB/s (1e9 B/s); busbw = algbw * 2(n-1)/n
    assert Point(2_000_000, 1e-3, 4).algbw == pytest.approx(2.0)
    assert Point(2_000_000, 1e-3, 4).busbw == pytest.approx(3.0)
    assert Point(2_000_000, 1e-3, 2).busbw == pytest.approx(2.0)
    assert Point(1 << 20, 0.5, 8).busbw == pytest.approx((1 << 20) / 0.5 / 1e9 * 14 / 8)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4096", 4096), ("4K", 4096), ("64kib", 65536), ("16M", 16 << 20), ("1G", 1 << 30)],
)
def test_parse_size_reads_binary_units(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "K", "4X", "0", "6", "-4K", "1.5M"])
def test_parse_size_refuses_what_is_not_a_positive_multiple_of_4(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def _series(seconds: float, cpu: float | None, barrier: float | None) -> Series:
    s = Series("plaintext", {4096: Point(4096, seconds, 2, cpu)})
    s.barrier = barrier
    return s


def test_median_of_rounds_odd_and_even() -> None:
    odd = median_of_rounds([_series(t, c, b) for t, c, b in [(3, 30, 1), (1, 10, 9), (2, 20, 5)]])
    assert (odd.points[4096].seconds, odd.points[4096].cpu, odd.barrier) == (2, 20, 5)
    even = median_of_rounds([_series(t, c, b) for t, c, b in [(1, 10, 2), (4, 40, 8)]])
    assert (even.points[4096].seconds, even.points[4096].cpu, even.barrier) == (2.5, 25, 5)
    assert even.points[4096].world == 2 and even.error is None


def test_median_of_rounds_without_cpu_or_with_a_failed_round() -> None:
    merged = median_of_rounds([_series(1, None, None), _series(3, 5, 1)])
    assert merged.points[4096].seconds == 2 and merged.points[4096].cpu is None
    assert merged.barrier is None
    failed = Series("plaintext", error="rank 1 exit 1")
    merged = median_of_rounds([_series(1, 1, 1), failed])
    assert merged.error == "rank 1 exit 1" and not merged.points


def test_a_calls_time_runs_from_the_last_start_to_the_last_end() -> None:
    # call 0: rank 0 in at 0 and out at 5, rank 1 in at 3 and out at 4: 5 - 3 = 2
    # call 1: rank 0 in at 10 and out at 11, rank 1 in at 10 and out at 16: 6
    # call 2: rank 0 in at 20 and out at 24, rank 1 in at 21 and out at 24: 3
    ranks = [
        {"starts": [0, 10, 20], "times": [5, 1, 4]},
        {"starts": [3, 10, 21], "times": [1, 6, 3]},
    ]
    assert last_start_to_last_end(ranks) == 3
    # each call's slowest rank: 5, 6, 4, median 5; the greater of the two ranks' medians
    # (4 and 3) says 4
    assert slowest_rank_median(ranks) == 5
    with pytest.raises(ValueError):  # every rank times every call
        slowest_rank_median([{"starts": [0, 1], "times": [1, 2]}, {"starts": [0], "times": [3]}])


def test_allreduce_exits_1_when_a_backend_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import allreduce

    def crash(*args: object, **kwargs: object) -> None:
        raise allreduce.LaunchError("rank 1 exited with status 1: simulated crash")

    monkeypatch.setattr(allreduce, "launch", crash)
    argv = ["--world", "2", "--sizes", "4K", "--iters", "1", "--warmup", "0"]
    argv += ["--modes", "plaintext", "--loop", "asyncio", "--no-tcp", "--no-gloo", "--no-mpi"]
    assert allreduce.main(argv) == 1
    out, err = capsys.readouterr()
    assert "note: plaintext world=2: failed (rank 1 exited" in out, out
    assert "FAILED: plaintext at world 2" in err, err


def test_an_unreadable_worker_result_fails_its_series_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import allreduce

    def short(*args: object, **kwargs: object) -> list[dict[str, object]]:
        good = {"starts": [0.0], "times": [1.0], "cpu": 0.5}
        return [{"results": [good]}, {"results": [{"times": [1.0]}]}]  # no starts

    monkeypatch.setattr(allreduce, "launch", short)
    series = allreduce.run_series("plaintext", "p2pdist", 2, [4096], [0], [1], tmp_path, 5, {})
    assert series.error is not None and "unreadable worker result" in series.error
    assert not series.points


def test_quic_median_run_odd_and_even() -> None:
    runs = [{"rate": 3.0, "cpu": 0.3}, {"rate": 1.0, "cpu": 0.1}, {"rate": 2.0, "cpu": 0.2}]
    assert quic_throughput.median_run(runs) == (2.0, {"rate": 2.0, "cpu": 0.2})
    runs = [{"rate": r, "cpu": r / 10} for r in (1.0, 2.0, 10.0, 4.0)]
    rate, nearest = quic_throughput.median_run(runs)
    assert rate == 3.0  # the mean of the middle two, not the upper one (4)
    assert nearest["rate"] in (2.0, 4.0)
    assert quic_throughput.median_run([{"rate": 7.0}]) == (7.0, {"rate": 7.0})


def test_allreduce_pattern_sums_are_exact_and_checked() -> None:
    base = worker.base_pattern(1000)
    for world in (1, 2, 3, 8):
        inputs = [base + np.float32(r + 1) for r in range(world)]
        expected = worker.expected_sum(base, world)
        assert expected.dtype == np.float32
        assert np.array_equal(np.sum(inputs, axis=0, dtype=np.float64), expected)
        worker.check(np.sum(inputs, axis=0), expected, 0.0, "sum")
        with pytest.raises(AssertionError, match="element 0 of 1000"):
            worker.check(np.roll(expected, -1), expected, 0.0, "chunks misplaced")
    # A ring chunk at the wrong place: chunk offsets are multiples of 2^k elements at the
    # benchmark's sizes, so the pattern's period must not divide them (16 did: a result
    # rolled by a whole chunk passed the check).
    n = 1 << 20
    expected = worker.expected_sum(worker.base_pattern(n), 4)
    for shift in (n // 4, n // 2, 1 << 18, 16, 1 << 10):
        with pytest.raises(AssertionError):
            worker.check(np.roll(expected, shift), expected, 0.0, f"rolled by {shift}")
    # the worst allowed relative error passes; garbage does not
    expected = worker.expected_sum(base, 4)
    worker.check(expected * np.float32(1.04), expected, 0.05, "int8")
    with pytest.raises(AssertionError, match="tolerance"):
        worker.check(np.roll(expected, 1), expected, 0.05, "int8")


def test_allreduce_tolerance_is_exact_unless_the_wire_cannot_carry_the_sum() -> None:
    assert worker.tolerance(4, {}) == 0.0
    assert worker.tolerance(4, {"mode": "deterministic"}) == 0.0
    assert worker.tolerance(4, {"wire_dtype": "float16"}) == 0.0
    assert worker.tolerance(8, {"wire_dtype": "bfloat16"}) == 0.0  # sums up to 132
    assert worker.tolerance(16, {"wire_dtype": "bfloat16"}) == worker.LOOSE  # up to 328
    assert worker.tolerance(2, {"wire_dtype": "int8"}) == worker.LOOSE


def test_reduce_modes_checks_each_mode_against_the_float64_sum() -> None:
    world, n = 3, 4096
    ref, fold = reduce_modes.reference(world, n)
    inputs = [reduce_modes._input(r, n) for r in range(world)]
    plain = (inputs[2] + inputs[0]) + inputs[1]  # float32, another order than rank order
    det = ref.astype(np.float32)
    assert reduce_modes.check("det", det, ref, fold) is None
    assert reduce_modes.check("det", plain, ref, fold) is not None  # last bits differ
    assert reduce_modes.check("plain", plain, ref, fold) is None
    assert reduce_modes.check("plain", plain + np.float32(1e-3), ref, fold) is not None
    half = ref.astype(np.float16).astype(np.float32)
    assert reduce_modes.check("f16", half, ref, fold) is None
    assert "not used" in str(reduce_modes.check("f16", plain, ref, fold))  # wire ignored
    assert "relative error" in str(reduce_modes.check("int8", inputs[0], ref, fold))


def _exit_3() -> None:
    raise SystemExit(3)


def test_wait_for_reports_a_dead_child_at_once() -> None:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_exit_3, name="sender")
    p.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="sender exited with status 3"):
        wait_for(q, [p], 60, "rate")
    assert time.monotonic() - t0 < 10
    p.join()


def test_reduce_modes_stops_waiting_when_any_rank_fails() -> None:
    import subprocess

    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], text=True)
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True)
    t0 = time.monotonic()
    try:
        with pytest.raises(SystemExit, match=r"rank 1 failed \(exit status 3\)"):
            reduce_modes._wait_all([slow, failing], 60)  # rank 0 still runs
        assert time.monotonic() - t0 < 10
    finally:
        slow.kill()
        slow.wait()


def test_the_relay_cpu_is_divided_by_what_the_senders_send() -> None:
    """A run of one message's size still sends two (the relay carries twice ``total``)."""
    assert quic_throughput.messages(1 << 20, 1 << 20) == 2
    assert quic_throughput.messages(64 << 20, 1 << 20) == 64


def test_cpu_seconds_are_finer_than_clock_ticks() -> None:
    import os

    from _procs import cpu_seconds

    start = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.003
    while time.process_time() < deadline:  # 3 ms of work: under one 10 ms tick
        pass
    used = cpu_seconds(os.getpid()) - start
    assert 0.0025 < used < 0.009, used  # clock ticks would say 0 or 0.01
