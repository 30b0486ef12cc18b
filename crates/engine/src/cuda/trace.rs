//! `SCORIA_TRACE_DECODE=1`: where a tiered decode token's time goes, layer by
//! layer, on the device and on the host, printed (to stderr) every
//! [`REPORT_EVERY`] traced tokens.
//!
//! Each MoE layer's host part stamps the device's stream with timed events (the
//! end of the dense segment, the routing's download, the expert products, the
//! CPU's rows on the device, the down products) and takes host instants (the
//! routing read, the CPU's work begun and ended); a step is named by its trunk
//! layer (every layer of the tiered archs has routed experts). At a token's start the
//! stream is idle, so an event recorded then and the host's clock at that moment
//! put both on one time line (to within a few microseconds). The events cost the
//! host about a microsecond each, so a traced token is a little slower than an
//! untraced one; the trace is for finding the gaps, not for timing the whole.

use super::weights::cuda_err;
use cuda::{Event, Gpu, Lane};
use model::ExecError;
use std::time::Instant;

/// Traced tokens per report.
pub const REPORT_EVERY: u64 = 128;

/// A point in a layer step's device work (a timed event on the stream).
#[derive(Clone, Copy)]
pub(crate) enum DevPoint {
    /// The dense segment before the layer's routing (mixer, norm, router, top-k).
    SegEnd,
    /// The routing on the host: a decode step's mailbox seen set (recorded by the
    /// host as it sees it, so the next row only means something added to this one),
    /// or a prompt's download done.
    Routed,
    /// The gate/up products of the experts the device computes (after their copies).
    Products,
    /// The CPU's output rows are on the device.
    Handed,
    /// The down products combined.
    Down,
}

/// A point in a layer step's host work.
#[derive(Clone, Copy)]
pub(crate) enum HostPoint {
    /// The routing read back.
    Read,
    /// The host started the CPU's experts (`Tiered::cpu_beside`).
    CpuStart,
    /// The CPU's experts are done.
    CpuEnd,
}

const N_DEV: usize = 5;
const N_HOST: usize = 3;

/// The phases of a layer step, as printed (their values: see `DecodeTrace::end`).
const PHASES: [&str; 8] = [
    "device: dense part (previous layer's down products to routing)",
    "device: routing handed to the host",
    "host: routing seen after it landed",
    "host: plan and issue until the CPU starts",
    "host: CPU computes its experts",
    "device: expert products done, after the CPU finished",
    "device: CPU rows in place, after the CPU finished",
    "device: down products and combine",
];

pub(crate) struct DecodeTrace {
    base: Event,
    base_at: Option<Instant>,
    dev: Vec<[Event; N_DEV]>,
    dev_set: Vec<[bool; N_DEV]>,
    host: Vec<[Option<Instant>; N_HOST]>,
    /// Per phase: sum of µs and count; and the layer period's.
    sums: [(f64, u64); PHASES.len()],
    period: (f64, u64),
    tokens: u64,
}

impl DecodeTrace {
    /// A trace for steps 0..n (one per trunk layer).
    pub fn new(gpu: &Gpu, n: usize) -> Result<DecodeTrace, ExecError> {
        let event = || gpu.new_timed_event().map_err(cuda_err("decode trace"));
        let mut dev = Vec::with_capacity(n);
        for _ in 0..n {
            dev.push([event()?, event()?, event()?, event()?, event()?]);
        }
        Ok(DecodeTrace {
            base: event()?,
            base_at: None,
            dev,
            dev_set: vec![[false; N_DEV]; n],
            host: vec![[None; N_HOST]; n],
            sums: [(0.0, 0); PHASES.len()],
            period: (0.0, 0),
            tokens: 0,
        })
    }

    /// Starts a token: waits for the stream to be idle and puts the base event and
    /// the host's clock at one moment.
    pub fn begin(&mut self, gpu: &Gpu) -> Result<(), ExecError> {
        gpu.sync().map_err(cuda_err("decode trace"))?;
        self.dev_set.iter_mut().for_each(|s| *s = [false; N_DEV]);
        self.host.iter_mut().for_each(|h| *h = [None; N_HOST]);
        let at = Instant::now();
        gpu.record(Lane::Stream, &self.base)
            .map_err(cuda_err("decode trace"))?;
        self.base_at = Some(at);
        Ok(())
    }

