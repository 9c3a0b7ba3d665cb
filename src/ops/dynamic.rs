//! Dynamic activation quantization — SPEC §3, ported from seed 002
//! (oxibonsai `dynamic_quant`): `compute_scale`, `dynamic_quantize_int8`,
//! `dynamic_quantize_int8_per_row`, `dynamic_quantize_int4` and their
//! dequantization.
//!
//! Math in f32, as the seed: a group's statistic is max |x| (`MaxAbs`) or the
//! element of rank `ceil(p·n) − 1` of the sorted |x| (`Percentile(p)`);
//! `scale = statistic / clip` (0 when the statistic is 0); codes
//! `clamp(round(v / scale), -clip, clip)` (clip 127 or 7), all zero when the
//! scale is 0; values `q as f32 * scale`.
//!
//! Deviations (SPEC): int4 codes are packed two a byte (1); non-finite input
//! is an error (2); the percentile rank is computed from one f64 multiply and
//! found by O(n) selection instead of a sort (3); per-row input is 2-D (5).
//!
//! ```
//! # fn main() -> Result<(), ferroquant::QuantError> {
//! use ferroquant::ops::dynamic::{compute_scale, dynamic_quantize, DynCodesMut, DynFormat, ScaleMode};
//!
//! let x = [0.5f32, -1.0, 0.25, 100.0]; // one outlier
//! assert_eq!(compute_scale(&x, 127.0, ScaleMode::MaxAbs)?, 100.0 / 127.0);
//! // The 50th percentile of |x| ignores it: rank ceil(0.5 * 4) - 1 = 1 of [0.25, 0.5, 1, 100].
//! let p50 = ScaleMode::percentile(0.5)?;
//! assert_eq!(compute_scale(&x, 127.0, p50)?, 0.5 / 127.0);
//! let (mut codes, mut scale) = ([0i8; 4], [0f32]);
//! dynamic_quantize(&x, &[4], DynFormat::Int8PerTensor, p50, DynCodesMut::Int8(&mut codes), &mut scale)?;
//! assert_eq!(codes, [127, -127, 64, 127]); // clipped at ±127
//! # Ok(())
//! # }
//! ```

use crate::element::Float;
use crate::error::{QuantError, Result};
use crate::ops::drive::split_quantize;
use crate::ops::pack::{packed_len, unpack_range, Int4Writer};
use crate::parallel;
use crate::simd::{self, AbsmaxRule, Isa, Store, F32_INF_BITS};
use crate::stage::STAGE;
use rayon::prelude::*;

/// How a group's scale is found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleMode {
    /// `max |x| / clip`.
    MaxAbs,
    /// `|x|` at rank `ceil(p·n) − 1` (clamped to `[0, n − 1]`) of the sorted
    /// `|x|`, over `clip`; `p` in (0, 1].
    Percentile(f64),
}

impl ScaleMode {
    /// `Percentile(p)`, or `InvalidConfig` naming `p` outside (0, 1].
    pub fn percentile(p: f64) -> Result<ScaleMode> {
        if p > 0.0 && p <= 1.0 {
            Ok(ScaleMode::Percentile(p))
        } else {
            Err(QuantError::invalid(
                "p",
                format!("expected a percentile in (0, 1], got {p}"),
            ))
        }
    }

    /// `self` if valid: a `Percentile` built directly (not through
    /// [`ScaleMode::percentile`]) is checked again by every kernel.
    fn checked(self) -> Result<ScaleMode> {
        match self {
            ScaleMode::Percentile(p) => ScaleMode::percentile(p),
            m => Ok(m),
        }
    }
}

/// The percentile rank of SPEC §3: `ceil(p·n) − 1` with `p·n` one f64
/// multiplication, clamped to `[0, n − 1]` (`n >= 1`).
pub fn percentile_rank(p: f64, n: usize) -> usize {
    let r = (p * n as f64).ceil();
    // `as usize` saturates (and maps NaN to 0), as the seed's cast does.
    (r as usize).saturating_sub(1).min(n.saturating_sub(1))
}

/// The three formats of a dynamically quantized tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DynFormat {
    /// One scale for the tensor, int8 codes.
    Int8PerTensor,
    /// One scale per row of a 2-D tensor, int8 codes.
    Int8PerRow,
    /// One scale for the tensor, int4 codes packed two a byte.
    Int4PerTensor,
}

impl DynFormat {
    /// The largest code: 127 or 7.
    pub fn clip(self) -> f32 {
        match self {
            DynFormat::Int4PerTensor => 7.0,
            _ => 127.0,
        }
    }

    fn rule(self) -> AbsmaxRule {
        AbsmaxRule {
            divisor: self.clip(),
            zero_scale: 0.0,
            clip: self.clip(),
        }
    }
}

