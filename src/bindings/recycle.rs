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
//! A buffer someone holds a weak reference to (`weakref.ref(result.base)`, a
//! `weakref.finalize`) is let go of instead of reused: the weak reference
//! then dies with it, as it would without the cache.
//!
//! The cache holds at most [`capacity`] bytes (in use or free) in at most
//! [`MAX_ENTRIES`] buffers. A request takes the smallest free buffer of at
//! least its size and at most a quarter more (the view covers the request).
//! On a miss it frees the least recently used free buffers first to make
//! room, so cached memory is returned before new memory is asked for; an
//! allocation that fails with `MemoryError` lets go of every free buffer and
//! tries once more. `set_output_cache(0)` turns it off and lets go of
//! everything.
//!
//! Buffers of at least [`HUGE_MIN`] bytes are asked for whole 2 MiB pages and
//! one more, and their outputs start at the first 2 MiB boundary inside (or,
//! if that much memory is refused, are allocated at their size). NumPy
//! asks the kernel for transparent huge pages on every array of 4 MiB or
//! more, but an allocation starts 16 bytes past a 4 KiB page, so only the
//! 2 MiB blocks wholly inside it get them: a quarter of an 8 MiB array stays
//! on 4 KiB pages, and a GEMV streaming such a weight pays for it (an int4
//! 4096 x 4096 `forward` after a flush, Zen 4: 0.64-0.76 ms against
//! 0.58-0.61 with the codes on a boundary). The slack is never written, so it
//! costs address space, not memory (the huge page holding the view's last
//! bytes may reach into it), and it stays zero: a free buffer found writable
//! (someone set `.base` writable to write to it) or resized is let go of,
//! not reused. `fq.load` reads large tensors the same way.
//!
//! While handed out, a buffer is read-only (results and their views keep the
//! flags they were made with): a frozen result's codes cannot be written
//! through `.base` without first changing its flags, as for memory NumPy owns.
//!
//! Reference counts are read with `sys.getrefcount`, calibrated at import on
//! an object known to have one owner and checked to count a second reference
//! (else the cache stays off). The lock is only ever tried: a thread that
//! finds it taken (or a forked child that inherited it taken) allocates as if
//! the cache were off, never waits.

use numpy::{PyArray1, PyArrayDescr, PyArrayDescrMethods, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError};
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
/// Buffers of at least this many bytes start their outputs on a huge-page
/// boundary (see the module docs); smaller ones are too small for a 2 MiB
/// page to pay.
pub(crate) const HUGE_MIN: usize = 2 << 20;
/// The transparent huge page size on x86-64 (where it is smaller, the
/// boundary is still one of its pages).
pub(crate) const HUGE_PAGE: usize = 2 << 20;
/// Default capacity: 256 MiB.
pub(crate) const DEFAULT_CAPACITY: usize = 256 << 20;

static CAPACITY: AtomicUsize = AtomicUsize::new(DEFAULT_CAPACITY);

struct Entry {
    buf: Py<PyArray1<u8>>,
    /// Where outputs start in `buf` (a huge-page boundary for large ones).
    offset: usize,
    /// Bytes usable from `offset` (what the capacity counts).
    bytes: usize,
    last_used: u64,
}

/// A byte buffer handed out for one output: `bytes` usable from `offset`.
struct Slot<'py> {
    buf: Bound<'py, PyArray1<u8>>,
    offset: usize,
    bytes: usize,
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
    getweakrefcount: Py<PyAny>,
    /// What `sys.getrefcount` returns, through this call path, for an object
    /// whose only reference is one held in Rust.
    sole: isize,
}

static PROBE: PyOnceLock<Option<Probe>> = PyOnceLock::new();

