//! AVX-512 (F/BW/VL/DQ) primitives: 16 lanes, masked loads and stores for tails,
//! so a block of any length runs without a scalar remainder loop.

use super::kernels::{
    products_via_dots, AbsmaxRule, Affine, Beside, Kernels, Nothing, PackedTokens, Range, Store,
    F32_FAST_LIMIT, F32_FAST_MARGIN, F32_INF_BITS, PACKED_MIN_TOKENS,
};
use super::scalar;
use super::Isa;
use half::{bf16, f16};
use std::arch::x86_64::*;

/// The AVX-512 ISA marker; `VNNI`: the integer dot products use `vpdpbusd`
/// (the caller is compiled with `avx512vnni`).
pub(crate) struct Avx512<const VNNI: bool>;

/// Elements (of `size` bytes, `addr` a multiple of `size`) before `addr`
/// reaches a multiple of `align`, at most `n`.
#[inline(always)]
fn head_to_align(addr: usize, align: usize, size: usize, n: usize) -> usize {
    (addr.wrapping_neg() % align / size).min(n)
}

/// Eight doubles rounded to f32 *to odd* (see `Kernels::f64_to_f32_odd`).
///
/// # Safety
/// AVX-512F/VL must be available.
#[inline(always)]
unsafe fn f32_odd(v: __m512d) -> __m256 {
    // SAFETY: per this function's contract.
    unsafe {
        let t = _mm512_cvt_roundpd_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        // Ordered: a NaN stays as converted, as in the scalar path.
        let inexact = _mm512_cmp_pd_mask::<_CMP_NEQ_OQ>(_mm512_cvtps_pd(t), v);
        let t = _mm256_castps_si256(t);
        _mm256_castsi256_ps(_mm256_mask_or_epi32(t, inexact, t, _mm256_set1_epi32(1)))
    }
}

/// Sixteen floats rounded to bfloat16, nearest even, NaN quieted with its
/// payload's top bits kept (as `half`).
///
/// # Safety
/// AVX-512F must be available.
#[inline(always)]
unsafe fn bf16_nearest_even(v: __m512) -> __m256i {
    // SAFETY: per this function's contract.
    unsafe {
        let b = _mm512_castps_si512(v);
        let high = _mm512_srli_epi32::<16>(b);
        // Add just under half an ulp, plus the kept lsb (ties to even).
        let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
        let magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
        let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
    }
}

/// Mask with the low `n` (< 16) lanes set.
#[inline(always)]
fn tail_mask(n: usize) -> __mmask16 {
    debug_assert!(n < 16);
    ((1u32 << n) - 1) as __mmask16
}

/// Mask of the first `min(n, 16)` lanes.
#[inline(always)]
fn lanes_mask(n: usize) -> __mmask16 {
    ((1u32 << n.min(16)) - 1) as __mmask16
}

/// How far ahead (in bytes of weight) the row-streaming products prefetch:
/// two tiles of four 4 KiB rows. Measured on Zen 4 (4096 x 4096 int8, caches
/// flushed): prefetching the next tile into L1 left the dequantizing dot
/// product at 12-14 GB/s; into L2 two tiles ahead, 16-18 GB/s, and the
/// `vpdpbusd` GEMV went from 14 to 21 GB/s.
const PREFETCH_BYTES: usize = 32 * 1024;

/// How far ahead the int4 dequantizing dot product also prefetches into L1
/// (`prefetcht0`), beside the L2 prefetch [`PREFETCH_BYTES`] ahead. Zen 4
/// drops some `prefetcht1` requests, in periods of minutes; a call whose far
/// prefetches were dropped waited on memory line by line (with no software
/// prefetch at all the flushed 4096² int4 forward took 1.85 ms, and in bad
/// periods 1.4-1.8 against 0.73-0.9 in good ones). A second request 2 KiB
/// on (one row of the next tile at 4096 columns) refetches what was dropped
/// in time. Old and new builds in alternating processes, 16 pairs, medians
/// of 15 flushed calls: 0.72-1.10 ms (mean 0.87) against 0.73-1.82 (mean
/// 1.18), the fastest unchanged. The int8 kernel, one row a step and twice
/// the bytes per product, got slower with it (mean 1.21 against 1.13 ms)
/// and keeps the far prefetch alone. `prefetcht0` alone does worse: 32 KiB
/// ahead it evicts the activation from L1 (1.2 ms int4, 1.7-1.9 int8), and
/// 4-8 KiB ahead it comes late (1.1-1.2 ms int4).
const NEAR_BYTES: usize = 2048;

/// How far ahead in the row it streams (in floats) the fused per-row loop
/// also prefetches into L1, beside its L2 prefetch of the row after: Zen 4
/// drops some `prefetcht1` requests (see [`NEAR_BYTES`]), and the row then
/// streams on demand. Per row on 2048 x 4096 after a flush, the builds
/// without and with it in alternating processes (twelve pairs, medians of
/// 12 calls): 2.63 -> 2.44 ms on average, 1.66x -> 1.62x the time of one
/// read of the input (`compute_scale`) in the same process; 1 KiB ahead
/// instead of 4: 2.44 ms, 1.57x. A small gain, inside this VM's swings.
const NEAR_ROW_FLOATS: usize = 1024;

/// The first of the rows (stride `stride` bytes, `R` a tile) to prefetch
/// while a tile at `base` is summed: about [`PREFETCH_BYTES`] ahead, whole
/// tiles, at least the next one; `None` when the slice (of `len` bytes from
/// `base`) does not reach that far, so prefetches stay inside it.
#[inline(always)]
fn rows_ahead<T, const R: usize>(base: *const T, stride: usize, len: usize) -> Option<*const T> {
    let bytes = stride.max(1) * std::mem::size_of::<T>();
    let rows = PREFETCH_BYTES.div_ceil(bytes).div_ceil(R).max(1) * R;
    let need = (rows + R).checked_mul(stride)?;
    (len >= need).then(|| base.wrapping_add(rows * stride))
}

/// Affine codes of at most 16 f32 values (masked load and store).
#[inline(always)]
unsafe fn quantize_masked_f32<const RANGE: bool, const CLAMP: bool>(
    x: &[f32],
    out: &mut [i8],
    fast: &FastLanes,
    exact: &AffineLanes,
) {
    // SAFETY: AVX-512F/BW per the caller; the masks cover `x.len()` (<= 16)
    // lanes, all inside `x` and `out` (callers pass equal lengths).
    unsafe {
        let k = lanes_mask(x.len().min(out.len()));
        let q = affine16_f32::<RANGE, CLAMP>(_mm512_maskz_loadu_ps(k, x.as_ptr()), fast, exact);
        _mm512_mask_cvtepi32_storeu_epi8(out.as_mut_ptr(), k, q);
    }
}

/// `((q - zp) * scale) as f32` of 16 codes, computed in f64.
#[inline(always)]
unsafe fn values16_f32(c: __m128i, zp: __m512d, scale: __m512d) -> __m512 {
    // SAFETY: AVX-512F per the caller; register operations only.
    unsafe {
        let (lo, hi) = affine_values16(c, zp, scale);
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo))),
            _mm256_castps_pd(_mm512_cvtpd_ps(hi)),
        ))
    }
}

/// [`values16_f32`] of fewer than 16 codes (masked load and store).
#[inline(always)]
unsafe fn dequantize_masked_f32(q: &[i8], out: &mut [f32], zp: __m512d, scale: __m512d) {
    // SAFETY: AVX-512F/BW per the caller; the masks cover `q.len()` (< 16)
    // lanes, all inside `q` and `out` (callers pass equal lengths).
    unsafe {
        let k = tail_mask(q.len().min(out.len()));
        let v = values16_f32(_mm_maskz_loadu_epi8(k, q.as_ptr()), zp, scale);
        _mm512_mask_storeu_ps(out.as_mut_ptr(), k, v);
    }
}

/// `round_half_away(y)` as i32 lanes for `|y| <= 2^24`: add ±0.5 rounding
/// toward zero, then truncate. Rounding the sum toward zero never carries it
/// across an integer, so this is `floor(|y| + 0.5)` with y's sign, exactly.
#[inline(always)]
unsafe fn round_half_away16(y: __m512) -> (__m512, __m512i) {
    // SAFETY: the caller runs with AVX-512F (the Kernels contract).
    unsafe {
        // copysign(0.5, y): y's sign bit over 0.5's other bits.
        let half = _mm512_ternarylogic_epi32::<0xCA>(
            _mm512_set1_epi32(i32::MIN),
            _mm512_castps_si512(y),
            _mm512_castps_si512(_mm512_set1_ps(0.5)),
        );
        let z = _mm512_add_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(
            y,
            _mm512_castsi512_ps(half),
        );
        (z, _mm512_cvttps_epi32(z))
    }
}

/// `round_half_away(v / s)` as i32 lanes, exactly as `scalar::quantize_one`
/// before its clamp: divide, limit to ±2^24 (a bound no code reaches, so the
/// conversion never overflows and the final clamp decides as before), round.
#[inline(always)]
unsafe fn round16_exact(v: __m512, s: __m512) -> __m512i {
    // SAFETY: the caller runs with AVX-512F/DQ (the Kernels contract).
    unsafe {
        let y = _mm512_div_ps(v, s);
        // vrangeps 0b0010: the operand of smaller magnitude with y's sign.
        let y = _mm512_range_ps::<0b0010>(y, _mm512_set1_ps(16_777_216.0));
        round_half_away16(y).1
    }
}

/// Near a rounding boundary `|z - rne(z)|` is below this: see [`round16_fast`].
const NEAR_TIE: f32 = 1.0 / 8192.0;

/// `round_half_away(v * r)` as i32 lanes, where `r = 1/s` rounded, and the
/// signed distance `e = z - rne(z)` of each lane's `z = fl(v * r)` (limited
/// to ±2^24) from the nearest integer, which says where it may differ from
/// `round16_exact(v, s)` (see [`near_tie`]).
///
/// `y1 = v * r` is within `|q|·(2^-23 + 2^-24)` of `fl(v / s)` (`q` the exact
/// quotient): under 2^-14.4 while `|q| < 256`, so the two round alike unless a
/// half-integer lies that close to `y1`, that is unless `z = y1 ± 0.5`
/// (rounded toward zero, one more ulp <= 2^-16 off) is within 2^-14 of an
/// integer. Those lanes are flagged (`NEAR_TIE` is twice that), as are
/// integral `z` of 2^23 or more (out of the bound, and of i32 range) and NaN.
/// Where `|q| >= 256` unflagged, both round to 255 or more, which every
/// clamp to ±clip (and the i8 saturation) maps alike.
#[inline(always)]
unsafe fn round16_fast(v: __m512, r: __m512) -> (__m512i, __m512) {
    // SAFETY: the caller runs with AVX-512F/DQ (the Kernels contract).
    unsafe {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let y = _mm512_range_ps::<0b0010>(_mm512_mul_ps(v, r), _mm512_set1_ps(16_777_216.0));
        (
            _mm512_cvt_roundps_epi32::<NEAREST>(y),
            _mm512_reduce_ps::<NEAREST>(y),
        )
    }
}

/// Whether a lane of four [`round16_fast`] distances lies within `NEAR_TIE`
/// of a half (or is NaN): then the reciprocal's codes may differ from the
/// division's. The largest magnitude of the four found first (`vrangeps`
/// keeps a NaN), then one compare.
#[inline(always)]
unsafe fn near_tie(e: [__m512; 4]) -> bool {
    // SAFETY: the caller runs with AVX-512F/DQ (the Kernels contract).
    unsafe {
        // vrangeps 0b1011: the larger magnitude, sign cleared.
        const MAX_ABS: i32 = 0b1011;
        let e01 = _mm512_range_ps::<MAX_ABS>(e[0], e[1]);
        let e23 = _mm512_range_ps::<MAX_ABS>(e[2], e[3]);
        let off = _mm512_range_ps::<MAX_ABS>(e01, e23);
        _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(off, _mm512_set1_ps(0.5 - NEAR_TIE)) != 0
    }
}

/// The i8 bounds of `clamp(r, -clip, clip) as i8` for an integer `r`:
/// `±floor(clip)`, saturated to i8 as `as` does.
#[inline(always)]
unsafe fn clip_bytes(clip: f32) -> (__m512i, __m512i) {
    let hi = clip.floor().min(127.0) as i8;
    let lo = (-clip.floor()).max(-128.0) as i8;
    // SAFETY: the caller runs with AVX-512F (the Kernels contract).
    unsafe { (_mm512_set1_epi8(lo), _mm512_set1_epi8(hi)) }
}

/// 16 codes with the clamp, as i8 in the low 16 bytes (the saturating
/// narrowing keeps order, so clamping the bytes equals clamping the i32s).
#[inline(always)]
unsafe fn quant16(v: __m512, s: __m512, lo: __m512i, hi: __m512i) -> __m128i {
    // SAFETY: as `round16_exact`.
    unsafe {
        let b = _mm512_cvtsepi32_epi8(round16_exact(v, s));
        _mm_min_epi8(
            _mm_max_epi8(b, _mm512_castsi512_si128(lo)),
            _mm512_castsi512_si128(hi),
        )
    }
}

/// Four vectors of i32 codes as 64 saturated bytes in order (three packs
/// and a permute where four `vpmovdb` cost twice as much on Zen 4).
#[inline(always)]
unsafe fn pack64(q: [__m512i; 4]) -> __m512i {
    // SAFETY: AVX-512F/BW (the Kernels contract).
    unsafe {
        let ab = _mm512_packs_epi32(q[0], q[1]);
        let cd = _mm512_packs_epi32(q[2], q[3]);
        // Each 128-bit lane k now holds dwords (q0[4k..], q1[4k..], q2[4k..],
        // q3[4k..]) of four bytes each: gather them back in order.
        let bytes = _mm512_packs_epi16(ab, cd);
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_epi32(order, bytes)
    }
}

/// Four vectors of i32 codes as 64 saturated bytes in order, clamped.
#[inline(always)]
unsafe fn narrow64(q: [__m512i; 4], lo: __m512i, hi: __m512i) -> __m512i {
    // SAFETY: AVX-512F/BW (the Kernels contract).
    unsafe { _mm512_min_epi8(_mm512_max_epi8(pack64(q), lo), hi) }
}

/// The streamed codes' end: block `k`'s codes `q` from byte `shift` on (the
/// part no whole line took), stored at `base + shift + 64k` (cached, masked).
/// `sel` picks dwords from `shift / 4` on, as in the streamed lines.
#[inline(always)]
unsafe fn stream_tail(q: __m512i, base: *mut i8, shift: usize, sel: __m512i, k: usize) {
    // SAFETY: the caller guarantees bytes `base + 64k .. base + 64(k + 1)` are
    // its block's codes (so the `64 - shift` written here are) and AVX-512F/BW.
    unsafe {
        let rest = _mm512_permutex2var_epi32(q, sel, _mm512_setzero_si512());
        _mm512_mask_storeu_epi8(base.add(shift + 64 * k), !0u64 >> shift, rest);
    }
}

