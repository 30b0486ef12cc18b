//! Server-sent events: the one writer every streaming route goes through.
//!
//! A route hands [`stream`] its [`Generation`] and an [`Encoder`] — what its API writes
//! before the first step, for each step, and after the last — and gets the response.
//! A task drives the generation and writes each step's frames into the response body
//! as they are made. A client that has gone makes a write fail: the task stops, and
//! as soon as hyper drops the body the task is dropped too, even while it waits for the
//! engine, which drops the `Generation` and stops the request at the worker.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::Response;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::gen::{Generation, Step};

/// One `data:` frame.
pub fn data(v: &impl Serialize) -> Bytes {
    Bytes::from(format!("data: {}\n\n", json(v)))
}

/// One frame with an `event:` line.
pub fn event(name: &str, v: &impl Serialize) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {}\n\n", json(v)))
}

/// The comment line the OpenAI chat and completions streams are kept alive with.
pub fn comment() -> Bytes {
    Bytes::from_static(b": keep-alive\n\n")
}

/// OpenAI's end of stream.
pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// A frame's JSON. Our frames are maps with string keys and plain values, which
/// always serialize.
fn json(v: &impl Serialize) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// What one API writes as a generation streams.
pub trait Encoder: Send + 'static {
    /// Frames before the first step.
    fn open(&mut self, _out: &mut Vec<Bytes>) {}

    /// Frames for one step. `gen` holds the log-probabilities of the tokens that
    /// arrived since they were last taken.
    fn step(&mut self, step: Step, gen: &mut Generation, out: &mut Vec<Bytes>);

    /// Frames after the last step.
    fn close(&mut self, _out: &mut Vec<Bytes>) {}
}

/// The streaming response for `gen`, framed by `enc`.
pub fn stream(mut gen: Generation, mut enc: impl Encoder) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
    let watch = tx.clone();
    let task = async move {
        let mut out = Vec::new();
        enc.open(&mut out);
        if !send(&tx, &mut out).await {
            return;
        }
        while let Some(step) = gen.next().await {
            enc.step(step, &mut gen, &mut out);
            if !send(&tx, &mut out).await {
                return;
            }
        }
        enc.close(&mut out);
        send(&tx, &mut out).await;
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = task => {}
            _ = watch.closed() => {}
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(body)
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

/// Writes `frames` in order (and empties the list); false once the client has gone.
async fn send(tx: &mpsc::Sender<Result<Bytes, Infallible>>, frames: &mut Vec<Bytes>) -> bool {
    for f in frames.drain(..) {
        if tx.send(Ok(f)).await.is_err() {
            return false;
        }
    }
    true
}
