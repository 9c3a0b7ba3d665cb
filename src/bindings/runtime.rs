//! Threads, instruction set and environment configuration.

use super::errors::to_pyerr;
use super::gil::Detach;
use crate::parallel;
use crate::simd::Isa;
use pyo3::prelude::*;
use pyo3::types::IntoPyDict;

/// Set the number of threads kernels use (1..=MAX_THREADS).
#[pyfunction]
pub(crate) fn set_num_threads(py: Python<'_>, n: usize) -> PyResult<()> {
    parallel::set_num_threads(n).map_err(|e| to_pyerr(py, e))
}

/// The number of threads kernels run on.
#[pyfunction]
pub(crate) fn get_num_threads() -> usize {
    parallel::get_num_threads()
}

/// Test hook: hold the thread pool's lock for `seconds`, the GIL released
/// (tests fork meanwhile; see `parallel::hold_pool_lock_for`).
#[pyfunction]
pub(crate) fn _hold_pool_lock(py: Python<'_>, seconds: f64) {
    let d = std::time::Duration::from_secs_f64(seconds.clamp(0.0, 10.0));
    py.detached(|| parallel::hold_pool_lock_for(d));
}

/// The instruction set the kernels run on (`"avx512"`, `"avx2"` or `"scalar"`).
#[pyfunction]
pub(crate) fn simd_isa() -> &'static str {
    Isa::detected().name()
}

/// Every instruction set this CPU supports.
#[pyfunction]
pub(crate) fn supported_isas() -> Vec<&'static str> {
    Isa::supported().into_iter().map(Isa::name).collect()
}

/// Set the output cache's capacity in bytes (0 turns it off).
#[pyfunction]
pub(crate) fn set_output_cache(py: Python<'_>, max_bytes: usize) -> PyResult<()> {
    super::recycle::set_capacity(py, max_bytes)
}

/// The output cache's capacity in bytes.
#[pyfunction]
pub(crate) fn get_output_cache() -> usize {
    super::recycle::capacity()
}

/// `(buffers, bytes, free bytes)` the output cache holds now.
#[pyfunction]
pub(crate) fn output_cache_usage(py: Python<'_>) -> PyResult<(usize, usize, usize)> {
    super::recycle::usage(py)
}

/// Why an environment variable of ferroquant's is ignored (one message each).
#[pyfunction]
pub(crate) fn env_warnings() -> Vec<String> {
    crate::env_warnings()
}

/// `x` rounded to float32 (as a float): the default environment's rounding
/// whatever this thread's flags, where NumPy's `float32(x)` would flush a
/// subnormal to zero under a caller's flush-to-zero.
#[pyfunction]
pub(crate) fn round_f32(x: f64) -> f64 {
    crate::simd::fpenv::widen(crate::simd::fpenv::narrow(x))
}

/// `x` (any supported float dtype, C-contiguous) as a flat float32 array,
/// rounded in the default floating-point environment (NumPy's `astype` runs
/// under the caller's flags: flush-to-zero would zero subnormal results).
#[pyfunction]
pub(crate) fn to_float32<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, numpy::PyArray1<f32>>> {
    let x = super::arrays::FloatArray::extract("x", x)?;
    super::arrays::with_float_slice!(x, xs => {
        let out = super::arrays::output::<f32>(py, xs.len())?;
        {
            let mut ow = super::arrays::writable(&out)?;
            let os = ow.as_slice_mut()?;
            py.detached(|| crate::element::to_f32_pinned(xs, os));
        }
        Ok(out)
    })
}

/// Register these functions and read the environment once, at import: the
/// thread count, worker binding and the instruction set are fixed before any thread or
/// `fork()` of the caller's can race with reading them.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let _ = parallel::env_num_threads();
    let _ = parallel::bind_threads();
    let _ = Isa::detected();
    m.add_function(wrap_pyfunction!(set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(get_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(_hold_pool_lock, m)?)?;
    m.add_function(wrap_pyfunction!(simd_isa, m)?)?;
    m.add_function(wrap_pyfunction!(supported_isas, m)?)?;
    m.add_function(wrap_pyfunction!(env_warnings, m)?)?;
    m.add_function(wrap_pyfunction!(round_f32, m)?)?;
    m.add_function(wrap_pyfunction!(to_float32, m)?)?;
    m.add_function(wrap_pyfunction!(set_output_cache, m)?)?;
    m.add_function(wrap_pyfunction!(get_output_cache, m)?)?;
    m.add_function(wrap_pyfunction!(output_cache_usage, m)?)?;
    // Not module attributes: only `atexit` and `os` hold them (see gil.rs).
    let py = m.py();
    let exiting = wrap_pyfunction!(interpreter_exiting, m)?;
    py.import("atexit")?.call_method1("register", (exiting,))?;
    let kwargs = [("after_in_child", wrap_pyfunction!(forked_child, m)?)].into_py_dict(py)?;
    py.import("os")?
        .getattr("register_at_fork")?
        .call((), Some(&kwargs))?;
    Ok(())
}

/// Run by `atexit`: keep daemon threads that are inside kernels from
/// re-taking the GIL while the interpreter finalizes (see gil.rs).
#[pyfunction]
fn interpreter_exiting(py: Python<'_>) {
    super::gil::interpreter_exiting(py);
}

/// Run by `os.fork()` in the child (see gil.rs).
#[pyfunction]
fn forked_child() {
    super::gil::forked_child();
}
