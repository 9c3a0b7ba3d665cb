//! Blockwise 8-bit (SPEC §1): every SIMD path equals the scalar path bit for
//! bit, at lengths that are not multiples of any vector width, with
//! adversarial values: exact rounding ties, the float just below a tie,
//! subnormals, signed zeros, and blocks whose scale underflows.

use ferroquant::element::Float;
use ferroquant::ops::blockwise::{
    dequantize_blockwise_with, num_blocks, quantize_blockwise_with, BlockwiseReport, Scales,
    ScalesMut,
};
use ferroquant::simd::{self, Isa, Store};
use ferroquant::QuantError;
use half::{bf16, f16};
use proptest::prelude::*;

use crate::rng::Rng;

/// Values that stress rounding: ties and near-ties of a power-of-two scale,
/// subnormals, signed zeros, ordinary noise.
pub fn adversarial(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|i| match r.next() % 8 {
            0 => (r.next() % 255) as f32 - 127.0 + 0.5, // exact .5 ties when scale is 1
            1 => {
                f32::from_bits(0.5f32.to_bits() - 1) * if i.is_multiple_of(2) { 1.0 } else { -1.0 }
            }
            2 => f32::from_bits((r.next() % 0x007f_ffff) as u32 + 1), // subnormal
            3 => -0.0,
            4 => {
                127.0
                    * if r.next().is_multiple_of(2) {
                        1.0
                    } else {
                        -1.0
                    }
            } // pins scale to 1
            _ => (r.unit() - 0.5) * 200.0,
        })
        .collect()
}

fn quantize(isa: Isa, x: &[f32], bs: usize) -> (Vec<i8>, Vec<f16>, BlockwiseReport) {
    let mut c = vec![0i8; x.len()];
    let mut s = vec![f16::ZERO; num_blocks(x.len(), bs)];
    let r = quantize_blockwise_with(isa, x, bs, &mut c, ScalesMut::F16(&mut s)).unwrap();
    (c, s, r)
}

#[test]
fn blockwise_quantize_matches_scalar_on_every_isa() {
    let blocks = [
        1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 4096,
    ];
    for isa in Isa::supported() {
        for &bs in &blocks {
            for n in (0..200).chain([1000, 4099, 70_001]) {
                let x = adversarial(n, (n * 131 + bs) as u64);
                assert_eq!(
                    quantize(isa, &x, bs),
                    quantize(Isa::Scalar, &x, bs),
                    "isa {isa:?} n {n} block {bs}"
                );
            }
        }
    }
}

/// Blocks of 64 run sixteen at a time on AVX-512, blocks of 32, 64 and 128
/// eight at a time on AVX2 (and 32 so on AVX-512): whole batches of blocks of
/// every kind (all zero, all -0.0, a max whose scale underflows to 0, scales
/// that are subnormal, a max of f32::MAX, near ties, ordinary), at every
/// block position of a batch, then a tail of blocks; a non-finite value at
/// every place in a stretch of batches; f16 and f32 scales. Every tier gives
/// the scalar loop's codes, scales and error.
#[test]
fn batches_of_blocks_match_scalar() {
    let kinds = |bs: usize, k: usize, seed: u64| -> Vec<f32> {
        let mut b = adversarial(bs, seed);
        let at = (seed % bs as u64) as usize;
        match k % 8 {
            0 => b.fill(0.0),
            1 => b.fill(-0.0),
            2 => {
                b.fill(0.0);
                b[at] = f32::from_bits(1); // scale 1.4e-45 / 127 == 0
            }
            3 => b.iter_mut().for_each(|v| *v *= 1e-40), // subnormal scale
            4 => b[at] = f32::MAX,                       // the largest scale
            5 => {
                // Exact ties at scale 1 (max 127), and one ulp either side.
                for (i, v) in b.iter_mut().enumerate() {
                    let t = ((i % 64) as f32 - 32.0) + 0.5;
                    *v = f32::from_bits((t.to_bits() as i64 + (i % 3) as i64 - 1) as u32);
                }
                b[0] = 127.0;
            }
            _ => {}
        }
        b
    };
    for bs in [32usize, 64, 128] {
        for isa in Isa::supported() {
            for rot in 0..8 {
                // 3 batches of 16 and 5 blocks: block j's kind is (j + rot) % 8.
                let x: Vec<f32> = (0..16 * 3 + 5)
                    .flat_map(|j| kinds(bs, j + rot, (j * 31 + rot) as u64))
                    .collect();
                // f16 scales: the f32::MAX block overflows float16, an error on every tier.
                let f16_run = |isa: Isa| {
                    let mut c = vec![0i8; x.len()];
                    let mut s = vec![f16::ZERO; x.len() / bs];
                    let r = quantize_blockwise_with(isa, &x, bs, &mut c, ScalesMut::F16(&mut s));
                    (r.is_ok().then_some((c, s)), format!("{r:?}"))
                };
                assert_eq!(
                    f16_run(isa),
                    f16_run(Isa::Scalar),
                    "{isa:?} bs {bs} rot {rot}"
                );
                let f32_run = |isa: Isa| {
                    let mut c = vec![0i8; x.len()];
                    let mut s = vec![0f32; x.len() / bs];
                    quantize_blockwise_with(isa, &x, bs, &mut c, ScalesMut::F32(&mut s)).unwrap();
                    (c, s.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
                };
                assert_eq!(
                    f32_run(isa),
                    f32_run(Isa::Scalar),
                    "f32 {isa:?} bs {bs} {rot}"
                );
            }
            let x = adversarial(bs * 40 + 512, 11);
            let (from, to) = (16 * bs, 32 * bs);
            for at in (from..to).step_by(61).chain([from, to - 1]) {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut y = x.clone();
                    y[at] = bad;
                    y[at + 300] = f32::NAN; // a later one, in the same or a later batch
                    let mut c = vec![0i8; y.len()];
                    let mut s = vec![f16::ZERO; y.len() / bs];
                    let e = quantize_blockwise_with(isa, &y, bs, &mut c, ScalesMut::F16(&mut s));
                    assert!(
                        matches!(e, Err(QuantError::NonFinite { index, .. }) if index == at),
                        "{isa:?} bs {bs} at {at}: {e:?}"
                    );
                }
            }
        }
    }
}

