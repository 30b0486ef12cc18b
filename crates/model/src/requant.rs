//! Requantizing a GGUF file: every tensor dequantized and written again at the type a
//! [`Preset`] gives it, chosen as `llama-quantize` chooses it ([`TypeChooser`]), the
//! metadata copied with the new `general.file_type`. `scoria quantize` runs it.
//!
//! The quantizers are round-to-nearest (`quant::quantize_row`), not llama.cpp's search for
//! better scales: the files are for measuring what a type costs (`scoria perplexity
//! --kld-base`) and for tests, not for publishing. Dequantizing to F32 is exact for every
//! type (a block's values are an f16 scale times small integers), so `--quant f32` gives
//! the float weights a quantized file means.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use gguf::{GgmlType, GgufFile, GgufWriter, Value, WriteError};
use rayon::prelude::*;

use crate::synth::plan::{quantize_order, TypeChooser};
use crate::synth::Preset;
use crate::tensors::{self, QuantRule, TensorId};
use crate::{ModelConfig, ModelError};

/// Why a file cannot be requantized; names the tensor or the file.
#[derive(Debug, thiserror::Error)]
pub enum RequantError {
    #[error(transparent)]
    Open(#[from] gguf::Error),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("tensor `{name}` is {ty}, which scoria cannot dequantize")]
    Unsupported { name: String, ty: GgmlType },
    #[error(
        "tensor `{name}`: rows of {ne0} values are not whole {ty} blocks ({block} values); choose a preset with smaller blocks (q8_0, bf16, f16, f32)"
    )]
    Shape {
        name: String,
        ne0: u64,
        ty: GgmlType,
        block: usize,
    },
    #[error("{}: {err}", .path.display())]
    Write { path: PathBuf, err: WriteError },
    #[error("{}: {err}", .path.display())]
    Io { path: PathBuf, err: std::io::Error },
}

/// What was written.
#[derive(Debug, Clone)]
pub struct RequantReport {
    pub path: PathBuf,
    pub file_size: u64,
    pub n_tensors: usize,
    /// Tensors written at a new type, and tensors whose bytes were copied (already at
    /// their type, or unknown to the arch's table).
    pub converted: usize,
    pub copied: usize,
    /// (type, tensors, bytes), most bytes first.
    pub by_type: Vec<(GgmlType, usize, u64)>,
}

/// The type each tensor of `file` gets under `preset`, in the file's tensor order.
fn target_types(
    file: &GgufFile,
    cfg: &ModelConfig,
    preset: Preset,
) -> Result<Vec<GgmlType>, RequantError> {
    let table = tensors::table(cfg.arch);
    // A file without `output.weight` uses the embedding as the head, and llama-quantize
    // gives it the head's type.
    let tied = file.tensor("output.weight").is_none();
    let rule_of = |name: &str| {
        table.find(name).map(|(block, def)| {
            let rule = if tied && def.id == TensorId::TokenEmbd {
                QuantRule::Output
            } else {
                def.quant
            };
            (block, rule, def.role)
        })
    };
    let infos = file.tensors();
    let mut order: Vec<usize> = (0..infos.len()).collect();
    order.sort_by(|&a, &b| quantize_order(&infos[a].name, &infos[b].name));
    let n_attention_wv = infos
        .iter()
        .filter(|t| matches!(rule_of(&t.name), Some((_, QuantRule::AttnV, _))))
        .count();
    let mut chooser = TypeChooser::new(preset, n_attention_wv, (cfg.n_layer + cfg.n_nextn) as u32);
    let mut types = vec![GgmlType::F32; infos.len()];
    for i in order {
        let t = &infos[i];
        let ne0 = t.dims[0];
        let ty = match rule_of(&t.name) {
            // Not in the arch's table: kept as it is.
            None => t.ty,
            // 1-D tensors are never quantized, whatever the table says.
            Some(_) if t.dims.len() == 1 => t.ty,
            Some((block, rule, role)) => chooser.next(rule, role, block, ne0),
        };
        if !ne0.is_multiple_of(ty.block_size() as u64) {
            return Err(RequantError::Shape {
                name: t.name.clone(),
                ne0,
                ty,
                block: ty.block_size(),
            });
        }
        types[i] = ty;
    }
    Ok(types)
}

