//! SmoothQuant — SPEC §3, ported from seed 002 (oxibonsai
//! `compute_smooth_factors`, `smooth_activations`, `smooth_weights`): move
//! quantization difficulty from activations to weights with one factor per
//! input feature, in f32.
//!
//! `s_j = max((amax_j + ε)^α / (wmax_j + ε)^(1 − α), ε)` with `ε = max(epsilon,
//! 1e-10)` and `f32::powf`; `A[i, j] /= s_j`, `W[i, j] *= s_j` in place.
//!
//! Deviations (SPEC): alpha outside [0, 1] is an error instead of a clamp (4);
//! non-finite input is an error (2) and nothing is modified.

use crate::element::Float;
use crate::error::{try_filled, QuantError, Result};
use crate::simd::{self, Isa, F32_INF_BITS};

/// Seed 002's `SmoothQuantConfig`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SmoothQuantConfig {
    /// Balance between activations (1) and weights (0), in [0, 1].
    pub alpha: f32,
    /// Floor of the factors (and the offset added before `powf`).
    pub epsilon: f32,
}

impl SmoothQuantConfig {
    /// A config, or `InvalidConfig` naming `alpha` outside [0, 1] (the seed's
    /// `InvalidAlpha`) or a non-finite `epsilon`.
    pub fn new(alpha: f32, epsilon: f32) -> Result<Self> {
        if !(0.0..=1.0).contains(&alpha) {
            return Err(QuantError::invalid(
                "alpha",
                format!("expected a value in [0, 1], got {alpha}"),
            ));
        }
        if !epsilon.is_finite() || epsilon < 0.0 {
            return Err(QuantError::invalid(
                "epsilon",
                format!("expected a finite value >= 0, got {epsilon}"),
            ));
        }
        Ok(SmoothQuantConfig { alpha, epsilon })
    }
}

impl Default for SmoothQuantConfig {
    fn default() -> Self {
        SmoothQuantConfig {
            alpha: 0.5,
            epsilon: 1e-5,
        }
    }
}

/// Columns handled at a time: the running column maxima of one block of
/// columns stay in L1 (two 16 KiB arrays) while the rows stream past.
const COL_BLOCK: usize = 4096;

/// Max |x| bit patterns of columns `c0..c0 + m.len()` of a row-major matrix
/// with rows of `cols` values, into `m`.
fn block_absmax<T: Float>(isa: Isa, x: &[T], cols: usize, c0: usize, m: &mut [u32]) {
    m.fill(0);
    let k = m.len();
    let mut stage = Vec::new();
    for row in x.chunks_exact(cols) {
        let part = &row[c0..c0 + k];
        match T::as_f32_slice(part) {
            Some(pf) => simd::absmax_columns(isa, pf, m),
            None => {
                stage.resize(k, 0.0);
                T::convert_to_f32(isa, part, &mut stage);
                simd::absmax_columns(isa, &stage, m);
            }
        }
    }
}

fn first_non_finite_of<T: Float>(x: &[T]) -> Option<usize> {
    x.iter().position(|v| !v.to_f32().is_finite())
}

/// Seed 002's `compute_smooth_factors` for activations `[tokens, cols]` and
/// weights `[out, cols]`: one factor per input feature (column).
///
/// Errors: `ShapeMismatch` when a matrix does not tile into rows of `cols`;
/// `InvalidConfig` for a config outside [`SmoothQuantConfig::new`]'s domain;
/// `NonFinite` naming the argument and the first NaN or infinity;
/// `OutOfMemory` when the `cols` factors cannot be allocated (empty matrices
/// of an impossible width: no input slice backs `cols`).
pub fn compute_smooth_factors<A: Float, W: Float>(
    activations: &[A],
    weights: &[W],
    cols: usize,
    config: &SmoothQuantConfig,
) -> Result<Vec<f32>> {
    // Shapes and config first: they are the errors to report, not the
    // allocation's.
    check_tiles(activations.len(), weights.len(), cols)?;
    SmoothQuantConfig::new(config.alpha, config.epsilon)?;
    let mut out = try_filled(cols, 0f32, "the smoothing factors")?;
    compute_smooth_factors_into(activations, weights, cols, config, &mut out)?;
    Ok(out)
}

