//! Writes `tests/golden/dynamic.safetensors`: inputs and the Rust kernels'
//! outputs for SPEC §3 (dynamic quantization, compute_scale, SmoothQuant
//! factors) and §4 (BitNet activations), bit for bit, for pytest to reproduce
//! through the wheel (`cargo run --example write_golden_dynamic`).
//!
//! Case kinds (metadata `cases`): `dynamic` (`.x`, `.data`, `.scales`,
//! `.deq`, `.scale127` = compute_scale(x, 127, mode)), `bitnet` (`.x`,
//! `.data`, `.scales`, `.deq`), `smooth` (`.a`, `.w`, `.factors`) and
//! `w8a8` (`.weight` int8, `.scales`, `.x`: 1-D for `w8a8_matvec`, 2-D for
//! `w8a8_matmul`, `.out`).

use ferroquant::ops::bitnet::quantize_activations;
use ferroquant::ops::calib::CalibStats;
use ferroquant::ops::dynamic::{
    compute_scale, dequantize_groups, dynamic_quantize, num_scales, quantization_mae, DynCodes,
    DynCodesMut, DynFormat, ScaleMode,
};
use ferroquant::ops::pack::packed_len;
use ferroquant::ops::smooth::{compute_smooth_factors, SmoothQuantConfig};
use ferroquant::ops::w8a8::{w8a8_matmul, w8a8_matvec};
use half::{bf16, f16};
use safetensors::tensor::Dtype;

#[path = "../tests/common/rng.rs"]
mod rng;
use rng::Rng;
#[path = "../tests/common/golden.rs"]
mod golden;
use golden::{bytes, Le, Tensors};

/// Exact ties of the int8/int4 grids, zeros, tiny values, outliers.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut r = Rng(seed);
    (0..n)
        .map(|i| match i % 7 {
            0 => 0.0,
            1 => ((r.next() % 509) as f32 * 0.5 - 127.0) * scale,
            2 => (r.unit() - 0.5) * 1e-3 * scale,
            3 => (r.unit() - 0.5) * 400.0 * scale,
            _ => (r.unit() - 0.5) * 8.0 * scale,
        })
        .collect()
}

fn fmt_name(f: DynFormat) -> &'static str {
    match f {
        DynFormat::Int8PerTensor => "int8_per_tensor",
        DynFormat::Int8PerRow => "int8_per_row",
        DynFormat::Int4PerTensor => "int4_per_tensor",
    }
}

fn mode_json(m: ScaleMode) -> String {
    match m {
        ScaleMode::MaxAbs => "null".into(),
        ScaleMode::Percentile(p) => format!("{p:?}"),
    }
}

fn dynamic<T: Le>(
    x: &[T],
    shape: &[usize],
    f: DynFormat,
    m: ScaleMode,
    i: usize,
    out: &mut Tensors,
) -> String {
    let n = x.len();
    let mut s = vec![0f32; num_scales(shape, f)];
    let mut deq = vec![0f32; n];
    let group = if f == DynFormat::Int8PerRow {
        shape[1]
    } else {
        n
    };
    let data = if f == DynFormat::Int4PerTensor {
        let mut d = vec![0u8; packed_len(n)];
        dynamic_quantize(x, shape, f, m, DynCodesMut::Int4(&mut d), &mut s).unwrap();
        dequantize_groups(DynCodes::Int4(&d), group, &s, &mut deq).unwrap();
        (Dtype::U8, vec![d.len()], d)
    } else {
        let mut d = vec![0i8; n];
        dynamic_quantize(x, shape, f, m, DynCodesMut::Int8(&mut d), &mut s).unwrap();
        dequantize_groups(DynCodes::Int8(&d), group, &s, &mut deq).unwrap();
        (Dtype::I8, vec![n], d.iter().map(|&v| v as u8).collect())
    };
    let scale127 = compute_scale(x, 127.0, m).unwrap();
    let mae = quantization_mae(x, &deq).unwrap();
    out.push((format!("c{i}.mae"), Dtype::F32, vec![], bytes(&[mae])));
    out.push((format!("c{i}.x"), T::DTYPE, shape.to_vec(), bytes(x)));
    out.push((format!("c{i}.data"), data.0, data.1, data.2));
    out.push((format!("c{i}.scales"), Dtype::F32, vec![s.len()], bytes(&s)));
    out.push((format!("c{i}.deq"), Dtype::F32, shape.to_vec(), bytes(&deq)));
    out.push((
        format!("c{i}.scale127"),
        Dtype::F32,
        vec![],
        bytes(&[scale127]),
    ));
    format!(
        r#"{{"case": "c{i}", "kind": "dynamic", "shape": {shape:?}, "format": "{}", "p": {}}}"#,
        fmt_name(f),
        mode_json(m)
    )
}