/// Writes `src`'s tensors at `preset`'s types to `dst` (through a temporary file in the
/// same directory, renamed into place when complete). `progress(done, total)`: tensors.
pub fn requantize(
    src: &Path,
    dst: &Path,
    preset: Preset,
    progress: &dyn Fn(usize, usize),
) -> Result<RequantReport, RequantError> {
    let file = GgufFile::open(src)?;
    let cfg = ModelConfig::from_gguf(&file)?;
    let types = target_types(&file, &cfg, preset)?;
    let infos = file.tensors();
    for t in infos {
        if !quant::is_supported(t.ty) {
            return Err(RequantError::Unsupported {
                name: t.name.clone(),
                ty: t.ty,
            });
        }
    }
    let write_err = |err| RequantError::Write {
        path: dst.to_path_buf(),
        err,
    };
    // Every key is copied in order (`general.alignment`, when there, sets the writer's).
    let mut w = GgufWriter::new();
    let mut has_file_type = false;
    for (k, v) in file.metadata() {
        if k.starts_with("split.") {
            continue;
        }
        let v = if k == "general.file_type" {
            has_file_type = true;
            Value::U32(preset.file_type())
        } else {
            v.clone()
        };
        w.add_kv(k.clone(), v).map_err(write_err)?;
    }
    if !has_file_type {
        w.add_kv("general.file_type", Value::U32(preset.file_type()))
            .map_err(write_err)?;
    }
    for (t, &ty) in infos.iter().zip(&types) {
        w.add_tensor(t.name.as_str(), &t.dims, ty)
            .map_err(write_err)?;
    }
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = crate::synth::partial_path(dst, &name);
    let io = |err| RequantError::Io {
        path: dst.to_path_buf(),
        err,
    };
    let result = (|| {
        let mut out = BufWriter::with_capacity(8 << 20, File::create(&tmp).map_err(io)?);
        w.write_header(&mut out).map_err(write_err)?;
        let (mut converted, mut copied) = (0, 0);
        for (i, (t, &ty)) in infos.iter().zip(&types).enumerate() {
            let data = file.try_tensor_data(t)?;
            if ty == t.ty {
                w.write_tensor(&mut out, data).map_err(write_err)?;
                copied += 1;
            } else {
                let bytes = convert(t.ty, ty, t.dims[0] as usize, data);
                w.write_tensor(&mut out, &bytes).map_err(write_err)?;
                converted += 1;
            }
            progress(i + 1, infos.len());
        }
        w.finish(&mut out).map_err(write_err)?;
        out.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)?;
        Ok::<_, RequantError>((converted, copied))
    })();
    let (converted, copied) = match result {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, dst).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })?;
    let mut by_type: Vec<(GgmlType, usize, u64)> = Vec::new();
    for (t, &ty) in infos.iter().zip(&types) {
        let bytes = ty.row_bytes(t.dims[0] as usize).unwrap_or(0) as u64 * t.n_elements()
            / t.dims[0].max(1);
        match by_type.iter_mut().find(|e| e.0 == ty) {
            Some(e) => {
                e.1 += 1;
                e.2 += bytes;
            }
            None => by_type.push((ty, 1, bytes)),
        }
    }
    by_type.sort_by_key(|e| std::cmp::Reverse(e.2));
    Ok(RequantReport {
        path: dst.to_path_buf(),
        file_size: std::fs::metadata(dst).map_err(io)?.len(),
        n_tensors: infos.len(),
        converted,
        copied,
        by_type,
    })
}

