//! Server and engine settings: built-in defaults, a JSON config file, the command line.
//!
//! Every setting is defined once, in [`table`]: its flag, its config-file key, its
//! kind, its default and its help. Precedence is command line > config file >
//! defaults, per setting. The file has two sections, `server` and `engine`, whose
//! names are the command-line flags without their dashes (`"max-context": 16384`). A
//! name that no section knows, or one in the wrong section, stops startup naming it;
//! so does an out-of-range value, before the model loads. The API key is
//! command-line only: a file that sets it is refused (config files get committed and
//! shared; keys should not).

mod table;
mod values;

pub use table::{
    EngineArgs, EngineSettings, RequestArgs, RequestDefaults, ServerArgs, ServerSettings, SlotArgs,
    SlotSettings,
};
pub use values::Size;

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

/// Where a setting's value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Default,
    Config,
    CommandLine,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Default => "default",
            Source::Config => "config",
            Source::CommandLine => "command line",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("cannot read config file {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("config file {path} is not valid JSON: {err}")]
    Parse {
        path: String,
        err: serde_json::Error,
    },
    #[error("config file {path}: the top level must be an object with \"server\" and/or \"engine\" sections")]
    NotObject { path: String },
    #[error("config file {path}: unknown section \"{name}\" (the sections are \"server\" and \"engine\")")]
    UnknownSection { path: String, name: String },
    #[error("config file {path}: section \"{section}\" must be an object")]
    SectionNotObject { path: String, section: String },
    #[error("config file {path}: unknown setting \"{name}\" in section \"{section}\"")]
    UnknownName {
        path: String,
        section: String,
        name: String,
    },
    #[error(
        "config file {path}: \"{name}\" belongs in the \"{belongs}\" section, not \"{section}\""
    )]
    WrongSection {
        path: String,
        section: String,
        name: String,
        belongs: String,
    },
    #[error("config file {path}: the API key is accepted only on the command line (--api-key), not in a config file")]
    ApiKeyInFile { path: String },
    #[error("setting {name} (from the {origin}): {msg}")]
    BadValue {
        name: String,
        origin: &'static str,
        msg: String,
    },
}

/// The value kinds settings take.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Str,
    Path,
    Port,
    /// A count, at least `min`.
    Count {
        min: u64,
    },
    /// A float in `[lo, hi]` (`lo_open`: the low end excluded).
    Float {
        lo: f64,
        hi: f64,
        lo_open: bool,
    },
    Seed,
    Bool,
    Effort,
    /// `cpu`, `cuda` or `cuda:N` (`engine::Device`).
    Device,
    /// A memory size: bytes, or a string such as "16G" (`engine::parse_size`).
    Size,
    /// `auto`, `mtp`, `ngram` or `off` (`engine::SpecMode`).
    Spec,
}

/// One setting (made by [`table`]'s macro).
struct Spec {
    name: &'static str,
    section: &'static str,
    kind: Kind,
    /// The built-in default (`null`: unset, with the meaning given in `unset`).
    default: fn() -> Value,
    /// What an unset value means, for the startup line and the help.
    unset: &'static str,
    /// What it does (the flag's help).
    doc: &'static str,
}

/// Every setting, in the order the startup line and `/props` list them.
const SPECS: &[Spec] = table::TABLE;

/// Every setting's name (its flag without dashes, its config-file key), in table
/// order.
pub fn names() -> impl Iterator<Item = &'static str> {
    SPECS.iter().map(|s| s.name)
}

/// A flag's help: what it does and what it is without the flag.
fn help(name: &str) -> String {
    let Some(s) = SPECS.iter().find(|s| s.name == name) else {
        return String::new();
    };
    let default = match (s.default)() {
        Value::Null => s.unset.to_string(),
        Value::String(t) => t,
        v => v.to_string(),
    };
    let doc = s.doc.split_whitespace().collect::<Vec<_>>().join(" ");
    format!("{} [default: {default}]", doc.trim_end_matches('.'))
}

