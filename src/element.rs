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

    /// The slice itself when `Self` is `f16`, so f16 kernels write in place.
    fn as_f16_mut(dst: &mut [Self]) -> Option<&mut [f16]> {
        let _ = dst;
        None
    }

    /// The slice itself when `Self` is `bf16`, so bf16 kernels write in place.
    fn as_bf16_mut(dst: &mut [Self]) -> Option<&mut [bf16]> {
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

/// `x` rounded to f32 *to odd*: exact values stay, an inexact one becomes the
/// f32 toward zero with its last bit set. Rounding that result to nearest-even
/// at 8 or 11 significant bits equals rounding `x` there directly (f32 keeps
/// more than two extra bits), so f64 -> f16/bf16 rounds once. (A plain
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

/// f64 -> f16/bf16 over `min(len)` as [`Float::from_f64_once`]: rounded to
/// odd at f32 and then to the narrow type by `narrow`, through a small stack
/// run (both steps vectorized).
fn narrow_from_f64<T>(isa: Isa, src: &[f64], dst: &mut [T], narrow: fn(Isa, &[f32], &mut [T])) {
    const RUN: usize = 256;
    let mut odd = [0f32; RUN];
    for (s, d) in src.chunks(RUN).zip(dst.chunks_mut(RUN)) {
        let odd = &mut odd[..s.len().min(d.len())];
        simd::f64_to_f32_odd(isa, s, odd);
        narrow(isa, odd, d);
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
    fn convert_from_f64(isa: Isa, src: &[f64], dst: &mut [Self]) {
        narrow_from_f64(isa, src, dst, simd::f32_to_f16);
    }
    fn as_f16_mut(dst: &mut [Self]) -> Option<&mut [f16]> {
        Some(dst)
    }
}

impl Float for bf16 {
    const NAME: &'static str = "bfloat16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // The top half of an f32, every pattern exactly (a signalling NaN
        // included), as the bulk widening `convert_to_f32` gives it.
        f32::from_bits(u32::from(self.to_bits()) << 16)
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
    fn convert_from_f64(isa: Isa, src: &[f64], dst: &mut [Self]) {
        narrow_from_f64(isa, src, dst, simd::f32_to_bf16);
    }
    fn as_bf16_mut(dst: &mut [Self]) -> Option<&mut [bf16]> {
        Some(dst)
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

    /// Doubles near every kind of edge of a rounding to f32, f16 and bf16:
    /// ties of each (exactly, and by a few bits f32 drops), the ends of the
    /// ranges and subnormals, signs, infinities and NaN, and plain values.
    fn rounding_edges() -> Vec<f64> {
        let mut v = vec![
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
            -f64::NAN,
        ];
        v.extend([
            f32::MAX as f64,
            f32::MAX as f64 * (1.0 + 1e-12),
            1e300,
            -1e300,
        ]);
        v.extend([
            65504.0,
            65519.99,
            65520.0,
            70000.0,
            2f64.powi(-24),
            2f64.powi(-25),
        ]);
        v.extend([
            1e-40,
            -1e-40,
            2f64.powi(-149),
            2f64.powi(-150),
            1e-300,
            -1e-320,
        ]);
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..4000 {
            let r = next();
            let bits16 = (r >> 48) as u16 & 0x7fff;
            let sign = if r & 1 == 1 { -1.0 } else { 1.0 };
            let h = f16::from_bits(bits16).to_f64();
            let b = bf16::from_bits(bits16).to_f64();
            let (hu, bu) = (2f64.powi(-11) * h.abs(), 2f64.powi(-8) * b.abs());
            let tiny = 2f64.powi(-40) * (r >> 20 & 0xff) as f64;
            for base in [h + hu / 2.0, b + bu / 2.0] {
                v.extend([base, base * (1.0 + tiny), base * (1.0 - tiny)].map(|x| sign * x));
            }
            v.push(f64::from_bits(r));
            v.push(sign * (r >> 11) as f64 * 2f64.powi(-53) * 3.0);
        }
        v
    }

    #[test]
    fn narrowing_runs_round_once_on_every_isa() {
        let xs = rounding_edges();
        let same = |a: u16, b: u16, nan: bool| a == b || nan;
        for isa in Isa::supported() {
            for start in [0usize, 1, 3] {
                let src = &xs[start..];
                let mut h = vec![f16::ZERO; src.len()];
                let mut b = vec![bf16::ZERO; src.len()];
                f16::convert_from_f64(isa, src, &mut h);
                bf16::convert_from_f64(isa, src, &mut b);
                for (i, &x) in src.iter().enumerate() {
                    let (wh, wb) = (f16::from_f64_once(x), bf16::from_f64_once(x));
                    assert!(
                        same(h[i].to_bits(), wh.to_bits(), x.is_nan()),
                        "{isa:?} f16 {x:e}"
                    );
                    assert!(
                        same(b[i].to_bits(), wb.to_bits(), x.is_nan()),
                        "{isa:?} bf16 {x:e}"
                    );
                    assert_eq!(h[i].is_nan(), x.is_nan());
                    assert_eq!(b[i].is_nan(), x.is_nan());
                }
            }
        }
    }

    #[test]
    fn odd_and_bf16_primitives_match_scalar() {
        let xs = rounding_edges();
        let fs: Vec<f32> = (0..=u32::MAX)
            .step_by(40_009)
            .map(f32::from_bits)
            .chain([
                f32::MAX,
                -f32::MAX,
                f32::INFINITY,
                f32::NAN,
                1.0 + f32::EPSILON,
            ])
            .collect();
        for isa in Isa::supported() {
            let (mut a, mut b) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
            simd::f64_to_f32_odd(isa, &xs, &mut a);
            simd::f64_to_f32_odd(Isa::Scalar, &xs, &mut b);
            for ((x, p), q) in xs.iter().zip(&a).zip(&b) {
                assert!(p.to_bits() == q.to_bits() || x.is_nan(), "{isa:?} {x:e}");
            }
            // Rounding to odd: exact, or the odd one of the two f32 either
            // side of the value (its own neighbours then bracket the value).
            for (x, p) in xs.iter().zip(&a).filter(|(x, _)| x.is_finite()) {
                let bits = p.to_bits();
                let near = |b: u32| (f32::from_bits(b) as f64).abs();
                // (Odd bits first: an exact zero has no neighbour below.)
                let bracketed = || near(bits - 1) < x.abs() && x.abs() < near(bits + 1);
                assert!(*p as f64 == *x || (bits & 1 == 1 && bracketed()), "{x:e}");
            }
            let (mut c, mut d) = (vec![bf16::ZERO; fs.len()], vec![bf16::ZERO; fs.len()]);
            for n in [0, 1, 15, 17, fs.len()] {
                simd::f32_to_bf16(isa, &fs[..n], &mut c[..n]);
                simd::f32_to_bf16(Isa::Scalar, &fs[..n], &mut d[..n]);
                let bits = |v: &[bf16]| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&c[..n]), bits(&d[..n]), "{isa:?} {n}");
            }
        }
    }

    #[test]
    fn f64_overflow_becomes_infinite() {
        assert!(1e300f64.to_f32().is_infinite());
        assert!(f32::as_f32_slice(&[1.0]).is_some());
        assert!(f64::as_f32_slice(&[1.0]).is_none());
    }
}
