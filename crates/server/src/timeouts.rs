//! Deadlines for what clients send (`--read-timeout`): a client that sends its
//! request slowly (byte by byte, or not at all) holds a connection and a task.
//! A connection's first request head must arrive within the limit of its accept, or
//! the connection is closed ([`HeadDeadline`]); a request's whole body must arrive
//! within the limit, or the answer is 408 and the connection is closed
//! ([`read_body`]: the body is read inside the API-key check, so a client without
//! the key never gets a body buffered, and handed on whole).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::Body as _;

use crate::{error, AppState, BODY_LIMIT};

/// `--read-timeout`'s default.
pub const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Reads the request body within the state's `read_timeout`; 408 when it does not
/// come in time, 413 past the body limit.
pub async fn read_body(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    if body.size_hint().exact() == Some(0) {
        return next.run(Request::from_parts(parts, body)).await;
    }
    let path = parts.uri.path().to_string();
    let limit = state.read_timeout;
    match tokio::time::timeout(limit, axum::body::to_bytes(body, BODY_LIMIT)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) if e.to_string().contains("length limit") => {
            StatusCode::PAYLOAD_TOO_LARGE.into_response()
        }
        Ok(Err(e)) => error::ApiError::with_status(
            StatusCode::BAD_REQUEST,
            format!("the request body could not be read: {e}"),
        )
        .into_response_as(error::Flavor::of_path(&path)),
        Err(_) => {
            tracing::warn!(
                "{} {path}: the request body did not arrive within {} s; closing the connection",
                parts.method,
                limit.as_secs_f64()
            );
            let mut res = error::ApiError::with_status(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s (the server's --read-timeout): send the whole body at once",
                    limit.as_secs_f64()
                ),
            )
            .into_response_as(error::Flavor::of_path(&path));
            res.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            res
        }
    }
}

/// The listener `scoria serve` uses: each connection's first request head (its
/// request line and headers) must arrive within `limit` of the connection's accept,
/// else the connection is closed (a client that sends its headers byte by byte
/// holds nothing for long). Later requests on a kept-alive connection are not timed.
pub struct HeadDeadline {
    pub listener: tokio::net::TcpListener,
    pub limit: Duration,
}

impl axum::serve::Listener for HeadDeadline {
    type Io = TimedHead;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (TimedHead, std::net::SocketAddr) {
        let (io, addr) = axum::serve::Listener::accept(&mut self.listener).await;
        let io = TimedHead {
            io,
            deadline: Box::pin(tokio::time::sleep(self.limit)),
            tail: 0,
            head_done: false,
        };
        (io, addr)
    }

    fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }
}

/// A connection whose reads fail once its first request head is late.
pub struct TimedHead {
    io: tokio::net::TcpStream,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// How much of "\r\n\r\n" (the end of a head) the bytes so far end in.
    tail: usize,
    head_done: bool,
}

impl TimedHead {
    fn scan(&mut self, bytes: &[u8]) {
        const END: &[u8] = b"\r\n\r\n";
        for &b in bytes {
            self.tail = if b == END[self.tail] {
                self.tail + 1
            } else if b == b'\r' {
                1
            } else {
                0
            };
            if self.tail == END.len() {
                self.head_done = true;
                return;
            }
        }
    }
}

impl tokio::io::AsyncRead for TimedHead {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        use std::task::Poll;
        let this = self.get_mut();
        if !this.head_done && this.deadline.as_mut().poll(cx).is_ready() {
            tracing::warn!(
                "a client did not send its request headers in time; closing its connection"
            );
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the request headers did not arrive in time",
            )));
        }
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut this.io).poll_read(cx, buf);
        if !this.head_done {
            this.scan(&buf.filled()[before..]);
        }
        r
    }
}

impl tokio::io::AsyncWrite for TimedHead {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_write(cx, data)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
