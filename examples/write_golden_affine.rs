//! Writes `tests/golden/affine.safetensors`: inputs and the Rust kernels'
//! outputs for SPEC §2, bit for bit, for pytest to reproduce through the wheel
//! (`cargo run --example write_golden_affine`, or `make golden`).
//!
//! Each case `c{i}` stores `c{i}.x` (the input, in its own dtype), `c{i}.data`
//! (int8 codes or packed int4 bytes), `c{i}.scales`, `c{i}.zero_points`
//! (float64) and `c{i}.deq` (in the input's dtype); the metadata entry `cases`
//! lists each case's shape and config.

use ferroquant::ops::affine::{
    dequantize, num_groups, quantize, Bits, Codes, CodesMut, Granularity, Mode, QuantConfig,
};
use ferroquant::ops::pack::packed_len;
use half::{bf16, f16};
use safetensors::tensor::Dtype;

#[path = "../tests/common/rng.rs"]
mod rng;
use rng::Rng;
#[path = "../tests/common/golden.rs"]
mod golden;
use golden::{bytes, Le, Tensors};

/// Noise with exact .5 ties of the int8/int4 grids, near-ties, zeros, an outlier.
fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut r = Rng(seed);
    (0..n)
        .map(|i| match i % 7 {
            0 => 127.0 * scale,
            1 => ((r.next() % 254) as f64 - 127.0 + 0.5) * scale,
            2 => f64::from_bits(0.5f64.to_bits() - 1) * scale,
            3 => 0.0,
            4 => -((r.next() % 14) as f64 - 7.0 + 0.5) * scale,
            _ => (r.unit() as f64 - 0.5) * 200.0 * scale,
        })
        .collect()
}

fn name(c: &QuantConfig) -> (u32, &'static str, &'static str) {
    (
        if c.bits == Bits::Int8 { 8 } else { 4 },
        if c.mode == Mode::Symmetric {
            "symmetric"
        } else {
            "asymmetric"
        },
        if c.granularity == Granularity::PerTensor {
            "per_tensor"
        } else {
            "per_channel"
        },
    )
}

fn run<T: Le>(x: &[T], shape: &[usize], c: QuantConfig, i: usize, out: &mut Tensors) -> String {
    let n = x.len();
    let g = num_groups(shape, c.granularity);
    let (mut s, mut z) = (vec![0f64; g], vec![0f64; g]);
    let mut deq = vec![T::from_f64_once(0.0); n];
    let data = match c.bits {
        Bits::Int8 => {
            let mut d = vec![0i8; n];
            quantize(x, shape, &c, CodesMut::Int8(&mut d), &mut s, &mut z).unwrap();
            dequantize(Codes::Int8(&d), shape, &c, &s, &z, &mut deq).unwrap();
            (Dtype::I8, vec![n], d.iter().map(|&v| v as u8).collect())
        }
        Bits::Int4 => {
            let mut d = vec![0u8; packed_len(n)];
            quantize(x, shape, &c, CodesMut::Int4(&mut d), &mut s, &mut z).unwrap();
            dequantize(Codes::Int4(&d), shape, &c, &s, &z, &mut deq).unwrap();
            (Dtype::U8, vec![packed_len(n)], d)
        }
    };
    let f64s = |v: &[f64]| v.iter().flat_map(|e| e.to_le_bytes()).collect::<Vec<u8>>();
    out.push((format!("c{i}.x"), T::DTYPE, shape.to_vec(), bytes(x)));
    out.push((format!("c{i}.data"), data.0, data.1, data.2));
    out.push((format!("c{i}.scales"), Dtype::F64, vec![g], f64s(&s)));
    out.push((format!("c{i}.zero_points"), Dtype::F64, vec![g], f64s(&z)));
    out.push((format!("c{i}.deq"), T::DTYPE, shape.to_vec(), bytes(&deq)));
    let (bits, mode, gran) = name(&c);
    format!(
        r#"{{"case": "c{i}", "shape": {shape:?}, "bits": {bits}, "mode": "{mode}", "granularity": "{gran}"}}"#
    )
}

fn main() {
    let configs: Vec<QuantConfig> = [
        QuantConfig::int8(),
        QuantConfig::int8_per_channel(),
        QuantConfig::int4(),
        QuantConfig::int4_per_channel(),
    ]
    .into_iter()
    .flat_map(|c| [c, c.asymmetric()])
    .collect();
    let mut tensors = Tensors::new();
    let mut params = Vec::new();
    for (k, c) in configs.into_iter().enumerate() {
        let base = 10 * k;
        let v = values(13 * 17, k as u64 + 1, 0.01);
        let f: Vec<f32> = v.iter().map(|&e| e as f32).collect();
        params.push(run(&f, &[13, 17], c, base, &mut tensors));
        let d: Vec<f64> = values(5 * 9 * 3, k as u64 + 11, 3.0)
            .iter()
            .map(|e| e * (1.0 + 1e-12))
            .collect();
        params.push(run(&d, &[5, 9, 3], c, base + 1, &mut tensors));
        let h: Vec<f16> = values(301, k as u64 + 21, 0.05)
            .iter()
            .map(|&e| f16::from_f64(e))
            .collect();
        params.push(run(&h, &[7, 43], c, base + 2, &mut tensors));
        let b: Vec<bf16> = values(255, k as u64 + 31, 40.0)
            .iter()
            .map(|&e| bf16::from_f64(e))
            .collect();
        params.push(run(&b, &[255], c, base + 3, &mut tensors));
        params.push(run(&[2.5f32], &[], c, base + 4, &mut tensors));
        params.push(run::<f32>(&[], &[3, 0], c, base + 5, &mut tensors));
    }
    golden::write("affine.safetensors", &tensors, &params);
}