/// Batched blocks (32, 64, 128) under other rules than §1's (per row and
/// per token reach the batched loop at those column counts): a divisor of 1, where a block of max
/// `f32::MAX` has a subnormal reciprocal (which the batches do not multiply
/// by), near ties of such blocks, a zero scale other than 1, a subnormal
/// divisor whose scales overflow, and a clip past i32's range (codes
/// saturate to 127 and -128 as `as i8` does). Every position of a batch,
/// every tier.
#[test]
fn batched_blocks_under_other_rules_match_scalar() {
    let rules = [
        (1.0f32, 1.0f32, 1.0f32),
        (7.0, 0.5, 7.0),
        (127.0, 1.0, 127.0),
        (3.0e-39, 1.0, 127.0), // a subnormal divisor: scales overflow to inf
        (1.0e30, 1.0, 1.0e10), // codes far past i32, clamped to a clip past it
    ];
    for ((divisor, zero_scale, clip), bs) in
        rules.into_iter().flat_map(|r| [(r, 32), (r, 64), (r, 128)])
    {
        let rule = simd::AbsmaxRule {
            divisor,
            zero_scale,
            clip,
        };
        for at in 0..16 {
            let mut x = adversarial(bs * 40, 5 + at as u64);
            for (b, block) in x.chunks_mut(bs).enumerate() {
                match (b + at) % 5 {
                    0 => {
                        // Near ties of a block of max f32::MAX: (k + 1/2)·s and a
                        // few ulps either side (where the reciprocal is subnormal,
                        // only division codes them right).
                        if divisor >= 1.0 {
                            let (c, s) = (clip as i64, f32::MAX / divisor);
                            for (i, v) in block.iter_mut().enumerate() {
                                let k = (i as i64 % (2 * c)) - c;
                                let t = (k as f32 + 0.5) * s;
                                *v = f32::from_bits(
                                    (t.to_bits() as i64 + (i as i64 % 5) - 2) as u32,
                                );
                            }
                        }
                        block[(b * 7) % bs] = f32::MAX;
                    }
                    1 => block[(b * 3) % bs] = -f32::MAX * 0.75,
                    2 => block.fill(0.0),
                    3 => block.iter_mut().for_each(|v| *v *= 1e-41),
                    _ => {}
                }
            }
            let run = |isa: Isa| {
                let mut c = vec![0i8; x.len()];
                let mut s = vec![0f32; x.len() / bs];
                let r = simd::absmax_blocks(isa, &x, bs, rule, &mut c, &mut s, Store::Cached);
                (r, c, s.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
            };
            let want = run(Isa::Scalar);
            for isa in Isa::supported() {
                assert!(run(isa) == want, "{isa:?} bs {bs} rule {divisor} at {at}");
            }
        }
    }
}

/// Streamed blocks of 64 (the batches assemble whole lines from neighbouring
/// blocks' codes): codes at every byte offset within a line, lengths of whole
/// batches and with tails, a non-finite value in the third batch; every tier
/// writes the scalar loop's codes and scales and no byte around them.
#[test]
fn streamed_batches_of_blocks_match_scalar_at_every_offset() {
    let rule = simd::AbsmaxRule {
        divisor: 127.0,
        zero_scale: 1.0,
        clip: 127.0,
    };
    let x = adversarial(64 * 16 * 4 + 64 * 5, 21);
    for isa in Isa::supported() {
        for n in [1024usize, 2048 + 64, x.len()] {
            let mut want = vec![0i8; n];
            let mut want_s = vec![0f32; n / 64];
            let r0 = simd::absmax_blocks(
                Isa::Scalar,
                &x[..n],
                64,
                rule,
                &mut want,
                &mut want_s,
                Store::Cached,
            );
            for off in 0..64 {
                let mut buf = vec![0x55i8; off + n + 64];
                let mut s = vec![0f32; n / 64];
                let out = &mut buf[off..off + n];
                let r = simd::absmax_blocks(isa, &x[..n], 64, rule, out, &mut s, Store::Streaming);
                assert_eq!(r, r0, "{isa:?} n {n} off {off}");
                assert_eq!(&buf[off..off + n], &want[..], "{isa:?} n {n} off {off}");
                assert_eq!(s, want_s, "{isa:?} n {n} off {off}");
                assert!(buf[..off].iter().chain(&buf[off + n..]).all(|&b| b == 0x55));
            }
        }
        let mut y = x.clone();
        y[2048 + 100] = f32::NAN;
        for off in [0usize, 16, 5] {
            let mut buf = vec![0x55i8; off + y.len() + 64];
            let mut s = vec![0f32; y.len() / 64];
            let out = &mut buf[off..off + y.len()];
            let r = simd::absmax_blocks(isa, &y, 64, rule, out, &mut s, Store::Streaming);
            assert_eq!(r, Err(2048 + 100), "{isa:?} off {off}");
            // The batches before the bad one are coded as the scalar loop codes them.
            assert_eq!(
                &buf[off..off + 2048],
                &want_prefix(&y, rule)[..],
                "{isa:?} off {off}"
            );
            assert!(buf[..off].iter().all(|&b| b == 0x55));
        }
    }
}

/// The scalar codes of the first two batches (2048 values) of `y`.
fn want_prefix(y: &[f32], rule: simd::AbsmaxRule) -> Vec<i8> {
    let mut c = vec![0i8; 2048];
    let mut s = vec![0f32; 32];
    let r = simd::absmax_blocks(
        Isa::Scalar,
        &y[..2048],
        64,
        rule,
        &mut c,
        &mut s,
        Store::Cached,
    );
    assert_eq!(r, Ok(()));
    c
}

#[test]
fn tails_of_every_length_match_scalar() {
    // Block 64 with a tail of 1..63, and primitives over lengths 0..70.
    for isa in Isa::supported() {
        for tail in 1..64 {
            let x = adversarial(64 * 3 + tail, tail as u64);
            assert_eq!(quantize(isa, &x, 64), quantize(Isa::Scalar, &x, 64));
        }
        for n in 0..70 {
            let x = adversarial(n, 7 + n as u64);
            assert_eq!(
                simd::absmax_bits(isa, &x),
                simd::absmax_bits(Isa::Scalar, &x)
            );
            for scale in [1.0f32, 0.37, 3.0e-3, 1.1e-40] {
                for clip in [127.0f32, 7.0, 1.0] {
                    let mut a = vec![0i8; n];
                    let mut b = vec![0i8; n];
                    simd::quantize_scaled(isa, &x, scale, clip, &mut a, Store::Cached);
                    simd::quantize_scaled(Isa::Scalar, &x, scale, clip, &mut b, Store::Cached);
                    assert_eq!(a, b, "isa {isa:?} n {n} scale {scale} clip {clip}");
                    // Streaming stores from every start offset give the same codes.
                    for off in [1usize, 7, 15] {
                        if off > n {
                            continue;
                        }
                        let mut c = vec![0x55i8; n];
                        let s = Store::Streaming;
                        simd::quantize_scaled(isa, &x[off..], scale, clip, &mut c[off..], s);
                        let mut d = vec![0i8; n - off];
                        simd::quantize_scaled(
                            Isa::Scalar,
                            &x[off..],
                            scale,
                            clip,
                            &mut d,
                            Store::Cached,
                        );
                        assert_eq!(&c[off..], &d[..], "streaming {isa:?} n {n} off {off}");
                        assert!(c[..off].iter().all(|&v| v == 0x55));
                    }
                }
            }
        }
    }
}

/// Values whose quotient by `scale` lands on, or within a few ulps of, a
/// half-integer (where a reciprocal multiply could round the other way),
/// exact integers, and quotients far beyond any clip; each 64-element chunk
/// of one kind, so chunks without near-ties take the shortcut.
fn near_ties(n: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|i| {
            let k = (r.next() % 300) as f32 - 150.0;
            let ordinary = (r.unit() - 0.5) * 300.0 * scale;
            let v = match (i / 64 + seed as usize) % 4 {
                0 => {
                    let t = (k + 0.5) * scale;
                    let d = (r.next() % 7) as i64 - 3;
                    f32::from_bits((t.to_bits() as i64 + d).max(0) as u32)
                }
                1 => k * scale,
                2 if r.next().is_multiple_of(4) => (r.unit() - 0.5) * 1e30,
                _ => ordinary,
            };
            if v.is_finite() {
                v
            } else {
                0.0
            }
        })
        .collect()
}

