//! SIMD kernels and their runtime dispatch: the only home of `unsafe`.
//!
//! The instruction set is detected once ([`Isa::detected`], cached in a
//! `OnceLock`), never fixed at compile time, so one wheel runs on any x86-64
//! CPU and uses AVX-512 where it exists. `FERROQUANT_SIMD=scalar` (or `avx2`)
//! caps the choice, for debugging and for comparing paths.
//!
//! Each ISA implements a few primitives ([`Kernels`]); the block loops are
//! written once, generically, and instantiated inside a
//! `#[target_feature]` entry point per ISA so the primitives inline with the
//! right instructions. The scalar implementation is the executable spec;
//! every other path reproduces it bit for bit (tests/simd_parity.rs).

#![allow(unsafe_code)]

pub mod fpenv;
pub mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use half::{bf16, f16};
use std::sync::atomic::{AtomicU8, Ordering};

/// Name of the environment variable that caps the instruction set.
pub const ENV_SIMD: &str = "FERROQUANT_SIMD";

/// Why the `FERROQUANT_SIMD` value in the environment is ignored, if it is.
pub fn env_warning() -> Option<String> {
    let raw = std::env::var(ENV_SIMD).ok()?;
    if Isa::from_name(raw.trim()).is_some() {
        return None;
    }
    let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
    Some(format!(
        "{ENV_SIMD}={raw:?} is not one of {}; it is ignored",
        names.join(", ")
    ))
}

/// Bits of `+inf` in f32: an absolute value's bits at or above this are non-finite.
pub const F32_INF_BITS: u32 = 0x7f80_0000;

/// An instruction set the kernels can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust; the reference every other path must equal.
    Scalar,
    /// x86-64 AVX2 with F16C (256-bit; every AVX2 CPU has F16C).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL (512-bit, masked tails).
    Avx512,
}

impl Isa {
    /// Lower-case name, as `ferroquant.simd_isa()` reports it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Whether this CPU can run the ISA.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every ISA this CPU supports, scalar first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// Every tier, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The tier named `name` (as [`Isa::name`] spells it).
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name)
    }

    /// The best supported ISA, capped by `FERROQUANT_SIMD` (`scalar`, `avx2`,
    /// `avx512`; any other value is ignored, and [`env_warning`] says so).
    /// Decided once per process.
    ///
    /// Cached in an atomic rather than a `OnceLock`: racing first calls both
    /// detect (the same answer) and nothing ever blocks, so a `fork()` during
    /// detection cannot leave a child waiting on an initialisation that will
    /// never finish.
    pub fn detected() -> Isa {
        static DETECTED: AtomicU8 = AtomicU8::new(0);
        let cached = DETECTED.load(Ordering::Acquire);
        if let Some(&isa) = Isa::ALL.get((cached as usize).wrapping_sub(1)) {
            return isa;
        }
        let cap = std::env::var(ENV_SIMD)
            .ok()
            .and_then(|v| Isa::from_name(v.trim()))
            .unwrap_or(Isa::Avx512);
        let isa = cap.usable();
        let index = Isa::ALL.iter().position(|&i| i == isa).unwrap_or(0);
        DETECTED.store(index as u8 + 1, Ordering::Release);
        isa
    }

    /// `self` if this CPU supports it, else the best supported ISA below it.
    /// Dispatch goes through this, so a caller can never run unsupported code.
    fn usable(self) -> Isa {
        if self.is_supported() {
            self
        } else {
            Isa::supported()
                .into_iter()
                .filter(|&i| i <= self)
                .max()
                .unwrap_or(Isa::Scalar)
        }
    }
}

/// The per-ISA primitives the generic loops are built from.
///
/// # Safety
/// Implementations may use instructions of their ISA: call them only from a
/// function compiled with (and a CPU that has) those target features.
pub(crate) trait Kernels {
    /// Largest `bits(x) & 0x7fff_ffff` over `x` (0 for empty): the bits of
    /// max |x|, and `>= F32_INF_BITS` iff some element is NaN or infinite.
    unsafe fn absmax_bits(x: &[f32]) -> u32;
    /// `out[i] = clamp(round_half_away(x[i] / scale), -127, 127)`, over `min(len)`.
    unsafe fn quantize_scaled(x: &[f32], scale: f32, out: &mut [i8]);
    /// `out[i] = q[i] as f32 * scale`, over `min(len)`.
    unsafe fn dequantize_scaled(q: &[i8], scale: f32, out: &mut [f32]);
    /// `out[i] = f32(x[i])`, exact, over `min(len)`.
    unsafe fn f16_to_f32(x: &[f16], out: &mut [f32]);
    /// `out[i] = f32(x[i])`, exact, over `min(len)`.
    unsafe fn bf16_to_f32(x: &[bf16], out: &mut [f32]);
    /// `out[i] = x[i] as f32` (round to nearest even), over `min(len)`.
    unsafe fn f64_to_f32(x: &[f64], out: &mut [f32]);
}

/// Seed 000's blockwise loop over f32 (kwaai-compression `BlockwiseQuantizer::compress`).
/// Writes each block's f32 scale to `scales`; returns the index (into `x`) of
/// the first non-finite element, if any, at which point it stops.
#[inline(always)]
unsafe fn blockwise_quantize_generic<K: Kernels>(
    x: &[f32],
    block: usize,
    codes: &mut [i8],
    scales: &mut [f32],
) -> Result<(), usize> {
    let blocks = x.chunks(block).zip(codes.chunks_mut(block));
    for (b, ((xb, cb), s)) in blocks.zip(scales.iter_mut()).enumerate() {
        // SAFETY: forwarded from this function's contract (caller has K's features).
        let m = unsafe { K::absmax_bits(xb) };
        if m >= F32_INF_BITS {
            return Err(b * block + scalar::first_non_finite(xb));
        }
        let scale = scalar::block_scale(f32::from_bits(m));
        *s = scale;
        if scale > 0.0 {
            // SAFETY: as above.
            unsafe { K::quantize_scaled(xb, scale, cb) };
        } else {
            cb.fill(0);
        }
    }
    Ok(())
}

