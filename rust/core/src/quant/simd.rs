//! Runtime CPU-feature detection, done once. `KVSERVE_SIMD=scalar|neon|avx2|avx512|avx512vnni`
//! forces a level (capped at what the CPU supports) for tests and comparisons; any other value is
//! an error ([`env_level`]) naming the valid ones. AMX is never used.
//!
//! Levels form one chain per architecture: x86-64 has scalar < avx2 < avx512 < avx512vnni,
//! aarch64 has scalar < neon (NEON is part of the aarch64 baseline; it is still detected, not
//! assumed). A level of the other architecture is never run: capped, an x86 level asked for on
//! aarch64 gives neon and `neon` asked for on x86-64 gives scalar ([`cap`]).

use std::sync::OnceLock;

use crate::error::{invalid, Result};

/// Kernel families, ordered from least to most capable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    Scalar,
    /// aarch64 Advanced SIMD (128-bit). Ordered below the x86 levels so that capping an x86
    /// level at an aarch64 CPU's best gives it; x86 code never runs at it.
    Neon,
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
            SimdLevel::Neon => "neon",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Avx512Vnni => "avx512vnni",
        }
    }

    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 5] = [
        SimdLevel::Scalar,
        SimdLevel::Neon,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
        SimdLevel::Avx512Vnni,
    ];

    /// The level named `s` (one of [`SimdLevel::name`]'s names, any case, surrounding blanks
    /// ignored).
    pub fn from_name(s: &str) -> Option<SimdLevel> {
        let s = s.trim().to_ascii_lowercase();
        SimdLevel::ALL.into_iter().find(|l| l.name() == s)
    }

    /// Whether this level belongs to the architecture the code was built for (scalar always).
    pub fn native(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            SimdLevel::Neon => cfg!(target_arch = "aarch64"),
            SimdLevel::Avx2 | SimdLevel::Avx512 | SimdLevel::Avx512Vnni => {
                cfg!(target_arch = "x86_64")
            }
        }
    }

    /// Every level this CPU can run, lowest first (for tests comparing kernels).
    pub fn available() -> Vec<SimdLevel> {
        let best = detect();
        SimdLevel::ALL
            .into_iter()
            .filter(|l| l.native() && *l <= best)
            .collect()
    }
}

/// The level `KVSERVE_SIMD` asks for: `None` when it is unset or blank, an error naming the valid
/// values when it names no level.
pub fn env_level() -> Result<Option<SimdLevel>> {
    parse_env_level(std::env::var_os("KVSERVE_SIMD").as_deref())
}

fn parse_env_level(value: Option<&std::ffi::OsStr>) -> Result<Option<SimdLevel>> {
    let Some(raw) = value else { return Ok(None) };
    let text = raw.to_string_lossy();
    if text.trim().is_empty() {
        return Ok(None);
    }
    SimdLevel::from_name(&text).map(Some).ok_or_else(|| {
        let names: Vec<&str> = SimdLevel::ALL.iter().map(|l| l.name()).collect();
        invalid(format!(
            "KVSERVE_SIMD={text:?} is not a SIMD level; valid values: {}",
            names.join(", ")
        ))
    })
}

/// The best level this CPU supports (detected once, then cached).
pub fn detect() -> SimdLevel {
    static BEST: OnceLock<SimdLevel> = OnceLock::new();
    *BEST.get_or_init(detect_uncached)
}

fn detect_uncached() -> SimdLevel {
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("neon") {
        return SimdLevel::Neon;
    }
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

/// `level` capped at this CPU: the highest level of this architecture's chain that is at most
/// `level` and at most [`detect`]. (The x86 levels are above `Neon`, so on aarch64 they cap to
/// it; `Neon` on x86-64 caps to scalar.)
pub fn cap(level: SimdLevel) -> SimdLevel {
    let capped = level.min(detect());
    if capped.native() {
        capped
    } else {
        SimdLevel::Scalar
    }
}

/// The level used by the dispatching kernels: detected once, lowered by `KVSERVE_SIMD`.
///
/// An invalid `KVSERVE_SIMD` cannot be returned as an error from here (kernels call this);
/// callers that start the engine check [`env_level`] first. Should one not, the first call
/// writes a one-line warning naming the valid values to stderr and uses the detected level.
pub fn level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let best = detect();
        match env_level() {
            Ok(Some(forced)) => cap(forced),
            Ok(None) => best,
            Err(e) => {
                eprintln!("kvserve: warning: {e}; using {}", best.name());
                best
            }
        }
    })
}

/// Test support: which SIMD kernels a comparison test really exercised on this CPU.
///
/// A dispatcher runs one kernel per range of levels (for example the AVX2 kernel at both
/// `Avx2` and `Avx512`); it lists the lowest level of each of its SIMD kernels next to its
/// code. Tests compare every kernel this CPU can run with the scalar twin, never a kernel with
/// itself, report the comparison on one line, and fail when the kernel that this CPU's best
/// level runs was not among those compared ([`detect`] itself is checked against
/// `/proc/cpuinfo` below, so a CPU whose features go undetected fails too).
#[cfg(test)]
pub(crate) mod coverage {
    use super::{detect, SimdLevel};
    use std::io::Write;

