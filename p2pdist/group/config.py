"""Group settings (frozen; times in seconds, sizes in bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UsageError
from ..settings import check_int, check_seconds
from ..transport.base import TransportConfig
from ..transport.punch import PunchConfig
from .link import PIECE_BYTES

__all__ = ["ALGORITHMS", "MODES", "PAIRWISE_MAX_WORLD", "PEER_LOSS", "GroupConfig"]

MODES = ("fast", "deterministic")
PEER_LOSS = ("break", "leave")
ALGORITHMS = ("auto", "ring", "pairwise")
PAIRWISE_MAX_WORLD = 4
"""``algorithm="auto"`` takes the pairwise exchange up to this many ranks (where it was
measured faster, docs/performance.md) and the ring above."""


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """How a :class:`~p2pdist.Group` behaves."""

    timeout: float = 60.0
    """Default bound on every collective and recv (override per call with ``timeout=``).
    A collective waiting on a rank that did start it gets a tenth more, at most 5 s, once
    (docs/architecture.md, section 5: the rank next to one that never called names it)."""
    connect_timeout: float = 60.0
    """How long forming the group may take (peers may start at different times)."""
    small_bytes: int = 64 * 1024
    """Arrays up to this size use the one-round direct algorithms instead of the ring."""
    chunk_bytes: int = 2 << 20
    """Ring and pipeline chunk size: transfer of one chunk overlaps reduction of the last."""
    algorithm: str = "auto"
    """How arrays above ``small_bytes`` are reduced and gathered (all_reduce,
    reduce_scatter, all_gather, reduce): ``"ring"`` (each rank sends to the next, n-1
    steps), ``"pairwise"`` (each rank exchanges its segments with every other rank at
    once: the same bytes per rank, n-1 flows at a time), or ``"auto"``: pairwise from 3
    up to :data:`PAIRWISE_MAX_WORLD` ranks, the ring otherwise (at 2 ranks the two are
    the same exchange). Compressed all-reduces always take the ring."""
    mode: str = "fast"
    """Default reduction mode: "fast" (ring/direct, identical on all ranks) or
    "deterministic" (float64 accumulation in rank order, identical across runs too)."""
    max_message_bytes: int = 16 << 30
    """Largest array :meth:`Group.recv` allocates for a sender (without ``out=``), and
    largest piece a peer may send this rank in :meth:`Group.all_to_all_v` (a larger one
    is a MismatchError naming it, before anything is allocated)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    punch: PunchConfig = field(default_factory=PunchConfig)
    """Hole punching for ranks that meet through a relay (``PunchConfig(enabled=False)``
    keeps them on the relay)."""
    on_peer_loss: str = "break"
    """What a connection lost without a goodbye (peer killed, network gone, keepalive
    silence) does to the group. ``"break"``: the group is unusable from then on, every
    waiter fails naming the lost rank. ``"leave"``: the lost rank counts as having left,
    exactly like one that closed on purpose: point to point with the others, sub-groups
    without it and :class:`~p2pdist.federated.GroupAveraging` go on; collectives that
    need it refuse to start (naming it), and one already running fails naming it."""

    def __post_init__(self) -> None:
        # Kept as plain numbers (numpy's are taken): formation compares them through msgpack.
        for name in ("timeout", "connect_timeout"):
            object.__setattr__(self, name, check_seconds(name, getattr(self, name)))
        for name, least in (("small_bytes", 0), ("chunk_bytes", 4096), ("max_message_bytes", 0)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), least))
        if self.transport.limits.max_payload < PIECE_BYTES:
            raise UsageError(
                f"transport.limits.max_payload must be at least {PIECE_BYTES} bytes: a group "
                "sends longer messages in pieces of that size"
            )
        if self.mode not in MODES:
            raise UsageError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.algorithm not in ALGORITHMS:
            raise UsageError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.on_peer_loss not in PEER_LOSS:
            raise UsageError(f"on_peer_loss must be one of {PEER_LOSS}, got {self.on_peer_loss!r}")
