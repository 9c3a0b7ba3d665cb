//! A tour of the crate, one family at a time: the same kernels the Python
//! wheel calls, on plain slices (`cargo run --release --example tour`).
//! `tests/tour.rs` runs it, so every line here is checked on every `cargo test`.

use ferroquant::ops::affine::{self, Codes, CodesMut, QuantConfig};
use ferroquant::ops::blockwise::{dequantize_blockwise, quantize_blockwise, Scales, ScalesMut};
use ferroquant::ops::dynamic::{self, DynCodes, DynCodesMut, DynFormat, ScaleMode};
use ferroquant::ops::linear::{linear_forward, DequantDtype, QuantizedWeight, WeightCodes};
use ferroquant::ops::ptq::{Calibrator, QuantizedModel, QuantizedWeights};
use ferroquant::ops::{bitnet, f16bits, pack, smooth, w8a8};
use ferroquant::QuantError;
use half::f16;

/// A deterministic, slightly skewed test signal.
fn signal(n: usize, k: f32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32 * 0.37 + k).sin() * 2.0 + 0.1 * k).clamp(-3.0, 3.0))
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs every family; returns the first kernel error (none is expected).
pub fn main() -> Result<(), QuantError> {
    let x = signal(4096, 1.0);

    // §1 Blockwise 8-bit: int8 codes, one f16 scale per block of 64.
    let mut codes = vec![0i8; x.len()];
    let mut scales = vec![f16::ZERO; x.len().div_ceil(64)];
    quantize_blockwise(&x, 64, &mut codes, ScalesMut::F16(&mut scales))?;
    let mut y = vec![0f32; x.len()];
    dequantize_blockwise(&codes, 64, Scales::F16(&scales), &mut y)?;
    println!("blockwise8     max|err| {:.2e}", max_abs_diff(&x, &y));
    assert!(max_abs_diff(&x, &y) < 0.02);

    // §2 Affine int4, asymmetric, per channel: a [64, 64] weight, codes packed
    // two a byte, f64 scales and zero points.
    let shape = [64usize, 64];
    let config = QuantConfig::int4_per_channel().asymmetric();
    let mut packed = vec![0u8; pack::packed_len(x.len())];
    let groups = affine::num_groups(&shape, config.granularity);
    let (mut s64, mut zp) = (vec![0f64; groups], vec![0f64; groups]);
    affine::quantize(
        &x,
        &shape,
        &config,
        CodesMut::Int4(&mut packed),
        &mut s64,
        &mut zp,
    )?;
    affine::dequantize(Codes::Int4(&packed), &shape, &config, &s64, &zp, &mut y)?;
    println!("int4 per-chan  max|err| {:.2e}", max_abs_diff(&x, &y));
    assert!(max_abs_diff(&x, &y) <= 0.5 * s64.iter().cloned().fold(0.0, f64::max) as f32 + 1e-6);

    // The same weight through the fused linear layer (no f32 weight built).
    let tokens = 3;
    let acts = signal(tokens * shape[1], 2.0);
    let w = QuantizedWeight {
        codes: WeightCodes::Int4(&packed),
        shape,
        scales: &s64,
        zero_points: &zp,
        dequant: DequantDtype::F32,
    };
    let mut out = vec![0f32; tokens * shape[0]];
    linear_forward(&w, &acts, tokens, None, &mut out)?;
    // Against the dequantized weight, in f64.
    for t in 0..tokens {
        for o in 0..shape[0] {
            let want: f64 = (0..shape[1])
                .map(|i| acts[t * shape[1] + i] as f64 * y[o * shape[1] + i] as f64)
                .sum();
            assert!((out[t * shape[0] + o] as f64 - want).abs() < 1e-3);
        }
    }
    println!("linear int4    {tokens} tokens x {shape:?}");

    // §3 Dynamic int8 per row with a percentile scale, and its values.
    let mode = ScaleMode::percentile(0.99)?;
    let mut dcodes = vec![0i8; x.len()];
    let mut row_scales = vec![0f32; 64];
    dynamic::dynamic_quantize(
        &x,
        &[64, 64],
        DynFormat::Int8PerRow,
        mode,
        DynCodesMut::Int8(&mut dcodes),
        &mut row_scales,
    )?;
    dynamic::dequantize_groups(DynCodes::Int8(&dcodes), 64, &row_scales, &mut y)?;
    println!(
        "dynamic p99    max|err| {:.2e} (outliers clipped)",
        max_abs_diff(&x, &y)
    );

    // SmoothQuant: factors moving activation outliers into the weights.
    let cfg = smooth::SmoothQuantConfig::new(0.5, 1e-5)?;
    let (a, mut wt) = (signal(8 * 16, 3.0), signal(4 * 16, 4.0));
    let factors = smooth::compute_smooth_factors(&a, &wt, 16, &cfg)?;
    smooth::smooth_weights(&mut wt, &factors)?;
    assert_eq!(factors.len(), 16);

    // W8A8: int8 weight with per-row scales times an activation quantized on
    // the fly; the integer dot products are exact for any length.
    let (rows, cols) = (32usize, 128usize);
    let weight: Vec<i8> = (0..rows * cols).map(|i| (i % 255) as i8).collect();
    let wscales = vec![0.01f32; rows];
    let act = signal(cols, 5.0);
    let mut gemv = vec![0f32; rows];
    w8a8::w8a8_matvec(&weight, [rows, cols], &wscales, &act, &mut gemv)?;
    println!("w8a8 matvec    out[0] = {:.4}", gemv[0]);

    // §4 BitNet per-token activations, 4 bits: one scale per token of 256.
    let mut bcodes = vec![0i8; x.len()];
    let mut token_scales = vec![0f32; x.len() / 256];
    bitnet::quantize_activations(&x, 256, 4, &mut bcodes, &mut token_scales)?;
    assert!(bcodes.iter().all(|&c| (-7..=7).contains(&c)));

    // §5 Post-training int8: calibrate, quantize, save the seed's JSON.
    let mut calib = Calibrator::new();
    calib.record_layer("fc".into(), &x)?;
    let ranges = calib.finish();
    let qw = QuantizedWeights::from_f32("fc".into(), &x, vec![64, 64], None, None)?;
    assert_eq!(qw.scale, ranges[0].weight_scale());
    let model = QuantizedModel {
        config_json: "{}".into(),
        total_quantized_bytes: qw.size_bytes(),
        total_fp32_bytes: qw.original_size_bytes(),
        layers: vec![qw],
        scheme: ferroquant::ops::ptq::SCHEME.into(),
    };
    let json = model.to_json()?;
    assert_eq!(QuantizedModel::from_json(json.as_bytes())?, model);
    println!(
        "ptq-int8       {} JSON bytes, ratio {:.1}x",
        json.len(),
        model.compression_ratio()
    );

    // float16 bits, rounded to nearest even as the `half` crate does.
    let mut bits = vec![0u16; x.len()];
    f16bits::fp32_to_fp16_bits(&x, &mut bits)?;
    f16bits::fp16_bits_to_fp32(&bits, &mut y)?;
    assert!(max_abs_diff(&x, &y) < 2e-3);
    println!("f16 bits       max|err| {:.2e}", max_abs_diff(&x, &y));

    // Bad input is an error value, never a panic.
    let err = QuantizedWeights::from_f32("bad".into(), &[f32::NAN], vec![1], None, None);
    assert_eq!(
        err.unwrap_err(),
        QuantError::NonFinite { arg: "w", index: 0 }
    );
    Ok(())
}
