//! BitNet activation quantization — SPEC §4, ported from seed 003
//! (bitnet_quantize `quantize_activations`, `dequantize_activations`).
//!
//! Per group (a token, or a whole batch item when not per token), in f32:
//! `scale = max|x| / (2^(bits-1) - 1)`, 1.0 for an all-zero group; codes
//! `clamp(round(v / scale), -max, max)`; values `q as f32 * scale`. A scale
//! that underflows to 0 (max|x| below ~1e-43) divides by zero as the seed
//! does: nonzero values go to ±max, zeros stay 0.
//!
//! Deviations (SPEC): non-finite input is an error (2); `bits` outside 2..=8
//! is an error and `per_token = false` is honoured (4).
//!
//! ```
//! # fn main() -> Result<(), ferroquant::QuantError> {
//! use ferroquant::ops::bitnet::quantize_activations;
//!
//! // Two tokens of three values, 4-bit codes in -7..=7, one scale per token.
//! let x = [0.7f32, -0.35, 0.0, 1.4, 0.2, -2.8];
//! let (mut codes, mut scales) = ([0i8; 6], [0f32; 2]);
//! quantize_activations(&x, 3, 4, &mut codes, &mut scales)?;
//! assert_eq!(codes, [7, -4, 0, 4, 1, -7]);
//! assert_eq!(scales, [0.7 / 7.0, 2.8 / 7.0]);
//! # Ok(())
//! # }
//! ```

use crate::element::Float;
use crate::error::{QuantError, Result};
use crate::ops::drive::split_quantize;
use crate::parallel;
use crate::simd::{AbsmaxRule, Isa};

/// The rule for `bits`-bit activations (2..=8), or `InvalidConfig` naming
/// `activation_bits`.
pub fn rule(bits: u32) -> Result<AbsmaxRule> {
    if !(2..=8).contains(&bits) {
        return Err(QuantError::invalid(
            "activation_bits",
            format!("expected 2..=8, got {bits}"),
        ));
    }
    let max = ((1u32 << (bits - 1)) - 1) as f32;
    Ok(AbsmaxRule {
        divisor: max,
        zero_scale: 1.0,
        clip: max,
    })
}

/// Quantize `x` in groups of `group` consecutive elements (one scale each).
///
/// Errors: `InvalidConfig` for `bits` outside 2..=8; `ShapeMismatch` when the
/// groups do not tile `x` or the outputs have the wrong length; `NonFinite`
/// naming the first NaN or infinity.
pub fn quantize_activations<T: Float>(
    x: &[T],
    group: usize,
    bits: u32,
    codes: &mut [i8],
    scales: &mut [f32],
) -> Result<()> {
    quantize_activations_with(Isa::detected(), x, group, bits, codes, scales)
}

/// [`quantize_activations`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn quantize_activations_with<T: Float>(
    isa: Isa,
    x: &[T],
    group: usize,
    bits: u32,
    codes: &mut [i8],
    scales: &mut [f32],
) -> Result<()> {
    let rule = rule(bits)?;
    let _env = crate::simd::fpenv::Pinned::new();
    let n = x.len();
    if group.checked_mul(scales.len()) != Some(n) {
        return Err(QuantError::ShapeMismatch {
            arg: "x",
            expected: format!("{} groups of {group}", scales.len()),
            actual: format!("{n} elements"),
        });
    }
    if codes.len() != n {
        return Err(QuantError::len_mismatch("codes", n, codes.len()));
    }
    if n == 0 {
        // Groups of nothing (hidden size 0): all-zero groups, scale 1.
        scales.fill(rule.zero_scale);
        return Ok(());
    }
    parallel::run(n, |par| {
        split_quantize(isa, x, group, rule, codes, scales, par)
    })
    .into_result()?;
    // zero_scale is 1, so a 0 scale is an underflow: v / 0 is ±inf for v != 0
    // (clamped to ±max) and NaN for 0 (cast to 0), as in the seed.
    for (g, &s) in scales.iter().enumerate() {
        if s == 0.0 {
            let range = g * group..(g + 1) * group;
            for (c, v) in codes[range.clone()].iter_mut().zip(&x[range]) {
                let v = v.to_f32();
                *c = if v > 0.0 {
                    rule.clip as i8
                } else if v < 0.0 {
                    -(rule.clip as i8)
                } else {
                    0
                };
            }
        }
    }
    Ok(())
}

/// Elements of `x` a slab of [`fake_quantize_activations`] holds codes for
/// (whole groups, at least one).
const SLAB: usize = 1 << 20;

