//! Every kernel writes exactly its output slices: each output is handed over as
//! a slice inside a larger buffer filled with a marker value, at offsets that
//! cover every alignment a SIMD store cares about, and the marker must survive
//! on both sides (two different markers, so a store that happens to write the
//! marker's own value is caught by the other). The results must also equal the
//! scalar path's on a plain buffer, wherever the output starts.

use crate::rng::Rng;
use ferroquant::ops::affine::{self, Bits, Codes, CodesMut, QuantConfig};
use ferroquant::ops::bitnet::{fake_quantize_activations, quantize_activations_with};
use ferroquant::ops::blockwise::{
    dequantize_blockwise_with, quantize_blockwise_with, Scales, ScalesMut,
};
use ferroquant::ops::dynamic::{
    dequantize_groups, dynamic_quantize_with, num_scales, DynCodes, DynCodesMut, DynFormat,
    ScaleMode,
};
use ferroquant::ops::f16bits::{fp16_bits_to_fp32_with, fp32_to_fp16_bits_with};
use ferroquant::ops::linear::{linear_forward_with, DequantDtype, QuantizedWeight, WeightCodes};
use ferroquant::ops::pack::packed_len;
use ferroquant::ops::ptq::quantize_weights_with;
use ferroquant::ops::smooth::{compute_smooth_factors_into, smooth_activations, SmoothQuantConfig};
use ferroquant::ops::w8a8::{w8a8_matmul_with, Batch};
use ferroquant::simd::Isa;
use half::f16;

/// Marker elements on each side of an output.
const PAD: usize = 64;
/// Element offsets of an output inside its buffer: every 64-byte alignment of
/// a byte output, and the interesting ones of wider elements.
const OFFSETS: [usize; 12] = [0, 1, 2, 3, 5, 8, 13, 16, 31, 32, 47, 63];

/// An element type with two marker values no kernel writes for the inputs
/// below (NaNs with payloads for floats), compared by bits.
trait Marker: Copy + std::fmt::Debug {
    const MARKS: [Self; 2];
    fn bits(self) -> u64;
}

impl Marker for i8 {
    const MARKS: [i8; 2] = [-128, 0x55];
    fn bits(self) -> u64 {
        self as u8 as u64
    }
}
impl Marker for u8 {
    const MARKS: [u8; 2] = [0xa5, 0x3c];
    fn bits(self) -> u64 {
        self as u64
    }
}
impl Marker for u16 {
    const MARKS: [u16; 2] = [0x7e55, 0xfdaa];
    fn bits(self) -> u64 {
        self as u64
    }
}
impl Marker for f16 {
    const MARKS: [f16; 2] = [f16::from_bits(0x7e55), f16::from_bits(0xfdaa)];
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}
impl Marker for f32 {
    const MARKS: [f32; 2] = [f32::from_bits(0x7fc1_2345), f32::from_bits(0xffaa_5a5a)];
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}
impl Marker for f64 {
    const MARKS: [f64; 2] = [
        f64::from_bits(0x7ff8_0000_1234_5678),
        f64::from_bits(0xfff5_a5a5_0000_0001),
    ];
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

/// An output of `n` elements at `off` inside marker padding.
struct Fenced<T: Marker> {
    buf: Vec<T>,
    off: usize,
    n: usize,
    mark: T,
}

impl<T: Marker> Fenced<T> {
    fn new(n: usize, off: usize, which: usize) -> Self {
        let mark = T::MARKS[which];
        Fenced {
            buf: vec![mark; PAD + off + n + PAD],
            off,
            n,
            mark,
        }
    }

    fn out(&mut self) -> &mut [T] {
        let start = PAD + self.off;
        &mut self.buf[start..start + self.n]
    }

    /// The output's bits, after checking that nothing outside it was written.
    fn done(self, what: &str) -> Vec<u64> {
        let start = PAD + self.off;
        let (head, rest) = self.buf.split_at(start);
        let (inner, tail) = rest.split_at(self.n);
        for (side, part) in [("before", head), ("after", tail)] {
            if let Some(i) = part.iter().position(|v| v.bits() != self.mark.bits()) {
                panic!(
                    "{what}: wrote {:?} {side} its {} elements (at {} of the {} marker \
                     elements; output offset {})",
                    part[i],
                    self.n,
                    i,
                    part.len(),
                    self.off
                );
            }
        }
        inner.iter().map(|v| v.bits()).collect()
    }
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..n)
        .map(|i| match i % 5 {
            0 => (r.next() % 255) as f32 * 0.5 - 63.5,
            1 => 0.0,
            _ => (r.unit() - 0.5) * 6.0,
        })
        .collect()
}

fn lengths() -> Vec<usize> {
    (0..=130).chain([255, 257, 1000, 4097]).collect()
}

