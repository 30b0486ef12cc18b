//! What the server's integration tests share: a real engine behind the real app, and
//! one HTTP request on its own connection.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A tiny random-weight model of `arch` at `path`.
pub fn tiny_model(path: &std::path::Path, arch: model::Arch, seed: u64) {
    let g = model::geometry::Geometry::by_name(Some(arch), "tiny").expect("tiny");
    model::synth::synthesize(
        path,
        &g,
        &model::synth::SynthOptions {
            preset: model::synth::Preset::Q8_0,
            seed,
            sync: false,
        },
        &|_, _| {},
    )
    .expect("synthesize");
}

/// `engine` behind the real app on a free loopback port.
pub async fn serve(engine: engine::Engine) -> SocketAddr {
    let stats = Arc::new(server::metrics::Stats::new());
    let loaded = server::core_for(engine, Default::default(), stats.clone()).expect("core");
    let state = server::AppState::new(
        stats,
        loaded.info,
        loaded.tokenizer,
        loaded.template,
        json!({}),
        None,
        "faulty".into(),
    )
    .with_core(loaded.core);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, server::app(Arc::new(state))).await });
    addr
}

/// One request on its own connection: the status and the body.
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    (status, rest.to_string())
}
