//! The quantized linear layer's forward pass: the dequantizing dot products
//! give the scalar result bit for bit on every ISA; the forward pass is
//! within float32 rounding of `x @ dequant(W).T + bias` on both paths and
//! does not depend on the ISA or the thread count.

use crate::rng::Rng;
use crate::with_threads;
use ferroquant::ops::linear::{
    linear_forward_with, DequantDtype, QuantizedWeight, WeightCodes, GEMM_MIN_TOKENS,
};
use ferroquant::ops::pack::packed_len;
use ferroquant::simd::{self, scalar, Isa};

fn floats(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    (0..n).map(|_| (r.unit() - 0.5) * 4.0).collect()
}

/// int4 codes packed two a byte (element 2i in the low nibble).
fn pack(q: &[i8]) -> Vec<u8> {
    q.chunks(2)
        .map(|p| (p[0] as u8 & 0xf) | (p.get(1).map_or(0, |&v| v as u8 & 0xf) << 4))
        .collect()
}

fn codes(n: usize, seed: u64) -> Vec<i8> {
    let mut r = Rng(seed | 1);
    (0..n).map(|_| r.next() as u8 as i8).collect()
}

/// Per-row scales for `zps`: ordinary, tiny, large.
fn scales_for(zps: &[f32]) -> Vec<f32> {
    (0..zps.len())
        .map(|r| [0.013f32, 1.0, 3.0e-5, 7.5e30][r % 4])
        .collect()
}

fn dots_i8(isa: Isa, q: &[i8], stride: usize, zps: &[f32], x: &[f32]) -> Vec<u32> {
    let mut out = vec![f32::NAN; zps.len()];
    let scales = scales_for(zps);
    simd::dot_dequant_i8_rows(isa, q, stride, zps, &scales, x, &mut out);
    out.iter().map(|v| v.to_bits()).collect()
}

