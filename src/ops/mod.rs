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
