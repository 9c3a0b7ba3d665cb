//! Shared drivers: groups of consecutive elements (blocks, rows, tokens), each
//! quantized with its own max-abs scale by an [`AbsmaxRule`], split across the
//! pool at group boundaries with a first-error-wins merge; and their
//! dequantization. Blockwise (SPEC §1) and the activation families (SPEC §3,
//! §4) are built on them.

use crate::element::Float;
use crate::error::{QuantError, Result};
use crate::ops::blockwise::BlockwiseReport;
use crate::parallel;
use crate::simd::{self, AbsmaxRule, Isa, Store, F32_INF_BITS};
use crate::stage::STAGE;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

/// How one task (a run of whole blocks) ended. Tasks never stop at a scale
/// overflow, only at a non-finite value, so the combined outcome is the same
/// whatever the split: the first non-finite index if any, else the first
/// overflowing block.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Outcome {
    pub(crate) non_finite: Option<usize>,
    pub(crate) overflow: Option<(usize, f32)>,
    pub(crate) lossy: usize,
}

impl Outcome {
    fn merge(self, later: Outcome) -> Outcome {
        Outcome {
            non_finite: self.non_finite.or(later.non_finite),
            overflow: self.overflow.or(later.overflow),
            lossy: self.lossy + later.lossy,
        }
    }

    pub(crate) fn into_result(self) -> Result<BlockwiseReport> {
        if let Some(index) = self.non_finite {
            return Err(QuantError::NonFinite { arg: "x", index });
        }
        if let Some((block, scale)) = self.overflow {
            return Err(QuantError::ScaleOverflow { block, scale });
        }
        Ok(BlockwiseReport {
            lossy_blocks: self.lossy,
        })
    }
}

/// A stored scale type: converts the f32 scales and notes overflow / precision
/// loss. Reading them back for dequantization is [`Float::convert_to_f32`].
pub(crate) trait ScaleStore: Float {
    /// Store `src` into `dst`; `first_block` is `src[0]`'s global block index.
    fn store(src: &[f32], dst: &mut [Self], first_block: usize, out: &mut Outcome);
}

impl ScaleStore for f32 {
    fn store(src: &[f32], dst: &mut [f32], _: usize, _: &mut Outcome) {
        dst.copy_from_slice(src);
    }
}

impl ScaleStore for f16 {
    fn store(src: &[f32], dst: &mut [f16], first_block: usize, out: &mut Outcome) {
        dst.convert_from_f32_slice(src);
        for (i, h) in dst.iter().enumerate() {
            if h.is_infinite() {
                out.overflow = out.overflow.or(Some((first_block + i, src[i])));
            } else if !h.is_normal() {
                // The scale is 1.0 for an all-zero block, so a subnormal or
                // zero f16 scale always means max_abs > 0 lost precision.
                out.lossy += 1;
            }
        }
    }
}

pub(crate) fn split_quantize<T: Float, S: ScaleStore>(
    isa: Isa,
    x: &[T],
    bs: usize,
    rule: AbsmaxRule,
    codes: &mut [i8],
    scales: &mut [S],
    par: bool,
) -> Outcome {
    let plan = Plan {
        isa,
        bs,
        rule,
        // Long groups (rows, tokens) of a large output stream their codes, and
        // so do blocks of 64, which a tier may code in batches whose codes it
        // streams as whole lines (a block alone is a line at most).
        store: Store::for_run(
            x.len(),
            if bs == 64 {
                Store::STREAMING_MIN_RUN
            } else {
                bs
            },
            par,
        ),
    };
    if !par {
        return quantize_task(plan, x, codes, scales, 0);
    }
    let per_task = parallel::units_per_task(scales.len(), bs);
    x.par_chunks(per_task * bs)
        .zip(codes.par_chunks_mut(per_task * bs))
        .zip(scales.par_chunks_mut(per_task))
        .enumerate()
        .map(|(t, ((xt, ct), st))| quantize_task(plan, xt, ct, st, t * per_task))
        .reduce(Outcome::default, Outcome::merge)
}

/// Elements of long groups whose maxima are found before their codes: a span
/// (64 KiB of f32) that stays in L2 between its two passes while the next span
/// is prefetched into L2 beside it. On Zen 4 (1 MiB of L2) 16 Ki to 256 Ki
/// elements measured alike; a whole 32 MiB input and single rows were slower.
/// On Zen 3 (512 KiB of L2), in one process against 64 Ki elements, 2048 x
/// 4096 rows after a cache flush: 16 Ki 5-10 % faster on one thread and 9-18 %
/// on two (32 Ki in between, 8 Ki slower again). Tiers that fuse a row's
/// codes with the next row's max ([`Isa::fuses_row_passes`]) take rows of up
/// to this many elements one at a time instead.
const L2_SPAN: usize = 16 * 1024;

