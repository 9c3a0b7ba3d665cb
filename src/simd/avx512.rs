//! AVX-512 (F/BW/VL) primitives: 16 lanes, masked loads and stores for tails,
//! so a block of any length runs without a scalar remainder loop.

use super::Kernels;
use half::{bf16, f16};
use std::arch::x86_64::*;

/// The AVX-512 ISA marker.
pub(crate) struct Avx512;

/// Mask with the low `n` (< 16) lanes set.
#[inline(always)]
fn tail_mask(n: usize) -> __mmask16 {
    debug_assert!(n < 16);
    ((1u32 << n) - 1) as __mmask16
}

/// `clamp(round_half_away(v / s), -127, 127)` as i32 lanes, exactly as
/// `scalar::quantize_one`: divide (not multiply by a reciprocal), truncate,
/// then step one away from zero where the dropped fraction is at least 0.5.
#[inline(always)]
unsafe fn quant16(v: __m512, s: __m512) -> __m512i {
    // SAFETY: the caller runs with AVX-512F (the Kernels contract).
    unsafe {
        let y = _mm512_div_ps(v, s);
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        // Exact: |y - t| < 1 and t is y with its fraction bits cleared.
        let frac = _mm512_abs_ps(_mm512_sub_ps(y, t));
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
        let sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(i32::MIN));
        let step = _mm512_castsi512_ps(_mm512_or_si512(
            sign,
            _mm512_castps_si512(_mm512_set1_ps(1.0)),
        ));
        let r = _mm512_mask_add_ps(t, up, t, step);
        let c = _mm512_min_ps(
            _mm512_max_ps(r, _mm512_set1_ps(-127.0)),
            _mm512_set1_ps(127.0),
        );
        _mm512_cvttps_epi32(c)
    }
}

/// Convert 16-bit floats (f16 or bf16) to f32, 16 lanes at a time with `cvt`.
///
/// # Safety
/// AVX-512F/BW/VL must be available, and `T` must be a 16-bit type (it is read
/// as raw 16-bit lanes).
#[inline(always)]
unsafe fn widen16<T: Copy>(x: &[T], out: &mut [f32], cvt: impl Fn(__m256i) -> __m512) {
    debug_assert_eq!(std::mem::size_of::<T>(), 2);
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    // SAFETY: per this function's contract; 16 lanes (32 bytes) are read from each
    // full chunk, the tail through a mask of its length, and stores match.
    unsafe {
        let mut xc = x.chunks_exact(16);
        let mut oc = out.chunks_exact_mut(16);
        for (c, o) in (&mut xc).zip(&mut oc) {
            _mm512_storeu_ps(o.as_mut_ptr(), cvt(_mm256_loadu_si256(c.as_ptr().cast())));
        }
        let rest = xc.remainder();
        if !rest.is_empty() {
            let k = tail_mask(rest.len());
            let h = _mm256_maskz_loadu_epi16(k, rest.as_ptr().cast());
            _mm512_mask_storeu_ps(oc.into_remainder().as_mut_ptr(), k, cvt(h));
        }
    }
}

