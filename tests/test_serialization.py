"""SPEC §6 serialization: round trips, plain safetensors interop, hostile input."""

from __future__ import annotations

import dataclasses
import json
import struct
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn
from helpers import craft, run_python
from hypothesis import given
from hypothesis import strategies as st

import ferroquant as fq
from ferroquant import _format


@pytest.fixture
def tensors(rng):
    w = rng.standard_normal((64, 48)).astype(np.float32)
    return {
        "layer.0.weight": fq.quantize_blockwise(w, 64),
        "layer.1.weight": fq.quantize_blockwise(w[:10], 7, np.float32),
        "layer.0.bias": rng.standard_normal(48).astype(np.float32),
        "strided": w[:, ::3],  # safetensors.numpy alone would write the wrong bytes
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "bf16": np.linspace(-1, 1, 9).astype(ml_dtypes.bfloat16),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, np.float64),
        "empty": fq.quantize_blockwise(np.zeros((0, 4), np.float32)),
    }


def assert_same(got, want):
    assert list(got) == sorted(want)
    for name, value in want.items():
        if isinstance(value, np.ndarray):
            assert isinstance(got[name], np.ndarray)
            assert got[name].shape == value.shape
            assert got[name].dtype == value.dtype.newbyteorder("=")
            assert (
                got[name].tobytes()
                == np.ascontiguousarray(value, value.dtype.newbyteorder("=")).tobytes()
            )
        else:
            assert type(got[name]) is type(value)
            assert got[name] == value


def test_file_round_trip(tmp_path, tensors):
    path = tmp_path / "m.safetensors"
    fq.save(path, tensors, metadata={"author": "test"})
    assert_same(fq.load(path), tensors)
    assert_same(fq.load(str(path)), tensors)


def test_bytes_round_trip(tensors):
    assert_same(fq.load_bytes(fq.save_bytes(tensors)), tensors)


def test_dataclass_to_bytes_from_bytes(tensors):
    q = tensors["layer.0.weight"]
    b = q.to_bytes()
    assert isinstance(b, bytes)
    assert fq.BlockwiseQuantized.from_bytes(b) == q
    with pytest.raises(fq.FormatError):
        fq.BlockwiseQuantized.from_bytes(fq.save_bytes({"a": np.zeros(3)}))


def test_loaded_arrays_are_read_only(tmp_path, tensors):
    fq.save(tmp_path / "m.safetensors", tensors)
    loaded = fq.load(tmp_path / "m.safetensors")
    assert not loaded["layer.0.bias"].flags.writeable
    assert not loaded["layer.0.weight"].data.flags.writeable


def test_file_is_plain_safetensors_with_json_entries(tmp_path, tensors):
    path = tmp_path / "m.safetensors"
    fq.save(path, {"w": tensors["layer.0.weight"], "b": tensors["layer.0.bias"]}, {"k": "v"})
    raw = stn.load_file(str(path))
    assert sorted(raw) == ["b", "w::data", "w::scales"]
    assert raw["w::data"].dtype == np.int8 and raw["w::scales"].dtype == np.float16
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    assert meta["k"] == "v"
    entry = json.loads(meta["ferroquant:w"])
    assert entry["format_version"] == fq.serialization.FORMAT_VERSION == 1
    assert entry["scheme"] == "blockwise8"
    assert entry["shape"] == [64, 48] and entry["block_size"] == 64
    assert entry["dtype"] == "float32"
    assert entry["arrays"] == {"data": "w::data", "scales": "w::scales"}


