//! ferroquant's own rayon pool, and the floating-point environment kernels run in.
//!
//! The kernels never use rayon's global pool (an application's other rayon
//! work must not be starved or resized by us). The pool is built lazily with
//! `FERROQUANT_NUM_THREADS` threads (read once; default: the available
//! parallelism), rebuilt by [`set_num_threads`], and rebuilt after `fork()`: a
//! forked child inherits the parent's memory but none of its threads, so a
//! kernel in the child would otherwise wait forever on workers that do not
//! exist.
//!
//! Fork safety: no lock is ever held while threads are spawned or joined. The
//! configuration lives in atomics; the one mutex guards only the swap of an
//! `Arc` (a pool built while the lock was held left children with a lock
//! nobody would release), and it is only ever tried: a `fork()` that lands
//! while another thread holds it copies it locked into the child, which
//! then runs its kernels on its own thread instead of waiting (see `lock`).
//!
//! Workers are bound to CPUs when the pool has one per CPU the process may
//! run on (Linux; see `bind_worker`): unbound, a worker woken for a job
//! often landed on the CPU its busy sibling was running on and waited there
//! for milliseconds, so two threads streamed a weight no faster than one.
//!
//! Every thread that runs kernel code computes in the default IEEE
//! environment ([`crate::simd::fpenv`]): round to nearest, no flush-to-zero,
//! no denormals-are-zero, whatever the caller set, so results never depend on
//! the caller's flags or on which thread ran a chunk.

use crate::error::{QuantError, Result};
use crate::simd::fpenv;
use rayon::{ThreadPool, ThreadPoolBuilder};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

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

/// The largest thread count [`set_num_threads`] accepts. Far above any core
/// count these kernels can use (they are memory-bound), and low enough that a
/// typo cannot make the next call spawn a hundred thousand threads.
pub const MAX_THREADS: usize = 1024;

/// Name of the environment variable read (once) for the default thread count.
pub const ENV_NUM_THREADS: &str = "FERROQUANT_NUM_THREADS";

/// Name of the environment variable that turns worker binding off (`0`) or
/// on (`1`, the default); read once.
pub const ENV_BIND_THREADS: &str = "FERROQUANT_BIND_THREADS";

/// Thread count set by [`set_num_threads`]; 0 while unset.
static REQUESTED: AtomicUsize = AtomicUsize::new(0);
/// `FERROQUANT_NUM_THREADS` as read once: 0 unread, `usize::MAX` absent or invalid.
static ENV_CACHE: AtomicUsize = AtomicUsize::new(0);
/// `FERROQUANT_BIND_THREADS` as read once: 0 unread, 1 off, 2 on.
static BIND_CACHE: AtomicUsize = AtomicUsize::new(0);
/// A thread count whose pool could not be built (the OS refused threads); 0 if none.
static FAILED: AtomicUsize = AtomicUsize::new(0);
/// The process one of whose threads is building a pool (0: none). One builder
/// at a time: without it, every thread whose first call raced the others
/// built a whole pool of its own, and all but one were thrown away (32 first
/// calls at 64 threads peaked at up to 762 OS threads).
static BUILDING: AtomicU32 = AtomicU32::new(0);

/// The claim to build a pool, released when dropped.
struct Building;

impl Building {
    /// Claim the build for this process, or `None` if another of its threads
    /// holds it. A claim copied from the parent by `fork()` (its builder does
    /// not exist here) is taken over.
    fn claim(pid: u32) -> Option<Building> {
        loop {
            match BUILDING.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(Building),
                Err(holder) if holder == pid => return None,
                Err(holder) => {
                    if BUILDING
                        .compare_exchange(holder, pid, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return Some(Building);
                    }
                }
            }
        }
    }
}

impl Drop for Building {
    fn drop(&mut self) {
        BUILDING.store(0, Ordering::Release);
    }
}

/// The live pool: the process that built it, its size, the pool.
type Live = Option<(u32, usize, Arc<ThreadPool>)>;
static POOL: Mutex<Live> = Mutex::new(None);
/// The process whose thread last took [`POOL`]'s lock (0: none yet).
static HOLDER: AtomicU32 = AtomicU32::new(0);

