//! Dynamic activation quantization (SPEC §3) and BitNet activations (SPEC
//! §4): extract, release the GIL around one `ops::dynamic` / `ops::bitnet`
//! call, map the error, return the NumPy-allocated outputs.

use super::arrays::{exact, output, with_float_slice, writable, FloatArray};
use super::errors::to_pyerr;
use super::gil::Detach;
use crate::ops::dynamic::{self as dq, DynCodes, DynCodesMut, DynFormat, ScaleMode};
use crate::ops::pack::packed_len;
use crate::ops::{bitnet, calib};
use crate::simd::fpenv::{narrow, widen};
use numpy::PyArray1;
use pyo3::prelude::*;

fn mode(py: Python<'_>, p: Option<f64>) -> PyResult<ScaleMode> {
    match p {
        None => Ok(ScaleMode::MaxAbs),
        Some(p) => ScaleMode::percentile(p).map_err(|e| to_pyerr(py, e)),
    }
}

fn format(py: Python<'_>, name: &str) -> PyResult<DynFormat> {
    match name {
        "int8_per_tensor" => Ok(DynFormat::Int8PerTensor),
        "int8_per_row" => Ok(DynFormat::Int8PerRow),
        "int4_per_tensor" => Ok(DynFormat::Int4PerTensor),
        other => Err(to_pyerr(
            py,
            crate::QuantError::invalid(
                "format",
                format!("expected int8_per_tensor, int8_per_row or int4_per_tensor, got {other:?}"),
            ),
        )),
    }
}

/// Seed 002's `compute_scale` of the flattened `x` (`p`: percentile, or
/// `None` for max-abs).
#[pyfunction]
#[pyo3(signature = (x, clip_val, p))]
pub(crate) fn compute_scale(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    clip_val: f64,
    p: Option<f64>,
) -> PyResult<f64> {
    let mode = mode(py, p)?;
    let clip_val = narrow(clip_val);
    let x = FloatArray::extract("x", x)?;
    let scale = with_float_slice!(x, xs => {
        if xs.len() < 65536 {
            dq::compute_scale(xs, clip_val, mode)
        } else {
            py.detached(|| dq::compute_scale(xs, clip_val, mode))
        }
    });
    scale.map(widen).map_err(|e| to_pyerr(py, e))
}

/// `(data, scales)`: int8 codes (or uint8 packed int4 bytes) of the C-order
/// `x` and float32 scales, in `format` (`p`: percentile, or `None` for max-abs).
#[pyfunction]
#[pyo3(signature = (x, format, p))]
pub(crate) fn quantize_dynamic<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    format: &str,
    p: Option<f64>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyArray1<f32>>)> {
    let (fmt, mode) = (self::format(py, format)?, self::mode(py, p)?);
    let shape: Vec<usize> = x.getattr("shape")?.extract()?;
    let x = FloatArray::extract("x", x)?;
    with_float_slice!(x, xs => {
        let scales = output::<f32>(py, dq::num_scales(&shape, fmt))?;
        let mut sw = writable(&scales)?;
        let ss = sw.as_slice_mut()?;
        let data = match fmt {
            DynFormat::Int4PerTensor => {
                let d = output::<u8>(py, packed_len(xs.len()))?;
                let mut dw = writable(&d)?;
                let ds = dw.as_slice_mut()?;
                py.detached(|| dq::dynamic_quantize(xs, &shape, fmt, mode, DynCodesMut::Int4(ds), ss))
                    .map_err(|e| to_pyerr(py, e))?;
                d.into_any()
            }
            _ => {
                let d = output::<i8>(py, xs.len())?;
                let mut dw = writable(&d)?;
                let ds = dw.as_slice_mut()?;
                py.detached(|| dq::dynamic_quantize(xs, &shape, fmt, mode, DynCodesMut::Int8(ds), ss))
                    .map_err(|e| to_pyerr(py, e))?;
                d.into_any()
            }
        };
        drop(sw);
        Ok((data, scales))
    })
}

/// Flat float32 values `q * scale` of `n` codes in groups of `group`
/// (int8 `data`, or uint8 packed int4 when `int4`).
#[pyfunction]
#[pyo3(signature = (data, n, group, scales, int4))]
pub(crate) fn dequantize_groups<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    n: usize,
    group: usize,
    scales: &Bound<'py, PyAny>,
    int4: bool,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let s = exact::<f32>("scales", "float32", scales)?;
    let ss = s.as_slice()?;
    let out = output::<f32>(py, n)?;
    {
        let mut ow = writable(&out)?;
        let os = ow.as_slice_mut()?;
        if int4 {
            let d = exact::<u8>("data", "uint8", data)?;
            let ds = d.as_slice()?;
            py.detached(|| dq::dequantize_groups(DynCodes::Int4(ds), group, ss, os))
        } else {
            let d = exact::<i8>("data", "int8", data)?;
            let ds = d.as_slice()?;
            py.detached(|| dq::dequantize_groups(DynCodes::Int8(ds), group, ss, os))
        }
        .map_err(|e| to_pyerr(py, e))?;
    }
    Ok(out)
}

/// int8 codes and float32 scales.
type Codes8AndScales<'py> = (Bound<'py, PyArray1<i8>>, Bound<'py, PyArray1<f32>>);

