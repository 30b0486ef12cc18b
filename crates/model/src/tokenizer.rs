//! The byte-level BPE tokenizer of Qwen models, built from the vocabulary llama.cpp's
//! converter stores in GGUF (`tokenizer.ggml.*`) and run with HF `tokenizers`.
//!
//! The pipeline is the one in Qwen's own `tokenizer.json`: added tokens are cut out of
//! the raw text first (leftmost-longest match), then every remaining segment is NFC
//! normalized, split by the Qwen pre-tokenizer regex, byte-level mapped and BPE-merged.
//! The added-token matching is done here rather than inside `tokenizers` so that one
//! BPE instance serves both `parse_special` modes and ids come straight from the file.
//!
//! Pre-tokenizer (`tokenizer.ggml.pre`): `qwen2` (Qwen2/Qwen3/Qwen3-Next regex) and
//! `qwen35` (letter runs extended with `\p{M}`, plus BPE `ignore_merges`, which the
//! Qwen3.5 vocabulary needs for ~200 tokens that no merge builds). A file without the key
//! is accepted with a warning and the `qwen2` regex (llama.cpp would use its GPT-2
//! "default" one, which no Qwen model was trained with); any other value is refused by
//! name, since tokenizing with the wrong regex silently changes every prompt.
//!
//! Decoding does not go through `tokenizers`: each id maps to its bytes once, at load
//! (byte-level tokens through GPT-2's byte map, added tokens as their text), so
//! [`Tokenizer::decode`] and [`StreamDecoder`] are plain concatenations.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{Model, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::vocab::{byte_to_char_table, token_type, FxBuild, QwenVocab, VocabParts};

/// Qwen2 / Qwen3 pre-tokenizer regex (tiktoken `PAT_STR`, HF `tokenizer.json`).
pub const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5 / Qwen3.6 pre-tokenizer regex: letter runs include combining marks (`\p{M}`).
pub const QWEN35_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token texts that end generation when present in the vocabulary (besides eos / eot).
const EOG_TEXTS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// Errors building or running the tokenizer. Each names the GGUF key or value at fault.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata: key {key}: {msg}")]
    Metadata { key: &'static str, msg: String },
    #[error(
        "unsupported tokenizer model {0:?} (tokenizer.ggml.model); scoria supports \"gpt2\" (byte-level BPE, Qwen)"
    )]
    UnsupportedModel(String),
    #[error(
        "unsupported pre-tokenizer {0:?} (tokenizer.ggml.pre); scoria supports \"qwen2\" and \"qwen35\""
    )]
    UnsupportedPre(String),
    #[error("building the tokenizer: {0}")]
    Build(String),
    #[error("tokenizing failed: {0}")]
    Encode(String),
}

/// The pre-tokenizer variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    Qwen2,
    Qwen35,
}

impl PreTokenizer {
    /// Parses `tokenizer.ggml.pre`.
    pub fn from_name(name: &str) -> Result<PreTokenizer, TokenizerError> {
        match name {
            "qwen2" => Ok(PreTokenizer::Qwen2),
            "qwen35" => Ok(PreTokenizer::Qwen35),
            other => Err(TokenizerError::UnsupportedPre(other.to_string())),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            PreTokenizer::Qwen2 => "qwen2",
            PreTokenizer::Qwen35 => "qwen35",
        }
    }
    pub fn regex(self) -> &'static str {
        match self {
            PreTokenizer::Qwen2 => QWEN2_REGEX,
            PreTokenizer::Qwen35 => QWEN35_REGEX,
        }
    }
    fn ignore_merges(self) -> bool {
        self == PreTokenizer::Qwen35
    }
}

/// Everything the tokenizer is built from, borrowed from a GGUF file or a [`VocabParts`].
struct Spec<'a> {
    tokens: Vec<&'a str>,
    types: Vec<i32>,
    merges: Vec<&'a str>,
    eos: Option<i64>,
    eot: Option<i64>,
    bos: Option<i64>,
    pad: Option<i64>,
    add_bos: bool,
    pre: PreTokenizer,
}

