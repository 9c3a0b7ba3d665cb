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
            for (rows, tokens) in [(1, 1), (4, 1), (5, 2), (9, 3), (3, 5), (8, 4)] {
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
fn rows_after_the_asked_ones_are_not_summed() {
    // i8_dots sums `rows` rows; the weight after them is only prefetched.
    for isa in Isa::supported() {
        for k in [1usize, 63, 64, 4096] {
            let w = bytes(70 * k, k as u64);
            let a = bytes(3 * k, 3);
            for rows in [0usize, 1, 4, 5, 30] {
                let mut out = vec![i64::MIN; rows * 3];
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
fn sums_past_i32_are_exact_on_every_isa() {
    // 200,000 products of 127·127 (3.2e9) and of (-128)·(-128) (3.3e9) both
    // overflow i32; mixed-sign extremes too.
    let k = 200_000;
    let cases: [(i8, i8); 4] = [(127, 127), (-128, -128), (-128, 127), (127, -127)];
    for isa in Isa::supported() {
        for (wv, av) in cases {
            let w = vec![wv; 5 * k];
            let a = vec![av; 3 * k];
            let want = wv as i64 * av as i64 * k as i64;
            assert_eq!(dots(isa, &w, &a, k), vec![want; 15], "{isa:?} {wv} x {av}");
        }
        let w = bytes(4 * k + 4 * 3, 5);
        let a = bytes(2 * (k + 3), 6);
        assert_eq!(dots(isa, &w, &a, k + 3), dots(Isa::Scalar, &w, &a, k + 3));
    }
    assert_eq!(scalar::i8_dot(&[-128; 3], &[-128; 3]), 3 * 16384);
}

#[test]
fn products_do_not_depend_on_isa_or_thread_count() {
    let (o, i, t) = (700usize, 1000usize, 7usize);
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
            assert_eq!(m, want_m);
            assert_eq!(v, want_v);
        }
    }
}
