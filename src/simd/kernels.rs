//! The primitive traits: what each ISA implements over one contiguous run.
//!
//! Primitives know no scheme: a clip, a scale rule or an affine map is a
//! parameter, chosen by the family in `ops/`. The scalar implementation
//! (`scalar.rs`) is the specification of every primitive.

use super::Isa;
use half::{bf16, f16};

/// Bits of `+inf` in f32: an absolute value's bits at or above this are non-finite.
pub const F32_INF_BITS: u32 = 0x7f80_0000;

/// From this many tokens on, `i8_products` on AVX2 and `i8_dots` on AVX-512
/// VNNI pack the activations (one copy a call) and run outer products over
/// them (fewer would leave token lanes idle).
pub const PACKED_MIN_TOKENS: usize = 16;

/// A per-group scale rule from the group's max |x| (blockwise, per-token and
/// per-row schemes): `scale = max_abs / divisor` if `max_abs > 0`, else
/// `zero_scale`; codes `clamp(round(v / scale), -clip, clip)`, or all 0 when
/// the scale is not positive (it underflowed, or `zero_scale` is 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AbsmaxRule {
    /// What max |x| is divided by (127 for int8).
    pub divisor: f32,
    /// The scale of an all-zero group.
    pub zero_scale: f32,
    /// Codes are clamped to `[-clip, clip]`, then saturated to i8. Not
    /// negative and not NaN (every scheme's is 1 to 127): the scalar rule
    /// panics on such a clip, as `f32::clamp` does, and the SIMD tiers give
    /// unspecified codes.
    pub clip: f32,
}

impl AbsmaxRule {
    /// The group scale for `max_abs` (finite, >= 0).
    #[inline(always)]
    pub fn scale(&self, max_abs: f32) -> f32 {
        if max_abs > 0.0 {
            max_abs / self.divisor
        } else {
            self.zero_scale
        }
    }
}

/// An affine map to integer codes in f64 (seed 001):
/// `q = clamp(round_half_away(v * inv + zp), qmin, qmax)` — a multiply, then an
/// add, each rounded (never fused).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Affine {
    /// `1 / scale`, or 0 when `|scale| < 1e-30`.
    pub inv: f64,
    /// The zero point (an integer value).
    pub zp: f64,
    /// The smallest code: an integer within i8 (SIMD paths prove codes
    /// in range from it, and clamp as bytes).
    pub qmin: f64,
    /// The largest code: an integer within i8, as `qmin`.
    pub qmax: f64,
    /// An upper bound on `|x|` over every value the codes are computed from
    /// (`f64::INFINITY` when unknown): SIMD paths drop checks it proves cannot
    /// fire. A bound below the true maximum may change codes.
    pub max_abs: f64,
}

/// When f32 input may take the f32 shortcut of the affine map, and its parameters.
///
/// The seed computes `y = fl64(fl64(v * inv) + zp)` and rounds half away from
/// zero. For f32 input `v`, SIMD paths may compute `y32 = fl32(fl32(v * inv32) +
/// zp32)` instead (16 lanes, no conversions) and take its nearest integer,
/// *provided* `|fl32(v * inv32)| <= F32_FAST_LIMIT` and `y32` lies at least
/// [`F32_FAST_MARGIN`] from every half-integer; any other vector is computed in
/// f64. That gives the same code, always:
///
/// - `|zp| <= 1024` and integer, so `zp32 == zp`; `inv32 = f32(inv)` has relative
///   error at most 2^-24 (inv is 0 or a normal f32, see [`Affine::f32_shortcut`]).
/// - With `p = v * inv` exactly: `|p| <= 1000 / (1 - 2^-23)`, `|fl32(v * inv32) -
///   p| <= |p| * 2^-23 * (1 + 2^-24)`, `|fl64(v * inv) - p| <= |p| * 2^-53`, and the
///   two sums round by at most `(|p| + |zp|) * 2^-24` and `* 2^-53`. So
///   `|y32 - y| <= 1000.0002 * 1.2e-7 + 2024.0002 * 6.0e-8 < 2.41e-4 < 2^-11`.
/// - `y32` is within `0.5 - 2^-11` of an integer `k`, so `y` is within
///   `0.5 - 2^-11 + 2.41e-4 < 0.5` of `k`: `k` is `y`'s nearest integer and `y`
///   is no tie, so round-half-away(y) = k, and the clamps agree.
pub const F32_FAST_LIMIT: f32 = 1000.0;
/// See [`F32_FAST_LIMIT`]: `|y32 - nearest integer|` must not exceed `0.5 - 2^-11`.
pub const F32_FAST_MARGIN: f32 = 0.5 - 1.0 / 2048.0;

