"""Review mends of group/ and federated/: the compressed ring's feedback step, the
shared helpers, and the rejoin refusal sent once."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest

from p2pdist import Group, UsageError
from p2pdist.group.buffers import expectation, mismatch
from p2pdist.group.compress import divide_for_mean, make_codec
from p2pdist.group.compressed_algorithms import _feed_back
from p2pdist.group.membership import _FORM_CHANNEL, _HELLO_CHANNEL, Membership


@pytest.mark.parametrize("wire", ["float16", "bfloat16", "int8"])
def test_feed_back_keep_decodes_once_into_the_same_bits(wire: str) -> None:
    """``keep`` leaves ``sent`` holding exactly ``decode(buf)`` and adds the same finite
    error to the residual as the plain mode does (an inf's element keeps its residual)."""
    codec = make_codec(wire, 64)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(256) * 100).astype(np.float32)
    x[7] = np.inf
    buf = np.empty(codec.nbytes(x.size), np.uint8)
    codec.encode_into(x, buf)
    decoded = np.empty_like(x)
    codec.decode_into(buf, decoded)
    start = rng.standard_normal(x.size).astype(np.float32)
    scratch, ok = np.empty_like(x), np.empty(x.size, np.bool_)

    plain_sent, plain_res = x.copy(), start.copy()
    _feed_back(codec, buf, plain_sent, scratch, ok, plain_res)
    np.testing.assert_array_equal(plain_sent, x)  # untouched

    kept_sent, kept_res = x.copy(), start.copy()
    _feed_back(codec, buf, kept_sent, scratch, ok, kept_res, keep=True)
    assert kept_sent.tobytes() == decoded.tobytes()
    assert kept_res.tobytes() == plain_res.tobytes()
    assert np.isfinite(kept_res).all()


def test_mismatch_names_what_differs() -> None:
    f4, i4 = np.dtype("<f4"), np.dtype("<i4")
    assert mismatch(f4, (2, 3), f4, (2, 3)) == ""
    assert mismatch(f4, (2, 3), None, None) == ""
    assert mismatch(i4, (2, 3), f4, (2, 3)) == "dtype float32"
    assert mismatch(f4, (3,), f4, (2, 3)) == "shape [2, 3]"
    assert mismatch(i4, (3,), f4, (2, 3)) == "dtype float32 and shape [2, 3]"
    with pytest.raises(UsageError, match=r"but dtype int32 and shape \[4\] was asked for"):
        expectation(None, (4,), "int32", np.zeros(3, np.float32))


def test_divide_for_mean_is_a_float32_divide_without_underflow_warnings() -> None:
    x = np.array([3.0, 1e-45, -6.0], np.float32)
    out = np.empty_like(x)
    with np.errstate(under="raise"):
        divide_for_mean(x, 3, out)
    np.testing.assert_array_equal(out, x / np.float32(3))


def test_bucket_block_default_is_all_reduce_s() -> None:
    from p2pdist.group.compress import INT8_BLOCK, make_codec

    assert inspect.signature(Group.all_reduce).parameters["block"].default == INT8_BLOCK
    assert inspect.signature(make_codec).parameters["block"].default == INT8_BLOCK


class _Conn:
    def __init__(self) -> None:
        self.sent: list[tuple[int, dict[str, Any]]] = []

    def send_nowait(self, channel: int, meta: bytes) -> None:
        self.sent.append((channel, msgpack.unpackb(meta, raw=False)))

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("noted", [False, True])
def test_turn_away_sends_the_formation_note_unless_it_went_already(noted: bool) -> None:
    conn = _Conn()
    spawned: list[Any] = []

    def spawn(work: Any) -> None:
        spawned.append(work)
        work.close()

    me = SimpleNamespace(_rank=0, peer_label=lambda r: f"rank {r}", _spawn=spawn)
    Membership._turn_away(me, conn, "why not", error="mismatch", rank=1, noted=noted)  # type: ignore[arg-type]
    forms = [m for c, m in conn.sent if c == _FORM_CHANNEL]
    hellos = [m for c, m in conn.sent if c == _HELLO_CHANNEL]
    assert forms == ([] if noted else [{"form": "refused", "why": "why not"}])
    assert hellos == [{"refused": "why not", "error": "mismatch"}]
    assert len(spawned) == 1  # closed
