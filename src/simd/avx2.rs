//! AVX2 primitives: 8 lanes; tails shorter than a vector go through the
//! scalar kernel, which computes the same values.

use super::kernels::{
    products_via_dots, AbsmaxRule, Affine, Beside, Kernels, Nothing, PackedTokens, Range, Store,
    F32_FAST_LIMIT, F32_FAST_MARGIN, F32_INF_BITS,
};
use super::scalar::{self, quantize_one, Scalar};
use super::Isa;
use half::{bf16, f16};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// The AVX2 ISA marker.
pub(crate) struct Avx2;

/// The cache lines of a slice that a loop brings toward the core ahead of
/// use, in order: a bare pointer walk, so a loop pays a compare and a
/// prefetch a line (stepping a `chunks(16)` iterator through `take(2)` took
/// about fifteen scalar instructions a step). Only addresses inside the
/// slice are named.
#[derive(Clone, Copy)]
struct Lines {
    next: *const f32,
    end: *const f32,
}

impl Lines {
    #[inline(always)]
    fn new(ahead: &[f32]) -> Self {
        let r = ahead.as_ptr_range();
        Lines {
            next: r.start,
            end: r.end,
        }
    }

    /// Prefetch the next line (16 floats), if the slice has one.
    #[inline(always)]
    unsafe fn one(&mut self) {
        if self.next < self.end {
            // SAFETY: the caller runs with SSE (any x86-64); a prefetch
            // reads nothing architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.next.cast()) };
            self.next = self.next.wrapping_add(16);
        }
    }

    /// Prefetch the next two lines (32 floats), as far as the slice goes.
    #[inline(always)]
    unsafe fn two(&mut self) {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            self.one();
            self.one();
        }
    }

    /// Prefetch every line left: after a loop that a head or a short run
    /// stopped before the end of `ahead`, so the last lines of the row after
    /// are not read on demand, one memory latency a row.
    #[inline(always)]
    unsafe fn rest(&mut self) {
        while self.next < self.end {
            // SAFETY: forwarded from this function's contract.
            unsafe { self.one() };
        }
    }
}

/// `clamp(round_half_away(v / s), -127, 127)` as i32 lanes (see avx512::quant16).
#[inline(always)]
unsafe fn quant8(v: __m256, s: __m256, clip: __m256) -> __m256i {
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
        let neg = _mm256_xor_ps(clip, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN)));
        let c = _mm256_min_ps(_mm256_max_ps(r, neg), clip);
        _mm256_cvttps_epi32(c)
    }
}

/// `clip` as the lanes [`quant8`] clamps to: at most 256, so a clamped code
/// converts exactly and then saturates to 127 or -128 as `as i8` does (a
/// clip of 2^31 or more let codes convert to i32::MIN, so -128 where the
/// scalar rule gives 127).
#[inline(always)]
unsafe fn clip_lanes(clip: f32) -> __m256 {
    // SAFETY: the caller runs with AVX2 (the Kernels contract).
    unsafe { _mm256_set1_ps(clip.min(256.0)) }
}

/// Near a rounding boundary `|y - rne(y)|` exceeds `0.5 - NEAR_TIE`: see
/// [`quant8_fast`] (the bound of `avx512::round16_fast`).
const NEAR_TIE: f32 = 1.0 / 8192.0;

/// `round(v * r)` (nearest even, as MXCSR's default mode converts; kernels
/// run in the default environment, see `fpenv`) as i32 lanes, with `r = 1/s`
/// rounded, and the lanes where it may differ from `quant8`'s
/// `round_half_away(v / s)`: as in `avx512::round16_fast`, `v * r` is within
/// `|q|·(2^-23 + 2^-24)` of `fl(v / s)`, under 2^-14.4 while `|q| < 256`, so
/// both round alike unless a half-integer lies that close, and those lanes
/// are flagged; where `|q| >= 256` both are 255 or more, which the clamp to
/// ±clip (and the i8 saturation) maps alike. A product out of i32's range
/// converts to i32::MIN, which converts back to -2^31, far from it: flagged,
/// as NaN is.
///
/// The flag is left to the caller as the bits of `|y - q|`: non-negative
/// floats order as their bits do, and NaN's bits exceed every number's, so
/// the largest of several vectors' bits (`vpmaxud`) compared once with
/// `0.5 - NEAR_TIE`'s flags exactly the lanes a float compare would.
#[inline(always)]
unsafe fn quant8_fast(v: __m256, r: __m256) -> (__m256i, __m256i) {
    // SAFETY: the caller runs with AVX2 (the Kernels contract).
    unsafe {
        let y = _mm256_mul_ps(v, r);
        let q = _mm256_cvtps_epi32(y);
        let e = _mm256_castps_si256(_mm256_sub_ps(y, _mm256_cvtepi32_ps(q)));
        (q, _mm256_and_si256(e, _mm256_set1_epi32(0x7fff_ffff)))
    }
}

/// The i8 bounds of `clamp(r, -clip, clip) as i8` for an integer `r`:
/// `±floor(clip)`, saturated to i8 as `as` does.
#[inline(always)]
unsafe fn clip_bytes(clip: f32) -> (__m256i, __m256i) {
    let hi = clip.floor().min(127.0) as i8;
    let lo = (-clip.floor()).max(-128.0) as i8;
    // SAFETY: the caller runs with AVX2 (the Kernels contract).
    unsafe { (_mm256_set1_epi8(lo), _mm256_set1_epi8(hi)) }
}

/// Four vectors of i32 codes as 32 saturated bytes in order.
#[inline(always)]
unsafe fn pack32(q: [__m256i; 4]) -> __m256i {
    // SAFETY: the caller runs with AVX2.
    unsafe {
        let w = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        // packs interleaved the 128-bit lanes: codes 0..32 in order.
        _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }
}

/// 32 codes of the floats at `x` in order by the reciprocal form
/// (`quant8_fast` lane for lane, narrowed with saturation, then clamped as
/// bytes: saturation keeps order, so clamping the bytes equals clamping the
/// integers), and whether a lane may differ from `quant8`'s (near a tie, out
/// of i32's range, NaN): such a step is redone by [`quant32_div`].
#[inline(always)]
unsafe fn quant32_fast(x: *const f32, r: __m256, bounds: (__m256i, __m256i)) -> (__m256i, bool) {
    // SAFETY: the caller guarantees 32 readable floats at `x` and AVX2.
    unsafe {
        let (a, ea) = quant8_fast(_mm256_loadu_ps(x), r);
        let (b, eb) = quant8_fast(_mm256_loadu_ps(x.add(8)), r);
        let (c, ec) = quant8_fast(_mm256_loadu_ps(x.add(16)), r);
        let (d, ed) = quant8_fast(_mm256_loadu_ps(x.add(24)), r);
        let e = _mm256_max_epu32(_mm256_max_epu32(ea, eb), _mm256_max_epu32(ec, ed));
        let limit = _mm256_set1_epi32((0.5 - NEAR_TIE).to_bits() as i32);
        let near = _mm256_movemask_epi8(_mm256_cmpgt_epi32(e, limit)) != 0;
        let (lo, hi) = bounds;
        (
            _mm256_min_epi8(_mm256_max_epi8(pack32([a, b, c, d]), lo), hi),
            near,
        )
    }
}

/// 32 codes of the floats at `x` in order (`quant8` lane for lane): the
/// reciprocal form where `fast` and no lane is near a tie, else division.
#[inline(always)]
unsafe fn quant32(
    x: *const f32,
    s: __m256,
    r: __m256,
    fast: bool,
    clip: __m256,
    bounds: (__m256i, __m256i),
) -> __m256i {
    // SAFETY: the caller guarantees 32 readable floats at `x` and AVX2.
    unsafe {
        if fast {
            let (q, near) = quant32_fast(x, r, bounds);
            if !near {
                return q;
            }
        }
        quant32_div(x, s, clip)
    }
}

/// 32 codes of the floats at `x` in order by division (`quant8` lane for
/// lane): `quant32`'s fallback. Cold, so it stays out of line: inlined, it
/// doubled the loop and its constants spilled the fast path's registers.
#[cold]
#[inline(never)]
#[target_feature(enable = "avx2")]
unsafe fn quant32_div(x: *const f32, s: __m256, clip: __m256) -> __m256i {
    // SAFETY: the caller guarantees 32 readable floats at `x`; AVX2 is
    // enabled for this function.
    unsafe { quant32_exact(x, s, clip) }
}

/// The body of [`quant32_div`], for loops that code their flagged steps in
/// line ([`fused_block`]).
#[inline(always)]
unsafe fn quant32_exact(x: *const f32, s: __m256, clip: __m256) -> __m256i {
    // SAFETY: the caller guarantees 32 readable floats at `x` and AVX2.
    let q = |i: usize| unsafe { quant8(_mm256_loadu_ps(x.add(8 * i)), s, clip) };
    // SAFETY: as above.
    unsafe { pack32([q(0), q(1), q(2), q(3)]) }
}

/// The largest of 8 unsigned 32-bit lanes.
#[inline(always)]
unsafe fn hmax_epu32(a: __m256i) -> u32 {
    // SAFETY: the caller runs with AVX2.
    unsafe {
        let h = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
        let h = _mm_max_epu32(h, _mm_shuffle_epi32::<0b01_00_11_10>(h));
        let h = _mm_max_epu32(h, _mm_shuffle_epi32::<0b10_11_00_01>(h));
        _mm_cvtsi128_si32(h) as u32
    }
}

/// The `B` values at `p` (a multiple of 16) as one vector of the largest |x|
/// bits of each lane position (`abs` masks the sign).
#[inline(always)]
unsafe fn fold<const B: usize>(p: *const f32, abs: __m256i) -> __m256i {
    // SAFETY: the caller guarantees `B` readable floats at `p` and AVX2.
    // (No closure for the loads: closures do not inherit `target_feature`,
    // and their intrinsics became calls.)
    unsafe {
        let mut a = _mm256_and_si256(_mm256_loadu_si256(p.cast()), abs);
        let mut b = _mm256_and_si256(_mm256_loadu_si256(p.add(8).cast()), abs);
        for i in (2..B / 8).step_by(2) {
            let c = _mm256_and_si256(_mm256_loadu_si256(p.add(8 * i).cast()), abs);
            let d = _mm256_and_si256(_mm256_loadu_si256(p.add(8 * i + 8).cast()), abs);
            a = _mm256_max_epu32(a, c);
            b = _mm256_max_epu32(b, d);
        }
        _mm256_max_epu32(a, b)
    }
}

/// The 8 lanes' maximum (as unsigned) of each of 8 vectors, in order: lane `j`
/// of the result is the largest lane of `v[j]`. Two in-lane halving steps and
/// one across the 128-bit halves: 21 ops for what 8 separate reductions do in
/// about 48.
#[inline(always)]
unsafe fn max_lanes8(v: [__m256i; 8]) -> __m256i {
    // SAFETY: AVX2 per the caller.
    unsafe {
        // Within each 128-bit half, a[j] holds v[2j]'s and v[2j + 1]'s pairs:
        // dwords (v[2j] 0|2, v[2j+1] 0|2, v[2j] 1|3, v[2j+1] 1|3).
        let mut a = [_mm256_setzero_si256(); 4];
        for (j, a) in a.iter_mut().enumerate() {
            let (p, q) = (v[2 * j], v[2 * j + 1]);
            *a = _mm256_max_epu32(_mm256_unpacklo_epi32(p, q), _mm256_unpackhi_epi32(p, q));
        }
        // Dword i of each half: v[i]'s (or v[4 + i]'s) maximum over that half.
        let b0 = _mm256_max_epu32(
            _mm256_unpacklo_epi64(a[0], a[1]),
            _mm256_unpackhi_epi64(a[0], a[1]),
        );
        let b4 = _mm256_max_epu32(
            _mm256_unpacklo_epi64(a[2], a[3]),
            _mm256_unpackhi_epi64(a[2], a[3]),
        );
        // The low halves together, the high halves together: v[0..4], v[4..8].
        _mm256_max_epu32(
            _mm256_permute2x128_si256::<0x20>(b0, b4),
            _mm256_permute2x128_si256::<0x31>(b0, b4),
        )
    }
}