/// Where codes go: int8 one a byte, or int4 packed.
#[derive(Debug)]
pub enum DynCodesMut<'a> {
    /// int8 codes, one per element.
    Int8(&'a mut [i8]),
    /// int4 codes packed two a byte, `ceil(n / 2)` bytes.
    Int4(&'a mut [u8]),
}

/// Reads a group as f32 a stage at a time (f32 input in place).
pub(crate) fn for_each_stage<T: Float>(
    isa: Isa,
    x: &[T],
    stage: &mut Vec<f32>,
    mut f: impl FnMut(usize, &[f32]) -> std::result::Result<(), usize>,
) -> std::result::Result<(), usize> {
    if let Some(xf) = T::as_f32_slice(x) {
        return f(0, xf);
    }
    stage.resize(STAGE.min(x.len()), 0.0);
    for (k, xs) in x.chunks(STAGE).enumerate() {
        let st = &mut stage[..xs.len()];
        T::convert_to_f32(isa, xs, st);
        f(k * STAGE, st)?;
    }
    Ok(())
}

/// [`for_each_stage`] over stages checked first: `Err(i)` names the first
/// NaN or infinity (group index) before `f` sees its stage; `f` also gets the
/// stage's max |x| bit pattern.
fn finite_stages<T: Float>(
    isa: Isa,
    x: &[T],
    stage: &mut Vec<f32>,
    mut f: impl FnMut(&[f32], u32),
) -> std::result::Result<(), usize> {
    for_each_stage(isa, x, stage, |off, xs| {
        let m = simd::absmax_bits(isa, xs);
        if m >= F32_INF_BITS {
            return Err(off + simd::scalar::first_non_finite(xs));
        }
        f(xs, m);
        Ok(())
    })
}

/// Bits an |x| bit pattern is shifted by to find its bin of [`abs_histogram`].
pub(crate) const BIN_SHIFT: u32 = 15;

/// Counts of |x| by the top 16 bits of its bit pattern (65536 bins, ordered as
/// the values are), or the group index of the first NaN or infinity.
pub(crate) fn abs_histogram<T: Float>(
    isa: Isa,
    x: &[T],
    stage: &mut Vec<f32>,
) -> std::result::Result<Vec<u64>, usize> {
    let mut hist = vec![0u64; 1 << 16];
    add_abs_histogram(isa, x, stage, &mut hist)?;
    Ok(hist)
}

/// [`abs_histogram`] added into `hist` (65536 bins).
pub(crate) fn add_abs_histogram<T: Float>(
    isa: Isa,
    x: &[T],
    stage: &mut Vec<f32>,
    hist: &mut [u64],
) -> std::result::Result<(), usize> {
    finite_stages(isa, x, stage, |xs, _| count_bins(hist, xs))
}

/// Add each |x| of `xs` to its bin of [`abs_histogram`]'s table (u64
/// counts; the percentile's sample counts in u32, half the table).
fn count_bins<C: std::ops::AddAssign + From<u8>>(hist: &mut [C], xs: &[f32]) {
    for v in xs {
        hist[((v.to_bits() & 0x7fff_ffff) >> BIN_SHIFT) as usize] += C::from(1);
    }
}

/// A group's statistic (max |x| or the percentile of |x|), or the group index
/// of its first non-finite value. `bits` is scratch for the percentile.
fn statistic<T: Float>(
    isa: Isa,
    x: &[T],
    mode: ScaleMode,
    stage: &mut Vec<f32>,
    bits: &mut Vec<u32>,
) -> std::result::Result<f32, usize> {
    match mode {
        ScaleMode::MaxAbs => max_abs(isa, x, stage),
        ScaleMode::Percentile(p) => {
            if x.is_empty() {
                return Ok(0.0);
            }
            let rank = percentile_rank(p, x.len());
            if x.len() >= HISTOGRAM_MIN {
                if let Some(v) = percentile_in_one_pass(isa, x, rank, stage, bits)? {
                    return Ok(v);
                }
                return percentile_by_histogram(isa, x, rank, stage);
            }
            // |x| as bit patterns: for non-negative finite floats their integer
            // order is the float order, so selection on integers is exact.
            bits.clear();
            bits.reserve(x.len());
            finite_stages(isa, x, stage, |xs, _| {
                bits.extend(xs.iter().map(|v| v.to_bits() & 0x7fff_ffff));
            })?;
            let (_, v, _) = bits.select_nth_unstable(rank);
            Ok(f32::from_bits(*v))
        }
    }
}

/// max |x| (0 for no values), or the group index of the first non-finite value.
fn max_abs<T: Float>(isa: Isa, x: &[T], stage: &mut Vec<f32>) -> std::result::Result<f32, usize> {
    let mut m = 0u32;
    finite_stages(isa, x, stage, |_, b| m = m.max(b))?;
    Ok(f32::from_bits(m))
}

/// [`statistic`] of a whole tensor: max |x| across the pool for long inputs
/// (the maximum is the same whatever the split; the first non-finite index
/// wins), the percentile on this thread.
fn tensor_statistic<T: Float>(
    isa: Isa,
    x: &[T],
    mode: ScaleMode,
    stage: &mut Vec<f32>,
    bits: &mut Vec<u32>,
) -> std::result::Result<f32, usize> {
    if mode != ScaleMode::MaxAbs {
        return statistic(isa, x, mode, stage, bits);
    }
    let n = x.len();
    parallel::run(n, |par| {
        if !par {
            return statistic(isa, x, mode, stage, bits);
        }
        let chunk = parallel::units_per_task(n.div_ceil(STAGE), STAGE) * STAGE;
        x.par_chunks(chunk)
            .enumerate()
            .map(|(t, xs)| max_abs(isa, xs, &mut Vec::new()).map_err(|i| t * chunk + i))
            .reduce(|| Ok(0.0), |a, b| parallel::first_error(a, b, f32::max))
    })
}

/// Groups at least this large find their percentile with a histogram of the
/// top 16 bits of |x| (a 256 KiB table); smaller ones copy and select.
const HISTOGRAM_MIN: usize = 1 << 16;

/// Every `SAMPLE_EVERY`-th stage of a large group is read ahead of the main
/// pass to guess where its percentile lies.
const SAMPLE_EVERY: usize = 64;

/// The |x| of rank `rank` in one streaming pass, when a sample places it: a
/// histogram of every [`SAMPLE_EVERY`]-th stage's |x| gives a threshold that,
/// with a wide margin, fewer values than `n - rank` lie above; the pass then
/// checks every stage for non-finite values and keeps the |x| at or above the
/// threshold. If the value of rank `rank` is among them (the `n - kept`
/// others are all smaller) it is selected there: exact, whatever the sample
/// said. `Ok(None)` when the threshold would keep more than an eighth of the
/// values, the kept ones outgrow twice the sample's estimate (or a quarter of
/// the values), or did not reach the rank: the caller takes the two-pass
/// path. `bits` never grows past what was reserved up front.
fn percentile_in_one_pass<T: Float>(
    isa: Isa,
    x: &[T],
    rank: usize,
    stage: &mut Vec<f32>,
    bits: &mut Vec<u32>,
) -> std::result::Result<Option<f32>, usize> {
    let n = x.len();
    let above = (n - rank) as u64;
    let mut hist = vec![0u32; 1 << 16];
    let mut m = 0u64;
    for xs in x.chunks(STAGE).step_by(SAMPLE_EVERY) {
        // Non-finite values only land in the top bins; the main pass reports them.
        let _ = for_each_stage(isa, xs, stage, |_, s| {
            count_bins(&mut hist, s);
            Ok(())
        });
        m += xs.len() as u64;
    }
    // How many sampled values must lie at or above the threshold: the rank's
    // share of the sample plus eight standard deviations and a constant.
    let want = (above * m).div_ceil(n as u64);
    let want = want + 8 * (want as f64).sqrt().ceil() as u64 + 32;
    let (mut bin, mut count) = (hist.len(), 0u64);
    while bin > 0 && count < want {
        bin -= 1;
        count += hist[bin] as u64;
    }
    if count < want || bin == 0 || count * 8 > m {
        return Ok(None);
    }
    let threshold = (bin as u32) << BIN_SHIFT;
    // Room for twice the values the sample expects above the threshold (at
    // most a quarter of them all), reserved up front: an allocation that
    // fails sends the call to the two-pass path, and the pass stops keeping
    // values before `bits` would have to grow (a stage adds at most STAGE,
    // and `select_at_least` asks for 2048 more than it writes).
    const HEADROOM: usize = STAGE + 2048 + 64;
    let expected = (count as u128 * n as u128 / m as u128) as usize;
    let room = expected.saturating_mul(2).min(n / 4) + HEADROOM;
    bits.clear();
    if bits.try_reserve(room).is_err() {
        return Ok(None);
    }
    let mut full = false;
    for_each_stage(isa, x, stage, |off, xs| {
        for (k, s) in xs.chunks(STAGE).enumerate() {
            if simd::absmax_bits(isa, s) >= F32_INF_BITS {
                return Err(off + k * STAGE + simd::scalar::first_non_finite(s));
            }
            full = full || bits.capacity() - bits.len() < HEADROOM;
            if !full {
                simd::select_at_least(isa, s, threshold, bits);
            }
        }
        Ok(())
    })?;
    let below = n - bits.len();
    if full || rank < below {
        return Ok(None);
    }
    let (_, v, _) = bits.select_nth_unstable(rank - below);
    Ok(Some(f32::from_bits(*v)))
}

/// The |x| of rank `rank` in two streaming passes, with no copy of the input
/// and no memory that grows with it: a histogram of the top 16 bits of each
/// |x| bit pattern (with the non-finite check) finds the bin holding the rank;
/// a second histogram, of the low 15 bits of that bin's values, finds the
/// value itself (the two histograms give all 31 bits). Exact: bins are ranges
/// of bit patterns, ordered as the values are. Ties cost nothing (a constant
/// input puts every value in one bin, which the old collect-and-select kept
/// whole). Should `x` change between the passes (another thread writing it),
/// the result is a value of the bin the first pass found, never a panic.
fn percentile_by_histogram<T: Float>(
    isa: Isa,
    x: &[T],
    rank: usize,
    stage: &mut Vec<f32>,
) -> std::result::Result<f32, usize> {
    let hist = abs_histogram(isa, x, stage)?;
    let (mut bin, mut below) = (0usize, 0u64);
    for (b, &c) in hist.iter().enumerate() {
        bin = b;
        if below + c > rank as u64 {
            break;
        }
        below += c;
    }
    let low = low_histogram(isa, x, bin, stage);
    let mut r = (rank as u64).saturating_sub(below);
    let mut sub = 0usize;
    for (s, &c) in low.iter().enumerate() {
        if c > r {
            sub = s;
            break;
        }
        r -= c;
    }
    Ok(f32::from_bits(((bin as u32) << BIN_SHIFT) | sub as u32))
}

/// Counts of the |x| in bin `bin` of [`abs_histogram`], by their low
/// [`BIN_SHIFT`] bits: with the bin, each count is of one exact value. Reads
/// `x` once more; its non-finite values (already reported by the first pass,
/// or written since by another thread) only land in the top bins.
pub(crate) fn low_histogram<T: Float>(
    isa: Isa,
    x: &[T],
    bin: usize,
    stage: &mut Vec<f32>,
) -> Vec<u64> {
    const LOW_MASK: u32 = (1 << BIN_SHIFT) - 1;
    let mut low = vec![0u64; 1 << BIN_SHIFT];
    let _ = for_each_stage(isa, x, stage, |_, xs| {
        for v in xs {
            let b = v.to_bits() & 0x7fff_ffff;
            if (b >> BIN_SHIFT) as usize == bin {
                low[(b & LOW_MASK) as usize] += 1;
            }
        }
        Ok(())
    });
    low
}

/// Seed 002's `compute_scale`: 0.0 for empty input or a zero statistic, else
/// `statistic / clip` (inf, as the seed, when a tiny `clip` overflows the
/// quotient). Errors: `NonFinite` naming the first NaN or infinity;
/// `InvalidConfig` for a `clip` that is not finite and > 0.
pub fn compute_scale<T: Float>(x: &[T], clip: f32, mode: ScaleMode) -> Result<f32> {
    compute_scale_with(Isa::detected(), x, clip, mode)
}

/// [`compute_scale`] on a chosen ISA.
pub fn compute_scale_with<T: Float>(isa: Isa, x: &[T], clip: f32, mode: ScaleMode) -> Result<f32> {
    let mode = mode.checked()?;
    if !(clip.is_finite() && clip > 0.0) {
        return Err(QuantError::invalid(
            "clip_val",
            format!("expected a finite value > 0, got {clip}"),
        ));
    }
    let _env = crate::simd::fpenv::Pinned::new();
    let s = tensor_statistic(isa, x, mode, &mut Vec::new(), &mut Vec::new())
        .map_err(|index| QuantError::NonFinite { arg: "x", index })?;
    Ok(scale_of(s, clip))
}

fn scale_of(statistic: f32, clip: f32) -> f32 {
    if statistic == 0.0 {
        0.0
    } else {
        statistic / clip
    }
}

/// Codes of a group with a known scale (all zero for scale 0), written to an
/// int8 slice or appended to an int4 writer.
fn codes_with_scale<T: Float>(
    isa: Isa,
    x: &[T],
    (scale, clip): (f32, f32),
    out: &mut GroupOut<'_, '_>,
    stage: &mut Vec<f32>,
    codes: &mut Vec<i8>,
    store: Store,
) {
    match out {
        GroupOut::Int8(c) => {
            if scale == 0.0 {
                c.fill(0);
                return;
            }
            // One fence for all spans' streaming stores, when the scope ends.
            simd::rows_out(c, store, |o| {
                if let Some(xf) = T::as_f32_slice(x) {
                    // A span at a time, the next one prefetched meanwhile.
                    for (off, xs, ahead) in crate::stage::spans_ahead(xf) {
                        o.quantize_scaled_ahead(isa, off, xs, scale, clip, ahead);
                    }
                    return;
                }
                let _ = for_each_stage(isa, x, stage, |off, xs| {
                    o.quantize_scaled_ahead(isa, off, xs, scale, clip, &[]);
                    Ok(())
                });
            });
        }
        GroupOut::Int4(w) => {
            codes.resize(STAGE.min(x.len()), 0);
            for xs in x.chunks(STAGE) {
                let cs = &mut codes[..xs.len()];
                if scale == 0.0 {
                    cs.fill(0);
                } else {
                    let _ = for_each_stage(isa, xs, stage, |_, xf| {
                        simd::quantize_scaled(isa, xf, scale, clip, cs, Store::Cached);
                        Ok(())
                    });
                }
                w.write(isa, cs);
            }
        }
    }
}

/// `codes[i] = clamp(round(x[i] / scale), -clip, clip)` for a scale known in
/// advance (`scale > 0`, `x` known finite), across the pool for long inputs
/// (elementwise, so any split gives the same codes).
pub(crate) fn quantize_known_scale<T: Float>(
    isa: Isa,
    x: &[T],
    scale: f32,
    clip: f32,
    codes: &mut [i8],
) {
    let n = x.len();
    let run = |xs: &[T], cs: &mut [i8], par: bool| {
        let mut stage = Vec::new();
        codes_with_scale(
            isa,
            xs,
            (scale, clip),
            &mut GroupOut::Int8(cs),
            &mut stage,
            &mut Vec::new(),
            Store::for_run(n, xs.len(), par),
        );
    };
    parallel::run(n, |par| {
        if !par {
            return run(x, codes, false);
        }
        let chunk = parallel::units_per_task(n.div_ceil(STAGE), STAGE) * STAGE;
        x.par_chunks(chunk)
            .zip(codes.par_chunks_mut(chunk))
            .for_each(|(xs, cs)| run(xs, cs, true));
    });
}

enum GroupOut<'a, 'b> {
    Int8(&'a mut [i8]),
    Int4(&'a mut Int4Writer<'b>),
}

/// Quantize `x` (of `shape`, C order) in `format` with `mode`: codes into
/// `codes`, one f32 scale per group into `scales` (1 per tensor, `shape[0]`
/// per row; none for an empty per-row input).
///
/// Errors: `ShapeMismatch` for a per-row shape that is not 2-D (naming `x2d`)
/// or wrong output lengths; `NonFinite` naming the first NaN or infinity.
pub fn dynamic_quantize<T: Float>(
    x: &[T],
    shape: &[usize],
    format: DynFormat,
    mode: ScaleMode,
    codes: DynCodesMut<'_>,
    scales: &mut [f32],
) -> Result<()> {
    dynamic_quantize_with(Isa::detected(), x, shape, format, mode, codes, scales)
}

/// Scales [`dynamic_quantize`] writes for `shape` in `format`.
pub fn num_scales(shape: &[usize], format: DynFormat) -> usize {
    match format {
        DynFormat::Int8PerRow => match shape {
            [rows, cols] if *rows > 0 && *cols > 0 => *rows,
            _ => 0,
        },
        _ => 1,
    }
}

/// [`dynamic_quantize`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn dynamic_quantize_with<T: Float>(
    isa: Isa,
    x: &[T],
    shape: &[usize],
    format: DynFormat,
    mode: ScaleMode,
    codes: DynCodesMut<'_>,
    scales: &mut [f32],
) -> Result<()> {
    let mode = mode.checked()?;
    let _env = crate::simd::fpenv::Pinned::new();
    let n = x.len();
    let want = super::shape_numel(shape);
    if format == DynFormat::Int8PerRow && shape.len() != 2 {
        return Err(QuantError::ShapeMismatch {
            arg: "x2d",
            expected: "a 2-D array".into(),
            actual: format!("{}-D", shape.len()),
        });
    }
    match want {
        Some(w) if w == n => {}
        Some(w) => return Err(QuantError::len_mismatch("x", w, n)),
        None => {
            return Err(QuantError::ShapeMismatch {
                arg: "x",
                expected: format!("shape {shape:?}, which holds more than usize::MAX elements"),
                actual: format!("{n} elements"),
            })
        }
    }
    if scales.len() != num_scales(shape, format) {
        return Err(QuantError::len_mismatch(
            "scales",
            num_scales(shape, format),
            scales.len(),
        ));
    }
    match (&codes, format) {
        (DynCodesMut::Int8(c), DynFormat::Int8PerTensor | DynFormat::Int8PerRow)
            if c.len() == n => {}
        (DynCodesMut::Int4(c), DynFormat::Int4PerTensor) if c.len() == packed_len(n) => {}
        (c, _) => {
            let (kind, want) = match format {
                DynFormat::Int4PerTensor => ("packed int4 bytes", packed_len(n)),
                _ => ("int8 codes", n),
            };
            let got = match c {
                DynCodesMut::Int8(c) => format!("{} int8 codes", c.len()),
                DynCodesMut::Int4(c) => format!("{} packed int4 bytes", c.len()),
            };
            return Err(QuantError::ShapeMismatch {
                arg: "codes",
                expected: format!("{want} {kind} for {format:?} of {n} values"),
                actual: got,
            });
        }
    }
    let nonfinite = |index| QuantError::NonFinite { arg: "x", index };
    let clip = format.clip();
    match (format, codes) {
        (DynFormat::Int8PerRow, DynCodesMut::Int8(c)) => {
            if scales.is_empty() {
                return Ok(());
            }
            let cols = shape[1];
            if mode == ScaleMode::MaxAbs {
                let outcome = parallel::run(n, |par| {
                    split_quantize(isa, x, cols, format.rule(), c, scales, par)
                });
                return outcome.into_result().map(|_| ());
            }
            // Percentile rows: a selection per row, rows across the pool.
            let row = |r0: usize, xs: &[T], cs: &mut [i8], ss: &mut [f32], par: bool| {
                let store = Store::for_run(n, cols, par);
                let (mut stage, mut bits, mut tmp) = (Vec::new(), Vec::new(), Vec::new());
                for (r, ((xr, cr), s)) in
                    xs.chunks(cols).zip(cs.chunks_mut(cols)).zip(ss).enumerate()
                {
                    let st = statistic(isa, xr, mode, &mut stage, &mut bits)
                        .map_err(|i| (r0 + r) * cols + i)?;
                    *s = scale_of(st, clip);
                    codes_with_scale(
                        isa,
                        xr,
                        (*s, clip),
                        &mut GroupOut::Int8(cr),
                        &mut stage,
                        &mut tmp,
                        store,
                    );
                }
                Ok(())
            };
            let rows = scales.len();
            parallel::run(n, |par| {
                if !par {
                    return row(0, x, c, scales, false);
                }
                let tr = parallel::units_per_task(rows, cols);
                x.par_chunks(tr * cols)
                    .zip(c.par_chunks_mut(tr * cols))
                    .zip(scales.par_chunks_mut(tr))
                    .enumerate()
                    .map(|(t, ((xs, cs), ss))| row(t * tr, xs, cs, ss, true))
                    .reduce(|| Ok(()), |a, b| parallel::first_error(a, b, |_, _| ()))
            })
            .map_err(nonfinite)
        }
        (_, codes) => {
            if n == 0 {
                scales[0] = 0.0;
                return Ok(());
            }
            let (mut stage, mut bits, mut tmp) = (Vec::new(), Vec::new(), Vec::new());
            let st = tensor_statistic(isa, x, mode, &mut stage, &mut bits).map_err(nonfinite)?;
            drop(bits);
            let scale = scale_of(st, clip);
            scales[0] = scale;
            match codes {
                DynCodesMut::Int8(c) if scale == 0.0 => c.fill(0),
                DynCodesMut::Int8(c) => quantize_known_scale(isa, x, scale, clip, c),
                DynCodesMut::Int4(c) => {
                    let mut w = Int4Writer::new(c, 0);
                    codes_with_scale(
                        isa,
                        x,
                        (scale, clip),
                        &mut GroupOut::Int4(&mut w),
                        &mut stage,
                        &mut tmp,
                        Store::Cached,
                    )
                }
            }
            Ok(())
        }
    }
}

/// Seed 002's `quantization_mae`: the mean of `|original[i] − restored[i]|`
/// over the common length, summed in f32 in order (the seed's iterator sum),
/// divided by the count in f32; 0 for no values. `original` is read as f32.
///
/// ```
/// use ferroquant::ops::dynamic::quantization_mae;
///
/// assert_eq!(quantization_mae(&[1.0f32, -2.0, 3.0], &[1.5, -2.0]).unwrap(), 0.25);
/// ```
///
/// Errors: `NonFinite` naming `original` (a value that becomes infinite in f32
/// included), else naming `restored`, with the first such index (past the
/// common length too).
pub fn quantization_mae<T: Float>(original: &[T], restored: &[f32]) -> Result<f32> {
    let _env = crate::simd::fpenv::Pinned::new();
    let n = original.len().min(restored.len());
    let mut sum = 0f32;
    for (i, (a, &b)) in original[..n].iter().zip(&restored[..n]).enumerate() {
        let a = a.to_f32();
        if !a.is_finite() {
            return Err(QuantError::NonFinite {
                arg: "original",
                index: i,
            });
        }
        sum += (a - b).abs();
    }
    // Values past the common length are not summed, but are still input.
    if let Some(i) = original[n..].iter().position(|v| !v.to_f32().is_finite()) {
        return Err(QuantError::NonFinite {
            arg: "original",
            index: n + i,
        });
    }
    // A NaN or infinite restored value would make the mean NaN or infinite
    // without a word: refused as the original's are (after them).
    if let Some(i) = restored.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NonFinite {
            arg: "restored",
            index: i,
        });
    }
    Ok(if n == 0 { 0.0 } else { sum / n as f32 })
}

