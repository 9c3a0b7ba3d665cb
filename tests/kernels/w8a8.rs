//! W8A8 integer products (SPEC §3): the int8 dot primitive on every ISA
//! (VNNI included) equals the scalar one bit for bit, at odd lengths, with
//! extreme bytes and sums past i32; the products do not depend on the
//! thread count.

use crate::rng::Rng;
use crate::with_threads;
use ferroquant::ops::w8a8::{w8a8_matmul_with, Batch};
use ferroquant::simd::{self, scalar, Isa};

fn bytes(n: usize, seed: u64) -> Vec<i8> {
    let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..n)
        .map(|_| match r.next() % 5 {
            0 => -128,
            1 => 127,
            2 => -127,
            _ => r.next() as u8 as i8,
        })
        .collect()
}

fn dots(isa: Isa, w: &[i8], a: &[i8], k: usize) -> Vec<i64> {
    let mut out = vec![i64::MIN; (w.len() / k) * (a.len() / k)];
    simd::i8_dots(isa, w, w.len() / k, a, k, &mut out);
    out
}

#[test]
fn every_isa_matches_scalar_at_odd_lengths() {
    for isa in Isa::supported() {
        for k in (1..=70).chain([127, 128, 129, 191, 4096 + 17]) {
            // From 16 tokens on, VNNI packs the tokens (blocks of 16 and 32
            // lanes) and takes rows in eights, fours and ones.
            let shapes = [(1, 1), (4, 1), (5, 2), (9, 3), (3, 5), (8, 4)];
            let packed = [(13, 8), (17, 16), (5, 17), (25, 33), (1, 40)];
            let packed = if k % 7 == 0 || k > 70 {
                &packed[..]
            } else {
                &[]
            };
            for &(rows, tokens) in shapes.iter().chain(packed) {
                let w = bytes(rows * k, (k * 31 + rows) as u64);
                let a = bytes(tokens * k, (k * 17 + tokens) as u64);
                assert_eq!(
                    dots(isa, &w, &a, k),
                    dots(Isa::Scalar, &w, &a, k),
                    "{isa:?} k {k} rows {rows} tokens {tokens}"
                );
            }
        }
    }
}

