//! Run-time choice of the kernel level.

use std::sync::OnceLock;

/// A kernel level. All levels compute bit-identical results (the canonical order);
/// they differ only in speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL without VNNI (plus the AVX2 set).
    Avx512Bw,
    /// AVX-512 F/BW/VL/VNNI (plus the AVX2 set).
    Avx512,
    /// The AVX-512 level plus AMX-TILE and AMX-INT8, with the OS's permission to use
    /// the tile state (Linux: `arch_prctl(ARCH_REQ_XCOMP_PERM)`, requested once per
    /// process). Only prompt matmuls differ from `Avx512`.
    Amx,
}

impl Isa {
    pub const ALL: [Isa; 5] = [Isa::Scalar, Isa::Avx2, Isa::Avx512Bw, Isa::Avx512, Isa::Amx];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Bw => "avx512bw",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        }
    }

    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == s)
    }

    /// Whether this CPU can run the level (ignores `SCORIA_ISA`).
    pub fn is_available(self) -> bool {
        self <= detected()
    }

    /// The highest level this CPU supports.
    pub fn detected() -> Isa {
        detected()
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512bw = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl");
    let avx512 = avx512bw && is_x86_feature_detected!("avx512vnni");
    if avx512 && amx_usable() {
        Isa::Amx
    } else if avx512 {
        Isa::Avx512
    } else if avx512bw {
        Isa::Avx512Bw
    } else if avx2 {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

/// Whether the CPU has AMX-TILE and AMX-INT8 and the OS lets this process use the
/// tile registers. Called once per process (from `detected`).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_usable() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    let (tile, int8) = (edx >> 24 & 1 == 1, edx >> 25 & 1 == 1);
    if !(tile && int8) {
        return false;
    }
    // Linux keeps the 8 KiB tile data out of a thread's state until the process asks:
    // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). Granted once, it holds for
    // every thread of the process; refused (old kernel, seccomp), we stay at AVX-512.
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: the arch_prctl system call with this request only changes the process's
    // permitted extended-state set; it reads and writes no memory of ours. The syscall
    // instruction clobbers rcx and r11 (declared).
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
    }
    ret == 0
}

/// AMX tile state needs the OS's consent, which only the Linux path asks for.
#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn amx_usable() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Scalar
}

fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

/// The level the kernels use: the detected one, lowered by `SCORIA_ISA` if set.
pub(crate) fn active() -> Isa {
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let hw = detected();
        match std::env::var("SCORIA_ISA") {
            Ok(v) => match Isa::from_name(v.trim()) {
                Some(want) => want.min(hw),
                None => {
                    eprintln!("SCORIA_ISA={v:?} is not one of scalar, avx2, avx512bw, avx512, amx; using {hw}");
                    hw
                }
            },
            Err(_) => hw,
        }
    })
}

/// The kernel level in use: "amx" (AVX-512 VNNI plus AMX-INT8 prompt matmuls),
/// "avx512" (with VNNI), "avx512bw" (without), "avx2" or "scalar".
pub fn kernel_isa() -> &'static str {
    active().name()
}

/// Proof that the AVX2 level's features were detected (only made here).
#[derive(Clone, Copy)]
pub(crate) struct Avx2Proof(());

/// Proof that the AVX-512 (VNNI) level's features were detected (only made here).
#[derive(Clone, Copy)]
pub(crate) struct Avx512Proof(());

/// Proof that the AVX-512 (no VNNI) level's features were detected (only made here).
#[derive(Clone, Copy)]
pub(crate) struct Avx512BwProof(());

/// Panics unless AVX2 is available; callers check `Isa::is_available` first.
pub(crate) fn avx2_proof() -> Avx2Proof {
    assert!(Isa::Avx2.is_available());
    Avx2Proof(())
}

/// Panics unless AVX-512 with VNNI is available; callers check `Isa::is_available` first.
pub(crate) fn avx512_proof() -> Avx512Proof {
    assert!(Isa::Avx512.is_available());
    Avx512Proof(())
}

/// Proof that the AMX level (AVX-512 VNNI, AMX-TILE, AMX-INT8, the OS's tile
/// permission) was detected (only made here).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct AmxProof(());

/// Panics unless the AMX level is available; callers check `Isa::is_available` first.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn amx_proof() -> AmxProof {
    assert!(Isa::Amx.is_available());
    AmxProof(())
}

/// Panics unless AVX-512 F/BW/VL is available; callers check `Isa::is_available` first.
pub(crate) fn avx512bw_proof() -> Avx512BwProof {
    assert!(Isa::Avx512Bw.is_available());
    Avx512BwProof(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_levels_are_ordered() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(Isa::from_name("sse2"), None);
        assert!(Isa::Scalar.is_available());
        assert!(active() <= detected());
        // Availability is downward closed: a level implies every lower one.
        let avail: Vec<bool> = Isa::ALL.iter().map(|i| i.is_available()).collect();
        assert!(avail.windows(2).all(|w| w[0] || !w[1]));
    }
}
