//! PyO3 bindings: the native module `ferroquant._ferroquant`.
//!
//! The only module that names `pyo3` or `numpy`. A binding extracts its
//! arguments (dtype, contiguity), releases the GIL around one `ops::` call,
//! maps the error, and hands the freshly allocated outputs to NumPy without a
//! copy. It does no math. One file per family, with the family's stem; each
//! has a `register` called below.

mod affine;
mod arrays;
mod blockwise;
mod dynamic;
mod errors;
mod f16bits;
mod formats;
mod gil;
mod ptq;
mod recycle;
mod runtime;
mod smooth;
mod w8a8;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _ferroquant(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Fill every lazy cache now, while importing (see arrays::warm_up).
    recycle::warm_up(m.py())?;
    arrays::warm_up(m.py())?;
    errors::classes(m.py())?;
    runtime::register(m)?;
    formats::register(m)?;
    blockwise::register(m)?;
    affine::register(m)?;
    dynamic::register(m)?;
    smooth::register(m)?;
    w8a8::register(m)?;
    f16bits::register(m)?;
    ptq::register(m)?;
    Ok(())
}
