//! Releasing the GIL around a kernel, safely at interpreter exit.
//!
//! Before Python 3.14, a thread that re-takes the GIL once the interpreter is
//! finalizing (a daemon thread still inside a kernel when the main thread
//! returns) is ended with `pthread_exit`: a forced unwind through our frames,
//! which PyO3's trampoline catches as a panic and drops, and glibc then aborts
//! the whole process ("FATAL: exception not rethrown", exit status 134 instead
//! of the program's own). PyO3 guards `PyGILState_Ensure` against this, not the
//! re-take at the end of `Python::detach`, and a drop guard of ours does not
//! run either (the re-take is a call that may not unwind, so no cleanup is
//! emitted for it).
//!
//! So the threads are kept from re-taking the GIL at all once it matters: an
//! `atexit` callback ([`interpreter_exiting`], run by the finalizing thread
//! after the non-daemon threads are joined and before finalization starts)
//! raises a flag, and any other thread parks for good, without the GIL, where
//! it would otherwise re-take it: when a kernel returns ([`Detach::detached`])
//! and before a NumPy call that releases the GIL itself ([`may_release`]: a
//! large `numpy.zeros` does, around `calloc`). That is what Python 3.14 itself
//! does with such threads. Threads already between the check and the GIL are
//! let through first: the callback releases the GIL until they hold it again.

use pyo3::Python;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// Raised by [`interpreter_exiting`].
static EXITING: AtomicBool = AtomicBool::new(false);
/// Threads past the check that may yet re-take the GIL: on their way back from
/// a kernel, or inside a call that may release it.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// The thread that runs the `atexit` callbacks: it finalizes, so it may always
/// re-take the GIL (callbacks registered before ours may still call kernels).
static FINALIZER: OnceLock<ThreadId> = OnceLock::new();

/// How long the callback waits for the threads in flight.
const LET_THROUGH: Duration = Duration::from_secs(2);

/// Count this thread in flight, or, if the interpreter is exiting and this is
/// not the thread that finalizes it, return `false` (the caller parks). Both
/// sides are SeqCst: either this thread sees the flag, or the callback sees
/// this thread in flight and waits for it.
fn take_off() -> bool {
    IN_FLIGHT.fetch_add(1, SeqCst);
    if EXITING.load(SeqCst) && FINALIZER.get() != Some(&std::thread::current().id()) {
        IN_FLIGHT.fetch_sub(1, SeqCst);
        return false;
    }
    true
}

/// Counts a thread out of flight when dropped (also on a panic).
struct Landed;

impl Drop for Landed {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, SeqCst);
    }
}

fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

/// `Python::detach` for the bindings.
pub(crate) trait Detach {
    /// Run `f` without the GIL, then re-take it, unless the interpreter is
    /// exiting and this is not the thread that finalizes it: then park the
    /// thread for good. A panic in `f` reaches Python as it would through
    /// `detach`.
    fn detached<T: Send, F: Send + FnOnce() -> T>(self, f: F) -> T;
}

impl Detach for Python<'_> {
    #[inline]
    fn detached<T: Send, F: Send + FnOnce() -> T>(self, f: F) -> T {
        let out = self.detach(move || {
            let out = catch_unwind(AssertUnwindSafe(f));
            if !take_off() {
                park_forever();
            }
            out
        });
        drop(Landed);
        match out {
            Ok(v) => v,
            Err(panic) => resume_unwind(panic),
        }
    }
}

/// Run `f`, a call that may release and re-take the GIL itself (NumPy's
/// `zeros`, or Python code such as our exception classes), so that an exiting
/// interpreter waits for it (or, once it is exiting, park without the GIL
/// instead of calling it).
pub(crate) fn may_release<T>(py: Python<'_>, f: impl FnOnce() -> T) -> T {
    if !take_off() {
        py.detach(|| -> () { park_forever() });
    }
    let _landed = Landed;
    f()
}

/// Run in a child after `os.fork()`: the threads that were in flight in the
/// parent do not exist here.
pub(crate) fn forked_child() {
    IN_FLIGHT.store(0, SeqCst);
}

/// The `atexit` callback: raise the flag, then release the GIL until every
/// thread in flight holds it again (at most [`LET_THROUGH`]).
pub(crate) fn interpreter_exiting(py: Python<'_>) {
    let _ = FINALIZER.set(std::thread::current().id());
    EXITING.store(true, SeqCst);
    py.detach(|| {
        let deadline = Instant::now() + LET_THROUGH;
        while IN_FLIGHT.load(SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(100));
        }
    });
}
