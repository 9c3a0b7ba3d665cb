//! W8A8 integer products (SPEC §3): extract, release the GIL around one
//! `ops::w8a8` call, map the error, return the NumPy-allocated result.

use super::arrays::{exact, output, with_float_slice, writable, FloatArray};
use super::errors::to_pyerr;
use crate::ops::w8a8::{w8a8_matmul_with, Batch};
use numpy::PyArray1;
use pyo3::prelude::*;

/// Flat float32 `[tokens, out_features]` (or `[out_features]` when `tokens`
/// is `None`: one activation vector with one scale) of the int8 `weight`
/// (`[out_features, in_features]`, C order) times the quantized activations.
#[pyfunction]
#[pyo3(signature = (weight, out_features, in_features, weight_scales, activations, tokens))]
pub(crate) fn w8a8_product<'py>(
    py: Python<'py>,
    weight: &Bound<'py, PyAny>,
    out_features: usize,
    in_features: usize,
    weight_scales: &Bound<'py, PyAny>,
    activations: &Bound<'py, PyAny>,
    tokens: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let w = exact::<i8>("weight_i8", "int8", weight)?;
    let ws = exact::<f32>("weight_scales", "float32", weight_scales)?;
    let (wv, wsv) = (w.as_slice()?, ws.as_slice()?);
    let (batch, n_out) = match tokens {
        None => (Batch::Vector, out_features),
        Some(t) => (Batch::Tokens(t), t.saturating_mul(out_features)),
    };
    let x = FloatArray::extract("activations", activations)?;
    with_float_slice!(x, xs => {
        let codes = output::<i8>(py, xs.len())?;
        let out = output::<f32>(py, n_out)?;
        {
            let mut cw = writable(&codes)?;
            let mut ow = writable(&out)?;
            let (cs, os) = (cw.as_slice_mut()?, ow.as_slice_mut()?);
            let shape = [out_features, in_features];
            let isa = crate::simd::Isa::detected();
            py.detach(|| w8a8_matmul_with(isa, wv, shape, wsv, xs, batch, cs, os))
                .map_err(|e| to_pyerr(py, e))?;
        }
        Ok(out)
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(w8a8_product, m)?)?;
    Ok(())
}
