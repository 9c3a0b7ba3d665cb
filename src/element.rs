//! Input element types.
//!
//! Kernels are generic over [`Float`], so an `f16`, `bf16` or `f64` array is
//! read where it lies and converted to the kernel's working precision element
//! by element (in small staged runs), never up-cast as a whole first.

use crate::simd::{self, Isa};
use half::{bf16, f16};

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A floating-point input element: `f32`, `f64`, `f16` or `bf16`.
///
/// Sealed: the kernels' exactness arguments are made for these four types.
pub trait Float: Copy + Send + Sync + 'static + private::Sealed {
    /// The NumPy name of the type (`"float32"`, ...).
    const NAME: &'static str;

    /// Convert to f32, rounding to nearest-even (f64 values beyond f32's range become ±inf).
    fn to_f32(self) -> f32;

    /// Convert to f64 (exact for every type but f64 itself, where it is the identity).
    fn to_f64(self) -> f64;

    /// Convert a run to f32 over `min(src.len(), dst.len())` elements, with
    /// `isa`'s conversion instructions (F16C, vcvtpd2ps, ...). The result is
    /// exactly that of mapping [`Float::to_f32`], whatever the ISA.
    fn convert_to_f32(isa: Isa, src: &[Self], dst: &mut [f32]);

    /// The slice itself when `Self` is `f32`, so f32 kernels read in place.
    fn as_f32_slice(src: &[Self]) -> Option<&[f32]> {
        let _ = src;
        None
    }

    /// The slice itself when `Self` is `f64`, so f64 kernels read in place.
    fn as_f64_slice(src: &[Self]) -> Option<&[f64]> {
        let _ = src;
        None
    }

    /// The slice itself when `Self` is `f32`, so f32 kernels write in place.
    fn as_f32_mut(dst: &mut [Self]) -> Option<&mut [f32]> {
        let _ = dst;
        None
    }

    /// The slice itself when `Self` is `f64`, so f64 kernels write in place.
    fn as_f64_mut(dst: &mut [Self]) -> Option<&mut [f64]> {
        let _ = dst;
        None
    }

    /// `x` rounded once, to nearest even, to `Self` (SPEC: a dequantized f64
    /// result is rounded once to the output dtype).
    fn from_f64_once(x: f64) -> Self;

    /// [`Float::from_f64_once`] over a run, `min(len)` elements.
    fn convert_from_f64(isa: Isa, src: &[f64], dst: &mut [Self]) {
        let _ = isa;
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_f64_once(s);
        }
    }
}

/// `x` rounded to f32 *to odd*: exact values stay, an inexact one becomes the
/// f32 toward zero with its last bit set. Rounding that result to nearest-even
/// at 8 or 11 significant bits equals rounding `x` there directly (f32 keeps
/// more than two extra bits), so f64 -> f16/bf16 rounds once. (A plain
/// `src` converted to f32 (as [`Float::to_f32`]) in the default floating-point
/// environment, whatever the calling thread's flags: a caller's flush-to-zero
/// would otherwise turn subnormal results into zeros.
pub fn to_f32_pinned<T: Float>(src: &[T], dst: &mut [f32]) {
    let _env = simd::fpenv::Pinned::new();
    // Opaque to the compiler, so the conversion stays after the switch.
    let src = std::hint::black_box(src);
    T::convert_to_f32(Isa::detected(), src, dst);
    std::hint::black_box(&mut *dst);
}

/// `x as f32` first would round twice and miss a tie by the dropped bits.)
#[inline]
pub fn f64_to_f32_round_to_odd(x: f64) -> f32 {
    let f = x as f32;
    if f as f64 == x || x.is_nan() {
        return f;
    }
    let toward_zero = if (f as f64).abs() > x.abs() {
        f32::from_bits(f.to_bits() - 1)
    } else {
        f
    };
    f32::from_bits(toward_zero.to_bits() | 1)
}

impl Float for f32 {
    const NAME: &'static str = "float32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn convert_to_f32(_: Isa, src: &[Self], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        dst[..n].copy_from_slice(&src[..n]);
    }
    fn as_f32_slice(src: &[Self]) -> Option<&[f32]> {
        Some(src)
    }
    fn as_f32_mut(dst: &mut [Self]) -> Option<&mut [f32]> {
        Some(dst)
    }
    #[inline(always)]
    fn from_f64_once(x: f64) -> Self {
        x as f32
    }
    fn convert_from_f64(isa: Isa, src: &[f64], dst: &mut [Self]) {
        simd::f64_to_f32(isa, src, dst);
    }
}

