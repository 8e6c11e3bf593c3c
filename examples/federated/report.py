"""The per-round table with a progress bar, and the accuracy plot."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from p2pdist.federated import RoundOutcome

HEADER = (
    f"{'round':>5} {'members':>7} {'particip':>8} {'stale':>5} {'dropped':>7} "
    f"{'rejected':>8} {'closed by':>9} {'loss':>7} {'accuracy':>8}  progress"
)


@dataclass(frozen=True)
class Row:
    """One round's line of the table."""

    round: int
    members: int
    participants: int
    stale: int
    dropped: int
    rejected: int
    reason: str
    loss: float
    accuracy: float

    @classmethod
    def of(cls, outcome: RoundOutcome, loss: float, accuracy: float) -> Row:
        """The row for ``outcome`` with the model's test ``loss`` and ``accuracy``."""
        return cls(
            outcome.round,
            outcome.members,
            len(outcome.participants) if outcome.applied else 0,
            outcome.stale if outcome.applied else 0,
            outcome.num_dropped,
            outcome.num_rejected,
            str(outcome.reason),
            loss,
            accuracy,
        )


def bar(done: int, total: int, width: int = 20) -> str:
    """``[#######.............]  7/20``."""
    filled = round(width * done / max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done:>3}/{total}"


class Table:
    """Prints the header once and one line per round, ending in the progress bar."""

    def __init__(self, total: int, out: TextIO = sys.stdout) -> None:
        self.total = total
        self.out = out
        self.rows: list[Row] = []
        print(HEADER, file=out, flush=True)

    def add(self, row: Row) -> None:
        """Print ``row`` and remember it."""
        self.rows.append(row)
        print(
            f"{row.round:>5} {row.members:>7} {row.participants:>8} {row.stale:>5} "
            f"{row.dropped:>7} {row.rejected:>8} {row.reason:>9} {row.loss:>7.4f} "
            f"{row.accuracy:>8.2%}  {bar(len(self.rows), self.total)}",
            file=self.out,
            flush=True,
        )


def plot(rows: list[Row], centralised: float | None, path: Path, title: str) -> None:
    """Accuracy per round (and the centralised baseline) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r.round for r in rows], [100 * r.accuracy for r in rows], marker=".", label="federated"
    )
    if centralised is not None:
        ax.axhline(100 * centralised, color="gray", linestyle="--", label="centralised")
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
