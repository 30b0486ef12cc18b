//! Times the image encoder on the GPU (and, with `--cpu`, on the CPU) for one image size.
//!
//! ```text
//! cargo run --release -p scoria-engine --features cuda --example encode_image_gpu -- \
//!     MMPROJ WIDTHxHEIGHT [RUNS] [--cpu]
//! cargo run ... --example encode_image_gpu -- --synth-q35 OUT.gguf [ROWS]
//! ```
//!
//! The image is random pixels at the given size, rounded up to whole merged patches as the
//! processor resizes (3840x2160 runs as 3840x2176), so no decoder runs: the time is the encoder's, from the
//! pixels on the host to the merged rows on the host. Prints the first run (it includes
//! nothing the later ones do not) and the best of RUNS (default 5).
//! `--synth-q35` writes a random-weights mmproj (F16) at Qwen3.5/3.6-35B-A3B's encoder
//! geometry (27 blocks of width 1152, MLP 4304, 16 heads, patch 16, merge 2, a 48×48
//! position grid, rows of 2048) with the keys and tensors llama.cpp's converter writes;
//! ROWS changes the width of the merged rows (to pair the file with a smaller text model,
//! e.g. the vision fixture's 64, when another engine needs one to load it).

use std::path::Path;
use std::time::Instant;

use engine::cuda::vision::GpuEncoder;
use gguf::{GgmlType, GgufWriter, Value, ValueType};
use model::vision::{PreparedImage, VisionModel};

struct Rng(u64);

impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn synth_q35(out: &Path, proj: u64) {
    let (h, ffn, heads, layers, patch, merge, side) =
        (1152u64, 4304u64, 16u32, 27u32, 16u64, 2u32, 48u64);
    let mut w = GgufWriter::new();
    let kv = |w: &mut GgufWriter, k: &str, v: Value| w.add_kv(k, v).expect("metadata");
    kv(&mut w, "general.architecture", Value::String("clip".into()));
    kv(&mut w, "general.type", Value::String("mmproj".into()));
    kv(&mut w, "general.file_type", Value::U32(1));
    kv(&mut w, "clip.has_vision_encoder", Value::Bool(true));
    kv(
        &mut w,
        "clip.projector_type",
        Value::String("qwen3vl_merger".into()),
    );
    kv(&mut w, "clip.use_gelu", Value::Bool(true));
    kv(
        &mut w,
        "clip.vision.projection_dim",
        Value::U32(proj as u32),
    );
    kv(
        &mut w,
        "clip.vision.image_size",
        Value::U32((side * patch) as u32),
    );
    kv(&mut w, "clip.vision.patch_size", Value::U32(patch as u32));
    kv(&mut w, "clip.vision.embedding_length", Value::U32(h as u32));
    kv(
        &mut w,
        "clip.vision.feed_forward_length",
        Value::U32(ffn as u32),
    );
    kv(&mut w, "clip.vision.block_count", Value::U32(layers));
    kv(
        &mut w,
        "clip.vision.attention.head_count",
        Value::U32(heads),
    );
    kv(
        &mut w,
        "clip.vision.attention.layer_norm_epsilon",
        Value::F32(1e-6),
    );
    kv(&mut w, "clip.vision.spatial_merge_size", Value::U32(merge));
    let half = Value::Array(ValueType::F32, vec![Value::F32(0.5); 3]);
    kv(&mut w, "clip.vision.image_mean", half.clone());
    kv(&mut w, "clip.vision.image_std", half);
    kv(
        &mut w,
        "clip.vision.is_deepstack_layers",
        Value::Array(ValueType::Bool, vec![Value::Bool(false); layers as usize]),
    );
    // (name, ggml dims, type, scale of the random values)
    let mut tensors: Vec<(String, Vec<u64>, GgmlType, f32)> = Vec::new();
    let mut t = |name: String, dims: Vec<u64>, ty, scale| tensors.push((name, dims, ty, scale));
    let mh = h * u64::from(merge * merge);
    for i in 0..layers {
        let b = |s: &str| format!("v.blk.{i}.{s}");
        for (n, i_n, o_n) in [
            ("attn_qkv", h, 3 * h),
            ("attn_out", h, h),
            ("ffn_up", h, ffn),
            ("ffn_down", ffn, h),
        ] {
            t(
                b(&format!("{n}.weight")),
                vec![i_n, o_n],
                GgmlType::F16,
                0.03,
            );
            t(b(&format!("{n}.bias")), vec![o_n], GgmlType::F32, 0.02);
        }
        for n in ["ln1", "ln2"] {
            t(b(&format!("{n}.weight")), vec![h], GgmlType::F32, -1.0);
            t(b(&format!("{n}.bias")), vec![h], GgmlType::F32, 0.02);
        }
    }
    t("mm.0.weight".into(), vec![mh, mh], GgmlType::F16, 0.015);
    t("mm.0.bias".into(), vec![mh], GgmlType::F32, 0.02);
    t("mm.2.weight".into(), vec![mh, proj], GgmlType::F16, 0.015);
    t("mm.2.bias".into(), vec![proj], GgmlType::F32, 0.02);
    t("v.post_ln.weight".into(), vec![h], GgmlType::F32, -1.0);
    t("v.post_ln.bias".into(), vec![h], GgmlType::F32, 0.02);
    t(
        "v.patch_embd.weight".into(),
        vec![patch, patch, 3, h],
        GgmlType::F16,
        0.03,
    );
    t(
        "v.patch_embd.weight.1".into(),
        vec![patch, patch, 3, h],
        GgmlType::F16,
        0.03,
    );
    t("v.patch_embd.bias".into(), vec![h], GgmlType::F32, 0.02);
    t(
        "v.position_embd.weight".into(),
        vec![h, side * side],
        GgmlType::F32,
        0.02,
    );
    let mut rng = Rng(0x5eed_1234_5678_9abc);
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, dims, ty, scale)| {
            let n: u64 = dims.iter().product();
            // A negative scale: LayerNorm weights, 1 ± |scale|/50.
            let v = (0..n).map(|_| {
                let r = rng.f();
                if *scale < 0.0 {
                    1.0 + 0.02 * r
                } else {
                    scale * r
                }
            });
            match ty {
                GgmlType::F16 => v
                    .flat_map(|x| half::f16::from_f32(x).to_le_bytes())
                    .collect(),
                _ => v.flat_map(|x| x.to_le_bytes()).collect(),
            }
        })
        .collect();
    for (name, dims, ty, _) in &tensors {
        w.add_tensor(name.clone(), dims, *ty).expect("tensor");
    }
    let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
    let bytes = w.write_to_path(out, &refs).expect("write");
    println!("{}: {bytes} bytes", out.display());
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--synth-q35") {
        let rows = args
            .get(2)
            .map_or(2048, |r| r.parse().expect("ROWS: a number"));
        synth_q35(Path::new(args.get(1).expect("--synth-q35 OUT.gguf")), rows);
        return;
    }
    let cpu = args.iter().any(|a| a == "--cpu");
    let args: Vec<&String> = args.iter().filter(|a| *a != "--cpu").collect();
    if args.len() < 2 {
        eprintln!(
            "usage: encode_image_gpu MMPROJ WIDTHxHEIGHT [RUNS] [--cpu] | --synth-q35 OUT.gguf"
        );
        std::process::exit(2);
    }
    let runs: usize = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(5);
    let m = VisionModel::open(Path::new(args[0])).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    let c = m.config().clone();
    let (wd, ht) = args[1]
        .split_once('x')
        .and_then(|(a, b)| Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?)))
        .expect("WIDTHxHEIGHT");
    // The sides the preprocessing would give: whole merged patches (3840x2160 -> 3840x2176).
    let unit = c.patch_size * c.merge;
    let (wd, ht) = (wd.div_ceil(unit) * unit, ht.div_ceil(unit) * unit);
    let (gh, gw) = (ht / c.patch_size, wd / c.patch_size);
    let mut rng = Rng(42);
    let img = PreparedImage {
        pixels: (0..gh * gw * c.patch_values()).map(|_| rng.f()).collect(),
        grid: [1, gh, gw],
        resized: (wd, ht),
        sha256: [0; 32],
    };
    let t = Instant::now();
    let g = GpuEncoder::open(0, &m, None).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut times = Vec::new();
    let mut out = None;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        out = Some(g.encode(&m, &img).unwrap_or_else(|e| {
            eprintln!("image {wd}x{ht}: {e}");
            std::process::exit(1)
        }));
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let best = times.iter().cloned().fold(f64::MAX, f64::min);
    let e = out.expect("one run");
    println!(
        "image {wd}x{ht}: {} patches, {} rows of {}; GPU open {open_ms:.0} ms ({:.2} GiB weights, {:.2} GiB scratch); encode first {:.1} ms, best {best:.1} ms of {}",
        gh * gw,
        e.rows,
        e.width,
        g.weight_bytes() as f64 / (1u64 << 30) as f64,
        g.scratch_bytes() as f64 / (1u64 << 30) as f64,
        times[0],
        times.len()
    );
    if cpu {
        let t = Instant::now();
        let ce = m.encode(&img).expect("encode on the CPU");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let scale = ce.data.iter().fold(0f32, |a, v| a.max(v.abs()));
        let diff = ce
            .data
            .iter()
            .zip(&e.data)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        println!(
            "CPU encode {ms:.0} ms ({} threads); max |GPU - CPU| {diff:.3e} of the largest value {scale:.3}",
            rayon::current_num_threads()
        );
    }
}