impl Affine {
    /// `(inv32, zp32)` when f32 input may take the f32 shortcut (see
    /// `F32_FAST_LIMIT`): the zero point is an integer of magnitude at most
    /// 1024 and `inv` is 0 or within f32's normal range.
    #[inline(always)]
    pub fn f32_shortcut(&self) -> Option<(f32, f32)> {
        let inv_ok = self.inv == 0.0 || (self.inv >= 2f64.powi(-120) && self.inv <= 2f64.powi(120));
        let zp_ok = self.zp.abs() <= 1024.0 && self.zp == self.zp.trunc();
        (inv_ok && zp_ok).then_some((self.inv as f32, self.zp as f32))
    }

    /// A bound on `|fl32(v * inv32)|` over `|v| <= max_abs`: `max_abs * |inv|`
    /// widened by `2^-20`, which covers `inv32`'s and the product's rounding.
    fn f32_product_bound(&self) -> f64 {
        self.max_abs * self.inv.abs() * (1.0 + 2f64.powi(-20))
    }

    /// Whether the shortcut's range condition (`|fl32(v * inv32)| <=
    /// F32_FAST_LIMIT`) holds for every input (so needs no check).
    pub fn f32_in_range(&self) -> bool {
        self.f32_product_bound() <= F32_FAST_LIMIT as f64
    }

    /// Whether every code the shortcut produces lies in `[qmin, qmax]` without
    /// a clamp: `|y32| <= Y` (`Y` the product bound plus `|zp|`, widened by
    /// `2^-20` for the add), and a shortcut code is within `0.5 - 2^-11` of
    /// `y32`, so its magnitude is below `Y + 0.5`; `Y < min(qmax, -qmin) + 0.5`
    /// keeps it inside.
    pub fn f32_within_codes(&self) -> bool {
        let y = (self.f32_product_bound() + self.zp.abs()) * (1.0 + 2f64.powi(-20));
        self.f32_in_range() && y < self.qmax.min(-self.qmin) + 0.5
    }
}

/// Min and max of a run, and whether it holds a NaN or an infinity (then
/// `min`/`max` are meaningless).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Range<T> {
    /// The smallest element (+inf for an empty run).
    pub min: T,
    /// The largest element (-inf for an empty run).
    pub max: T,
    /// Some element is NaN or infinite.
    pub non_finite: bool,
}

impl<T: PartialOrd + Copy> Range<T> {
    /// The range of two runs together (exact: a min and a max merge in any order).
    #[inline(always)]
    pub fn merge(self, other: Range<T>) -> Range<T> {
        Range {
            min: if other.min < self.min {
                other.min
            } else {
                self.min
            },
            max: if other.max > self.max {
                other.max
            } else {
                self.max
            },
            non_finite: self.non_finite || other.non_finite,
        }
    }
}

/// The range a symmetric scale reads from `bits`, the bits of max |x| of a
/// run (as `absmax_bits` returns them): `(-m, m)`, non-finite iff `bits` is
/// at least [`F32_INF_BITS`].
#[inline(always)]
pub(crate) fn magnitude(bits: u32) -> Range<f32> {
    let m = f32::from_bits(bits);
    Range {
        min: -m,
        max: m,
        non_finite: bits >= F32_INF_BITS,
    }
}

/// What a tier's codes loop reads beside its own input, a step at a time
/// (the tier's step: 64 floats on AVX-512, 32 on AVX2): nothing, or the next
/// row, whose range it gathers. The fused per-channel loop: the next row
/// streams in from memory while this one is coded from cache.
pub(crate) trait Beside {
    /// Whether another step can be taken.
    fn more(&self) -> bool;
    /// Read the next step's values.
    ///
    /// # Safety
    /// The implementing tier's CPU features must be available and `more()`
    /// must have returned true.
    unsafe fn step(&mut self);
}

