//! Which draft source an engine settles on: `auto` takes the model's MTP block where
//! the executor runs it, else prompt lookup, and only where the executor can roll a
//! sequence back; and an explicit mode such an executor cannot
//! serve (the CUDA executor today) is refused at load with the reason and the remedy.
//! The CPU executor, behind a wrapper that passes on only what every executor has,
//! stands in for one without rollback.

use super::{choose_drafter, Engine};
use crate::api::{DeviceReport, EngineConfig};
use crate::exec::{Executor, SeqStep, StepOut};
use crate::spec::{Drafter, SpecConfig, SpecMode};
use model::synth::{synthesize, Preset, SynthOptions};
use model::ExecError;

/// An executor without rollback: the CPU executor's steps, nothing else.
struct Plain(Box<dyn Executor>);

impl Executor for Plain {
    fn report(&self) -> DeviceReport {
        self.0.report()
    }
    fn sequences(&self) -> usize {
        self.0.sequences()
    }
    fn clear(&mut self, seq: usize) -> Result<(), ExecError> {
        self.0.clear(seq)
    }
    fn step(&mut self, batch: &[SeqStep]) -> Result<Vec<StepOut>, ExecError> {
        self.0.step(batch)
    }
}

#[test]
fn without_rollback_auto_is_off_and_an_explicit_mode_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let g = model::geometry::Geometry::by_name(Some(model::Arch::Qwen35Moe), "tiny")
        .expect("tiny geometry");
    let path = dir.path().join("tiny.gguf");
    let opts = SynthOptions {
        preset: Preset::Q8_0,
        seed: 3,
        sync: false,
    };
    synthesize(&path, &g, &opts, &|_, _| {}).expect("synthesize");
    let cfg = EngineConfig {
        max_context: Some(128),
        device: Some(crate::api::Device::Cpu),
        ..Default::default()
    };
    let mut eng = Engine::load(&path, &cfg).expect("load");
    let spec = |mode| SpecConfig {
        mode,
        ..SpecConfig::default()
    };
    // The CPU executor rolls back and runs this model's MTP block: auto drafts with it
    // (and by lookup where the text repeats a long stretch).
    assert!(
        eng.cfg.n_nextn > 0,
        "the tiny qwen35moe geometry has an MTP block"
    );
    let cpu = eng.exec.as_mut();
    assert_eq!(
        choose_drafter(&spec(SpecMode::Auto), &eng.cfg, cpu).unwrap(),
        Some(Drafter::MtpAndNgram)
    );
    assert_eq!(
        choose_drafter(&spec(SpecMode::Ngram), &eng.cfg, eng.exec.as_mut()).unwrap(),
        Some(Drafter::Ngram)
    );
    let Engine {
        exec, cfg: mcfg, ..
    } = eng;
    let mut plain = Plain(exec);
    assert_eq!(
        choose_drafter(&spec(SpecMode::Auto), &mcfg, &mut plain).unwrap(),
        None
    );
    assert_eq!(
        choose_drafter(&spec(SpecMode::Off), &mcfg, &mut plain).unwrap(),
        None
    );
    let e = choose_drafter(&spec(SpecMode::Ngram), &mcfg, &mut plain)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--spec ngram") && e.contains("cannot roll") && e.contains("--spec auto"),
        "{e}"
    );
}
