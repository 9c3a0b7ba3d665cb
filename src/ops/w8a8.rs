//! W8A8 integer products — SPEC §3, ported from seed 002 (oxibonsai
//! `w8a8_matvec`) and its batched form.
//!
//! The activation is quantized with the crate's dynamic int8 kernel (MaxAbs,
//! one scale per tensor for the vector, one per row for the batch); each
//! output is the exact integer `acc = Σ w[o, i] · a[i]` (i64; SIMD lanes never
//! overflow, see [`crate::simd::i8_dots`]) turned into
//! `acc as f32 * w_scale[o] * a_scale` in f32, multiplied left to right.
//!
//! Deviations (SPEC): the seed sums in one i32, which wraps past ~133,000
//! products of ±127; here the sum is exact for any length. Non-finite
//! activations and weight scales are errors.
//!
//! Work is split by output rows across the pool; a batch is tiled so each
//! panel of weight rows is read from memory once for a block of tokens that
//! stays in cache. From [`crate::simd::PACKED_MIN_TOKENS`] tokens on, AVX-512
//! VNNI (bytes, `vpdpbusd`) and AVX2 (i16 pairs, `vpmaddwd`) pack each block
//! of tokens once, run outer products over it and rescale in the kernel
//! ([`crate::simd::i8_products`]). Results do not depend on the split or the
//! path: every one is the exact sum, rescaled the same way.
//!
//! ```
//! # fn main() -> Result<(), ferroquant::QuantError> {
//! use ferroquant::ops::w8a8::w8a8_matvec;
//!
//! let weight = [1i8, 2, 3, -1, -2, -3]; // [2, 3], per-row scales
//! let mut out = [0f32; 2];
//! w8a8_matvec(&weight, [2, 3], &[0.5, 0.25], &[1.27f32, 0.0, -1.27], &mut out)?;
//! // The activation becomes codes [127, 0, -127] with scale 0.01:
//! // row 0: (127 - 381) * 0.5 * 0.01.
//! assert_eq!(out, [-254.0 * 0.5 * 0.01, 254.0 * 0.25 * 0.01]);
//! # Ok(())
//! # }
//! ```

use crate::element::Float;
use crate::error::{try_filled, QuantError, Result};
use crate::ops::dynamic::{self, DynCodesMut, DynFormat, ScaleMode};
use crate::parallel;
use crate::simd::{self, Isa, PackedTokens};
use rayon::prelude::*;

/// Bytes of weight rows one task keeps in L2 while every token of a block
/// passes over them.
const PANEL_BYTES: usize = 256 * 1024;
/// Bytes of quantized tokens in one block (read from L2 for every panel).
const TOKEN_BLOCK_BYTES: usize = 512 * 1024;

/// `out[o] = Σ_i weight[o, i] · q(activation)[i]`, rescaled: seed 002's
/// `w8a8_matvec` with an exact sum. `weight` is `[out_features, in_features]`
/// row-major int8, `weight_scales` one f32 per output row.
///
/// Errors, in the seed's order: `EmptyInput` for an empty `activation`;
/// `ShapeMismatch` naming `activation`, `weight`, `weight_scales` or `out`;
/// `NonFinite` naming `weight_scales` or `activation`. `OutOfMemory` when
/// the activation's codes or scales cannot be allocated.
pub fn w8a8_matvec<T: Float>(
    weight: &[i8],
    shape: [usize; 2],
    weight_scales: &[f32],
    activation: &[T],
    out: &mut [f32],
) -> Result<()> {
    let mut codes = try_filled(activation.len(), 0i8, "the activation's codes")?;
    w8a8_matmul_with(
        Isa::detected(),
        weight,
        shape,
        weight_scales,
        activation,
        Batch::Vector,
        &mut codes,
        out,
    )
}

