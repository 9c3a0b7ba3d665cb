//! Portable primitives: the executable specification every SIMD path must equal.

use super::kernels::{Affine, Kernels, Range, Store};
use crate::round::{round_f32, round_f64};
use half::{bf16, f16};

/// The scalar ISA marker.
pub(crate) struct Scalar;

/// One absmax code: `clamp(round(v / scale), -clip, clip)` (seed 000's formula).
#[inline(always)]
pub fn quantize_one(v: f32, scale: f32, clip: f32) -> i8 {
    round_f32(v / scale).clamp(-clip, clip) as i8
}

/// One affine code: `clamp(round(v * inv + zp), qmin, qmax)`, a multiply then
/// an add, each rounded (seed 001's `(v * inv_scale + zero_point).round().clamp(..)`).
#[inline(always)]
pub fn affine_one(v: f64, a: Affine) -> i8 {
    round_f64(v * a.inv + a.zp).clamp(a.qmin, a.qmax) as i8
}

/// One affine value back: `(q - zp) * scale` in f64.
#[inline(always)]
pub fn affine_value(q: i8, zp: f64, scale: f64) -> f64 {
    (q as f64 - zp) * scale
}

/// Products summed in one i32 before they move to the i64 total: 65536
/// products of at most 128·128 = 2^14 stay within 2^30, whatever the bytes.
/// (SPEC §3 allows chunks of up to 131072; the integer is the same.)
pub const DOT_CHUNK: usize = 65_536;

/// The exact dot product of two int8 vectors (over their common length): i32
/// partial sums over chunks of [`DOT_CHUNK`] products, added in i64.
pub fn i8_dot(w: &[i8], a: &[i8]) -> i64 {
    w.chunks(DOT_CHUNK)
        .zip(a.chunks(DOT_CHUNK))
        .map(|(wc, ac)| {
            let part: i32 = wc.iter().zip(ac).map(|(&x, &y)| x as i32 * y as i32).sum();
            part as i64
        })
        .sum()
}

/// Lanes of the dequantizing dot product: element `i` is added into lane
/// `i % DOT_LANES` (a fused multiply-add, in increasing `i`), then the lanes
/// are summed as a tree (`lane[j] += lane[j + w]` for w = 32, 16, .., 1).
/// Every ISA follows this order, so every ISA gives the same f32.
pub const DOT_LANES: usize = 64;

/// The tree sum of [`DOT_LANES`] lanes.
pub fn lanes_tree_sum(mut acc: [f32; DOT_LANES]) -> f32 {
    let mut w = DOT_LANES / 2;
    while w >= 1 {
        for j in 0..w {
            acc[j] += acc[j + w];
        }
        w /= 2;
    }
    acc[0]
}

/// `Σ x[i] · d(i)` in the lane order of [`DOT_LANES`].
#[inline(always)]
pub fn dot_lanes(x: &[f32], d: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; DOT_LANES];
    for (i, &v) in x.iter().enumerate() {
        let lane = &mut acc[i % DOT_LANES];
        *lane = v.mul_add(d(i), *lane);
    }
    lanes_tree_sum(acc)
}

/// Elements in one block of [`nibble_planes`] order: 64 bytes of codes.
pub const PLANE_BLOCK: usize = 128;

/// `x` reordered for the int4 dot product, [`PLANE_BLOCK`] elements at a
/// time (the last block zero-padded): 64 bytes of codes read as sixteen
/// 32-bit words hold elements `8d..8d + 8` in word `d`, nibble `p` holding
/// element `8d + p`; plane `p` (the `p`-th nibble of every word) takes
/// positions `16p..16p + 16` of the block.
pub fn nibble_planes(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; planes_len(x.len())];
    for (i, &v) in x.iter().enumerate() {
        out[plane_index(i)] = v;
    }
    out
}

