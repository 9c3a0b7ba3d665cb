//! float16 bits (SPEC §5): F16C / AVX-512 conversions equal the scalar path
//! (the `half` crate) bit for bit for every class of f32 — normals, values at
//! the rounding midpoints, subnormal results, overflow, signed zeros, NaNs
//! with any payload — at every length, and the thread count changes nothing.

use crate::rng::Rng;
use crate::with_threads;
use ferroquant::ops::f16bits::{fp16_bits_to_fp32_with, fp32_to_fp16_bits_with};
use ferroquant::simd::Isa;

fn patterns(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|i| {
            let b = r.next() as u32;
            f32::from_bits(match i % 6 {
                // Midpoints between two halves and their neighbours.
                0 => (b & 0xffff_e000) | 0x1000 ^ (r.next() as u32 & 1),
                // Exponents around the half range: subnormal, normal, overflow.
                1 => (b & 0x807f_ffff) | ((100 + r.next() as u32 % 60) << 23),
                2 => b | 0x7f80_0000, // inf and NaN with any payload
                3 => b & 0x8000_0000, // signed zeros
                _ => b,
            })
        })
        .collect()
}

#[test]
fn every_isa_converts_like_scalar() {
    for isa in Isa::supported() {
        for n in (0..70).chain([1000, 70_001]) {
            let x = patterns(n, n as u64 + 3);
            let (mut a, mut b) = (vec![0u16; n], vec![0u16; n]);
            fp32_to_fp16_bits_with(isa, &x, &mut a).unwrap();
            fp32_to_fp16_bits_with(Isa::Scalar, &x, &mut b).unwrap();
            assert_eq!(a, b, "f32 -> f16 {isa:?} n {n}");
            let (mut c, mut d) = (vec![0f32; n], vec![0f32; n]);
            fp16_bits_to_fp32_with(isa, &a, &mut c).unwrap();
            fp16_bits_to_fp32_with(Isa::Scalar, &a, &mut d).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&c), bits(&d), "f16 -> f32 {isa:?} n {n}");
        }
    }
}

#[test]
fn large_inputs_do_not_depend_on_the_thread_count() {
    let x = patterns(1 << 20, 99);
    let runs = with_threads(&[1, 2, 3], |_| {
        let mut a = vec![0u16; x.len()];
        fp32_to_fp16_bits_with(Isa::detected(), &x, &mut a).unwrap();
        a
    });
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
}

#[test]
fn streamed_conversion_matches_scalar_at_every_offset() {
    use ferroquant::simd;
    use half::f16;
    // The streamed primitives: a cached head up to a 64-byte line, aligned
    // lines, a cached tail; every start within a line, lengths around a line.
    let x = patterns(70_001, 41);
    for isa in Isa::supported() {
        for off in 0..33 {
            for n in (0..70).chain([1000, 70_001 - 33]) {
                let mut a = vec![f16::from_bits(0x5555); n + 66];
                let mut b = a.clone();
                simd::f32_to_f16_streamed(isa, &x[..n], &mut a[off..off + n]);
                simd::f32_to_f16(Isa::Scalar, &x[..n], &mut b[off..off + n]);
                let bits = |v: &[f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{isa:?} offset {off} n {n}");
                // And back: every half widened, streamed against scalar.
                let mut c = vec![f32::from_bits(0x5555_5555); n + 66];
                let mut d = c.clone();
                simd::f16_to_f32_streamed(isa, &b[off..off + n], &mut c[off..off + n]);
                simd::f16_to_f32(Isa::Scalar, &b[off..off + n], &mut d[off..off + n]);
                let wide = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(wide(&c), wide(&d), "back {isa:?} offset {off} n {n}");
            }
        }
    }
}

#[test]
fn one_thread_output_past_the_streaming_size_matches_scalar() {
    // 8 MiB of halves and more take the streamed path on one thread.
    let n = (8 << 20) / 2 + 33;
    let x = patterns(n, 5);
    let mut want = vec![0u16; n];
    fp32_to_fp16_bits_with(Isa::Scalar, &x, &mut want).unwrap();
    let runs = with_threads(&[1, 2], |_| {
        let mut a = vec![0u16; n + 1];
        fp32_to_fp16_bits_with(Isa::detected(), &x, &mut a[1..]).unwrap();
        a
    });
    for r in runs {
        assert_eq!(r[0], 0);
        assert!(r[1..] == want[..]);
    }
    // And back: 16 MiB of floats and more, streamed on one thread.
    let mut back = vec![0f32; n];
    fp16_bits_to_fp32_with(Isa::Scalar, &want, &mut back).unwrap();
    let back: Vec<u32> = back.iter().map(|f| f.to_bits()).collect();
    let runs = with_threads(&[1, 2], |_| {
        let mut a = vec![0f32; n + 1];
        fp16_bits_to_fp32_with(Isa::detected(), &want, &mut a[1..]).unwrap();
        a
    });
    for r in runs {
        assert_eq!(r[0].to_bits(), 0);
        assert!(r[1..].iter().map(|f| f.to_bits()).eq(back.iter().copied()));
    }
}

#[test]
fn streamed_widening_keeps_every_half_pattern() {
    use ferroquant::simd;
    use half::f16;
    // All 65536 halves (signalling NaNs included), which the round trip above
    // never produces, at every start within a line.
    let halves: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let n = halves.len();
    for isa in Isa::supported() {
        for off in 0..16 {
            let mut a = vec![f32::from_bits(0x5555_5555); n + 32];
            let mut b = a.clone();
            simd::f16_to_f32_streamed(isa, &halves, &mut a[off..off + n]);
            simd::f16_to_f32(Isa::Scalar, &halves, &mut b[off..off + n]);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "{isa:?} offset {off}");
        }
    }
}
