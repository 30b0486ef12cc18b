//! The CPU vision encoder against transformers' `Qwen3_5MoeVisionModel`: the fixture
//! `tests/fixtures/qwen35moe-vision/` (tools/reference/make_vision_fixture.py) holds a
//! random 2-block ViT converted by llama.cpp's converter (F32 and F16 mmproj), the
//! processor's patches of one image (grid 1×6×8) and the reference's merged embedding.
//! Also: BF16 and Q8_0 copies written here, and files and images the encoder refuses.

use gguf::{GgmlType, GgufFile, InMemoryTensor, Value};
use model::vision::{PreparedImage, VisionConfig, VisionModel};
use std::path::{Path, PathBuf};

mod common;
use common::{fixture, read_npy};

fn fixture_image() -> PreparedImage {
    let (shape, pixels) = read_npy(&fixture("pixel_values_image.npy"));
    assert_eq!(shape, [48, 1536]);
    PreparedImage {
        pixels,
        grid: [1, 6, 8],
        resized: (128, 96),
        sha256: [0; 32],
    }
}

/// (max |ours - reference|, max |reference|) over the fixture image's embedding.
fn embedding_error(m: &VisionModel) -> (f32, f32) {
    let (shape, want) = read_npy(&fixture("image_embeds.npy"));
    let got = m.encode(&fixture_image()).expect("encode");
    assert_eq!([got.rows, got.width], [shape[0], shape[1]]);
    let diff = got
        .data
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = want.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    assert!(got.data.iter().all(|v| v.is_finite()));
    (diff, scale)
}

#[test]
fn f32_mmproj_matches_the_reference_embedding() {
    let m = VisionModel::open(&fixture("mmproj-f32.gguf")).expect("open");
    let c = m.config();
    assert_eq!(
        (
            c.hidden,
            c.n_layer,
            c.n_head,
            c.ffn,
            c.patch_size,
            c.merge,
            c.pos_side,
            c.out_hidden
        ),
        (64, 2, 4, 128, 16, 2, 6, 64)
    );
    assert_eq!(c.image_mean, [0.5; 3]);
    let (diff, scale) = embedding_error(&m);
    println!("f32 mmproj: max abs diff {diff:e}, reference max abs {scale}");
    assert!(
        diff < 1e-5 * scale.max(1.0),
        "max abs diff {diff} (scale {scale})"
    );
}

#[test]
fn f16_mmproj_is_close_to_the_reference_embedding() {
    let m = VisionModel::open(&fixture("mmproj-f16.gguf")).expect("open");
    let (diff, scale) = embedding_error(&m);
    println!("f16 mmproj: max abs diff {diff:e}, reference max abs {scale}");
    assert!(
        diff < 1e-2 * scale.max(1.0),
        "max abs diff {diff} (scale {scale})"
    );
}

/// A scratch directory for this test binary.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("scoria-vision-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes a copy of the F32 mmproj to `path`, metadata passed through `meta` and each
/// tensor through `tensor` (None drops it): (name, dims, type, bytes).
fn rewrite(
    path: &Path,
    meta: impl Fn(&str, &Value) -> Value,
    tensor: impl Fn(&str, &[u64], &[f32]) -> Option<Stored>,
) {
    let src = GgufFile::open(&fixture("mmproj-f32.gguf")).unwrap();
    let kvs: Vec<(&str, Value)> = src
        .metadata()
        .iter()
        .map(|(k, v)| (k.as_str(), meta(k, v)))
        .collect();
    let mut tensors = Vec::new();
    for t in src.tensors() {
        let vals: Vec<f32> = src
            .tensor_data(t)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        if let Some(x) = tensor(&t.name, &t.dims, &vals) {
            tensors.push((t.name.clone(), x));
        }
    }
    let mem: Vec<InMemoryTensor> = tensors
        .iter()
        .map(|(name, (dims, ty, data))| InMemoryTensor {
            name,
            dims,
            ty: *ty,
            data,
        })
        .collect();
    gguf::write_file(path, &kvs, &mem).unwrap();
}

/// A tensor as a rewrite stores it: dims (ggml order), type, bytes.
type Stored = (Vec<u64>, GgmlType, Vec<u8>);

