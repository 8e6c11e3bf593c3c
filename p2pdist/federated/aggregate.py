"""Pure functions: update validation and the aggregation rules (no I/O, no clocks).

Every rule gives the same bits for the same inputs in the same order on any machine:
accumulation is elementwise in float64, in the order given, with no reduction whose
association numpy may choose, and the result is rounded once to the model's dtype.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import UsageError
from ..group.buffers import wire_form
from ..settings import INT_MAX, as_int
from ..wire.arrays import MAX_NDIM
from .config import FederatedConfig

__all__ = [
    "Reason",
    "aggregate",
    "apply_update",
    "check_model",
    "check_update",
    "trim_count",
]

log = logging.getLogger(__name__)


class Reason(enum.StrEnum):
    """Why an update did not count. The first five are *rejections* (bad content); the
    others are *drops* (the update came at the wrong time or was replaced)."""

    DTYPE = "dtype"
    """The update's dtype differs from the model's."""
    SHAPE = "shape"
    """The update's shape differs from the model's."""
    NONFINITE = "nonfinite"
    """The update holds NaN or Inf."""
    NORM = "norm"
    """The update's L2 norm exceeds ``max_norm``."""
    SAMPLES = "samples"
    """``num_samples`` is not an int in [1, max_num_samples] (at most 2**63 - 1)."""
    TOO_STALE = "too_stale"
    """``round - base_round`` exceeds ``max_staleness`` (or ``base_round`` is ahead)."""
    FUTURE = "future_round"
    """Submitted for a round that has not opened yet."""
    DUPLICATE = "duplicate"
    """A second update from the same client for the same round and base, or one from a
    base round at or before that of the client's update already aggregated (a resend)."""
    SUPERSEDED = "superseded"
    """Replaced by a newer update (a later ``base_round``) from the same client."""

    @property
    def is_rejection(self) -> bool:
        """True for validation failures (counted as *rejected*, not *dropped*)."""
        return self in _REJECTIONS


_REJECTIONS = frozenset({Reason.DTYPE, Reason.SHAPE, Reason.NONFINITE, Reason.NORM, Reason.SAMPLES})


def check_update(
    update: np.ndarray,
    num_samples: Any,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    config: FederatedConfig,
) -> tuple[Reason, str] | None:
    """None when ``update`` may be aggregated, else ``(reason, explanation)``."""
    count, top = as_int(num_samples), min(config.max_num_samples or INT_MAX, INT_MAX)
    if count is None or count < 1 or count > top:
        bounds = f"[1, {top}]"
        return Reason.SAMPLES, f"num_samples {num_samples!r} is not an int {bounds}"
    if update.dtype != dtype:
        return Reason.DTYPE, f"dtype {update.dtype} where the model has {dtype}"
    if update.shape != shape:
        return Reason.SHAPE, f"shape {list(update.shape)} where the model has {list(shape)}"
    if update.dtype.kind in "fc" and not bool(np.isfinite(update).all()):
        return Reason.NONFINITE, "holds NaN or Inf"
    if config.max_norm is not None:
        norm = float(np.linalg.norm(update.reshape(-1).astype(np.float64)))
        if norm > config.max_norm:
            return Reason.NORM, f"L2 norm {norm:.4g} exceeds max_norm {config.max_norm:g}"
    return None


def check_model(model: np.ndarray) -> np.ndarray:
    """``model`` as a C-ordered copy, after checking it is a real numeric array: the norm
    bound, the mean and the robust rules work on real values (a complex model would lose
    its imaginary parts there; train on real and imaginary parts as two arrays)."""
    arr = np.array(model, copy=True, order="C")
    if arr.dtype.kind == "u":
        # An update is a delta in the model's dtype: a weight that goes down would wrap
        # around to a huge one (uint8 100 -> 99 sends 255), silently.
        raise UsageError(
            f"a federated model cannot be unsigned ({arr.dtype}): updates are deltas, "
            "which may be negative; use a signed integer or a float dtype"
        )
    if arr.dtype.kind not in "fi":
        raise UsageError(
            f"a federated model must be a real numeric array, got {arr.dtype}"
            + (
                " (pass the real and imaginary parts as real arrays)"
                if arr.dtype.kind == "c"
                else ""
            )
        )
    # As it travels: a dtype that cannot (float128) is refused now, not at each client's
    # join, and a big-endian model is kept little-endian, the dtype the updates come in.
    wire = wire_form(arr.dtype)
    if arr.ndim > MAX_NDIM:  # no model message could carry it
        raise UsageError(f"a federated model has at most {MAX_NDIM} dimensions, got {arr.ndim}")
    return arr if arr.dtype == wire else arr.astype(wire)


