//! Blockwise 8-bit quantization with per-block scales — SPEC §1, ported from
//! seed 000 (kwaai-compression 0.3.5, `BlockwiseQuantizer::compress` /
//! `decompress`).
//!
//! Per block of the flattened input (the last may be short): `max_abs` in f32;
//! `scale = max_abs / 127` if `max_abs > 0` else 1.0; codes
//! `clamp(round(v / scale), -127, 127)` computed with the **f32** scale (0 if
//! that scale underflowed to 0); the stored scale is `f16(scale)` (or the f32
//! scale itself); dequantization multiplies by the stored scale.
//!
//! Deviations (SPEC): non-finite input is an error (2); an f16 scale that
//! overflows is an error instead of a silent inf (6).

use crate::element::Float;
use crate::error::{QuantError, Result};
use crate::ops::drive::{split_dequantize, split_quantize};
use crate::parallel;
use crate::simd::{AbsmaxRule, Isa};
use half::f16;

/// Seed 000's scale rule: `max_abs / 127`, 1.0 for an all-zero block, codes in ±127.
pub const RULE: AbsmaxRule = AbsmaxRule {
    divisor: 127.0,
    zero_scale: 1.0,
    clip: 127.0,
};

/// Mutable destination for per-block scales.
#[derive(Debug)]
pub enum ScalesMut<'a> {
    /// float16 scales (the seed's format).
    F16(&'a mut [f16]),
    /// float32 scales (exact; no overflow, no precision loss).
    F32(&'a mut [f32]),
}

/// Per-block scales to dequantize with.
#[derive(Debug, Clone, Copy)]
pub enum Scales<'a> {
    /// float16 scales.
    F16(&'a [f16]),
    /// float32 scales.
    F32(&'a [f32]),
}

impl Scales<'_> {
    fn len(&self) -> usize {
        match self {
            Scales::F16(s) => s.len(),
            Scales::F32(s) => s.len(),
        }
    }
}

impl ScalesMut<'_> {
    fn len(&self) -> usize {
        match self {
            ScalesMut::F16(s) => s.len(),
            ScalesMut::F32(s) => s.len(),
        }
    }
}

/// What a successful quantization noticed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockwiseReport {
    /// Blocks with `max_abs > 0` whose f16 scale is subnormal or zero: their
    /// stored scale lost precision (always 0 with f32 scales).
    pub lossy_blocks: usize,
}

/// Number of blocks for `n` elements: `ceil(n / block_size)`.
pub fn num_blocks(n: usize, block_size: usize) -> usize {
    n.div_ceil(block_size.max(1))
}

fn check_block_size(block_size: usize) -> Result<()> {
    if block_size == 0 {
        return Err(QuantError::invalid(
            "block_size",
            "expected an integer >= 1, got 0",
        ));
    }
    Ok(())
}

/// Quantize `x` blockwise into `codes` (len n) and `scales` (len ceil(n/block_size)).
///
/// Errors: `InvalidConfig` for `block_size == 0`; `ShapeMismatch` for wrong
/// output lengths; `NonFinite` naming the first NaN/inf; `ScaleOverflow` when
/// an f16 scale would be infinite (non-finite input takes precedence).
pub fn quantize_blockwise<T: Float>(
    x: &[T],
    block_size: usize,
    codes: &mut [i8],
    scales: ScalesMut<'_>,
) -> Result<BlockwiseReport> {
    quantize_blockwise_with(Isa::detected(), x, block_size, codes, scales)
}

/// [`quantize_blockwise`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn quantize_blockwise_with<T: Float>(
    isa: Isa,
    x: &[T],
    block_size: usize,
    codes: &mut [i8],
    scales: ScalesMut<'_>,
) -> Result<BlockwiseReport> {
    check_block_size(block_size)?;
    let n = x.len();
    let nb = num_blocks(n, block_size);
    if codes.len() != n {
        return Err(QuantError::len_mismatch("codes", n, codes.len()));
    }
    if scales.len() != nb {
        return Err(QuantError::len_mismatch("scales", nb, scales.len()));
    }
    let outcome = parallel::run(n, |par| match scales {
        ScalesMut::F16(s) => split_quantize(isa, x, block_size, RULE, codes, s, par),
        ScalesMut::F32(s) => split_quantize(isa, x, block_size, RULE, codes, s, par),
    });
    outcome.into_result()
}

/// Dequantize blockwise codes: `out[i] = codes[i] as f32 * f32(scales[i / block_size])`.
///
/// Errors: `InvalidConfig` for `block_size == 0`; `ShapeMismatch` when
/// `scales` or `out` do not match `codes`.
pub fn dequantize_blockwise(
    codes: &[i8],
    block_size: usize,
    scales: Scales<'_>,
    out: &mut [f32],
) -> Result<()> {
    dequantize_blockwise_with(Isa::detected(), codes, block_size, scales, out)
}