fn same(_: &str, v: &Value) -> Value {
    v.clone()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Every tensor whose rows are whole blocks of `ty` is stored as `ty`, the rest as F32.
fn as_type(ty: GgmlType) -> impl Fn(&str, &[u64], &[f32]) -> Option<Stored> {
    move |_, dims, vals| {
        let ne0 = dims[0] as usize;
        match ty.row_bytes(ne0) {
            Some(rb) if dims.len() > 1 => {
                let mut out = vec![0u8; rb * (vals.len() / ne0)];
                for (src, dst) in vals.chunks_exact(ne0).zip(out.chunks_exact_mut(rb)) {
                    quant::quantize_row(ty, src, dst);
                }
                Some((dims.to_vec(), ty, out))
            }
            _ => Some((dims.to_vec(), GgmlType::F32, f32_bytes(vals))),
        }
    }
}

#[test]
fn bf16_and_q8_0_mmproj_load_and_stay_close() {
    let dir = scratch("types");
    for (ty, tol) in [(GgmlType::BF16, 3e-2), (GgmlType::Q8_0, 3e-2)] {
        let path = dir.join(format!("mmproj-{ty}.gguf"));
        rewrite(&path, same, as_type(ty));
        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.tensor("mm.0.weight").unwrap().ty, ty);
        let m = VisionModel::open(&path).expect("open");
        let (diff, scale) = embedding_error(&m);
        println!("{ty} mmproj: max abs diff {diff:e}, reference max abs {scale}");
        assert!(
            diff < tol * scale.max(1.0),
            "{ty}: max abs diff {diff} (scale {scale})"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn identity_and_bytes() {
    let a = VisionModel::open(&fixture("mmproj-f32.gguf")).unwrap();
    let b = VisionModel::open(&fixture("mmproj-f32.gguf")).unwrap();
    let h = VisionModel::open(&fixture("mmproj-f16.gguf")).unwrap();
    assert_eq!(a.identity(), b.identity());
    assert_ne!(a.identity(), h.identity());
    // A copy that differs in one weight value has another identity.
    let dir = scratch("identity");
    let path = dir.join("one-weight.gguf");
    rewrite(&path, same, |name, dims, vals| {
        let mut v = vals.to_vec();
        if name == "mm.2.bias" {
            v[0] += 1.0;
        }
        Some((dims.to_vec(), GgmlType::F32, f32_bytes(&v)))
    });
    assert_ne!(VisionModel::open(&path).unwrap().identity(), a.identity());
    std::fs::remove_dir_all(&dir).unwrap();
    // Every weight is held once: the F32 file's as f32, the F16 file's matrices as
    // F16 (the patch embedding, re-laid out, and the vectors as f32).
    let file = GgufFile::open(&fixture("mmproj-f32.gguf")).unwrap();
    let values: u64 = file.tensors().iter().map(|t| t.n_elements()).sum();
    assert_eq!(a.bytes(), 4 * values);
    let f16 = GgufFile::open(&fixture("mmproj-f16.gguf")).unwrap();
    let half: u64 = f16
        .tensors()
        .iter()
        .filter(|t| t.ty == GgmlType::F16 && !t.name.starts_with("v.patch_embd"))
        .map(|t| t.n_elements())
        .sum();
    assert!(half > 0);
    assert_eq!(h.bytes(), 4 * values - 2 * half);
}

/// The error opening a rewritten copy of the F32 mmproj; the message must name the file.
fn open_error(
    name: &str,
    meta: impl Fn(&str, &Value) -> Value,
    tensor: impl Fn(&str, &[u64], &[f32]) -> Option<Stored>,
) -> String {
    let dir = scratch(name);
    let path = dir.join(format!("{name}.gguf"));
    rewrite(&path, meta, tensor);
    let e = VisionModel::open(&path)
        .expect_err("must be refused")
        .to_string();
    assert!(e.contains(&path.display().to_string()), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
    e
}

#[test]
fn a_missing_or_misshaped_tensor_is_named() {
    let keep = as_type(GgmlType::F32);
    let e = open_error("missing", same, |name, dims, vals| {
        (name != "v.blk.1.ffn_down.bias")
            .then(|| keep(name, dims, vals))
            .flatten()
    });
    assert!(e.contains("`v.blk.1.ffn_down.bias` is missing"), "{e}");
    let e = open_error("shape", same, |name, dims, vals| {
        if name == "v.position_embd.weight" {
            // 25 positions where image_size / patch_size = 6 needs 36.
            return Some((vec![64, 25], GgmlType::F32, f32_bytes(&vals[..64 * 25])));
        }
        keep(name, dims, vals)
    });
    assert!(
        e.contains("`v.position_embd.weight` has shape [64, 25], expected [64, 36]"),
        "{e}"
    );
}

#[test]
fn another_projector_or_deepstack_is_refused() {
    let keep = as_type(GgmlType::F32);
    let e = open_error(
        "projector",
        |k, v| match k {
            "clip.projector_type" => Value::String("gemma3".into()),
            _ => v.clone(),
        },
        &keep,
    );
    assert!(
        e.contains("clip.projector_type") && e.contains("`gemma3` is not supported"),
        "{e}"
    );
    assert!(e.contains("qwen3vl_merger"), "{e}");
    let e = open_error(
        "deepstack",
        |k, v| match k {
            "clip.vision.is_deepstack_layers" => Value::Array(
                gguf::ValueType::Bool,
                vec![Value::Bool(false), Value::Bool(true)],
            ),
            _ => v.clone(),
        },
        &keep,
    );
    assert!(
        e.contains("clip.vision.is_deepstack_layers") && e.contains("layer(s) 1"),
        "{e}"
    );
    assert!(e.contains("deep-stack"), "{e}");
    let e = open_error(
        "text",
        |k, v| match k {
            "general.architecture" => Value::String("qwen35moe".into()),
            _ => v.clone(),
        },
        &keep,
    );
    assert!(
        e.contains("general.architecture") && e.contains("expected `clip`"),
        "{e}"
    );
    // And a key the encoder needs, missing.
    let dir = scratch("nokey");
    let path = dir.join("nokey.gguf");
    rewrite(&path, same, &keep);
    let src = GgufFile::open(&path).unwrap();
    let mut w = gguf::GgufWriter::new();
    for (k, v) in src.metadata() {
        if k != "clip.vision.spatial_merge_size" {
            w.add_kv(k.clone(), v.clone()).unwrap();
        }
    }
    for t in src.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty).unwrap();
    }
    let data: Vec<&[u8]> = src.tensors().iter().map(|t| src.tensor_data(t)).collect();
    let path2 = dir.join("nokey2.gguf");
    w.write_to_path(&path2, &data).unwrap();
    let e = VisionConfig::from_gguf(&GgufFile::open(&path2).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("clip.vision.spatial_merge_size") && e.contains("missing"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_bad_grid_is_refused() {
    let m = VisionModel::open(&fixture("mmproj-f32.gguf")).unwrap();
    let good = fixture_image();
    let with = |grid: [usize; 3], n: usize| PreparedImage {
        pixels: vec![0.0; n * 1536],
        grid,
        ..good.clone()
    };
    let e = m.encode(&with([2, 6, 8], 96)).unwrap_err().to_string();
    assert!(e.contains("t = 2") && e.contains("[2, 6, 8]"), "{e}");
    let e = m.encode(&with([1, 5, 8], 40)).unwrap_err().to_string();
    assert!(
        e.contains("[1, 5, 8]") && e.contains("multiples of the merge size 2"),
        "{e}"
    );
    let e = m.encode(&with([1, 6, 0], 0)).unwrap_err().to_string();
    assert!(e.contains("[1, 6, 0]"), "{e}");
    let e = m.encode(&with([1, 6, 8], 47)).unwrap_err().to_string();
    assert!(e.contains("73728 pixel values, found 72192"), "{e}");
    // The odd image's grid (1×6×10) encodes to 15 rows.
    let (shape, pixels) = read_npy(&fixture("pixel_values_odd.npy"));
    assert_eq!(shape, [60, 1536]);
    let odd = PreparedImage {
        pixels,
        grid: [1, 6, 10],
        ..good
    };
    let out = m.encode(&odd).unwrap();
    assert_eq!((out.rows, out.width, out.data.len()), (15, 64, 15 * 64));
}