/// Per-id bytes and types, shared with [`StreamDecoder`]s.
#[derive(Debug)]
struct Pieces {
    bytes: Vec<u8>,
    /// `offsets[id]..offsets[id + 1]` are id's bytes.
    offsets: Vec<u32>,
    types: Vec<i32>,
    /// The longest piece, in bytes.
    max_len: usize,
}

impl Pieces {
    fn get(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let start = *self.offsets.get(i)? as usize;
        let end = *self.offsets.get(i + 1)? as usize;
        self.bytes.get(start..end)
    }

    /// The bytes `id` contributes to decoded text: nothing for an unknown id, for
    /// padding (UNUSED) ids, and for control tokens when `skip_special`.
    fn output(&self, id: u32, skip_special: bool) -> &[u8] {
        match self.types.get(id as usize) {
            None => &[],
            Some(&token_type::UNUSED) => &[],
            Some(&token_type::CONTROL) if skip_special => &[],
            Some(_) => self.get(id).unwrap_or(&[]),
        }
    }
}

/// One added token, matched whole in the raw text before BPE.
#[derive(Debug)]
struct Added {
    text: Box<str>,
    id: u32,
    control: bool,
}

/// Leftmost-longest matcher over the added tokens, bucketed by first byte.
#[derive(Debug)]
struct AddedMatcher {
    by_first: Vec<Vec<Added>>,
}

impl AddedMatcher {
    fn new(mut added: Vec<Added>) -> AddedMatcher {
        // Longest first, so the first hit at a position is the longest one.
        added.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        let mut by_first: Vec<Vec<Added>> = (0..256).map(|_| Vec::new()).collect();
        let mut seen = HashSet::new();
        for a in added {
            if let Some(&b) = a.text.as_bytes().first() {
                if seen.insert(a.text.clone()) {
                    by_first[b as usize].push(a);
                }
            }
        }
        AddedMatcher { by_first }
    }

    /// The next added token in `text` at or after byte `from`: (start, len, id). A
    /// control token is matched only with `parse_special`, and never at a position
    /// inside one of the sorted, disjoint byte ranges `literal`.
    fn find(
        &self,
        text: &str,
        from: usize,
        parse_special: bool,
        literal: &[std::ops::Range<usize>],
    ) -> Option<(usize, usize, u32)> {
        let bytes = text.as_bytes();
        let in_literal = |i: usize| {
            let k = literal.partition_point(|r| r.end <= i);
            literal.get(k).is_some_and(|r| r.start <= i)
        };
        for (i, &b) in bytes.iter().enumerate().skip(from) {
            for a in &self.by_first[b as usize] {
                if a.control && (!parse_special || in_literal(i)) {
                    continue;
                }
                if bytes[i..].starts_with(a.text.as_bytes()) {
                    return Some((i, a.text.len(), a.id));
                }
            }
        }
        None
    }
}

/// A byte-level BPE tokenizer for Qwen vocabularies. `Send + Sync`; share it behind an `Arc`.
pub struct Tokenizer {
    bpe: tokenizers::Tokenizer,
    pieces: Arc<Pieces>,
    added: AddedMatcher,
    /// Text -> id for tokens outside the BPE vocabulary (added, padding).
    other_ids: HashMap<String, u32>,
    eog: Vec<u32>,
    eos: Option<u32>,
    bos: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    pre: PreTokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("pre", &self.pre)
            .field("eos", &self.eos)
            .field("bos", &self.bos)
            .field("eog", &self.eog)
            .finish()
    }
}

fn meta_err(key: &'static str, msg: impl Into<String>) -> TokenizerError {
    TokenizerError::Metadata {
        key,
        msg: msg.into(),
    }
}

