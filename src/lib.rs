//! # ferroquant
//!
//! Fast, bit-exact quantization kernels over plain slices.
//!
//! The crate ports five small reference quantization kernels (see the
//! project's `SPEC.md`) and makes them fast with runtime-dispatched SIMD
//! ([`simd`]) and a private rayon pool ([`parallel`]). Every kernel has a
//! scalar path that is the executable specification; the SIMD paths reproduce
//! it bit for bit, and results never depend on the thread count.
//!
//! The families, one module of [`ops`] each, over caller-allocated slices:
//!
//! | SPEC | module | what |
//! |---|---|---|
//! | §1 | [`ops::blockwise`] | blockwise int8 with f16/f32 scales |
//! | §2 | [`ops::affine`], [`ops::linear`] | int8/int4 symmetric/asymmetric, per tensor/channel; the fused quantized linear layer |
//! | §3 | [`ops::dynamic`], [`ops::calib`], [`ops::smooth`], [`ops::w8a8`] | dynamic activation quantization, calibration statistics, SmoothQuant, exact W8A8 GEMV/GEMM |
//! | §4 | [`ops::bitnet`] | BitNet per-token activations |
//! | §5 | [`ops::ptq`], [`ops::f16bits`] | post-training int8 with the seed's JSON; f16 bits |
//!
//! `cargo run --example tour` runs one call of each. The Python wheel calls
//! these same functions, and golden vectors hold both to the same bytes.
//!
//! Layout:
//! - [`ops`]: the safe public kernel API. Validates once, fuses the
//!   non-finite check into the first pass, picks the ISA, splits the work.
//! - [`simd`]: the only module that may opt out of `#![deny(unsafe_code)]`,
//!   and the only home of `#[target_feature]`.
//! - [`element`]: the [`Float`] trait that lets kernels read `f32`, `f64`,
//!   `f16` and `bf16` input in place.
//! - [`error`]: the one error enum, [`QuantError`].
//! - `bindings` (feature `python`): the PyO3 glue, the only module that names
//!   PyO3 or rust-numpy.
//!
//! ```
//! # fn main() -> Result<(), ferroquant::QuantError> {
//! use ferroquant::ops::blockwise::{quantize_blockwise, dequantize_blockwise, ScalesMut, Scales};
//! use half::f16;
//!
//! let x: Vec<f32> = (0..100).map(|i| i as f32 * 0.25 - 12.0).collect();
//! let mut codes = vec![0i8; x.len()];
//! let mut scales = vec![f16::ZERO; x.len().div_ceil(64)];
//! let report = quantize_blockwise(&x, 64, &mut codes, ScalesMut::F16(&mut scales))?;
//! assert_eq!(report.lossy_blocks, 0);
//! let mut y = vec![0f32; x.len()];
//! dequantize_blockwise(&codes, 64, Scales::F16(&scales), &mut y)?;
//! assert!((y[0] - x[0]).abs() < 0.1);
//! # Ok(())
//! # }
//! ```

// The compiler keeps raw-pointer code in src/simd/, the one module that allows it.
#![deny(unsafe_code)]

pub mod element;
mod env;
pub mod error;
pub mod formats;
pub mod ops;
pub mod parallel;
pub mod round;
pub mod simd;
pub mod stage;

#[cfg(feature = "python")]
mod bindings;

pub use element::Float;

/// Why a ferroquant environment variable (`FERROQUANT_NUM_THREADS`,
/// `FERROQUANT_BIND_THREADS`, `FERROQUANT_SIMD`) is ignored, one message each;
/// empty if none is.
pub fn env_warnings() -> Vec<String> {
    [
        parallel::env_warning(),
        parallel::bind_env_warning(),
        simd::env_warning(),
    ]
    .into_iter()
    .flatten()
    .collect()
}
pub use error::{QuantError, Result};
