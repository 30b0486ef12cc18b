//! A request field as the client sent it, and the checks that turn it into a value or a
//! 400 naming it.
//!
//! Request types declare every field they read as a [`Field`]: deserializing a body
//! never fails on a field of the wrong type (serde's own messages name neither the
//! field's path nor what to send); the value is kept and refused when it is used, with
//! a message that names the field and says what it must be. A field the route reads
//! leniently (a flag that is simply off unless it is `true`) is read with
//! [`Field::ok`], which ignores a value of another type as the route always has.

use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};

use crate::error::ApiError;

/// One field of a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Field<T> {
    /// Not in the request.
    #[default]
    Absent,
    /// Sent as `null`.
    Null,
    /// A value of the expected shape.
    Ok(T),
    /// A value of another shape, kept for the error message.
    Wrong(Value),
}

/// A JSON value read as a typed one: `Err` hands the value back unchanged (for the
/// error message) when it is not of this shape.
pub trait FromJson: Sized {
    fn from_json(v: Value) -> Result<Self, Value>;
}

impl FromJson for Value {
    fn from_json(v: Value) -> Result<Self, Value> {
        Ok(v)
    }
}

impl FromJson for String {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::String(s) => Ok(s),
            other => Err(other),
        }
    }
}

impl FromJson for bool {
    fn from_json(v: Value) -> Result<Self, Value> {
        v.as_bool().ok_or(v)
    }
}

/// Any JSON number.
impl FromJson for f64 {
    fn from_json(v: Value) -> Result<Self, Value> {
        v.as_f64().ok_or(v)
    }
}

/// A whole number >= 0 (`5.0` is not one).
impl FromJson for u64 {
    fn from_json(v: Value) -> Result<Self, Value> {
        v.as_u64().ok_or(v)
    }
}

/// A whole number, negative or not.
impl FromJson for i128 {
    fn from_json(v: Value) -> Result<Self, Value> {
        match (v.as_u64(), v.as_i64()) {
            (Some(n), _) => Ok(n as i128),
            (None, Some(n)) => Ok(n as i128),
            _ => Err(v),
        }
    }
}

impl FromJson for Map<String, Value> {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::Object(m) => Ok(m),
            other => Err(other),
        }
    }
}

/// A list; each element is its own [`Field`], so one bad element does not make the
/// list a wrong value.
impl<T: FromJson> FromJson for Vec<Field<T>> {
    fn from_json(v: Value) -> Result<Self, Value> {
        match v {
            Value::Array(a) => Ok(a.into_iter().map(Field::from_value).collect()),
            other => Err(other),
        }
    }
}

/// Implements [`FromJson`] for request structs: an object, deserialized field by
/// field (every field a [`Field`] or a plain `Value`, so it cannot fail); anything
/// else is a wrong value.
macro_rules! objects {
    ($($t:ty),* $(,)?) => {$(
        impl $crate::api::field::FromJson for $t {
            fn from_json(v: serde_json::Value) -> Result<Self, serde_json::Value> {
                if !v.is_object() {
                    return Err(v);
                }
                // Unknown keys are ignored and every declared field takes any value.
                <$t as serde::Deserialize>::deserialize(v)
                    .map_err(|e| serde_json::Value::String(e.to_string()))
            }
        }
    )*};
}
pub(crate) use objects;

impl<'de, T: FromJson> Deserialize<'de> for Field<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Field::from_value(Value::deserialize(d)?))
    }
}

impl<T: FromJson> Field<T> {
    /// `v` as this field's type.
    pub fn from_value(v: Value) -> Field<T> {
        match v {
            Value::Null => Field::Null,
            v => match T::from_json(v) {
                Ok(t) => Field::Ok(t),
                Err(v) => Field::Wrong(v),
            },
        }
    }

    /// A value looked up in an object (None: absent).
    pub fn of(v: Option<&Value>) -> Field<T> {
        match v {
            None => Field::Absent,
            Some(v) => Field::from_value(v.clone()),
        }
    }
}

impl<T> Field<T> {
    /// The value when it has the expected shape; absent, null and a value of
    /// another shape are all None (for fields read leniently).
    pub fn ok(&self) -> Option<&T> {
        match self {
            Field::Ok(t) => Some(t),
            _ => None,
        }
    }

    /// Sent with a value other than null.
    pub fn is_set(&self) -> bool {
        matches!(self, Field::Ok(_) | Field::Wrong(_))
    }

