//! Every setting, defined once.
//!
//! One entry per setting gives its help text, its name (the `--flag` and the
//! config-file key), its section in the file, the kind of value (checked the same way
//! from the file and from the command line), its built-in default, what an unset
//! value means, and its field in the settings the server uses. From the table, the
//! [`settings!`] macro makes, per group, the command-line flags (`...Args`, a
//! `clap::Args` that `scoria serve` flattens; `run` and `bench` flatten
//! [`EngineArgs`] too) and the effective values (`...Settings`, [`RequestDefaults`]),
//! and the list of specs the config file and the startup line are read against.

use std::path::PathBuf;

use serde_json::{json, Value};

use super::values::{CliValue, FromSetting, Size};
use super::{Entries, Kind, Spec};

/// Builds the groups of settings and the spec list from one table. Each entry:
///
/// ```text
/// /// Help text.
/// field: EffectiveType = "section" "name", Kind::.., default json, "what unset means",
///     arg FlagType (, clap_key = value)*;
/// ```
macro_rules! settings {
    ($(
        $(#[$gmeta:meta])*
        $Args:ident => $Values:ident {$(
            $(#[doc = $doc:literal])*
            $field:ident : $ty:ty = $section:literal $name:literal, $kind:expr, $default:expr,
                $unset:literal, arg $cli:ty $(, $akey:ident = $aval:expr)* ;
        )*}
    )*) => {
        $(
            $(#[$gmeta])*
            #[derive(clap::Args, Debug, Clone, Default)]
            pub struct $Args {$(
                #[arg(long = $name, help = super::help($name) $(, $akey = $aval)*)]
                pub $field: $cli,
            )*}

            $(#[$gmeta])*
            #[derive(Debug, Clone, PartialEq)]
            pub struct $Values {$(
                $(#[doc = $doc])*
                pub $field: $ty,
            )*}

            impl $Args {
                /// The flags given, as (setting name, value) pairs.
                pub fn overrides(&self, out: &mut Vec<(&'static str, Value)>) {$(
                    if let Some(v) = CliValue::setting(&self.$field) {
                        out.push(($name, v));
                    }
                )*}

                /// These flags over the built-in defaults, with no config file (what
                /// `run` and `bench` use; each flag's value was parsed by its type).
                pub fn values(&self) -> $Values {
                    $Values {$(
                        $field: FromSetting::from_setting(
                            &CliValue::setting(&self.$field).unwrap_or_else(|| $default),
                        ),
                    )*}
                }
            }

            impl $Values {
                pub(super) fn from_entries(e: &Entries) -> $Values {
                    $Values {$(
                        $field: FromSetting::from_setting(e.value($name)),
                    )*}
                }
            }

            impl Default for $Values {
                /// The built-in defaults.
                fn default() -> Self {
                    $Values {$(
                        $field: FromSetting::from_setting(&$default),
                    )*}
                }
            }
        )*

        pub(super) const TABLE: &[Spec] = &[$($(
            Spec {
                name: $name,
                section: $section,
                kind: $kind,
                default: || $default,
                unset: $unset,
                doc: concat!($($doc),*),
            },
        )*)*];
    };
}

const NULL: Value = Value::Null;

settings! {
    /// The HTTP side (file section `server`).
    ServerArgs => ServerSettings {
        /// GGUF model file (the first shard of a split model). Without it, the demo
        /// model (models/demo.gguf: a tiny qwen35moe trained for a few minutes) is served.
        model: Option<PathBuf> = "server" "model", Kind::Path, NULL,
            "the demo model", arg Option<PathBuf>;
        /// Address to listen on (127.0.0.1: this machine only).
        host: String = "server" "host", Kind::Str, json!("127.0.0.1"), "", arg Option<String>;
        /// Port to listen on.
        port: u16 = "server" "port", Kind::Port, json!(8080), "", arg Option<u16>;
        /// Model id reported by /v1/models and in responses.
        alias: Option<String> = "server" "alias", Kind::Str, NULL, "model name",
            arg Option<String>;
        /// Let browser pages from this origin call the API (CORS), e.g.
        /// https://app.example.com; repeat the flag or separate with commas; `*` allows
        /// any origin. Preflight requests are answered before the API key is checked.
        cors_origin: Vec<String> = "server" "cors-origin", Kind::Str, NULL,
            "no CORS: browsers refuse pages of other origins",
            arg Vec<String>, value_name = "ORIGIN";
        /// Seconds that requests still running when the server is stopped (SIGTERM,
        /// Ctrl-C) get to finish; then each ends with a final error event. New
        /// connections are refused from the signal on; 0 ends requests at once.
        shutdown_grace: usize = "server" "shutdown-grace", Kind::Count { min: 0 }, json!(10),
            "", arg Option<u64>, value_name = "SECONDS";
        /// Seconds a client may take to send a request's headers (from a new
        /// connection's accept, or from a kept-alive connection's last answer) and its
        /// body; a slower one (sending byte by byte, or idle) has its connection
        /// closed (408 for a late body).
        read_timeout: usize = "server" "read-timeout", Kind::Count { min: 1 }, json!(60),
            "", arg Option<u64>, value_name = "SECONDS";
    }

    /// Where and how the engine runs: shared by `serve`, `run` and `bench` (file
    /// section `engine`).
    EngineArgs => EngineSettings {
        /// CPU threads for the kernels.
        threads: Option<usize> = "engine" "threads", Kind::Count { min: 1 }, NULL, "all cores",
            arg Option<usize>, short = 't';
        /// Where model steps run: cpu, cuda (device 0) or cuda:N.
        device: Option<engine::Device> = "engine" "device", Kind::Device, NULL,
            "engine's choice: the GPU when the build has CUDA and one is present, else the CPU",
            arg Option<engine::Device>;
        /// GPU: VRAM to use in all, e.g. 16G or 12.5GiB. A model that does not fit
        /// keeps its dense weights in VRAM and its routed experts in VRAM slots, a
        /// pinned RAM copy and the model file (same output).
        vram_budget: Option<u64> = "engine" "vram-budget", Kind::Size, NULL,
            "the free VRAM minus 512 MiB; a model that does not fit tiers its experts",
            arg Option<Size>;
        /// GPU, tiered experts: pinned RAM for the experts' copy, e.g. 40G. The rest is
        /// read from the file.
        ram_budget: Option<u64> = "engine" "ram-budget", Kind::Size, NULL,
            "tiered experts: what is available minus 8 GiB, at most every expert",
            arg Option<Size>;
        /// GPU, tiered experts: a routing profile (`scoria profile -o FILE`) that
        /// divides the VRAM slots by measured demand and fills them before the first
        /// token.
        profile: Option<PathBuf> = "engine" "profile", Kind::Path, NULL,
            "tiered experts: slots divided evenly, filled on use", arg Option<PathBuf>;
        /// GPU, tiered experts: experts held in the prompt pool, VRAM beside the slots
        /// that the next layer's experts are copied into while a prompt's mixer runs;
        /// 0 turns it off (same output either way).
        prompt_pool: Option<usize> = "engine" "prompt-pool", Kind::Count { min: 0 }, NULL,
            "tiered experts: five eighths of a layer's experts within a sixteenth of the expert VRAM, none for short prompt chunks",
            arg Option<u64>;
        /// GPU, tiered experts: how many of the next layer's likeliest experts a decode
        /// step copies ahead while the current layer runs; 0 turns it off (same output).
        guess_experts: Option<usize> = "engine" "guess-experts", Kind::Count { min: 0 }, NULL,
            "3", arg Option<u64>;
        /// Speculative decoding: auto (what the model file and the device support),
        /// mtp (the model's next-next-token layer), ngram (prompt lookup: drafts
        /// copied from the prompt and the text generated so far) or off. Drafts are
        /// checked in one step; the output is the same bytes either way.
        spec: engine::SpecMode = "engine" "spec", Kind::Spec, json!("off"), "",
            arg Option<engine::SpecMode>;
        /// Speculative decoding: draft tokens per step at most (a request's
        /// `speculative.n_max` overrides it).
        draft_max: usize = "engine" "draft-max", Kind::Count { min: 0 },
            json!(engine::spec::DEFAULT_DRAFT_MAX), "", arg Option<u64>;
        /// Speculative decoding: shorter drafts are not checked, the step decodes one
        /// token (a request's `speculative.n_min` overrides it).
        draft_min: usize = "engine" "draft-min", Kind::Count { min: 0 }, json!(0), "",
            arg Option<u64>;
        /// Speculative decoding: draft as long as the acceptance allows, whatever a
        /// verify step costs. Without it the draft length is chosen from what verify
        /// steps measured to cost against a decode step and how many drafts are kept,
        /// and speculation pauses (trying again now and then) where it does not pay.
        draft_fixed: bool = "engine" "draft-fixed", Kind::Bool, json!(false), "", arg bool;
        /// Context length to allocate (per slot on a GPU; one pool the slots share on
        /// the CPU).
        max_context: Option<usize> = "engine" "max-context", Kind::Count { min: 64 }, NULL,
            "the model's trained length when memory allows, else the longest power of two that fits (logged with why)", arg Option<usize>, short = 'c';
        /// Vision encoder (an mmproj GGUF, as llama.cpp's converter writes it): requests
        /// may then carry images.
        mmproj: Option<PathBuf> = "engine" "mmproj", Kind::Path, NULL,
            "the one mmproj*.gguf in the model file's directory, if there is exactly one",
            arg Option<PathBuf>, value_name = "FILE";
        /// Load no vision encoder, even when an mmproj*.gguf lies beside the model.
        no_mmproj: bool = "engine" "no-mmproj", Kind::Bool, json!(false), "", arg bool;
        /// Images of up to this many patches (16×16 pixels each for Qwen3.5/3.6) are
        /// encoded on the GPU, in a scratch allocated at startup (about 19 KB a patch);
        /// larger ones on the CPU. 0 keeps every image on the CPU.
        vision_gpu_patches: Option<usize> = "engine" "vision-gpu-patches", Kind::Count { min: 0 },
            NULL, "what a 32nd of the GPU's memory holds, 8,192 to 65,536 (logged at startup)",
            arg Option<usize>;
        /// Images larger than this many pixels are scaled down to it (keeping their
        /// shape) before the encoder sees them: fewer prompt tokens per image.
        image_max_pixels: usize = "engine" "image-max-pixels", Kind::Count { min: 1 },
            json!(crate::images::ImageLimits::default().max_pixels), "", arg Option<u64>;
        /// Images smaller than this many pixels are scaled up to it.
        image_min_pixels: usize = "engine" "image-min-pixels", Kind::Count { min: 1 },
            json!(crate::images::ImageLimits::default().min_pixels), "", arg Option<u64>;
    }

    /// The server's slots and prompt cache (file section `engine`).
    SlotArgs => SlotSettings {
        /// RAM for the prompt cache: conversations no slot holds any more, reused when
        /// they come back, e.g. 4G; 0 turns it off.
        prompt_cache: Option<u64> = "engine" "prompt-cache", Kind::Size, NULL,
            "the smaller of 8 GiB and a quarter of the available RAM; 0 turns it off",
            arg Option<Size>;
        /// Directory where the prompt cache persists, so a restart resumes warm.
        prompt_cache_dir: Option<PathBuf> = "engine" "prompt-cache-dir", Kind::Path, NULL,
            "memory only", arg Option<PathBuf>;
        /// Requests decoded at once, each in its own slot; more wait in arrival order.
        parallel: Option<usize> = "engine" "parallel", Kind::Count { min: 1 }, NULL,
            "4 (on a GPU: 1 when 4 would push experts out of VRAM)", arg Option<u64>;
    }

    /// What a request gets for each field it omits (file section `engine`; content
    /// special tokens in `server`).
    RequestArgs => RequestDefaults {
        /// Temperature for requests that send none (0 = greedy).
        temp: f32 = "engine" "temp",
            Kind::Float { lo: 0.0, hi: 2.0, lo_open: false }, json!(0.6), "", arg Option<f64>;
        /// Top-k for requests that send none (0 = off).
        top_k: usize = "engine" "top-k", Kind::Count { min: 0 }, json!(20), "", arg Option<u64>;
        /// Top-p for requests that send none, in (0, 1] (1 = off).
        top_p: f32 = "engine" "top-p",
            Kind::Float { lo: 0.0, hi: 1.0, lo_open: true }, json!(0.95), "", arg Option<f64>;
        /// Min-p for requests that send none, in [0, 1] (0 = off).
        min_p: f32 = "engine" "min-p",
            Kind::Float { lo: 0.0, hi: 1.0, lo_open: false }, json!(0.0), "", arg Option<f64>;
        /// Presence penalty for requests that send none, in [-2, 2].
        presence_penalty: f32 = "engine" "presence-penalty",
            Kind::Float { lo: -2.0, hi: 2.0, lo_open: false }, json!(0.0), "",
            arg Option<f64>, allow_hyphen_values = true;
        /// Frequency penalty for requests that send none, in [-2, 2].
        frequency_penalty: f32 = "engine" "frequency-penalty",
            Kind::Float { lo: -2.0, hi: 2.0, lo_open: false }, json!(0.0), "",
            arg Option<f64>, allow_hyphen_values = true;
        /// Repetition penalty over the last 64 tokens for requests that send none
        /// (llama.cpp style; 1 = off).
        repeat_penalty: f32 = "engine" "repeat-penalty",
            Kind::Float { lo: 0.0, hi: 10.0, lo_open: true }, json!(1.0), "", arg Option<f64>;
        /// Seed for requests that send none.
        seed: Option<u64> = "engine" "seed", Kind::Seed, NULL, "random per request",
            arg Option<u64>;
        /// Token budget for requests that send none.
        max_tokens_default: usize = "engine" "max-tokens-default", Kind::Count { min: 1 },
            json!(8192), "", arg Option<u64>;
        /// Reasoning effort for requests that name none: none, minimal (256-token
        /// thinking budget), low (1024), medium (4096), high, xhigh, max, ultra (no
        /// budget).
        reasoning_effort: Option<String> = "engine" "reasoning-effort", Kind::Effort, NULL,
            "none: no budget from effort", arg Option<String>;
        /// Thinking on or off for requests that do not say.
        enable_thinking: bool = "engine" "enable-thinking", Kind::Bool, json!(true), "",
            arg Option<bool>;
        /// Thinking budget for requests that send none.
        max_thinking_tokens: Option<usize> = "engine" "max-thinking-tokens",
            Kind::Count { min: 1 }, NULL, "no budget", arg Option<u64>;
        /// Tokens of the budget kept for the answer: the think block is closed when
        /// max(this, 15% of max_tokens) remain (0 = off).
        thinking_answer_room: usize = "engine" "thinking-answer-room", Kind::Count { min: 0 },
            json!(1024), "", arg Option<u64>;
        /// Let control-token text inside messages (`<|im_end|>` typed by a user or
        /// returned by a tool) act as the control token, as before; unsafe: such text
        /// can forge turns (false: message text is text).
        content_special_tokens: bool = "server" "content-special-tokens", Kind::Bool,
            json!(false), "", arg Option<bool>, value_name = "BOOL";
        /// Drop per-session noise from system prompts before rendering: Claude Code's
        /// `x-anthropic-billing-header: ...` line, whose suffix changes with every
        /// session, so new sessions and sub-agents reuse the cached system prompt and
        /// tools (false: system prompts are rendered exactly as sent).
        strip_session_noise: bool = "server" "strip-session-noise", Kind::Bool,
            json!(true), "", arg Option<bool>, value_name = "BOOL";
    }
}

#[cfg(test)]
mod tests {
    use super::super::{check, Source};
    use super::TABLE;

    #[test]
    fn every_setting_has_help_and_a_valid_default() {
        for s in TABLE {
            assert!(!s.doc.trim().is_empty(), "{}", s.name);
            let d = (s.default)();
            assert!(
                d.is_null() || check(s, &d, Source::Default).is_ok(),
                "{}: {d}",
                s.name
            );
            assert!(
                d.is_null() || s.unset.is_empty(),
                "{}: unset text unused",
                s.name
            );
            assert!(
                !d.is_null() || !s.unset.is_empty(),
                "{}: unset says nothing",
                s.name
            );
        }
    }
}