/// Nothing beside: the plain codes loop.
pub(crate) struct Nothing;

impl Beside for Nothing {
    #[inline(always)]
    fn more(&self) -> bool {
        false
    }
    #[inline(always)]
    unsafe fn step(&mut self) {}
}

/// How a primitive writes a large output: a hint that never changes a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// Ordinary stores: the output stays in cache for whatever reads it next.
    Cached,
    /// Non-temporal stores where the ISA has them: the output goes to memory
    /// without first being read into cache (saves a read of every output line
    /// the cache does not hold). For outputs too large to stay in cache anyway.
    ///
    /// The code primitives (`quantize_scaled*`, `affine_quantize_f32*`) leave
    /// them unfenced: their dispatchers fence once per call, or once per
    /// `dispatch::RowsOut` scope of many calls (a fence waits for the last
    /// lines to reach memory: ~10 % of per-row int8 time at 4096-value rows
    /// on Zen 4 when paid a row).
    Streaming,
}

impl Store {
    /// Outputs of at least this many bytes are streamed. Measured per tensor at
    /// 16 Mi float32 (16 MiB of codes), one thread, interleaved with ONNX Runtime:
    /// 6.2 → 5.6 ms; a 64 MiB float32 dequantize output likewise gains.
    pub const STREAMING_MIN_BYTES: usize = 8 << 20;

    /// Runs (one primitive call) shorter than this are never streamed: each
    /// pays a masked head (and, before fences moved to `dispatch::RowsOut`
    /// scopes, a fence), and short per-channel rows (64 float32 values) of a
    /// large output ran up to 10x slower streamed. Not re-measured since.
    pub const STREAMING_MIN_RUN: usize = 4096;

    /// [`Store::Streaming`] for a run of `run` bytes of an output of `total`
    /// bytes when both are large enough and the call runs on one thread, else
    /// [`Store::Cached`]. From two threads at once, streaming stores made per
    /// tensor int8 (16 Mi) 6.3 ms instead of 4.3 and dequantize 4.0 instead of
    /// 2.3 on the 2-vCPU build VM; on one thread they save 15-20 %.
    pub fn for_run(total: usize, run: usize, parallel: bool) -> Store {
        if !parallel && total >= Self::STREAMING_MIN_BYTES && run >= Self::STREAMING_MIN_RUN {
            Store::Streaming
        } else {
            Store::Cached
        }
    }
}

