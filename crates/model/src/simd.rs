//! Run-time builds of the elementwise and recurrence loops for the CPU's vector level.
//!
//! The workspace compiles for baseline x86-64 (SSE2), where every `f32::mul_add` in
//! [`crate::math`] is a call into libm's `fmaf` and every `round_ties_even` a call to
//! `rintf`. Hardware FMA (`vfmadd`, one rounding) and SSE4.1 `roundss` (nearest-even)
//! give exactly the bits of those calls, so a copy of a loop compiled with
//! `#[target_feature(enable = "avx2,fma")]` performs the same float operations in the
//! same order, only inline and on wider vectors: LLVM never reassociates or contracts
//! float arithmetic, so whatever it vectorises is lane-wise the scalar sequence.
//!
//! [`multiversion!`] turns one function body into a dispatcher plus an `_at` variant that
//! takes the [`Level`] explicitly (the tests run every level the CPU has against
//! [`Level::Plain`]). The level follows the quant kernels' choice ([`quant::kernel_isa`]),
//! so `SCORIA_ISA=scalar` runs the plain build everywhere.

use std::sync::OnceLock;

/// A build of the multiversioned loops. Every level computes the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// The baseline build (libm calls for fused multiply-adds and rounding).
    Plain,
    /// AVX2 + FMA (+ SSE4.1 rounding).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F on top of the AVX2 set.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Level {
    /// Whether this CPU can run the level.
    pub fn is_available(self) -> bool {
        match self {
            Level::Plain => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => {
                Level::Avx2.is_available() && std::arch::is_x86_feature_detected!("avx512f")
            }
        }
    }

    /// Every level this CPU can run, lowest first (for tests and benchmarks).
    pub fn available() -> Vec<Level> {
        let all = [
            Level::Plain,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2,
            #[cfg(target_arch = "x86_64")]
            Level::Avx512,
        ];
        all.into_iter().filter(|l| l.is_available()).collect()
    }
}

/// The level in use: the widest one allowed by the quant kernels' level (which
/// `SCORIA_ISA` lowers), chosen once per process.
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use quant::Isa;
            let isa = Isa::from_name(quant::kernel_isa()).unwrap_or(Isa::Scalar);
            if isa >= Isa::Avx512Bw && Level::Avx512.is_available() {
                return Level::Avx512;
            }
            if isa >= Isa::Avx2 && Level::Avx2.is_available() {
                return Level::Avx2;
            }
        }
        Level::Plain
    })
}

/// Defines `fn $name(args) -> ret` (runs at [`level()`]) and `fn $at(level, args) -> ret`
/// (runs the given level; panics if the CPU lacks it) from one body, compiled once per
/// level. The body is an ordinary function body over the arguments; everything it calls
/// that is `#[inline]` is compiled into each build.
macro_rules! multiversion {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident / $at:ident ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?
        $body:block
    ) => {
        $(#[$attr])*
        #[inline]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            $at($crate::simd::level(), $($arg),*)
        }

        #[doc = concat!("[`", stringify!($name), "`] built for `level` (the same bits at every level).")]
        #[doc = ""]
        #[doc = "Panics if this CPU cannot run `level` ([`crate::simd::Level::is_available`])."]
        // One argument more than the body's: the level.
        #[allow(clippy::too_many_arguments)]
        $vis fn $at(level: $crate::simd::Level, $($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            fn avx512($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }

            match level {
                $crate::simd::Level::Plain => body($($arg),*),
                #[cfg(target_arch = "x86_64")]
                $crate::simd::Level::Avx2 => {
                    assert!(level.is_available(), "this CPU lacks AVX2/FMA");
                    // SAFETY: the CPU has AVX2 and FMA (checked just above).
                    unsafe { avx2($($arg),*) }
                }
                #[cfg(target_arch = "x86_64")]
                $crate::simd::Level::Avx512 => {
                    assert!(level.is_available(), "this CPU lacks AVX-512 F/AVX2/FMA");
                    // SAFETY: the CPU has AVX-512 F, AVX2 and FMA (checked just above).
                    unsafe { avx512($($arg),*) }
                }
            }
        }
    };
}

pub(crate) use multiversion;