/// `ShapeMismatch` naming the matrix whose length is not whole rows of `cols`.
fn check_tiles(activations: usize, weights: usize, cols: usize) -> Result<()> {
    for (arg, len) in [("activations", activations), ("weights", weights)] {
        if !len.is_multiple_of(cols) {
            return Err(QuantError::ShapeMismatch {
                arg,
                expected: format!("rows of {cols} values"),
                actual: format!("{len} values"),
            });
        }
    }
    Ok(())
}

/// [`compute_smooth_factors`] into a caller's `out` of `cols` values (no
/// allocation: the columns are handled a block at a time).
pub fn compute_smooth_factors_into<A: Float, W: Float>(
    activations: &[A],
    weights: &[W],
    cols: usize,
    config: &SmoothQuantConfig,
    out: &mut [f32],
) -> Result<()> {
    check_tiles(activations.len(), weights.len(), cols)?;
    if out.len() != cols {
        return Err(QuantError::len_mismatch("out", cols, out.len()));
    }
    // The fields are public: a config not made by `new` is checked here.
    let config = SmoothQuantConfig::new(config.alpha, config.epsilon)?;
    let _env = crate::simd::fpenv::Pinned::new();
    let isa = Isa::detected();
    let alpha = config.alpha;
    let eps = config.epsilon.max(1e-10);
    let (mut am, mut wm) = ([0u32; COL_BLOCK], [0u32; COL_BLOCK]);
    let mut c0 = 0;
    while c0 < cols {
        let k = COL_BLOCK.min(cols - c0);
        block_absmax(isa, activations, cols, c0, &mut am[..k]);
        block_absmax(isa, weights, cols, c0, &mut wm[..k]);
        let bad = |m: &[u32]| m.iter().any(|&b| b >= F32_INF_BITS);
        if bad(&am[..k]) || bad(&wm[..k]) {
            // As if each matrix were checked whole, activations first.
            return Err(match first_non_finite_of(activations) {
                Some(index) => QuantError::NonFinite {
                    arg: "activations",
                    index,
                },
                None => QuantError::NonFinite {
                    arg: "weights",
                    index: first_non_finite_of(weights).unwrap_or(0),
                },
            });
        }
        for ((o, &a), &w) in out[c0..c0 + k].iter_mut().zip(&am[..k]).zip(&wm[..k]) {
            let num = (f32::from_bits(a) + eps).powf(alpha);
            let den = (f32::from_bits(w) + eps).powf(1.0 - alpha);
            *o = (num / den).max(eps);
        }
        c0 += k;
    }
    Ok(())
}

/// Shapes and factors: any finite factor is the seed's (a negative one flips
/// signs, `w * 0` is 0); a zero divisor is refused when there is a value to
/// divide, since every quotient by it is ±inf or NaN.
fn check_factors(x_len: usize, factors: &[f32], arg: &'static str, multiply: bool) -> Result<()> {
    let cols = factors.len();
    if !x_len.is_multiple_of(cols) {
        return Err(QuantError::ShapeMismatch {
            arg,
            expected: format!("rows of {cols} values (one per smoothing factor)"),
            actual: format!("{x_len} values"),
        });
    }
    if let Some(i) = factors.iter().position(|s| !s.is_finite()) {
        return Err(QuantError::NonFinite { arg: "s", index: i });
    }
    if multiply || x_len == 0 {
        return Ok(());
    }
    if let Some(i) = factors.iter().position(|&s| s == 0.0) {
        return Err(QuantError::invalid(
            "s",
            format!(
                "s[{i}] = {}: {arg}[:, {i}] / s[{i}] would be ±inf or NaN; nothing was modified",
                factors[i]
            ),
        ));
    }
    Ok(())
}

fn first_non_finite(x: &[f32]) -> Option<usize> {
    let m = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    (m >= F32_INF_BITS).then(|| x.iter().position(|v| !v.is_finite()).unwrap_or(0))
}

/// `v / f` (`multiply == false`) or `v * f`, in f32.
#[inline(always)]
fn apply(v: f32, f: f32, multiply: bool) -> f32 {
    if multiply {
        v * f
    } else {
        v / f
    }
}

