"""Federated-averaging messages (sans-I/O codec): one DATA frame each.

A message's meta is a msgpack map with ``"t"`` (its type) and small fields; an array
travels as the frame's raw payload, described by the map's ``"a"`` (``[dtype, shape]``,
see :mod:`p2pdist.wire.arrays`). Nothing received is unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ..errors import RemoteProtocolError, UsageError
from ..group.buffers import as_array
from ..transport.mailbox import SPACE_SHIFT
from ..wire.arrays import ArrayHeader, ArrayHeaderError
from ..wire.frames import Frame

__all__ = [
    "CLIENT_CHANNEL",
    "DECISION",
    "FED_SPACE",
    "ROUND_SPACE",
    "UPDATE",
    "Message",
    "decode",
    "encode",
    "round_channel",
    "round_space",
]

FED_SPACE = 0xFF00
"""Channel space of the coordinator/client links (their own connections, no Group)."""
CLIENT_CHANNEL = FED_SPACE << SPACE_SHIFT
"""The one channel (each way) between a coordinator and a client."""
ROUND_SPACE = 0xFE00
"""Channel space of decentralised averaging with ``tag`` 0; tag ``t`` uses
``ROUND_SPACE + t``. These lie in the range a Group reserves
(:meth:`~p2pdist.Group.reserve_channel_space`), which ``split`` never hands out."""
MAX_TAG = 0xFF
"""Largest ``tag`` of a decentralised averaging instance (256 may share one Group)."""
_KINDS = 4
_MAX_COUNTER = 1 << SPACE_SHIFT


def round_space(tag: int) -> int:
    """The channel space of decentralised averaging instance ``tag`` (0..255)."""
    if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise UsageError(f"tag must be in [0, {MAX_TAG}], got {tag!r}")
    return ROUND_SPACE + tag


UPDATE, DECISION = 0, 1
"""Kinds of a round's channels: the ranks' updates, the leader's decision (or a rank's
refusal to lead, see :mod:`.recovery`)."""


def round_channel(tag: int, round_id: int, kind: int) -> int:
    """The channel of a decentralised round's messages of ``kind`` (0 updates, 1 the
    leader's decision, 2 and 3 for recovery). Counters only grow, so a channel is never
    reused."""
    assert 0 <= kind < _KINDS
    counter = round_id * _KINDS + kind
    if counter >= _MAX_COUNTER:
        raise UsageError("round id too large for a channel")
    return (round_space(tag) << SPACE_SHIFT) | counter


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded message: its type, its small fields, and its array (if any)."""

    kind: str
    fields: dict[str, Any]
    array: np.ndarray | None = field(default=None, repr=False)

    def get_int(self, name: str, label: str, *, low: int = 0) -> int:
        """Field ``name`` as an int >= ``low``, or RemoteProtocolError naming ``label``."""
        value = self.fields.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise RemoteProtocolError(label, f"{self.kind} message: bad {name!r} {value!r}")
        return value

    def get_float(self, name: str, label: str) -> float:
        """Field ``name`` as a float, or RemoteProtocolError naming ``label``."""
        value = self.fields.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RemoteProtocolError(label, f"{self.kind} message: bad {name!r} {value!r}")
        return float(value)

    def need_array(self, label: str) -> np.ndarray:
        """The message's array, or RemoteProtocolError naming ``label``."""
        if self.array is None:
            raise RemoteProtocolError(label, f"{self.kind} message without its array")
        return self.array


def encode(
    kind: str, fields: dict[str, Any] | None = None, array: np.ndarray | None = None
) -> tuple[bytes, memoryview]:
    """``(meta, payload)`` of one message; the array's bytes are the payload (no copy)."""
    body: dict[str, Any] = {"t": kind, **(fields or {})}
    payload = memoryview(b"")
    if array is not None:
        arr = as_array(array)  # C-contiguous, little-endian, a wire dtype (else UsageError)
        body["a"] = ArrayHeader.of(arr).to_wire()
        payload = arr.reshape(-1).data.cast("B") if arr.size else memoryview(b"")
    return bytes(msgpack.packb(body, use_bin_type=True)), payload


def decode(frame: Frame, label: str) -> Message:
    """Parse ``frame``; anything malformed raises RemoteProtocolError naming ``label``."""
    try:
        body = msgpack.unpackb(frame.meta, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack's own exception types
        raise RemoteProtocolError(label, f"undecodable message: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("t"), str):
        raise RemoteProtocolError(label, "message is not a map with a type")
    kind = body.pop("t")
    header_wire = body.pop("a", None)
    array = None
    if header_wire is not None:
        try:
            header = ArrayHeader.from_wire(header_wire)
            array = header.view(frame.payload)
        except ArrayHeaderError as exc:
            raise RemoteProtocolError(label, f"{kind} message: {exc}") from None
    elif frame.payload.nbytes:
        raise RemoteProtocolError(label, f"{kind} message has a payload but no array header")
    return Message(kind, body, array)