/// [`POOL`]'s lock, or `None` when it is held by a thread of another process:
/// a `fork()` while one of the parent's threads held it (for the few
/// instructions of a swap, or longer if that thread was preempted there)
/// copies it locked into the child, where no thread will ever release it.
/// Waiting would hang the child; callers then run on the calling thread,
/// which gives the same results. A thread of this process that has the lock
/// but has not yet recorded itself may send another one that way once, too.
fn lock() -> Option<MutexGuard<'static, Live>> {
    let pid = std::process::id();
    loop {
        match POOL.try_lock() {
            Ok(guard) => {
                HOLDER.store(pid, Ordering::Release);
                return Some(guard);
            }
            // Every write under this lock is a single assignment, so a
            // poisoned lock still holds a consistent value.
            Err(TryLockError::Poisoned(p)) => {
                HOLDER.store(pid, Ordering::Release);
                return Some(p.into_inner());
            }
            Err(TryLockError::WouldBlock) => {
                if HOLDER.load(Ordering::Acquire) != pid {
                    return None;
                }
                std::thread::yield_now();
            }
        }
    }
}

/// Test hook, not for use: hold the pool's lock for `d`, the state a `fork()`
/// landing inside a swap copies into the child (see [`lock`]).
#[doc(hidden)]
pub fn hold_pool_lock_for(d: std::time::Duration) {
    let guard = lock();
    std::thread::sleep(d);
    drop(guard);
}

/// Parse a `FERROQUANT_NUM_THREADS` value: an integer in `1..=MAX_THREADS`.
pub fn parse_num_threads(raw: &str) -> std::result::Result<usize, String> {
    match raw.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_THREADS).contains(&n) => Ok(n),
        _ => Err(format!(
            "{ENV_NUM_THREADS}={} is not an integer in 1..={MAX_THREADS}; it is ignored",
            crate::env::shown(raw)
        )),
    }
}

/// The thread count named by `FERROQUANT_NUM_THREADS`, if valid. The variable
/// is read on the first call only (the Python module calls this at import), so
/// later writes to the environment cannot race with running kernels.
pub fn env_num_threads() -> Option<usize> {
    let mut v = ENV_CACHE.load(Ordering::Acquire);
    if v == 0 {
        v = match crate::env::text(ENV_NUM_THREADS) {
            Some(Ok(raw)) => parse_num_threads(&raw).unwrap_or(usize::MAX),
            _ => usize::MAX,
        };
        // Racing first calls read the same variable; either store is fine.
        ENV_CACHE.store(v, Ordering::Release);
    }
    (v != usize::MAX).then_some(v)
}

/// Why the `FERROQUANT_NUM_THREADS` value in the environment is ignored, if it is.
pub fn env_warning() -> Option<String> {
    match crate::env::text(ENV_NUM_THREADS)? {
        Ok(raw) => parse_num_threads(&raw).err(),
        Err(warning) => Some(warning),
    }
}

/// `FERROQUANT_BIND_THREADS`'s value: `0` off, `1` on (surrounding spaces
/// allowed); anything else is ignored (binding stays on), with this message.
pub fn parse_bind_threads(raw: &str) -> std::result::Result<bool, String> {
    match raw.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!(
            "{ENV_BIND_THREADS}={} is not 0 or 1; it is ignored (binding stays on)",
            crate::env::shown(raw)
        )),
    }
}

/// Whether workers may be bound to CPUs (`FERROQUANT_BIND_THREADS`, read on
/// the first call only: the Python module calls this at import, beside the
/// thread count; an atomic, like the thread count, so a `fork()` at any moment
/// leaves nothing half-initialised).
pub fn bind_threads() -> bool {
    let mut v = BIND_CACHE.load(Ordering::Acquire);
    if v == 0 {
        let on = match crate::env::text(ENV_BIND_THREADS) {
            Some(Ok(raw)) => parse_bind_threads(&raw).unwrap_or(true),
            _ => true,
        };
        v = if on { 2 } else { 1 };
        BIND_CACHE.store(v, Ordering::Release);
    }
    v == 2
}

/// Why the `FERROQUANT_BIND_THREADS` value in the environment is ignored, if
/// it is set to something else than `0` or `1`.
pub fn bind_env_warning() -> Option<String> {
    match crate::env::text(ENV_BIND_THREADS)? {
        Ok(raw) => parse_bind_threads(&raw).err(),
        Err(warning) => Some(format!("{warning} (binding stays on)")),
    }
}