/// The bits of the largest finite `b >= 0` whose `apply(b, f)` is finite
/// (`f` finite, and not 0 when dividing): `f32::MAX` unless the factor can
/// overflow. Division and multiplication round correctly and a sign changes
/// no magnitude, so `|result|` grows with `|v|` and every `|v|` up to the
/// bound stays finite.
fn finite_bound(f: f32, multiply: bool) -> u32 {
    let f = f.abs();
    let grows = if multiply { f > 1.0 } else { f < 1.0 };
    if !grows {
        return f32::MAX.to_bits();
    }
    // Within an ulp or two of the bound; step to it.
    let mut b = if multiply { f32::MAX / f } else { f32::MAX * f };
    while b > 0.0 && !apply(b, f, multiply).is_finite() {
        b = b.next_down();
    }
    while b < f32::MAX && apply(b.next_up(), f, multiply).is_finite() {
        b = b.next_up();
    }
    b.to_bits()
}

/// The first flat index of `x` (rows of `s.len()`) whose value is not finite
/// or whose result with its factor would not be: one pass that reads `x`
/// once, a block of columns' bounds at a time.
fn first_unsafe(x: &[f32], s: &[f32], multiply: bool) -> Option<usize> {
    let cols = s.len();
    if cols == 0 {
        return None;
    }
    let mut bounds = [0u32; COL_BLOCK];
    let mut first: Option<usize> = None;
    let mut c0 = 0;
    while c0 < cols {
        let k = COL_BLOCK.min(cols - c0);
        for (b, &f) in bounds[..k].iter_mut().zip(&s[c0..c0 + k]) {
            *b = finite_bound(f, multiply);
        }
        let bounds = &bounds[..k];
        for (i, row) in x.chunks_exact(cols).enumerate() {
            if first.is_some_and(|at| at < i * cols) {
                break;
            }
            let part = &row[c0..c0 + k];
            // Branch-free over the row (it vectorizes); NaN's bits exceed
            // every bound.
            let over = part
                .iter()
                .zip(bounds)
                .fold(false, |o, (v, &b)| o | (v.to_bits() & 0x7fff_ffff > b));
            if over {
                let j = part
                    .iter()
                    .zip(bounds)
                    .position(|(v, &b)| v.to_bits() & 0x7fff_ffff > b)
                    .unwrap_or(0);
                let at = i * cols + c0 + j;
                first = Some(first.map_or(at, |f| f.min(at)));
                break;
            }
        }
        c0 += k;
    }
    first
}

/// Check `x` (named `arg`) against the factors, then smooth it in place.
fn smooth(x: &mut [f32], s: &[f32], arg: &'static str, multiply: bool) -> Result<()> {
    // A caller's flush-to-zero flags would zero subnormal results.
    let _env = crate::simd::fpenv::Pinned::new();
    check_factors(x.len(), s, arg, multiply)?;
    if let Some(at) = first_unsafe(x, s, multiply) {
        // A non-finite input comes first; else a finite value the factor
        // takes past float32's range.
        if let Some(index) = first_non_finite(x) {
            return Err(QuantError::NonFinite { arg, index });
        }
        let (i, j) = (at / s.len(), at % s.len());
        let op = if multiply { "*" } else { "/" };
        return Err(QuantError::invalid(
            "s",
            format!(
                "{arg}[{i}, {j}] {op} s[{j}] = {} {op} {} overflows float32; \
                 nothing was modified",
                x[at], s[j]
            ),
        ));
    }
    for row in x.chunks_exact_mut(s.len().max(1)) {
        for (v, &f) in row.iter_mut().zip(s) {
            *v = apply(*v, f, multiply);
        }
    }
    Ok(())
}

/// `a[i, j] /= s[j]` in place (rows of `s.len()`). Nothing is modified on
/// error: `ShapeMismatch`, `NonFinite` (naming `a` or `s`), `InvalidConfig`
/// naming `s` for a zero factor or one that would take a finite value of `a`
/// past float32's range (a subnormal factor, say). Negative factors are the
/// seed's: they flip signs.
pub fn smooth_activations(a: &mut [f32], s: &[f32]) -> Result<()> {
    smooth(a, s, "a", false)
}

