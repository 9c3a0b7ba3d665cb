//! L1-sized staging of input the primitives cannot read in place, and the
//! run-level helpers every family's driver is built from.
//!
//! f32 and f64 input is read where it lies; f16 and bf16 input is widened to
//! f32 (exactly) a stage at a time, so no array is ever up-cast whole. A stage
//! of 4 Ki elements (16 KiB of f32) stays in L1 between the conversion and the
//! primitive that reads it.

use crate::element::Float;
use crate::simd::{self, Affine, Isa, Range, RowsOut, Store};

/// Elements per stage: 16 KiB of f32, so a staged run stays in L1 between the
/// conversion and the passes that read it (64 KiB stages made blockwise f16
/// input 1.4x slower at 16M elements).
pub const STAGE: usize = 4 * 1024;

/// Elements of a long single-pass run coded at a time while the next span is
/// prefetched (see [`spans_ahead`]).
pub const AHEAD_SPAN: usize = 16 * 1024;

/// `(offset, span, next span)` over `x` in spans of [`AHEAD_SPAN`]: a pass
/// that streams a large run from memory codes one span while bringing the
/// next toward the core, so the memory keeps working while it computes. On
/// Zen 3 (AVX2, one thread, 16 Mi float32 from memory, interleaved): codes by
/// a max-abs scale 5.2-5.3 ms in one call, 4.1-4.6 ms by spans.
pub fn spans_ahead<T>(x: &[T]) -> impl Iterator<Item = (usize, &[T], &[T])> {
    x.chunks(AHEAD_SPAN).enumerate().map(move |(k, xs)| {
        let next = ((k + 1) * AHEAD_SPAN).min(x.len());
        (
            k * AHEAD_SPAN,
            xs,
            &x[next..(next + AHEAD_SPAN).min(x.len())],
        )
    })
}

/// Scratch space for one task: an f32 stage and an i8 stage.
pub struct Scratch {
    /// Widened input.
    pub f32s: Vec<f32>,
    /// Codes before packing.
    pub codes: Vec<i8>,
    /// f64 results before rounding to a narrower output.
    pub f64s: Vec<f64>,
}

impl Scratch {
    /// Empty scratch; buffers grow to one stage on first use.
    pub fn new() -> Self {
        Scratch {
            f32s: Vec::new(),
            codes: Vec::new(),
            f64s: Vec::new(),
        }
    }

    fn f32s(&mut self, n: usize) -> &mut [f32] {
        if self.f32s.len() < n {
            self.f32s.resize(n, 0.0);
        }
        &mut self.f32s[..n]
    }
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

/// Min and max (in f64, exact) of a run, or `Err(i)` naming its first
/// non-finite element (run-relative); `Ok(None)` for an empty run.
pub fn range<T: Float>(
    isa: Isa,
    x: &[T],
    scratch: &mut Scratch,
) -> Result<Option<(f64, f64)>, usize> {
    if x.is_empty() {
        return Ok(None);
    }
    if let Some(xf) = T::as_f64_slice(x) {
        let r = simd::range_f64(isa, xf);
        if r.non_finite {
            return Err(simd::scalar::first_non_finite_f64(xf));
        }
        return Ok(Some((r.min, r.max)));
    }
    let mut all = Range {
        min: f32::INFINITY,
        max: f32::NEG_INFINITY,
        non_finite: false,
    };
    let mut visit = |off: usize, xf: &[f32]| -> Result<(), usize> {
        let r = simd::range_f32(isa, xf);
        if r.non_finite {
            return Err(off + simd::scalar::first_non_finite(xf));
        }
        all = all.merge(r);
        Ok(())
    };
    if let Some(xf) = T::as_f32_slice(x) {
        visit(0, xf)?;
    } else {
        for (k, xs) in x.chunks(STAGE).enumerate() {
            let st = scratch.f32s(xs.len());
            T::convert_to_f32(isa, xs, st);
            visit(k * STAGE, st)?;
        }
    }
    Ok(Some((all.min as f64, all.max as f64)))
}

/// `(-a, a)` for `a = max |x|` of a run, or `Err(i)` naming its first
/// non-finite element; `Ok(None)` for an empty run. A symmetric map needs no
/// more than this of [`range`], and on f32 input one `absmax_bits` pass costs
/// less than the min and max (other types take [`range`]).
pub fn magnitude_range<T: Float>(
    isa: Isa,
    x: &[T],
    scratch: &mut Scratch,
) -> Result<Option<(f64, f64)>, usize> {
    let Some(xf) = T::as_f32_slice(x) else {
        return range(isa, x, scratch);
    };
    if xf.is_empty() {
        return Ok(None);
    }
    let bits = simd::absmax_bits(isa, xf);
    if bits >= simd::F32_INF_BITS {
        return Err(simd::scalar::first_non_finite(xf));
    }
    let a = f32::from_bits(bits) as f64;
    Ok(Some((-a, a)))
}

/// Affine codes of a run into `out` from byte `at` on, computed in f64 (the
/// output's store applies to f32 and staged input). f32 input brings `ahead`
/// (the next run, or nothing) toward the core meanwhile.
pub fn affine_codes<T: Float>(
    isa: Isa,
    x: &[T],
    a: Affine,
    out: &mut RowsOut<'_>,
    at: usize,
    scratch: &mut Scratch,
    ahead: &[T],
) {
    if let Some(xf) = T::as_f64_slice(x) {
        return out.affine_quantize_f64(isa, at, xf, a);
    }
    if let Some(xf) = T::as_f32_slice(x) {
        let ahead = T::as_f32_slice(ahead).unwrap_or(&[]);
        return out.affine_quantize_f32_ahead(isa, at, xf, a, ahead);
    }
    for (k, xs) in x.chunks(STAGE).enumerate() {
        let st = scratch.f32s(xs.len());
        T::convert_to_f32(isa, xs, st);
        out.affine_quantize_f32_ahead(isa, at + k * STAGE, st, a, &[]);
    }
}

/// `(q - zp) * scale` of a run of codes into `out` (same length), rounded once
/// to `O`; `store` is a hint for f32 output (see [`Store`]).
pub fn affine_values<O: Float>(
    isa: Isa,
    q: &[i8],
    zp: f64,
    scale: f64,
    out: &mut [O],
    scratch: &mut Scratch,
    store: Store,
) {
    if let Some(of) = O::as_f32_mut(out) {
        return simd::affine_dequantize_f32(isa, q, zp, scale, of, store);
    }
    if let Some(of) = O::as_f64_mut(out) {
        return simd::affine_dequantize_f64(isa, q, zp, scale, of);
    }
    if let Some(oh) = O::as_f16_mut(out) {
        return simd::affine_dequantize_f16(isa, q, zp, scale, oh);
    }
    if let Some(ob) = O::as_bf16_mut(out) {
        return simd::affine_dequantize_bf16(isa, q, zp, scale, ob);
    }
    if scratch.f64s.len() < STAGE.min(q.len()) {
        scratch.f64s.resize(STAGE.min(q.len()), 0.0);
    }
    for (qs, os) in q.chunks(STAGE).zip(out.chunks_mut(STAGE)) {
        let st = &mut scratch.f64s[..qs.len()];
        simd::affine_dequantize_f64(isa, qs, zp, scale, st);
        O::convert_from_f64(isa, st, os);
    }
}
