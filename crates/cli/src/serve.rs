//! `scoria serve`: the HTTP server (OpenAI and Anthropic APIs).
//!
//! Every flag but `--api-key` and `--config` is a setting, defined once in
//! `server::settings` (its flag, config-file key, kind, default and help): a value
//! given here wins over the config file, which wins over the built-in default.

use std::path::PathBuf;

use anyhow::Context;
use server::settings::{EngineArgs, Overrides, RequestArgs, ServerArgs, Settings, SlotArgs};

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Require this key (Authorization: Bearer KEY, or x-api-key) on every route but
    /// /health. Command line only: a config file may not set it.
    #[arg(long)]
    pub api_key: Option<String>,
    /// JSON config file with "server" and "engine" sections (names = these flags
    /// without dashes). The command line wins over it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub slots: SlotArgs,
    #[command(flatten)]
    pub requests: RequestArgs,
}

impl ServeArgs {
    fn overrides(&self) -> Overrides {
        let mut o = Overrides {
            config: self.config.clone(),
            api_key: self.api_key.clone(),
            values: Vec::new(),
        };
        self.server.overrides(&mut o.values);
        self.engine.overrides(&mut o.values);
        self.slots.overrides(&mut o.values);
        self.requests.overrides(&mut o.values);
        o
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let settings = Settings::resolve(&args.overrides()).context("invalid settings")?;
    server::run(settings)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser, Debug)]
    struct Wrap {
        #[command(flatten)]
        a: ServeArgs,
    }

    #[test]
    fn every_setting_is_a_flag_of_the_same_name() {
        let cmd = Wrap::command();
        for name in server::settings::names() {
            assert!(
                cmd.get_arguments().any(|a| a.get_long() == Some(name)),
                "no --{name}"
            );
        }
    }

    #[test]
    fn flags_reach_the_settings_as_given() {
        let a = Wrap::try_parse_from([
            "serve",
            "--vram-budget",
            "16G",
            "--device",
            "cuda",
            "--cors-origin",
            "https://a.example",
            "--cors-origin",
            "https://b.example",
            "-t",
            "3",
            "--temp",
            "0.2",
            "--presence-penalty",
            "-1.5",
            "--content-special-tokens",
            "true",
            "--strip-session-noise",
            "false",
        ])
        .unwrap()
        .a;
        let s = Settings::resolve(&a.overrides()).unwrap();
        assert_eq!(s.engine.vram_budget, Some(16 << 30));
        assert_eq!(s.engine.device, Some(engine::Device::Cuda(0)));
        assert_eq!(s.engine.threads, Some(3));
        assert_eq!(
            s.server.cors_origin,
            ["https://a.example", "https://b.example"]
        );
        assert_eq!(s.defaults.temp, 0.2);
        assert_eq!(s.defaults.presence_penalty, -1.5);
        assert!(s.defaults.content_special_tokens);
        assert!(!s.defaults.strip_session_noise);
        // Shown as given, with where it came from.
        let j = s.to_json();
        assert_eq!(j["engine"]["vram-budget"]["value"], "16G");
        assert_eq!(j["engine"]["vram-budget"]["source"], "command line");
        assert_eq!(j["engine"]["device"]["value"], "cuda:0");
        assert_eq!(j["engine"]["temp"]["source"], "command line");
        assert_eq!(j["engine"]["top-k"]["source"], "default");
        // The same flags alone, as run and bench read them.
        let e = a.engine.values();
        assert_eq!((e.vram_budget, e.threads), (Some(16 << 30), Some(3)));
    }
}