fn default_num_threads() -> usize {
    env_num_threads().unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(MAX_THREADS)
    })
}

fn wanted_threads() -> usize {
    match REQUESTED.load(Ordering::Acquire) {
        0 => default_num_threads(),
        n => n,
    }
}

/// The number of threads kernels run on: the configured count, or 1 if the
/// operating system refused to start a pool of that size.
pub fn get_num_threads() -> usize {
    let want = wanted_threads();
    if FAILED.load(Ordering::Acquire) == want {
        1
    } else {
        want
    }
}

/// Set the number of threads kernels use, in `1..=MAX_THREADS`. Takes effect
/// on the next call; calls already running finish on the old pool.
pub fn set_num_threads(n: usize) -> Result<()> {
    if !(1..=MAX_THREADS).contains(&n) {
        return Err(QuantError::invalid(
            "n",
            format!("the thread count must be in 1..={MAX_THREADS}, got {n}"),
        ));
    }
    REQUESTED.store(n, Ordering::Release);
    FAILED.store(0, Ordering::Release);
    // Drop the old pool outside the lock: its idle workers exit on their own.
    // (With the lock stuck after a fork there is no pool of ours to drop.)
    if let Some(mut guard) = lock() {
        let old = guard.take();
        drop(guard);
        release(old);
    }
    Ok(())
}

/// Drop a pool this process built; leak one inherited across `fork()`, whose
/// worker threads do not exist here (dropping it would signal phantom workers
/// through locks that may have been copied mid-use).
fn release(old: Live) {
    if let Some((owner, _, pool)) = old {
        if owner != std::process::id() {
            std::mem::forget(pool);
        }
    }
}

/// The pool for this process, built (or rebuilt after a fork or a resize) if needed.
///
/// Returns `None` when one thread is wanted or the pool cannot be built;
/// callers then run on the calling thread, which gives the same result.
fn pool() -> Option<Arc<ThreadPool>> {
    let want = wanted_threads();
    if want <= 1 || FAILED.load(Ordering::Acquire) == want {
        return None;
    }
    let pid = std::process::id();
    if let Some((owner, n, p)) = lock()?.as_ref() {
        if *owner == pid && *n == want {
            return Some(Arc::clone(p));
        }
    }
    // One builder at a time; a call that finds another thread building runs
    // on its own thread, which gives the same results.
    let _building = Building::claim(pid)?;
    // Spawn the workers with no lock held (see the module docs on fork).
    let built = match build_pool(want, bind_threads()) {
        Ok(p) => Arc::new(p),
        Err(_) => {
            FAILED.store(want, Ordering::Release);
            return None;
        }
    };
    let Some(mut guard) = lock() else {
        return None; // `built` is dropped here (this process's own threads)
    };
    if let Some((owner, n, p)) = guard.as_ref() {
        if *owner == pid && *n == want {
            // Another thread installed an equal pool first: use it, drop ours.
            let winner = Arc::clone(p);
            drop(guard);
            drop(built);
            return Some(winner);
        }
    }
    let old = guard.replace((pid, want, Arc::clone(&built)));
    drop(guard);
    release(old);
    Some(built)
}

/// Run `f` on ferroquant's pool when `work` (see [`MIN_PARALLEL_WORK`]) is
/// large enough to repay the hand-off, otherwise on the calling thread. `f`
/// receives whether it runs in parallel, so it can split its work accordingly.
///
/// On the calling thread, `f` runs in the default floating-point environment
/// (the caller's is restored afterwards); pool workers always run in it.
pub fn run<R: Send>(work: usize, f: impl FnOnce(bool) -> R + Send) -> R {
    let _env = fpenv::Pinned::new();
    if work < MIN_PARALLEL_WORK {
        return f(false);
    }
    match pool() {
        Some(p) => p.install(|| f(true)),
        None => f(false),
    }
}