/// The per-ISA primitives the generic loops are built from.
///
/// # Safety
/// Implementations may use instructions of their ISA: call them only from a
/// function compiled with (and a CPU that has) those target features. Every
/// primitive works over `min(len)` of its slices unless it says otherwise.
pub(crate) trait Kernels {
    /// Largest `bits(x) & 0x7fff_ffff` over `x` (0 for empty): the bits of
    /// max |x|, and `>= F32_INF_BITS` iff some element is NaN or infinite.
    unsafe fn absmax_bits(x: &[f32]) -> u32;
    /// `absmax_bits`, bringing `ahead` toward the core meanwhile.
    unsafe fn absmax_bits_ahead(x: &[f32], ahead: &[f32]) -> u32 {
        let _ = ahead;
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::absmax_bits(x) }
    }
    /// `out[i] = clamp(round_half_away(x[i] / scale), -clip, clip)`.
    unsafe fn quantize_scaled(x: &[f32], scale: f32, clip: f32, out: &mut [i8], store: Store);
    /// `quantize_scaled`, bringing `ahead` toward the core meanwhile.
    unsafe fn quantize_scaled_ahead(
        x: &[f32],
        scale: f32,
        clip: f32,
        out: &mut [i8],
        store: Store,
        ahead: &[f32],
    ) {
        let _ = ahead;
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::quantize_scaled(x, scale, clip, out, store) }
    }
    /// `quantize_scaled_ahead(x, ..)`, then `absmax_bits(next)`: codes of one
    /// row and the max |x| of the next, `ahead` (the row after) brought
    /// toward the core meanwhile. A tier may fuse the two loops, so the next
    /// row streams from memory while this one is coded from cache.
    #[allow(clippy::too_many_arguments)]
    unsafe fn quantize_scaled_then_absmax(
        x: &[f32],
        scale: f32,
        clip: f32,
        out: &mut [i8],
        store: Store,
        next: &[f32],
        ahead: &[f32],
    ) -> u32 {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            Self::quantize_scaled_ahead(x, scale, clip, out, store, ahead);
            Self::absmax_bits(next)
        }
    }
    /// Exact integer dot products of int8 rows with int8 tokens:
    /// `out[r * tokens + t] = Σ_i w[r·k + i] · a[t·k + i]` for the first
    /// `rows` rows of `w` and the `tokens = a.len() / k` rows of `a`
    /// (`k >= 1`, `w.len() >= rows · k`, `out.len() >= rows · tokens`).
    /// Bytes of `w` past those rows are not read, only prefetched (the next
    /// call's rows). Exact for any `k` and any bytes (see `scalar::i8_dot`).
    unsafe fn i8_dots(w: &[i8], rows: usize, a: &[i8], k: usize, out: &mut [i64]);
    /// The tier whose layout [`Kernels::pack_tokens`] writes, if it packs.
    const PACKS: Option<Isa> = None;
    /// The tokens of `a` (`k >= 1` wide) laid out for this tier's outer
    /// products; `None` where the tier has no packed form, below
    /// [`PACKED_MIN_TOKENS`] tokens, or when the copy cannot be allocated.
    unsafe fn pack_tokens(a: &[i8], k: usize) -> Option<Vec<u32>> {
        let _ = (a, k);
        None
    }
    /// The rescaled W8A8 products of the first `rows = w_scales.len()` rows
    /// of `w` (stride `k`) with the `tokens` of `p`:
    /// `out[t·stride + r] = (acc as f32 · w_scales[r]) · a_scales[t]`, `acc`
    /// the exact sum of `i8_dots`, in f32, left to right (`rows <= stride`,
    /// `a_scales.len() >= tokens`, `out` holding `(tokens - 1)·stride + rows`
    /// values). Bytes of `w` past those rows are only prefetched. Tokens
    /// packed by another tier (or not at all) go through `i8_dots`. Tokens
    /// zero wide (`p.k == 0`) write nothing.
    #[inline(always)]
    unsafe fn i8_products(
        w: &[i8],
        p: &PackedTokens<'_>,
        w_scales: &[f32],
        a_scales: &[f32],
        out: &mut [f32],
        stride: usize,
    ) {
        if p.k == 0 {
            return; // no products (and no token count) for zero-width tokens
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { products_via_dots::<Self>(w, p.codes, p.k, w_scales, a_scales, out, stride) }
    }
    /// For each row `r < out.len()`: `out[r] = (Σ x[i] · (q[r·stride + i] as
    /// f32 - zps[r])) · scales[r]` over `i < x.len()`, the sum in the order
    /// of `scalar::dot_lanes` (64 lanes of fused multiply-adds, then a tree)
    /// and scaled once. The caller keeps subnormal `x` away (a product of
    /// one with a small code would round to the subnormal grid, where the
    /// scale could magnify the error) and redoes a non-finite result (the
    /// unscaled sum can leave float32's range where the scaled one would not).
    unsafe fn dot_dequant_i8_rows(
        q: &[i8],
        stride: usize,
        zps: &[f32],
        scales: &[f32],
        x: &[f32],
        out: &mut [f32],
    );
    /// For each row `r < out.len()`: the int4 dot product of the `n` codes
    /// packed from byte `r·stride` of `p` (low nibble first) with `xs`, the
    /// activation in `scalar::nibble_planes` order, as
    /// `scalar::dot_dequant_i4_spec`.
    unsafe fn dot_dequant_i4_rows(
        p: &[u8],
        stride: usize,
        n: usize,
        zps: &[f32],
        scales: &[f32],
        xs: &[f32],
        out: &mut [f32],
    );
    /// `out[i] = q[i] as f32 * scale`.
    unsafe fn dequantize_scaled(q: &[i8], scale: f32, out: &mut [f32]);
    /// `out[i] = f32(x[i])`, exact.
    unsafe fn f16_to_f32(x: &[f16], out: &mut [f32]);
    /// `out[i] = f32(x[i])`, exact.
    unsafe fn bf16_to_f32(x: &[bf16], out: &mut [f32]);
    /// `out[i] = x[i] as f32` (round to nearest even).
    unsafe fn f64_to_f32(x: &[f64], out: &mut [f32]);
    /// `out[i] = x[i]` rounded to f32 *to odd*
    /// ([`crate::element::f64_to_f32_round_to_odd`]), so a later rounding to
    /// f16 or bf16 rounds `x` once. NaN converts as `as f32` does.
    unsafe fn f64_to_f32_odd(x: &[f64], out: &mut [f32]);
    /// `out[i] = bf16(x[i])`, round to nearest even, NaN quieted with its
    /// payload's top bits kept (as the `half` crate does).
    unsafe fn f32_to_bf16(x: &[f32], out: &mut [bf16]);
    /// `out[i] = f16(x[i])`, IEEE round to nearest even, NaN quieted with its
    /// payload's top bits kept (as the `half` crate and F16C do).
    unsafe fn f32_to_f16(x: &[f32], out: &mut [f16]);
    /// [`f32_to_f16`](Self::f32_to_f16) with the output written by streaming
    /// stores where the ISA has them (after a head that aligns it to a line),
    /// fenced before returning: for outputs too large to stay in cache (no
    /// line of the output is read first). The same bits.
    unsafe fn f32_to_f16_streamed(x: &[f32], out: &mut [f16]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::f32_to_f16(x, out) }
    }
    /// [`f16_to_f32`](Self::f16_to_f32) with the output written by streaming
    /// stores where the ISA has them, as
    /// [`f32_to_f16_streamed`](Self::f32_to_f16_streamed). The same bits.
    unsafe fn f16_to_f32_streamed(x: &[f16], out: &mut [f32]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::f16_to_f32(x, out) }
    }

    /// `(Σ (x - k), Σ (x - k)²)` in f64 over a run, in a fixed order every ISA
    /// follows: element `i` goes to lane `i % 16` (each `d = x - k` rounded,
    /// `d * d` rounded, then added), and the 16 lanes are added in lane order.
    unsafe fn shifted_moments(x: &[f32], k: f64) -> (f64, f64);
    /// Blocks of `block` values (32, 64 or 128), the start of
    /// [`absmax_blocks`](super::absmax_blocks)'s loop: for each block of `x`
    /// (`x.len() / block` whole blocks, `codes` as long, `scales` one a
    /// block), `scales[b] = rule.scale(max |x|)`, then codes as
    /// `quantize_scaled` (or zeros for a zero scale). With
    /// [`Store::Streaming`] a tier may stream whole lines of codes, left
    /// unfenced (the caller fences). Returns how many blocks it did, from the
    /// first: a tier may do none (this default, and every tier for other
    /// block sizes), leave a tail, or stop before a block holding a
    /// non-finite value; the caller does the rest the general way.
    unsafe fn absmax_blocks_batched(
        x: &[f32],
        block: usize,
        rule: AbsmaxRule,
        codes: &mut [i8],
        scales: &mut [f32],
        store: Store,
    ) -> usize {
        let _ = (x, block, rule, codes, scales, store);
        0
    }
    /// `acc[j] = max(acc[j], bits(row[j]) & 0x7fff_ffff)` over `min(len)`:
    /// running column maxima of |x| as bit patterns.
    unsafe fn absmax_columns(row: &[f32], acc: &mut [u32]);
    /// Appends to `out`, in order, the |x| bit patterns at or above
    /// `threshold`; returns the largest |x| bit pattern below it (0 if none).
    unsafe fn select_at_least(x: &[f32], threshold: u32, out: &mut Vec<u32>) -> u32;
    /// Min, max and the non-finite flag of an f32 run, in one pass.
    unsafe fn range_f32(x: &[f32]) -> Range<f32>;
    /// Min, max and the non-finite flag of an f64 run, in one pass.
    unsafe fn range_f64(x: &[f64]) -> Range<f64>;
    /// `out[i] = affine code of (x[i] as f64)` (see [`Affine`]).
    unsafe fn affine_quantize_f32(x: &[f32], a: Affine, out: &mut [i8], store: Store);
    /// `affine_quantize_f32`, bringing `ahead` toward the core meanwhile (a
    /// line of it for every 16 values coded: the next run, read while this
    /// one is coded from cache).
    #[inline(always)]
    unsafe fn affine_quantize_f32_ahead(
        x: &[f32],
        a: Affine,
        out: &mut [i8],
        store: Store,
        ahead: &[f32],
    ) {
        let _ = ahead;
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::affine_quantize_f32(x, a, out, store) }
    }
    /// The range of a run as a scale reads it: `range_f32(x)`, or with
    /// `magnitude` [`magnitude`]`(absmax_bits(x))` (lanes as they fall; the
    /// dispatcher's `row_range` fixes a zero extreme's sign).
    #[inline(always)]
    unsafe fn row_range(x: &[f32], magnitude: bool) -> Range<f32> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            if magnitude {
                self::magnitude(Self::absmax_bits(x))
            } else {
                Self::range_f32(x)
            }
        }
    }
    /// `affine_quantize_f32_ahead(x, ..)`, then `row_range(next, magnitude)`
    /// (with `magnitude`, all a symmetric scale reads). A tier may fuse the two loops, so the
    /// next row streams in from memory while this one is coded from cache.
    #[allow(clippy::too_many_arguments)]
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
        // SAFETY: forwarded from this function's contract.
        unsafe {
            Self::affine_quantize_f32_ahead(x, a, out, store, ahead);
            Self::row_range(next, magnitude)
        }
    }
    /// `out[i] = affine code of x[i]` (see [`Affine`]).
    unsafe fn affine_quantize_f64(x: &[f64], a: Affine, out: &mut [i8]);
    /// `out[i] = ((q[i] as f64 - zp) * scale) as f32`.
    unsafe fn affine_dequantize_f32(q: &[i8], zp: f64, scale: f64, out: &mut [f32], store: Store);
    /// `out[i] = (q[i] as f64 - zp) * scale`.
    unsafe fn affine_dequantize_f64(q: &[i8], zp: f64, scale: f64, out: &mut [f64]);
    /// `out[i] = f16((q[i] as f64 - zp) * scale)`, rounded once to nearest
    /// even, over `min(len)`. By default the f64 values, rounded to odd at
    /// f32, then to f16, through a short run on the stack.
    #[inline(always)]
    unsafe fn affine_dequantize_f16(q: &[i8], zp: f64, scale: f64, out: &mut [f16]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { narrow_staged::<Self, f16>(q, zp, scale, out) }
    }
    /// `out[i] = bf16((q[i] as f64 - zp) * scale)`, as
    /// [`Kernels::affine_dequantize_f16`].
    #[inline(always)]
    unsafe fn affine_dequantize_bf16(q: &[i8], zp: f64, scale: f64, out: &mut [bf16]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { narrow_staged::<Self, bf16>(q, zp, scale, out) }
    }
    /// Pack pairs of 4-bit two's-complement codes: `out[i] = (q[2i] & 15) |
    /// (q[2i+1] & 15) << 4`, over `min(q.len() / 2, out.len())` bytes.
    unsafe fn pack_int4(q: &[i8], out: &mut [u8]);
    /// Affine int4 codes of f32 pairs, packed: `out[i]` holds the codes of
    /// `x[2i]` (low nibble) and `x[2i + 1]`, over `min(x.len() / 2, out.len())`
    /// bytes; as `affine_quantize_f32` then `pack_int4`, without the stage.
    #[inline(always)]
    unsafe fn affine_quantize_int4_f32(x: &[f32], a: Affine, out: &mut [u8]) {
        let n = (x.len() / 2).min(out.len());
        let mut codes = [0i8; 64];
        for (xs, os) in x[..2 * n].chunks(64).zip(out[..n].chunks_mut(32)) {
            let cs = &mut codes[..xs.len()];
            // SAFETY: forwarded from this function's contract.
            unsafe {
                Self::affine_quantize_f32(xs, a, cs, Store::Cached);
                Self::pack_int4(cs, os);
            }
        }
    }
    /// `affine_quantize_int4_f32`, bringing `ahead` toward the core meanwhile
    /// (as `affine_quantize_f32_ahead`).
    #[inline(always)]
    unsafe fn affine_quantize_int4_f32_ahead(x: &[f32], a: Affine, out: &mut [u8], ahead: &[f32]) {
        let _ = ahead;
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::affine_quantize_int4_f32(x, a, out) }
    }
    /// `affine_quantize_int4_f32_ahead(x, ..)`, then the range of `next` (as
    /// `affine_quantize_f32_then_range`).
    #[inline(always)]
    unsafe fn affine_quantize_int4_f32_then_range(
        x: &[f32],
        a: Affine,
        out: &mut [u8],
        next: &[f32],
        ahead: &[f32],
        magnitude: bool,
    ) -> Range<f32> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            Self::affine_quantize_int4_f32_ahead(x, a, out, ahead);
            Self::row_range(next, magnitude)
        }
    }
    /// Unpack: `out[2i]` is the sign-extended low nibble of `p[i]`, `out[2i+1]`
    /// the high one, over `min(p.len(), out.len() / 2)` bytes.
    unsafe fn unpack_int4(p: &[u8], out: &mut [i8]);
}