/// How groups are quantized: the ISA, the group length, the scale rule and
/// how codes are stored.
#[derive(Clone, Copy)]
struct Plan {
    isa: Isa,
    bs: usize,
    rule: AbsmaxRule,
    store: Store,
}

/// Quantize a run of whole blocks starting at global block `first_block`.
fn quantize_task<T: Float, S: ScaleStore>(
    plan: Plan,
    x: &[T],
    codes: &mut [i8],
    scales: &mut [S],
    first_block: usize,
) -> Outcome {
    let bs = plan.bs;
    let mut out = Outcome::default();
    if let (Some(xf), true) = (T::as_f32_slice(x), bs >= STAGE) {
        // Long groups (rows, tokens), a span of rows at a time: every max |x|
        // (from memory), then every code (the span is still in L2) while the
        // next span is prefetched. Alternating a row's max with its codes left
        // the memory idle half the time; two passes over all of `x` re-read it
        // from memory.
        let mut f32s = vec![0f32; scales.len()];
        if plan.isa.fuses_row_passes() && bs <= L2_SPAN {
            if let Err(i) = quantize_rows_fused(plan, xf, codes, &mut f32s) {
                out.non_finite = Some(first_block * bs + i);
                return out;
            }
            S::store(&f32s, scales, first_block, &mut out);
            return out;
        }
        let rows = (L2_SPAN / bs).max(1);
        let spans = xf
            .chunks(rows * bs)
            .zip(codes.chunks_mut(rows * bs))
            .zip(f32s.chunks_mut(rows));
        for (k, ((xs, cs), ss)) in spans.enumerate() {
            for (b, (xb, s)) in xs.chunks(bs).zip(ss.iter_mut()).enumerate() {
                let m = simd::absmax_bits(plan.isa, xb);
                if m >= F32_INF_BITS {
                    out.non_finite = Some(
                        (first_block + k * rows + b) * bs + simd::scalar::first_non_finite(xb),
                    );
                    return out;
                }
                *s = plan.rule.scale(f32::from_bits(m));
            }
            let next = &xf[((k + 1) * rows * bs).min(xf.len())..];
            let mut nexts = next.chunks(bs);
            for ((xb, cb), &s) in xs.chunks(bs).zip(cs.chunks_mut(bs)).zip(ss.iter()) {
                let ahead = nexts.next().unwrap_or(&[]);
                if s > 0.0 {
                    simd::quantize_scaled_ahead(
                        plan.isa,
                        xb,
                        s,
                        plan.rule.clip,
                        cb,
                        plan.store,
                        ahead,
                    );
                } else {
                    cb.fill(0);
                }
            }
        }
        S::store(&f32s, scales, first_block, &mut out);
        return out;
    }
    // Blocks are handled in groups whose f32 scales fit a small buffer.
    let group = (STAGE / bs).clamp(1, 1024);
    let mut tmp = [0f32; 1024];
    let mut stage = if T::as_f32_slice(x).is_some() {
        Vec::new()
    } else {
        vec![0f32; STAGE.min(group * bs).min(x.len())]
    };
    let groups = x
        .chunks(group * bs)
        .zip(codes.chunks_mut(group * bs))
        .zip(scales.chunks_mut(group));
    for (g, ((xg, cg), sg)) in groups.enumerate() {
        let tmp = &mut tmp[..sg.len()];
        let done = quantize_group(plan, xg, cg, tmp, &mut stage);
        let base_elem = (first_block + g * group) * bs;
        if let Err(i) = done {
            out.non_finite = Some(base_elem + i);
            return out;
        }
        S::store(tmp, sg, first_block + g * group, &mut out);
    }
    out
}