/// [`nibble_planes`] of `x` into `out` (padding positions are left as they
/// are): a block's 16 × 8 elements transposed to 8 × 16, whole blocks with
/// fixed indices.
///
/// # Panics
/// If `out` is shorter than [`planes_len`] of `x`'s length.
pub fn nibble_planes_into(x: &[f32], out: &mut [f32]) {
    assert!(
        out.len() >= planes_len(x.len()),
        "nibble_planes_into: out holds {} of the {} positions",
        out.len(),
        planes_len(x.len())
    );
    let whole = x.len() - x.len() % PLANE_BLOCK;
    let (xb, xt) = x.split_at(whole);
    for (xb, ob) in xb
        .chunks_exact(PLANE_BLOCK)
        .zip(out.chunks_exact_mut(PLANE_BLOCK))
    {
        for p in 0..8 {
            for d in 0..16 {
                ob[16 * p + d] = xb[8 * d + p];
            }
        }
    }
    for (i, &v) in xt.iter().enumerate() {
        out[plane_index(whole + i)] = v;
    }
}

/// Length of [`nibble_planes`] of `n` elements.
#[inline(always)]
pub fn planes_len(n: usize) -> usize {
    n.div_ceil(PLANE_BLOCK) * PLANE_BLOCK
}

/// Where element `i` goes in [`nibble_planes`] order.
#[inline(always)]
pub fn plane_index(i: usize) -> usize {
    let (block, e) = (i / PLANE_BLOCK, i % PLANE_BLOCK);
    block * PLANE_BLOCK + (e % 8) * 16 + e / 8
}

/// The element at position `k` of [`nibble_planes`] order (the inverse of
/// [`plane_index`]).
#[inline(always)]
pub fn plane_element(k: usize) -> usize {
    let (block, j) = (k / PLANE_BLOCK, k % PLANE_BLOCK);
    block * PLANE_BLOCK + (j % 16) * 8 + j / 16
}

/// The specification of the int4 dequantizing dot product: `xs[k]` (in
/// [`nibble_planes`] order) times its element's `nibble − zp`, added into lane
/// `k % 64`, for the elements the bytes of `p` hold; then the tree, times
/// `scale` (once, as the int8 product scales its sum).
pub fn dot_dequant_i4_spec(p: &[u8], zp: f32, scale: f32, xs: &[f32]) -> f32 {
    let mut acc = [0f32; DOT_LANES];
    for (k, &v) in xs.iter().enumerate() {
        let e = plane_element(k);
        let Some(&b) = p.get(e / 2) else { continue };
        let d = nibble(if e.is_multiple_of(2) { b } else { b >> 4 }) as f32 - zp;
        let lane = &mut acc[k % DOT_LANES];
        *lane = v.mul_add(d, *lane);
    }
    lanes_tree_sum(acc) * scale
}

/// Sign-extend the low nibble of `b`.
#[inline(always)]
pub fn nibble(b: u8) -> i8 {
    (((b & 0x0f) ^ 0x08) as i8) - 8
}

/// Index of the first NaN or infinity in `x` (`x.len()` if none).
pub fn first_non_finite(x: &[f32]) -> usize {
    x.iter().position(|v| !v.is_finite()).unwrap_or(x.len())
}

/// Index of the first NaN or infinity in `x` (`x.len()` if none).
pub fn first_non_finite_f64(x: &[f64]) -> usize {
    x.iter().position(|v| !v.is_finite()).unwrap_or(x.len())
}

macro_rules! range_impl {
    ($x:expr, $t:ty) => {{
        let mut r = Range {
            min: <$t>::INFINITY,
            max: <$t>::NEG_INFINITY,
            non_finite: false,
        };
        for &v in $x {
            r.non_finite |= !v.is_finite();
            r.min = if v < r.min { v } else { r.min };
            r.max = if v > r.max { v } else { r.max };
        }
        r
    }};
}

impl Kernels for Scalar {
    unsafe fn dot_dequant_i8_rows(
        q: &[i8],
        stride: usize,
        zps: &[f32],
        scales: &[f32],
        x: &[f32],
        out: &mut [f32],
    ) {
        for (r, (o, (&zp, &s))) in out.iter_mut().zip(zps.iter().zip(scales)).enumerate() {
            let row = &q[r * stride..r * stride + x.len()];
            *o = dot_lanes(x, |i| row[i] as f32 - zp) * s;
        }
    }

