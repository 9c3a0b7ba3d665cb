//! Affine int8 / int4 (SPEC §2): the f64 primitives and the whole kernel on
//! every ISA equal the scalar path bit for bit — tails 1..15, odd int4
//! lengths, per-channel rows of every length 0..70, every input dtype — and
//! results do not depend on the thread count.

use crate::rng::Rng;
use crate::with_threads;
use ferroquant::ops::affine::{
    dequantize_with, num_groups, quantize_with, Bits, Codes, CodesMut, QuantConfig,
};
use ferroquant::ops::pack::packed_len;
use ferroquant::simd::{self, Affine, Isa, Store};
use ferroquant::{Float, QuantError};
use half::{bf16, f16};

/// Values that stress the affine map: exact .5 ties of `v * inv + zp`, the
/// doubles just beside them, huge and tiny magnitudes, signed zeros, noise.
fn adversarial_f64(n: usize, seed: u64) -> Vec<f64> {
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|_| match r.next() % 9 {
            0 => (r.next() % 300) as f64 - 150.0 + 0.5,
            1 => f64::from_bits((2.5f64).to_bits() - 1),
            2 => f64::from_bits((-0.5f64).to_bits() + 1),
            3 => -0.0,
            4 => 1e-310,
            5 => (r.next() % 7) as f64 * 1e3 - 3e3,
            _ => (r.unit() as f64 - 0.5) * 300.0 + r.unit() as f64 * 1e-9,
        })
        .collect()
}

const CONFIGS: [fn() -> QuantConfig; 4] = [
    QuantConfig::int8,
    QuantConfig::int8_per_channel,
    QuantConfig::int4,
    QuantConfig::int4_per_channel,
];

fn every_config() -> Vec<QuantConfig> {
    CONFIGS
        .iter()
        .flat_map(|c| [c(), c().asymmetric()])
        .collect()
}

#[derive(Debug, PartialEq)]
struct Out {
    codes: Vec<u8>,
    scales: Vec<u64>,
    zps: Vec<u64>,
}

fn run<T: Float>(isa: Isa, x: &[T], shape: &[usize], c: QuantConfig) -> Result<Out, QuantError> {
    let g = num_groups(shape, c.granularity);
    let (mut s, mut z) = (vec![0.0; g], vec![0.0; g]);
    let codes = match c.bits {
        Bits::Int8 => {
            let mut d = vec![0i8; x.len()];
            quantize_with(isa, x, shape, &c, CodesMut::Int8(&mut d), &mut s, &mut z)?;
            d.iter().map(|&v| v as u8).collect()
        }
        Bits::Int4 => {
            let mut p = vec![0u8; packed_len(x.len())];
            quantize_with(isa, x, shape, &c, CodesMut::Int4(&mut p), &mut s, &mut z)?;
            p
        }
    };
    let bits = |v: Vec<f64>| v.iter().map(|f| f.to_bits()).collect();
    Ok(Out {
        codes,
        scales: bits(s),
        zps: bits(z),
    })
}

fn values<O: Float>(isa: Isa, o: &Out, shape: &[usize], c: QuantConfig, n: usize) -> Vec<O> {
    let f = |v: &Vec<u64>| v.iter().map(|&b| f64::from_bits(b)).collect::<Vec<_>>();
    let (s, z) = (f(&o.scales), f(&o.zps));
    let i8s: Vec<i8> = o.codes.iter().map(|&b| b as i8).collect();
    let codes = match c.bits {
        Bits::Int8 => Codes::Int8(&i8s),
        Bits::Int4 => Codes::Int4(&o.codes),
    };
    let mut out = vec![O::from_f64_once(0.0); n];
    dequantize_with(isa, codes, shape, &c, &s, &z, &mut out).expect("consistent");
    out
}

