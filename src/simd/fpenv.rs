//! The floating-point environment kernels compute in.
//!
//! A caller may have set flush-to-zero / denormals-are-zero or another
//! rounding mode in MXCSR (a library built with `-ffast-math` does so on load).
//! Those flags are per thread, so a kernel split across the pool would compute
//! some chunks with them and some without, and give results that depend on the
//! thread count. Every thread that runs kernel code therefore computes in the
//! default environment: [`Pinned`] on the calling thread (restoring the
//! caller's flags afterwards), [`set_default`] once on each pool worker.

/// MXCSR at power-on: all exceptions masked, round to nearest, no FTZ, no DAZ.
#[cfg(target_arch = "x86_64")]
const DEFAULT_MXCSR: u32 = 0x1f80;
/// The control bits of MXCSR (DAZ, the exception masks, rounding, FTZ); the
/// low six bits are sticky exception flags, which do not change results.
#[cfg(target_arch = "x86_64")]
const CONTROL_BITS: u32 = 0xffc0;

#[cfg(target_arch = "x86_64")]
fn read() -> u32 {
    let mut v: u32 = 0;
    // SAFETY: stmxcsr stores the 4-byte MXCSR to the given, valid, writable
    // address; SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags));
    }
    v
}

#[cfg(target_arch = "x86_64")]
fn write(v: u32) {
    // SAFETY: ldmxcsr loads MXCSR from the given valid address; every value
    // written here is one read from MXCSR or DEFAULT_MXCSR (no reserved bits set).
    unsafe {
        std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, readonly, preserves_flags));
    }
}

/// Put this thread in the default environment (for threads owned by ferroquant).
pub fn set_default() {
    #[cfg(target_arch = "x86_64")]
    write(DEFAULT_MXCSR);
}

/// Turn flush-to-zero and denormals-are-zero on or off for this thread, as a
/// `-ffast-math` library does on load. Kernels are unaffected either way; this
/// exists so tests can play such a caller.
pub fn set_flush_denormals(on: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        const FTZ_DAZ: u32 = 0x8040;
        let cur = read();
        write(if on { cur | FTZ_DAZ } else { cur & !FTZ_DAZ });
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = on;
}

/// Whether this thread's control flags are the default ones.
pub fn is_default() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        read() & CONTROL_BITS == DEFAULT_MXCSR & CONTROL_BITS
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

/// Holds the default environment on this thread while alive; restores the
/// previous flags when dropped (also on unwinding).
#[derive(Debug)]
pub struct Pinned {
    #[cfg(target_arch = "x86_64")]
    saved: Option<u32>,
}

impl Pinned {
    /// Switch this thread to the default environment if it is not already in it.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let cur = read();
            if cur & CONTROL_BITS == DEFAULT_MXCSR & CONTROL_BITS {
                Pinned { saved: None }
            } else {
                write(DEFAULT_MXCSR);
                Pinned { saved: Some(cur) }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Pinned {}
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = self.saved {
            write(v);
        }
    }
}

/// `v` rounded to f32 as the default environment rounds it, whatever this
/// thread's flags: for floats coming in from a caller (Python's are f64), so
/// that a caller's rounding mode or flush-to-zero does not change a parameter.
pub fn narrow(v: f64) -> f32 {
    let env = Pinned::new();
    // black_box orders the conversion after the switch and before the restore
    // (the compiler does not otherwise tie floating-point code to MXCSR).
    let r = std::hint::black_box(std::hint::black_box(v) as f32);
    drop(env);
    r
}

/// `v` widened to f64 exactly, whatever this thread's flags (denormals-are-zero
/// would read a subnormal `v` as 0): for results going out to a caller.
pub fn widen(v: f32) -> f64 {
    let env = Pinned::new();
    let r = std::hint::black_box(std::hint::black_box(v) as f64);
    drop(env);
    r
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn narrow_and_widen_ignore_the_callers_flags() {
        let before = read();
        // Round toward zero, flush-to-zero, denormals-are-zero.
        write(DEFAULT_MXCSR | 0x6000 | 0x8040);
        let (a, b, c) = (narrow(0.1), narrow(1e-40), widen(1e-40f32));
        let plain = std::hint::black_box(std::hint::black_box(1e-40f32) as f64);
        write(before);
        assert_eq!(a, 0.1f32, "round to nearest");
        assert_eq!(b.to_bits(), 1e-40f32.to_bits(), "no flush to zero");
        assert_eq!(c, 1e-40f32 as f64, "no denormals-are-zero");
        assert_eq!(plain, 0.0, "the flags were in force");
    }

    #[test]
    fn pinned_clears_ftz_daz_and_restores_them() {
        let tiny = std::hint::black_box(1e-39f32); // subnormal
        let before = read();
        write(DEFAULT_MXCSR | 0x8040); // FTZ | DAZ
        assert_eq!(std::hint::black_box(tiny) * 1.0, 0.0, "DAZ active");
        {
            let _p = Pinned::new();
            assert!(is_default());
            assert_eq!(std::hint::black_box(tiny) * 1.0, tiny);
        }
        assert_eq!(
            read() & CONTROL_BITS,
            (DEFAULT_MXCSR | 0x8040) & CONTROL_BITS
        );
        write(before);
    }
}