fn dots_i4(isa: Isa, p: &[u8], stride: usize, n: usize, zps: &[f32], xs: &[f32]) -> Vec<u32> {
    let mut out = vec![f32::NAN; zps.len()];
    let scales = scales_for(zps);
    simd::dot_dequant_i4_rows(isa, p, stride, n, zps, &scales, xs, &mut out);
    out.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn rows_shorter_than_the_activation_panic_on_every_isa() {
    // A safe function: a row without x.len() codes is a panic, never a read
    // past the slice (an adversarial review found the AVX-512 path reading on).
    for isa in Isa::supported() {
        let x = vec![1.0f32; 4096];
        let mut out = [0f32; 1];
        let i8_short = std::panic::catch_unwind(|| {
            let mut out = [0f32; 1];
            simd::dot_dequant_i8_rows(isa, &[1i8; 64], 64, &[0.0], &[1.0], &x, &mut out);
        });
        assert!(i8_short.is_err(), "{isa:?}");
        let i4_short = std::panic::catch_unwind(|| {
            let mut out = [0f32; 1];
            simd::dot_dequant_i4_rows(isa, &[0x11u8; 32], 32, 4096, &[0.0], &[1.0], &x, &mut out);
        });
        assert!(i4_short.is_err(), "{isa:?}");
        // Whole rows are fine.
        simd::dot_dequant_i8_rows(isa, &[1i8; 4096], 4096, &[0.0], &[1.0], &x, &mut out);
        assert_eq!(out[0], 4096.0);
    }
}

#[test]
fn int4_dots_match_scalar_for_every_nibble_and_zero_point() {
    // Every nibble value in every position of a word, integer and fractional
    // zero points small and huge, and x with signed zeros (a zero product's
    // sign must match the spec's) give the scalar result bit for bit.
    let n = 128 * 3 + 5;
    let bstride = packed_len(n);
    let zps = [
        64.0f32,
        -64.0,
        65.0,
        -65.0,
        63.5,
        0.5,
        -0.0,
        0.0,
        7.0,
        15.0,
        8.0,
        -8.0,
        1.0e6,
        1.0e9,
        -3.0e9,
        f32::MIN_POSITIVE,
    ];
    let rows = zps.len();
    // Row r, byte b: nibbles (b + r) and (b + 3r + 1), so every nibble
    // value lands in every position of a word across the rows.
    let p: Vec<u8> = (0..rows * bstride)
        .map(|i| {
            let (r, b) = (i / bstride, i % bstride);
            (((b + r) & 15) | (((b + 3 * r + 1) & 15) << 4)) as u8
        })
        .collect();
    let mut x = floats(n, 5);
    for (i, v) in x.iter_mut().enumerate() {
        match i % 5 {
            0 => *v = 0.0,
            1 => *v = -0.0,
            _ => {}
        }
    }
    let xs = scalar::nibble_planes(&x);
    for isa in Isa::supported() {
        // Threes and pairs of rows (the AVX-512 kernel's steps) mixing both
        // kinds of zero point, and each row alone.
        for start in 0..rows {
            for len in [1, 2, 3] {
                let end = (start + len).min(rows);
                let (pr, z) = (&p[start * bstride..], &zps[start..end]);
                assert_eq!(
                    dots_i4(isa, pr, bstride, n, z, &xs),
                    dots_i4(Isa::Scalar, pr, bstride, n, z, &xs),
                    "{isa:?} rows {start}..{end}"
                );
            }
        }
        assert_eq!(
            dots_i4(isa, &p, bstride, n, &zps, &xs),
            dots_i4(Isa::Scalar, &p, bstride, n, &zps, &xs),
            "{isa:?}"
        );
    }
}

#[test]
fn dequantizing_dots_match_scalar_on_every_isa() {
    for isa in Isa::supported() {
        for n in (0..200).chain([1000, 4096 + 63]) {
            for rows in [1usize, 3, 4, 5, 9] {
                // ±0 zero points take the kernels' no-subtraction path.
                let zps: Vec<f32> = [0.0f32, 3.0, -128.0, 1.0e6, -7.0, -0.0][..rows.min(6)]
                    .iter()
                    .cycle()
                    .take(rows)
                    .copied()
                    .collect();
                let x = floats(n, n as u64);
                let stride = n + 3;
                let q = codes(rows * stride, 7 + n as u64);
                let want = dots_i8(Isa::Scalar, &q, stride, &zps, &x);
                assert_eq!(
                    dots_i8(isa, &q, stride, &zps, &x),
                    want,
                    "i8 {isa:?} n {n} rows {rows}"
                );
                // Codes after the last row (the next task's rows, which the
                // kernels prefetch) do not change the sums.
                let mut longer = q.clone();
                longer.extend(codes(40 * stride, 11));
                assert_eq!(dots_i8(isa, &longer, stride, &zps, &x), want);
                let bstride = packed_len(n) + 1;
                let p: Vec<u8> = codes(rows * bstride, 9 + n as u64)
                    .iter()
                    .map(|&v| v as u8)
                    .collect();
                // In nibble-plane order (padded), shorter, and in natural order.
                let xs = scalar::nibble_planes(&x);
                for xs in [&xs[..], &xs[..xs.len() / 2], &x[..]] {
                    assert_eq!(
                        dots_i4(isa, &p, bstride, n, &zps, xs),
                        dots_i4(Isa::Scalar, &p, bstride, n, &zps, xs),
                        "i4 {isa:?} n {n} rows {rows}"
                    );
                }
            }
        }
    }
    // The scalar order is the documented one: 64 lanes, then a tree; int8
    // scales the sum once.
    let x: Vec<f32> = (0..130).map(|i| 1.0 + i as f32 * 1e-3).collect();
    let q: Vec<i8> = (0..130).map(|i| (i % 7) as i8 - 3).collect();
    let mut lanes = [0f32; scalar::DOT_LANES];
    for (i, v) in x.iter().enumerate() {
        lanes[i % 64] = v.mul_add(q[i] as f32 - 2.0, lanes[i % 64]);
    }
    let want = (scalar::lanes_tree_sum(lanes) * 0.013).to_bits();
    assert_eq!(dots_i8(Isa::Scalar, &q, 130, &[2.0], &x), vec![want]);
    // int4: the same sum over the nibble-plane order, each element once,
    // scaled once after the tree (nibble 3, zero point 1).
    let p = vec![0x33u8; 65];
    let xs = scalar::nibble_planes(&x);
    let mut lanes = [0f32; scalar::DOT_LANES];
    for (k, v) in xs.iter().enumerate() {
        let e = scalar::plane_element(k);
        assert_eq!(scalar::plane_index(e), k);
        if e < 130 {
            lanes[k % 64] = v.mul_add(3.0 - 1.0, lanes[k % 64]);
        }
    }
    let want = (scalar::lanes_tree_sum(lanes) * 0.013).to_bits();
    assert_eq!(dots_i4(Isa::Scalar, &p, 65, 130, &[1.0], &xs), vec![want]);
}

/// At the ends of f32 every ISA still gives the scalar bits: subnormal
/// products and sums, sums that overflow (or come near to), cancelling
/// terms and non-finite activations.
#[test]
fn dequantizing_dots_match_scalar_at_the_ends_of_f32() {
    let mut r = crate::rng::Rng(0x5eed);
    // Activations by magnitude: subnormal, around 2^-126, ordinary, large
    // enough that 2^24 · x · q passes f32::MAX while x · q does not, and
    // large enough to overflow unscaled too.
    let magnitudes = [1.0e-44f32, 1.0e-40, 1.2e-38, 1.0, 1.0e30, 1.0e33, 1.0e37];
    for isa in Isa::supported() {
        for n in [1usize, 63, 64, 65, 130, 257] {
            for case in 0..40 {
                let m = magnitudes[case % magnitudes.len()];
                let mut x: Vec<f32> = (0..n).map(|_| (r.unit() - 0.5) * 2.0 * m).collect();
                // Cancelling pairs (equal terms of both signs) and a few
                // non-finite inputs.
                if case % 3 == 1 {
                    for i in (1..n).step_by(2) {
                        x[i] = -x[i - 1];
                    }
                }
                if case % 13 == 5 {
                    x[n / 2] = [f32::INFINITY, f32::NAN, f32::NEG_INFINITY][case % 3];
                }
                let rows = 4;
                let zps = [0.0f32, 3.0, -128.0, 1.0e6];
                let mut q = codes(rows * n, case as u64 * 31 + n as u64);
                if case % 3 == 1 {
                    // Equal codes where the activations cancel.
                    for i in (1..rows * n).step_by(2) {
                        if (i % n) % 2 == 1 {
                            q[i] = q[i - 1];
                        }
                    }
                }
                assert_eq!(
                    dots_i8(isa, &q, n, &zps, &x),
                    dots_i8(Isa::Scalar, &q, n, &zps, &x),
                    "i8 {isa:?} n {n} case {case} magnitude {m:e}"
                );
                let stride = packed_len(n);
                let p: Vec<u8> = q[..rows * stride].iter().map(|&v| v as u8).collect();
                let xs = scalar::nibble_planes(&x);
                assert_eq!(
                    dots_i4(isa, &p, stride, n, &zps, &xs),
                    dots_i4(Isa::Scalar, &p, stride, n, &zps, &xs),
                    "i4 {isa:?} n {n} case {case} magnitude {m:e}"
                );
            }
        }
    }
    // Sums of 2^110 come back exactly.
    let x = vec![2.0f32.powi(103); 64];
    let xs = scalar::nibble_planes(&x);
    for isa in Isa::supported() {
        let want = vec![(2.0f32.powi(110) * 0.013).to_bits()];
        assert_eq!(dots_i8(isa, &[2i8; 64], 64, &[0.0], &x), want);
        assert_eq!(dots_i4(isa, &[0x22u8; 32], 32, 64, &[0.0], &xs), want);
    }
}

/// `x @ dequant(W).T + bias` in f64, and a bound on its f32 rounding error.
fn reference(
    q: &[i8],
    scales: &[f64],
    zps: &[f64],
    shape: [usize; 2],
    x: &[f32],
    bias: &[f32],
    dtype: DequantDtype,
) -> (Vec<f64>, Vec<f64>) {
    let [o, i] = shape;
    let tokens = x.len() / i;
    let (mut y, mut bound) = (vec![0f64; tokens * o], vec![0f64; tokens * o]);
    for t in 0..tokens {
        for r in 0..o {
            let j = if scales.len() == 1 { 0 } else { r };
            let (mut s, mut a) = (bias[r] as f64, bias[r].abs() as f64);
            for c in 0..i {
                let w = dtype.round((q[r * i + c] as f64 - zps[j]) * scales[j]);
                s += x[t * i + c] as f64 * w;
                a += (x[t * i + c] as f64 * w).abs();
            }
            y[t * o + r] = s;
            // A sum of i products in f32, any order, plus the dequantized
            // weight's own rounding: (i + 3) unit roundoffs of Σ|x·w|.
            bound[t * o + r] = a * (i as f64 + 3.0) * f32::EPSILON as f64;
        }
    }
    (y, bound)
}

#[test]
fn forward_is_within_f32_rounding_on_both_paths() {
    let dtypes = [DequantDtype::F32, DequantDtype::F16, DequantDtype::Bf16];
    for ((o, i), dtype) in [(7usize, 33usize), (16, 64), (5, 129), (40, 300)]
        .into_iter()
        .flat_map(|s| dtypes.map(|d| (s, d)))
    {
        for int4 in [false, true] {
            for per_tensor in [false, true] {
                let k = if per_tensor { 1 } else { o };
                let q: Vec<i8> = codes(o * i, (o * i) as u64)
                    .iter()
                    .map(|&v| if int4 { (v >> 4).clamp(-8, 7) } else { v })
                    .collect();
                let scales: Vec<f64> = (0..k).map(|r| 1e-2 * (1 + r % 5) as f64).collect();
                let zps: Vec<f64> = (0..k).map(|r| (r % 9) as f64 - 4.0).collect();
                let packed = pack(&q);
                let bias = floats(o, 3);
                for tokens in [0usize, 1, 3, GEMM_MIN_TOKENS, GEMM_MIN_TOKENS + 5] {
                    let x = floats(tokens * i, (tokens + i) as u64);
                    let (want, bound) = reference(&q, &scales, &zps, [o, i], &x, &bias, dtype);
                    let w = QuantizedWeight {
                        codes: if int4 {
                            WeightCodes::Int4(&packed)
                        } else {
                            WeightCodes::Int8(&q)
                        },
                        shape: [o, i],
                        scales: &scales,
                        zero_points: &zps,
                        dequant: dtype,
                    };
                    let mut first: Option<Vec<f32>> = None;
                    for isa in Isa::supported() {
                        let mut out = vec![f32::NAN; tokens * o];
                        linear_forward_with(isa, &w, &x, tokens, Some(&bias), &mut out).unwrap();
                        for (j, (&g, (&e, &b))) in
                            out.iter().zip(want.iter().zip(&bound)).enumerate()
                        {
                            assert!(
                                (g as f64 - e).abs() <= b + 1e-30,
                                "{o}x{i} {dtype:?} int4 {int4} per_tensor {per_tensor} tokens {tokens} {isa:?} [{j}]: {g} vs {e} (bound {b})"
                            );
                        }
                        match &first {
                            None => first = Some(out),
                            Some(f) => assert_eq!(f, &out, "ISAs differ: {isa:?}"),
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn forward_does_not_depend_on_the_thread_count() {
    let (o, i) = (300usize, 1024usize);
    let q = codes(o * i, 5);
    let scales: Vec<f64> = (0..o).map(|r| 1e-3 * (1 + r % 7) as f64).collect();
    let zps = vec![0.0f64; o];
    let w = QuantizedWeight {
        codes: WeightCodes::Int8(&q),
        shape: [o, i],
        scales: &scales,
        zero_points: &zps,
        dequant: DequantDtype::F32,
    };
    for tokens in [1usize, 2 * GEMM_MIN_TOKENS] {
        let x = floats(tokens * i, 8);
        let runs = with_threads(&[1, 2, 3], |_| {
            let mut out = vec![0f32; tokens * o];
            linear_forward_with(Isa::detected(), &w, &x, tokens, None, &mut out).unwrap();
            out
        });
        assert_eq!(runs[0], runs[1]);
        assert_eq!(runs[0], runs[2]);
    }
}

#[test]
fn rows_longer_than_a_panel_are_summed_a_block_at_a_time() {
    // Rows past a panel (64 Ki floats under 8 tokens, 2 Mi from 8) are cut
    // into blocks of columns whose products add up: still within f32
    // rounding, on every ISA and thread count, int4 rows starting mid-byte.
    // Every product is positive, so the worst-case bound is also tight
    // enough to miss no block.
    for (o, i, tokens, dtype) in [
        (3usize, 70_001usize, 1usize, DequantDtype::F16),
        (2, 65_536 * 2 + 7, 2, DequantDtype::Bf16),
        (2, 2 * 1024 * 1024 + 3, GEMM_MIN_TOKENS, DequantDtype::F32),
    ] {
        for int4 in [false, true] {
            let q: Vec<i8> = codes(o * i, (o + i) as u64)
                .iter()
                .map(|&v| {
                    if int4 {
                        (v >> 4).abs().min(7)
                    } else {
                        v.max(0)
                    }
                })
                .collect();
            let packed = pack(&q);
            let scales: Vec<f64> = (0..o).map(|r| 1e-2 * (1 + r) as f64 / 3.0).collect();
            let zps: Vec<f64> = (0..o).map(|r| -1.0 - r as f64).collect();
            let bias = floats(o, 5);
            let x: Vec<f32> = floats(tokens * i, 6).iter().map(|v| v.abs()).collect();
            let (want, bound) = reference(&q, &scales, &zps, [o, i], &x, &bias, dtype);
            let w = QuantizedWeight {
                codes: if int4 {
                    WeightCodes::Int4(&packed)
                } else {
                    WeightCodes::Int8(&q)
                },
                shape: [o, i],
                scales: &scales,
                zero_points: &zps,
                dequant: dtype,
            };
            let runs = with_threads(&[1, 2], |_| {
                let mut outs = Vec::new();
                for isa in Isa::supported() {
                    let mut out = vec![f32::NAN; tokens * o];
                    linear_forward_with(isa, &w, &x, tokens, Some(&bias), &mut out).unwrap();
                    outs.push(out);
                }
                outs
            });
            for out in runs.iter().flatten() {
                assert_eq!(
                    out, &runs[0][0],
                    "{o}x{i} int4 {int4}: ISAs or threads differ"
                );
            }
            for (j, (&g, (&e, &b))) in runs[0][0].iter().zip(want.iter().zip(&bound)).enumerate() {
                let at = format!("{o}x{i} {dtype:?} int4 {int4} tokens {tokens} [{j}]");
                assert!((g as f64 - e).abs() <= b, "{at}: {g} vs {e} (bound {b})");
            }
        }
    }
}

#[test]
fn forward_is_within_f32_rounding_at_the_edges_of_the_range() {
    // The int8 dot path sums x · (q − zp) and scales once. Two inputs where
    // that alone would not do: subnormal activations under a huge scale (the
    // products would round to the subnormal grid first), and huge activations
    // under a tiny scale (the unscaled sum overflows where the result does not).
    let (o, i) = (6usize, 200usize);
    let q = codes(o * i, 21);
    let zps: Vec<f64> = (0..o).map(|r| [0.0, 3.0, 2.5][r % 3]).collect();
    let cases: [(f64, f32); 2] = [(1.0e30, 2.0e-45), (1.0e-30, 3.0e37)];
    for (scale, magnitude) in cases {
        let scales = vec![scale; o];
        let mut x: Vec<f32> = floats(i, 4).iter().map(|v| v * magnitude).collect();
        x[7] = 0.0;
        let bias = vec![0f32; o];
        let (want, bound) = reference(&q, &scales, &zps, [o, i], &x, &bias, DequantDtype::F32);
        let w = QuantizedWeight {
            codes: WeightCodes::Int8(&q),
            shape: [o, i],
            scales: &scales,
            zero_points: &zps,
            dequant: DequantDtype::F32,
        };
        for isa in Isa::supported() {
            let mut out = vec![f32::NAN; o];
            linear_forward_with(isa, &w, &x, 1, Some(&bias), &mut out).unwrap();
            for (j, (&g, (&e, &b))) in out.iter().zip(want.iter().zip(&bound)).enumerate() {
                assert!(
                    g.is_finite() && (g as f64 - e).abs() <= b,
                    "scale {scale} |x| {magnitude} {isa:?} [{j}]: {g} vs {e} (bound {b})"
                );
            }
        }
    }
}

#[test]
fn weights_past_the_f32_range_sum_to_their_true_value() {
    // A float64 weight's scale can put dequantized values past f32::MAX
    // (1e39 / 127 per code step). The f32 paths see ±inf there; the outputs
    // they touch are redone in f64, with the f64 values when the weight
    // dequantizes to float64, so +1e39 and -1e39 cancel instead of making
    // NaN, and a sum past f32's range is ±inf.
    let (o, i) = (3usize, 37usize);
    let scale = 1e39f64 / 127.0;
    let mut q = vec![0i8; o * i];
    (q[5], q[6]) = (127, -127); // row 0: +1e39 and -1e39 cancel
    q[i + 5] = 127; // row 1: +1e39 alone overflows
    (q[2 * i + 5], q[2 * i + 6]) = (127, -127); // row 2: cancels, plus 0.5 · scale
    q[2 * i + 9] = 1;
    let (scales, zps) = (vec![scale], vec![0.0f64]);
    for (tokens, dequant) in [1usize, 2 * GEMM_MIN_TOKENS]
        .into_iter()
        .flat_map(|t| [(t, DequantDtype::F64), (t, DequantDtype::F32)])
    {
        let w = QuantizedWeight {
            codes: WeightCodes::Int8(&q),
            shape: [o, i],
            scales: &scales,
            zero_points: &zps,
            dequant,
        };
        let mut x = vec![1.0f32; tokens * i];
        for t in 0..tokens {
            x[t * i + 9] = 0.5;
        }
        let bias = [0.25f32, 0.0, -1.0];
        for isa in Isa::supported() {
            let mut out = vec![f32::NAN; tokens * o];
            linear_forward_with(isa, &w, &x, tokens, Some(&bias), &mut out).unwrap();
            for t in 0..tokens {
                let y = &out[t * o..(t + 1) * o];
                let at = format!("{isa:?} tokens {tokens} {dequant:?}");
                assert_eq!(y[1], f32::INFINITY, "{at}");
                if dequant == DequantDtype::F64 {
                    assert_eq!(y[0], 0.25, "{at}");
                    assert_eq!(y[2], (0.5 * scale - 1.0) as f32, "{at}");
                } else {
                    // dequantize::<f32> holds +inf and -inf: their sum is NaN.
                    assert!(y[0].is_nan() && y[2].is_nan(), "{at}");
                }
            }
        }
    }
}

#[test]
fn nibble_planes_into_transposes_as_the_scatter_does() {
    // Whole blocks, tails of every length, and padding left untouched.
    for n in (0..300).chain([1023, 1024, 1025, 4096]) {
        let x = floats(n, 77 + n as u64);
        let want = scalar::nibble_planes(&x);
        let mut got = vec![-1.5f32; want.len()];
        scalar::nibble_planes_into(&x, &mut got);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let padding = scalar::plane_element(k) >= n;
            let expect = if padding { -1.5 } else { *w };
            assert_eq!(g.to_bits(), expect.to_bits(), "n {n} position {k}");
        }
    }
}

#[test]
#[should_panic(expected = "nibble_planes_into: out holds 128 of the 256 positions")]
fn nibble_planes_into_refuses_a_short_output() {
    let x = floats(256, 5);
    scalar::nibble_planes_into(&x, &mut [0f32; 128]);
}