/// The 64 values at `p` as one vector of the largest |x| bits of each lane
/// position (`abs` masks the sign).
#[inline(always)]
unsafe fn fold64(p: *const f32, abs: __m512i) -> __m512i {
    // SAFETY: the caller guarantees 64 readable floats at `p` and AVX-512F.
    unsafe {
        let a = _mm512_and_si512(_mm512_loadu_si512(p.cast()), abs);
        let b = _mm512_and_si512(_mm512_loadu_si512(p.add(16).cast()), abs);
        let c = _mm512_and_si512(_mm512_loadu_si512(p.add(32).cast()), abs);
        let d = _mm512_and_si512(_mm512_loadu_si512(p.add(48).cast()), abs);
        _mm512_max_epu32(_mm512_max_epu32(a, b), _mm512_max_epu32(c, d))
    }
}

/// The 16 lanes' maximum (as unsigned) of each of 16 vectors, in order: lane
/// `j` of the result is the largest lane of `v[j]`. Four halving steps (256-bit,
/// 128-bit, then two in-lane ones) and a permute: 46 ops for what 16 separate
/// reductions do in about 150.
#[inline(always)]
unsafe fn max_lanes16(v: [__m512i; 16]) -> __m512i {
    // SAFETY: AVX-512F per the caller.
    unsafe {
        // Halves of 256 bits: w[j] holds v[2j]'s two halves' maxima in its low
        // 256 bits and v[2j + 1]'s in its high 256.
        let mut w = [_mm512_setzero_si512(); 8];
        for (j, w) in w.iter_mut().enumerate() {
            let (a, b) = (v[2 * j], v[2 * j + 1]);
            let lo = _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b);
            let hi = _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b);
            *w = _mm512_max_epu32(lo, hi);
        }
        // Quarters: 128-bit lane k of u[j] is block 4j + k's four maxima.
        let mut u = [_mm512_setzero_si512(); 4];
        for (j, u) in u.iter_mut().enumerate() {
            let (a, b) = (w[2 * j], w[2 * j + 1]);
            let lo = _mm512_shuffle_i64x2::<0b10_00_10_00>(a, b);
            let hi = _mm512_shuffle_i64x2::<0b11_01_11_01>(a, b);
            *u = _mm512_max_epu32(lo, hi);
        }
        // Within each 128-bit lane k: dword i of the result is block 4i + k.
        let m01 = _mm512_max_epu32(
            _mm512_unpacklo_epi32(u[0], u[1]),
            _mm512_unpackhi_epi32(u[0], u[1]),
        );
        let m23 = _mm512_max_epu32(
            _mm512_unpacklo_epi32(u[2], u[3]),
            _mm512_unpackhi_epi32(u[2], u[3]),
        );
        let r = _mm512_max_epu32(
            _mm512_unpacklo_epi64(m01, m23),
            _mm512_unpackhi_epi64(m01, m23),
        );
        // Dword 4k + i holds block 4i + k: gather them back in block order.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_epi32(order, r)
    }
}

/// Blocks of 64 sixteen at a time: each block's |x| folded to one vector, the 16
/// maxima found together ([`max_lanes16`]) and checked for non-finite values
/// at once, the 16 scales and reciprocals divided at once, then each block's
/// codes by `quant64` from L1, beside the next batch's loads. A batch holding
/// a non-finite value, and the blocks after the last whole batch, are left
/// to the caller. The same scales and codes as the block-at-a-time loop (the
/// divisions are IEEE's, as the scalar rule's) with about two thirds of its
/// time from L2. Streamed (outputs whose start is a multiple of 4 bytes),
/// each aligned line takes one block's codes from the line boundary and the
/// next block's up to it, so a large output is written without reading it
/// first: the block-at-a-time loop cannot stream a 64-byte block that
/// straddles two lines.
///
/// # Safety
/// AVX-512F/BW/DQ.
#[inline(always)]
unsafe fn blocks64_batched(
    x: &[f32],
    rule: AbsmaxRule,
    codes: &mut [i8],
    scales: &mut [f32],
    store: Store,
) -> usize {
    let batches = (x.len() / 1024)
        .min(codes.len() / 1024)
        .min(scales.len() / 16);
    if batches == 0 {
        return 0;
    }
    // SAFETY: AVX-512F/BW/DQ per the caller; batch `t` reads
    // `x[1024t..1024(t + 1)]` and writes the same range of `codes` and
    // `scales[16t..16(t + 1)]`, all inside the slices (`batches` bounds them).
    // Streamed, block k's bytes are written as parts of 64-byte aligned
    // lines: the head `[0, shift)` of block 0 (masked), line k - 1 at
    // `shift + 64(k - 1)` once block k is coded (it ends inside block k),
    // and the last coded block's bytes from `shift` on (masked); streaming
    // stores are left unfenced (the Kernels contract).
    unsafe {
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let (lo, hi) = clip_bytes(rule.clip);
        let divisor = _mm512_set1_ps(rule.divisor);
        let zero_scale = _mm512_set1_ps(rule.zero_scale);
        let inf_bits = _mm512_set1_epi32(F32_INF_BITS as i32);
        let mut v = [_mm512_setzero_si512(); 16];
        for (j, v) in v.iter_mut().enumerate() {
            *v = fold64(x.as_ptr().add(64 * j), abs);
        }
        let mut m = max_lanes16(v);
        // Streaming: line i of the codes from the first 64-byte boundary is
        // block i's bytes from `shift` on, then block i + 1's up to it.
        let base = codes.as_mut_ptr();
        let shift = (64 - base as usize % 64) % 64;
        let stream = matches!(store, Store::Streaming) && shift.is_multiple_of(4);
        let sel = _mm512_add_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32((shift / 4) as i32),
        );
        let mut prev = _mm512_setzero_si512();
        for t in 0..batches {
            if _mm512_cmpge_epu32_mask(m, inf_bits) != 0 {
                if stream && t > 0 {
                    stream_tail(prev, base, shift, sel, 16 * t - 1);
                }
                return 16 * t;
            }
            // rule.scale: max / divisor where max > 0 (bits > 0), else zero_scale.
            let positive = _mm512_cmpneq_epi32_mask(m, _mm512_setzero_si512());
            let s = _mm512_mask_div_ps(zero_scale, positive, _mm512_castsi512_ps(m), divisor);
            let r = _mm512_div_ps(_mm512_set1_ps(1.0), s);
            _mm512_storeu_ps(scales.as_mut_ptr().add(16 * t), s);
            let (mut sv, mut rv) = ([0f32; 16], [0f32; 16]);
            _mm512_storeu_ps(sv.as_mut_ptr(), s);
            _mm512_storeu_ps(rv.as_mut_ptr(), r);
            // Each block's codes (from L1) beside the next batch's block
            // maxima (from memory), so the loads overlap the arithmetic.
            let xp = x.as_ptr().add(1024 * t);
            let more = t + 1 < batches;
            for j in 0..16 {
                if more {
                    v[j] = fold64(xp.add(1024 + 64 * j), abs);
                }
                let out = codes.as_mut_ptr().add(1024 * t + 64 * j);
                let (sj, rj) = (sv[j], rv[j]);
                let q = if sj > 0.0 {
                    let fast = sj.is_normal() && rj.is_normal();
                    quant64(
                        xp.add(64 * j),
                        _mm512_set1_ps(sj),
                        _mm512_set1_ps(rj),
                        fast,
                        lo,
                        hi,
                    )
                } else {
                    _mm512_setzero_si512()
                };
                if stream {
                    let k = 16 * t + j;
                    if k == 0 {
                        if shift > 0 {
                            _mm512_mask_storeu_epi8(out, (1u64 << shift) - 1, q);
                        }
                    } else {
                        // Line k - 1: block k - 1 from `shift`, block k up to it
                        // (block k - 1 itself when `shift` is 0).
                        let line = _mm512_permutex2var_epi32(prev, sel, q);
                        _mm512_stream_si512(base.add(shift + 64 * (k - 1)).cast(), line);
                    }
                    prev = q;
                } else {
                    _mm512_storeu_si512(out.cast(), q);
                }
            }
            if more {
                m = max_lanes16(v);
            }
        }
        if stream {
            stream_tail(prev, base, shift, sel, 16 * batches - 1);
        }
        16 * batches
    }
}

/// 64 codes from 64 floats at `x`, clamped, in order. `r` is `1/s` when
/// `fast` (see `round16_fast`); a chunk with any lane near a tie is redone
/// with the exact division.
#[inline(always)]
unsafe fn quant64(
    x: *const f32,
    s: __m512,
    r: __m512,
    fast: bool,
    lo: __m512i,
    hi: __m512i,
) -> __m512i {
    // SAFETY: the caller guarantees 64 readable floats at `x` and AVX-512F/BW/DQ.
    unsafe {
        let v = [
            _mm512_loadu_ps(x),
            _mm512_loadu_ps(x.add(16)),
            _mm512_loadu_ps(x.add(32)),
            _mm512_loadu_ps(x.add(48)),
        ];
        if fast {
            let (a, ea) = round16_fast(v[0], r);
            let (b, eb) = round16_fast(v[1], r);
            let (c, ec) = round16_fast(v[2], r);
            let (d, ed) = round16_fast(v[3], r);
            if !near_tie([ea, eb, ec, ed]) {
                return narrow64([a, b, c, d], lo, hi);
            }
        }
        let q = [
            round16_exact(v[0], s),
            round16_exact(v[1], s),
            round16_exact(v[2], s),
            round16_exact(v[3], s),
        ];
        narrow64(q, lo, hi)
    }
}

/// The broadcast parameters of the scaled codes for one scale and clip:
/// `s` for division, `r = 1/s` for the reciprocal shortcut (which holds only
/// where `fast`: a normal scale and reciprocal), the clamp's byte bounds.
struct ScaledLanes {
    s: __m512,
    r: __m512,
    fast: bool,
    lo: __m512i,
    hi: __m512i,
}

impl ScaledLanes {
    #[inline(always)]
    unsafe fn new(scale: f32, clip: f32) -> Self {
        let recip = 1.0 / scale;
        // SAFETY: AVX-512F per the caller (the Kernels contract).
        unsafe {
            let (lo, hi) = clip_bytes(clip);
            ScaledLanes {
                s: _mm512_set1_ps(scale),
                r: _mm512_set1_ps(recip),
                fast: scale.is_normal() && recip.is_normal(),
                lo,
                hi,
            }
        }
    }

    /// 64 codes of the 64 floats at `x` (see `quant64`).
    #[inline(always)]
    unsafe fn codes64(&self, x: *const f32) -> __m512i {
        // SAFETY: the caller guarantees 64 readable floats at `x` and AVX-512F/BW/DQ.
        unsafe { quant64(x, self.s, self.r, self.fast, self.lo, self.hi) }
    }
}

/// Prefetches every line left in `lines` into L2: the steps prefetch four
/// lines per 64 values, so when a masked head shortened the run, the last
/// lines of the row after would otherwise be read on demand, one memory
/// latency a row (8-12 % of the per-channel kernel's perf samples on Zen 4).
#[inline(always)]
unsafe fn prefetch_rest<'a>(lines: impl Iterator<Item = &'a [f32]>) {
    for line in lines {
        // SAFETY: SSE, which every x86-64 CPU has; a prefetch reads nothing
        // architecturally.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
    }
}

/// `quantize_scaled` over one run, prefetching `ahead` into L2 at the rate the
/// run consumes its input (four lines for every 64 elements coded). Streaming
/// stores are left unfenced, as the Kernels contract allows.
#[inline(always)]
unsafe fn scaled_run(
    x: &[f32],
    scale: f32,
    clip: f32,
    out: &mut [i8],
    store: Store,
    ahead: &[f32],
) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    let mut ahead = ahead.chunks(16);
    // SAFETY: AVX-512F/BW/DQ per the Kernels contract; loads and stores stay
    // inside the equal-length `x` and `out` (a masked head, 64-element chunks,
    // masked tails of at most 16); streaming stores go to 64-byte aligned
    // chunks only (the head aligns them), left unfenced (the Kernels
    // contract). Prefetches only name addresses inside `ahead`.
    unsafe {
        let lanes = ScaledLanes::new(scale, clip);
        let (s, lo, hi) = (lanes.s, lanes.lo, lanes.hi);
        let head = match store {
            Store::Streaming => head_to_align(out.as_ptr() as usize, 64, 1, n),
            Store::Cached => 0,
        };
        for (c, o) in x[..head].chunks(16).zip(out[..head].chunks_mut(16)) {
            let k = lanes_mask(c.len());
            let q = quant16(_mm512_maskz_loadu_ps(k, c.as_ptr()), s, lo, hi);
            _mm_mask_storeu_epi8(o.as_mut_ptr().cast(), k, q);
        }
        let (x, out) = (&x[head..], &mut out[head..]);
        let mut xc = x.chunks_exact(64);
        let mut oc = out.chunks_exact_mut(64);
        for (c, o) in (&mut xc).zip(&mut oc) {
            for line in (&mut ahead).take(4) {
                _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
            }
            let q = lanes.codes64(c.as_ptr());
            match store {
                Store::Streaming => _mm512_stream_si512(o.as_mut_ptr().cast(), q),
                Store::Cached => _mm512_storeu_si512(o.as_mut_ptr().cast(), q),
            }
        }
        prefetch_rest(ahead);
        let out = oc.into_remainder();
        for (c, o) in xc.remainder().chunks(16).zip(out.chunks_mut(16)) {
            let k = lanes_mask(c.len());
            let q = quant16(_mm512_maskz_loadu_ps(k, c.as_ptr()), s, lo, hi);
            _mm_mask_storeu_epi8(o.as_mut_ptr().cast(), k, q);
        }
    }
}

/// Affine codes of 8 f64 lanes as i32 lanes, exactly as `scalar::affine_one`:
/// a multiply, then an add (never fused), round half away from zero, clamp.
#[inline(always)]
unsafe fn affine8(v: __m512d, a: &AffineLanes) -> __m256i {
    // SAFETY: the caller runs with AVX-512F (the Kernels contract).
    unsafe {
        let y = _mm512_add_pd(_mm512_mul_pd(v, a.inv), a.zp);
        let t = _mm512_roundscale_pd::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        // Exact: t is y with its fraction bits cleared.
        let frac = _mm512_abs_pd(_mm512_sub_pd(y, t));
        let up = _mm512_cmp_pd_mask::<_CMP_GE_OQ>(frac, _mm512_set1_pd(0.5));
        let sign = _mm512_and_si512(_mm512_castpd_si512(y), _mm512_set1_epi64(i64::MIN));
        let step = _mm512_castsi512_pd(_mm512_or_si512(
            sign,
            _mm512_castpd_si512(_mm512_set1_pd(1.0)),
        ));
        let r = _mm512_mask_add_pd(t, up, t, step);
        let c = _mm512_min_pd(_mm512_max_pd(r, a.qmin), a.qmax);
        _mm512_cvttpd_epi32(c)
    }
}

