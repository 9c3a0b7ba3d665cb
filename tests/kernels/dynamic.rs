//! Dynamic activation quantization (SPEC §3) and BitNet (SPEC §4): every ISA
//! gives the scalar result bit for bit; the thread count changes nothing.

use crate::rng::Rng;
use crate::with_threads;
use ferroquant::ops::bitnet::quantize_activations_with;
use ferroquant::ops::dynamic::{
    compute_scale_with, dynamic_quantize_with, num_scales, DynCodesMut, DynFormat, ScaleMode,
};
use ferroquant::ops::pack::packed_len;
use ferroquant::simd::Isa;
use half::f16;

/// Values with many exact rounding ties, zeros, tiny and large magnitudes.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..n)
        .map(|i| match i % 7 {
            0 => 0.0,
            1 => (r.next() % 509) as f32 * 0.5 - 127.0,
            2 => (r.unit() - 0.5) * 1e-3,
            3 => (r.unit() - 0.5) * 3e4,
            _ => (r.unit() - 0.5) * 8.0,
        })
        .collect()
}

type Out = (Vec<u8>, Vec<f32>);

fn run(isa: Isa, x: &[f32], shape: &[usize], f: DynFormat, m: ScaleMode) -> Out {
    let mut s = vec![0f32; num_scales(shape, f)];
    let codes = if f == DynFormat::Int4PerTensor {
        let mut c = vec![0u8; packed_len(x.len())];
        dynamic_quantize_with(isa, x, shape, f, m, DynCodesMut::Int4(&mut c), &mut s).unwrap();
        c
    } else {
        let mut c = vec![0i8; x.len()];
        dynamic_quantize_with(isa, x, shape, f, m, DynCodesMut::Int8(&mut c), &mut s).unwrap();
        c.iter().map(|&v| v as u8).collect()
    };
    (codes, s)
}

const MODES: [ScaleMode; 3] = [
    ScaleMode::MaxAbs,
    ScaleMode::Percentile(0.99),
    ScaleMode::Percentile(0.3),
];

#[test]
fn every_isa_matches_scalar_for_rows_of_every_length() {
    for cols in 0..=70 {
        for rows in [1usize, 2, 5] {
            let x = values(rows * cols, (rows * 97 + cols) as u64);
            let shape = [rows, cols];
            for f in [
                DynFormat::Int8PerTensor,
                DynFormat::Int8PerRow,
                DynFormat::Int4PerTensor,
            ] {
                for m in MODES {
                    let want = run(Isa::Scalar, &x, &shape, f, m);
                    for isa in Isa::supported() {
                        assert_eq!(
                            run(isa, &x, &shape, f, m),
                            want,
                            "{isa:?} {f:?} {m:?} {shape:?}"
                        );
                    }
                }
            }
            for isa in Isa::supported() {
                for m in MODES {
                    assert_eq!(
                        compute_scale_with(isa, &x, 127.0, m).unwrap().to_bits(),
                        compute_scale_with(Isa::Scalar, &x, 127.0, m)
                            .unwrap()
                            .to_bits()
                    );
                }
                for bits in 2..=8 {
                    let groups = rows;
                    let (mut c1, mut s1) = (vec![0i8; x.len()], vec![0f32; groups]);
                    let (mut c2, mut s2) = (vec![0i8; x.len()], vec![0f32; groups]);
                    quantize_activations_with(isa, &x, cols, bits, &mut c1, &mut s1).unwrap();
                    quantize_activations_with(Isa::Scalar, &x, cols, bits, &mut c2, &mut s2)
                        .unwrap();
                    assert_eq!((c1, s1), (c2, s2), "bitnet {isa:?} {bits} {shape:?}");
                }
            }
        }
    }
}