    /// In the request at all (null included).
    pub fn is_present(&self) -> bool {
        !matches!(self, Field::Absent)
    }

    /// The value, or a 400 `"{name} must be {what}, got {v}"` for a value of another
    /// shape; absent and null are None.
    pub fn checked(&self, name: &str, what: &str) -> Result<Option<&T>, ApiError> {
        match self {
            Field::Absent | Field::Null => Ok(None),
            Field::Ok(t) => Ok(Some(t)),
            Field::Wrong(v) => Err(ApiError::field(
                name,
                format!("{name} must be {what}, got {v}"),
            )),
        }
    }
}

impl Field<bool> {
    /// `true`/`false`, or a 400 naming `name`.
    pub fn flag(&self, name: &str) -> Result<Option<bool>, ApiError> {
        Ok(self.checked(name, "true or false")?.copied())
    }

    /// `true` only when sent as `true` (anything else reads as not set).
    pub fn is_true(&self) -> bool {
        self.ok() == Some(&true)
    }
}

impl Field<String> {
    /// A string, or a 400 naming `name`.
    pub fn text(&self, name: &str) -> Result<Option<&str>, ApiError> {
        Ok(self.checked(name, "a string")?.map(String::as_str))
    }

    /// The string when it is one (anything else reads as not set).
    pub fn str(&self) -> Option<&str> {
        self.ok().map(String::as_str)
    }

    /// The value as JSON text for a message: `"auto"`, `3`, `null`, or `nothing` when
    /// the field is absent.
    pub fn shown(&self) -> String {
        match self {
            Field::Absent => "nothing".into(),
            Field::Null => "null".into(),
            Field::Ok(s) => Value::String(s.clone()).to_string(),
            Field::Wrong(v) => v.to_string(),
        }
    }
}

impl Field<f64> {
    /// A number within `[lo, hi]`, or a 400 naming `name`.
    pub fn within(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
        match self.checked(name, "a number")? {
            None => Ok(None),
            Some(&x) if x >= lo && x <= hi => Ok(Some(x)),
            Some(x) => Err(ApiError::field(
                name,
                format!("{name} must be between {lo} and {hi}, got {x}"),
            )),
        }
    }
}

impl Field<u64> {
    /// A whole number `>= min`, or a 400 naming `name`.
    pub fn at_least(&self, name: &str, min: u64) -> Result<Option<u64>, ApiError> {
        let bad = |v: &dyn std::fmt::Display| {
            ApiError::field(
                name,
                format!("{name} must be a whole number >= {min}, got {v}"),
            )
        };
        match self {
            Field::Absent | Field::Null => Ok(None),
            Field::Ok(n) if *n >= min => Ok(Some(*n)),
            Field::Ok(n) => Err(bad(n)),
            Field::Wrong(v) => Err(bad(v)),
        }
    }
}

impl Field<Value> {
    /// The value as sent (null included); None when absent.
    pub fn sent(&self) -> Option<Value> {
        match self {
            Field::Absent => None,
            Field::Null => Some(Value::Null),
            Field::Ok(v) | Field::Wrong(v) => Some(v.clone()),
        }
    }

    /// The value, or null when absent.
    pub fn or_null(&self) -> Value {
        self.sent().unwrap_or(Value::Null)
    }
}

/// An object field's shape for messages: `"{name} must be an object, got {v}"`.
pub const OBJECT: &str = "an object";

/// Parses a request body: a JSON object, read as `T`.
pub fn body<T: FromJson>(bytes: &[u8]) -> Result<T, ApiError> {
    let v = match serde_json::from_slice::<Value>(bytes) {
        Ok(v @ Value::Object(_)) => v,
        Ok(other) => {
            return Err(ApiError::bad_request(format!(
                "the request body must be a JSON object, got {}",
                match other {
                    Value::Array(_) => "an array",
                    Value::String(_) => "a string",
                    Value::Number(_) => "a number",
                    Value::Bool(_) => "a boolean",
                    _ => "null",
                }
            )))
        }
        Err(e) => return Err(ApiError::bad_request(json_error(&e, bytes))),
    };
    T::from_json(v).map_err(|_| ApiError::bad_request("the request body must be a JSON object"))
}

