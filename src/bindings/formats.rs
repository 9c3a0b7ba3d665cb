//! File-format helpers: the safetensors header parser.

use super::errors::to_pyerr;
use crate::formats::safetensors_header::parse_header;
use pyo3::prelude::*;

/// One tensor of a header: `(name, dtype tag, shape, start, end)`.
type Entry = (String, String, Vec<usize>, usize, usize);
/// A parsed header: metadata pairs and tensors.
type Parsed = (Vec<(String, String)>, Vec<Entry>);

/// Parse and validate a safetensors JSON header (see `formats::safetensors_header`):
/// `(metadata pairs sorted by key, tensors in offset order)`.
#[pyfunction]
pub(crate) fn parse_safetensors_header(
    py: Python<'_>,
    header: &[u8],
    file_len: usize,
    max_ndim: usize,
) -> PyResult<Parsed> {
    let h = py
        .detach(|| parse_header(header, file_len, max_ndim))
        .map_err(|e| to_pyerr(py, e))?;
    let tensors = h
        .tensors
        .into_iter()
        .map(|t| (t.name, t.dtype, t.shape, t.start, t.end))
        .collect();
    Ok((h.metadata, tensors))
}

/// Register these functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_safetensors_header, m)?)?;
    Ok(())
}