/// `(data, scales)`: BitNet int8 codes of the C-order `x` and one float32
/// scale for each of `groups` equal groups of consecutive elements.
#[pyfunction]
#[pyo3(signature = (x, groups, bits))]
pub(crate) fn quantize_bitnet<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    groups: usize,
    bits: u32,
) -> PyResult<Codes8AndScales<'py>> {
    bitnet::rule(bits).map_err(|e| to_pyerr(py, e))?;
    let x = FloatArray::extract("x", x)?;
    with_float_slice!(x, xs => {
        let group = xs.len().checked_div(groups).unwrap_or(0);
        let codes = output::<i8>(py, xs.len())?;
        let scales = output::<f32>(py, groups)?;
        {
            let (mut cw, mut sw) = (writable(&codes)?, writable(&scales)?);
            let (cs, ss) = (cw.as_slice_mut()?, sw.as_slice_mut()?);
            py.detached(|| bitnet::quantize_activations(xs, group, bits, cs, ss))
                .map_err(|e| to_pyerr(py, e))?;
        }
        Ok((codes, scales))
    })
}

/// float32 `q · scale` of BitNet's codes of the C-order `x` (`groups` equal
/// groups), without holding every code: the straight-through estimator.
#[pyfunction]
#[pyo3(signature = (x, groups, bits))]
pub(crate) fn fake_quantize_bitnet<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    groups: usize,
    bits: u32,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    bitnet::rule(bits).map_err(|e| to_pyerr(py, e))?;
    let x = FloatArray::extract("x", x)?;
    with_float_slice!(x, xs => {
        let group = xs.len().checked_div(groups).unwrap_or(0);
        let out = output::<f32>(py, xs.len())?;
        {
            let mut ow = writable(&out)?;
            let os = ow.as_slice_mut()?;
            py.detached(|| bitnet::fake_quantize_activations(xs, group, bits, os))
                .map_err(|e| to_pyerr(py, e))?;
        }
        Ok(out)
    })
}

/// Seed 002's `quantization_mae` of the flat `original` against the `n`
/// values of `data` (int8, or int4 packed) times the scale of each one's
/// group, without materializing them.
#[pyfunction]
#[pyo3(signature = (original, data, n, group, scales, int4))]
pub(crate) fn quantization_mae(
    py: Python<'_>,
    original: &Bound<'_, PyAny>,
    data: &Bound<'_, PyAny>,
    n: usize,
    group: usize,
    scales: &Bound<'_, PyAny>,
    int4: bool,
) -> PyResult<f64> {
    let s = exact::<f32>("scales", "float32", scales)?;
    let ss = s.as_slice()?;
    let x = FloatArray::extract("original", original)?;
    if int4 {
        let d = exact::<u8>("data", "uint8", data)?;
        let ds = d.as_slice()?;
        with_float_slice!(x, xs => py.detached(|| {
            dq::quantization_mae_codes(xs, DynCodes::Int4(ds), n, group, ss)
        }))
    } else {
        let d = exact::<i8>("data", "int8", data)?;
        let ds = d.as_slice()?;
        with_float_slice!(x, xs => py.detached(|| {
            dq::quantization_mae_codes(xs, DynCodes::Int8(ds), n, group, ss)
        }))
    }
    .map(widen)
    .map_err(|e| to_pyerr(py, e))
}

/// `CalibStats.collect`'s state: `ops::calib::CalibAccumulator` behind a
/// Python object, one batch per `push` (the GIL released around it).
#[pyclass(module = "ferroquant._ferroquant")]
pub(crate) struct CalibAccumulator {
    inner: Option<calib::CalibAccumulator>,
}

/// `(min, max, mean, std_dev, p99, suggested_scale, exact, spill_error)`.
/// Floats widened exactly (whatever the caller's flags) for Python.
type CalibResult = (f64, f64, f64, f64, f64, f64, bool, Option<String>);

#[pymethods]
impl CalibAccumulator {
    #[new]
    #[pyo3(signature = (total=None, spill_dir=None))]
    fn new(total: Option<u64>, spill_dir: Option<std::path::PathBuf>) -> Self {
        let acc = calib::CalibAccumulator::new(total);
        CalibAccumulator {
            inner: Some(match spill_dir {
                Some(dir) => acc.with_spill_dir(dir),
                None => acc,
            }),
        }
    }

    /// Values seen so far.
    fn count(&self) -> u64 {
        self.inner.as_ref().map_or(0, |a| a.count())
    }

    /// Add one C-contiguous float batch (`NonFiniteError` indexes all batches).
    fn push(&mut self, py: Python<'_>, batch: &Bound<'_, PyAny>) -> PyResult<()> {
        let acc = self.inner.as_mut().ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err("the accumulator is finished")
        })?;
        let x = FloatArray::extract("batch", batch)?;
        with_float_slice!(x, xs => py.detached(|| acc.push(xs))).map_err(|e| to_pyerr(py, e))
    }

    /// Drop the state now (its temporary file too), not when the object goes:
    /// an exception's traceback can keep the object alive.
    fn discard(&mut self) {
        self.inner = None;
    }

    /// The statistics; the accumulator is spent.
    fn finish(&mut self) -> PyResult<CalibResult> {
        let acc = self.inner.take().ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err("the accumulator is finished")
        })?;
        let out = acc.finish();
        let s = out.stats;
        Ok((
            widen(s.min),
            widen(s.max),
            widen(s.mean),
            widen(s.std_dev),
            widen(s.p99),
            widen(s.suggested_scale),
            out.exact,
            out.spill_error,
        ))
    }
}

/// Register this family's functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compute_scale, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_dynamic, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_groups, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_bitnet, m)?)?;
    m.add_function(wrap_pyfunction!(fake_quantize_bitnet, m)?)?;
    m.add_class::<CalibAccumulator>()?;
    m.add_function(wrap_pyfunction!(quantization_mae, m)?)?;
    Ok(())
}