/// Blocks of `B` values (32, 64 or 128) eight at a time, as the AVX-512 tier
/// does sixteen: each block's |x| folded to one vector, the 8 maxima found
/// together ([`max_lanes8`]) and checked for non-finite values at once, the 8
/// scales and reciprocals divided at once, then each block's codes by
/// `quant32` beside the next batch's loads. Returns the blocks done: a batch
/// holding a non-finite value, and the blocks after the last whole batch, are
/// left to the caller. The same scales and codes as the block-at-a-time loop
/// (IEEE divisions, as the scalar rule's). Codes are stored cached: streaming
/// whole 32-byte chunks gathered from blocks that straddle them (as a NumPy
/// output's do) measured no faster.
///
/// # Safety
/// AVX2; `B` is 32, 64 or 128.
#[inline(always)]
unsafe fn blocks_batched<const B: usize>(
    x: &[f32],
    rule: AbsmaxRule,
    codes: &mut [i8],
    scales: &mut [f32],
) -> usize {
    let batches = (x.len() / (8 * B))
        .min(codes.len() / (8 * B))
        .min(scales.len() / 8);
    if batches == 0 {
        return 0;
    }
    // SAFETY: AVX2 per the caller; batch `t` reads `x[8Bt..8B(t + 1)]` and
    // writes the same range of `codes` and `scales[8t..8(t + 1)]`, all inside
    // the slices (`batches` bounds them).
    unsafe {
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let bounds = clip_bytes(rule.clip);
        let clip = clip_lanes(rule.clip);
        let divisor = _mm256_set1_ps(rule.divisor);
        let zero_scale = _mm256_set1_ps(rule.zero_scale);
        let finite = _mm256_set1_epi32(F32_INF_BITS as i32 - 1);
        let mut v = [_mm256_setzero_si256(); 8];
        for (j, v) in v.iter_mut().enumerate() {
            *v = fold::<B>(x.as_ptr().add(B * j), abs);
        }
        let mut m = max_lanes8(v);
        for t in 0..batches {
            // |x| bits are below 2^31, so the signed compare orders them.
            if _mm256_movemask_epi8(_mm256_cmpgt_epi32(m, finite)) != 0 {
                return 8 * t;
            }
            // rule.scale: max / divisor where max > 0 (bits > 0), else zero_scale.
            let zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(m, _mm256_setzero_si256()));
            let s = _mm256_blendv_ps(
                _mm256_div_ps(_mm256_castsi256_ps(m), divisor),
                zero_scale,
                zero,
            );
            let r = _mm256_div_ps(_mm256_set1_ps(1.0), s);
            _mm256_storeu_ps(scales.as_mut_ptr().add(8 * t), s);
            let (mut sv, mut rv) = ([0f32; 8], [0f32; 8]);
            _mm256_storeu_ps(sv.as_mut_ptr(), s);
            _mm256_storeu_ps(rv.as_mut_ptr(), r);
            // Each block's codes (from L1) beside the next batch's block
            // maxima (from memory), so the loads overlap the arithmetic.
            let xp = x.as_ptr().add(8 * B * t);
            let more = t + 1 < batches;
            for j in 0..8 {
                if more {
                    v[j] = fold::<B>(xp.add(8 * B + B * j), abs);
                }
                let (sj, rj) = (sv[j], rv[j]);
                let (s8, r8) = (_mm256_set1_ps(sj), _mm256_set1_ps(rj));
                let fast = sj.is_normal() && rj.is_normal();
                for h in 0..B / 32 {
                    let q = if sj > 0.0 {
                        quant32(xp.add(B * j + 32 * h), s8, r8, fast, clip, bounds)
                    } else {
                        _mm256_setzero_si256()
                    };
                    let out = codes.as_mut_ptr().add(8 * B * t + B * j + 32 * h);
                    _mm256_storeu_si256(out.cast(), q);
                }
            }
            if more {
                m = max_lanes8(v);
            }
        }
        8 * batches
    }
}

/// Store 32 code bytes at `o`: streamed (the caller guarantees 32-byte
/// alignment and fences after the run) or cached.
#[inline(always)]
unsafe fn store32(o: *mut i8, q: __m256i, stream: bool) {
    // SAFETY: the caller runs with AVX2, `o` has 32 writable bytes, and is
    // 32-byte aligned when `stream`.
    unsafe {
        if stream {
            _mm256_stream_si256(o.cast(), q);
        } else {
            _mm256_storeu_si256(o.cast(), q);
        }
    }
}

/// Values a `quantize_scaled` run needs before AVX2 streams its codes (a
/// hint it may decline, see [`Store`]): the spans of a per-tensor pass (16 Ki)
/// gained 3-8 %, single 4096-value stages lost 2-8 %. The fused per-row loop
/// (`quantize_scaled_then_absmax`) has its own rule: rows of any length
/// stream when their codes are left aligned.
const STREAM_MIN_RUN: usize = 16 * 1024;

/// The broadcast parameters of the scaled codes for one scale and clip: `s`
/// and `clip` for division, `r = 1/s` for the reciprocal form (which holds
/// only where `fast`).
struct ScaledLanes {
    s: __m256,
    r: __m256,
    fast: bool,
    clip: __m256,
    bounds: (__m256i, __m256i),
}

impl ScaledLanes {
    /// Codes of the 32 floats at `x` (see `quant32`).
    #[inline(always)]
    unsafe fn codes32(&self, x: *const f32) -> __m256i {
        // SAFETY: the caller runs with AVX2 and has 32 readable floats at `x`.
        unsafe { quant32(x, self.s, self.r, self.fast, self.clip, self.bounds) }
    }

    #[inline(always)]
    unsafe fn new(scale: f32, clip: f32) -> Self {
        // The reciprocal form needs a normal scale and reciprocal.
        let recip = 1.0 / scale;
        // SAFETY: the caller runs with AVX2.
        unsafe {
            ScaledLanes {
                s: _mm256_set1_ps(scale),
                r: _mm256_set1_ps(recip),
                fast: scale.is_normal() && recip.is_normal(),
                clip: clip_lanes(clip),
                bounds: clip_bytes(clip),
            }
        }
    }
}

/// `quantize_scaled_ahead` for one store kind. Streaming: a head up to a
/// 64-byte boundary of `out` goes the cached way, then whole 32-byte chunks
/// bypass the cache (a cached store first reads every line it writes).
#[inline(always)]
unsafe fn scaled_run<const STREAM: bool>(
    x: &[f32],
    scale: f32,
    clip: f32,
    out: &mut [i8],
    ahead: &[f32],
) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    let head = if STREAM {
        ((out.as_ptr() as usize).wrapping_neg() % 64).min(n)
    } else {
        0
    };
    let (xh, x) = x.split_at(head);
    let (oh, out) = out.split_at_mut(head);
    let mut ahead = Lines::new(ahead);
    let mut xc = x.chunks_exact(32);
    let mut oc = out.chunks_exact_mut(32);
    // SAFETY: the caller runs with AVX2; 32 floats read and 32 bytes written
    // per full chunk; streamed chunks are 32-byte aligned (the head aligned
    // `out`, chunks are 32 bytes) and left unfenced (the Kernels contract allows it). Prefetches
    // only name addresses inside `ahead` (two lines for every 32 values
    // coded: the same rate).
    unsafe {
        quantize_scaled_short(xh, scale, clip, oh);
        let lanes = ScaledLanes::new(scale, clip);
        for (c, o) in (&mut xc).zip(&mut oc) {
            ahead.two();
            let q = lanes.codes32(c.as_ptr());
            store32(o.as_mut_ptr(), q, STREAM);
        }
        ahead.rest();
        quantize_scaled_short(xc.remainder(), scale, clip, oc.into_remainder());
    }
}

/// Steps of a [`fused_block`] (the most its list of flagged steps holds: 512
/// bytes on the stack, uninitialized).
const REDO_STEPS: usize = 256;

/// The fused per-row loop (`quantize_scaled_then_absmax`): each step codes
/// 32 values of `x` (from cache) into `out`, folds 32 values of `next`
/// (streaming in from memory) into the max of |next|'s bits, and prefetches
/// two lines of `ahead`; returns that max. Runs over the whole steps that
/// `x`, `out` and `next` all hold, [`REDO_STEPS`] at a time. Streamed codes
/// are left unfenced: the caller fences (the Kernels contract of
/// `quantize_scaled_then_absmax`).
#[inline(always)]
unsafe fn fused_run<const STREAM: bool>(
    x: &[f32],
    out: &mut [i8],
    next: &[f32],
    ahead: &[f32],
    lanes: &ScaledLanes,
) -> u32 {
    let steps = (x.len() / 32).min(out.len() / 32).min(next.len() / 32);
    let (xp, op, np) = (x.as_ptr(), out.as_mut_ptr(), next.as_ptr());
    let mut lines = Lines::new(ahead);
    let mut m = 0;
    let mut block = 0;
    // SAFETY: the caller runs with AVX2 and, when `STREAM`, 32-byte aligned
    // `out` (left unfenced for the caller); a block of `n` steps from step
    // `block` reads floats `32 · block` to `32 · (block + n)` of `x` and
    // `next` and writes those bytes of `out`, all below `32 · steps`;
    // prefetches only name addresses inside `ahead`.
    unsafe {
        while block < steps {
            let n = (steps - block).min(REDO_STEPS);
            let (xb, ob, nb) = (xp.add(32 * block), op.add(32 * block), np.add(32 * block));
            m = m.max(fused_block::<STREAM>(xb, ob, nb, n, &mut lines, lanes));
            block += n;
        }
    }
    m
}

/// `n <= REDO_STEPS` steps of [`fused_run`]: the codes of `x` in `out`, and
/// the max of |next|'s bits over them.
///
/// The loop makes no call. A step whose reciprocal form is flagged (a lane
/// near a tie, or a scale the form does not hold for: `!lanes.fast`) is
/// listed; after the loop the listed steps are coded by division. Cached
/// stores write a listed step's codes anyway (no branch; the redo
/// overwrites them in L1); streamed ones skip it, so each streamed code is
/// stored once and needs no fence before the run's closing one. With the
/// division called in the loop (cold, out of line), the call's clobbers made
/// the compiler keep the next row's four vectors and an accumulator on the
/// stack: five stores and five loads a step, for the ~1 % of steps that
/// divide. The redo is in line for the same reason: rustc 1.95 emitted no
/// `noinline` for `#[inline(never)]` on a `#[target_feature]` function, so
/// a call after the loop could land in the loop's function and spill its
/// constants.
#[target_feature(enable = "avx2")]
unsafe fn fused_block<const STREAM: bool>(
    x: *const f32,
    out: *mut i8,
    next: *const f32,
    n: usize,
    lines: &mut Lines,
    lanes: &ScaledLanes,
) -> u32 {
    let mut list = [MaybeUninit::<u16>::uninit(); REDO_STEPS];
    let mut listed = 0;
    // A local copy: stores through `out` could alias the caller's.
    let mut ahead = *lines;
    // SAFETY: the caller guarantees 32 · `n` floats at `x` and `next` and
    // as many writable bytes at `out` (32-byte aligned when `STREAM`), and
    // `n <= REDO_STEPS`; entry `listed <= i < n` is written at step `i`, and
    // the redo reads the `listed` entries written; prefetches only name
    // addresses `lines` holds; AVX2 is enabled here.
    unsafe {
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for i in 0..n {
            ahead.two();
            let p = next.add(32 * i);
            let v0 = _mm256_and_si256(_mm256_loadu_si256(p.cast()), abs);
            let v1 = _mm256_and_si256(_mm256_loadu_si256(p.add(8).cast()), abs);
            let v2 = _mm256_and_si256(_mm256_loadu_si256(p.add(16).cast()), abs);
            let v3 = _mm256_and_si256(_mm256_loadu_si256(p.add(24).cast()), abs);
            a0 = _mm256_max_epu32(a0, _mm256_max_epu32(v0, v2));
            a1 = _mm256_max_epu32(a1, _mm256_max_epu32(v1, v3));
            let (q, near) = quant32_fast(x.add(32 * i), lanes.r, lanes.bounds);
            let flagged = near || !lanes.fast;
            if !STREAM || !flagged {
                store32(out.add(32 * i), q, STREAM);
            }
            list.get_unchecked_mut(listed).write(i as u16);
            listed += usize::from(flagged);
        }
        *lines = ahead;
        if listed > 0 {
            for k in list.get_unchecked(..listed) {
                let at = 32 * usize::from(k.assume_init());
                let q = quant32_exact(x.add(at), lanes.s, lanes.clip);
                store32(out.add(at), q, STREAM);
            }
        }
        hmax_epu32(_mm256_max_epu32(a0, a1))
    }
}