#[test]
fn primitives_match_scalar_on_every_isa() {
    let params = [
        Affine {
            inv: 1.0,
            zp: 0.0,
            qmin: -127.0,
            qmax: 127.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 0.5,
            zp: -3.0,
            qmin: -128.0,
            qmax: 127.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 127.0 / 149.5,
            zp: 0.0,
            qmin: -7.0,
            qmax: 7.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 0.0,
            zp: 5.0,
            qmin: -8.0,
            qmax: 7.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 1e300,
            zp: -1e300,
            qmin: -8.0,
            qmax: 7.0,
            max_abs: f64::INFINITY,
        },
    ];
    for isa in Isa::supported() {
        for n in (0..70).chain([127, 128, 129, 1000]) {
            let x = adversarial_f64(n, 31 + n as u64);
            let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            assert_eq!(
                simd::range_f64(isa, &x),
                simd::range_f64(Isa::Scalar, &x),
                "{isa:?} {n}"
            );
            assert_eq!(
                simd::range_f32(isa, &xf),
                simd::range_f32(Isa::Scalar, &xf),
                "{isa:?} {n}"
            );
            // The maps the drivers build from the data: symmetric int8 / int4 with
            // the exact bound, where the shortcut needs neither range check nor clamp.
            let amax = xf.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs()));
            for qm in [127.0, 7.0] {
                let a = Affine {
                    inv: if amax > 0.0 { 1.0 / (amax / qm) } else { 0.0 },
                    zp: 0.0,
                    qmin: -qm,
                    qmax: qm,
                    max_abs: amax,
                };
                let (mut p, mut q) = (vec![0i8; n], vec![0i8; n]);
                simd::affine_quantize_f32(isa, &xf, a, &mut p, Store::Cached);
                simd::affine_quantize_f32(Isa::Scalar, &xf, a, &mut q, Store::Cached);
                assert_eq!(p, q, "f32 data-driven {isa:?} n {n} {a:?}");
                assert!(q.iter().all(|&c| (c as f64).abs() <= qm));
                if qm == 7.0 {
                    // Packed straight from registers: the scalar codes, packed.
                    let (mut packed, mut want) = (vec![0x55u8; n / 2 + 1], vec![0x55u8; n / 2 + 1]);
                    simd::affine_quantize_int4_f32(isa, &xf, a, &mut packed);
                    simd::pack_int4(Isa::Scalar, &q, &mut want[..n / 2]);
                    assert_eq!(packed, want, "int4 packed {isa:?} n {n}");
                }
            }
            for a in params {
                let (mut p, mut q) = (vec![0i8; n], vec![0i8; n]);
                simd::affine_quantize_f64(isa, &x, a, &mut p);
                simd::affine_quantize_f64(Isa::Scalar, &x, a, &mut q);
                assert_eq!(p, q, "f64 {isa:?} n {n} {a:?}");
                simd::affine_quantize_f32(isa, &xf, a, &mut p, Store::Cached);
                simd::affine_quantize_f32(Isa::Scalar, &xf, a, &mut q, Store::Cached);
                assert_eq!(p, q, "f32 {isa:?} n {n} {a:?}");
                if a.qmin >= -8.0 && a.qmax <= 7.0 {
                    // int4 maps (asymmetric, clamping, extreme) packed from registers.
                    let (mut packed, mut want) = (vec![0x55u8; n / 2 + 1], vec![0x55u8; n / 2 + 1]);
                    simd::affine_quantize_int4_f32(isa, &xf, a, &mut packed);
                    simd::pack_int4(Isa::Scalar, &q, &mut want[..n / 2]);
                    assert_eq!(packed, want, "int4 packed {isa:?} n {n} {a:?}");
                }
                // With the tightest bound, checks it proves idle are dropped.
                let tight = Affine {
                    max_abs: xf.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs())),
                    ..a
                };
                let mut t = vec![0i8; n];
                simd::affine_quantize_f32(isa, &xf, tight, &mut t, Store::Cached);
                assert_eq!(t, q, "f32 tight {isa:?} n {n} {tight:?}");
                let (mut d1, mut d2) = (vec![0f64; n], vec![0f64; n]);
                simd::affine_dequantize_f64(isa, &p, a.zp, 0.37, &mut d1);
                simd::affine_dequantize_f64(Isa::Scalar, &p, a.zp, 0.37, &mut d2);
                assert_eq!(d1, d2);
                let (mut f1, mut f2) = (vec![0f32; n], vec![0f32; n]);
                simd::affine_dequantize_f32(isa, &p, a.zp, 1.0 / 3.0, &mut f1, Store::Cached);
                simd::affine_dequantize_f32(
                    Isa::Scalar,
                    &p,
                    a.zp,
                    1.0 / 3.0,
                    &mut f2,
                    Store::Cached,
                );
                assert_eq!(f1, f2);
            }
            let codes: Vec<i8> = x
                .iter()
                .map(|&v| (v as i64).rem_euclid(16) as i8 - 8)
                .collect();
            let (mut p1, mut p2) = (vec![0u8; n / 2], vec![0u8; n / 2]);
            simd::pack_int4(isa, &codes, &mut p1);
            simd::pack_int4(Isa::Scalar, &codes, &mut p2);
            assert_eq!(p1, p2);
            let (mut u1, mut u2) = (vec![0i8; 2 * (n / 2)], vec![0i8; 2 * (n / 2)]);
            simd::unpack_int4(isa, &p1, &mut u1);
            simd::unpack_int4(Isa::Scalar, &p1, &mut u2);
            assert_eq!(u1, u2);
            assert_eq!(u1, codes[..2 * (n / 2)]);
        }
    }
}

