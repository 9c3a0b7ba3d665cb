//! File-format helpers: the safetensors header parser, and the spill a
//! streaming writer keeps its tensors in.

use super::arrays::exact;
use super::errors::{os_error, to_pyerr};
use super::gil::Detach;
use crate::error::QuantError;
use crate::formats::safetensors_header::{parse_header, sort_metadata, sort_metadata_in_file};
use crate::formats::spilled::{self, Spilled, WriteError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::path::PathBuf;

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
        .detached(|| parse_header(header, file_len, max_ndim))
        .map_err(|e| to_pyerr(py, e))?;
    let tensors = h
        .tensors
        .into_iter()
        .map(|t| (t.name, t.dtype, t.shape, t.start, t.end))
        .collect();
    Ok((h.metadata, tensors))
}

/// `formats::spilled::SpillFile` for Python: tensors' bytes appended to an
/// unnamed temporary file, then the safetensors file written from it one
/// tensor at a time (the GIL released).
#[pyclass(module = "ferroquant._ferroquant")]
pub(crate) struct SpillFile {
    inner: Option<spilled::SpillFile>,
}

/// One spilled tensor: `(name, safetensors dtype tag, shape, offset, length)`.
type SpilledEntry = (String, String, Vec<usize>, u64, usize);

impl SpillFile {
    fn open(&mut self) -> PyResult<&mut spilled::SpillFile> {
        self.inner
            .as_mut()
            .ok_or_else(|| pyo3::exceptions::PyValueError::new_err("the spill is closed"))
    }
}

#[pymethods]
impl SpillFile {
    /// A new spill in directory `dir`.
    #[new]
    fn new(py: Python<'_>, dir: PathBuf) -> PyResult<Self> {
        let inner = py
            .detached(|| spilled::SpillFile::new_in(&dir))
            .map_err(os_error)?;
        Ok(SpillFile { inner: Some(inner) })
    }

    /// Append the bytes of the C-contiguous uint8 array `data`; returns their offset.
    fn append(&mut self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
        let d = exact::<u8>("data", "uint8", data)?;
        let bytes = d.as_slice()?;
        let inner = self.open()?;
        py.detached(|| inner.append(bytes)).map_err(os_error)
    }

    /// Write the safetensors file `path` from `tensors` and `metadata`.
    #[pyo3(signature = (path, tensors, metadata=None))]
    fn write_safetensors(
        &mut self,
        py: Python<'_>,
        path: PathBuf,
        tensors: Vec<SpilledEntry>,
        metadata: Option<HashMap<String, String>>,
    ) -> PyResult<()> {
        let tensors: Vec<Spilled> = tensors
            .into_iter()
            .map(|(name, dtype, shape, offset, len)| Spilled {
                name,
                dtype,
                shape,
                offset,
                len,
            })
            .collect();
        let inner = self.open()?;
        py.detached(|| inner.write_safetensors(&tensors, metadata, &path))
            .map_err(|e| match e {
                WriteError::Io(e) => os_error(e),
                WriteError::OutOfMemory(_) => {
                    pyo3::exceptions::PyMemoryError::new_err(e.to_string())
                }
                WriteError::Format(msg) => to_pyerr(py, QuantError::Format { msg }),
            })
    }

    /// Drop the spill (its space is freed).
    fn close(&mut self) {
        self.inner = None;
    }

    /// Whether the spill was dropped.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_none()
    }
}

/// The header (JSON, without its length prefix) with its `__metadata__` entries
/// in key order, or `None` if it is already so or is not the `safetensors`
/// writer's (see `formats::safetensors_header::sort_metadata`).
#[pyfunction]
fn sort_safetensors_metadata(py: Python<'_>, header: &[u8]) -> Option<Py<PyBytes>> {
    let mut h = header.to_vec();
    sort_metadata(&mut h).then(|| PyBytes::new(py, &h).unbind())
}

/// `sort_safetensors_metadata` on the file at `path`, in place.
#[pyfunction]
fn sort_safetensors_metadata_file(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.detached(|| sort_metadata_in_file(&path))
        .map_err(os_error)
}

/// Register these functions.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_safetensors_header, m)?)?;
    m.add_function(wrap_pyfunction!(sort_safetensors_metadata, m)?)?;
    m.add_function(wrap_pyfunction!(sort_safetensors_metadata_file, m)?)?;
    m.add_class::<SpillFile>()?;
    Ok(())
}