/// `clamp(round_half_away(v / s))` of a short run (a streaming head or a
/// tail under 32 values): 8 lanes at a time, then one by one.
#[inline(always)]
unsafe fn quantize_scaled_short(x: &[f32], scale: f32, clip: f32, out: &mut [i8]) {
    let mut xc = x.chunks_exact(8);
    let mut oc = out.chunks_exact_mut(8);
    // SAFETY: the caller runs with AVX2; loads read 8 floats of a full chunk,
    // stores write the 8 bytes of the matching output chunk.
    unsafe {
        let s = _mm256_set1_ps(scale);
        let clip = clip_lanes(clip);
        for (c, o) in (&mut xc).zip(&mut oc) {
            let q = quant8(_mm256_loadu_ps(c.as_ptr()), s, clip);
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
        *o = quantize_one(v, scale, clip);
    }
}

/// Bits of max |x| (see `Kernels::absmax_bits`); with `AHEAD`, a line of
/// `ahead` prefetched for every 16 values read (the same rate). Two
/// instances, so `absmax_bits` carries no idle prefetch branch (blockwise
/// through this loop: 0.97-1.0x the previous crate's time, its old-vs-old
/// control 0.96-1.01x).
#[inline(always)]
unsafe fn absmax_run<const AHEAD: bool>(x: &[f32], ahead: &[f32]) -> u32 {
    let mut ahead = Lines::new(ahead);
    let mut chunks = x.chunks_exact(16);
    // SAFETY: the caller runs with AVX2; loads read full chunks of `x`;
    // prefetches only name addresses inside `ahead`.
    let m = unsafe {
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for c in &mut chunks {
            if AHEAD {
                ahead.one();
            }
            let v0 = _mm256_loadu_si256(c.as_ptr().cast());
            let v1 = _mm256_loadu_si256(c.as_ptr().add(8).cast());
            a0 = _mm256_max_epu32(a0, _mm256_and_si256(v0, abs));
            a1 = _mm256_max_epu32(a1, _mm256_and_si256(v1, abs));
        }
        hmax_epu32(_mm256_max_epu32(a0, a1))
    };
    // SAFETY: the scalar kernels need no CPU features.
    m.max(unsafe { Scalar::absmax_bits(chunks.remainder()) })
}

/// The [`Affine`] parameters broadcast to lanes.
struct AffineLanes {
    inv: __m256d,
    zp: __m256d,
    qmin: __m256d,
    qmax: __m256d,
}

impl AffineLanes {
    #[inline(always)]
    unsafe fn new(a: Affine) -> Self {
        // SAFETY: the caller runs with AVX2.
        unsafe {
            AffineLanes {
                inv: _mm256_set1_pd(a.inv),
                zp: _mm256_set1_pd(a.zp),
                qmin: _mm256_set1_pd(a.qmin),
                qmax: _mm256_set1_pd(a.qmax),
            }
        }
    }
}

/// Affine codes of 4 f64 lanes as i32 lanes, exactly as `scalar::affine_one`
/// (multiply, then add, never fused; round half away from zero; clamp).
#[inline(always)]
unsafe fn affine4(v: __m256d, a: &AffineLanes) -> __m128i {
    // SAFETY: the caller runs with AVX2.
    unsafe {
        let y = _mm256_add_pd(_mm256_mul_pd(v, a.inv), a.zp);
        let t = _mm256_round_pd::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        let abs = _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MAX));
        let frac = _mm256_and_pd(_mm256_sub_pd(y, t), abs);
        let up = _mm256_cmp_pd::<_CMP_GE_OQ>(frac, _mm256_set1_pd(0.5));
        let sign = _mm256_and_pd(y, _mm256_castsi256_pd(_mm256_set1_epi64x(i64::MIN)));
        let step = _mm256_and_pd(_mm256_or_pd(sign, _mm256_set1_pd(1.0)), up);
        let r = _mm256_add_pd(t, step);
        let c = _mm256_min_pd(_mm256_max_pd(r, a.qmin), a.qmax);
        _mm256_cvttpd_epi32(c)
    }
}

/// The f32 shortcut's lanes (see [`Affine::f32_shortcut`]), when it applies.
struct FastLanes {
    /// Whether the range check can fire (`!Affine::f32_in_range`).
    range: bool,
    /// Whether a code can leave `[qmin, qmax]` (`!Affine::f32_within_codes`).
    clamp: bool,
    /// Whether the zero point is 0 (every symmetric map): `m + 0 = m` for
    /// every `m` but -0, whose code is 0 as well, so the add is left out.
    zero: bool,
    inv: __m256,
    zp: __m256,
    /// `F32_FAST_LIMIT`'s bits: `|m|`'s bits above them fail the range check.
    lim: __m256i,
    /// `F32_FAST_MARGIN`'s bits: `|y - rne(y)|`'s bits above them flag a lane.
    margin: __m256i,
    /// `qmin` and `qmax` as bytes.
    qmin: __m256i,
    qmax: __m256i,
}

impl FastLanes {
    #[inline(always)]
    unsafe fn new(a: Affine) -> Option<Self> {
        let (inv, zp) = a.f32_shortcut()?;
        // SAFETY: the caller runs with AVX2.
        unsafe {
            Some(FastLanes {
                range: !a.f32_in_range(),
                clamp: !a.f32_within_codes(),
                zero: zp == 0.0,
                inv: _mm256_set1_ps(inv),
                zp: _mm256_set1_ps(zp),
                lim: _mm256_set1_epi32(F32_FAST_LIMIT.to_bits() as i32),
                margin: _mm256_set1_epi32(F32_FAST_MARGIN.to_bits() as i32),
                qmin: _mm256_set1_epi8(a.qmin as i8),
                qmax: _mm256_set1_epi8(a.qmax as i8),
            })
        }
    }
}

/// The shortcut for 8 f32 lanes: `rne(y)` with `y = fl32(fl32(v·inv) + zp)` as
/// i32 lanes (MXCSR's default rounding; kernels run in the default
/// environment, see `fpenv`), the bits of `|y - rne(y)|` (exact: `rne(y)` is
/// an integer within 0.5 of `y`), and the bits of `|v·inv|`. Non-negative
/// floats order as their bits do, and a NaN's or infinity's bits exceed
/// every finite bound, so the caller compares the largest bits of several
/// vectors (`vpmaxud`) once.
#[inline(always)]
unsafe fn affine8_fast<const ZP: bool>(v: __m256, f: &FastLanes) -> (__m256i, __m256i, __m256i) {
    // SAFETY: the caller runs with AVX2.
    unsafe {
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let m = _mm256_mul_ps(v, f.inv);
        let y = if ZP { _mm256_add_ps(m, f.zp) } else { m };
        let q = _mm256_cvtps_epi32(y);
        let e = _mm256_sub_ps(y, _mm256_cvtepi32_ps(q));
        let e = _mm256_and_si256(_mm256_castps_si256(e), abs);
        (q, e, _mm256_and_si256(_mm256_castps_si256(m), abs))
    }
}

/// 32 affine codes of the floats at `x` as bytes in order, exactly as
/// `scalar::affine_one`: the f32 shortcut when no lane of the 32 is near a
/// half-integer or (with `RANGE`) out of its range, else the f64 form.
///
/// The shortcut's code is `rne(y)`, which is the seed's code whenever `y` is
/// at most `F32_FAST_MARGIN` from an integer (see `F32_FAST_LIMIT`); a tie
/// is 0.5 away, so flagged. Codes are narrowed with saturation, which keeps
/// their order, so clamping the bytes to `[qmin, qmax]` (with `CLAMP`)
/// equals clamping the integers. `RANGE = false` / `CLAMP = false` leave out
/// checks the map's bound proves idle (`Affine::f32_in_range`,
/// `Affine::f32_within_codes`); `ZP = false` leaves out the add of a zero
/// point that is 0 (`FastLanes::zero`).
#[inline(always)]
unsafe fn affine32<const RANGE: bool, const CLAMP: bool, const ZP: bool>(
    x: *const f32,
    l: &AffineLanes,
    f: Option<&FastLanes>,
) -> __m256i {
    // SAFETY: the caller guarantees 32 readable floats at `x` and AVX2.
    unsafe {
        if let Some(f) = f {
            let (a, ea, ma) = affine8_fast::<ZP>(_mm256_loadu_ps(x), f);
            let (b, eb, mb) = affine8_fast::<ZP>(_mm256_loadu_ps(x.add(8)), f);
            let (c, ec, mc) = affine8_fast::<ZP>(_mm256_loadu_ps(x.add(16)), f);
            let (d, ed, md) = affine8_fast::<ZP>(_mm256_loadu_ps(x.add(24)), f);
            let e = _mm256_max_epu32(_mm256_max_epu32(ea, eb), _mm256_max_epu32(ec, ed));
            let mut flag = _mm256_cmpgt_epi32(e, f.margin);
            if RANGE {
                let m = _mm256_max_epu32(_mm256_max_epu32(ma, mb), _mm256_max_epu32(mc, md));
                flag = _mm256_or_si256(flag, _mm256_cmpgt_epi32(m, f.lim));
            }
            if _mm256_movemask_epi8(flag) == 0 {
                let q = pack32([a, b, c, d]);
                return if CLAMP {
                    _mm256_min_epi8(_mm256_max_epi8(q, f.qmin), f.qmax)
                } else {
                    q
                };
            }
        }
        affine32_f64(x, l)
    }
}

/// 32 affine codes of the floats at `x` as bytes in order, in the f64 form
/// (`affine4`): the shortcut's fallback, out of the loop's way.
#[cold]
#[inline(never)]
#[target_feature(enable = "avx2")]
unsafe fn affine32_f64(x: *const f32, l: &AffineLanes) -> __m256i {
    let four = |i: usize| {
        // SAFETY: the caller guarantees 32 readable floats at `x`; AVX2 is
        // enabled for this function.
        unsafe { affine4(_mm256_cvtps_pd(_mm_loadu_ps(x.add(4 * i))), l) }
    };
    let q = |i: usize| _mm256_set_m128i(four(2 * i + 1), four(2 * i));
    // SAFETY: AVX2 is enabled for this function.
    unsafe { pack32([q(0), q(1), q(2), q(3)]) }
}

/// Runs the instance of an affine run (`RANGE`, `CLAMP`, `ZP`) that the
/// shortcut's lanes call for: the checks the map's bound proves idle left
/// out, the add of a zero zero point too; no shortcut takes every check (the
/// f64 form, where they do not matter).
macro_rules! shortcut_instance {
    ($run:ident, $fast:expr, $($arg:expr),*) => {
        match $fast.map(|f| (f.range, f.clamp, f.zero)) {
            Some((false, false, true)) => $run::<false, false, false>($($arg),*),
            Some((false, false, false)) => $run::<false, false, true>($($arg),*),
            Some((false, true, _)) => $run::<false, true, true>($($arg),*),
            _ => $run::<true, true, true>($($arg),*),
        }
    };
}

/// The range of a row gathered 32 floats a step ([`Beside`]), the rest by
/// [`RowRange::finish`]; `MAG`: only max |x|, all a symmetric scale reads.
struct RowRange<'a, const MAG: bool> {
    x: &'a [f32],
    /// Floats read so far (a multiple of 32).
    done: usize,
    lo: __m256,
    hi: __m256,
    /// Max of the bits of |x|: at least `F32_INF_BITS` iff a NaN or an
    /// infinity was read.
    bits: __m256i,
}

impl<'a, const MAG: bool> RowRange<'a, MAG> {
    /// # Safety
    /// AVX2 must be available.
    #[inline(always)]
    unsafe fn new(x: &'a [f32]) -> Self {
        // SAFETY: per this function's contract.
        unsafe {
            RowRange {
                x,
                done: 0,
                lo: _mm256_set1_ps(f32::INFINITY),
                hi: _mm256_set1_ps(f32::NEG_INFINITY),
                bits: _mm256_setzero_si256(),
            }
        }
    }

