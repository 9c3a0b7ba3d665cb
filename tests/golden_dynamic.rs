//! The activation kernels still reproduce tests/golden/dynamic.safetensors
//! (written by `cargo run --example write_golden_dynamic`) bit for bit;
//! pytest checks the same file against the wheel.

use ferroquant::ops::bitnet::quantize_activations;
use ferroquant::ops::calib::CalibStats;
use ferroquant::ops::dynamic::{
    compute_scale, dequantize_groups, dynamic_quantize, num_scales, quantization_mae, DynCodes,
    DynCodesMut, DynFormat, ScaleMode,
};
use ferroquant::ops::pack::packed_len;
use ferroquant::ops::smooth::{compute_smooth_factors, SmoothQuantConfig};
use ferroquant::ops::w8a8::{w8a8_matmul, w8a8_matvec};
use ferroquant::Float;
use half::{bf16, f16};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

const GOLDEN: &[u8] = include_bytes!("golden/dynamic.safetensors");

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|e| e.to_le_bytes()).collect()
}

fn decode<T: Copy, const N: usize>(b: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    b.chunks(N).map(|c| f(c.try_into().unwrap())).collect()
}

fn field<'a>(st: &'a SafeTensors<'a>, case: &str, k: &str) -> Vec<u8> {
    st.tensor(&format!("{case}.{k}")).unwrap().data().to_vec()
}

fn check_dynamic<T: Float>(
    x: &[T],
    shape: &[usize],
    f: DynFormat,
    m: ScaleMode,
    st: &SafeTensors<'_>,
    case: &str,
) {
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
        d
    } else {
        let mut d = vec![0i8; n];
        dynamic_quantize(x, shape, f, m, DynCodesMut::Int8(&mut d), &mut s).unwrap();
        dequantize_groups(DynCodes::Int8(&d), group, &s, &mut deq).unwrap();
        d.iter().map(|&v| v as u8).collect()
    };
    assert_eq!(data, field(st, case, "data"), "{case} data");
    assert_eq!(f32s(&s), field(st, case, "scales"), "{case} scales");
    assert_eq!(f32s(&deq), field(st, case, "deq"), "{case} deq");
    let s127 = compute_scale(x, 127.0, m).unwrap();
    assert_eq!(f32s(&[s127]), field(st, case, "scale127"), "{case} scale");
    let mae = quantization_mae(x, &deq).unwrap();
    assert_eq!(f32s(&[mae]), field(st, case, "mae"), "{case} mae");
}

fn with_input(st: &SafeTensors<'_>, case: &str, run: &mut dyn FnMut(Input)) {
    let t = st.tensor(&format!("{case}.x")).unwrap();
    match t.dtype() {
        Dtype::F32 => run(Input::F32(decode(t.data(), f32::from_le_bytes))),
        Dtype::F64 => run(Input::F64(decode(t.data(), f64::from_le_bytes))),
        Dtype::F16 => run(Input::F16(decode(t.data(), f16::from_le_bytes))),
        Dtype::BF16 => run(Input::BF16(decode(t.data(), bf16::from_le_bytes))),
        d => panic!("unexpected dtype {d:?}"),
    }
}

enum Input {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

macro_rules! on_input {
    ($input:expr, $x:ident => $body:expr) => {
        match $input {
            Input::F32($x) => $body,
            Input::F64($x) => $body,
            Input::F16($x) => $body,
            Input::BF16($x) => $body,
        }
    };
}

fn usizes(v: &serde_json::Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect()
}

#[test]
fn the_kernels_reproduce_the_golden_file() {
    let st = SafeTensors::deserialize(GOLDEN).unwrap();
    let (_, meta) = SafeTensors::read_metadata(GOLDEN).unwrap();
    let cases: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["cases"]).unwrap();
    let mut seen = 0;
    for c in cases.as_array().unwrap() {
        let case = c["case"].as_str().unwrap();
        match c["kind"].as_str().unwrap() {
            "dynamic" => {
                let shape = usizes(&c["shape"]);
                let f = match c["format"].as_str().unwrap() {
                    "int8_per_tensor" => DynFormat::Int8PerTensor,
                    "int8_per_row" => DynFormat::Int8PerRow,
                    _ => DynFormat::Int4PerTensor,
                };
                let m = c["p"]
                    .as_f64()
                    .map_or(ScaleMode::MaxAbs, ScaleMode::Percentile);
                with_input(
                    &st,
                    case,
                    &mut |input| on_input!(input, x => check_dynamic(&x, &shape, f, m, &st, case)),
                );
            }
            "bitnet" => {
                let shape = usizes(&c["shape"]);
                let bits = c["bits"].as_u64().unwrap() as u32;
                let per_token = c["per_token"].as_bool().unwrap();
                let groups = if per_token {
                    shape[..shape.len() - 1].iter().product()
                } else {
                    shape[0]
                };
                with_input(&st, case, &mut |input| {
                    on_input!(input, x => {
                        let n = x.len();
                        let (mut q, mut s) = (vec![0i8; n], vec![0f32; groups]);
                        quantize_activations(&x, n.checked_div(groups).unwrap_or(0), bits, &mut q, &mut s).unwrap();
                        let q8: Vec<u8> = q.iter().map(|&v| v as u8).collect();
                        assert_eq!(q8, field(&st, case, "data"), "{case}");
                        assert_eq!(f32s(&s), field(&st, case, "scales"), "{case}");
                    })
                });
            }
            "calib" => {
                let x = decode(&field(&st, case, "x"), f32::from_le_bytes);
                let sizes = usizes(&c["sizes"]);
                let mut batches = Vec::new();
                let mut at = 0;
                for n in sizes {
                    batches.push(&x[at..at + n]);
                    at += n;
                }
                let s = CalibStats::collect(&batches).unwrap();
                let stats = [s.min, s.max, s.mean, s.std_dev, s.p99, s.suggested_scale];
                assert_eq!(f32s(&stats), field(&st, case, "stats"), "{case}");
            }
            "w8a8" => {
                let view = st.tensor(&format!("{case}.weight")).unwrap();
                let [o, k] = [view.shape()[0], view.shape()[1]];
                let w: Vec<i8> = view.data().iter().map(|&b| b as i8).collect();
                let ws = decode(&field(&st, case, "scales"), f32::from_le_bytes);
                let x = decode(&field(&st, case, "x"), f32::from_le_bytes);
                let tokens = c["tokens"].as_u64().unwrap() as usize;
                let mut out = vec![0f32; tokens.max(1) * o];
                if tokens == 0 {
                    w8a8_matvec(&w, [o, k], &ws, &x, &mut out).unwrap();
                } else {
                    w8a8_matmul(&w, [o, k], &ws, &x, tokens, &mut out).unwrap();
                }
                assert_eq!(f32s(&out), field(&st, case, "out"), "{case}");
            }
            _ => {
                let a = decode(&field(&st, case, "a"), f32::from_le_bytes);
                let w = decode(&field(&st, case, "w"), f32::from_le_bytes);
                let alpha = c["alpha"].as_f64().unwrap() as f32;
                let cfg = SmoothQuantConfig::new(alpha, 1e-5).unwrap();
                let s = compute_smooth_factors(&a, &w, 21, &cfg).unwrap();
                assert_eq!(f32s(&s), field(&st, case, "factors"), "{case}");
            }
        }
        seen += 1;
    }
    assert_eq!(seen, 75);
}
