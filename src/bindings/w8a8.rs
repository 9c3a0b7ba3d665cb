//! W8A8 integer products (SPEC §3) and the quantized linear layer's fused
//! forward pass (SPEC §2): extract, release the GIL around one
//! `ops::w8a8` call, map the error, return the NumPy-allocated result.

use super::arrays::{exact, output, with_float_slice, writable, FloatArray};
use super::errors::to_pyerr;
use super::gil::Detach;
use crate::ops::linear::{self, DequantDtype, QuantizedWeight, WeightCodes};
use crate::ops::w8a8::{w8a8_matmul_with, Batch};
use numpy::PyArray1;
use pyo3::exceptions::PyValueError;
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
            py.detached(|| w8a8_matmul_with(isa, wv, shape, wsv, xs, batch, cs, os))
                .map_err(|e| to_pyerr(py, e))?;
        }
        Ok(out)
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(w8a8_product, m)?)?;
    m.add_function(wrap_pyfunction!(linear_forward, m)?)?;
    Ok(())
}

/// Flat float32 `[tokens, out_features]`: `x @ dequant(W).T + bias` for an
/// int8 (`bits == 8`) or packed int4 weight with `scales` / `zero_points`
/// (`out_features` of each, or one), never materializing the float weight;
/// `dequant_dtype` is the dtype `dequantize` gives (the source tensor's).
#[pyfunction]
#[pyo3(signature = (codes, bits, out_features, in_features, scales, zero_points, x, tokens, bias, dequant_dtype))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_forward<'py>(
    py: Python<'py>,
    codes: &Bound<'py, PyAny>,
    bits: u32,
    out_features: usize,
    in_features: usize,
    scales: &Bound<'py, PyAny>,
    zero_points: &Bound<'py, PyAny>,
    x: &Bound<'py, PyAny>,
    tokens: usize,
    bias: Option<&Bound<'py, PyAny>>,
    dequant_dtype: &str,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let dequant = DequantDtype::from_name(dequant_dtype).ok_or_else(|| {
        PyValueError::new_err(format!(
            "dequant_dtype: expected float32, float64, float16 or bfloat16, got {dequant_dtype:?}"
        ))
    })?;
    let s = exact::<f64>("scales", "float64", scales)?;
    let z = exact::<f64>("zero_points", "float64", zero_points)?;
    // Any of the four float dtypes, converted a block of tokens at a time.
    let xa = FloatArray::extract("x", x)?;
    let b = bias
        .map(|b| exact::<f32>("bias", "float32", b))
        .transpose()?;
    let (i8c, u8c);
    let weight_codes = if bits == 4 {
        u8c = exact::<u8>("data", "uint8", codes)?;
        WeightCodes::Int4(u8c.as_slice()?)
    } else {
        i8c = exact::<i8>("data", "int8", codes)?;
        WeightCodes::Int8(i8c.as_slice()?)
    };
    let w = QuantizedWeight {
        codes: weight_codes,
        shape: [out_features, in_features],
        scales: s.as_slice()?,
        zero_points: z.as_slice()?,
        dequant,
    };
    let bs = b.as_ref().map(|b| b.as_slice()).transpose()?;
    let out = output::<f32>(py, tokens.saturating_mul(out_features))?;
    {
        let mut ow = writable(&out)?;
        let os = ow.as_slice_mut()?;
        with_float_slice!(xa, xs => {
            py.detached(|| linear::linear_forward_from(&w, xs, tokens, bs, os))
                .map_err(|e| to_pyerr(py, e))?;
        });
    }
    Ok(out)
}
