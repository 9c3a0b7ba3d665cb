//! The forward pass of a quantized linear layer — SPEC §2's
//! `QuantizedLinear.forward`, `y = x @ dequant(W).T + bias`, without ever
//! holding the dequantized float32 weight.
//!
//! `W` is `[out, in]` int8 or packed int4 codes with one affine `(scale, zp)`
//! per output row (per channel) or one for the tensor. Two paths:
//!
//! - A few tokens: each output is `scale · Σ x_i · (q_i − zp) + bias`, the
//!   codes dequantized inside the dot product (`q − zp` converted, or for
//!   int4 on AVX-512 picked from a 16-entry table), each row's sum scaled
//!   once ([`crate::simd::dot_dequant_i8_rows`], `_i4`), rows split across
//!   the pool. The weight is read once per
//!   call at its quantized size (1 or ½ byte an element).
//! - Many tokens: panels of weight rows are dequantized exactly as
//!   `dequantize` does (f64 math, rounded once to the weight's dtype, then
//!   widened to f32) into a scratch panel of [`PANEL_BYTES`], and multiplied
//!   by a register-blocked f32 GEMM (the `gemm` crate), panels across the
//!   pool. A float16/bfloat16 weight takes this path for any token count
//!   (in smaller panels): its values are rounded to 11 or 8 bits, which the
//!   dot products' f32 `(q − zp) · scale` does not do.
//!
//! Results are within float32 rounding of `x @ dequant(W).T + bias`; the
//! summation order is fixed (not the reference's), so they do not depend on
//! the ISA or the thread count.

use crate::element::Float;
use crate::error::{try_filled, QuantError, Result};
use crate::ops::pack::packed_len;
use crate::parallel;
use crate::simd::{self, Isa, Store};
use crate::stage::{self, Scratch};
use half::{bf16, f16};
use rayon::prelude::*;

/// From this many tokens on, the panel GEMM path runs.
pub const GEMM_MIN_TOKENS: usize = 8;
/// Bytes of one dequantized f32 weight panel (the GEMM path's only scratch):
/// the GEMM packs the tokens again for every panel, so panels are large (at
/// batch 64 on 4096², 2 MiB panels ran at 0.69x NumPy's GEMM, 8 MiB at 0.9x
/// on Zen 3; 32 MiB fell out of cache at 0.3x).
pub const PANEL_BYTES: usize = 8 * 1024 * 1024;
/// The panel size below [`GEMM_MIN_TOKENS`] tokens (weights that take the
/// panel path for their values: float16/bfloat16 ones, or scales the f32 dot
/// products cannot hold): with little reuse per panel, it should stay in L2.
/// At batch 1 on a 4096² int8 float16 weight (Zen 4, 1 MiB L2): 8 MiB 13.4
/// ms, 1 MiB 5.8, 256 KiB 4.7, 64 KiB 5.7, 16 KiB 6.2.
const FEW_TOKENS_PANEL_BYTES: usize = 256 * 1024;

/// The codes of a quantized weight, row-major `[out, in]`.
#[derive(Debug, Clone, Copy)]
pub enum WeightCodes<'a> {
    /// One int8 code an element.
    Int8(&'a [i8]),
    /// int4 codes packed two a byte (element `2i` in the low nibble), over
    /// the flattened weight.
    Int4(&'a [u8]),
}

/// A quantized weight: codes and affine parameters (`out` of each, or one
/// for the whole tensor), values `(q − zp) · scale`.
#[derive(Debug, Clone, Copy)]
pub struct QuantizedWeight<'a> {
    /// The codes.
    pub codes: WeightCodes<'a>,
    /// `[out_features, in_features]`.
    pub shape: [usize; 2],
    /// Scales, `out_features` of them or 1.
    pub scales: &'a [f64],
    /// Zero points, as many as scales.
    pub zero_points: &'a [f64],
    /// The dtype the weight dequantizes to (`dequantize` returns the source
    /// tensor's dtype): the forward pass is held to the weight's values as
    /// that dtype holds them.
    pub dequant: DequantDtype,
}

/// The dtype a weight's `dequantize` gives: `(q - zp) · scale` in f64,
/// rounded once to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DequantDtype {
    /// float32 (a value past f32's range is ±inf).
    #[default]
    F32,
    /// float64: values keep their f64 value, also past f32's range.
    F64,
    /// float16: values rounded to f16 (±inf past 65504).
    F16,
    /// bfloat16: values rounded to bf16.
    Bf16,
}

impl DequantDtype {
    /// The dtype NumPy names `name` (`"float32"`, `"float64"`, `"float16"`,
    /// `"bfloat16"`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "float32" => Some(Self::F32),
            "float64" => Some(Self::F64),
            "float16" => Some(Self::F16),
            "bfloat16" => Some(Self::Bf16),
            _ => None,
        }
    }

    /// `v` rounded once to this dtype, widened back to f64 (exact).
    pub fn round(self, v: f64) -> f64 {
        match self {
            Self::F32 => f32::from_f64_once(v) as f64,
            Self::F64 => v,
            Self::F16 => f16::from_f64_once(v).to_f64(),
            Self::Bf16 => bf16::from_f64_once(v).to_f64(),
        }
    }

    /// Whether the f32 paths' weight values (rounded once to f32) can
    /// differ from this dtype's by more than f32 rounding: f16 and bf16
    /// round to fewer bits, so their weights take the panel path, which
    /// rounds each value as `dequantize` does.
    fn coarser_than_f32(self) -> bool {
        matches!(self, Self::F16 | Self::Bf16)
    }
}

