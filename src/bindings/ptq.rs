//! Post-training int8 (SPEC §5): the weight kernels and the seed's JSON,
//! written and read by `ops::ptq` (serde), so Python writes the same bytes
//! as the Rust seed.

use super::arrays::{exact, output, with_float_slice, writable, FloatArray};
use super::errors::{os_error, to_pyerr};
use super::gil::Detach;
use crate::ops::ptq::{self, QuantizedModel, QuantizedModelRef, QuantizedWeightsRef};
use crate::simd::fpenv::{narrow, widen};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArrayDyn};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// `(codes, scale)`: the seed's `from_f32` of the C-order `w` (flat int8 codes).
#[pyfunction]
#[pyo3(signature = (w, scale))]
pub(crate) fn ptq_quantize<'py>(
    py: Python<'py>,
    w: &Bound<'py, PyAny>,
    scale: Option<f64>,
) -> PyResult<(Bound<'py, PyArray1<i8>>, f64)> {
    let scale = scale.map(narrow);
    let w = FloatArray::extract("w", w)?;
    with_float_slice!(w, ws => {
        let codes = output::<i8>(py, ws.len())?;
        let s = {
            let mut cw = writable(&codes)?;
            let cs = cw.as_slice_mut()?;
            py.detached(|| ptq::quantize_weights(ws, scale, cs)).map_err(|e| to_pyerr(py, e))?
        };
        Ok((codes, widen(s)))
    })
}

/// `(min, max)` of the C-order `w` read as float32.
#[pyfunction]
pub(crate) fn ptq_range(py: Python<'_>, w: &Bound<'_, PyAny>) -> PyResult<(f64, f64)> {
    let w = FloatArray::extract("w", w)?;
    with_float_slice!(w, ws => py.detached(|| ptq::weight_range(ws)))
        .map(|(lo, hi)| (widen(lo), widen(hi)))
        .map_err(|e| to_pyerr(py, e))
}

/// One layer as Python passes it: name, int8 codes, shape, scale, bias.
type LayerArgs<'py> = (
    String,
    Bound<'py, PyAny>,
    Vec<usize>,
    f64,
    Option<Bound<'py, PyAny>>,
);

/// The seed's `to_string_pretty` bytes of a model, written to `path`, or
/// returned when `path` is `None`.
#[pyfunction]
#[pyo3(signature = (path, config_json, layers, scheme, total_quantized_bytes, total_fp32_bytes))]
pub(crate) fn ptq_write_json<'py>(
    py: Python<'py>,
    path: Option<std::path::PathBuf>,
    config_json: &str,
    layers: Vec<LayerArgs<'py>>,
    scheme: &str,
    total_quantized_bytes: usize,
    total_fp32_bytes: usize,
) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let mut held: Vec<(
        PyReadonlyArrayDyn<'py, i8>,
        Option<PyReadonlyArrayDyn<'py, f32>>,
    )> = Vec::with_capacity(layers.len());
    for (_, w, _, _, b) in &layers {
        let w = exact::<i8>("weights_i8", "int8", w)?;
        let b = match b {
            Some(b) => Some(exact::<f32>("bias", "float32", b)?),
            None => None,
        };
        held.push((w, b));
    }
    let mut views = Vec::with_capacity(layers.len());
    for ((name, _, shape, scale, _), (w, b)) in layers.iter().zip(&held) {
        views.push(QuantizedWeightsRef {
            name,
            weights_i8: w.as_slice()?,
            shape,
            scale: narrow(*scale),
            bias: match b {
                Some(b) => Some(b.as_slice()?),
                None => None,
            },
        });
    }
    let model = QuantizedModelRef {
        config_json,
        layers: views,
        scheme,
        total_quantized_bytes,
        total_fp32_bytes,
    };
    match path {
        None => {
            let mut buf = Vec::new();
            py.detached(|| model.write_json(&mut buf))
                .map_err(|e| to_pyerr(py, e))?;
            Ok(Some(PyBytes::new(py, &buf)))
        }
        Some(path) => {
            let written = py
                .detached(|| -> std::io::Result<crate::Result<()>> {
                    let file = std::fs::File::create(&path)?;
                    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
                    let r = model.write_json(&mut w);
                    std::io::Write::flush(&mut w)?;
                    Ok(r)
                })
                .map_err(os_error)?;
            written.map_err(|e| to_pyerr(py, e))?;
            Ok(None)
        }
    }
}

/// A parsed model: `(config_json, scheme, total_quantized_bytes,
/// total_fp32_bytes, [(name, codes, shape, scale, bias | None), ...])`.
type ModelParts<'py> = (String, String, usize, usize, Bound<'py, PyList>);

/// Parse and check the seed's JSON model (`FormatError` for anything wrong).
#[pyfunction]
pub(crate) fn ptq_read_json<'py>(py: Python<'py>, data: &[u8]) -> PyResult<ModelParts<'py>> {
    let model = py
        .detached(|| QuantizedModel::from_json(data))
        .map_err(|e| to_pyerr(py, e))?;
    let layers = PyList::empty(py);
    for l in model.layers {
        let codes = l.weights_i8.into_pyarray(py);
        let bias = l.bias.map(|b| b.into_pyarray(py));
        layers.append((l.name, codes, l.shape, widen(l.scale), bias))?;
    }
    Ok((
        model.config_json,
        model.scheme,
        model.total_quantized_bytes,
        model.total_fp32_bytes,
        layers,
    ))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(ptq_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(ptq_range, m)?)?;
    m.add_function(wrap_pyfunction!(ptq_write_json, m)?)?;
    m.add_function(wrap_pyfunction!(ptq_read_json, m)?)?;
    Ok(())
}
