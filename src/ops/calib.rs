//! Calibration statistics — SPEC §3, ported from seed 002 (oxibonsai
//! `CalibStats::collect`), one batch at a time so that a stream of batches
//! never has to be held: per batch the exact min and max, shifted sums for the
//! mean and variance (f64; combined across batches by the caller with Chan et
//! al.'s pairwise update), and the |x| that may still be the p99 (those at or
//! above a threshold), as bit patterns: for non-negative finite floats the
//! integer order is the float order, so selection on them is exact.
//!
//! Deviations (SPEC): sums accumulate in f64 (8); non-finite input is an error (2).

use crate::element::Float;
use crate::error::{QuantError, Result};
use crate::ops::dynamic::{abs_histogram, for_each_stage, low_histogram, BIN_SHIFT};
use crate::parallel;
use crate::simd::{self, Isa};
use crate::stage::STAGE;
use rayon::prelude::*;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// One batch's statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchStats {
    /// Number of values.
    pub n: u64,
    /// The smallest value (+inf for an empty batch).
    pub min: f32,
    /// The largest value (-inf for an empty batch).
    pub max: f32,
    /// The batch mean (0 for an empty batch).
    pub mean: f64,
    /// The sum of squared deviations from the batch mean.
    pub m2: f64,
    /// Bit patterns of the largest `|x|`, at most `keep` of them: those above
    /// the threshold, then as many equal to it as there is room for.
    pub candidates: Vec<u32>,
    /// The largest `|x|` bit pattern below the threshold (0 if none).
    pub below_max: u32,
}

/// Elements per task: partial sums are formed over these fixed chunks and
/// added in chunk order, so results do not depend on the thread count.
const CHUNK: usize = 16 * STAGE;

/// Elements per wave of [`batch_stats`]: at most this many candidates (1 Mi,
/// 4 MiB, briefly twice while they are merged) are held beyond `keep` while a
/// batch is read. The result does not depend on it: each wave keeps the
/// `keep` largest so far, whatever the waves.
const WAVE: usize = 16 * CHUNK;

struct Part {
    min: f32,
    max: f32,
    s1: f64,
    s2: f64,
    /// `|x|` above the threshold (every `|x|` without one).
    candidates: Vec<u32>,
    /// How many `|x|` equal the threshold: counted, not stored.
    ties: u64,
    /// The largest `|x|` below the threshold (0 if none).
    below_max: u32,
}

/// Statistics of one chunk (read as f32), shifted by `k`; `Err(i)` is the
/// chunk index of the first non-finite value. With a threshold, the `|x|`
/// above it are candidates and those equal to it are only counted (a batch of
/// one repeated value must not be copied whole); without one, every `|x|` is.
fn part<T: Float>(
    isa: Isa,
    x: &[T],
    k: f64,
    threshold: Option<u32>,
) -> std::result::Result<Part, usize> {
    let mut stage = Vec::new();
    let xf: &[f32] = match T::as_f32_slice(x) {
        Some(xf) => xf,
        None => {
            stage.resize(x.len(), 0.0);
            T::convert_to_f32(isa, x, &mut stage);
            &stage
        }
    };
    let r = simd::range_f32(isa, xf);
    if r.non_finite {
        return non_finite_or_redo(isa, xf, k, threshold);
    }
    let (s1, s2) = simd::shifted_moments(isa, xf, k);
    let mut candidates = Vec::new();
    let (mut ties, mut below_max) = (0, 0);
    match threshold {
        None => {
            simd::select_at_least(isa, xf, 0, &mut candidates);
        }
        Some(t) => {
            // Above t (t + 1 stays a finite pattern: t is at most f32::MAX's).
            below_max = simd::select_at_least(isa, xf, t + 1, &mut candidates);
            if below_max == t {
                // Values equal to t are here: count them, and find the largest below.
                (ties, below_max) = ties_and_below(xf, t);
            }
        }
    }
    // The chunk is read again after the range pass: a value another thread
    // made non-finite meanwhile (a data race on the caller's array) must be
    // reported as such, not reach the sums or the candidates.
    let inf = f32::INFINITY.to_bits();
    if !(s1.is_finite() && s2.is_finite()) || candidates.iter().any(|&c| c >= inf) {
        return non_finite_or_redo(isa, xf, k, threshold);
    }
    Ok(Part {
        min: r.min,
        max: r.max,
        s1,
        s2,
        candidates,
        ties,
        below_max,
    })
}

/// A pass over `xf` saw a non-finite value: its index, or, if a rescan finds
/// none (another thread wrote it and wrote it back: a data race on the
/// caller's array), the chunk redone from a private copy, so every pass sees
/// one state of it and an error names a value that was there.
fn non_finite_or_redo(
    isa: Isa,
    xf: &[f32],
    k: f64,
    threshold: Option<u32>,
) -> std::result::Result<Part, usize> {
    let i = simd::scalar::first_non_finite(xf);
    if i < xf.len() {
        return Err(i);
    }
    let snapshot = xf.to_vec();
    part(isa, &snapshot, k, threshold)
}

/// How many `|x|` of `xs` have the bit pattern `t`, and the largest pattern
/// below `t` (0 if none).
fn ties_and_below(xs: &[f32], t: u32) -> (u64, u32) {
    let (mut ties, mut below) = (0u64, 0u32);
    for v in xs {
        let b = v.to_bits() & 0x7fff_ffff;
        if b == t {
            ties += 1;
        } else if b < t {
            below = below.max(b);
        }
    }
    (ties, below)
}