/// `out[t, o] = Σ_i x[t, i] · dequant(W)[o, i] + bias[o]` for `tokens` rows
/// of `x` (`[tokens, in]`), `out` `[tokens, out]`.
///
/// Errors: `ShapeMismatch` naming `weight`, `scales`, `x`, `bias` or `out`;
/// `NonFinite` naming `x` or `bias` (first flat index); `OutOfMemory` when
/// working memory sized by `x` or `out` cannot be allocated.
pub fn linear_forward(
    w: &QuantizedWeight<'_>,
    x: &[f32],
    tokens: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    linear_forward_with(Isa::detected(), w, x, tokens, bias, out)
}

/// How many bytes of float32 activation [`linear_forward_from`] converts at a
/// time (or one token, when a row is longer): from 8 tokens, a block this large
/// costs one more pass over the weight's panels, a few per mille of its product.
pub const CONVERT_BYTES: usize = 8 << 20;

/// [`linear_forward`] for an activation of any float type: float32 is read in
/// place; float64, float16 and bfloat16 are converted value by value to
/// float32 (a float64 past float32's range becomes ±inf: `NonFinite`) a block
/// of tokens at a time ([`CONVERT_BYTES`], or one token), in the default
/// floating-point environment, never the whole activation at once. A block's
/// tokens are summed as a call with those tokens alone would sum them; the
/// result stays within float32 rounding of the reference.
///
/// Errors: as [`linear_forward`] (a `NonFinite` index counts from the start of
/// `x`).
pub fn linear_forward_from<T: Float>(
    w: &QuantizedWeight<'_>,
    x: &[T],
    tokens: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    if let Some(xf) = T::as_f32_slice(x) {
        return linear_forward(w, xf, tokens, bias, out);
    }
    // The conversion too: a caller's flush-to-zero flags would zero subnormals.
    let _env = simd::fpenv::Pinned::new();
    validate(w, x.len(), tokens, bias, out.len())?;
    let [out_f, in_f] = w.shape;
    if tokens == 0 || in_f == 0 {
        return linear_forward(w, &[], tokens, bias, out);
    }
    // Blocks of `per` tokens, the last one what is left.
    let per = (CONVERT_BYTES / (4 * in_f)).clamp(1, tokens);
    let mut buf = try_filled(per * in_f, 0f32, "the float32 activation block")?;
    let isa = Isa::detected();
    for b in 0..tokens.div_ceil(per) {
        let t0 = b * per;
        let t = per.min(tokens - t0);
        let xs = &x[t0 * in_f..(t0 + t) * in_f];
        let xf = &mut buf[..t * in_f];
        T::convert_to_f32(isa, xs, xf);
        linear_forward(w, xf, t, bias, &mut out[t0 * out_f..(t0 + t) * out_f]).map_err(
            |e| match e {
                QuantError::NonFinite { arg: "x", index } => QuantError::NonFinite {
                    arg: "x",
                    index: index + t0 * in_f,
                },
                e => e,
            },
        )?;
    }
    Ok(())
}

/// The checks of [`linear_forward`] on the weight's side (its codes, scales
/// and zero points, and the bias), as for a call with no activation.
#[cfg_attr(not(feature = "python"), allow(dead_code))] // the bindings' plan
pub(crate) fn check_weight(w: &QuantizedWeight<'_>, bias: Option<&[f32]>) -> Result<()> {
    validate(w, 0, 0, bias, 0)
}

/// The checks of [`linear_forward`], in its order: the weight's codes, the
/// scales, `x`'s length, the bias, the output's length.
fn validate(
    w: &QuantizedWeight<'_>,
    x_len: usize,
    tokens: usize,
    bias: Option<&[f32]>,
    out_len: usize,
) -> Result<()> {
    let [out_f, in_f] = w.shape;
    let numel = out_f
        .checked_mul(in_f)
        .ok_or_else(|| mismatch("weight", "a shape that fits memory", "overflow".into()))?;
    let codes_len = match w.codes {
        WeightCodes::Int8(c) => (c.len(), numel),
        WeightCodes::Int4(c) => (c.len(), packed_len(numel)),
    };
    if codes_len.0 != codes_len.1 {
        return Err(mismatch(
            "weight",
            &format!("{} code bytes", codes_len.1),
            codes_len.0.to_string(),
        ));
    }
    let k = w.scales.len();
    if !(k == out_f || k == 1) || w.zero_points.len() != k {
        return Err(mismatch(
            "scales",
            &format!("{out_f} or 1 scales and as many zero points"),
            format!("{k} scales, {} zero points", w.zero_points.len()),
        ));
    }
    if tokens.checked_mul(in_f) != Some(x_len) {
        return Err(mismatch(
            "x",
            &format!("{tokens} x {in_f} elements"),
            x_len.to_string(),
        ));
    }
    if let Some(b) = bias {
        if b.len() != out_f {
            return Err(mismatch(
                "bias",
                &format!("{out_f} elements"),
                b.len().to_string(),
            ));
        }
        if let Some(i) = b.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFinite {
                arg: "bias",
                index: i,
            });
        }
    }
    // Checked: with `in_features == 0` any token count passes the `x` check.
    let want = tokens.checked_mul(out_f);
    if want != Some(out_len) {
        let expected = want.map_or_else(|| format!("{tokens} x {out_f}"), |n| n.to_string());
        return Err(mismatch("out", &expected, out_len.to_string()));
    }
    Ok(())
}

