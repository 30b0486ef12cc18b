use super::report::summarize;
use super::*;
use clap::Parser;

#[derive(Parser, Debug)]
struct Wrap {
    #[command(flatten)]
    a: BenchArgs,
}

fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
    Wrap::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|w| w.a)
}

#[test]
fn defaults_are_llama_bench_like() {
    // Without -m the demo model is benchmarked.
    assert!(parse(&["-p", "512"]).unwrap().model.is_none());
    let a = parse(&["-m", "x.gguf"]).unwrap();
    assert_eq!(a.n_prompt, vec![512]);
    assert_eq!(a.n_gen, vec![128]);
    assert_eq!(a.n_depth, vec![0]);
    assert_eq!(a.repetitions, 3);
    assert_eq!(a.format, Format::Md);
    assert_eq!(a.engine.device, None);
    assert_eq!(a.engine.max_context, None);
    assert!(a.output.is_none());
}

#[test]
fn lists_formats_and_device_parse() {
    let a = parse(&[
        "-m", "x.gguf", "-p", "512,4096", "-n", "128", "-d", "0,4096", "-r", "5", "-o", "json",
        "--output", "out.json", "--device", "cuda:1", "-t", "16", "-c", "9000", "--seed", "7",
    ])
    .unwrap();
    assert_eq!(a.n_prompt, vec![512, 4096]);
    assert_eq!(a.n_depth, vec![0, 4096]);
    assert_eq!(a.repetitions, 5);
    assert_eq!(a.format, Format::Json);
    assert_eq!(a.output, Some(PathBuf::from("out.json")));
    assert_eq!(a.engine.device, Some(engine::Device::Cuda(1)));
    assert_eq!(a.engine.threads, Some(16));
    assert_eq!(a.engine.max_context, Some(9000));
    assert_eq!(a.seed, 7);
    assert_eq!(
        parse(&["-m", "x", "-o", "jsonl"]).unwrap().format,
        Format::Jsonl
    );
    assert_eq!(
        parse(&["-m", "x", "--device", "cpu"])
            .unwrap()
            .engine
            .device,
        Some(engine::Device::Cpu)
    );
}