/// Run `f(0)`, …, `f(tasks - 1)` (in any order, each once) on the calling
/// thread *and* every worker of ferroquant's pool when `work` is large
/// enough (see [`run`]), otherwise on the calling thread in order; returns
/// an error of a failed task (no task is started after one fails or
/// panics; a panic reaches the caller).
///
/// Why the caller works too: [`run`] hands the whole call to the pool and
/// sleeps, so a call pays for waking a worker (33-120 µs, median 65-80, on
/// the 2-vCPU VM after a 5 ms idle), for that worker waking the next, and for
/// waking the caller at the end: a flushed 4096² int4 GEMV took 0.37-0.41 ms
/// on two threads, 0.52 on one. Here the caller starts at once and the
/// workers join as they wake, claiming tasks one at a time, so a late worker
/// only takes fewer tasks: 0.36 ms (caller and both workers; with one worker
/// it landed on the caller's CPU and took 0.55). The caller then waits for
/// the tasks the workers hold (at most one each): outside any rayon pool by
/// yielding its CPU for up to a millisecond (a worker may share it), then
/// in the scope.
pub fn run_tasks<E: Send>(
    work: usize,
    tasks: usize,
    f: impl Fn(usize) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<(), E> {
    let _env = fpenv::Pinned::new();
    let pool = if work >= MIN_PARALLEL_WORK && tasks > 1 {
        pool()
    } else {
        None
    };
    let Some(pool) = pool else {
        return (0..tasks).try_for_each(f);
    };
    /// Counts a task as finished when dropped, so a task that panics
    /// (the scope re-raises it) cannot leave the caller waiting; a panic,
    /// like an error, stops the claiming.
    struct Finished<'a> {
        finished: &'a AtomicUsize,
        next: &'a AtomicUsize,
        tasks: usize,
    }
    impl Drop for Finished<'_> {
        fn drop(&mut self) {
            if std::thread::panicking() {
                self.next.fetch_max(self.tasks, Ordering::Relaxed);
            }
            self.finished.fetch_add(1, Ordering::Release);
        }
    }
    let next = AtomicUsize::new(0);
    let (started, finished) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let failure: Mutex<Option<E>> = Mutex::new(None);
    let claim = || loop {
        let t = next.fetch_add(1, Ordering::Relaxed);
        if t >= tasks {
            return;
        }
        started.fetch_add(1, Ordering::Relaxed);
        let _done = Finished {
            finished: &finished,
            next: &next,
            tasks,
        };
        if let Err(e) = f(t) {
            let mut slot = failure.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(e);
            // No task starts after a failure (one claimed already runs on).
            next.fetch_max(tasks, Ordering::Relaxed);
        }
    };
    // A job per worker, but never more than the tasks the caller leaves:
    // each job must run before the call returns.
    let helpers = pool.current_num_threads().min(tasks - 1);
    pool.in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| claim());
        }
        claim();
        // No task is left to claim: wait for those still running elsewhere
        // (a task claimed but not yet counted is waited for by the scope).
        // Only a thread outside every rayon pool spins, and briefly: a
        // worker of some pool must wait in the scope, where it runs its
        // pool's queued jobs (a task here may be waiting on one of them).
        if rayon::current_thread_index().is_none() {
            let running = started.load(Ordering::Relaxed);
            let since = std::time::Instant::now();
            while finished.load(Ordering::Acquire) < running
                && since.elapsed() < std::time::Duration::from_millis(1)
            {
                std::thread::yield_now();
            }
        }
    });
    match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A pool of `threads` workers named `ferroquant-<i>`, each in the default
/// floating-point environment and, if `bind`, bound as [`bind_worker`] says.
fn build_pool(
    threads: usize,
    bind: bool,
) -> std::result::Result<ThreadPool, rayon::ThreadPoolBuildError> {
    ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("ferroquant-{i}"))
        .start_handler(move |i| {
            fpenv::set_default();
            if bind {
                bind_worker(i, threads);
            }
        })
        .build()
}

