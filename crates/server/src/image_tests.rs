//! Images through every API, over HTTP with a scripted generator that records the
//! request it gets (`test_server`): the prompt with each `<|image_pad|>` expanded to
//! its image's rows, the images in order with where their rows start, in user messages
//! and in tool results; and the 400s (an image URL, bad base64, an image that does not
//! decode or is too large, no encoder), each naming the field, after which the server
//! keeps serving.

use std::sync::{Arc, Mutex};

use base64::Engine as _;
use model::vision::{PreparedImage, VisionConfig};
use serde_json::{json, Value};

use crate::api_tests::{post, qwen35, tokenizer};
use crate::images::{prepare, ImageLimits, IMAGE_PAD};
use crate::test_http::{request, Reply};
use crate::test_server::{Seen, Setup};

async fn get(addr: std::net::SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path, "", None).await
}

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/qwen35moe-vision/"
);

fn png(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}{name}")).expect("fixture image")
}

fn data_url(name: &str) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(png(name));
    format!("data:image/png;base64,{b64}")
}

fn b64(name: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(png(name))
}

/// The Qwen3.5 encoder's geometry: 16-pixel patches, 2×2 merge.
fn vision() -> VisionConfig {
    VisionConfig {
        hidden: 32,
        n_layer: 2,
        n_head: 2,
        ffn: 64,
        patch_size: 16,
        temporal_patch: 2,
        merge: 2,
        pos_side: 16,
        out_hidden: 64,
        eps: 1e-6,
        image_mean: [0.5; 3],
        image_std: [0.5; 3],
        rope_theta: 10000.0,
    }
}

/// What the server's preprocessing makes of a fixture image.
fn prepared(name: &str) -> PreparedImage {
    prepare(&png(name), &vision(), &ImageLimits::default()).expect("fixture prepares")
}

/// A server with the Qwen3.5 template whose fake engine has an encoder, and what it
/// records.
async fn server() -> (std::net::SocketAddr, Seen) {
    let seen: Seen = Arc::new(Mutex::new(Vec::new()));
    let mut setup = Setup::new("I see it.");
    setup.renderer = qwen35();
    setup.vision = Some(vision());
    setup.seen = Some(seen.clone());
    (setup.serve().await, seen)
}

/// Checks the last recorded request: the images' grids are `names`' in order, each
/// image's rows are placeholders between `<|vision_start|>` and `<|vision_end|>`
/// starting at its `at`, no other placeholder, and the decoded prompt contains each of
/// `texts` with `{N}` standing for image N's placeholders. Returns the prompt text.
fn check_last(seen: &Seen, names: &[&str], texts: &[&str]) -> String {
    let (prompt, images) = seen.lock().unwrap().last().cloned().expect("a request");
    let tok = tokenizer();
    let pad = tok.token_id(IMAGE_PAD).unwrap();
    let start = tok.token_id("<|vision_start|>").unwrap();
    let end = tok.token_id("<|vision_end|>").unwrap();
    assert_eq!(images.len(), names.len());
    let mut last_end = 0;
    let mut total = 0;
    for (img, name) in images.iter().zip(names) {
        let want = prepared(name);
        assert_eq!(img.image.grid, want.grid, "{name}");
        let rows = want.rows(2);
        assert!(img.at >= last_end, "images overlap or are out of order");
        assert_eq!(prompt[img.at - 1], start);
        assert!(prompt[img.at..img.at + rows].iter().all(|&t| t == pad));
        assert_eq!(prompt[img.at + rows], end);
        last_end = img.at + rows;
        total += rows;
    }
    assert_eq!(prompt.iter().filter(|&&t| t == pad).count(), total);
    let text = tok.decode(&prompt, false);
    for t in texts {
        let mut want = t.to_string();
        for (k, name) in names.iter().enumerate() {
            let run = format!(
                "<|vision_start|>{}<|vision_end|>",
                IMAGE_PAD.repeat(prepared(name).rows(2))
            );
            want = want.replace(&format!("{{{k}}}"), &run);
        }
        assert!(text.contains(&want), "{want:?} not in {text:?}");
    }
    text
}

