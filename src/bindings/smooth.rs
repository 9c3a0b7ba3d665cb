//! SmoothQuant (SPEC §3): factors from two matrices of any float dtype, and
//! the in-place smoothing of a writable C-contiguous float32 array.

use super::arrays::{exact, output, with_float_slice, writable, FloatArray};
use super::errors::to_pyerr;
use super::gil::Detach;
use crate::ops::smooth::{self as sm, SmoothQuantConfig};
use crate::simd::fpenv::narrow;
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// `float32[cols]` smoothing factors of `activations` and `weights` (flattened,
/// rows of `cols`).
#[pyfunction]
#[pyo3(signature = (activations, weights, cols, alpha, epsilon))]
pub(crate) fn compute_smooth_factors<'py>(
    py: Python<'py>,
    activations: &Bound<'py, PyAny>,
    weights: &Bound<'py, PyAny>,
    cols: usize,
    alpha: f64,
    epsilon: f64,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let config = SmoothQuantConfig::new(narrow(alpha), narrow(epsilon));
    let config = config.map_err(|e| to_pyerr(py, e))?;
    let a = FloatArray::extract("activations", activations)?;
    let w = FloatArray::extract("weights", weights)?;
    let out = output::<f32>(py, cols)?;
    {
        let mut ow = writable(&out)?;
        let os = ow.as_slice_mut()?;
        with_float_slice!(a, av => {
            with_float_slice!(w, wv => {
                py.detached(|| sm::compute_smooth_factors_into(av, wv, cols, &config, os))
            })
        })
        .map_err(|e| to_pyerr(py, e))?;
    }
    Ok(out)
}

/// Divide (`multiply == false`) or multiply the rows of `x` by the factors,
/// in place.
#[pyfunction]
#[pyo3(signature = (x, arg, factors, multiply))]
pub(crate) fn smooth_in_place(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    arg: &str,
    factors: &Bound<'_, PyAny>,
    multiply: bool,
) -> PyResult<()> {
    let arr = x.cast::<PyArrayDyn<f32>>().map_err(|_| {
        PyValueError::new_err(format!(
            "{arg} must be a writable C-contiguous float32 array"
        ))
    })?;
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{arg} must be C-contiguous")));
    }
    let s = exact::<f32>("s", "float32", factors)?;
    let ss = s.as_slice()?;
    let mut rw = arr
        .try_readwrite()
        .map_err(|e| super::arrays::borrow_error(arg, e))?;
    // An empty array's pointer may be misaligned (see `misaligned_empty`): nothing
    // to smooth, but the factors are still checked.
    let mut none: [f32; 0] = [];
    let xs: &mut [f32] = if super::arrays::misaligned_empty(arr) {
        &mut none
    } else {
        rw.as_slice_mut()?
    };
    py.detached(|| {
        if multiply {
            sm::smooth_weights(xs, ss)
        } else {
            sm::smooth_activations(xs, ss)
        }
    })
    .map_err(|e| to_pyerr(py, e))
}

/// Register this family's functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compute_smooth_factors, m)?)?;
    m.add_function(wrap_pyfunction!(smooth_in_place, m)?)?;
    Ok(())
}
