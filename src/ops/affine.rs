//! Affine int8 / int4 quantization — SPEC §2, ported from seed 001 (shrew,
//! `quantize` module: `QuantConfig`, `compute_scale_zp`, `quantize_per_tensor`,
//! `quantize_per_channel` and their dequantizers).
//!
//! Math in f64, exactly as the seed: symmetric `scale = amax / qmax` (1.0 if
//! `amax < 1e-30`), zero point 0; asymmetric `scale = (max - min) / (qmax -
//! qmin)` (1.0 if the range is below 1e-30), `zp = round(qmin - min / scale)`;
//! `inv = 0 if |scale| < 1e-30 else 1 / scale`; codes `clamp(round(v * inv +
//! zp), qmin, qmax)`; values `(q - zp) * scale`. Per channel: one (scale, zp)
//! per index of axis 0; a 0-d input falls back to per tensor.
//!
//! Deviations (SPEC): int4 codes are packed two a byte (1); non-finite input
//! is an error (2).
//!
//! ```
//! # fn main() -> Result<(), ferroquant::QuantError> {
//! use ferroquant::ops::affine::{dequantize, num_groups, quantize, Codes, CodesMut, QuantConfig};
//!
//! let x = [-1.0f32, -0.25, 0.0, 0.5, 2.0, 3.0]; // a [2, 3] weight
//! let config = QuantConfig::int8_per_channel().asymmetric();
//! let groups = num_groups(&[2, 3], config.granularity);
//! let (mut codes, mut scales, mut zps) = ([0i8; 6], vec![0f64; groups], vec![0f64; groups]);
//! quantize(&x, &[2, 3], &config, CodesMut::Int8(&mut codes), &mut scales, &mut zps)?;
//! assert_eq!(scales[0], 1.0 / 255.0); // row 0 spans [-1, 0]
//! let mut y = [0f32; 6];
//! dequantize(Codes::Int8(&codes), &[2, 3], &config, &scales, &zps, &mut y)?;
//! assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() <= 0.5 * 3.0 / 255.0 + 1e-7));
//! # Ok(())
//! # }
//! ```

use crate::element::Float;
use crate::error::{QuantError, Result};
use crate::ops::pack::{packed_len, unpack_range, Int4Writer};
use crate::parallel;
use crate::simd::{self, Affine, Isa, Store};
use crate::stage::{self, Scratch, STAGE};
use rayon::prelude::*;

/// Code width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    /// 8-bit codes, one a byte.
    Int8,
    /// 4-bit codes, packed two a byte.
    Int4,
}

/// Symmetric (zero point 0) or asymmetric (min/max mapped to qmin/qmax).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// `scale = amax / qmax`, zero point 0.
    Symmetric,
    /// `scale = (max - min) / (qmax - qmin)`, `zp = round(qmin - min / scale)`.
    Asymmetric,
}

/// One (scale, zero point) for the whole tensor, or one per index of axis 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// One group: the whole tensor.
    PerTensor,
    /// One group per index of axis 0 (per output channel of a weight).
    PerChannel,
}

/// Seed 001's `QuantConfig`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantConfig {
    /// Code width.
    pub bits: Bits,
    /// Symmetric or asymmetric.
    pub mode: Mode,
    /// Per tensor or per channel.
    pub granularity: Granularity,
}

impl Default for QuantConfig {
    fn default() -> Self {
        Self::int8()
    }
}

impl QuantConfig {
    /// int8, symmetric, per tensor (the default).
    pub fn int8() -> Self {
        QuantConfig {
            bits: Bits::Int8,
            mode: Mode::Symmetric,
            granularity: Granularity::PerTensor,
        }
    }

    /// int8, symmetric, per channel.
    pub fn int8_per_channel() -> Self {
        QuantConfig {
            granularity: Granularity::PerChannel,
            ..Self::int8()
        }
    }

    /// int4, symmetric, per tensor.
    pub fn int4() -> Self {
        QuantConfig {
            bits: Bits::Int4,
            ..Self::int8()
        }
    }

    /// int4, symmetric, per channel.
    pub fn int4_per_channel() -> Self {
        QuantConfig {
            bits: Bits::Int4,
            ..Self::int8_per_channel()
        }
    }

    /// The same configuration, asymmetric.
    pub fn asymmetric(self) -> Self {
        QuantConfig {
            mode: Mode::Asymmetric,
            ..self
        }
    }