/// [`quantization_mae`] of `original` against the `len` values `codes` hold
/// (`q as f32 * scale` of each element's group of `group`, as
/// [`dequantize_groups`] gives them), without materializing those values:
/// the same f32 sum, in the same order. A product of finite inputs that
/// overflows f32 (a code of 127 times a scale near `f32::MAX / 127`) enters
/// the sum as the ±inf the seed's dequantization gives, so the mean is inf as
/// the seed's is; [`quantization_mae`], handed that inf as a restored value,
/// refuses it as non-finite input instead.
///
/// Errors: `ShapeMismatch` when `codes` or `scales` do not fit `len` and
/// `group`; `NonFinite` naming `original`, else `scales` (a NaN or infinite
/// scale, whether or not a value uses it).
pub fn quantization_mae_codes<T: Float>(
    original: &[T],
    codes: DynCodes<'_>,
    len: usize,
    group: usize,
    scales: &[f32],
) -> Result<f32> {
    let _env = crate::simd::fpenv::Pinned::new();
    // As `dequantize_groups`: a group of no elements is a config error, and
    // no values take any number of scales (per tensor keeps one, 0.0).
    if group == 0 && len > 0 {
        return Err(QuantError::invalid(
            "group",
            format!("expected at least 1 element a group for {len} values, got 0"),
        ));
    }
    let groups = if len == 0 {
        scales.len()
    } else {
        len.div_ceil(group)
    };
    if scales.len() != groups {
        return Err(QuantError::len_mismatch("scales", groups, scales.len()));
    }
    let n = original.len().min(len);
    let sum = match codes {
        DynCodes::Int8(c) => {
            if c.len() != len {
                return Err(QuantError::len_mismatch("data", len, c.len()));
            }
            abs_error_sum(original, n, group, scales, |i| f32::from(c[i]))?
        }
        DynCodes::Int4(p) => {
            if p.len() != packed_len(len) {
                return Err(QuantError::len_mismatch("data", packed_len(len), p.len()));
            }
            abs_error_sum(original, n, group, scales, |i| {
                let nibble = (p[i / 2] >> (4 * (i % 2))) & 15;
                f32::from((nibble ^ 8) as i8 - 8)
            })?
        }
    };
    // Values past the common length are not summed, but are still input.
    if let Some(i) = original[n..].iter().position(|v| !v.to_f32().is_finite()) {
        return Err(QuantError::NonFinite {
            arg: "original",
            index: n + i,
        });
    }
    // A NaN or infinite scale would make the mean so without a word.
    if let Some(i) = scales.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NonFinite {
            arg: "scales",
            index: i,
        });
    }
    Ok(if n == 0 { 0.0 } else { sum / n as f32 })
}

