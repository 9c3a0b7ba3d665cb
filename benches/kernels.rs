//! Criterion benches of the blockwise kernels: scalar vs each supported ISA,
//! one thread vs the pool, f32 and f16 input. Throughput is reported in
//! input elements. `cargo bench --bench kernels`; `cargo test --benches` runs
//! each once as a smoke test.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferroquant::ops::blockwise::{
    dequantize_blockwise_with, num_blocks, quantize_blockwise_with, Scales, ScalesMut,
};
use ferroquant::parallel;
use ferroquant::simd::Isa;
use half::f16;
use std::hint::black_box;

const N: usize = 16 << 20;
const BLOCK: usize = 64;

fn input(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % 2001) as f32 * 0.01 - 10.0)
        .collect()
}

fn blockwise(c: &mut Criterion) {
    let x = input(N);
    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
    let mut codes = vec![0i8; N];
    let mut scales = vec![f16::ZERO; num_blocks(N, BLOCK)];
    let mut out = vec![0f32; N];

    let mut g = c.benchmark_group("blockwise_16M");
    g.throughput(Throughput::Elements(N as u64));
    g.sample_size(10);
    for threads in [1usize, 2] {
        parallel::set_num_threads(threads).expect("threads >= 1");
        for isa in Isa::supported() {
            let id = format!("{}/{}t", isa.name(), threads);
            g.bench_function(BenchmarkId::new("quantize_f32", &id), |b| {
                b.iter(|| {
                    quantize_blockwise_with(
                        isa,
                        black_box(&x),
                        BLOCK,
                        &mut codes,
                        ScalesMut::F16(&mut scales),
                    )
                    .expect("finite input")
                })
            });
            g.bench_function(BenchmarkId::new("quantize_f16", &id), |b| {
                b.iter(|| {
                    quantize_blockwise_with(
                        isa,
                        black_box(&xh),
                        BLOCK,
                        &mut codes,
                        ScalesMut::F16(&mut scales),
                    )
                    .expect("finite input")
                })
            });
            g.bench_function(BenchmarkId::new("dequantize", &id), |b| {
                b.iter(|| {
                    dequantize_blockwise_with(
                        isa,
                        black_box(&codes),
                        BLOCK,
                        Scales::F16(&scales),
                        &mut out,
                    )
                    .expect("consistent lengths")
                })
            });
        }
    }
    g.finish();
}

fn copy_floor(c: &mut Criterion) {
    // The memory-bandwidth reference: a plain copy of the same 64 MiB.
    let x = input(N);
    let mut y = vec![0f32; N];
    let mut g = c.benchmark_group("copy_16M");
    g.throughput(Throughput::Bytes((N * 4) as u64));
    g.sample_size(10);
    g.bench_function("copy_f32", |b| b.iter(|| y.copy_from_slice(black_box(&x))));
    g.finish();
}

criterion_group!(benches, blockwise, copy_floor);
criterion_main!(benches);
