//! The crate's one error type.
//!
//! Every fallible kernel returns [`Result`]. Messages name the offending
//! argument and say what was expected and what was found; the Python bindings
//! map each variant to one exception class of `ferroquant.errors`.

use std::fmt;

/// Everything a kernel can refuse.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantError {
    /// A configuration parameter is out of its domain (block size 0, bits out of range, ...).
    InvalidConfig {
        /// Name of the argument, as the public API spells it.
        arg: &'static str,
        /// What was wrong, including the expected and the actual value.
        msg: String,
    },
    /// Two arguments' shapes or lengths do not agree.
    ShapeMismatch {
        /// Name of the argument whose shape is wrong.
        arg: &'static str,
        /// The shape or length that was expected.
        expected: String,
        /// The shape or length that was given.
        actual: String,
    },
    /// An argument that must hold at least one element is empty.
    EmptyInput {
        /// Name of the empty argument.
        arg: &'static str,
    },
    /// An input holds NaN or ±infinity (after conversion to working precision).
    NonFinite {
        /// Name of the argument holding the value.
        arg: &'static str,
        /// Flat (C-order) index of the first non-finite element.
        index: usize,
    },
    /// A blockwise scale does not fit the requested scale dtype (f16 overflow).
    ScaleOverflow {
        /// Index of the first block whose scale overflowed.
        block: usize,
        /// That block's f32 scale (max |x| / 127).
        scale: f32,
    },
    /// Serialized data is malformed or inconsistent.
    Format {
        /// What was wrong with it.
        msg: String,
    },
    /// A call's working memory could not be allocated.
    OutOfMemory {
        /// What the memory was for.
        what: &'static str,
        /// How many bytes were asked for.
        bytes: usize,
    },
}

/// Shorthand for `std::result::Result<T, QuantError>`.
pub type Result<T> = std::result::Result<T, QuantError>;

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantError::InvalidConfig { arg, msg } => write!(f, "invalid {arg}: {msg}"),
            QuantError::ShapeMismatch {
                arg,
                expected,
                actual,
            } => write!(f, "{arg}: expected {expected}, got {actual}"),
            QuantError::EmptyInput { arg } => {
                write!(f, "{arg} is empty: expected at least one element")
            }
            QuantError::NonFinite { arg, index } => write!(
                f,
                "{arg} holds a non-finite value (NaN or ±inf) at flat index {index}"
            ),
            QuantError::ScaleOverflow { block, scale } => write!(
                f,
                "invalid scales: the scale of block {block} (max |x| / 127 = {scale:e}) \
                 overflows float16 (largest finite 65504); use float32 scales"
            ),
            QuantError::Format { msg } => write!(f, "malformed data: {msg}"),
            QuantError::OutOfMemory { what, bytes } if *bytes == usize::MAX => {
                // Saturated: the size itself does not fit in usize.
                write!(
                    f,
                    "out of memory: {what} would take more than {bytes} bytes"
                )
            }
            QuantError::OutOfMemory { what, bytes } => {
                write!(
                    f,
                    "out of memory: {bytes} bytes for {what} could not be allocated"
                )
            }
        }
    }
}

impl std::error::Error for QuantError {}

/// `n` copies of `v` in a new vector, or [`QuantError::OutOfMemory`] naming
/// `what` when the memory cannot be had (where `vec![v; n]` would abort the
/// process): for working memory whose size follows the caller's input.
pub(crate) fn try_filled<T: Clone>(n: usize, v: T, what: &'static str) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| QuantError::OutOfMemory {
            what,
            bytes: n.saturating_mul(std::mem::size_of::<T>()),
        })?;
    out.resize(n, v);
    Ok(out)
}

impl QuantError {
    /// Shorthand for an [`QuantError::InvalidConfig`].
    pub fn invalid(arg: &'static str, msg: impl Into<String>) -> Self {
        QuantError::InvalidConfig {
            arg,
            msg: msg.into(),
        }
    }

    /// Shorthand for a [`QuantError::ShapeMismatch`] over lengths.
    pub fn len_mismatch(arg: &'static str, expected: usize, actual: usize) -> Self {
        QuantError::ShapeMismatch {
            arg,
            expected: format!("length {expected}"),
            actual: format!("length {actual}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_working_memory_is_an_error_not_an_abort() {
        let e = try_filled(usize::MAX / 2, 0f32, "the test's scratch").unwrap_err();
        assert_eq!(
            e,
            QuantError::OutOfMemory {
                what: "the test's scratch",
                bytes: usize::MAX, // the byte count saturates
            }
        );
        assert!(e.to_string().starts_with("out of memory: "), "{e}");
        assert_eq!(try_filled(3, 7u8, "three").unwrap(), vec![7, 7, 7]);
    }

    #[test]
    fn messages_name_the_argument() {
        let e = QuantError::NonFinite { arg: "x", index: 7 };
        assert!(e.to_string().starts_with("x holds a non-finite value"));
        assert!(e.to_string().contains("index 7"));
        let e = QuantError::len_mismatch("codes", 3, 4);
        assert_eq!(e.to_string(), "codes: expected length 3, got length 4");
        let e = QuantError::ScaleOverflow {
            block: 2,
            scale: 1e5,
        };
        assert!(e.to_string().contains("float32 scales"));
        // The core names no language's API (the bindings add scale_dtype=np.float32).
        assert!(!e.to_string().contains("np."));
    }
}