/// The calibrated reference counter, or `None` if `sys.getrefcount` does not
/// count references (replaced by something else): then nothing is reused.
fn probe(py: Python<'_>) -> PyResult<Option<&Probe>> {
    let p = PROBE.get_or_try_init(py, || -> PyResult<Option<Probe>> {
        let getrefcount = py.import("sys")?.getattr("getrefcount")?.unbind();
        let getweakrefcount = py.import("weakref")?.getattr("getweakrefcount")?.unbind();
        let count = |o: &Bound<'_, PyAny>| -> PyResult<isize> {
            getrefcount.bind(py).call1((o,))?.extract()
        };
        let owned: Py<PyAny> = PyList::empty(py).into_any().unbind();
        let sole = count(owned.bind(py))?;
        let second = owned.clone_ref(py);
        let with_second = count(owned.bind(py))?;
        drop(second);
        let valid = sole > 0 && with_second == sole + 1 && count(owned.bind(py))? == sole;
        Ok(valid.then_some(Probe {
            getrefcount,
            getweakrefcount,
            sole,
        }))
    })?;
    Ok(p.as_ref())
}

/// What holds a cached buffer besides the cache.
#[derive(PartialEq)]
enum Holders {
    /// Nothing: free to hand out again.
    None,
    /// Only weak references: let it go (they die with it, as without a cache).
    Weak,
    /// A strong reference: in use.
    Strong,
}

fn holders(py: Python<'_>, p: &Probe, buf: &Py<PyArray1<u8>>) -> Holders {
    let b = buf.bind(py);
    let strong = p
        .getrefcount
        .bind(py)
        .call1((b,))
        .and_then(|c| c.extract::<isize>());
    if !strong.is_ok_and(|c| c == p.sole) {
        return Holders::Strong;
    }
    let weak = p
        .getweakrefcount
        .bind(py)
        .call1((b,))
        .and_then(|c| c.extract::<isize>());
    match weak {
        Ok(0) => Holders::None,
        Ok(_) => Holders::Weak,
        Err(_) => Holders::Strong,
    }
}

/// `numpy.zeros(n, descr)`: NumPy's own allocation, or its `MemoryError`.
fn zeros<'py>(
    py: Python<'py>,
    n: usize,
    descr: &Bound<'py, PyArrayDescr>,
) -> PyResult<Bound<'py, PyAny>> {
    // NumPy refuses these with a ValueError ("array is too big"): an output no
    // memory could hold is the MemoryError every other allocation failure is.
    let item = descr.itemsize();
    if n.checked_mul(item).is_none_or(|b| b > isize::MAX as usize) {
        // usize::MAX is also what a caller's saturated count of more arrives as.
        let count = if n == usize::MAX {
            "2^64 or more".to_string()
        } else {
            n.to_string()
        };
        return Err(PyMemoryError::new_err(format!(
            "cannot allocate an output of {count} elements of {item} bytes: more than memory can address"
        )));
    }
    static ZEROS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let zeros = ZEROS.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("numpy")?.getattr("zeros")?.unbind())
    })?;
    // NumPy releases the GIL around its calloc (see gil.rs).
    super::gil::may_release(py, || zeros.bind(py).call1((n, descr)))
}

/// [`zeros`], and if NumPy cannot allocate, once more after letting go of
/// every free cached buffer.
fn zeros_or_release<'py>(
    py: Python<'py>,
    n: usize,
    descr: &Bound<'py, PyArrayDescr>,
) -> PyResult<Bound<'py, PyAny>> {
    match zeros(py, n, descr) {
        Err(e) if e.is_instance_of::<PyMemoryError>(py) => {
            if release_free(py)? == 0 {
                return Err(e);
            }
            zeros(py, n, descr)
        }
        r => r,
    }
}

/// Let go of every cached buffer nothing else holds; the bytes released.
fn release_free(py: Python<'_>) -> PyResult<usize> {
    let Some(p) = probe(py)? else {
        return Ok(0);
    };
    let mut dropped = Vec::new();
    if let Ok(mut cache) = CACHE.try_lock() {
        let mut i = 0;
        while i < cache.entries.len() {
            if holders(py, p, &cache.entries[i].buf) != Holders::Strong {
                dropped.push(cache.entries.swap_remove(i));
            } else {
                i += 1;
            }
        }
    }
    let bytes = dropped.iter().map(|e| e.bytes).sum();
    drop(dropped);
    Ok(bytes)
}

/// Whether a free buffer was changed behind the cache's back: made writable
/// again (through a result's `.base`; the cache leaves it read-only), so
/// its slack may hold what someone wrote there, or resized. Such a buffer
/// is let go of rather than handed out. (Writing it and setting it
/// read-only again is not seen: the slack is the one part of a buffer no
/// kernel overwrites.)
fn tampered(buf: &Bound<'_, PyArray1<u8>>, e: &Entry) -> bool {
    buf.len() < e.offset.saturating_add(e.bytes) || buf.try_readwrite().is_ok()
}

