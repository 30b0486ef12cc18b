//! The engine's error: one type for everything a caller can act on.

use model::ExecError;

/// Errors a caller can act on; each names what is wrong and the remedy.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] gguf::Error),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("prompt of {prompt} tokens does not fit the context of {n_ctx} tokens (shorten the prompt or raise --max-context)")]
    PromptTooLong { prompt: usize, n_ctx: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary of {n_vocab} tokens")]
    BadToken { id: u32, n_vocab: usize },
    /// A request's images cannot be taken (no encoder, misplaced rows, an encoder error).
    #[error("image: {0}")]
    Image(String),
    #[error("memory: {0}")]
    Memory(String),
    #[error("device: {0}")]
    Device(String),
    /// A setting that cannot be used (names the flag and the remedy).
    #[error("{0}")]
    Settings(String),
    #[error("executor: {0}")]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Constraint(#[from] crate::constraint::ConstraintError),
}