fn bitnet<T: Le>(
    x: &[T],
    shape: &[usize],
    bits: u32,
    per_token: bool,
    i: usize,
    out: &mut Tensors,
) -> String {
    let (b, s) = (shape[0], if shape.len() == 3 { shape[1] } else { 1 });
    let groups = if per_token { b * s } else { b };
    let n = x.len();
    let group = n.checked_div(groups).unwrap_or(0);
    let (mut c, mut sc) = (vec![0i8; n], vec![0f32; groups]);
    quantize_activations(x, group, bits, &mut c, &mut sc).unwrap();
    let mut deq = vec![0f32; n];
    dequantize_groups(DynCodes::Int8(&c), group, &sc, &mut deq).unwrap();
    out.push((format!("b{i}.x"), T::DTYPE, shape.to_vec(), bytes(x)));
    out.push((
        format!("b{i}.data"),
        Dtype::I8,
        shape.to_vec(),
        c.iter().map(|&v| v as u8).collect(),
    ));
    out.push((format!("b{i}.scales"), Dtype::F32, vec![groups], bytes(&sc)));
    out.push((format!("b{i}.deq"), Dtype::F32, shape.to_vec(), bytes(&deq)));
    format!(
        r#"{{"case": "b{i}", "kind": "bitnet", "shape": {shape:?}, "bits": {bits}, "per_token": {per_token}}}"#
    )
}

