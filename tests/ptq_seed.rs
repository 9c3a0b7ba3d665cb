//! SPEC §5 against seed 004 itself: the seed's structs (with its `Vec<i32>`
//! codes) are restated here as the seed declares them, so serde writes the
//! seed's bytes; the crate's files must be those bytes, load where the seed's
//! loader loads them, and pass the seed's own unit tests.

use ferroquant::ops::ptq::{quantize_model_weights, QuantizedModel, QuantizedWeights, SCHEME};
use serde::{Deserialize, Serialize};

/// Seed 004's `QuantizedWeights`, field for field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SeedWeights {
    name: String,
    weights_i8: Vec<i32>,
    shape: Vec<usize>,
    scale: f32,
    bias: Option<Vec<f32>>,
}

/// Seed 004's `QuantizedModel`, field for field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SeedModel {
    config_json: String,
    layers: Vec<SeedWeights>,
    scheme: String,
    total_quantized_bytes: usize,
    total_fp32_bytes: usize,
}

/// The sample model of the seed's `test_save_load_roundtrip`.
fn seed_sample() -> SeedModel {
    SeedModel {
        config_json: "{}".into(),
        layers: vec![SeedWeights {
            name: "l1".into(),
            weights_i8: vec![1, -2, 3],
            shape: vec![1, 3],
            scale: 0.01,
            bias: None,
        }],
        scheme: "symmetric_per_tensor_int8".into(),
        total_quantized_bytes: 3,
        total_fp32_bytes: 12,
    }
}

fn to_seed(m: &QuantizedModel) -> SeedModel {
    SeedModel {
        config_json: m.config_json.clone(),
        layers: m
            .layers
            .iter()
            .map(|l| SeedWeights {
                name: l.name.clone(),
                weights_i8: l.weights_i8.iter().map(|&q| q as i32).collect(),
                shape: l.shape.clone(),
                scale: l.scale,
                bias: l.bias.clone(),
            })
            .collect(),
        scheme: m.scheme.clone(),
        total_quantized_bytes: m.total_quantized_bytes,
        total_fp32_bytes: m.total_fp32_bytes,
    }
}

#[test]
fn the_seeds_sample_model_is_byte_for_byte() {
    let seed_json = serde_json::to_string_pretty(&seed_sample()).unwrap();
    // Typed out from serde_json's pretty printer: two-space indent, ryu's f32 text.
    let expected = "{\n  \"config_json\": \"{}\",\n  \"layers\": [\n    {\n      \"name\": \"l1\",\n      \
        \"weights_i8\": [\n        1,\n        -2,\n        3\n      ],\n      \"shape\": [\n        1,\n        \
        3\n      ],\n      \"scale\": 0.01,\n      \"bias\": null\n    }\n  ],\n  \"scheme\": \
        \"symmetric_per_tensor_int8\",\n  \"total_quantized_bytes\": 3,\n  \"total_fp32_bytes\": 12\n}";
    assert_eq!(seed_json, expected);
    let ours = QuantizedModel::from_json(seed_json.as_bytes()).unwrap();
    assert_eq!(ours.layers[0].weights_i8, vec![1, -2, 3]);
    assert_eq!(ours.layers[0].scale, 0.01);
    assert_eq!(ours.to_json().unwrap(), seed_json);
}

#[test]
fn quantized_models_serialize_as_the_seed_would_and_load_there() {
    let layers = (0..4).map(|k| {
        let n = 6 * (k + 1);
        let w: Vec<f32> = (0..n)
            .map(|i| ((i * 37 + k * 11) % 23) as f32 * 0.173 - 1.9)
            .collect();
        let bias = (k % 2 == 0).then(|| vec![-0.0, 0.1, 12345.679][..(k / 2 + 1)].to_vec());
        let shape = vec![k / 2 + 1, n / (k / 2 + 1)];
        (format!("enc.{k} \u{2028}\"q\""), w, shape, bias)
    });
    let config = "{\"d\": 1e-45, \"s\": \"\u{1}\\\"\"}".to_string();
    let model = quantize_model_weights(config, layers).unwrap();
    let ours = model.to_json().unwrap();
    let seed = serde_json::to_string_pretty(&to_seed(&model)).unwrap();
    assert_eq!(ours, seed);
    // The seed's loader reads our file into its own structs, unchanged.
    let back: SeedModel = serde_json::from_str(&ours).unwrap();
    assert_eq!(back, to_seed(&model));
    assert_eq!(model.scheme, SCHEME);
}

