//! Runtime dispatch: one `#[target_feature]` entry point per tier around each
//! generic loop or primitive, and the safe function that picks among them.
//!
//! The match over tiers is exhaustive (no `_ =>` arm): a new tier must say
//! which implementation it runs, and a tier without its own primitive falls to
//! its base tier's, never silently to scalar.

use super::kernels::{
    AbsmaxRule, Affine, Kernels, PackedTokens, Range, Store, F32_INF_BITS, PACKED_MIN_TOKENS,
};
use super::scalar::{self, Scalar};
use super::Isa;
#[cfg(target_arch = "x86_64")]
use super::{avx2::Avx2, avx512::Avx512};
use half::{bf16, f16};
use std::marker::PhantomData;

/// Generates one `#[target_feature]` entry point per ISA around a generic
/// function, and the safe dispatcher that picks among them.
macro_rules! dispatch {
    ($(#[$doc:meta])* pub fn $name:ident = $($generic:ident)::+($($arg:ident: $ty:ty),*) -> $ret:ty;) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        pub fn $name(isa: Isa, $($arg: $ty),*) -> $ret {
            match isa.usable() {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni => {
                    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
                    unsafe fn entry($($arg: $ty),*) -> $ret {
                        // SAFETY: compiled with the AVX-512 features the kernels use.
                        unsafe { $($generic)::+::<Avx512<true>>($($arg),*) }
                    }
                    // SAFETY: `usable()` returned Avx512Vnni, so the CPU supports it.
                    unsafe { entry($($arg),*) }
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => {
                    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
                    unsafe fn entry($($arg: $ty),*) -> $ret {
                        // SAFETY: compiled with the AVX-512 features the kernels use.
                        unsafe { $($generic)::+::<Avx512<false>>($($arg),*) }
                    }
                    // SAFETY: `usable()` returned Avx512, so the CPU supports it.
                    unsafe { entry($($arg),*) }
                }
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => {
                    #[target_feature(enable = "avx2,f16c,fma")]
                    unsafe fn entry($($arg: $ty),*) -> $ret {
                        // SAFETY: compiled with AVX2 and F16C, which the kernels use.
                        unsafe { $($generic)::+::<Avx2>($($arg),*) }
                    }
                    // SAFETY: `usable()` returned Avx2, so the CPU supports it.
                    unsafe { entry($($arg),*) }
                }
                // SAFETY: the scalar kernels use no special instructions.
                Isa::Scalar => unsafe { $($generic)::+::<Scalar>($($arg),*) },
                // Tiers compiled only for x86-64 cannot be `usable()` elsewhere.
                #[cfg(not(target_arch = "x86_64"))]
                Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => unreachable!("usable() returned an x86-64 tier"),
            }
        }
    };
}

/// A primitive of [`Kernels`] exposed as a dispatched function.
macro_rules! primitive {
    ($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        paste_generic!($(#[$doc])* $name, $name, ($($arg: $ty),*), $ret);
    };
}

macro_rules! paste_generic {
    ($(#[$doc:meta])* $name:ident, $prim:ident, ($($arg:ident: $ty:ty),*), $ret:ty) => {
        mod $name {
            use super::*;
            #[inline(always)]
            pub(super) unsafe fn generic<K: Kernels>($($arg: $ty),*) -> $ret {
                // SAFETY: forwarded from this function's contract.
                unsafe { K::$prim($($arg),*) }
            }
        }
        dispatch! {
            $(#[$doc])*
            pub fn $name = $name::generic($($arg: $ty),*) -> $ret;
        }
    };
}

/// Blockwise absmax loop over f32: per block, max |x| (non-finite check fused),
/// the rule's scale, then codes. Writes each block's f32 scale to `scales`;
/// returns the index (into `x`) of the first non-finite element, if any, at
/// which point it stops. A loop in `simd/` because a block (64 elements) is
/// too small a unit to dispatch on its own.
#[inline(always)]
unsafe fn absmax_blocks_generic<K: Kernels>(
    x: &[f32],
    block: usize,
    rule: AbsmaxRule,
    codes: &mut [i8],
    scales: &mut [f32],
    store: Store,
) -> Result<(), usize> {
    // One loop per store kind, so the per-block code sees a constant one
    // (deciding it per block cost blockwise at 64 values a block 3-5 %).
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match store {
            Store::Cached => absmax_blocks_with::<K>(x, block, rule, codes, scales, Store::Cached),
            Store::Streaming => {
                let r = absmax_blocks_with::<K>(x, block, rule, codes, scales, Store::Streaming);
                // The blocks' codes leave their stores unfenced.
                fence(Store::Streaming);
                r
            }
        }
    }
}

#[inline(always)]
unsafe fn absmax_blocks_with<K: Kernels>(
    x: &[f32],
    block: usize,
    rule: AbsmaxRule,
    codes: &mut [i8],
    scales: &mut [f32],
    store: Store,
) -> Result<(), usize> {
    // Blocks of 32, 64 or 128: a tier may do (most of) them in batches.
    let done = if matches!(block, 32 | 64 | 128) {
        let whole = (x.len() / block).min(codes.len() / block).min(scales.len());
        let (xw, cw, sw) = (
            &x[..block * whole],
            &mut codes[..block * whole],
            &mut scales[..whole],
        );
        // SAFETY: forwarded from this function's contract (caller has K's features).
        unsafe { K::absmax_blocks_batched(xw, block, rule, cw, sw, store) }.min(whole)
    } else {
        0
    };
    let (x, codes, scales) = (
        &x[done * block..],
        &mut codes[done * block..],
        &mut scales[done..],
    );
    let blocks = x.chunks(block).zip(codes.chunks_mut(block));
    for (b, ((xb, cb), s)) in blocks.zip(scales.iter_mut()).enumerate() {
        let b = b + done;
        // SAFETY: forwarded from this function's contract (caller has K's features).
        let m = unsafe { K::absmax_bits(xb) };
        if m >= F32_INF_BITS {
            return Err(b * block + scalar::first_non_finite(xb));
        }
        let scale = rule.scale(f32::from_bits(m));
        *s = scale;
        if scale > 0.0 {
            // SAFETY: as above.
            unsafe { K::quantize_scaled(xb, scale, rule.clip, cb, store) };
        } else {
            cb.fill(0);
        }
    }
    Ok(())
}

#[inline(always)]
unsafe fn scaled_blocks_dequantize_generic<K: Kernels>(
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

dispatch! {
    /// Quantize consecutive blocks of `x` (the last may be short) to codes and
    /// f32 scales by `rule`. `Err(i)`: `x[i]` is the first non-finite value.
    pub fn absmax_blocks = absmax_blocks_generic(
        x: &[f32], block: usize, rule: AbsmaxRule, codes: &mut [i8], scales: &mut [f32],
        store: Store
    ) -> Result<(), usize>;
}

dispatch! {
    /// Dequantize consecutive blocks: `out[i] = codes[i] as f32 * scales[i / block]`.
    pub fn scaled_blocks_dequantize = scaled_blocks_dequantize_generic(
        codes: &[i8], block: usize, scales: &[f32], out: &mut [f32]
    ) -> ();
}

primitive!(
    /// Bits of max |x| (`>= F32_INF_BITS` iff some element is non-finite).
    absmax_bits(x: &[f32]) -> u32
);
paste_generic!(
    /// `quantize_scaled_then_absmax` with its streaming stores left unfenced
    /// (only [`RowsOut`] calls it, and fences).
    scaled_then_absmax_unfenced, quantize_scaled_then_absmax,
    (x: &[f32], scale: f32, clip: f32, out: &mut [i8], store: Store, next: &[f32], ahead: &[f32]),
    u32
);

/// Codes of `x` by `scale` (as `quantize_scaled`), then the bits of max |x| of
/// `next`, bringing `ahead` toward the core meanwhile. One row of
/// [`RowsOut::quantize_scaled_then_absmax`], fenced on return.
#[allow(clippy::too_many_arguments)]
pub fn quantize_scaled_then_absmax(
    isa: Isa,
    x: &[f32],
    scale: f32,
    clip: f32,
    out: &mut [i8],
    store: Store,
    next: &[f32],
    ahead: &[f32],
) -> u32 {
    rows_out(out, store, |o| {
        o.quantize_scaled_then_absmax(isa, 0, x, scale, clip, next, ahead)
    })
}

/// An int8 output that a loop fills run by run: the rows of per-row and
/// per-channel scales (each row's kernel reading the next row beside it), the
/// spans of a per-tensor call. The runs' streaming stores are fenced once,
/// when [`rows_out`]'s scope ends, not after every run: a fence waits for the
/// run's last lines to reach memory, which cost ~10 % of per-row int8 time at
/// 4096-value rows on Zen 4 when paid a row (2048 x 4096, one thread).
///
/// Only [`rows_out`] makes one, so no code reads the output before that
/// fence; it is not `Send`, since a fence orders its own thread's stores only.
pub struct RowsOut<'a> {
    out: &'a mut [i8],
    store: Store,
    _one_thread: PhantomData<*mut ()>,
}

/// Orders the streaming stores this thread made before whatever it does
/// next (a no-op for [`Store::Cached`]).
fn fence(store: Store) {
    if matches!(store, Store::Streaming) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: SSE, which every x86-64 CPU has.
        unsafe {
            std::arch::x86_64::_mm_sfence()
        };
    }
}

/// Runs `body` over `out` as a [`RowsOut`] whose rows take `store`, then
/// fences their streaming stores (also when `body` panics).
pub fn rows_out<R>(out: &mut [i8], store: Store, body: impl FnOnce(&mut RowsOut<'_>) -> R) -> R {
    /// Fences on drop, so an unwinding `body` fences too.
    struct Fence(Store);
    impl Drop for Fence {
        fn drop(&mut self) {
            fence(self.0);
        }
    }
    let _fence = Fence(store);
    body(&mut RowsOut {
        out,
        store,
        _one_thread: PhantomData,
    })
}

impl RowsOut<'_> {
    /// Bytes of the output.
    pub fn len(&self) -> usize {
        self.out.len()
    }

    /// Whether the output has no bytes.
    pub fn is_empty(&self) -> bool {
        self.out.is_empty()
    }

    /// The output from byte `at` on (empty past the end).
    fn tail(&mut self, at: usize) -> &mut [i8] {
        let n = self.out.len();
        &mut self.out[at.min(n)..]
    }

    /// Sets bytes `at..at + len` (as far as the output goes) to `v`.
    pub fn fill(&mut self, at: usize, len: usize, v: i8) {
        let t = self.tail(at);
        let n = len.min(t.len());
        t[..n].fill(v);
    }

    /// [`quantize_scaled_ahead`] of a run, its codes at byte `at` on.
    #[allow(clippy::too_many_arguments)]
    pub fn quantize_scaled_ahead(
        &mut self,
        isa: Isa,
        at: usize,
        x: &[f32],
        scale: f32,
        clip: f32,
        ahead: &[f32],
    ) {
        let store = self.store;
        scaled_ahead_unfenced(isa, x, scale, clip, self.tail(at), store, ahead);
    }

    /// [`affine_quantize_f32_ahead`] of a run, its codes at byte `at` on.
    pub fn affine_quantize_f32_ahead(
        &mut self,
        isa: Isa,
        at: usize,
        x: &[f32],
        a: Affine,
        ahead: &[f32],
    ) {
        let store = self.store;
        affine_ahead_unfenced(isa, x, a, self.tail(at), store, ahead);
    }

    /// [`affine_quantize_f64`] of a run (always cached stores), its codes at
    /// byte `at` on.
    pub fn affine_quantize_f64(&mut self, isa: Isa, at: usize, x: &[f64], a: Affine) {
        affine_quantize_f64(isa, x, a, self.tail(at));
    }

    /// [`quantize_scaled_then_absmax`] of one row, its codes at byte `at` on.
    #[allow(clippy::too_many_arguments)]
    pub fn quantize_scaled_then_absmax(
        &mut self,
        isa: Isa,
        at: usize,
        x: &[f32],
        scale: f32,
        clip: f32,
        next: &[f32],
        ahead: &[f32],
    ) -> u32 {
        let store = self.store;
        scaled_then_absmax_unfenced(isa, x, scale, clip, self.tail(at), store, next, ahead)
    }

    /// [`affine_quantize_f32_then_range`] of one row, its codes at byte `at` on.
    #[allow(clippy::too_many_arguments)]
    pub fn affine_quantize_f32_then_range(
        &mut self,
        isa: Isa,
        at: usize,
        x: &[f32],
        a: Affine,
        next: &[f32],
        ahead: &[f32],
        magnitude: bool,
    ) -> Range<f32> {
        let store = self.store;
        let out = self.tail(at);
        let r = affine_then_range_unfenced(isa, x, a, out, store, next, ahead, magnitude);
        if magnitude {
            r
        } else {
            first_zero_sign(r, next)
        }
    }
}
primitive!(
    /// `absmax_bits`, bringing `ahead` toward the core meanwhile.
    absmax_bits_ahead(x: &[f32], ahead: &[f32]) -> u32
);
paste_generic!(
    /// `quantize_scaled_ahead`, its streaming stores unfenced (only
    /// [`RowsOut`] calls it, and fences).
    scaled_ahead_unfenced, quantize_scaled_ahead,
    (x: &[f32], scale: f32, clip: f32, out: &mut [i8], store: Store, ahead: &[f32]),
    ()
);

/// `out[i] = clamp(round(x[i] / scale), -clip, clip)` (scale > 0).
pub fn quantize_scaled(isa: Isa, x: &[f32], scale: f32, clip: f32, out: &mut [i8], store: Store) {
    quantize_scaled_ahead(isa, x, scale, clip, out, store, &[]);
}

/// `quantize_scaled`, bringing `ahead` toward the core meanwhile.
pub fn quantize_scaled_ahead(
    isa: Isa,
    x: &[f32],
    scale: f32,
    clip: f32,
    out: &mut [i8],
    store: Store,
    ahead: &[f32],
) {
    rows_out(out, store, |o| {
        o.quantize_scaled_ahead(isa, 0, x, scale, clip, ahead)
    });
}
primitive!(
    /// Exact int8 dot products of the first `rows` rows of `w` with every
    /// token of `a` (both `k` wide): `out[r * tokens + t]`; later rows of `w`
    /// are only prefetched.
    i8_dots(w: &[i8], rows: usize, a: &[i8], k: usize, out: &mut [i64]) -> ()
);
primitive!(
    /// Rescaled int8 products of the first `w_scales.len()` rows of `w` with
    /// every token of `p`: `out[t * stride + r] = (acc as f32 * w_scales[r]) *
    /// a_scales[t]`, `acc` the exact sum (see `Kernels::i8_products`). Tokens
    /// packed for another tier are read as given: the same results, slower.
    /// Zero-wide tokens (`k == 0`) write nothing.
    i8_products(w: &[i8], p: &PackedTokens<'_>, w_scales: &[f32], a_scales: &[f32], out: &mut [f32], stride: usize) -> ()
);

#[inline(always)]
unsafe fn pack_tokens_generic<K: Kernels>(a: &[i8], k: usize) -> PackedTokens<'_> {
    let mut p = PackedTokens::unpacked(a, k);
    if K::PACKS.is_some() && k >= 1 && a.len() / k >= PACKED_MIN_TOKENS {
        // SAFETY: forwarded from this function's contract.
        if let Some(words) = unsafe { K::pack_tokens(a, k) } {
            (p.by, p.words) = (K::PACKS, words);
        }
    }
    p
}

dispatch! {
    /// The tokens of `a` (`k` wide) laid out once for [`i8_products`] on
    /// `isa`, to be shared by every call over them. On a tier without a
    /// packed form, below [`PACKED_MIN_TOKENS`] tokens, or when the copy
    /// cannot be allocated, the tokens as they are.
    pub fn pack_tokens = pack_tokens_generic(a: &[i8], k: usize) -> PackedTokens<'_>;
}

/// Whether [`pack_tokens`] on `isa` packs `tokens` activations (a copy, then
/// outer products over them; on AVX-512 VNNI [`i8_dots`] too): callers
/// should then hand [`i8_products`] many rows per call, not a small panel at
/// a time.
pub fn i8_dots_packs(isa: Isa, tokens: usize) -> bool {
    matches!(isa.usable(), Isa::Avx512Vnni | Isa::Avx2) && tokens >= PACKED_MIN_TOKENS
}

primitive!(
    /// Per row `r`: `(Σ x[i] · (q[r·stride + i] - zps[r])) · scales[r]` over
    /// int8 codes (f32, `scalar::DOT_LANES` order, scaled once), into `out[r]`.
    dot_dequant_i8_rows(q: &[i8], stride: usize, zps: &[f32], scales: &[f32], x: &[f32], out: &mut [f32]) -> ()
);
primitive!(
    /// Per row `r`: the int4 dot product of the `n` codes from byte `r·stride`
    /// with `xs` (`scalar::nibble_planes` order), into `out[r]`.
    dot_dequant_i4_rows(p: &[u8], stride: usize, n: usize, zps: &[f32], scales: &[f32], xs: &[f32], out: &mut [f32]) -> ()
);
primitive!(
    /// `out[i] = q[i] as f32 * scale`.
    dequantize_scaled(q: &[i8], scale: f32, out: &mut [f32]) -> ()
);
primitive!(
    /// float16 -> float32 (exact), over `min(len)`.
    f16_to_f32(x: &[f16], out: &mut [f32]) -> ()
);
primitive!(
    /// bfloat16 -> float32 (exact), over `min(len)`.
    bf16_to_f32(x: &[bf16], out: &mut [f32]) -> ()
);
primitive!(
    /// float64 -> float32 (round to nearest even, as `as f32`), over `min(len)`.
    f64_to_f32(x: &[f64], out: &mut [f32]) -> ()
);
primitive!(
    /// float64 -> float32 rounded to odd (exact values kept, an inexact one
    /// toward zero with its last bit set), over `min(len)`.
    f64_to_f32_odd(x: &[f64], out: &mut [f32]) -> ()
);
primitive!(
    /// float32 -> bfloat16, round to nearest even (as `half`), over `min(len)`.
    f32_to_bf16(x: &[f32], out: &mut [bf16]) -> ()
);
primitive!(
    /// float32 -> float16, round to nearest even (as `half`), over `min(len)`.
    f32_to_f16(x: &[f32], out: &mut [f16]) -> ()
);
primitive!(
    /// [`f32_to_f16`] through streaming stores (fenced): the same bits, for an
    /// output too large to stay in cache.
    f32_to_f16_streamed(x: &[f32], out: &mut [f16]) -> ()
);
primitive!(
    /// [`f16_to_f32`] through streaming stores (fenced): the same bits, for an
    /// output too large to stay in cache.
    f16_to_f32_streamed(x: &[f16], out: &mut [f32]) -> ()
);
primitive!(
    /// `(Σ (x - k), Σ (x - k)²)` in f64, in the fixed 16-lane order.
    shifted_moments(x: &[f32], k: f64) -> (f64, f64)
);
primitive!(
    /// Appends the |x| bit patterns at or above `threshold` to `out` (in
    /// order); returns the largest |x| bit pattern below it (0 if none).
    select_at_least(x: &[f32], threshold: u32, out: &mut Vec<u32>) -> u32
);
primitive!(
    /// Running column maxima of |x| as bit patterns.
    absmax_columns(row: &[f32], acc: &mut [u32]) -> ()
);
paste_generic!(
    /// Min, max and non-finite flag of an f32 run, lanes merged in any order
    /// (a ±0 extreme may carry either sign: see [`range_f32`]).
    range_f32_lanes, range_f32, (x: &[f32]), Range<f32>
);
paste_generic!(
    /// As [`range_f32_lanes`] for f64.
    range_f64_lanes, range_f64, (x: &[f64]), Range<f64>
);

/// Min, max and non-finite flag of an f32 run. Of equal extremes the scalar
/// loop keeps the first; equal values have equal bits except ±0, so a zero
/// extreme takes the sign of the run's first zero (the lanes may have kept
/// another).
pub fn range_f32(isa: Isa, x: &[f32]) -> Range<f32> {
    first_zero_sign(range_f32_lanes(isa, x), x)
}

/// As [`range_f32`] for f64.
pub fn range_f64(isa: Isa, x: &[f64]) -> Range<f64> {
    first_zero_sign(range_f64_lanes(isa, x), x)
}

/// The range of an f32 run as a scale reads it: [`range_f32`], or with
/// `magnitude` `(-m, m)` for `m = max |x|` (all a symmetric scale reads),
/// non-finite iff the run holds a NaN or an infinity.
pub fn row_range(isa: Isa, x: &[f32], magnitude: bool) -> Range<f32> {
    if magnitude {
        super::kernels::magnitude(absmax_bits(isa, x))
    } else {
        range_f32(isa, x)
    }
}

fn first_zero_sign<T: PartialEq + Copy + From<i8>>(mut r: Range<T>, x: &[T]) -> Range<T> {
    let zero = T::from(0);
    if !r.non_finite && (r.min == zero || r.max == zero) {
        if let Some(&z) = x.iter().find(|&&v| v == zero) {
            if r.min == zero {
                r.min = z;
            }
            if r.max == zero {
                r.max = z;
            }
        }
    }
    r
}
paste_generic!(
    /// `affine_quantize_f32_ahead`, its streaming stores unfenced (only
    /// [`RowsOut`] calls it, and fences).
    affine_ahead_unfenced, affine_quantize_f32_ahead,
    (x: &[f32], a: Affine, out: &mut [i8], store: Store, ahead: &[f32]),
    ()
);

/// Affine codes of f32 values, computed in f64 (see [`Affine`]).
pub fn affine_quantize_f32(isa: Isa, x: &[f32], a: Affine, out: &mut [i8], store: Store) {
    affine_quantize_f32_ahead(isa, x, a, out, store, &[]);
}

/// `affine_quantize_f32`, bringing `ahead` toward the core meanwhile.
pub fn affine_quantize_f32_ahead(
    isa: Isa,
    x: &[f32],
    a: Affine,
    out: &mut [i8],
    store: Store,
    ahead: &[f32],
) {
    rows_out(out, store, |o| {
        o.affine_quantize_f32_ahead(isa, 0, x, a, ahead)
    });
}
paste_generic!(
    /// `affine_quantize_f32_ahead`, then the range of `next` as the lanes
    /// left it, its streaming stores unfenced (only [`RowsOut`] calls it, and
    /// fences).
    affine_then_range_unfenced, affine_quantize_f32_then_range,
    (x: &[f32], a: Affine, out: &mut [i8], store: Store, next: &[f32], ahead: &[f32], magnitude: bool),
    Range<f32>
);

/// `affine_quantize_f32_ahead`, then the range of `next`: as [`range_f32`],
/// or with `magnitude` `(-m, m)` for `m = max |next|` (all a symmetric scale
/// reads), in one loop where the tier fuses them.
#[allow(clippy::too_many_arguments)]
pub fn affine_quantize_f32_then_range(
    isa: Isa,
    x: &[f32],
    a: Affine,
    out: &mut [i8],
    store: Store,
    next: &[f32],
    ahead: &[f32],
    magnitude: bool,
) -> Range<f32> {
    rows_out(out, store, |o| {
        o.affine_quantize_f32_then_range(isa, 0, x, a, next, ahead, magnitude)
    })
}
primitive!(
    /// Affine codes of f64 values (see [`Affine`]).
    affine_quantize_f64(x: &[f64], a: Affine, out: &mut [i8]) -> ()
);
primitive!(
    /// `((q - zp) * scale) as f32`, computed in f64.
    affine_dequantize_f32(q: &[i8], zp: f64, scale: f64, out: &mut [f32], store: Store) -> ()
);
primitive!(
    /// `(q - zp) * scale` in f64.
    affine_dequantize_f64(q: &[i8], zp: f64, scale: f64, out: &mut [f64]) -> ()
);
primitive!(
    /// `out[i] = f16((q[i] as f64 - zp) * scale)`, rounded once, over `min(len)`.
    affine_dequantize_f16(q: &[i8], zp: f64, scale: f64, out: &mut [f16]) -> ()
);
primitive!(
    /// `out[i] = bf16((q[i] as f64 - zp) * scale)`, rounded once, over `min(len)`.
    affine_dequantize_bf16(q: &[i8], zp: f64, scale: f64, out: &mut [bf16]) -> ()
);
primitive!(
    /// Pack pairs of int4 codes into bytes (element 2i in the low nibble).
    pack_int4(q: &[i8], out: &mut [u8]) -> ()
);
primitive!(
    /// Affine int4 codes of f32 pairs, packed two a byte (low nibble first).
    affine_quantize_int4_f32(x: &[f32], a: Affine, out: &mut [u8]) -> ()
);
primitive!(
    /// `affine_quantize_int4_f32`, bringing `ahead` toward the core meanwhile.
    affine_quantize_int4_f32_ahead(x: &[f32], a: Affine, out: &mut [u8], ahead: &[f32]) -> ()
);
paste_generic!(
    /// `affine_quantize_int4_f32_ahead`, then the range of `next` as the
    /// lanes left it (see [`affine_quantize_int4_f32_then_range`]).
    affine_quantize_int4_f32_then_range_lanes, affine_quantize_int4_f32_then_range,
    (x: &[f32], a: Affine, out: &mut [u8], next: &[f32], ahead: &[f32], magnitude: bool),
    Range<f32>
);

/// `affine_quantize_int4_f32_ahead`, then the range of `next` (as
/// [`affine_quantize_f32_then_range`]).
pub fn affine_quantize_int4_f32_then_range(
    isa: Isa,
    x: &[f32],
    a: Affine,
    out: &mut [u8],
    next: &[f32],
    ahead: &[f32],
    magnitude: bool,
) -> Range<f32> {
    let r = affine_quantize_int4_f32_then_range_lanes(isa, x, a, out, next, ahead, magnitude);
    if magnitude {
        r
    } else {
        first_zero_sign(r, next)
    }
}
primitive!(
    /// Unpack bytes into sign-extended int4 codes (low nibble first).
    unpack_int4(p: &[u8], out: &mut [i8]) -> ()
);