/// The [`Affine`] parameters broadcast to lanes.
struct AffineLanes {
    inv: __m512d,
    zp: __m512d,
    qmin: __m512d,
    qmax: __m512d,
}

impl AffineLanes {
    #[inline(always)]
    unsafe fn new(a: Affine) -> Self {
        // SAFETY: the caller runs with AVX-512F.
        unsafe {
            AffineLanes {
                inv: _mm512_set1_pd(a.inv),
                zp: _mm512_set1_pd(a.zp),
                qmin: _mm512_set1_pd(a.qmin),
                qmax: _mm512_set1_pd(a.qmax),
            }
        }
    }
}

/// The f32 shortcut's parameters broadcast (see `kernels::F32_FAST_LIMIT`).
struct FastLanes {
    on: bool,
    /// `|fl32(v * inv32)| <= F32_FAST_LIMIT` may fail for some input: check it.
    check_range: bool,
    /// Some shortcut code may fall outside `[qmin, qmax]`: clamp.
    clamp: bool,
    /// The zero point is ±0: `y = v · inv` needs no add (`m + 0` differs
    /// from `m` only for `m = -0`, which codes to 0 either way).
    zp_zero: bool,
    inv: __m512,
    zp: __m512,
    lim: __m512,
    margin: __m512,
    qmin: __m512,
    qmax: __m512,
}

impl FastLanes {
    #[inline(always)]
    unsafe fn new(a: Affine) -> Self {
        let shortcut = a.f32_shortcut();
        let (inv, zp) = shortcut.unwrap_or((0.0, 0.0));
        // SAFETY: the caller runs with AVX-512F.
        unsafe {
            FastLanes {
                on: shortcut.is_some(),
                check_range: !a.f32_in_range(),
                clamp: !a.f32_within_codes(),
                zp_zero: zp == 0.0,
                inv: _mm512_set1_ps(inv),
                zp: _mm512_set1_ps(zp),
                lim: _mm512_set1_ps(F32_FAST_LIMIT),
                margin: _mm512_set1_ps(F32_FAST_MARGIN),
                qmin: _mm512_set1_ps(a.qmin as f32),
                qmax: _mm512_set1_ps(a.qmax as f32),
            }
        }
    }
}

/// Affine codes of 16 f32 values: the f32 shortcut where provably exact
/// (kernels::F32_FAST_LIMIT), else the seed's f64 arithmetic, 8 lanes at a time.
#[inline(always)]
unsafe fn affine16_f32<const RANGE: bool, const CLAMP: bool>(
    v: __m512,
    fast: &FastLanes,
    exact: &AffineLanes,
) -> __m512i {
    // SAFETY: the caller runs with AVX-512F.
    unsafe {
        if fast.on {
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let m = _mm512_mul_ps(v, fast.inv);
            let y = _mm512_add_ps(m, fast.zp);
            // y - rne(y), exact: the distance to the nearest integer.
            let off = _mm512_abs_ps(_mm512_reduce_ps::<NEAREST>(y));
            let mut slow = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(off, fast.margin);
            if RANGE {
                slow |= _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(m), fast.lim);
            }
            if slow == 0 {
                // Clamping to the integers qmin, qmax before rounding equals
                // clamping after it (rounding is monotone).
                let c = if CLAMP {
                    _mm512_min_ps(_mm512_max_ps(y, fast.qmin), fast.qmax)
                } else {
                    y
                };
                return _mm512_cvt_roundps_epi32::<NEAREST>(c);
            }
        }
        let lo = affine8(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), exact);
        let hi = affine8(
            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(v),
            ))),
            exact,
        );
        join(lo, hi)
    }
}

/// Affine codes of 64 f32 values at `x` as four vectors of i32 lanes, each
/// as [`affine16_f32`] gives it. The shortcut's checks are made once for the
/// 64 (the largest distance from an integer, and the largest product, by
/// `vrangeps`): on Zen 4 the per-vector compare chain cost as much as the
/// codes. Any flagged vector is redone by `affine16_f32`.
#[inline(always)]
unsafe fn affine64_f32<const RANGE: bool, const CLAMP: bool>(
    x: *const f32,
    fast: &FastLanes,
    exact: &AffineLanes,
) -> [__m512i; 4] {
    // SAFETY: forwarded. One branch a step, so each body is straight-line.
    unsafe {
        if fast.zp_zero {
            affine64_f32_zp::<RANGE, CLAMP, false>(x, fast, exact)
        } else {
            affine64_f32_zp::<RANGE, CLAMP, true>(x, fast, exact)
        }
    }
}

/// [`affine64_f32`] with the zero point's add compiled in (`ZP`) or out.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // several arrays, one index
unsafe fn affine64_f32_zp<const RANGE: bool, const CLAMP: bool, const ZP: bool>(
    x: *const f32,
    fast: &FastLanes,
    exact: &AffineLanes,
) -> [__m512i; 4] {
    // SAFETY: the caller guarantees 64 readable floats at `x` and
    // AVX-512F/DQ (the Kernels contract). No closures: they would not
    // inherit the caller's target features.
    unsafe {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        // vrangeps 0b1011: the larger magnitude, sign cleared.
        const MAX_ABS: i32 = 0b1011;
        let mut v = [_mm512_setzero_ps(); 4];
        for (k, v) in v.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(x.add(16 * k));
        }
        let mut q = [_mm512_setzero_si512(); 4];
        if fast.on {
            let (mut m, mut y, mut e) = (
                [_mm512_setzero_ps(); 4],
                [_mm512_setzero_ps(); 4],
                [_mm512_setzero_ps(); 4],
            );
            for k in 0..4 {
                m[k] = _mm512_mul_ps(v[k], fast.inv);
                y[k] = if ZP {
                    _mm512_add_ps(m[k], fast.zp)
                } else {
                    m[k]
                };
                // y - rne(y), exact: the distance to the nearest integer.
                e[k] = _mm512_reduce_ps::<NEAREST>(y[k]);
            }
            let e01 = _mm512_range_ps::<MAX_ABS>(e[0], e[1]);
            let e23 = _mm512_range_ps::<MAX_ABS>(e[2], e[3]);
            let off = _mm512_range_ps::<MAX_ABS>(e01, e23);
            // Unordered counts as slow too.
            let mut slow = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(off, fast.margin);
            if RANGE {
                let m01 = _mm512_range_ps::<MAX_ABS>(m[0], m[1]);
                let m23 = _mm512_range_ps::<MAX_ABS>(m[2], m[3]);
                let top = _mm512_range_ps::<MAX_ABS>(m01, m23);
                slow |= _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(top, fast.lim);
            }
            if slow == 0 {
                for k in 0..4 {
                    // Clamping to the integers qmin, qmax before rounding
                    // equals clamping after it (rounding is monotone).
                    let c = if CLAMP {
                        _mm512_min_ps(_mm512_max_ps(y[k], fast.qmin), fast.qmax)
                    } else {
                        y[k]
                    };
                    q[k] = _mm512_cvt_roundps_epi32::<NEAREST>(c);
                }
                return q;
            }
        }
        for k in 0..4 {
            q[k] = affine16_f32::<RANGE, CLAMP>(v[k], fast, exact);
        }
        q
    }
}

/// The range of a row gathered 64 floats a step ([`Beside`]), the rest by
/// [`RowRange::finish`]; `MAG`: only max |x|, all a symmetric scale reads.
struct RowRange<'a, const MAG: bool> {
    x: &'a [f32],
    /// Floats read so far (a multiple of 64).
    done: usize,
    lo: [__m512; 2],
    hi: [__m512; 2],
    /// Max of the bits of |x|: at least `F32_INF_BITS` iff a NaN or an
    /// infinity was read.
    bits: [__m512i; 2],
}

impl<'a, const MAG: bool> RowRange<'a, MAG> {
    /// # Safety
    /// AVX-512F must be available.
    #[inline(always)]
    unsafe fn new(x: &'a [f32]) -> Self {
        // SAFETY: per this function's contract.
        unsafe {
            let (lo, hi) = (
                _mm512_set1_ps(f32::INFINITY),
                _mm512_set1_ps(f32::NEG_INFINITY),
            );
            RowRange {
                x,
                done: 0,
                lo: [lo; 2],
                hi: [hi; 2],
                bits: [_mm512_setzero_si512(); 2],
            }
        }
    }

    /// The range of the whole row: what the steps gathered merged with the
    /// rest's (`range_f32`, or for `MAG` `(-m, m)` from `absmax_bits`).
    ///
    /// # Safety
    /// AVX-512F/BW must be available.
    #[inline(always)]
    unsafe fn finish(self) -> Range<f32> {
        // SAFETY: per this function's contract; register reductions, and the
        // rest is read by primitives that keep their own contracts.
        unsafe {
            let rest = &self.x[self.done..];
            let bits = _mm512_reduce_max_epu32(_mm512_max_epu32(self.bits[0], self.bits[1]));
            if MAG {
                return super::kernels::magnitude(bits.max(Avx512::<false>::absmax_bits(rest)));
            }
            let gathered = Range {
                min: _mm512_reduce_min_ps(_mm512_min_ps(self.lo[0], self.lo[1])),
                max: _mm512_reduce_max_ps(_mm512_max_ps(self.hi[0], self.hi[1])),
                non_finite: bits >= super::F32_INF_BITS,
            };
            gathered.merge(Avx512::<false>::range_f32(rest))
        }
    }
}

impl<const MAG: bool> Beside for RowRange<'_, MAG> {
    #[inline(always)]
    fn more(&self) -> bool {
        self.x.len() - self.done >= 64
    }
    #[inline(always)]
    unsafe fn step(&mut self) {
        // SAFETY: `more()` held, so 64 floats are readable at `done`; AVX-512F
        // per this function's contract. As in `range_f32`, the value goes
        // first: vminps/vmaxps return their second operand for a NaN, so a
        // NaN leaves the lane as it was (and shows in `bits`).
        unsafe {
            let p = self.x.as_ptr().add(self.done);
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            for k in 0..4 {
                let v = _mm512_loadu_ps(p.add(16 * k));
                let b = _mm512_and_si512(_mm512_castps_si512(v), abs);
                self.bits[k % 2] = _mm512_max_epu32(self.bits[k % 2], b);
                if !MAG {
                    self.lo[k % 2] = _mm512_min_ps(v, self.lo[k % 2]);
                    self.hi[k % 2] = _mm512_max_ps(v, self.hi[k % 2]);
                }
            }
            self.done += 64;
        }
    }
}

/// The affine codes loop over f32, with the shortcut's range check (`RANGE`)
/// and clamp (`CLAMP`) compiled in or out (see `FastLanes`). Streaming
/// stores are left unfenced, as the Kernels contract allows.
#[inline(always)]
unsafe fn quantize_f32_run<const RANGE: bool, const CLAMP: bool, B: Beside>(
    x: &[f32],
    a: Affine,
    out: &mut [i8],
    store: Store,
    fast: &FastLanes,
    ahead: &[f32],
    beside: &mut B,
) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    // SAFETY: AVX-512F/BW per the Kernels contract; loads and stores stay
    // inside the equal-length `x` and `out` (a masked head, exact chunks of 64
    // then 16, a masked tail); streaming stores go to 64-byte aligned chunks
    // only (the head aligns them), left unfenced (the Kernels contract). Prefetches
    // only name addresses inside `ahead`; `beside` steps only while `more()`.
    unsafe {
        let exact = AffineLanes::new(a);
        let mut ahead = ahead.chunks(16);
        let head = match store {
            Store::Streaming => head_to_align(out.as_ptr() as usize, 64, 1, n),
            Store::Cached => 0,
        };
        for (c, o) in x[..head].chunks(16).zip(out[..head].chunks_mut(16)) {
            quantize_masked_f32::<RANGE, CLAMP>(c, o, fast, &exact);
        }
        let (x, out) = (&x[head..], &mut out[head..]);
        let mut xc = x.chunks_exact(64);
        let mut oc = out.chunks_exact_mut(64);
        for (c, o) in (&mut xc).zip(&mut oc) {
            // A line ahead for every 16 values coded.
            for line in (&mut ahead).take(4) {
                _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
            }
            if beside.more() {
                beside.step();
            }
            let q = pack64(affine64_f32::<RANGE, CLAMP>(c.as_ptr(), fast, &exact));
            match store {
                Store::Streaming => _mm512_stream_si512(o.as_mut_ptr().cast(), q),
                Store::Cached => _mm512_storeu_si512(o.as_mut_ptr().cast(), q),
            }
        }
        prefetch_rest(ahead);
        let (x, out) = (xc.remainder(), oc.into_remainder());
        let mut xc = x.chunks_exact(16);
        let mut oc = out.chunks_exact_mut(16);
        for (c, o) in (&mut xc).zip(&mut oc) {
            let q = affine16_f32::<RANGE, CLAMP>(_mm512_loadu_ps(c.as_ptr()), fast, &exact);
            _mm_storeu_si128(o.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q));
        }
        let rest = xc.remainder();
        if !rest.is_empty() {
            quantize_masked_f32::<RANGE, CLAMP>(rest, oc.into_remainder(), fast, &exact);
        }
    }
}

/// Affine codes of f32 values with `beside` read alongside (see [`Beside`]):
/// the loop variant picked by what `FastLanes` proved.
///
/// # Safety
/// AVX-512F/BW must be available.
#[inline(always)]
unsafe fn quantize_f32_beside<B: Beside>(
    x: &[f32],
    a: Affine,
    out: &mut [i8],
    store: Store,
    ahead: &[f32],
    b: &mut B,
) {
    // SAFETY: forwarded; a variant only drops checks `FastLanes` proved
    // cannot fire.
    unsafe {
        let f = &FastLanes::new(a);
        match (f.check_range, f.clamp) {
            (false, false) => quantize_f32_run::<false, false, B>(x, a, out, store, f, ahead, b),
            (false, true) => quantize_f32_run::<false, true, B>(x, a, out, store, f, ahead, b),
            (true, false) => quantize_f32_run::<true, false, B>(x, a, out, store, f, ahead, b),
            (true, true) => quantize_f32_run::<true, true, B>(x, a, out, store, f, ahead, b),
        }
    }
}

/// [`quantize_f32_beside`] for packed int4 codes.
///
/// # Safety
/// AVX-512F/BW must be available.
#[inline(always)]
unsafe fn quantize_int4_f32_beside<B: Beside>(
    x: &[f32],
    a: Affine,
    out: &mut [u8],
    ahead: &[f32],
    b: &mut B,
) {
    // SAFETY: forwarded; a variant only drops checks `FastLanes` proved
    // cannot fire.
    unsafe {
        let f = &FastLanes::new(a);
        match (f.check_range, f.clamp) {
            (false, false) => quantize_int4_f32_run::<false, false, B>(x, a, out, f, ahead, b),
            (false, true) => quantize_int4_f32_run::<false, true, B>(x, a, out, f, ahead, b),
            (true, false) => quantize_int4_f32_run::<true, false, B>(x, a, out, f, ahead, b),
            (true, true) => quantize_int4_f32_run::<true, true, B>(x, a, out, f, ahead, b),
        }
    }
}

