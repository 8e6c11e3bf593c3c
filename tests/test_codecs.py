"""Wire codecs: the float16 bit route equals numpy's cast bit for bit; in-place codec
methods agree with encode/decode; int8 scales and tails."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from p2pdist.group.compress import ErrorFeedback, make_codec
from p2pdist.group.halfcast import HalfScratch, decode_f16, encode_f16


def _f32_sweep(step: int) -> np.ndarray:
    """Every ``step``-th float32 bit pattern (all signs, exponents, NaNs and infinities)."""
    return np.arange(0, 1 << 32, step, dtype=np.uint64).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("chunk", [1 << 16, 1 << 20])
def test_f16_encode_matches_numpy_over_the_float32_range(chunk: int) -> None:
    xs = _f32_sweep(977)
    scratch = HalfScratch()
    with np.errstate(all="ignore"):
        for i in range(0, xs.size, chunk):  # chunks without inf/NaN take the fast route
            x = xs[i : i + chunk]
            finite = x[np.abs(x) < 65519.99]
            for part in (x, finite):
                got = np.empty(part.size, np.uint16)
                encode_f16(part, got, scratch)
                np.testing.assert_array_equal(got, part.astype(np.float16).view(np.uint16))


def test_f16_encode_ties_subnormals_and_edges() -> None:
    tiny = np.float32(2.0**-24)  # the smallest float16 subnormal
    x = np.array(
        [0.0, -0.0, 1.0, -1.0, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 65504.0, 65519.0, -65519.0,
         tiny, tiny / 2, tiny * 1.5, tiny * 2.5, 2.0**-14, 2.0**-14 - tiny / 2, 6.1e-5,
         1e-8, -1e-8, 3.0e-5],
        np.float32,
    )  # fmt: skip
    got = np.empty(x.size, np.uint16)
    encode_f16(x, got, HalfScratch())
    np.testing.assert_array_equal(got, x.astype(np.float16).view(np.uint16))


def test_f16_decode_matches_numpy_for_every_half() -> None:
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for part in (h, h[(h & 0x7FFF) < 0x7C00]):  # with and without inf/NaN
        got = np.empty(part.size, np.float32)
        decode_f16(part, got, HalfScratch())
        want = part.view(np.float16).astype(np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("wire", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 70_000, 300_001])
def test_in_place_methods_agree_with_encode_decode(wire: str, n: int) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(np.float32)
    codec = make_codec(wire, 256)
    enc = codec.encode(x)
    assert enc.nbytes == codec.nbytes(n)
    buf = np.full(codec.nbytes(n), 0xAB, np.uint8)
    codec.encode_into(x, buf)
    np.testing.assert_array_equal(buf, enc)
    dec = codec.decode(enc, n)
    out = np.full(n, np.nan, np.float32)
    codec.decode_into(enc, out)
    np.testing.assert_array_equal(out, dec)
    acc = rng.standard_normal(n).astype(np.float32)
    want = acc + dec
    codec.accumulate(enc, acc)
    np.testing.assert_array_equal(acc, want)
    if wire == "bfloat16":
        np.testing.assert_array_equal(dec, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    elif wire == "float16":
        np.testing.assert_array_equal(dec, x.astype(np.float16).astype(np.float32))
        numpy_route = make_codec(wire, f16_route="numpy")
        np.testing.assert_array_equal(numpy_route.encode(x), enc)
    else:
        np.testing.assert_allclose(dec, x, atol=float(np.abs(x).max(initial=0)) / 127 / 2 * 1.001)


@pytest.mark.parametrize("block", [1, 7, 64, 256, 4096])
def test_int8_scales_per_block(block: int) -> None:
    rng = np.random.default_rng(block)
    x = rng.standard_normal(10_007).astype(np.float32)
    x[:block] = 0.0  # an all-zero block decodes to zeros
    codec = make_codec("int8", block)
    dec = codec.decode(codec.encode(x), x.size)
    for s in range(0, x.size, block):
        part = x[s : s + block]
        bound = np.abs(part).max() / 127 / 2 * 1.001
        assert np.abs(dec[s : s + block] - part).max() <= bound
    assert not dec[:block].any()


@pytest.mark.parametrize("wire", ["float16", "bfloat16", "int8"])
def test_error_feedback_pieces_equal_one_whole_roundtrip(wire: str) -> None:
    # More than one piece (2**18 elements) and a ragged tail: the piecewise roundtrip must
    # give exactly decode(encode(x + residual)) and the residual of the whole array.
    rng = np.random.default_rng(7)
    n = (1 << 19) + 7
    codec = make_codec(wire, 256)
    ef = ErrorFeedback()
    residual = np.zeros(n, np.float32)
    for _ in range(3):
        x = rng.standard_normal(n)  # float64 input: cast to float32 first
        target = x.astype(np.float32) + residual
        want = codec.decode(codec.encode(target), n)
        residual = target - want
        np.testing.assert_array_equal(ef.apply(x, codec), want)
        assert ef.residual is not None
        np.testing.assert_array_equal(ef.residual, residual)


def test_importing_p2pdist_leaves_ml_dtypes_for_the_first_bfloat16_codec() -> None:
    """ml_dtypes' import takes most of a second: ranks, the relay and the CLI that never
    compress to bfloat16 do not pay it."""
    code = (
        "import sys, p2pdist, relay.server\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported early'\n"
        "from p2pdist.group.compress import make_codec\n"
        "make_codec('bfloat16')\n"
        "assert 'ml_dtypes' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
