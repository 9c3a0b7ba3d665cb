//! The §5 kernels still reproduce tests/golden/ptq.safetensors (written by
//! `cargo run --example write_golden_ptq`) bit for bit; pytest checks the same
//! file against the wheel.

use ferroquant::ops::f16bits::{fp16_bits_to_fp32, fp32_to_fp16_bits};
use safetensors::SafeTensors;

const GOLDEN: &[u8] = include_bytes!("golden/ptq.safetensors");

#[test]
fn ptq_golden_vectors_are_reproduced() {
    let st = SafeTensors::deserialize(GOLDEN).unwrap();
    let (_, meta) = SafeTensors::read_metadata(GOLDEN).unwrap();
    let cases: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["cases"]).unwrap();
    let field = |c: &str, k: &str| st.tensor(&format!("{c}.{k}")).unwrap().data().to_vec();
    let mut seen = 0;
    for c in cases.as_array().unwrap() {
        let case = c["case"].as_str().unwrap();
        assert_eq!(c["kind"], "f16bits");
        let x: Vec<f32> = field(case, "x")
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let mut bits = vec![0u16; x.len()];
        fp32_to_fp16_bits(&x, &mut bits).unwrap();
        let bits_le: Vec<u8> = bits.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(bits_le, field(case, "bits"), "{case}");
        let bits_in: Vec<u16> = field(case, "bits_in")
            .chunks(2)
            .map(|b| u16::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let mut values = vec![0f32; bits_in.len()];
        fp16_bits_to_fp32(&bits_in, &mut values).unwrap();
        let values_le: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(values_le, field(case, "values"), "{case}");
        seen += 1;
    }
    assert_eq!(seen, 3);
}