/// The 32 packed bytes of 64 int4 codes held as four vectors of i32 lanes
/// (codes in i8's range, as every int4 code is): the codes as 64 bytes in
/// order ([`pack64`]), then each 16-bit pair's `even & 15 | (odd & 15) << 4`
/// in its low byte (one select of the pair and the pair shifted right by 4),
/// narrowed: seven ops where a narrowing per vector took eighteen.
#[inline(always)]
unsafe fn nibbles64(q: [__m512i; 4]) -> __m256i {
    // SAFETY: AVX-512F/BW per the caller; register operations only.
    unsafe {
        let b = pack64(q);
        // 0xCA: mask ? b : b >> 4 bitwise; bits 8-15 are dropped by the narrowing.
        let w = _mm512_ternarylogic_epi32::<0xCA>(
            _mm512_set1_epi16(0x000f),
            b,
            _mm512_srli_epi16::<4>(b),
        );
        _mm512_cvtepi16_epi8(w)
    }
}

/// `affine_quantize_int4_f32`: 64 values a step, coded as 16-lane i32 vectors
/// and packed in registers ([`nibbles64`]), the rest through a stage.
#[inline(always)]
unsafe fn quantize_int4_f32_run<const RANGE: bool, const CLAMP: bool, B: Beside>(
    x: &[f32],
    a: Affine,
    out: &mut [u8],
    fast: &FastLanes,
    ahead: &[f32],
    beside: &mut B,
) {
    let n = (x.len() / 2).min(out.len());
    let (x, out) = (&x[..2 * n], &mut out[..n]);
    // SAFETY: AVX-512F/BW per the caller; each step reads `x[64k..64k + 64]`
    // and writes `out[32k..32k + 32]` of exact chunks; the rest goes through
    // the staged default on the remainders. Prefetches only name addresses
    // inside `ahead`; `beside` steps only while `more()`.
    unsafe {
        let exact = AffineLanes::new(a);
        let mut ahead = ahead.chunks(16);
        let mut xc = x.chunks_exact(64);
        let mut oc = out.chunks_exact_mut(32);
        for (c, o) in (&mut xc).zip(&mut oc) {
            // A line ahead for every 16 values coded.
            for line in (&mut ahead).take(4) {
                _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
            }
            if beside.more() {
                beside.step();
            }
            let q = affine64_f32::<RANGE, CLAMP>(c.as_ptr(), fast, &exact);
            _mm256_storeu_si256(o.as_mut_ptr().cast(), nibbles64(q));
        }
        prefetch_rest(ahead);
        let (xr, or) = (xc.remainder(), oc.into_remainder());
        let mut codes = [0i8; 64];
        let cs = &mut codes[..xr.len()];
        quantize_f32_run::<RANGE, CLAMP, _>(xr, a, cs, Store::Cached, fast, &[], &mut Nothing);
        Avx512::<false>::pack_int4(cs, or);
    }
}

/// Two halves of 8 i32 lanes as one vector of 16.
#[inline(always)]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    // SAFETY: the caller runs with AVX-512F.
    unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi) }
}

/// `(q - zp) * scale` for 16 int8 codes, as two vectors of 8 f64.
#[inline(always)]
unsafe fn affine_values16(b: __m128i, zp: __m512d, scale: __m512d) -> (__m512d, __m512d) {
    // SAFETY: the caller runs with AVX-512F.
    unsafe {
        let q = _mm512_cvtepi8_epi32(b);
        let lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(q));
        let hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(q));
        (
            _mm512_mul_pd(_mm512_sub_pd(lo, zp), scale),
            _mm512_mul_pd(_mm512_sub_pd(hi, zp), scale),
        )
    }
}

/// A 16-bit float type that 16 f32 lanes round to, nearest even. (A trait,
/// not a closure: a closure's body is compiled without the caller's target
/// features, and its intrinsics then run as calls, 20x slower here.)
trait Narrow16: Copy {
    /// # Safety
    /// AVX-512F must be available.
    unsafe fn narrow(v: __m512) -> __m256i;
}

impl Narrow16 for f16 {
    #[inline(always)]
    unsafe fn narrow(v: __m512) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
    }
}

impl Narrow16 for bf16 {
    #[inline(always)]
    unsafe fn narrow(v: __m512) -> __m256i {
        // SAFETY: per the trait's contract.
        unsafe { bf16_nearest_even(v) }
    }
}

/// `(q - zp) * scale` of 16 int8 codes in f64, rounded to f32 *to odd*.
///
/// # Safety
/// AVX-512F/VL/DQ must be available.
#[inline(always)]
unsafe fn affine_odd16(c: __m128i, zp: __m512d, scale: __m512d) -> __m512 {
    // SAFETY: per this function's contract.
    unsafe {
        let (lo, hi) = affine_values16(c, zp, scale);
        _mm512_insertf32x8::<1>(_mm512_castps256_ps512(f32_odd(lo)), f32_odd(hi))
    }
}

/// `(q - zp) * scale` of int8 codes in f64, rounded once to a 16-bit float:
/// to odd at f32 in registers, then to nearest even, 16 lanes at a time.
///
/// # Safety
/// AVX-512F/BW/VL/DQ must be available.
#[inline(always)]
unsafe fn narrow16<T: Narrow16>(q: &[i8], zp: f64, scale: f64, out: &mut [T]) {
    debug_assert_eq!(std::mem::size_of::<T>(), 2);
    let n = q.len().min(out.len());
    let (q, out) = (&q[..n], &mut out[..n]);
    // SAFETY: per this function's contract; 16 codes in and 16 lanes (32
    // bytes) out per full chunk, the tail through masks of its length.
    unsafe {
        let (zp, scale) = (_mm512_set1_pd(zp), _mm512_set1_pd(scale));
        let mut qc = q.chunks_exact(16);
        let mut oc = out.chunks_exact_mut(16);
        for (c, o) in (&mut qc).zip(&mut oc) {
            let v = affine_odd16(_mm_loadu_si128(c.as_ptr().cast()), zp, scale);
            _mm256_storeu_si256(o.as_mut_ptr().cast(), T::narrow(v));
        }
        let rest = qc.remainder();
        if !rest.is_empty() {
            let k = tail_mask(rest.len());
            let v = affine_odd16(_mm_maskz_loadu_epi8(k, rest.as_ptr()), zp, scale);
            _mm256_mask_storeu_epi16(oc.into_remainder().as_mut_ptr().cast(), k, T::narrow(v));
        }
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

/// Mask of the first `min(n, 64)` bytes.
#[inline(always)]
fn byte_mask(n: usize) -> __mmask64 {
    if n >= 64 {
        !0
    } else {
        (1u64 << n) - 1
    }
}

/// The sum of a vector's sixteen i32 lanes, in i64.
#[inline(always)]
unsafe fn lanes_sum_i64(v: __m512i) -> i64 {
    // SAFETY: the caller runs with AVX-512F.
    unsafe {
        let lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v));
        let hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64::<1>(v));
        _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi))
    }
}

/// `Σ a[i]` over `k` bytes at `a`, exactly: `vpsadbw` of the bytes offset to
/// unsigned (`a + 128`), less `128·k`.
#[inline(always)]
unsafe fn byte_sum(a: *const i8, k: usize) -> i64 {
    // SAFETY: the caller guarantees `k` readable bytes at `a` and AVX-512BW.
    unsafe {
        let flip = _mm512_set1_epi8(i8::MIN);
        let zero = _mm512_setzero_si512();
        let (mut s0, mut s1) = (zero, zero);
        let mut i = 0;
        while i + 128 <= k {
            let u0 = _mm512_xor_si512(_mm512_loadu_si512(a.add(i).cast()), flip);
            let u1 = _mm512_xor_si512(_mm512_loadu_si512(a.add(i + 64).cast()), flip);
            s0 = _mm512_add_epi64(s0, _mm512_sad_epu8(u0, zero));
            s1 = _mm512_add_epi64(s1, _mm512_sad_epu8(u1, zero));
            i += 128;
        }
        while i < k {
            // Masked-off bytes load as 0 and count 128 like the rest.
            let v = _mm512_maskz_loadu_epi8(byte_mask(k - i), a.add(i));
            s0 = _mm512_add_epi64(s0, _mm512_sad_epu8(_mm512_xor_si512(v, flip), zero));
            i += 64;
        }
        _mm512_reduce_add_epi64(_mm512_add_epi64(s0, s1)) - 128 * i as i64
    }
}

/// Exact dot products of `R` rows of `w` with `T` tokens of `a` (both at
/// stride `k`), in i64: per 64 bytes either `vpdpbusd` (VNNI: the weight
/// bytes offset to unsigned, `w + 128`, times the signed activation, four
/// products a lane; `128·Σa` is taken off at the end) or `vpmaddwd` on
/// sign-extended halves; lanes widened to i64 after every `DOT_CHUNK`, so no
/// i32 lane can overflow. The tail is a masked load (zeros add nothing).
#[inline(always)]
unsafe fn dots_tile<const VNNI: bool, const R: usize, const T: usize>(
    w: *const i8,
    a: *const i8,
    k: usize,
    asum: [i64; T],
    ahead: Option<*const i8>,
) -> [[i64; T]; R] {
    let mut total = [[0i64; T]; R];
    // SAFETY: the caller guarantees R rows and T tokens of `k` readable bytes
    // and AVX-512F/BW (and VNNI when `VNNI`); loads are masked to `k`.
    unsafe {
        let flip = _mm512_set1_epi8(i8::MIN);
        let mut start = 0;
        while start < k {
            let end = (start + scalar::DOT_CHUNK).min(k);
            let mut acc = [[_mm512_setzero_si512(); T]; R];
            let mut i = start;
            while i < end {
                if let Some(p) = ahead {
                    for r in 0..R {
                        _mm_prefetch::<_MM_HINT_T1>(p.add(r * k + i));
                    }
                }
                let full = end - i >= 64;
                let m = byte_mask(end - i);
                let mut av = [_mm512_setzero_si512(); T];
                for (t, v) in av.iter_mut().enumerate() {
                    let p = a.add(t * k + i);
                    *v = if full {
                        _mm512_loadu_si512(p.cast())
                    } else {
                        _mm512_maskz_loadu_epi8(m, p)
                    };
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    let p = w.add(r * k + i);
                    let wv = if full {
                        _mm512_loadu_si512(p.cast())
                    } else {
                        _mm512_maskz_loadu_epi8(m, p)
                    };
                    if VNNI {
                        let wu = _mm512_xor_si512(wv, flip);
                        for (t, acc) in acc.iter_mut().enumerate() {
                            *acc = _mm512_dpbusd_epi32(*acc, wu, av[t]);
                        }
                    } else {
                        let wl = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(wv));
                        let wh = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(wv));
                        for (t, acc) in acc.iter_mut().enumerate() {
                            let al = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(av[t]));
                            let ah = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(av[t]));
                            let p = _mm512_add_epi32(
                                _mm512_madd_epi16(wl, al),
                                _mm512_madd_epi16(wh, ah),
                            );
                            *acc = _mm512_add_epi32(*acc, p);
                        }
                    }
                }
                i += 64;
            }
            for (tot, acc) in total.iter_mut().zip(acc) {
                for (t, v) in tot.iter_mut().zip(acc) {
                    *t += lanes_sum_i64(v);
                }
            }
            start = end;
        }
    }
    if VNNI {
        for tot in total.iter_mut() {
            for (t, s) in tot.iter_mut().zip(asum) {
                // Masked-off weight bytes also became 128, against activation 0.
                *t -= 128 * s;
            }
        }
    }
    total
}

/// Tokens in one packed block: two vectors of sixteen i32 lanes.
const OUTER_TOKENS: usize = 32;
/// Groups of four bytes summed in one i32 lane before it moves to i64: a
/// lane gains at most 4·255·128 = 130,560 a group, and 16,384 groups stay
/// below 2^31.
const OUTER_CHUNK_GROUPS: usize = scalar::DOT_CHUNK / 4;

/// Activations laid out for [`outer_tile`]: per block of up to 32 tokens, per
/// group `g` of four bytes, the group of each token in turn (`lanes` of
/// them, 16 or 32), the codes offset to unsigned (`a + 128`: the weight is
/// the signed operand, and `128·Σw` is taken off each product) in one
/// little-endian word. Lanes past the block's tokens and bytes past `k` are
/// 0 (the weight's bytes there are 0 too, so they add nothing). `None` if
/// the buffer cannot be allocated. Sixteen tokens by sixteen groups at a
/// time are transposed in registers ([`transpose16`]); the groups after the
/// last such stretch, one word at a time. (Word by word throughout, 32
/// tokens x 4096 took 0.10 ms, run before the products on one thread: 5 %
/// of a 2-thread `w8a8_matmul`.)
#[inline(always)]
unsafe fn pack_quads(a: &[i8], k: usize) -> Option<Vec<u32>> {
    let tokens = a.len() / k;
    let groups = k.div_ceil(4);
    let blocks = tokens.div_ceil(OUTER_TOKENS);
    let mut out = super::kernels::spare_words();
    out.try_reserve_exact(blocks.checked_mul(groups)?.checked_mul(OUTER_TOKENS)?)
        .ok()?;
    // Groups that whole 16-group stretches of every row cover.
    let wide = k / 64 * 16;
    for t0 in (0..tokens).step_by(OUTER_TOKENS) {
        let tb = (tokens - t0).min(OUTER_TOKENS);
        let lanes = if tb > 16 { 32 } else { 16 };
        let base = out.len();
        out.resize(base + groups * lanes, 0);
        let block = &mut out[base..];
        for t in 0..tb {
            let row = &a[(t0 + t) * k..(t0 + t + 1) * k];
            for (g, q) in row.chunks(4).enumerate().skip(wide) {
                let mut quad = [0u8; 4];
                for (d, &v) in quad.iter_mut().zip(q) {
                    *d = v as u8 ^ 0x80;
                }
                block[g * lanes + t] = u32::from_le_bytes(quad);
            }
        }
        for tt in (0..tb).step_by(16) {
            let n = (tb - tt).min(16);
            for g0 in (0..wide).step_by(16) {
                // SAFETY: AVX-512F per the caller; token t < tb holds 64
                // bytes from 4·g0 (g0 + 16 <= k / 4); the stores go to words
                // (g0 + j)·lanes + tt .. + 16 of `block`, inside its
                // groups·lanes words (tt + 16 <= lanes).
                unsafe {
                    let flip = _mm512_set1_epi8(i8::MIN);
                    let mut r = [_mm512_setzero_si512(); 16];
                    for (i, v) in r.iter_mut().enumerate().take(n) {
                        let at = a.as_ptr().add((t0 + tt + i) * k + 4 * g0);
                        *v = _mm512_xor_si512(_mm512_loadu_si512(at.cast()), flip);
                    }
                    let c = transpose16(r);
                    for (j, v) in c.iter().enumerate() {
                        let at = block.as_mut_ptr().add((g0 + j) * lanes + tt);
                        _mm512_storeu_si512(at.cast(), *v);
                    }
                }
            }
        }
    }
    Some(out)
}

