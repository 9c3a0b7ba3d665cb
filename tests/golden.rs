//! The kernels still reproduce the committed golden vectors bit for bit
//! (tests/golden/*.safetensors, written by `cargo run --example write_golden`).
//! pytest checks the same file against the wheel, so Rust and Python agree.

use ferroquant::ops::blockwise::{
    dequantize_blockwise, num_blocks, quantize_blockwise, Scales, ScalesMut,
};
use ferroquant::Float;
use half::{bf16, f16};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;

const GOLDEN: &[u8] = include_bytes!("golden/blockwise.safetensors");

fn decode<T: Copy, const N: usize>(b: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    b.chunks(N).map(|c| f(c.try_into().unwrap())).collect()
}

fn check<T: Float>(x: &[T], st: &SafeTensors<'_>, case: &str, block: usize, f32_scales: bool) {
    let n = x.len();
    let mut codes = vec![0i8; n];
    let mut deq = vec![0f32; n];
    let nb = num_blocks(n, block);
    let scale_bytes: Vec<u8> = if f32_scales {
        let mut s = vec![0f32; nb];
        quantize_blockwise(x, block, &mut codes, ScalesMut::F32(&mut s)).unwrap();
        dequantize_blockwise(&codes, block, Scales::F32(&s), &mut deq).unwrap();
        s.iter().flat_map(|v| v.to_le_bytes()).collect()
    } else {
        let mut s = vec![f16::ZERO; nb];
        quantize_blockwise(x, block, &mut codes, ScalesMut::F16(&mut s)).unwrap();
        dequantize_blockwise(&codes, block, Scales::F16(&s), &mut deq).unwrap();
        s.iter().flat_map(|v| v.to_le_bytes()).collect()
    };
    let want = |k: &str| st.tensor(&format!("{case}.{k}")).unwrap().data().to_vec();
    let code_bytes: Vec<u8> = codes.iter().map(|&c| c as u8).collect();
    assert_eq!(code_bytes, want("codes"), "{case} codes");
    assert_eq!(scale_bytes, want("scales"), "{case} scales");
    let deq_bytes: Vec<u8> = deq.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(deq_bytes, want("deq"), "{case} deq");
}

#[test]
fn kernels_reproduce_the_golden_vectors() {
    let st = SafeTensors::deserialize(GOLDEN).unwrap();
    let (_, meta) = SafeTensors::read_metadata(GOLDEN).unwrap();
    let cases = &meta.metadata().as_ref().expect("metadata")["cases"];
    let cases: Vec<serde_json::Value> = serde_json::from_str(cases).unwrap();
    assert!(cases.len() >= 9, "golden file lists its cases");
    for params in &cases {
        let case = params["case"].as_str().unwrap();
        let block = params["block_size"].as_u64().unwrap() as usize;
        let f32_scales = params["scale_dtype"] == "float32";
        let x = st.tensor(&format!("{case}.x")).unwrap();
        match x.dtype() {
            Dtype::F32 => check(
                &decode(x.data(), f32::from_le_bytes),
                &st,
                case,
                block,
                f32_scales,
            ),
            Dtype::F64 => check(
                &decode(x.data(), f64::from_le_bytes),
                &st,
                case,
                block,
                f32_scales,
            ),
            Dtype::F16 => check(
                &decode(x.data(), f16::from_le_bytes),
                &st,
                case,
                block,
                f32_scales,
            ),
            Dtype::BF16 => check(
                &decode(x.data(), bf16::from_le_bytes),
                &st,
                case,
                block,
                f32_scales,
            ),
            other => panic!("unexpected input dtype {other:?}"),
        }
    }
}
