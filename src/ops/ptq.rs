//! Post-training int8 — SPEC §5, ported from seed 004 (sensorlm
//! `quantization/int8.rs`): per-layer weight ranges ([`Calibrator`]),
//! symmetric per-tensor int8 weights ([`QuantizedWeights`]) and a model of
//! them ([`QuantizedModel`]) saved as the seed's JSON.
//!
//! Math in f32, as the seed: `scale = max(scale or max |w| / 127, 1e-8)`,
//! codes `clamp(round(w / scale), -127, 127)`, values `q as f32 * scale`.
//! The max-abs pass (with the fused non-finite check) and the codes are the
//! dynamic int8 kernels of SPEC §3, so they run on every SIMD tier and across
//! the pool.
//!
//! The JSON is the seed's `serde_json::to_string_pretty` of its structs, byte
//! for byte: the same field names and order, written by serde_json's pretty
//! printer (f32 values in ryu's shortest form, as serde_json printed them when
//! the seed was written; `weights_i8` as JSON integers; a missing bias as
//! `null`). A file the seed wrote loads here, and the other
//! way round.
//!
//! Deviations (SPEC): codes are held as `i8`, not `i32` (7; the JSON is the
//! same); non-finite weights are an error (2); a supplied scale must be finite
//! and positive (the seed turns NaN, 0 and negative scales into 1e-8); an
//! empty weight cannot be calibrated (the seed records `+inf`/`-inf`); loaded
//! JSON is checked (codes in the int8 range by type, counts against `shape`,
//! no unknown or duplicate field, finite floats).
//!
//! ```
//! # fn main() -> Result<(), ferroquant::QuantError> {
//! use ferroquant::ops::ptq::{quantize_model_weights, QuantizedModel};
//!
//! let w: Vec<f32> = (0..12).map(|i| i as f32 * 0.1 - 0.6).collect();
//! let model = quantize_model_weights(
//!     "{}".to_string(),
//!     vec![("fc".to_string(), w, vec![3, 4], Some(vec![0.5, 0.0, -0.5]))],
//! )?;
//! assert_eq!(model.total_fp32_bytes, 48);
//! assert_eq!(model.layers[0].weights_i8[0], -127);
//! let json = model.to_json()?;
//! assert!(json.starts_with("{\n  \"config_json\": \"{}\",\n  \"layers\": [\n"));
//! assert_eq!(QuantizedModel::from_json(json.as_bytes())?, model);
//! # Ok(())
//! # }
//! ```

use crate::element::Float;
use crate::error::{QuantError, Result};
use crate::ops::dynamic::{self, for_each_stage, quantize_known_scale, DynCodes, ScaleMode};
use crate::parallel;
use crate::simd::{self, Isa, Range};
use crate::stage::STAGE;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// The smallest scale: the seed's `.max(1e-8)`.
pub const MIN_SCALE: f32 = 1e-8;

/// The largest code magnitude (symmetric int8).
pub const QMAX: f32 = 127.0;

/// The `scheme` string [`quantize_model_weights`] records.
pub const SCHEME: &str = "symmetric_per_tensor_int8";

/// Calibration data of one layer (the seed's struct; `act_*` are the seed's
/// placeholders for weight-only PTQ).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerCalibration {
    /// Layer name.
    pub name: String,
    /// Smallest weight.
    pub w_min: f32,
    /// Largest weight.
    pub w_max: f32,
    /// Smallest input activation (`-1.0` from [`Calibrator`]).
    pub act_min: f32,
    /// Largest input activation (`1.0` from [`Calibrator`]).
    pub act_max: f32,
}

impl LayerCalibration {
    /// The symmetric int8 weight scale `max(|w_min|, |w_max|) / 127` (f32).
    pub fn weight_scale(&self) -> f32 {
        self.w_min.abs().max(self.w_max.abs()) / QMAX
    }
}