fn opt_int(v: Option<&gguf::Value>, key: &'static str) -> Result<Option<i64>, TokenizerError> {
    match v {
        None => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| meta_err(key, format!("expected an integer, found {v:?}"))),
    }
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &gguf::GgufFile) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_metadata(|k| file.get(k))
    }

    /// Builds the tokenizer from any metadata lookup with GGUF keys and values
    /// (what [`Tokenizer::from_gguf`] does, without needing a file).
    pub fn from_metadata<'a>(
        get: impl Fn(&str) -> Option<&'a gguf::Value>,
    ) -> Result<Tokenizer, TokenizerError> {
        const MODEL: &str = "tokenizer.ggml.model";
        const PRE: &str = "tokenizer.ggml.pre";
        const TOKENS: &str = "tokenizer.ggml.tokens";
        const TYPES: &str = "tokenizer.ggml.token_type";
        const MERGES: &str = "tokenizer.ggml.merges";
        let model = get(MODEL)
            .ok_or_else(|| meta_err(MODEL, "missing: the file has no tokenizer"))?
            .as_str()
            .ok_or_else(|| meta_err(MODEL, "not a string"))?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre = match get(PRE) {
            None => {
                tracing::warn!(
                    "GGUF has no {PRE}; using the qwen2 pre-tokenizer regex (set the key to \
                     \"qwen2\" or \"qwen35\" to silence this)"
                );
                PreTokenizer::Qwen2
            }
            Some(v) => {
                PreTokenizer::from_name(v.as_str().ok_or_else(|| meta_err(PRE, "not a string"))?)?
            }
        };
        let tokens: Vec<&str> = get(TOKENS)
            .ok_or_else(|| meta_err(TOKENS, "missing"))?
            .as_array()
            .ok_or_else(|| meta_err(TOKENS, "not an array"))?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .ok_or_else(|| meta_err(TOKENS, format!("element {i} is not a string")))
            })
            .collect::<Result<_, _>>()?;
        let types: Vec<i32> = match get(TYPES) {
            None => {
                tracing::warn!("GGUF has no {TYPES}; treating every token as normal");
                vec![token_type::NORMAL; tokens.len()]
            }
            Some(v) => v
                .as_array()
                .ok_or_else(|| meta_err(TYPES, "not an array"))?
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_i64()
                        .and_then(|x| i32::try_from(x).ok())
                        .ok_or_else(|| meta_err(TYPES, format!("element {i} is not an i32")))
                })
                .collect::<Result<_, _>>()?,
        };
        let merges: Vec<&str> = get(MERGES)
            .ok_or_else(|| meta_err(MERGES, "missing (a gpt2 BPE vocabulary needs merges)"))?
            .as_array()
            .ok_or_else(|| meta_err(MERGES, "not an array"))?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .ok_or_else(|| meta_err(MERGES, format!("element {i} is not a string")))
            })
            .collect::<Result<_, _>>()?;
        let add_bos = match get("tokenizer.ggml.add_bos_token") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| meta_err("tokenizer.ggml.add_bos_token", "not a bool"))?,
        };
        Tokenizer::build(Spec {
            tokens,
            types,
            merges,
            eos: opt_int(
                get("tokenizer.ggml.eos_token_id"),
                "tokenizer.ggml.eos_token_id",
            )?,
            eot: opt_int(
                get("tokenizer.ggml.eot_token_id"),
                "tokenizer.ggml.eot_token_id",
            )?,
            bos: opt_int(
                get("tokenizer.ggml.bos_token_id"),
                "tokenizer.ggml.bos_token_id",
            )?,
            pad: opt_int(
                get("tokenizer.ggml.padding_token_id"),
                "tokenizer.ggml.padding_token_id",
            )?,
            add_bos,
            pre,
        })
    }

    /// Builds the tokenizer from an in-memory vocabulary (e.g. [`crate::vocab::load`]).
    pub fn from_parts(parts: &VocabParts) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::build(Spec {
            tokens: parts.tokens.iter().map(String::as_str).collect(),
            types: parts.token_types.clone(),
            merges: parts.merges.iter().map(String::as_str).collect(),
            eos: parts.eos_id.map(i64::from),
            eot: None,
            bos: parts.bos_id.map(i64::from),
            pad: parts.pad_id.map(i64::from),
            add_bos: parts.add_bos,
            pre: PreTokenizer::from_name(parts.pre)?,
        })
    }

    /// The tokenizer of an embedded Qwen vocabulary, built once per process and shared
    /// (building the Qwen3.5 one takes about a second; tests and tools reuse it).
    pub fn qwen(v: QwenVocab) -> Result<Arc<Tokenizer>, TokenizerError> {
        static QWEN2: OnceLock<Result<Arc<Tokenizer>, TokenizerError>> = OnceLock::new();
        static QWEN35: OnceLock<Result<Arc<Tokenizer>, TokenizerError>> = OnceLock::new();
        let cell = match v {
            QwenVocab::Qwen2 => &QWEN2,
            QwenVocab::Qwen35 => &QWEN35,
        };
        cell.get_or_init(|| {
            let parts = crate::vocab::load(v).map_err(|e| TokenizerError::Build(e.to_string()))?;
            Tokenizer::from_parts(parts).map(Arc::new)
        })
        .clone()
    }

    fn build(spec: Spec<'_>) -> Result<Tokenizer, TokenizerError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(meta_err("tokenizer.ggml.tokens", "empty vocabulary"));
        }
        if n > u32::MAX as usize / 2 {
            return Err(meta_err(
                "tokenizer.ggml.tokens",
                format!("{n} tokens is too many"),
            ));
        }
        if spec.types.len() != n {
            return Err(meta_err(
                "tokenizer.ggml.token_type",
                format!("{} entries for {n} tokens", spec.types.len()),
            ));
        }
        let special_id = |v: Option<i64>, key: &str| -> Option<u32> {
            let v = v?;
            match u32::try_from(v) {
                Ok(id) if (id as usize) < n => Some(id),
                _ => {
                    tracing::warn!("{key} = {v} is outside the vocabulary (0..{n}); ignored");
                    None
                }
            }
        };
        let eos = special_id(spec.eos, "tokenizer.ggml.eos_token_id");
        let eot = special_id(spec.eot, "tokenizer.ggml.eot_token_id");
        let bos = special_id(spec.bos, "tokenizer.ggml.bos_token_id");
        let pad = special_id(spec.pad, "tokenizer.ggml.padding_token_id");

        // Per-id bytes; the BPE vocabulary (byte-level tokens); everything else by text.
        let table = byte_to_char_table();
        // GPT-2's byte map uses characters below U+0144.
        let mut char_to_byte = [None::<u8>; 0x144];
        for (b, &c) in table.iter().enumerate() {
            if let Some(slot) = char_to_byte.get_mut(c as usize) {
                *slot = Some(b as u8);
            }
        }
        let mut bytes = Vec::with_capacity(n * 8);
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0u32);
        let mut vocab = Vocab::with_capacity(n);
        let mut other_ids = HashMap::new();
        let mut added = Vec::new();
        let mut unmapped = 0usize;
        let mut duplicates = 0usize;
        for (id, (&text, &ty)) in spec.tokens.iter().zip(&spec.types).enumerate() {
            let id = id as u32;
            let byte_level = !matches!(
                ty,
                token_type::CONTROL | token_type::USER_DEFINED | token_type::UNUSED
            );
            if byte_level {
                for c in text.chars() {
                    match char_to_byte.get(c as usize).copied().flatten() {
                        Some(b) => bytes.push(b),
                        None => {
                            // Not a byte-level character: keep its UTF-8 as is.
                            unmapped += 1;
                            let mut buf = [0u8; 4];
                            bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                        }
                    }
                }
                if vocab.contains_key(text) {
                    duplicates += 1;
                } else {
                    vocab.insert(text.to_string(), id);
                }
            } else {
                bytes.extend_from_slice(text.as_bytes());
                other_ids.entry(text.to_string()).or_insert(id);
                if matches!(ty, token_type::CONTROL | token_type::USER_DEFINED) && !text.is_empty()
                {
                    added.push(Added {
                        text: text.into(),
                        id,
                        control: ty == token_type::CONTROL,
                    });
                }
            }
            let end = u32::try_from(bytes.len())
                .map_err(|_| meta_err("tokenizer.ggml.tokens", "token texts exceed 4 GiB"))?;
            offsets.push(end);
        }
        if unmapped > 0 {
            tracing::warn!(
                "{unmapped} characters of byte-level tokens are outside GPT-2's byte map"
            );
        }
        if duplicates > 0 {
            tracing::warn!(
                "{duplicates} byte-level token texts repeat an earlier one; the first id is used"
            );
        }
        let missing_bytes = table
            .iter()
            .filter(|c| !vocab.contains_key(&c.to_string()))
            .count();
        if missing_bytes > 0 {
            tracing::warn!(
                "{missing_bytes} of the 256 single-byte tokens are missing; text using those bytes \
                 loses them in tokenization"
            );
        }

        // Merges "left right" (split at the first space after the first character, as
        // llama.cpp does), keeping only those whose parts and result are in the vocabulary.
        let mut merges = Vec::with_capacity(spec.merges.len());
        let mut seen: HashSet<(u32, u32), FxBuild> =
            HashSet::with_capacity_and_hasher(spec.merges.len(), FxBuild::default());
        let mut bad = 0usize;
        let mut joined = String::new();
        for m in &spec.merges {
            let split = m
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i);
            let Some(at) = split else {
                bad += 1;
                continue;
            };
            let (a, b) = (&m[..at], &m[at + 1..]);
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let (Some(&ia), Some(&ib)) = (vocab.get(a), vocab.get(b)) else {
                bad += 1;
                continue;
            };
            if !vocab.contains_key(joined.as_str()) {
                bad += 1;
                continue;
            }
            if seen.insert((ia, ib)) {
                merges.push((a.to_string(), b.to_string()));
            }
        }
        if bad > 0 {
            tracing::warn!("{bad} merges name tokens that are not in the vocabulary; ignored");
        }

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(spec.pre.ignore_merges())
            .build()
            .map_err(|e| TokenizerError::Build(e.to_string()))?;
        let split = Split::new(
            SplitPattern::Regex(spec.pre.regex().to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Build(format!("pre-tokenizer regex: {e}")))?;
        let pre_tok = Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
        ]);
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_normalizer(Some(NFC));
        tk.with_pre_tokenizer(Some(pre_tok));

        let mut eog = Vec::new();
        for id in [eos, eot].into_iter().flatten() {
            if !eog.contains(&id) {
                eog.push(id);
            }
        }
        for t in EOG_TEXTS {
            if let Some(&id) = other_ids.get(t) {
                if !eog.contains(&id) {
                    eog.push(id);
                }
            }
        }

        let max_len = offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(1);
        Ok(Tokenizer {
            bpe: tk,
            pieces: Arc::new(Pieces {
                bytes,
                offsets,
                types: spec.types,
                max_len,
            }),
            added: AddedMatcher::new(added),
            other_ids,
            eog,
            eos,
            bos,
            pad,
            add_bos: spec.add_bos,
            pre: spec.pre,
        })
    }

    /// Tokenizes `text` (never adds BOS; see [`Tokenizer::encode_prompt`]).
    ///
    /// With `parse_special`, the text of a control token (`<|im_start|>`, `<|im_end|>`, ...)
    /// becomes that token: use it for prompts rendered from a chat template. Without it,
    /// control-token text is tokenized as plain text (for untrusted content). User-defined
    /// added tokens (`<think>`, `</think>`, `<tool_call>`, ...) are matched whole in both
    /// modes, as llama.cpp and HF do.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_marked(text, parse_special, &[])
    }

    /// [`Tokenizer::encode`], where control-token text starting inside one of the byte
    /// ranges `literal` (sorted, disjoint) is plain text even with `parse_special`.
    fn encode_marked(
        &self,
        text: &str,
        parse_special: bool,
        literal: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut pos = 0;
        while pos < text.len() {
            match self.added.find(text, pos, parse_special, literal) {
                Some((start, len, id)) => {
                    self.encode_plain(&text[pos..start], &mut out)?;
                    out.push(id);
                    pos = start + len;
                }
                None => {
                    self.encode_plain(&text[pos..], &mut out)?;
                    break;
                }
            }
        }
        Ok(out)
    }

    /// [`Tokenizer::encode`] with `parse_special`, preceded by BOS when the vocabulary
    /// asks for it (`tokenizer.ggml.add_bos_token`; false for Qwen).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if self.add_bos {
            if let Some(b) = self.bos {
                ids.push(b);
            }
        }
        ids.extend(self.encode(text, true)?);
        Ok(ids)
    }

    /// [`Tokenizer::encode_prompt`] for a prompt rendered from a chat template in which
    /// the byte ranges `literal` (sorted, disjoint) hold control-token text that came
    /// from a message, not from the template: there it is tokenized as plain text, so
    /// text a user or a tool wrote cannot forge a turn. Everywhere else the result is
    /// `encode_prompt`'s.
    pub fn encode_prompt_marked(
        &self,
        text: &str,
        literal: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if self.add_bos {
            if let Some(b) = self.bos {
                ids.push(b);
            }
        }
        ids.extend(self.encode_marked(text, true, literal)?);
        Ok(ids)
    }

    /// The texts of the control tokens (`<|im_start|>`, `<|im_end|>`, ...): what
    /// `parse_special` turns into control ids.
    pub fn control_texts(&self) -> Vec<&str> {
        self.added
            .by_first
            .iter()
            .flatten()
            .filter(|a| a.control)
            .map(|a| &*a.text)
            .collect()
    }

    /// A lower bound on the number of tokens `bytes` bytes of text encode to, found
    /// without tokenizing: every token covers at most [`Pieces`]' longest piece of the
    /// NFC-normalized text, and NFC shrinks text at most 3 to 1 (three 3-byte Hangul
    /// jamo compose into one 3-byte syllable). Used to refuse a prompt that cannot fit
    /// the context before spending time and memory on it.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes / (3 * self.pieces.max_len.max(1))
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        let enc = self
            .bpe
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// The text of `ids`. Unknown ids and padding ids produce nothing; control tokens are
    /// dropped when `skip_special`. Invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut buf = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            buf.extend_from_slice(self.pieces.output(id, skip_special));
        }
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// The raw bytes of one token (byte-level tokens decoded, added and padding tokens as
    /// their text); empty for an id outside the vocabulary. May be partial UTF-8.
    pub fn token_to_piece(&self, id: u32) -> Vec<u8> {
        self.pieces.get(id).unwrap_or(&[]).to_vec()
    }

    /// The id of a token by its stored (GGUF) text: `"<|im_end|>"`, `"<think>"`, or a
    /// byte-level token such as `"Ġhello"`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.other_ids
            .get(text)
            .copied()
            .or_else(|| self.bpe.get_model().token_to_id(text))
    }

    /// Number of ids (== rows of the embedding matrix).
    pub fn vocab_size(&self) -> usize {
        self.pieces.types.len()
    }

    /// End-of-generation ids: eos, eot, then `<|im_end|>` and `<|endoftext|>` when present.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Whether `id` is a control token (what `skip_special` drops).
    pub fn is_special(&self, id: u32) -> bool {
        self.token_type(id) == Some(token_type::CONTROL)
    }

    /// The llama.cpp token type of `id` ([`crate::vocab::token_type`]).
    pub fn token_type(&self, id: u32) -> Option<i32> {
        self.pieces.types.get(id as usize).copied()
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// An incremental detokenizer for one output stream.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder {
            pieces: Arc::clone(&self.pieces),
            skip_special,
            pending: Vec::new(),
        }
    }
}

