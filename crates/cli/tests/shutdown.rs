//! `scoria serve` stopped with SIGTERM while a request streams: new connections are
//! refused, the stream finishes within `--shutdown-grace` (or, past it, ends with a
//! final error event), the prompt cache directory holds no partial file, and the
//! exit status is 0. (A killed server's cache files: the engine's
//! tests/faults_prompt_cache.rs.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

struct Server {
    child: Child,
    port: u16,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Server {
    fn start(model: &Path, cache: &Path, grace: u32) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_scoria"))
            .args(["serve", "--device", "cpu", "--threads", "1", "--port"])
            .arg(port.to_string())
            .arg("--model")
            .arg(model)
            .arg("--prompt-cache-dir")
            .arg(cache)
            .args(["--shutdown-grace", &grace.to_string(), "--parallel", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn scoria serve");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut s = Server {
            child,
            port,
            lines,
            seen: Vec::new(),
        };
        s.wait_for("ready on", Duration::from_secs(120));
        s
    }

    /// Waits for a stderr line containing `text`.
    fn wait_for(&mut self, text: &str, within: Duration) -> String {
        let t0 = Instant::now();
        loop {
            let left = within.saturating_sub(t0.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(text) {
                        return l;
                    }
                }
                Err(_) => panic!("no line with {text:?}; stderr:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// A whole completion of `prompt`.
    fn complete(&self, prompt: &str) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": 8, "temperature": 0}}"#);
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).expect("write");
        let mut got = String::new();
        s.read_to_string(&mut got).expect("read");
        assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    }

    /// Starts a streaming completion and reads until its first token's frame.
    fn stream(&self, max_tokens: usize) -> (TcpStream, Vec<u8>) {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let body = format!(
            r#"{{"prompt": "the server is stopped while this streams", "max_tokens": {max_tokens}, "temperature": 0, "stream": true}}"#
        );
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).expect("write");
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("\"text\"") {
            let n = s.read(&mut buf).expect("read");
            assert!(
                n > 0,
                "closed before the first token: {}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
        }
        (s, got)
    }

    fn terminate(&self) {
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill");
    }

    /// The exit status, waited for at most a minute.
    fn exit(&mut self) -> std::process::ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(l);
                }
                return st;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "scoria did not exit"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Reads the rest of a stream, until the server closes it.
fn rest(mut s: TcpStream, mut got: Vec<u8>) -> String {
    s.read_to_end(&mut got)
        .expect("the stream ends with a clean close");
    String::from_utf8_lossy(&got).into_owned()
}

/// The cache directory's entries; no partial one (`.<entry>.tmp-<pid>`) is left.
fn cache_entries(cache: &Path) -> usize {
    let Ok(dir) = std::fs::read_dir(cache) else {
        return 0;
    };
    let mut n = 0;
    for e in dir {
        let name = e.expect("entry").file_name().to_string_lossy().into_owned();
        assert!(
            !name.contains(".tmp-"),
            "a partial cache file was left: {name}"
        );
        n += 1;
    }
    n
}

#[test]
fn sigterm_lets_a_stream_finish_within_the_grace_period_and_exits_0() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::tiny_model(dir.path());
    let cache = dir.path().join("cache");
    let mut srv = Server::start(&path, &cache, 120);
    // A conversation the stream's request takes the only slot from: it goes to the
    // prompt cache, whose writer saves it while the stream runs.
    srv.complete("a conversation before the stream");
    let (s, got) = srv.stream(400);
    srv.terminate();
    let line = srv.wait_for("new connections are refused", Duration::from_secs(10));
    assert!(line.contains("1 request(s) still running"), "{line}");
    // The listener closes (at once, on the server's runtime): no new connections.
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", srv.port)).is_ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "connections are still accepted after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let body = rest(s, got);
    assert!(body.contains("data: [DONE]"), "{body}");
    assert!(!body.contains("\"error\""), "{body}");
    let st = srv.exit();
    assert_eq!(st.code(), Some(0), "{st:?}\n{}", srv.seen.join("\n"));
    assert!(
        srv.seen.iter().any(|l| l.contains("scoria serve: stopped")),
        "{}",
        srv.seen.join("\n")
    );
    // The writer finished before the exit: the conversation is there, whole.
    assert!(cache_entries(&cache) >= 1, "{}", srv.seen.join("\n"));
}

#[test]
fn sigterm_past_the_grace_period_ends_a_stream_with_a_final_error_event_and_exits_0() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::tiny_model(dir.path());
    let cache = dir.path().join("cache");
    let mut srv = Server::start(&path, &cache, 0);
    let (s, got) = srv.stream(100_000);
    srv.terminate();
    let body = rest(s, got);
    assert!(
        body.contains("the server is shutting down and ended this request"),
        "{body}"
    );
    let st = srv.exit();
    assert_eq!(st.code(), Some(0), "{st:?}\n{}", srv.seen.join("\n"));
    assert!(
        srv.seen
            .iter()
            .any(|l| l.contains("ending the 1 request(s) still running")),
        "{}",
        srv.seen.join("\n")
    );
    cache_entries(&cache);
}