/// Reasoning efforts a request or the server default may name: OpenAI's (`none` to
/// `xhigh`), Codex's `max` and `ultra`, and Anthropic's `output_config.effort` values
/// (`low` to `max`). `params::effort_budget` maps each to a thinking budget.
pub const EFFORTS: &[&str] = &[
    "none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra",
];

/// Command-line values, by setting name (flags without dashes). `api_key` separately.
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub config: Option<PathBuf>,
    pub api_key: Option<String>,
    pub values: Vec<(&'static str, Value)>,
}

impl Overrides {
    /// Adds `name = value` when the flag was given.
    pub fn set<T: Into<Value>>(&mut self, name: &'static str, value: Option<T>) {
        if let Some(v) = value {
            self.values.push((name, v.into()));
        }
    }
}

/// The effective settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub server: ServerSettings,
    pub engine: EngineSettings,
    pub slots: SlotSettings,
    pub defaults: RequestDefaults,
    pub api_key: Option<String>,
    /// Every setting's value and source, in table order, for the startup line and
    /// /props.
    entries: Entries,
    pub config_path: Option<PathBuf>,
}

/// (name, section, value, source) of every setting.
#[derive(Debug, Clone)]
struct Entries(Vec<(&'static str, &'static str, Value, Source)>);

impl Entries {
    fn value(&self, name: &str) -> &Value {
        self.0
            .iter()
            .find(|e| e.0 == name)
            .map(|e| &e.2)
            .unwrap_or(&Value::Null)
    }

    fn set(&mut self, name: &str, value: Value, source: Source) {
        if let Some(e) = self.0.iter_mut().find(|e| e.0 == name) {
            e.2 = value;
            e.3 = source;
        }
    }
}

impl EngineSettings {
    /// Copies where and how the engine runs into its configuration.
    pub fn apply(&self, cfg: &mut engine::EngineConfig) {
        cfg.threads = self.threads;
        cfg.max_context = self.max_context;
        cfg.device = self.device;
        cfg.vram_budget = self.vram_budget;
        cfg.ram_budget = self.ram_budget;
        cfg.expert_profile = self.profile.clone();
        cfg.prompt_pool = self.prompt_pool;
        cfg.guess_experts = self.guess_experts;
        cfg.spec = engine::SpecConfig {
            mode: self.spec,
            draft_max: self.draft_max,
            draft_min: self.draft_min,
            fixed: self.draft_fixed,
        };
        cfg.mmproj = self.mmproj.clone();
        cfg.vision_gpu_patches = self.vision_gpu_patches;
    }

    /// The vision encoder for `model` (`--mmproj`, else one `mmproj*.gguf` beside the
    /// model unless `--no-mmproj`) into `cfg`, and what to log about the choice.
    pub fn choose_mmproj(
        &self,
        model: &std::path::Path,
        cfg: &mut engine::EngineConfig,
    ) -> Option<String> {
        let (path, note) =
            crate::images::choose_mmproj(model, self.mmproj.as_deref(), self.no_mmproj);
        cfg.mmproj = path;
        note
    }

    /// What an image may be (`--image-max-pixels`, `--image-min-pixels`).
    pub fn image_limits(&self) -> crate::images::ImageLimits {
        crate::images::ImageLimits {
            max_pixels: self.image_max_pixels,
            min_pixels: self.image_min_pixels,
            ..Default::default()
        }
    }
}

