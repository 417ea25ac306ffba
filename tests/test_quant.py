"""Dequantization of every supported ggml type against ``gguf.quants`` (the reference
implementation shipped with llama.cpp's Python tools): random blocks with sane f16 scales, and
real tensors of the test model. Plus the error contract of ``kvserve._core.dequantize``.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

import kvserve._core as core

TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]

# Byte offsets, inside one block, of the f16 fields (scales / mins) of each block type.
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def _sane_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random f16 bit patterns over the whole finite range (subnormals, zeros, both signs)."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    inf_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_nan] &= ~np.uint16(0x4000)  # drop the top exponent bit: finite
    return bits


def random_blocks(name: str, n_blocks: int, seed: int) -> tuple[bytes, int]:
    """(data, n_elements): random bytes for ``n_blocks`` blocks with finite scale fields."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    n = n_blocks * block
    if name == "F32":
        vals = rng.normal(0, 10.0, n).astype(np.float32)
        vals[::7] *= np.float32(1e-40)  # subnormals
        vals[1::7] *= np.float32(1e30)
        return vals.tobytes(), n
    if name == "F16":
        return _sane_f16(rng, n).tobytes(), n
    if name == "BF16":
        f = rng.normal(0, 1e3, n).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes(), n
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        raw[:, off : off + 2] = _sane_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.tobytes(), n


def ours(name: str, data: bytes, n: int) -> np.ndarray:
    out = np.frombuffer(core.dequantize(name, data, n), dtype=np.float32)
    assert out.shape == (n,)
    return out


def theirs(name: str, data: bytes) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np.uint8)
    return gguf_dequantize(arr, GGMLQuantizationType[name]).astype(np.float32).reshape(-1)


def assert_same(name: str, got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.isfinite(want).all(), "test data produced non-finite reference values"
    assert np.array_equal(got, want), f"{name}: not bit-exact; first diffs at {_diffs(got, want)}"


def _diffs(got: np.ndarray, want: np.ndarray) -> list[tuple[int, float, float]]:
    idx = np.nonzero(got != want)[0][:5]
    return [(int(i), float(got[i]), float(want[i])) for i in idx]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n_blocks", [1, 3, 64])
def test_random_blocks_match_gguf(name: str, n_blocks: int):
    data, n = random_blocks(name, n_blocks, seed=zlib.crc32(f"{name}/{n_blocks}".encode()))
    assert_same(name, ours(name, data, n), theirs(name, data))


def test_random_blocks_are_not_trivial():
    """The random data really exercises the values: no type dequantizes to all zeros."""
    for name in TYPES:
        block = GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
        data, n = random_blocks(name, 8 if block > 1 else 256, seed=1)
        v = ours(name, data, n)
        assert np.count_nonzero(v) > n // 2, name
        assert len(np.unique(v)) > 16, name


@pytest.fixture(scope="module")
def reader(model_path) -> GGUFReader:
    return GGUFReader(model_path)


def _model_tensor(reader: GGUFReader, tensor_name: str, rows: int | None) -> tuple[str, bytes, int]:
    """(type name, raw bytes, element count) of a tensor of the model, or its first rows."""
    for t in reader.tensors:
        if t.name == tensor_name:
            data = t.data if rows is None else t.data[:rows]
            raw = np.ascontiguousarray(data).tobytes()
            block, size = GGML_QUANT_SIZES[t.tensor_type]
            return t.tensor_type.name, raw, len(raw) // size * block
    pytest.fail(f"test model has no tensor {tensor_name}")


@pytest.mark.parametrize(
    ("tensor_name", "type_name", "rows"),
    [
        ("token_embd.weight", "Q8_0", 256),
        ("blk.0.attn_q.weight", "Q4_1", None),
        ("output_norm.weight", "F32", None),
    ],
)
def test_model_tensors_match_gguf(reader, tensor_name: str, type_name: str, rows):
    ty, data, n = _model_tensor(reader, tensor_name, rows)
    assert ty == type_name, f"{tensor_name} is {ty}, the test expects {type_name}"
    got = ours(ty, data, n)
    assert_same(ty, got, theirs(ty, data))
    assert np.abs(got).max() > 0


def test_wrong_byte_length_is_value_error():
    data, n = random_blocks("Q4_K", 2, seed=3)
    with pytest.raises(ValueError, match="bytes"):
        core.dequantize("Q4_K", data[:-1], n)
    with pytest.raises(ValueError, match="bytes"):
        core.dequantize("Q4_K", data + b"\0", n)
    with pytest.raises(ValueError):
        core.dequantize("Q8_0", bytes(34), 16)  # not a whole number of blocks


def test_unknown_type_name_is_value_error():
    with pytest.raises(ValueError, match="NOPE"):
        core.dequantize("NOPE", b"", 0)


def test_unsupported_type_names_the_supported_ones():
    with pytest.raises(ValueError) as e:  # ModelError is a ValueError
        core.dequantize("IQ2_XXS", bytes(66), 256)
    msg = str(e.value)
    assert "IQ2_XXS" in msg
    for name in TYPES:
        assert name in msg, f"supported type {name} missing from: {msg}"


@pytest.mark.parametrize(("name", "rel_rms"), [("Q4_K", 0.1), ("Q5_K", 0.05), ("Q6_K", 0.03)])
def test_reference_kquant_writer_round_trips(name: str, rel_rms: float):
    """tests/reference.py writes K-quant blocks with its own numpy quantizer; gguf must read them
    back close to the input (a Gaussian row quantized to 4/5/6 bits: about 6%, 3%, 2% RMS), so
    that the tiny K-quant models hold the weights they were meant to, including rows of one
    sign and a zero row."""
    from reference import quantize_k

    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (6, 512)).astype(np.float32)
    x[1] = np.abs(x[1]) + 1.0
    x[2] = -np.abs(x[2])
    x[3] = 0.0
    raw = quantize_k(x, name)
    back = gguf_dequantize(raw, GGMLQuantizationType[name]).reshape(x.shape)
    assert np.array_equal(back[3], x[3])
    err = np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2))
    assert err < rel_rms, f"{name}: relative RMS error {err:.3f}"
    assert_same(name, ours(name, raw.tobytes(), x.size), back.reshape(-1))
