//! `model::synth`: tiny models of every arch and preset re-read with the GGUF reader,
//! checked tensor by tensor against the arch's GGUF inventory; determinism across thread
//! counts; value statistics of the generated blocks; the inspect accounting.

use std::path::{Path, PathBuf};

use gguf::{GgmlType, GgufFile, Value};
use model::geometry::{Arch, Geometry, ARCHS};
use model::synth::{self, accounting, Mix, Preset, SynthOptions};

fn scratch(name: &str) -> PathBuf {
    // One directory per file, so tests running in parallel never remove each other's.
    let dir = std::env::temp_dir().join(format!("scoria-synth-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Removes a scratch file and its directory.
fn discard(path: &Path) {
    std::fs::remove_file(path).unwrap();
    if let Some(dir) = path.parent() {
        std::fs::remove_dir(dir).unwrap();
    }
}

fn opts(preset: Preset, seed: u64) -> SynthOptions {
    SynthOptions {
        preset,
        seed,
        sync: false,
    }
}

fn tiny(arch: Arch) -> Geometry {
    Geometry::by_name(Some(arch), "tiny").unwrap()
}

/// The tensors a GGUF of `g` must hold, with ggml shapes, written out from the
/// reference tables (not from the plan under test).
fn expected_tensors(g: &Geometry) -> Vec<(String, Vec<u64>)> {
    let e = u64::from(g.n_embd);
    let v = u64::from(g.n_vocab);
    let mut t: Vec<(String, Vec<u64>)> = vec![
        ("token_embd.weight".into(), vec![e, v]),
        ("output_norm.weight".into(), vec![e]),
        ("output.weight".into(), vec![e, v]),
    ];
    let (hd, nh, nkv) = (
        u64::from(g.head_dim),
        u64::from(g.n_head),
        u64::from(g.n_head_kv),
    );
    let (ne, ff, sff) = (
        u64::from(g.n_expert),
        u64::from(g.expert_ff),
        u64::from(g.shared_ff),
    );
    for il in 0..g.block_count() {
        let mut add = |s: &str, d: Vec<u64>| t.push((format!("blk.{il}.{s}"), d));
        add("attn_norm.weight", vec![e]);
        match g.arch {
            Arch::Qwen3Moe => add("ffn_norm.weight", vec![e]),
            _ => add("post_attention_norm.weight", vec![e]),
        }
        let recurrent =
            g.arch.is_hybrid() && il < g.n_layer && (il + 1) % g.full_attention_interval != 0;
        if recurrent {
            let l = g.linear.unwrap();
            let (hk, hv, dk, dv) = (
                u64::from(l.n_k_heads),
                u64::from(l.n_v_heads),
                u64::from(l.head_dim),
                u64::from(l.head_dim),
            );
            let conv = 2 * hk * dk + hv * dv;
            add("attn_qkv.weight", vec![e, conv]);
            add("attn_gate.weight", vec![e, hv * dv]);
            if g.arch == Arch::Qwen3Next {
                add("ssm_ba.weight", vec![e, 2 * hv]);
            } else {
                add("ssm_alpha.weight", vec![e, hv]);
                add("ssm_beta.weight", vec![e, hv]);
            }
            add("ssm_conv1d.weight", vec![4, conv]);
            add("ssm_a", vec![hv]);
            add("ssm_dt.bias", vec![hv]);
            add("ssm_norm.weight", vec![dv]);
            add("ssm_out.weight", vec![hv * dv, e]);
        } else {
            let gate = if g.arch.is_hybrid() { 2 } else { 1 };
            add("attn_q.weight", vec![e, nh * hd * gate]);
            add("attn_k.weight", vec![e, nkv * hd]);
            add("attn_v.weight", vec![e, nkv * hd]);
            add("attn_output.weight", vec![nh * hd, e]);
            add("attn_q_norm.weight", vec![hd]);
            add("attn_k_norm.weight", vec![hd]);
        }
        add("ffn_gate_inp.weight", vec![e, ne]);
        add("ffn_gate_exps.weight", vec![e, ff, ne]);
        add("ffn_up_exps.weight", vec![e, ff, ne]);
        add("ffn_down_exps.weight", vec![ff, e, ne]);
        if sff > 0 {
            add("ffn_gate_inp_shexp.weight", vec![e]);
            add("ffn_gate_shexp.weight", vec![e, sff]);
            add("ffn_up_shexp.weight", vec![e, sff]);
            add("ffn_down_shexp.weight", vec![sff, e]);
        }
        if il >= g.n_layer {
            add("nextn.eh_proj.weight", vec![2 * e, e]);
            add("nextn.enorm.weight", vec![e]);
            add("nextn.hnorm.weight", vec![e]);
            add("nextn.shared_head_norm.weight", vec![e]);
        }
    }
    t
}

fn more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The type llama.cpp's converter + llama-quantize give `name` under `preset`.
fn expected_type(name: &str, dims: &[u64], preset: Preset, n_blocks: i64) -> GgmlType {
    let keep_f32 = dims.len() == 1
        || name.ends_with("_norm.weight")
        || name.contains("ffn_gate_inp")
        || name.contains("ssm_conv1d")
        || !name.ends_with(".weight");
    if keep_f32 {
        return GgmlType::F32;
    }
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse::<i64>().ok());
    match preset {
        Preset::F32 => GgmlType::F32,
        Preset::F16 => GgmlType::F16,
        Preset::Bf16 => GgmlType::BF16,
        Preset::Q8_0 => GgmlType::Q8_0,
        Preset::Q4KM => {
            if name == "output.weight" {
                GgmlType::Q6_K
            } else if name.contains("ffn_down")
                || name.contains("attn_v.weight")
                || name.contains("attn_qkv.weight")
            {
                // one attn_v or attn_qkv per block, so i_attention_wv == block index
                match layer {
                    Some(il) if more_bits(il, n_blocks) => GgmlType::Q6_K,
                    _ => GgmlType::Q4_K,
                }
            } else {
                GgmlType::Q4_K
            }
        }
        Preset::Uniform(t) if dims[0].is_multiple_of(t.block_size() as u64) => t,
        Preset::Uniform(_) => GgmlType::Q8_0,
        Preset::Mix(m) => {
            let routed = name.contains("_exps.");
            let down = name.contains("ffn_down_exps");
            match m {
                Mix::Nvfp4Scaled if name == "token_embd.weight" || name == "output.weight" => {
                    GgmlType::BF16
                }
                Mix::Nvfp4Scaled if dims[0].is_multiple_of(64) => GgmlType::NVFP4,
                Mix::Mxfp4Moe if routed => GgmlType::MXFP4,
                Mix::Mxfp4Moe => GgmlType::Q8_0,
                _ if name == "token_embd.weight" => GgmlType::Q4_K,
                _ if name == "output.weight" => GgmlType::Q6_K,
                Mix::UdQ2KXL if routed => [GgmlType::Q2_K, GgmlType::Q3_K][down as usize],
                Mix::UdQ3KXL if routed => [GgmlType::Q3_K, GgmlType::Q4_K][down as usize],
                Mix::UdIq2Xxs if routed => [GgmlType::IQ2_XXS, GgmlType::IQ3_S][down as usize],
                _ => GgmlType::Q8_0,
            }
        }
    }
}

fn u(f: &GgufFile, key: &str) -> u64 {
    f.get(key)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("missing {key}"))
}

fn check_file(path: &Path, g: &Geometry, preset: Preset, seed: u64) {
    let f = GgufFile::open(path).unwrap();
    let a = g.arch.name();
    assert_eq!(f.architecture(), Some(a));
    let k = |s: &str| format!("{a}.{s}");
    assert_eq!(u(&f, &k("block_count")), u64::from(g.n_layer + g.n_nextn));
    assert_eq!(u(&f, &k("embedding_length")), u64::from(g.n_embd));
    assert_eq!(u(&f, &k("attention.head_count")), u64::from(g.n_head));
    assert_eq!(u(&f, &k("attention.head_count_kv")), u64::from(g.n_head_kv));
    assert_eq!(u(&f, &k("attention.key_length")), u64::from(g.head_dim));
    assert_eq!(u(&f, &k("attention.value_length")), u64::from(g.head_dim));
    assert_eq!(u(&f, &k("expert_count")), u64::from(g.n_expert));
    assert_eq!(u(&f, &k("expert_used_count")), u64::from(g.n_expert_used));
    assert_eq!(
        u(&f, &k("expert_feed_forward_length")),
        u64::from(g.expert_ff)
    );
    assert_eq!(u(&f, &k("context_length")), u64::from(g.context_length));
    assert!(f
        .get(&k("rope.freq_base"))
        .and_then(Value::as_f64)
        .is_some());
    assert!(f
        .get(&k("attention.layer_norm_rms_epsilon"))
        .and_then(Value::as_f64)
        .is_some());
    if g.arch.is_hybrid() {
        let l = g.linear.unwrap();
        assert_eq!(u(&f, &k("rope.dimension_count")), u64::from(g.n_rot));
        assert_eq!(u(&f, &k("ssm.conv_kernel")), 4);
        assert_eq!(u(&f, &k("ssm.state_size")), u64::from(l.head_dim));
        assert_eq!(u(&f, &k("ssm.group_count")), u64::from(l.n_k_heads));
        assert_eq!(u(&f, &k("ssm.time_step_rank")), u64::from(l.n_v_heads));
        assert_eq!(
            u(&f, &k("ssm.inner_size")),
            u64::from(l.n_v_heads * l.head_dim)
        );
        assert_eq!(u(&f, &k("full_attention_interval")), 4);
        assert_eq!(
            u(&f, &k("expert_shared_feed_forward_length")),
            u64::from(g.shared_ff)
        );
    }
    if g.arch == Arch::Qwen35Moe {
        assert_eq!(u(&f, &k("nextn_predict_layers")), 1);
        let s: Vec<i64> = f
            .get(&k("rope.dimension_sections"))
            .and_then(Value::as_array)
            .unwrap()
            .iter()
            .filter_map(Value::as_i64)
            .collect();
        assert_eq!(s, vec![11, 11, 10, 0]);
    } else {
        assert!(f.get(&k("nextn_predict_layers")).is_none());
    }
    assert_eq!(u(&f, "general.file_type"), u64::from(preset.file_type()));
    assert_eq!(u(&f, "general.quantization_version"), 2);
    assert_eq!(
        f.get("general.name").and_then(Value::as_str),
        Some(format!("scoria synthetic {}", g.name).as_str())
    );
    assert_eq!(
        f.get("scoria.synthetic").and_then(Value::as_bool),
        Some(true)
    );
    assert_eq!(u(&f, "scoria.synthetic.seed"), seed);
    // tokenizer
    assert_eq!(
        f.get("tokenizer.ggml.model").and_then(Value::as_str),
        Some("gpt2")
    );
    let pre = if g.arch == Arch::Qwen35Moe {
        "qwen35"
    } else {
        "qwen2"
    };
    assert_eq!(
        f.get("tokenizer.ggml.pre").and_then(Value::as_str),
        Some(pre)
    );
    let n_tokens = f
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .unwrap()
        .len();
    assert_eq!(n_tokens as u32, g.n_vocab);
    let n_types = f
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .unwrap()
        .len();
    assert_eq!(n_types, n_tokens);
    assert!(
        f.get("tokenizer.ggml.merges")
            .and_then(Value::as_array)
            .unwrap()
            .len()
            > 100_000
    );
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id",
    ] {
        assert!(u(&f, key) < n_tokens as u64, "{key}");
    }
    assert_eq!(
        f.get("tokenizer.ggml.add_bos_token")
            .and_then(Value::as_bool),
        Some(false)
    );
    assert!(f
        .get("tokenizer.chat_template")
        .and_then(Value::as_str)
        .is_some_and(|t| t.contains("im_start")));

    // tensors: exactly the expected set, shapes and types (with an NVFP4 matrix's
    // second-level scale beside it in the converted-checkpoint mix)
    let n_blocks = i64::from(g.block_count());
    let mut want = expected_tensors(g);
    if preset == Preset::Mix(Mix::Nvfp4Scaled) {
        let scales: Vec<(String, Vec<u64>)> = want
            .iter()
            .filter(|(n, d)| expected_type(n, d, preset, n_blocks) == GgmlType::NVFP4)
            .map(|(n, d)| {
                let stem = n.strip_suffix(".weight").unwrap();
                (
                    format!("{stem}.scale"),
                    vec![d.get(2).copied().unwrap_or(1)],
                )
            })
            .collect();
        assert!(scales.len() > 10, "{} scales", scales.len());
        want.extend(scales);
    }
    assert_eq!(f.tensors().len(), want.len(), "tensor count");
    want.sort();
    let mut got: Vec<(String, Vec<u64>)> = f
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone()))
        .collect();
    got.sort();
    assert_eq!(got, want);
    for t in f.tensors() {
        assert_eq!(
            t.ty,
            expected_type(&t.name, &t.dims, preset, n_blocks),
            "type of {} under {preset}",
            t.name
        );
    }
    // llama-quantize order: non-block tensors first, then by block, by name within
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        &names[..3],
        &["output.weight", "output_norm.weight", "token_embd.weight"]
    );
    // accounting sums to the file size exactly, with no stray bytes
    let acc = accounting::account(&f).unwrap();
    let size = std::fs::metadata(path).unwrap().len();
    assert_eq!(acc.file_size, size);
    assert_eq!(acc.total(), size);
    assert_eq!(acc.shards[0].unreferenced, 0);
    assert_eq!(acc.dense.bytes + acc.routed_expert.bytes, acc.tensor_data());
    let group_sum: u64 = acc.groups.values().map(|t| t.bytes).sum();
    assert_eq!(group_sum, acc.tensor_data());
}