/// 2-D shapes: rows of every small width, and a few wide ones.
fn shapes() -> Vec<[usize; 2]> {
    let mut s: Vec<[usize; 2]> = (1..=3)
        .flat_map(|r| (1..=70).map(move |c| [r, c]))
        .collect();
    s.extend([[5, 4099], [33, 1001], [0, 7], [4, 0]]);
    s
}

/// `run(isa, off, which)` for every ISA, offset and marker: each result equal
/// to the scalar one at offset 0.
fn each<R: PartialEq + std::fmt::Debug>(what: &str, run: impl Fn(Isa, usize, usize) -> R) {
    let want = run(Isa::Scalar, 0, 0);
    for isa in Isa::supported() {
        for off in OFFSETS {
            for which in 0..2 {
                let got = run(isa, off, which);
                assert!(
                    got == want,
                    "{what} {isa:?} offset {off}: {got:?} != {want:?}"
                );
            }
        }
    }
}

#[test]
#[should_panic(expected = "wrote 7 after its 3 elements")]
fn a_write_past_an_output_is_caught() {
    let mut f = Fenced::<i8>::new(3, 5, 0);
    f.out().fill(1);
    f.buf[PAD + 5 + 3] = 7;
    f.done("this");
}

#[test]
fn blockwise_writes_only_its_codes_scales_and_values() {
    for n in lengths() {
        let x = values(n, n as u64);
        for bs in [1usize, 7, 64] {
            let nb = n.div_ceil(bs);
            let what = format!("blockwise n {n} block {bs}");
            each(&what, |isa, off, which| {
                let mut c = Fenced::<i8>::new(n, off, which);
                let mut s = Fenced::<f16>::new(nb, off, which);
                quantize_blockwise_with(isa, &x, bs, c.out(), ScalesMut::F16(s.out())).unwrap();
                let mut s32 = Fenced::<f32>::new(nb, off, which);
                let mut c32 = Fenced::<i8>::new(n, off, which);
                quantize_blockwise_with(isa, &x, bs, c32.out(), ScalesMut::F32(s32.out())).unwrap();
                let (codes, scales) = (c.done(&what), s.done(&what));
                let q: Vec<i8> = codes.iter().map(|&b| b as u8 as i8).collect();
                let sh: Vec<f16> = scales.iter().map(|&b| f16::from_bits(b as u16)).collect();
                let mut out = Fenced::<f32>::new(n, off, which);
                dequantize_blockwise_with(isa, &q, bs, Scales::F16(&sh), out.out()).unwrap();
                (
                    codes,
                    scales,
                    c32.done(&what),
                    s32.done(&what),
                    out.done(&what),
                )
            });
        }
    }
}

#[test]
fn affine_writes_only_its_codes_scales_zero_points_and_values() {
    let configs = [
        QuantConfig::int8(),
        QuantConfig::int4(),
        QuantConfig::int8_per_channel(),
        QuantConfig::int4_per_channel(),
    ];
    let mut cases: Vec<Vec<usize>> = lengths().into_iter().map(|n| vec![n]).collect();
    cases.extend(shapes().into_iter().map(|s| s.to_vec()));
    for shape in cases {
        let n: usize = shape.iter().product();
        let x: Vec<f64> = values(n, 3 + n as u64).iter().map(|&v| v as f64).collect();
        // Per tensor on the flat lengths, per channel on the rows.
        let fits = |c: &&QuantConfig| {
            (shape.len() == 1) == (c.granularity == QuantConfig::int8().granularity)
        };
        for c in configs
            .iter()
            .filter(fits)
            .flat_map(|c| [*c, c.asymmetric()])
        {
            let g = affine::num_groups(&shape, c.granularity);
            let what = format!("affine {shape:?} {c:?}");
            each(&what, |isa, off, which| {
                let mut s = Fenced::<f64>::new(g, off, which);
                let mut z = Fenced::<f64>::new(g, off, which);
                let codes = match c.bits {
                    Bits::Int8 => {
                        let mut d = Fenced::<i8>::new(n, off, which);
                        let (dc, sc, zc) = (d.out(), s.out(), z.out());
                        affine::quantize_with(isa, &x, &shape, &c, CodesMut::Int8(dc), sc, zc)
                            .unwrap();
                        d.done(&what)
                    }
                    Bits::Int4 => {
                        let mut p = Fenced::<u8>::new(packed_len(n), off, which);
                        let (pc, sc, zc) = (p.out(), s.out(), z.out());
                        affine::quantize_with(isa, &x, &shape, &c, CodesMut::Int4(pc), sc, zc)
                            .unwrap();
                        p.done(&what)
                    }
                };
                let (scales, zps) = (s.done(&what), z.done(&what));
                let sf: Vec<f64> = scales.iter().map(|&b| f64::from_bits(b)).collect();
                let zf: Vec<f64> = zps.iter().map(|&b| f64::from_bits(b)).collect();
                let (i8s, u8s): (Vec<i8>, Vec<u8>) = (
                    codes.iter().map(|&b| b as u8 as i8).collect(),
                    codes.iter().map(|&b| b as u8).collect(),
                );
                let q = match c.bits {
                    Bits::Int8 => Codes::Int8(&i8s),
                    Bits::Int4 => Codes::Int4(&u8s),
                };
                let mut o32 = Fenced::<f32>::new(n, off, which);
                affine::dequantize_with(isa, q, &shape, &c, &sf, &zf, o32.out()).unwrap();
                let mut o64 = Fenced::<f64>::new(n, off, which);
                affine::dequantize_with(isa, q, &shape, &c, &sf, &zf, o64.out()).unwrap();
                (codes, scales, zps, o32.done(&what), o64.done(&what))
            });
        }
    }
}

