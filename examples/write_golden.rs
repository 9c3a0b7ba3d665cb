//! Writes `tests/golden/blockwise.safetensors`: inputs and the Rust kernels'
//! outputs, bit for bit, for pytest to reproduce through the wheel
//! (`cargo run --example write_golden`, or `make golden`).
//!
//! Each case `c{i}` stores `c{i}.x` (the input, in its own dtype),
//! `c{i}.codes`, `c{i}.scales` and `c{i}.deq`; the one metadata entry `cases`
//! is a JSON array of each case's parameters (name, shape, block_size,
//! scale_dtype, lossy_blocks), one key so that the file is byte-reproducible.

use ferroquant::ops::blockwise::{
    dequantize_blockwise, num_blocks, quantize_blockwise, Scales, ScalesMut,
};
use ferroquant::Float;
use half::{bf16, f16};
use safetensors::tensor::Dtype;

// The parity tests' generator: deterministic, so the file only changes when the kernels do.
#[path = "../tests/common/rng.rs"]
mod rng;
use rng::Rng;
#[path = "../tests/common/golden.rs"]
mod golden;

/// Mixed values: noise, exact .5 ties (block max pinned to 127), near-ties, zeros.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut r = Rng(seed);
    (0..n)
        .map(|i| match i % 9 {
            0 => 127.0 * scale,
            1 => ((r.next() % 254) as f32 - 127.0 + 0.5) * scale,
            2 => f32::from_bits(0.5f32.to_bits() - 1) * scale,
            3 => 0.0,
            _ => (r.unit() - 0.5) * 200.0 * scale,
        })
        .collect()
}

struct Case {
    x: (Dtype, Vec<u8>),
    shape: Vec<usize>,
    block: usize,
    f32_scales: bool,
}

fn bytes<T: Copy>(v: &[T], to: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
    v.iter().flat_map(|&e| to(e)).collect()
}

fn run<T: Float>(
    x: &[T],
    case: &Case,
    out: &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    i: usize,
) -> String {
    let n = x.len();
    let nb = num_blocks(n, case.block);
    let mut codes = vec![0i8; n];
    let mut deq = vec![0f32; n];
    let (scale_bytes, dt, lossy) = if case.f32_scales {
        let mut s = vec![0f32; nb];
        let r = quantize_blockwise(x, case.block, &mut codes, ScalesMut::F32(&mut s)).unwrap();
        dequantize_blockwise(&codes, case.block, Scales::F32(&s), &mut deq).unwrap();
        (
            bytes(&s, |v| v.to_le_bytes().to_vec()),
            Dtype::F32,
            r.lossy_blocks,
        )
    } else {
        let mut s = vec![f16::ZERO; nb];
        let r = quantize_blockwise(x, case.block, &mut codes, ScalesMut::F16(&mut s)).unwrap();
        dequantize_blockwise(&codes, case.block, Scales::F16(&s), &mut deq).unwrap();
        (
            bytes(&s, |v| v.to_le_bytes().to_vec()),
            Dtype::F16,
            r.lossy_blocks,
        )
    };
    out.push((
        format!("c{i}.codes"),
        Dtype::I8,
        vec![n],
        bytes(&codes, |v| vec![v as u8]),
    ));
    out.push((format!("c{i}.scales"), dt, vec![nb], scale_bytes));
    out.push((
        format!("c{i}.deq"),
        Dtype::F32,
        case.shape.clone(),
        bytes(&deq, |v| v.to_le_bytes().to_vec()),
    ));
    format!(
        r#"{{"case": "c{i}", "shape": {:?}, "block_size": {}, "scale_dtype": "{}", "lossy_blocks": {}}}"#,
        case.shape,
        case.block,
        if case.f32_scales {
            "float32"
        } else {
            "float16"
        },
        lossy
    )
}

fn main() {
    let f32b = |v: &[f32]| bytes(v, |e| e.to_le_bytes().to_vec());
    let mut cases = vec![
        Case {
            x: (Dtype::F32, f32b(&values(1000, 1, 1.0))),
            shape: vec![1000],
            block: 64,
            f32_scales: false,
        },
        Case {
            x: (Dtype::F32, f32b(&values(13 * 17, 2, 0.01))),
            shape: vec![13, 17],
            block: 7,
            f32_scales: true,
        },
        Case {
            x: (Dtype::F32, f32b(&values(4 * 3 * 33, 3, 3.0e-5))),
            shape: vec![4, 3, 33],
            block: 16,
            f32_scales: false,
        },
        Case {
            x: (Dtype::F32, f32b(&values(70_001, 4, 50.0))),
            shape: vec![70_001],
            block: 64,
            f32_scales: false,
        },
        Case {
            x: (Dtype::F32, f32b(&[0.0; 130])),
            shape: vec![130],
            block: 64,
            f32_scales: false,
        },
        Case {
            x: (Dtype::F32, f32b(&values(1, 5, 1.0))),
            shape: vec![],
            block: 64,
            f32_scales: false,
        },
    ];
    let v = values(513, 6, 2.0);
    let h: Vec<f16> = v.iter().map(|&e| f16::from_f32(e)).collect();
    cases.push(Case {
        x: (Dtype::F16, bytes(&h, |e| e.to_le_bytes().to_vec())),
        shape: vec![27, 19],
        block: 32,
        f32_scales: false,
    });
    let b: Vec<bf16> = v.iter().map(|&e| bf16::from_f32(e * 1.7)).collect();
    cases.push(Case {
        x: (Dtype::BF16, bytes(&b, |e| e.to_le_bytes().to_vec())),
        shape: vec![513],
        block: 64,
        f32_scales: false,
    });
    let d: Vec<f64> = values(250, 7, 9.0)
        .iter()
        .map(|&e| e as f64 * (1.0 + 1e-9))
        .collect();
    cases.push(Case {
        x: (Dtype::F64, bytes(&d, |e| e.to_le_bytes().to_vec())),
        shape: vec![10, 25],
        block: 100,
        f32_scales: true,
    });

    let mut tensors = Vec::new();
    let mut params = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let raw = &case.x.1;
        let json = match case.x.0 {
            Dtype::F32 => run(
                &raw.chunks(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<_>>(),
                case,
                &mut tensors,
                i,
            ),
            Dtype::F16 => run(
                &raw.chunks(2)
                    .map(|c| f16::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<_>>(),
                case,
                &mut tensors,
                i,
            ),
            Dtype::BF16 => run(
                &raw.chunks(2)
                    .map(|c| bf16::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<_>>(),
                case,
                &mut tensors,
                i,
            ),
            Dtype::F64 => run(
                &raw.chunks(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<_>>(),
                case,
                &mut tensors,
                i,
            ),
            _ => unreachable!(),
        };
        tensors.push((format!("c{i}.x"), case.x.0, case.shape.clone(), raw.clone()));
        params.push(json);
    }
    golden::write("blockwise.safetensors", &tensors, &params);
}
