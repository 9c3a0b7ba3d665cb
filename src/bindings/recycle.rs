//! Recycled output buffers: large outputs reuse the memory of earlier outputs
//! that nothing references any more.
//!
//! The first write to fresh memory costs a page fault and the kernel zeroing
//! the page: for a 64 MiB float32 output that is ~4 ms against ~3.5 ms for
//! the whole dequantize kernel. ONNX Runtime and PyTorch avoid it with arenas
//! that keep freed memory mapped; this is the same idea kept small. Every
//! output of at least [`MIN_BYTES`] is a view of a byte buffer that this
//! cache also holds. A buffer is handed out again, whole, only when the
//! cache's reference is the only one left: every NumPy view of a buffer holds
//! a reference to it (NumPy collapses a view's `base` to the owning array),
//! so a buffer still visible to any Python object — through a result, a view
//! of one, a memoryview or a dataclass — is never reused. Kernels overwrite
//! every element of their outputs, so old contents never show through (tests
//! poison recycled buffers to check it).
//!
//! The cache holds at most [`capacity`] bytes (in use or free) in at most
//! [`MAX_ENTRIES`] buffers. On a miss it frees the least recently used free
//! buffers first to make room, so cached memory is returned before new memory
//! is asked for. `set_output_cache(0)` turns it off and lets go of everything.
//!
//! Reference counts are read with `sys.getrefcount`, calibrated at import on
//! an object known to have one owner (the only safe way pyo3 offers). The
//! lock is only ever tried: a thread that finds it taken (or a forked child
//! that inherited it taken) allocates as if the cache were off, never waits.

use numpy::{PyArray1, PyArrayDescr, PyArrayDescrMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyList;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Outputs smaller than this are allocated fresh: the C allocator already
/// reuses small blocks without faulting.
pub(crate) const MIN_BYTES: usize = 1 << 20;
/// At most this many buffers are tracked (each miss scans them all).
pub(crate) const MAX_ENTRIES: usize = 16;
/// Default capacity: 256 MiB.
pub(crate) const DEFAULT_CAPACITY: usize = 256 << 20;

static CAPACITY: AtomicUsize = AtomicUsize::new(DEFAULT_CAPACITY);

struct Entry {
    buf: Py<PyArray1<u8>>,
    bytes: usize,
    last_used: u64,
}

struct Cache {
    entries: Vec<Entry>,
    clock: u64,
}

static CACHE: Mutex<Cache> = Mutex::new(Cache {
    entries: Vec::new(),
    clock: 0,
});

struct Probe {
    getrefcount: Py<PyAny>,
    /// What `sys.getrefcount` returns, through this call path, for an object
    /// whose only reference is one held in Rust.
    sole: isize,
}

static PROBE: PyOnceLock<Probe> = PyOnceLock::new();

fn probe(py: Python<'_>) -> PyResult<&Probe> {
    PROBE.get_or_try_init(py, || {
        let getrefcount = py.import("sys")?.getattr("getrefcount")?.unbind();
        let owned: Py<PyAny> = PyList::empty(py).into_any().unbind();
        let sole = getrefcount.bind(py).call1((owned.bind(py),))?.extract()?;
        Ok(Probe { getrefcount, sole })
    })
}

fn sole_owner(py: Python<'_>, p: &Probe, buf: &Py<PyArray1<u8>>) -> bool {
    p.getrefcount
        .bind(py)
        .call1((buf.bind(py),))
        .and_then(|c| c.extract::<isize>())
        .is_ok_and(|c| c == p.sole)
}

/// `numpy.zeros(n, descr)`: NumPy's own allocation, or its `MemoryError`.
fn zeros<'py>(
    py: Python<'py>,
    n: usize,
    descr: &Bound<'py, PyArrayDescr>,
) -> PyResult<Bound<'py, PyAny>> {
    static ZEROS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let zeros = ZEROS.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("numpy")?.getattr("zeros")?.unbind())
    })?;
    zeros.bind(py).call1((n, descr))
}