fn set_writeable(buf: &Bound<'_, PyArray1<u8>>, on: bool) -> PyResult<()> {
    buf.call_method1("setflags", (on,))?;
    Ok(())
}

/// Whether an output of `bytes` bytes goes through the cache.
fn cacheable(bytes: usize) -> bool {
    bytes >= MIN_BYTES && bytes <= CAPACITY.load(Ordering::Relaxed)
}

/// A writable 1-D byte buffer of at least `bytes` (cacheable) bytes for an
/// output that the caller overwrites completely: recycled if the cache has a
/// free one of that size (up to a quarter more), else newly allocated
/// (zero-filled) and, if it fits, cached.
fn buffer<'py>(py: Python<'py>, p: &Probe, bytes: usize) -> PyResult<Slot<'py>> {
    let capacity = CAPACITY.load(Ordering::Relaxed);
    let u8s = numpy::dtype::<u8>(py);
    let fresh = |py: Python<'py>| -> PyResult<Slot<'py>> {
        if bytes >= HUGE_MIN {
            // Whole huge pages for the view wherever it starts, and one more
            // to find the boundary in.
            let padded = bytes
                .checked_next_multiple_of(HUGE_PAGE)
                .and_then(|b| b.checked_add(HUGE_PAGE));
            let got = padded.map(|b| zeros_or_release(py, b, &u8s));
            match got {
                Some(Ok(buf)) => {
                    let buf = buf.cast_into::<PyArray1<u8>>()?;
                    // The address only, never dereferenced here.
                    let at = buf.data() as usize;
                    let offset = at.next_multiple_of(HUGE_PAGE) - at;
                    return Ok(Slot { buf, offset, bytes });
                }
                // Without room for the padding, the output itself may fit.
                Some(Err(e)) if !e.is_instance_of::<PyMemoryError>(py) => return Err(e),
                _ => {}
            }
        }
        let buf = zeros_or_release(py, bytes, &u8s)?.cast_into::<PyArray1<u8>>()?;
        Ok(Slot {
            buf,
            offset: 0,
            bytes,
        })
    };
    let Ok(mut cache) = CACHE.try_lock() else {
        return fresh(py);
    };
    cache.clock += 1;
    let now = cache.clock;
    // One scan: who holds each buffer (weakly held ones are let go of, and
    // so are free ones someone tampered with, see `tampered`).
    let mut states = Vec::with_capacity(cache.entries.len());
    for e in &cache.entries {
        let state = match holders(py, p, &e.buf) {
            Holders::None if tampered(e.buf.bind(py), e) => Holders::Weak,
            state => state,
        };
        states.push(state);
    }
    let mut released = Vec::new();
    for i in (0..states.len()).rev() {
        if states[i] == Holders::Weak {
            released.push(cache.entries.swap_remove(i));
            states.swap_remove(i);
        }
    }
    let hit = (0..cache.entries.len())
        .filter(|&i| states[i] == Holders::None)
        .filter(|&i| (bytes..=bytes + bytes / 4).contains(&cache.entries[i].bytes))
        .min_by_key(|&i| cache.entries[i].bytes);
    if let Some(i) = hit {
        let e = &mut cache.entries[i];
        e.last_used = now;
        let slot = Slot {
            buf: e.buf.bind(py).clone(),
            offset: e.offset,
            bytes: e.bytes,
        };
        drop(cache);
        drop(released);
        return Ok(slot);
    }
    // A miss: make room by letting go of the least recently used free buffers.
    let used = |c: &Cache| c.entries.iter().map(|e| e.bytes).sum::<usize>();
    while cache.entries.len() >= MAX_ENTRIES || used(&cache) + bytes > capacity {
        let victim = (0..cache.entries.len())
            .filter(|&i| states[i] == Holders::None)
            .min_by_key(|&i| cache.entries[i].last_used);
        match victim {
            Some(i) => {
                released.push(cache.entries.swap_remove(i));
                states.swap_remove(i);
            }
            None => break,
        }
    }
    let room = cache.entries.len() < MAX_ENTRIES && used(&cache) + bytes <= capacity;
    drop(cache);
    // Free before allocating, outside the lock (a dealloc can run Python code).
    drop(released);
    let slot = fresh(py)?;
    if room {
        if let Ok(mut cache) = CACHE.try_lock() {
            if cache.entries.len() < MAX_ENTRIES && used(&cache) + bytes <= capacity {
                cache.entries.push(Entry {
                    buf: slot.buf.clone().unbind(),
                    offset: slot.offset,
                    bytes,
                    last_used: now,
                });
            }
        }
    }
    Ok(slot)
}

