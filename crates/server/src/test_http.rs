//! A minimal HTTP/1.1 client for the server's own tests: one request per
//! connection, the reply read to the end and de-chunked.

use serde_json::Value;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub(crate) struct Reply {
    pub status: u16,
    /// The response head, lower-cased.
    pub headers: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// SSE frames as (event name, data).
    pub fn frames(&self) -> Vec<(Option<String>, String)> {
        self.body
            .split("\n\n")
            .filter(|f| !f.trim().is_empty())
            .map(|f| {
                let mut ev = None;
                let mut data = String::new();
                for line in f.lines() {
                    if let Some(e) = line.strip_prefix("event: ") {
                        ev = Some(e.to_string());
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data.push_str(d);
                    }
                }
                (ev, data)
            })
            .collect()
    }
}

/// Sends one request; `headers` are extra header lines, each ending in "\r\n".
pub(crate) async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &str,
    body: Option<&str>,
) -> Reply {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\n\r\n{body}",
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
    let headers = head.to_ascii_lowercase();
    let body = if headers.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Reply {
        status,
        headers,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}