/// A 16 x 16 matrix of 32-bit words, one row a vector, transposed: word `j`
/// of row `i` becomes word `i` of row `j`.
#[inline(always)]
unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // SAFETY: AVX-512F per the caller; register operations only.
    unsafe {
        // Per four rows 4b..4b + 4: vector 4b + c holds, in 128-bit lane L,
        // column 4L + c of those rows.
        let mut u = [_mm512_setzero_si512(); 16];
        for b in 0..4 {
            let (r0, r1, r2, r3) = (r[4 * b], r[4 * b + 1], r[4 * b + 2], r[4 * b + 3]);
            let (lo01, hi01) = (_mm512_unpacklo_epi32(r0, r1), _mm512_unpackhi_epi32(r0, r1));
            let (lo23, hi23) = (_mm512_unpacklo_epi32(r2, r3), _mm512_unpackhi_epi32(r2, r3));
            u[4 * b] = _mm512_unpacklo_epi64(lo01, lo23);
            u[4 * b + 1] = _mm512_unpackhi_epi64(lo01, lo23);
            u[4 * b + 2] = _mm512_unpacklo_epi64(hi01, hi23);
            u[4 * b + 3] = _mm512_unpackhi_epi64(hi01, hi23);
        }
        // Column c's lanes gathered across the four row groups.
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let (a, b, d, e) = (u[c], u[4 + c], u[8 + c], u[12 + c]);
            let v0 = _mm512_shuffle_i32x4::<0x88>(a, b);
            let v1 = _mm512_shuffle_i32x4::<0xDD>(a, b);
            let w0 = _mm512_shuffle_i32x4::<0x88>(d, e);
            let w1 = _mm512_shuffle_i32x4::<0xDD>(d, e);
            out[c] = _mm512_shuffle_i32x4::<0x88>(v0, w0);
            out[c + 8] = _mm512_shuffle_i32x4::<0xDD>(v0, w0);
            out[c + 4] = _mm512_shuffle_i32x4::<0x88>(v1, w1);
            out[c + 12] = _mm512_shuffle_i32x4::<0xDD>(v1, w1);
        }
        out
    }
}

/// Rows in the outer-product tile. Read in place, rows 4 KiB apart share
/// one L1 set: eight fit its eight ways, twelve thrashed them (12 rows
/// in place ran at 77-88 % of the VNNI peak, 12 rows copied to an L1
/// buffer first at 74-85 %, 8 rows in place at 90-96 %; 32 tokens x 4096,
/// the weight in L3 and in L2).
const OUTER_ROWS: usize = 8;

/// `R` weight rows (stride `k`) at `w` against one packed block of `16·NV`
/// token lanes at `packed`, over the `full` whole groups of four bytes: per
/// group each row's four bytes, signed as they are, are broadcast and
/// `vpdpbusd`-ed with the block's vectors (the activations offset to
/// unsigned by [`pack_quads`]); lanes widen to i64 every
/// [`OUTER_CHUNK_GROUPS`]. With `sums`, each row's `Σw` over those groups
/// too, from the lines just read (one `vpdpbusd` with ones a line: 3-4 %
/// of the tile's time; `vpsadbw` on the offset bytes was no faster). `R`
/// rows from `ahead` are fetched into L2 meanwhile. Returns the raw sums
/// `Σ w · (a + 128)` and the rows' `Σw` (0 without `sums`).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // indices keep the accumulators in registers
unsafe fn outer_tile<const R: usize, const NV: usize>(
    w: *const i8,
    k: usize,
    packed: *const u8,
    full: usize,
    ahead: Option<*const i8>,
    sums: bool,
) -> ([[i64; 32]; R], [i64; R]) {
    let mut total = [[0i64; 32]; R];
    let mut row_sums = [0i64; R];
    debug_assert!(R <= OUTER_ROWS);
    // SAFETY: AVX-512F/BW/VNNI per the caller; rows r < R hold `4·full`
    // bytes from r·k (each line's load is masked to them), the block `full`
    // groups of `64·NV` bytes; prefetches never fault.
    unsafe {
        let ones = _mm512_set1_epi8(1);
        let mut acc = [[_mm512_setzero_si512(); NV]; R];
        let mut rs = [_mm512_setzero_si512(); R];
        for c0 in (0..full).step_by(OUTER_CHUNK_GROUPS) {
            let c1 = (c0 + OUTER_CHUNK_GROUPS).min(full);
            // The accumulators in a local for the chunk: kept in the array
            // across it, every vpdpbusd was also stored back to the stack.
            let (mut a, mut s) = (acc, rs);
            // A line (16 groups) at a time; the next tile's rows come into
            // L2 a line each per line.
            for l in (c0..c1).step_by(16) {
                let g1 = (l + 16).min(c1);
                if let Some(p) = ahead {
                    for r in 0..R {
                        _mm_prefetch::<_MM_HINT_T1>(p.add(r * k + 4 * l));
                    }
                }
                for g in l..g1 {
                    let mut av = [_mm512_setzero_si512(); NV];
                    for v in 0..NV {
                        av[v] = _mm512_loadu_si512(packed.add((g * NV + v) * 64).cast());
                    }
                    for r in 0..R {
                        let at = w.add(r * k + 4 * g);
                        let wb = _mm512_set1_epi32(std::ptr::read_unaligned(at.cast::<i32>()));
                        for v in 0..NV {
                            a[r][v] = _mm512_dpbusd_epi32(a[r][v], av[v], wb);
                        }
                    }
                }
                if sums {
                    let m = byte_mask(4 * (g1 - l));
                    for r in 0..R {
                        let line = _mm512_maskz_loadu_epi8(m, w.add(r * k + 4 * l));
                        s[r] = _mm512_dpbusd_epi32(s[r], ones, line);
                    }
                }
            }
            (acc, rs) = (a, s);
            // Widen every chunk: a lane gains at most 130,560 a group (and a
            // row-sum lane 512 a line), so a chunk stays below 2^31.
            for (tot, acc) in total.iter_mut().zip(acc.iter_mut()) {
                for (v, x) in acc.iter_mut().enumerate() {
                    let lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(*x));
                    let hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64::<1>(*x));
                    let at = tot.as_mut_ptr().add(16 * v);
                    let sum = _mm512_add_epi64(_mm512_loadu_si512(at.cast()), lo);
                    _mm512_storeu_si512(at.cast(), sum);
                    let at = at.add(8);
                    let sum = _mm512_add_epi64(_mm512_loadu_si512(at.cast()), hi);
                    _mm512_storeu_si512(at.cast(), sum);
                    *x = _mm512_setzero_si512();
                }
            }
            if sums {
                for (t, x) in row_sums.iter_mut().zip(rs.iter_mut()) {
                    *t += lanes_sum_i64(*x);
                    *x = _mm512_setzero_si512();
                }
            }
        }
    }
    (total, row_sums)
}

/// `R` (<= [`OUTER_ROWS`]) rows from row `r0` against every packed block:
/// the whole groups through [`outer_tile`], the last partial group (k not a
/// multiple of 4) from a copy of each row's tail, less `128·Σw` per row,
/// into `out`.
#[inline(always)]
unsafe fn outer_rows<const R: usize>(
    w: &[i8],
    r0: usize,
    k: usize,
    packed: &[u32],
    tokens: usize,
    out: &mut Products<'_>,
) {
    let full = k / 4;
    let groups = k.div_ceil(4);
    // SAFETY: AVX-512F/BW/VNNI per the caller; rows r0..r0+R lie inside `w`
    // (the caller's tiling), the packed blocks inside `packed`.
    unsafe {
        let wp = w.as_ptr().add(r0 * k);
        let ahead = rows_ahead::<i8, R>(wp, k, w.len() - r0 * k);
        // The partial group's weight bytes, 0 past k (so the activation's
        // padding there adds nothing), and their sum.
        let mut tail = [0i32; R];
        let mut tail_sums = [0i64; R];
        for r in 0..R {
            let row = &w[(r0 + r) * k..(r0 + r + 1) * k];
            let mut quad = [0u8; 4];
            for (q, &v) in quad.iter_mut().zip(&row[4 * full..]) {
                *q = v as u8;
                tail_sums[r] += v as i64;
            }
            tail[r] = i32::from_le_bytes(quad);
        }
        let mut offsets = [0i64; R];
        let mut at = 0;
        for t0 in (0..tokens).step_by(OUTER_TOKENS) {
            let tb = (tokens - t0).min(OUTER_TOKENS);
            let lanes = if tb > 16 { 32 } else { 16 };
            let block = packed.as_ptr().add(at).cast::<u8>();
            at += groups * lanes;
            // The rows' sums once, with the first block.
            let first = t0 == 0;
            let (mut total, row_sums) = if lanes == 32 {
                outer_tile::<R, 2>(wp, k, block, full, ahead, first)
            } else {
                outer_tile::<R, 1>(wp, k, block, full, ahead, first)
            };
            if first {
                for r in 0..R {
                    offsets[r] = 128 * (row_sums[r] + tail_sums[r]);
                }
            }
            if full < groups {
                for (tot, &quad) in total.iter_mut().zip(&tail) {
                    let wb = _mm512_set1_epi32(quad);
                    for v in 0..lanes / 16 {
                        let a = _mm512_loadu_si512(block.add((full * lanes / 16 + v) * 64).cast());
                        let d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, wb);
                        let mut lane = [0i32; 16];
                        _mm512_storeu_si512(lane.as_mut_ptr().cast(), d);
                        for (x, &l) in tot[16 * v..16 * v + 16].iter_mut().zip(&lane) {
                            *x += l as i64;
                        }
                    }
                }
            }
            match out {
                Products::Raw(out) => {
                    for (r, tot) in total.iter().enumerate() {
                        let row = &mut out[(r0 + r) * tokens + t0..][..tb];
                        for (o, &x) in row.iter_mut().zip(tot) {
                            *o = x - offsets[r];
                        }
                    }
                }
                Products::Scaled {
                    out,
                    stride,
                    w_scales,
                    a_scales,
                } => {
                    // Token by token: R neighbouring outputs of its row.
                    for (j, &a_scale) in a_scales[t0..t0 + tb].iter().enumerate() {
                        let row = &mut out[(t0 + j) * *stride + r0..][..R];
                        for (r, o) in row.iter_mut().enumerate() {
                            let exact = total[r][j] - offsets[r];
                            *o = exact as f32 * w_scales[r0 + r] * a_scale;
                        }
                    }
                }
            }
        }
    }
}

/// Where [`outer_all`] puts its products.
enum Products<'a> {
    /// The exact sums, `out[r * tokens + t]` (`i8_dots`).
    Raw(&'a mut [i64]),
    /// Rescaled as `Kernels::i8_products`: `out[t * stride + r]`.
    Scaled {
        out: &'a mut [f32],
        stride: usize,
        w_scales: &'a [f32],
        a_scales: &'a [f32],
    },
}

/// The outer-product form of `i8_dots` (VNNI, `tokens >= PACKED_MIN_TOKENS`)
/// over `tokens` laid out by [`pack_quads`]: [`OUTER_ROWS`] rows at a time
/// against every block of 32 tokens, accumulators in registers over the
/// whole row, no horizontal sums.
#[inline(always)]
unsafe fn outer_all(
    w: &[i8],
    rows: usize,
    packed: &[u32],
    tokens: usize,
    k: usize,
    mut out: Products<'_>,
) {
    let mut r = 0;
    // SAFETY: AVX-512F/BW/VNNI per the caller; every tile stays inside `rows`.
    unsafe {
        while r + OUTER_ROWS <= rows {
            outer_rows::<OUTER_ROWS>(w, r, k, packed, tokens, &mut out);
            r += OUTER_ROWS;
        }
        while r + 4 <= rows {
            outer_rows::<4>(w, r, k, packed, tokens, &mut out);
            r += 4;
        }
        while r < rows {
            outer_rows::<1>(w, r, k, packed, tokens, &mut out);
            r += 1;
        }
    }
}

/// Tokens whose byte sums are taken at once (a stack buffer).
const SUM_BLOCK: usize = 64;

/// `dots_tile` over every row and token: tokens in blocks of `SUM_BLOCK`
/// (each token's `Σa` taken once), rows in fours, tokens in pairs.
#[inline(always)]
unsafe fn dots_all<const VNNI: bool>(w: &[i8], rows: usize, a: &[i8], k: usize, out: &mut [i64]) {
    let (rows, tokens) = (rows.min(w.len() / k), a.len() / k);
    // SAFETY: VNNI per the caller (the const); `rows` fit `w`.
    if VNNI && tokens >= PACKED_MIN_TOKENS {
        // SAFETY: AVX-512F per the caller.
        if let Some(packed) = unsafe { pack_quads(a, k) } {
            // SAFETY: VNNI per the caller (the const); `rows` fit `w`.
            unsafe { outer_all(w, rows, &packed, tokens, k, Products::Raw(out)) };
            return;
        }
    }
    // SAFETY: AVX-512F/BW(/VNNI) per the caller; every tile reads whole rows
    // of `w` and tokens of `a` inside the slices; `out` is written through
    // bounds-checked indexing.
    unsafe {
        let mut sums = [0i64; SUM_BLOCK];
        for t0 in (0..tokens).step_by(SUM_BLOCK) {
            let tn = (tokens - t0).min(SUM_BLOCK);
            if VNNI {
                for (j, s) in sums[..tn].iter_mut().enumerate() {
                    *s = byte_sum(a.as_ptr().add((t0 + j) * k), k);
                }
            }
            let mut r = 0;
            while r < rows {
                let rn = if rows - r >= 4 { 4 } else { 1 };
                let wp = w.as_ptr().add(r * k);
                // Rows two tiles on, fetched into L2 while the first tokens
                // pass over these.
                let next = if rn == 4 {
                    rows_ahead::<i8, 4>(wp, k, w.len() - r * k)
                } else {
                    rows_ahead::<i8, 1>(wp, k, w.len() - r * k)
                };
                let mut t = t0;
                while t < t0 + tn {
                    let ap = a.as_ptr().add(t * k);
                    let j = t - t0;
                    let ahead = if t == t0 { next } else { None };
                    if t0 + tn - t >= 4 && rn == 4 {
                        let s = [sums[j], sums[j + 1], sums[j + 2], sums[j + 3]];
                        let d = dots_tile::<VNNI, 4, 4>(wp, ap, k, s, ahead);
                        for (i, row) in d.iter().enumerate() {
                            out[(r + i) * tokens + t..][..4].copy_from_slice(row);
                        }
                        t += 4;
                    } else if t0 + tn - t >= 2 {
                        let s = [sums[j], sums[j + 1]];
                        if rn == 4 {
                            let d = dots_tile::<VNNI, 4, 2>(wp, ap, k, s, ahead);
                            for (i, row) in d.iter().enumerate() {
                                out[(r + i) * tokens + t..][..2].copy_from_slice(row);
                            }
                        } else {
                            let d = dots_tile::<VNNI, 1, 2>(wp, ap, k, s, ahead);
                            out[r * tokens + t..][..2].copy_from_slice(&d[0]);
                        }
                        t += 2;
                    } else {
                        let s = [sums[j]];
                        if rn == 4 {
                            let d = dots_tile::<VNNI, 4, 1>(wp, ap, k, s, ahead);
                            for (i, row) in d.iter().enumerate() {
                                out[(r + i) * tokens + t] = row[0];
                            }
                        } else {
                            out[r * tokens + t] =
                                dots_tile::<VNNI, 1, 1>(wp, ap, k, s, ahead)[0][0];
                        }
                        t += 1;
                    }
                }
                r += rn;
            }
        }
    }
}