#[test]
fn half_inputs_are_their_f32_values() {
    let x = values(4099, 3);
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    let xf: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
    for f in [
        DynFormat::Int8PerTensor,
        DynFormat::Int8PerRow,
        DynFormat::Int4PerTensor,
    ] {
        for m in MODES {
            let shape = [1, 4099];
            let mut s = vec![0f32; num_scales(&shape, f)];
            let mut c = vec![0i8; 4099];
            let mut p = vec![0u8; packed_len(4099)];
            let codes = match f {
                DynFormat::Int4PerTensor => DynCodesMut::Int4(&mut p),
                _ => DynCodesMut::Int8(&mut c),
            };
            dynamic_quantize_with(Isa::detected(), &xh, &shape, f, m, codes, &mut s).unwrap();
            let got = if f == DynFormat::Int4PerTensor {
                p.clone()
            } else {
                c.iter().map(|&v| v as u8).collect()
            };
            assert_eq!((got, s), run(Isa::Scalar, &xf, &shape, f, m), "{f:?} {m:?}");
        }
    }
}

#[test]
fn large_inputs_do_not_depend_on_the_thread_count() {
    let (rows, cols) = (1024, 1031);
    let x = values(rows * cols, 11);
    for f in [
        DynFormat::Int8PerTensor,
        DynFormat::Int8PerRow,
        DynFormat::Int4PerTensor,
    ] {
        for m in [ScaleMode::MaxAbs, ScaleMode::Percentile(0.999)] {
            let outs = with_threads(&[1, 2, 3], |_| {
                run(Isa::detected(), &x, &[rows, cols], f, m)
            });
            assert_eq!(outs[0], outs[1], "{f:?} {m:?}");
            assert_eq!(outs[0], outs[2], "{f:?} {m:?}");
        }
    }
    let outs = with_threads(&[1, 3], |_| {
        let (mut c, mut s) = (vec![0i8; x.len()], vec![0f32; rows]);
        quantize_activations_with(Isa::detected(), &x, cols, 8, &mut c, &mut s).unwrap();
        (c, s)
    });
    assert_eq!(outs[0], outs[1]);
}

#[test]
fn the_first_non_finite_index_does_not_depend_on_the_thread_count() {
    let (rows, cols) = (1024, 1024);
    let mut x = values(rows * cols, 5);
    x[900_001] = f32::INFINITY;
    x[600_000] = f32::NAN;
    for f in [
        DynFormat::Int8PerTensor,
        DynFormat::Int8PerRow,
        DynFormat::Int4PerTensor,
    ] {
        for m in [ScaleMode::MaxAbs, ScaleMode::Percentile(0.5)] {
            let errs = with_threads(&[1, 2, 3], |_| {
                let mut s = vec![0f32; num_scales(&[rows, cols], f)];
                let mut c = vec![0i8; x.len()];
                let mut p = vec![0u8; packed_len(x.len())];
                let codes = match f {
                    DynFormat::Int4PerTensor => DynCodesMut::Int4(&mut p),
                    _ => DynCodesMut::Int8(&mut c),
                };
                dynamic_quantize_with(Isa::detected(), &x, &[rows, cols], f, m, codes, &mut s)
                    .unwrap_err()
            });
            for e in errs {
                assert_eq!(e.to_string(), errs_string(600_000), "{f:?} {m:?}");
            }
        }
    }
}

/// Rows of at least 4096 values are coded a row at a time: on tiers that
/// fuse the passes, the next row's max is read beside this row's codes (up
/// to 16 Ki values a row; longer rows take spans of two passes). Lengths
/// around the 32-value chunk, all-zero rows, the last row, both limits.
#[test]
fn long_rows_match_scalar_on_every_isa() {
    for cols in [4096usize, 4097, 4099, 4127, 4128, 5000, 16384, 16385, 20000] {
        for rows in [1usize, 2, 3, 5] {
            let mut x = values(rows * cols, (rows * 31 + cols) as u64);
            if rows >= 3 {
                x[cols..2 * cols].fill(0.0);
                x[(rows - 1) * cols..].fill(-0.0);
            }
            let shape = [rows, cols];
            let want = run(
                Isa::Scalar,
                &x,
                &shape,
                DynFormat::Int8PerRow,
                ScaleMode::MaxAbs,
            );
            for bits in [8, 2] {
                let (mut c2, mut s2) = (vec![0i8; x.len()], vec![0f32; rows]);
                quantize_activations_with(Isa::Scalar, &x, cols, bits, &mut c2, &mut s2).unwrap();
                for isa in Isa::supported() {
                    let (mut c1, mut s1) = (vec![0i8; x.len()], vec![0f32; rows]);
                    quantize_activations_with(isa, &x, cols, bits, &mut c1, &mut s1).unwrap();
                    assert!(c1 == c2 && s1 == s2, "bitnet {isa:?} {bits} {shape:?}");
                }
            }
            for isa in Isa::supported() {
                let got = run(isa, &x, &shape, DynFormat::Int8PerRow, ScaleMode::MaxAbs);
                assert!(got == want, "{isa:?} {shape:?}");
            }
        }
    }
}