    /// The range of the whole row: what the steps gathered merged with the
    /// rest's (`range_f32`, or for `MAG` `(-m, m)` from `absmax_bits`).
    ///
    /// # Safety
    /// AVX2 must be available.
    #[inline(always)]
    unsafe fn finish(self) -> Range<f32> {
        // SAFETY: per this function's contract; register reductions, and the
        // rest is read by primitives that keep their own contracts.
        unsafe {
            let rest = &self.x[self.done..];
            let bits = hmax_epu32(self.bits);
            if MAG {
                return super::kernels::magnitude(bits.max(Avx2::absmax_bits(rest)));
            }
            let (min, max) = reduce_pd(
                _mm256_min_pd(
                    _mm256_cvtps_pd(_mm256_castps256_ps128(self.lo)),
                    _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(self.lo)),
                ),
                _mm256_max_pd(
                    _mm256_cvtps_pd(_mm256_castps256_ps128(self.hi)),
                    _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(self.hi)),
                ),
            );
            let gathered = Range {
                min: min as f32,
                max: max as f32,
                non_finite: bits >= super::F32_INF_BITS,
            };
            gathered.merge(Avx2::range_f32(rest))
        }
    }
}

impl<const MAG: bool> Beside for RowRange<'_, MAG> {
    #[inline(always)]
    fn more(&self) -> bool {
        self.x.len() - self.done >= 32
    }
    #[inline(always)]
    unsafe fn step(&mut self) {
        // SAFETY: `more()` held, so 32 floats are readable at `done`; AVX2 per
        // this function's contract. As in `range_f32`, the value goes first:
        // vminps/vmaxps return their second operand for a NaN, so a NaN
        // leaves the lane as it was (and shows in `bits`).
        unsafe {
            let p = self.x.as_ptr().add(self.done);
            let abs = _mm256_set1_epi32(0x7fff_ffff);
            for k in 0..4 {
                let v = _mm256_loadu_ps(p.add(8 * k));
                let b = _mm256_and_si256(_mm256_castps_si256(v), abs);
                self.bits = _mm256_max_epu32(self.bits, b);
                if !MAG {
                    self.lo = _mm256_min_ps(v, self.lo);
                    self.hi = _mm256_max_ps(v, self.hi);
                }
            }
            self.done += 32;
        }
    }
}

/// The full 32-value chunks of an affine int8 run: codes narrowed in
/// registers and stored 32 at a time, two lines of `ahead` prefetched and
/// `beside` read a chunk.
#[inline(always)]
unsafe fn affine32_run<const RANGE: bool, const CLAMP: bool, const ZP: bool>(
    xc: &mut std::slice::ChunksExact<'_, f32>,
    oc: &mut std::slice::ChunksExactMut<'_, i8>,
    l: &AffineLanes,
    f: Option<&FastLanes>,
    ahead: &mut Lines,
    beside: &mut impl Beside,
) {
    // SAFETY: AVX2 per the caller; 32 floats read and 32 bytes written per
    // chunk (the iterators' own); prefetches only name addresses inside
    // `ahead`; `beside` steps only while `more()`.
    unsafe {
        for (c, o) in xc.zip(oc) {
            ahead.two();
            if beside.more() {
                beside.step();
            }
            let b = affine32::<RANGE, CLAMP, ZP>(c.as_ptr(), l, f);
            _mm256_storeu_si256(o.as_mut_ptr().cast(), b);
        }
    }
}

/// The full 32-value chunks of an affine int4 run: codes narrowed in
/// registers, paired into bytes by `maddubs` and stored 16 bytes at a time,
/// two lines of `ahead` prefetched a chunk. (No fused variant: reading the
/// next row's range beside it ran int4 per channel 2-5 % slower on this
/// tier, 4096 x 4096 on Zen 4 capped to AVX2, where int8 gained 2-6 %.)
#[inline(always)]
unsafe fn int4_32_run<const RANGE: bool, const CLAMP: bool, const ZP: bool>(
    xc: &mut std::slice::ChunksExact<'_, f32>,
    oc: &mut std::slice::ChunksExactMut<'_, u8>,
    l: &AffineLanes,
    f: Option<&FastLanes>,
    ahead: &mut Lines,
) {
    // SAFETY: AVX2 per the caller; 32 floats read and 16 bytes written per
    // chunk (the iterators' own). packus is exact (every 16-bit lane is at
    // most 0xff). Prefetches only name addresses inside `ahead`.
    unsafe {
        let low = _mm256_set1_epi8(0x0f);
        // (even & 15) + 16·(odd & 15) in each 16-bit lane.
        let weights = _mm256_set1_epi16(0x1001);
        for (c, o) in xc.zip(oc) {
            ahead.two();
            let b = affine32::<RANGE, CLAMP, ZP>(c.as_ptr(), l, f);
            let pairs = _mm256_maddubs_epi16(_mm256_and_si256(b, low), weights);
            let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(pairs, pairs));
            _mm_storeu_si128(o.as_mut_ptr().cast(), _mm256_castsi256_si128(p));
        }
    }
}

/// `affine_quantize_f32_ahead` with `beside` read alongside the full
/// 32-value chunks (see [`Beside`]).
///
/// # Safety
/// AVX2 must be available.
#[inline(always)]
unsafe fn affine_codes_beside(
    x: &[f32],
    a: Affine,
    out: &mut [i8],
    store: Store,
    ahead: &[f32],
    beside: &mut impl Beside,
) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    let mut ahead = Lines::new(ahead);
    let mut xc = x.chunks_exact(32);
    let mut oc = out.chunks_exact_mut(32);
    // SAFETY: AVX2 per this function's contract; 32 floats read and 32 bytes
    // written per full chunk, 8 and 8 per tail chunk. The saturating packs
    // are exact: codes are already within i8. Prefetches only name
    // addresses inside `ahead` (two lines for every 32 values coded: the
    // same rate).
    unsafe {
        let l = AffineLanes::new(a);
        let fast = FastLanes::new(a);
        let f = fast.as_ref();
        let (xs, os) = (&mut xc, &mut oc);
        shortcut_instance!(affine32_run, f, xs, os, &l, f, &mut ahead, beside);
        ahead.rest();
        let (x, out) = (xc.remainder(), oc.into_remainder());
        let mut xc = x.chunks_exact(8);
        let mut oc = out.chunks_exact_mut(8);
        // A tail under 32 values: the f64 form, 8 lanes at a time.
        for (c, o) in (&mut xc).zip(&mut oc) {
            let lo = affine4(_mm256_cvtps_pd(_mm_loadu_ps(c.as_ptr())), &l);
            let hi = affine4(_mm256_cvtps_pd(_mm_loadu_ps(c.as_ptr().add(4))), &l);
            store8(lo, hi, o.as_mut_ptr());
        }
        // SAFETY: the scalar kernels need no CPU features.
        Scalar::affine_quantize_f32(xc.remainder(), a, oc.into_remainder(), store);
    }
}

/// 8 i32 codes (two halves of 4) to 8 bytes, stored at `out`.
#[inline(always)]
unsafe fn store8(lo: __m128i, hi: __m128i, out: *mut i8) {
    // SAFETY: the caller runs with AVX2 and `out` has 8 writable bytes. The
    // saturating packs are exact: codes are already within i8.
    unsafe {
        let w = _mm_packs_epi32(lo, hi);
        _mm_storel_epi64(out.cast(), _mm_packs_epi16(w, w));
    }
}

/// `(q - zp) * scale` for 8 int8 codes (in the low 8 bytes), as two vectors of 4 f64.
#[inline(always)]
unsafe fn affine_values8(b: __m128i, zp: __m256d, scale: __m256d) -> (__m256d, __m256d) {
    // SAFETY: the caller runs with AVX2.
    unsafe {
        let q = _mm256_cvtepi8_epi32(b);
        let lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(q));
        let hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256::<1>(q));
        (
            _mm256_mul_pd(_mm256_sub_pd(lo, zp), scale),
            _mm256_mul_pd(_mm256_sub_pd(hi, zp), scale),
        )
    }
}

/// `1.5 · 2^52` as bits: adding a small integer `k` (as i64) to these bits
/// gives the double `1.5 · 2^52 + k` exactly (the mantissa's ulp there is 1).
const MAGIC_BITS: i64 = 0x4338_0000_0000_0000;

/// `zp` as `1.5 · 2^52 + zp`, if that is exact and `(1.5 · 2^52 + q) − it`
/// is `q − zp` exactly for every int8 `q`: `zp` an integer below 2^40 in
/// magnitude (both operands are then integers below 2^53 whose difference
/// is too). Otherwise `None` (a non-integer or huge zero point).
#[inline(always)]
fn magic_zero_point(zp: f64) -> Option<f64> {
    (zp.trunc() == zp && zp.abs() < (1u64 << 40) as f64).then_some(1.5 * (1u64 << 52) as f64 + zp)
}

/// `(q − zp) · scale` for the 4 int8 codes in the 4 bytes at `q`, without
/// converting: each code sign-extended to 64 bits and added to
/// [`MAGIC_BITS`] is the double `1.5 · 2^52 + q`, and subtracting `bias`
/// (`magic_zero_point(zp)`) leaves `q − zp` exactly; one rounding, the
/// product's, as in `(q as f64 − zp) · scale`. Integer adds and a float
/// subtract replace `vcvtdq2pd`, which (like `vcvtpd2ps`) retires one a
/// cycle on Zen 3, where the two were the loop's limit.
#[inline(always)]
unsafe fn affine_values4_magic(q: *const i8, bias: __m256d, scale: __m256d) -> __m256d {
    // SAFETY: the caller guarantees 4 bytes at `q` and AVX2.
    unsafe {
        let b = _mm_cvtsi32_si128(q.cast::<i32>().read_unaligned());
        let m = _mm256_add_epi64(_mm256_cvtepi8_epi64(b), _mm256_set1_epi64x(MAGIC_BITS));
        _mm256_mul_pd(_mm256_sub_pd(_mm256_castsi256_pd(m), bias), scale)
    }
}

/// [`affine_values8`] rounded to f32 (nearest even, as `as f32`), in order.
#[inline(always)]
unsafe fn affine_floats8(b: __m128i, zp: __m256d, scale: __m256d) -> __m256 {
    // SAFETY: the caller runs with AVX2.
    unsafe {
        let (lo, hi) = affine_values8(b, zp, scale);
        _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo))
    }
}

/// Horizontal min and max of two f64 accumulators.
#[inline(always)]
unsafe fn reduce_pd(lo: __m256d, hi: __m256d) -> (f64, f64) {
    let (mut a, mut b) = ([0f64; 4], [0f64; 4]);
    // SAFETY: the caller runs with AVX2; stores write 4 doubles each.
    unsafe {
        _mm256_storeu_pd(a.as_mut_ptr(), lo);
        _mm256_storeu_pd(b.as_mut_ptr(), hi);
    }
    let min = a
        .iter()
        .copied()
        .fold(f64::INFINITY, |m, v| if v < m { v } else { m });
    let max = b
        .iter()
        .copied()
        .fold(f64::NEG_INFINITY, |m, v| if v > m { v } else { m });
    (min, max)
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

/// Exact dot products of `R` rows of `w` (stride `k`) with one token `a`:
/// `vpmaddwd` on sign-extended 16-byte steps (pairs of products in i32
/// lanes), lanes widened to i64 after every `DOT_CHUNK`, the `k % 16` tail
/// in scalar.
#[inline(always)]
unsafe fn dots_rows<const R: usize>(
    w: &[i8],
    a: &[i8],
    k: usize,
    ahead: Option<*const i8>,
) -> [i64; R] {
    let mut total = [0i64; R];
    let body = k - k % 16;
    // SAFETY: AVX2 per the Kernels contract; every load reads 16 bytes at
    // `i < body <= k` of a row of `w` (R rows of k) or of `a` (k bytes);
    // prefetches (of the caller's rows `ahead`, R rows of k) never fault.
    unsafe {
        let mut start = 0;
        while start < body {
            let end = (start + scalar::DOT_CHUNK).min(body);
            let mut acc = [_mm256_setzero_si256(); R];
            let mut i = start;
            while i < end {
                if let (Some(p), 0) = (ahead, i % 64) {
                    for r in 0..R {
                        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(r * k + i).cast());
                    }
                }
                let av = _mm256_cvtepi8_epi16(_mm_loadu_si128(a.as_ptr().add(i).cast()));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let p = w.as_ptr().add(r * k + i);
                    let wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast()));
                    *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(wv, av));
                }
                i += 16;
            }
            for (t, acc) in total.iter_mut().zip(acc) {
                let lo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc));
                let hi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256::<1>(acc));
                let s = _mm256_add_epi64(lo, hi);
                let mut lanes = [0i64; 4];
                _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s);
                *t += lanes.iter().sum::<i64>();
            }
            start = end;
        }
    }
    for (r, t) in total.iter_mut().enumerate() {
        *t += scalar::i8_dot(&w[r * k + body..(r + 1) * k], &a[body..k]);
    }
    total
}

