//! Shared by the golden-vector writers (`examples/write_golden_*.rs`):
//! little-endian bytes of each float type and the file writer.

// Each writer includes this module and uses a different part of it.
#![allow(dead_code)]

use ferroquant::Float;
use half::{bf16, f16};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;

/// Named tensors to write: name, dtype, shape, little-endian bytes.
pub type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

/// A float type stored in its own width, little-endian.
pub trait Le: Float {
    const DTYPE: Dtype;
    fn le(self) -> Vec<u8>;
}

macro_rules! le_impl {
    ($t:ty, $d:expr) => {
        impl Le for $t {
            const DTYPE: Dtype = $d;
            fn le(self) -> Vec<u8> {
                self.to_le_bytes().to_vec()
            }
        }
    };
}
le_impl!(f32, Dtype::F32);
le_impl!(f64, Dtype::F64);
le_impl!(f16, Dtype::F16);
le_impl!(bf16, Dtype::BF16);

/// The little-endian bytes of a slice.
pub fn bytes<T: Le>(v: &[T]) -> Vec<u8> {
    v.iter().flat_map(|e| e.le()).collect()
}

/// Write `tensors` to `tests/golden/<file>` with the `cases` metadata entry.
pub fn write(file: &str, tensors: &Tensors, cases: &[String]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dt, shape, data)| {
            (
                name.clone(),
                TensorView::new(*dt, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let path = format!("{}/tests/golden/{file}", env!("CARGO_MANIFEST_DIR"));
    let meta = HashMap::from([("cases".to_string(), format!("[{}]", cases.join(", ")))]);
    safetensors::serialize_to_file(views, Some(meta), std::path::Path::new(&path)).unwrap();
    println!("wrote {path} ({} cases)", cases.len());
}