/// [`linear_forward`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn linear_forward_with(
    isa: Isa,
    w: &QuantizedWeight<'_>,
    x: &[f32],
    tokens: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    let _env = simd::fpenv::Pinned::new();
    validate(w, x.len(), tokens, bias, out.len())?;
    let params = RowParams::new(w)?;
    forward_checked(isa, w, &params, x, tokens, bias, out)
}

/// A weight's row parameters as the dot products use them, worked out once
/// for a layer that runs many forward passes (the bindings' `LinearPlan`):
/// each scale and zero point rounded to f32, and whether the f32 dot path is
/// within an ulp of `dequantize` for every row. Each call otherwise reads
/// the f64 parameters twice (16 bytes a row, from memory between a model's
/// layers) and spends microseconds on the check.
#[derive(Debug, Clone)]
pub(crate) struct RowParams {
    /// As many as the weight's scales: `out_features`, or one for the whole
    /// tensor (never more than the weight's own parameters).
    scales: Vec<f32>,
    zero_points: Vec<f32>,
    f32_exact: bool,
}

impl RowParams {
    /// The parameters of `w`, whose scales and zero points are `out_features`
    /// or one of each (as [`validate`] requires).
    pub(crate) fn new(w: &QuantizedWeight<'_>) -> Result<Self> {
        let k = w.scales.len().min(w.zero_points.len());
        let what = "the weight's f32 row parameters";
        let (mut scales, mut zero_points) =
            (try_filled(k, 0f32, what)?, try_filled(k, 0f32, what)?);
        for (d, &v) in scales.iter_mut().zip(w.scales) {
            *d = v as f32;
        }
        for (d, &v) in zero_points.iter_mut().zip(w.zero_points) {
            *d = v as f32;
        }
        // The dot path dequantizes in f32: `(q − zp) · scale` with the scale
        // rounded to f32. Where that is not within an ulp of `dequantize` (a
        // scale outside f32's normal range, a zero point beyond 2^22) or could
        // overflow (|scale| · (|zp| + 128) not below f32::MAX, padding's code 0
        // included), every row takes the panel path, which dequantizes as
        // `dequantize` does. (A fold, not `all`: it vectorizes.)
        let f32_exact = w
            .scales
            .iter()
            .zip(w.zero_points)
            .fold(true, |ok, (&s, &z)| {
                let s32 = s as f32;
                let widest = (s32 as f64).abs() * (z.abs() + 128.0);
                // `|s32|` in [MIN_POSITIVE, MAX]: normal (NaN fails both).
                let normal = (s32.abs() >= f32::MIN_POSITIVE) & (s32.abs() <= f32::MAX);
                ok & (normal | (s == 0.0))
                    & (z.abs() < (1u32 << 22) as f64)
                    & (widest < f32::MAX as f64)
            });
        Ok(RowParams {
            scales,
            zero_points,
            f32_exact,
        })
    }
}

/// [`linear_forward_with`] with `w`'s [`RowParams`] worked out before
/// (`params` must be `RowParams::new(w)`'s, for this very weight).
#[cfg_attr(not(feature = "python"), allow(dead_code))] // the bindings' plan
pub(crate) fn linear_forward_prepared(
    isa: Isa,
    w: &QuantizedWeight<'_>,
    params: &RowParams,
    x: &[f32],
    tokens: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    let _env = simd::fpenv::Pinned::new();
    validate(w, x.len(), tokens, bias, out.len())?;
    if params.scales.len() != w.scales.len() {
        return Err(mismatch(
            "scales",
            &format!("the row parameters of {} scales", w.scales.len()),
            params.scales.len().to_string(),
        ));
    }
    forward_checked(isa, w, params, x, tokens, bias, out)
}