/// Streaming stores align the output with a masked head first: every start
/// offset of the output (mod 64 bytes) and every length around the steps give
/// the scalar result, and nothing outside the output is written.
#[test]
fn streaming_stores_match_scalar_at_every_alignment() {
    let a = Affine {
        inv: 1.0 / 0.0371,
        zp: -3.0,
        qmin: -128.0,
        qmax: 127.0,
        max_abs: f64::INFINITY,
    };
    let x: Vec<f32> = adversarial_f64(200, 7).iter().map(|&v| v as f32).collect();
    let codes: Vec<i8> = x
        .iter()
        .map(|&v| (v as i64).rem_euclid(256) as u8 as i8)
        .collect();
    for isa in Isa::supported() {
        for n in [0, 1, 15, 16, 17, 31, 33, 64, 65, 100, 130] {
            for off in 0..64 {
                let mut want = vec![0i8; n];
                simd::affine_quantize_f32(Isa::Scalar, &x[..n], a, &mut want, Store::Cached);
                let mut buf = vec![0x55i8; off + n + 64];
                simd::affine_quantize_f32(
                    isa,
                    &x[..n],
                    a,
                    &mut buf[off..off + n],
                    Store::Streaming,
                );
                assert_eq!(
                    &buf[off..off + n],
                    &want[..],
                    "codes {isa:?} n {n} offset {off}"
                );
                assert!(buf[..off].iter().chain(&buf[off + n..]).all(|&b| b == 0x55));

                let mut want = vec![0f32; n];
                let q = &codes[..n];
                simd::affine_dequantize_f32(Isa::Scalar, q, 3.0, 0.0371, &mut want, Store::Cached);
                // f32 offsets: every 4-byte position in a 64-byte line.
                let o = off % 16;
                let mut buf = vec![-7.5f32; o + n + 16];
                simd::affine_dequantize_f32(
                    isa,
                    q,
                    3.0,
                    0.0371,
                    &mut buf[o..o + n],
                    Store::Streaming,
                );
                assert_eq!(&buf[o..o + n], &want[..], "values {isa:?} n {n} offset {o}");
                assert!(buf[..o].iter().chain(&buf[o + n..]).all(|&v| v == -7.5));
            }
        }
    }
}

