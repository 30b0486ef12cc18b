//! Deadlines for what clients send (`--read-timeout`): a client that sends its
//! request slowly (byte by byte, or not at all) holds a connection and a task.
//! Every request head must arrive within the limit — a connection's first one from its
//! accept, each next one on a kept-alive connection from when the connection went
//! idle — or the connection is closed ([`serve`]); a request's whole body must arrive
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

/// Serves `app` on `listener` until `stop` resolves, then stops accepting and waits
/// for the open connections to finish the responses they are sending (idle kept-alive
/// connections close at once). Every request head must arrive within `head_limit`:
/// a connection's first one from its accept, and each next one on a kept-alive
/// connection from when the connection went idle after its last response (hyper's
/// header read timeout); otherwise the connection is closed without an answer. So a
/// client that sends its headers byte by byte, or keeps a connection open and idle,
/// holds a connection and a task for at most `head_limit`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    head_limit: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut h1 = hyper::server::conn::http1::Builder::new();
    h1.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(head_limit);
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // A connection that failed before it was accepted is the client's
                    // business; anything else (out of file descriptors) is waited out.
                    if !matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::ConnectionRefused
                    ) {
                        tracing::warn!("accepting a connection: {e}; retrying in 1 s");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = graceful.watch(h1.serve_connection(hyper_util::rt::TokioIo::new(stream), svc));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                if e.is_timeout() {
                    tracing::warn!(
                        "a client did not send its request headers within {} s; closed its connection",
                        head_limit.as_secs_f64()
                    );
                } else {
                    tracing::debug!("connection: {e}");
                }
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
