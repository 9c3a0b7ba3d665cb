//! The safe public kernel API.
//!
//! Each function validates its arguments once, then runs the kernel on
//! ferroquant's pool (large inputs) or the calling thread (small ones), with
//! the ISA from [`crate::simd::Isa::detected`]. `*_with` variants take the ISA
//! explicitly, so tests can compare every path against the scalar one.
//! Outputs are caller-allocated slices; nothing is written to them before
//! validation passes, and on error their contents are unspecified.
//!
//! Inputs to quantize are checked for NaN and infinity (`NonFinite`). The
//! scales and zero points that dequantizing functions and
//! [`linear::linear_forward`] take are trusted as the quantizers made them:
//! their lengths are checked, their values are not, so a NaN or infinite
//! scale gives NaN or infinite outputs, as in the seeds. (The Python
//! package's dataclasses check them when built or loaded.)

pub mod affine;
pub mod bitnet;
pub mod blockwise;
pub mod calib;
pub(crate) mod drive;
pub mod dynamic;
pub mod f16bits;
pub mod linear;
pub mod pack;
pub mod ptq;
pub mod smooth;
pub mod w8a8;

/// The element count `shape` describes (0 when any dimension is 0, whatever
/// the others), or `None` if it overflows `usize`.
pub fn shape_numel(shape: &[usize]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

#[cfg(test)]
mod tests {
    use super::shape_numel;
    use crate::ops::affine::{quantize, CodesMut, QuantConfig};
    use crate::ops::dynamic::{dynamic_quantize, DynCodesMut, DynFormat, ScaleMode};

    #[test]
    fn a_zero_dimension_makes_an_empty_shape_in_any_position() {
        assert_eq!(shape_numel(&[usize::MAX, 2, 0]), Some(0));
        assert_eq!(shape_numel(&[0, usize::MAX, 2]), Some(0));
        assert_eq!(shape_numel(&[usize::MAX, 2]), None);
        assert_eq!(shape_numel(&[]), Some(1));
        assert_eq!(shape_numel(&[3, 4]), Some(12));
        // The quantizers agree: an empty input of that shape is fine, whatever
        // the order of its dimensions.
        for shape in [[usize::MAX, 2, 0], [0, usize::MAX, 2]] {
            let config = QuantConfig::int8();
            let (mut s, mut z) = ([0.0], [0.0]);
            quantize::<f32>(
                &[],
                &shape,
                &config,
                CodesMut::Int8(&mut []),
                &mut s,
                &mut z,
            )
            .unwrap();
            let mut scales = [1.0f32];
            let codes = DynCodesMut::Int8(&mut []);
            let format = DynFormat::Int8PerTensor;
            dynamic_quantize::<f32>(&[], &shape, format, ScaleMode::MaxAbs, codes, &mut scales)
                .unwrap();
            assert_eq!(scales, [0.0]);
        }
    }
}