/// A threshold at or below the `keep`-th largest `|x|` that leaves few values
/// above it: the lowest bit pattern of the 16-bit histogram bin that holds the
/// `keep`-th largest, when that bin and those above hold at most about twice
/// `keep`; else (values crowd into that bin: ties, a narrow band) the
/// `keep`-th largest itself, from a histogram of the bin's low bits. `None`
/// on a non-finite value (the main pass reports it).
fn histogram_threshold<T: Float>(isa: Isa, x: &[T], keep: usize) -> Option<u32> {
    const ROOM: u64 = 1 << 16;
    let mut stage = Vec::new();
    let hist = abs_histogram(isa, x, &mut stage).ok()?;
    let keep = keep as u64;
    let mut above = 0u64;
    for (bin, &c) in hist.iter().enumerate().rev() {
        if above + c >= keep {
            if above + c <= 2 * keep + ROOM {
                return Some((bin as u32) << BIN_SHIFT);
            }
            // The (keep - above)-th largest of the bin, counting from its top.
            let low = low_histogram(isa, x, bin, &mut stage);
            let mut need = keep - above;
            for (sub, &n) in low.iter().enumerate().rev() {
                if n >= need {
                    return Some(((bin as u32) << BIN_SHIFT) | sub as u32);
                }
                need -= n;
            }
            // Only if `x` changed between the passes: the bin's lowest pattern.
            return Some((bin as u32) << BIN_SHIFT);
        }
        above += c;
    }
    Some(0)
}

/// The statistics of one batch `x` (read as f32); `threshold` is the smallest
/// `|x|` bit pattern still worth returning as a p99 candidate (0: none yet,
/// one is found from a histogram of `x` when it holds more than `keep`
/// values), and at most the `keep` largest candidates are returned (the
/// largest one left out counts in `below_max`). Values equal to the threshold
/// are counted, not copied: memory stays near `keep`, however many values
/// tie or crowd together.
///
/// Errors: `InvalidConfig` when `threshold` is not the pattern of a finite
/// `|x|` (above `f32::MAX.to_bits()`); `NonFinite` naming `x` and the first
/// NaN or infinity (a value that becomes infinite in f32 included).
pub fn batch_stats<T: Float>(x: &[T], threshold: u32, keep: usize) -> Result<BatchStats> {
    if threshold > f32::MAX.to_bits() {
        return Err(QuantError::invalid(
            "threshold",
            format!(
                "expected the bit pattern of a finite |x| (at most {:#x}), got {threshold:#x}",
                f32::MAX.to_bits()
            ),
        ));
    }
    let isa = Isa::detected();
    let _env = crate::simd::fpenv::Pinned::new();
    let n = x.len();
    if n == 0 {
        return Ok(BatchStats {
            n: 0,
            min: f32::INFINITY,
            max: f32::NEG_INFINITY,
            mean: 0.0,
            m2: 0.0,
            candidates: Vec::new(),
            below_max: 0,
        });
    }
    let k = x[0].to_f32() as f64;
    let k = if k.is_finite() { k } else { 0.0 };
    // With no threshold yet and fewer to keep than values, start from a
    // histogram of |x| (see `histogram_threshold`): the values below its
    // threshold are smaller than the keep-th largest, and their maximum is
    // reported as let go.
    let mut threshold = match threshold {
        0 if keep < n => histogram_threshold(isa, x, keep),
        0 => None,
        t => Some(t),
    };
    let (mut min, mut max, mut s1, mut s2) = (f32::INFINITY, f32::NEG_INFINITY, 0f64, 0f64);
    let mut candidates: Vec<u32> = Vec::new();
    let mut below_max = 0u32;
    // A wave of chunks at a time, the candidates cut back to `keep` after each
    // and the threshold raised to the smallest kept: values above the running
    // threshold (a batch of one large constant) are never all held at once.
    // Waves are fixed runs of chunks, so nothing depends on the thread count.
    for (w, xw) in x.chunks(WAVE).enumerate() {
        let at = |c: usize, i: usize| w * WAVE + c * CHUNK + i;
        let parts: std::result::Result<Vec<Part>, usize> = parallel::run(xw.len(), |par| {
            if !par {
                return xw
                    .chunks(CHUNK)
                    .enumerate()
                    .map(|(c, xs)| part(isa, xs, k, threshold).map_err(|i| at(c, i)))
                    .collect();
            }
            xw.par_chunks(CHUNK)
                .enumerate()
                .map(|(c, xs)| part(isa, xs, k, threshold).map_err(|i| at(c, i)))
                .collect::<Vec<_>>()
                .into_iter()
                .collect()
        });
        let parts = parts.map_err(|index| QuantError::NonFinite { arg: "x", index })?;
        let mut ties = 0u64;
        candidates.reserve(parts.iter().map(|p| p.candidates.len()).sum());
        for p in parts {
            below_max = below_max.max(p.below_max);
            ties += p.ties;
            min = min.min(p.min);
            max = max.max(p.max);
            s1 += p.s1;
            s2 += p.s2;
            candidates.extend_from_slice(&p.candidates);
        }
        // Values equal to the threshold rank below every candidate: as many of
        // them as `keep` leaves room for join the candidates; the rest are let go.
        if let Some(t) = threshold.filter(|_| ties > 0) {
            let room = keep.saturating_sub(candidates.len()) as u64;
            candidates.extend(std::iter::repeat_n(t, ties.min(room) as usize));
            if ties > room {
                below_max = below_max.max(t);
            }
        }
        if candidates.len() > keep {
            // Only the `keep` largest can matter: select them here, in O(n).
            let cut = candidates.len() - keep;
            let (low, pivot, _) = candidates.select_nth_unstable(cut - 1);
            let dropped = low.iter().copied().fold(*pivot, u32::max);
            below_max = below_max.max(dropped);
            candidates.drain(..cut);
        }
        if candidates.len() >= keep {
            if let Some(&least) = candidates.iter().min() {
                threshold = Some(threshold.map_or(least, |t| t.max(least)));
            }
        }
    }
    let nf = n as f64;
    Ok(BatchStats {
        n: n as u64,
        min,
        max,
        mean: k + s1 / nf,
        m2: (s2 - s1 * s1 / nf).max(0.0),
        candidates,
        below_max,
    })
}