    unsafe fn dot_dequant_i4_rows(
        p: &[u8],
        stride: usize,
        n: usize,
        zps: &[f32],
        scales: &[f32],
        xs: &[f32],
        out: &mut [f32],
    ) {
        for (r, (o, (&zp, &s))) in out.iter_mut().zip(zps.iter().zip(scales)).enumerate() {
            *o = dot_dequant_i4_spec(&p[r * stride..r * stride + n.div_ceil(2)], zp, s, xs);
        }
    }

    unsafe fn i8_dots(w: &[i8], rows: usize, a: &[i8], k: usize, out: &mut [i64]) {
        let tokens = a.len() / k;
        let rows = rows.min(w.len() / k);
        for (r, wr) in w[..rows * k].chunks_exact(k).enumerate() {
            for (t, at) in a.chunks_exact(k).enumerate() {
                out[r * tokens + t] = i8_dot(wr, at);
            }
        }
    }

    #[inline(always)]
    unsafe fn absmax_bits(x: &[f32]) -> u32 {
        x.iter()
            .map(|v| v.to_bits() & 0x7fff_ffff)
            .fold(0, u32::max)
    }

    #[inline(always)]
    unsafe fn shifted_moments(x: &[f32], k: f64) -> (f64, f64) {
        let (mut s1, mut s2) = ([0f64; 16], [0f64; 16]);
        for (i, &v) in x.iter().enumerate() {
            let d = v as f64 - k;
            s1[i % 16] += d;
            s2[i % 16] += d * d;
        }
        let (mut t1, mut t2) = (0f64, 0f64);
        for j in 0..16 {
            t1 += s1[j];
            t2 += s2[j];
        }
        (t1, t2)
    }

    #[inline(always)]
    unsafe fn select_at_least(x: &[f32], threshold: u32, out: &mut Vec<u32>) -> u32 {
        let mut below = 0u32;
        for v in x {
            let b = v.to_bits() & 0x7fff_ffff;
            if b >= threshold {
                out.push(b);
            } else {
                below = below.max(b);
            }
        }
        below
    }

    #[inline(always)]
    unsafe fn absmax_columns(row: &[f32], acc: &mut [u32]) {
        for (a, v) in acc.iter_mut().zip(row) {
            *a = (*a).max(v.to_bits() & 0x7fff_ffff);
        }
    }

