//! The one rounding primitive: round half away from zero.
//!
//! All seeds round with Rust's `f32::round` / `f64::round`, which rounds ties
//! away from zero. SIMD paths reproduce it as `t = trunc(x); t + copysign(1, x)
//! where |x - t| >= 0.5`, which is exact in floating point (`x - t` never
//! rounds), unlike `trunc(x + 0.5*sign(x))`, which misrounds 0.49999997.

/// Round half away from zero in f32 (the seeds' `f32::round`).
#[inline(always)]
pub fn round_f32(x: f32) -> f32 {
    x.round()
}

/// Round half away from zero in f64 (the seeds' `f64::round`).
#[inline(always)]
pub fn round_f64(x: f64) -> f64 {
    x.round()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_away_from_zero() {
        assert_eq!(round_f32(0.5), 1.0);
        assert_eq!(round_f32(-0.5), -1.0);
        assert_eq!(round_f32(1.5), 2.0);
        assert_eq!(round_f32(2.5), 3.0);
        assert_eq!(round_f32(-2.5), -3.0);
        assert_eq!(round_f64(2.5), 3.0);
        assert_eq!(round_f64(-0.5), -1.0);
    }

    #[test]
    fn just_below_half_rounds_down() {
        // 0.49999997 is the largest f32 below 0.5; x + 0.5 would round up to 1.0.
        let x = f32::from_bits(0.5f32.to_bits() - 1);
        assert_eq!(round_f32(x), 0.0);
        assert_eq!(round_f32(-x), -0.0);
        let y = f64::from_bits(0.5f64.to_bits() - 1);
        assert_eq!(round_f64(y), 0.0);
    }

    #[test]
    fn large_values_are_already_integers() {
        assert_eq!(round_f32(8388609.0), 8388609.0);
        assert_eq!(round_f32(-16777216.0), -16777216.0);
    }
}
