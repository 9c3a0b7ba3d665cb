//! W8A8 integer products (SPEC §3) and the quantized linear layer's fused
//! forward pass (SPEC §2, through [`LinearPlan`]): extract, release the GIL
//! around one `ops` call, map the error, return the NumPy-allocated result.

use super::arrays::{borrow_error, exact, output, with_float_slice, writable, FloatArray};
use super::errors::to_pyerr;
use super::gil::Detach;
use crate::ops::linear::{self, DequantDtype, QuantizedWeight, WeightCodes};
use crate::ops::w8a8::{w8a8_matmul_with, Batch};
use numpy::{
    PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Flat float32 `[tokens, out_features]` (or `[out_features]` when `tokens`
/// is `None`: one activation vector with one scale) of the int8 `weight`
/// (`[out_features, in_features]`, C order) times the quantized activations.
#[pyfunction]
#[pyo3(signature = (weight, out_features, in_features, weight_scales, activations, tokens))]
pub(crate) fn w8a8_product<'py>(
    py: Python<'py>,
    weight: &Bound<'py, PyAny>,
    out_features: usize,
    in_features: usize,
    weight_scales: &Bound<'py, PyAny>,
    activations: &Bound<'py, PyAny>,
    tokens: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let w = exact::<i8>("weight_i8", "int8", weight)?;
    let ws = exact::<f32>("weight_scales", "float32", weight_scales)?;
    let (wv, wsv) = (w.as_slice()?, ws.as_slice()?);
    let (batch, n_out) = match tokens {
        None => (Batch::Vector, out_features),
        Some(t) => (Batch::Tokens(t), t.saturating_mul(out_features)),
    };
    let x = FloatArray::extract("activations", activations)?;
    with_float_slice!(x, xs => {
        let codes = output::<i8>(py, xs.len())?;
        let out = output::<f32>(py, n_out)?;
        {
            let mut cw = writable(&codes)?;
            let mut ow = writable(&out)?;
            let (cs, os) = (cw.as_slice_mut()?, ow.as_slice_mut()?);
            let shape = [out_features, in_features];
            let isa = crate::simd::Isa::detected();
            py.detached(|| w8a8_matmul_with(isa, wv, shape, wsv, xs, batch, cs, os))
                .map_err(|e| to_pyerr(py, e))?;
        }
        Ok(out)
    })
}

/// A quantized weight's codes, held for [`LinearPlan`].
enum PlanCodes {
    Int8(Py<PyArrayDyn<i8>>),
    Int4(Py<PyArrayDyn<u8>>),
}

/// `QuantizedLinear`'s forward pass, the weight's side prepared once: the
/// codes (int8, or int4 packed two a byte, with `bits` 8 or 4), scales, zero
/// points, bias and the dtype `dequantize` gives, checked at construction, the scales, zero points and bias copied, and the
/// f32 row parameters worked out (`linear::RowParams`). A call takes only
/// `x`, and only a C-contiguous, aligned native float32 `numpy.ndarray` (not
/// a subclass) of shape `(in_features,)` or `(tokens, in_features)`: for any
/// other `x`, or a weight that failed the checks, it returns `None` and the
/// caller takes the general path, `run` (which raises the errors). Between a
/// model's layers the caches are cold, and the Python-level checks, the
/// per-call extraction and the scan of the scales this replaces cost 35-60
/// us a call (4096² int4 weight after a 64 MiB copy, Zen 4), 6-10 % of it.
///
/// The weight's arrays must never change (a frozen `QuantizedTensor`'s
/// cannot): the plan keeps values derived from them.
#[pyclass(frozen, module = "ferroquant._ferroquant")]
pub(crate) struct LinearPlan {
    codes: PlanCodes,
    shape: [usize; 2],
    scales: Vec<f64>,
    zero_points: Vec<f64>,
    bias: Option<Vec<f32>>,
    dequant: DequantDtype,
    /// `None`: the weight failed the forward pass's checks.
    params: Option<linear::RowParams>,
}

#[pymethods]
impl LinearPlan {
    #[new]
    #[pyo3(signature = (codes, bits, out_features, in_features, scales, zero_points, bias, dequant_dtype))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        codes: &Bound<'_, PyAny>,
        bits: u32,
        out_features: usize,
        in_features: usize,
        scales: &Bound<'_, PyAny>,
        zero_points: &Bound<'_, PyAny>,
        bias: Option<&Bound<'_, PyAny>>,
        dequant_dtype: &str,
    ) -> PyResult<Self> {
        let dequant = parse_dequant(dequant_dtype)?;
        let bits = code_bits(bits)?;
        let scales = exact::<f64>("scales", "float64", scales)?
            .as_slice()?
            .to_vec();
        let zero_points = exact::<f64>("zero_points", "float64", zero_points)?
            .as_slice()?
            .to_vec();
        let bias = bias
            .map(|b| -> PyResult<Vec<f32>> {
                Ok(exact::<f32>("bias", "float32", b)?.as_slice()?.to_vec())
            })
            .transpose()?;
        let (i8c, u8c);
        let (weight_codes, held) = if bits == 4 {
            u8c = exact::<u8>("data", "uint8", codes)?;
            let held = PlanCodes::Int4(Bound::clone(&u8c).unbind());
            (WeightCodes::Int4(u8c.as_slice()?), held)
        } else {
            i8c = exact::<i8>("data", "int8", codes)?;
            let held = PlanCodes::Int8(Bound::clone(&i8c).unbind());
            (WeightCodes::Int8(i8c.as_slice()?), held)
        };
        let w = QuantizedWeight {
            codes: weight_codes,
            shape: [out_features, in_features],
            scales: &scales,
            zero_points: &zero_points,
            dequant,
        };
        let params = prepare(&w, bias.as_deref());
        Ok(LinearPlan {
            codes: held,
            shape: [out_features, in_features],
            scales,
            zero_points,
            bias,
            dequant,
            params,
        })
    }

    /// `x @ dequant(W).T + bias`, float32, of shape `x.shape[:-1] + (out,)`;
    /// `None` for an `x` (or a weight) the general path must take.
    fn __call__<'py>(&self, x: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = x.py();
        let Some(params) = &self.params else {
            return Ok(None);
        };
        if !x.is_exact_instance_of::<PyUntypedArray>() {
            return Ok(None);
        }
        let Ok(arr) = x.cast::<PyArrayDyn<f32>>() else {
            return Ok(None);
        };
        let [out_f, in_f] = self.shape;
        let tokens = match arr.shape() {
            [n] if *n == in_f => 1,
            [t, n] if *n == in_f => *t,
            _ => return Ok(None),
        };
        // The address only, never dereferenced here.
        if !arr.is_c_contiguous() || !(arr.data() as usize).is_multiple_of(4) {
            return Ok(None);
        }
        let xr = arr.try_readonly().map_err(|e| borrow_error("x", e))?;
        let xs = xr.as_slice()?;
        let held = self.borrow_codes(py)?;
        let w = self.weight(held.codes()?);
        let out = output::<f32>(py, tokens.saturating_mul(out_f))?;
        {
            let mut ow = writable(&out)?;
            let os = ow.as_slice_mut()?;
            let bias = self.bias.as_deref();
            let isa = crate::simd::Isa::detected();
            py.detached(|| linear::linear_forward_prepared(isa, &w, params, xs, tokens, bias, os))
                .map_err(|e| to_pyerr(py, e))?;
        }
        Ok(Some(if arr.ndim() == 1 {
            out.into_any()
        } else {
            out.reshape([tokens, out_f])?.into_any()
        }))
    }

    /// The general path: flat float32 `[tokens, out_features]` for a flat
    /// C-contiguous `x` of any float dtype (float64, float16 and bfloat16
    /// converted a block of tokens at a time), with every check of the
    /// forward pass run and raised (a weight that failed them included).
    fn run<'py>(
        &self,
        x: &Bound<'py, PyAny>,
        tokens: usize,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let py = x.py();
        let xa = FloatArray::extract("x", x)?;
        let held = self.borrow_codes(py)?;
        let w = self.weight(held.codes()?);
        let out = output::<f32>(py, tokens.saturating_mul(self.shape[0]))?;
        {
            let mut ow = writable(&out)?;
            let os = ow.as_slice_mut()?;
            let bias = self.bias.as_deref();
            with_float_slice!(xa, xs => {
                py.detached(|| linear::linear_forward_from(&w, xs, tokens, bias, os))
                    .map_err(|e| to_pyerr(py, e))?;
            });
        }
        Ok(out)
    }
}