#[inline(always)]
unsafe fn blockwise_dequantize_generic<K: Kernels>(
    codes: &[i8],
    block: usize,
    scales: &[f32],
    out: &mut [f32],
) {
    let blocks = codes.chunks(block).zip(out.chunks_mut(block));
    for ((cb, ob), &s) in blocks.zip(scales) {
        // SAFETY: forwarded from this function's contract.
        unsafe { K::dequantize_scaled(cb, s, ob) };
    }
}

/// Generates one `#[target_feature]` entry point per ISA around a generic
/// loop, and the safe dispatcher that picks among them.
macro_rules! dispatch {
    ($(#[$doc:meta])* pub fn $name:ident = $generic:ident($($arg:ident: $ty:ty),*) -> $ret:ty;) => {
        $(#[$doc])*
        pub fn $name(isa: Isa, $($arg: $ty),*) -> $ret {
            match isa.usable() {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => {
                    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
                    unsafe fn entry($($arg: $ty),*) -> $ret {
                        // SAFETY: compiled with the AVX-512 features the kernels use.
                        unsafe { $generic::<avx512::Avx512>($($arg),*) }
                    }
                    // SAFETY: `usable()` returned Avx512, so the CPU supports it.
                    unsafe { entry($($arg),*) }
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => {
                    #[target_feature(enable = "avx2,f16c")]
                    unsafe fn entry($($arg: $ty),*) -> $ret {
                        // SAFETY: compiled with AVX2 and F16C, which the kernels use.
                        unsafe { $generic::<avx2::Avx2>($($arg),*) }
                    }
                    // SAFETY: `usable()` returned Avx2, so the CPU supports it.
                    unsafe { entry($($arg),*) }
                }
                // SAFETY: the scalar kernels use no special instructions.
                Isa::Scalar => unsafe { $generic::<scalar::Scalar>($($arg),*) },
                // Tiers compiled only for x86-64 cannot be `usable()` elsewhere.
                #[cfg(not(target_arch = "x86_64"))]
                Isa::Avx2 | Isa::Avx512 => unreachable!("usable() returned an x86-64 tier"),
            }
        }
    };
}

dispatch! {
    /// Quantize consecutive blocks of `x` (the last may be short) to int8 codes
    /// and f32 scales, seed 000's math. `Err(i)`: `x[i]` is the first non-finite value.
    pub fn blockwise_quantize_f32 = blockwise_quantize_generic(
        x: &[f32], block: usize, codes: &mut [i8], scales: &mut [f32]
    ) -> Result<(), usize>;
}

dispatch! {
    /// Dequantize consecutive blocks: `out[i] = codes[i] as f32 * scales[i / block]`.
    pub fn blockwise_dequantize = blockwise_dequantize_generic(
        codes: &[i8], block: usize, scales: &[f32], out: &mut [f32]
    ) -> ();
}

#[inline(always)]
unsafe fn absmax_bits_generic<K: Kernels>(x: &[f32]) -> u32 {
    // SAFETY: forwarded from this function's contract.
    unsafe { K::absmax_bits(x) }
}

#[inline(always)]
unsafe fn quantize_scaled_generic<K: Kernels>(x: &[f32], scale: f32, out: &mut [i8]) {
    // SAFETY: forwarded from this function's contract.
    unsafe { K::quantize_scaled(x, scale, out) }
}

dispatch! {
    /// Bits of max |x| (`>= F32_INF_BITS` iff some element is non-finite).
    pub fn absmax_bits = absmax_bits_generic(x: &[f32]) -> u32;
}

dispatch! {
    /// `out[i] = clamp(round(x[i] / scale), -127, 127)` (scale > 0).
    pub fn quantize_scaled = quantize_scaled_generic(x: &[f32], scale: f32, out: &mut [i8]) -> ();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detected_is_supported() {
        assert!(Isa::detected().is_supported());
        assert_eq!(Isa::supported()[0], Isa::Scalar);
    }

    #[test]
    fn usable_never_exceeds_support() {
        for isa in Isa::ALL {
            assert!(isa.usable().is_supported());
            assert!(isa.usable() <= isa);
        }
    }
}

/// Generic wrappers so the conversions dispatch like the kernels.
macro_rules! conversion {
    ($(#[$doc:meta])* $name:ident, $generic:ident, $t:ty) => {
        #[inline(always)]
        unsafe fn $generic<K: Kernels>(x: &[$t], out: &mut [f32]) {
            // SAFETY: forwarded from this function's contract.
            unsafe { K::$name(x, out) }
        }
        dispatch! {
            $(#[$doc])*
            pub fn $name = $generic(x: &[$t], out: &mut [f32]) -> ();
        }
    };
}

conversion!(
    /// float16 -> float32 (exact), over `min(len)`.
    f16_to_f32, f16_to_f32_generic, f16
);
conversion!(
    /// bfloat16 -> float32 (exact), over `min(len)`.
    bf16_to_f32, bf16_to_f32_generic, bf16
);
conversion!(
    /// float64 -> float32 (round to nearest even, as `as f32`), over `min(len)`.
    f64_to_f32, f64_to_f32_generic, f64
);