    /// The configuration named as the Python API spells it: `bits` 8 or 4,
    /// `mode` `"symmetric"` / `"asymmetric"`, `granularity` `"per_tensor"` /
    /// `"per_channel"`. Anything else is `InvalidConfig` naming the argument.
    pub fn from_names(bits: u32, mode: &str, granularity: &str) -> Result<Self> {
        let bits = match bits {
            8 => Bits::Int8,
            4 => Bits::Int4,
            b => {
                return Err(QuantError::invalid(
                    "bits",
                    format!("expected 8 or 4, got {b}"),
                ))
            }
        };
        let mode = match mode {
            "symmetric" => Mode::Symmetric,
            "asymmetric" => Mode::Asymmetric,
            m => {
                return Err(QuantError::invalid(
                    "mode",
                    format!("expected 'symmetric' or 'asymmetric', got {m:?}"),
                ))
            }
        };
        let granularity = match granularity {
            "per_tensor" => Granularity::PerTensor,
            "per_channel" => Granularity::PerChannel,
            g => {
                return Err(QuantError::invalid(
                    "granularity",
                    format!("expected 'per_tensor' or 'per_channel', got {g:?}"),
                ))
            }
        };
        Ok(QuantConfig {
            bits,
            mode,
            granularity,
        })
    }

    /// The largest code: 127 or 7.
    pub fn qmax(&self) -> f64 {
        match self.bits {
            Bits::Int8 => 127.0,
            Bits::Int4 => 7.0,
        }
    }

    /// The smallest code, the seed's table: int8 -127 / -128, int4 -7 / -8
    /// (symmetric / asymmetric).
    pub fn qmin(&self) -> f64 {
        match (self.bits, self.mode) {
            (Bits::Int8, Mode::Symmetric) => -127.0,
            (Bits::Int8, Mode::Asymmetric) => -128.0,
            (Bits::Int4, Mode::Symmetric) => -7.0,
            (Bits::Int4, Mode::Asymmetric) => -8.0,
        }
    }
}

/// Number of (scale, zero point) pairs for `shape`: 1 per tensor (also for
/// empty or 0-d input), `shape[0]` per channel.
pub fn num_groups(shape: &[usize], granularity: Granularity) -> usize {
    match (granularity, shape.first()) {
        (Granularity::PerChannel, Some(&rows)) => rows,
        _ => 1,
    }
}

/// Seed 001's `compute_scale_zp` from a group's exact (min, max), `None` for an
/// empty group: `(scale, zero point)`.
pub fn scale_zero_point(range: Option<(f64, f64)>, config: &QuantConfig) -> (f64, f64) {
    let Some((min, max)) = range else {
        return (1.0, 0.0);
    };
    let (qmin, qmax) = (config.qmin(), config.qmax());
    match config.mode {
        Mode::Symmetric => {
            // The seed folds max(|v|) from 0.0; over finite input that is max(|min|, |max|).
            let amax = (-min).max(max).max(0.0);
            let scale = if amax < 1e-30 { 1.0 } else { amax / qmax };
            (scale, 0.0)
        }
        Mode::Asymmetric => {
            let range = max - min;
            let scale = if range < 1e-30 {
                1.0
            } else {
                range / (qmax - qmin)
            };
            (scale, (qmin - min / scale).round())
        }
    }
}

/// The seed's `inv_scale`: 0 when `|scale| < 1e-30`, else `1 / scale`.
pub fn inverse(scale: f64) -> f64 {
    if scale.abs() < 1e-30 {
        0.0
    } else {
        1.0 / scale
    }
}

/// The affine map of a group with exact range `range` (its bound lets SIMD
/// paths drop checks that cannot fire).
fn affine(config: &QuantConfig, range: Option<(f64, f64)>, scale: f64, zp: f64) -> Affine {
    Affine {
        inv: inverse(scale),
        zp,
        qmin: config.qmin(),
        qmax: config.qmax(),
        max_abs: range.map_or(0.0, |(lo, hi)| lo.abs().max(hi.abs())),
    }
}

/// Seed 001's `QuantStats`: what quantizing a model's parameters would save.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantStats {
    /// Parameters of rank >= 2 (quantized).
    pub num_quantized: usize,
    /// Other parameters (kept in f32).
    pub num_fp32: usize,
    /// 4 bytes an element of every parameter.
    pub fp32_bytes: usize,
    /// Code bytes plus 16 bytes of metadata a group, and 4 bytes an element of the rest.
    pub quantized_bytes: usize,
    /// `fp32_bytes / quantized_bytes` in f64 (1.0 when nothing is held).
    pub compression_ratio: f64,
}