#[test]
fn bad_arguments_are_refused() {
    for bad in [
        &["-m", "x", "-o", "csv"][..],
        &["-m", "x", "-r", "0"],
        &["-m", "x", "-p", "12,abc"],
        &["-m", "x", "--device", "tpu"],
    ] {
        assert!(parse(bad).is_err(), "{bad:?} was accepted");
    }
    let e = parse(&["-m", "x", "--device", "gpu7"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("cuda:N"), "{e}");
}

#[test]
fn labels_match_llama_bench() {
    let t = |p, n, d| TestSpec {
        n_prompt: p,
        n_gen: n,
        n_depth: d,
        n_streams: 1,
    };
    let x4 = TestSpec {
        n_streams: 4,
        ..t(0, 128, 0)
    };
    assert_eq!(x4.label(), "tg128 x4");
    assert_eq!(t(512, 0, 0).label(), "pp512");
    assert_eq!(t(0, 128, 0).label(), "tg128");
    assert_eq!(t(512, 0, 4096).label(), "pp512 @ d4096");
    assert_eq!(t(0, 128, 4096).label(), "tg128 @ d4096");
    assert_eq!(t(512, 128, 0).label(), "pp512+tg128");
}

#[test]
fn plan_order_skips_zeros_and_sizes_the_context() {
    let p = plan(&[512, 4096], &[128], &[0, 4096], 1);
    let labels: Vec<String> = p.iter().map(TestSpec::label).collect();
    assert_eq!(
        labels,
        [
            "pp512",
            "pp4096",
            "tg128",
            "pp512 @ d4096",
            "pp4096 @ d4096",
            "tg128 @ d4096"
        ]
    );
    assert_eq!(plan(&[0], &[64], &[0], 1).len(), 1);
    assert!(plan(&[0], &[0], &[0, 8], 1).is_empty());
    // A prompt must be shorter than the context; each decode step needs a position.
    assert_eq!(p[1].n_ctx_needed(), 4097);
    assert_eq!(p[4].n_ctx_needed(), 8193);
    assert_eq!(p[2].n_ctx_needed(), 1 + 128 + 1);
    assert_eq!(p[5].n_ctx_needed(), 4096 + 128 + 1);
    assert_eq!(p[5].prefix_len(), 4096);
    assert_eq!(p[2].prefix_len(), 1);
    assert_eq!(p[3].prefix_len(), 4096);
    assert_eq!(p[5].timed_tokens(), 128);
}

#[test]
fn random_ids_rotate_and_are_never_zero() {
    let a = random_ids(1, 0, 1, 4096, 1000);
    assert_eq!(a, random_ids(1, 0, 1, 4096, 1000), "seeded");
    assert_ne!(a, random_ids(1, 0, 2, 4096, 1000), "repetitions differ");
    assert_ne!(a, random_ids(1, 0, 0, 4096, 1000), "warm-up differs");
    assert_ne!(a, random_ids(1, 1, 1, 4096, 1000), "tests differ");
    assert_ne!(a, random_ids(2, 0, 1, 4096, 1000), "seeds differ");
    assert!(a.iter().all(|&t| (1..1000).contains(&t)));
    let distinct: std::collections::HashSet<u32> = a.iter().copied().collect();
    assert!(distinct.len() > 900, "{} distinct ids", distinct.len());
}

#[test]
fn statistics() {
    let s = summarize(&[10.0, 12.0, 14.0]);
    assert_eq!(s.mean, 12.0);
    assert_eq!(s.stddev, 2.0);
    assert_eq!(s.median, 12.0);
    let s = summarize(&[4.0, 1.0, 3.0, 100.0]);
    assert_eq!(s.median, 3.5);
    assert_eq!(s.mean, 27.0);
    // Sample standard deviation (n - 1), as llama-bench.
    let want =
        ((23.0f64.powi(2) + 26.0f64.powi(2) + 24.0f64.powi(2) + 73.0f64.powi(2)) / 3.0).sqrt();
    assert!((s.stddev - want).abs() < 1e-9);
    let one = summarize(&[5.0]);
    assert_eq!((one.mean, one.stddev, one.median), (5.0, 0.0, 5.0));
    assert_eq!(summarize(&[]).median, 0.0);
}

#[test]
fn samples_come_from_engine_milliseconds() {
    let s = Sample::from_ms(512, 250.0).unwrap();
    assert_eq!(s.ns, 250_000_000);
    assert_eq!(s.tps, 2048.0);
    assert!(Sample::from_ms(4, 0.0).is_err());
}

#[test]
fn dates_are_rfc3339_utc() {
    assert_eq!(report::rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(report::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(report::rfc3339(1_798_761_599), "2026-12-31T23:59:59Z");
    assert_eq!(report::utc_now().len(), 20);
}

fn sample_report(device: engine::Device) -> Report {
    let info = engine::ModelInfo {
        arch: "qwen35moe".into(),
        name: "Q35".into(),
        path: "/m/q35.gguf".into(),
        file_bytes: 21 << 30,
        n_ctx_train: 262_144,
        n_ctx: 4225,
        n_vocab: 248_320,
        n_layer: 40,
        n_embd: 2048,
        n_expert: 256,
        n_expert_used: 8,
        synthetic: true,
    };
    let report = engine::DeviceReport {
        device,
        name: "NVIDIA H200".into(),
        vram_used: Some(22 << 30),
        vram_total: Some(140 << 30),
    };
    let result = |spec: TestSpec, tps: &[f64]| TestResult {
        spec,
        samples: tps
            .iter()
            .map(|&t| Sample {
                ns: (spec.timed_tokens() as f64 / t * 1e9) as u64,
                tps: t,
            })
            .collect(),
        device: report.clone(),
        finished_at: "2026-11-30T00:00:00Z".into(),
        experts: None,
        ram_bytes_per_token: None,
    };
    Report {
        model: ModelDesc {
            filename: "/m/q35.gguf".into(),
            info,
            size: 20 << 30,
            n_params: 34_660_000_000,
            file_type: Some(15),
        },
        device: report.clone(),
        threads: 16,
        seed: 1,
        repetitions: 3,
        date: "2026-11-30T00:00:00Z".into(),
        command: "scoria bench -m /m/q35.gguf".into(),
        build_commit: "abc1234".into(),
        ram_read_bps: None,
        sampling: Default::default(),
        tests: vec![
            result(
                TestSpec {
                    n_prompt: 512,
                    n_gen: 0,
                    n_depth: 0,
                    n_streams: 1,
                },
                &[5000.0, 5100.0, 5300.0],
            ),
            result(
                TestSpec {
                    n_prompt: 0,
                    n_gen: 128,
                    n_depth: 4096,
                    n_streams: 1,
                },
                &[250.0, 252.0, 260.0],
            ),
        ],
    }
}

#[test]
fn markdown_has_llama_bench_columns() {
    let md = sample_report(engine::Device::Cuda(0)).markdown();
    let lines: Vec<&str> = md.lines().collect();
    assert_eq!(
        lines[0],
        "| model                          |       size |     params | backend    | threads |            test |                  t/s |   median t/s |"
    );
    assert_eq!(
        lines[1],
        "| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: | -----------: |"
    );
    assert_eq!(
        lines[2],
        "| qwen35moe Q35                  |  20.00 GiB |    34.66 B | CUDA       |      16 |           pp512 |     5133.33 ± 152.75 |      5100.00 |"
    );
    assert!(lines[3].contains("tg128 @ d4096"), "{}", lines[3]);
    assert!(lines[3].contains(" 252.00 |"), "{}", lines[3]);
    assert!(md.contains("\nbuild: abc1234 (scoria "));
    assert!(md.contains("device: NVIDIA H200 [cuda:0], VRAM 22.00 GiB used of 140.00 GiB"));
    assert!(md.contains("note: synthetic model"));
    let cpu = sample_report(engine::Device::Cpu).markdown();
    assert!(cpu.lines().nth(2).unwrap().contains("| CPU        |"));
}

#[test]
fn json_shape() {
    let r = sample_report(engine::Device::Cuda(0));
    let j = r.to_json();
    assert_eq!(j["tool"], "scoria bench");
    assert_eq!(j["build_commit"], "abc1234");
    assert_eq!(j["backends"], "CUDA");
    assert_eq!(j["device"]["device"], "cuda:0");
    assert_eq!(j["device"]["vram_used_bytes"], 22u64 << 30);
    assert_eq!(j["model"]["n_params"], 34_660_000_000u64);
    assert_eq!(j["model"]["synthetic"], true);
    assert_eq!(j["n_threads"], 16);
    let t = &j["tests"][1];
    assert_eq!(t["test"], "tg128 @ d4096");
    assert_eq!(
        (t["n_prompt"].as_u64(), t["n_gen"].as_u64()),
        (Some(0), Some(128))
    );
    assert_eq!(t["n_depth"], 4096);
    assert_eq!(t["samples_ts"].as_array().map(Vec::len), Some(3));
    assert_eq!(t["samples_ns"].as_array().map(Vec::len), Some(3));
    assert_eq!(t["median_ts"], 252.0);
    assert!(t["avg_ts"].as_f64().unwrap() > 252.0);
    assert!(t["stddev_ts"].as_f64().unwrap() > 0.0);
    assert_eq!(t["vram_used_bytes"], 22u64 << 30);
    let lines: Vec<Value> = r
        .to_jsonl()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["test"], "pp512");
    assert_eq!(lines[0]["median_ts"], 5100.0);
    assert_eq!(lines[1]["model"]["arch"], "qwen35moe");
    assert_eq!(lines[1]["backends"], "CUDA");
}

use serde_json::Value;
