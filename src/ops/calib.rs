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
use crate::ops::dynamic::{abs_histogram, BIN_SHIFT};
use crate::parallel;
use crate::simd::{self, Isa};
use crate::stage::STAGE;
use rayon::prelude::*;

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
    /// Bit patterns of every `|x|` whose bits are at least the threshold.
    pub candidates: Vec<u32>,
    /// The largest `|x|` bit pattern below the threshold (0 if none).
    pub below_max: u32,
}

/// Elements per task: partial sums are formed over these fixed chunks and
/// added in chunk order, so results do not depend on the thread count.
const CHUNK: usize = 16 * STAGE;

struct Part {
    min: f32,
    max: f32,
    s1: f64,
    s2: f64,
    candidates: Vec<u32>,
    below_max: u32,
}

/// Statistics of one chunk (read as f32), shifted by `k`; `Err(i)` is the
/// chunk index of the first non-finite value.
fn part<T: Float>(isa: Isa, x: &[T], k: f64, threshold: u32) -> std::result::Result<Part, usize> {
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
        return Err(simd::scalar::first_non_finite(xf));
    }
    let (s1, s2) = simd::shifted_moments(isa, xf, k);
    // Branch-free: every value is written, only candidates advance the cursor.
    let mut candidates = vec![0u32; xf.len()];
    let (mut m, mut below_max) = (0usize, 0u32);
    for v in xf {
        let b = v.to_bits() & 0x7fff_ffff;
        let take = b >= threshold;
        candidates[m] = b;
        m += take as usize;
        below_max = below_max.max(if take { 0 } else { b });
    }
    candidates.truncate(m);
    Ok(Part {
        min: r.min,
        max: r.max,
        s1,
        s2,
        candidates,
        below_max,
    })
}

/// The lowest bit pattern of the 16-bit histogram bin (of |x|) that holds the
/// `keep`-th largest value, or `None` on a non-finite value (the main pass
/// reports it) or when that bin is the lowest.
fn histogram_threshold<T: Float>(isa: Isa, x: &[T], keep: usize) -> Option<u32> {
    let hist = abs_histogram(isa, x, &mut Vec::new()).ok()?;
    let mut above = 0u64;
    for (bin, &c) in hist.iter().enumerate().rev() {
        above += c;
        if above >= keep as u64 {
            return (bin > 0).then_some((bin as u32) << BIN_SHIFT);
        }
    }
    None
}

/// The statistics of one batch `x` (read as f32); `threshold` is the smallest
/// `|x|` bit pattern still worth returning as a p99 candidate (0: all), and at
/// most the `keep` largest candidates are returned (the largest one left out
/// counts in `below_max`).
///
/// Errors: `NonFinite` naming `x` and the first NaN or infinity (a value that
/// becomes infinite in f32 included).
pub fn batch_stats<T: Float>(x: &[T], threshold: u32, keep: usize) -> Result<BatchStats> {
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
    // With no threshold yet and fewer to keep than values, start from the bin
    // of a 16-bit histogram of |x| that holds the keep-th largest: only values
    // from that bin up are candidates; the rest are smaller than the keep-th
    // largest and their maximum is reported as let go.
    let threshold = if threshold == 0 && keep < n {
        histogram_threshold(isa, x, keep).unwrap_or(0)
    } else {
        threshold
    };
    let parts: std::result::Result<Vec<Part>, usize> = parallel::run(n, |par| {
        if !par {
            return x
                .chunks(CHUNK)
                .enumerate()
                .map(|(c, xs)| part(isa, xs, k, threshold).map_err(|i| c * CHUNK + i))
                .collect();
        }
        x.par_chunks(CHUNK)
            .enumerate()
            .map(|(c, xs)| part(isa, xs, k, threshold).map_err(|i| c * CHUNK + i))
            .collect::<Vec<_>>()
            .into_iter()
            .collect()
    });
    let parts = parts.map_err(|index| QuantError::NonFinite { arg: "x", index })?;
    let (mut min, mut max, mut s1, mut s2) = (f32::INFINITY, f32::NEG_INFINITY, 0f64, 0f64);
    let mut candidates = Vec::with_capacity(parts.iter().map(|p| p.candidates.len()).sum());
    let mut below_max = 0u32;
    for p in parts {
        below_max = below_max.max(p.below_max);
        min = min.min(p.min);
        max = max.max(p.max);
        s1 += p.s1;
        s2 += p.s2;
        candidates.extend_from_slice(&p.candidates);
    }
    if candidates.len() > keep {
        // Only the `keep` largest can matter: select them here, in O(n).
        let cut = candidates.len() - keep;
        let (low, pivot, _) = candidates.select_nth_unstable(cut - 1);
        let dropped = low.iter().copied().fold(*pivot, u32::max);
        below_max = below_max.max(dropped);
        candidates.drain(..cut);
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
        Ok(())
    }
}