def test_any_safetensors_file_loads_as_plain_arrays(tmp_path):
    path = tmp_path / "plain.safetensors"
    stn.save_file({"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), np.int64)}, str(path))
    out = fq.load(path)
    assert list(out) == ["a", "b"]
    np.testing.assert_array_equal(out["a"], np.arange(4))


@pytest.mark.parametrize(
    ("tensors", "metadata", "exc"),
    [
        ({"a": [1, 2]}, None, TypeError),
        ({"a": np.array([object()])}, None, TypeError),
        ({"a": np.ones(2, np.complex128)}, None, TypeError),
        ({1: np.ones(2)}, None, TypeError),
        ({"a": np.ones(2)}, {"ferroquant:a": "{}"}, ValueError),
        ({"a": np.ones(2)}, {"k": 3}, TypeError),
        ([("a", np.ones(2))], None, TypeError),
    ],
)
def test_save_rejects_what_it_cannot_store(tmp_path, tensors, metadata, exc):
    with pytest.raises(exc):
        fq.save(tmp_path / "x.safetensors", tensors, metadata)


def test_save_rejects_name_collisions(tmp_path):
    q = fq.quantize_blockwise(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="used twice"):
        fq.save_bytes({"w": q, "w::data": np.zeros(2)})


def test_missing_path_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        fq.load(tmp_path / "nope.safetensors")


# --- hostile files --------------------------------------------------------------


def blockwise_file(entry_patch=None, data_dtype="I8", scales_len=2, n=10, meta_extra=None):
    entry = {
        "format_version": 1,
        "scheme": "blockwise8",
        "shape": [n],
        "dtype": "float32",
        "block_size": 8,
        "arrays": {"data": "w::data", "scales": "w::scales"},
    }
    entry.update(entry_patch or {})
    item = {"I8": 1, "F32": 4}[data_dtype]
    meta = {"ferroquant:w": json.dumps(entry), **(meta_extra or {})}
    header = {
        "__metadata__": meta,
        "w::data": {"dtype": data_dtype, "shape": [n], "data_offsets": [0, n * item]},
        "w::scales": {
            "dtype": "F16",
            "shape": [scales_len],
            "data_offsets": [n * item, n * item + 2 * scales_len],
        },
    }
    data = bytes(n * item) + np.ones(scales_len, np.float16).tobytes()
    return craft(header, data)


def test_crafted_valid_file_loads():
    q = fq.load_bytes(blockwise_file())["w"]
    assert isinstance(q, fq.BlockwiseQuantized) and q.shape == (10,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scales_len": 3}, "scales"),
        ({"data_dtype": "F32"}, "int8"),
        ({"entry_patch": {"scheme": "mystery"}}, "unknown scheme"),
        ({"entry_patch": {"format_version": 99}}, "upgrade"),
        ({"entry_patch": {"format_version": "1"}}, "format_version"),
        ({"entry_patch": {"shape": [11]}}, "data"),
        ({"entry_patch": {"shape": "ten"}}, "shape"),
        ({"entry_patch": {"shape": [-10]}}, "sizes in"),
        ({"entry_patch": {"shape": [2.5, 4]}}, "shape"),
        ({"entry_patch": {"shape": [True] * 10}}, "shape"),
        # Hardening #8: every field checked; no tensor can be silently dropped.
        ({"entry_patch": {"dtype": "float128"}}, "dtype"),
        ({"entry_patch": {"dtype": None}}, "dtype"),
        ({"entry_patch": {"dtype": "int8"}}, "dtype"),
        ({"entry_patch": {"surprise": 1}}, "unknown"),
        ({"entry_patch": {"shape": [0, 2**70]}}, "shape"),
        ({"entry_patch": {"shape": [0] * 70}}, "dimensions"),
        ({"entry_patch": {"block_size": 0}}, "block_size"),
        ({"entry_patch": {"block_size": 2.5}}, "block_size"),
        ({"entry_patch": {"block_size": None}}, "block_size"),
        ({"entry_patch": {"arrays": {"data": "w::data", "scales": "gone"}}}, "missing tensor"),
        ({"entry_patch": {"arrays": {"data": "w::data"}}}, "must map exactly"),
        (
            {"entry_patch": {"arrays": {"data": "w::data", "scales": "w::scales", "extra": "b"}}},
            "must map exactly",
        ),
        ({"entry_patch": {"arrays": ["w::data"]}}, "arrays"),
        (
            {
                "meta_extra": {
                    "ferroquant:v": json.dumps(
                        {
                            "format_version": 1,
                            "scheme": "blockwise8",
                            "shape": [10],
                            "dtype": "float32",
                            "block_size": 8,
                            "arrays": {"data": "w::data", "scales": "w::scales"},
                        }
                    )
                }
            },
            "claimed by entries",
        ),
        ({"meta_extra": {"ferroquant:x": "{not json"}}, "not valid JSON"),
        ({"meta_extra": {"ferroquant:x": "[1, 2]"}}, "JSON object"),
        ({"meta_extra": {"ferroquant:x": "[" * 100000 + "]" * 100000}}, "JSON"),
    ],
)
def test_inconsistent_entries_raise_format_error(kwargs, match):
    with pytest.raises(fq.FormatError, match=match):
        fq.load_bytes(blockwise_file(**kwargs))


def test_a_missing_dtype_key_is_a_format_error():
    blob = blockwise_file()
    good = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
    e = json.loads(good["__metadata__"]["ferroquant:w"])
    del e["dtype"]
    good["__metadata__"]["ferroquant:w"] = json.dumps(e)
    with pytest.raises(fq.FormatError, match="missing"):
        fq.load_bytes(craft(good, blob[8 + struct.unpack("<Q", blob[:8])[0] :]))


def test_a_code_of_minus_128_is_a_format_error():
    raw = bytearray(blockwise_file())
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    raw[start + 3] = 0x80
    with pytest.raises(fq.FormatError, match="-128"):
        fq.load_bytes(bytes(raw))


def test_non_finite_or_negative_scales_raise_format_error():
    good = blockwise_file()
    for bad in (np.nan, np.inf, -1.0):
        raw = bytearray(good)
        raw[-4:-2] = np.float16(bad).tobytes()
        with pytest.raises(fq.FormatError, match="scales"):
            fq.load_bytes(bytes(raw))


F32_MAX = float(np.finfo(np.float32).max)
F64_MAX = float(np.finfo(np.float64).max)


def _patched(q, old: np.ndarray, new: np.ndarray) -> bytes:
    raw = q.to_bytes()
    assert raw.count(old.tobytes()) == 1
    return raw.replace(old.tobytes(), new.tobytes())


def test_scales_no_finite_input_gives_are_refused():
    # A scale past max|x| / divisor for every finite float32 input, or an affine
    # scale and zero point whose codes reach past the source dtype, dequantize to
    # inf: refused when made by hand and when read from bytes.
    x = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)
    makers = [
        (lambda v: fq.quantize_blockwise(v, 4, scale_dtype=np.float32), 127),
        (fq.dynamic_quantize_int8, 127),
        (fq.dynamic_quantize_int4, 7),
        (lambda v: fq.quantize_activations(v, fq.BitNetConfig(3)), 3),
    ]
    for make, divisor in makers:
        q = make(x)
        top = np.float32(F32_MAX) / np.float32(divisor)
        for scale, ok in ((top, True), (np.nextafter(top, np.float32(np.inf)), False)):
            raw = _patched(q, q.scales, np.array([scale], np.float32))
            if ok:
                assert type(q).from_bytes(raw).scales[0] == scale
            else:
                with pytest.raises(fq.FormatError, match="scales must be at most"):
                    type(q).from_bytes(raw)
        with pytest.raises(fq.InvalidConfigError, match="at most"):
            dataclasses.replace(q, scales=np.array([3e38], np.float32))
    q = fq.quantize(x, fq.QuantConfig.int8().asymmetric())
    for old in (q.scales, q.zero_points):
        raw = _patched(q, old, np.array([1e300]))
        with pytest.raises(fq.FormatError, match="beyond what a finite float32 input gives"):
            fq.QuantizedTensor.from_bytes(raw)
    # A float64 source keeps any finite zero point and any scale > 0.
    q64 = fq.quantize(x.astype(np.float64), fq.QuantConfig.int8().asymmetric())
    raw = _patched(q64, q64.scales, np.array([1e300]))
    assert fq.QuantizedTensor.from_bytes(raw).scales[0] == 1e300
    # What the quantizers make of float32's extremes still loads, at every width.
    ends = np.array([[F32_MAX, -F32_MAX]], np.float32)
    for bits in (8, 4):
        for mode in ("symmetric", "asymmetric"):
            q = fq.quantize(ends, fq.QuantConfig(bits, mode))
            assert fq.QuantizedTensor.from_bytes(q.to_bytes()) == q
    for bits in range(2, 9):
        q = fq.quantize_activations(ends, fq.BitNetConfig(bits))
        assert type(q).from_bytes(q.to_bytes()) == q
    for make, _ in makers[:3]:
        q = make(ends)
        assert type(q).from_bytes(q.to_bytes()) == q