/// One tensor's rows of `ne0` values, from type `from` to type `to`.
fn convert(from: GgmlType, to: GgmlType, ne0: usize, data: &[u8]) -> Vec<u8> {
    let (src_row, dst_row) = match (from.row_bytes(ne0), to.row_bytes(ne0)) {
        (Some(a), Some(b)) => (a, b),
        _ => unreachable!("row sizes were checked when the types were chosen"),
    };
    let rows = data.len() / src_row;
    let mut out = vec![0u8; rows * dst_row];
    out.par_chunks_mut(dst_row)
        .zip(data.par_chunks(src_row))
        .for_each_init(
            || vec![0f32; ne0],
            |x, (dst, src)| {
                quant::dequantize_row(from, src, x);
                quant::quantize_row(to, x, dst);
            },
        );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::{Arch, Geometry};
    use crate::synth::{synthesize, SynthOptions};

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("scoria-requant-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn types(f: &GgufFile) -> Vec<(String, GgmlType)> {
        f.tensors().iter().map(|t| (t.name.clone(), t.ty)).collect()
    }

    #[test]
    fn types_follow_the_preset_and_dequantizing_is_exact() {
        let dir = temp("types");
        let g = Geometry::by_name(Some(Arch::Qwen3Moe), "tiny").unwrap();
        let q4 = dir.join("q4km.gguf");
        let opts = SynthOptions {
            preset: Preset::Q4KM,
            seed: 3,
            sync: false,
        };
        synthesize(&q4, &g, &opts, &|_, _| {}).unwrap();
        let q8 = dir.join("q8.gguf");
        let r = requantize(&q4, &q8, Preset::Q8_0, &|_, _| {}).unwrap();
        assert_eq!(r.converted + r.copied, r.n_tensors);
        let (a, b) = (GgufFile::open(&q4).unwrap(), GgufFile::open(&q8).unwrap());
        assert_eq!(
            b.get("general.file_type").and_then(Value::as_u64),
            Some(u64::from(Preset::Q8_0.file_type()))
        );
        for t in a.tensors() {
            let u = b.tensor(&t.name).unwrap();
            assert_eq!(u.dims, t.dims);
            let want = if t.ty == GgmlType::F32 {
                GgmlType::F32
            } else {
                GgmlType::Q8_0
            };
            assert_eq!(u.ty, want, "{}", t.name);
        }
        // Back to Q4_K_M: the types llama-quantize gives, as the synthesizer gave them.
        let back = dir.join("back.gguf");
        requantize(&q8, &back, Preset::Q4KM, &|_, _| {}).unwrap();
        let c = GgufFile::open(&back).unwrap();
        assert_eq!(types(&c), types(&a));
        assert_eq!(c.metadata().len(), a.metadata().len());
        ModelConfig::from_gguf(&c).unwrap();
        // F32 holds exactly the values a quantized tensor means.
        for t in a.tensors().iter().filter(|t| t.ty != GgmlType::F32) {
            let ne0 = t.dims[0] as usize;
            let data = a.tensor_data(t);
            let f = convert(t.ty, GgmlType::F32, ne0, data);
            let row = t.ty.row_bytes(ne0).unwrap();
            let mut want = vec![0f32; ne0];
            for (src, got) in data.chunks(row).zip(f.chunks(4 * ne0)) {
                quant::dequantize_row(t.ty, src, &mut want);
                let got: Vec<u32> = got
                    .chunks(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "{}", t.name);
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rows_that_are_not_whole_k_blocks_take_the_fallback_type() {
        let dir = temp("shape");
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .ancestors()
            .nth(2)
            .unwrap();
        // The demo model's rows are 128 values: not whole Q4_K blocks, so Q4_K_M writes
        // them as llama-quantize does, Q5_0.
        let demo = root.join(crate::synth::DEMO_MODEL_FILE);
        let out = dir.join("x.gguf");
        requantize(&demo, &out, Preset::Q4KM, &|_, _| {}).expect("requantize");
        let f = GgufFile::open(&out).expect("open");
        let t = f.tensor("blk.0.attn_gate.weight").expect("attn_gate");
        assert_eq!(t.ty, GgmlType::Q5_0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