/// The first non-finite value of long rows is the one reported, wherever it
/// sits (first row, a later row, the last value), with another after it.
#[test]
fn long_rows_report_the_first_non_finite_value_on_every_isa() {
    for cols in [4096usize, 4099, 20000] {
        let rows = 4;
        for at in [0, 17, cols + 5, 2 * cols - 1, 3 * cols, rows * cols - 1] {
            let mut x = values(rows * cols, 3);
            x[at] = f32::NAN;
            if at + 1 < x.len() {
                x[rows * cols - 1] = f32::INFINITY;
            }
            for isa in Isa::supported() {
                let (mut c, mut s) = (vec![0i8; x.len()], vec![0f32; rows]);
                let e = dynamic_quantize_with(
                    isa,
                    &x,
                    &[rows, cols],
                    DynFormat::Int8PerRow,
                    ScaleMode::MaxAbs,
                    DynCodesMut::Int8(&mut c),
                    &mut s,
                )
                .unwrap_err();
                assert_eq!(e.to_string(), errs_string(at), "{isa:?} cols {cols}");
                let e = quantize_activations_with(isa, &x, cols, 8, &mut c, &mut s).unwrap_err();
                assert_eq!(e.to_string(), errs_string(at), "bitnet {isa:?} cols {cols}");
            }
        }
    }
}

/// A per-row output of at least 8 MiB is written with streaming stores on
/// one thread: the same codes as the scalar path, on one and two threads.
#[test]
fn streamed_long_rows_match_scalar() {
    let (rows, cols) = (2049, 4100);
    let x = values(rows * cols, 21);
    let want = run(
        Isa::Scalar,
        &x,
        &[rows, cols],
        DynFormat::Int8PerRow,
        ScaleMode::MaxAbs,
    );
    for isa in Isa::supported() {
        let outs = with_threads(&[1, 2], |_| {
            run(
                isa,
                &x,
                &[rows, cols],
                DynFormat::Int8PerRow,
                ScaleMode::MaxAbs,
            )
        });
        assert!(outs.iter().all(|o| *o == want), "{isa:?}");
    }
}

fn errs_string(i: usize) -> String {
    format!("x holds a non-finite value (NaN or ±inf) at flat index {i}")
}

/// Large groups select by a histogram of the top 16 bits: the same element a
/// full sort picks, for spread, clustered, duplicated and tiny values.
#[test]
fn the_histogram_percentile_is_the_sorted_element() {
    let n = 70_001;
    let mut r = crate::rng::Rng(77);
    let dists: Vec<Vec<f32>> = vec![
        values(n, 9),
        (0..n).map(|_| 1.0 + r.unit() * 1e-6).collect(), // one bin
        (0..n).map(|i| (i % 3) as f32).collect(),        // duplicates and zeros
        (0..n).map(|i| f32::from_bits((i % 5000) as u32)).collect(), // subnormals
        vec![-2.5; n],
    ];
    for x in &dists {
        let mut sorted: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
        for p in [1e-9, 0.01, 0.5, 0.9, 0.99, 0.999, 1.0] {
            let rank = ferroquant::ops::dynamic::percentile_rank(p, n);
            let got =
                compute_scale_with(Isa::detected(), x, 1.0, ScaleMode::Percentile(p)).unwrap();
            let want = if sorted[rank] == 0.0 {
                0.0
            } else {
                sorted[rank] / 1.0
            };
            assert_eq!(got.to_bits(), want.to_bits(), "p {p}");
        }
    }
}

