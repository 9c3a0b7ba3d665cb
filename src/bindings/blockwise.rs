//! Blockwise 8-bit (SPEC §1): extract, release the GIL around one
//! `ops::blockwise` call, map the error, return the NumPy-allocated outputs the
//! kernel filled (no copy).

use super::arrays::{exact, output, with_float_slice, writable, FloatArray};
use super::errors::{dtype_error, to_pyerr};
use super::gil::Detach;
use crate::ops::blockwise::{self as bw, num_blocks, Scales, ScalesMut};
use crate::Float;
use half::f16;
use numpy::{Element, PyArray1, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

/// `(codes, scales, lossy_blocks)` for the flattened `x`; scales are float16
/// unless `f32_scales`.
#[pyfunction]
#[pyo3(signature = (x, block_size, f32_scales))]
pub(crate) fn quantize_blockwise<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    block_size: usize,
    f32_scales: bool,
) -> PyResult<(Bound<'py, PyArray1<i8>>, Bound<'py, PyAny>, usize)> {
    let x = FloatArray::extract("x", x)?;
    with_float_slice!(x, xs => {
        let codes = output::<i8>(py, xs.len())?;
        let (scales, lossy) = if f32_scales {
            blockwise_into(py, xs, block_size, &codes, |s| ScalesMut::F32(s))?
        } else {
            blockwise_into(py, xs, block_size, &codes, |s| ScalesMut::F16(s))?
        };
        Ok((codes, scales, lossy))
    })
}

/// Quantize into `codes` and a new scale array of element type `S`, GIL released.
fn blockwise_into<'py, T: Float, S: Element>(
    py: Python<'py>,
    xs: &[T],
    block_size: usize,
    codes: &Bound<'py, PyArray1<i8>>,
    wrap: fn(&mut [S]) -> ScalesMut<'_>,
) -> PyResult<(Bound<'py, PyAny>, usize)> {
    let scales = output::<S>(py, num_blocks(xs.len(), block_size))?;
    let mut cw = writable(codes)?;
    let mut sw = writable(&scales)?;
    let (cs, ss) = (cw.as_slice_mut()?, sw.as_slice_mut()?);
    let report = py
        .detached(|| bw::quantize_blockwise(xs, block_size, cs, wrap(ss)))
        .map_err(|e| to_pyerr(py, e))?;
    Ok((scales.into_any(), report.lossy_blocks))
}

/// Flat float32 dequantization of blockwise `codes` with float16 or float32 `scales`.
#[pyfunction]
#[pyo3(signature = (codes, block_size, scales))]
pub(crate) fn dequantize_blockwise<'py>(
    py: Python<'py>,
    codes: &Bound<'py, PyAny>,
    block_size: usize,
    scales: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let codes = exact::<i8>("data", "int8", codes)?;
    let cs = codes.as_slice()?;
    let out = output::<f32>(py, cs.len())?;
    let mut ow = writable(&out)?;
    let os = ow.as_slice_mut()?;
    let kind = scales
        .cast::<PyUntypedArray>()
        .map(|a| (a.dtype().kind(), a.dtype().itemsize()))
        .unwrap_or((0, 0));
    match kind {
        (b'f', 2) => {
            let s = exact::<f16>("scales", "float16 or float32", scales)?;
            let ss = s.as_slice()?;
            py.detached(|| bw::dequantize_blockwise(cs, block_size, Scales::F16(ss), os))
        }
        (b'f', 4) => {
            let s = exact::<f32>("scales", "float16 or float32", scales)?;
            let ss = s.as_slice()?;
            py.detached(|| bw::dequantize_blockwise(cs, block_size, Scales::F32(ss), os))
        }
        _ => {
            let got = scales
                .getattr("dtype")
                .map(|d| d.to_string())
                .unwrap_or_else(|_| "no dtype".into());
            return Err(dtype_error("scales", "float16 or float32", &got));
        }
    }
    .map_err(|e| to_pyerr(py, e))?;
    Ok(out)
}

/// Register this family's functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quantize_blockwise, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_blockwise, m)?)?;
    Ok(())
}
