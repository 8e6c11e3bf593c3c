"""The data and the model of the federated example: scikit-learn's bundled digits
(1797 8x8 images, no download), split non-IID across clients, and multinomial logistic
regression (softmax) in plain numpy. The model is one float32 vector of 650 parameters
(a 64x10 weight matrix and 10 biases)."""

from __future__ import annotations

import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FEATURES, CLASSES = 64, 10
PARAMS = FEATURES * CLASSES + CLASSES


@dataclass(frozen=True)
class Split:
    """Features scaled to [0, 1] and integer labels."""

    x: np.ndarray
    y: np.ndarray


def load_digits() -> tuple[Split, Split]:
    """(train, test): a fixed, stratified 75/25 split of the digits data set.

    The CSV that ships inside the scikit-learn wheel is read directly, which avoids
    importing scikit-learn (a second per process on a small machine)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the example needs scikit-learn: pip install -e '.[examples]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
    with gzip.open(path) as fh:
        raw = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    x, y = raw[:, :FEATURES] / 16.0, raw[:, FEATURES].astype(np.int64)
    rng = np.random.default_rng(12345)
    train_idx, test_idx = [], []
    for c in range(CLASSES):
        idx = rng.permutation(np.flatnonzero(y == c))
        cut = round(0.75 * len(idx))
        train_idx.append(idx[:cut])
        test_idx.append(idx[cut:])
    tr, te = np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))
    return Split(x[tr], y[tr]), Split(x[te], y[te])


MIN_SHARD = 10
"""Fewest samples a client's shard may hold."""
SHARD_DRAWS = 1000
"""Dirichlet draws :func:`non_iid_shards` tries before it gives up."""


def non_iid_shards(
    y: np.ndarray, clients: int, alpha: float = 0.3, seed: int = 0
) -> list[np.ndarray]:
    """Indices of each client's samples: for every class, a Dirichlet(``alpha``) share
    per client (small alpha: each client sees mostly a few digits). Every client gets
    at least 10 samples (:class:`ValueError` when that cannot be drawn: ``alpha`` not
    positive, more than one client per 10 samples, or no luck in 1000 draws)."""
    if not alpha > 0:  # also NaN
        raise ValueError(f"alpha must be positive, got {alpha}")
    if clients < 1 or clients * MIN_SHARD > len(y):
        raise ValueError(
            f"{len(y)} samples cannot give {clients} clients {MIN_SHARD} each "
            f"(at most {len(y) // MIN_SHARD} clients)"
        )
    rng = np.random.default_rng([seed, clients])
    for _ in range(SHARD_DRAWS):
        parts: list[list[np.ndarray]] = [[] for _ in range(clients)]
        for c in range(CLASSES):
            idx = rng.permutation(np.flatnonzero(y == c))
            share = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(share)[:-1] * len(idx)).astype(int)
            for i, piece in enumerate(np.split(idx, cuts)):
                parts[i].append(piece)
        shards = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(s) for s in shards) >= MIN_SHARD:
            return shards
    raise ValueError(
        f"no split of {len(y)} samples over {clients} clients with alpha {alpha} gave every "
        f"client {MIN_SHARD} samples in {SHARD_DRAWS} draws: use a larger alpha or fewer clients"
    )


def init_model(seed: int = 0) -> np.ndarray:
    """Small random initial parameters (the same for every run with ``seed``)."""
    return (np.random.default_rng(seed).standard_normal(PARAMS) * 0.01).astype(np.float32)


def _unpack(params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return params[: FEATURES * CLASSES].reshape(FEATURES, CLASSES), params[FEATURES * CLASSES :]


def _probs(params: np.ndarray, x: np.ndarray) -> np.ndarray:
    w, b = _unpack(params)
    z = x @ w + b
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    out: np.ndarray = e / e.sum(axis=1, keepdims=True)
    return out


def evaluate(params: np.ndarray, data: Split) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``params`` on ``data``."""
    p = _probs(params, data.x)
    loss = float(-np.mean(np.log(p[np.arange(len(data.y)), data.y] + 1e-12)))
    return loss, float(np.mean(p.argmax(axis=1) == data.y))


def sgd(
    params: np.ndarray,
    data: Split,
    *,
    epochs: int,
    lr: float = 0.5,
    batch: int = 32,
    l2: float = 1e-4,
    seed: int = 0,
) -> np.ndarray:
    """Minibatch SGD on the cross-entropy; returns new parameters (float32)."""
    p = params.astype(np.float64)
    rng = np.random.default_rng(seed)
    n = len(data.y)
    onehot = np.eye(CLASSES)[data.y]
    for _ in range(epochs):
        order = rng.permutation(n)
        for a in range(0, n, batch):
            idx = order[a : a + batch]
            xb, yb = data.x[idx].astype(np.float64), onehot[idx]
            err = (_probs(p, xb) - yb) / len(idx)
            w, _ = _unpack(p)
            grad = np.concatenate([(xb.T @ err + l2 * w).reshape(-1), err.sum(axis=0)])
            p -= lr * grad
    return p.astype(np.float32)


def centralised_accuracy(train: Split, test: Split, epochs: int, seed: int = 0) -> float:
    """Test accuracy of the same model trained on all the training data at once."""
    params = sgd(init_model(seed), train, epochs=epochs, seed=seed)
    return evaluate(params, test)[1]