/// The tree sum (`scalar::lanes_tree_sum`) of 8 lanes: `j + j+4`, `j + j+2`,
/// `j + j+1`.
#[inline(always)]
pub(super) unsafe fn tree8(d: __m256) -> f32 {
    // SAFETY: AVX per the caller (every tier here has it).
    unsafe {
        let e = _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps::<1>(d));
        let f = _mm_add_ps(e, _mm_movehl_ps(e, e));
        _mm_cvtss_f32(_mm_add_ss(f, _mm_movehdup_ps(f)))
    }
}

/// The tree sum of 64 lanes held as four vectors (lanes 0-15, .., 48-63).
#[inline(always)]
unsafe fn tree64(a: [__m512; 4]) -> f32 {
    // SAFETY: AVX-512F per the caller.
    unsafe {
        let c = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
        let lo = _mm512_castps512_ps256(c);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(c)));
        tree8(_mm256_add_ps(lo, hi))
    }
}

/// One 64-element step of the dequantizing dot product for `R` rows of
/// int8 codes at `q` (row stride `stride`) against 64 floats at `x`:
/// `acc[r][j] += x[16j..] · (q[r][16j..] - zp[r])`, the x loads shared (the
/// row's scale multiplies the sum once).
/// `ZP == false`: every zero point is ±0, so the subtraction (exact, and
/// `q - ±0 == q` with no signed zero to keep) is left out.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // several arrays, one index
unsafe fn step_i8<const R: usize, const ZP: bool>(
    q: *const i8,
    stride: usize,
    x: *const f32,
    zp: &[__m512; R],
    acc: &mut [[__m512; 4]; R],
    ahead: Option<*const i8>,
) {
    // SAFETY: the caller guarantees 64 codes at `q + r·stride` for r < R,
    // 64 floats at `x`, and AVX-512F; prefetches never fault.
    unsafe {
        if let Some(a) = ahead {
            for r in 0..R {
                _mm_prefetch::<_MM_HINT_T1>(a.add(r * stride));
            }
        }
        for j in 0..4 {
            let xv = _mm512_loadu_ps(x.add(16 * j));
            for r in 0..R {
                let c = _mm_loadu_si128(q.add(r * stride + 16 * j).cast());
                let v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
                let d = if ZP { _mm512_sub_ps(v, zp[r]) } else { v };
                acc[r][j] = _mm512_fmadd_ps(xv, d, acc[r][j]);
            }
        }
    }
}

/// One [`scalar::PLANE_BLOCK`]-element step of the int4 dequantizing dot
/// product for `R` rows: 64 bytes a row at `p` (stride `stride` bytes)
/// against 128 floats at `xs` in `nibble_planes` order. The bytes are read
/// as sixteen 32-bit words; plane `k` is nibble `k` of every word (the word
/// shifted right by `4k`: the table lookup reads only the low four bits of
/// each lane), valued `(sext(nibble) - zp) · s` from the row's table and
/// added into accumulator `k % 4`. No widening: one load a row feeds eight
/// lookups, and the x loads are shared by the rows.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // several arrays, one index
unsafe fn step_i4<const R: usize>(
    p: *const u8,
    stride: usize,
    xs: *const f32,
    table: &[__m512; R],
    acc: &mut [[__m512; 4]; R],
    ahead: Option<(*const u8, *const u8)>,
) {
    // SAFETY: the caller guarantees 64 bytes at `p + r·stride` for r < R,
    // 128 floats at `xs`, and AVX-512F; prefetches never fault.
    unsafe {
        let mut words = [_mm512_setzero_si512(); R];
        for r in 0..R {
            if let Some((far, near)) = ahead {
                _mm_prefetch::<_MM_HINT_T1>(far.add(r * stride).cast());
                _mm_prefetch::<_MM_HINT_T0>(near.add(r * stride).cast());
            }
            words[r] = _mm512_loadu_si512(p.add(r * stride).cast());
        }
        for k in 0..8 {
            let xv = _mm512_loadu_ps(xs.add(16 * k));
            for r in 0..R {
                if k > 0 {
                    words[r] = _mm512_srli_epi32::<4>(words[r]);
                }
                let d = _mm512_permutexvar_ps(words[r], table[r]);
                acc[r][k % 4] = _mm512_fmadd_ps(xv, d, acc[r][k % 4]);
            }
        }
    }
}

/// `dot_dequant_i8_rows` for `R` rows from `q`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // several arrays, one index
unsafe fn rows_i8<const R: usize, const ZP: bool>(
    q: &[i8],
    stride: usize,
    zps: &[f32],
    scales: &[f32],
    x: &[f32],
) -> [f32; R] {
    let n = x.len();
    let body = n - n % 64;
    // SAFETY: AVX-512F per the caller; rows r < R hold `n` codes from
    // r·stride (the Kernels contract), full steps stay inside them and `x`;
    // the tail runs on zero-padded copies (a zero x adds nothing to a lane,
    // which is never -0).
    unsafe {
        let mut zp = [_mm512_setzero_ps(); R];
        for r in 0..R {
            zp[r] = _mm512_set1_ps(zps[r]);
        }
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        // Rows further on, fetched into L2 while these are summed (the
        // weight streams from memory once; the prefetcher alone left it idle).
        let next = rows_ahead::<i8, R>(q.as_ptr(), stride, q.len());
        for i in (0..body).step_by(64) {
            let ahead = next.map(|a| a.wrapping_add(i));
            let (qp, xp) = (q.as_ptr().add(i), x.as_ptr().add(i));
            step_i8::<R, ZP>(qp, stride, xp, &zp, &mut acc, ahead);
        }
        if body < n {
            let mut qt = [[0i8; 64]; R];
            let mut xt = [0f32; 64];
            for (r, t) in qt.iter_mut().enumerate() {
                t[..n - body].copy_from_slice(&q[r * stride + body..r * stride + n]);
            }
            xt[..n - body].copy_from_slice(&x[body..n]);
            step_i8::<R, ZP>(qt.as_ptr().cast(), 64, xt.as_ptr(), &zp, &mut acc, None);
        }
        let mut out = [0f32; R];
        for ((o, a), s) in out.iter_mut().zip(acc).zip(scales) {
            *o = tree64(a) * s;
        }
        out
    }
}

/// `dot_dequant_i4_rows` for `R` rows from `p`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // several arrays, one index
unsafe fn rows_i4<const R: usize>(
    p: &[u8],
    stride: usize,
    n: usize,
    zps: &[f32],
    scales: &[f32],
    xs: &[f32],
) -> [f32; R] {
    const BLOCK: usize = scalar::PLANE_BLOCK;
    let bytes = n.div_ceil(2);
    let m = xs.len().min(2 * bytes);
    let body = m - m % BLOCK;
    // SAFETY: as `rows_i8`; a full step reads 64 bytes of each row (inside
    // its `bytes`) and 128 floats of `xs`.
    unsafe {
        let values = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0,
        );
        let mut table = [_mm512_setzero_ps(); R];
        for r in 0..R {
            table[r] = _mm512_sub_ps(values, _mm512_set1_ps(zps[r]));
        }
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        let next = rows_ahead::<u8, R>(p.as_ptr(), stride, p.len());
        for i in (0..body).step_by(BLOCK) {
            // A step reads one 64-byte stretch a row: fetch the ones ahead,
            // far and near (both inside the slice when the far rows are:
            // `NEAR_BYTES` is short of them).
            let near = p.as_ptr().wrapping_add(i / 2 + NEAR_BYTES);
            let ahead = next.map(|a| (a.wrapping_add(i / 2), near));
            let (pp, xp) = (p.as_ptr().add(i / 2), xs.as_ptr().add(i));
            step_i4::<R>(pp, stride, xp, &table, &mut acc, ahead);
        }
        let rest = xs.len().min(body + BLOCK) - body;
        if rest > 0 && body < 2 * bytes {
            let mut pt = [[0u8; BLOCK / 2]; R];
            let mut xt = [0f32; BLOCK];
            let take = (bytes - body / 2).min(BLOCK / 2);
            for (r, t) in pt.iter_mut().enumerate() {
                let start = r * stride + body / 2;
                t[..take].copy_from_slice(&p[start..start + take]);
            }
            for (k, v) in xt[..rest].iter_mut().enumerate() {
                // Only elements whose byte exists count (as in the spec).
                if scalar::plane_element(body + k) / 2 < bytes {
                    *v = xs[body + k];
                }
            }
            let (pp, xp) = (pt.as_ptr().cast(), xt.as_ptr());
            step_i4::<R>(pp, BLOCK / 2, xp, &table, &mut acc, None);
        }
        let mut out = [0f32; R];
        for ((o, a), s) in out.iter_mut().zip(acc).zip(scales) {
            *o = tree64(a) * s;
        }
        out
    }
}

impl<const VNNI: bool> Kernels for Avx512<VNNI> {
    #[inline(always)]
    unsafe fn dot_dequant_i8_rows(
        q: &[i8],
        stride: usize,
        zps: &[f32],
        scales: &[f32],
        x: &[f32],
        out: &mut [f32],
    ) {
        let rows = out.len().min(zps.len()).min(scales.len());
        let mut r = 0;
        // SAFETY: forwarded from this function's contract (row r holds x.len()
        // codes from r·stride).
        unsafe {
            // One row at a time: four rows' accumulators, scales and zero
            // points spilled out of the 32 registers and ran at half speed.
            while r < rows {
                // The row's own codes must exist (a panic, as the other
                // tiers); the codes after it are only prefetched.
                let _ = &q[r * stride..r * stride + x.len()];
                let (q, z, s) = (&q[r * stride..], &zps[r..], &scales[r..]);
                out[r] = if zps[r] == 0.0 {
                    rows_i8::<1, false>(q, stride, z, s, x)[0]
                } else {
                    rows_i8::<1, true>(q, stride, z, s, x)[0]
                };
                r += 1;
            }
        }
    }

    #[inline(always)]
    unsafe fn dot_dequant_i4_rows(
        p: &[u8],
        stride: usize,
        n: usize,
        zps: &[f32],
        scales: &[f32],
        xs: &[f32],
        out: &mut [f32],
    ) {
        let rows = out.len().min(zps.len()).min(scales.len());
        let mut r = 0;
        // SAFETY: forwarded from this function's contract.
        unsafe {
            // Rows taken together share the x loads (16 Mi codes from L2:
            // 0.56 ms one row at a time, 0.50 in pairs; 63 rows of 4096
            // from L2, Zen 4: 35.2 codes/ns in pairs, 36.0 in threes, 35.5
            // in fours). Pairs and a single row finish the rest.
            while r + 3 <= rows {
                let _ = &p[r * stride..(r + 2) * stride + n.div_ceil(2)];
                let (p, z, s) = (&p[r * stride..], &zps[r..], &scales[r..]);
                [out[r], out[r + 1], out[r + 2]] = rows_i4::<3>(p, stride, n, z, s, xs);
                r += 3;
            }
            while r + 2 <= rows {
                // The rows' own bytes must exist (a panic, as the other
                // tiers); the bytes after them are only prefetched.
                let _ = &p[r * stride..(r + 1) * stride + n.div_ceil(2)];
                let (p, z, s) = (&p[r * stride..], &zps[r..], &scales[r..]);
                [out[r], out[r + 1]] = rows_i4::<2>(p, stride, n, z, s, xs);
                r += 2;
            }
            if r < rows {
                let _ = &p[r * stride..r * stride + n.div_ceil(2)];
                out[r] = rows_i4::<1>(&p[r * stride..], stride, n, &zps[r..], &scales[r..], xs)[0];
            }
        }
    }

    #[inline(always)]
    unsafe fn i8_dots(w: &[i8], rows: usize, a: &[i8], k: usize, out: &mut [i64]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { dots_all::<VNNI>(w, rows, a, k, out) }
    }

    const PACKS: Option<Isa> = if VNNI { Some(Isa::Avx512Vnni) } else { None };

    #[inline(always)]
    unsafe fn pack_tokens(a: &[i8], k: usize) -> Option<Vec<u32>> {
        // SAFETY: AVX-512F per the Kernels contract.
        unsafe { pack_quads(a, k) }
    }