    /// Records point `p` of step `step` on the stream now (in a traced token).
    pub fn dev(&mut self, gpu: &Gpu, step: usize, p: DevPoint) -> Result<(), ExecError> {
        match self.stamp(step, p) {
            Some(m) => gpu
                .record(Lane::Stream, m)
                .map_err(cuda_err("decode trace")),
            None => Ok(()),
        }
    }

    /// The event of point `p` of step `step`, for the caller to record where the
    /// point is (None unless a token is traced).
    pub fn stamp(&mut self, step: usize, p: DevPoint) -> Option<&Event> {
        if self.base_at.is_none() || step >= self.dev.len() {
            return None;
        }
        self.dev_set[step][p as usize] = true;
        Some(&self.dev[step][p as usize])
    }

    pub fn host(&mut self, step: usize, p: HostPoint) {
        if self.base_at.is_some() && step < self.host.len() {
            self.host[step][p as usize] = Some(Instant::now());
        }
    }

    /// Ends a token: waits for the stream, adds its steps' phases, and prints the
    /// averages every [`REPORT_EVERY`] tokens.
    pub fn end(&mut self, gpu: &Gpu) -> Result<(), ExecError> {
        let Some(base_at) = self.base_at.take() else {
            return Ok(());
        };
        gpu.sync().map_err(cuda_err("decode trace"))?;
        let mut dev = vec![[None; N_DEV]; self.dev.len()];
        for (i, events) in self.dev.iter().enumerate() {
            for (j, m) in events.iter().enumerate() {
                if self.dev_set[i][j] {
                    dev[i][j] = Some(
                        gpu.elapsed_us(&self.base, m)
                            .map_err(cuda_err("decode trace"))?,
                    );
                }
            }
        }
        let host: Vec<[Option<f64>; N_HOST]> = self
            .host
            .iter()
            .map(|h| h.map(|t| t.map(|t| t.duration_since(base_at).as_secs_f64() * 1e6)))
            .collect();
        use DevPoint as D;
        use HostPoint as H;
        for i in 0..dev.len() {
            let d = |p: D| dev[i][p as usize];
            let h = |p: H| host[i][p as usize];
            let prev_down = i.checked_sub(1).and_then(|j| dev[j][D::Down as usize]);
            let diff = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a - b);
            let phases = [
                diff(d(D::SegEnd), prev_down),
                diff(d(D::Routed), d(D::SegEnd)),
                diff(h(H::Read), d(D::Routed)),
                diff(h(H::CpuStart), h(H::Read)),
                diff(h(H::CpuEnd), h(H::CpuStart)),
                diff(d(D::Products), h(H::CpuEnd)),
                diff(d(D::Handed), h(H::CpuEnd)),
                diff(d(D::Down), d(D::Handed)),
            ];
            for (s, v) in self.sums.iter_mut().zip(phases) {
                if let Some(v) = v {
                    *s = (s.0 + v, s.1 + 1);
                }
            }
            if let Some(v) = diff(d(D::Down), prev_down) {
                self.period = (self.period.0 + v, self.period.1 + 1);
            }
        }
        self.tokens += 1;
        if self.tokens.is_multiple_of(REPORT_EVERY) {
            eprintln!("{}", self.report());
        }
        Ok(())
    }

    /// The averages so far, one line per phase (µs per layer step that had it).
    pub fn report(&self) -> String {
        let mean = |(s, n): (f64, u64)| if n == 0 { f64::NAN } else { s / n as f64 };
        let mut out = format!(
            "decode trace, {} tokens: a layer step takes {:.1} µs on the device ({} steps); per step that has the phase:",
            self.tokens,
            mean(self.period),
            self.period.1
        );
        for (label, s) in PHASES.iter().zip(self.sums) {
            out.push_str(&format!("\n  {:>8.1} µs  {label} ({} steps)", mean(s), s.1));
        }
        out
    }
}