/// Int8 tokens for `simd::i8_products`, laid out once (by
/// `simd::pack_tokens`) and shared by every part of a call: each part used
/// to pack its own copy, four a thread with the pool.
pub struct PackedTokens<'a> {
    /// The tokens as given, `k` wide: every tier can read them.
    pub(crate) codes: &'a [i8],
    pub(crate) k: usize,
    /// The tier whose layout `words` is in; `None` when nothing was packed.
    pub(crate) by: Option<Isa>,
    pub(crate) words: Vec<u32>,
}

/// The most words a thread keeps from its last [`PackedTokens`] for the
/// next (4 MiB): a block of tokens at the usual widths fits, a rare huge
/// one is freed.
const SPARE_WORDS_MAX: usize = 1 << 20;

thread_local! {
    /// The packed words' buffer of this thread's last [`PackedTokens`],
    /// emptied, for the next pack on it. Fresh memory faults its pages in
    /// on every call: 62 of the 83 µs that packing 32 tokens x 4096 took
    /// on a 2-vCPU VM, on the calling thread before the pool starts (4 % of
    /// a 2-thread `w8a8_matmul`).
    static SPARE_WORDS: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// An empty buffer for packed words: this thread's spare (see
/// [`SPARE_WORDS_MAX`]) or a new one.
pub(crate) fn spare_words() -> Vec<u32> {
    SPARE_WORDS.try_with(|s| s.take()).unwrap_or_default()
}

impl Drop for PackedTokens<'_> {
    fn drop(&mut self) {
        let mut words = std::mem::take(&mut self.words);
        if words.capacity() > 0 && words.capacity() <= SPARE_WORDS_MAX {
            words.clear();
            // A thread being torn down has no spare to keep: the buffer is freed.
            let _ = SPARE_WORDS.try_with(|s| s.set(words));
        }
    }
}

