//! Tier 2 of the tests (DESIGN.md): one cargo test binary, a module per
//! family, every SIMD path held to the scalar one bit for bit, results held
//! independent of the thread count.

#[path = "../common/rng.rs"]
mod rng;

mod affine;
mod api;
mod blockwise;
mod bounds;
mod dynamic;
mod f16bits;
mod linear;
mod ptq;
mod w8a8;

/// Thread-count changes are process-wide: tests that make them hold this lock.
pub static THREADS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run `f` with the pool at each of `counts` threads, under [`THREADS`].
pub fn with_threads<R>(counts: &[usize], mut f: impl FnMut(usize) -> R) -> Vec<R> {
    let _guard = THREADS.lock().unwrap_or_else(|p| p.into_inner());
    counts
        .iter()
        .map(|&n| {
            ferroquant::parallel::set_num_threads(n).expect("valid thread count");
            f(n)
        })
        .collect()
}