/// Tokens in one packed group of the outer-product kernel (two vectors).
const GROUP: usize = 16;
/// Weight rows one outer-product tile takes: 12 accumulators, two token
/// vectors and a broadcast fill 15 of the 16 registers.
const TILE: usize = 6;
/// Pairs of products an i32 lane sums before it is widened (`DOT_CHUNK`
/// products: exact for any bytes).
const CHUNK_PAIRS: usize = scalar::DOT_CHUNK / 2;

/// Tokens packed for [`outer_block`]: for group `g` of 16 tokens and pair
/// `p` of positions `2p, 2p + 1`, 16 words at `(g·kp + p)·16`, word `t`
/// holding token `16g + t`'s two codes as i16 (position `2p` low). Missing
/// tokens and the partner of an odd `k`'s last position are 0. `None` when
/// the buffer cannot be allocated.
fn pack_pairs(a: &[i8], k: usize) -> Option<Vec<u32>> {
    let (tokens, kp) = (a.len() / k, k.div_ceil(2));
    let groups = tokens.div_ceil(GROUP);
    let len = groups.checked_mul(kp)?.checked_mul(GROUP)?;
    let mut out = super::kernels::spare_words();
    out.try_reserve_exact(len).ok()?;
    out.resize(len, 0u32);
    for (t, at) in a.chunks_exact(k).enumerate() {
        let (g, lane) = (t / GROUP, t % GROUP);
        let dst = &mut out[g * kp * GROUP..(g + 1) * kp * GROUP];
        for (p, pair) in at.chunks(2).enumerate() {
            let lo = pair[0] as i16 as u16 as u32;
            let hi = pair.get(1).map_or(0, |&b| b as i16 as u16 as u32);
            dst[p * GROUP + lane] = lo | hi << 16;
        }
    }
    Some(out)
}

/// Pairs in one block of k: a tile's widened block (6 KiB) stays in L1
/// while every token group's slice (16 KiB) streams past it.
const BLOCK_PAIRS: usize = 256;

/// `R` weight rows (stride `k`) widened for [`outer_block`]: row `r`'s
/// `kp = ceil(k / 2)` pairs at `r·kp`, each word two i16 codes (position
/// `2p` low, an odd `k`'s missing partner 0). Whole rows: read in order,
/// the weight streams from memory at full speed.
#[inline(always)]
unsafe fn widen_rows<const R: usize>(w: &[i8], k: usize, out: &mut [u32]) {
    let kp = k.div_ceil(2);
    for r in 0..R {
        let row = &w[r * k..(r + 1) * k];
        let dst = &mut out[r * kp..(r + 1) * kp];
        let body = row.len() - row.len() % 16;
        // SAFETY: AVX2 per the caller; each load reads 16 bytes of `row`
        // below `body`, each store 8 words of `dst` below `body / 2 <= n`.
        unsafe {
            let mut i = 0;
            while i < body {
                let v = _mm256_cvtepi8_epi16(_mm_loadu_si128(row.as_ptr().add(i).cast()));
                _mm256_storeu_si256(dst.as_mut_ptr().add(i / 2).cast(), v);
                i += 16;
            }
        }
        for (p, pair) in row[body..].chunks(2).enumerate() {
            let lo = pair[0] as i16 as u16 as u32;
            let hi = pair.get(1).map_or(0, |&b| b as i16 as u16 as u32);
            dst[body / 2 + p] = lo | hi << 16;
        }
    }
}

/// Pair `p` of [`outer_block`] (a function, not a closure: closures do not
/// inherit the caller's target features).
#[inline(always)]
unsafe fn outer_step<const R: usize>(
    v: &mut [[__m256i; 2]; R],
    wp: *const u32,
    kp: usize,
    tq: *const u32,
    p: usize,
) {
    // SAFETY: AVX2 and the bounds per `outer_block`.
    unsafe {
        let t0 = _mm256_loadu_si256(tq.add(p * GROUP).cast());
        let t1 = _mm256_loadu_si256(tq.add(p * GROUP + 8).cast());
        for (r, v) in v.iter_mut().enumerate() {
            let b = _mm256_set1_epi32(*wp.add(r * kp + p) as i32);
            v[0] = _mm256_add_epi32(v[0], _mm256_madd_epi16(b, t0));
            v[1] = _mm256_add_epi32(v[1], _mm256_madd_epi16(b, t1));
        }
    }
}

/// `n` pairs of `R` widened rows (`wb`, row `r` at `r·kp`) against one
/// packed group's slice (`tp`, 16 words a pair), added to the i32 sums `acc`
/// (`[r][t]`): `vpmaddwd` of a row's broadcast pair against two vectors of
/// token pairs. The caller widens the sums before they can overflow.
#[inline(always)]
unsafe fn outer_block<const R: usize>(
    wb: &[u32],
    kp: usize,
    tp: &[u32],
    n: usize,
    acc: &mut [[i32; GROUP]; R],
) {
    assert!(n <= kp && wb.len() >= (R - 1) * kp + n && tp.len() >= n * GROUP);
    let (wp, tq) = (wb.as_ptr(), tp.as_ptr());
    // SAFETY: AVX2 per the caller; pair `p < n` reads word `r·kp + p` of `wb`
    // and words `16p..16p + 16` of `tp`, inside both (asserted); `acc` is R
    // rows of 16 i32.
    unsafe {
        let mut v = [[_mm256_setzero_si256(); 2]; R];
        for (v, a) in v.iter_mut().zip(acc.iter()) {
            v[0] = _mm256_loadu_si256(a.as_ptr().cast());
            v[1] = _mm256_loadu_si256(a.as_ptr().add(8).cast());
        }
        for p in 0..n {
            outer_step::<R>(&mut v, wp, kp, tq, p);
        }
        for (v, a) in v.iter().zip(acc.iter_mut()) {
            _mm256_storeu_si256(a.as_mut_ptr().cast(), v[0]);
            _mm256_storeu_si256(a.as_mut_ptr().add(8).cast(), v[1]);
        }
    }
}

/// The exact sums of `R` rows (stride `k`) with every packed group, `[g][r][t]`
/// into `tot`: block by block of k, the rows widened once a block, i32 sums
/// widened to i64 before [`CHUNK_PAIRS`] pairs.
#[inline(always)]
unsafe fn outer_rows<const R: usize>(
    w: &[i8],
    k: usize,
    packed: &[u32],
    wb: &mut [u32],
    acc: &mut Vec<[[i32; GROUP]; R]>,
    tot: &mut Vec<[[i64; GROUP]; R]>,
) {
    let kp = k.div_ceil(2);
    let groups = packed.len() / (kp * GROUP);
    // Within the capacity the caller reserved: no allocation.
    acc.clear();
    acc.resize(groups, [[0; GROUP]; R]);
    tot.clear();
    tot.resize(groups, [[0; GROUP]; R]);
    // SAFETY: AVX2 per the caller; the rows lie inside `w`.
    unsafe { widen_rows::<R>(w, k, wb) };
    let mut pending = 0;
    let mut p0 = 0;
    while p0 < kp {
        let n = BLOCK_PAIRS.min(kp - p0);
        for (g, a) in acc.iter_mut().enumerate() {
            let tp = &packed[(g * kp + p0) * GROUP..(g * kp + p0 + n) * GROUP];
            // SAFETY: as above; `wb` holds the widened rows.
            unsafe { outer_block::<R>(&wb[p0..], kp, tp, n, a) };
        }
        pending += n;
        p0 += n;
        if pending + BLOCK_PAIRS > CHUNK_PAIRS || p0 == kp {
            for (t, a) in tot.iter_mut().zip(acc.iter_mut()) {
                for (tr, ar) in t.iter_mut().zip(a.iter_mut()) {
                    for (x, y) in tr.iter_mut().zip(ar.iter_mut()) {
                        *x += *y as i64;
                        *y = 0;
                    }
                }
            }
            pending = 0;
        }
    }
}

/// [`Kernels::i8_products`] by outer products over the tokens packed by
/// [`pack_pairs`]: tiles of rows against every group, rescaled. `false`
/// (nothing written) when a buffer cannot be allocated.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn outer_products(
    w: &[i8],
    packed: &[u32],
    tokens: usize,
    k: usize,
    w_scales: &[f32],
    a_scales: &[f32],
    out: &mut [f32],
    stride: usize,
) -> bool {
    let rows = w_scales.len().min(w.len() / k);
    let kp = k.div_ceil(2);
    let mut wb = Vec::new();
    if wb.try_reserve_exact(TILE * kp).is_err() {
        return false;
    }
    wb.resize(TILE * kp, 0u32);
    fn put<const R: usize>(
        out: &mut [f32],
        stride: usize,
        r0: usize,
        sums: &[[[i64; GROUP]; R]],
        w_scales: &[f32],
        a_scales: &[f32],
    ) {
        let tokens = a_scales.len();
        for (g, s) in sums.iter().enumerate() {
            for (j, s) in s.iter().enumerate() {
                let ws = w_scales[r0 + j];
                for (lane, &acc) in s.iter().enumerate() {
                    let t = g * GROUP + lane;
                    if t < tokens {
                        out[t * stride + r0 + j] = acc as f32 * ws * a_scales[t];
                    }
                }
            }
        }
    }
    let a_scales = &a_scales[..tokens];
    // The sums of every group, reserved here so that `outer_rows` never
    // allocates: a failure sends the call to the dot products instead.
    let groups = tokens.div_ceil(GROUP);
    let (mut acc, mut tot) = (Vec::new(), Vec::new());
    let (mut acc1, mut tot1) = (Vec::new(), Vec::new());
    if acc.try_reserve_exact(groups).is_err()
        || tot.try_reserve_exact(groups).is_err()
        || acc1.try_reserve_exact(groups).is_err()
        || tot1.try_reserve_exact(groups).is_err()
    {
        return false;
    }
    let mut r0 = 0;
    while r0 + TILE <= rows {
        // SAFETY: AVX2 per the caller; the tile's rows lie inside `w`.
        unsafe { outer_rows::<TILE>(&w[r0 * k..], k, packed, &mut wb, &mut acc, &mut tot) };
        put::<TILE>(out, stride, r0, &tot, w_scales, a_scales);
        r0 += TILE;
    }
    while r0 < rows {
        // SAFETY: as above, one row.
        unsafe { outer_rows::<1>(&w[r0 * k..], k, packed, &mut wb, &mut acc1, &mut tot1) };
        put::<1>(out, stride, r0, &tot1, w_scales, a_scales);
        r0 += 1;
    }
    true
}

/// 64 steps of the dequantizing dot product into eight 8-lane accumulators
/// (lanes 8j..8j+8), `d(i) = q[i] - zp` (the row's scale comes after the sum).
#[inline(always)]
unsafe fn dot64_i8<const ZP: bool>(q: *const i8, x: *const f32, zp: __m256, acc: &mut [__m256; 8]) {
    // SAFETY: the caller guarantees 64 codes at `q`, 64 floats at `x`, AVX2/FMA.
    unsafe {
        for (j, a) in acc.iter_mut().enumerate() {
            let c = _mm_loadl_epi64(q.add(8 * j).cast());
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
            // `ZP = false`: a zero point of ±0 (`q - 0 = q`, exact) is skipped.
            let d = if ZP { _mm256_sub_ps(v, zp) } else { v };
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8 * j)), d, *a);
        }
    }
}