/// The forward pass once the arguments passed [`validate`], in the default
/// floating-point environment.
fn forward_checked(
    isa: Isa,
    w: &QuantizedWeight<'_>,
    params: &RowParams,
    x: &[f32],
    tokens: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    let [out_f, in_f] = w.shape;
    let f32_exact = params.f32_exact;
    if simd::absmax_bits(isa, x) >= simd::F32_INF_BITS {
        let index = simd::scalar::first_non_finite(x);
        return Err(QuantError::NonFinite { arg: "x", index });
    }
    if tokens == 0 || out_f == 0 {
        return Ok(());
    }
    if in_f == 0 {
        for o in out.chunks_mut(out_f) {
            match bias {
                Some(b) => o.copy_from_slice(b),
                None => o.fill(0.0),
            }
        }
        return Ok(());
    }
    // The dot paths scale each row's sum once, after it: a subnormal x
    // would round its products to the subnormal grid first, an error the
    // scale could magnify. Rare enough to send to the panel path.
    let subnormal = || x.iter().fold(false, |any, v| any | v.is_subnormal());
    // The dot paths copy the activation (below): with as many tokens as a
    // quarter of the rows, that copy would rival the float32 weight.
    let wide_x = tokens.saturating_mul(4) >= out_f;
    let panels = tokens >= GEMM_MIN_TOKENS
        || !f32_exact
        || wide_x
        || w.dequant.coarser_than_f32()
        || subnormal();
    // The dot products read the activation from a copy on 64-byte
    // boundaries (int4 with even rows: in `nibble_planes` order).
    let planes = matches!(w.codes, WeightCodes::Int4(_)) && in_f % 2 == 0;
    let act = if panels {
        Activation::default()
    } else {
        Activation::new(x, in_f, planes)?
    };
    let job = Job {
        isa,
        w: *w,
        params,
        x,
        act: &act,
        tokens,
        bias,
        panels,
    };
    // A float64 weight keeps its f64 values, which the f32 panels cannot
    // hold when the scale is outside f32's normal range (1e-50 · 100 is 0
    // in f32): every output is summed in f64 instead. Only a hand-built or
    // loaded tensor has such a scale.
    if w.dequant == DequantDtype::F64 && !f32_exact {
        let mut all = try_filled(tokens, 0usize, "the token list")?;
        all.iter_mut().enumerate().for_each(|(t, v)| *v = t);
        for r in 0..out_f {
            for (t, v) in job.exact_row(r, &all)?.into_iter().enumerate() {
                out[t * out_f + r] = v;
            }
        }
        return Ok(());
    }
    let work = (out_f * in_f).saturating_mul(tokens); // checked by `validate`
    if panels {
        parallel::run(work, |par| {
            // Whole panels, two tasks a thread: each reuses one panel buffer.
            // Sized inside the run, on the pool.
            let threads = parallel::get_num_threads().max(1);
            let per = panel_shape(in_f, out_f, tokens).0;
            let rows = out_f.div_ceil(2 * threads).div_ceil(per).max(1) * per;
            let tasks = out_f.div_ceil(rows);
            if par && tasks > 1 {
                // Each finished panel goes straight into `out`, so no more
                // than a panel a thread is ever held besides the output
                // (collecting every part first doubled the peak memory of a
                // large batch). The only error is running out of working
                // memory: any task's will do.
                let out = std::sync::Mutex::new(&mut *out);
                (0..tasks).into_par_iter().try_for_each(|p| {
                    job.rows(p * rows, ((p + 1) * rows).min(out_f), &mut |first, part| {
                        let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                        job.scatter(&mut out, part, first);
                    })
                })
            } else {
                (0..tasks).try_for_each(|p| {
                    let r1 = ((p + 1) * rows).min(out_f);
                    job.rows(p * rows, r1, &mut |first, part| {
                        job.scatter(out, part, first)
                    })
                })
            }
        })?;
    } else {
        // Dot products: tasks of a few hundred KiB of weight, sixteen a
        // thread, claimed one at a time by the caller and the workers as they
        // wake (see `parallel::run_tasks`). Each task's rows go straight into
        // `out`. The only error is running out of working memory.
        let threads = parallel::get_num_threads().max(1);
        let min_rows = parallel::MIN_TASK_ELEMENTS.div_ceil(in_f);
        let rows = out_f.div_ceil(16 * threads).max(min_rows).max(1);
        let tasks = out_f.div_ceil(rows);
        let out = std::sync::Mutex::new(&mut *out);
        parallel::run_tasks(work, tasks, |p| {
            job.rows(p * rows, ((p + 1) * rows).min(out_f), &mut |first, part| {
                let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                job.scatter(&mut out, part, first);
            })
        })?;
    }
    // A float32 sum in a fixed order can pass float32's range where the exact
    // sum does not (terms near 2^128 of both signs): redo those outputs in
    // f64, each such row's weights dequantized once for all its tokens (a
    // weight holding an infinity makes every output of its row non-finite:
    // one redo per output took 2 s for 16 tokens of a 4096² weight).
    if out.iter().fold(false, |any, v| any | !v.is_finite()) {
        let mut redo = try_filled(out_f, false, "the rows to redo")?;
        for (j, v) in out.iter().enumerate() {
            redo[j % out_f] |= !v.is_finite();
        }
        let mut ts = try_filled(tokens, 0usize, "the tokens to redo")?;
        for r in (0..out_f).filter(|&r| redo[r]) {
            ts.clear();
            ts.extend((0..tokens).filter(|&t| !out[t * out_f + r].is_finite()));
            for (&t, v) in ts.iter().zip(job.exact_row(r, &ts)?) {
                out[t * out_f + r] = v;
            }
        }
    }
    Ok(())
}

