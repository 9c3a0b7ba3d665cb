//! Writes `tests/golden/ptq.safetensors`: inputs and the Rust kernels' outputs
//! for SPEC §5, bit for bit, for pytest to reproduce through the wheel
//! (`cargo run --example write_golden_ptq`).
//!
//! Case kinds (metadata `cases`):
//! - `f16bits`: `.x` float32 -> `.bits` uint16, and `.bits_in` uint16 -> `.values` float32.
//! - `weights`: `QuantizedWeights::from_f32` of `.w` (any float dtype; `shape`,
//!   optional `scale`, optional `.bias`) -> `.codes` int8, `.scale` float32[1],
//!   `.deq` float32 (inputs under 100,000 values); and the calibrator's
//!   `.range` float32[2] of `.w`.
//! - `model`: `quantize_model_weights(config_json, layers)` over the float32
//!   layers `.w<k>` (shape `shapes[k]`, bias `.b<k>` where `biases[k]`) ->
//!   `.json`, the model's JSON bytes as uint8 (the seed's `to_string_pretty`).
//! - `seed_model`: the seed's own sample model (its `test_save_load_roundtrip`)
//!   -> `.json` bytes.

use ferroquant::ops::f16bits::{fp16_bits_to_fp32, fp32_to_fp16_bits};
use ferroquant::ops::ptq::{
    quantize_model_weights, weight_range, QuantizedModel, QuantizedWeights, SCHEME,
};
use half::{bf16, f16};
use safetensors::tensor::Dtype;

#[path = "../tests/common/rng.rs"]
#[allow(dead_code)] // Rng::unit is not needed here
mod rng;
use rng::Rng;
#[path = "../tests/common/golden.rs"]
mod golden;
use golden::{bytes, Le, Tensors};

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

fn i8_bytes(v: &[i8]) -> Vec<u8> {
    v.iter().map(|&e| e as u8).collect()
}

/// Weights with outliers, exact zeros and values on rounding ties of `scale`.
fn weights(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    (0..n)
        .map(|i| match i % 11 {
            0 => 0.0,
            3 => (r.next() % 255) as f32 / 2.0 - 63.5,
            7 => ((r.next() % 2000) as f32 - 1000.0) * 0.37,
            _ => ((r.next() % 20001) as f32 - 10000.0) * 1e-4,
        })
        .collect()
}

fn weight_case<T: Le>(
    t: &mut Tensors,
    cases: &mut Vec<String>,
    name: &str,
    shape: &[usize],
    scale: Option<f32>,
    bias: bool,
    seed: u64,
) {
    let n: usize = shape.iter().product();
    let w: Vec<T> = weights(n, seed)
        .into_iter()
        .map(|v| T::from_f64_once(v as f64))
        .collect();
    let b: Option<Vec<f32>> = bias.then(|| weights(shape[0], seed + 1));
    let qw = QuantizedWeights::from_f32(name.into(), &w, shape.to_vec(), b.clone(), scale).unwrap();
    t.push((format!("{name}.w"), T::DTYPE, vec![n], bytes(&w)));
    if let Some(b) = &b {
        t.push((format!("{name}.bias"), Dtype::F32, vec![b.len()], bytes(b)));
    }
    t.push((
        format!("{name}.codes"),
        Dtype::I8,
        vec![n],
        i8_bytes(&qw.weights_i8),
    ));
    t.push((
        format!("{name}.scale"),
        Dtype::F32,
        vec![1],
        bytes(&[qw.scale]),
    ));
    // (Long inputs, there to cross the parallel threshold, skip the values.)
    if n < 100_000 {
        t.push((
            format!("{name}.deq"),
            Dtype::F32,
            vec![n],
            bytes(&qw.dequantize()),
        ));
    }
    if n > 0 {
        let (lo, hi) = weight_range(&w).unwrap();
        t.push((
            format!("{name}.range"),
            Dtype::F32,
            vec![2],
            bytes(&[lo, hi]),
        ));
    }
    let scale = scale.map_or("null".to_string(), |s| format!("{s:?}"));
    cases.push(format!(
        r#"{{"case": "{name}", "kind": "weights", "shape": {shape:?}, "scale": {scale}, "bias": {bias}}}"#
    ));
}

fn main() {
    let mut t: Tensors = Vec::new();
    let mut cases = Vec::new();
    weight_case::<f32>(&mut t, &mut cases, "w0", &[24, 37], None, true, 11);
    weight_case::<f32>(&mut t, &mut cases, "w1", &[3, 5, 7], Some(0.1), false, 12);
    weight_case::<f32>(&mut t, &mut cases, "w2", &[64], Some(1e-9), false, 13);
    weight_case::<f32>(&mut t, &mut cases, "w3", &[0, 4], None, false, 14);
    weight_case::<f32>(&mut t, &mut cases, "w4", &[300, 1000], None, true, 15);
    weight_case::<f16>(&mut t, &mut cases, "w5", &[16, 33], None, true, 16);
    weight_case::<bf16>(&mut t, &mut cases, "w6", &[9, 10], Some(0.25), false, 17);
    weight_case::<f64>(&mut t, &mut cases, "w7", &[5, 129], None, true, 18);

    // A model of float32 layers, its config text full of what JSON must escape.
    let config =
        "{\"name\": \"sensorlm-tiny \u{e9}\u{2028}\", \"tab\": \"\t\", \"nul\": \"\u{1}\"}";
    let shapes: [&[usize]; 3] = [&[4, 6], &[3, 1], &[2, 2, 2]];
    let biases = [true, false, true];
    let mut layers = Vec::new();
    for (k, (shape, has_bias)) in shapes.iter().zip(biases).enumerate() {
        let n: usize = shape.iter().product();
        let w = weights(n, 40 + k as u64);
        let b = has_bias.then(|| weights(shape[0], 50 + k as u64));
        t.push((format!("m0.w{k}"), Dtype::F32, vec![n], bytes(&w)));
        if let Some(b) = &b {
            t.push((format!("m0.b{k}"), Dtype::F32, vec![b.len()], bytes(b)));
        }
        layers.push((format!("layer.{k}"), w, shape.to_vec(), b));
    }
    let model = quantize_model_weights(config.to_string(), layers).unwrap();
    let json = model.to_json().unwrap();
    t.push((
        "m0.json".into(),
        Dtype::U8,
        vec![json.len()],
        json.into_bytes(),
    ));
    cases.push(format!(
        r#"{{"case": "m0", "kind": "model", "config_json": {}, "shapes": {shapes:?}, "biases": {biases:?}}}"#,
        serde_json::to_string(config).unwrap()
    ));

    // The seed's own sample model (seed 004, test_save_load_roundtrip).
    let seed = QuantizedModel {
        config_json: "{}".into(),
        layers: vec![QuantizedWeights {
            name: "l1".into(),
            weights_i8: vec![1, -2, 3],
            shape: vec![1, 3],
            scale: 0.01,
            bias: None,
        }],
        scheme: SCHEME.into(),
        total_quantized_bytes: 3,
        total_fp32_bytes: 12,
    };
    let json = seed.to_json().unwrap();
    t.push((
        "s0.json".into(),
        Dtype::U8,
        vec![json.len()],
        json.into_bytes(),
    ));
    cases.push(r#"{"case": "s0", "kind": "seed_model"}"#.to_string());

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