impl Kernels for Avx512 {
    #[inline(always)]
    unsafe fn absmax_bits(x: &[f32]) -> u32 {
        // SAFETY: AVX-512F per the Kernels contract; every load reads inside `x`
        // (full chunks from chunks_exact, the tail through a mask of its length).
        unsafe {
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let (mut a0, mut a1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            let mut pairs = x.chunks_exact(32);
            for c in &mut pairs {
                let v0 = _mm512_loadu_epi32(c.as_ptr().cast());
                let v1 = _mm512_loadu_epi32(c.as_ptr().add(16).cast());
                a0 = _mm512_max_epu32(a0, _mm512_and_si512(v0, abs));
                a1 = _mm512_max_epu32(a1, _mm512_and_si512(v1, abs));
            }
            let mut rest = pairs.remainder();
            if rest.len() >= 16 {
                let v = _mm512_loadu_epi32(rest.as_ptr().cast());
                a0 = _mm512_max_epu32(a0, _mm512_and_si512(v, abs));
                rest = &rest[16..];
            }
            if !rest.is_empty() {
                let v = _mm512_maskz_loadu_epi32(tail_mask(rest.len()), rest.as_ptr().cast());
                a1 = _mm512_max_epu32(a1, _mm512_and_si512(v, abs));
            }
            _mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1))
        }
    }

    #[inline(always)]
    unsafe fn quantize_scaled(x: &[f32], scale: f32, out: &mut [i8]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        // SAFETY: AVX-512F per the Kernels contract; loads and stores stay inside
        // the equal-length `x` and `out` (exact chunks, then a masked tail).
        unsafe {
            let s = _mm512_set1_ps(scale);
            let mut xc = x.chunks_exact(16);
            let mut oc = out.chunks_exact_mut(16);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let q = quant16(_mm512_loadu_ps(c.as_ptr()), s);
                _mm_storeu_si128(o.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q));
            }
            let rest = xc.remainder();
            if !rest.is_empty() {
                let k = tail_mask(rest.len());
                let q = quant16(_mm512_maskz_loadu_ps(k, rest.as_ptr()), s);
                _mm512_mask_cvtepi32_storeu_epi8(oc.into_remainder().as_mut_ptr(), k, q);
            }
        }
    }

    #[inline(always)]
    unsafe fn dequantize_scaled(q: &[i8], scale: f32, out: &mut [f32]) {
        let n = q.len().min(out.len());
        let (q, out) = (&q[..n], &mut out[..n]);
        // SAFETY: AVX-512F/BW/VL per the Kernels contract; accesses stay inside
        // the equal-length `q` and `out`.
        unsafe {
            let s = _mm512_set1_ps(scale);
            let mut qc = q.chunks_exact(16);
            let mut oc = out.chunks_exact_mut(16);
            for (c, o) in (&mut qc).zip(&mut oc) {
                let b = _mm_loadu_si128(c.as_ptr().cast());
                let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(f, s));
            }
            let rest = qc.remainder();
            if !rest.is_empty() {
                let k = tail_mask(rest.len());
                let b = _mm_maskz_loadu_epi8(k, rest.as_ptr());
                let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
                _mm512_mask_storeu_ps(oc.into_remainder().as_mut_ptr(), k, _mm512_mul_ps(f, s));
            }
        }
    }

    #[inline(always)]
    unsafe fn f16_to_f32(x: &[f16], out: &mut [f32]) {
        // SAFETY: AVX-512F per the Kernels contract; f16 is a 16-bit type.
        unsafe { widen16(x, out, |h| _mm512_cvtph_ps(h)) }
    }

    #[inline(always)]
    unsafe fn bf16_to_f32(x: &[bf16], out: &mut [f32]) {
        // SAFETY: as above. bfloat16 is the top half of an f32: zero-extend, shift.
        unsafe {
            widen16(x, out, |h| {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            })
        }
    }

    #[inline(always)]
    unsafe fn f64_to_f32(x: &[f64], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        // SAFETY: AVX-512F per the Kernels contract; 8 doubles per full chunk, the
        // tail through a mask. vcvtpd2ps rounds to nearest even, as `as f32` does.
        unsafe {
            let mut xc = x.chunks_exact(8);
            let mut oc = out.chunks_exact_mut(8);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let f = _mm512_cvtpd_ps(_mm512_loadu_pd(c.as_ptr()));
                _mm256_storeu_ps(o.as_mut_ptr(), f);
            }
            let rest = xc.remainder();
            if !rest.is_empty() {
                let k = ((1u32 << rest.len()) - 1) as __mmask8;
                let f = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(k, rest.as_ptr()));
                _mm256_mask_storeu_ps(oc.into_remainder().as_mut_ptr(), k, f);
            }
        }
    }
}