impl<'a> PackedTokens<'a> {
    /// `codes` (`k >= 1` wide) as they are, packed by no tier.
    pub fn unpacked(codes: &'a [i8], k: usize) -> Self {
        PackedTokens {
            codes,
            k,
            by: None,
            words: Vec::new(),
        }
    }

    /// The tier whose layout the tokens were packed in, `None` if unpacked.
    pub fn layout(&self) -> Option<Isa> {
        self.by
    }

    /// The number of tokens.
    pub fn tokens(&self) -> usize {
        self.codes.len() / self.k.max(1)
    }

    /// The packed words, if tier `isa` laid them out.
    pub(crate) fn packed_by(&self, isa: Option<Isa>) -> Option<&[u32]> {
        (isa.is_some() && self.by == isa).then_some(&self.words[..])
    }
}

/// Rows a block of [`products_via_dots`] sums at once.
const PRODUCT_ROWS: usize = 64;

/// `Kernels::i8_products` through the tier's own `i8_dots`, a block of rows
/// at a time, then the rescale: the form every tier has.
#[inline(always)]
pub(crate) unsafe fn products_via_dots<K: Kernels + ?Sized>(
    w: &[i8],
    a: &[i8],
    k: usize,
    w_scales: &[f32],
    a_scales: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let (rows, tokens) = (w_scales.len().min(w.len() / k), a.len() / k);
    let mut acc = vec![0i64; PRODUCT_ROWS.min(rows) * tokens];
    for r0 in (0..rows).step_by(PRODUCT_ROWS) {
        let n = PRODUCT_ROWS.min(rows - r0);
        let acc = &mut acc[..n * tokens];
        // SAFETY: forwarded from this function's contract.
        unsafe { K::i8_dots(&w[r0 * k..], n, a, k, acc) };
        for (t, &a_scale) in a_scales[..tokens].iter().enumerate() {
            let row = &mut out[t * stride + r0..][..n];
            for (r, o) in row.iter_mut().enumerate() {
                *o = acc[r * tokens + t] as f32 * w_scales[r0 + r] * a_scale;
            }
        }
    }
}