fn check(spec: &Spec, v: &Value, source: Source) -> Result<Value, SettingsError> {
    let bad = |msg: String| SettingsError::BadValue {
        name: spec.name.to_string(),
        origin: source.as_str(),
        msg,
    };
    if v.is_null() {
        return Ok(Value::Null);
    }
    match spec.kind {
        Kind::Str | Kind::Path => match v.as_str() {
            Some(s) if !s.is_empty() => Ok(v.clone()),
            _ => Err(bad(format!("expected a non-empty string, got {v}"))),
        },
        Kind::Port => match v.as_u64() {
            Some(p) if (1..=65535).contains(&p) => Ok(v.clone()),
            _ => Err(bad(format!("expected a port number 1..65535, got {v}"))),
        },
        Kind::Count { min } => match v.as_u64() {
            Some(n) if n >= min => Ok(v.clone()),
            _ => Err(bad(format!("expected a whole number >= {min}, got {v}"))),
        },
        Kind::Float { lo, hi, lo_open } => match v.as_f64() {
            Some(x) if x <= hi && (x > lo || (!lo_open && x == lo)) => Ok(v.clone()),
            _ => {
                let open = if lo_open { "(" } else { "[" };
                Err(bad(format!(
                    "expected a number in {open}{lo}, {hi}], got {v}"
                )))
            }
        },
        Kind::Seed => match v.as_u64() {
            Some(_) => Ok(v.clone()),
            None => Err(bad(format!("expected a whole number >= 0, got {v}"))),
        },
        Kind::Bool => match v.as_bool() {
            Some(_) => Ok(v.clone()),
            None => Err(bad(format!("expected true or false, got {v}"))),
        },
        Kind::Effort => match v.as_str() {
            Some(s) if EFFORTS.contains(&s) => Ok(v.clone()),
            _ => Err(bad(format!(
                "expected one of {}, got {v}",
                EFFORTS.join(", ")
            ))),
        },
        Kind::Size => match size(v) {
            Some(_) => Ok(v.clone()),
            None => Err(bad(format!(
                "expected a size such as \"16G\", \"12.5GiB\" or a number of bytes, got {v}"
            ))),
        },
        Kind::Spec => match v.as_str().map(str::parse::<engine::SpecMode>) {
            Some(Ok(m)) => Ok(json!(m.to_string())),
            Some(Err(e)) => Err(bad(e)),
            None => Err(bad(format!(
                "expected \"auto\", \"mtp\", \"ngram\" or \"off\", got {v}"
            ))),
        },
        Kind::Device => match v.as_str().map(str::parse::<engine::Device>) {
            Some(Ok(d)) => Ok(json!(d.to_string())),
            Some(Err(e)) => Err(bad(e)),
            None => Err(bad(format!(
                "expected \"cpu\", \"cuda\" or \"cuda:N\", got {v}"
            ))),
        },
    }
}

/// A size setting's bytes: a JSON number of bytes or a size string.
fn size(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => engine::parse_size(s).ok(),
        _ => None,
    }
}

/// Reads a config file into (name, value) pairs, checking sections and names.
fn read_config(path: &Path) -> Result<Vec<(&'static Spec, Value)>, SettingsError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|err| SettingsError::Read {
        path: p.clone(),
        err,
    })?;
    let root: Value = serde_json::from_str(&text).map_err(|err| SettingsError::Parse {
        path: p.clone(),
        err,
    })?;
    let Value::Object(root) = root else {
        return Err(SettingsError::NotObject { path: p });
    };
    let mut out = Vec::new();
    for (section, body) in &root {
        if section != "server" && section != "engine" {
            return Err(SettingsError::UnknownSection {
                path: p,
                name: section.clone(),
            });
        }
        let Value::Object(body) = body else {
            return Err(SettingsError::SectionNotObject {
                path: p,
                section: section.clone(),
            });
        };
        for (name, value) in body {
            if name == "api-key" || name == "api_key" || name == "apikey" {
                return Err(SettingsError::ApiKeyInFile { path: p });
            }
            let Some(spec) = SPECS.iter().find(|s| s.name == name) else {
                return Err(SettingsError::UnknownName {
                    path: p,
                    section: section.clone(),
                    name: name.clone(),
                });
            };
            if spec.section != section {
                return Err(SettingsError::WrongSection {
                    path: p,
                    section: section.clone(),
                    name: name.clone(),
                    belongs: spec.section.to_string(),
                });
            }
            let mut value = check(spec, value, Source::Config)?;
            // A model path in the file is relative to the file.
            if let (Kind::Path, Some(s)) = (spec.kind, value.as_str()) {
                let rel = Path::new(s);
                if rel.is_relative() {
                    if let Some(dir) = path.parent() {
                        value = json!(dir.join(rel).display().to_string());
                    }
                }
            }
            out.push((spec, value));
        }
    }
    Ok(out)
}