    /// One level per distinct SIMD kernel of a dispatcher whose kernels start at `starts`,
    /// restricted to what this CPU runs: the kernels to compare with the scalar one.
    pub(crate) fn simd_kernels(starts: &[SimdLevel]) -> Vec<SimdLevel> {
        let best = detect();
        starts
            .iter()
            .copied()
            .filter(|&l| l != SimdLevel::Scalar && l.native() && l <= best)
            .collect()
    }

    /// Writes `simd coverage: <what>: scalar vs <kernels> (this CPU: <best>)` to stderr (past the
    /// test harness's capture, so every run shows it) and asserts that the kernel run at this
    /// CPU's best level is among `tested`.
    pub(crate) fn report(what: &str, starts: &[SimdLevel], tested: &[SimdLevel]) {
        let best = detect();
        let names: Vec<&str> = tested.iter().map(|l| l.name()).collect();
        let vs = if names.is_empty() {
            "no SIMD kernel on this CPU".to_string()
        } else {
            names.join(", ")
        };
        let line = format!(
            "simd coverage: {what}: scalar vs {vs} (this CPU: {})\n",
            best.name()
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        let top = starts
            .iter()
            .copied()
            .filter(|&l| l.native() && l <= best)
            .max();
        if let Some(top) = top.filter(|&l| l != SimdLevel::Scalar) {
            assert!(
                tested.contains(&top),
                "{what}: the kernel this CPU's best level ({}) runs, from level {}, was not \
                 compared with scalar",
                best.name(),
                top.name()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn level_names_round_trip_and_env_values_are_checked() {
        for l in SimdLevel::ALL {
            assert_eq!(SimdLevel::from_name(l.name()), Some(l));
            assert_eq!(
                parse_env_level(Some(OsStr::new(&format!(" {} ", l.name().to_uppercase())))),
                Ok(Some(l))
            );
        }
        assert_eq!(parse_env_level(None), Ok(None));
        assert_eq!(parse_env_level(Some(OsStr::new(" "))), Ok(None));
        for bad in ["avx", "sse4", "vnni", "none", "avx512 vnni", "sve"] {
            let e = parse_env_level(Some(OsStr::new(bad)))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
            assert!(
                e.contains("valid values: scalar, neon, avx2, avx512, avx512vnni"),
                "{e}"
            );
        }
    }

    /// The level the kernel tests take as "this CPU's best" must be what the CPU really has,
    /// read independently from the kernel's own flag list; otherwise an undetected feature
    /// would silently leave its kernels untested.
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    #[test]
    fn detected_level_matches_proc_cpuinfo() {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("read /proc/cpuinfo");
        let flags: Vec<&str> = info
            .lines()
            .find(|l| l.starts_with("flags"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, f)| f.split_whitespace().collect())
            .expect("/proc/cpuinfo has no flags line");
        let has = |names: &[&str]| names.iter().all(|n| flags.contains(n));
        let avx2 = has(&["avx2", "fma", "f16c"]);
        let avx512 = avx2 && has(&["avx512f", "avx512bw", "avx512vl", "avx512dq"]);
        let want = if avx512 && has(&["avx512_vnni"]) {
            SimdLevel::Avx512Vnni
        } else if avx512 {
            SimdLevel::Avx512
        } else if avx2 {
            SimdLevel::Avx2
        } else {
            SimdLevel::Scalar
        };
        assert_eq!(detect(), want, "detected level differs from /proc/cpuinfo");
        let line = format!("simd coverage: this CPU's best level: {}\n", want.name());
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }

    /// Capping keeps every level inside this architecture's chain and never above the CPU.
    #[test]
    fn cap_stays_on_this_architecture() {
        let best = detect();
        assert!(best.native(), "{best:?}");
        for l in SimdLevel::ALL {
            let c = cap(l);
            assert!(c.native() && c <= best && c <= l, "{l:?} -> {c:?}");
            if l.native() {
                assert_eq!(c, l.min(best), "{l:?}");
            }
        }
        assert!(SimdLevel::available().iter().all(|l| l.native()));
        #[cfg(target_arch = "x86_64")]
        assert_eq!(cap(SimdLevel::Neon), SimdLevel::Scalar);
        #[cfg(target_arch = "aarch64")]
        for l in [SimdLevel::Avx2, SimdLevel::Avx512, SimdLevel::Avx512Vnni] {
            assert_eq!(cap(l), SimdLevel::Neon, "{l:?}");
        }
    }

    /// On aarch64 the kernel tests take NEON as this CPU's best level (it is part of the
    /// aarch64 baseline; a CPU or emulator without it would leave its kernels untested).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn detected_level_is_neon_on_aarch64() {
        assert_eq!(detect(), SimdLevel::Neon);
        let line = "simd coverage: this CPU's best level: neon\n";
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
}
