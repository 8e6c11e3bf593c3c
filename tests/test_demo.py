"""End-to-end tests of ``p2pdist demo`` and the hello example, run as real subprocesses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180
CHECK = re.compile(r"^\[rank (\d+)\] \[check\] (.+?)\s+(ok|FAIL)\b")
SUMMARY = re.compile(r"^\[rank (\d+)\] \[summary\] .*: (\d+)/(\d+) checks ok here, all ok;")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` from the repository root and capture its output."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.parametrize("mode", [[], ["--plaintext"]], ids=["tls", "plaintext"])
def test_demo_all_checks_pass(mode: list[str]) -> None:
    proc = run("-m", "p2pdist.cli", "demo", "-n", "3", "--steps", "5", *mode)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    checks = [m.groups() for line in proc.stdout.splitlines() if (m := CHECK.match(line))]
    names = {name for _, name, _ in checks}
    assert all(status == "ok" for _, _, status in checks), report
    for expected in (
        "all_reduce sum float32[6,4] non-contiguous",
        "all_reduce sum float32[0] empty",
        "all_reduce sum float64[2] < world",
        "all_reduce sum float32[70001] ring",
        "reduce_scatter sum float32[10,5]",
        "all_gather float64[20000] ring",
        "broadcast src=1 float64[300000] chain",
        "barrier",
        "send/recv ring float32[3,5] (like=)",
        "sgd parameters bitwise identical",
        "sgd guard: local-only weights differ",
    ):
        assert expected in names, f"missing check {expected!r}:\n{report}"
    for op in ("sum", "mean", "max", "min", "prod"):
        assert f"all_reduce {op} float32[5,7]" in names, report
    assert len(checks) >= 40, report
    assert "max |w_rank - w_0| = 0 over 3 ranks (bitwise identical: yes)" in proc.stdout, report
    assert [step for step in re.findall(r"\[sgd\] step +(\d+)/5", proc.stdout)] == [
        str(s) for s in range(1, 6)
    ], report
    summaries = {m.group(1) for line in proc.stdout.splitlines() if (m := SUMMARY.match(line))}
    assert summaries == {"0", "1", "2"}, report
    assert "p2pdist demo: ok" in proc.stdout, report
    assert "Traceback" not in report, report


def test_demo_single_rank() -> None:
    proc = run("-m", "p2pdist.cli", "demo", "-n", "1", "--steps", "3", "--bench-mib", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    assert "(bitwise identical: yes)" in proc.stdout


def test_demo_fails_when_a_check_fails() -> None:
    # Rank 1 feeds a wrong input to the first all_reduce: every rank must notice.
    proc = run(
        "-m", "p2pdist.demo", "-n", "2", "--steps", "2", "--bench-mib", "1", "--corrupt-rank", "1"
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert re.search(
        r"^\[rank 0\] \[check\] all_reduce sum float32\[5,7\] +FAIL", proc.stdout, re.M
    )
    assert "FAILED across ranks" in proc.stdout
    assert "p2pdist demo: FAILED" in proc.stdout


def test_demo_rejects_bad_arguments() -> None:
    proc = run("-m", "p2pdist.cli", "demo", "-n", "0")
    assert proc.returncode == 2
    assert "-n" in proc.stderr
    assert "the number of ranks (-n) must be 1 to 1024 on one machine" in proc.stderr
    assert "got 0" in proc.stderr  # not just any error


def test_hello_example_under_launch() -> None:
    proc = run(
        "-m", "p2pdist.cli", "launch", "-n", "2", "--",
        sys.executable, "examples/allreduce_hello.py",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert len(lines) == 2, proc.stdout
    for rank, line in enumerate(lines):
        assert line.startswith(f"[rank {rank}] hello from rank {rank} ("), line
        assert line.endswith("of 2: all_reduce sum = [3. 3. 3. 3.]"), line
