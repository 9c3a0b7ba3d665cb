//! SIMD primitives and their runtime dispatch: the only home of `unsafe`.
//!
//! The instruction set is detected once ([`Isa::detected`], cached in an
//! atomic), never fixed at compile time, so one wheel runs on any x86-64 CPU
//! and uses AVX-512 where it exists. `FERROQUANT_SIMD=scalar` (or `avx2`)
//! caps the choice, for debugging and for comparing paths.
//!
//! - `isa.rs`: the table of tiers, detection, the environment cap.
//! - `kernels.rs`: the primitive trait, over one contiguous run each.
//! - `scalar.rs`: the specification of every primitive.
//! - `avx2.rs`, `avx512.rs`: lane helpers and the implementations.
//! - `dispatch.rs`: one `#[target_feature]` entry point per tier and the safe
//!   dispatcher, an exhaustive match over tiers.
//! - `fpenv.rs`: the floating-point environment kernels compute in.
//!
//! Every SIMD path reproduces the scalar one bit for bit (`tests/kernels/`)
//! on the inputs the drivers in `ops/` hand them: they check first what the
//! primitives assume. Finite values (non-finite ones are found by the
//! max-abs pass before any code is made), finite positive scales,
//! `qmin <= qmax` and a clip > 0, `k >= 1` for the integer dot products. Off
//! that contract a primitive stays memory-safe (a slice shorter than its
//! stated length panics) but its result is unspecified and may differ
//! between tiers, or the scalar one may panic. Call `ops/`, not these, with
//! untrusted input.
//!
//! Primitives compute in the default floating-point environment (round to
//! nearest even, no flush-to-zero, no denormals-are-zero): several convert
//! with the current rounding mode (`vcvtps2dq`). The drivers in `ops/` pin
//! it for the call ([`fpenv::Pinned`]); a caller of these primitives that may
//! run under another MXCSR does the same.

#![allow(unsafe_code)]

pub mod fpenv;
pub mod gemm;
pub mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod dispatch;
mod isa;
mod kernels;

pub use dispatch::{
    absmax_bits, absmax_bits_ahead, absmax_blocks, absmax_columns, affine_dequantize_bf16,
    affine_dequantize_f16, affine_dequantize_f32, affine_dequantize_f64, affine_quantize_f32,
    affine_quantize_f32_ahead, affine_quantize_f32_then_range, affine_quantize_f64,
    affine_quantize_int4_f32, affine_quantize_int4_f32_ahead, affine_quantize_int4_f32_then_range,
    bf16_to_f32, dequantize_scaled, dot_dequant_i4_rows, dot_dequant_i8_rows, f16_to_f32,
    f16_to_f32_streamed, f32_to_bf16, f32_to_f16, f32_to_f16_streamed, f64_to_f32, f64_to_f32_odd,
    i8_dots, i8_dots_packs, i8_products, pack_int4, pack_tokens, quantize_scaled,
    quantize_scaled_ahead, quantize_scaled_then_absmax, range_f32, range_f64, row_range, rows_out,
    scaled_blocks_dequantize, select_at_least, shifted_moments, unpack_int4, RowsOut,
};
pub use isa::{env_warning, Isa, ENV_SIMD};
pub use kernels::{
    AbsmaxRule, Affine, PackedTokens, Range, Store, F32_INF_BITS, PACKED_MIN_TOKENS,
};
