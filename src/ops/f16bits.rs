//! float16 bit patterns — SPEC §5's `fp32_to_fp16_bits` / `fp16_bits_to_fp32`
//! (seed 004 stores f16 bits as u16): IEEE binary16, round to nearest even,
//! exactly as the `half` crate converts (subnormals, overflow to ±inf, NaN
//! quieted with the top of its payload kept). F16C / AVX-512 convert the same
//! way (checked exhaustively against `half`); large inputs are split across
//! the pool.
//!
//! ```
//! # fn main() -> Result<(), ferroquant::QuantError> {
//! use ferroquant::ops::f16bits::{fp16_bits_to_fp32, fp32_to_fp16_bits};
//!
//! let x = [1.0f32, 65520.0, 1e-8, -0.0];
//! let mut bits = [0u16; 4];
//! fp32_to_fp16_bits(&x, &mut bits)?;
//! assert_eq!(bits, [0x3c00, 0x7c00, 0x0000, 0x8000]); // 65520 rounds to inf
//! let mut back = [0f32; 4];
//! fp16_bits_to_fp32(&bits, &mut back)?;
//! assert_eq!(back[0], 1.0);
//! # Ok(())
//! # }
//! ```

use crate::element::Float;
use crate::error::{QuantError, Result};
use crate::parallel;
use crate::simd::{self, Isa, Store};
use half::f16;
use half::slice::HalfBitsSliceExt;
use rayon::prelude::*;

/// Elements one task converts (a conversion is a few cycles an element).
const TASK: usize = 1 << 16;

/// `out[i]` = the binary16 bits of `x[i]` rounded to nearest even.
///
/// Errors: `ShapeMismatch` naming `out` when the lengths differ.
pub fn fp32_to_fp16_bits(x: &[f32], out: &mut [u16]) -> Result<()> {
    fp32_to_fp16_bits_with(Isa::detected(), x, out)
}

/// [`fp32_to_fp16_bits`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn fp32_to_fp16_bits_with(isa: Isa, x: &[f32], out: &mut [u16]) -> Result<()> {
    check(x.len(), out.len())?;
    let _env = simd::fpenv::Pinned::new();
    let out: &mut [f16] = out.reinterpret_cast_mut();
    parallel::run(x.len(), |par| {
        if par {
            x.par_chunks(TASK)
                .zip(out.par_chunks_mut(TASK))
                .for_each(|(xs, os)| simd::f32_to_f16(isa, xs, os));
        } else if Store::for_run(2 * x.len(), 2 * x.len(), false) == Store::Streaming {
            // One thread, an output too large for the cache: written without
            // first reading its lines (f32 -> f16 of 16 Mi values, 1 thread,
            // Zen 4, interleaved with ONNX Runtime's Cast: see benches/README).
            simd::f32_to_f16_streamed(isa, x, out);
        } else {
            simd::f32_to_f16(isa, x, out);
        }
    });
    Ok(())
}

/// [`fp32_to_fp16_bits`] of any float input, each value first read as f32 as
/// every kernel reads its input (SPEC: f64 rounded to nearest even, f16 and
/// bf16 exactly; a value past f32's range becomes ±inf, converted as such).
/// An f64 value is thus rounded twice, to f32 and then to f16.
///
/// Errors: `ShapeMismatch` naming `out` when the lengths differ.
pub fn float_to_fp16_bits<T: Float>(x: &[T], out: &mut [u16]) -> Result<()> {
    if let Some(xf) = T::as_f32_slice(x) {
        return fp32_to_fp16_bits(xf, out);
    }
    check(x.len(), out.len())?;
    let isa = Isa::detected();
    let _env = simd::fpenv::Pinned::new();
    let out: &mut [f16] = out.reinterpret_cast_mut();
    // A task's values through a stage of f32 (a task at a time: never the
    // whole input up-cast).
    let task = |xs: &[T], os: &mut [f16]| {
        let mut stage = vec![0f32; xs.len()];
        T::convert_to_f32(isa, xs, &mut stage);
        simd::f32_to_f16(isa, &stage, os);
    };
    parallel::run(x.len(), |par| {
        if par {
            x.par_chunks(TASK)
                .zip(out.par_chunks_mut(TASK))
                .for_each(|(xs, os)| task(xs, os));
        } else {
            x.chunks(TASK)
                .zip(out.chunks_mut(TASK))
                .for_each(|(xs, os)| task(xs, os));
        }
    });
    Ok(())
}

/// `out[i]` = the float32 value of the binary16 bits `bits[i]` (exact).
///
/// Errors: `ShapeMismatch` naming `out` when the lengths differ.
pub fn fp16_bits_to_fp32(bits: &[u16], out: &mut [f32]) -> Result<()> {
    fp16_bits_to_fp32_with(Isa::detected(), bits, out)
}

/// [`fp16_bits_to_fp32`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn fp16_bits_to_fp32_with(isa: Isa, bits: &[u16], out: &mut [f32]) -> Result<()> {
    check(bits.len(), out.len())?;
    let _env = simd::fpenv::Pinned::new();
    let h: &[f16] = bits.reinterpret_cast();
    parallel::run(h.len(), |par| {
        if par {
            h.par_chunks(TASK)
                .zip(out.par_chunks_mut(TASK))
                .for_each(|(hs, os)| simd::f16_to_f32(isa, hs, os));
        } else if Store::for_run(4 * h.len(), 4 * h.len(), false) == Store::Streaming {
            // As fp32_to_fp16_bits: an output too large for the cache.
            simd::f16_to_f32_streamed(isa, h, out);
        } else {
            simd::f16_to_f32(isa, h, out);
        }
    });
    Ok(())
}

fn check(n: usize, out: usize) -> Result<()> {
    if n != out {
        return Err(QuantError::ShapeMismatch {
            arg: "out",
            expected: format!("{n} elements"),
            actual: out.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_half_round_trips_and_matches_the_half_crate() {
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        for isa in Isa::supported() {
            let mut f = vec![0f32; bits.len()];
            fp16_bits_to_fp32_with(isa, &bits, &mut f).unwrap();
            for (&b, &v) in bits.iter().zip(&f) {
                assert_eq!(
                    v.to_bits(),
                    f16::from_bits(b).to_f32().to_bits(),
                    "{isa:?} {b:#x}"
                );
            }
            let mut back = vec![0u16; bits.len()];
            fp32_to_fp16_bits_with(isa, &f, &mut back).unwrap();
            for (&b, &r) in bits.iter().zip(&back) {
                // A signalling NaN comes back quiet; every other half exactly.
                let want = f16::from_f32(f16::from_bits(b).to_f32()).to_bits();
                assert_eq!(r, want, "{isa:?} {b:#x}");
            }
        }
    }

    #[test]
    fn lengths_must_match() {
        let e = fp32_to_fp16_bits(&[1.0, 2.0], &mut [0u16; 3]).unwrap_err();
        assert!(matches!(e, QuantError::ShapeMismatch { arg: "out", .. }));
    }
}