/// [`dequantize_blockwise`] on a chosen ISA (downgraded if the CPU lacks it).
pub fn dequantize_blockwise_with(
    isa: Isa,
    codes: &[i8],
    block_size: usize,
    scales: Scales<'_>,
    out: &mut [f32],
) -> Result<()> {
    check_block_size(block_size)?;
    let n = codes.len();
    let nb = num_blocks(n, block_size);
    if scales.len() != nb {
        return Err(QuantError::len_mismatch("scales", nb, scales.len()));
    }
    if out.len() != n {
        return Err(QuantError::len_mismatch("out", n, out.len()));
    }
    // Dequantizing an element costs about an eighth of quantizing one at the
    // parallel break-even (it only converts and multiplies): measured 2^21
    // elements on the build VM, where 2^20 was still faster on one thread.
    parallel::run(n / 8, |par| match scales {
        Scales::F16(s) => split_dequantize(isa, codes, block_size, s, out, par),
        Scales::F32(s) => split_dequantize(isa, codes, block_size, s, out, par),
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stage::STAGE;
    use half::bf16;

    fn q16(x: &[f32], bs: usize) -> Result<(Vec<i8>, Vec<f16>, BlockwiseReport)> {
        let mut c = vec![0i8; x.len()];
        let mut s = vec![f16::ZERO; num_blocks(x.len(), bs)];
        let r = quantize_blockwise(x, bs, &mut c, ScalesMut::F16(&mut s))?;
        Ok((c, s, r))
    }

    #[test]
    fn scale_of_zero_block_is_one() {
        assert_eq!(RULE.scale(0.0), 1.0);
        assert_eq!(RULE.scale(127.0), 1.0);
        // The smallest subnormal divided by 127 underflows to zero.
        assert_eq!(RULE.scale(f32::from_bits(1)), 0.0);
    }

    #[test]
    fn seed_roundtrip_test() -> Result<()> {
        // Seed 000's own test: 0.0, 0.1, ... 25.5 in blocks of 64, error < 0.5.
        let x: Vec<f32> = (0..256).map(|i| i as f32 * 0.1).collect();
        let (c, s, _) = q16(&x, 64)?;
        let mut y = vec![0f32; x.len()];
        dequantize_blockwise(&c, 64, Scales::F16(&s), &mut y)?;
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 0.5);
        }
        let ratio = (4 * x.len()) as f32 / (x.len() + 2 * s.len()) as f32;
        assert!(ratio > 3.0);
        Ok(())
    }

    #[test]
    fn codes_follow_the_seed_formula() -> Result<()> {
        // Block 0: max 254 -> scale exactly 2; block 1: max 127 -> scale 1.
        let x = [1.0f32, -3.0, 5.0, 254.0, 0.0, -127.0, 63.5];
        let (c, s, r) = q16(&x, 4)?;
        assert_eq!(s, vec![f16::from_f32(2.0), f16::ONE]);
        // 0.5 -> 1, -1.5 -> -2, 2.5 -> 3: ties round away from zero.
        assert_eq!(&c[..4], &[1, -2, 3, 127]);
        assert_eq!(&c[4..], &[0, -127, 64]);
        assert_eq!(r.lossy_blocks, 0);
        Ok(())
    }

    #[test]
    fn all_zero_block_has_scale_one() -> Result<()> {
        let (c, s, _) = q16(&[0.0; 5], 5)?;
        assert_eq!(c, vec![0; 5]);
        assert_eq!(s, vec![f16::ONE]);
        Ok(())
    }

    #[test]
    fn underflowed_scale_gives_zero_codes_and_counts_as_lossy() -> Result<()> {
        let tiny = f32::from_bits(1); // 1.4e-45: tiny / 127 == 0 in f32
        let (c, s, r) = q16(&[tiny, -tiny, 0.0], 3)?;
        assert_eq!(c, vec![0, 0, 0]);
        assert_eq!(s[0], f16::ZERO);
        assert_eq!(r.lossy_blocks, 1);
        Ok(())
    }

    #[test]
    fn small_scales_are_reported_lossy() -> Result<()> {
        let x = [1e-3f32, 1.0, 5e-4, 2.0];
        let (_, _, r) = q16(&x, 1)?;
        assert_eq!(r.lossy_blocks, 2);
        Ok(())
    }

    #[test]
    fn f16_overflow_is_an_error_and_f32_scales_are_fine() -> Result<()> {
        let x = [1.0f32, 9e6, 2.0];
        assert!(matches!(
            q16(&x, 1),
            Err(QuantError::ScaleOverflow { block: 1, .. })
        ));
        let mut c = vec![0i8; 3];
        let mut s = vec![0f32; 3];
        quantize_blockwise(&x, 1, &mut c, ScalesMut::F32(&mut s))?;
        assert_eq!(s[1], 9e6f32 / 127.0);
        Ok(())
    }

    #[test]
    fn non_finite_reports_first_index_and_wins_over_overflow() -> Result<()> {
        let mut x = vec![1.0f32; 300];
        x[10] = 1e7;
        x[200] = f32::NAN;
        x[250] = f32::INFINITY;
        assert_eq!(
            q16(&x, 64).map(|_| ()),
            Err(QuantError::NonFinite {
                arg: "x",
                index: 200
            })
        );
        Ok(())
    }

    #[test]
    fn f64_out_of_f32_range_is_non_finite() -> Result<()> {
        let x = [0.0f64, 1e39];
        let mut c = vec![0i8; 2];
        let mut s = vec![0f32; 1];
        let e = quantize_blockwise(&x, 8, &mut c, ScalesMut::F32(&mut s)).expect_err("must fail");
        assert_eq!(e, QuantError::NonFinite { arg: "x", index: 1 });
        Ok(())
    }

    #[test]
    fn other_dtypes_match_f32_of_the_converted_values() -> Result<()> {
        let xf: Vec<f32> = (0..5000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
            .collect();
        let (c_ref, s_ref, _) = q16(&xf, 48)?;
        let xb: Vec<bf16> = xf.iter().map(|&v| bf16::from_f32(v)).collect();
        let xb_f: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
        let (c_b_ref, s_b_ref, _) = q16(&xb_f, 48)?;
        let mut c = vec![0i8; xb.len()];
        let mut s = vec![f16::ZERO; s_ref.len()];
        quantize_blockwise(&xb, 48, &mut c, ScalesMut::F16(&mut s))?;
        assert_eq!((c, s), (c_b_ref, s_b_ref));
        let xd: Vec<f64> = xf.iter().map(|&v| v as f64).collect();
        let mut c = vec![0i8; xd.len()];
        let mut s = vec![f16::ZERO; s_ref.len()];
        quantize_blockwise(&xd, 48, &mut c, ScalesMut::F16(&mut s))?;
        assert_eq!((c, s), (c_ref, s_ref));
        Ok(())
    }

    #[test]
    fn huge_blocks_of_non_f32_input_use_the_two_pass_path() -> Result<()> {
        let n = 3 * STAGE + 17;
        let xf: Vec<f32> = (0..n).map(|i| ((i % 977) as f32 - 488.0) * 0.011).collect();
        let xh: Vec<f16> = xf.iter().map(|&v| f16::from_f32(v)).collect();
        let xh_f: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
        let (c_ref, s_ref, _) = q16(&xh_f, n)?;
        let mut c = vec![0i8; n];
        let mut s = vec![f16::ZERO; 1];
        quantize_blockwise(&xh, n, &mut c, ScalesMut::F16(&mut s))?;
        assert_eq!((c, s), (c_ref, s_ref));
        let mut xh_bad = xh.clone();
        xh_bad[2 * STAGE + 5] = f16::NEG_INFINITY;
        let e = quantize_blockwise(
            &xh_bad,
            n,
            &mut vec![0i8; n],
            ScalesMut::F16(&mut [f16::ZERO]),
        );
        assert_eq!(
            e.expect_err("must fail"),
            QuantError::NonFinite {
                arg: "x",
                index: 2 * STAGE + 5
            }
        );
        Ok(())
    }

    #[test]
    fn bad_arguments_are_rejected() -> Result<()> {
        let x = [1.0f32; 10];
        let e = quantize_blockwise(&x, 0, &mut [0; 10], ScalesMut::F32(&mut [0.0; 1]));
        assert!(matches!(
            e,
            Err(QuantError::InvalidConfig {
                arg: "block_size",
                ..
            })
        ));
        let e = quantize_blockwise(&x, 4, &mut [0; 9], ScalesMut::F32(&mut [0.0; 3]));
        assert!(matches!(
            e,
            Err(QuantError::ShapeMismatch { arg: "codes", .. })
        ));
        let e = quantize_blockwise(&x, 4, &mut [0; 10], ScalesMut::F32(&mut [0.0; 2]));
        assert!(matches!(
            e,
            Err(QuantError::ShapeMismatch { arg: "scales", .. })
        ));
        let e = dequantize_blockwise(&[0; 10], 4, Scales::F32(&[1.0; 3]), &mut [0.0; 9]);
        assert!(matches!(
            e,
            Err(QuantError::ShapeMismatch { arg: "out", .. })
        ));
        Ok(())
    }

    #[test]
    fn empty_input_has_no_blocks() -> Result<()> {
        let (c, s, _) = q16(&[], 64)?;
        assert!(c.is_empty() && s.is_empty());
        dequantize_blockwise(&[], 64, Scales::F16(&[]), &mut [])?;
        Ok(())
    }
}