#[test]
fn reciprocal_shortcut_matches_division() {
    // The AVX-512 path multiplies by 1/scale and redoes near-tie chunks with
    // the division: every chunk kind, scales with a subnormal or infinite
    // reciprocal (no shortcut), clips that are not integers or exceed i8.
    let scales = [
        1.0f32,
        0.37,
        3.0e-3,
        1.0 / 127.0,
        0.1,
        7.3e5,
        1.2e-38,
        1.0e-39,
        3.0e38,
        2.9e-39,
    ];
    for isa in Isa::supported() {
        for (i, &scale) in scales.iter().enumerate() {
            for clip in [127.0f32, 7.0, 1.0, 7.5, 127.9, 200.0, 0.0] {
                for n in [64usize, 65, 127, 128, 200, 1000, 4096 + 37] {
                    let x = near_ties(n, scale, (i * 1000 + n) as u64);
                    let mut a = vec![0i8; n];
                    let mut b = vec![0i8; n];
                    simd::quantize_scaled(Isa::Scalar, &x, scale, clip, &mut b, Store::Cached);
                    simd::quantize_scaled(isa, &x, scale, clip, &mut a, Store::Cached);
                    assert_eq!(a, b, "isa {isa:?} scale {scale} clip {clip} n {n}");
                    let ahead = near_ties(n, 1.0, 9);
                    let mut c = vec![0i8; n];
                    simd::quantize_scaled_ahead(
                        isa,
                        &x,
                        scale,
                        clip,
                        &mut c,
                        Store::Cached,
                        &ahead,
                    );
                    assert_eq!(c, b, "ahead: isa {isa:?} scale {scale} clip {clip} n {n}");
                    for off in [1usize, 17, 63] {
                        let mut d = vec![0x55i8; n];
                        let st = Store::Streaming;
                        simd::quantize_scaled(isa, &x[off..], scale, clip, &mut d[off..], st);
                        let mut e = vec![0i8; n - off];
                        simd::quantize_scaled(
                            Isa::Scalar,
                            &x[off..],
                            scale,
                            clip,
                            &mut e,
                            Store::Cached,
                        );
                        assert_eq!(
                            &d[off..],
                            &e[..],
                            "streaming {isa:?} off {off} scale {scale}"
                        );
                        assert!(d[..off].iter().all(|&v| v == 0x55));
                    }
                }
            }
        }
    }
}