/// Seed 001's `quantization_stats` over parameter shapes, without quantizing:
/// a parameter of rank >= 2 counts its code bytes (`numel`, or `ceil(numel / 2)`
/// for int4) plus 16 bytes of metadata (`16 · shape[0]` per channel); any other
/// stays f32.
///
/// Errors: `InvalidConfig` naming `params` when a count overflows `usize`.
///
/// ```
/// use ferroquant::ops::affine::{quantization_stats, QuantConfig};
///
/// let shapes: [&[usize]; 2] = [&[256, 128], &[256]];
/// let s = quantization_stats(shapes, &QuantConfig::int8()).unwrap();
/// assert_eq!((s.num_quantized, s.num_fp32), (1, 1));
/// assert_eq!(s.quantized_bytes, 256 * 128 + 16 + 256 * 4);
/// ```
pub fn quantization_stats<'a>(
    shapes: impl IntoIterator<Item = &'a [usize]>,
    config: &QuantConfig,
) -> Result<QuantStats> {
    let overflow = || QuantError::invalid("params", "the byte counts overflow usize");
    let (mut num_quantized, mut num_fp32, mut fp32_bytes, mut quantized_bytes) =
        (0, 0, 0usize, 0usize);
    let add =
        |acc: usize, v: Option<usize>| v.and_then(|v| acc.checked_add(v)).ok_or_else(overflow);
    for shape in shapes {
        let numel = super::shape_numel(shape);
        fp32_bytes = add(fp32_bytes, numel.and_then(|n| n.checked_mul(4)))?;
        if shape.len() >= 2 {
            num_quantized += 1;
            let size = match config.bits {
                Bits::Int8 => numel,
                Bits::Int4 => numel.map(|n| n.div_ceil(2)),
            };
            let meta = match config.granularity {
                Granularity::PerChannel => shape[0].checked_mul(16),
                Granularity::PerTensor => Some(16),
            };
            quantized_bytes = add(
                quantized_bytes,
                size.and_then(|s| meta.and_then(|m| s.checked_add(m))),
            )?;
        } else {
            num_fp32 += 1;
            quantized_bytes = add(quantized_bytes, numel.and_then(|n| n.checked_mul(4)))?;
        }
    }
    let compression_ratio = if quantized_bytes > 0 {
        fp32_bytes as f64 / quantized_bytes as f64
    } else {
        1.0
    };
    Ok(QuantStats {
        num_quantized,
        num_fp32,
        fp32_bytes,
        quantized_bytes,
        compression_ratio,
    })
}

/// Where quantized codes go.
#[derive(Debug)]
pub enum CodesMut<'a> {
    /// int8 codes, one per element.
    Int8(&'a mut [i8]),
    /// int4 codes packed two a byte, `ceil(n / 2)` bytes.
    Int4(&'a mut [u8]),
}

/// Quantized codes to read.
#[derive(Debug, Clone, Copy)]
pub enum Codes<'a> {
    /// int8 codes, one per element.
    Int8(&'a [i8]),
    /// int4 codes packed two a byte.
    Int4(&'a [u8]),
}

impl Codes<'_> {
    fn check(&self, config: &QuantConfig, n: usize) -> Result<()> {
        match (self, config.bits) {
            (Codes::Int8(c), Bits::Int8) if c.len() == n => Ok(()),
            (Codes::Int4(c), Bits::Int4) if c.len() == packed_len(n) => Ok(()),
            (Codes::Int8(c), Bits::Int8) => Err(QuantError::len_mismatch("data", n, c.len())),
            (Codes::Int4(c), Bits::Int4) => {
                Err(QuantError::len_mismatch("data", packed_len(n), c.len()))
            }
            _ => Err(QuantError::invalid(
                "data",
                format!(
                    "{:?} codes given for a {:?} configuration",
                    self.bits(),
                    config.bits
                ),
            )),
        }
    }

    fn bits(&self) -> Bits {
        match self {
            Codes::Int8(_) => Bits::Int8,
            Codes::Int4(_) => Bits::Int4,
        }
    }
}

fn numel(shape: &[usize], arg: &'static str) -> Result<usize> {
    super::shape_numel(shape).ok_or_else(|| {
        QuantError::invalid(
            arg,
            format!("{shape:?} holds more than usize::MAX elements"),
        )
    })
}

fn check_lengths(
    shape: &[usize],
    config: &QuantConfig,
    n: usize,
    scales: usize,
    zps: usize,
) -> Result<()> {
    let want = numel(shape, "shape")?;
    if want != n {
        return Err(QuantError::ShapeMismatch {
            arg: "x",
            expected: format!("{want} elements for shape {shape:?}"),
            actual: format!("{n}"),
        });
    }
    let groups = num_groups(shape, config.granularity);
    if scales != groups {
        return Err(QuantError::len_mismatch("scales", groups, scales));
    }
    if zps != groups {
        return Err(QuantError::len_mismatch("zero_points", groups, zps));
    }
    Ok(())
}

/// Quantize `x` (of `shape`, C order) into `codes`, `scales` and `zero_points`
/// (one per group, see [`num_groups`]).
///
/// Errors: `ShapeMismatch` for inconsistent lengths, `InvalidConfig` for codes
/// of the wrong width, `NonFinite` naming the first NaN or infinity.
pub fn quantize<T: Float>(
    x: &[T],
    shape: &[usize],
    config: &QuantConfig,
    codes: CodesMut<'_>,
    scales: &mut [f64],
    zero_points: &mut [f64],
) -> Result<()> {
    quantize_with(
        Isa::detected(),
        x,
        shape,
        config,
        codes,
        scales,
        zero_points,
    )
}

/// [`quantize`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn quantize_with<T: Float>(
    isa: Isa,
    x: &[T],
    shape: &[usize],
    config: &QuantConfig,
    codes: CodesMut<'_>,
    scales: &mut [f64],
    zero_points: &mut [f64],
) -> Result<()> {
    // The scale and zero point are computed between the two parallel passes, on
    // this thread: pin the default rounding mode for all of it, not only the passes.
    let _env = crate::simd::fpenv::Pinned::new();
    let n = x.len();
    check_lengths(shape, config, n, scales.len(), zero_points.len())?;
    match &codes {
        CodesMut::Int8(c) => Codes::Int8(c),
        CodesMut::Int4(c) => Codes::Int4(c),
    }
    .check(config, n)?;
    let rows = num_groups(shape, config.granularity);
    let outcome = if config.granularity == Granularity::PerChannel && !shape.is_empty() {
        per_channel(isa, x, rows, config, codes, scales, zero_points)
    } else {
        per_tensor(isa, x, config, codes, &mut scales[0], &mut zero_points[0])
    };
    outcome.map_err(|index| QuantError::NonFinite { arg: "x", index })
}