#[test]
fn dynamic_and_bitnet_write_only_their_outputs() {
    let modes = [ScaleMode::MaxAbs, ScaleMode::Percentile(0.9)];
    let mut cases: Vec<Vec<usize>> = lengths().into_iter().map(|n| vec![n]).collect();
    cases.extend(shapes().into_iter().map(|s| s.to_vec()));
    for shape in cases {
        let n: usize = shape.iter().product();
        let x = values(n, 11 + n as u64);
        let formats: &[DynFormat] = if shape.len() == 2 {
            &[DynFormat::Int8PerRow]
        } else {
            &[DynFormat::Int8PerTensor, DynFormat::Int4PerTensor]
        };
        for (&f, m) in formats
            .iter()
            .flat_map(|f| modes.iter().map(move |m| (f, *m)))
        {
            let k = num_scales(&shape, f);
            let what = format!("dynamic {shape:?} {f:?} {m:?}");
            each(&what, |isa, off, which| {
                let mut s = Fenced::<f32>::new(k, off, which);
                let group = if f == DynFormat::Int8PerRow {
                    shape[1]
                } else {
                    n
                };
                let (codes, scales, out) = if f == DynFormat::Int4PerTensor {
                    let mut p = Fenced::<u8>::new(packed_len(n), off, which);
                    dynamic_quantize_with(
                        isa,
                        &x,
                        &shape,
                        f,
                        m,
                        DynCodesMut::Int4(p.out()),
                        s.out(),
                    )
                    .unwrap();
                    let (codes, scales) = (p.done(&what), s.done(&what));
                    let u: Vec<u8> = codes.iter().map(|&b| b as u8).collect();
                    let sf: Vec<f32> = scales.iter().map(|&b| f32::from_bits(b as u32)).collect();
                    let mut o = Fenced::<f32>::new(n, off, which);
                    dequantize_groups(DynCodes::Int4(&u), group, &sf, o.out()).unwrap();
                    (codes, scales, o.done(&what))
                } else {
                    let mut d = Fenced::<i8>::new(n, off, which);
                    dynamic_quantize_with(
                        isa,
                        &x,
                        &shape,
                        f,
                        m,
                        DynCodesMut::Int8(d.out()),
                        s.out(),
                    )
                    .unwrap();
                    let (codes, scales) = (d.done(&what), s.done(&what));
                    let q: Vec<i8> = codes.iter().map(|&b| b as u8 as i8).collect();
                    let sf: Vec<f32> = scales.iter().map(|&b| f32::from_bits(b as u32)).collect();
                    let mut o = Fenced::<f32>::new(n, off, which);
                    dequantize_groups(DynCodes::Int8(&q), group, &sf, o.out()).unwrap();
                    (codes, scales, o.done(&what))
                };
                (codes, scales, out)
            });
        }
        if shape.len() == 2 && shape[1] > 0 {
            let cols = shape[1];
            let what = format!("bitnet {shape:?}");
            each(&what, |isa, off, which| {
                let mut c = Fenced::<i8>::new(n, off, which);
                let mut s = Fenced::<f32>::new(shape[0], off, which);
                quantize_activations_with(isa, &x, cols, 6, c.out(), s.out()).unwrap();
                let mut fake = Fenced::<f32>::new(n, off, which);
                fake_quantize_activations(&x, cols, 6, fake.out()).unwrap();
                (c.done(&what), s.done(&what), fake.done(&what))
            });
        }
    }
}

