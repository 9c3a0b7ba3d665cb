"""The general rules of SPEC, held by every public kernel through one table.

A new kernel gets these checks by adding a row to ``KERNELS``: dtypes, layouts
(strided, Fortran, big-endian, unaligned, read-only, 0-d), the non-finite
index, TypeError for non-float input, the caller's array left untouched,
frozen read-only results, value equality, a short repr, the bytes round trip,
thread-count independence.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import ml_dtypes
import numpy as np
import pytest

import ferroquant as fq


class Kernel(NamedTuple):
    name: str
    call: Callable[[np.ndarray], Any]
    result: type
    arrays: tuple


def _affine(config: fq.QuantConfig) -> Kernel:
    return Kernel(
        f"quantize[{config.name}]",
        lambda x: fq.quantize(x, config),
        fq.QuantizedTensor,
        ("data", "scales", "zero_points"),
    )


KERNELS = [
    Kernel(
        "quantize_blockwise",
        lambda x: fq.quantize_blockwise(x, 16, np.float32),
        fq.BlockwiseQuantized,
        ("data", "scales"),
    ),
    *[
        _affine(fq.QuantConfig(bits, mode, gran))
        for bits in (8, 4)
        for mode in ("symmetric", "asymmetric")
        for gran in ("per_tensor", "per_channel")
    ],
]

IDS = [k.name for k in KERNELS]


@pytest.fixture
def x(rng) -> np.ndarray:
    return (rng.standard_normal((24, 37)) * 3).astype(np.float32)


def unaligned(a: np.ndarray) -> np.ndarray:
    buf = np.zeros(a.nbytes + 1, np.uint8)
    out = buf[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned
    return out


LAYOUTS = {
    "strided": lambda a: np.repeat(a, 2, axis=1)[:, ::2],
    "fortran": np.asfortranarray,
    "big-endian": lambda a: a.astype(a.dtype.newbyteorder(">")),
    "unaligned": unaligned,
    "read-only": lambda a: np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape),
}


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_any_layout_gives_the_contiguous_result(kernel, layout, x):
    arr = LAYOUTS[layout](x)
    before = arr.copy()
    assert kernel.call(arr) == kernel.call(np.ascontiguousarray(x))
    np.testing.assert_array_equal(arr, before)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_float_dtypes_are_read_natively(kernel, dtype, x):
    q = kernel.call(x.astype(dtype))
    assert isinstance(q, kernel.result)
    assert q.dtype == np.dtype(dtype).name


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize(
    "bad", [np.int32, np.int8, np.bool_, np.complex64, object], ids=lambda d: np.dtype(d).name
)
def test_other_dtypes_raise_type_error_naming_x(kernel, bad):
    with pytest.raises(TypeError, match="x"):
        kernel.call(np.ones((4, 4), dtype=bad))


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_non_finite_input_names_its_first_index(kernel, value, dtype, x):
    a = x.astype(dtype)
    a[20, 3] = value
    a[22, 0] = np.nan
    before = a.copy()
    with pytest.raises(fq.NonFiniteError) as e:
        kernel.call(a)
    assert e.value.index == 20 * 37 + 3
    assert isinstance(e.value, ValueError) and "x" in str(e.value)
    np.testing.assert_array_equal(a, before)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_results_are_frozen_read_only_and_compare_by_value(kernel, x):
    q = kernel.call(x)
    assert isinstance(q, kernel.result)
    for name in kernel.arrays:
        assert not getattr(q, name).flags.writeable
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.shape = (1,)  # type: ignore[misc]
    assert q == kernel.call(x.copy())
    assert q != kernel.call(x * 2)
    assert q.nbytes == sum(getattr(q, n).nbytes for n in kernel.arrays)
    r = repr(q)
    assert len(r) < 200 and "shape=(24, 37)" in r and "ratio=" in r and "array(" not in r
    with pytest.raises(TypeError):
        hash(q)


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_bytes_and_files_round_trip(kernel, x, tmp_path):
    q = kernel.call(x.astype(np.float16))
    assert kernel.result.from_bytes(q.to_bytes()) == q
    fq.save(tmp_path / "q.safetensors", {"q": q})
    assert fq.load(tmp_path / "q.safetensors")["q"] == q


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_zero_d_and_empty_inputs(kernel):
    for a in (np.array(1.5, np.float32), np.zeros((0, 5), np.float32), np.zeros(0, np.float64)):
        q = kernel.call(a)
        assert q.shape == a.shape
        assert q.dequantize().shape == a.shape


@pytest.mark.parametrize("kernel", KERNELS, ids=IDS)
def test_results_do_not_depend_on_the_thread_count(kernel, rng, restore_threads):
    big = rng.standard_normal((1024, 1030)).astype(np.float32)
    fq.set_num_threads(1)
    one = kernel.call(big)
    fq.set_num_threads(2)
    assert kernel.call(big) == one
    fq.set_num_threads(3)
    assert kernel.call(big) == one
