//! AVX2 primitives: 8 lanes; tails shorter than a vector go through the
//! scalar kernel, which computes the same values.

use super::scalar::{quantize_one, Scalar};
use super::Kernels;
use half::{bf16, f16};
use std::arch::x86_64::*;

/// The AVX2 ISA marker.
pub(crate) struct Avx2;

/// `clamp(round_half_away(v / s), -127, 127)` as i32 lanes (see avx512::quant16).
#[inline(always)]
unsafe fn quant8(v: __m256, s: __m256) -> __m256i {
    // SAFETY: the caller runs with AVX2 (the Kernels contract).
    unsafe {
        let y = _mm256_div_ps(v, s);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        let frac = _mm256_and_ps(_mm256_sub_ps(y, t), abs);
        let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
        let sign = _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN)));
        let step = _mm256_and_ps(_mm256_or_ps(sign, _mm256_set1_ps(1.0)), up);
        let r = _mm256_add_ps(t, step);
        let c = _mm256_min_ps(
            _mm256_max_ps(r, _mm256_set1_ps(-127.0)),
            _mm256_set1_ps(127.0),
        );
        _mm256_cvttps_epi32(c)
    }
}

/// Convert the whole 8-lane chunks of 16-bit floats (f16 or bf16) to f32 with
/// `cvt`; the caller converts the remaining `len % 8` elements.
///
/// # Safety
/// AVX2 (and F16C if `cvt` uses it) must be available, and `T` must be a
/// 16-bit type (it is read as raw 16-bit lanes).
#[inline(always)]
unsafe fn widen8<T: Copy>(x: &[T], out: &mut [f32], cvt: impl Fn(__m128i) -> __m256) {
    debug_assert_eq!(std::mem::size_of::<T>(), 2);
    // SAFETY: per this function's contract; 8 lanes (16 bytes) are read from each
    // full chunk and 8 floats written to the matching output chunk.
    unsafe {
        for (c, o) in x.chunks_exact(8).zip(out.chunks_exact_mut(8)) {
            _mm256_storeu_ps(o.as_mut_ptr(), cvt(_mm_loadu_si128(c.as_ptr().cast())));
        }
    }
}

impl Kernels for Avx2 {
    #[inline(always)]
    unsafe fn absmax_bits(x: &[f32]) -> u32 {
        let mut chunks = x.chunks_exact(16);
        // SAFETY: AVX2 per the Kernels contract; loads read full chunks of `x`.
        let m = unsafe {
            let abs = _mm256_set1_epi32(0x7fff_ffff);
            let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for c in &mut chunks {
                let v0 = _mm256_loadu_si256(c.as_ptr().cast());
                let v1 = _mm256_loadu_si256(c.as_ptr().add(8).cast());
                a0 = _mm256_max_epu32(a0, _mm256_and_si256(v0, abs));
                a1 = _mm256_max_epu32(a1, _mm256_and_si256(v1, abs));
            }
            let a = _mm256_max_epu32(a0, a1);
            let h = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
            let h = _mm_max_epu32(h, _mm_shuffle_epi32::<0b01_00_11_10>(h));
            let h = _mm_max_epu32(h, _mm_shuffle_epi32::<0b10_11_00_01>(h));
            _mm_cvtsi128_si32(h) as u32
        };
        // SAFETY: the scalar kernels need no CPU features.
        m.max(unsafe { Scalar::absmax_bits(chunks.remainder()) })
    }

    #[inline(always)]
    unsafe fn quantize_scaled(x: &[f32], scale: f32, out: &mut [i8]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let mut xc = x.chunks_exact(8);
        let mut oc = out.chunks_exact_mut(8);
        // SAFETY: AVX2 per the Kernels contract; loads read 8 floats of a full
        // chunk, stores write the 8 bytes of the matching output chunk.
        unsafe {
            let s = _mm256_set1_ps(scale);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let q = quant8(_mm256_loadu_ps(c.as_ptr()), s);
                // i32 -> i16 -> i8 with saturation (values are already in range);
                // the packs interleave 128-bit lanes, so lane 1's bytes sit at 4..8 of the high half.
                let w = _mm256_packs_epi32(q, q);
                let b = _mm256_packs_epi16(w, w);
                let lo = _mm256_castsi256_si128(b);
                let hi = _mm256_extracti128_si256::<1>(b);
                _mm_storel_epi64(o.as_mut_ptr().cast(), _mm_unpacklo_epi32(lo, hi));
            }
        }
        for (o, &v) in oc.into_remainder().iter_mut().zip(xc.remainder()) {
            *o = quantize_one(v, scale);
        }
    }

    #[inline(always)]
    unsafe fn dequantize_scaled(q: &[i8], scale: f32, out: &mut [f32]) {
        let n = q.len().min(out.len());
        let (q, out) = (&q[..n], &mut out[..n]);
        let mut qc = q.chunks_exact(8);
        let mut oc = out.chunks_exact_mut(8);
        // SAFETY: AVX2 per the Kernels contract; loads read the 8 bytes of a
        // full chunk, stores write 8 floats of the matching output chunk.
        unsafe {
            let s = _mm256_set1_ps(scale);
            for (c, o) in (&mut qc).zip(&mut oc) {
                let b = _mm_loadl_epi64(c.as_ptr().cast());
                let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(f, s));
            }
        }
        for (o, &c) in oc.into_remainder().iter_mut().zip(qc.remainder()) {
            *o = c as f32 * scale;
        }
    }

    #[inline(always)]
    unsafe fn f16_to_f32(x: &[f16], out: &mut [f32]) {
        // SAFETY: AVX2 and F16C per the Kernels contract; f16 is a 16-bit type.
        unsafe { widen8(x, out, |h| _mm256_cvtph_ps(h)) };
        let done = x.len().min(out.len()) / 8 * 8;
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::f16_to_f32(&x[done..], &mut out[done..]) };
    }

    #[inline(always)]
    unsafe fn bf16_to_f32(x: &[bf16], out: &mut [f32]) {
        // SAFETY: AVX2 per the Kernels contract; bf16 is a 16-bit type. bfloat16
        // is the top half of an f32: zero-extend, shift.
        unsafe {
            widen8(x, out, |h| {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            })
        };
        let done = x.len().min(out.len()) / 8 * 8;
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::bf16_to_f32(&x[done..], &mut out[done..]) };
    }

    #[inline(always)]
    unsafe fn f64_to_f32(x: &[f64], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let mut xc = x.chunks_exact(4);
        let mut oc = out.chunks_exact_mut(4);
        // SAFETY: AVX2 per the Kernels contract; 4 doubles per full chunk.
        unsafe {
            for (c, o) in (&mut xc).zip(&mut oc) {
                let f = _mm256_cvtpd_ps(_mm256_loadu_pd(c.as_ptr()));
                _mm_storeu_ps(o.as_mut_ptr(), f);
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::f64_to_f32(xc.remainder(), oc.into_remainder()) };
    }
}