/// What is wrong with a body that does not parse. A string escape that is half of a
/// UTF-16 surrogate pair (`"\ud800"`, as some JSON writers emit for text cut in the
/// middle of an emoji) is JSON by its grammar but not text: say that, and where.
fn json_error(e: &serde_json::Error, body: &[u8]) -> String {
    let text = e.to_string();
    // serde_json says "unexpected end of hex escape" when the pair's second half is
    // missing: look for the lone half itself.
    if (text.contains("surrogate") || text.contains("escape") || text.contains("code point"))
        && has_lone_surrogate(body)
    {
        return format!(
            "the request body has a string with a lone UTF-16 surrogate escape (such as \\ud800 without the \\udc00..\\udfff that must follow it) at line {} column {}: that is not Unicode text; send the character itself, its complete surrogate pair, or U+FFFD in its place",
            e.line(),
            e.column()
        );
    }
    format!("the request body is not valid JSON: {text}")
}

/// Whether a JSON text has a `\uD800`..`\uDFFF` escape that is not half of a
/// high-low pair.
fn has_lone_surrogate(body: &[u8]) -> bool {
    let hex = |at: usize| -> Option<u16> {
        let h = body.get(at..at + 4)?;
        u16::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()
    };
    let mut i = 0;
    while i < body.len() {
        if body[i] != b'\\' {
            i += 1;
            continue;
        }
        if body.get(i + 1) != Some(&b'u') {
            i += 2;
            continue;
        }
        match hex(i + 2) {
            Some(0xD800..=0xDBFF) => {
                let low = (body.get(i + 6..i + 8) == Some(b"\\u"))
                    .then(|| hex(i + 8))
                    .flatten();
                if !matches!(low, Some(0xDC00..=0xDFFF)) {
                    return true;
                }
                i += 12;
            }
            Some(0xDC00..=0xDFFF) => return true,
            _ => i += 6,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Deserialize, Default, Debug)]
    #[serde(default)]
    struct Probe {
        n: Field<u64>,
        x: Field<f64>,
        s: Field<String>,
        list: Field<Vec<Field<String>>>,
        inner: Field<Inner>,
    }

    #[derive(Deserialize, Default, Debug, PartialEq)]
    #[serde(default)]
    struct Inner {
        on: Field<bool>,
    }

    objects!(Probe, Inner);

    fn probe(v: Value) -> Probe {
        Probe::from_json(v).unwrap()
    }

    #[test]
    fn a_wrong_value_is_kept_not_refused_by_serde() {
        let p = probe(json!({"n": 5.0, "x": "1", "s": 3, "list": ["a", 2], "inner": [true]}));
        assert_eq!(p.n, Field::Wrong(json!(5.0)));
        assert_eq!(p.x, Field::Wrong(json!("1")));
        assert_eq!(p.s, Field::Wrong(json!(3)));
        assert_eq!(
            p.list,
            Field::Ok(vec![Field::Ok("a".into()), Field::Wrong(json!(2))])
        );
        // An array is not an object, even though serde would read a struct from one.
        assert_eq!(p.inner, Field::Wrong(json!([true])));
        let e = p.n.at_least("n", 1).unwrap_err();
        assert_eq!(e.message, "n must be a whole number >= 1, got 5.0");
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = p.x.within("x", 0.0, 2.0).unwrap_err();
        assert_eq!(e.message, "x must be a number, got \"1\"");
    }

    #[test]
    fn absent_null_and_ranges() {
        let p = probe(json!({"n": null, "x": 2.5, "inner": {"on": true}}));
        assert_eq!(p.n, Field::Null);
        assert_eq!(p.s, Field::Absent);
        assert!(p.n.is_present() && !p.n.is_set() && !p.s.is_present());
        assert_eq!(p.n.at_least("n", 1).unwrap(), None);
        let e = p.x.within("x", 0.0, 2.0).unwrap_err();
        assert_eq!(e.message, "x must be between 0 and 2, got 2.5");
        assert!(p.inner.ok().unwrap().on.is_true());
        assert_eq!(p.s.shown(), "nothing");
    }

    #[test]
    fn bodies_must_be_objects() {
        let e = body::<Probe>(b"[1]").unwrap_err();
        assert_eq!(
            e.message,
            "the request body must be a JSON object, got an array"
        );
        let e = body::<Probe>(b"{").unwrap_err();
        assert!(e
            .message
            .starts_with("the request body is not valid JSON: "));
        assert_eq!(body::<Probe>(b"{\"n\": 2}").unwrap().n, Field::Ok(2));
    }
}