#[test]
fn rescaled_products_match_scalar_on_every_isa() {
    // i8_products: the exact sums converted and multiplied in f32, written
    // at a row stride; VNNI fuses it into the packed kernel from 8 tokens.
    for isa in Isa::supported() {
        for k in [1usize, 3, 64, 67, 130, 4096 + 5] {
            for (rows, tokens, stride) in [
                (1, 1, 1),
                (5, 3, 7),
                (13, 8, 13),
                (25, 33, 30),
                (12, 17, 12),
            ] {
                let w = bytes(rows * k + 2 * k, (k * 3 + rows) as u64);
                let a = bytes(tokens * k, (k * 5 + tokens) as u64);
                let ws: Vec<f32> = (0..rows).map(|r| 1e-3 * (1 + r % 7) as f32 / 3.0).collect();
                let at: Vec<f32> = (0..tokens).map(|t| 0.37 / (1 + t) as f32).collect();
                // Tokens packed by tier `by`, the products on tier `isa`
                // (a layout of another tier is read as the plain codes).
                let run = |by: Isa, isa: Isa| {
                    let mut out = vec![f32::NAN; (tokens - 1) * stride + rows];
                    let p = simd::pack_tokens(by, &a, k);
                    simd::i8_products(isa, &w, &p, &ws, &at, &mut out, stride);
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                // VNNI and AVX2 pack from 16 tokens; the other tiers never.
                let packs = tokens >= 16 && matches!(isa, Isa::Avx512Vnni | Isa::Avx2);
                let layout = simd::pack_tokens(isa, &a, k).layout();
                assert_eq!(layout, packs.then_some(isa), "{isa:?} {tokens} tokens");
                let want = run(Isa::Scalar, Isa::Scalar);
                let at_k = format!("k {k} rows {rows} tokens {tokens}");
                assert_eq!(run(isa, isa), want, "{isa:?} {at_k}");
                for other in Isa::supported() {
                    assert_eq!(
                        run(other, isa),
                        want,
                        "packed {other:?}, run {isa:?} {at_k}"
                    );
                }
                // The scalar form is the exact sum rescaled left to right.
                let exact = dots(Isa::Scalar, &w[..rows * k], &a, k);
                for t in 0..tokens {
                    for r in 0..rows {
                        let v = exact[r * tokens + t] as f32 * ws[r] * at[t];
                        assert_eq!(want[t * stride + r], v.to_bits());
                    }
                }
            }
        }
    }
}

#[test]
fn rows_after_the_asked_ones_are_not_summed() {
    // i8_dots sums `rows` rows; the weight after them is only prefetched.
    for isa in Isa::supported() {
        for k in [1usize, 63, 64, 4096] {
            let w = bytes(70 * k, k as u64);
            for (rows, tokens) in [(0usize, 3usize), (1, 3), (4, 3), (5, 3), (30, 3), (13, 17)] {
                let a = bytes(tokens * k, 3);
                let mut out = vec![i64::MIN; rows * tokens];
                simd::i8_dots(isa, &w, rows, &a, k, &mut out);
                assert_eq!(
                    out,
                    dots(Isa::Scalar, &w[..rows * k], &a, k),
                    "{isa:?} k {k}"
                );
            }
        }
    }
}

#[test]
fn the_cases_reach_both_forms() {
    // The shapes above and below take the dot products (few tokens) and the
    // packed outer products (many) on VNNI.
    const { assert!(3 < simd::PACKED_MIN_TOKENS && 17 >= simd::PACKED_MIN_TOKENS) };
    const { assert!(33 > 2 * simd::PACKED_MIN_TOKENS, "two packed blocks") };
}

#[test]
fn sums_past_i32_are_exact_on_every_isa() {
    // 200,000 products of 127·127 (3.2e9) and of (-128)·(-128) (3.3e9) both
    // overflow i32; mixed-sign extremes too.
    let k = 200_000;
    let cases: [(i8, i8); 4] = [(127, 127), (-128, -128), (-128, 127), (127, -127)];
    for isa in Isa::supported() {
        for (wv, av) in cases {
            let w = vec![wv; 5 * k];
            let want = wv as i64 * av as i64 * k as i64;
            // 3 tokens: dot products; 17: the packed outer products.
            for tokens in [3, 17] {
                let a = vec![av; tokens * k];
                let got = dots(isa, &w, &a, k);
                assert_eq!(
                    got,
                    vec![want; 5 * tokens],
                    "{isa:?} {wv} x {av} x {tokens}"
                );
            }
        }
        for tokens in [2, 17] {
            let w = bytes(4 * k + 4 * 3, 5);
            let a = bytes(tokens * (k + 3), 6);
            assert_eq!(dots(isa, &w, &a, k + 3), dots(Isa::Scalar, &w, &a, k + 3));
        }
        // The rescaled form (AVX2 packs from 16 tokens and sums i16 pairs):
        // unit scales leave the exact sum, rounded once to f32.
        for (wv, av) in cases {
            let (rows, tokens) = (5, 17);
            let (w, a) = (vec![wv; rows * k], vec![av; tokens * k]);
            let mut out = vec![f32::NAN; rows * tokens];
            let p = simd::pack_tokens(isa, &a, k);
            simd::i8_products(isa, &w, &p, &[1.0; 5], &[1.0; 17], &mut out, rows);
            let want = (wv as i64 * av as i64 * k as i64) as f32;
            assert!(
                out.iter().all(|&v| v == want),
                "{isa:?} {wv} x {av}: {out:?}"
            );
        }
    }
    assert_eq!(scalar::i8_dot(&[-128; 3], &[-128; 3]), 3 * 16384);
}

#[test]
fn products_do_not_depend_on_isa_or_thread_count() {
    // 32,000 wide: blocks of 16 tokens (512 KiB of codes), so 37 tokens are
    // two packed blocks and a short one that is not packed.
    for (o, i, t) in [(700usize, 1000usize, 20usize), (13, 32_000, 37)] {
        let w = bytes(o * i, 9);
        let ws: Vec<f32> = (0..o).map(|r| 1e-3 * (1 + r % 13) as f32).collect();
        let mut r = Rng(77);
        let x: Vec<f32> = (0..t * i).map(|_| (r.unit() - 0.5) * 6.0).collect();
        let run = |isa: Isa, batch: Batch, x: &[f32]| {
            let n = match batch {
                Batch::Vector => o,
                Batch::Tokens(t) => t * o,
            };
            let mut out = vec![f32::NAN; n];
            let mut codes = vec![0i8; x.len()];
            w8a8_matmul_with(isa, &w, [o, i], &ws, x, batch, &mut codes, &mut out).unwrap();
            out
        };
        let want_m = run(Isa::Scalar, Batch::Tokens(t), &x);
        let want_v = run(Isa::Scalar, Batch::Vector, &x[..i]);
        let results = with_threads(&[1, 2, 3], |_| {
            Isa::supported()
                .into_iter()
                .map(|isa| {
                    (
                        run(isa, Batch::Tokens(t), &x),
                        run(isa, Batch::Vector, &x[..i]),
                    )
                })
                .collect::<Vec<_>>()
        });
        for per_isa in results {
            for (m, v) in per_isa {
                assert_eq!(m, want_m, "{o} x {i}, {t} tokens");
                assert_eq!(v, want_v, "{o} x {i}");
            }
        }
    }
}

#[test]
fn zero_wide_tokens_write_nothing_on_every_isa() {
    // k == 0 through the public packing API: no products, no panic.
    let (w, a) = ([1i8; 4], [1i8; 20]);
    for isa in Isa::supported() {
        for p in [
            simd::pack_tokens(isa, &a, 0),
            simd::PackedTokens::unpacked(&a, 0),
        ] {
            assert_eq!(p.layout(), None, "{isa:?}");
            let mut out = [7f32; 4];
            simd::i8_products(isa, &w, &p, &[1.0; 1], &[1.0; 20], &mut out, 1);
            assert_eq!(out, [7.0; 4], "{isa:?}");
        }
    }
}