type Found = std::result::Result<Option<(f64, f64)>, usize>;

fn merge_ranges(a: Option<(f64, f64)>, b: Option<(f64, f64)>) -> Option<(f64, f64)> {
    match (a, b) {
        (Some((l1, h1)), Some((l2, h2))) => Some((l1.min(l2), h1.max(h2))),
        (a, None) => a,
        (None, b) => b,
    }
}

/// Elements per parallel task for a flat pass (even, so int4 bytes never straddle tasks).
fn flat_task_len(n: usize) -> usize {
    parallel::units_per_task(n.div_ceil(2), 2) * 2
}

fn per_tensor<T: Float>(
    isa: Isa,
    x: &[T],
    config: &QuantConfig,
    mut codes: CodesMut<'_>,
    scale_out: &mut f64,
    zp_out: &mut f64,
) -> std::result::Result<(), usize> {
    let n = x.len();
    // Each pass hands off to the pool separately, so the break-even is later than
    // for one-pass kernels: measured 2^18 elements 64 µs on one thread, 98 µs on
    // two; 2^20 elements 222 vs 188 µs. Work is counted at a quarter per element.
    let work = n / 4;
    // Pass 1: the exact range, with the non-finite check fused.
    let found: Found = parallel::run(work, |par| {
        if !par {
            return stage::range(isa, x, &mut Scratch::new());
        }
        let len = flat_task_len(n);
        x.par_chunks(len)
            .enumerate()
            .map(|(t, xs)| stage::range(isa, xs, &mut Scratch::new()).map_err(|i| t * len + i))
            .reduce(
                || Ok(None),
                |a, b| parallel::first_error(a, b, merge_ranges),
            )
    });
    let range = found?;
    let (scale, zp) = scale_zero_point(range, config);
    (*scale_out, *zp_out) = (scale, zp);
    let a = affine(config, range, scale, zp);
    // Pass 2: the codes. (Rayon's iterators only inside the pool: outside it they
    // would start rayon's global pool, which ferroquant never uses.)
    parallel::run(work, |par| {
        let store = Store::for_run(n, n, par);
        if !par {
            return codes_run(isa, x, a, &mut codes, store);
        }
        // Even, so int4 bytes never straddle two tasks.
        let len = flat_task_len(n);
        match &mut codes {
            CodesMut::Int8(c) => x
                .par_chunks(len)
                .zip(c.par_chunks_mut(len))
                .for_each(|(xs, cs)| codes_run(isa, xs, a, &mut CodesMut::Int8(cs), store)),
            CodesMut::Int4(c) => x
                .par_chunks(len)
                .zip(c.par_chunks_mut(len / 2))
                .for_each(|(xs, bs)| codes_run(isa, xs, a, &mut CodesMut::Int4(bs), store)),
        }
    });
    Ok(())
}

/// The codes pass of a run (each task's share of pass 2).
fn codes_run<T: Float>(isa: Isa, x: &[T], a: Affine, codes: &mut CodesMut<'_>, store: Store) {
    let mut scratch = Scratch::new();
    // A span at a time, the next one prefetched meanwhile (spans are even, so
    // int4 pairs never straddle two).
    match codes {
        // One fence for all spans' streaming stores, when the scope ends.
        CodesMut::Int8(c) => simd::rows_out(c, store, |o| {
            for (off, xs, ahead) in stage::spans_ahead(x) {
                stage::affine_codes(isa, xs, a, o, off, &mut scratch, ahead);
            }
        }),
        CodesMut::Int4(c) => {
            let mut w = Int4Writer::new(c, 0);
            for (_, xs, ahead) in stage::spans_ahead(x) {
                int4_run(isa, xs, a, &mut w, &mut scratch, ahead);
            }
        }
    }
}