/// Seed 002's calibration statistics over every value of every batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CalibStats {
    /// The exact smallest value.
    pub min: f32,
    /// The exact largest value.
    pub max: f32,
    /// Population mean, accumulated in f64, rounded once.
    pub mean: f32,
    /// Population standard deviation, accumulated in f64, rounded once.
    pub std_dev: f32,
    /// The exact `|x|` of rank `ceil(0.99·n) − 1` (see [`CalibOutcome::exact`]).
    pub p99: f32,
    /// `p99 / 127`, else `max|x| / 127`, else `1 / 127`.
    pub suggested_scale: f32,
}

/// What [`CalibAccumulator::finish`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct CalibOutcome {
    /// The statistics (all zero for no values).
    pub stats: CalibStats,
    /// Whether `p99` is exact. Only a stream of unknown total length can make it
    /// an upper bound: memory is bounded by what the count so far needs, so when
    /// the count grows much past it (many more batches, or larger ones) while the
    /// largest values came early, values the final p99 needs were let go, and
    /// the spill of every value (see [`CalibAccumulator`]) could not be used.
    pub exact: bool,
    /// Why the spill could not be used (the temporary file's error), if it
    /// was needed and failed.
    pub spill_error: Option<String>,
}

impl CalibStats {
    /// The statistics of all values of `batches` (the total is known, so the
    /// p99 is always exact).
    ///
    /// Errors: `NonFinite` naming `batches` and the flat index over all batches.
    ///
    /// ```
    /// # fn main() -> Result<(), ferroquant::QuantError> {
    /// use ferroquant::ops::calib::CalibStats;
    ///
    /// let a: Vec<f32> = (0..100).map(|i| i as f32).collect();
    /// let s = CalibStats::collect(&[&a[..60], &a[60..]])?;
    /// assert_eq!((s.min, s.max, s.mean, s.p99), (0.0, 99.0, 49.5, 98.0));
    /// assert_eq!(s.suggested_scale, 98.0 / 127.0);
    /// # Ok(())
    /// # }
    /// ```
    pub fn collect<T: Float>(batches: &[&[T]]) -> Result<CalibStats> {
        let total = batches.iter().map(|b| b.len() as u64).sum();
        let mut acc = CalibAccumulator::new(Some(total));
        for b in batches {
            acc.push(b)?;
        }
        Ok(acc.finish().stats)
    }
}

/// The number of largest `|x|` the p99 of `n` values is among.
fn needed(n: u64) -> usize {
    if n == 0 {
        return 0;
    }
    (n - crate::ops::dynamic::percentile_rank(0.99, n as usize) as u64) as usize
}

/// Streams batches into [`CalibStats`], holding the running sums and only the
/// largest `|x|` the exact p99 can still need.
///
/// With the total length known up front exactly that many are kept; without
/// it, twice what the count so far needs (plus 1024), merged only when the
/// waiting candidates outnumber them, so the work stays linear.
///
/// Without a known total no bounded memory can promise the exact p99: a value
/// let go early is needed again when enough smaller values follow (a stream
/// whose magnitudes fall). So every `|x|` of such a stream is also written,
/// as a 4-byte bit pattern, to a spill: 1 MiB in memory, then an unnamed
/// temporary file (in `TMPDIR`, or the directory given to
/// [`CalibAccumulator::with_spill_dir`]). It is read only when the kept
/// values and the counts by bin cannot give the p99, once, for the one bin the
/// p99 lies in. If the file cannot be created or written, the result is the
/// bound described in [`CalibOutcome::exact`].
#[derive(Debug)]
pub struct CalibAccumulator {
    total: Option<u64>,
    n: u64,
    lo: f32,
    hi: f32,
    mean: f64,
    m2: f64,
    kept: Vec<u32>,
    pending: Vec<u32>,
    keep: usize,
    threshold: u32,
    /// The largest `|x|` bit pattern let go of (-1: none).
    dropped: i64,
    /// Without a known total: the count of every `|x|` pushed, by the bins of
    /// [`abs_histogram`] (allocated at the first push). When the p99's bin
    /// turns out to hold only kept values, their order gives it exactly,
    /// although larger values were let go (their counts are still here).
    bins: Vec<u64>,
    /// Without a known total: every `|x|` pushed.
    spill: Spill,
}

/// Bit patterns held in memory before the spill goes to its file (1 MiB;
/// as much again while they are written).
const SPILL_BUFFER: usize = 1 << 18;