/// The straight-through estimator's forward pass: `q as f32 * scale` of
/// [`quantize_activations`] written to `out`, with codes for about a million
/// elements held at a time (whole groups) instead of all of them: the same
/// values as quantizing then [`dequantize_groups`](crate::ops::dynamic::dequantize_groups).
///
/// Errors: as [`quantize_activations`], and `ShapeMismatch` naming `out`.
pub fn fake_quantize_activations<T: Float>(
    x: &[T],
    group: usize,
    bits: u32,
    out: &mut [f32],
) -> Result<()> {
    rule(bits)?;
    let n = x.len();
    if !n.is_multiple_of(group) {
        return Err(QuantError::ShapeMismatch {
            arg: "x",
            expected: format!("whole groups of {group}"),
            actual: format!("{n} elements"),
        });
    }
    if out.len() != n {
        return Err(QuantError::len_mismatch("out", n, out.len()));
    }
    if n == 0 {
        return Ok(());
    }
    let per = (SLAB / group).max(1) * group;
    let mut codes = vec![0i8; per.min(n)];
    let mut scales = vec![0f32; per.min(n) / group];
    for (k, (xs, os)) in x.chunks(per).zip(out.chunks_mut(per)).enumerate() {
        let (cs, ss) = (&mut codes[..xs.len()], &mut scales[..xs.len() / group]);
        quantize_activations(xs, group, bits, cs, ss).map_err(|e| match e {
            QuantError::NonFinite { arg, index } => QuantError::NonFinite {
                arg,
                index: k * per + index,
            },
            other => other,
        })?;
        crate::ops::dynamic::dequantize_groups(
            crate::ops::dynamic::DynCodes::Int8(cs),
            group,
            ss,
            os,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_quantization_is_quantize_then_dequantize() -> Result<()> {
        // Groups of 3 and of 2^20 + 5 (one a slab), bits 2..=8, an error's
        // index counted over the whole input.
        for group in [3usize, SLAB + 5] {
            let n = 4 * group;
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1000) as f32 / 97.0 - 5.0)
                .collect();
            for bits in [2, 5, 8] {
                let (mut codes, mut scales) = (vec![0i8; n], vec![0f32; n / group]);
                quantize_activations(&x, group, bits, &mut codes, &mut scales)?;
                let mut want = vec![0f32; n];
                crate::ops::dynamic::dequantize_groups(
                    crate::ops::dynamic::DynCodes::Int8(&codes),
                    group,
                    &scales,
                    &mut want,
                )?;
                let mut got = vec![0f32; n];
                fake_quantize_activations(&x, group, bits, &mut got)?;
                assert!(got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
            let mut bad = x.clone();
            bad[n - 2] = f32::NAN;
            let mut out = vec![0f32; n];
            assert!(matches!(
                fake_quantize_activations(&bad, group, 8, &mut out),
                Err(QuantError::NonFinite { index, .. }) if index == n - 2
            ));
        }
        Ok(())
    }

    #[test]
    fn codes_follow_the_seed_formula() -> Result<()> {
        // Token 0: max 254 -> scale 2; token 1: all zero -> scale 1.
        let x = [1.0f32, -3.0, 5.0, 254.0, 0.0, 0.0, 0.0, 0.0];
        let (mut c, mut s) = (vec![0i8; 8], vec![0f32; 2]);
        quantize_activations(&x, 4, 8, &mut c, &mut s)?;
        assert_eq!(s, vec![2.0, 1.0]);
        assert_eq!(c, vec![1, -2, 3, 127, 0, 0, 0, 0]);
        // 2 bits: max 1.
        quantize_activations(&x, 4, 2, &mut c, &mut s)?;
        assert_eq!(s, vec![254.0, 1.0]);
        assert_eq!(&c[..4], &[0, 0, 0, 1]);
        Ok(())
    }

    #[test]
    fn an_underflowing_scale_divides_by_zero_as_the_seed() -> Result<()> {
        let tiny = f32::from_bits(1);
        let x = [tiny, -tiny, 0.0];
        let (mut c, mut s) = (vec![9i8; 3], vec![9f32; 1]);
        quantize_activations(&x, 3, 8, &mut c, &mut s)?;
        assert_eq!(s, vec![0.0]);
        assert_eq!(c, vec![127, -127, 0]);
        Ok(())
    }

    #[test]
    fn bits_outside_2_to_8_are_refused() {
        for b in [0, 1, 9, 32] {
            assert!(matches!(rule(b), Err(QuantError::InvalidConfig { .. })));
        }
    }
}