fn weather_call() -> Value {
    json!({"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}})
}

#[tokio::test]
async fn chat_images_in_a_user_message_and_a_tool_result_take_their_rows_in_order() {
    let (addr, seen) = server().await;
    let body = json!({"messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": data_url("image.png")}},
            {"type": "text", "text": "with"},
            // A bare string is accepted too.
            {"type": "image_url", "image_url": data_url("odd.png")}]},
        {"role": "assistant", "content": "", "tool_calls": [weather_call()]},
        {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "text", "text": "shot:"},
            {"type": "image_url", "image_url": {"url": data_url("image.png")}}]}]});
    let r = post(addr, "/v1/chat/completions", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    check_last(
        &seen,
        &["image.png", "odd.png", "image.png"],
        &[
            "<|im_start|>user\nCompare{0}with{1}<|im_end|>",
            "<tool_response>\nshot:{2}\n</tool_response>",
        ],
    );
}

#[tokio::test]
async fn responses_input_image_in_a_message_and_a_function_call_output() {
    let (addr, seen) = server().await;
    let body = json!({"input": [
        {"role": "user", "content": [
            {"type": "input_image", "image_url": data_url("odd.png")},
            {"type": "input_text", "text": "What is this?"}]},
        {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": data_url("image.png")}]}]});
    let r = post(addr, "/v1/responses", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    check_last(
        &seen,
        &["odd.png", "image.png"],
        &[
            "<|im_start|>user\n{0}What is this?<|im_end|>",
            "<tool_response>\n{1}\n</tool_response>",
        ],
    );
}

#[tokio::test]
async fn anthropic_image_blocks_in_a_user_message_and_a_tool_result() {
    let (addr, seen) = server().await;
    let image = |name: &str| json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(name)}});
    let body = json!({"max_tokens": 20, "messages": [
        {"role": "user", "content": [image("image.png"), {"type": "text", "text": "Take a screenshot."}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "here"}, image("odd.png")]},
            {"type": "text", "text": "And now?"}]}]});
    let r = post(addr, "/v1/messages", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    check_last(
        &seen,
        &["image.png", "odd.png"],
        &[
            "<|im_start|>user\n{0}Take a screenshot.<|im_end|>",
            "<tool_response>\nhere{1}\n</tool_response>",
        ],
    );
    // count_tokens counts the image's rows.
    let r = post(addr, "/v1/messages/count_tokens", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let n = seen.lock().unwrap().last().unwrap().0.len();
    assert_eq!(r.json()["input_tokens"], n);
}

// Typed `<|image_pad|>` is text: it never becomes a placeholder an image could land on.
#[tokio::test]
async fn typed_image_pad_text_stays_text() {
    let (addr, seen) = server().await;
    let typed = format!("not an image: {IMAGE_PAD}<|vision_start|>");
    let body = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": typed},
        {"type": "image_url", "image_url": {"url": data_url("image.png")}}]}]});
    let r = post(addr, "/v1/chat/completions", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    check_last(&seen, &["image.png"], &[&format!("{typed}{{0}}")]);
    // Without an image, no placeholder at all.
    let body = json!({"messages": [{"role": "user", "content": typed}]});
    let r = post(addr, "/v1/chat/completions", &body, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let (prompt, images) = seen.lock().unwrap().last().cloned().unwrap();
    let pad = tokenizer().token_id(IMAGE_PAD).unwrap();
    assert!(images.is_empty());
    assert!(!prompt.contains(&pad));
}

/// Posts `body` and checks a 400 naming `field` with `says` in its message.
async fn refused(addr: std::net::SocketAddr, path: &str, body: &Value, field: &str, says: &str) {
    let r = post(addr, path, body, "").await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains(field), "{field} not in {}", r.body);
    assert!(r.body.contains(says), "{says:?} not in {}", r.body);
}

fn chat_image(url: Value) -> Value {
    json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": url}]}]})
}

