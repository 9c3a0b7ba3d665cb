# Hand-written stub of the native module, checked by `python -m mypy.stubtest`.
import os
from typing import Any, Dict, List, Optional, Tuple, Union, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "CalibAccumulator",
    "LinearPlan",
    "SpillFile",
    "__version__",
    "_hold_pool_lock",
    "compute_scale",
    "compute_smooth_factors",
    "dequantize_affine",
    "dequantize_blockwise",
    "dequantize_groups",
    "env_warnings",
    "fake_quantize_bitnet",
    "fp16_bits_to_fp32",
    "fp32_to_fp16_bits",
    "get_num_threads",
    "get_output_cache",
    "output_cache_usage",
    "parse_safetensors_header",
    "ptq_quantize",
    "ptq_range",
    "ptq_read_json",
    "ptq_write_json",
    "quantization_mae",
    "quantization_stats",
    "quantize_affine",
    "quantize_bitnet",
    "quantize_blockwise",
    "quantize_dynamic",
    "round_f32",
    "set_num_threads",
    "set_output_cache",
    "simd_isa",
    "smooth_in_place",
    "sort_safetensors_metadata",
    "sort_safetensors_metadata_file",
    "supported_isas",
    "to_float32",
    "w8a8_product",
]

__version__: str

def quantize_blockwise(
    x: npt.NDArray[np.floating], block_size: int, f32_scales: bool
) -> Tuple[npt.NDArray[np.int8], npt.NDArray[np.floating], int]: ...
def dequantize_blockwise(
    codes: npt.NDArray[np.int8], block_size: int, scales: npt.NDArray[np.floating]
) -> npt.NDArray[np.float32]: ...
def quantize_affine(
    x: npt.NDArray[np.floating], bits: int, mode: str, granularity: str
) -> Tuple[npt.NDArray[np.integer], npt.NDArray[np.float64], npt.NDArray[np.float64]]: ...
def dequantize_affine(
    data: npt.NDArray[np.integer],
    shape: List[int],
    bits: int,
    mode: str,
    granularity: str,
    scales: npt.NDArray[np.float64],
    zero_points: npt.NDArray[np.float64],
    dtype: str,
) -> npt.NDArray[np.floating]: ...
def set_num_threads(n: int) -> None: ...
def env_warnings() -> List[str]: ...
def round_f32(x: float) -> float: ...
def to_float32(x: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]: ...
def parse_safetensors_header(
    header: bytes, file_len: int, max_ndim: int
) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str, List[int], int, int]]]: ...
def sort_safetensors_metadata(header: bytes) -> Optional[bytes]: ...
def sort_safetensors_metadata_file(path: Union[str, os.PathLike[str]]) -> None: ...
def get_num_threads() -> int: ...
def _hold_pool_lock(seconds: float) -> None: ...
def set_output_cache(max_bytes: int) -> None: ...
def get_output_cache() -> int: ...
def output_cache_usage() -> Tuple[int, int, int]: ...
def simd_isa() -> str: ...
def supported_isas() -> List[str]: ...
def compute_scale(x: npt.NDArray[np.floating], clip_val: float, p: Optional[float]) -> float: ...
def quantize_dynamic(
    x: npt.NDArray[np.floating], format: str, p: Optional[float]
) -> Tuple[npt.NDArray[np.integer], npt.NDArray[np.float32]]: ...
def dequantize_groups(
    data: npt.NDArray[np.integer],
    n: int,
    group: int,
    scales: npt.NDArray[np.float32],
    int4: bool,
) -> npt.NDArray[np.float32]: ...
def quantize_bitnet(
    x: npt.NDArray[np.floating], groups: int, bits: int
) -> Tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]: ...
def fake_quantize_bitnet(
    x: npt.NDArray[np.floating], groups: int, bits: int
) -> npt.NDArray[np.float32]: ...
def compute_smooth_factors(
    activations: npt.NDArray[np.floating],
    weights: npt.NDArray[np.floating],
    cols: int,
    alpha: float,
    epsilon: float,
) -> npt.NDArray[np.float32]: ...
def smooth_in_place(
    x: npt.NDArray[np.float32], arg: str, factors: npt.NDArray[np.float32], multiply: bool
) -> None: ...

@final
class SpillFile:
    def __new__(cls, dir: str) -> SpillFile: ...
    def append(self, data: npt.NDArray[np.uint8]) -> int: ...
    def write_safetensors(
        self,
        path: str,
        tensors: List[Tuple[str, str, List[int], int, int]],
        metadata: Optional[Dict[str, str]] = None,
    ) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...

@final
class CalibAccumulator:
    def __new__(
        cls, total: Optional[int] = None, spill_dir: Optional[str] = None
    ) -> CalibAccumulator: ...
    def count(self) -> int: ...
    def push(self, batch: npt.NDArray[np.floating]) -> None: ...
    def discard(self) -> None: ...
    def finish(
        self,
    ) -> Tuple[float, float, float, float, float, float, bool, Optional[str]]: ...

def w8a8_product(
    weight: npt.NDArray[np.int8],
    out_features: int,
    in_features: int,
    weight_scales: npt.NDArray[np.float32],
    activations: npt.NDArray[np.floating],
    tokens: Optional[int],
) -> npt.NDArray[np.float32]: ...

@final
class LinearPlan:
    def __new__(
        cls,
        codes: npt.NDArray[np.integer],
        bits: int,
        out_features: int,
        in_features: int,
        scales: npt.NDArray[np.float64],
        zero_points: npt.NDArray[np.float64],
        bias: Optional[npt.NDArray[np.float32]],
        dequant_dtype: str,
    ) -> LinearPlan: ...
    def __call__(self, x: object) -> Optional[npt.NDArray[np.float32]]: ...
    def run(self, x: npt.NDArray[np.floating], tokens: int) -> npt.NDArray[np.float32]: ...

def fp32_to_fp16_bits(x: npt.NDArray[np.floating]) -> npt.NDArray[np.uint16]: ...
def fp16_bits_to_fp32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]: ...
def ptq_quantize(
    w: npt.NDArray[np.generic], scale: Optional[float]
) -> Tuple[npt.NDArray[np.int8], float]: ...
def ptq_range(w: npt.NDArray[np.generic]) -> Tuple[float, float]: ...
def ptq_write_json(
    path: Optional[str],
    config_json: str,
    layers: List[
        Tuple[str, npt.NDArray[np.int8], List[int], float, Optional[npt.NDArray[np.float32]]]
    ],
    scheme: str,
    total_quantized_bytes: int,
    total_fp32_bytes: int,
) -> Optional[bytes]: ...
def ptq_read_json(
    data: bytes,
) -> Tuple[str, str, int, int, List[Tuple[str, npt.NDArray[np.int8], List[int], float, Any]]]: ...
def quantization_mae(
    original: npt.NDArray[np.generic],
    data: npt.NDArray[np.generic],
    n: int,
    group: int,
    scales: npt.NDArray[np.float32],
    int4: bool,
) -> float: ...
def quantization_stats(
    shapes: List[List[int]], bits: int, mode: str, granularity: str
) -> Tuple[int, int, int, int, float]: ...
