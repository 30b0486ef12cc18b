//! Grammars compiled with llguidance over a token trie of our tokenizer.
//!
//! The trie holds every token's bytes as the detokenizer produces them: byte-level
//! BPE pieces decoded to raw bytes, user-defined added tokens (`<think>`,
//! `<tool_call>`, ...) as their text, so a grammar's literal `<tool_call>` matches that
//! token or its spelling in pieces; control tokens (`<|im_end|>`, ...) carry
//! llguidance's special-token marker byte (0xFF) in front, so no grammar text can
//! produce them; padding ids have no bytes and are never allowed.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use model::tokenizer::Tokenizer;
use model::vocab::token_type;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use super::{Allowed, ConstraintError, TokenConstraint, TokenMask};

/// A grammar to enforce.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON schema (draft 2020-12); the output is one JSON value that validates.
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark dialect (`%json {schema}` embeds a schema).
    Lark(String),
}

/// A grammar that cannot be compiled: an unsupported keyword, an invalid schema.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// Compiles grammars for one tokenizer. Building it walks the whole vocabulary
/// (a few hundred milliseconds for 250k tokens): build one per model and share it.
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    eos: u32,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

/// The bytes a token stands for in the trie (module docs).
fn token_bytes(tok: &Tokenizer, id: u32) -> Vec<u8> {
    match tok.token_type(id) {
        Some(token_type::UNUSED) | None => Vec::new(),
        Some(token_type::CONTROL) => {
            let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            b.extend(tok.token_to_piece(id));
            b
        }
        Some(_) => tok.token_to_piece(id),
    }
}

impl GrammarCompiler {
    pub fn new(tok: &Tokenizer) -> Result<GrammarCompiler, GrammarError> {
        let n = tok.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32).map(|id| token_bytes(tok, id)).collect();
        let eos = tok
            .eos_id()
            .or_else(|| tok.eog_ids().first().copied())
            .ok_or_else(|| GrammarError("the vocabulary has no end-of-generation token".into()))?;
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| GrammarError(format!("cannot prepare the token trie: {e}")))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
            eos,
        })
    }

    /// Compiles `grammar` into a constraint in its initial state. JSON is compact
    /// (no optional whitespace), as a model that may emit whitespace could emit it
    /// forever; a schema's own `x-guidance` options win.
    pub fn compile(&self, grammar: &Grammar) -> Result<Box<dyn TokenConstraint>, GrammarError> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| GrammarError(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError(e));
        }
        Ok(Box::new(LlgConstraint {
            matcher,
            eos: self.eos,
        }))
    }
}

/// `schema` with compact JSON asked for, unless it says otherwise.
pub fn compact(schema: &serde_json::Value) -> serde_json::Value {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        let g = o
            .entry("x-guidance")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(g) = g.as_object_mut() {
            g.entry("whitespace_flexible")
                .or_insert(serde_json::Value::Bool(false));
        }
    }
    s
}

/// An llguidance matcher as a [`TokenConstraint`].
struct LlgConstraint {
    matcher: Matcher,
    eos: u32,
}

impl TokenConstraint for LlgConstraint {
    fn box_clone(&self) -> Box<dyn TokenConstraint> {
        Box::new(LlgConstraint {
            matcher: self.matcher.deep_clone(),
            eos: self.eos,
        })
    }

    fn allowed(&mut self) -> Result<Allowed, ConstraintError> {
        let mut v = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| ConstraintError(e.to_string()))?;
        let may_end = v.is_allowed(self.eos);
        v.disallow_token(self.eos);
        Ok(Allowed {
            tokens: TokenMask {
                words: v.as_slice().to_vec(),
            },
            may_end,
        })
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError(format!("token {token} is not allowed here: {e}")))
    }
}
