//! Clients that misbehave: one that stops reading its stream cannot make the server
//! hold its output without bound or hold up another stream, and one that sends its
//! request body byte by byte is answered 408 at the read deadline while other
//! requests are served.

use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::test_http::request;
use crate::test_server::{serve_state, user, Setup};

/// The unread bytes a stream may leave in these tests.
const BACKLOG: usize = 16 << 10;

/// `state`'s app behind the listener `scoria serve` uses, with a head deadline of
/// `limit`; its address.
async fn serve_timed(
    state: std::sync::Arc<crate::AppState>,
    limit: Duration,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(crate::timeouts::serve(
        listener,
        crate::app(state),
        limit,
        std::future::pending(),
    ));
    addr
}

fn post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_is_stopped_at_its_backlog_and_others_go_on() {
    let words = 20_000;
    let mut setup = Setup::new(&"word ".repeat(words));
    setup.n_ctx = 100_000;
    let mut state = setup.state();
    state.core.as_mut().expect("core").backlog = BACKLOG;
    let addr = serve_state(state).await;

    // Asks for every word, then reads nothing.
    let mut slow = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = json!({"prompt": "go", "max_tokens": words + 10, "stream": true});
    slow.write_all(post("/v1/completions", &body.to_string()).as_bytes())
        .await
        .expect("write");

    // Another stream, read as it comes: complete, with its own text.
    let body = json!({"prompt": "go", "max_tokens": 5, "stream": true});
    let other = request(addr, "POST", "/v1/completions", "", Some(&body.to_string())).await;
    assert_eq!(other.status, 200);
    let frames = other.frames();
    let text: String = frames
        .iter()
        .filter(|(_, d)| d.starts_with('{'))
        .filter_map(|(_, d)| {
            let v: serde_json::Value = serde_json::from_str(d).ok()?;
            Some(v["choices"][0]["text"].as_str()?.to_string())
        })
        .collect();
    assert_eq!(text, "word word word word word", "{}", other.body);
    assert_eq!(frames.last().map(|f| f.1.as_str()), Some("[DONE]"));

    // The reader comes back: what was held, then the error that ended it early.
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), slow.read_to_end(&mut raw))
        .await
        .expect("the stream ends")
        .expect("read");
    let got = String::from_utf8_lossy(&raw);
    assert!(
        got.contains("the client did not read its stream")
            && got.contains(&format!("the limit is {BACKLOG}")),
        "{}",
        &got[got.len().saturating_sub(2000)..]
    );
    let received = got.matches("word").count();
    assert!(
        received > 0 && received < words / 2,
        "{received} of {words} words: the request was not stopped at its backlog"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sent_byte_by_byte_is_answered_408_at_the_deadline() {
    let limit = Duration::from_millis(500);
    let state = Setup::new("hello there").state().with_read_timeout(limit);
    let addr = serve_state(state).await;
    let body = json!({"model": "test-model", "messages": user("hi")}).to_string();

    let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut r, mut w) = s.into_split();
    let head = post("/v1/chat/completions", &body);
    let head = &head[..head.len() - body.len()];
    w.write_all(head.as_bytes()).await.expect("head");
    let t0 = Instant::now();
    let dribble = body.clone();
    let dribbler = tokio::spawn(async move {
        for b in dribble.bytes() {
            if w.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    // Meanwhile a client that sends its body at once is served.
    let ok = request(addr, "POST", "/v1/chat/completions", "", Some(&body)).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert!(ok.body.contains("hello there"), "{}", ok.body);

    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut raw))
        .await
        .expect("the server closes the connection")
        .expect("read");
    let waited = t0.elapsed();
    let got = String::from_utf8_lossy(&raw);
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("--read-timeout"), "{got}");
    assert!(
        got.to_ascii_lowercase().contains("connection: close"),
        "{got}"
    );
    // Answered at the deadline, long before the body would have been complete.
    let whole = Duration::from_millis(100) * body.len() as u32;
    assert!(
        waited >= limit && waited < whole / 2,
        "{waited:?} of {whole:?}"
    );
    dribbler.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_sent_byte_by_byte_have_their_connection_closed_at_the_deadline() {
    let limit = Duration::from_millis(500);
    let state = std::sync::Arc::new(Setup::new("hello there").state());
    let addr = serve_timed(state, limit).await;
    let body = json!({"model": "test-model", "messages": user("hi")}).to_string();

    let s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let t0 = Instant::now();
    let (mut r, mut w) = s.into_split();
    let head = post("/v1/chat/completions", &body);
    let dribbler = tokio::spawn(async move {
        for b in head.bytes() {
            if w.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });

    // Meanwhile a client that sends its request at once is served (the connection
    // limit applies per connection).
    let ok = request(addr, "POST", "/v1/chat/completions", "", Some(&body)).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert!(ok.body.contains("hello there"), "{}", ok.body);

    let mut raw = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut raw))
        .await
        .expect("the server closes the connection");
    let waited = t0.elapsed();
    // Closed (a reset counts too) without an answer to a request never completed.
    assert!(
        read.is_err() || raw.is_empty(),
        "{}",
        String::from_utf8_lossy(&raw)
    );
    assert!(
        waited >= limit && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    dribbler.abort();
}

/// A kept-alive connection: the next request sent at once is served; the next head sent
/// byte by byte, or none at all, has the connection closed at the deadline, timed from
/// when the connection went idle after its answer (the server's clock starts when it
/// wrote the answer, a little before the client has read it: hence the slack below the
/// limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_alive_connections_are_timed_for_every_head() {
    let limit = Duration::from_millis(600);
    let state = std::sync::Arc::new(Setup::new("hello there").state());
    let addr = serve_timed(state, limit).await;
    let body = json!({"model": "test-model", "messages": user("hi")}).to_string();
    let keep = |path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    // Reads one response (headers and a Content-Length body) from `r`.
    async fn response(r: &mut tokio::net::tcp::OwnedReadHalf) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = tokio::time::timeout(Duration::from_secs(10), r.read(&mut buf))
                .await
                .expect("a response in time")
                .expect("read");
            assert!(
                n > 0,
                "closed before a whole response: {}",
                String::from_utf8_lossy(&got)
            );
            got.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&got).to_string();
            if let Some(end) = text.find("\r\n\r\n") {
                let len: usize = text[..end]
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length: ")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .expect("content-length");
                if got.len() >= end + 4 + len {
                    return text;
                }
            }
        }
    }
    async fn closed(r: &mut tokio::net::tcp::OwnedReadHalf) -> bool {
        let mut rest = Vec::new();
        match tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut rest)).await {
            Ok(Ok(_)) => rest.is_empty(),
            Ok(Err(_)) => true,
            Err(_) => false,
        }
    }

    // Two requests in a row on one connection, the second well within the deadline.
    let (mut r, mut w) = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap()
        .into_split();
    for _ in 0..2 {
        w.write_all(keep("/v1/chat/completions").as_bytes())
            .await
            .unwrap();
        let got = response(&mut r).await;
        assert!(
            got.starts_with("HTTP/1.1 200") && got.contains("hello there"),
            "{got}"
        );
        tokio::time::sleep(limit / 3).await;
    }

    // After an answer, the next head byte by byte: closed at the deadline.
    w.write_all(keep("/v1/chat/completions").as_bytes())
        .await
        .unwrap();
    assert!(response(&mut r).await.starts_with("HTTP/1.1 200"));
    let idle = Instant::now();
    let head = keep("/v1/chat/completions");
    let dribbler = tokio::spawn(async move {
        for b in head.bytes() {
            if w.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    assert!(closed(&mut r).await, "a dribbled second head was answered");
    let waited = idle.elapsed();
    assert!(
        waited >= limit * 3 / 4 && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    dribbler.abort();

    // An idle kept-alive connection: closed at the deadline too.
    let (mut r, mut w) = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap()
        .into_split();
    w.write_all(keep("/v1/chat/completions").as_bytes())
        .await
        .unwrap();
    assert!(response(&mut r).await.starts_with("HTTP/1.1 200"));
    let idle = Instant::now();
    assert!(closed(&mut r).await, "an idle connection stayed open");
    let waited = idle.elapsed();
    assert!(
        waited >= limit * 3 / 4 && waited < Duration::from_secs(3),
        "{waited:?}"
    );
}