def test_scales_past_a_narrower_source_or_float64_are_refused():
    # The reach is judged against the dtype the values came from: a float16 source
    # caps scales at 65504 / divisor (rounded as the scales are), and a float64
    # affine scale and zero point must not reach past float64 either.
    h = np.array([[65504.0, -1.0, 0.5, 3.0]], np.float16)
    makers = [
        (lambda v: fq.quantize_blockwise(v, 4), 127),  # float16 scales
        (lambda v: fq.quantize_blockwise(v, 4, scale_dtype=np.float32), 127),
        (fq.dynamic_quantize_int8, 127),
        (fq.dynamic_quantize_int4, 7),
        (lambda v: fq.quantize_activations(v, fq.BitNetConfig(3)), 3),
    ]
    for make, divisor in makers:
        q = make(h)  # float16's largest value itself: kept
        assert q.dtype == "float16" and type(q).from_bytes(q.to_bytes()) == q
        top = (np.float32(65504) / np.float32(divisor)).astype(q.scales.dtype)
        assert q.scales[0] == top
        above = np.nextafter(top, np.array(np.inf, q.scales.dtype))
        with pytest.raises(fq.FormatError, match="float16's largest value 65504"):
            type(q).from_bytes(_patched(q, q.scales, np.array([above], q.scales.dtype)))
        # The same scale is fine for a float32 source.
        q32 = make(h.astype(np.float32))
        patched = _patched(q32, q32.scales, np.array([above], q32.scales.dtype))
        assert type(q32).from_bytes(patched).scales[0] == above
    # float64 affine: a finite scale and zero point whose codes pass float64's
    # largest value; an overflowed (infinite) scale, as the seed's math makes it,
    # still loads.
    x64 = np.array([0.0, 1e306], np.float64)  # scale 3.9e303, zero point -128
    q = fq.quantize(x64, fq.QuantConfig.int8().asymmetric())
    for old, new in ((q.scales, [1e307]), (q.zero_points, [-1e6])):
        with pytest.raises(fq.FormatError, match="beyond what a finite float64 input gives"):
            fq.QuantizedTensor.from_bytes(_patched(q, old, np.array(new)))
        with pytest.raises(fq.InvalidConfigError, match="beyond what a finite float64"):
            field = "scales" if old is q.scales else "zero_points"
            dataclasses.replace(q, **{field: np.array(new)})
    for x in ([1.7e308, -1.7e308], [0.0, 1.7e308], [-F64_MAX, 0.0], [1e300, 1e300]):
        for config in (fq.QuantConfig.int8().asymmetric(), fq.QuantConfig.int4().asymmetric()):
            q = fq.quantize(np.array(x), config)
            assert fq.QuantizedTensor.from_bytes(q.to_bytes()) == q
    # Post-training layers: a code times the scale past the source's largest value
    # (the smallest weight that rounds to it already is) cannot come from a weight.
    for dtype, scale in (("float32", 3e38), ("float16", 1000.0)):
        with pytest.raises(fq.InvalidConfigError, match=f"beyond {dtype}'s largest value"):
            fq.QuantizedWeights("l", np.array([127, 0], np.int8), (2,), scale, dtype=dtype)
        fq.QuantizedWeights("l", np.array([1, 0], np.int8), (2,), scale, dtype=dtype)
    # Any scale from_f32 is given still makes a layer that loads, extremes included:
    # the reach is judged as the kernel rounds (fl32(w / scale) can land on k + 0.5
    # while the exact quotient lies just below it).
    q = fq.QuantizedWeights.from_f32("l", np.array([3.4e38, -1.0], np.float32), scale=6.9e37)
    assert q.weights_i8.tolist() == [5, 0]
    q = fq.QuantizedWeights.from_f32("l", np.array([F32_MAX, -1.0], np.float32))
    assert q.weights_i8[0] == 127
    for source, top in (
        (np.float16, 65504.0),
        (np.float32, F32_MAX),
        (ml_dtypes.bfloat16, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)),
    ):
        w = np.array([top, 1.0], source)
        for k in (1, 5, 6, 63, 126):
            s = np.float32(top / (k + 0.5))
            for scale in (np.nextafter(s, np.float32(0)), s, np.nextafter(s, np.float32(np.inf))):
                q = fq.QuantizedWeights.from_f32("l", w, scale=float(scale))
                assert fq.load_bytes(fq.save_bytes({"q": q}))["q"] == q
                with pytest.raises(fq.InvalidConfigError, match="largest value"):
                    codes = q.weights_i8.copy()
                    codes[0] = codes[0] + 1 if codes[0] < 127 else -128  # one code further
                    fq.QuantizedWeights("l", codes, q.shape, q.scale, dtype=q.dtype)