    #[inline(always)]
    unsafe fn i8_products(
        w: &[i8],
        p: &PackedTokens<'_>,
        w_scales: &[f32],
        a_scales: &[f32],
        out: &mut [f32],
        stride: usize,
    ) {
        let k = p.k;
        if k == 0 {
            return; // as Kernels::i8_products: nothing for zero-width tokens
        }
        let rows = w_scales.len().min(w.len() / k);
        match p.packed_by(Self::PACKS) {
            Some(packed) if rows <= stride => {
                let scaled = Products::Scaled {
                    out,
                    stride,
                    w_scales,
                    a_scales,
                };
                // SAFETY: VNNI per the caller (PACKS is set only then);
                // `rows` fit `w`; the outputs are written through
                // bounds-checked indexing.
                unsafe { outer_all(w, rows, packed, p.tokens(), k, scaled) }
            }
            // SAFETY: forwarded from this function's contract.
            _ => unsafe {
                products_via_dots::<Self>(w, p.codes, k, w_scales, a_scales, out, stride)
            },
        }
    }

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
    unsafe fn absmax_bits_ahead(x: &[f32], ahead: &[f32]) -> u32 {
        let mut lines = ahead.chunks(16);
        let mut pairs = x.chunks_exact(32);
        // SAFETY: AVX-512F per the Kernels contract; full chunks from
        // chunks_exact, the rest through `absmax_bits`; prefetches only name
        // addresses inside `ahead`, two lines for every 32 values read.
        unsafe {
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let (mut a0, mut a1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for c in &mut pairs {
                for line in (&mut lines).take(2) {
                    _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
                }
                let v0 = _mm512_loadu_epi32(c.as_ptr().cast());
                let v1 = _mm512_loadu_epi32(c.as_ptr().add(16).cast());
                a0 = _mm512_max_epu32(a0, _mm512_and_si512(v0, abs));
                a1 = _mm512_max_epu32(a1, _mm512_and_si512(v1, abs));
            }
            let m = _mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1));
            m.max(Self::absmax_bits(pairs.remainder()))
        }
    }

    #[inline(always)]
    unsafe fn shifted_moments(x: &[f32], k: f64) -> (f64, f64) {
        // SAFETY: AVX-512F per the Kernels contract; loads read inside `x` (full
        // chunks, the tail through masks). Lanes 0..8 and 8..16 of the scalar
        // order are the low and high accumulators; tail lanes past the end are
        // masked out of the adds.
        unsafe {
            let kk = _mm512_set1_pd(k);
            let (mut a_lo, mut a_hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
            let (mut b_lo, mut b_hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
            let mut xc = x.chunks_exact(16);
            for c in &mut xc {
                let v = _mm512_loadu_ps(c.as_ptr());
                let lo = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), kk);
                let hi = _mm512_sub_pd(
                    _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                        _mm512_castps_pd(v),
                    ))),
                    kk,
                );
                a_lo = _mm512_add_pd(a_lo, lo);
                a_hi = _mm512_add_pd(a_hi, hi);
                b_lo = _mm512_add_pd(b_lo, _mm512_mul_pd(lo, lo));
                b_hi = _mm512_add_pd(b_hi, _mm512_mul_pd(hi, hi));
            }
            let rest = xc.remainder();
            if !rest.is_empty() {
                let k16 = tail_mask(rest.len());
                let (k_lo, k_hi) = ((k16 & 0xff) as __mmask8, (k16 >> 8) as __mmask8);
                let v = _mm512_maskz_loadu_ps(k16, rest.as_ptr());
                let lo = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), kk);
                let hi = _mm512_sub_pd(
                    _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                        _mm512_castps_pd(v),
                    ))),
                    kk,
                );
                a_lo = _mm512_mask_add_pd(a_lo, k_lo, a_lo, lo);
                a_hi = _mm512_mask_add_pd(a_hi, k_hi, a_hi, hi);
                b_lo = _mm512_mask_add_pd(b_lo, k_lo, b_lo, _mm512_mul_pd(lo, lo));
                b_hi = _mm512_mask_add_pd(b_hi, k_hi, b_hi, _mm512_mul_pd(hi, hi));
            }
            let (mut l1, mut l2) = ([0f64; 16], [0f64; 16]);
            _mm512_storeu_pd(l1.as_mut_ptr(), a_lo);
            _mm512_storeu_pd(l1.as_mut_ptr().add(8), a_hi);
            _mm512_storeu_pd(l2.as_mut_ptr(), b_lo);
            _mm512_storeu_pd(l2.as_mut_ptr().add(8), b_hi);
            let (mut t1, mut t2) = (0f64, 0f64);
            for j in 0..16 {
                t1 += l1[j];
                t2 += l2[j];
            }
            (t1, t2)
        }
    }

    #[inline(always)]
    unsafe fn select_at_least(x: &[f32], threshold: u32, out: &mut Vec<u32>) -> u32 {
        // SAFETY: the AVX-512 tier's features include AVX2's. Few chunks hold a
        // candidate, so the loop is bound by its loads, not by the lane count.
        unsafe { super::avx2::Avx2::select_at_least(x, threshold, out) }
    }

    /// Blocks of 64 sixteen at a time ([`blocks64_batched`]); blocks of 32
    /// by the AVX2 tier's batches of eight (whose 32-byte steps fit them:
    /// 6.3 -> 4.4 ms on 16 Mi values), others none. (Blocks of 128 in
    /// batches of sixteen, by the same loop with two steps a block, took
    /// 5.0-5.5 ms against 4.4 for the block-at-a-time loop.)
    #[inline(always)]
    unsafe fn absmax_blocks_batched(
        x: &[f32],
        block: usize,
        rule: AbsmaxRule,
        codes: &mut [i8],
        scales: &mut [f32],
        store: Store,
    ) -> usize {
        // SAFETY: forwarded from this function's contract; the AVX-512 tier's
        // features include AVX2's.
        unsafe {
            match block {
                32 => super::avx2::Avx2::absmax_blocks_batched(x, 32, rule, codes, scales, store),
                64 => blocks64_batched(x, rule, codes, scales, store),
                _ => 0,
            }
        }
    }

    #[inline(always)]
    unsafe fn absmax_columns(row: &[f32], acc: &mut [u32]) {
        let n = row.len().min(acc.len());
        let (row, acc) = (&row[..n], &mut acc[..n]);
        // SAFETY: AVX-512F per the Kernels contract; loads and stores stay inside
        // the equal-length `row` and `acc` (exact chunks, then a masked tail).
        unsafe {
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let mut rc = row.chunks_exact(16);
            let mut ac = acc.chunks_exact_mut(16);
            for (r, a) in (&mut rc).zip(&mut ac) {
                let v = _mm512_and_si512(_mm512_loadu_epi32(r.as_ptr().cast()), abs);
                let m = _mm512_max_epu32(_mm512_loadu_epi32(a.as_ptr().cast()), v);
                _mm512_storeu_epi32(a.as_mut_ptr().cast(), m);
            }
            let rest = rc.remainder();
            if !rest.is_empty() {
                let k = tail_mask(rest.len());
                let a = ac.into_remainder();
                let v = _mm512_and_si512(_mm512_maskz_loadu_epi32(k, rest.as_ptr().cast()), abs);
                let m = _mm512_max_epu32(_mm512_maskz_loadu_epi32(k, a.as_ptr().cast()), v);
                _mm512_mask_storeu_epi32(a.as_mut_ptr().cast(), k, m);
            }
        }
    }

    #[inline(always)]
    unsafe fn quantize_scaled(x: &[f32], scale: f32, clip: f32, out: &mut [i8], store: Store) {
        // SAFETY: forwarded from this function's contract.
        unsafe { scaled_run(x, scale, clip, out, store, &[]) }
    }

    /// `quantize_scaled_then_absmax` in one loop: each 64-value step codes 64
    /// values of `x` (a row read from cache), folds 64 values of `next` (the
    /// next row, streaming from memory) into the max of |next|'s bits and
    /// prefetches four lines of `ahead` (the row after) into L2, so the memory
    /// reads run under the coding instead of between rows. A streamed `out` is
    /// first aligned by a masked head; what the steps leave over (a tail of
    /// `x`, a longer `next`) goes through `scaled_run` and `absmax_bits`.
    #[inline(always)]
    unsafe fn quantize_scaled_then_absmax(
        x: &[f32],
        scale: f32,
        clip: f32,
        out: &mut [i8],
        store: Store,
        next: &[f32],
        ahead: &[f32],
    ) -> u32 {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let head = match store {
            Store::Streaming => head_to_align(out.as_ptr() as usize, 64, 1, n),
            Store::Cached => 0,
        };
        let steps = ((n - head) / 64).min(next.len() / 64);
        let (xh, xb) = x.split_at(head);
        let (oh, ob) = out.split_at_mut(head);
        let (xb, xr) = xb.split_at(64 * steps);
        let (ob, or) = ob.split_at_mut(64 * steps);
        let (nb, nr) = next.split_at(64 * steps);
        let mut lines = ahead.chunks(16);
        // Steps whose near lines (`NEAR_ROW_FLOATS` on) are still in `next`.
        let near_steps = nb.len().saturating_sub(NEAR_ROW_FLOATS) / 64;
        // SAFETY: AVX-512F/BW/DQ per the Kernels contract; each step reads 64
        // floats of `xb` and `nb` and writes 64 bytes of `ob` (equal lengths of
        // 64 · `steps`); a streamed `ob` starts on a 64-byte boundary (the head
        // aligned it) and is left unfenced (the caller fences, as the Kernels
        // contract says). Prefetches only name addresses inside `ahead` and
        // `nb`. The head and the rest go through `scaled_run` and
        // `absmax_bits`, which keep their own contracts.
        unsafe {
            scaled_run(xh, scale, clip, oh, Store::Cached, &[]);
            let lanes = ScaledLanes::new(scale, clip);
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let (mut a0, mut a1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            let (xp, op, np) = (xb.as_ptr(), ob.as_mut_ptr(), nb.as_ptr());
            for i in 0..steps {
                for line in (&mut lines).take(4) {
                    _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast());
                }
                let p = np.add(64 * i);
                if i < near_steps {
                    let near = p.add(NEAR_ROW_FLOATS);
                    for l in 0..4 {
                        _mm_prefetch::<_MM_HINT_T0>(near.add(16 * l).cast());
                    }
                }
                let v0 = _mm512_and_si512(_mm512_loadu_si512(p.cast()), abs);
                let v1 = _mm512_and_si512(_mm512_loadu_si512(p.add(16).cast()), abs);
                let v2 = _mm512_and_si512(_mm512_loadu_si512(p.add(32).cast()), abs);
                let v3 = _mm512_and_si512(_mm512_loadu_si512(p.add(48).cast()), abs);
                a0 = _mm512_max_epu32(a0, _mm512_max_epu32(v0, v2));
                a1 = _mm512_max_epu32(a1, _mm512_max_epu32(v1, v3));
                let q = lanes.codes64(xp.add(64 * i));
                match store {
                    Store::Streaming => _mm512_stream_si512(op.add(64 * i).cast(), q),
                    Store::Cached => _mm512_storeu_si512(op.add(64 * i).cast(), q),
                }
            }
            prefetch_rest(lines);
            scaled_run(xr, scale, clip, or, store, &[]);
            let m = _mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1));
            m.max(Self::absmax_bits(nr))
        }
    }

    #[inline(always)]
    unsafe fn quantize_scaled_ahead(
        x: &[f32],
        scale: f32,
        clip: f32,
        out: &mut [i8],
        store: Store,
        ahead: &[f32],
    ) {
        // SAFETY: forwarded from this function's contract.
        unsafe { scaled_run(x, scale, clip, out, store, ahead) }
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
    unsafe fn f32_to_f16(x: &[f32], out: &mut [f16]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        // SAFETY: AVX-512F per the Kernels contract; 16 floats in and 16 halves
        // (32 bytes) out per full chunk, the tail through a mask of its length.
        unsafe {
            let mut xc = x.chunks_exact(16);
            let mut oc = out.chunks_exact_mut(16);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_loadu_ps(c.as_ptr()),
                );
                _mm256_storeu_si256(o.as_mut_ptr().cast(), h);
            }
            let rest = xc.remainder();
            if !rest.is_empty() {
                let k = tail_mask(rest.len());
                let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_maskz_loadu_ps(k, rest.as_ptr()),
                );
                _mm256_mask_storeu_epi16(oc.into_remainder().as_mut_ptr().cast(), k, h);
            }
        }
    }

    #[inline(always)]
    unsafe fn f16_to_f32_streamed(x: &[f16], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let head = head_to_align(out.as_ptr() as usize, 64, 4, n);
        // SAFETY: AVX-512F per the Kernels contract; f16 is a 16-bit type. The
        // head (cached) aligns the output to 64 bytes; then 16 halves in and
        // one aligned 64-byte line streamed per full chunk, the tail cached;
        // fenced before returning.
        unsafe {
            Self::f16_to_f32(&x[..head], &mut out[..head]);
            let mut xc = x[head..].chunks_exact(16);
            let mut oc = out[head..].chunks_exact_mut(16);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let f = _mm512_cvtph_ps(_mm256_loadu_si256(c.as_ptr().cast()));
                _mm512_stream_ps(o.as_mut_ptr(), f);
            }
            _mm_sfence();
            Self::f16_to_f32(xc.remainder(), oc.into_remainder());
        }
    }

    #[inline(always)]
    unsafe fn f32_to_f16_streamed(x: &[f32], out: &mut [f16]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let head = head_to_align(out.as_ptr() as usize, 64, 2, n);
        // SAFETY: AVX-512F per the Kernels contract. The head (cached) aligns
        // the output to 64 bytes; then 32 floats in and one aligned 64-byte
        // line streamed per full chunk, the tail cached; fenced before
        // returning, so no caller sees the lines unordered.
        unsafe {
            Self::f32_to_f16(&x[..head], &mut out[..head]);
            let mut xc = x[head..].chunks_exact(32);
            let mut oc = out[head..].chunks_exact_mut(32);
            for (c, o) in (&mut xc).zip(&mut oc) {
                const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
                let lo = _mm512_cvtps_ph::<RNE>(_mm512_loadu_ps(c.as_ptr()));
                let hi = _mm512_cvtps_ph::<RNE>(_mm512_loadu_ps(c.as_ptr().add(16)));
                let line = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                _mm512_stream_si512(o.as_mut_ptr().cast(), line);
            }
            _mm_sfence();
            Self::f32_to_f16(xc.remainder(), oc.into_remainder());
        }
    }

    #[inline(always)]
    unsafe fn f64_to_f32_odd(x: &[f64], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        // SAFETY: AVX-512F/VL per the Kernels contract; 8 doubles per full
        // chunk, the tail through a mask.
        unsafe {
            let mut xc = x.chunks_exact(8);
            let mut oc = out.chunks_exact_mut(8);
            for (c, o) in (&mut xc).zip(&mut oc) {
                _mm256_storeu_ps(o.as_mut_ptr(), f32_odd(_mm512_loadu_pd(c.as_ptr())));
            }
            let rest = xc.remainder();
            if !rest.is_empty() {
                let k = ((1u32 << rest.len()) - 1) as __mmask8;
                let f = f32_odd(_mm512_maskz_loadu_pd(k, rest.as_ptr()));
                _mm256_mask_storeu_ps(oc.into_remainder().as_mut_ptr(), k, f);
            }
        }
    }

    #[inline(always)]
    unsafe fn f32_to_bf16(x: &[f32], out: &mut [bf16]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        // SAFETY: AVX-512F/BW per the Kernels contract; 16 floats in and 16
        // bf16 (32 bytes) out per full chunk, the tail through a mask of its
        // length; bf16 is a 16-bit type.
        unsafe {
            let mut xc = x.chunks_exact(16);
            let mut oc = out.chunks_exact_mut(16);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let h = bf16_nearest_even(_mm512_loadu_ps(c.as_ptr()));
                _mm256_storeu_si256(o.as_mut_ptr().cast(), h);
            }
            let rest = xc.remainder();
            if !rest.is_empty() {
                let k = tail_mask(rest.len());
                let h = bf16_nearest_even(_mm512_maskz_loadu_ps(k, rest.as_ptr()));
                _mm256_mask_storeu_epi16(oc.into_remainder().as_mut_ptr().cast(), k, h);
            }
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

    #[inline(always)]
    unsafe fn range_f32(x: &[f32]) -> Range<f32> {
        // SAFETY: AVX-512F per the Kernels contract; loads read inside `x`.
        unsafe {
            let inf = _mm512_set1_ps(f32::INFINITY);
            let (mut lo0, mut hi0) = (inf, _mm512_set1_ps(f32::NEG_INFINITY));
            let (mut lo1, mut hi1) = (lo0, hi0);
            let abs = _mm512_set1_epi32(0x7fff_ffff);
            let (mut b0, mut b1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            // Two independent sets of accumulators keep more loads in flight.
            // The value goes first: vminps/vmaxps return their second operand
            // when either is NaN, so a NaN leaves the lane as it was (the
            // scalar's `<` and `>` skip it too).
            let mut pairs = x.chunks_exact(32);
            for c in &mut pairs {
                let v0 = _mm512_loadu_ps(c.as_ptr());
                let v1 = _mm512_loadu_ps(c.as_ptr().add(16));
                lo0 = _mm512_min_ps(v0, lo0);
                hi0 = _mm512_max_ps(v0, hi0);
                lo1 = _mm512_min_ps(v1, lo1);
                hi1 = _mm512_max_ps(v1, hi1);
                b0 = _mm512_max_epu32(b0, _mm512_and_si512(_mm512_castps_si512(v0), abs));
                b1 = _mm512_max_epu32(b1, _mm512_and_si512(_mm512_castps_si512(v1), abs));
            }
            let mut rest = pairs.remainder();
            if rest.len() >= 16 {
                let v = _mm512_loadu_ps(rest.as_ptr());
                lo0 = _mm512_min_ps(v, lo0);
                hi0 = _mm512_max_ps(v, hi0);
                b0 = _mm512_max_epu32(b0, _mm512_and_si512(_mm512_castps_si512(v), abs));
                rest = &rest[16..];
            }
            if !rest.is_empty() {
                let k = tail_mask(rest.len());
                let v = _mm512_maskz_loadu_ps(k, rest.as_ptr());
                lo1 = _mm512_mask_min_ps(lo1, k, v, lo1);
                hi1 = _mm512_mask_max_ps(hi1, k, v, hi1);
                b1 = _mm512_max_epu32(b1, _mm512_and_si512(_mm512_castps_si512(v), abs));
            }
            Range {
                min: _mm512_reduce_min_ps(_mm512_min_ps(lo0, lo1)),
                max: _mm512_reduce_max_ps(_mm512_max_ps(hi0, hi1)),
                non_finite: _mm512_reduce_max_epu32(_mm512_max_epu32(b0, b1))
                    >= super::F32_INF_BITS,
            }
        }
    }

    #[inline(always)]
    unsafe fn range_f64(x: &[f64]) -> Range<f64> {
        // SAFETY: AVX-512F per the Kernels contract; loads read inside `x`.
        unsafe {
            let (mut lo, mut hi) = (
                _mm512_set1_pd(f64::INFINITY),
                _mm512_set1_pd(f64::NEG_INFINITY),
            );
            let abs = _mm512_set1_epi64(i64::MAX);
            let mut bits = _mm512_setzero_si512();
            let mut xc = x.chunks_exact(8);
            for c in &mut xc {
                let v = _mm512_loadu_pd(c.as_ptr());
                lo = _mm512_min_pd(v, lo);
                hi = _mm512_max_pd(v, hi);
                bits = _mm512_max_epu64(bits, _mm512_and_si512(_mm512_castpd_si512(v), abs));
            }
            let rest = xc.remainder();
            if !rest.is_empty() {
                let k = ((1u32 << rest.len()) - 1) as __mmask8;
                let v = _mm512_maskz_loadu_pd(k, rest.as_ptr());
                lo = _mm512_mask_min_pd(lo, k, v, lo);
                hi = _mm512_mask_max_pd(hi, k, v, hi);
                bits = _mm512_max_epu64(bits, _mm512_and_si512(_mm512_castpd_si512(v), abs));
            }
            Range {
                min: _mm512_reduce_min_pd(lo),
                max: _mm512_reduce_max_pd(hi),
                non_finite: _mm512_reduce_max_epu64(bits) >= f64::INFINITY.to_bits(),
            }
        }
    }

    #[inline(always)]
    unsafe fn affine_quantize_f32(x: &[f32], a: Affine, out: &mut [i8], store: Store) {
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::affine_quantize_f32_ahead(x, a, out, store, &[]) }
    }

    #[inline(always)]
    unsafe fn affine_quantize_f32_ahead(
        x: &[f32],
        a: Affine,
        out: &mut [i8],
        store: Store,
        ahead: &[f32],
    ) {
        // SAFETY: forwarded (AVX-512F/BW per the Kernels contract).
        unsafe { quantize_f32_beside(x, a, out, store, ahead, &mut Nothing) }
    }

    #[inline(always)]
    unsafe fn affine_quantize_f32_then_range(
        x: &[f32],
        a: Affine,
        out: &mut [i8],
        store: Store,
        next: &[f32],
        ahead: &[f32],
        magnitude: bool,
    ) -> Range<f32> {
        // One loop: each 64 codes of `x` beside 64 values of `next`.
        // SAFETY: forwarded (AVX-512F/BW per the Kernels contract).
        unsafe {
            if magnitude {
                let mut r = RowRange::<true>::new(next);
                quantize_f32_beside(x, a, out, store, ahead, &mut r);
                r.finish()
            } else {
                let mut r = RowRange::<false>::new(next);
                quantize_f32_beside(x, a, out, store, ahead, &mut r);
                r.finish()
            }
        }
    }

    #[inline(always)]
    unsafe fn affine_quantize_int4_f32(x: &[f32], a: Affine, out: &mut [u8]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::affine_quantize_int4_f32_ahead(x, a, out, &[]) }
    }

    #[inline(always)]
    unsafe fn affine_quantize_int4_f32_ahead(x: &[f32], a: Affine, out: &mut [u8], ahead: &[f32]) {
        // SAFETY: forwarded (AVX-512F/BW per the Kernels contract).
        unsafe { quantize_int4_f32_beside(x, a, out, ahead, &mut Nothing) }
    }

    #[inline(always)]
    unsafe fn affine_quantize_int4_f32_then_range(
        x: &[f32],
        a: Affine,
        out: &mut [u8],
        next: &[f32],
        ahead: &[f32],
        magnitude: bool,
    ) -> Range<f32> {
        // One loop, as `affine_quantize_f32_then_range`.
        // SAFETY: forwarded (AVX-512F/BW per the Kernels contract).
        unsafe {
            if magnitude {
                let mut r = RowRange::<true>::new(next);
                quantize_int4_f32_beside(x, a, out, ahead, &mut r);
                r.finish()
            } else {
                let mut r = RowRange::<false>::new(next);
                quantize_int4_f32_beside(x, a, out, ahead, &mut r);
                r.finish()
            }
        }
    }

    #[inline(always)]
    unsafe fn affine_quantize_f64(x: &[f64], a: Affine, out: &mut [i8]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        // SAFETY: AVX-512F per the Kernels contract; loads and stores stay inside
        // the equal-length `x` and `out`.
        unsafe {
            let a = AffineLanes::new(a);
            let mut xc = x.chunks_exact(16);
            let mut oc = out.chunks_exact_mut(16);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let lo = affine8(_mm512_loadu_pd(c.as_ptr()), &a);
                let hi = affine8(_mm512_loadu_pd(c.as_ptr().add(8)), &a);
                _mm_storeu_si128(o.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(join(lo, hi)));
            }
            let rest = xc.remainder();
            if !rest.is_empty() {
                let k = tail_mask(rest.len());
                let k_lo = (k & 0xff) as __mmask8;
                let k_hi = (k >> 8) as __mmask8;
                let lo = affine8(_mm512_maskz_loadu_pd(k_lo, rest.as_ptr()), &a);
                let hi_ptr = rest.as_ptr().add(rest.len().min(8));
                let hi = affine8(_mm512_maskz_loadu_pd(k_hi, hi_ptr), &a);
                _mm512_mask_cvtepi32_storeu_epi8(oc.into_remainder().as_mut_ptr(), k, join(lo, hi));
            }
        }
    }

    #[inline(always)]
    unsafe fn affine_dequantize_f32(q: &[i8], zp: f64, scale: f64, out: &mut [f32], store: Store) {
        let n = q.len().min(out.len());
        let (q, out) = (&q[..n], &mut out[..n]);
        // SAFETY: AVX-512F/BW/VL per the Kernels contract; accesses stay inside
        // the equal-length `q` and `out` (a masked head, exact chunks, a masked
        // tail); streaming stores go to 64-byte aligned chunks only (the head
        // aligns them) and are fenced before returning. vcvtpd2ps rounds to
        // nearest even, as `as f32`.
        unsafe {
            let (zp, scale) = (_mm512_set1_pd(zp), _mm512_set1_pd(scale));
            let head = match store {
                Store::Streaming => head_to_align(out.as_ptr() as usize, 64, 4, n),
                Store::Cached => 0,
            };
            if head > 0 {
                dequantize_masked_f32(&q[..head], &mut out[..head], zp, scale);
            }
            let (q, out) = (&q[head..], &mut out[head..]);
            let mut qc = q.chunks_exact(16);
            let mut oc = out.chunks_exact_mut(16);
            match store {
                Store::Streaming => {
                    for (c, o) in (&mut qc).zip(&mut oc) {
                        let v = values16_f32(_mm_loadu_si128(c.as_ptr().cast()), zp, scale);
                        _mm512_stream_ps(o.as_mut_ptr(), v);
                    }
                    _mm_sfence();
                }
                Store::Cached => {
                    for (c, o) in (&mut qc).zip(&mut oc) {
                        let v = values16_f32(_mm_loadu_si128(c.as_ptr().cast()), zp, scale);
                        _mm512_storeu_ps(o.as_mut_ptr(), v);
                    }
                }
            }
            let rest = qc.remainder();
            if !rest.is_empty() {
                dequantize_masked_f32(rest, oc.into_remainder(), zp, scale);
            }
        }
    }

    #[inline(always)]
    unsafe fn affine_dequantize_f64(q: &[i8], zp: f64, scale: f64, out: &mut [f64]) {
        let n = q.len().min(out.len());
        let (q, out) = (&q[..n], &mut out[..n]);
        // SAFETY: AVX-512F/BW/VL per the Kernels contract; accesses stay inside
        // the equal-length `q` and `out`.
        unsafe {
            let (zp, scale) = (_mm512_set1_pd(zp), _mm512_set1_pd(scale));
            let mut qc = q.chunks_exact(16);
            let mut oc = out.chunks_exact_mut(16);
            for (c, o) in (&mut qc).zip(&mut oc) {
                let (lo, hi) = affine_values16(_mm_loadu_si128(c.as_ptr().cast()), zp, scale);
                _mm512_storeu_pd(o.as_mut_ptr(), lo);
                _mm512_storeu_pd(o.as_mut_ptr().add(8), hi);
            }
            let rest = qc.remainder();
            if !rest.is_empty() {
                let k = tail_mask(rest.len());
                let (lo, hi) = affine_values16(_mm_maskz_loadu_epi8(k, rest.as_ptr()), zp, scale);
                let o = oc.into_remainder();
                let k_lo = (k & 0xff) as __mmask8;
                let k_hi = (k >> 8) as __mmask8;
                _mm512_mask_storeu_pd(o.as_mut_ptr(), k_lo, lo);
                _mm512_mask_storeu_pd(o.as_mut_ptr().add(rest.len().min(8)), k_hi, hi);
            }
        }
    }

    #[inline(always)]
    unsafe fn affine_dequantize_f16(q: &[i8], zp: f64, scale: f64, out: &mut [f16]) {
        // SAFETY: AVX-512F/BW/VL per the Kernels contract; f16 is a 16-bit
        // type; see `narrow16`.
        unsafe { narrow16(q, zp, scale, out) }
    }

    #[inline(always)]
    unsafe fn affine_dequantize_bf16(q: &[i8], zp: f64, scale: f64, out: &mut [bf16]) {
        // SAFETY: as above.
        unsafe { narrow16(q, zp, scale, out) }
    }

    #[inline(always)]
    unsafe fn pack_int4(q: &[i8], out: &mut [u8]) {
        let n = (q.len() / 2).min(out.len());
        let (q, out) = (&q[..2 * n], &mut out[..n]);
        // SAFETY: AVX-512BW per the Kernels contract; 64 codes in, 32 bytes out per
        // full chunk, the tail through masks of its length.
        unsafe {
            let low = _mm512_set1_epi16(0x000f);
            let high = _mm512_set1_epi16(0x00f0);
            // Each 16-bit lane holds a pair (even code in the low byte).
            let pack = |w: __m512i| {
                _mm512_or_si512(
                    _mm512_and_si512(w, low),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(w), high),
                )
            };
            let mut qc = q.chunks_exact(64);
            let mut oc = out.chunks_exact_mut(32);
            for (c, o) in (&mut qc).zip(&mut oc) {
                let w = _mm512_loadu_si512(c.as_ptr().cast());
                _mm256_storeu_si256(o.as_mut_ptr().cast(), _mm512_cvtepi16_epi8(pack(w)));
            }
            let rest = qc.remainder();
            if !rest.is_empty() {
                let pairs = rest.len() / 2;
                let kb = (1u64 << rest.len()) - 1;
                let w = _mm512_maskz_loadu_epi8(kb, rest.as_ptr());
                let kw = ((1u64 << pairs) - 1) as __mmask32;
                _mm512_mask_cvtepi16_storeu_epi8(
                    oc.into_remainder().as_mut_ptr().cast(),
                    kw,
                    pack(w),
                );
            }
        }
    }

    #[inline(always)]
    unsafe fn unpack_int4(p: &[u8], out: &mut [i8]) {
        let n = p.len().min(out.len() / 2);
        let (p, out) = (&p[..n], &mut out[..2 * n]);
        // SAFETY: AVX-512BW per the Kernels contract; 32 bytes in, 64 codes out per
        // full chunk, the tail through masks of its length.
        unsafe {
            let low = _mm512_set1_epi16(0x000f);
            let eight = _mm512_set1_epi8(8);
            let unpack = |b: __m256i| {
                let w = _mm512_cvtepu8_epi16(b);
                let pair = _mm512_or_si512(
                    _mm512_and_si512(w, low),
                    _mm512_slli_epi16::<8>(_mm512_srli_epi16::<4>(w)),
                );
                // Sign-extend each nibble: (n ^ 8) - 8.
                _mm512_sub_epi8(_mm512_xor_si512(pair, eight), eight)
            };
            let mut pc = p.chunks_exact(32);
            let mut oc = out.chunks_exact_mut(64);
            for (c, o) in (&mut pc).zip(&mut oc) {
                let b = _mm256_loadu_si256(c.as_ptr().cast());
                _mm512_storeu_si512(o.as_mut_ptr().cast(), unpack(b));
            }
            let rest = pc.remainder();
            if !rest.is_empty() {
                let kb = ((1u64 << rest.len()) - 1) as __mmask32;
                let b = _mm256_maskz_loadu_epi8(kb, rest.as_ptr().cast());
                let ko = (1u64 << (2 * rest.len())) - 1;
                _mm512_mask_storeu_epi8(oc.into_remainder().as_mut_ptr(), ko, unpack(b));
            }
        }
    }
}