/// Every `|x|` bit pattern of a stream, in memory up to [`SPILL_BUFFER`] and
/// then in an unnamed temporary file (removed when it is dropped).
#[derive(Default)]
struct Spill {
    buffer: Vec<u32>,
    /// The buffer as little-endian bytes, as written.
    bytes: Vec<u8>,
    file: Option<File>,
    /// The process that made `file`: a forked child shares its descriptor
    /// (and offset) with the parent, so only this process may use it.
    owner: u32,
    /// Patterns written to `file`.
    on_file: u64,
    /// The file's error: nothing more is kept once set.
    error: Option<String>,
    /// Where the file goes (`None`: the system's temporary directory).
    dir: Option<PathBuf>,
}

impl std::fmt::Debug for Spill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spill")
            .field("in_memory", &self.buffer.len())
            .field("on_file", &self.on_file)
            .field("error", &self.error)
            .finish()
    }
}

impl Spill {
    /// Keep the `|x|` bit patterns of `xs`, and count them by bin into `bins`
    /// (from the same reads, so the counts and the spill agree even if another
    /// thread rewrites the batch meanwhile). The buffer goes to the file only
    /// when it is full and more values come.
    fn add(&mut self, xs: &[f32], bins: &mut [u64]) {
        let mut rest = xs;
        while !rest.is_empty() {
            if self.buffer.len() >= SPILL_BUFFER {
                self.flush();
            }
            let (part, tail) = rest.split_at((SPILL_BUFFER - self.buffer.len()).min(rest.len()));
            rest = tail;
            let start = self.buffer.len();
            self.buffer
                .extend(part.iter().map(|v| v.to_bits() & 0x7fff_ffff));
            for &b in &self.buffer[start..] {
                bins[(b >> BIN_SHIFT) as usize] += 1;
            }
            if self.error.is_some() {
                self.buffer.clear();
            }
        }
    }

    /// Set the error if the file belongs to another process (this one is a
    /// forked child); true if the spill is still usable.
    fn usable(&mut self) -> bool {
        if self.error.is_none() && self.file.is_some() && self.owner != std::process::id() {
            self.error = Some(
                "the process forked while the values were kept in a temporary file, which \
                 the parent process still uses"
                    .into(),
            );
            self.file = None;
            self.buffer = Vec::new();
        }
        self.error.is_none()
    }

    /// Move the buffer to the file (created on first use).
    fn flush(&mut self) {
        if !self.usable() || self.buffer.is_empty() {
            return;
        }
        let written = match self.file.as_mut() {
            Some(f) => Ok(f),
            None => spill_file(self.dir.as_deref()).map(|f| {
                self.owner = std::process::id();
                self.file.insert(f)
            }),
        }
        .and_then(|f| {
            self.bytes.resize(4 * self.buffer.len(), 0);
            for (w, b) in self.bytes.chunks_exact_mut(4).zip(&self.buffer) {
                w.copy_from_slice(&b.to_le_bytes());
            }
            f.write_all(&self.bytes)
        });
        match written {
            Ok(()) => self.on_file += self.buffer.len() as u64,
            Err(e) => {
                self.error = Some(format!("the temporary file for the values failed: {e}"));
                self.file = None;
                self.buffer = Vec::new();
                self.bytes = Vec::new();
            }
        }
        self.buffer.clear();
    }

    /// Call `f` on every pattern kept, in order; the file's error, if any.
    fn visit(&mut self, mut f: impl FnMut(u32)) -> std::result::Result<(), String> {
        if !self.usable() {
            return Err(self.error.clone().unwrap_or_default());
        }
        if let Some(file) = self.file.as_mut() {
            let failed = |e: std::io::Error| format!("reading back the temporary file failed: {e}");
            file.seek(SeekFrom::Start(0)).map_err(failed)?;
            let mut bytes = vec![0u8; 4 * SPILL_BUFFER];
            let mut left = self.on_file;
            while left > 0 {
                let n = left.min(SPILL_BUFFER as u64) as usize;
                file.read_exact(&mut bytes[..4 * n]).map_err(failed)?;
                for w in bytes[..4 * n].chunks_exact(4) {
                    f(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
                }
                left -= n as u64;
            }
        }
        self.buffer.iter().for_each(|&b| f(b));
        Ok(())
    }
}

/// An unnamed temporary file in `dir`, else in the system's temporary
/// directory (`TMPDIR`, read now).
fn spill_file(dir: Option<&Path>) -> std::io::Result<File> {
    let system = std::env::temp_dir();
    let dirs: Vec<&Path> = dir.into_iter().chain([system.as_path()]).collect();
    spill_file_in(&dirs)
}

/// An unnamed temporary file in the first of `dirs` that takes one; the error
/// names every directory tried and why it failed.
fn spill_file_in(dirs: &[&Path]) -> std::io::Result<File> {
    let mut failed = Vec::new();
    for (i, d) in dirs.iter().enumerate() {
        if dirs[..i].contains(d) {
            continue;
        }
        match tempfile::tempfile_in(d) {
            Ok(f) => return Ok(f),
            Err(e) => failed.push(format!("in {}: {e}", d.display())),
        }
    }
    Err(std::io::Error::other(failed.join("; ")))
}

impl CalibAccumulator {
    /// An empty accumulator; `total`: the number of values to come, if known.
    pub fn new(total: Option<u64>) -> Self {
        CalibAccumulator {
            total,
            n: 0,
            lo: f32::INFINITY,
            hi: f32::NEG_INFINITY,
            mean: 0.0,
            m2: 0.0,
            kept: Vec::new(),
            pending: Vec::new(),
            keep: 0,
            threshold: 0,
            dropped: -1,
            bins: Vec::new(),
            spill: Spill::default(),
        }
    }