/// The range of no values (what [`Range::merge`] starts from).
const EMPTY: Range<f32> = Range {
    min: f32::INFINITY,
    max: f32::NEG_INFINITY,
    non_finite: false,
};

/// Records the weight range of each layer (the seed's `Calibrator`).
#[derive(Debug, Clone, Default)]
pub struct Calibrator {
    calibrations: Vec<LayerCalibration>,
}

impl Calibrator {
    /// An empty calibrator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record layer `name`'s weights: their exact min and max (read as f32),
    /// activations `[-1, 1]` as the seed's placeholder.
    ///
    /// Errors: `EmptyInput` for no weights; `NonFinite` naming `w`.
    pub fn record_layer<T: Float>(&mut self, name: String, weights: &[T]) -> Result<()> {
        let (w_min, w_max) = weight_range(weights)?;
        self.calibrations.push(LayerCalibration {
            name,
            w_min,
            w_max,
            act_min: -1.0,
            act_max: 1.0,
        });
        Ok(())
    }

    /// The recorded layers, in order.
    pub fn finish(self) -> Vec<LayerCalibration> {
        self.calibrations
    }
}

/// Min and max of `w` read as f32, in one pass with the non-finite check,
/// across the pool for long inputs.
///
/// Errors: `EmptyInput` naming `w`; `NonFinite` naming `w` and the
/// first NaN or infinity (a value that becomes infinite in f32 included).
pub fn weight_range<T: Float>(w: &[T]) -> Result<(f32, f32)> {
    weight_range_with(Isa::detected(), w)
}

/// [`weight_range`] on a chosen ISA.
pub fn weight_range_with<T: Float>(isa: Isa, w: &[T]) -> Result<(f32, f32)> {
    if w.is_empty() {
        return Err(QuantError::EmptyInput { arg: "w" });
    }
    // The range of a run, staged as f32 by the dynamic family's stage loop.
    let part = |xs: &[T]| -> std::result::Result<Range<f32>, usize> {
        let mut acc = EMPTY;
        for_each_stage(isa, xs, &mut Vec::new(), |off, xf| {
            let r = simd::range_f32(isa, xf);
            if r.non_finite {
                return Err(off + simd::scalar::first_non_finite(xf));
            }
            acc = acc.merge(r);
            Ok(())
        })?;
        Ok(acc)
    };
    let n = w.len();
    let r = parallel::run(n, |par| {
        if !par {
            return part(w);
        }
        let chunk = parallel::units_per_task(n.div_ceil(STAGE), STAGE) * STAGE;
        w.par_chunks(chunk)
            .enumerate()
            .map(|(t, xs)| part(xs).map_err(|i| t * chunk + i))
            .reduce(
                || Ok(EMPTY),
                |a, b| parallel::first_error(a, b, Range::merge),
            )
    })
    .map_err(|index| QuantError::NonFinite { arg: "w", index })?;
    Ok((r.min, r.max))
}

/// The seed's `from_f32` codes: writes `codes` and returns the scale,
/// `max(scale or max |w| / 127, 1e-8)`.
///
/// Errors: `InvalidConfig` naming `scale` for a supplied scale that is not
/// finite and positive; `ShapeMismatch` naming `codes`; `NonFinite` naming
/// `w` (checked even when the scale is supplied).
pub fn quantize_weights<T: Float>(w: &[T], scale: Option<f32>, codes: &mut [i8]) -> Result<f32> {
    quantize_weights_with(Isa::detected(), w, scale, codes)
}