#[test]
fn streaming_codes_match_scalar_at_every_line_offset() {
    // Streaming stores start at the output's first 64-byte boundary: every
    // offset within a line, every length around the 32-value chunk, with
    // and without a prefetched run ahead; bytes around the output untouched.
    // Runs long enough that every tier streams them (AVX2 declines the hint
    // below 16 Ki values) as well as short ones.
    let x = near_ties(20_000, 0.37, 5);
    let ahead = near_ties(300, 1.0, 9);
    for isa in Isa::supported() {
        for n in [
            0usize, 1, 8, 31, 32, 33, 63, 64, 65, 100, 130, 200, 300, 16_384, 16_417, 20_000,
        ] {
            let mut want = vec![0i8; n];
            simd::quantize_scaled(Isa::Scalar, &x[..n], 0.37, 127.0, &mut want, Store::Cached);
            for off in 0..64 {
                for ahead in [&[][..], &ahead[..]] {
                    let mut buf = vec![0x55i8; off + n + 64];
                    let out = &mut buf[off..off + n];
                    let st = Store::Streaming;
                    simd::quantize_scaled_ahead(isa, &x[..n], 0.37, 127.0, out, st, ahead);
                    assert_eq!(&buf[off..off + n], &want[..], "{isa:?} n {n} offset {off}");
                    assert!(buf[..off].iter().chain(&buf[off + n..]).all(|&b| b == 0x55));
                }
            }
        }
    }
}