/// A dequantized panel's rows and columns `(rows, kc)`: about
/// [`PANEL_BYTES`] of f32 ([`FEW_TOKENS_PANEL_BYTES`] for fewer than
/// [`GEMM_MIN_TOKENS`]). `kc` is `in_f`, or for a row longer than that, an
/// eighth of a panel (the row is then taken a block of columns at a time).
/// Rows: at most a quarter of the `out_f` rows (a panel stays far smaller
/// than the f32 weight the layer never builds), and few enough that the
/// panel's products for every token (`tokens` × rows of f32) fit in
/// [`PANEL_BYTES`] too, so the scratch stays bounded however many tokens
/// come. (A review found one-row panels of a 2 x 4,000,000 weight holding
/// as much as the f32 weight before rows were cut into blocks.)
fn panel_shape(in_f: usize, out_f: usize, tokens: usize) -> (usize, usize) {
    let floats = if tokens < GEMM_MIN_TOKENS {
        FEW_TOKENS_PANEL_BYTES
    } else {
        PANEL_BYTES
    } / 4;
    let kc = if in_f <= floats {
        in_f.max(1)
    } else {
        floats / 8
    };
    let rows = (floats / kc)
        .min(PANEL_BYTES / (4 * tokens.max(1)))
        .min(out_f.div_ceil(4))
        .clamp(1, 4096);
    (rows, kc)
}

/// The activation as the dot products read it: each token from a 64-byte
/// boundary, `stride` floats apart. A misaligned activation splits a cache
/// line every 64-byte load: 16 Mi codes from L2 took 0.57 -> 0.67-0.74 ms
/// (int8) and 0.47 -> 0.54-0.57 ms (int4), and the bench's medians swung
/// between runs with wherever the allocator put it.
#[derive(Default)]
struct Activation {
    buf: Vec<f32>,
    start: usize,
    stride: usize,
    /// `x` itself, unaligned (the copy could not be allocated; natural order only).
    direct: bool,
}

impl Activation {
    /// Without memory for the copy, a natural-order activation is read in
    /// place (the same sums, a little slower); the int4 planes, which the
    /// kernel cannot do without, are an error (taking the panel path
    /// instead would change the result's bits with the memory free).
    fn new(x: &[f32], in_f: usize, planes: bool) -> Result<Self> {
        let stride = if planes {
            simd::scalar::planes_len(in_f)
        } else {
            in_f.next_multiple_of(16)
        };
        let tokens = x.len() / in_f.max(1);
        let len = tokens.saturating_mul(stride).saturating_add(15);
        let mut buf = Vec::new();
        if buf.try_reserve_exact(len).is_err() {
            if planes {
                return Err(QuantError::OutOfMemory {
                    what: "the activation's copy",
                    bytes: len.saturating_mul(4),
                });
            }
            return Ok(Activation {
                direct: true,
                stride: in_f,
                ..Activation::default()
            });
        }
        buf.resize(len, 0.0);
        let start = (64 - buf.as_ptr() as usize % 64) % 64 / 4;
        for (t, xt) in x.chunks_exact(in_f).enumerate() {
            let row = &mut buf[start + t * stride..start + (t + 1) * stride];
            if planes {
                simd::scalar::nibble_planes_into(xt, row);
            } else {
                row[..in_f].copy_from_slice(xt);
            }
        }
        Ok(Activation {
            buf,
            start,
            stride,
            direct: false,
        })
    }

    /// Token `t`: `len` floats (`in_f`, or the planes' padded length).
    fn token<'a>(&'a self, x: &'a [f32], t: usize, len: usize) -> &'a [f32] {
        if self.direct {
            &x[t * self.stride..t * self.stride + len]
        } else {
            let at = self.start + t * self.stride;
            &self.buf[at..at + len]
        }
    }
}

fn mismatch(arg: &'static str, expected: &str, actual: String) -> QuantError {
    QuantError::ShapeMismatch {
        arg,
        expected: expected.to_string(),
        actual,
    }
}

#[derive(Clone, Copy)]
struct Job<'a> {
    isa: Isa,
    w: QuantizedWeight<'a>,
    params: &'a RowParams,
    x: &'a [f32],
    /// The activation as the dot products read it (few tokens only).
    act: &'a Activation,
    tokens: usize,
    bias: Option<&'a [f32]>,
    /// Dequantized panels and a GEMM (else dequantizing dot products).
    panels: bool,
}