/// [`quantize_weights`] on a chosen ISA.
pub fn quantize_weights_with<T: Float>(
    isa: Isa,
    w: &[T],
    scale: Option<f32>,
    codes: &mut [i8],
) -> Result<f32> {
    if let Some(s) = scale {
        if !(s.is_finite() && s > 0.0) {
            return Err(QuantError::invalid(
                "scale",
                format!("expected a finite scale > 0, got {s}"),
            ));
        }
    }
    if codes.len() != w.len() {
        return Err(QuantError::len_mismatch("codes", w.len(), codes.len()));
    }
    // max |w| / 127 (0.0 for all zeros), with the non-finite check.
    let from_data =
        dynamic::compute_scale_with(isa, w, QMAX, ScaleMode::MaxAbs).map_err(|e| match e {
            QuantError::NonFinite { index, .. } => QuantError::NonFinite { arg: "w", index },
            other => other,
        })?;
    let s = scale.unwrap_or(from_data).max(MIN_SCALE);
    quantize_known_scale(isa, w, s, QMAX, codes);
    Ok(s)
}

/// `out[i] = q[i] as f32 * scale`, across the pool for long inputs.
///
/// Errors: `ShapeMismatch` naming `out` when the lengths differ.
pub fn dequantize_weights(q: &[i8], scale: f32, out: &mut [f32]) -> Result<()> {
    if out.len() != q.len() {
        return Err(QuantError::len_mismatch("out", q.len(), out.len()));
    }
    dynamic::dequantize_groups(DynCodes::Int8(q), q.len().max(1), &[scale], out)
}

pub use super::shape_numel;

/// A borrowed [`QuantizedWeights`]: what the JSON writer serializes (the
/// owned type serializes through it, so both write the same bytes).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct QuantizedWeightsRef<'a> {
    /// Layer name.
    pub name: &'a str,
    /// Codes in row-major order.
    pub weights_i8: &'a [i8],
    /// Weight shape.
    pub shape: &'a [usize],
    /// Per-tensor scale.
    pub scale: f32,
    /// Bias, kept in f32.
    pub bias: Option<&'a [f32]>,
}

impl QuantizedWeightsRef<'_> {
    /// Check what the seed's format cannot express or a reader would refuse:
    /// `weights_i8.len()` must be the product of `shape`, a bias must have
    /// `shape[0]` finite values, the scale must be finite and > 0.
    ///
    /// Errors: `ShapeMismatch` naming `weights_i8` or `bias`; `InvalidConfig`
    /// naming `scale`; `NonFinite` naming `bias`.
    pub fn validate(&self) -> Result<()> {
        let numel = shape_numel(self.shape);
        if numel != Some(self.weights_i8.len()) {
            return Err(QuantError::ShapeMismatch {
                arg: "weights_i8",
                expected: format!("{} values for shape {:?}", fmt_count(numel), self.shape),
                actual: format!("{} values", self.weights_i8.len()),
            });
        }
        // `from_f32` never makes a scale below 1e-8: 0 or a negative scale
        // would dequantize to zeros or flip every sign.
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(QuantError::invalid(
                "scale",
                format!("expected a finite scale > 0, got {}", self.scale),
            ));
        }
        if let Some(b) = self.bias {
            match self.shape.first() {
                Some(&out) if out == b.len() => {}
                first => {
                    return Err(QuantError::ShapeMismatch {
                        arg: "bias",
                        expected: match first {
                            Some(out) => format!("{out} values (shape[0])"),
                            None => "no bias for a 0-d weight".into(),
                        },
                        actual: format!("{} values", b.len()),
                    })
                }
            }
            if let Some(index) = b.iter().position(|v| !v.is_finite()) {
                return Err(QuantError::NonFinite { arg: "bias", index });
            }
        }
        Ok(())
    }
}

fn fmt_count(n: Option<usize>) -> String {
    n.map_or_else(|| "more than usize::MAX".to_string(), |n| n.to_string())
}

/// Int8 weights of one layer (the seed's struct; codes held as `i8`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantizedWeights {
    /// Layer name.
    pub name: String,
    /// Codes, row-major: `from_f32` gives `[-127, 127]`; a loaded or
    /// hand-built layer may hold any int8 (SPEC §5 refuses only values outside
    /// the int8 range).
    pub weights_i8: Vec<i8>,
    /// Weight shape (`[out_features, in_features]` for a linear layer).
    pub shape: Vec<usize>,
    /// Per-tensor scale.
    pub scale: f32,
    /// Bias, kept in f32.
    pub bias: Option<Vec<f32>>,
}