/// Long groups (rows, tokens) of at most [`L2_SPAN`] values, on a tier that
/// fuses a row's codes with the next row's max: row `r + 1` streams in from
/// memory (prefetched while row `r - 1` was coded) while row `r` is coded
/// from cache, and row `r + 2` is prefetched, so the memory never idles
/// through a separate max pass. `Err(i)`: `x[i]` is the first non-finite
/// value (every row before it is coded; none after).
fn quantize_rows_fused(
    plan: Plan,
    x: &[f32],
    codes: &mut [i8],
    scales: &mut [f32],
) -> std::result::Result<(), usize> {
    let bs = plan.bs;
    let row = |r: usize| &x[(r * bs).min(x.len())..((r + 1) * bs).min(x.len())];
    let mut m = simd::absmax_bits_ahead(plan.isa, row(0), row(1));
    // One fence for all rows' streaming stores, when the scope ends.
    simd::rows_out(codes, plan.store, |out| {
        for (r, s) in scales.iter_mut().enumerate() {
            if m >= F32_INF_BITS {
                return Err(r * bs + simd::scalar::first_non_finite(row(r)));
            }
            let scale = plan.rule.scale(f32::from_bits(m));
            *s = scale;
            let (next, ahead) = (row(r + 1), row(r + 2));
            m = if scale > 0.0 {
                let clip = plan.rule.clip;
                out.quantize_scaled_then_absmax(plan.isa, r * bs, row(r), scale, clip, next, ahead)
            } else {
                out.fill(r * bs, bs, 0);
                simd::absmax_bits_ahead(plan.isa, next, ahead)
            };
        }
        Ok(())
    })
}

/// Quantize one group of blocks to codes and f32 scales; `Err(i)` is the
/// group-relative index of the first non-finite value.
fn quantize_group<T: Float>(
    plan: Plan,
    x: &[T],
    codes: &mut [i8],
    scales: &mut [f32],
    stage: &mut [f32],
) -> std::result::Result<(), usize> {
    let Plan {
        isa,
        bs,
        rule,
        store,
    } = plan;
    if let Some(xf) = T::as_f32_slice(x) {
        return simd::absmax_blocks(isa, xf, bs, rule, codes, scales, store);
    }
    if x.len() <= stage.len() {
        // The whole group fits the stage: convert once, run the f32 kernel.
        let st = &mut stage[..x.len()];
        T::convert_to_f32(isa, x, st);
        return simd::absmax_blocks(isa, st, bs, rule, codes, scales, store);
    }
    // One block larger than the stage: two passes over it, converting a
    // stage-full at a time, so no block is ever up-cast whole.
    debug_assert_eq!(scales.len(), 1);
    let mut max_bits = 0u32;
    let step = stage.len();
    for (k, xs) in x.chunks(step).enumerate() {
        let st = &mut stage[..xs.len()];
        T::convert_to_f32(isa, xs, st);
        let m = simd::absmax_bits(isa, st);
        if m >= F32_INF_BITS {
            return Err(k * step + simd::scalar::first_non_finite(st));
        }
        max_bits = max_bits.max(m);
    }
    let scale = rule.scale(f32::from_bits(max_bits));
    scales[0] = scale;
    if scale > 0.0 {
        for (xs, cs) in x.chunks(step).zip(codes.chunks_mut(step)) {
            let st = &mut stage[..xs.len()];
            T::convert_to_f32(isa, xs, st);
            simd::quantize_scaled(isa, st, scale, rule.clip, cs, store);
        }
    } else {
        codes.fill(0);
    }
    Ok(())
}

pub(crate) fn split_dequantize<S: ScaleStore>(
    isa: Isa,
    codes: &[i8],
    bs: usize,
    scales: &[S],
    out: &mut [f32],
    par: bool,
) {
    if !par {
        return dequantize_task(isa, codes, bs, scales, out);
    }
    let per_task = parallel::units_per_task(scales.len(), bs);
    codes
        .par_chunks(per_task * bs)
        .zip(scales.par_chunks(per_task))
        .zip(out.par_chunks_mut(per_task * bs))
        .for_each(|((c, s), o)| dequantize_task(isa, c, bs, s, o));
}

fn dequantize_task<S: ScaleStore>(
    isa: Isa,
    codes: &[i8],
    bs: usize,
    scales: &[S],
    out: &mut [f32],
) {
    let group = (STAGE / bs).clamp(1, 1024);
    let mut tmp = [0f32; 1024];
    let groups = codes
        .chunks(group * bs)
        .zip(scales.chunks(group))
        .zip(out.chunks_mut(group * bs));
    for ((cg, sg), og) in groups {
        let tmp = &mut tmp[..sg.len()];
        S::convert_to_f32(isa, sg, tmp);
        simd::scaled_blocks_dequantize(isa, cg, bs, tmp, og);
    }
}
