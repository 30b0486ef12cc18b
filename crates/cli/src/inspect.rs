//! `scoria inspect FILE`: what a GGUF model is and where every byte of it goes.

use std::path::PathBuf;

use anyhow::Context;
use gguf::{GgufFile, Value};
use model::synth::accounting::{self, Accounting, Classifier, Group};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The model (a GGUF file, or the first shard of a split model).
    pub file: PathBuf,
    /// List every tensor (name, type, shape, bytes, offset).
    #[arg(long)]
    pub tensors: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `writeln!` into a String (which cannot fail).
macro_rules! outln {
    ($out:expr) => {{
        $out.push('\n');
    }};
    ($out:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = writeln!($out, $($arg)*);
    }};
}

/// Writes to stdout; a closed pipe (`| head`) ends quietly.
fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

/// llama.cpp's `llama_ftype` names (`general.file_type`).
fn file_type_name(ft: u64) -> &'static str {
    match ft {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        39 => "NVFP4",
        _ => "unknown",
    }
}

fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} kB", b / 1e3)
    } else {
        format!("{bytes} B")
    }
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// A metadata value for display: long arrays summarised, long strings cut.
fn short(v: &Value) -> String {
    match v {
        Value::Array(ty, items) if items.len() > 8 => {
            format!("[{ty}; {} items]", items.len())
        }
        Value::String(s) if s.chars().count() > 80 => {
            let head: String = s.chars().take(60).collect();
            format!("{head:?}… ({} bytes)", s.len())
        }
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

fn json_value(v: &Value) -> serde_json::Value {
    match v {
        Value::Array(_, items) if items.len() > 64 => json!({
            "type": v.describe_type(),
            "len": items.len(),
        }),
        Value::Array(_, items) => items.iter().map(json_value).collect(),
        Value::String(s) if s.len() > 4096 => json!({ "type": "string", "len": s.len() }),
        Value::String(s) => json!(s),
        Value::Bool(b) => json!(b),
        Value::F32(x) => json!(x),
        Value::F64(x) => json!(x),
        other => match (other.as_u64(), other.as_i64()) {
            (Some(u), _) => json!(u),
            (None, Some(i)) => json!(i),
            _ => json!(other.to_string()),
        },
    }
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let f = GgufFile::open(&args.file)
        .with_context(|| format!("cannot read {} as a GGUF model", args.file.display()))?;
    let acc = accounting::account(&f)
        .with_context(|| format!("cannot account for {}", args.file.display()))?;
    if acc.total() != acc.file_size {
        anyhow::bail!(
            "internal error: accounted {} bytes of a {} byte file",
            acc.total(),
            acc.file_size
        );
    }
    if args.json {
        print_json(&f, &acc, args.tensors)
    } else {
        emit(&print_text(&f, &acc, args.tensors))
    }
}

fn is_tokenizer_key(k: &str) -> bool {
    k.starts_with("tokenizer.")
}

fn print_text(f: &GgufFile, acc: &Accounting, list_tensors: bool) -> String {
    let mut out = String::new();
    let arch = f.architecture().unwrap_or("(none)");
    let n_shards = f.shards().len();
    outln!(
        out,
        "file:  {} ({} shard{}, {} = {} bytes)",
        f.paths()
            .first()
            .map_or(String::new(), |p| p.display().to_string()),
        n_shards,
        if n_shards == 1 { "" } else { "s" },
        human(acc.file_size),
        acc.file_size
    );
    let ft = f.get("general.file_type").and_then(Value::as_u64);
    outln!(
        out,
        "arch:  {arch}    name: {}    file type: {}",
        f.get("general.name").and_then(Value::as_str).unwrap_or("-"),
        ft.map_or("-".to_string(), |t| format!("{t} ({})", file_type_name(t)))
    );
    if f.get("scoria.synthetic").and_then(Value::as_bool) == Some(true) {
        outln!(
            out,
            "synthetic: geometry {}, seed {} (random weights)",
            f.get("scoria.synthetic.geometry")
                .and_then(Value::as_str)
                .unwrap_or("?"),
            f.get("scoria.synthetic.seed")
                .and_then(Value::as_u64)
                .map_or("?".to_string(), |s| s.to_string())
        );
    }
    outln!(out);
    outln!(out, "metadata:");
    for (k, v) in f.metadata() {
        if !is_tokenizer_key(k) {
            outln!(out, "  {k:<48} {}", short(v));
        }
    }
    let tok = |k: &str| f.get(k);
    let arr_len = |k: &str| tok(k).and_then(Value::as_array).map_or(0, |a| a.len());
    outln!(
        out,
        "tokenizer: {} / pre {}, {} tokens, {} merges, eos {}, pad {}, bos {}, chat template {}",
        tok("tokenizer.ggml.model")
            .and_then(Value::as_str)
            .unwrap_or("-"),
        tok("tokenizer.ggml.pre")
            .and_then(Value::as_str)
            .unwrap_or("-"),
        arr_len("tokenizer.ggml.tokens"),
        arr_len("tokenizer.ggml.merges"),
        id(tok("tokenizer.ggml.eos_token_id")),
        id(tok("tokenizer.ggml.padding_token_id")),
        id(tok("tokenizer.ggml.bos_token_id")),
        tok("tokenizer.chat_template")
            .and_then(Value::as_str)
            .map_or("none".to_string(), |t| format!("{} bytes", t.len()))
    );
    outln!(out);
    let data = acc.tensor_data();
    outln!(out, "tensors: {}", f.tensors().len());
    outln!(
        out,
        "  {:<8} {:>8} {:>14} {:>7}",
        "type",
        "tensors",
        "bytes",
        "%"
    );
    let mut types: Vec<_> = acc.by_type.iter().collect();
    types.sort_by_key(|t| std::cmp::Reverse(t.1.bytes));
    for (ty, t) in types {
        outln!(
            out,
            "  {:<8} {:>8} {:>14} {:>6.2}%",
            ty.name(),
            t.tensors,
            human(t.bytes),
            pct(t.bytes, data)
        );
    }
    outln!(out);
    outln!(
        out,
        "  {:<24} {:>8} {:>14} {:>7}",
        "group",
        "tensors",
        "bytes",
        "%"
    );
    for g in Group::ALL {
        if let Some(t) = acc.groups.get(&g) {
            outln!(
                out,
                "  {:<24} {:>8} {:>14} {:>6.2}%",
                g.name(),
                t.tensors,
                human(t.bytes),
                pct(t.bytes, data)
            );
        }
    }
    outln!(out);
    outln!(
        out,
        "  dense:          {:>14} {:>6.2}%  ({} tensors)",
        human(acc.dense.bytes),
        pct(acc.dense.bytes, data),
        acc.dense.tensors
    );
    outln!(
        out,
        "  routed experts: {:>14} {:>6.2}%  ({} tensors)",
        human(acc.routed_expert.bytes),
        pct(acc.routed_expert.bytes, data),
        acc.routed_expert.tensors
    );
    outln!(out);
    outln!(out, "bytes:");
    for s in &acc.shards {
        if n_shards > 1 {
            outln!(out, "  {}", s.path.display());
        }
        let rows: [(&str, u64); 8] = [
            ("header (magic, version, counts)", s.fixed_header),
            ("metadata", s.metadata),
            ("tensor infos", s.tensor_infos),
            ("padding before data", s.header_padding),
            ("tensor data", s.tensor_data),
            ("padding after tensors", s.tensor_padding),
            ("unreferenced", s.unreferenced),
            ("total = file size", s.total()),
        ];
        for (label, v) in rows {
            outln!(out, "  {label:<34} {v:>16}");
        }
        let ok = if s.total() == s.file_size {
            "exact"
        } else {
            "MISMATCH"
        };
        outln!(
            out,
            "  {:<34} {:>16} ({ok}, alignment {})",
            "file size on disk",
            s.file_size,
            s.alignment
        );
    }
    if n_shards > 1 {
        outln!(
            out,
            "  all shards: {} bytes accounted, {} on disk",
            acc.total(),
            acc.file_size
        );
    }
    if list_tensors {
        outln!(out);
        let c = Classifier::for_file(f);
        outln!(
            out,
            "{:<44} {:<7} {:<22} {:>14} {:>5} {:>14}  group",
            "name",
            "type",
            "shape",
            "bytes",
            "shard",
            "offset"
        );
        for t in f.tensors() {
            let shape = format!("{:?}", t.dims);
            outln!(
                out,
                "{:<44} {:<7} {:<22} {:>14} {:>5} {:>14}  {}",
                t.name,
                t.ty.name(),
                shape,
                t.size,
                t.shard,
                t.offset,
                c.classify(&t.name).name()
            );
        }
    }
    out
}

fn id(v: Option<&Value>) -> String {
    v.and_then(Value::as_u64)
        .map_or("-".to_string(), |x| x.to_string())
}

fn print_json(f: &GgufFile, acc: &Accounting, list_tensors: bool) -> anyhow::Result<()> {
    let metadata: serde_json::Map<String, serde_json::Value> = f
        .metadata()
        .iter()
        .map(|(k, v)| (k.clone(), json_value(v)))
        .collect();
    let by_type: serde_json::Map<String, serde_json::Value> = acc
        .by_type
        .iter()
        .map(|(ty, t)| {
            (
                ty.name().to_string(),
                json!({ "tensors": t.tensors, "bytes": t.bytes }),
            )
        })
        .collect();
    let groups: serde_json::Map<String, serde_json::Value> = acc
        .groups
        .iter()
        .map(|(g, t)| {
            (
                g.name().to_string(),
                json!({ "tensors": t.tensors, "bytes": t.bytes }),
            )
        })
        .collect();
    let shards: Vec<serde_json::Value> = acc
        .shards
        .iter()
        .map(|s| {
            json!({
                "path": s.path.display().to_string(),
                "file_size": s.file_size,
                "alignment": s.alignment,
                "tensors": s.n_tensors,
                "header": s.fixed_header,
                "metadata": s.metadata,
                "tensor_infos": s.tensor_infos,
                "header_padding": s.header_padding,
                "tensor_data": s.tensor_data,
                "tensor_padding": s.tensor_padding,
                "unreferenced": s.unreferenced,
                "total": s.total(),
            })
        })
        .collect();
    let mut out = json!({
        "file": f.paths().first().map(|p| p.display().to_string()),
        "arch": f.architecture(),
        "file_size": acc.file_size,
        "accounted": acc.total(),
        "file_type": f.get("general.file_type").and_then(Value::as_u64),
        "file_type_name": f.get("general.file_type").and_then(Value::as_u64).map(file_type_name),
        "metadata": metadata,
        "n_tensors": f.tensors().len(),
        "by_type": by_type,
        "groups": groups,
        "dense": { "tensors": acc.dense.tensors, "bytes": acc.dense.bytes },
        "routed_experts": { "tensors": acc.routed_expert.tensors, "bytes": acc.routed_expert.bytes },
        "shards": shards,
    });
    if list_tensors {
        let c = Classifier::for_file(f);
        let tensors: Vec<serde_json::Value> = f
            .tensors()
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "type": t.ty.name(),
                    "dims": t.dims,
                    "bytes": t.size,
                    "shard": t.shard,
                    "offset": t.offset,
                    "group": c.classify(&t.name).name(),
                })
            })
            .collect();
        if let Some(obj) = out.as_object_mut() {
            obj.insert("tensors".into(), serde_json::Value::Array(tensors));
        }
    }
    let mut text = serde_json::to_string_pretty(&out)?;
    text.push('\n');
    emit(&text)
}