#[test]
fn fused_codes_and_next_max_match_scalar() {
    // A row's codes with the next row's max read beside them: rows and next
    // rows of unequal lengths (either may be empty or have a tail), next
    // rows holding NaN or infinity, cached and streamed at every line offset.
    let x = near_ties(300, 0.37, 5);
    let mut next = adversarial(300, 3);
    let ahead = near_ties(300, 1.0, 9);
    for isa in Isa::supported() {
        for n in [0usize, 1, 31, 32, 33, 64, 100, 257] {
            for m in [0usize, 1, 31, 32, 33, 64, 100, 257] {
                for poison in [None, Some(f32::NAN), Some(f32::NEG_INFINITY)] {
                    let saved = next[m / 2];
                    if let (Some(p), true) = (poison, m > 0) {
                        next[m / 2] = p;
                    }
                    let mut want = vec![0i8; n];
                    simd::quantize_scaled(
                        Isa::Scalar,
                        &x[..n],
                        0.37,
                        127.0,
                        &mut want,
                        Store::Cached,
                    );
                    let want_m = simd::absmax_bits(Isa::Scalar, &next[..m]);
                    for (off, st) in [
                        (0, Store::Cached),
                        (5, Store::Streaming),
                        (40, Store::Streaming),
                    ] {
                        for a in [&[][..], &ahead[..m.min(ahead.len())]] {
                            let mut buf = vec![0x55i8; off + n + 64];
                            let got_m = simd::quantize_scaled_then_absmax(
                                isa,
                                &x[..n],
                                0.37,
                                127.0,
                                &mut buf[off..off + n],
                                st,
                                &next[..m],
                                a,
                            );
                            assert_eq!(
                                &buf[off..off + n],
                                &want[..],
                                "{isa:?} n {n} m {m} off {off}"
                            );
                            assert!(buf[..off].iter().chain(&buf[off + n..]).all(|&b| b == 0x55));
                            assert_eq!(got_m, want_m, "{isa:?} n {n} m {m} {poison:?}");
                        }
                    }
                    next[m / 2] = saved;
                }
            }
        }
        // Rows at every 4-byte offset of a 32-byte boundary against codes at
        // every byte offset: some pairs leave the codes aligned after the
        // rows' head, and those stream.
        for xo in 0..8 {
            for oo in 0..32 {
                let (xs, ns) = (&x[xo..xo + 200], &next[xo..xo + 150]);
                let mut want = vec![0i8; 200];
                simd::quantize_scaled(Isa::Scalar, xs, 0.37, 127.0, &mut want, Store::Cached);
                let mut buf = vec![0x55i8; oo + 200 + 64];
                let st = Store::Streaming;
                let out = &mut buf[oo..oo + 200];
                let m =
                    simd::quantize_scaled_then_absmax(isa, xs, 0.37, 127.0, out, st, ns, &ahead);
                assert_eq!(
                    &buf[oo..oo + 200],
                    &want[..],
                    "{isa:?} rows +{xo} codes +{oo}"
                );
                assert!(buf[..oo].iter().chain(&buf[oo + 200..]).all(|&b| b == 0x55));
                assert_eq!(m, simd::absmax_bits(Isa::Scalar, ns), "{isa:?} +{xo} +{oo}");
            }
        }
        // The next row's max at every position, beside a row long enough to
        // pair every chunk of it.
        for m in [33usize, 100, 257] {
            for at in 0..m {
                let mut nx = next[..m].to_vec();
                nx[at] = -3.0e30;
                let mut out = vec![0i8; 300];
                let st = Store::Cached;
                let got =
                    simd::quantize_scaled_then_absmax(isa, &x, 0.37, 127.0, &mut out, st, &nx, &[]);
                assert_eq!(got, (3.0e30f32).to_bits(), "{isa:?} m {m} at {at}");
            }
        }
    }
}

/// Rows coded one after another into one `RowsOut`, as the per-row driver
/// does: streamed rows share one fence at the end of the scope. Rows of
/// lengths with and without tails, the output at every offset in a line
/// (so heads differ from row to row), zero-filled rows between them, a row
/// past the end: every tier gives the scalar codes, maxima and bytes.
#[test]
fn rows_coded_in_one_scope_match_scalar() {
    for isa in Isa::supported() {
        for len in [64usize, 100, 257, 1000] {
            let rows = 6;
            let x = near_ties(rows * len + len, 0.37, len as u64);
            let row = |r: usize| &x[r * len..(r + 1) * len];
            let mut want = vec![0i8; rows * len];
            let mut want_m = Vec::new();
            for r in 0..rows {
                let cs = &mut want[r * len..(r + 1) * len];
                if r == 2 {
                    cs.fill(0);
                } else {
                    simd::quantize_scaled(Isa::Scalar, row(r), 0.37, 127.0, cs, Store::Cached);
                }
                want_m.push(simd::absmax_bits(Isa::Scalar, row(r + 1)));
            }
            for off in [0usize, 1, 17, 63] {
                for st in [Store::Cached, Store::Streaming] {
                    let mut buf = vec![0x55i8; off + rows * len + 64];
                    let out = &mut buf[off..off + rows * len];
                    let got_m = simd::rows_out(out, st, |o| {
                        assert_eq!(o.len(), rows * len);
                        let mut ms = Vec::new();
                        for r in 0..rows {
                            let (next, ahead) = (row(r + 1), &x[((r + 2) * len).min(x.len())..]);
                            if r == 2 {
                                o.fill(r * len, len, 0);
                                ms.push(simd::absmax_bits(isa, next));
                            } else {
                                let at = r * len;
                                let m = o.quantize_scaled_then_absmax(
                                    isa,
                                    at,
                                    row(r),
                                    0.37,
                                    127.0,
                                    next,
                                    ahead,
                                );
                                ms.push(m);
                            }
                        }
                        // Past the end: nothing written, the next max still read.
                        let m = o.quantize_scaled_then_absmax(
                            isa,
                            rows * len + 5,
                            row(0),
                            0.37,
                            127.0,
                            row(1),
                            &[],
                        );
                        assert_eq!(m, want_m[0]);
                        o.fill(rows * len - 1, 10, 0x7f);
                        ms
                    });
                    let last = std::mem::replace(&mut want[rows * len - 1], 0x7f);
                    let what = format!("{isa:?} len {len} off {off} {st:?}");
                    assert_eq!(&buf[off..off + rows * len], &want[..], "{what}");
                    assert!(buf[..off]
                        .iter()
                        .chain(&buf[off + rows * len..])
                        .all(|&b| b == 0x55));
                    assert_eq!(got_m, want_m, "{what}");
                    want[rows * len - 1] = last;
                }
            }
        }
    }
}

