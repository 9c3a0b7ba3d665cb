//! ferroquant's own rayon pool.
//!
//! The kernels never use rayon's global pool (an application's other rayon
//! work must not be starved or resized by us). The pool is built lazily with
//! `FERROQUANT_NUM_THREADS` threads (default: the available parallelism),
//! rebuilt by [`set_num_threads`], and rebuilt after `fork()`: a forked child
//! inherits the parent's memory but none of its threads, so a kernel in the
//! child would otherwise wait forever on workers that do not exist.

use crate::error::{QuantError, Result};
use rayon::{ThreadPool, ThreadPoolBuilder};
use std::sync::{Arc, Mutex, MutexGuard};

/// Calls with less work than this stay on the calling thread: below it the
/// hand-off to the pool (waking its workers, 15-50 µs on the 2-vCPU build VM)
/// costs more than a second thread saves.
///
/// Work is counted in *blockwise-quantize element equivalents* (about 0.2 ns
/// each on one core there); kernels scale their element counts by their
/// relative cost. Measured break-even for quantize: 2^18 elements (60 µs one
/// thread, 49 µs two); at 2^16 the pool made it 1.7x slower.
pub const MIN_PARALLEL_WORK: usize = 1 << 18;

/// Work per rayon task, in elements, is at least this much.
pub const MIN_TASK_ELEMENTS: usize = 1 << 14;

struct PoolState {
    /// Requested thread count (None: default from the environment).
    threads: Option<usize>,
    /// The live pool and the process id that built it.
    pool: Option<(u32, Arc<ThreadPool>)>,
}

static STATE: Mutex<PoolState> = Mutex::new(PoolState {
    threads: None,
    pool: None,
});

fn lock() -> MutexGuard<'static, PoolState> {
    // A panic while holding this lock cannot leave PoolState inconsistent
    // (every write is a single assignment), so a poisoned lock is still usable.
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The thread count named by `FERROQUANT_NUM_THREADS`, if it is a positive integer.
pub fn env_num_threads() -> Option<usize> {
    std::env::var("FERROQUANT_NUM_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n >= 1)
}

fn default_num_threads() -> usize {
    env_num_threads().unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    })
}

/// The number of threads kernels use.
pub fn get_num_threads() -> usize {
    lock().threads.unwrap_or_else(default_num_threads)
}

/// Set the number of threads kernels use (at least 1). Takes effect on the next call.
pub fn set_num_threads(n: usize) -> Result<()> {
    if n == 0 {
        return Err(QuantError::invalid(
            "n",
            "the thread count must be at least 1, got 0",
        ));
    }
    let mut st = lock();
    st.threads = Some(n);
    // Dropping the old pool lets its idle workers exit; calls running on it finish first.
    st.pool = None;
    Ok(())
}

/// The pool for this process, built (or rebuilt after a fork) if needed.
///
/// Returns `None` when one thread is requested or the pool cannot be built;
/// callers then run on the calling thread, which gives the same result.
fn pool() -> Option<Arc<ThreadPool>> {
    let pid = std::process::id();
    let mut st = lock();
    let threads = st.threads.unwrap_or_else(default_num_threads);
    if threads <= 1 {
        return None;
    }
    if let Some((owner, pool)) = &st.pool {
        if *owner == pid {
            return Some(Arc::clone(pool));
        }
        // Inherited across fork(): its worker threads do not exist here.
        // Dropping it would signal those phantom workers through locks that may
        // have been copied mid-use, so it is deliberately leaked.
        if let Some(stale) = st.pool.take() {
            std::mem::forget(stale);
        }
    }
    let built = ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("ferroquant-{i}"))
        .build()
        .ok()?;
    let built = Arc::new(built);
    st.pool = Some((pid, Arc::clone(&built)));
    Some(built)
}

/// Run `f` on ferroquant's pool when `work` (see [`MIN_PARALLEL_WORK`]) is
/// large enough to repay the hand-off, otherwise on the calling thread. `f`
/// receives whether it runs in parallel, so it can split its work accordingly.
pub fn run<R: Send>(work: usize, f: impl FnOnce(bool) -> R + Send) -> R {
    if work < MIN_PARALLEL_WORK {
        return f(false);
    }
    match pool() {
        Some(p) => p.install(|| f(true)),
        None => f(false),
    }
}

/// Split `n_units` units of `unit_len` elements each into task-sized groups:
/// returns how many units one task takes, so that each task holds at least
/// [`MIN_TASK_ELEMENTS`] elements and there are about four tasks per thread.
pub fn units_per_task(n_units: usize, unit_len: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let unit_len = unit_len.max(1);
    let min_units = MIN_TASK_ELEMENTS.div_ceil(unit_len);
    let balanced = n_units.div_ceil(threads * 4);
    balanced.max(min_units).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_threads_is_rejected() {
        assert!(matches!(
            set_num_threads(0),
            Err(QuantError::InvalidConfig { arg: "n", .. })
        ));
    }

    #[test]
    fn small_work_stays_on_the_calling_thread() {
        let caller = std::thread::current().id();
        let (par, id) = run(10, |par| (par, std::thread::current().id()));
        assert!(!par);
        assert_eq!(id, caller);
    }

    #[test]
    fn units_per_task_respects_minimum() {
        assert!(units_per_task(1 << 20, 64) * 64 >= MIN_TASK_ELEMENTS);
        assert_eq!(units_per_task(0, 64), MIN_TASK_ELEMENTS / 64);
        assert!(units_per_task(3, 1 << 20) >= 1);
    }
}