def test_truncated_files_raise_format_error(tmp_path, tensors):
    good = fq.save_bytes(tensors)
    path = tmp_path / "t.safetensors"
    for cut in [0, 1, 7, 8, 9, 20, len(good) // 2, len(good) - 1]:
        with pytest.raises(fq.FormatError):
            fq.load_bytes(good[:cut])
        path.write_bytes(good[:cut])
        with pytest.raises(fq.FormatError):
            fq.load(path)


def test_oversized_header_and_bad_offsets_raise_format_error(tmp_path):
    for blob in [
        craft({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), 2**40),
        craft({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), 2**63),
        craft({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}}, bytes(8)),
        craft({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 2]}}, bytes(8)),
        craft({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
        craft({"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, bytes(8)),
        craft({"a": {"dtype": "Q99", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
        craft({"a": "nonsense"}),
        b"\xff" * 64,
    ]:
        with pytest.raises(fq.FormatError):
            fq.load_bytes(blob)
        path = tmp_path / "h.safetensors"
        path.write_bytes(blob)
        with pytest.raises(fq.FormatError):
            fq.load(path)


@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_format_error(blob):
    try:
        fq.load_bytes(blob)
    except fq.FormatError:
        pass


@given(st.data())
def test_bit_flips_in_a_valid_file_only_raise_format_error(data):
    good = bytearray(blockwise_file())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] ^= 1 << data.draw(st.integers(0, 7))
    try:
        out = fq.load_bytes(bytes(good))
    except fq.FormatError:
        return
    assert isinstance(out, dict)


def test_an_entry_giving_a_key_twice_is_refused():
    # json keeps the last of duplicate keys: a file could show one value to a
    # reader that keeps the first and another to ferroquant.
    b = fq.quantize(np.ones((2, 3), np.float32)).to_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])
    text = header["__metadata__"]["ferroquant:value"]
    assert text.startswith("{")
    header["__metadata__"]["ferroquant:value"] = '{"dtype": "float64", ' + text[1:]
    with pytest.raises(fq.FormatError, match="'dtype' appears twice"):
        fq.load_bytes(craft(header, b[8 + n :]))


def test_writer_errors_are_ours():
    from ferroquant._format import _writer_error

    class SafetensorError(Exception):  # the name safetensors' writer raises
        pass

    full = _writer_error(
        SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        ),
        "out.safetensors",
    )
    assert type(full) is OSError and full.errno == 28 and full.filename == "out.safetensors"
    big = _writer_error(SafetensorError("Error while serializing: header too large"), None)
    assert isinstance(big, fq.FormatError) and "header too large" in str(big)
    other = KeyError("x")
    assert _writer_error(other, "out.safetensors") is other


def test_an_oversized_header_is_a_format_error(tmp_path):
    meta = {"note": "x" * 100_000_001}  # past safetensors' 100 MB header limit
    with pytest.raises(fq.FormatError, match="header too large"):
        fq.save_bytes({"a": np.ones(2, np.float32)}, metadata=meta)
    with pytest.raises(fq.FormatError, match="header too large"):
        fq.save(tmp_path / "h.safetensors", {"a": np.ones(2, np.float32)}, metadata=meta)
    assert list(tmp_path.iterdir()) == []


def test_a_path_with_a_trailing_slash_is_a_directory(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"precious")
    for path in (f"{victim}/", f"{tmp_path / 'missing'}/"):
        with pytest.raises(IsADirectoryError):
            fq.save(path, {"a": np.ones(2, np.float32)})
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 8, 1001])
def test_int4_unpacking_and_range_check_match_a_brute_force(rng, n):
    from ferroquant._base import first_int4_outside, unpack_int4

    data = rng.integers(0, 256, (n + 1) // 2).astype(np.uint8)
    if n % 2:
        data[-1] |= 0x80  # the unused high nibble (-8 if read): never reported
    codes = [
        (b >> (4 * h) & 15) - 16 * (b >> (4 * h + 3) & 1) for b in map(int, data) for h in (0, 1)
    ][:n]
    got = unpack_int4(data, n)
    assert got.dtype == np.int8 and got.tolist() == codes
    for lo, hi in ((-7, 7), (-8, 7), (-2, 3)):
        bad = [(k, c) for k, c in enumerate(codes) if not lo <= c <= hi]
        assert first_int4_outside(data, n, lo, hi) == (bad[0] if bad else None)


def test_loading_int4_values_does_not_unpack_them(tmp_path, rng):
    import tracemalloc

    x = rng.standard_normal(1 << 22).astype(np.float32)
    path = tmp_path / "q.safetensors"
    fq.save(path, {"a": fq.quantize(x, fq.QuantConfig.int4()), "d": fq.dynamic_quantize_int4(x)})
    tracemalloc.start()
    try:
        got = fq.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    packed = got["a"].data.nbytes + got["d"].data.nbytes  # 2 MiB each
    # The two packed arrays with the 2 MiB each is read into the middle of (untouched:
    # address space, which tracemalloc counts), plus slices of a MiB: not the 4 MiB of
    # unpacked codes each.
    assert peak < packed + 2 * (2 << 20) + (3 << 20), (peak, packed)


@pytest.mark.parametrize("via_link", [False, True], ids=["typed", "through-a-link"])
@pytest.mark.parametrize(
    "path, exc",
    [
        ("new/.", FileNotFoundError),
        ("keep.safetensors/.", NotADirectoryError),
        ("keep.safetensors/", IsADirectoryError),
        ("nodir/../made.safetensors", FileNotFoundError),
        ("keep.safetensors/../made.safetensors", NotADirectoryError),
        ("sub/..", IsADirectoryError),
    ],
)
def test_paths_are_resolved_as_open_would(tmp_path, path, exc, via_link):
    # realpath() flattens `x/.` and `x/..` without asking whether x is a
    # directory: fq.save would have replaced keep.safetensors or made
    # made.safetensors. A link's target is checked the same way.
    keep = tmp_path / "keep.safetensors"
    keep.write_bytes(b"orig")
    (tmp_path / "sub").mkdir()
    if via_link:
        (tmp_path / "evil").symlink_to(path)
    with pytest.raises(exc):
        fq.save(tmp_path / "evil" if via_link else f"{tmp_path}/{path}", {"a": np.ones(2)})
    assert keep.read_bytes() == b"orig"
    names = ["keep.safetensors", "sub"] + (["evil"] if via_link else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_a_link_to_a_file_is_written_through(tmp_path):
    (tmp_path / "keep.safetensors").write_bytes(b"orig")
    (tmp_path / "good").symlink_to("keep.safetensors")
    (tmp_path / "new").symlink_to("made.safetensors")  # dangling: the target is made
    for name in ("good", "new"):
        fq.save(tmp_path / name, {"a": np.ones(2, np.float32)})
        assert (tmp_path / name).is_symlink()
    assert "a" in fq.load(tmp_path / "keep.safetensors")
    assert "a" in fq.load(tmp_path / "made.safetensors")


def test_a_header_naming_a_tensor_or_metadata_key_twice_is_refused():
    t = {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}
    one = json.dumps({"p": t})
    twice = "{" + one[1:-1] + "," + one[1:-1] + "}"
    with pytest.raises(fq.FormatError, match='name "p" appears twice'):
        fq.load_bytes(craft_text(twice, b"\0\0"))
    meta = '{"__metadata__": {"k": "a", "k": "b"}, ' + one[1:]
    with pytest.raises(fq.FormatError, match='"k" appears twice'):
        fq.load_bytes(craft_text(meta, b"\0\0"))


def craft_text(text: str, data: bytes) -> bytes:
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def test_a_streaming_writer_closes_once(tmp_path):
    from ferroquant.serialization import StreamingWriter

    path = tmp_path / "s.safetensors"
    w = StreamingWriter(path)
    w.add("a", np.arange(3, dtype=np.float32))
    w.close()
    w.close()  # nothing more to do
    with pytest.raises(ValueError, match="is closed"):
        w.add("b", np.ones(2, np.float32))
    np.testing.assert_array_equal(fq.load(path)["a"], np.arange(3, dtype=np.float32))


def test_a_streaming_writer_refuses_a_name_as_array_and_as_value(tmp_path):
    # Found by a review: the file was written, and load() refused it.
    from ferroquant.serialization import StreamingWriter

    x = np.ones(64, np.float32)
    for first, second in ((x, fq.quantize_blockwise(x)), (fq.quantize_blockwise(x), x)):
        w = StreamingWriter(tmp_path / "n.safetensors")
        w.add("x", first)
        with pytest.raises(ValueError, match="used twice"):
            w.add("x", second)
        w.add("y", second)
        w.close()
        got = fq.load(tmp_path / "n.safetensors")
        assert list(got) == ["x", "y"]


def test_a_streaming_writer_is_left_to_its_process_after_a_fork(tmp_path):
    # A child forked with a writer open shares its spill's descriptor: its use
    # is refused, and the parent's file holds the parent's tensors (a review saw
    # the child's bytes land in the parent's file).
    import os

    from ferroquant.serialization import StreamingWriter

    path = tmp_path / "f.safetensors"
    w = StreamingWriter(path)
    w.add("a", np.full(1000, 1.0, np.float32))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            w.add("b", np.full(1000, 7.0, np.float32))
        except OSError as e:
            code = 0 if "forked" in str(e) else 2
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    w.add("c", np.full(1000, 3.0, np.float32))
    w.close()
    got = fq.load(path)
    assert sorted(got) == ["a", "c"]
    assert (got["a"] == 1.0).all() and (got["c"] == 3.0).all()


def test_a_streaming_writer_serves_threads_one_call_at_a_time(tmp_path):
    import threading

    from ferroquant.serialization import StreamingWriter

    w = StreamingWriter(tmp_path / "t.safetensors")
    errors = []

    def add(k: int) -> None:
        try:
            for i in range(20):
                w.add(f"t{k}_{i}", np.full(20_000, k + i, np.float32))
        except BaseException as e:  # pragma: no cover - the failure being tested
            errors.append(e)

    threads = [threading.Thread(target=add, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    assert not errors
    got = fq.load(tmp_path / "t.safetensors")
    assert len(got) == 80 and all(
        (got[f"t{k}_{i}"] == k + i).all() for k in range(4) for i in range(20)
    )


def test_a_ragged_list_is_a_type_error_naming_the_argument():
    for f in (fq.fp32_to_fp16_bits, fq.quantize, fq.dynamic_quantize_int8, fq.quantize_blockwise):
        with pytest.raises(TypeError, match="x must be a floating array"):
            f([[1.0, 2.0], [3.0]])


@pytest.mark.parametrize(
    "path, exc",
    [("", FileNotFoundError), ("keep.safetensors/..", NotADirectoryError)],
)
def test_errors_of_odd_paths_are_open_s(tmp_path, monkeypatch, path, exc):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.safetensors").write_bytes(b"orig")
    with pytest.raises(exc):
        fq.save(path, {"a": np.ones(2, np.float32)})
    assert (tmp_path / "keep.safetensors").read_bytes() == b"orig"


SETTINGS = [
    fq.QuantConfig.int8(),
    fq.QuantConfig.int4_per_channel().asymmetric(),
    fq.MaxAbs(),
    fq.Percentile(0.999),
    fq.SmoothQuantConfig(0.25, 3e-7),
    fq.BitNetConfig(3, per_token_activation=False),
    fq.quantization_stats(
        {"w": np.ones((8, 4), np.float32), "b": np.ones(4)}, fq.QuantConfig.int4()
    ),
]


def test_statistics_without_arrays_are_hashable_by_value():
    # Frozen dataclasses of floats: hashable as such, consistent with ==.
    cal = fq.LayerCalibration("l", -1.0, 2.0, -1.0, 1.0)
    stats = fq.CalibStats.collect([np.array([1.0, -2.0, 0.5], np.float32)])
    for value, same, other in (
        (cal, fq.LayerCalibration("l", -1.0, 2.0, -1.0, 1.0), dataclasses.replace(cal, w_max=3.0)),
        (stats, fq.CalibStats.from_bytes(stats.to_bytes()), dataclasses.replace(stats, max=4.0)),
    ):
        assert hash(value) == hash(same) and {value: 1}[same] == 1
        assert value != other and len({value, same, other}) == 2
    # -0.0 == 0.0, so they hash alike.
    zero = fq.LayerCalibration("z", 0.0, 0.0, -1.0, 1.0)
    assert hash(zero) == hash(fq.LayerCalibration("z", -0.0, 0.0, -1.0, 1.0))


@pytest.mark.parametrize("value", SETTINGS, ids=lambda v: type(v).__name__)
def test_settings_and_stats_dataclasses_serialize_too(value, tmp_path):
    # SPEC §6: every dataclass has to_bytes / from_bytes; they stay hashable.
    cls = type(value)
    back = cls.from_bytes(value.to_bytes())
    assert back == value and hash(back) == hash(value) and value.nbytes == 0
    fq.save(tmp_path / "s.safetensors", {"s": value, "w": np.ones(2, np.float32)})
    assert fq.load(tmp_path / "s.safetensors")["s"] == value
    with pytest.raises(fq.FormatError, match="not a"):
        (fq.MaxAbs if cls is not fq.MaxAbs else fq.QuantConfig).from_bytes(value.to_bytes())


@pytest.mark.parametrize(
    ("scheme", "params"),
    [
        ("quant-config", {"bits": 5, "mode": "symmetric", "granularity": "per_tensor"}),
        ("quant-config", {"bits": 8, "mode": "symmetric"}),
        ("percentile", {"p": 0.0}),
        ("percentile", {"p": "0.5"}),
        ("max-abs", {"p": 0.5}),
        ("smooth-quant-config", {"alpha": 2.0, "epsilon": 1e-5}),
        ("bitnet-config", {"activation_bits": 9, "per_token_activation": True}),
        ("bitnet-config", {"activation_bits": 8, "per_token_activation": 1}),
        (
            "quant-stats",
            {
                "num_quantized": 1,
                "num_fp32": 0,
                "fp32_bytes": 64,
                "quantized_bytes": 16,
                "compression_ratio": 5.0,  # not 64 / 16
            },
        ),
        (
            "quant-stats",
            {
                "num_quantized": -1,
                "num_fp32": 0,
                "fp32_bytes": 0,
                "quantized_bytes": 0,
                "compression_ratio": 1.0,
            },
        ),
    ],
)
def test_hostile_settings_entries_are_format_errors(scheme, params):
    entry = {"format_version": 1, "scheme": scheme, **params, "arrays": {}}
    blob = craft({"__metadata__": {"ferroquant:value": json.dumps(entry)}})
    with pytest.raises(fq.FormatError):
        fq.load_bytes(blob)


def test_arrays_are_read_as_little_endian(tmp_path, tensors, monkeypatch):
    # safetensors stores little-endian bytes: native dtypes would read them swapped
    # on a big-endian host. On this (little-endian) host the canonical dtype objects,
    # which fast paths compare by identity (`x.dtype is float32`).
    assert sys.byteorder == "little"
    path = tmp_path / "m.safetensors"
    fq.save(path, tensors)
    for got in (fq.load(path), fq.load_bytes(fq.save_bytes(tensors))):
        for name, value in got.items():
            if isinstance(value, np.ndarray):
                assert value.dtype is np.dtype(value.dtype.type), name
    # As a big-endian host reads them: every multi-byte element named "<".
    monkeypatch.setattr(_format, "_LITTLE_HOST", False)
    for got in (fq.load(path), fq.load_bytes(fq.save_bytes(tensors))):
        arrays = {n: v for n, v in got.items() if isinstance(v, np.ndarray)}
        assert arrays
        for name, value in arrays.items():
            assert value.dtype.byteorder in "<|", (name, value.dtype.byteorder)


def test_the_same_values_give_the_same_bytes_in_every_process(tmp_path):
    # The writer keeps metadata in a hash map and wrote it in that map's order: the
    # same values and metadata gave different files from call to call.
    code = f"""
    import hashlib, numpy as np, ferroquant as fq
    rng = np.random.default_rng(0)
    d = {{f"w{{i}}": fq.quantize_blockwise(rng.standard_normal((8, 8)).astype(np.float32))
         for i in range(6)}}
    d["plain"] = np.ones(3, np.float32)
    meta = {{f"k{{i}}": str(i) for i in range(5)}}
    seen = set()
    for i in range(4):
        seen.add(hashlib.sha256(fq.save_bytes(d, metadata=meta)).hexdigest())
        path = {str(tmp_path)!r} + f"/f{{i}}.safetensors"
        fq.save(path, d, metadata=meta)
        seen.add(hashlib.sha256(open(path, "rb").read()).hexdigest())
    print(*seen)
    """
    digests = set()
    for _ in range(3):
        p = run_python(code)
        assert p.returncode == 0, p.stderr
        digests.update(p.stdout.split())
    assert len(digests) == 1
    # In key order in the header itself, and read back whole.
    d = {f"w{i}": fq.quantize_blockwise(np.ones((4, 4), np.float32)) for i in range(3)}
    raw = fq.save_bytes(d, metadata={"z": "1", "a": "2"})
    (n,) = struct.unpack_from("<Q", raw)
    keys = list(json.loads(raw[8 : 8 + n])["__metadata__"])
    assert keys == sorted(keys) and len(keys) == 5
    assert fq.load_bytes(raw).keys() == d.keys()


def test_large_loaded_tensors_start_on_a_huge_page_boundary(tmp_path, rng):
    # Read into a 2 MiB-aligned stretch of a larger zeroed buffer, so that the
    # transparent huge pages NumPy asks for cover all of a streamed weight.
    w = rng.standard_normal((2048, 2048)).astype(np.float32)  # 16 MiB
    q = fq.QuantizedLinear.from_linear(w, None, fq.QuantConfig.int4_per_channel())
    small = np.arange(10, dtype=np.float32)
    plain_codes = np.ones(4 << 20, np.int8)
    fq.save(
        tmp_path / "m.safetensors",
        {"big": w, "small": small, "c": plain_codes, "q": q.weight_quantized},
    )
    # Memory an earlier tensor filled and freed: none of it shows through `.base`.
    fq.save(tmp_path / "s.safetensors", {"s": np.full(6 << 20, 0x5A, np.uint8)})
    for _ in range(3):
        del fq.load(tmp_path / "s.safetensors")["s"]
    loaded = fq.load(tmp_path / "m.safetensors")
    big, codes = loaded["big"], loaded["q"].data  # 16 MiB of float32, 2 MiB of packed codes
    np.testing.assert_array_equal(big, w)
    np.testing.assert_array_equal(loaded["small"], small)
    assert loaded["q"] == q.weight_quantized
    for arr in (big, codes):
        assert arr.__array_interface__["data"][0] % (2 << 20) == 0
        assert not arr.flags.writeable
        owner = arr.base
        start = arr.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
        assert not owner[:start].any() and not owner[start + arr.nbytes :].any()
        # Whole huge pages for the array, wherever it starts.
        assert owner.nbytes >= start + -(-arr.nbytes // (2 << 20)) * (2 << 20)
    # A plain tensor is the caller's, as one NumPy allocated would be: it may be made
    # writable, so a frozen value built on it copies it.
    c = loaded["c"]
    assert c.__array_interface__["data"][0] % (2 << 20) == 0
    frozen = fq.BlockwiseQuantized(c, np.ones(c.size // 64, np.float16), c.shape, 64)
    assert not np.shares_memory(frozen.data, c)
    c.flags.writeable = True
    c[...] = -128
    np.testing.assert_array_equal(frozen.data, plain_codes)
    # A quantized value's arrays are the reader's: held without a copy, never writable.
    with pytest.raises(ValueError):
        codes.flags.writeable = True
    layer = fq.QuantizedLinear(loaded["q"])
    assert np.shares_memory(layer.weight_quantized.data, codes)
    x = rng.standard_normal(2048).astype(np.float32)
    np.testing.assert_array_equal(layer.forward(x), q.forward(x))