impl Float for f64 {
    const NAME: &'static str = "float64";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    fn convert_to_f32(isa: Isa, src: &[Self], dst: &mut [f32]) {
        simd::f64_to_f32(isa, src, dst);
    }
    fn as_f64_slice(src: &[Self]) -> Option<&[f64]> {
        Some(src)
    }
    fn as_f64_mut(dst: &mut [Self]) -> Option<&mut [f64]> {
        Some(dst)
    }
    #[inline(always)]
    fn from_f64_once(x: f64) -> Self {
        x
    }
}

impl Float for f16 {
    const NAME: &'static str = "float16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn convert_to_f32(isa: Isa, src: &[Self], dst: &mut [f32]) {
        simd::f16_to_f32(isa, src, dst);
    }
    #[inline(always)]
    fn from_f64_once(x: f64) -> Self {
        f16::from_f32(f64_to_f32_round_to_odd(x))
    }
}

impl Float for bf16 {
    const NAME: &'static str = "bfloat16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn convert_to_f32(isa: Isa, src: &[Self], dst: &mut [f32]) {
        simd::bf16_to_f32(isa, src, dst);
    }
    #[inline(always)]
    fn from_f64_once(x: f64) -> Self {
        bf16::from_f32(f64_to_f32_round_to_odd(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_slice_matches_scalar<T: Float>(xs: &[T]) {
        for isa in Isa::supported() {
            // Every prefix length, so vector tails of every size are covered.
            for n in [0, 1, 7, 15, 16, 17, 31, xs.len()] {
                let n = n.min(xs.len());
                let mut dst = vec![-1f32; n];
                T::convert_to_f32(isa, &xs[..n], &mut dst);
                for (x, d) in xs.iter().zip(&dst) {
                    let (want, got) = (x.to_f32(), *d);
                    // NaN payloads may be quieted differently; NaN input is an error anyway.
                    assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()));
                }
            }
        }
    }

    #[test]
    fn slice_conversion_equals_element_conversion() {
        let f: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 1.37e-3).collect();
        check_slice_matches_scalar(&f);
        let d: Vec<f64> = vec![1e300, -1e300, 1.0 + 1e-12, 3.4028235677973366e38, -0.0];
        check_slice_matches_scalar(&d);
        let h: Vec<f16> = (0..u16::MAX).step_by(97).map(f16::from_bits).collect();
        check_slice_matches_scalar(&h);
        let b: Vec<bf16> = (0..u16::MAX).step_by(89).map(bf16::from_bits).collect();
        check_slice_matches_scalar(&b);
    }

    #[test]
    fn f64_to_half_rounds_once() {
        // 1 + 2^-8 + 2^-40: above the bf16 tie at 1 + 2^-8 only by bits f32 drops.
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(bf16::from_f64_once(x).to_bits(), 0x3f81);
        assert_eq!(
            bf16::from_f32(x as f32).to_bits(),
            0x3f80,
            "double rounding"
        );
        let y = 1.0 + 2f64.powi(-11) + 2f64.powi(-45);
        assert_eq!(f16::from_f64_once(y).to_bits(), 0x3c01);
        // Exact ties still go to even; overflow, subnormals, signs.
        assert_eq!(f16::from_f64_once(1.0 + 2f64.powi(-11)).to_bits(), 0x3c00);
        assert_eq!(f16::from_f64_once(70000.0), f16::INFINITY);
        assert_eq!(f16::from_f64_once(-1e-300).to_bits(), 0x8000);
        assert_eq!(f16::from_f64_once(2f64.powi(-24)).to_bits(), 0x0001);
        assert_eq!(bf16::from_f64_once(1e300), bf16::INFINITY);
        assert_eq!(bf16::from_f64_once(-3.0).to_f32(), -3.0);
        // Against exhaustive neighbours of every f16: the nearest, ties to even.
        for bits in (0u16..0x7bff).step_by(7) {
            let lo = f16::from_bits(bits).to_f64();
            let hi = f16::from_bits(bits + 1).to_f64();
            let mid = (lo + hi) / 2.0;
            assert_eq!(
                f16::from_f64_once(mid + (hi - lo) * 1e-9).to_bits(),
                bits + 1
            );
            assert_eq!(f16::from_f64_once(mid - (hi - lo) * 1e-9).to_bits(), bits);
        }
    }

    #[test]
    fn f64_overflow_becomes_infinite() {
        assert!(1e300f64.to_f32().is_infinite());
        assert!(f32::as_f32_slice(&[1.0]).is_some());
        assert!(f64::as_f32_slice(&[1.0]).is_none());
    }
}