#[test]
fn tiny_models_of_every_arch_and_preset() {
    for arch in ARCHS {
        let g = tiny(arch);
        for preset in Preset::ALL {
            // Each one-type preset once (its tensors' types and bytes are what it adds),
            // on the arch with every tensor kind.
            if matches!(preset, Preset::Uniform(_)) && arch != Arch::Qwen35Moe {
                continue;
            }
            let path = scratch(&format!("{}-{preset}.gguf", g.name));
            let report = synth::synthesize(&path, &g, &opts(preset, 7), &|_, _| {}).unwrap();
            assert_eq!(
                report.file_size,
                std::fs::metadata(&path).unwrap().len(),
                "{} {preset}",
                g.name
            );
            assert_eq!(
                report.file_size,
                synth::file_size(&g, &opts(preset, 7)).unwrap()
            );
            check_file(&path, &g, preset, 7);
            discard(&path);
        }
    }
}

fn file_digest(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap()
}

#[test]
fn same_seed_same_bytes_whatever_the_thread_count() {
    let g = tiny(Arch::Qwen35Moe);
    let run = |threads: usize, seed: u64, name: &str| {
        let path = scratch(name);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| synth::synthesize(&path, &g, &opts(Preset::Q4KM, seed), &|_, _| {}))
            .unwrap();
        let bytes = file_digest(&path);
        discard(&path);
        bytes
    };
    let one = run(1, 42, "det-1.gguf");
    let four = run(4, 42, "det-4.gguf");
    assert!(one == four, "1 and 4 threads gave different bytes");
    let other = run(4, 43, "det-other.gguf");
    assert_eq!(one.len(), other.len());
    assert!(one != other, "a different seed gave the same bytes");
}