impl Settings {
    /// Applies defaults, then the config file (if `over.config`), then the command line.
    pub fn resolve(over: &Overrides) -> Result<Settings, SettingsError> {
        let mut entries = Entries(
            SPECS
                .iter()
                .map(|s| (s.name, s.section, (s.default)(), Source::Default))
                .collect(),
        );
        if let Some(path) = &over.config {
            for (spec, value) in read_config(path)? {
                entries.set(spec.name, value, Source::Config);
            }
        }
        for (name, value) in &over.values {
            let Some(spec) = SPECS.iter().find(|s| s.name == *name) else {
                return Err(SettingsError::BadValue {
                    name: name.to_string(),
                    origin: Source::CommandLine.as_str(),
                    msg: "not a known setting".into(),
                });
            };
            let value = check(spec, value, Source::CommandLine)?;
            entries.set(spec.name, value, Source::CommandLine);
        }
        let server = ServerSettings::from_entries(&entries);
        if let Some(bad) = server
            .cors_origin
            .iter()
            .find(|o| *o != "*" && !o.starts_with("http://") && !o.starts_with("https://"))
        {
            let source = entries
                .0
                .iter()
                .find(|e| e.0 == "cors-origin")
                .map(|e| e.3)
                .unwrap_or(Source::Default);
            return Err(SettingsError::BadValue {
                name: "cors-origin".into(),
                origin: source.as_str(),
                msg: format!("\"{bad}\" is not an origin: give scheme and host, such as https://app.example.com (or * for any)"),
            });
        }
        Ok(Settings {
            server,
            engine: EngineSettings::from_entries(&entries),
            slots: SlotSettings::from_entries(&entries),
            defaults: RequestDefaults::from_entries(&entries),
            api_key: over.api_key.clone().filter(|k| !k.is_empty()),
            entries,
            config_path: over.config.clone(),
        })
    }

    /// The engine's configuration.
    pub fn engine_config(&self) -> engine::EngineConfig {
        let mut cfg = engine::EngineConfig {
            parallel: self.slots.parallel,
            prompt_cache: self.slots.prompt_cache,
            prompt_cache_dir: self.slots.prompt_cache_dir.clone(),
            ..Default::default()
        };
        self.engine.apply(&mut cfg);
        cfg
    }

    /// `{"server": {name: {"value", "source"}}, "engine": {...}}` (the API key's value
    /// is never shown, only whether one is set).
    pub fn to_json(&self) -> Value {
        let mut server = Map::new();
        let mut engine = Map::new();
        for (name, section, value, source) in &self.entries.0 {
            let entry = json!({"value": value, "source": source.as_str()});
            if *section == "server" {
                server.insert(name.to_string(), entry);
            } else {
                engine.insert(name.to_string(), entry);
            }
        }
        server.insert(
            "api-key".into(),
            json!({"value": self.api_key.is_some(),
                   "source": if self.api_key.is_some() { "command line" } else { "default" }}),
        );
        json!({
            "server": server,
            "engine": engine,
            "config_file": self.config_path.as_ref().map(|p| p.display().to_string()),
        })
    }