def check_fits(model: np.ndarray, max_payload: int) -> None:
    """Refuse a model whose updates could not travel: each goes in one frame, and a
    frame larger than ``max_payload`` is dropped by the sending connection."""
    if model.nbytes > max_payload:
        raise UsageError(
            f"the model has {model.nbytes} bytes, more than one frame carries "
            f"(transport limits.max_payload, {max_payload} bytes): its updates could not "
            "be sent; raise the limit on every process, or split the model"
        )


def trim_count(n: int, fraction: float) -> int:
    """Values cut from each end of a coordinate by the trimmed mean of ``n`` values."""
    k = math.floor(fraction * n + 1e-9)
    return k if n - 2 * k >= 1 else (n - 1) // 2


def aggregate(
    updates: Sequence[np.ndarray],
    weights: Sequence[float],
    rule: str,
    trim_fraction: float,
    dtype: np.dtype[Any],
) -> np.ndarray:
    """Combine ``updates`` (same shape) by ``rule``; the result has ``dtype``.

    ``"mean"``: ``sum(w_i * x_i) / sum(w_i)``, summed in the order given. Weights above
    :data:`_UNSCALED_WEIGHT` (never those of :class:`FederatedRounds`, whose sample counts
    stop at 2**63 - 1 and discounts at 1), or all below 1 (stale updates discounted to the
    floor), are first all scaled by one power of two, which brings the largest to
    [0.5, 1): the sums cannot overflow, and tiny weights keep full precision.
    ``"median"``: coordinate-wise median (weights ignored).
    ``"trimmed_mean"``: per coordinate, sort, cut :func:`trim_count` values from each end,
    average the rest (weights ignored).
    """
    if not updates:
        raise UsageError("aggregate needs at least one update")
    if len(weights) != len(updates):
        raise UsageError("one weight per update")
    shape = updates[0].shape
    if rule == "mean":
        ws = [float(w) for w in weights]
        if not all(w >= 0 and math.isfinite(w) for w in ws) or not max(ws) > 0:
            raise UsageError(f"weights must be finite, >= 0 and not all 0, got {ws[:8]}")
        top = max(ws)
        # Scaled by a power of two (exact: every rank gets the same bits) when the weights
        # are huge, so the sums cannot overflow, or below 1, so that weights as small as
        # the discount floor do not take x * w into float64's subnormals.
        shift = -math.frexp(top)[1] if top > _UNSCALED_WEIGHT or top < 1.0 else 0
        scaled = [math.ldexp(w, shift) for w in ws]
        acc = np.zeros(shape, np.float64)
        total = 0.0
        with np.errstate(over="ignore", invalid="ignore"):  # (redone below if so)
            for x, w in zip(updates, scaled, strict=True):
                acc += np.multiply(x, w, dtype=np.float64)
                total += w
        acc /= total
        if not np.isfinite(acc).all():
            acc = _mean_near_the_limit(updates, [w / total for w in scaled], shape, acc)
        return _rounded(acc, dtype)
    stacked = np.stack([np.asarray(x, np.float64).reshape(-1) for x in updates])
    stacked.sort(axis=0)
    n = len(updates)
    if rule == "median":
        mid = n // 2
        if n % 2:  # (_rounded makes a new array: a view would keep the stack alive)
            return _rounded(stacked[mid].reshape(shape), dtype)
        low, high = stacked[mid - 1], stacked[mid]
        with np.errstate(over="ignore"):
            out = (low + high) * 0.5
        # Two values near float64's limit: their sum overflows, each half does not.
        past = np.isinf(out) & np.isfinite(low) & np.isfinite(high)
        out[past] = low[past] * 0.5 + high[past] * 0.5
        return _rounded(out.reshape(shape), dtype)
    if rule == "trimmed_mean":
        k = trim_count(n, trim_fraction)
        kept = stacked[k : n - k]
        acc = np.array(kept[0], copy=True)
        with np.errstate(over="ignore", invalid="ignore"):
            for row in kept[1:]:
                acc += row
        acc /= float(len(kept))
        if not np.isfinite(acc).all():
            share = 1.0 / len(kept)
            acc = _mean_near_the_limit(list(kept), [share] * len(kept), acc.shape, acc)
        return _rounded(acc.reshape(shape), dtype)
    raise UsageError(f"unknown aggregation rule {rule!r}")