fn main() {
    let mut t = Tensors::new();
    let mut cases = Vec::new();
    let modes = [
        ScaleMode::MaxAbs,
        ScaleMode::Percentile(0.99),
        ScaleMode::Percentile(0.9),
    ];
    let formats = [
        DynFormat::Int8PerTensor,
        DynFormat::Int8PerRow,
        DynFormat::Int4PerTensor,
    ];
    let mut i = 0;
    for (k, f) in formats.into_iter().enumerate() {
        for (j, m) in modes.into_iter().enumerate() {
            let seed = (10 * k + j) as u64 + 1;
            cases.push(dynamic(
                &values(13 * 17, seed, 0.01),
                &[13, 17],
                f,
                m,
                i,
                &mut t,
            ));
            let h: Vec<f16> = values(7 * 43, seed + 100, 0.05)
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect();
            cases.push(dynamic(&h, &[7, 43], f, m, i + 1, &mut t));
            let b: Vec<bf16> = values(5 * 9, seed + 200, 3.0)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();
            cases.push(dynamic(&b, &[5, 9], f, m, i + 2, &mut t));
            let d: Vec<f64> = values(4 * 33, seed + 300, 1.0)
                .iter()
                .map(|&v| v as f64 * (1.0 + 1e-9))
                .collect();
            cases.push(dynamic(&d, &[4, 33], f, m, i + 3, &mut t));
            cases.push(dynamic::<f32>(&[], &[3, 0], f, m, i + 4, &mut t));
            i += 5;
        }
    }
    let mut i = 0;
    for bits in [8, 4, 2] {
        for per_token in [true, false] {
            let seed = 1000 + bits as u64 * 10 + per_token as u64;
            cases.push(bitnet(
                &values(4 * 37, seed, 0.1),
                &[4, 37],
                bits,
                per_token,
                i,
                &mut t,
            ));
            let h: Vec<f16> = values(2 * 3 * 29, seed + 7, 0.3)
                .iter()
                .map(|&v| f16::from_f32(v))
                .collect();
            cases.push(bitnet(&h, &[2, 3, 29], bits, per_token, i + 1, &mut t));
            cases.push(bitnet::<f32>(
                &[0.0; 6],
                &[2, 3],
                bits,
                per_token,
                i + 2,
                &mut t,
            ));
            i += 3;
        }
    }
    for (i, alpha) in [0.0f32, 0.5, 0.8, 1.0].into_iter().enumerate() {
        let a = values(9 * 21, 2000 + i as u64, 2.0);
        let w = values(5 * 21, 3000 + i as u64, 0.05);
        let c = SmoothQuantConfig::new(alpha, 1e-5).unwrap();
        let s = compute_smooth_factors(&a, &w, 21, &c).unwrap();
        t.push((format!("s{i}.a"), Dtype::F32, vec![9, 21], bytes(&a)));
        t.push((format!("s{i}.w"), Dtype::F32, vec![5, 21], bytes(&w)));
        t.push((format!("s{i}.factors"), Dtype::F32, vec![21], bytes(&s)));
        cases.push(format!(
            r#"{{"case": "s{i}", "kind": "smooth", "alpha": {alpha:?}, "epsilon": 1e-05}}"#
        ));
    }
    // W8A8: odd lengths, extreme weight bytes, a sum past i32 (2 x 140,000).
    for (i, (o, k, tokens)) in [
        (7, 65, 0),
        (5, 131, 3),
        (3, 1, 2),
        (2, 140_000, 0),
        (9, 300, 5),
    ]
    .into_iter()
    .enumerate()
    {
        let mut r = Rng(4000 + i as u64);
        let w: Vec<i8> = (0..o * k)
            .map(|j| match j % 5 {
                0 => -128,
                1 => 127,
                _ => r.next() as u8 as i8,
            })
            .collect();
        let ws: Vec<f32> = (0..o).map(|j| 1e-3 * (1 + j) as f32).collect();
        let rows = tokens.max(1);
        let x = if k > 100_000 {
            vec![1.0f32; k]
        } else {
            values(rows * k, 5000 + i as u64, 0.5)
        };
        let mut out = vec![0f32; rows * o];
        let shape = if tokens == 0 {
            w8a8_matvec(&w, [o, k], &ws, &x, &mut out).unwrap();
            vec![k]
        } else {
            w8a8_matmul(&w, [o, k], &ws, &x, tokens, &mut out).unwrap();
            vec![tokens, k]
        };
        let wb: Vec<u8> = w.iter().map(|&v| v as u8).collect();
        t.push((format!("w{i}.weight"), Dtype::I8, vec![o, k], wb));
        t.push((format!("w{i}.scales"), Dtype::F32, vec![o], bytes(&ws)));
        t.push((format!("w{i}.x"), Dtype::F32, shape, bytes(&x)));
        t.push((
            format!("w{i}.out"),
            Dtype::F32,
            vec![out.len()],
            bytes(&out),
        ));
        cases.push(format!(
            r#"{{"case": "w{i}", "kind": "w8a8", "tokens": {tokens}}}"#
        ));
    }
    // CalibStats over batches of uneven sizes (one past the parallel threshold).
    for (i, sizes) in [vec![1000usize, 70_000, 5], vec![300_000, 17], vec![1]]
        .into_iter()
        .enumerate()
    {
        let x = values(sizes.iter().sum(), 6000 + i as u64, 1.0);
        let mut batches = Vec::new();
        let mut at = 0;
        for &n in &sizes {
            batches.push(&x[at..at + n]);
            at += n;
        }
        let s = CalibStats::collect(&batches).unwrap();
        let stats = [s.min, s.max, s.mean, s.std_dev, s.p99, s.suggested_scale];
        t.push((format!("k{i}.x"), Dtype::F32, vec![x.len()], bytes(&x)));
        t.push((format!("k{i}.stats"), Dtype::F32, vec![6], bytes(&stats)));
        cases.push(format!(
            r#"{{"case": "k{i}", "kind": "calib", "sizes": {sizes:?}}}"#
        ));
    }
    golden::write("dynamic.safetensors", &t, &cases);
}
