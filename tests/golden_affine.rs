//! The affine kernels still reproduce tests/golden/affine.safetensors (written
//! by `cargo run --example write_golden_affine`) bit for bit; pytest checks the
//! same file against the wheel.

use ferroquant::ops::affine::{dequantize, num_groups, quantize, Codes, CodesMut, QuantConfig};
use ferroquant::ops::pack::packed_len;
use ferroquant::Float;
use half::{bf16, f16};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

const GOLDEN: &[u8] = include_bytes!("golden/affine.safetensors");

fn decode<T: Copy, const N: usize>(b: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    b.chunks(N).map(|c| f(c.try_into().unwrap())).collect()
}

fn le<T: Float>(v: &[T]) -> Vec<u8> {
    // Every Float is stored little-endian in its own width.
    v.iter()
        .flat_map(|e| {
            let b = e.to_f64();
            match std::mem::size_of::<T>() {
                8 => b.to_le_bytes().to_vec(),
                4 => (b as f32).to_le_bytes().to_vec(),
                _ => {
                    if T::NAME == "float16" {
                        f16::from_f64(b).to_le_bytes().to_vec()
                    } else {
                        bf16::from_f64(b).to_le_bytes().to_vec()
                    }
                }
            }
        })
        .collect()
}

fn check<T: Float>(x: &[T], shape: &[usize], c: QuantConfig, st: &SafeTensors<'_>, case: &str) {
    let want = |k: &str| st.tensor(&format!("{case}.{k}")).unwrap().data().to_vec();
    let n = x.len();
    let g = num_groups(shape, c.granularity);
    let (mut s, mut z) = (vec![0f64; g], vec![0f64; g]);
    let mut deq = vec![T::from_f64_once(0.0); n];
    let data: Vec<u8> = if c.qmax() == 127.0 {
        let mut d = vec![0i8; n];
        quantize(x, shape, &c, CodesMut::Int8(&mut d), &mut s, &mut z).unwrap();
        dequantize(Codes::Int8(&d), shape, &c, &s, &z, &mut deq).unwrap();
        d.iter().map(|&v| v as u8).collect()
    } else {
        let mut d = vec![0u8; packed_len(n)];
        quantize(x, shape, &c, CodesMut::Int4(&mut d), &mut s, &mut z).unwrap();
        dequantize(Codes::Int4(&d), shape, &c, &s, &z, &mut deq).unwrap();
        d
    };
    let f64s = |v: &[f64]| v.iter().flat_map(|e| e.to_le_bytes()).collect::<Vec<u8>>();
    assert_eq!(data, want("data"), "{case} data");
    assert_eq!(f64s(&s), want("scales"), "{case} scales");
    assert_eq!(f64s(&z), want("zero_points"), "{case} zero points");
    assert_eq!(le(&deq), want("deq"), "{case} deq");
}

#[test]
fn affine_kernels_reproduce_the_golden_vectors() {
    let st = SafeTensors::deserialize(GOLDEN).unwrap();
    let (_, meta) = SafeTensors::read_metadata(GOLDEN).unwrap();
    let cases = &meta.metadata().as_ref().expect("metadata")["cases"];
    let cases: Vec<serde_json::Value> = serde_json::from_str(cases).unwrap();
    assert_eq!(cases.len(), 48);
    for p in &cases {
        let case = p["case"].as_str().unwrap();
        let shape: Vec<usize> = serde_json::from_value(p["shape"].clone()).unwrap();
        let c = QuantConfig::from_names(
            p["bits"].as_u64().unwrap() as u32,
            p["mode"].as_str().unwrap(),
            p["granularity"].as_str().unwrap(),
        )
        .unwrap();
        let x = st.tensor(&format!("{case}.x")).unwrap();
        match x.dtype() {
            Dtype::F32 => check(&decode(x.data(), f32::from_le_bytes), &shape, c, &st, case),
            Dtype::F64 => check(&decode(x.data(), f64::from_le_bytes), &shape, c, &st, case),
            Dtype::F16 => check(&decode(x.data(), f16::from_le_bytes), &shape, c, &st, case),
            Dtype::BF16 => check(&decode(x.data(), bf16::from_le_bytes), &shape, c, &st, case),
            other => panic!("unexpected input dtype {other:?}"),
        }
    }
}