/// Incremental detokenization: push ids as they are generated and get back the text that
/// is complete so far. Bytes of a UTF-8 sequence split across tokens are held back until
/// the sequence completes. The concatenation of everything returned by `push` and
/// `finish` equals [`Tokenizer::decode`] of all the ids. Owns its data (`'static`, `Send`).
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    pieces: Arc<Pieces>,
    skip_special: bool,
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let piece = self.pieces.output(id, self.skip_special);
        self.pending.extend_from_slice(piece);
        self.drain(false)
    }

    /// Adds several tokens; returns the newly completed text.
    pub fn push_many(&mut self, ids: &[u32]) -> String {
        for &id in ids {
            let piece = self.pieces.output(id, self.skip_special);
            self.pending.extend_from_slice(piece);
        }
        self.drain(false)
    }

    /// Ends the stream: whatever is held back comes out, an incomplete sequence as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    /// Bytes held back waiting for the rest of a UTF-8 sequence.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    fn drain(&mut self, all: bool) -> String {
        let mut out = String::new();
        let mut pos = 0;
        while pos < self.pending.len() {
            match std::str::from_utf8(&self.pending[pos..]) {
                Ok(s) => {
                    out.push_str(s);
                    pos = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Checked valid just above.
                    out.push_str(
                        std::str::from_utf8(&self.pending[pos..pos + valid]).unwrap_or(""),
                    );
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{fffd}');
                            pos += valid + bad;
                        }
                        None if all => {
                            out.push('\u{fffd}');
                            pos = self.pending.len();
                        }
                        None => {
                            pos += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..pos);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: all 256 bytes, a few merges, ChatML control tokens, <think>.
    fn toy(pre: &'static str) -> VocabParts {
        let table = byte_to_char_table();
        let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
        let mut types = vec![token_type::NORMAL; 256];
        let mut merges = Vec::new();
        for (a, b) in [
            ("h", "e"),
            ("l", "l"),
            ("he", "ll"),
            ("hell", "o"),
            ("Ġ", "w"),
        ] {
            merges.push(format!("{a} {b}"));
            tokens.push(format!("{a}{b}"));
            types.push(token_type::NORMAL);
        }
        for (t, ty) in [
            ("<|endoftext|>", token_type::CONTROL),
            ("<|im_start|>", token_type::CONTROL),
            ("<|im_end|>", token_type::CONTROL),
            ("<think>", token_type::USER_DEFINED),
            ("</think>", token_type::USER_DEFINED),
            ("[PAD266]", token_type::UNUSED),
        ] {
            tokens.push(t.to_string());
            types.push(ty);
        }
        let n = tokens.len();
        VocabParts {
            tokens,
            token_types: types,
            merges,
            eos_id: Some(263),
            bos_id: Some(261),
            pad_id: Some(261),
            add_bos: false,
            pre,
            vocab_size: n,
        }
    }

    #[test]
    fn shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<StreamDecoder>();
        assert_send_sync::<crate::chat::ChatTemplate>();
    }

    #[test]
    fn marked_ranges_keep_control_text_as_text() {
        let tk = Tokenizer::from_parts(&toy("qwen2")).expect("build");
        let text = "<|im_start|>hello<|im_end|><|im_end|><think>";
        // Unmarked: every control text is a control token.
        let all = tk.encode_prompt_marked(text, &[]).expect("encode");
        assert_eq!(all, tk.encode_prompt(text).expect("encode"));
        assert_eq!(all.iter().filter(|&&t| t == 263).count(), 2);
        // The first <|im_end|> (bytes 17..27) came from a message: plain text there only.
        let first = std::ops::Range { start: 17, end: 27 };
        let marked = tk.encode_prompt_marked(text, &[first]).expect("encode");
        assert_eq!(marked.iter().filter(|&&t| t == 263).count(), 1);
        assert_eq!(marked[0], 262);
        assert_eq!(marked[marked.len() - 2..], [263, 264]);
        assert_eq!(tk.decode(&marked, false), text);
        let mut controls = tk.control_texts();
        controls.sort();
        assert!(controls.contains(&"<|im_end|>") && !controls.contains(&"<think>"));
        // A lower bound: never more than the real count.
        for s in ["hello hello", text, "héllo wörld 🦙 日本"] {
            let n = tk.encode(s, true).expect("encode").len();
            assert!(tk.min_tokens(s.len()) <= n, "{s}");
        }
    }

    #[test]
    fn toy_encode_decode() {
        let tk = Tokenizer::from_parts(&toy("qwen2")).expect("build");
        assert_eq!(tk.vocab_size(), 267);
        let hello = tk.token_id("hello").expect("hello");
        let ids = tk.encode("hello", true).expect("encode");
        assert_eq!(ids, vec![hello]);
        let ids = tk
            .encode("<|im_start|>hello<|im_end|><think>", true)
            .expect("encode");
        assert_eq!(ids, vec![262, hello, 263, 264]);
        assert_eq!(tk.decode(&ids, false), "<|im_start|>hello<|im_end|><think>");
        assert_eq!(tk.decode(&ids, true), "hello<think>");
        // Without parse_special, control text is plain text; <think> still matches.
        let ids = tk.encode("<|im_end|><think>", false).expect("encode");
        assert!(!ids.contains(&263));
        assert_eq!(ids.last(), Some(&264));
        assert_eq!(tk.decode(&ids, false), "<|im_end|><think>");
        assert_eq!(tk.eog_ids(), &[263, 261]);
        assert!(tk.is_special(262));
        assert!(!tk.is_special(264));
        // Padding decodes to nothing; ids past the end too.
        assert_eq!(tk.decode(&[266, 9999], false), "");
        // Non-ASCII round trip through single bytes.
        let s = "héllo wörld 🦙 日本";
        assert_eq!(tk.decode(&tk.encode(s, true).expect("encode"), false), s);
    }

    #[test]
    fn stream_decoder_holds_partial_utf8() {
        let tk = Tokenizer::from_parts(&toy("qwen35")).expect("build");
        let ids = tk.encode("a🦙b", true).expect("encode");
        assert_eq!(ids.len(), 6);
        let mut sd = tk.stream_decoder(false);
        let mut got = Vec::new();
        for &id in &ids {
            got.push(sd.push(id));
        }
        assert_eq!(got, vec!["a", "", "", "", "🦙", "b"]);
        // A truncated sequence is flushed as U+FFFD; an invalid one mid-stream too.
        let mut sd = tk.stream_decoder(false);
        assert_eq!(sd.push(ids[1]), "");
        assert_eq!(sd.pending_bytes(), 1);
        assert_eq!(sd.push(ids[0]), "\u{fffd}a");
        assert_eq!(sd.push(ids[1]), "");
        assert_eq!(sd.finish(), "\u{fffd}");
    }

    #[test]
    fn weird_vocabularies_do_not_panic() {
        let mut v = toy("qwen2");
        v.merges.push("nospace".into());
        v.merges.push("x yz_not_there".into());
        v.merges.push("h e".into()); // duplicate
        v.tokens[260] = String::new();
        v.eos_id = Some(1_000_000);
        let tk = Tokenizer::from_parts(&v).expect("build");
        assert_eq!(tk.eos_id(), None);
        let _ = tk
            .encode("hello <|im_end|> \u{0}\u{ffff}", true)
            .expect("encode");
        let mut v = toy("gpt-4o");
        assert!(matches!(
            Tokenizer::from_parts(&v),
            Err(TokenizerError::UnsupportedPre(p)) if p == "gpt-4o"
        ));
        v.pre = "qwen2";
        v.token_types.pop();
        assert!(Tokenizer::from_parts(&v).is_err());
    }
}
