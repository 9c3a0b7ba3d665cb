//! File formats, parsed by the libraries that define them.

pub mod safetensors_header;
pub mod spilled;