/// Quantize a run and append its codes to an int4 writer, a stage at a time
/// (f32 input brings `ahead` toward the core meanwhile, see `affine_codes`).
fn int4_run<T: Float>(
    isa: Isa,
    x: &[T],
    a: Affine,
    w: &mut Int4Writer<'_>,
    scratch: &mut Scratch,
    ahead: &[T],
) {
    if let Some(xf) = T::as_f32_slice(x) {
        // Packed from registers, no stage: int4 per channel at 4096 x 4096, one
        // thread, went from 1.14x to 1.06-1.11x of int8's time.
        return w.write_affine_f32(isa, xf, a, T::as_f32_slice(ahead).unwrap_or(&[]));
    }
    let mut codes = std::mem::take(&mut scratch.codes);
    codes.resize(STAGE.min(x.len()), 0);
    for xs in x.chunks(STAGE) {
        let cs = &mut codes[..xs.len()];
        // Codes go to an L1 stage, packed from there.
        simd::rows_out(cs, Store::Cached, |o| {
            stage::affine_codes(isa, xs, a, o, 0, scratch, &[]);
        });
        w.write(isa, cs);
    }
    scratch.codes = codes;
}

#[allow(clippy::too_many_arguments)]
fn per_channel<T: Float>(
    isa: Isa,
    x: &[T],
    rows: usize,
    config: &QuantConfig,
    codes: CodesMut<'_>,
    scales: &mut [f64],
    zero_points: &mut [f64],
) -> std::result::Result<(), usize> {
    let n = x.len();
    if rows == 0 {
        return Ok(());
    }
    let cs = n / rows;
    if cs == 0 {
        scales.fill(1.0);
        zero_points.fill(0.0);
        return Ok(());
    }
    // int4 rows of odd length share bytes: tasks take rows in pairs.
    let unit = if config.bits == Bits::Int4 && cs % 2 == 1 {
        2
    } else {
        1
    };
    let task_rows = || parallel::units_per_task(rows.div_ceil(unit), cs * unit) * unit;
    let task = |t0: usize, xs: &[T], out: TaskOut<'_>, sc: &mut [f64], zs: &mut [f64], par| {
        let store = Store::for_run(n, cs, par);
        if let (Some(xf), true) = (T::as_f32_slice(xs), isa.fuses_row_passes()) {
            return fused_rows(isa, xf, cs, config, out, sc, zs, store).map_err(|i| t0 * cs + i);
        }
        let mut scratch = Scratch::new();
        // Each row's range and parameters, then its codes (`code`: row, values,
        // map, the next row to bring in meanwhile).
        let mut rows = |code: &mut CodeRow<'_, T>| {
            for (r, xr) in xs.chunks(cs).enumerate() {
                // The next row streams in from memory while this one is coded
                // from cache, so its range pass reads it from L2.
                let next = xs
                    .get((r + 1) * cs..((r + 2) * cs).min(xs.len()))
                    .unwrap_or(&[]);
                let found = match config.mode {
                    // max(|min|, |max|) is all the symmetric scale reads.
                    Mode::Symmetric => stage::magnitude_range(isa, xr, &mut scratch),
                    Mode::Asymmetric => stage::range(isa, xr, &mut scratch),
                }
                .map_err(|i| (t0 + r) * cs + i)?;
                let (scale, zp) = scale_zero_point(found, config);
                (sc[r], zs[r]) = (scale, zp);
                code(r, xr, affine(config, found, scale, zp), next, &mut scratch);
            }
            Ok(())
        };
        match out {
            // One fence for all rows' streaming stores, when the scope ends.
            TaskOut::Int8(c) => simd::rows_out(c, store, |o| {
                rows(&mut |r, xr, a, next, s| {
                    stage::affine_codes(isa, xr, a, o, r * cs, s, next);
                })
            }),
            TaskOut::Int4(mut w) => {
                rows(&mut |_, xr, a, next, s| int4_run(isa, xr, a, &mut w, s, next))
            }
        }
    };
    parallel::run(n, |par| {
        if !par {
            let out = match codes {
                CodesMut::Int8(c) => TaskOut::Int8(c),
                CodesMut::Int4(c) => TaskOut::Int4(Int4Writer::new(c, 0)),
            };
            return task(0, x, out, scales, zero_points, false);
        }
        let tr = task_rows();
        let scales = scales
            .par_chunks_mut(tr)
            .zip(zero_points.par_chunks_mut(tr));
        match codes {
            CodesMut::Int8(c) => x
                .par_chunks(tr * cs)
                .zip(c.par_chunks_mut(tr * cs))
                .zip(scales)
                .enumerate()
                .map(|(t, ((xs, c), (sc, zs)))| task(t * tr, xs, TaskOut::Int8(c), sc, zs, true))
                .reduce(|| Ok(()), |a, b| parallel::first_error(a, b, |_, _| ())),
            CodesMut::Int4(c) => x
                .par_chunks(tr * cs)
                .zip(c.par_chunks_mut(packed_len(tr * cs)))
                .zip(scales)
                .enumerate()
                .map(|(t, ((xs, b), (sc, zs)))| {
                    task(
                        t * tr,
                        xs,
                        TaskOut::Int4(Int4Writer::new(b, 0)),
                        sc,
                        zs,
                        true,
                    )
                })
                .reduce(|| Ok(()), |a, b| parallel::first_error(a, b, |_, _| ())),
        }
    })
}