/// How far ahead (bytes of weight) the row-streaming dot products prefetch
/// into L2, as on AVX-512: the hardware prefetcher alone left the weight
/// streaming at 8 GB/s on Zen 3, where NumPy's GEMV read at 19.
const PREFETCH_BYTES: usize = 32 * 1024;

/// The row about [`PREFETCH_BYTES`] after row `r` of rows `stride` bytes
/// apart in a slice of `len` bytes from `base`, if the slice holds all of it
/// (`n` bytes a row); prefetches stay inside the caller's data.
#[inline(always)]
fn row_ahead<T>(base: *const T, len: usize, stride: usize, r: usize, n: usize) -> Option<*const T> {
    let rows = PREFETCH_BYTES.div_ceil(stride.max(1));
    let at = (r + rows).checked_mul(stride)?;
    (at.checked_add(n)? <= len).then(|| base.wrapping_add(at))
}

/// As `dot64_i8` for the 128 int4 codes in 64 bytes at `p`, `xs` in
/// `nibble_planes` order: each half of the bytes read as eight 32-bit words
/// (words `8h..8h + 8` of the block), nibble `k` of every word is plane `k`,
/// lanes `8h..` of positions `16k..`, which go to accumulator `2(k % 4) + h`.
/// A nibble is sign-extended by moving it to the top bits and shifting it
/// down arithmetically; `ZP = false` skips subtracting a zero point of ±0
/// (exact: `n - 0 = n`). The vector units are the limit here, so every
/// operation a step saves counts (the row's scale comes after the sum).
#[inline(always)]
unsafe fn dot128_i4<const ZP: bool>(
    p: *const u8,
    xs: *const f32,
    zp: __m256,
    acc: &mut [__m256; 8],
) {
    // SAFETY: the caller guarantees 64 bytes at `p`, 128 floats at `xs`, AVX2/FMA.
    unsafe {
        for h in 0..2 {
            let w = _mm256_loadu_si256(p.add(32 * h).cast());
            let planes = [
                _mm256_srai_epi32::<28>(_mm256_slli_epi32::<28>(w)),
                _mm256_srai_epi32::<28>(_mm256_slli_epi32::<24>(w)),
                _mm256_srai_epi32::<28>(_mm256_slli_epi32::<20>(w)),
                _mm256_srai_epi32::<28>(_mm256_slli_epi32::<16>(w)),
                _mm256_srai_epi32::<28>(_mm256_slli_epi32::<12>(w)),
                _mm256_srai_epi32::<28>(_mm256_slli_epi32::<8>(w)),
                _mm256_srai_epi32::<28>(_mm256_slli_epi32::<4>(w)),
                _mm256_srai_epi32::<28>(w),
            ];
            for (k, n) in planes.into_iter().enumerate() {
                let v = _mm256_cvtepi32_ps(n);
                let d = if ZP { _mm256_sub_ps(v, zp) } else { v };
                let a = &mut acc[2 * (k % 4) + h];
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(xs.add(16 * k + 8 * h)), d, *a);
            }
        }
    }
}

/// The tree sum of 64 lanes held as eight 8-lane vectors.
#[inline(always)]
unsafe fn tree64(a: [__m256; 8]) -> f32 {
    // SAFETY: AVX per the caller.
    unsafe {
        let b = [
            _mm256_add_ps(a[0], a[4]),
            _mm256_add_ps(a[1], a[5]),
            _mm256_add_ps(a[2], a[6]),
            _mm256_add_ps(a[3], a[7]),
        ];
        let c0 = _mm256_add_ps(b[0], b[2]);
        let c1 = _mm256_add_ps(b[1], b[3]);
        super::avx512::tree8(_mm256_add_ps(c0, c1))
    }
}

/// One row of `dot_dequant_i8_rows`.
#[inline(always)]
unsafe fn dot_i8(q: &[i8], zp: f32, scale: f32, x: &[f32], ahead: Option<*const i8>) -> f32 {
    let n = x.len().min(q.len());
    let body = n - n % 64;
    // SAFETY: AVX2/FMA per the Kernels contract; full steps read inside
    // `q` and `x`; the tail runs on zero-padded copies; prefetches (of the
    // caller's row `ahead`, as long as this one) never fault.
    unsafe {
        let zpv = _mm256_set1_ps(zp);
        let mut acc = [_mm256_setzero_ps(); 8];
        for i in (0..body).step_by(64) {
            if let Some(a) = ahead {
                _mm_prefetch::<_MM_HINT_T1>(a.wrapping_add(i).cast());
            }
            if zp == 0.0 {
                dot64_i8::<false>(q.as_ptr().add(i), x.as_ptr().add(i), zpv, &mut acc);
            } else {
                dot64_i8::<true>(q.as_ptr().add(i), x.as_ptr().add(i), zpv, &mut acc);
            }
        }
        if body < n {
            let (mut qt, mut xt) = ([0i8; 64], [0f32; 64]);
            qt[..n - body].copy_from_slice(&q[body..n]);
            xt[..n - body].copy_from_slice(&x[body..n]);
            dot64_i8::<true>(qt.as_ptr(), xt.as_ptr(), zpv, &mut acc);
        }
        tree64(acc) * scale
    }
}

/// One row of `dot_dequant_i4_rows` (its bytes exactly).
#[inline(always)]
unsafe fn dot_i4(p: &[u8], zp: f32, scale: f32, xs: &[f32], ahead: Option<*const u8>) -> f32 {
    const BLOCK: usize = scalar::PLANE_BLOCK;
    let n = xs.len().min(2 * p.len());
    let body = n - n % BLOCK;
    // SAFETY: AVX2/FMA per the Kernels contract; a full step reads 64
    // bytes of `p` and 128 of `xs`, inside both; the tail runs on
    // zero-padded copies.
    unsafe {
        let zpv = _mm256_set1_ps(zp);
        let mut acc = [_mm256_setzero_ps(); 8];
        for i in (0..body).step_by(BLOCK) {
            if let Some(a) = ahead {
                _mm_prefetch::<_MM_HINT_T1>(a.wrapping_add(i / 2).cast());
            }
            if zp == 0.0 {
                dot128_i4::<false>(p.as_ptr().add(i / 2), xs.as_ptr().add(i), zpv, &mut acc);
            } else {
                dot128_i4::<true>(p.as_ptr().add(i / 2), xs.as_ptr().add(i), zpv, &mut acc);
            }
        }
        let rest = xs.len().min(body + BLOCK) - body;
        if rest > 0 && body < 2 * p.len() {
            let (mut pt, mut xt) = ([0u8; BLOCK / 2], [0f32; BLOCK]);
            let bytes = (p.len() - body / 2).min(BLOCK / 2);
            pt[..bytes].copy_from_slice(&p[body / 2..body / 2 + bytes]);
            for (k, v) in xt[..rest].iter_mut().enumerate() {
                if scalar::plane_element(body + k) / 2 < p.len() {
                    *v = xs[body + k];
                }
            }
            dot128_i4::<true>(pt.as_ptr(), xt.as_ptr(), zpv, &mut acc);
        }
        tree64(acc) * scale
    }
}

/// `LEFT_PACK[m]`: the lanes set in the 8-bit mask `m`, in order, then zeros
/// (a `vpermd` index that moves the selected lanes to the front).
static LEFT_PACK: [[u32; 8]; 256] = {
    let mut t = [[0u32; 8]; 256];
    let mut m = 0;
    while m < 256 {
        let (mut lane, mut k) = (0, 0);
        while lane < 8 {
            if m & (1 << lane) != 0 {
                t[m][k] = lane as u32;
                k += 1;
            }
            lane += 1;
        }
        m += 1;
    }
    t
};

