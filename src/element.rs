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
    fn f64_overflow_becomes_infinite() {
        assert!(1e300f64.to_f32().is_infinite());
        assert!(f32::as_f32_slice(&[1.0]).is_some());
        assert!(f64::as_f32_slice(&[1.0]).is_none());
    }
}
