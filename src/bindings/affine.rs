//! Affine int8 / int4 (SPEC §2): extract, release the GIL around one
//! `ops::affine` call, map the error, return the NumPy-allocated outputs.

use super::arrays::{exact, output, output_named, with_float_slice, writable, FloatArray};
use super::errors::to_pyerr;
use super::gil::Detach;
use crate::ops::affine::{self as af, num_groups, Bits, Codes, CodesMut, QuantConfig};
use crate::ops::pack::packed_len;
use crate::Float;
use half::{bf16, f16};
use numpy::{Element, PyArray1};
use pyo3::prelude::*;

/// `(data, scales, zero_points)` arrays.
type Quantized<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyArray1<f64>>,
    Bound<'py, PyArray1<f64>>,
);

/// `(data, scales, zero_points)`: int8 codes (or uint8 packed int4 bytes) of
/// the C-order `x`, and float64 scales and zero points, one per group.
#[pyfunction]
#[pyo3(signature = (x, bits, mode, granularity))]
pub(crate) fn quantize_affine<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    bits: u32,
    mode: &str,
    granularity: &str,
) -> PyResult<Quantized<'py>> {
    let config = QuantConfig::from_names(bits, mode, granularity).map_err(|e| to_pyerr(py, e))?;
    let shape: Vec<usize> = x.getattr("shape")?.extract()?;
    let x = FloatArray::extract("x", x)?;
    with_float_slice!(x, xs => {
        let groups = num_groups(&shape, config.granularity);
        let scales = output::<f64>(py, groups)?;
        let zps = output::<f64>(py, groups)?;
        let (mut sw, mut zw) = (writable(&scales)?, writable(&zps)?);
        let (ss, zs) = (sw.as_slice_mut()?, zw.as_slice_mut()?);
        let data = match config.bits {
            Bits::Int8 => {
                let d = output::<i8>(py, xs.len())?;
                let mut dw = writable(&d)?;
                let ds = dw.as_slice_mut()?;
                py.detached(|| af::quantize(xs, &shape, &config, CodesMut::Int8(ds), ss, zs))
                    .map_err(|e| to_pyerr(py, e))?;
                d.into_any()
            }
            Bits::Int4 => {
                let d = output::<u8>(py, packed_len(xs.len()))?;
                let mut dw = writable(&d)?;
                let ds = dw.as_slice_mut()?;
                py.detached(|| af::quantize(xs, &shape, &config, CodesMut::Int4(ds), ss, zs))
                    .map_err(|e| to_pyerr(py, e))?;
                d.into_any()
            }
        };
        drop((sw, zw));
        Ok((data, scales, zps))
    })
}

fn dequantize_into<'py, O: Float + Element>(
    py: Python<'py>,
    out: Bound<'py, PyArray1<O>>,
    codes: Codes<'_>,
    shape: &[usize],
    config: &QuantConfig,
    scales: &[f64],
    zps: &[f64],
) -> PyResult<Bound<'py, PyAny>> {
    {
        let mut ow = writable(&out)?;
        let os = ow.as_slice_mut()?;
        py.detached(|| af::dequantize(codes, shape, config, scales, zps, os))
            .map_err(|e| to_pyerr(py, e))?;
    }
    Ok(out.into_any())
}

/// Flat values `(q - zp) * scale` in `dtype` (float32, float64, float16 or
/// bfloat16), computed in f64 and rounded once.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (data, shape, bits, mode, granularity, scales, zero_points, dtype))]
pub(crate) fn dequantize_affine<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    shape: Vec<usize>,
    bits: u32,
    mode: &str,
    granularity: &str,
    scales: &Bound<'py, PyAny>,
    zero_points: &Bound<'py, PyAny>,
    dtype: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let config = QuantConfig::from_names(bits, mode, granularity).map_err(|e| to_pyerr(py, e))?;
    let n = crate::ops::shape_numel(&shape)
        .ok_or_else(|| pyo3::exceptions::PyOverflowError::new_err("shape is too large"))?;
    let s = exact::<f64>("scales", "float64", scales)?;
    let z = exact::<f64>("zero_points", "float64", zero_points)?;
    let (ss, zs) = (s.as_slice()?, z.as_slice()?);
    let (d8, d4);
    let codes = match config.bits {
        Bits::Int8 => {
            d8 = exact::<i8>("data", "int8", data)?;
            Codes::Int8(d8.as_slice()?)
        }
        Bits::Int4 => {
            d4 = exact::<u8>("data", "uint8", data)?;
            Codes::Int4(d4.as_slice()?)
        }
    };
    match dtype {
        "float32" => dequantize_into(py, output::<f32>(py, n)?, codes, &shape, &config, ss, zs),
        "float64" => dequantize_into(py, output::<f64>(py, n)?, codes, &shape, &config, ss, zs),
        "float16" => dequantize_into(py, output::<f16>(py, n)?, codes, &shape, &config, ss, zs),
        "bfloat16" => dequantize_into(
            py,
            output_named::<bf16>(py, n, "bfloat16")?,
            codes,
            &shape,
            &config,
            ss,
            zs,
        ),
        other => Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "dtype must be float32, float64, float16 or bfloat16, got {other}"
        ))),
    }
}

/// Register this family's functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize_affine, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_affine, m)?)?;
    m.add_function(wrap_pyfunction!(quantization_stats, m)?)?;
    Ok(())
}

/// Seed 001's `quantization_stats` over parameter shapes: `(num_quantized,
/// num_fp32, fp32_bytes, quantized_bytes, compression_ratio)`.
#[pyfunction]
pub(crate) fn quantization_stats(
    py: Python<'_>,
    shapes: Vec<Vec<usize>>,
    bits: u32,
    mode: &str,
    granularity: &str,
) -> PyResult<(usize, usize, usize, usize, f64)> {
    let config = QuantConfig::from_names(bits, mode, granularity).map_err(|e| to_pyerr(py, e))?;
    let s = af::quantization_stats(shapes.iter().map(Vec::as_slice), &config)
        .map_err(|e| to_pyerr(py, e))?;
    Ok((
        s.num_quantized,
        s.num_fp32,
        s.fp32_bytes,
        s.quantized_bytes,
        s.compression_ratio,
    ))
}
