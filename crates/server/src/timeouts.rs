//! The request body's deadline: a client that sends its body slowly (byte by byte,
//! or not at all after the headers) holds a connection and a task; the whole body
//! must arrive within `--read-timeout` seconds, else the answer is 408 and the
//! connection is closed. The body is read here, inside the API-key check (a client
//! without the key never gets a body buffered), and handed on whole.

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