impl Serialize for QuantizedWeights {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.as_ref().serialize(s)
    }
}

impl QuantizedWeights {
    /// Quantize `w` (row-major, of `shape`): the seed's `from_f32`.
    ///
    /// Errors: as [`quantize_weights`], and `ShapeMismatch` when `w` does not
    /// hold `shape`'s element count or `bias` does not hold `shape[0]` finite
    /// values.
    pub fn from_f32<T: Float>(
        name: String,
        w: &[T],
        shape: Vec<usize>,
        bias: Option<Vec<f32>>,
        scale: Option<f32>,
    ) -> Result<Self> {
        if shape_numel(&shape) != Some(w.len()) {
            return Err(QuantError::ShapeMismatch {
                arg: "w",
                expected: format!(
                    "{} values for shape {shape:?}",
                    fmt_count(shape_numel(&shape))
                ),
                actual: format!("{} values", w.len()),
            });
        }
        let mut weights_i8 = vec![0i8; w.len()];
        let scale = quantize_weights(w, scale, &mut weights_i8)?;
        let qw = QuantizedWeights {
            name,
            weights_i8,
            shape,
            scale,
            bias,
        };
        qw.as_ref().validate()?;
        Ok(qw)
    }

    /// The borrowed view (what is serialized).
    pub fn as_ref(&self) -> QuantizedWeightsRef<'_> {
        QuantizedWeightsRef {
            name: &self.name,
            weights_i8: &self.weights_i8,
            shape: &self.shape,
            scale: self.scale,
            bias: self.bias.as_deref(),
        }
    }

    /// `q as f32 * scale` for every code.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.weights_i8.len()];
        dequantize_weights(&self.weights_i8, self.scale, &mut out)
            .expect("out has the codes' length");
        out
    }

    /// Bytes of the codes (one a code).
    pub fn size_bytes(&self) -> usize {
        self.weights_i8.len()
    }

    /// Bytes the f32 weights would take.
    pub fn original_size_bytes(&self) -> usize {
        self.weights_i8.len() * 4
    }

    /// `original_size_bytes as f32 / size_bytes as f32` (NaN for no weights, as the seed).
    pub fn compression_ratio(&self) -> f32 {
        self.original_size_bytes() as f32 / self.size_bytes() as f32
    }
}

/// A borrowed [`QuantizedModel`], serialized exactly as the owned one.
#[derive(Debug, Clone, Serialize)]
pub struct QuantizedModelRef<'a> {
    /// Model configuration, as JSON text.
    pub config_json: &'a str,
    /// Every quantized layer.
    pub layers: Vec<QuantizedWeightsRef<'a>>,
    /// Scheme name.
    pub scheme: &'a str,
    /// Sum of the layers' `size_bytes`.
    pub total_quantized_bytes: usize,
    /// Sum of the layers' `original_size_bytes`.
    pub total_fp32_bytes: usize,
}

impl QuantizedModelRef<'_> {
    /// Write the seed's `serde_json::to_string_pretty` bytes (no trailing
    /// newline), after checking every layer ([`QuantizedWeightsRef::validate`]).
    pub fn write_json<W: Write>(&self, w: W) -> Result<()> {
        for l in &self.layers {
            l.validate()?;
        }
        let mut ser = serde_json::Serializer::with_formatter(w, SeedFormatter::default());
        self.serialize(&mut ser)
            .map_err(|e| QuantError::Format { msg: e.to_string() })
    }
}

/// serde_json's pretty printer with f32 values in ryu's shortest text, as
/// serde_json printed them when seed 004 was written (recent serde_json
/// releases format `1e16f32` as `1e+16`; ryu, and so the seed, as `1e16`).
/// Only finite values reach it: the layers are
/// validated first.
#[derive(Default)]
struct SeedFormatter<'a>(serde_json::ser::PrettyFormatter<'a>);