/// The f32 sum, in order, of `|original[i] - code(i) * scale|` over the first
/// `n` elements, group by group.
fn abs_error_sum<T: Float>(
    original: &[T],
    n: usize,
    group: usize,
    scales: &[f32],
    code: impl Fn(usize) -> f32,
) -> Result<f32> {
    let mut sum = 0f32;
    let mut start = 0;
    for &scale in scales {
        if start >= n {
            break;
        }
        let end = (start + group).min(n);
        for (i, a) in original[start..end].iter().enumerate() {
            let a = a.to_f32();
            if !a.is_finite() {
                return Err(QuantError::NonFinite {
                    arg: "original",
                    index: start + i,
                });
            }
            sum += (a - code(start + i) * scale).abs();
        }
        start = end;
    }
    Ok(sum)
}

/// Codes to read back.
#[derive(Debug, Clone, Copy)]
pub enum DynCodes<'a> {
    /// int8 codes, one per element.
    Int8(&'a [i8]),
    /// int4 codes packed two a byte.
    Int4(&'a [u8]),
}

/// `out[i] = q[i] as f32 * scale` of element i's group: groups of `group`
/// elements (the whole tensor per tensor, a row per row).
///
/// Errors: `InvalidConfig` for `group == 0` with values to dequantize;
/// `ShapeMismatch` when `scales` or `out` do not fit the codes.
pub fn dequantize_groups(
    codes: DynCodes<'_>,
    group: usize,
    scales: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let isa = Isa::detected();
    let _env = crate::simd::fpenv::Pinned::new();
    let n = out.len();
    let groups = if n == 0 {
        scales.len()
    } else {
        n.div_ceil(group.max(1))
    };
    if group == 0 && n > 0 {
        return Err(QuantError::invalid(
            "group",
            format!("expected at least 1 element a group for {n} values, got 0"),
        ));
    }
    if scales.len() != groups {
        return Err(QuantError::len_mismatch("scales", groups, scales.len()));
    }
    match codes {
        DynCodes::Int8(c) => {
            if c.len() != n {
                return Err(QuantError::len_mismatch("data", n, c.len()));
            }
            if n > 0 {
                parallel::run(n / 8, |par| {
                    crate::ops::drive::split_dequantize(isa, c, group, scales, out, par)
                });
            }
        }
        DynCodes::Int4(p) => {
            if p.len() != packed_len(n) {
                return Err(QuantError::len_mismatch("data", packed_len(n), p.len()));
            }
            // int4 is per tensor: one scale for every stage.
            let mut q = vec![0i8; STAGE.min(n)];
            for (k, os) in out.chunks_mut(STAGE).enumerate() {
                let qs = &mut q[..os.len()];
                unpack_range(isa, p, k * STAGE, qs);
                let scale = scales[k * STAGE / group];
                if os.len() <= group - (k * STAGE) % group {
                    simd::dequantize_scaled(isa, qs, scale, os);
                } else {
                    for (j, (o, &c)) in os.iter_mut().zip(qs.iter()).enumerate() {
                        *o = c as f32 * scales[(k * STAGE + j) / group];
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod mae_tests {
    use super::*;

    #[test]
    fn a_zero_group_is_named_as_such() {
        let mut out = [0f32; 1];
        let e = dequantize_groups(DynCodes::Int8(&[1]), 0, &[1.0], &mut out).unwrap_err();
        assert!(
            matches!(e, QuantError::InvalidConfig { arg: "group", .. }),
            "{e}"
        );
        assert_eq!(out, [0.0]);
        // No values: no group size needed.
        assert!(dequantize_groups(DynCodes::Int8(&[]), 0, &[], &mut []).is_ok());
    }

    #[test]
    fn mae_refuses_a_non_finite_restored_value() {
        let nf = |r: Result<f32>| match r {
            Err(QuantError::NonFinite { arg, index }) => (arg, index),
            other => panic!("{other:?}"),
        };
        let x = [1.0f32, -2.0, 3.0];
        assert_eq!(
            nf(quantization_mae(&x, &[1.0, f32::NAN, 3.0])),
            ("restored", 1)
        );
        // Past the common length too, as the original's values are.
        assert_eq!(
            nf(quantization_mae(&x[..1], &[1.0, 2.0, f32::NEG_INFINITY])),
            ("restored", 2)
        );
        // The original's are named first.
        assert_eq!(
            nf(quantization_mae(&[1.0f32, 2.0, f32::INFINITY], &[f32::NAN])),
            ("original", 2)
        );
        assert_eq!(quantization_mae(&x, &[1.0, -2.0, 2.0]).unwrap(), 1.0 / 3.0);
        // From codes: a non-finite scale, after the original's values.
        let codes = DynCodes::Int8(&[1, -2, 3]);
        let mae = |o: &[f32], s: &[f32]| quantization_mae_codes(o, codes, 3, 1, s);
        assert_eq!(nf(mae(&x, &[1.0, f32::NAN, 1.0])), ("scales", 1));
        assert_eq!(nf(mae(&[f32::NAN; 3], &[f32::NAN; 3])), ("original", 0));
        assert_eq!(mae(&x, &[1.0, 1.0, 0.5]).unwrap(), 0.5);
        // Finite inputs whose product overflows: the seed's inf, not an error
        // (Python's quantization_mae of f32::MAX quantized per tensor).
        let big = DynCodes::Int8(&[127, 1, -127]);
        let m = quantization_mae_codes(&x, big, 3, 3, &[3e38]).unwrap();
        assert_eq!(m, f32::INFINITY);
    }

    #[test]
    fn mae_of_codes_checks_group_and_scales_as_dequantize_does() {
        // A review: group 0 was "scales: expected length 1, got length 1", and
        // more scales than groups passed.
        let err = quantization_mae_codes(&[1.0f32], DynCodes::Int8(&[1]), 1, 0, &[1.0]);
        assert!(
            matches!(err, Err(QuantError::InvalidConfig { arg: "group", .. })),
            "{err:?}"
        );
        let err = quantization_mae_codes(&[1.0f32; 2], DynCodes::Int8(&[1, 1]), 2, 2, &[1.0; 3]);
        assert!(
            matches!(err, Err(QuantError::ShapeMismatch { arg: "scales", .. })),
            "{err:?}"
        );
        // No values keep any scales (per tensor keeps one).
        assert_eq!(
            quantization_mae_codes(&[] as &[f32], DynCodes::Int8(&[]), 0, 0, &[0.0]).ok(),
            Some(0.0)
        );
    }

    #[test]
    fn mae_of_codes_is_mae_of_their_values() -> Result<()> {
        // Per row (groups of 5) and int4 per tensor (odd length), the original
        // shorter and longer than the codes: the same f32 sum as against the
        // dequantized values.
        let x: Vec<f32> = (0..35)
            .map(|i| ((i * 37) % 23) as f32 * 0.3 - 3.0)
            .collect();
        let (mut c8, mut s8) = (vec![0i8; 35], vec![0f32; 7]);
        dynamic_quantize(
            &x,
            &[7, 5],
            DynFormat::Int8PerRow,
            ScaleMode::MaxAbs,
            DynCodesMut::Int8(&mut c8),
            &mut s8,
        )?;
        let (mut c4, mut s4) = (vec![0u8; packed_len(35)], vec![0f32; 1]);
        dynamic_quantize(
            &x,
            &[35],
            DynFormat::Int4PerTensor,
            ScaleMode::MaxAbs,
            DynCodesMut::Int4(&mut c4),
            &mut s4,
        )?;
        for (codes, group, scales) in [
            (DynCodes::Int8(&c8), 5, &s8[..]),
            (DynCodes::Int4(&c4), 35, &s4[..]),
        ] {
            let mut restored = vec![0f32; 35];
            dequantize_groups(codes, group, scales, &mut restored)?;
            for original in [&x[..], &x[..12], &[&x[..], &[1.0, 2.0]].concat()[..]] {
                let want = quantization_mae(original, &restored)?;
                let got = quantization_mae_codes(original, codes, 35, group, scales)?;
                assert_eq!(got.to_bits(), want.to_bits());
            }
        }
        assert!(quantization_mae_codes(&x, DynCodes::Int8(&c8), 35, 5, &s8[..6]).is_err());
        assert!(quantization_mae_codes(&x, DynCodes::Int4(&c4), 37, 37, &s4).is_err());
        Ok(())
    }
}