def _mean_near_the_limit(
    updates: Sequence[np.ndarray],
    shares: list[float],
    shape: tuple[int, ...],
    first: np.ndarray,
) -> np.ndarray:
    """A mean whose plain sum left float64's range (finite values near 1.8e308 summed),
    again where it did: each update times its share of the total weight (at most 1),
    summed in the same order, so no partial sum exceeds the largest update. ``first``
    (the plain result) is kept where it is finite, and where an update was not finite."""
    again = np.zeros(shape, np.float64)
    for x, share in zip(updates, shares, strict=True):
        again += np.multiply(np.reshape(x, shape), share, dtype=np.float64)
    redo = ~np.isfinite(first) & np.isfinite(again)
    first[redo] = again[redo]
    return first


_UNSCALED_WEIGHT = 2.0**64
"""Weights up to this go into the weighted mean as they are (the formula's bits)."""


def _range(dtype: np.dtype[Any]) -> tuple[float, float] | None:
    """The float64 bounds a model of ``dtype`` holds (None: not an int or float dtype).
    For an integer dtype the largest float64 within its range (2^63 is one past int64's)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        top = float(info.max)
        if top > info.max:
            top = float(np.nextafter(top, 0.0))
        return float(info.min), top
    if dtype.kind == "f":
        big = float(np.finfo(dtype).max)
        return -big, big
    return None


def _rounded(values: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """``values`` (float64) rounded once to ``dtype``: to nearest (ties to even) and
    saturating at its range for an integer dtype (a cast alone truncates toward zero,
    so a minority's small updates would never move an integer model), and at its largest
    finite values for a float dtype (a cast makes inf, and every update trained from an
    inf model is rejected as not finite: the run could never move again)."""
    bounds = _range(dtype)
    if bounds is not None:
        values = np.clip(np.rint(values) if dtype.kind in "iu" else values, *bounds)
    return np.asarray(values).astype(dtype, copy=False)


def _past_range(values: np.ndarray, dtype: np.dtype[Any]) -> int:
    """How many of ``values`` (float64) lie outside what ``dtype`` holds (saturated)."""
    bounds = _range(dtype)
    if bounds is None:
        return 0
    low, high = bounds
    with np.errstate(invalid="ignore"):
        return int(np.count_nonzero((values < low) | (values > high)))


def apply_update(model: np.ndarray, update: np.ndarray, server_lr: float) -> np.ndarray:
    """``model + server_lr * update`` as a new array of the model's dtype (computed in
    float64 and rounded once, see :func:`_rounded`: values past the dtype's range
    saturate, with a warning; a 0-d model stays a 0-d array). The model is replaced,
    never changed in place: a message may still be sending its bytes."""
    with np.errstate(over="ignore"):  # a float64 model past its range: saturated below
        step = np.multiply(update, server_lr, dtype=np.float64)
        total = np.add(model, step, dtype=np.float64)
    if saturated := _past_range(total, model.dtype):
        log.warning(
            "the new model has %d values past what %s holds: saturated at its range "
            "(a model near its dtype's limits, a large server_lr, or a hostile update)",
            saturated,
            model.dtype,
        )
    return _rounded(total, model.dtype)