/// A writable 1-D output of `n` elements of `descr` (a native dtype): a view
/// of a recycled byte buffer when large enough to cache (see the module
/// docs), else a fresh zero-filled array that owns its memory.
pub(crate) fn output<'py>(
    py: Python<'py>,
    n: usize,
    descr: &Bound<'py, PyArrayDescr>,
) -> PyResult<Bound<'py, PyAny>> {
    let bytes = match (n.checked_mul(descr.itemsize()), probe(py)?) {
        (Some(b), Some(p)) if cacheable(b) => (b, p),
        _ => return zeros_or_release(py, n, descr),
    };
    let (bytes, p) = bytes;
    let Slot {
        buf,
        offset,
        bytes: usable,
    } = buffer(py, p, bytes)?;
    let end = offset.checked_add(usable).filter(|&e| e <= buf.len());
    let Some(end) = end.filter(|_| usable >= bytes) else {
        return Err(PyRuntimeError::new_err(
            "recycled output buffer is too small",
        ));
    };
    // Writable for this view only; read-only again while handed out.
    set_writeable(&buf, true)?;
    let out = if offset == 0 && buf.len() == bytes {
        buf.call_method1("view", (descr,))?
    } else {
        // The bytes past the view may hold an earlier output: cleared, so no
        // result shows another's data through its `.base` (at most a quarter
        // of the view; the slack before `offset` is never written).
        if usable > bytes {
            let mut whole = buf
                .try_readwrite()
                .map_err(|e| PyRuntimeError::new_err(format!("recycled output buffer: {e}")))?;
            whole.as_slice_mut()?[offset + bytes..end].fill(0);
        }
        let view = pyo3::types::PySlice::new(py, offset as isize, (offset + bytes) as isize, 1);
        buf.get_item(view)?.call_method1("view", (descr,))?
    };
    set_writeable(&buf, false)?;
    Ok(out)
}

/// Set the cache's capacity in bytes (0 turns it off). Buffers beyond the new
/// capacity are let go of, free ones first; buffers still in use stay valid.
pub(crate) fn set_capacity(py: Python<'_>, bytes: usize) -> PyResult<()> {
    CAPACITY.store(bytes, Ordering::Relaxed);
    let mut dropped = Vec::new();
    if let (Some(p), Ok(mut cache)) = (probe(py)?, CACHE.try_lock()) {
        let mut used: usize = cache.entries.iter().map(|e| e.bytes).sum();
        // Free ones first (in LRU order), then the ones in use.
        let mut order: Vec<(bool, u64, usize)> = cache
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (holders(py, p, &e.buf) == Holders::Strong, e.last_used, i))
            .collect();
        order.sort_unstable();
        let mut remove = Vec::new();
        for (_, _, i) in order {
            if used <= bytes {
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
    let Some(p) = probe(py)? else {
        return Ok((0, 0, 0));
    };
    let Ok(cache) = CACHE.try_lock() else {
        return Ok((0, 0, 0));
    };
    let bytes = cache.entries.iter().map(|e| e.bytes).sum();
    let free = cache
        .entries
        .iter()
        .filter(|e| holders(py, p, &e.buf) == Holders::None)
        .map(|e| e.bytes)
        .sum();
    Ok((cache.entries.len(), bytes, free))
}

/// Fill the lazy caches at import (see `arrays::warm_up`).
pub(crate) fn warm_up(py: Python<'_>) -> PyResult<()> {
    if probe(py)?.is_none() {
        CAPACITY.store(0, Ordering::Relaxed);
    }
    zeros(py, 0, &numpy::dtype::<u8>(py))?;
    Ok(())
}
