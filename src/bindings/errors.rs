//! Mapping of [`QuantError`] to the exception classes of `ferroquant.errors`.
//!
//! The classes are defined in Python (documented, picklable, subclassable);
//! this module looks them up when an error is raised, which is the cold path.

use crate::error::QuantError;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// Build the `ferroquant.errors` exception for `err`, message from its `Display`.
pub(crate) fn to_pyerr(py: Python<'_>, err: QuantError) -> PyErr {
    // Exhaustive on purpose: a new variant must choose its Python class here.
    let class = match &err {
        QuantError::InvalidConfig { .. } | QuantError::ScaleOverflow { .. } => "InvalidConfigError",
        QuantError::ShapeMismatch { .. } => "ShapeMismatchError",
        QuantError::EmptyInput { .. } => "EmptyInputError",
        QuantError::NonFinite { .. } => "NonFiniteError",
        QuantError::Format { .. } => "FormatError",
    };
    let msg = err.to_string();
    let built = (|| -> PyResult<PyErr> {
        let cls = py.import("ferroquant.errors")?.getattr(class)?;
        let exc = match err {
            QuantError::NonFinite { index, .. } => cls.call1((msg.clone(), index))?,
            _ => cls.call1((msg.clone(),))?,
        };
        Ok(PyErr::from_value(exc))
    })();
    // The package ships errors.py beside the native module; if it is somehow
    // missing, still raise a ValueError with the same message.
    built.unwrap_or_else(|_| PyValueError::new_err(msg))
}

/// A `TypeError` naming the argument and the dtype it had.
pub(crate) fn dtype_error(arg: &str, expected: &str, got: &str) -> PyErr {
    PyTypeError::new_err(format!("{arg} must have dtype {expected}, got {got}"))
}
