//! Portable kernels: the executable specification every SIMD path must equal.

use super::Kernels;
use crate::round::round_f32;
use half::{bf16, f16};

/// The scalar ISA marker.
pub(crate) struct Scalar;

/// Seed 000's per-block scale: `max_abs / 127` if `max_abs > 0`, else 1.0 (f32).
#[inline(always)]
pub fn block_scale(max_abs: f32) -> f32 {
    if max_abs > 0.0 {
        max_abs / 127.0
    } else {
        1.0
    }
}

/// Seed 000's code for one value: `clamp(round(v / scale), -127, 127)`.
#[inline(always)]
pub fn quantize_one(v: f32, scale: f32) -> i8 {
    round_f32(v / scale).clamp(-127.0, 127.0) as i8
}

/// Index of the first NaN or infinity in `x` (`x.len()` if none).
pub fn first_non_finite(x: &[f32]) -> usize {
    x.iter().position(|v| !v.is_finite()).unwrap_or(x.len())
}

impl Kernels for Scalar {
    #[inline(always)]
    unsafe fn absmax_bits(x: &[f32]) -> u32 {
        x.iter()
            .map(|v| v.to_bits() & 0x7fff_ffff)
            .fold(0, u32::max)
    }

    #[inline(always)]
    unsafe fn quantize_scaled(x: &[f32], scale: f32, out: &mut [i8]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = quantize_one(v, scale);
        }
    }

    #[inline(always)]
    unsafe fn dequantize_scaled(q: &[i8], scale: f32, out: &mut [f32]) {
        for (o, &c) in out.iter_mut().zip(q) {
            *o = c as f32 * scale;
        }
    }

    #[inline(always)]
    unsafe fn f16_to_f32(x: &[f16], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v.to_f32();
        }
    }

    #[inline(always)]
    unsafe fn bf16_to_f32(x: &[bf16], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v.to_f32();
        }
    }

    #[inline(always)]
    unsafe fn f64_to_f32(x: &[f64], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_of_zero_block_is_one() {
        assert_eq!(block_scale(0.0), 1.0);
        assert_eq!(block_scale(127.0), 1.0);
        // The smallest subnormal divided by 127 underflows to zero.
        assert_eq!(block_scale(f32::from_bits(1)), 0.0);
    }

    #[test]
    fn codes_round_half_away_and_clamp() {
        assert_eq!(quantize_one(0.5, 1.0), 1);
        assert_eq!(quantize_one(-0.5, 1.0), -1);
        assert_eq!(quantize_one(-2.5, 1.0), -3);
        assert_eq!(quantize_one(1000.0, 1.0), 127);
        assert_eq!(quantize_one(-1000.0, 1.0), -127);
    }

    #[test]
    fn absmax_bits_flags_non_finite() {
        // SAFETY: the scalar kernels need no CPU features.
        let m = unsafe { Scalar::absmax_bits(&[1.0, -3.0, 2.0]) };
        assert_eq!(f32::from_bits(m), 3.0);
        let m = unsafe { Scalar::absmax_bits(&[1.0, f32::NEG_INFINITY]) };
        assert!(m >= super::super::F32_INF_BITS);
        let m = unsafe { Scalar::absmax_bits(&[f32::NAN]) };
        assert!(m > super::super::F32_INF_BITS);
        assert_eq!(first_non_finite(&[0.0, 1.0, f32::NAN]), 2);
    }
}