    #[inline(always)]
    unsafe fn quantize_scaled(x: &[f32], scale: f32, clip: f32, out: &mut [i8], _store: Store) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = quantize_one(v, scale, clip);
        }
    }

    #[inline(always)]
    unsafe fn dequantize_scaled(q: &[i8], scale: f32, out: &mut [f32]) {
        for (o, &c) in out.iter_mut().zip(q) {
            *o = c as f32 * scale;
        }
    }

    #[inline(always)]
    unsafe fn f16_to_f32(x: &[f16], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v.to_f32();
        }
    }

    #[inline(always)]
    unsafe fn bf16_to_f32(x: &[bf16], out: &mut [f32]) {
        // bfloat16 is the top half of an f32: every pattern widens exactly, a
        // signalling NaN included, as the SIMD tiers widen it (`bf16::to_f32`
        // quiets it).
        for (o, &v) in out.iter_mut().zip(x) {
            *o = f32::from_bits(u32::from(v.to_bits()) << 16);
        }
    }

    #[inline(always)]
    unsafe fn f64_to_f32(x: &[f64], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v as f32;
        }
    }

    #[inline(always)]
    unsafe fn f32_to_f16(x: &[f32], out: &mut [f16]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = f16::from_f32(v);
        }
    }

    #[inline(always)]
    unsafe fn f64_to_f32_odd(x: &[f64], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = crate::element::f64_to_f32_round_to_odd(v);
        }
    }

    #[inline(always)]
    unsafe fn f32_to_bf16(x: &[f32], out: &mut [bf16]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = bf16::from_f32(v);
        }
    }

    #[inline(always)]
    unsafe fn range_f32(x: &[f32]) -> Range<f32> {
        range_impl!(x, f32)
    }

    #[inline(always)]
    unsafe fn range_f64(x: &[f64]) -> Range<f64> {
        range_impl!(x, f64)
    }

    #[inline(always)]
    unsafe fn affine_quantize_f32(x: &[f32], a: Affine, out: &mut [i8], _store: Store) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = affine_one(v as f64, a);
        }
    }

    #[inline(always)]
    unsafe fn affine_quantize_f64(x: &[f64], a: Affine, out: &mut [i8]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = affine_one(v, a);
        }
    }

    #[inline(always)]
    unsafe fn affine_dequantize_f32(q: &[i8], zp: f64, scale: f64, out: &mut [f32], _store: Store) {
        for (o, &c) in out.iter_mut().zip(q) {
            *o = affine_value(c, zp, scale) as f32;
        }
    }

    #[inline(always)]
    unsafe fn affine_dequantize_f64(q: &[i8], zp: f64, scale: f64, out: &mut [f64]) {
        for (o, &c) in out.iter_mut().zip(q) {
            *o = affine_value(c, zp, scale);
        }
    }

    #[inline(always)]
    unsafe fn pack_int4(q: &[i8], out: &mut [u8]) {
        for (o, pair) in out.iter_mut().zip(q.chunks_exact(2)) {
            *o = (pair[0] as u8 & 0x0f) | ((pair[1] as u8 & 0x0f) << 4);
        }
    }

    #[inline(always)]
    unsafe fn unpack_int4(p: &[u8], out: &mut [i8]) {
        for (&b, pair) in p.iter().zip(out.chunks_exact_mut(2)) {
            pair[0] = nibble(b);
            pair[1] = nibble(b >> 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_half_away_and_clamp() {
        assert_eq!(quantize_one(0.5, 1.0, 127.0), 1);
        assert_eq!(quantize_one(-0.5, 1.0, 127.0), -1);
        assert_eq!(quantize_one(-2.5, 1.0, 127.0), -3);
        assert_eq!(quantize_one(1000.0, 1.0, 127.0), 127);
        assert_eq!(quantize_one(-1000.0, 1.0, 7.0), -7);
    }

    #[test]
    fn affine_codes_multiply_then_add() {
        let a = Affine {
            inv: 0.1,
            zp: 3.0,
            qmin: -8.0,
            qmax: 7.0,
            max_abs: f64::INFINITY,
        };
        // 25 * 0.1 rounds to 2.5 in f64; + 3 = 5.5, a tie: away from zero.
        assert_eq!(affine_one(25.0, a), 6);
        assert_eq!(affine_one(-5.0, a), 3); // -0.5 + 3 = 2.5 -> 3 (away from zero)
        assert_eq!(affine_one(-1000.0, a), -8);
        assert_eq!(affine_one(1e300, a), 7);
        assert_eq!(affine_value(-8, 3.0, 0.5), -5.5);
    }

    #[test]
    fn int4_pack_round_trips_every_pair() {
        let mut q = Vec::new();
        for lo in -8i8..=7 {
            for hi in -8i8..=7 {
                q.extend([lo, hi]);
            }
        }
        let mut p = vec![0u8; q.len() / 2];
        let mut back = vec![0i8; q.len()];
        // SAFETY: the scalar kernels need no CPU features.
        unsafe {
            Scalar::pack_int4(&q, &mut p);
            Scalar::unpack_int4(&p, &mut back);
        }
        assert_eq!(back, q);
        assert_eq!(p[0], 0x88); // -8, -8
        assert_eq!(nibble(0x0f), -1);
    }

    #[test]
    fn range_flags_non_finite() {
        // SAFETY: the scalar kernels need no CPU features.
        let r = unsafe { Scalar::range_f32(&[1.0, -3.0, 2.0]) };
        assert_eq!((r.min, r.max, r.non_finite), (-3.0, 2.0, false));
        let r = unsafe { Scalar::range_f64(&[1.0, f64::NAN]) };
        assert!(r.non_finite);
        let m = unsafe { Scalar::absmax_bits(&[1.0, f32::NEG_INFINITY]) };
        assert!(m >= super::super::F32_INF_BITS);
        assert_eq!(first_non_finite(&[0.0, 1.0, f32::NAN]), 2);
    }
}
