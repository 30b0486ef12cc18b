//! The synthetic demo model (random weights, for tests): synthesized once into the cache
//! directory, then reused.

use gguf::{GgufFile, Value};
use model::synth;

#[test]
fn demo_model_is_made_once_and_reused() {
    let dir = std::env::temp_dir().join(format!("scoria-demo-test-{}", std::process::id()));
    // The only test in this binary, so no other thread reads the environment.
    std::env::set_var("SCORIA_CACHE_DIR", &dir);
    let path = synth::synthetic_demo_path().unwrap();
    assert!(path.starts_with(&dir));
    let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
    let again = synth::synthetic_demo_path().unwrap();
    assert_eq!(path, again);
    assert_eq!(
        std::fs::metadata(&again).unwrap().modified().unwrap(),
        modified,
        "the cached demo model was rewritten"
    );
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.architecture(), Some("qwen35moe"));
    assert_eq!(
        f.get("general.file_type").and_then(Value::as_u64),
        Some(u64::from(synth::Preset::Q8_0.file_type()))
    );
    assert_eq!(
        f.get("scoria.synthetic.geometry").and_then(Value::as_str),
        Some("tiny-qwen35moe")
    );
    drop(f);
    // A truncated cache entry is remade, not used.
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let remade = synth::synthetic_demo_path().unwrap();
    assert_eq!(std::fs::metadata(&remade).unwrap().len(), len);
    std::fs::remove_dir_all(&dir).unwrap();
}
