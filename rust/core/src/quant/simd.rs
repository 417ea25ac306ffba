//! Runtime CPU-feature detection, done once. `KVSERVE_SIMD=scalar|avx2|avx512|avx512vnni` forces
//! a level (capped at what the CPU supports) for tests and comparisons. AMX is never used.

use std::sync::OnceLock;

/// Kernel families, ordered from least to most capable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ (plus AVX2 level).
    Avx512,
    /// AVX-512 with VNNI int8 dot products.
    Avx512Vnni,
}

impl SimdLevel {
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx512Vnni => "avx512vnni",
        }
    }

    pub fn from_name(s: &str) -> Option<SimdLevel> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" => Some(SimdLevel::Scalar),
            "avx2" => Some(SimdLevel::Avx2),
            "avx512" => Some(SimdLevel::Avx512),
            "avx512vnni" | "vnni" => Some(SimdLevel::Avx512Vnni),
            _ => None,
        }
    }

    /// Every level this CPU can run, lowest first (for tests comparing kernels).
    pub fn available() -> Vec<SimdLevel> {
        let best = detect();
        [
            SimdLevel::Scalar,
            SimdLevel::Avx2,
            SimdLevel::Avx512,
            SimdLevel::Avx512Vnni,
        ]
        .into_iter()
        .filter(|l| *l <= best)
        .collect()
    }
}

/// The best level this CPU supports (detected once, then cached).
pub fn detect() -> SimdLevel {
    static BEST: OnceLock<SimdLevel> = OnceLock::new();
    *BEST.get_or_init(detect_uncached)
}

fn detect_uncached() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        let avx512 = avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq");
        let vnni = avx512 && is_x86_feature_detected!("avx512vnni");
        if vnni {
            return SimdLevel::Avx512Vnni;
        }
        if avx512 {
            return SimdLevel::Avx512;
        }
        if avx2 {
            return SimdLevel::Avx2;
        }
    }
    SimdLevel::Scalar
}

/// The level used by the dispatching kernels: detected once, lowered by `KVSERVE_SIMD`.
pub fn level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = detect();
        match std::env::var("KVSERVE_SIMD")
            .ok()
            .and_then(|v| SimdLevel::from_name(&v))
        {
            Some(forced) => forced.min(best),
            None => best,
        }
    })
}