    /// The spill of a stream of unknown length goes to a temporary file in
    /// `dir`, or in the system's temporary directory (`TMPDIR`) if no file can
    /// be made there. Python passes `tempfile.gettempdir()`, which skips an
    /// unusable `TMPDIR`.
    pub fn with_spill_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.spill.dir = Some(dir.into());
        self
    }

    /// Values seen so far.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// Add one batch (read as f32). On error nothing is added.
    ///
    /// Errors: `NonFinite` naming `batches` and the flat index over all batches
    /// so far (the batch's own index is that minus [`count`](Self::count));
    /// `InvalidConfig` naming `total` when more values arrive than announced.
    pub fn push<T: Float>(&mut self, batch: &[T]) -> Result<()> {
        let _env = crate::simd::fpenv::Pinned::new();
        if batch.is_empty() {
            return Ok(());
        }
        let len = batch.len() as u64;
        if let Some(total) = self.total {
            if self.n + len > total {
                return Err(QuantError::invalid(
                    "total",
                    format!(
                        "{total} values were announced, and {} have now been pushed",
                        self.n + len
                    ),
                ));
            }
        }
        let keep = match self.total {
            Some(total) => needed(total),
            None => 2 * needed(self.n + len) + 1024,
        };
        let b = batch_stats(batch, self.threshold, keep).map_err(|e| match e {
            QuantError::NonFinite { index, .. } => QuantError::NonFinite {
                arg: "batches",
                index: self.n as usize + index,
            },
            other => other,
        })?;
        if self.total.is_none() {
            if self.bins.is_empty() {
                self.bins = vec![0; 1 << 16];
            }
            // The batch was read whole above: it is finite.
            let (bins, spill) = (&mut self.bins, &mut self.spill);
            let _ = for_each_stage(Isa::detected(), batch, &mut Vec::new(), |_, xs| {
                spill.add(xs, bins);
                Ok(())
            });
        }
        self.keep = keep;
        if (b.candidates.len() as u64) < b.n {
            // Some values were left out; the largest of them is `below_max`.
            self.dropped = self.dropped.max(b.below_max as i64);
        }
        // Ties keep the earlier value (as `min`/`max` over the batches in order).
        if b.min < self.lo {
            self.lo = b.min;
        }
        if b.max > self.hi {
            self.hi = b.max;
        }
        // Chan et al.'s pairwise update of the mean and the sum of squared deviations.
        let (n, bn) = (self.n as f64, b.n as f64);
        let delta = b.mean - self.mean;
        self.mean += delta * bn / (n + bn);
        self.m2 += b.m2 + delta * delta * n * bn / (n + bn);
        self.n += b.n;
        self.pending.extend_from_slice(&b.candidates);
        if self.pending.len() > keep + 4096 {
            self.compact();
        }
        Ok(())
    }

    /// Merge the waiting candidates into the kept ones, keeping the `keep` largest.
    fn compact(&mut self) {
        let mut both = std::mem::take(&mut self.kept);
        both.append(&mut self.pending);
        if both.len() > self.keep {
            let cut = both.len() - self.keep;
            let (_, pivot, _) = both.select_nth_unstable(cut - 1);
            self.dropped = self.dropped.max(*pivot as i64);
            both.drain(..cut);
        }
        self.threshold = match both.iter().min() {
            Some(&m) if both.len() >= self.keep => m,
            _ => 0,
        };
        self.kept = both;
    }

    /// The `m`-th largest `|x|` bit pattern from the counts of every value
    /// ([`bins`](Self::bins)) when its bin holds kept values only: the values
    /// in higher bins are counted (kept or not), and the bin's own are all
    /// here to be ordered. `None` without counts, or when values of that bin
    /// were let go.
    fn p99_by_bins(&mut self, m: usize) -> Option<u32> {
        let (bin, count, rank) = self.p99_bin(m)?;
        let mut inside: Vec<u32> = self
            .kept
            .iter()
            .copied()
            .filter(|&b| b >> BIN_SHIFT == bin)
            .collect();
        if inside.len() as u64 != count {
            return None;
        }
        let at = inside.len() - rank as usize;
        Some(*inside.select_nth_unstable(at).1)
    }

    /// The bin of [`bins`](Self::bins) the `m`-th largest `|x|` lies in, its
    /// count, and the value's rank in it (1-based, from the bin's top).
    fn p99_bin(&self, m: usize) -> Option<(u32, u64, u64)> {
        let mut above = 0u64;
        let (bin, count) = self.bins.iter().enumerate().rev().find_map(|(bin, &c)| {
            above += c;
            (above >= m as u64).then_some((bin as u32, c))
        })?;
        Some((bin, count, m as u64 - (above - count)))
    }

    /// The `m`-th largest `|x|` bit pattern from the spill of every value: the
    /// counts give its bin, one read of the spill the bin's values by their
    /// low bits. `Err` with the spill's error.
    fn p99_by_spill(&mut self, m: usize) -> std::result::Result<Option<u32>, String> {
        let Some((bin, count, rank)) = self.p99_bin(m) else {
            return Ok(None);
        };
        let mut low = vec![0u64; 1 << BIN_SHIFT];
        let mut seen = 0u64;
        self.spill.visit(|b| {
            if b >> BIN_SHIFT == bin {
                low[(b & ((1 << BIN_SHIFT) - 1)) as usize] += 1;
                seen += 1;
            }
        })?;
        if seen != count {
            return Err(format!(
                "the temporary file held {seen} values of the p99's bin where {count} were \
                 counted"
            ));
        }
        let mut need = rank;
        for (sub, &n) in low.iter().enumerate().rev() {
            if n >= need {
                return Ok(Some((bin << BIN_SHIFT) | sub as u32));
            }
            need -= n;
        }
        Ok(None)
    }