/// Bind worker `i` of a pool of `threads` to the `i`-th CPU it may run on,
/// if the pool has exactly one worker for each of those CPUs (and at least
/// two); otherwise, or if the OS refuses, the worker stays unbound.
///
/// Why: a job wakes one worker, which wakes the next as it splits the work.
/// Unbound, the scheduler often queued that next worker on the CPU where the
/// first was already running, and it started milliseconds later or never:
/// on a 2-vCPU VM a 16 MiB weight streamed by `w8a8_matvec` after a cache
/// flush took 1.33-1.40 ms on two threads against 1.13-1.29 ms on one;
/// bound, 0.96-1.01 ms. A pool smaller than the CPU set is never bound, so
/// processes that each take a few threads of a large machine are still
/// spread by the scheduler, not stacked on its first CPUs.
#[cfg(target_os = "linux")]
fn bind_worker(i: usize, threads: usize) {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    let me = Pid::from_raw(0);
    // The mask the worker inherited from the thread that built the pool.
    let Ok(allowed) = sched_getaffinity(me) else {
        return;
    };
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|&c| allowed.is_set(c).unwrap_or(false))
        .collect();
    if threads < 2 || cpus.len() != threads {
        return;
    }
    let mut one = CpuSet::new();
    if one.set(cpus[i % threads]).is_ok() {
        // A refusal (a seccomp policy, a cpuset change) leaves it unbound.
        let _ = sched_setaffinity(me, &one);
    }
}

#[cfg(not(target_os = "linux"))]
fn bind_worker(_i: usize, _threads: usize) {}