/// Dequantizing with any zero point and scale gives the scalar bits on every
/// ISA: integer zero points (AVX2 forms `q − zp` exactly without converting,
/// up to 2^40 in magnitude), non-integer, huge and non-finite ones (the
/// converting form), and scales whose products are subnormal, overflow
/// float32 or are NaN. Every code, in every position of a 16-code step.
#[test]
fn dequantize_matches_scalar_for_every_zero_point_and_scale() {
    let two40 = (1u64 << 40) as f64;
    let zps = [
        0.0,
        -0.0,
        1.0,
        -3.0,
        127.0,
        -128.0,
        255.0,
        -256.0,
        12345.0,
        two40 - 1.0,
        -(two40 - 1.0),
        two40,
        -two40,
        two40 + 1.0,
        1e15,
        // 1.5 · 2^52 + zp is not a double here (odd, above 2^53).
        2_251_799_813_685_249.0,
        3_000_000_000_000_001.0,
        -9.007_199_254_740_993e15,
        1e300,
        0.5,
        -2.25,
        127.5,
        1e-300,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ];
    let scales = [
        0.0371,
        1.0 / 3.0,
        -0.37,
        0.0,
        1e-45,
        3e-39,
        1e30,
        3.4e38 / 200.0,
        f64::MAX,
        f64::MIN_POSITIVE,
        f64::NAN,
        f64::INFINITY,
    ];
    // Every code, shifted so each lands in every lane of a 16-code step.
    let codes: Vec<i8> = (0..256 + 37)
        .map(|i| ((i * 7 + 3) % 256) as u8 as i8)
        .collect();
    for isa in Isa::supported() {
        for &zp in &zps {
            for &scale in &scales {
                for off in [0, 1, 5] {
                    let q = &codes[off..];
                    let n = q.len();
                    let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
                    simd::affine_dequantize_f32(isa, q, zp, scale, &mut got, Store::Cached);
                    simd::affine_dequantize_f32(
                        Isa::Scalar,
                        q,
                        zp,
                        scale,
                        &mut want,
                        Store::Cached,
                    );
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "f32 {isa:?} zp {zp} scale {scale}");
                    let (mut got, mut want) = (vec![0f64; n], vec![0f64; n]);
                    simd::affine_dequantize_f64(isa, q, zp, scale, &mut got);
                    simd::affine_dequantize_f64(Isa::Scalar, q, zp, scale, &mut want);
                    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "f64 {isa:?} zp {zp} scale {scale}");
                    // f16 / bf16: the f64 value rounded once (NaN as NaN).
                    let (mut h, mut b) = (vec![f16::ZERO; n], vec![bf16::ZERO; n]);
                    simd::affine_dequantize_f16(isa, q, zp, scale, &mut h);
                    simd::affine_dequantize_bf16(isa, q, zp, scale, &mut b);
                    for (i, &v) in want.iter().enumerate() {
                        let (wh, wb) = (f16::from_f64_once(v), bf16::from_f64_once(v));
                        let at = format!("{isa:?} zp {zp} scale {scale} [{i}] {v:e}");
                        let same_h = h[i].to_bits() == wh.to_bits() || h[i].is_nan() && wh.is_nan();
                        let same_b = b[i].to_bits() == wb.to_bits() || b[i].is_nan() && wb.is_nan();
                        assert!(
                            same_h,
                            "f16 {at}: {:#x} vs {:#x}",
                            h[i].to_bits(),
                            wh.to_bits()
                        );
                        assert!(
                            same_b,
                            "bf16 {at}: {:#x} vs {:#x}",
                            b[i].to_bits(),
                            wb.to_bits()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn the_f32_shortcut_agrees_with_f64_next_to_every_half_integer() {
    // f32 inputs whose v * inv lands within a few f32 ulps of k + 0.5 (where f32
    // and f64 arithmetic may round apart) and near the shortcut's limits; every
    // SIMD path must still give the seed's f64 codes.
    let params = [
        Affine {
            inv: 127.0 / 3.3,
            zp: 0.0,
            qmin: -127.0,
            qmax: 127.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 255.0 / 7.77,
            zp: -37.0,
            qmin: -128.0,
            qmax: 127.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 15.0 / 0.123,
            zp: 5.0,
            qmin: -8.0,
            qmax: 7.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 1.0 / 3.0,
            zp: 1024.0,
            qmin: -128.0,
            qmax: 127.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 1.0 / 3.0,
            zp: 1025.0,
            qmin: -128.0,
            qmax: 127.0,
            max_abs: f64::INFINITY,
        },
        Affine {
            inv: 0.999,
            zp: 0.0,
            qmin: -128.0,
            qmax: 127.0,
            max_abs: f64::INFINITY,
        },
    ];
    let mut r = Rng(77);
    for a in params {
        let mut x = Vec::new();
        for k in -1100i32..1100 {
            let target = ((k as f64 + 0.5) - a.zp) / a.inv;
            let base = target as f32;
            for d in -3i32..=3 {
                x.push(f32::from_bits((base.to_bits() as i32 + d) as u32));
            }
            x.push((target * (1.0 + (r.unit() as f64 - 0.5) * 1e-6)) as f32);
        }
        let tight = Affine {
            max_abs: x.iter().fold(0.0f64, |m, &v| m.max((v as f64).abs())),
            ..a
        };
        for isa in Isa::supported() {
            let (mut p, mut q) = (vec![0i8; x.len()], vec![0i8; x.len()]);
            simd::affine_quantize_f32(isa, &x, a, &mut p, Store::Cached);
            simd::affine_quantize_f32(Isa::Scalar, &x, a, &mut q, Store::Cached);
            assert_eq!(p, q, "{isa:?} {a:?}");
            simd::affine_quantize_f32(isa, &x, tight, &mut p, Store::Streaming);
            assert_eq!(p, q, "{isa:?} {tight:?}");
            // Packed straight from registers: the same codes, packed.
            let (mut packed, mut want) = (vec![0u8; x.len() / 2], vec![0u8; x.len() / 2]);
            simd::pack_int4(
                Isa::Scalar,
                &q.iter().map(|&c| c.clamp(-8, 7)).collect::<Vec<_>>(),
                &mut want,
            );
            let a4 = |a: Affine| Affine {
                qmin: a.qmin.max(-8.0),
                qmax: a.qmax.min(7.0),
                ..a
            };
            for b in [a4(a), a4(tight)] {
                simd::affine_quantize_int4_f32(isa, &x, b, &mut packed);
                assert_eq!(packed, want, "int4 {isa:?} {b:?}");
            }
        }
    }
}

#[test]
fn non_finite_values_are_flagged_by_every_range() {
    for isa in Isa::supported() {
        for n in [1usize, 3, 8, 15, 16, 17, 33, 100] {
            for pos in [0, n / 2, n - 1] {
                for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                    let mut x = vec![1.0f64; n];
                    x[pos] = bad;
                    assert!(simd::range_f64(isa, &x).non_finite, "{isa:?} {n} {pos}");
                    let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
                    assert!(simd::range_f32(isa, &xf).non_finite, "{isa:?} {n} {pos}");
                }
            }
        }
    }
}

fn check_all_isas<T: Float + std::fmt::Debug>(x: &[T], shape: &[usize]) {
    for c in every_config() {
        let want = run(Isa::Scalar, x, shape, c).expect("finite input");
        let vals: Vec<T> = values(Isa::Scalar, &want, shape, c, x.len());
        for isa in Isa::supported() {
            let got = run(isa, x, shape, c).expect("finite input");
            assert_eq!(got, want, "{isa:?} {c:?} shape {shape:?} {}", T::NAME);
            let v: Vec<T> = values(isa, &got, shape, c, x.len());
            let bits = |v: &[T]| v.iter().map(|e| e.to_f64().to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&v), bits(&vals), "{isa:?} {c:?} {shape:?}");
        }
    }
}

#[test]
fn the_kernel_matches_scalar_for_tails_and_rows_of_every_length() {
    for n in 0..=40 {
        let x = adversarial_f64(n, 5 + n as u64);
        check_all_isas(&x, &[n]);
        let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        check_all_isas(&xf, &[n]);
    }
    for cols in 0..=70 {
        for rows in [1usize, 2, 3] {
            let x = adversarial_f64(rows * cols, (rows * 100 + cols) as u64);
            let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            check_all_isas(&xf, &[rows, cols]);
            check_all_isas(&x, &[rows, cols]);
        }
    }
}

#[test]
fn half_precision_inputs_match_on_every_isa() {
    let x = adversarial_f64(4099, 17);
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f64(v)).collect();
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f64(v)).collect();
    for shape in [vec![4099usize, 1], vec![1, 4099], vec![4099]] {
        check_all_isas(&xh, &shape);
        check_all_isas(&xb, &shape);
    }
    // And the codes of a half input are those of its exact f64 values.
    let xd: Vec<f64> = xh.iter().map(|v| v.to_f64()).collect();
    for c in every_config() {
        assert_eq!(
            run(Isa::detected(), &xh, &[4099], c).unwrap(),
            run(Isa::Scalar, &xd, &[4099], c).unwrap()
        );
    }
}

#[test]
fn large_inputs_do_not_depend_on_the_thread_count() {
    let n = 1 << 20;
    let x: Vec<f32> = adversarial_f64(n, 99).iter().map(|&v| v as f32).collect();
    for c in every_config() {
        for shape in [vec![n], vec![1024, 1024], vec![4097, 255]] {
            let k: usize = shape.iter().product();
            let outs = with_threads(&[1, 2, 3], |_| {
                run(Isa::detected(), &x[..k], &shape, c).unwrap()
            });
            assert_eq!(outs[0], outs[1], "{c:?} {shape:?}");
            assert_eq!(outs[0], outs[2], "{c:?} {shape:?}");
            let vals = with_threads(&[1, 3], |_| {
                values::<f32>(Isa::detected(), &outs[0], &shape, c, k)
            });
            assert_eq!(vals[0], vals[1]);
        }
    }
}

/// Outputs of at least `Store::STREAMING_MIN_BYTES` take the streaming-store
/// paths (rows of 4099 start at every alignment): still the scalar result.
#[test]
fn outputs_large_enough_to_stream_match_scalar() {
    let (rows, cols) = (2049, 4099);
    let n = rows * cols;
    assert!(n >= Store::STREAMING_MIN_BYTES);
    let x: Vec<f32> = adversarial_f64(n, 5).iter().map(|&v| v as f32).collect();
    let int8 = QuantConfig::int8();
    // Streaming stores are used on one thread only; check both.
    with_threads(&[1, 2], |_| {
        // Per tensor ignores the shape: one each (int4's codes are packed
        // span by span; the odd total leaves a half byte).
        let int4 = QuantConfig::int4().asymmetric();
        let cases = [
            (int8, &[vec![n]][..]),
            (int8.asymmetric(), &[vec![n]][..]),
            (int4, &[vec![n]][..]),
            (
                QuantConfig::int8_per_channel(),
                &[vec![n], vec![rows, cols]][..],
            ),
        ];
        for (c, shapes) in cases {
            for shape in shapes {
                let fast = run(Isa::detected(), &x, shape, c).unwrap();
                assert_eq!(fast, run(Isa::Scalar, &x, shape, c).unwrap(), "{c:?}");
                // 4 bytes an element: 8 Mi elements and more stream their values too.
                assert_eq!(
                    values::<f32>(Isa::detected(), &fast, shape, c, n),
                    values::<f32>(Isa::Scalar, &fast, shape, c, n),
                    "{c:?}"
                );
            }
        }
    });
}

#[test]
fn the_reported_non_finite_index_does_not_depend_on_the_thread_count() {
    let n = 1 << 20;
    let mut x: Vec<f32> = adversarial_f64(n, 7).iter().map(|&v| v as f32).collect();
    x[900_001] = f32::INFINITY;
    x[600_000] = f32::NAN;
    for c in every_config() {
        let errs = with_threads(&[1, 2, 3, 7], |_| {
            run(Isa::detected(), &x, &[1024, 1024], c).unwrap_err()
        });
        for e in errs {
            assert_eq!(
                e,
                QuantError::NonFinite {
                    arg: "x",
                    index: 600_000
                }
            );
        }
    }
}

/// The range primitives with NaN and infinities among the values: the flag on
/// every tier, and the min and max of the other values as the scalar's `<`
/// and `>` find them (a NaN is skipped, wherever it falls in a vector).
#[test]
fn ranges_skip_nan_as_the_scalar_does() {
    for isa in Isa::supported() {
        for n in (1..70).chain([127, 1000]) {
            for (pos, bad) in [
                (0usize, f64::NAN),
                (n / 2, f64::NAN),
                (n - 1, f64::NAN),
                (n / 3, f64::INFINITY),
            ] {
                let mut x = adversarial_f64(n, 5 + n as u64);
                x[pos] = bad;
                let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
                let (a, b) = (simd::range_f32(isa, &xf), simd::range_f32(Isa::Scalar, &xf));
                assert!(a.non_finite && b.non_finite, "{isa:?} n {n}");
                assert_eq!(
                    (a.min, a.max),
                    (b.min, b.max),
                    "f32 {isa:?} n {n} pos {pos}"
                );
                let (a, b) = (simd::range_f64(isa, &x), simd::range_f64(Isa::Scalar, &x));
                assert!(a.non_finite && b.non_finite, "{isa:?} n {n}");
                assert_eq!(
                    (a.min, a.max),
                    (b.min, b.max),
                    "f64 {isa:?} n {n} pos {pos}"
                );
            }
        }
    }
}

#[test]
fn zero_extremes_keep_the_first_zeros_sign_on_every_isa() {
    // Equal extremes are equal bits except ±0: the scalar loop keeps the
    // first zero, so must every ISA (an adversarial review found AVX2's lane
    // merge returning -0.0 for [0.0; 4] ++ [-0.0; 4]).
    let bits = |r: simd::Range<f32>| (r.min.to_bits(), r.max.to_bits());
    let bits64 = |r: simd::Range<f64>| (r.min.to_bits(), r.max.to_bits());
    for isa in Isa::supported() {
        for n in [1usize, 2, 7, 8, 9, 16, 17, 33, 64, 100, 257] {
            for first in [0, 1.min(n - 1), n / 2, n - 1] {
                for (first_sign, fill) in [(0.0f32, -0.0f32), (-0.0, 0.0)] {
                    for other in [0.0f32, 1.5, -1.5] {
                        // Zeros of one sign from `first` on, the other sign's
                        // zero first, the rest `other` (so a zero is the min,
                        // the max or both).
                        let mut x = vec![other; n];
                        for v in x[first..].iter_mut().step_by(2) {
                            *v = fill;
                        }
                        x[first] = first_sign;
                        let want = bits(simd::range_f32(Isa::Scalar, &x));
                        assert_eq!(bits(simd::range_f32(isa, &x)), want, "{isa:?} {x:?}");
                        let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
                        let want = bits64(simd::range_f64(Isa::Scalar, &x64));
                        assert_eq!(bits64(simd::range_f64(isa, &x64)), want, "{isa:?} {x64:?}");
                    }
                }
            }
        }
    }
    assert_eq!(
        bits(simd::range_f32(Isa::Scalar, &[1.0, 0.0, -0.0])),
        (0.0f32.to_bits(), 1.0f32.to_bits())
    );
}

/// The fused per-channel step: a row's codes (int8, cached and streamed at
/// several offsets, or packed int4) with the next row's range read beside
/// them. Rows and next rows of unequal lengths (either may be empty or end
/// in a tail), next rows holding NaN or an infinity, signed-zero extremes,
/// the magnitude form and the full range: every tier gives the scalar codes
/// and `row_range` of the next row, bit for bit.
#[test]
fn codes_fused_with_the_next_rows_range_match_scalar() {
    let a = Affine {
        inv: 1.0 / 0.0371,
        zp: -3.0,
        qmin: -128.0,
        qmax: 127.0,
        max_abs: f64::INFINITY,
    };
    let a4 = Affine {
        inv: 1.0 / 0.61,
        zp: 1.0,
        qmin: -8.0,
        qmax: 7.0,
        max_abs: f64::INFINITY,
    };
    let x: Vec<f32> = adversarial_f64(300, 11).iter().map(|&v| v as f32).collect();
    let mut next: Vec<f32> = adversarial_f64(300, 13).iter().map(|&v| v as f32).collect();
    let ahead: Vec<f32> = adversarial_f64(300, 17).iter().map(|&v| v as f32).collect();
    let bits = |r: simd::Range<f32>| (r.min.to_bits(), r.max.to_bits(), r.non_finite);
    for isa in Isa::supported() {
        for n in [0usize, 1, 15, 63, 64, 65, 128, 200, 256, 300] {
            for m in [0usize, 1, 63, 64, 65, 130, 256, 300] {
                for poison in [None, Some(f32::NAN), Some(f32::NEG_INFINITY), Some(0.0)] {
                    let saved = next[..m].to_vec();
                    match poison {
                        Some(0.0) => {
                            // Zeros of both signs as the only values: the
                            // extremes are zeros, the first one's sign kept.
                            for (i, v) in next[..m].iter_mut().enumerate() {
                                *v = if i % 3 == 1 { -0.0 } else { 0.0 };
                            }
                        }
                        Some(p) if m > 0 => next[m / 2] = p,
                        _ => {}
                    }
                    let ns = &next[..m];
                    let mut want = vec![0i8; n];
                    simd::affine_quantize_f32(Isa::Scalar, &x[..n], a, &mut want, Store::Cached);
                    let mut want4 = vec![0u8; n / 2];
                    simd::affine_quantize_int4_f32(Isa::Scalar, &x[..n / 2 * 2], a4, &mut want4);
                    for magnitude in [false, true] {
                        let want_r = bits(simd::row_range(Isa::Scalar, ns, magnitude));
                        for (off, st) in [
                            (0, Store::Cached),
                            (3, Store::Streaming),
                            (64, Store::Streaming),
                        ] {
                            for ah in [&[][..], &ahead[..m]] {
                                let mut buf = vec![0x55i8; off + n + 64];
                                let out = &mut buf[off..off + n];
                                let r = simd::affine_quantize_f32_then_range(
                                    isa,
                                    &x[..n],
                                    a,
                                    out,
                                    st,
                                    ns,
                                    ah,
                                    magnitude,
                                );
                                let what = format!("{isa:?} n {n} m {m} {poison:?} {magnitude}");
                                assert_eq!(&buf[off..off + n], &want[..], "{what} off {off}");
                                assert!(buf[..off]
                                    .iter()
                                    .chain(&buf[off + n..])
                                    .all(|&b| b == 0x55));
                                assert_eq!(bits(r), want_r, "{what}");
                            }
                        }
                        let mut packed = vec![0xaau8; n / 2 + 8];
                        let r = simd::affine_quantize_int4_f32_then_range(
                            isa,
                            &x[..n / 2 * 2],
                            a4,
                            &mut packed[..n / 2],
                            ns,
                            &ahead,
                            magnitude,
                        );
                        let what = format!("int4 {isa:?} n {n} m {m} {poison:?} {magnitude}");
                        assert_eq!(&packed[..n / 2], &want4[..], "{what}");
                        assert!(packed[n / 2..].iter().all(|&b| b == 0xaa), "{what}");
                        assert_eq!(bits(r), want_r, "{what}");
                    }
                    next[..m].copy_from_slice(&saved);
                }
            }
        }
        // The next row's extremes at every position, beside a row long
        // enough to pair every step of it.
        for m in [65usize, 130, 257] {
            for at in 0..m {
                let mut nx = next[..m].to_vec();
                nx[at] = -3.0e30;
                nx[(at + m / 2) % m] = 2.5e30;
                let mut out = vec![0i8; 300];
                for magnitude in [false, true] {
                    let r = simd::affine_quantize_f32_then_range(
                        isa,
                        &x,
                        a,
                        &mut out,
                        Store::Cached,
                        &nx,
                        &[],
                        magnitude,
                    );
                    let want = if magnitude {
                        (-3.0e30, 3.0e30)
                    } else {
                        (-3.0e30, 2.5e30)
                    };
                    assert_eq!((r.min, r.max), want, "{isa:?} m {m} at {at} {magnitude}");
                }
            }
        }
    }
}

/// Rows coded one after another into one `RowsOut`, as the per-channel
/// driver does: streamed rows share one fence at the end of the scope. Rows
/// with and without tails, the output at every offset in a line, both range
/// forms: every tier gives the scalar codes and next-row ranges.
#[test]
fn rows_coded_in_one_scope_match_scalar() {
    let a = Affine {
        inv: 1.0 / 0.0371,
        zp: -3.0,
        qmin: -128.0,
        qmax: 127.0,
        max_abs: f64::INFINITY,
    };
    let bits = |r: simd::Range<f32>| (r.min.to_bits(), r.max.to_bits(), r.non_finite);
    for isa in Isa::supported() {
        for len in [64usize, 100, 257, 1000] {
            let rows = 5;
            let x: Vec<f32> = adversarial_f64((rows + 1) * len, len as u64)
                .iter()
                .map(|&v| v as f32)
                .collect();
            let row = |r: usize| &x[r * len..(r + 1) * len];
            let mut want = vec![0i8; rows * len];
            for r in 0..rows {
                let cs = &mut want[r * len..(r + 1) * len];
                simd::affine_quantize_f32(Isa::Scalar, row(r), a, cs, Store::Cached);
            }
            for magnitude in [false, true] {
                let want_r: Vec<_> = (1..=rows)
                    .map(|r| bits(simd::row_range(Isa::Scalar, row(r), magnitude)))
                    .collect();
                for off in [0usize, 3, 40] {
                    for st in [Store::Cached, Store::Streaming] {
                        let mut buf = vec![0x55i8; off + rows * len + 64];
                        let out = &mut buf[off..off + rows * len];
                        let got_r: Vec<_> = simd::rows_out(out, st, |o| {
                            (0..rows)
                                .map(|r| {
                                    let ahead = &x[((r + 2) * len).min(x.len())..];
                                    let (at, next) = (r * len, row(r + 1));
                                    let f = o.affine_quantize_f32_then_range(
                                        isa,
                                        at,
                                        row(r),
                                        a,
                                        next,
                                        ahead,
                                        magnitude,
                                    );
                                    bits(f)
                                })
                                .collect()
                        });
                        let what = format!("{isa:?} len {len} off {off} {st:?} {magnitude}");
                        assert_eq!(&buf[off..off + rows * len], &want[..], "{what}");
                        assert!(buf[..off]
                            .iter()
                            .chain(&buf[off + rows * len..])
                            .all(|&b| b == 0x55));
                        assert_eq!(got_r, want_r, "{what}");
                    }
                }
            }
        }
    }
}

/// Per-channel rows long enough for the fused loop's steps (64 values) and
/// its tails, in every dtype the driver reads as f32 or stages: every tier
/// equals scalar, and a NaN in any row reports the same first index.
#[test]
fn long_per_channel_rows_match_scalar() {
    for cols in [64usize, 127, 128, 200, 1000] {
        let rows = 5;
        let x = adversarial_f64(rows * cols, cols as u64);
        let xf: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        check_all_isas(&xf, &[rows, cols]);
        for bad in [0, cols - 1, 2 * cols + cols / 2, rows * cols - 1] {
            let mut y = xf.clone();
            y[bad] = f32::NAN;
            y[(bad + cols + 3) % (rows * cols)] = f32::INFINITY;
            let first = bad.min((bad + cols + 3) % (rows * cols));
            for c in every_config() {
                for isa in Isa::supported() {
                    let e = run(isa, &y, &[rows, cols], c).expect_err("non-finite input");
                    assert!(
                        matches!(e, QuantError::NonFinite { index, .. } if index == first),
                        "{isa:?} {c:?} cols {cols} bad {bad}: {e:?}"
                    );
                }
            }
        }
    }
}
