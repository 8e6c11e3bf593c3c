"""Data-parallel agreement across real processes.

Ranks train ``examples/data_parallel_sgd.py`` on different shards and each saves its final
weights with ``np.save``; the test compares the bytes. The guard runs the same training
without the gradient all-reduce and shows the weights then differ, so the agreement test
cannot pass by accident (e.g. if every rank had the same data).
"""

from __future__ import annotations

import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "data_parallel_sgd.py"
TIMEOUT_S = 180
WORLD = 3


def train(tmp_path: Path, *options: str, world: int = WORLD) -> list[np.ndarray]:
    """Launch ``world`` ranks of the example; return each rank's saved weights."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    prefix = tmp_path / "w"
    proc = subprocess.run(
        [
            sys.executable, "-m", "p2pdist.cli", "launch", "-n", str(world), "--",
            sys.executable, str(SCRIPT), "--save", str(prefix), *options,
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    weights = [np.load(f"{prefix}.rank{r}.npy") for r in range(world)]
    for w in weights:
        assert w.dtype == np.float32
        assert np.all(np.isfinite(w))
    return weights


def raw(w: np.ndarray) -> bytes:
    """The exact bytes of an array (dtype and shape included)."""
    return w.dtype.str.encode() + repr(w.shape).encode() + w.tobytes()


# 16 features keeps the gradient under GroupConfig.small_bytes (direct all-reduce);
# 32768 float32 features (128 KiB) take the chunked ring path.
SETTINGS = {
    "direct": ["--steps", "20"],
    "ring": ["--steps", "8", "--features", "32768", "--samples", "64", "--lr", "0.0005"],
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_ranks_end_bitwise_identical(tmp_path: Path, setting: str) -> None:
    weights = train(tmp_path, *SETTINGS[setting])
    assert len({raw(w) for w in weights}) == 1
    assert np.any(weights[0] != 0)  # it trained


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_guard_without_allreduce_ranks_disagree(tmp_path: Path, setting: str) -> None:
    weights = train(tmp_path, *SETTINGS[setting], "--no-allreduce")
    for a, b in combinations(weights, 2):
        assert raw(a) != raw(b)
        assert not np.allclose(a, b, rtol=0, atol=1e-6)


def test_single_rank_matches_local_training(tmp_path: Path) -> None:
    # A size-1 group's all_reduce is the identity: the same bits as training alone.
    (reduced,) = train(tmp_path / "a", "--steps", "10", world=1)
    (alone,) = train(tmp_path / "b", "--steps", "10", "--no-allreduce", world=1)
    assert raw(reduced) == raw(alone)


def test_diverged_training_fails_although_the_ranks_agree(tmp_path: Path) -> None:
    """NaN weights are bitwise identical on every rank, so agreement alone used to report
    success; a --save folder that does not exist is refused before training."""
    proc = subprocess.run(
        [
            sys.executable, "-m", "p2pdist.cli", "launch", "-n", "2", "--",
            sys.executable, str(SCRIPT), "--steps", "30", "--lr", "50",
        ],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "training diverged" in proc.stdout
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--save", str(tmp_path / "missing" / "w")],
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode == 2 and "no such directory" in bad.stderr
