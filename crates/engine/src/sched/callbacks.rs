//! How a request reports back: [`RequestCallbacks`], which the server's jobs and the
//! tests implement, and `Closures`, the one `Engine::generate*` builds from closures.

use crate::api::{Completion, Flow, PromptProgress, TokenEvent};
use crate::error::EngineError;

/// A request's callbacks: where its progress goes, and whether it still wants to go
/// on. The engine calls them from the thread that steps the engine.
pub trait RequestCallbacks {
    /// The request took slot `slot`; `cached` of its prompt's tokens are reused
    /// from the slot's state.
    fn admitted(&mut self, _slot: usize, _cached: usize) {}
    /// After each piece of the prompt is read. `Flow::Stop` ends the request
    /// before its first token (finish `Stopped`, no tokens); the pieces read stay
    /// in the slot's cache. `Flow::Force` is read as `Continue`.
    fn prompt(&mut self, _progress: &PromptProgress) -> Flow {
        Flow::Continue
    }
    /// After each token: continue, stop, or force tokens in next.
    fn token(&mut self, ev: &TokenEvent) -> Flow;
    /// True when `logits` should get every set of logits a token was chosen from
    /// (the prompt's last position, then each generated token's but the last).
    fn wants_logits(&self) -> bool {
        false
    }
    fn logits(&mut self, _logits: &[f32]) {}
    /// The request is no longer wanted (its client left): checked while it waits
    /// and before each step; it then ends with finish `Stopped`.
    fn cancelled(&self) -> bool {
        false
    }
    /// The request ended: its completion, or why it failed. Called exactly once.
    fn done(&mut self, result: Result<Completion, EngineError>);
}

/// Where `Engine::generate_with_logits` hands each set of logits.
pub(crate) type LogitsFn<'a> = &'a mut dyn FnMut(&[f32]);

/// [`RequestCallbacks`] over the borrowed closures of `Engine::generate*`; keeps
/// the result.
pub(crate) struct Closures<'a> {
    pub on_prompt: &'a mut dyn FnMut(&PromptProgress) -> Flow,
    pub on_token: &'a mut dyn FnMut(&TokenEvent) -> Flow,
    pub on_logits: Option<LogitsFn<'a>>,
    pub result: Option<Result<Completion, EngineError>>,
}

impl RequestCallbacks for Closures<'_> {
    fn prompt(&mut self, p: &PromptProgress) -> Flow {
        (self.on_prompt)(p)
    }
    fn token(&mut self, ev: &TokenEvent) -> Flow {
        (self.on_token)(ev)
    }
    fn wants_logits(&self) -> bool {
        self.on_logits.is_some()
    }
    fn logits(&mut self, l: &[f32]) {
        if let Some(f) = self.on_logits.as_mut() {
            f(l);
        }
    }
    fn done(&mut self, r: Result<Completion, EngineError>) {
        self.result = Some(r);
    }
}