impl LinearPlan {
    /// The weight's codes, lent for one call.
    fn borrow_codes<'py>(&self, py: Python<'py>) -> PyResult<HeldCodes<'py>> {
        Ok(match &self.codes {
            PlanCodes::Int8(c) => HeldCodes::Int8(
                c.bind(py)
                    .try_readonly()
                    .map_err(|e| borrow_error("data", e))?,
            ),
            PlanCodes::Int4(c) => HeldCodes::Int4(
                c.bind(py)
                    .try_readonly()
                    .map_err(|e| borrow_error("data", e))?,
            ),
        })
    }

    /// The weight with `codes`, and the plan's own copies of its parameters.
    fn weight<'a>(&'a self, codes: WeightCodes<'a>) -> QuantizedWeight<'a> {
        QuantizedWeight {
            codes,
            shape: self.shape,
            scales: &self.scales,
            zero_points: &self.zero_points,
            dequant: self.dequant,
        }
    }
}

/// [`PlanCodes`] lent for a call.
enum HeldCodes<'py> {
    Int8(PyReadonlyArrayDyn<'py, i8>),
    Int4(PyReadonlyArrayDyn<'py, u8>),
}

impl HeldCodes<'_> {
    fn codes(&self) -> PyResult<WeightCodes<'_>> {
        Ok(match self {
            HeldCodes::Int8(c) => WeightCodes::Int8(c.as_slice()?),
            HeldCodes::Int4(c) => WeightCodes::Int4(c.as_slice()?),
        })
    }
}

/// The row parameters of a weight that passes the forward pass's checks
/// (with no activation), else `None`.
fn prepare(w: &QuantizedWeight<'_>, bias: Option<&[f32]>) -> Option<linear::RowParams> {
    linear::check_weight(w, bias).ok()?;
    linear::RowParams::new(w).ok()
}

/// `bits`, which must be 8 (int8 codes) or 4 (packed int4 codes).
fn code_bits(bits: u32) -> PyResult<u32> {
    match bits {
        4 | 8 => Ok(bits),
        _ => Err(PyValueError::new_err(format!(
            "bits: expected 8 or 4, got {bits}"
        ))),
    }
}

/// The dtype named `name`, one `dequantize` can give.
fn parse_dequant(name: &str) -> PyResult<DequantDtype> {
    DequantDtype::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "dequant_dtype: expected float32, float64, float16 or bfloat16, got {name:?}"
        ))
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<LinearPlan>()?;
    m.add_function(wrap_pyfunction!(w8a8_product, m)?)?;
    Ok(())
}
