//! Extraction of NumPy arguments into typed, contiguous, read-only views.

use super::errors::dtype_error;
use half::{bf16, f16};
use numpy::{
    dtype, BorrowError, Element, PyArray1, PyArrayDescr, PyArrayDescrMethods, PyArrayDyn,
    PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// A floating-point input array of one of the four supported dtypes.
pub(crate) enum FloatArray<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    F64(PyReadonlyArrayDyn<'py, f64>),
    F16(PyReadonlyArrayDyn<'py, f16>),
    BF16(PyReadonlyArrayDyn<'py, bf16>),
}

fn untyped<'a, 'py>(
    arg: &str,
    x: &'a Bound<'py, PyAny>,
) -> PyResult<&'a Bound<'py, PyUntypedArray>> {
    x.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{arg} must be a numpy.ndarray, got {}",
            x.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })
}

/// The error for an argument rust-numpy would not lend: in use by a call on
/// another thread (which holds it for writing, or reads it while this call
/// would write), or read-only.
pub(crate) fn borrow_error(arg: &str, e: BorrowError) -> PyErr {
    PyValueError::new_err(match e {
        BorrowError::AlreadyBorrowed => format!(
            "{arg} is in use by another ferroquant call (on another thread) that \
             writes it, or reads it while this call would write it: wait for that \
             call, or pass a copy"
        ),
        BorrowError::NotWriteable => format!("{arg} must be writable (it is read-only)"),
        other => format!("{arg} cannot be used: {other}"),
    })
}

fn readonly<'py, T: Element>(
    arg: &str,
    x: &Bound<'py, PyAny>,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let arr = x
        .cast::<PyArrayDyn<T>>()
        .map_err(|e| PyTypeError::new_err(format!("{arg}: {e}")))?;
    if misaligned_empty(arr) {
        // NumPy calls an empty array aligned whatever its pointer (a view at an odd
        // byte offset), but a Rust slice, even an empty one, must be aligned: lend
        // an empty array of the same shape that NumPy allocated instead.
        let fresh = output::<T>(x.py(), 0)?.reshape(arr.shape())?;
        return fresh.try_readonly().map_err(|e| borrow_error(arg, e));
    }
    let ro = arr.try_readonly().map_err(|e| borrow_error(arg, e))?;
    if !ro.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{arg} must be C-contiguous")));
    }
    Ok(ro)
}

/// Whether `arr` has no elements and a data pointer not aligned for `T`: its
/// elements cannot be lent as a slice (see [`readonly`]).
pub(crate) fn misaligned_empty<T: Element>(arr: &Bound<'_, PyArrayDyn<T>>) -> bool {
    arr.len() == 0 && !(arr.data() as usize).is_multiple_of(std::mem::align_of::<T>())
}

fn dtype_str(arr: &Bound<'_, PyUntypedArray>) -> String {
    arr.dtype().str().map(|s| s.to_string()).unwrap_or_default()
}

impl<'py> FloatArray<'py> {
    /// Accept a C-contiguous, native-byte-order float32/float64/float16/bfloat16 array.
    pub(crate) fn extract(arg: &str, x: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = x.py();
        let arr = untyped(arg, x)?;
        let dt = arr.dtype();
        if dt.is_equiv_to(&dtype::<f32>(py)) {
            return Ok(FloatArray::F32(readonly(arg, x)?));
        }
        if dt.is_equiv_to(&dtype::<f64>(py)) {
            return Ok(FloatArray::F64(readonly(arg, x)?));
        }
        if dt.is_equiv_to(&dtype::<f16>(py)) {
            return Ok(FloatArray::F16(readonly(arg, x)?));
        }
        // rust-numpy resolves bf16 as `numpy.dtype("bfloat16")` and panics if that
        // lookup fails, so resolve it here first (it works once ml_dtypes is
        // imported): only an array of exactly that registered dtype is read as bf16.
        if dt.itemsize() == 2 {
            let registered = py.import("numpy")?.call_method1("dtype", ("bfloat16",));
            if let Ok(bf16_dtype) = registered.and_then(|d| Ok(d.cast_into::<PyArrayDescr>()?)) {
                if dt.is_equiv_to(&bf16_dtype) {
                    return Ok(FloatArray::BF16(readonly(arg, x)?));
                }
            }
        }
        Err(dtype_error(
            arg,
            "float32, float64, float16 or bfloat16",
            &dtype_str(arr),
        ))
    }
}