impl Job<'_> {
    fn params(&self, r: usize) -> (f64, f64) {
        let j = if self.w.scales.len() == 1 { 0 } else { r };
        (self.w.scales[j], self.w.zero_points[j])
    }

    /// Codes `q` as `dequantize` gives them, `(q − zp) · scale` in f64
    /// rounded once to [`QuantizedWeight::dequant`], widened back to f64
    /// (`q` at most [`EXACT_RUN`] codes).
    fn exact_values(&self, q: &[i8], zp: f64, scale: f64, w: &mut [f64]) {
        match self.w.dequant {
            DequantDtype::F64 => simd::affine_dequantize_f64(self.isa, q, zp, scale, w),
            DequantDtype::F32 => rounded_as::<f32>(self.isa, q, zp, scale, w),
            DequantDtype::F16 => rounded_as::<f16>(self.isa, q, zp, scale, w),
            DequantDtype::Bf16 => rounded_as::<bf16>(self.isa, q, zp, scale, w),
        }
    }

    /// Outputs of row `r` for tokens `ts`, in f64: `Σ x · dequant(w)` with
    /// the weight dequantized exactly as `dequantize` does (f64, rounded once
    /// to [`QuantizedWeight::dequant`]) in four interleaved partial sums,
    /// plus the bias, rounded once. For the rare outputs whose f32 sum left
    /// the range (with a float64 weight, terms of both signs near 1e39
    /// cancel here rather than make NaN).
    fn exact_row(&self, r: usize, ts: &[usize]) -> Result<Vec<f32>> {
        const RUN: usize = EXACT_RUN;
        let in_f = self.w.shape[1];
        let (scale, zp) = self.params(r);
        let (mut q, mut w) = ([0i8; RUN], [0f64; RUN]);
        let mut acc = try_filled(ts.len(), [0f64; 4], "the exact sums")?;
        let mut sums = try_filled(ts.len(), 0f32, "the exact sums")?;
        for k0 in (0..in_f).step_by(RUN) {
            let n = RUN.min(in_f - k0);
            let (q, w) = (&mut q[..n], &mut w[..n]);
            let first = r * in_f + k0;
            match self.w.codes {
                WeightCodes::Int8(c) => q.copy_from_slice(&c[first..first + n]),
                WeightCodes::Int4(p) => {
                    for (e, v) in (first..).zip(q.iter_mut()) {
                        let b = p[e / 2];
                        *v = simd::scalar::nibble(if e.is_multiple_of(2) { b } else { b >> 4 });
                    }
                }
            }
            self.exact_values(q, zp, scale, w);
            for (a, &t) in acc.iter_mut().zip(ts) {
                let xt = &self.x[t * in_f + k0..t * in_f + k0 + n];
                let (xc, wc) = (xt.chunks_exact(4), w.chunks_exact(4));
                let (xr, wr) = (xc.remainder(), wc.remainder());
                for (x4, w4) in xc.zip(wc) {
                    for l in 0..4 {
                        a[l] += x4[l] as f64 * w4[l];
                    }
                }
                for (l, (&xv, &wv)) in xr.iter().zip(wr).enumerate() {
                    a[l] += xv as f64 * wv;
                }
            }
        }
        let bias = self.bias.map_or(0.0, |b| b[r] as f64);
        for (s, a) in sums.iter_mut().zip(&acc) {
            *s = ((a[0] + a[1]) + (a[2] + a[3]) + bias) as f32;
        }
        Ok(sums)
    }

    /// Outputs of weight rows `r0..r1` for every token, handed to `sink`
    /// a part at a time: `sink(first, part)`, `part` `[row][token]` from row
    /// `first`.
    fn rows(&self, r0: usize, r1: usize, sink: &mut dyn FnMut(usize, &[f32])) -> Result<()> {
        if self.panels {
            self.rows_gemm(r0, r1, sink)
        } else {
            sink(r0, &self.rows_dot(r0, r1)?);
            Ok(())
        }
    }

    fn rows_dot(&self, r0: usize, r1: usize) -> Result<Vec<f32>> {
        let [_, in_f] = self.w.shape;
        let n = r1 - r0;
        let what = "the dot products' rows";
        // A per-tensor weight's one scale and zero point, repeated for the rows.
        let (fill_s, fill_z);
        let (scales, zps) = if self.params.scales.len() == 1 {
            fill_s = try_filled(n, self.params.scales[0], what)?;
            fill_z = try_filled(n, self.params.zero_points[0], what)?;
            (&fill_s[..], &fill_z[..])
        } else {
            (
                &self.params.scales[r0..r1],
                &self.params.zero_points[r0..r1],
            )
        };
        let mut acc = try_filled(n, 0f32, what)?;
        let mut res = try_filled(
            n.saturating_mul(self.tokens),
            0f32,
            "the dot products' outputs",
        )?;
        let mut odd = Vec::new();
        for t in 0..self.tokens {
            match self.w.codes {
                // The codes from row r0 to the end: the kernels sum the
                // first `n` rows and prefetch the rows after them.
                WeightCodes::Int8(c) => {
                    let q = &c[r0 * in_f..];
                    let xt = self.act.token(self.x, t, in_f);
                    simd::dot_dequant_i8_rows(self.isa, q, in_f, zps, scales, xt, &mut acc);
                }
                WeightCodes::Int4(p) if in_f % 2 == 0 => {
                    let (stride, bytes) = (in_f / 2, &p[r0 * in_f / 2..]);
                    let xs = self.act.token(self.x, t, simd::scalar::planes_len(in_f));
                    simd::dot_dequant_i4_rows(
                        self.isa, bytes, stride, in_f, zps, scales, xs, &mut acc,
                    );
                }
                WeightCodes::Int4(p) => {
                    // Odd in_features: rows start in either nibble. Unpack
                    // each row whole, then the int8 dot product.
                    let xt = self.act.token(self.x, t, in_f);
                    if odd.len() != in_f + 2 {
                        odd = try_filled(in_f + 2, 0i8, "an unpacked weight row")?;
                    }
                    for (r, a) in (r0..r1).zip(acc.iter_mut()) {
                        let (first, skip) = (r * in_f, (r * in_f) % 2);
                        let bytes = packed_len(in_f + skip);
                        let start = first / 2;
                        let q = &mut odd[..2 * bytes];
                        simd::unpack_int4(self.isa, &p[start..start + bytes], q);
                        let (zp, sc) = ([zps[r - r0]], [scales[r - r0]]);
                        let one = std::slice::from_mut(a);
                        simd::dot_dequant_i8_rows(
                            self.isa,
                            &q[skip..skip + in_f],
                            in_f,
                            &zp,
                            &sc,
                            xt,
                            one,
                        );
                    }
                }
            }
            for (r, &a) in acc.iter().enumerate() {
                let b = self.bias.map_or(0.0, |b| b[r0 + r]);
                res[r * self.tokens + t] = a + b;
            }
        }
        Ok(res)
    }

    /// The panel path over rows `r0..r1`: a panel of [`PANEL_BYTES`] at a
    /// time, one panel buffer for the whole range (a fresh 2 MiB buffer a
    /// panel took 49 ms at batch 64 where one reused buffer takes 40 ms),
    /// each panel's outputs handed to `sink` as soon as they are summed.
    fn rows_gemm(&self, r0: usize, r1: usize, sink: &mut dyn FnMut(usize, &[f32])) -> Result<()> {
        let [out_f, in_f] = self.w.shape;
        let tokens = self.tokens;
        let (per_panel, kc) = panel_shape(in_f, out_f, tokens);
        let per_panel = per_panel.min(r1 - r0);
        let mut panel = try_filled(per_panel * kc, 0f32, "a dequantized weight panel")?;
        let what = "the panel's outputs";
        let mut by_token = try_filled(tokens.saturating_mul(per_panel), 0f32, what)?;
        let mut unpacked = match self.w.codes {
            WeightCodes::Int4(_) => try_filled(kc + 2, 0i8, "an unpacked weight row")?,
            WeightCodes::Int8(_) => Vec::new(),
        };
        for p0 in (r0..r1).step_by(per_panel) {
            let p1 = (p0 + per_panel).min(r1);
            let n = p1 - p0;
            let by_row = &mut by_token[..n * tokens];
            // Columns k0..k1 of the panel's rows at a time (all of them
            // unless a row is longer than a panel holds), each block's
            // products added to the last.
            for k0 in (0..in_f).step_by(kc) {
                let kn = kc.min(in_f - k0);
                for r in p0..p1 {
                    let (scale, zp) = self.params(r);
                    let row = &mut panel[(r - p0) * kn..(r - p0 + 1) * kn];
                    let first = r * in_f + k0;
                    match self.w.codes {
                        WeightCodes::Int8(c) => {
                            self.dequantize_row(&c[first..first + kn], zp, scale, row)
                        }
                        WeightCodes::Int4(p) => {
                            let skip = first % 2;
                            // Whole bytes: unpack_int4 fills pairs.
                            let bytes = packed_len(kn + skip);
                            let q = &mut unpacked[..2 * bytes];
                            let start = first / 2;
                            simd::unpack_int4(self.isa, &p[start..start + bytes], q);
                            self.dequantize_row(&q[skip..skip + kn], zp, scale, row);
                        }
                    }
                }
                // by_row[row][token] += Σ_i panel[row, i] · x[token, k0 + i]:
                // the panel as the GEMM's left side, the tokens as its right.
                simd::gemm::gemm_abt_strided(
                    n,
                    tokens,
                    kn,
                    (&panel[..n * kn], kn),
                    (&self.x[k0..], in_f),
                    by_row,
                    k0 > 0,
                );
            }
            // The bias, or +0.0 (which also makes a -0.0 sum +0.0, as the dot
            // path's outputs are).
            for (j, vals) in by_row.chunks_exact_mut(tokens).enumerate() {
                let b = self.bias.map_or(0.0, |b| b[p0 + j]);
                vals.iter_mut().for_each(|v| *v += b);
            }
            sink(p0, by_row);
        }
        Ok(())
    }

    /// One panel row: codes `q` dequantized as `dequantize` does for the
    /// weight's dtype, as f32 (f16 and bf16 values are rounded to their
    /// dtype first, a short run at a time on the stack, then widen exactly).
    fn dequantize_row(&self, q: &[i8], zp: f64, scale: f64, row: &mut [f32]) {
        match self.w.dequant {
            DequantDtype::F16 => widened_from::<f16>(self.isa, q, zp, scale, row),
            DequantDtype::Bf16 => widened_from::<bf16>(self.isa, q, zp, scale, row),
            DequantDtype::F32 | DequantDtype::F64 => {
                simd::affine_dequantize_f32(self.isa, q, zp, scale, row, Store::Cached)
            }
        }
    }

    /// Copy rows `first..` of `[row][token]` results into `out[token][row]`
    /// (written in order, token by token).
    fn scatter(&self, out: &mut [f32], part: &[f32], first: usize) {
        let out_f = self.w.shape[0];
        let tokens = self.tokens;
        let n = part.len() / tokens.max(1);
        for (t, o) in out.chunks_exact_mut(out_f).enumerate() {
            for (r, o) in o[first..first + n].iter_mut().enumerate() {
                *o = part[r * tokens + t];
            }
        }
    }
}

