//! Metadata values: the typed accessors the model loader uses, and a short
//! human-readable rendering for `scoria inspect`.

use std::fmt;

/// A metadata value. Arrays keep their element type so a writer can round-trip them.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type id (0..=12) and the elements.
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// GGUF metadata value type ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// Every value type, in id order.
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The type for a stored id, or None for an id this format version does not define.
    pub fn from_id(id: u32) -> Option<ValueType> {
        ValueType::ALL.get(usize::try_from(id).ok()?).copied()
    }

    /// The id stored in the file.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// Lower-case name as used in error messages and `inspect` output ("u32", "string", ...).
    pub const fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }

    /// The smallest number of bytes one value of this type occupies in a file. The
    /// reader multiplies an array's count by this before allocating, so that a forged
    /// count cannot make it reserve more than the file could possibly hold.
    pub(crate) const fn min_encoded_size(self) -> u64 {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 => 8,
            // u64 length, possibly empty
            ValueType::String => 8,
            // u32 element type + u64 count, possibly empty
            ValueType::Array => 12,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Value {
    /// The type id this value is stored with.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Lower-case type name ("u32", "string", "array", ...).
    pub fn type_name(&self) -> &'static str {
        self.value_type().name()
    }

    /// A type description for error messages: arrays include element type and length
    /// ("array[string; 3]") because "array" alone rarely tells the user what went wrong.
    pub fn describe_type(&self) -> String {
        match self {
            Value::Array(ty, items) => format!("array[{ty}; {}]", items.len()),
            other => other.type_name().to_string(),
        }
    }

    /// Any integer value that is >= 0 (bools are not integers).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(u64::from(v)),
            Value::U16(v) => Some(u64::from(v)),
            Value::U32(v) => Some(u64::from(v)),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value that fits an i64 (bools are not integers).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(i64::from(v)),
            Value::U16(v) => Some(i64::from(v)),
            Value::U32(v) => Some(i64::from(v)),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(i64::from(v)),
            Value::I16(v) => Some(i64::from(v)),
            Value::I32(v) => Some(i64::from(v)),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any numeric value as f64. Converters are not consistent about storing e.g.
    /// `rope.freq_base` as f32 or an integer, so the loader accepts both.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(f64::from(v)),
            Value::F64(v) => Some(v),
            // Integers beyond 2^53 lose precision here; metadata floats never get there.
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, items) => Some(items),
            _ => None,
        }
    }

    /// The element type of an array value.
    pub fn array_type(&self) -> Option<ValueType> {
        match self {
            Value::Array(ty, _) => Some(*ty),
            _ => None,
        }
    }
}

/// Strings longer than this many chars are cut in the short form.
const SHORT_STRING_CHARS: usize = 60;
/// Arrays show this many elements in the short form.
const SHORT_ARRAY_ITEMS: usize = 5;

/// The short form (`{}`) is for people: long strings are cut and arrays show their
/// element type, length and first few elements, so that `scoria inspect` can print a
/// 151k-entry vocabulary on one line. The alternate form (`{:#}`) prints everything.
/// Use the `as_*` accessors, not `to_string()`, to get at the value itself.
impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let full = f.alternate();
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => write!(f, "{v:?}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v:?}"),
            Value::String(s) => {
                let n_chars = s.chars().count();
                if full || n_chars <= SHORT_STRING_CHARS {
                    write!(f, "{s:?}")
                } else {
                    let cut: String = s.chars().take(SHORT_STRING_CHARS).collect();
                    write!(f, "{cut:?}... ({} bytes)", s.len())
                }
            }
            Value::Array(ty, items) => {
                write!(f, "[{ty}; {}] [", items.len())?;
                let shown = if full {
                    items.len()
                } else {
                    items.len().min(SHORT_ARRAY_ITEMS)
                };
                for (i, item) in items.iter().take(shown).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    if full {
                        write!(f, "{item:#}")?;
                    } else {
                        write!(f, "{item}")?;
                    }
                }
                if shown < items.len() {
                    if shown > 0 {
                        f.write_str(", ")?;
                    }
                    f.write_str("...")?;
                }
                f.write_str("]")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accessors_convert_only_what_fits() {
        assert_eq!(Value::I32(-1).as_u64(), None);
        assert_eq!(Value::I32(7).as_u64(), Some(7));
        assert_eq!(Value::U64(u64::MAX).as_i64(), None);
        assert_eq!(Value::Bool(true).as_u64(), None);
        assert_eq!(Value::U16(3).as_f64(), Some(3.0));
        assert_eq!(Value::F32(0.5).as_f64(), Some(0.5));
        assert_eq!(Value::String("x".into()).as_f64(), None);
        assert_eq!(Value::String("x".into()).as_str(), Some("x"));
        assert_eq!(Value::Bool(false).as_bool(), Some(false));
        let arr = Value::Array(ValueType::U8, vec![Value::U8(1)]);
        assert_eq!(arr.as_array().map(|a| a.len()), Some(1));
        assert_eq!(arr.array_type(), Some(ValueType::U8));
    }

    #[test]
    fn type_ids_round_trip() {
        for t in ValueType::ALL {
            assert_eq!(ValueType::from_id(t.id()), Some(t));
        }
        assert_eq!(ValueType::from_id(13), None);
        assert_eq!(ValueType::from_id(u32::MAX), None);
    }

    #[test]
    fn short_display() {
        let toks = Value::Array(
            ValueType::String,
            (0..100).map(|i| Value::String(format!("t{i}"))).collect(),
        );
        assert_eq!(
            toks.to_string(),
            r#"[string; 100] ["t0", "t1", "t2", "t3", "t4", ...]"#
        );
        assert!(format!("{toks:#}").contains("\"t99\""));
        let long = Value::String("a".repeat(1000));
        assert!(long.to_string().ends_with("... (1000 bytes)"));
        assert_eq!(Value::F32(1.0).to_string(), "1.0");
        assert_eq!(
            Value::Array(ValueType::I32, vec![]).to_string(),
            "[i32; 0] []"
        );
        assert_eq!(long.describe_type(), "string");
        assert_eq!(toks.describe_type(), "array[string; 100]");
    }
}