/// `w[i, j] *= s[j]` in place; errors as [`smooth_activations`] (naming `w`).
pub fn smooth_weights(w: &mut [f32], s: &[f32]) -> Result<()> {
    smooth(w, s, "w", true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factors_follow_the_seed_formula() -> Result<()> {
        let act = [1.0f32, -4.0, 0.5, 2.0];
        let w = [0.25f32, 1.0, -0.5, 9.0];
        let c = SmoothQuantConfig::default();
        let s = compute_smooth_factors(&act, &w, 2, &c)?;
        let eps = 1e-5f32;
        let want0 = ((1.0f32 + eps).powf(0.5) / (0.5f32 + eps).powf(0.5)).max(eps);
        let want1 = ((4.0f32 + eps).powf(0.5) / (9.0f32 + eps).powf(0.5)).max(eps);
        assert_eq!(s, vec![want0, want1]);
        Ok(())
    }

    #[test]
    fn an_impossible_width_is_an_error_not_an_abort() {
        // Empty matrices tile into rows of any width: only the factors' own
        // allocation can fail (it aborted, or panicked on capacity overflow).
        let c = SmoothQuantConfig::default();
        let got = compute_smooth_factors::<f32, f32>(&[], &[], 1 << 62, &c);
        assert!(
            matches!(got, Err(QuantError::OutOfMemory { bytes, .. }) if bytes == usize::MAX),
            "{got:?}"
        );
        assert!(got.unwrap_err().to_string().contains("more than"));
        // A matrix that does not tile, or a bad config, is still the error reported.
        let got = compute_smooth_factors::<f32, f32>(&[1.0], &[], 1 << 62, &c);
        assert!(
            matches!(
                got,
                Err(QuantError::ShapeMismatch {
                    arg: "activations",
                    ..
                })
            ),
            "{got:?}"
        );
        let bad = SmoothQuantConfig {
            alpha: 2.0,
            ..SmoothQuantConfig::default()
        };
        let got = compute_smooth_factors::<f32, f32>(&[], &[], 1 << 62, &bad);
        assert!(
            matches!(got, Err(QuantError::InvalidConfig { .. })),
            "{got:?}"
        );
    }

    #[test]
    fn nothing_is_modified_on_error() {
        let mut a = [1.0f32, 2.0, f32::NAN, 4.0];
        let before = a.map(f32::to_bits);
        assert!(smooth_activations(&mut a, &[2.0, 2.0]).is_err());
        assert_eq!(a.map(f32::to_bits), before);
        let mut w = [1.0f32, 2.0, 3.0];
        assert!(smooth_weights(&mut w, &[2.0, 2.0]).is_err());
        assert!(smooth_activations(&mut w, &[2.0, 0.0, 1.0]).is_err());
        assert!(smooth_activations(&mut w, &[2.0, -0.0, 1.0]).is_err());
        assert_eq!(w, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn any_finite_factor_is_the_seeds() -> Result<()> {
        // Negative factors flip signs; `w * 0` is 0; no value, no quotient.
        let mut w = [1.0f32, -2.0, 3.0, 4.0];
        smooth_weights(&mut w, &[-2.0, 0.0])?;
        assert_eq!(
            w.map(f32::to_bits),
            [-2.0f32, -0.0, -6.0, 0.0].map(f32::to_bits)
        );
        let mut a = [1.0f32, -2.0];
        smooth_activations(&mut a, &[-4.0, 0.5])?;
        assert_eq!(a, [-0.25, -4.0]);
        smooth_activations(&mut [], &[0.0])?;
        // A negative factor's overflow is found by its magnitude.
        let mut a = [1.0f32, 1e30];
        let err = smooth_activations(&mut a, &[1.0, -1e-10]).unwrap_err();
        assert!(err.to_string().contains("a[0, 1]"), "{err}");
        assert_eq!(a, [1.0, 1e30]);
        Ok(())
    }

    #[test]
    fn a_result_past_float32_is_refused_and_nothing_is_modified() {
        // Finite values and factors > 0 whose quotient or product overflows.
        let mut a = [1.0f32, 2.0, 3.0, 4.0];
        let s = [1.0f32, 1e-45];
        let err = smooth_activations(&mut a, &s).unwrap_err();
        assert!(
            matches!(err, QuantError::InvalidConfig { arg: "s", .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("a[0, 1]"), "{err}");
        assert_eq!(a, [1.0, 2.0, 3.0, 4.0]);
        let mut w = [2.0f32, 1e38, 1.0, 1.0];
        let err = smooth_weights(&mut w, &[1.0, 10.0]).unwrap_err();
        assert!(err.to_string().contains("w[0, 1]"), "{err}");
        assert_eq!(w, [2.0, 1e38, 1.0, 1.0]);
        // A non-finite input is reported first, even after the overflow.
        let mut a = [1.0f32, 2.0, f32::NAN, 4.0];
        let err = smooth_activations(&mut a, &s).unwrap_err();
        assert!(
            matches!(err, QuantError::NonFinite { arg: "a", index: 2 }),
            "{err:?}"
        );
        // The first overflow in row-major order, across column blocks.
        let cols = COL_BLOCK + 3;
        let mut s = vec![1.0f32; cols];
        let mut x = vec![1.0f32; 3 * cols];
        s[5] = 1e-30;
        s[COL_BLOCK + 1] = 1e-30;
        x[2 * cols + 5] = 1e10; // row 2, first block
        x[cols + COL_BLOCK + 1] = 1e10; // row 1, second block: first
        let err = smooth_activations(&mut x, &s).unwrap_err();
        let want = format!("a[1, {}]", COL_BLOCK + 1);
        assert!(err.to_string().contains(&want), "{err}");
    }

    #[test]
    fn the_bound_is_exact() {
        for (f, multiply) in [(1e-45f32, false), (0.3, false), (7.0, true), (3e30, true)] {
            let b = f32::from_bits(finite_bound(f, multiply));
            assert!(apply(b, f, multiply).is_finite(), "{f} {multiply}");
            assert!(
                !apply(b.next_up(), f, multiply).is_finite(),
                "{f} {multiply}"
            );
            let mut x = [b, -b];
            let s = [f];
            let run = |x: &mut [f32]| match multiply {
                true => smooth_weights(x, &s[..1]),
                false => smooth_activations(x, &s[..1]),
            };
            run(&mut x).unwrap();
            assert!(x.iter().all(|v| v.is_finite()));
            let mut x = [b.next_up()];
            assert!(run(&mut x).is_err());
            assert_eq!(x, [b.next_up()]);
        }
        assert_eq!(finite_bound(1.0, false), f32::MAX.to_bits());
        assert_eq!(finite_bound(1.0, true), f32::MAX.to_bits());
        assert_eq!(finite_bound(1e-3, true), f32::MAX.to_bits());
    }

    #[test]
    fn a_callers_flush_to_zero_flags_change_nothing() {
        // 1e-40 / 2 and 1e-40 * 2 are subnormal: FTZ/DAZ would make both 0.
        std::thread::spawn(|| {
            crate::simd::fpenv::set_flush_denormals(true);
            // black_box: constants folded at compile time ignore the flags.
            let (mut a, mut w) = std::hint::black_box(([1e-40f32, 3.0], [1e-40f32, 3.0]));
            let s = std::hint::black_box([2.0f32, 2.0]);
            smooth_activations(&mut a, &s).unwrap();
            smooth_weights(&mut w, &s).unwrap();
            let keep = std::hint::black_box(1e-40f32);
            crate::simd::fpenv::set_flush_denormals(false);
            assert_eq!(a[0].to_bits(), (keep / 2.0).to_bits());
            assert_eq!(w[0].to_bits(), (keep * 2.0).to_bits());
            assert!(a[0] > 0.0 && w[0] > 0.0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn alpha_outside_0_1_is_refused() {
        for a in [-0.1f32, 1.1, f32::NAN] {
            assert!(SmoothQuantConfig::new(a, 1e-5).is_err());
        }
        assert!(SmoothQuantConfig::new(0.0, 1e-5).is_ok());
        assert!(SmoothQuantConfig::new(1.0, 1e-5).is_ok());
    }
}