#[test]
fn f32_text_is_ryus_as_when_the_seed_was_written() {
    // serde_json printed f32 with ryu; releases since print large values as
    // `1e+16`. The crate pins ryu's text: these strings are what ryu prints.
    let values = [
        1e-8f32,
        1e-45,
        1e16,
        3.402_823_5e38,
        1.5e-5,
        0.1,
        1e7,
        -0.0,
        2.5e-7,
    ];
    let text = [
        "1e-8",
        "1e-45",
        "1e16",
        "3.4028235e38",
        "0.000015",
        "0.1",
        "10000000.0",
        "-0.0",
        "2.5e-7",
    ];
    let model = QuantizedModel {
        config_json: String::new(),
        layers: vec![QuantizedWeights {
            name: "a".into(),
            weights_i8: vec![0; values.len()],
            shape: vec![values.len()],
            scale: 1e-8,
            bias: Some(values.to_vec()),
        }],
        scheme: SCHEME.into(),
        total_quantized_bytes: 0,
        total_fp32_bytes: 0,
    };
    let json = model.to_json().unwrap();
    let bias: Vec<&str> = json
        .split("\"bias\": [")
        .nth(1)
        .unwrap()
        .split(']')
        .next()
        .unwrap()
        .split(',')
        .map(str::trim)
        .collect();
    assert_eq!(bias, text);
    assert!(json.contains("\"scale\": 1e-8,"));
    assert_eq!(QuantizedModel::from_json(json.as_bytes()).unwrap(), model);
}

#[test]
fn the_seeds_unit_tests_pass() {
    // test_quantize_roundtrip
    let weights: Vec<f32> = (0..100).map(|i| i as f32 * 0.01 - 0.5).collect();
    let qw = QuantizedWeights::from_f32("test".into(), &weights, vec![10, 10], None, None).unwrap();
    let dq = qw.dequantize();
    assert_eq!(dq.len(), weights.len());
    let max_err = weights
        .iter()
        .zip(&dq)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        max_err <= qw.scale / 2.0 + 1e-6,
        "{max_err} > {}",
        qw.scale / 2.0
    );
    // test_compression_ratio
    let ones = vec![1.0f32; 1024];
    let qw = QuantizedWeights::from_f32("test".into(), &ones, vec![32, 32], None, None).unwrap();
    assert!((qw.compression_ratio() - 4.0).abs() < 1e-5);
    // test_save_load_roundtrip, through a file
    let path =
        std::env::temp_dir().join(format!("ferroquant-ptq-seed-{}.json", std::process::id()));
    let sample: QuantizedModel =
        serde_json::from_str(&serde_json::to_string(&seed_sample()).unwrap()).unwrap();
    sample.save(&path).unwrap();
    let loaded = QuantizedModel::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(loaded.layers[0].name, "l1");
    assert_eq!(loaded.layers[0].weights_i8, vec![1, -2, 3]);
}

#[test]
fn what_the_seed_would_misread_is_refused() {
    let mut bad = serde_json::to_value(seed_sample()).unwrap();
    bad["layers"][0]["weights_i8"] = serde_json::json!([1, 200, 3]);
    let err = QuantizedModel::from_json(bad.to_string().as_bytes()).unwrap_err();
    assert!(err.to_string().contains("i8"), "{err}");
    let mut short = serde_json::to_value(seed_sample()).unwrap();
    short["layers"][0]["shape"] = serde_json::json!([2, 3]);
    let err = QuantizedModel::from_json(short.to_string().as_bytes()).unwrap_err();
    assert!(err.to_string().contains("weights_i8"), "{err}");
    let mut extra = serde_json::to_value(seed_sample()).unwrap();
    extra["layers"][0]["zero_point"] = serde_json::json!(0);
    assert!(QuantizedModel::from_json(extra.to_string().as_bytes()).is_err());
    let dup =
        "{\"config_json\": \"{}\", \"config_json\": \"{}\", \"layers\": [], \"scheme\": \"s\", \
               \"total_quantized_bytes\": 0, \"total_fp32_bytes\": 0}";
    assert!(QuantizedModel::from_json(dup.as_bytes()).is_err());
}