/// Rows long enough for several of the tiers' blocks of steps (AVX2 codes
/// 256 steps of 32 values, then redoes the flagged ones): near-ties in every
/// block and across their boundaries, scales the reciprocal form does not
/// hold for (every step redone), fused with the next row's max and alone,
/// cached and streamed.
#[test]
fn absmax_with_a_prefetch_matches_scalar() {
    // absmax_bits_ahead reads x as absmax_bits does and only prefetches
    // `ahead` (any length, empty included): the bits, NaN and infinities too.
    let mut x = adversarial(300, 11);
    let ahead = near_ties(300, 1.0, 2);
    for isa in Isa::supported() {
        for n in [0usize, 1, 15, 16, 31, 32, 33, 63, 64, 65, 100, 257, 300] {
            for poison in [None, Some(f32::NAN), Some(f32::INFINITY)] {
                let saved = x[n / 2];
                if let (Some(p), true) = (poison, n > 0) {
                    x[n / 2] = p;
                }
                let want = simd::absmax_bits(Isa::Scalar, &x[..n]);
                for a in [0usize, 1, 40, 300] {
                    let got = simd::absmax_bits_ahead(isa, &x[..n], &ahead[..a]);
                    assert_eq!(got, want, "{isa:?} n {n} ahead {a} {poison:?}");
                }
                x[n / 2] = saved;
            }
        }
    }
}

#[test]
fn long_rows_with_near_ties_in_every_block_match_scalar() {
    let n = 3 * 8192 + 100;
    for (k, &scale) in [0.37f32, 1.0e-39, 3.0e38, 1.0 / 127.0].iter().enumerate() {
        let x = near_ties(n, scale, 11 + k as u64);
        let mut next = adversarial(n, 12 + k as u64);
        next[n - 70] = -7.0e29;
        let want_m = simd::absmax_bits(Isa::Scalar, &next);
        for isa in Isa::supported() {
            for len in [8192usize, 8192 + 33, n] {
                let mut want = vec![0i8; len];
                let (xs, st) = (&x[..len], Store::Cached);
                simd::quantize_scaled(Isa::Scalar, xs, scale, 127.0, &mut want, st);
                for (off, st) in [
                    (0, Store::Cached),
                    (0, Store::Streaming),
                    (9, Store::Streaming),
                ] {
                    let mut buf = vec![0x55i8; off + len + 64];
                    let out = &mut buf[off..off + len];
                    simd::quantize_scaled(isa, xs, scale, 127.0, out, st);
                    assert_eq!(
                        &buf[off..off + len],
                        &want[..],
                        "{isa:?} {scale} {len} +{off}"
                    );
                    let mut buf = vec![0x55i8; off + len + 64];
                    let out = &mut buf[off..off + len];
                    let m = simd::quantize_scaled_then_absmax(
                        isa,
                        xs,
                        scale,
                        127.0,
                        out,
                        st,
                        &next,
                        &[],
                    );
                    assert_eq!(
                        &buf[off..off + len],
                        &want[..],
                        "fused {isa:?} {scale} {len}"
                    );
                    assert!(buf[..off]
                        .iter()
                        .chain(&buf[off + len..])
                        .all(|&b| b == 0x55));
                    assert_eq!(m, want_m, "fused max {isa:?} {scale} {len} +{off}");
                }
            }
        }
    }
}