/// Groups of many stages guess the percentile's range from a sample of stages
/// (0, 64, 128, ...) and select in one pass; a sample that misleads sends
/// them to the two-pass path. Either way: the sorted element, for f32 and
/// f64 input, and the first non-finite index wherever it lies.
#[test]
fn the_sampled_percentile_is_the_sorted_element_even_when_the_sample_misleads() {
    const STAGE: usize = 4096;
    let n = 300_001;
    let sampled = |i: usize| (i / STAGE).is_multiple_of(64);
    let mut r = crate::rng::Rng(5);
    let dists: Vec<Vec<f32>> = vec![
        values(n, 3),
        // The sample sees only small values (the threshold keeps everything).
        (0..n)
            .map(|i| if sampled(i) { 1.0 } else { 100.0 + r.unit() })
            .collect(),
        // The sample sees only large values (too few kept to reach the rank).
        (0..n)
            .map(|i| if sampled(i) { 1e6 + i as f32 } else { r.unit() })
            .collect(),
        // Growing magnitudes: the sample is spread but not representative.
        (0..n)
            .map(|i| (i as f32).sqrt() * if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect(),
        (0..n).map(|i| (i % 7) as f32 * 0.25).collect(),
        // Every value in one bin of the top 16 bits, distinct in the low 15
        // (the second histogram tells them apart), and one value throughout.
        (0..n)
            .map(|i| (1.0 + r.unit().abs() * 0.0077) * if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect(),
        vec![-3.5; n],
    ];
    for x in &dists {
        let mut sorted: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for p in [1e-9, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999, 0.99999, 1.0] {
            let rank = ferroquant::ops::dynamic::percentile_rank(p, n);
            for isa in Isa::supported() {
                let got = compute_scale_with(isa, x, 1.0, ScaleMode::Percentile(p)).unwrap();
                assert_eq!(got.to_bits(), sorted[rank].to_bits(), "{isa:?} p {p}");
                let got = compute_scale_with(isa, &x64, 1.0, ScaleMode::Percentile(p)).unwrap();
                assert_eq!(got.to_bits(), sorted[rank].to_bits(), "{isa:?} f64 p {p}");
            }
        }
    }
    // A NaN outside the sample, one in a sampled stage after it, then one in
    // a sampled stage before it: the first wins.
    let mut x = values(n, 4);
    x[200_000] = f32::NAN;
    let err = |x: &[f32]| compute_scale_with(Isa::detected(), x, 1.0, ScaleMode::Percentile(0.99));
    assert_eq!(err(&x).unwrap_err().to_string(), errs_string(200_000));
    x[64 * STAGE + 5] = f32::INFINITY;
    assert_eq!(err(&x).unwrap_err().to_string(), errs_string(200_000));
    x[5] = f32::NEG_INFINITY;
    assert_eq!(err(&x).unwrap_err().to_string(), errs_string(5));
}

/// Outputs of 8 MiB or more with rows of 4 KiB or more stream their codes:
/// still the scalar result (rows of 4099 start at every alignment).
#[test]
fn outputs_large_enough_to_stream_match_scalar() {
    let (rows, cols) = (2049, 4099);
    let x = values(rows * cols, 13);
    // Streaming stores are used on one thread only; check both.
    with_threads(&[1, 2], |_| {
        for f in [DynFormat::Int8PerRow, DynFormat::Int8PerTensor] {
            let m = ScaleMode::MaxAbs;
            assert_eq!(
                run(Isa::detected(), &x, &[rows, cols], f, m),
                run(Isa::Scalar, &x, &[rows, cols], f, m),
                "{f:?}"
            );
        }
        let bitnet = |isa| {
            let (mut c, mut s) = (vec![0i8; x.len()], vec![0f32; rows]);
            quantize_activations_with(isa, &x, cols, 8, &mut c, &mut s).unwrap();
            (c, s)
        };
        assert_eq!(bitnet(Isa::detected()), bitnet(Isa::Scalar));
    });
}

#[test]
fn moment_and_column_primitives_match_scalar() {
    use ferroquant::simd;
    for n in (0..70).chain([1000, 4099]) {
        let x = values(n, 40 + n as u64);
        for k in [0.0f64, 1.5, -3.25e3, x.first().map_or(0.0, |&v| v as f64)] {
            let want = simd::shifted_moments(Isa::Scalar, &x, k);
            for isa in Isa::supported() {
                let got = simd::shifted_moments(isa, &x, k);
                assert_eq!(
                    (got.0.to_bits(), got.1.to_bits()),
                    (want.0.to_bits(), want.1.to_bits()),
                    "{isa:?} n {n} k {k}"
                );
            }
        }
        let init: Vec<u32> = (0..n as u32)
            .map(|i| i.wrapping_mul(2_654_435_761) >> 2)
            .collect();
        let mut want = init.clone();
        simd::absmax_columns(Isa::Scalar, &x, &mut want);
        for isa in Isa::supported() {
            let mut got = init.clone();
            simd::absmax_columns(isa, &x, &mut got);
            assert_eq!(got, want, "{isa:?} n {n}");
        }
    }
}

/// The candidate filter of the percentile and calibration passes: the values
/// at or above a threshold in order, the largest below it, on every tier —
/// thresholds that take none, a few, every value, and ones equal to a value
/// (with -0.0, subnormals and the largest finite values among them).
#[test]
fn candidate_selection_matches_scalar() {
    use ferroquant::simd;
    for n in (0..70).chain([1000, 4099]) {
        let mut x = values(n, 90 + n as u64);
        for (i, v) in x.iter_mut().enumerate() {
            match i % 11 {
                3 => *v = -0.0,
                5 => *v = f32::from_bits(1 + i as u32),
                7 => *v = if i % 2 == 0 { f32::MAX } else { -f32::MAX },
                _ => {}
            }
        }
        let mut sorted: Vec<u32> = x.iter().map(|v| v.to_bits() & 0x7fff_ffff).collect();
        sorted.sort_unstable();
        let mut thresholds = vec![0, 1, u32::MAX, 0x7f80_0000];
        thresholds.extend(sorted.iter().step_by(7).copied());
        thresholds.extend(sorted.iter().rev().take(3).map(|b| b + 1));
        for t in thresholds {
            let mut want = vec![7u32];
            let below = simd::select_at_least(Isa::Scalar, &x, t, &mut want);
            let expect: Vec<u32> = std::iter::once(7)
                .chain(
                    x.iter()
                        .map(|v| v.to_bits() & 0x7fff_ffff)
                        .filter(|&b| b >= t),
                )
                .collect();
            assert_eq!(want, expect, "scalar n {n} t {t:#x}");
            let expect_below = sorted.iter().copied().filter(|&b| b < t).max().unwrap_or(0);
            assert_eq!(below, expect_below, "scalar n {n} t {t:#x}");
            for isa in Isa::supported() {
                let mut got = vec![7u32];
                let got_below = simd::select_at_least(isa, &x, t, &mut got);
                assert_eq!(
                    (got, got_below),
                    (want.clone(), below),
                    "{isa:?} n {n} t {t:#x}"
                );
            }
        }
    }
}

/// Rows of 4096 or more take the two-pass path (every max first, then every
/// code): the first non-finite index is still the first, for any thread count,
/// and nothing else differs from scalar.
#[test]
fn long_rows_report_the_first_non_finite_value() {
    let (rows, cols) = (300, 4100);
    let mut x = values(rows * cols, 21);
    assert_eq!(
        run(
            Isa::detected(),
            &x,
            &[rows, cols],
            DynFormat::Int8PerRow,
            ScaleMode::MaxAbs
        ),
        run(
            Isa::Scalar,
            &x,
            &[rows, cols],
            DynFormat::Int8PerRow,
            ScaleMode::MaxAbs
        )
    );
    x[250 * cols + 7] = f32::NAN;
    x[170 * cols + 4099] = f32::NEG_INFINITY;
    let errs = with_threads(&[1, 2, 3], |_| {
        let (mut c, mut s) = (vec![0i8; x.len()], vec![0f32; rows]);
        quantize_activations_with(Isa::detected(), &x, cols, 8, &mut c, &mut s).unwrap_err()
    });
    for e in errs {
        assert_eq!(e.to_string(), errs_string(170 * cols + 4099));
    }
}
