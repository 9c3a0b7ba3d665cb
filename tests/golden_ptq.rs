//! The §5 kernels still reproduce tests/golden/ptq.safetensors (written by
//! `cargo run --example write_golden_ptq`) bit for bit; pytest checks the same
//! file against the wheel.

use ferroquant::ops::f16bits::{fp16_bits_to_fp32, fp32_to_fp16_bits};
use ferroquant::ops::ptq::{
    quantize_model_weights, weight_range, QuantizedModel, QuantizedWeights,
};
use ferroquant::Float;
use half::{bf16, f16};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

const GOLDEN: &[u8] = include_bytes!("golden/ptq.safetensors");

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn le<T: Copy>(v: &[T], f: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    v.iter().flat_map(|&e| f(e)).collect()
}

/// `QuantizedWeights::from_f32` of one input type: codes, scale, values, range.
fn weights_case<T: Float>(st: &SafeTensors<'_>, case: &str, c: &serde_json::Value, w: Vec<T>) {
    let field = |k: &str| {
        st.tensor(&format!("{case}.{k}"))
            .ok()
            .map(|t| t.data().to_vec())
    };
    let shape: Vec<usize> = serde_json::from_value(c["shape"].clone()).unwrap();
    let scale = c["scale"].as_f64().map(|s| s as f32);
    let bias = field("bias").map(|b| f32s(&b));
    let qw = QuantizedWeights::from_f32(case.into(), &w, shape, bias, scale).unwrap();
    let codes: Vec<u8> = qw.weights_i8.iter().map(|&q| q as u8).collect();
    assert_eq!(codes, field("codes").unwrap(), "{case}");
    assert_eq!(
        qw.scale.to_le_bytes().to_vec(),
        field("scale").unwrap(),
        "{case}"
    );
    if let Some(deq) = field("deq") {
        assert_eq!(
            le(&qw.dequantize(), |v| v.to_le_bytes().to_vec()),
            deq,
            "{case}"
        );
    }
    if let Some(range) = field("range") {
        let (lo, hi) = weight_range(&w).unwrap();
        assert_eq!(f32s(&range), vec![lo, hi], "{case}");
    }
}

#[test]
fn ptq_golden_vectors_are_reproduced() {
    let st = SafeTensors::deserialize(GOLDEN).unwrap();
    let (_, meta) = SafeTensors::read_metadata(GOLDEN).unwrap();
    let cases: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["cases"]).unwrap();
    let field = |c: &str, k: &str| st.tensor(&format!("{c}.{k}")).unwrap().data().to_vec();
    let mut kinds = std::collections::BTreeMap::new();
    for c in cases.as_array().unwrap() {
        let case = c["case"].as_str().unwrap();
        let kind = c["kind"].as_str().unwrap();
        *kinds.entry(kind.to_string()).or_insert(0) += 1;
        match kind {
            "f16bits" => {
                let x = f32s(&field(case, "x"));
                let mut bits = vec![0u16; x.len()];
                fp32_to_fp16_bits(&x, &mut bits).unwrap();
                assert_eq!(le(&bits, |v| v.to_le_bytes().to_vec()), field(case, "bits"));
                let bits_in: Vec<u16> = field(case, "bits_in")
                    .chunks(2)
                    .map(|b| u16::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                let mut values = vec![0f32; bits_in.len()];
                fp16_bits_to_fp32(&bits_in, &mut values).unwrap();
                assert_eq!(
                    le(&values, |v| v.to_le_bytes().to_vec()),
                    field(case, "values")
                );
            }
            "weights" => {
                let t = st.tensor(&format!("{case}.w")).unwrap();
                let raw = t.data();
                match t.dtype() {
                    Dtype::F32 => weights_case(&st, case, c, f32s(raw)),
                    Dtype::F64 => {
                        let w = raw
                            .chunks(8)
                            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                            .collect();
                        weights_case::<f64>(&st, case, c, w)
                    }
                    Dtype::F16 => {
                        let w = raw
                            .chunks(2)
                            .map(|b| f16::from_le_bytes(b.try_into().unwrap()))
                            .collect();
                        weights_case::<f16>(&st, case, c, w)
                    }
                    Dtype::BF16 => {
                        let w = raw
                            .chunks(2)
                            .map(|b| bf16::from_le_bytes(b.try_into().unwrap()))
                            .collect();
                        weights_case::<bf16>(&st, case, c, w)
                    }
                    other => panic!("{case}: unexpected dtype {other:?}"),
                }
            }
            "model" => {
                let shapes: Vec<Vec<usize>> = serde_json::from_value(c["shapes"].clone()).unwrap();
                let biases: Vec<bool> = serde_json::from_value(c["biases"].clone()).unwrap();
                let layers = shapes.iter().zip(&biases).enumerate().map(|(k, (s, &b))| {
                    let w = f32s(&field(case, &format!("w{k}")));
                    let bias = b.then(|| f32s(&field(case, &format!("b{k}"))));
                    (format!("layer.{k}"), w, s.clone(), bias)
                });
                let config = c["config_json"].as_str().unwrap().to_string();
                let model = quantize_model_weights(config, layers).unwrap();
                let want = field(case, "json");
                assert_eq!(model.to_json().unwrap().into_bytes(), want, "{case}");
                assert_eq!(QuantizedModel::from_json(&want).unwrap(), model, "{case}");
            }
            "seed_model" => {
                let model = QuantizedModel::from_json(&field(case, "json")).unwrap();
                assert_eq!(model.layers[0].weights_i8, vec![1, -2, 3]);
                assert_eq!(model.to_json().unwrap().into_bytes(), field(case, "json"));
            }
            other => panic!("unknown case kind {other}"),
        }
    }
    let want: std::collections::BTreeMap<String, i32> = [
        ("f16bits", 3),
        ("weights", 8),
        ("model", 1),
        ("seed_model", 1),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(kinds, want);
}
