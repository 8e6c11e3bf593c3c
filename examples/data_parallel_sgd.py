"""Data-parallel SGD on a linear model, one process per rank.

Every rank holds a different shard of a regression data set (y = X w* + noise), computes
the gradient on its shard, and averages the gradients with ``all_reduce(op="mean")``.
Because every rank starts from the same weights and applies the same averaged gradient,
the weights stay bitwise identical on all ranks; the script checks that at the end.

Run it with the launcher::

    p2pdist launch -n 4 -- python examples/data_parallel_sgd.py --steps 50

Options: ``--steps``, ``--lr``, ``--features``, ``--samples`` (per rank), ``--seed``,
``--no-allreduce`` (train each rank alone, to see the weights drift apart), and
``--save PATH`` (each rank writes its final weights to ``PATH.rank<R>.npy``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys

import numpy as np

from p2pdist import Group, P2PError


def make_shard(
    seed: int, rank: int, samples: int, features: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This rank's shard ``(X, y)`` and the true weights ``w*`` (shared by all ranks)."""
    w_star = np.random.default_rng([seed, 0]).standard_normal(features).astype(np.float32)
    rng = np.random.default_rng([seed, 1, rank])  # different data on every rank
    x = (rng.standard_normal((samples, features)) + rng.normal(0, 0.1, features)).astype(np.float32)
    noise = 0.1 * rng.standard_normal(samples)
    y = (x @ w_star + noise).astype(np.float32)
    return x, y, w_star


def gradient(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Gradient and value of the mean squared error ``0.5 * mean((X w - y)^2)``."""
    resid = x @ w - y
    return x.T @ resid / np.float32(len(y)), float(0.5 * np.mean(resid * resid))


async def train(args: argparse.Namespace) -> int:
    """Train; return 0 when the ranks end with identical, finite weights (or
    --no-allreduce), 1 otherwise (NaN weights are identical on every rank too)."""
    async with Group.from_env() as g:
        x, y, w_star = make_shard(args.seed, g.rank, args.samples, args.features)
        w = np.zeros(args.features, np.float32)
        lr = np.float32(args.lr)
        for step in range(1, args.steps + 1):
            grad, loss = gradient(w, x, y)
            if not args.no_allreduce:
                grad = await g.all_reduce(grad, op="mean")
                loss = float((await g.all_reduce(np.array([loss]), op="mean"))[0])
            w -= lr * grad
            if g.rank == 0 and (step % 10 == 0 or step == 1):
                print(f"step {step:4d}  loss {loss:.6f}")

        if args.save:
            np.save(f"{args.save}.rank{g.rank}.npy", w)
        everyone = await g.all_gather(w)  # shape (size, features)
        spread = float(np.max(np.abs(everyone - everyone[0])))
        identical = all(row.tobytes() == w.tobytes() for row in everyone)
        finite = bool(np.isfinite(everyone).all())
        if g.rank == 0:
            print(f"distance to w*: {np.linalg.norm(w - w_star):.4f}")
            print(f"max weight difference between ranks: {spread:g} (identical: {identical})")
            if not finite:
                print("training diverged (weights not finite): try a smaller --lr")
        return 0 if finite and (identical or args.no_allreduce) else 1


def main() -> int:
    """Parse the options and train."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--samples", type=int, default=256, help="samples per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-allreduce", action="store_true", help="train each rank alone")
    p.add_argument("--save", default=None, metavar="PATH", help="np.save weights per rank")
    args = p.parse_args()
    for flag in ("steps", "features", "samples"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a positive number, got {args.lr}")
    if args.save is not None and not os.path.isdir(os.path.dirname(args.save) or "."):
        p.error(f"--save {args.save}: no such directory")  # fail now, not after training
    try:
        return asyncio.run(train(args))
    except P2PError as exc:  # not started by the launcher, a relay that refused us, ...
        sys.exit(f"data_parallel_sgd: {exc}")


if __name__ == "__main__":
    sys.exit(main())
