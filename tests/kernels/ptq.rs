//! Post-training int8 (SPEC §5): every ISA quantizes weights and finds their
//! range like the scalar path, bit for bit, for every input type and length,
//! with and without a supplied scale; the thread count changes nothing; and the
//! codes are the seed's `clamp(round(w / scale), -127, 127)` in f32.

use crate::rng::Rng;
use crate::with_threads;
use ferroquant::ops::ptq::{quantize_weights_with, weight_range_with, MIN_SCALE};
use ferroquant::simd::Isa;
use ferroquant::Float;
use half::{bf16, f16};

/// Weights with exact ties of the scale, outliers, zeros and signed zeros.
fn weights(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|i| match i % 9 {
            0 => 0.0,
            1 => -0.0,
            2 => ((r.next() % 255) as f32 - 127.0) * 0.5, // ties when scale = 1
            3 => (r.unit() - 0.5) * 1e4,
            4 => (r.unit() - 0.5) * 1e-30,
            _ => r.unit() - 0.5,
        })
        .collect()
}

/// The seed's codes, in f32 arithmetic.
fn seed_codes(w: &[f32], s: f32) -> Vec<i8> {
    w.iter()
        .map(|&x| (x / s).round().clamp(-127.0, 127.0) as i8)
        .collect()
}

fn check<T: Float>(w32: &[f32], scale: Option<f32>) {
    let w: Vec<T> = w32.iter().map(|&v| T::from_f64_once(v as f64)).collect();
    let as_f32: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
    let mut want = vec![0i8; w.len()];
    let s = quantize_weights_with(Isa::Scalar, &w, scale, &mut want).unwrap();
    let max_abs = as_f32.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert_eq!(s, scale.unwrap_or(max_abs / 127.0).max(MIN_SCALE));
    assert_eq!(want, seed_codes(&as_f32, s));
    let range = (!w.is_empty()).then(|| weight_range_with(Isa::Scalar, &w).unwrap());
    for isa in Isa::supported() {
        let mut got = vec![0i8; w.len()];
        assert_eq!(quantize_weights_with(isa, &w, scale, &mut got).unwrap(), s);
        assert_eq!(got, want, "{isa:?} n {}", w.len());
        if let Some(r) = range {
            assert_eq!(weight_range_with(isa, &w).unwrap(), r, "{isa:?}");
        }
    }
}

#[test]
fn every_isa_quantizes_like_the_seed() {
    for n in (0..70).chain([1000, 4097, 70_001]) {
        let w = weights(n, n as u64 + 7);
        for scale in [None, Some(1.0), Some(0.003), Some(1e-12)] {
            check::<f32>(&w, scale);
        }
        check::<f64>(&w, None);
        check::<f16>(&w, None);
        check::<bf16>(&w, Some(0.5));
    }
}

#[test]
fn large_inputs_do_not_depend_on_the_thread_count() {
    let w = weights(1 << 20, 5);
    let runs = with_threads(&[1, 2, 3], |_| {
        let mut c = vec![0i8; w.len()];
        let s = quantize_weights_with(Isa::detected(), &w, None, &mut c).unwrap();
        (s, c, weight_range_with(Isa::detected(), &w).unwrap())
    });
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
}