#[tokio::test]
async fn bad_images_are_refused_naming_the_field_and_the_server_keeps_serving() {
    let seen: Seen = Arc::new(Mutex::new(Vec::new()));
    let mut setup = Setup::new("ok");
    setup.renderer = qwen35();
    setup.vision = Some(vision());
    setup.seen = Some(seen.clone());
    // Small enough that image.png (PNG, > 1 KiB) is too large, odd.png too.
    setup.image_limits = ImageLimits {
        max_bytes: 64,
        ..Default::default()
    };
    let addr = setup.serve().await;
    let f = "messages[2].content[1].image_url.url";
    let chat = "/v1/chat/completions";
    refused(
        addr,
        chat,
        &chat_image(json!({"url": "https://example.com/cat.png"})),
        f,
        "makes no outbound requests",
    )
    .await;
    refused(
        addr,
        chat,
        &chat_image(json!({"url": "data:image/png;base64,@@not base64@@"})),
        f,
        "not valid base64",
    )
    .await;
    let junk = base64::engine::general_purpose::STANDARD.encode(b"hello, not an image");
    refused(
        addr,
        chat,
        &chat_image(json!({"url": format!("data:image/png;base64,{junk}")})),
        f,
        f,
    )
    .await;
    // Too large: the preprocessing's own words.
    let r = post(
        addr,
        chat,
        &chat_image(json!({"url": data_url("image.png")})),
        "",
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    let e = prepare(
        &png("image.png"),
        &vision(),
        &ImageLimits {
            max_bytes: 64,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        r.body.contains(&format!("{f}: {e}"))
            || r.json()["error"]["message"] == format!("{f}: {e}"),
        "{}",
        r.body
    );
    // A bare-string URL names `image_url`.
    refused(
        addr,
        chat,
        &chat_image(json!("http://x/y.png")),
        "messages[2].content[1].image_url",
        "data: URL",
    )
    .await;
    // Anthropic: a URL source, Responses: a file id.
    let body = json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]});
    refused(
        addr,
        "/v1/messages",
        &body,
        "messages[0].content[0].source.url",
        "no outbound requests",
    )
    .await;
    let body = json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!"}}]}]});
    refused(
        addr,
        "/v1/messages",
        &body,
        "messages[0].content[0].source.data",
        "not valid base64",
    )
    .await;
    let body = json!({"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-123"}]}]});
    refused(
        addr,
        "/v1/responses",
        &body,
        "input[0].content[0].file_id",
        "stores no files",
    )
    .await;
    // An image in a system or assistant message.
    let body = json!({"messages": [
        {"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url("odd.png")}}]},
        {"role": "user", "content": "hi"}]});
    refused(
        addr,
        chat,
        &body,
        "messages[0].content[0]",
        "images go in user messages and tool results",
    )
    .await;
    // None of them reached the engine, and the server still answers.
    assert!(seen.lock().unwrap().is_empty());
    let r = post(
        addr,
        chat,
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
}

#[tokio::test]
async fn an_image_without_an_encoder_is_refused() {
    let mut setup = Setup::new("ok");
    setup.renderer = qwen35();
    let addr = setup.serve().await;
    let msg = "this model has no vision encoder: start the server with --mmproj FILE";
    refused(
        addr,
        "/v1/chat/completions",
        &chat_image(json!({"url": data_url("image.png")})),
        "messages[2].content[1].image_url.url",
        msg,
    )
    .await;
    let body = json!({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64("odd.png")}}]}]});
    refused(
        addr,
        "/v1/messages",
        &body,
        "messages[0].content[0].source.data",
        msg,
    )
    .await;
    // /props and /v1/models say so.
    let props = get(addr, "/props").await.json();
    assert_eq!(
        props["modalities"],
        json!({"vision": false, "audio": false})
    );
    let models = get(addr, "/v1/models").await.json();
    assert_eq!(models["data"][0]["capabilities"], json!(["completion"]));
}

#[tokio::test]
async fn props_and_models_say_the_model_takes_images() {
    let (addr, _) = server().await;
    let props = get(addr, "/props").await.json();
    assert_eq!(props["modalities"], json!({"vision": true, "audio": false}));
    assert_eq!(props["capabilities"]["images"], true);
    let models = get(addr, "/v1/models").await.json();
    let caps = models["data"][0]["capabilities"]
        .as_array()
        .unwrap()
        .clone();
    assert!(
        caps.contains(&json!("vision")) && caps.contains(&json!("multimodal")),
        "{models}"
    );
}