impl Kernels for Avx2 {
    #[inline(always)]
    unsafe fn dot_dequant_i8_rows(
        q: &[i8],
        stride: usize,
        zps: &[f32],
        scales: &[f32],
        x: &[f32],
        out: &mut [f32],
    ) {
        for (r, (o, (&zp, &s))) in out.iter_mut().zip(zps.iter().zip(scales)).enumerate() {
            let ahead = row_ahead(q.as_ptr(), q.len(), stride, r, x.len());
            // SAFETY: forwarded from this function's contract.
            *o = unsafe { dot_i8(&q[r * stride..r * stride + x.len()], zp, s, x, ahead) };
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
        for (r, (o, (&zp, &s))) in out.iter_mut().zip(zps.iter().zip(scales)).enumerate() {
            let row = &p[r * stride..r * stride + n.div_ceil(2)];
            let ahead = row_ahead(p.as_ptr(), p.len(), stride, r, row.len());
            // SAFETY: forwarded from this function's contract.
            *o = unsafe { dot_i4(row, zp, s, xs, ahead) };
        }
    }

    #[inline(always)]
    unsafe fn i8_dots(w: &[i8], rows: usize, a: &[i8], k: usize, out: &mut [i64]) {
        let (rows, tokens) = (rows.min(w.len() / k), a.len() / k);
        for (t, at) in a.chunks_exact(k).enumerate() {
            let mut r = 0;
            while r + 4 <= rows {
                // The rows about 32 KiB on (of `w`, which may run past `rows`).
                let ahead = row_ahead(w.as_ptr(), w.len(), k, r, 4 * k);
                // SAFETY: forwarded from this function's contract.
                let d = unsafe { dots_rows::<4>(&w[r * k..(r + 4) * k], at, k, ahead) };
                for (j, v) in d.into_iter().enumerate() {
                    out[(r + j) * tokens + t] = v;
                }
                r += 4;
            }
            while r < rows {
                // SAFETY: as above.
                let d = unsafe { dots_rows::<1>(&w[r * k..(r + 1) * k], at, k, None) };
                out[r * tokens + t] = d[0];
                r += 1;
            }
        }
    }

    const PACKS: Option<Isa> = Some(Isa::Avx2);

    #[inline(always)]
    unsafe fn pack_tokens(a: &[i8], k: usize) -> Option<Vec<u32>> {
        pack_pairs(a, k)
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
        let (k, tokens) = (p.k, p.tokens());
        if k == 0 {
            return; // as Kernels::i8_products: nothing for zero-width tokens
        }
        let rows = w_scales.len().min(w.len() / k);
        if let Some(packed) = p.packed_by(Self::PACKS) {
            // SAFETY: AVX2 per the Kernels contract; outputs are written
            // through bounds-checked indexing.
            if rows <= stride
                && unsafe { outer_products(w, packed, tokens, k, w_scales, a_scales, out, stride) }
            {
                return;
            }
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { products_via_dots::<Self>(w, p.codes, k, w_scales, a_scales, out, stride) }
    }

    #[inline(always)]
    unsafe fn absmax_bits(x: &[f32]) -> u32 {
        // SAFETY: AVX2 per the Kernels contract.
        unsafe { absmax_run::<false>(x, &[]) }
    }

    #[inline(always)]
    unsafe fn absmax_bits_ahead(x: &[f32], ahead: &[f32]) -> u32 {
        // SAFETY: AVX2 per the Kernels contract.
        unsafe { absmax_run::<true>(x, ahead) }
    }

    /// Blocks of 32, 64 or 128 (others: none done), in batches of eight (see
    /// [`blocks_batched`]).
    #[inline(always)]
    unsafe fn absmax_blocks_batched(
        x: &[f32],
        block: usize,
        rule: AbsmaxRule,
        codes: &mut [i8],
        scales: &mut [f32],
        store: Store,
    ) -> usize {
        let _ = store;
        // SAFETY: forwarded from this function's contract.
        unsafe {
            match block {
                32 => blocks_batched::<32>(x, rule, codes, scales),
                64 => blocks_batched::<64>(x, rule, codes, scales),
                128 => blocks_batched::<128>(x, rule, codes, scales),
                _ => 0,
            }
        }
    }

    #[inline(always)]
    unsafe fn shifted_moments(x: &[f32], k: f64) -> (f64, f64) {
        let mut xc = x.chunks_exact(16);
        let (mut l1, mut l2) = ([0f64; 16], [0f64; 16]);
        // SAFETY: AVX2 per the Kernels contract; loads read full chunks of `x`
        // and the stores write the two 16-lane arrays. Accumulator `j` holds
        // lanes 4j..4j + 4 of the scalar order (value i goes to lane i % 16).
        unsafe {
            let kk = _mm256_set1_pd(k);
            let mut a = [_mm256_setzero_pd(); 4];
            let mut b = [_mm256_setzero_pd(); 4];
            for c in &mut xc {
                let v0 = _mm256_loadu_ps(c.as_ptr());
                let v1 = _mm256_loadu_ps(c.as_ptr().add(8));
                let d = [
                    _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v0)), kk),
                    _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v0)), kk),
                    _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v1)), kk),
                    _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v1)), kk),
                ];
                for j in 0..4 {
                    a[j] = _mm256_add_pd(a[j], d[j]);
                    b[j] = _mm256_add_pd(b[j], _mm256_mul_pd(d[j], d[j]));
                }
            }
            for j in 0..4 {
                _mm256_storeu_pd(l1.as_mut_ptr().add(4 * j), a[j]);
                _mm256_storeu_pd(l2.as_mut_ptr().add(4 * j), b[j]);
            }
        }
        // The tail continues the same lanes (it starts at a multiple of 16).
        for (i, &v) in xc.remainder().iter().enumerate() {
            let d = v as f64 - k;
            l1[i] += d;
            l2[i] += d * d;
        }
        let (mut t1, mut t2) = (0f64, 0f64);
        for j in 0..16 {
            t1 += l1[j];
            t2 += l2[j];
        }
        (t1, t2)
    }

    #[inline(always)]
    unsafe fn select_at_least(x: &[f32], threshold: u32, out: &mut Vec<u32>) -> u32 {
        // Chunks of 8 between capacity checks.
        const GROUP: usize = 256;
        let mut xc = x.chunks_exact(8);
        // SAFETY: AVX2 per the Kernels contract; loads read full chunks of `x`.
        // Every chunk stores 8 lanes at `out`'s end, inside the capacity
        // reserved for its group (8 per chunk), and the length then grows by
        // the number of lanes taken, all of them written: `set_len` covers
        // initialized values only.
        let below = unsafe {
            let abs = _mm256_set1_epi32(0x7fff_ffff);
            let t = _mm256_set1_epi32(threshold as i32);
            let mut m = _mm256_setzero_si256();
            while xc.len() > 0 {
                out.reserve(8 * GROUP.min(xc.len()));
                let mut len = out.len();
                let base = out.as_mut_ptr();
                for c in (&mut xc).take(GROUP) {
                    let b = _mm256_and_si256(_mm256_loadu_si256(c.as_ptr().cast()), abs);
                    // b >= t (unsigned) exactly where max(b, t) == b.
                    let ge = _mm256_cmpeq_epi32(_mm256_max_epu32(b, t), b);
                    m = _mm256_max_epu32(m, _mm256_andnot_si256(ge, b));
                    let mask = _mm256_movemask_ps(_mm256_castsi256_ps(ge)) as usize;
                    // Left-pack the taken lanes, in order.
                    let idx = _mm256_loadu_si256(LEFT_PACK[mask].as_ptr().cast());
                    _mm256_storeu_si256(base.add(len).cast(), _mm256_permutevar8x32_epi32(b, idx));
                    len += mask.count_ones() as usize;
                }
                out.set_len(len);
            }
            let h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
            let h = _mm_max_epu32(h, _mm_shuffle_epi32::<0b01_00_11_10>(h));
            let h = _mm_max_epu32(h, _mm_shuffle_epi32::<0b10_11_00_01>(h));
            _mm_cvtsi128_si32(h) as u32
        };
        // SAFETY: the scalar kernels need no CPU features.
        below.max(unsafe { Scalar::select_at_least(xc.remainder(), threshold, out) })
    }

    #[inline(always)]
    unsafe fn absmax_columns(row: &[f32], acc: &mut [u32]) {
        // SAFETY: as above; the compiler vectorizes the integer loop for AVX2.
        unsafe { Scalar::absmax_columns(row, acc) }
    }

    #[inline(always)]
    unsafe fn quantize_scaled(x: &[f32], scale: f32, clip: f32, out: &mut [i8], store: Store) {
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::quantize_scaled_ahead(x, scale, clip, out, store, &[]) }
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
        // One loop instance per store kind: a per-chunk branch on it cost
        // blockwise (a call every 64 values) 1-4 %. Runs shorter than
        // STREAM_MIN_RUN take cached stores whatever the hint: streamed
        // 4096-value stages of float16/bfloat16 input ran 2-8 % slower.
        // SAFETY: AVX2 per the Kernels contract.
        unsafe {
            match store {
                Store::Streaming if x.len() >= STREAM_MIN_RUN => {
                    scaled_run::<true>(x, scale, clip, out, ahead)
                }
                _ => scaled_run::<false>(x, scale, clip, out, ahead),
            }
        }
    }

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
        // One loop: each 32 codes of `x` (from cache) beside 32 values of
        // `next` (streaming in from memory, prefetched a row earlier) and two
        // lines of `ahead` prefetched, so the memory never waits for a
        // separate max pass.
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        // Loads of both rows 32-byte aligned (a load across two lines costs
        // two): heads of each go the short way. Codes stream only when that
        // leaves them 32-byte aligned too, else they take cached stores.
        let head = ((x.as_ptr() as usize).wrapping_neg() % 32 / 4).min(n);
        let stream =
            matches!(store, Store::Streaming) && (out.as_ptr() as usize + head).is_multiple_of(32);
        let (xh, x) = x.split_at(head);
        let (oh, out) = out.split_at_mut(head);
        let nhead = ((next.as_ptr() as usize).wrapping_neg() % 32 / 4).min(next.len());
        let (nh, next) = next.split_at(nhead);
        let pairs = (x.len() / 32).min(next.len() / 32);
        let (xf, xrest) = x.split_at(32 * pairs);
        let (of, orest) = out.split_at_mut(32 * pairs);
        let (nf, nrest) = next.split_at(32 * pairs);
        let (af, arest) = ahead.split_at((32 * pairs).min(ahead.len()));
        // SAFETY: AVX2 per the Kernels contract; the run gets equal-length
        // prefixes (32 · `pairs` values and codes), streams only when `out`
        // is 32-byte aligned after the head (`stream`), and prefetches
        // inside `af`.
        let m = unsafe {
            quantize_scaled_short(xh, scale, clip, oh);
            let lanes = ScaledLanes::new(scale, clip);
            if stream {
                fused_run::<true>(xf, of, nf, af, &lanes)
            } else {
                fused_run::<false>(xf, of, nf, af, &lanes)
            }
        };
        // SAFETY: AVX2 per the Kernels contract (this tier's own kernels).
        unsafe {
            Lines::new(arest).rest();
            Self::quantize_scaled_ahead(xrest, scale, clip, orest, store, &[]);
            let m = m.max(Scalar::absmax_bits(nh));
            m.max(Self::absmax_bits(nrest))
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
    unsafe fn f32_to_f16(x: &[f32], out: &mut [f16]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let mut xc = x.chunks_exact(8);
        let mut oc = out.chunks_exact_mut(8);
        // SAFETY: AVX2 and F16C per the Kernels contract; 8 floats in and 8
        // halves (16 bytes) out per full chunk; f16 is a 16-bit type.
        unsafe {
            for (c, o) in (&mut xc).zip(&mut oc) {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(c.as_ptr()));
                _mm_storeu_si128(o.as_mut_ptr().cast(), h);
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::f32_to_f16(xc.remainder(), oc.into_remainder()) };
    }

    #[inline(always)]
    unsafe fn f16_to_f32_streamed(x: &[f16], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let head = ((out.as_ptr() as usize).wrapping_neg() % 64 / 4).min(n);
        // SAFETY: AVX2 and F16C per the Kernels contract; f16 is a 16-bit type.
        // The head (cached) aligns the output to 64 bytes; then 8 halves in and
        // one aligned 32-byte half line streamed per full chunk, the tail
        // cached; fenced before returning.
        unsafe {
            Self::f16_to_f32(&x[..head], &mut out[..head]);
            let mut xc = x[head..].chunks_exact(8);
            let mut oc = out[head..].chunks_exact_mut(8);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let f = _mm256_cvtph_ps(_mm_loadu_si128(c.as_ptr().cast()));
                _mm256_stream_ps(o.as_mut_ptr(), f);
            }
            _mm_sfence();
            Self::f16_to_f32(xc.remainder(), oc.into_remainder());
        }
    }

    #[inline(always)]
    unsafe fn f32_to_f16_streamed(x: &[f32], out: &mut [f16]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let head = ((out.as_ptr() as usize).wrapping_neg() % 64 / 2).min(n);
        // SAFETY: AVX2 and F16C per the Kernels contract. The head (cached)
        // aligns the output to 64 bytes; then 16 floats in and one aligned
        // 32-byte half line streamed per full chunk (two fill a line), the
        // tail cached; fenced before returning.
        unsafe {
            Self::f32_to_f16(&x[..head], &mut out[..head]);
            let mut xc = x[head..].chunks_exact(16);
            let mut oc = out[head..].chunks_exact_mut(16);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let lo = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(c.as_ptr()));
                let hi = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(
                    c.as_ptr().add(8),
                ));
                _mm256_stream_si256(o.as_mut_ptr().cast(), _mm256_set_m128i(hi, lo));
            }
            _mm_sfence();
            Self::f32_to_f16(xc.remainder(), oc.into_remainder());
        }
    }

    #[inline(always)]
    unsafe fn f64_to_f32_odd(x: &[f64], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let mut xc = x.chunks_exact(4);
        let mut oc = out.chunks_exact_mut(4);
        // SAFETY: AVX2 per the Kernels contract; 4 doubles in and 4 floats out
        // per full chunk.
        unsafe {
            let sign = _mm256_set1_pd(-0.0);
            // The low dword of each 64-bit compare mask, packed into 128 bits.
            let lows = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
            let narrow = |m: __m256d| {
                _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(m), lows))
            };
            for (c, o) in (&mut xc).zip(&mut oc) {
                let v = _mm256_loadu_pd(c.as_ptr());
                let f = _mm256_cvtpd_ps(v); // nearest even
                let back = _mm256_cvtps_pd(f);
                // Ordered compares: a NaN stays as converted, as in the scalar path.
                let inexact = narrow(_mm256_cmp_pd::<_CMP_NEQ_OQ>(back, v));
                let away = narrow(_mm256_cmp_pd::<_CMP_GT_OQ>(
                    _mm256_andnot_pd(sign, back),
                    _mm256_andnot_pd(sign, v),
                ));
                // Rounded away from zero: one ulp back (the mask is -1). Then
                // an inexact result gets its last bit set.
                let toward = _mm_add_epi32(_mm_castps_si128(f), away);
                let odd = _mm_or_si128(toward, _mm_and_si128(inexact, _mm_set1_epi32(1)));
                _mm_storeu_si128(o.as_mut_ptr().cast(), odd);
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::f64_to_f32_odd(xc.remainder(), oc.into_remainder()) };
    }

    #[inline(always)]
    unsafe fn f32_to_bf16(x: &[f32], out: &mut [bf16]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let mut xc = x.chunks_exact(8);
        let mut oc = out.chunks_exact_mut(8);
        // SAFETY: AVX2 per the Kernels contract; 8 floats in and 8 bf16 (16
        // bytes) out per full chunk; bf16 is a 16-bit type.
        unsafe {
            let one = _mm256_set1_epi32(1);
            let half_ulp = _mm256_set1_epi32(0x7fff);
            let inf = _mm256_set1_epi32(0x7f80_0000);
            let magnitude = _mm256_set1_epi32(0x7fff_ffff);
            let quiet = _mm256_set1_epi32(0x40);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let b = _mm256_castps_si256(_mm256_loadu_ps(c.as_ptr()));
                let high = _mm256_srli_epi32::<16>(b);
                // Nearest even: add just under half an ulp, plus the kept lsb.
                let lsb = _mm256_and_si256(high, one);
                let rounded =
                    _mm256_srli_epi32::<16>(_mm256_add_epi32(b, _mm256_add_epi32(half_ulp, lsb)));
                let nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, magnitude), inf);
                let r = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), nan);
                // Every lane is below 2^16: the unsigned pack is exact; then
                // the two 64-bit halves holding lanes 0-3 and 4-7 move together.
                let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(r, r));
                _mm_storeu_si128(o.as_mut_ptr().cast(), _mm256_castsi256_si128(packed));
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::f32_to_bf16(xc.remainder(), oc.into_remainder()) };
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

    #[inline(always)]
    unsafe fn range_f32(x: &[f32]) -> Range<f32> {
        let mut xc = x.chunks_exact(8);
        // SAFETY: AVX2 per the Kernels contract; loads read full chunks of `x`.
        let (min, max, bad) = unsafe {
            let (mut lo, mut hi) = (
                _mm256_set1_ps(f32::INFINITY),
                _mm256_set1_ps(f32::NEG_INFINITY),
            );
            let mut bad = _mm256_setzero_ps();
            for c in &mut xc {
                let v = _mm256_loadu_ps(c.as_ptr());
                // x - x is 0 for finite x and NaN for NaN or ±inf.
                bad = _mm256_or_ps(
                    bad,
                    _mm256_cmp_ps::<_CMP_NEQ_UQ>(_mm256_sub_ps(v, v), _mm256_setzero_ps()),
                );
                // min/max in f32 lanes, exact. With `v` first a NaN `v` leaves
                // the lane as it was (vminps returns its second operand when
                // either is NaN): NaN is skipped, as the scalar's `<` skips
                // it. Of ±0 either may stay; they compare equal.
                lo = _mm256_min_ps(v, lo);
                hi = _mm256_max_ps(v, hi);
            }
            let (min, max) = reduce_pd(
                _mm256_min_pd(
                    _mm256_cvtps_pd(_mm256_castps256_ps128(lo)),
                    _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(lo)),
                ),
                _mm256_max_pd(
                    _mm256_cvtps_pd(_mm256_castps256_ps128(hi)),
                    _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(hi)),
                ),
            );
            (min as f32, max as f32, _mm256_movemask_ps(bad) != 0)
        };
        let body = Range {
            min,
            max,
            non_finite: bad,
        };
        // SAFETY: the scalar kernels need no CPU features.
        body.merge(unsafe { Scalar::range_f32(xc.remainder()) })
    }

    #[inline(always)]
    unsafe fn range_f64(x: &[f64]) -> Range<f64> {
        let mut xc = x.chunks_exact(4);
        // SAFETY: AVX2 per the Kernels contract; loads read full chunks of `x`.
        let (min, max, bad) = unsafe {
            let (mut lo, mut hi) = (
                _mm256_set1_pd(f64::INFINITY),
                _mm256_set1_pd(f64::NEG_INFINITY),
            );
            let mut bad = _mm256_setzero_pd();
            for c in &mut xc {
                let v = _mm256_loadu_pd(c.as_ptr());
                bad = _mm256_or_pd(
                    bad,
                    _mm256_cmp_pd::<_CMP_NEQ_UQ>(_mm256_sub_pd(v, v), _mm256_setzero_pd()),
                );
                // The value first: a NaN leaves the lane as it was (see range_f32).
                lo = _mm256_min_pd(v, lo);
                hi = _mm256_max_pd(v, hi);
            }
            let (min, max) = reduce_pd(lo, hi);
            (min, max, _mm256_movemask_pd(bad) != 0)
        };
        let body = Range {
            min,
            max,
            non_finite: bad,
        };
        // SAFETY: the scalar kernels need no CPU features.
        body.merge(unsafe { Scalar::range_f64(xc.remainder()) })
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
        // SAFETY: forwarded (AVX2 per the Kernels contract).
        unsafe { affine_codes_beside(x, a, out, store, ahead, &mut Nothing) }
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
        // One loop: each 32 codes of `x` beside 32 values of `next`.
        // SAFETY: forwarded (AVX2 per the Kernels contract).
        unsafe {
            if magnitude {
                let mut r = RowRange::<true>::new(next);
                affine_codes_beside(x, a, out, store, ahead, &mut r);
                r.finish()
            } else {
                let mut r = RowRange::<false>::new(next);
                affine_codes_beside(x, a, out, store, ahead, &mut r);
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
        let n = (x.len() / 2).min(out.len());
        let (x, out) = (&x[..2 * n], &mut out[..n]);
        let mut ahead = Lines::new(ahead);
        let mut xc = x.chunks_exact(32);
        let mut oc = out.chunks_exact_mut(16);
        // SAFETY: AVX2 per the Kernels contract; 32 floats read and 16 bytes
        // written per full chunk (`int4_32_run`'s own contract). Prefetches
        // only name addresses inside `ahead`.
        unsafe {
            let l = AffineLanes::new(a);
            let fast = FastLanes::new(a);
            let f = fast.as_ref();
            let (xs, os) = (&mut xc, &mut oc);
            shortcut_instance!(int4_32_run, f, xs, os, &l, f, &mut ahead);
            ahead.rest();
        }
        let rest = xc.remainder();
        let mut codes = [0i8; 32];
        let codes = &mut codes[..rest.len()];
        // SAFETY: AVX2 per the Kernels contract (this tier's own kernels).
        unsafe {
            Self::affine_quantize_f32(rest, a, codes, Store::Cached);
            Self::pack_int4(codes, oc.into_remainder());
        }
    }

    #[inline(always)]
    unsafe fn affine_quantize_f64(x: &[f64], a: Affine, out: &mut [i8]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        let mut xc = x.chunks_exact(8);
        let mut oc = out.chunks_exact_mut(8);
        // SAFETY: AVX2 per the Kernels contract; 8 doubles read and 8 bytes
        // written per full chunk.
        unsafe {
            let l = AffineLanes::new(a);
            for (c, o) in (&mut xc).zip(&mut oc) {
                let lo = affine4(_mm256_loadu_pd(c.as_ptr()), &l);
                let hi = affine4(_mm256_loadu_pd(c.as_ptr().add(4)), &l);
                store8(lo, hi, o.as_mut_ptr());
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::affine_quantize_f64(xc.remainder(), a, oc.into_remainder()) };
    }

    #[inline(always)]
    unsafe fn affine_dequantize_f32(q: &[i8], zp: f64, scale: f64, out: &mut [f32], store: Store) {
        let n = q.len().min(out.len());
        let (q, out) = (&q[..n], &mut out[..n]);
        // Streaming: a head up to a 64-byte boundary of `out` goes the cached
        // way, then whole lines (two 32-byte streaming stores each) bypass the
        // cache: the output is four times the input, and a cached store would
        // first read every line it writes.
        let head = match store {
            Store::Streaming => (out.as_ptr() as usize).wrapping_neg() % 64 / 4,
            Store::Cached => 0,
        }
        .min(n);
        let (qh, qb) = q.split_at(head);
        let (oh, ob) = out.split_at_mut(head);
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::affine_dequantize_f32(qh, zp, scale, oh, Store::Cached) };
        let mut qc = qb.chunks_exact(16);
        let mut oc = ob.chunks_exact_mut(16);
        // SAFETY: AVX2 per the Kernels contract; 16 bytes read and 16 floats
        // written per full chunk, streamed only to 64-byte aligned lines (the
        // head aligned `ob`, and chunks are 64 bytes) and fenced before
        // returning. vcvtpd2ps rounds to nearest even, as `as f32` does.
        unsafe {
            let (z, s) = (_mm256_set1_pd(zp), _mm256_set1_pd(scale));
            let streaming = matches!(store, Store::Streaming);
            let magic = magic_zero_point(zp).map(|b| _mm256_set1_pd(b));
            for (c, o) in (&mut qc).zip(&mut oc) {
                let (v0, v1) = if let Some(bias) = magic {
                    let p = c.as_ptr();
                    let f = |k: usize| _mm256_cvtpd_ps(affine_values4_magic(p.add(4 * k), bias, s));
                    (_mm256_set_m128(f(1), f(0)), _mm256_set_m128(f(3), f(2)))
                } else {
                    let b = _mm_loadu_si128(c.as_ptr().cast());
                    (
                        affine_floats8(b, z, s),
                        affine_floats8(_mm_unpackhi_epi64(b, b), z, s),
                    )
                };
                if streaming {
                    _mm256_stream_ps(o.as_mut_ptr(), v0);
                    _mm256_stream_ps(o.as_mut_ptr().add(8), v1);
                } else {
                    _mm256_storeu_ps(o.as_mut_ptr(), v0);
                    _mm256_storeu_ps(o.as_mut_ptr().add(8), v1);
                }
            }
            if streaming {
                _mm_sfence();
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe {
            Scalar::affine_dequantize_f32(qc.remainder(), zp, scale, oc.into_remainder(), store)
        };
    }

    #[inline(always)]
    unsafe fn affine_dequantize_f64(q: &[i8], zp: f64, scale: f64, out: &mut [f64]) {
        let n = q.len().min(out.len());
        let (q, out) = (&q[..n], &mut out[..n]);
        let mut qc = q.chunks_exact(8);
        let mut oc = out.chunks_exact_mut(8);
        // SAFETY: AVX2 per the Kernels contract; 8 bytes read and 8 doubles written
        // per full chunk.
        unsafe {
            let (z, s) = (_mm256_set1_pd(zp), _mm256_set1_pd(scale));
            let magic = magic_zero_point(zp).map(|b| _mm256_set1_pd(b));
            for (c, o) in (&mut qc).zip(&mut oc) {
                let (lo, hi) = match magic {
                    Some(bias) => (
                        affine_values4_magic(c.as_ptr(), bias, s),
                        affine_values4_magic(c.as_ptr().add(4), bias, s),
                    ),
                    None => affine_values8(_mm_loadl_epi64(c.as_ptr().cast()), z, s),
                };
                _mm256_storeu_pd(o.as_mut_ptr(), lo);
                _mm256_storeu_pd(o.as_mut_ptr().add(4), hi);
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::affine_dequantize_f64(qc.remainder(), zp, scale, oc.into_remainder()) };
    }

    #[inline(always)]
    unsafe fn pack_int4(q: &[i8], out: &mut [u8]) {
        let n = (q.len() / 2).min(out.len());
        let (q, out) = (&q[..2 * n], &mut out[..n]);
        let mut qc = q.chunks_exact(32);
        let mut oc = out.chunks_exact_mut(16);
        // SAFETY: AVX2 per the Kernels contract; 32 codes read and 16 bytes written
        // per full chunk. packus is exact: every 16-bit lane is at most 0xff.
        unsafe {
            let low = _mm256_set1_epi16(0x000f);
            let high = _mm256_set1_epi16(0x00f0);
            for (c, o) in (&mut qc).zip(&mut oc) {
                let w = _mm256_loadu_si256(c.as_ptr().cast());
                let r = _mm256_or_si256(
                    _mm256_and_si256(w, low),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(w), high),
                );
                let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(r, r));
                _mm_storeu_si128(o.as_mut_ptr().cast(), _mm256_castsi256_si128(p));
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::pack_int4(qc.remainder(), oc.into_remainder()) };
    }

    #[inline(always)]
    unsafe fn unpack_int4(p: &[u8], out: &mut [i8]) {
        let n = p.len().min(out.len() / 2);
        let (p, out) = (&p[..n], &mut out[..2 * n]);
        let mut pc = p.chunks_exact(16);
        let mut oc = out.chunks_exact_mut(32);
        // SAFETY: AVX2 per the Kernels contract; 16 bytes read and 32 codes
        // written per full chunk.
        unsafe {
            let low = _mm256_set1_epi16(0x000f);
            let eight = _mm256_set1_epi8(8);
            for (c, o) in (&mut pc).zip(&mut oc) {
                let w = _mm256_cvtepu8_epi16(_mm_loadu_si128(c.as_ptr().cast()));
                let pair = _mm256_or_si256(
                    _mm256_and_si256(w, low),
                    _mm256_slli_epi16::<8>(_mm256_srli_epi16::<4>(w)),
                );
                let v = _mm256_sub_epi8(_mm256_xor_si256(pair, eight), eight);
                _mm256_storeu_si256(o.as_mut_ptr().cast(), v);
            }
        }
        // SAFETY: the scalar kernels need no CPU features.
        unsafe { Scalar::unpack_int4(pc.remainder(), oc.into_remainder()) };
    }
}