/// A 16-bit float that `K` rounds f32 runs to (a trait rather than a
/// function pointer, so the call inlines into `K`'s target features).
trait Narrow: Sized {
    /// `K::f32_to_f16` or `K::f32_to_bf16`.
    ///
    /// # Safety
    /// `K`'s contract.
    unsafe fn from_f32s<K: Kernels + ?Sized>(x: &[f32], out: &mut [Self]);
}

impl Narrow for f16 {
    #[inline(always)]
    unsafe fn from_f32s<K: Kernels + ?Sized>(x: &[f32], out: &mut [Self]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { K::f32_to_f16(x, out) }
    }
}

impl Narrow for bf16 {
    #[inline(always)]
    unsafe fn from_f32s<K: Kernels + ?Sized>(x: &[f32], out: &mut [Self]) {
        // SAFETY: forwarded from this function's contract.
        unsafe { K::f32_to_bf16(x, out) }
    }
}

/// `(q - zp) * scale` rounded once to a 16-bit float, through f64 and
/// round-to-odd f32 runs on the stack (`K`'s own primitives).
///
/// # Safety
/// `K`'s contract: the CPU has the features its kernels use.
#[inline(always)]
unsafe fn narrow_staged<K: Kernels + ?Sized, T: Narrow>(
    q: &[i8],
    zp: f64,
    scale: f64,
    out: &mut [T],
) {
    const RUN: usize = 128;
    let (mut wide, mut odd) = ([0f64; RUN], [0f32; RUN]);
    for (qs, os) in q.chunks(RUN).zip(out.chunks_mut(RUN)) {
        let n = qs.len().min(os.len());
        // SAFETY: forwarded from this function's contract.
        unsafe {
            K::affine_dequantize_f64(&qs[..n], zp, scale, &mut wide[..n]);
            K::f64_to_f32_odd(&wide[..n], &mut odd[..n]);
            T::from_f32s::<K>(&odd[..n], &mut os[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sym(qm: f64, amax: f64) -> Affine {
        Affine {
            inv: 1.0 / (amax / qm),
            zp: 0.0,
            qmin: -qm,
            qmax: qm,
            max_abs: amax,
        }
    }

    #[test]
    fn bounds_drop_only_the_checks_they_prove_idle() {
        // A symmetric map over its own range never needs the range check or a clamp.
        for amax in [1e-20, 0.37, 3.0, 1e6, 3e30] {
            assert!(sym(127.0, amax).f32_within_codes(), "{amax}");
            assert!(sym(7.0, amax).f32_within_codes(), "{amax}");
        }
        // Unknown bound: keep both.
        let unknown = Affine {
            max_abs: f64::INFINITY,
            ..sym(127.0, 3.0)
        };
        assert!(!unknown.f32_in_range() && !unknown.f32_within_codes());
        // Asymmetric: the zero point can push a code past qmax (clamp), though
        // the product stays in range.
        let asym = Affine {
            inv: 255.0 / 4.0,
            zp: -128.0 + 64.0,
            qmin: -128.0,
            qmax: 127.0,
            max_abs: 3.0,
        };
        assert!(asym.f32_in_range() && !asym.f32_within_codes());
        // Products above F32_FAST_LIMIT keep the range check.
        let wide = Affine {
            inv: 1.0,
            zp: 0.0,
            qmin: -127.0,
            qmax: 127.0,
            max_abs: 1001.0,
        };
        assert!(!wide.f32_in_range());
    }
}