/// `out[t, o] = Σ_i weight[o, i] · q(activations[t])[i]`, rescaled by
/// `weight_scales[o]` and token `t`'s own scale. `activations` is
/// `[tokens, in_features]`; `out` is `[tokens, out_features]`. Zero tokens
/// give an empty result; `in_features == 0` is `EmptyInput`; the other
/// errors are [`w8a8_matvec`]'s.
pub fn w8a8_matmul<T: Float>(
    weight: &[i8],
    shape: [usize; 2],
    weight_scales: &[f32],
    activations: &[T],
    tokens: usize,
    out: &mut [f32],
) -> Result<()> {
    let mut codes = try_filled(activations.len(), 0i8, "the activations' codes")?;
    w8a8_matmul_with(
        Isa::detected(),
        weight,
        shape,
        weight_scales,
        activations,
        Batch::Tokens(tokens),
        &mut codes,
        out,
    )
}

/// The activation side of a product: one vector quantized per tensor
/// (`w8a8_matvec`), or `tokens` rows quantized one scale each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batch {
    /// One activation vector, one scale.
    Vector,
    /// `[tokens, in_features]`, one scale per token.
    Tokens(usize),
}

/// [`w8a8_matvec`] / [`w8a8_matmul`] on a chosen ISA, with the scratch for
/// the activation codes supplied (`codes.len() == activations.len()`).
#[allow(clippy::too_many_arguments)]
pub fn w8a8_matmul_with<T: Float>(
    isa: Isa,
    weight: &[i8],
    shape: [usize; 2],
    weight_scales: &[f32],
    activations: &[T],
    batch: Batch,
    codes: &mut [i8],
    out: &mut [f32],
) -> Result<()> {
    let _env = simd::fpenv::Pinned::new();
    let [out_f, in_f] = shape;
    let (arg, tokens) = match batch {
        Batch::Vector => ("activation", 1),
        Batch::Tokens(t) => ("activations", t),
    };
    let empty = match batch {
        Batch::Vector => activations.is_empty(),
        Batch::Tokens(_) => in_f == 0,
    };
    if empty {
        return Err(QuantError::EmptyInput { arg });
    }
    let want = tokens.checked_mul(in_f);
    if want != Some(activations.len()) {
        let expected = match batch {
            Batch::Vector => format!("{in_f} elements (in_features)"),
            Batch::Tokens(t) => format!("{t} x {in_f} elements"),
        };
        return Err(mismatch(arg, expected, activations.len()));
    }
    if out_f.checked_mul(in_f) != Some(weight.len()) {
        return Err(mismatch(
            "weight",
            format!("{out_f} x {in_f}"),
            weight.len(),
        ));
    }
    if weight_scales.len() != out_f {
        return Err(mismatch(
            "weight_scales",
            format!("{out_f} (out_features)"),
            weight_scales.len(),
        ));
    }
    if codes.len() != activations.len() {
        return Err(mismatch(
            "codes",
            activations.len().to_string(),
            codes.len(),
        ));
    }
    // Checked: `tokens * out_f` past usize would wrap to a small length.
    let n_out = tokens.checked_mul(out_f);
    if n_out != Some(out.len()) {
        let expected = n_out.map_or_else(|| format!("{tokens} x {out_f}"), |n| n.to_string());
        return Err(mismatch("out", expected, out.len()));
    }
    if let Some(i) = weight_scales.iter().position(|s| !s.is_finite()) {
        return Err(QuantError::NonFinite {
            arg: "weight_scales",
            index: i,
        });
    }
    if tokens == 0 || out_f == 0 {
        // Still the activation's errors first: its non-finite values count.
        let mut a_scales = try_filled(tokens.max(1), 0f32, "the activations' scales")?;
        return quantize_activations(isa, activations, batch, in_f, codes, &mut a_scales, arg);
    }
    let mut a_scales = try_filled(tokens, 0f32, "the activations' scales")?;
    quantize_activations(isa, activations, batch, in_f, codes, &mut a_scales, arg)?;
    let dims = Dims {
        isa,
        in_f,
        out_f,
        tokens,
    };
    let block = block_tokens(in_f);
    if simd::i8_dots_packs(isa, tokens.min(block)) {
        // A block of tokens at a time, laid out once and shared by every
        // part of the weight: packed by each part, it was copied four times
        // a thread with the pool; packed all at once, it would hold up to
        // twice the codes' bytes.
        for (b, cb) in codes.chunks(block * in_f).enumerate() {
            let (t0, bt) = (b * block, cb.len() / in_f);
            let packed = [simd::pack_tokens(isa, cb, in_f)];
            let dims = Dims { tokens: bt, ..dims };
            let out = &mut out[t0 * out_f..(t0 + bt) * out_f];
            every_part(dims, weight, weight_scales, &packed, &a_scales[t0..], out);
        }
    } else {
        let blocks: Vec<_> = codes
            .chunks(block * in_f)
            .map(|cb| PackedTokens::unpacked(cb, in_f))
            .collect();
        every_part(dims, weight, weight_scales, &blocks, &a_scales, out);
    }
    Ok(())
}