#[test]
fn non_finite_index_is_the_same_on_every_isa() {
    for isa in Isa::supported() {
        for n in [1usize, 15, 16, 17, 64, 1000, 100_000] {
            for pos in [0, n / 2, n - 1] {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut x = adversarial(n, 99);
                    x[pos] = bad;
                    let mut c = vec![0i8; n];
                    let mut s = vec![f16::ZERO; num_blocks(n, 64)];
                    let e = quantize_blockwise_with(isa, &x, 64, &mut c, ScalesMut::F16(&mut s));
                    assert_eq!(
                        e.unwrap_err(),
                        QuantError::NonFinite {
                            arg: "x",
                            index: pos
                        }
                    );
                }
            }
        }
    }
}

#[test]
fn dequantize_matches_scalar_on_every_isa() {
    for isa in Isa::supported() {
        for &bs in &[1usize, 5, 16, 17, 64, 100] {
            for n in (0..150).chain([4097, 100_003]) {
                let mut r = Rng(n as u64 + 3);
                let codes: Vec<i8> = (0..n).map(|_| (r.next() % 255) as i8).collect();
                let s16: Vec<f16> = (0..num_blocks(n, bs))
                    .map(|_| f16::from_f32(r.unit() * 0.1 + 1e-6))
                    .collect();
                let s32: Vec<f32> = s16.iter().map(|h| h.to_f32() * 1.000_1).collect();
                for scales in [Scales::F16(&s16), Scales::F32(&s32)] {
                    let mut a = vec![0f32; n];
                    let mut b = vec![0f32; n];
                    dequantize_blockwise_with(isa, &codes, bs, scales, &mut a).unwrap();
                    dequantize_blockwise_with(Isa::Scalar, &codes, bs, scales, &mut b).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&b), "isa {isa:?} n {n} block {bs}");
                }
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let x = adversarial(1 << 20, 5);
    ferroquant::parallel::set_num_threads(1).unwrap();
    let one = quantize(Isa::detected(), &x, 64);
    ferroquant::parallel::set_num_threads(3).unwrap();
    let three = quantize(Isa::detected(), &x, 64);
    assert_eq!(one, three);
}

#[test]
fn half_and_bf16_inputs_match_on_every_isa() {
    let xf = adversarial(10_007, 11);
    let xh: Vec<f16> = xf.iter().map(|&v| f16::from_f32(v)).collect();
    let xb: Vec<bf16> = xf.iter().map(|&v| bf16::from_f32(v)).collect();
    for isa in Isa::supported() {
        for bs in [64usize, 20_000] {
            let mut c1 = vec![0i8; xf.len()];
            let mut s1 = vec![0f32; num_blocks(xf.len(), bs)];
            let mut c2 = c1.clone();
            let mut s2 = s1.clone();
            quantize_blockwise_with(isa, &xh, bs, &mut c1, ScalesMut::F32(&mut s1)).unwrap();
            quantize_blockwise_with(Isa::Scalar, &xh, bs, &mut c2, ScalesMut::F32(&mut s2))
                .unwrap();
            assert_eq!((&c1, &s1), (&c2, &s2));
            quantize_blockwise_with(isa, &xb, bs, &mut c1, ScalesMut::F32(&mut s1)).unwrap();
            quantize_blockwise_with(Isa::Scalar, &xb, bs, &mut c2, ScalesMut::F32(&mut s2))
                .unwrap();
            assert_eq!((&c1, &s1), (&c2, &s2));
        }
    }
}

proptest! {
    #[test]
    fn random_inputs_match_scalar(
        x in prop::collection::vec(-1.0e6f32..1.0e6, 0..600),
        bs in 1usize..130,
    ) {
        for isa in Isa::supported() {
            let mut c1 = vec![0i8; x.len()];
            let mut s1 = vec![0f32; num_blocks(x.len(), bs)];
            let mut c2 = c1.clone();
            let mut s2 = s1.clone();
            quantize_blockwise_with(isa, &x, bs, &mut c1, ScalesMut::F32(&mut s1)).unwrap();
            quantize_blockwise_with(Isa::Scalar, &x, bs, &mut c2, ScalesMut::F32(&mut s2)).unwrap();
            prop_assert_eq!(&c1, &c2);
            prop_assert_eq!(&s1, &s2);
            // Unclamped codes are within half a step of the value.
            for (b, (xb, cb)) in x.chunks(bs).zip(c1.chunks(bs)).enumerate() {
                for (&v, &q) in xb.iter().zip(cb) {
                    prop_assert!((q as f32 * s1[b] - v).abs() <= s1[b] * 0.5 * 1.0001);
                }
            }
        }
    }
}

#[test]
fn conversions_match_scalar_for_every_half_bit_pattern() {
    let halves: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let brains: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let mut r = Rng(17);
    let doubles: Vec<f64> = (0..10_007)
        .map(|i| match i % 4 {
            0 => f64::from_bits(r.next()),        // anything, NaN and inf included
            1 => (r.unit() as f64 - 0.5) * 1e-40, // f32 subnormal range
            2 => f32::MAX as f64 * (1.0 + 1e-9 * i as f64), // overflow to inf
            _ => (r.unit() as f64 - 0.5) * 1e6 + 1e-9,
        })
        .collect();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let nan_agnostic = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    };
    for isa in Isa::supported() {
        let (mut a, mut b) = (vec![0f32; halves.len()], vec![0f32; halves.len()]);
        for start in [0usize, 1, 5] {
            simd::f16_to_f32(isa, &halves[start..], &mut a[start..]);
            simd::f16_to_f32(Isa::Scalar, &halves[start..], &mut b[start..]);
            assert!(nan_agnostic(&a, &b), "f16 {isa:?}");
            assert_eq!(bits(&a), bits(&b), "f16 NaN bits {isa:?}");
            simd::bf16_to_f32(isa, &brains[start..], &mut a[start..]);
            simd::bf16_to_f32(Isa::Scalar, &brains[start..], &mut b[start..]);
            // Exact widening: every bf16 pattern, signalling NaNs included, is
            // the top half of its f32.
            let widened = brains[start..].iter().map(|h| u32::from(h.to_bits()) << 16);
            assert!(widened.eq(bits(&a[start..])), "bf16 {isa:?}");
            // The per-element widening the kernels' scalar loops use, likewise.
            let one = brains[start..].iter().map(|&h| Float::to_f32(h).to_bits());
            assert!(one.eq(bits(&a[start..])), "bf16 Float::to_f32");
            assert_eq!(bits(&a), bits(&b), "bf16 {isa:?}");
        }
        let (mut a, mut b) = (vec![0f32; doubles.len()], vec![0f32; doubles.len()]);
        simd::f64_to_f32(isa, &doubles, &mut a);
        simd::f64_to_f32(Isa::Scalar, &doubles, &mut b);
        assert!(nan_agnostic(&a, &b), "f64 {isa:?}");
        let finite: Vec<u32> = bits(&a)
            .into_iter()
            .filter(|&x| x & 0x7f80_0000 != 0x7f80_0000)
            .collect();
        assert!(finite.len() > doubles.len() / 2);
    }
}

