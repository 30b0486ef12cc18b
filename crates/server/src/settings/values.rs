//! How a setting's value travels: from its flag's type to the JSON the table checks
//! ([`CliValue`]), and from that JSON to the type the server uses ([`FromSetting`]).

use std::path::PathBuf;

use serde_json::Value;

/// A memory size on the command line, e.g. `16G`, `12.5GiB` or bytes: parsed
/// (`engine::parse_size`) and kept as written, so the startup line and `/props` show
/// what was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Size {
    pub text: String,
    pub bytes: u64,
}

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> Result<Size, String> {
        Ok(Size {
            text: s.to_string(),
            bytes: engine::parse_size(s)?,
        })
    }
}

/// A flag's value as the setting's JSON; None when the flag was not given.
pub trait CliValue {
    fn setting(&self) -> Option<Value>;
}

impl<T: ToSetting> CliValue for Option<T> {
    fn setting(&self) -> Option<Value> {
        self.as_ref().map(ToSetting::to_setting)
    }
}

/// A repeatable flag (`--cors-origin`): its values joined by commas.
/// A flag without a value (`--no-mmproj`): set when given.
impl CliValue for bool {
    fn setting(&self) -> Option<Value> {
        self.then_some(Value::Bool(true))
    }
}

impl CliValue for Vec<String> {
    fn setting(&self) -> Option<Value> {
        (!self.is_empty()).then(|| Value::String(self.join(",")))
    }
}

/// One flag value as JSON.
pub trait ToSetting {
    fn to_setting(&self) -> Value;
}

macro_rules! to_setting_via_from {
    ($($t:ty),*) => {$(
        impl ToSetting for $t {
            fn to_setting(&self) -> Value {
                Value::from(self.clone())
            }
        }
    )*};
}
to_setting_via_from!(String, u16, u64, usize, f64, bool);

impl ToSetting for PathBuf {
    fn to_setting(&self) -> Value {
        Value::String(self.display().to_string())
    }
}

impl ToSetting for engine::Device {
    fn to_setting(&self) -> Value {
        Value::String(self.to_string())
    }
}

impl ToSetting for engine::SpecMode {
    fn to_setting(&self) -> Value {
        Value::String(self.to_string())
    }
}

impl FromSetting for engine::SpecMode {
    fn from_setting(v: &Value) -> Self {
        v.as_str().and_then(|m| m.parse().ok()).unwrap_or_default()
    }
}

impl ToSetting for Size {
    fn to_setting(&self) -> Value {
        Value::String(self.text.clone())
    }
}

/// A setting's JSON (checked, or a built-in default) as the type the server uses.
/// Null is an unset `Option`.
pub trait FromSetting {
    fn from_setting(v: &Value) -> Self;
}

impl<T: FromSetting> FromSetting for Option<T> {
    fn from_setting(v: &Value) -> Self {
        (!v.is_null()).then(|| T::from_setting(v))
    }
}

impl FromSetting for String {
    fn from_setting(v: &Value) -> Self {
        v.as_str().unwrap_or_default().to_string()
    }
}

impl FromSetting for PathBuf {
    fn from_setting(v: &Value) -> Self {
        PathBuf::from(v.as_str().unwrap_or_default())
    }
}

impl FromSetting for bool {
    fn from_setting(v: &Value) -> Self {
        v.as_bool().unwrap_or_default()
    }
}

impl FromSetting for f32 {
    fn from_setting(v: &Value) -> Self {
        v.as_f64().unwrap_or_default() as f32
    }
}

impl FromSetting for usize {
    fn from_setting(v: &Value) -> Self {
        v.as_u64().unwrap_or_default() as usize
    }
}

impl FromSetting for u16 {
    fn from_setting(v: &Value) -> Self {
        v.as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .unwrap_or_default()
    }
}

/// A number, or a memory size written as text ("16G").
impl FromSetting for u64 {
    fn from_setting(v: &Value) -> Self {
        super::size(v).unwrap_or_default()
    }
}

impl FromSetting for engine::Device {
    fn from_setting(v: &Value) -> Self {
        v.as_str()
            .and_then(|d| d.parse().ok())
            .unwrap_or(engine::Device::Cpu)
    }
}

/// `cors-origin`: origins separated by commas (or `*`), trimmed, empties dropped.
impl FromSetting for Vec<String> {
    fn from_setting(v: &Value) -> Self {
        v.as_str()
            .unwrap_or_default()
            .split(',')
            .map(|o| o.trim().trim_end_matches('/').to_string())
            .filter(|o| !o.is_empty())
            .collect()
    }
}
