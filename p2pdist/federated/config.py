"""Federated averaging settings (frozen; times in seconds, counts in updates or rounds)."""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass

from ..errors import UsageError

__all__ = [
    "DISCOUNTS",
    "MIN_DISCOUNT",
    "POLICIES",
    "RULES",
    "FederatedConfig",
    "config_or_default",
]

RULES = ("mean", "median", "trimmed_mean")
"""Aggregation rules: sample-weighted mean, coordinate-wise median, trimmed mean."""
POLICIES = ("deadline", "quorum")
"""When a round closes: at its deadline, or as soon as the quorum of fresh updates is
met."""
DISCOUNTS = ("polynomial", "exponential", "none")
"""Staleness discounts: ``(1 + s) ** -a``, ``a ** s``, or 1."""
MIN_DISCOUNT = sys.float_info.min
"""The smallest staleness discount (the smallest normal float, 2.2e-308): a discount
that would underflow to 0 stops here."""


@dataclass(frozen=True, slots=True)
class FederatedConfig:
    """How rounds of federated averaging open, close, weigh and check updates.

    An *update* is a model delta: the client's model after local training minus the
    model of the round it started from (its ``base_round``). The round's aggregate is
    added to the model (times ``server_lr``).
    """

    round_timeout: float = 10.0
    """Seconds from a round's opening to its deadline. The round closes at the deadline
    at the latest, with whatever valid updates have arrived."""
    policy: str = "deadline"
    """``"deadline"``: wait until the deadline, or until every member of the round has
    its part in (docs/federated.md §3). ``"quorum"``: also close as soon as ``quorum``
    valid fresh updates (from the current model) are in; stale ones are aggregated with
    them but do not count."""
    quorum: int | float = 1
    """Valid updates a round needs to produce an aggregate: an ``int`` count (>= 1), or a
    ``float`` fraction in (0, 1] of the members at the round's opening (rounded up, at
    least 1). A round that closes short of it leaves the model unchanged, and its valid
    updates roll into the next round (where their staleness has grown by one)."""
    max_staleness: int = 2
    """Largest accepted ``round - base_round``, in rounds (an int >= 0). Older updates
    are dropped and counted (reason ``too_stale``)."""
    discount: str = "polynomial"
    """Staleness discount ``d(s)``: ``"polynomial"`` is ``(1 + s) ** -discount_param``,
    ``"exponential"`` is ``discount_param ** s``, ``"none"`` is 1."""
    discount_param: float = 0.5
    """The exponent (polynomial, >= 0) or base (exponential, in (0, 1]). The default,
    ``(1 + s) ** -0.5``, is FedAsync's polynomial staleness function (Xie et al. 2019):
    an update one round old weighs 0.71 of a fresh one, two rounds old 0.58."""
    rule: str = "mean"
    """``"mean"``: weighted by ``num_samples * d(staleness)``. ``"median"`` and
    ``"trimmed_mean"``: coordinate-wise and unweighted (a client could lie about its
    sample count), robust to a minority of arbitrary updates."""
    trim_fraction: float = 0.2
    """For ``"trimmed_mean"``: the fraction of values cut from *each* end of every
    coordinate, ``floor(trim_fraction * n)`` of ``n`` (when that leaves at least one)."""
    max_norm: float | None = None
    """Reject updates whose L2 norm exceeds this (None: no bound)."""
    max_num_samples: int | None = None
    """Reject submissions claiming more samples than this (None: no bound)."""
    server_lr: float = 1.0
    """Factor applied to the aggregate before it is added to the model (finite, > 0)."""

    def __post_init__(self) -> None:
        if not _positive(self.round_timeout) or not math.isfinite(self.round_timeout):
            raise UsageError(
                f"round_timeout must be a finite positive number of seconds, "
                f"got {self.round_timeout!r}"
            )
        if self.policy not in POLICIES:
            raise UsageError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        q = self.quorum
        if isinstance(q, bool) or not isinstance(q, numbers.Real):
            raise UsageError(f"quorum must be an int count or a float fraction, got {q!r}")
        # numpy scalars become Python numbers: they travel in msgpack messages and are
        # compared with a peer's settings.
        q = int(q) if isinstance(q, numbers.Integral) else float(q)
        object.__setattr__(self, "quorum", q)
        if isinstance(q, int) and q < 1:
            raise UsageError(f"a quorum count must be at least 1, got {q!r}")
        if isinstance(q, float) and not 0.0 < q <= 1.0:
            raise UsageError(f"a quorum fraction must be in (0, 1], got {q!r}")
        if not _integer(self.max_staleness) or self.max_staleness < 0:
            raise UsageError(
                f"max_staleness must be an int >= 0 (rounds), got {self.max_staleness!r}"
            )
        self._check_discount()
        if self.rule not in RULES:
            raise UsageError(f"rule must be one of {RULES}, got {self.rule!r}")
        if not _real(self.trim_fraction) or not 0.0 <= self.trim_fraction < 0.5:
            raise UsageError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction!r}")
        if self.max_norm is not None and not _positive(self.max_norm):
            raise UsageError(f"max_norm must be a positive number (or None), got {self.max_norm!r}")
        n = self.max_num_samples
        if n is not None and (not _integer(n) or n < 1):
            raise UsageError(f"max_num_samples must be an int >= 1 (or None), got {n!r}")
        if not _positive(self.server_lr) or not math.isfinite(self.server_lr):
            raise UsageError(f"server_lr must be a finite positive number, got {self.server_lr!r}")
        for name in ("round_timeout", "discount_param", "trim_fraction", "server_lr", "max_norm"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, float(value))
        for name in ("max_staleness", "max_num_samples"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, int(value))

    def _check_discount(self) -> None:
        if self.discount not in DISCOUNTS:
            raise UsageError(f"discount must be one of {DISCOUNTS}, got {self.discount!r}")
        a = self.discount_param
        if not _real(a) or not math.isfinite(a):
            raise UsageError(f"discount_param must be a finite number, got {a!r}")
        if self.discount == "polynomial" and not a >= 0:
            raise UsageError(f"a polynomial discount needs discount_param >= 0, got {a!r}")
        if self.discount == "exponential" and not 0.0 < a <= 1.0:
            raise UsageError(f"an exponential discount needs discount_param in (0, 1], got {a!r}")

    def needed(self, members: int) -> int:
        """The quorum as a count, for a round that opened with ``members`` members."""
        if isinstance(self.quorum, int):
            return self.quorum
        return max(1, math.ceil(self.quorum * members - 1e-9))

    def staleness_factor(self, staleness: int) -> float:
        """``d(staleness)``, the discount multiplied into a stale update's weight; never
        below :data:`MIN_DISCOUNT`, so that no update weighs nothing (a round of updates
        all that stale still averages them by their sample counts)."""
        if self.discount == "none" or staleness <= 0:
            return 1.0
        if self.discount == "polynomial":
            d = (1.0 + staleness) ** -self.discount_param
        else:
            d = self.discount_param**staleness
        return max(float(d), MIN_DISCOUNT)


def config_or_default(config: object) -> FederatedConfig:
    """``config``, or the defaults for None; anything else is a :class:`UsageError` (a
    dict of settings would fail much later, with an AttributeError)."""
    if config is None:
        return FederatedConfig()
    if not isinstance(config, FederatedConfig):
        raise UsageError(f"config must be a FederatedConfig, got {type(config).__name__}")
    return config


def _real(value: object) -> bool:
    """A real number (an int or a float, numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    """A real number above 0 (NaN is not)."""
    return _real(value) and value > 0  # type: ignore[operator]