/// Every part of the weight's rows against the token `blocks` (of
/// [`block_tokens`] each; `dims.tokens` in all), on the pool when the work
/// is large enough.
fn every_part(
    dims: Dims,
    weight: &[i8],
    weight_scales: &[f32],
    blocks: &[PackedTokens<'_>],
    a_scales: &[f32],
    out: &mut [f32],
) {
    let Dims { in_f, out_f, .. } = dims;
    parallel::run(weight.len().saturating_mul(dims.tokens), |par| {
        let rows = part_rows(dims, par);
        // Each part gets the weight from its first row to the end: it reads
        // its own rows and prefetches the next part's first ones.
        let from = |p: usize| &weight[p * rows * in_f..];
        if !par {
            for (p, sp) in weight_scales.chunks(rows).enumerate() {
                let out = &mut out[p * rows..];
                products(dims, from(p), sp, blocks, a_scales, out, out_f);
            }
            return;
        }
        // Each part's results go into `out` a block of tokens at a time, so
        // besides the output no more than a block a thread is held
        // (collecting every part first doubled the peak memory, as it did in
        // the linear layer).
        let out = std::sync::Mutex::new(&mut *out);
        weight_scales
            .par_chunks(rows)
            .enumerate()
            .for_each(|(p, sp)| {
                let mut part = Vec::new();
                products_blocks(
                    dims,
                    from(p),
                    sp,
                    blocks,
                    a_scales,
                    &mut part,
                    |t0, block| {
                        let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                        scatter(&mut out[t0 * out_f..], block, p * rows, sp.len(), out_f);
                    },
                );
            });
    });
}

fn mismatch(arg: &'static str, expected: String, actual: usize) -> QuantError {
    QuantError::ShapeMismatch {
        arg,
        expected,
        actual: actual.to_string(),
    }
}

/// The activation codes and scales: per tensor for a vector, per row for a
/// batch; a non-finite value is reported against the caller's argument name.
fn quantize_activations<T: Float>(
    isa: Isa,
    x: &[T],
    batch: Batch,
    in_f: usize,
    codes: &mut [i8],
    scales: &mut [f32],
    arg: &'static str,
) -> Result<()> {
    let (shape, format, scales) = match batch {
        Batch::Vector => (vec![x.len()], DynFormat::Int8PerTensor, &mut scales[..1]),
        Batch::Tokens(t) => (vec![t, in_f], DynFormat::Int8PerRow, &mut scales[..t]),
    };
    let done = dynamic::dynamic_quantize_with(
        isa,
        x,
        &shape,
        format,
        ScaleMode::MaxAbs,
        DynCodesMut::Int8(codes),
        scales,
    );
    done.map_err(|e| match e {
        QuantError::NonFinite { index, .. } => QuantError::NonFinite { arg, index },
        other => other,
    })
}

#[derive(Clone, Copy)]
struct Dims {
    isa: Isa,
    in_f: usize,
    out_f: usize,
    tokens: usize,
}

/// Tokens in one block: about [`TOKEN_BLOCK_BYTES`], at least 2.
fn block_tokens(in_f: usize) -> usize {
    (TOKEN_BLOCK_BYTES / in_f.max(1)).max(2)
}

/// Weight rows in one panel: about [`PANEL_BYTES`], a multiple of 4 (the
/// kernels take rows in fours), at least 4.
fn panel_rows(in_f: usize) -> usize {
    ((PANEL_BYTES / in_f.max(1)) / 4 * 4).clamp(4, 1024)
}

/// Weight rows in one part of the work: a panel that stays in cache while
/// every block of tokens passes over it, or, where the kernel packs the
/// tokens (once a block, shared by the parts), the most rows a call: all of
/// them, or four parts a thread with the pool (with two a thread, 32 tokens
/// x 4096² at 2 threads took 1.85-3.1 ms from run to run, one slow part
/// holding up the call; with four, 1.8-2.2 ms).
fn part_rows(dims: Dims, par: bool) -> usize {
    let Dims {
        isa,
        in_f,
        out_f,
        tokens,
    } = dims;
    if !simd::i8_dots_packs(isa, tokens.min(block_tokens(in_f))) {
        panel_rows(in_f)
    } else if par {
        out_f
            .div_ceil(4 * parallel::get_num_threads().max(1))
            .max(1)
    } else {
        out_f.max(1)
    }
}

/// One part of weight rows (the first `w_scales.len()` rows of `w`) against
/// every token, block by block (`blocks`: [`TOKEN_BLOCK_BYTES`] of tokens
/// each, packed), rescaled by the kernel into `out[t * stride + r]`.
fn products(
    dims: Dims,
    w: &[i8],
    w_scales: &[f32],
    blocks: &[PackedTokens<'_>],
    a_scales: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let Dims { isa, in_f, .. } = dims;
    let block = block_tokens(in_f);
    for (b, cb) in blocks.iter().enumerate() {
        let (t0, bt) = (b * block, cb.tokens());
        let (a_s, out) = (&a_scales[t0..t0 + bt], &mut out[t0 * stride..]);
        simd::i8_products(isa, w, cb, w_scales, a_s, out, stride);
    }
}

/// [`products`] a block of tokens at a time into `part` (`[block][rows]`),
/// each block handed to `sink` with its first token.
fn products_blocks(
    dims: Dims,
    w: &[i8],
    w_scales: &[f32],
    blocks: &[PackedTokens<'_>],
    a_scales: &[f32],
    part: &mut Vec<f32>,
    mut sink: impl FnMut(usize, &[f32]),
) {
    let Dims { isa, in_f, .. } = dims;
    let (block, rows) = (block_tokens(in_f), w_scales.len());
    for (b, cb) in blocks.iter().enumerate() {
        let (t0, bt) = (b * block, cb.tokens());
        part.resize(bt * rows, 0.0);
        let a_s = &a_scales[t0..t0 + bt];
        simd::i8_products(isa, w, cb, w_scales, a_s, part, rows);
        sink(t0, part);
    }
}

/// Copy a block's `[tokens][rows]` results into `out[tokens][out_f]` from
/// column `first_row`.
fn scatter(out: &mut [f32], part: &[f32], first_row: usize, rows: usize, out_f: usize) {
    for (o, p) in out.chunks_mut(out_f).zip(part.chunks_exact(rows)) {
        o[first_row..first_row + rows].copy_from_slice(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(w: &[i8], shape: [usize; 2], ws: &[f32], codes: &[i8], a_scale: f32) -> Vec<f32> {
        let [o, i] = shape;
        (0..o)
            .map(|r| {
                let acc: i64 = (0..i).map(|j| w[r * i + j] as i64 * codes[j] as i64).sum();
                acc as f32 * ws[r] * a_scale
            })
            .collect()
    }

    #[test]
    fn matvec_is_the_exact_sum_rescaled() {
        let (o, i) = (13usize, 301usize);
        let w: Vec<i8> = (0..o * i).map(|k| ((k * 37) % 256) as u8 as i8).collect();
        let ws: Vec<f32> = (0..o).map(|k| 0.01 + k as f32 * 1e-3).collect();
        let x: Vec<f32> = (0..i).map(|k| (k as f32 * 0.37).sin() * 4.0).collect();
        let mut out = vec![0f32; o];
        w8a8_matvec(&w, [o, i], &ws, &x, &mut out).unwrap();
        let mut codes = vec![0i8; i];
        let mut s = [0f32];
        dynamic::dynamic_quantize(
            &x,
            &[i],
            DynFormat::Int8PerTensor,
            ScaleMode::MaxAbs,
            DynCodesMut::Int8(&mut codes),
            &mut s,
        )
        .unwrap();
        assert_eq!(out, reference(&w, [o, i], &ws, &codes, s[0]));
    }

    #[test]
    fn sums_past_i32_are_exact() {
        // 200,000 products of 127 * 127 overflow i32 (the seed would wrap).
        let i = 200_000;
        let w = vec![127i8; i];
        let x = vec![1.0f32; i];
        for isa in Isa::supported() {
            let mut out = [0f32];
            let mut codes = vec![0i8; i];
            w8a8_matmul_with(
                isa,
                &w,
                [1, i],
                &[1.0],
                &x,
                Batch::Vector,
                &mut codes,
                &mut out,
            )
            .unwrap();
            let exact = (127i64 * 127 * i as i64) as f32 * 1.0 * (1.0f32 / 127.0);
            assert_eq!(out[0], exact, "{isa:?}");
        }
    }

    #[test]
    fn errors_follow_the_seed_order() {
        let w = [1i8; 6];
        let mut out = [0f32; 2];
        let e = w8a8_matvec::<f32>(&w, [2, 3], &[1.0, 1.0], &[], &mut out).unwrap_err();
        assert!(matches!(e, QuantError::EmptyInput { arg: "activation" }));
        let e = w8a8_matvec(&w, [2, 3], &[1.0, 1.0], &[1.0f32; 2], &mut out).unwrap_err();
        assert!(matches!(
            e,
            QuantError::ShapeMismatch {
                arg: "activation",
                ..
            }
        ));
        let e = w8a8_matvec(&w[..5], [2, 3], &[1.0, 1.0], &[1.0f32; 3], &mut out).unwrap_err();
        assert!(matches!(e, QuantError::ShapeMismatch { arg: "weight", .. }));
        let e = w8a8_matvec(&w, [2, 3], &[1.0], &[1.0f32; 3], &mut out).unwrap_err();
        assert!(matches!(
            e,
            QuantError::ShapeMismatch {
                arg: "weight_scales",
                ..
            }
        ));
        let e = w8a8_matvec(&w, [2, 3], &[1.0, f32::NAN], &[1.0f32; 3], &mut out).unwrap_err();
        assert!(matches!(
            e,
            QuantError::NonFinite {
                arg: "weight_scales",
                index: 1
            }
        ));
        let e = w8a8_matvec(
            &w,
            [2, 3],
            &[1.0, 1.0],
            &[1.0, f32::INFINITY, 0.0],
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            QuantError::NonFinite {
                arg: "activation",
                index: 1
            }
        ));
        let e = w8a8_matmul::<f32>(&[], [2, 0], &[1.0, 1.0], &[], 3, &mut [0.0; 6]).unwrap_err();
        assert!(matches!(e, QuantError::EmptyInput { arg: "activations" }));
        w8a8_matmul::<f32>(&w, [2, 3], &[1.0, 1.0], &[], 0, &mut []).unwrap();
    }
}