fn zero_bytes(py: Python<'_>, bytes: usize) -> PyResult<Bound<'_, PyArray1<u8>>> {
    Ok(zeros(py, bytes, &numpy::dtype::<u8>(py))?.cast_into::<PyArray1<u8>>()?)
}

/// Whether an output of `bytes` bytes goes through the cache.
fn cacheable(bytes: usize) -> bool {
    bytes >= MIN_BYTES && bytes <= CAPACITY.load(Ordering::Relaxed)
}

/// A writable 1-D byte buffer of exactly `bytes` (cacheable) bytes for an
/// output that the caller overwrites completely: recycled if the cache has a
/// free one of that size, else newly allocated (zero-filled) and, if it fits,
/// cached.
fn buffer(py: Python<'_>, bytes: usize) -> PyResult<Bound<'_, PyArray1<u8>>> {
    let capacity = CAPACITY.load(Ordering::Relaxed);
    let p = probe(py)?;
    let Ok(mut cache) = CACHE.try_lock() else {
        return zero_bytes(py, bytes);
    };
    cache.clock += 1;
    let now = cache.clock;
    if let Some(e) = cache
        .entries
        .iter_mut()
        .find(|e| e.bytes == bytes && sole_owner(py, p, &e.buf))
    {
        e.last_used = now;
        return Ok(e.buf.bind(py).clone());
    }
    // A miss: make room by letting go of the least recently used free buffers.
    let mut evicted = Vec::new();
    while cache.entries.len() >= MAX_ENTRIES
        || cache.entries.iter().map(|e| e.bytes).sum::<usize>() + bytes > capacity
    {
        let victim = cache
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| sole_owner(py, p, &e.buf))
            .min_by_key(|(_, e)| e.last_used)
            .map(|(i, _)| i);
        match victim {
            Some(i) => evicted.push(cache.entries.swap_remove(i)),
            None => break,
        }
    }
    let room = cache.entries.len() < MAX_ENTRIES
        && cache.entries.iter().map(|e| e.bytes).sum::<usize>() + bytes <= capacity;
    drop(cache);
    // Free before allocating, outside the lock (a dealloc can run Python code).
    drop(evicted);
    let buf = zero_bytes(py, bytes)?;
    if room {
        if let Ok(mut cache) = CACHE.try_lock() {
            let used: usize = cache.entries.iter().map(|e| e.bytes).sum();
            if cache.entries.len() < MAX_ENTRIES && used + bytes <= capacity {
                cache.entries.push(Entry {
                    buf: buf.clone().unbind(),
                    bytes,
                    last_used: now,
                });
            }
        }
    }
    Ok(buf)
}

/// A writable 1-D output of `n` elements of `descr` (a native dtype): a view
/// of a recycled byte buffer when large enough to cache (see the module
/// docs), else a fresh zero-filled array that owns its memory.
pub(crate) fn output<'py>(
    py: Python<'py>,
    n: usize,
    descr: &Bound<'py, PyArrayDescr>,
) -> PyResult<Bound<'py, PyAny>> {
    let bytes = match n.checked_mul(descr.itemsize()) {
        Some(b) if cacheable(b) => b,
        _ => return zeros(py, n, descr),
    };
    let buf = buffer(py, bytes)?;
    if buf.len() != bytes {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(
            "recycled output buffer has the wrong size",
        ));
    }
    buf.call_method1("view", (descr,))
}

/// Set the cache's capacity in bytes (0 turns it off). Buffers beyond the new
/// capacity are let go of, free ones first; buffers still in use stay valid.
pub(crate) fn set_capacity(py: Python<'_>, bytes: usize) -> PyResult<()> {
    CAPACITY.store(bytes, Ordering::Relaxed);
    let p = probe(py)?;
    let mut dropped = Vec::new();
    if let Ok(mut cache) = CACHE.try_lock() {
        let mut used: usize = cache.entries.iter().map(|e| e.bytes).sum();
        // Free ones first (in LRU order), then the ones in use.
        let mut order: Vec<(bool, u64, usize)> = cache
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (!sole_owner(py, p, &e.buf), e.last_used, i))
            .collect();
        order.sort_unstable();
        let mut remove = Vec::new();
        for (_, _, i) in order {
            if used <= bytes && cache.entries.len() - remove.len() <= MAX_ENTRIES {
                break;
            }
            used -= cache.entries[i].bytes;
            remove.push(i);
        }
        remove.sort_unstable_by(|a, b| b.cmp(a));
        for i in remove {
            dropped.push(cache.entries.swap_remove(i));
        }
    }
    drop(dropped);
    Ok(())
}

/// The cache's capacity in bytes.
pub(crate) fn capacity() -> usize {
    CAPACITY.load(Ordering::Relaxed)
}

/// `(buffers, bytes, free bytes)` the cache holds now.
pub(crate) fn usage(py: Python<'_>) -> PyResult<(usize, usize, usize)> {
    let p = probe(py)?;
    let Ok(cache) = CACHE.try_lock() else {
        return Ok((0, 0, 0));
    };
    let bytes = cache.entries.iter().map(|e| e.bytes).sum();
    let free = cache
        .entries
        .iter()
        .filter(|e| sole_owner(py, p, &e.buf))
        .map(|e| e.bytes)
        .sum();
    Ok((cache.entries.len(), bytes, free))
}

/// Fill the lazy caches at import (see `arrays::warm_up`).
pub(crate) fn warm_up(py: Python<'_>) -> PyResult<()> {
    probe(py)?;
    zero_bytes(py, 0)?;
    Ok(())
}