impl serde_json::ser::Formatter for SeedFormatter<'_> {
    fn write_f32<W: ?Sized + Write>(&mut self, w: &mut W, value: f32) -> std::io::Result<()> {
        w.write_all(ryu::Buffer::new().format_finite(value).as_bytes())
    }
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

/// Int8 weights of a whole model (the seed's struct).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantizedModel {
    /// Model configuration, as JSON text.
    pub config_json: String,
    /// Every quantized layer.
    pub layers: Vec<QuantizedWeights>,
    /// Scheme name ([`SCHEME`] from [`quantize_model_weights`]).
    pub scheme: String,
    /// Sum of the layers' `size_bytes`.
    pub total_quantized_bytes: usize,
    /// Sum of the layers' `original_size_bytes`.
    pub total_fp32_bytes: usize,
}

impl Serialize for QuantizedModel {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.as_ref().serialize(s)
    }
}

impl QuantizedModel {
    /// The borrowed view (what is serialized).
    pub fn as_ref(&self) -> QuantizedModelRef<'_> {
        QuantizedModelRef {
            config_json: &self.config_json,
            layers: self.layers.iter().map(QuantizedWeights::as_ref).collect(),
            scheme: &self.scheme,
            total_quantized_bytes: self.total_quantized_bytes,
            total_fp32_bytes: self.total_fp32_bytes,
        }
    }

    /// `total_fp32_bytes as f32 / max(total_quantized_bytes, 1) as f32`.
    pub fn compression_ratio(&self) -> f32 {
        self.total_fp32_bytes as f32 / self.total_quantized_bytes.max(1) as f32
    }

    /// The seed's JSON text (`serde_json::to_string_pretty`).
    ///
    /// Errors: as [`QuantizedWeightsRef::validate`] for a layer the format
    /// cannot carry (a non-finite scale or bias would be written as `null`).
    pub fn to_json(&self) -> Result<String> {
        let mut buf = Vec::new();
        self.as_ref().write_json(&mut buf)?;
        Ok(String::from_utf8(buf).expect("serde_json writes UTF-8"))
    }

    /// Parse and check the seed's JSON.
    ///
    /// Errors: `Format` for malformed JSON, a missing, unknown or duplicate
    /// field (except a layer's `bias`, which serde reads as `None` when it is
    /// left out, as the seed does), a value of the wrong type (a code outside
    /// the int8 range included), or a layer that fails
    /// [`QuantizedWeightsRef::validate`].
    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        let model: QuantizedModel =
            serde_json::from_slice(bytes).map_err(|e| QuantError::Format { msg: e.to_string() })?;
        for (i, l) in model.layers.iter().enumerate() {
            l.as_ref().validate().map_err(|e| QuantError::Format {
                msg: format!("layer {i} ({:?}): {e}", l.name),
            })?;
        }
        Ok(model)
    }

    /// Write [`to_json`](Self::to_json)'s bytes to `path` (the seed's `save`),
    /// atomically, as the Python `save` does
    /// ([`write_atomic`](crate::formats::write_atomic)): a failure or a crash
    /// mid-write leaves the file as it was, symbolic links are followed and
    /// kept, a replaced file keeps its mode, a new one gets `0o666` less the
    /// umask.
    ///
    /// Errors: `InvalidInput` for a model `to_json` refuses; else those of
    /// `write_atomic` (a directory, a device, a file the caller may not
    /// write, what creating, writing or renaming returns), naming `path`.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        // The JSON first: a model `to_json` refuses leaves the file as it was.
        let mut bytes = Vec::new();
        self.as_ref()
            .write_json(&mut bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        crate::formats::write_atomic(path, &bytes)
    }

    /// Read a model [`save`](Self::save) (or the seed) wrote; malformed
    /// content is an `InvalidData` error carrying the [`QuantError`].
    ///
    /// Errors: also those of [`crate::formats::read_regular`]: a directory, a
    /// FIFO or a device is refused before any read (a FIFO without a writer
    /// would block forever), naming `path`.
    pub fn load(path: &Path) -> std::io::Result<Self> {
        let bytes = crate::formats::read_regular(path)?;
        Self::from_json(&bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }
}

