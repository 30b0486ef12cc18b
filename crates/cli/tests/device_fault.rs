//! `scoria serve` when its executor fails for good (a GPU's sticky context error;
//! injected on the CPU executor with `SCORIA_TEST_DEVICE_FAULT`): the request that
//! met it gets an error naming it, the server says why it stops, and the process
//! exits with a non-zero status within seconds — for a supervisor to restart it,
//! never a hang. (`/health` turning `unhealthy` meanwhile:
//! crates/server/tests/faults_device.rs.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

#[test]
fn a_lost_device_stops_the_server_with_a_non_zero_status() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::tiny_model(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_scoria"))
        .args([
            "serve",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--parallel",
            "1",
            "--port",
        ])
        .arg(port.to_string())
        .arg("--model")
        .arg(&path)
        .env("SCORIA_TEST_DEVICE_FAULT", "2")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn scoria serve");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    let t0 = Instant::now();
    while !seen.iter().any(|l: &String| l.contains("ready on")) {
        match lines.recv_timeout(Duration::from_secs(120).saturating_sub(t0.elapsed())) {
            Ok(l) => seen.push(l),
            Err(_) => panic!("not ready; stderr:\n{}", seen.join("\n")),
        }
    }

    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let body = r#"{"prompt": "the device test", "max_tokens": 8, "temperature": 0}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let mut got = String::new();
    s.read_to_string(&mut got).expect("read");
    assert!(!got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("the device stopped answering"), "{got}");

    // The process stops by itself, non-zero.
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("the server did not exit after the device failed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    seen.extend(lines.try_iter());
    let err = seen.join("\n");
    assert!(!status.success(), "exit status {status}; stderr:\n{err}");
    assert!(
        err.contains("can run nothing more") && err.contains("restart"),
        "{err}"
    );
}