/// Merge the outcomes of two neighbouring parallel tasks so that the first
/// error in sequence order wins (the one at the smallest flat index, which each
/// task reports for itself), whatever the split: rayon's `reduce` combines
/// neighbours in order, so the merged error does not depend on the thread count.
pub fn first_error<T, E>(
    a: std::result::Result<T, E>,
    b: std::result::Result<T, E>,
    merge: impl FnOnce(T, T) -> T,
) -> std::result::Result<T, E> {
    match (a, b) {
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(e),
        (Ok(x), Ok(y)) => Ok(merge(x, y)),
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
    fn thread_counts_out_of_range_are_rejected() {
        for n in [0, MAX_THREADS + 1, usize::MAX] {
            assert!(matches!(
                set_num_threads(n),
                Err(QuantError::InvalidConfig { arg: "n", .. })
            ));
        }
    }

    #[test]
    fn env_values_are_parsed_strictly() {
        assert_eq!(parse_num_threads(" 4 "), Ok(4));
        assert_eq!(parse_num_threads("1024"), Ok(1024));
        for bad in ["0", "-1", "two", "", "1025", "99999999999999999999999"] {
            let e = parse_num_threads(bad).expect_err(bad);
            assert!(e.contains(ENV_NUM_THREADS) && e.contains("ignored"), "{e}");
        }
    }

    #[test]
    fn bind_env_values_are_parsed_strictly() {
        assert_eq!(parse_bind_threads(" 0 "), Ok(false));
        assert_eq!(parse_bind_threads("1"), Ok(true));
        for bad in ["", "2", "yes", "off", "-0", "01"] {
            let e = parse_bind_threads(bad).expect_err(bad);
            assert!(e.contains(ENV_BIND_THREADS) && e.contains("ignored"), "{e}");
        }
        // A long value is cut short in the message.
        let e = parse_bind_threads(&"x".repeat(100_000)).unwrap_err();
        assert!(e.len() < 200 && e.contains("..."), "{e}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn workers_are_bound_one_a_cpu_only_when_the_pool_covers_every_cpu() {
        use nix::sched::{sched_getaffinity, CpuSet};
        use nix::unistd::Pid;
        let mask = || {
            let set = sched_getaffinity(Pid::from_raw(0)).expect("sched_getaffinity");
            (0..CpuSet::count())
                .filter(|&c| set.is_set(c).unwrap_or(false))
                .collect::<Vec<usize>>()
        };
        let allowed = mask();
        let n = allowed.len();
        // Each worker's own mask, in worker order.
        let masks = |threads: usize, bind: bool| {
            let pool = build_pool(threads, bind).expect("pool");
            pool.broadcast(|_| mask())
        };
        if n >= 2 {
            let one_each: Vec<Vec<usize>> = allowed.iter().map(|&c| vec![c]).collect();
            assert_eq!(masks(n, true), one_each);
            assert!(masks(n, false).iter().all(|m| *m == allowed));
        }
        // More workers than CPUs (or a single worker): nobody is bound.
        assert!(masks(n + 1, true).iter().all(|m| *m == allowed));
        assert!(masks(1, true).iter().all(|m| *m == allowed));
        // The caller's own mask is never touched.
        assert_eq!(mask(), allowed);
    }

    #[test]
    fn small_work_stays_on_the_calling_thread() {
        let caller = std::thread::current().id();
        let (par, id) = run(10, |par| (par, std::thread::current().id()));
        assert!(!par);
        assert_eq!(id, caller);
    }

    #[test]
    fn run_tasks_runs_each_task_once_on_any_thread() {
        // Work above the threshold: the caller and the default pool (every
        // CPU) share the tasks when there are two or more CPUs.
        let tasks = 1000;
        let runs: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
        let r: std::result::Result<(), ()> = run_tasks(MIN_PARALLEL_WORK, tasks, |t| {
            runs[t].fetch_add(1, Ordering::Relaxed);
            Ok(())
        });
        assert_eq!(r, Ok(()));
        assert!(runs.iter().all(|n| n.load(Ordering::Relaxed) == 1));
        // Below the threshold: in order, on the calling thread.
        let order = Mutex::new(Vec::new());
        let me = std::thread::current().id();
        let r: std::result::Result<(), ()> = run_tasks(MIN_PARALLEL_WORK - 1, 5, |t| {
            assert_eq!(std::thread::current().id(), me);
            order.lock().unwrap().push(t);
            Ok(())
        });
        assert_eq!(r, Ok(()));
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn run_tasks_reports_a_failure_and_survives_a_panic() {
        let r = run_tasks(MIN_PARALLEL_WORK, 400, |t| {
            if t % 100 == 37 {
                Err(t)
            } else {
                Ok(())
            }
        });
        let failed = r.expect_err("tasks 37, 137, ... fail");
        assert_eq!(failed % 100, 37);
        // A panicking task reaches the caller, and the call returns (the
        // caller does not wait forever on the task that never finished).
        let caught = std::panic::catch_unwind(|| {
            run_tasks(MIN_PARALLEL_WORK, 64, |t| -> std::result::Result<(), ()> {
                assert!(t != 40, "task 40 panics");
                Ok(())
            })
        });
        assert!(caught.is_err());
    }

    #[test]
    fn run_tasks_stops_claiming_after_a_panic() {
        // Each task sleeps 200 µs: the 20,000 would take 2 s on two
        // threads. After the panic only tasks that start while its hook runs
        // (it prints the message, and a backtrace if asked) still run.
        let ran = AtomicUsize::new(0);
        let caught = std::panic::catch_unwind(|| {
            run_tasks(
                MIN_PARALLEL_WORK,
                20_000,
                |t| -> std::result::Result<(), ()> {
                    ran.fetch_add(1, Ordering::Relaxed);
                    assert!(t != 0, "task 0 panics");
                    std::thread::sleep(std::time::Duration::from_micros(200));
                    Ok(())
                },
            )
        });
        assert!(caught.is_err());
        assert!(ran.load(Ordering::Relaxed) < 10_000, "{ran:?} tasks ran");
    }

    #[test]
    fn run_tasks_on_a_worker_of_another_pool_lets_that_pool_run() {
        // The caller is the only worker of `app`, and tasks on ferroquant's
        // workers need `app`: the caller must run `app`'s jobs while it
        // waits for them, not spin (it did: a deadlock, found in review).
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let app = ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            for _ in 0..20 {
                let r: std::result::Result<(), ()> = app.install(|| {
                    run_tasks(MIN_PARALLEL_WORK, 8, |_| {
                        let name = std::thread::current().name().map(str::to_owned);
                        if name.is_some_and(|n| n.starts_with("ferroquant-")) {
                            std::thread::sleep(std::time::Duration::from_millis(2));
                            assert_eq!(app.install(|| (0..1000u64).sum::<u64>()), 499_500);
                        } else {
                            // The caller leaves tasks for the workers.
                            std::thread::sleep(std::time::Duration::from_micros(300));
                        }
                        Ok(())
                    })
                });
                r.unwrap();
            }
            let _ = tx.send(());
        });
        let waited = rx.recv_timeout(std::time::Duration::from_secs(60));
        assert!(waited.is_ok(), "run_tasks did not return within 60 s");
    }

    #[test]
    fn units_per_task_respects_minimum() {
        assert!(units_per_task(1 << 20, 64) * 64 >= MIN_TASK_ELEMENTS);
        assert_eq!(units_per_task(0, 64), MIN_TASK_ELEMENTS / 64);
        assert!(units_per_task(3, 1 << 20) >= 1);
    }
}
