//! Mapping of [`QuantError`] to the exception classes of `ferroquant.errors`.
//!
//! The classes are defined in Python (documented, picklable, subclassable).
//! They are looked up once, on the first error, and cached; there is no
//! fallback to a generic class: if the package's own `errors` module cannot be
//! imported, that import error is what the caller sees.

use crate::error::QuantError;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The exception classes, in the order of [`Class`].
static CLASSES: PyOnceLock<[Py<PyType>; 5]> = PyOnceLock::new();

/// The Python class of each error kind.
#[derive(Clone, Copy)]
enum Class {
    InvalidConfig = 0,
    ShapeMismatch = 1,
    EmptyInput = 2,
    NonFinite = 3,
    Format = 4,
}

const NAMES: [&str; 5] = [
    "InvalidConfigError",
    "ShapeMismatchError",
    "EmptyInputError",
    "NonFiniteError",
    "FormatError",
];

/// The exception classes (looked up on the first call; the module calls it at import).
pub(crate) fn classes(py: Python<'_>) -> PyResult<&[Py<PyType>; 5]> {
    CLASSES.get_or_try_init(py, || {
        let module = py.import("ferroquant.errors")?;
        let get = |i: usize| -> PyResult<Py<PyType>> {
            Ok(module.getattr(NAMES[i])?.cast_into::<PyType>()?.unbind())
        };
        Ok([get(0)?, get(1)?, get(2)?, get(3)?, get(4)?])
    })
}

/// Build the `ferroquant.errors` exception for `err`, message from its `Display`.
pub(crate) fn to_pyerr(py: Python<'_>, err: QuantError) -> PyErr {
    // Exhaustive on purpose: a new variant must choose its Python class here.
    let class = match &err {
        QuantError::InvalidConfig { .. } | QuantError::ScaleOverflow { .. } => Class::InvalidConfig,
        QuantError::ShapeMismatch { .. } => Class::ShapeMismatch,
        QuantError::EmptyInput { .. } => Class::EmptyInput,
        QuantError::NonFinite { .. } => Class::NonFinite,
        QuantError::Format { .. } => Class::Format,
        // Python's own class, as for an output NumPy could not allocate.
        QuantError::OutOfMemory { .. } => {
            return pyo3::exceptions::PyMemoryError::new_err(err.to_string())
        }
    };
    let msg = match &err {
        // The core speaks of float32 scales; Python's argument is scale_dtype.
        QuantError::ScaleOverflow { block, scale } => format!(
            "invalid scale_dtype: the scale of block {block} (max |x| / 127 = {scale:e}) \
             overflows float16 (largest finite 65504); use scale_dtype=np.float32"
        ),
        _ => err.to_string(),
    };
    // The classes are Python code, which may let another thread take the GIL.
    let built = super::gil::may_release(py, || -> PyResult<PyErr> {
        let cls = classes(py)?[class as usize].bind(py);
        let exc = match err {
            QuantError::NonFinite { index, .. } => cls.call1((msg, index))?,
            _ => cls.call1((msg,))?,
        };
        Ok(PyErr::from_value(exc))
    });
    built.unwrap_or_else(|e| e)
}

/// A `TypeError` naming the argument and the dtype it had.
pub(crate) fn dtype_error(arg: &str, expected: &str, got: &str) -> PyErr {
    PyTypeError::new_err(format!("{arg} must have dtype {expected}, got {got}"))
}

/// An `OSError` carrying the OS error number (so Python picks the subclass and
/// reports the cause: `File too large`, `No space left on device`).
pub(crate) fn os_error(e: std::io::Error) -> PyErr {
    match e.raw_os_error() {
        Some(code) => {
            // The system's text ("File too large"), as Python's own OSError has it.
            let text = e.to_string();
            let strerror = text.split(" (os error").next().unwrap_or(&text).to_string();
            pyo3::exceptions::PyOSError::new_err((code, strerror))
        }
        None => PyErr::from(e),
    }
}