/// Codes at a time in [`Job::exact_row`].
const EXACT_RUN: usize = 1024;

/// `(q − zp) · scale` rounded once to `O` as `dequantize` does, widened
/// back to f64 into `w` (`q` at most [`EXACT_RUN`] codes).
fn rounded_as<O: Float>(isa: Isa, q: &[i8], zp: f64, scale: f64, w: &mut [f64]) {
    let mut v = [O::from_f64_once(0.0); EXACT_RUN];
    let v = &mut v[..q.len()];
    stage::affine_values(isa, q, zp, scale, v, &mut Scratch::new(), Store::Cached);
    w.iter_mut()
        .zip(v.iter())
        .for_each(|(d, s)| *d = s.to_f64());
}

/// `(q − zp) · scale` rounded once to `O` as `dequantize` does, widened
/// exactly to f32 into `row`, through 256-value runs on the stack.
fn widened_from<O: Float>(isa: Isa, q: &[i8], zp: f64, scale: f64, row: &mut [f32]) {
    const RUN: usize = 256;
    let mut v = [O::from_f64_once(0.0); RUN];
    for (qs, rs) in q.chunks(RUN).zip(row.chunks_mut(RUN)) {
        let v = &mut v[..qs.len()];
        stage::affine_values(isa, qs, zp, scale, v, &mut Scratch::new(), Store::Cached);
        O::convert_to_f32(isa, v, rs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight<'a>(
        codes: WeightCodes<'a>,
        shape: [usize; 2],
        scales: &'a [f64],
        zero_points: &'a [f64],
    ) -> QuantizedWeight<'a> {
        QuantizedWeight {
            codes,
            shape,
            scales,
            zero_points,
            dequant: DequantDtype::F32,
        }
    }

    #[test]
    fn prepared_forward_matches_the_one_shot_call_bit_for_bit() {
        let (out_f, in_f) = (37, 130);
        let mut s = 7u32;
        let mut next = move || {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            s >> 8
        };
        let i8s: Vec<i8> = (0..out_f * in_f).map(|_| next() as u8 as i8).collect();
        let packed: Vec<u8> = (0..packed_len(out_f * in_f))
            .map(|_| next() as u8)
            .collect();
        let x: Vec<f32> = (0..3 * in_f).map(|_| next() as f32 / 4e6 - 2.0).collect();
        let bias: Vec<f32> = (0..out_f).map(|r| r as f32 / 8.0).collect();
        let scales: Vec<f64> = (0..out_f).map(|r| 0.01 + r as f64 * 1e-3).collect();
        let zps: Vec<f64> = (0..out_f).map(|r| (r % 5) as f64 - 2.0).collect();
        // Per channel, per tensor, and a scale below f32's normal range (every
        // row on the panel path).
        let params: [(&[f64], &[f64]); 3] =
            [(&scales, &zps), (&[0.02], &[1.0]), (&[1e-40], &[0.0])];
        // An odd row length too (int4 rows then start in either nibble).
        for (in_f, codes) in [
            (in_f, WeightCodes::Int8(&i8s)),
            (in_f, WeightCodes::Int4(&packed)),
            (67, WeightCodes::Int4(&packed[..packed_len(out_f * 67)])),
        ] {
            for (sc, zp) in params {
                let w = weight(codes, [out_f, in_f], sc, zp);
                let prepared = RowParams::new(&w).unwrap();
                // One f32 pair a scale: a per-tensor weight's rows share one.
                assert_eq!(prepared.scales.len(), sc.len());
                for tokens in [0, 1, 3] {
                    let xs = &x[..tokens * in_f];
                    for b in [None, Some(&bias[..])] {
                        let (mut want, mut got) =
                            (vec![0f32; tokens * out_f], vec![1f32; tokens * out_f]);
                        linear_forward_with(Isa::detected(), &w, xs, tokens, b, &mut want).unwrap();
                        linear_forward_prepared(
                            Isa::detected(),
                            &w,
                            &prepared,
                            xs,
                            tokens,
                            b,
                            &mut got,
                        )
                        .unwrap();
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got), bits(&want), "{codes:?} {sc:?} tokens {tokens}");
                    }
                }
            }
        }
        // Row parameters of another weight's row count are refused.
        let w = weight(WeightCodes::Int8(&i8s), [out_f, in_f], &scales, &zps);
        let short = weight(WeightCodes::Int8(&i8s[..in_f]), [1, in_f], &[0.5], &[0.0]);
        let other = RowParams::new(&short).unwrap();
        let mut out = vec![0f32; out_f];
        let err =
            linear_forward_prepared(Isa::detected(), &w, &other, &x[..in_f], 1, None, &mut out);
        assert!(
            matches!(err, Err(QuantError::ShapeMismatch { arg: "scales", .. })),
            "{err:?}"
        );
    }
}