    /// The statistics of everything pushed.
    pub fn finish(mut self) -> CalibOutcome {
        let _env = crate::simd::fpenv::Pinned::new();
        self.compact();
        if self.n == 0 {
            let zero = CalibStats {
                min: 0.0,
                max: 0.0,
                mean: 0.0,
                std_dev: 0.0,
                p99: 0.0,
                suggested_scale: 0.0,
            };
            return CalibOutcome {
                stats: zero,
                exact: true,
                spill_error: None,
            };
        }
        // Every value left out is at most `dropped`. With `c` kept values at
        // least `dropped`: c >= m puts the m-th largest among them; c == m - 1
        // makes it `dropped` itself (a value that was seen); fewer leaves only
        // the bound.
        let m = needed(self.n);
        let dropped = self.dropped;
        let c = self.kept.iter().filter(|&&b| b as i64 >= dropped).count();
        let mut spill_error = None;
        let (bits, exact) = if c >= m {
            let at = self.kept.len() - m;
            (*self.kept.select_nth_unstable(at).1 as i64, true)
        } else if let Some(bits) = self.p99_by_bins(m) {
            (bits as i64, true)
        } else if c + 1 == m && dropped >= 0 {
            (dropped, true)
        } else {
            match self.p99_by_spill(m) {
                Ok(Some(bits)) => (bits as i64, true),
                Ok(None) => (dropped, false),
                Err(e) => {
                    spill_error = Some(e);
                    (dropped, false)
                }
            }
        };
        let p99 = f32::from_bits(bits as u32);
        let max_abs = if self.hi.abs() > self.lo.abs() {
            self.hi.abs()
        } else {
            self.lo.abs()
        };
        let suggested_scale = if p99 > 0.0 {
            p99 / 127.0
        } else if max_abs > 0.0 {
            max_abs / 127.0
        } else {
            1.0 / 127.0
        };
        CalibOutcome {
            stats: CalibStats {
                min: self.lo,
                max: self.hi,
                mean: self.mean as f32,
                std_dev: (self.m2.max(0.0) / self.n as f64).sqrt() as f32,
                p99,
                suggested_scale,
            },
            exact,
            spill_error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_has_exact_extremes_and_candidates() -> Result<()> {
        let x = [3.0f32, -1.0, 2.0, 0.5, -4.0];
        let s = batch_stats(&x, 2.0f32.to_bits(), usize::MAX)?;
        assert_eq!((s.n, s.min, s.max), (5, -4.0, 3.0));
        assert!((s.mean - 0.1).abs() < 1e-15);
        let want: f64 = x.iter().map(|&v| (v as f64 - 0.1).powi(2)).sum();
        assert!((s.m2 - want).abs() < 1e-12);
        let mut c = s.candidates.clone();
        c.sort();
        assert_eq!(
            c,
            vec![2.0f32.to_bits(), 3.0f32.to_bits(), 4.0f32.to_bits()]
        );
        let bad = [1.0f32, f32::NAN];
        assert!(matches!(
            batch_stats(&bad, 0, 10),
            Err(QuantError::NonFinite { index: 1, .. })
        ));
        // A threshold no finite |x| reaches is refused (t + 1 overflowed at
        // u32::MAX); f32::MAX's own pattern is the largest allowed.
        for t in [f32::INFINITY.to_bits(), u32::MAX, (-1.0f32).to_bits()] {
            assert!(matches!(
                batch_stats(&x, t, usize::MAX),
                Err(QuantError::InvalidConfig {
                    arg: "threshold",
                    ..
                })
            ));
        }
        let s = batch_stats(&[f32::MAX, 1.0], f32::MAX.to_bits(), usize::MAX)?;
        assert_eq!(s.candidates, vec![f32::MAX.to_bits()]);
        assert_eq!(s.below_max, 1.0f32.to_bits());
        Ok(())
    }
}

#[cfg(test)]
mod accumulator_tests {
    use super::*;

    fn exact_p99(values: &[f32]) -> f32 {
        let mut a: Vec<f32> = values.iter().map(|v| v.abs()).collect();
        a.sort_by(f32::total_cmp);
        a[crate::ops::dynamic::percentile_rank(0.99, a.len())]
    }

    #[test]
    fn a_stream_of_unknown_length_gives_the_exact_p99() -> Result<()> {
        let values: Vec<f32> = (0..200_000u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) as f32 / 65536.0) - 128.0)
            .collect();
        let mut acc = CalibAccumulator::new(None);
        for b in values.chunks(7_000) {
            acc.push(b)?;
        }
        let out = acc.finish();
        assert!(out.exact);
        assert_eq!(out.stats.p99, exact_p99(&values));
        let known = CalibStats::collect(&values.chunks(7_000).collect::<Vec<_>>())?;
        assert_eq!(known, out.stats);
        Ok(())
    }

    #[test]
    fn the_bound_is_exact_when_only_the_dropped_value_can_rank() -> Result<()> {
        let a: Vec<f32> = (1..=3000).map(|i| i as f32).collect();
        let b = vec![0f32; 105_600];
        let mut acc = CalibAccumulator::new(None);
        acc.push(&a)?;
        acc.push(&b)?;
        let out = acc.finish();
        let mut all = a.clone();
        all.extend(&b);
        assert_eq!(out.stats.p99, exact_p99(&all));
        assert!(out.exact);
        let mut over = CalibAccumulator::new(Some(10));
        assert!(matches!(
            over.push(&[0f32; 11]),
            Err(QuantError::InvalidConfig { arg: "total", .. })
        ));
        Ok(())
    }

