//! The public Rust API refuses what a careless caller can build: sizes whose
//! products overflow, configs made without their constructors, wrong output
//! lengths, each with the argument it names (an adversarial review's repros).

use ferroquant::ops::affine::{self, Codes, QuantConfig};
use ferroquant::ops::dynamic::{self, DynCodesMut, DynFormat, ScaleMode};
use ferroquant::ops::linear::{linear_forward, DequantDtype, QuantizedWeight, WeightCodes};
use ferroquant::ops::ptq::QuantizedModel;
use ferroquant::ops::smooth::{compute_smooth_factors, SmoothQuantConfig};
use ferroquant::QuantError;

fn arg_of(e: QuantError) -> (&'static str, &'static str) {
    match e {
        QuantError::ShapeMismatch { arg, .. } => ("shape", arg),
        QuantError::InvalidConfig { arg, .. } => ("config", arg),
        QuantError::EmptyInput { arg } => ("empty", arg),
        QuantError::NonFinite { arg, .. } => ("non-finite", arg),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
#[should_panic(expected = "gemm_abt: slices shorter")]
fn gemm_sizes_whose_product_wraps_panic_instead_of_writing_out_of_bounds() {
    // (1 << 63) * 2 wraps to 0 in usize: the check must not pass empty slices.
    ferroquant::simd::gemm::gemm_abt(1 << 63, 2, 2, &[], &[0.0; 4], &mut []);
}

#[test]
fn linear_output_length_is_checked_without_overflow() {
    // in_features == 0 lets any token count through the `x` check; the output
    // length tokens x out_features overflows usize.
    let w = QuantizedWeight {
        codes: WeightCodes::Int8(&[]),
        shape: [2, 0],
        scales: &[1.0],
        zero_points: &[0.0],
        dequant: DequantDtype::F32,
    };
    let e = linear_forward(&w, &[], usize::MAX / 2 + 1, None, &mut []).unwrap_err();
    assert_eq!(arg_of(e), ("shape", "out"));
}

#[test]
fn affine_dequantize_names_the_short_argument() {
    let c = QuantConfig::int8_per_channel();
    let mut out = [0f32; 4];
    let codes = Codes::Int8(&[1, 2, 3, 4]);
    let e = affine::dequantize(codes, &[2, 2], &c, &[1.0], &[0.0, 0.0], &mut out).unwrap_err();
    assert_eq!(arg_of(e), ("shape", "scales"));
    let e = affine::dequantize(codes, &[2, 2], &c, &[1.0; 2], &[0.0], &mut out).unwrap_err();
    assert_eq!(arg_of(e), ("shape", "zero_points"));
    let e = affine::dequantize(codes, &[2, 2], &c, &[1.0; 2], &[0.0; 2], &mut out[..3]);
    assert_eq!(arg_of(e.unwrap_err()), ("shape", "out"));
}

#[test]
fn dynamic_codes_of_the_wrong_length_and_huge_shapes_are_shape_errors() {
    let q = |shape: &[usize], codes: DynCodesMut<'_>| {
        dynamic::dynamic_quantize(
            &[1f32; 4],
            shape,
            DynFormat::Int8PerTensor,
            ScaleMode::MaxAbs,
            codes,
            &mut [0.0],
        )
        .unwrap_err()
    };
    assert_eq!(
        arg_of(q(&[4], DynCodesMut::Int8(&mut [0; 3]))),
        ("shape", "codes")
    );
    assert_eq!(
        arg_of(q(&[4], DynCodesMut::Int4(&mut [0; 2]))),
        ("shape", "codes")
    );
    match q(&[usize::MAX, 2], DynCodesMut::Int8(&mut [0; 4])) {
        QuantError::ShapeMismatch {
            arg: "x", expected, ..
        } => {
            assert!(expected.contains("more than usize::MAX"), "{expected}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn configs_built_without_their_constructors_are_checked_by_the_kernels() {
    let x = [1f32, -2.0, 3.0];
    for p in [0.0, -1.0, 5.0, f64::NAN] {
        let e = dynamic::compute_scale(&x, 127.0, ScaleMode::Percentile(p)).unwrap_err();
        assert_eq!(arg_of(e), ("config", "p"), "{p}");
        let e = dynamic::dynamic_quantize(
            &x,
            &[3],
            DynFormat::Int8PerTensor,
            ScaleMode::Percentile(p),
            DynCodesMut::Int8(&mut [0; 3]),
            &mut [0.0],
        );
        assert_eq!(arg_of(e.unwrap_err()), ("config", "p"), "{p}");
    }
    for clip in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = dynamic::compute_scale(&x, clip, ScaleMode::MaxAbs).unwrap_err();
        assert_eq!(arg_of(e), ("config", "clip_val"), "{clip}");
    }
    assert_eq!(
        dynamic::compute_scale(&x, 127.0, ScaleMode::Percentile(1.0)).unwrap(),
        3.0 / 127.0
    );
    let bad = SmoothQuantConfig {
        alpha: 2.0,
        epsilon: 1e-5,
    };
    let e = compute_smooth_factors(&[1f32, 2.0], &[1f32, 2.0], 2, &bad).unwrap_err();
    assert_eq!(arg_of(e), ("config", "alpha"));
    let bad = SmoothQuantConfig {
        alpha: 0.5,
        epsilon: -1.0,
    };
    let e = compute_smooth_factors(&[1f32, 2.0], &[1f32, 2.0], 2, &bad).unwrap_err();
    assert_eq!(arg_of(e), ("config", "epsilon"));
}

#[test]
fn a_json_model_with_a_scale_that_is_not_positive_is_refused() {
    for scale in ["0.0", "-1.0", "-0.0"] {
        let json = format!(
            r#"{{"config_json":"","layers":[{{"name":"a","weights_i8":[1,2],"shape":[2],"scale":{scale},"bias":null}}],"scheme":"x","total_quantized_bytes":0,"total_fp32_bytes":0}}"#
        );
        match QuantizedModel::from_json(json.as_bytes()) {
            Err(QuantError::Format { msg }) => assert!(msg.contains("scale"), "{msg}"),
            other => panic!("scale {scale}: {other:?}"),
        }
    }
}
