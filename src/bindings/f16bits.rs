//! float16 bits (SPEC §5): extract, release the GIL around one
//! `ops::f16bits` call, return the NumPy-allocated result (flat).

use super::arrays::{exact, output, with_float_slice, writable, FloatArray};
use super::errors::to_pyerr;
use super::gil::Detach;
use crate::ops::f16bits;
use numpy::PyArray1;
use pyo3::prelude::*;

/// Flat uint16 binary16 bits of the float `x` (C order; f64, f16 and bf16
/// values read as f32 first, as every kernel reads them).
#[pyfunction]
pub(crate) fn fp32_to_fp16_bits<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u16>>> {
    let x = FloatArray::extract("x", x)?;
    with_float_slice!(x, xs => {
        let out = output::<u16>(py, xs.len())?;
        {
            let mut ow = writable(&out)?;
            let os = ow.as_slice_mut()?;
            py.detached(|| f16bits::float_to_fp16_bits(xs, os))
                .map_err(|e| to_pyerr(py, e))?;
        }
        Ok(out)
    })
}

/// Flat float32 values of the uint16 binary16 `bits` (C order).
#[pyfunction]
pub(crate) fn fp16_bits_to_fp32<'py>(
    py: Python<'py>,
    bits: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let b = exact::<u16>("bits", "uint16", bits)?;
    let bs = b.as_slice()?;
    let out = output::<f32>(py, bs.len())?;
    {
        let mut ow = writable(&out)?;
        let os = ow.as_slice_mut()?;
        py.detached(|| f16bits::fp16_bits_to_fp32(bs, os))
            .map_err(|e| to_pyerr(py, e))?;
    }
    Ok(out)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(fp32_to_fp16_bits, m)?)?;
    m.add_function(wrap_pyfunction!(fp16_bits_to_fp32, m)?)?;
    Ok(())
}