/// Run `$body` with `$s` bound to the input's element slice, whatever its dtype.
macro_rules! with_float_slice {
    ($arr:expr, $s:ident => $body:expr) => {
        match &$arr {
            $crate::bindings::arrays::FloatArray::F32(a) => {
                let $s = a.as_slice()?;
                $body
            }
            $crate::bindings::arrays::FloatArray::F64(a) => {
                let $s = a.as_slice()?;
                $body
            }
            $crate::bindings::arrays::FloatArray::F16(a) => {
                let $s = a.as_slice()?;
                $body
            }
            $crate::bindings::arrays::FloatArray::BF16(a) => {
                let $s = a.as_slice()?;
                $body
            }
        }
    };
}
pub(crate) use with_float_slice;

/// A C-contiguous array of exactly dtype `T` (integer arguments: no casting).
pub(crate) fn exact<'py, T: Element>(
    arg: &str,
    expected: &str,
    x: &Bound<'py, PyAny>,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    let arr = untyped(arg, x)?;
    if !arr.dtype().is_equiv_to(&dtype::<T>(x.py())) {
        return Err(dtype_error(arg, expected, &dtype_str(arr)));
    }
    readonly(arg, x)
}

/// A new 1-D output array of `n` elements for a kernel to overwrite whole.
///
/// Allocated by NumPy (which asks for transparent huge pages on large
/// buffers) through [`recycle`](super::recycle): large outputs reuse the
/// memory of earlier outputs nothing references any more, small ones are
/// fresh zero-filled arrays. A failed allocation is the `MemoryError` NumPy
/// raised (rust-numpy's `PyArray::zeros` would panic instead).
pub(crate) fn output<T: Element>(py: Python<'_>, n: usize) -> PyResult<Bound<'_, PyArray1<T>>> {
    Ok(super::recycle::output(py, n, &dtype::<T>(py))?.cast_into::<PyArray1<T>>()?)
}

/// Initialise, at import, every lazily initialised cache a kernel call would
/// otherwise fill on first use: rust-numpy's C-API table, API version, dtype
/// and borrow-tracking caches, and ours. A `fork()` while another thread is
/// half-way through filling such a cache (the GIL can switch threads inside
/// the import it runs) leaves the child waiting forever on an initialisation
/// that will never finish.
pub(crate) fn warm_up(py: Python<'_>) -> PyResult<()> {
    fn touch<T: Element>(py: Python<'_>) -> PyResult<()> {
        let a = output::<T>(py, 0)?;
        drop(
            a.try_readonly()
                .map_err(|e| PyValueError::new_err(e.to_string()))?,
        );
        drop(writable(&a)?);
        Ok(())
    }
    touch::<f32>(py)?;
    touch::<f64>(py)?;
    touch::<f16>(py)?;
    touch::<i8>(py)?;
    touch::<u8>(py)?;
    // bfloat16 resolves once ml_dtypes is imported (the package imports it first).
    if py
        .import("numpy")?
        .call_method1("dtype", ("bfloat16",))
        .is_ok()
    {
        drop(dtype::<bf16>(py));
    }
    Ok(())
}

/// Like [`output`], with the dtype looked up by NumPy name: for dtypes that
/// rust-numpy resolves lazily and would panic on if unregistered (bfloat16,
/// registered by ml_dtypes, which the package imports first).
pub(crate) fn output_named<'py, T: Element>(
    py: Python<'py>,
    n: usize,
    name: &str,
) -> PyResult<Bound<'py, PyArray1<T>>> {
    let descr = py
        .import("numpy")?
        .call_method1("dtype", (name,))?
        .cast_into::<PyArrayDescr>()?;
    Ok(super::recycle::output(py, n, &descr)?.cast_into::<PyArray1<T>>()?)
}

/// Exclusive access to an output array this binding just created.
pub(crate) fn writable<'py, T: Element>(
    arr: &Bound<'py, PyArray1<T>>,
) -> PyResult<numpy::PyReadwriteArray1<'py, T>> {
    arr.try_readwrite()
        .map_err(|e| PyValueError::new_err(format!("output array is not writable: {e}")))
}