/// Quantize `(name, weights, shape, bias)` layers into a model with the
/// seed's scheme name and byte totals (the seed's `quantize_model_weights`).
///
/// Errors: the first layer's error from [`QuantizedWeights::from_f32`].
pub fn quantize_model_weights(
    config_json: String,
    layers: impl IntoIterator<Item = (String, Vec<f32>, Vec<usize>, Option<Vec<f32>>)>,
) -> Result<QuantizedModel> {
    let mut quantized = Vec::new();
    let (mut total_fp32_bytes, mut total_quantized_bytes) = (0usize, 0usize);
    for (name, weights, shape, bias) in layers {
        let qw = QuantizedWeights::from_f32(name, &weights, shape, bias, None)?;
        total_fp32_bytes += qw.original_size_bytes();
        total_quantized_bytes += qw.size_bytes();
        quantized.push(qw);
    }
    Ok(QuantizedModel {
        config_json,
        layers: quantized,
        scheme: SCHEME.to_string(),
        total_quantized_bytes,
        total_fp32_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_refuses_what_is_not_a_regular_file_without_blocking() {
        // A review: a FIFO with no writer blocked `load` forever.
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("model.json");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (at, fifo_path) = (fifo.clone(), fifo.clone());
        std::thread::spawn(move || tx.send(QuantizedModel::load(&at).map(drop)));
        let got = rx.recv_timeout(std::time::Duration::from_secs(20));
        let e = got.expect("load blocked on a FIFO").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains("model.json"), "{e}");
        for (path, kind) in [
            (dir.path(), std::io::ErrorKind::IsADirectory),
            (Path::new("/dev/zero"), std::io::ErrorKind::InvalidInput),
        ] {
            let e = QuantizedModel::load(path).map(drop).unwrap_err();
            assert_eq!(e.kind(), kind, "{}: {e}", path.display());
        }
        let e = QuantizedModel::load(Path::new("")).map(drop).unwrap_err();
        assert!(e.to_string().starts_with("'' (an empty path): "), "{e}");
        // Refused without being opened: a writer blocked opening the FIFO stays
        // blocked (opening it to refuse it released the writer into nothing).
        let writer = std::thread::spawn(move || std::fs::write(&fifo, b"{}"));
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(QuantizedModel::load(&fifo_path).is_err());
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!writer.is_finished(), "load opened the FIFO");
        // Let the writer go: a reader opens the FIFO and takes what it writes.
        std::fs::read(&fifo_path).unwrap();
        writer.join().unwrap().unwrap();
    }

    #[test]
    fn a_model_that_cannot_be_saved_leaves_the_file_as_it_was() -> Result<()> {
        // A review: save created (emptied) the file before the JSON was refused.
        let mut m = quantize_model_weights(
            "{}".into(),
            [("l".to_string(), vec![1.0f32, -2.0], vec![2], None)],
        )?;
        let path = std::env::temp_dir().join(format!("fq-save-{}.json", std::process::id()));
        m.save(&path)
            .map_err(|e| QuantError::Format { msg: e.to_string() })?;
        let before = std::fs::read(&path).map_err(|e| QuantError::Format { msg: e.to_string() })?;
        m.layers[0].scale = f32::NAN;
        assert!(m.save(&path).is_err());
        let after = std::fs::read(&path).map_err(|e| QuantError::Format { msg: e.to_string() })?;
        let _ = std::fs::remove_file(&path);
        assert_eq!(after, before);
        Ok(())
    }

    #[cfg(unix)]
    #[test]
    fn save_replaces_atomically_and_keeps_the_mode() {
        use std::os::unix::fs::{symlink, PermissionsExt};
        let m = quantize_model_weights(
            "{}".into(),
            [("l".to_string(), vec![1.0f32, -2.0], vec![2], None)],
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        let names = || {
            let mut v: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            v.sort();
            v
        };
        // A new file: 0o666 less the umask (not the temporary file's 0o600).
        let new = dir.path().join("new.json");
        m.save(&new).unwrap();
        let umask = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("Umask:"))?.to_owned();
                u32::from_str_radix(line[6..].trim(), 8).ok()
            });
        if let Some(umask) = umask {
            assert_eq!(mode(&new), 0o666 & !umask);
        }
        assert_eq!(
            QuantizedModel::load(&new).unwrap().layers[0].weights_i8,
            vec![64, -127]
        );
        // A replaced file keeps its mode and gets the whole new text.
        let old = dir.path().join("old.json");
        std::fs::write(&old, b"old text").unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o640)).unwrap();
        m.save(&old).unwrap();
        assert_eq!(mode(&old), 0o640);
        assert_eq!(
            std::fs::read(&old).unwrap(),
            m.to_json().unwrap().into_bytes()
        );
        // Through a symbolic link: the file it points to is replaced, the link kept.
        let link = dir.path().join("link.json");
        symlink(&old, &link).unwrap();
        std::fs::write(&old, b"again").unwrap();
        m.save(&link).unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read(&old).unwrap(),
            m.to_json().unwrap().into_bytes()
        );
        // A directory at the path is an error and stays as it was.
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let e = m.save(&sub).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::IsADirectory, "{e}");
        assert!(std::fs::read_dir(&sub).unwrap().next().is_none());
        // A missing directory: NotFound naming the caller's path, nothing made.
        let e = m.save(&dir.path().join("no/such.json")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
        assert!(e.to_string().contains("no/such.json"), "{e}");
        assert!(!e.to_string().contains(".ferroquant-"), "{e}");
        // A dangling link: the file it names is made, the link kept.
        let dangling = dir.path().join("dangling.json");
        symlink("made.json", &dangling).unwrap();
        m.save(&dangling).unwrap();
        assert!(std::fs::symlink_metadata(&dangling)
            .unwrap()
            .file_type()
            .is_symlink());
        let made = dir.path().join("made.json");
        assert_eq!(
            std::fs::read(&made).unwrap(),
            m.to_json().unwrap().into_bytes()
        );
        // ... or, into a missing directory, NotFound with the link kept.
        let nowhere = dir.path().join("nowhere.json");
        symlink("no/such.json", &nowhere).unwrap();
        let e = m.save(&nowhere).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
        assert!(std::fs::symlink_metadata(&nowhere)
            .unwrap()
            .file_type()
            .is_symlink());
        // A trailing slash names a directory, as open(2) has it.
        for p in ["new.json/", "none.json/"] {
            let e = m.save(&dir.path().join(p)).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::IsADirectory, "{p}: {e}");
        }
        // A chain of 40 links (the kernel's limit) is followed; 41 are refused
        // as the kernel refuses them (ELOOP), leaving everything as it was.
        let chain = dir.path().join("chain");
        std::fs::create_dir(&chain).unwrap();
        for i in 0..41 {
            let to = if i == 0 {
                "../old.json".to_string()
            } else {
                format!("l{}", i - 1)
            };
            symlink(to, chain.join(format!("l{i}"))).unwrap();
        }
        std::fs::write(&old, b"chained").unwrap();
        m.save(&chain.join("l39")).unwrap();
        assert_eq!(
            std::fs::read(&old).unwrap(),
            m.to_json().unwrap().into_bytes()
        );
        std::fs::write(&old, b"chained").unwrap();
        let e = m.save(&chain.join("l40")).unwrap_err();
        assert!(e.to_string().contains("symbolic links"), "{e}");
        assert_eq!(std::fs::read(&old).unwrap(), b"chained");
        let errno = e
            .get_ref()
            .and_then(|inner| inner.source())
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .and_then(|s| s.raw_os_error());
        assert_eq!(errno, Some(40), "the system's error is the source");
        std::fs::remove_dir_all(&chain).unwrap();
        // A directory whose name holds tempfile's " at path ": the message is
        // still the caller's path and the system's text, nothing after.
        let odd = dir.path().join("q at path z");
        std::fs::create_dir(&odd).unwrap();
        let e = m.save(&odd.join("no/such.json")).unwrap_err();
        let want = format!("{}: ", odd.join("no/such.json").display());
        assert!(e.to_string().starts_with(&want), "{e}");
        assert!(e.to_string().ends_with("(os error 2)"), "{e}");
        std::fs::remove_dir(&odd).unwrap();
        // No temporary file is left behind by any of these.
        let all = [
            "dangling.json",
            "link.json",
            "made.json",
            "new.json",
            "nowhere.json",
            "old.json",
            "sub",
        ];
        assert_eq!(names(), all);
    }

    #[test]
    fn scale_floor_and_supplied_scale() -> Result<()> {
        let mut c = [0i8; 3];
        assert_eq!(quantize_weights(&[0f32; 3], None, &mut c)?, MIN_SCALE);
        assert_eq!(c, [0, 0, 0]);
        assert_eq!(
            quantize_weights(&[1f32, -3.0, 0.3], Some(1e-9), &mut c)?,
            MIN_SCALE
        );
        assert_eq!(c, [127, -127, 127]);
        assert_eq!(
            quantize_weights(&[1f32, -3.0, 0.3], Some(0.5), &mut c)?,
            0.5
        );
        assert_eq!(c, [2, -6, 1]);
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(matches!(
                quantize_weights(&[1f32], Some(bad), &mut c[..1]),
                Err(QuantError::InvalidConfig { arg: "scale", .. })
            ));
        }
        Ok(())
    }

    #[test]
    fn non_finite_is_named_even_with_a_scale() {
        let mut c = [0i8; 3];
        let err = quantize_weights(&[1f32, f32::NAN, 0.0], Some(1.0), &mut c).unwrap_err();
        assert_eq!(err, QuantError::NonFinite { arg: "w", index: 1 });
        let err = weight_range(&[1f64, 1e39]).unwrap_err();
        assert_eq!(err, QuantError::NonFinite { arg: "w", index: 1 });
        assert_eq!(
            weight_range::<f32>(&[]).unwrap_err(),
            QuantError::EmptyInput { arg: "w" }
        );
    }

    #[test]
    fn range_is_exact_across_chunks() -> Result<()> {
        let mut w: Vec<f32> = (0..300_001u64)
            .map(|i| ((i * 7919) % 1000) as f32 - 500.0)
            .collect();
        w[123_456] = -777.25;
        w[299_999] = 901.5;
        assert_eq!(weight_range(&w)?, (-777.25, 901.5));
        Ok(())
    }

    #[test]
    fn validate_rejects_what_json_cannot_carry() {
        let qw = QuantizedWeights {
            name: "l".into(),
            weights_i8: vec![1, 2],
            shape: vec![2, 1],
            scale: 0.5,
            bias: Some(vec![0.0, f32::NAN]),
        };
        assert_eq!(
            qw.as_ref().validate(),
            Err(QuantError::NonFinite {
                arg: "bias",
                index: 1
            })
        );
        let bad_count = QuantizedWeights {
            shape: vec![3],
            bias: None,
            ..qw.clone()
        };
        assert!(matches!(
            bad_count.as_ref().validate(),
            Err(QuantError::ShapeMismatch {
                arg: "weights_i8",
                ..
            })
        ));
    }
}