    #[test]
    fn the_counts_of_every_value_make_a_late_p99_exact() -> Result<()> {
        // 10 000 large values, then 2 000 000 small ones: the p99 (rank from
        // the top 20 101) is the 10 101st largest small value, below the 9 000
        // large ones let go while the count was small. Only their counts say so.
        let big: Vec<f32> = (0..10_000).map(|i| 100.0 + (i % 977) as f32).collect();
        let small: Vec<f32> = (0..2_000_000u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 9) as f32 / 8.4e8) - 2.5e-3)
            .collect();
        let mut acc = CalibAccumulator::new(None);
        acc.push(&big)?;
        for b in small.chunks(50_000) {
            acc.push(b)?;
        }
        let out = acc.finish();
        let mut all = big.clone();
        all.extend(&small);
        assert!(out.exact);
        assert_eq!(out.stats.p99, exact_p99(&all));
        assert!(out.stats.p99 < 0.01);
        let known: Vec<&[f32]> = vec![&big, &small];
        assert_eq!(CalibStats::collect(&known)?, out.stats);
        Ok(())
    }

    /// 100 000 values 1..=100 000, then 10 485 760 zeros: the p99 (about the
    /// 105 858th largest) is a zero, but zeros came when the threshold was
    /// already above them, so their bin holds values let go.
    fn ones_then_zeros() -> Result<(CalibAccumulator, Vec<f32>)> {
        ones_then_zeros_into(CalibAccumulator::new(None))
    }

    fn ones_then_zeros_into(mut acc: CalibAccumulator) -> Result<(CalibAccumulator, Vec<f32>)> {
        let a: Vec<f32> = (1..=100_000).map(|i| i as f32).collect();
        let zeros = vec![0f32; 1 << 20];
        acc.push(&a)?;
        let mut all = a.clone();
        for _ in 0..10 {
            acc.push(&zeros)?;
            all.extend(&zeros);
        }
        Ok((acc, all))
    }

    #[test]
    fn a_p99_among_values_let_go_is_read_back_from_the_spill() -> Result<()> {
        let (acc, all) = ones_then_zeros()?;
        assert!(
            acc.spill.file.is_some(),
            "40 MiB of patterns go to the file"
        );
        let out = acc.finish();
        assert_eq!(exact_p99(&all), 0.0);
        assert_eq!(
            (out.stats.p99, out.exact, out.spill_error),
            (0.0, true, None)
        );
        Ok(())
    }

    #[test]
    fn the_spill_goes_to_the_directory_given() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| QuantError::invalid("dir", e.to_string()))?;
        let (acc, _) =
            ones_then_zeros_into(CalibAccumulator::new(None).with_spill_dir(dir.path()))?;
        let out = acc.finish();
        assert_eq!(
            (out.stats.p99, out.exact, out.spill_error),
            (0.0, true, None)
        );
        // A directory that does not exist: the system's is used instead.
        let missing = dir.path().join("missing");
        let acc = CalibAccumulator::new(None).with_spill_dir(&missing);
        let (acc, _) = ones_then_zeros_into(acc)?;
        let out = acc.finish();
        assert_eq!(
            (out.stats.p99, out.exact, out.spill_error),
            (0.0, true, None)
        );
        // When no directory takes the file, the error names each one tried.
        let other = dir.path().join("other");
        let err = spill_file_in(&[&missing, &missing, &other])
            .unwrap_err()
            .to_string();
        let missing_text = format!("in {}:", missing.display());
        assert_eq!(err.matches(&missing_text).count(), 1, "{err}");
        assert!(err.contains(&format!("; in {}:", other.display())), "{err}");
        Ok(())
    }

    #[test]
    fn the_spill_holds_a_full_buffer_in_memory() -> Result<()> {
        // Exactly SPILL_BUFFER values stay in memory (no file); one more, in
        // any split, moves them to the file and the buffer never grows past it.
        let x = vec![1.5f32; SPILL_BUFFER + 1];
        let mut acc = CalibAccumulator::new(None);
        acc.push(&x[..SPILL_BUFFER - 3])?;
        acc.push(&x[..3])?;
        assert!(acc.spill.file.is_none() && acc.spill.buffer.len() == SPILL_BUFFER);
        acc.push(&x[..1])?;
        assert_eq!(
            (acc.spill.on_file, acc.spill.buffer.len()),
            (SPILL_BUFFER as u64, 1)
        );
        acc.push(&x)?;
        assert!(acc.spill.buffer.len() <= SPILL_BUFFER);
        assert!(acc.spill.buffer.capacity() <= 2 * SPILL_BUFFER);
        Ok(())
    }

    #[test]
    fn without_the_spill_a_p99_among_values_let_go_is_a_flagged_bound() -> Result<()> {
        let (mut acc, _) = ones_then_zeros()?;
        acc.spill.error = Some("no room".into());
        let out = acc.finish();
        assert!(!out.exact);
        assert_eq!(out.spill_error.as_deref(), Some("no room"));
        assert!(out.stats.p99 >= 1.0 && out.stats.p99 <= 100_000.0);
        Ok(())
    }

    #[test]
    fn a_stream_of_falling_magnitudes_gives_the_exact_p99() -> Result<()> {
        // Each batch's values a step smaller than the last: the final p99 needs
        // values the first batches let go; the spill (in memory and on file)
        // gives it, for f32 and for f64 read as f32.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for batch in [1000usize, 300_000] {
            let batches: Vec<Vec<f32>> = (0..12)
                .map(|i| (0..batch).map(|_| next() * (12 - i) as f32).collect())
                .collect();
            let all: Vec<f32> = batches.concat();
            let mut acc = CalibAccumulator::new(None);
            let mut acc64 = CalibAccumulator::new(None);
            let mut unspilled = CalibAccumulator::new(None);
            unspilled.spill.error = Some("off".into());
            for b in &batches {
                acc.push(b)?;
                acc64.push(&b.iter().map(|&v| f64::from(v)).collect::<Vec<_>>())?;
                unspilled.push(b)?;
            }
            let (out, out64) = (acc.finish(), acc64.finish());
            assert!(out.exact && out64.exact);
            if batch > 1000 {
                // The spill was needed: without it, only a bound.
                assert!(!unspilled.finish().exact);
            }
            assert_eq!(out.stats.p99, exact_p99(&all), "batch {batch}");
            assert_eq!(out64.stats, out.stats);
            let known: Vec<&[f32]> = batches.iter().map(|b| &b[..]).collect();
            assert_eq!(CalibStats::collect(&known)?, out.stats);
        }
        Ok(())
    }

    #[test]
    fn crowded_batches_keep_few_candidates_and_exact_statistics() -> Result<()> {
        // One value throughout, one narrow band (a single 16-bit bin), and a
        // band with a few larger outliers: the candidates stay near `keep`,
        // whatever the threshold, and the p99 is exact.
        let n = 1 << 20;
        let mut r = 0x9e37_79b9_7f4a_7c15u64;
        let mut unit = move || {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            (r >> 40) as f32 / (1u64 << 24) as f32
        };
        let constant = vec![-2.5f32; n];
        let band: Vec<f32> = (0..n).map(|_| 1.0 + unit() * 0.0077).collect();
        let mut outliers = band.clone();
        for i in (0..n).step_by(4099) {
            outliers[i] = 50.0 + i as f32;
        }
        for x in [&constant, &band, &outliers] {
            let keep = needed(n as u64);
            for threshold in [0, 1.0f32.to_bits(), x[7].abs().to_bits()] {
                let b = batch_stats(x, threshold, keep)?;
                assert!(
                    b.candidates.len() <= keep,
                    "{} > {keep}",
                    b.candidates.len()
                );
            }
            assert_eq!(CalibStats::collect(&[&x[..]])?.p99, exact_p99(x));
            let halves: Vec<&[f32]> = vec![&x[..n / 2], &x[n / 2..]];
            assert_eq!(CalibStats::collect(&halves)?.p99, exact_p99(x));
            let mut acc = CalibAccumulator::new(None);
            for h in &halves {
                acc.push(h)?;
            }
            let out = acc.finish();
            assert!(out.exact);
            assert_eq!(out.stats.p99, exact_p99(x));
        }
        Ok(())
    }

    #[test]
    fn a_batch_above_the_threshold_is_cut_back_wave_by_wave() -> Result<()> {
        // Three waves of values all above the threshold: the candidates are
        // still exactly the `keep` largest, the largest let go is reported, and
        // a NaN in the last wave is found at its index.
        let n = 3 * WAVE + 12_345;
        let x: Vec<f32> = (0..n).map(|i| 2.0 + ((i * 7919) % n) as f32).collect();
        let keep = 40_000;
        let b = batch_stats(&x, 1.0f32.to_bits(), keep)?;
        let mut want: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
        want.sort_unstable();
        let mut got = b.candidates.clone();
        got.sort_unstable();
        assert_eq!(got, want[n - keep..]);
        assert_eq!(b.below_max, want[n - keep - 1]);
        let mut bad = x.clone();
        bad[3 * WAVE + 5] = f32::NAN;
        assert!(matches!(
            batch_stats(&bad, 1.0f32.to_bits(), keep),
            Err(QuantError::NonFinite { index, .. }) if index == 3 * WAVE + 5
        ));
        Ok(())
    }

    #[test]
    fn errors_name_the_index_over_all_batches() {
        let a = [1.0f32; 10];
        let b = [0.0f32, f32::INFINITY];
        assert_eq!(
            CalibStats::collect(&[&a[..], &b[..]]),
            Err(QuantError::NonFinite {
                arg: "batches",
                index: 11
            })
        );
        let none: [&[f32]; 0] = [];
        assert_eq!(CalibStats::collect(&none).unwrap().suggested_scale, 0.0);
    }
}

#[cfg(test)]
mod fpenv_tests {
    use super::*;
    use crate::ops::dynamic::quantization_mae;

    #[test]
    fn a_callers_flush_to_zero_mode_changes_nothing() -> Result<()> {
        let x: Vec<f32> = (0..1000).map(|i| i as f32 * 1e-42).collect();
        let a = (
            CalibStats::collect(&[&x[..]])?,
            quantization_mae(&x, &[0.0; 1000])?,
        );
        crate::simd::fpenv::set_flush_denormals(true);
        let b = (
            CalibStats::collect(&[&x[..]]),
            quantization_mae(&x, &[0.0; 1000]),
        );
        crate::simd::fpenv::set_flush_denormals(false);
        assert_eq!((b.0?, b.1?), a);
        assert!(a.1 > 0.0 && a.0.mean > 0.0);
        Ok(())
    }
}