/// Per-channel rows of f32 on a tier that fuses a row's codes with the next
/// row's range: row `r + 1` streams in from memory while row `r` is coded
/// from cache and row `r + 2` is prefetched, so the memory never idles
/// through a separate range pass. On Zen 4 (4096 x 4096 after a cache flush,
/// both builds in one process, five runs): int8 symmetric 2-7 % faster on one
/// thread and 5-6 % on two, asymmetric 0-9 %, int4 -3-6 %; the AVX2 tier
/// (the same CPU capped to AVX2) int8 2-6 % on one thread and 6-8 % on two.
/// AVX2 int4 and the scalar tier run the default (codes, then the range) in
/// the same order. `Err(i)`: `x[i]` is the first non-finite value (every row before it
/// is coded).
#[allow(clippy::too_many_arguments)]
fn fused_rows(
    isa: Isa,
    x: &[f32],
    cs: usize,
    config: &QuantConfig,
    out: TaskOut<'_>,
    scales: &mut [f64],
    zero_points: &mut [f64],
    store: Store,
) -> std::result::Result<(), usize> {
    let n = x.len();
    let row = |r: usize| &x[(r * cs).min(n)..((r + 1) * cs).min(n)];
    // max(|min|, |max|) is all the symmetric scale reads.
    let magnitude = config.mode == Mode::Symmetric;
    let first = simd::row_range(isa, row(0), magnitude);
    // Row r's parameters from its range, then its codes beside row r + 1's
    // range (`code`); `Err` at the first non-finite row.
    let mut rows = |code: &mut dyn FnMut(usize, Affine) -> simd::Range<f32>| {
        let mut found = first;
        for (r, (sc, zs)) in scales.iter_mut().zip(zero_points.iter_mut()).enumerate() {
            if found.non_finite {
                return Err(r * cs + simd::scalar::first_non_finite(row(r)));
            }
            let range = Some((found.min as f64, found.max as f64));
            let (scale, zp) = scale_zero_point(range, config);
            (*sc, *zs) = (scale, zp);
            found = code(r, affine(config, range, scale, zp));
        }
        Ok(())
    };
    match out {
        // One fence for all rows' streaming stores, when the scope ends.
        TaskOut::Int8(c) => simd::rows_out(c, store, |o| {
            rows(&mut |r, a| {
                let (next, ahead) = (row(r + 1), row(r + 2));
                o.affine_quantize_f32_then_range(isa, r * cs, row(r), a, next, ahead, magnitude)
            })
        }),
        TaskOut::Int4(mut w) => rows(&mut |r, a| {
            w.write_affine_f32_then_range(isa, row(r), a, row(r + 1), row(r + 2), magnitude)
        }),
    }
}

/// Codes one row of a per-channel task: its index, values, map, and the
/// next row to bring in meanwhile.
type CodeRow<'c, T> = dyn FnMut(usize, &[T], Affine, &[T], &mut Scratch) + 'c;