    /// One line listing every setting with its source, for the startup log.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        for (name, _, value, source) in &self.entries.0 {
            let shown = match value {
                Value::Null => SPECS
                    .iter()
                    .find(|s| s.name == *name)
                    .map(|s| format!("({})", s.unset))
                    .unwrap_or_default(),
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            parts.push(format!("{name}={shown} [{}]", source.as_str()));
        }
        parts.push(format!(
            "api-key={} [{}]",
            if self.api_key.is_some() {
                "set"
            } else {
                "none"
            },
            if self.api_key.is_some() {
                "command line"
            } else {
                "default"
            }
        ));
        let origin = match &self.config_path {
            Some(p) => format!("config file {}", p.display()),
            None => "no config file".to_string(),
        };
        format!("settings ({origin}): {}", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("scoria-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn defaults_are_valid() {
        let s = Settings::resolve(&Overrides::default()).unwrap();
        assert_eq!(s.server.host, "127.0.0.1");
        assert_eq!(s.server.port, 8080);
        assert_eq!(s.defaults.max_tokens_default, 8192);
        assert!(s.summary().contains("temp=0.6 [default]"));
        assert_eq!(RequestDefaults::default(), s.defaults);
    }

    #[test]
    fn precedence_cli_over_file_over_default() {
        let p = write(
            "a.json",
            r#"{"server": {"port": 9000, "model": "m.gguf"}, "engine": {"max-context": 4096, "temp": 0.2}}"#,
        );
        let mut o = Overrides {
            config: Some(p.clone()),
            ..Default::default()
        };
        o.set("max-context", Some(2048u64));
        let s = Settings::resolve(&o).unwrap();
        assert_eq!(s.server.port, 9000);
        assert_eq!(s.engine.max_context, Some(2048));
        assert_eq!(s.defaults.temp, 0.2);
        assert_eq!(s.server.model, Some(p.parent().unwrap().join("m.gguf")));
        let j = s.to_json();
        assert_eq!(j["server"]["port"]["source"], "config");
        assert_eq!(j["engine"]["max-context"]["source"], "command line");
        assert_eq!(j["engine"]["top-k"]["source"], "default");
        assert!(s.summary().contains("max-context=2048 [command line]"));
    }

    #[test]
    fn unknown_and_misplaced_names_refused() {
        let p = write("b.json", r#"{"engine": {"tmep": 1}}"#);
        let e = Settings::resolve(&Overrides {
            config: Some(p),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("\"tmep\""), "{e}");
        let p = write("c.json", r#"{"engine": {"port": 1}}"#);
        let e = Settings::resolve(&Overrides {
            config: Some(p),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            e.to_string().contains("\"port\" belongs in the \"server\""),
            "{e}"
        );
        let p = write("d.json", r#"{"server": {"api-key": "x"}}"#);
        let e = Settings::resolve(&Overrides {
            config: Some(p),
            ..Default::default()
        })
        .unwrap_err();
        assert!(matches!(e, SettingsError::ApiKeyInFile { .. }));
        let p = write("e.json", r#"{"sever": {}}"#);
        let e = Settings::resolve(&Overrides {
            config: Some(p),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("\"sever\""));
    }

    #[test]
    fn out_of_range_refused_naming_the_setting() {
        let mut o = Overrides::default();
        o.set("top-p", Some(0.0));
        let e = Settings::resolve(&o).unwrap_err();
        assert!(e.to_string().contains("top-p"), "{e}");
        let p = write("f.json", r#"{"engine": {"reasoning-effort": "extreme"}}"#);
        let e = Settings::resolve(&Overrides {
            config: Some(p),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("reasoning-effort"), "{e}");
    }

    #[test]
    fn device_from_file_and_command_line() {
        let s = Settings::resolve(&Overrides::default()).unwrap();
        assert_eq!(s.engine.device, None);
        assert!(
            s.summary().contains("device=(engine's choice"),
            "{}",
            s.summary()
        );
        let p = write("g.json", r#"{"engine": {"device": "cpu"}}"#);
        let mut o = Overrides {
            config: Some(p.clone()),
            ..Default::default()
        };
        let s = Settings::resolve(&o).unwrap();
        assert_eq!(s.engine.device, Some(engine::Device::Cpu));
        assert_eq!(s.to_json()["engine"]["device"]["source"], "config");
        // `cuda` is normalised to its ordinal.
        o.set("device", Some("cuda"));
        let s = Settings::resolve(&o).unwrap();
        assert_eq!(s.engine.device, Some(engine::Device::Cuda(0)));
        assert_eq!(s.to_json()["engine"]["device"]["value"], "cuda:0");
        assert_eq!(s.to_json()["engine"]["device"]["source"], "command line");
        let mut o = Overrides::default();
        o.set("device", Some("cuda:1"));
        assert_eq!(
            Settings::resolve(&o).unwrap().engine.device,
            Some(engine::Device::Cuda(1))
        );
    }

    #[test]
    fn bad_device_refused_naming_the_setting() {
        let mut o = Overrides::default();
        o.set("device", Some("tpu"));
        let e = Settings::resolve(&o).unwrap_err().to_string();
        assert!(e.contains("device") && e.contains("tpu"), "{e}");
        let p = write("h.json", r#"{"engine": {"device": 0}}"#);
        let e = Settings::resolve(&Overrides {
            config: Some(p.clone()),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("device") && e.contains("cuda:N"), "{e}");
        let p = write("i.json", r#"{"server": {"device": "cpu"}}"#);
        let e = Settings::resolve(&Overrides {
            config: Some(p),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("belongs in the \"engine\""), "{e}");
    }

    #[test]
    fn cors_origin_setting_is_checked() {
        let mut o = Overrides::default();
        o.set(
            "cors-origin",
            Some("https://a.example, http://b.example:3000/"),
        );
        let s = Settings::resolve(&o).unwrap();
        assert_eq!(
            s.server.cors_origin,
            ["https://a.example", "http://b.example:3000"]
        );
        assert!(Settings::resolve(&Overrides::default())
            .unwrap()
            .server
            .cors_origin
            .is_empty());
        let mut o = Overrides::default();
        o.set("cors-origin", Some("a.example"));
        let e = Settings::resolve(&o).unwrap_err().to_string();
        assert!(e.contains("cors-origin") && e.contains("https://"), "{e}");
    }

    #[test]
    fn content_special_tokens_setting() {
        assert!(
            !Settings::resolve(&Overrides::default())
                .unwrap()
                .defaults
                .content_special_tokens
        );
        let mut o = Overrides::default();
        o.set("content-special-tokens", Some(true));
        assert!(
            Settings::resolve(&o)
                .unwrap()
                .defaults
                .content_special_tokens
        );
    }
}

#[cfg(test)]
mod session_noise_setting_tests {
    use super::*;

    #[test]
    fn session_noise_is_stripped_by_default_and_can_be_kept() {
        let s = Settings::resolve(&Overrides::default()).unwrap();
        assert!(s.defaults.strip_session_noise);
        assert_eq!(
            s.to_json()["server"]["strip-session-noise"]["value"],
            serde_json::json!(true)
        );
        let mut o = Overrides::default();
        o.set("strip-session-noise", Some(false));
        assert!(!Settings::resolve(&o).unwrap().defaults.strip_session_noise);
    }
}

#[cfg(test)]
mod size_settings_tests {
    use super::*;

    #[test]
    fn vram_and_ram_budgets_take_sizes_and_refuse_nonsense() {
        let mut o = Overrides::default();
        o.set("vram-budget", Some("16G"));
        o.set("ram-budget", Some(1u64 << 30));
        o.set("profile", Some("routing.json"));
        let s = Settings::resolve(&o).expect("resolve");
        assert_eq!(s.engine.vram_budget, Some(16 << 30));
        assert_eq!(s.engine.ram_budget, Some(1 << 30));
        assert_eq!(s.engine.profile, Some(PathBuf::from("routing.json")));
        let mut o = Overrides::default();
        o.set("vram-budget", Some("sixteen"));
        let e = Settings::resolve(&o).unwrap_err().to_string();
        assert!(e.contains("vram-budget") && e.contains("16G"), "{e}");
    }
}