#[test]
fn smoothing_f16_bits_and_ptq_write_only_their_outputs() {
    for n in lengths() {
        let x = values(n, 17 + n as u64);
        let what = format!("f16 bits n {n}");
        each(&what, |isa, off, which| {
            let mut h = Fenced::<u16>::new(n, off, which);
            fp32_to_fp16_bits_with(isa, &x, h.out()).unwrap();
            let bits = h.done(&what);
            let hb: Vec<u16> = bits.iter().map(|&b| b as u16).collect();
            let mut f = Fenced::<f32>::new(n, off, which);
            fp16_bits_to_fp32_with(isa, &hb, f.out()).unwrap();
            (bits, f.done(&what))
        });
        let what = format!("ptq n {n}");
        each(&what, |isa, off, which| {
            let mut c = Fenced::<i8>::new(n, off, which);
            let scale = quantize_weights_with(isa, &x, None, c.out()).unwrap();
            (scale.to_bits(), c.done(&what))
        });
    }
    for [rows, cols] in shapes() {
        let a = values(rows * cols, 5);
        let w = values(3 * cols, 6);
        let what = format!("smooth {rows}x{cols}");
        // The detected ISA only (these take none); offsets and markers as above.
        each(&what, |_, off, which| {
            let mut s = Fenced::<f32>::new(cols, off, which);
            compute_smooth_factors_into(&a, &w, cols, &SmoothQuantConfig::default(), s.out())
                .unwrap();
            let factors: Vec<f32> = s
                .done(&what)
                .iter()
                .map(|&b| f32::from_bits(b as u32))
                .collect();
            let mut act = Fenced::<f32>::new(rows * cols, off, which);
            act.out().copy_from_slice(&a);
            smooth_activations(act.out(), &factors).unwrap();
            (
                factors.iter().map(|f| f.to_bits()).collect::<Vec<_>>(),
                act.done(&what),
            )
        });
    }
}

#[test]
fn matrix_kernels_write_only_their_outputs() {
    let sizes = [
        [1usize, 1],
        [3, 5],
        [7, 63],
        [5, 64],
        [9, 65],
        [17, 127],
        [4, 129],
        [16, 1000],
    ];
    for [o, i] in sizes {
        let wf = values(o * i, (o * i) as u64);
        for tokens in [1usize, 2, 9, 33] {
            let x = values(tokens * i, 3);
            let bias = values(o, 4);
            for c in [
                QuantConfig::int8_per_channel(),
                QuantConfig::int4_per_channel().asymmetric(),
            ] {
                let g = o;
                let (mut s, mut z) = (vec![0.0; g], vec![0.0; g]);
                let shape = [o, i];
                let mut q8 = vec![0i8; o * i];
                let mut q4 = vec![0u8; packed_len(o * i)];
                let codes = if c.bits == Bits::Int8 {
                    affine::quantize(&wf, &shape, &c, CodesMut::Int8(&mut q8), &mut s, &mut z)
                        .unwrap();
                    WeightCodes::Int8(&q8)
                } else {
                    affine::quantize(&wf, &shape, &c, CodesMut::Int4(&mut q4), &mut s, &mut z)
                        .unwrap();
                    WeightCodes::Int4(&q4)
                };
                let w = QuantizedWeight {
                    codes,
                    shape,
                    scales: &s,
                    zero_points: &z,
                    dequant: DequantDtype::F32,
                };
                let what = format!("forward {o}x{i} tokens {tokens} {c:?}");
                each(&what, |isa, off, which| {
                    let mut out = Fenced::<f32>::new(tokens * o, off, which);
                    linear_forward_with(isa, &w, &x, tokens, Some(&bias), out.out()).unwrap();
                    out.done(&what)
                });
            }
            let wq: Vec<i8> = wf
                .iter()
                .map(|&v| (v * 20.0).clamp(-127.0, 127.0) as i8)
                .collect();
            let ws: Vec<f32> = (0..o).map(|r| 1e-3 * (1 + r % 5) as f32).collect();
            let what = format!("w8a8 {o}x{i} tokens {tokens}");
            each(&what, |isa, off, which| {
                let mut codes = Fenced::<i8>::new(tokens * i, off, which);
                let mut out = Fenced::<f32>::new(tokens * o, off, which);
                let batch = Batch::Tokens(tokens);
                w8a8_matmul_with(isa, &wq, [o, i], &ws, &x, batch, codes.out(), out.out()).unwrap();
                let mut vc = Fenced::<i8>::new(i, off, which);
                let mut vo = Fenced::<f32>::new(o, off, which);
                w8a8_matmul_with(
                    isa,
                    &wq,
                    [o, i],
                    &ws,
                    &x[..i],
                    Batch::Vector,
                    vc.out(),
                    vo.out(),
                )
                .unwrap();
                (
                    codes.done(&what),
                    out.done(&what),
                    vc.done(&what),
                    vo.done(&what),
                )
            });
        }
    }
}
