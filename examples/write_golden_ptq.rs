//! Writes `tests/golden/ptq.safetensors`: inputs and the Rust kernels' outputs
//! for SPEC §5 — so far the float16 bit conversions — bit for bit, for pytest
//! to reproduce through the wheel (`cargo run --example write_golden_ptq`).
//!
//! Case kinds (metadata `cases`): `f16bits` (`.x` float32 -> `.bits` uint16,
//! and `.bits_in` uint16 -> `.values` float32).

use ferroquant::ops::f16bits::{fp16_bits_to_fp32, fp32_to_fp16_bits};
use safetensors::tensor::Dtype;

#[path = "../tests/common/rng.rs"]
#[allow(dead_code)] // Rng::unit is not needed here
mod rng;
use rng::Rng;
#[path = "../tests/common/golden.rs"]
mod golden;
use golden::{bytes, Tensors};

/// f32 of every class: midpoints between halves, the edges of the half
/// range, subnormal results, overflow, signed zeros, infinities, NaN payloads.
fn patterns(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    let mut v: Vec<f32> = [
        0.0f32,
        -0.0,
        1.0,
        65504.0,
        65519.99,
        65520.0,
        5.960_464_5e-8,
        2.980_232_2e-8,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE,
        f32::MAX,
    ]
    .into_iter()
    .chain([0x7f80_0001u32, 0xffc0_1234, 0x7fbf_ffff].map(f32::from_bits))
    .collect();
    v.extend((0..n).map(|i| {
        let b = r.next() as u32;
        f32::from_bits(match i % 5 {
            0 => (b & 0xffff_e000) | 0x1000,
            1 => (b & 0x807f_ffff) | ((100 + r.next() as u32 % 60) << 23),
            2 => b | 0x7f80_0000,
            _ => b,
        })
    }));
    v
}

fn u16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|e| e.to_le_bytes()).collect()
}

fn main() {
    let mut t: Tensors = Vec::new();
    let mut cases = Vec::new();
    for (i, n) in [0usize, 17, 1000].into_iter().enumerate() {
        let x = patterns(n, 7000 + i as u64);
        let mut bits = vec![0u16; x.len()];
        fp32_to_fp16_bits(&x, &mut bits).unwrap();
        let mut r = Rng(8000 + i as u64);
        let bits_in: Vec<u16> = (0..n + 5).map(|_| r.next() as u16).collect();
        let mut values = vec![0f32; bits_in.len()];
        fp16_bits_to_fp32(&bits_in, &mut values).unwrap();
        t.push((format!("h{i}.x"), Dtype::F32, vec![x.len()], bytes(&x)));
        t.push((
            format!("h{i}.bits"),
            Dtype::U16,
            vec![bits.len()],
            u16_bytes(&bits),
        ));
        t.push((
            format!("h{i}.bits_in"),
            Dtype::U16,
            vec![bits_in.len()],
            u16_bytes(&bits_in),
        ));
        t.push((
            format!("h{i}.values"),
            Dtype::F32,
            vec![values.len()],
            bytes(&values),
        ));
        cases.push(format!(r#"{{"case": "h{i}", "kind": "f16bits"}}"#));
    }
    golden::write("ptq.safetensors", &t, &cases);
}