/// A task's share of the output codes.
enum TaskOut<'a> {
    Int8(&'a mut [i8]),
    Int4(Int4Writer<'a>),
}

/// Dequantize: `out[i] = (q[i] - zp) * scale` of element i's group, computed
/// in f64 and rounded once to `O`.
///
/// Errors: `ShapeMismatch` for inconsistent lengths, `InvalidConfig` for codes
/// of the wrong width.
pub fn dequantize<O: Float>(
    codes: Codes<'_>,
    shape: &[usize],
    config: &QuantConfig,
    scales: &[f64],
    zero_points: &[f64],
    out: &mut [O],
) -> Result<()> {
    dequantize_with(
        Isa::detected(),
        codes,
        shape,
        config,
        scales,
        zero_points,
        out,
    )
}

/// [`dequantize`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn dequantize_with<O: Float>(
    isa: Isa,
    codes: Codes<'_>,
    shape: &[usize],
    config: &QuantConfig,
    scales: &[f64],
    zero_points: &[f64],
    out: &mut [O],
) -> Result<()> {
    let _env = crate::simd::fpenv::Pinned::new();
    let n = out.len();
    // The input's length is `out`'s here (the codes are checked next).
    check_lengths(shape, config, n, scales.len(), zero_points.len()).map_err(|e| match e {
        QuantError::ShapeMismatch {
            arg: "x",
            expected,
            actual,
        } => QuantError::ShapeMismatch {
            arg: "out",
            expected,
            actual,
        },
        e => e,
    })?;
    codes.check(config, n)?;
    // Elements per (scale, zero point) group.
    let cs = if config.granularity == Granularity::PerChannel && !shape.is_empty() {
        n.checked_div(shape[0]).unwrap_or(0)
    } else {
        n
    };
    if n == 0 {
        return Ok(());
    }
    let size = std::mem::size_of::<O>();
    // Rows of one group are cut into runs of at most `len` elements (even, so
    // int4 runs start on a byte unless a row itself starts mid-byte).
    let run = |e0: usize, o: &mut [O], scratch: &mut Scratch, par: bool| {
        let g = e0 / cs;
        let (zp, scale) = (zero_points[g], scales[g]);
        let store = Store::for_run(n.saturating_mul(size), o.len().saturating_mul(size), par);
        match codes {
            Codes::Int8(c) => {
                stage::affine_values(isa, &c[e0..e0 + o.len()], zp, scale, o, scratch, store)
            }
            Codes::Int4(p) => {
                let mut q = std::mem::take(&mut scratch.codes);
                q.resize(STAGE.min(o.len()), 0);
                for (k, os) in o.chunks_mut(STAGE).enumerate() {
                    let qs = &mut q[..os.len()];
                    unpack_range(isa, p, e0 + k * STAGE, qs);
                    stage::affine_values(isa, qs, zp, scale, os, scratch, store);
                }
                scratch.codes = q;
            }
        }
    };
    // Measured break-even: 2^20 elements took 227 µs on one thread, 258 on two;
    // 2^22 took 1.23 ms and 1.15 ms. Work is counted at a sixteenth per element.
    // A task's span of the output, split at group boundaries.
    let span = |start: usize, o: &mut [O], par: bool| {
        let mut scratch = Scratch::new();
        let mut done = 0;
        while done < o.len() {
            let e0 = start + done;
            let group_end = (e0 / cs + 1) * cs;
            let end = group_end.min(start + o.len());
            run(e0, &mut o[done..end - start], &mut scratch, par);
            done = end - start;
        }
    };
    parallel::run(n / 16, |par| {
        if !par {
            return span(0, out, false);
        }
        let len = flat_task_len(n);
        out.par_chunks_mut(len)
            .enumerate()
            .for_each(|(t, o)| span(t * len, o, true))
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    struct Q {
        data: Vec<i8>,
        packed: Vec<u8>,
        scales: Vec<f64>,
        zps: Vec<f64>,
    }

    fn q<T: Float>(x: &[T], shape: &[usize], c: QuantConfig) -> Result<Q> {
        let groups = num_groups(shape, c.granularity);
        let mut out = Q {
            data: vec![0; x.len()],
            packed: vec![0; packed_len(x.len())],
            scales: vec![0.0; groups],
            zps: vec![0.0; groups],
        };
        let codes = match c.bits {
            Bits::Int8 => CodesMut::Int8(&mut out.data),
            Bits::Int4 => CodesMut::Int4(&mut out.packed),
        };
        quantize(x, shape, &c, codes, &mut out.scales, &mut out.zps)?;
        Ok(out)
    }

    #[test]
    fn seed_int8_symmetric_per_tensor() -> Result<()> {
        // Seed 001's test: [1, -0.5, 0.25, -1, 0, 0.75] in shape [2, 3].
        let x = [1.0f32, -0.5, 0.25, -1.0, 0.0, 0.75];
        let r = q(&x, &[2, 3], QuantConfig::int8())?;
        assert_eq!(r.scales, vec![1.0 / 127.0]);
        assert_eq!(r.zps, vec![0.0]);
        assert_eq!(r.data, vec![127, -64, 32, -127, 0, 95]);
        let mut y = vec![0f32; 6];
        dequantize(
            Codes::Int8(&r.data),
            &[2, 3],
            &QuantConfig::int8(),
            &r.scales,
            &r.zps,
            &mut y,
        )?;
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 0.02);
        }
        Ok(())
    }

    #[test]
    fn qmin_qmax_follow_the_seed_table() {
        let t = |c: QuantConfig| (c.qmin(), c.qmax());
        assert_eq!(t(QuantConfig::int8()), (-127.0, 127.0));
        assert_eq!(t(QuantConfig::int8().asymmetric()), (-128.0, 127.0));
        assert_eq!(t(QuantConfig::int4()), (-7.0, 7.0));
        assert_eq!(t(QuantConfig::int4_per_channel().asymmetric()), (-8.0, 7.0));
    }

    #[test]
    fn asymmetric_zero_point_and_codes() -> Result<()> {
        let x = [0.0f64, 1.0, 2.0, 3.0];
        let c = QuantConfig::int4().asymmetric();
        let r = q(&x, &[4], c)?;
        // scale = 3 / 15 = 0.2; zp = round(-8 - 0 / 0.2) = -8.
        assert_eq!(r.scales, vec![3.0 / 15.0]);
        assert_eq!(r.zps, vec![-8.0]);
        // codes: -8, round(1/0.2 - 8) = -3, 2, 7 -> nibbles 8, d, 2, 7
        assert_eq!(r.packed, vec![0xd8, 0x72]);
        Ok(())
    }

    #[test]
    fn tiny_scales_give_zero_inverse() -> Result<()> {
        // amax 1e-29 >= 1e-30, so scale = 1e-29 / 127 < 1e-30 and inv = 0: all codes 0.
        let r = q(&[1e-29f64, -5e-30], &[2], QuantConfig::int8())?;
        assert_eq!(r.scales, vec![1e-29 / 127.0]);
        assert_eq!(r.data, vec![0, 0]);
        Ok(())
    }

    #[test]
    fn empty_inputs_follow_the_spec() -> Result<()> {
        let r = q::<f32>(&[], &[0], QuantConfig::int8())?;
        assert_eq!((r.scales, r.zps), (vec![1.0], vec![0.0]));
        let r = q::<f32>(&[], &[0, 4], QuantConfig::int8_per_channel())?;
        assert!(r.scales.is_empty());
        let r = q::<f32>(&[], &[3, 0], QuantConfig::int4_per_channel().asymmetric())?;
        assert_eq!((r.scales, r.zps), (vec![1.0; 3], vec![0.0; 3]));
        Ok(())
    }

    #[test]
    fn zero_d_per_channel_is_per_tensor() -> Result<()> {
        let r = q(&[2.5f32], &[], QuantConfig::int8_per_channel())?;
        assert_eq!(r.scales, vec![2.5 / 127.0]);
        assert_eq!(r.data, vec![127]);
        Ok(())
    }

    #[test]
    fn per_channel_rows_have_their_own_scales() -> Result<()> {
        let x = [1.0f32, -2.0, 4.0, 0.5, 0.0, 0.0];
        let r = q(&x, &[3, 2], QuantConfig::int8_per_channel())?;
        assert_eq!(r.scales, vec![2.0 / 127.0, 4.0 / 127.0, 1.0]);
        assert_eq!(r.data, vec![64, -127, 127, 16, 0, 0]);
        Ok(())
    }

    #[test]
    fn non_finite_names_the_first_index() {
        let mut x = vec![1.0f32; 1000];
        x[700] = f32::NAN;
        x[300] = f32::NEG_INFINITY;
        for c in [
            QuantConfig::int8(),
            QuantConfig::int4_per_channel().asymmetric(),
        ] {
            let e = q(&x, &[10, 100], c).err();
            assert_eq!(
                e,
                Some(QuantError::NonFinite {
                    arg: "x",
                    index: 300
                })
            );
        }
        let e = q(&[0.0f64, 1e300, f64::INFINITY], &[3], QuantConfig::int8()).err();
        assert_eq!(e, Some(QuantError::NonFinite { arg: "x", index: 2 }));
    }

    #[test]
    fn half_inputs_equal_their_f64_values_and_outputs_round_once() -> Result<()> {
        let xf: Vec<f32> = (0..3001)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
            .collect();
        let xh: Vec<f16> = xf.iter().map(|&v| f16::from_f32(v)).collect();
        let xd: Vec<f64> = xh.iter().map(|v| v.to_f64()).collect();
        for c in [
            QuantConfig::int8(),
            QuantConfig::int4_per_channel().asymmetric(),
        ] {
            let shape = [3001usize];
            let a = q(&xh, &shape, c)?;
            let b = q(&xd, &shape, c)?;
            assert_eq!(
                (&a.data, &a.packed, &a.scales, &a.zps),
                (&b.data, &b.packed, &b.scales, &b.zps)
            );
        }
        let xb: Vec<bf16> = xf.iter().map(|&v| bf16::from_f32(v)).collect();
        let c = QuantConfig::int8();
        let r = q(&xb, &[3001], c)?;
        let mut yb = vec![bf16::ZERO; xb.len()];
        let mut yd = vec![0f64; xb.len()];
        dequantize(
            Codes::Int8(&r.data),
            &[3001],
            &c,
            &r.scales,
            &r.zps,
            &mut yb,
        )?;
        dequantize(
            Codes::Int8(&r.data),
            &[3001],
            &c,
            &r.scales,
            &r.zps,
            &mut yd,
        )?;
        for (b, d) in yb.iter().zip(&yd) {
            assert_eq!(*b, bf16::from_f64_once(*d));
        }
        Ok(())
    }

    #[test]
    fn bad_lengths_and_widths_are_rejected() {
        let x = [1.0f32; 6];
        let mut d = vec![0i8; 6];
        let (mut s, mut z) = (vec![0.0; 1], vec![0.0; 1]);
        let e = quantize(
            &x,
            &[2, 2],
            &QuantConfig::int8(),
            CodesMut::Int8(&mut d),
            &mut s,
            &mut z,
        );
        assert!(matches!(e, Err(QuantError::ShapeMismatch { arg: "x", .. })));
        let mut p = vec![0u8; 3];
        let e = quantize(
            &x,
            &[6],
            &QuantConfig::int8(),
            CodesMut::Int4(&mut p),
            &mut s,
            &mut z,
        );
        assert!(matches!(
            e,
            Err(QuantError::InvalidConfig { arg: "data", .. })
        ));
        let e = quantize(
            &x,
            &[2, 3],
            &QuantConfig::int8_per_channel(),
            CodesMut::Int8(&mut d),
            &mut s,
            &mut z,
        );
        assert!(matches!(
            e,
            Err(QuantError::ShapeMismatch { arg: "scales", .. })
        ));
    }
}