#[test]
fn the_reported_error_does_not_depend_on_the_thread_count() {
    // Tasks hit different problems: an f16 overflow early, non-finite values later.
    // Whatever the split, non-finite wins and names its first index; with only
    // overflows, the first overflowing block is named.
    let n = 1 << 20;
    let mut x = adversarial(n, 23);
    x[1000] = 2e7; // overflows an f16 scale (block 15)
    x[600_000] = f32::NAN;
    x[900_000] = f32::INFINITY;
    let mut only_overflow = adversarial(n, 24);
    only_overflow[700_001] = -3e7;
    only_overflow[300_000] = 1e7;
    let run = |x: &[f32]| {
        let mut c = vec![0i8; n];
        let mut s = vec![f16::ZERO; num_blocks(n, 64)];
        quantize_blockwise_with(Isa::detected(), x, 64, &mut c, ScalesMut::F16(&mut s)).unwrap_err()
    };
    for threads in [1, 2, 3, 7] {
        ferroquant::parallel::set_num_threads(threads).unwrap();
        assert_eq!(
            run(&x),
            QuantError::NonFinite {
                arg: "x",
                index: 600_000
            }
        );
        match run(&only_overflow) {
            QuantError::ScaleOverflow { block, .. } => assert_eq!(block, 300_000 / 64),
            other => panic!("expected an overflow, got {other:?}"),
        }
    }
}

#[test]
fn a_callers_flush_to_zero_flags_change_nothing() {
    // 2^19 subnormals: max |x| = 1e-39, scale 1e-39/127 (subnormal, non-zero),
    // codes 127. With the caller's FTZ/DAZ leaking into some threads, one
    // thread gave scale 1.0 and codes 0 while two gave the right answer.
    let n = 1 << 19;
    let x = vec![1e-39f32; n];
    let run = move || {
        let mut c = vec![0i8; n];
        let mut s = vec![0f32; num_blocks(n, 64)];
        quantize_blockwise_with(Isa::detected(), &x, 64, &mut c, ScalesMut::F32(&mut s)).unwrap();
        (c, s)
    };
    let scale = std::hint::black_box(1e-39f32) / 127.0;
    assert!(scale > 0.0 && !scale.is_normal());
    std::thread::spawn(move || {
        ferroquant::simd::fpenv::set_flush_denormals(true);
        for threads in [1, 2] {
            ferroquant::parallel::set_num_threads(threads).unwrap();
            let (c, s) = run();
            assert!(c.iter().all(|&v| v == 127), "threads={threads}");
            assert!(s.iter().all(|&v| v == scale), "threads={threads}");
        }
        assert!(
            !ferroquant::simd::fpenv::is_default(),
            "the caller's flags are restored"
        );
    })
    .join()
    .unwrap();
}