fn stats(x: &[f32]) -> (f64, f64) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = x
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, var.sqrt())
}

fn decode(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => quant::dequantize_row(ty, bytes, out),
    }
}

#[test]
fn generated_values_have_the_target_statistics() {
    let g = tiny(Arch::Qwen35Moe);
    for preset in [Preset::Q4KM, Preset::Q8_0, Preset::Bf16, Preset::F16] {
        let path = scratch(&format!("stats-{preset}.gguf"));
        synth::synthesize(&path, &g, &opts(preset, 3), &|_, _| {}).unwrap();
        let f = GgufFile::open(&path).unwrap();
        for t in f.tensors() {
            let n = t.n_elements() as usize;
            let mut x = vec![0f32; n];
            decode(t.ty, f.tensor_data(t), &mut x);
            assert!(x.iter().all(|v| v.is_finite()), "{} not finite", t.name);
            let (mean, std) = stats(&x);
            let name = t.name.as_str();
            if name.ends_with("norm.weight") {
                assert!((mean - 1.0).abs() < 0.02, "{name} mean {mean}");
            } else if name.ends_with("ssm_a") {
                assert!(x.iter().all(|&v| (-1.001..0.0).contains(&v)), "{name}");
            } else if name.ends_with("ssm_dt.bias") {
                assert!(x.iter().all(|&v| v.abs() <= 0.5), "{name}");
            } else if name.contains("ssm_conv1d") {
                assert!((std - 0.3).abs() < 0.05, "{name} std {std}");
            } else {
                let fan_in = if name == "token_embd.weight" {
                    1.0
                } else {
                    t.dims[0] as f64
                };
                let target = 1.0 / fan_in.sqrt();
                assert!(
                    (std / target - 1.0).abs() < 0.12,
                    "{name} ({}) std {std} target {target}",
                    t.ty
                );
                // within 4 standard errors of 0 (plus 2% of the std for block-mean bias)
                let tol = 4.0 * target / (n as f64).sqrt() + 0.02 * target;
                assert!(mean.abs() < tol, "{name} mean {mean} tol {tol}");
            }
        }
        drop(f);
        discard(&path);
    }
}

#[test]
fn real_geometry_layouts() {
    // Sizes of the benchmark models at Q4_K_M (docs/benchmarks.md: N80 ~46 GB, Q35 ~21 GB, M30 ~18 GB).
    let gb = |name: &str| {
        let g = Geometry::by_name(None, name).unwrap();
        synth::file_size(&g, &opts(Preset::Q4KM, 1)).unwrap() as f64 / 1e9
    };
    let n80 = gb("qwen3-next-80b-a3b");
    let q35 = gb("qwen3.6-35b-a3b");
    let m30 = gb("qwen3-30b-a3b");
    assert!((43.0..50.0).contains(&n80), "N80 {n80} GB");
    assert!((19.0..23.5).contains(&q35), "Q35 {q35} GB");
    assert!((16.0..20.0).contains(&m30), "M30 {m30} GB");
}
