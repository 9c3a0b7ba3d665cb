//! The table of instruction-set tiers, runtime detection, and the
//! `FERROQUANT_SIMD` cap.

use std::sync::atomic::{AtomicU8, Ordering};

/// Name of the environment variable that caps the instruction set.
pub const ENV_SIMD: &str = "FERROQUANT_SIMD";

/// Parse a `FERROQUANT_SIMD` value: a tier name as [`Isa::name`] spells it
/// (surrounding spaces allowed); anything else is ignored, with this message.
pub fn parse_cap(raw: &str) -> std::result::Result<Isa, String> {
    Isa::from_name(raw.trim()).ok_or_else(|| {
        let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
        format!(
            "{ENV_SIMD}={} is not one of {}; it is ignored",
            crate::env::shown(raw),
            names.join(", ")
        )
    })
}

/// Why the `FERROQUANT_SIMD` value in the environment is ignored, if it is
/// (not a tier's name, or not UTF-8 text).
pub fn env_warning() -> Option<String> {
    match crate::env::text(ENV_SIMD)? {
        Ok(raw) => parse_cap(&raw).err(),
        Err(warning) => Some(warning),
    }
}

/// An instruction set the kernels can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust; the reference every other path must equal.
    Scalar,
    /// x86-64 AVX2 with F16C and FMA (256-bit; every AVX2 CPU has both).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/DQ (512-bit, masked tails; every AVX-512 CPU with
    /// BW and VL has DQ).
    Avx512,
    /// AVX-512 as above plus VNNI (`vpdpbusd`, four byte products into each
    /// 32-bit lane): the same kernels, and the integer dot products use it.
    Avx512Vnni,
}

impl Isa {
    /// Lower-case name, as `ferroquant.simd_isa()` reports it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    /// Whether this CPU can run the ISA.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("f16c")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512dq")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx512.is_supported() && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Whether long rows are coded by `quantize_scaled_then_absmax` (the next
    /// row's max read beside this row's codes) rather than in spans of two
    /// passes. The AVX2 tier fuses the loops: on Zen 3, 2048 x 4096 float32
    /// per row after a cache flush, in one process against the spans, 4-13 %
    /// faster on one thread from Rust, 0-5 % from Python (NumPy's arrays sit
    /// 16 bytes past a line). AVX-512 likewise on Zen 4 (2026-11-26, from
    /// Python, 12 runs each side by side): per row 5-13 % faster on one
    /// thread (cold 2.3-2.9 -> 2.1-2.7 ms, warm 1.9-2.5 -> 1.8-2.3 ms), BitNet
    /// per token alike, 1-10 % on two. Scalar gains nothing from fusing.
    /// Per-channel affine rows take the same shape where this holds
    /// (`affine_quantize_f32_then_range`).
    pub fn fuses_row_passes(self) -> bool {
        match self {
            Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => true,
            Isa::Scalar => false,
        }
    }

    /// Every ISA this CPU supports, scalar first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// Every tier, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni];

    /// The tier named `name` (as [`Isa::name`] spells it).
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == name)
    }

    /// The best supported ISA, capped by `FERROQUANT_SIMD` (`scalar`, `avx2`,
    /// `avx512`, `avx512vnni`; any other value is ignored, and [`env_warning`] says so).
    /// Decided once per process.
    ///
    /// Cached in an atomic rather than a `OnceLock`: racing first calls both
    /// detect (the same answer) and nothing ever blocks, so a `fork()` during
    /// detection cannot leave a child waiting on an initialisation that will
    /// never finish.
    pub fn detected() -> Isa {
        static DETECTED: AtomicU8 = AtomicU8::new(0);
        let cached = DETECTED.load(Ordering::Acquire);
        if let Some(&isa) = Isa::ALL.get((cached as usize).wrapping_sub(1)) {
            return isa;
        }
        let cap = match crate::env::text(ENV_SIMD) {
            Some(Ok(raw)) => parse_cap(&raw).unwrap_or(Isa::Avx512Vnni),
            _ => Isa::Avx512Vnni,
        };
        let isa = cap.usable();
        let index = Isa::ALL.iter().position(|&i| i == isa).unwrap_or(0);
        DETECTED.store(index as u8 + 1, Ordering::Release);
        isa
    }

    /// `self` if this CPU supports it, else the best supported ISA below it.
    /// Dispatch goes through this, so a caller can never run unsupported code.
    pub(crate) fn usable(self) -> Isa {
        if self.is_supported() {
            self
        } else {
            Isa::supported()
                .into_iter()
                .filter(|&i| i <= self)
                .max()
                .unwrap_or(Isa::Scalar)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detected_is_supported() {
        assert!(Isa::detected().is_supported());
        assert_eq!(Isa::supported()[0], Isa::Scalar);
    }

    #[test]
    fn cap_values_are_parsed_strictly() {
        assert_eq!(parse_cap(" avx2 "), Ok(Isa::Avx2));
        assert_eq!(parse_cap("scalar"), Ok(Isa::Scalar));
        for bad in ["AVX2", "avx9000", "avx2,scalar", "0"] {
            let e = parse_cap(bad).unwrap_err();
            assert!(e.contains(ENV_SIMD) && e.contains("ignored"), "{e}");
        }
        let e = parse_cap(&"x".repeat(100_000)).unwrap_err();
        assert!(e.len() < 200, "{}", e.len());
    }

    #[test]
    fn usable_never_exceeds_support() {
        for isa in Isa::ALL {
            assert!(isa.usable().is_supported());
            assert!(isa.usable() <= isa);
        }
    }
}
