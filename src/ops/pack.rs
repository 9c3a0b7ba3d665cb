//! int4 codes packed two a byte, the ONNX order: element `2i` in the low
//! nibble of byte `i`, element `2i + 1` in the high nibble, two's complement;
//! the high nibble of an odd-length array's last byte is 0 (SPEC §2).

use crate::simd::{self, Affine, Isa, Range, Store};

/// Bytes that hold `n` packed int4 codes: `ceil(n / 2)`.
pub fn packed_len(n: usize) -> usize {
    n.div_ceil(2)
}

/// Writes codes into packed bytes in order, from any element position
/// (a run may start in the high nibble of a byte another run began).
/// Crate-internal: the drivers size `out` first; a write past it panics.
#[derive(Debug)]
pub(crate) struct Int4Writer<'a> {
    out: &'a mut [u8],
    pos: usize,
}

impl<'a> Int4Writer<'a> {
    /// A writer whose first code goes to element `first` of `out`
    /// (`out[first / 2]`, low nibble if `first` is even).
    pub(crate) fn new(out: &'a mut [u8], first: usize) -> Self {
        Int4Writer { out, pos: first }
    }

    /// Append `codes` (each in -8..=7).
    pub(crate) fn write(&mut self, isa: Isa, codes: &[i8]) {
        let mut c = codes;
        if self.pos % 2 == 1 {
            if let Some((&first, rest)) = c.split_first() {
                let b = &mut self.out[self.pos / 2];
                *b = (*b & 0x0f) | ((first as u8 & 0x0f) << 4);
                self.pos += 1;
                c = rest;
            }
        }
        let pairs = c.len() / 2;
        let at = self.pos / 2;
        simd::pack_int4(isa, &c[..2 * pairs], &mut self.out[at..at + pairs]);
        self.pos += 2 * pairs;
        if let Some(&last) = c.get(2 * pairs) {
            // A new byte: its high nibble stays 0 unless a later code fills it.
            self.out[self.pos / 2] = last as u8 & 0x0f;
            self.pos += 1;
        }
    }
}

impl Int4Writer<'_> {
    /// Append the affine int4 codes of f32 values (the codes
    /// `simd::affine_quantize_f32` gives), pairs packed straight from registers,
    /// bringing `ahead` toward the core meanwhile.
    pub(crate) fn write_affine_f32(&mut self, isa: Isa, x: &[f32], a: Affine, ahead: &[f32]) {
        let mut x = x;
        let mut one = [0i8; 1];
        if self.pos % 2 == 1 {
            if let Some((first, rest)) = x.split_first() {
                let v = std::slice::from_ref(first);
                simd::affine_quantize_f32(isa, v, a, &mut one, Store::Cached);
                self.write(isa, &one);
                x = rest;
            }
        }
        let pairs = x.len() / 2;
        let at = self.pos / 2;
        let out = &mut self.out[at..at + pairs];
        simd::affine_quantize_int4_f32_ahead(isa, &x[..2 * pairs], a, out, ahead);
        self.pos += 2 * pairs;
        if let Some(last) = x.get(2 * pairs) {
            let v = std::slice::from_ref(last);
            simd::affine_quantize_f32(isa, v, a, &mut one, Store::Cached);
            self.write(isa, &one);
        }
    }

    /// [`write_affine_f32`](Self::write_affine_f32), then the range of `next`
    /// as [`simd::row_range`] finds it; a run that starts and ends on a byte
    /// boundary reads `next` in the same loop as it codes `x`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_affine_f32_then_range(
        &mut self,
        isa: Isa,
        x: &[f32],
        a: Affine,
        next: &[f32],
        ahead: &[f32],
        magnitude: bool,
    ) -> Range<f32> {
        if self.pos % 2 == 1 || x.len() % 2 == 1 {
            self.write_affine_f32(isa, x, a, ahead);
            return simd::row_range(isa, next, magnitude);
        }
        let at = self.pos / 2;
        let out = &mut self.out[at..at + x.len() / 2];
        let r = simd::affine_quantize_int4_f32_then_range(isa, x, a, out, next, ahead, magnitude);
        self.pos += x.len();
        r
    }
}

/// Unpack elements `start .. start + out.len()` of a packed array (the
/// caller checked they exist; crate-internal, as [`Int4Writer`]).
pub(crate) fn unpack_range(isa: Isa, packed: &[u8], start: usize, out: &mut [i8]) {
    let mut pos = start;
    let mut skip = 0;
    if pos % 2 == 1 && !out.is_empty() {
        out[0] = simd::scalar::nibble(packed[pos / 2] >> 4);
        pos += 1;
        skip = 1;
    }
    let o = &mut out[skip..];
    let pairs = o.len() / 2;
    simd::unpack_int4(isa, &packed[pos / 2..pos / 2 + pairs], &mut o[..2 * pairs]);
    if o.len() % 2 == 1 {
        o[2 * pairs] = simd::scalar::nibble(packed[pos / 2 + pairs]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_from_odd_positions_pack_like_one_run() {
        let codes: Vec<i8> = (0..101).map(|i| ((i * 5) % 16) as i8 - 8).collect();
        for isa in Isa::supported() {
            let mut whole = vec![0u8; packed_len(codes.len())];
            Int4Writer::new(&mut whole, 0).write(isa, &codes);
            for cut in [0, 1, 2, 3, 33, 64, 100, 101] {
                let mut split = vec![0u8; packed_len(codes.len())];
                let mut w = Int4Writer::new(&mut split, 0);
                w.write(isa, &codes[..cut]);
                w.write(isa, &codes[cut..]);
                assert_eq!(split, whole, "cut {cut}");
            }
            assert_eq!(whole[50] >> 4, 0, "odd tail's high nibble is 0");
            // Codes computed from f32 and packed from registers, from any position.
            let x: Vec<f32> = (0..101)
                .map(|i| ((i * 37) % 29) as f32 * 0.5 - 7.0)
                .collect();
            let a = Affine {
                inv: 0.5,
                zp: 0.0,
                qmin: -8.0,
                qmax: 7.0,
                max_abs: 7.0,
            };
            let mut codes8 = vec![0i8; x.len()];
            simd::affine_quantize_f32(Isa::Scalar, &x, a, &mut codes8, Store::Cached);
            let mut want = vec![0u8; packed_len(x.len())];
            Int4Writer::new(&mut want, 0).write(Isa::Scalar, &codes8);
            for cut in [0, 1, 2, 3, 33, 64, 100, 101] {
                let mut got = vec![0u8; packed_len(x.len())];
                let mut w = Int4Writer::new(&mut got, 0);
                w.write_affine_f32(isa, &x[..cut], a, &x[cut..]);
                w.write_affine_f32(isa, &x[cut..], a, &[]);
                assert_eq!(got, want, "f32 cut {cut}");
            }
            for start in [0, 1, 2, 7, 50, 100] {
                for len in [0, 1, 2, 3, 40, 101 - start] {
                    let len = len.min(101 - start);
                    let mut back = vec![0i8; len];
                    unpack_range(isa, &whole, start, &mut back);
                    assert_eq!(back, &codes[start..start + len], "start {start} len {len}");
                }
            }
        }
    }
}
