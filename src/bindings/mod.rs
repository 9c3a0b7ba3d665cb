//! PyO3 bindings: the native module `ferroquant._ferroquant`.
//!
//! The only module that names `pyo3` or `numpy`. A binding extracts its
//! arguments (dtype, contiguity), releases the GIL around one `ops::` call,
//! maps the error, and hands the freshly allocated outputs to NumPy without a
//! copy. It does no math. The Python package (`python/ferroquant/functional.py`)
//! is its only caller and prepares the inputs (contiguous, native byte order).

mod arrays;
mod errors;
mod ops;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _ferroquant(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(ops::quantize_blockwise, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dequantize_blockwise, m)?)?;
    m.add_function(wrap_pyfunction!(ops::set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(ops::get_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(ops::simd_isa, m)?)?;
    m.add_function(wrap_pyfunction!(ops::supported_isas, m)?)?;
    Ok(())
}
