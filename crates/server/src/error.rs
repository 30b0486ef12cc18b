//! Errors a route answers with, in the route's own wire shape.
//!
//! A handler builds an [`ApiError`] and the route decides the shape: OpenAI routes
//! answer `{"error": {"message", "type", "param", "code"}}`, Anthropic routes
//! `{"type": "error", "error": {"type", "message"}}`. The message always names the
//! field at fault, so a client can fix its request without reading our code.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// Which API family a route belongs to (it decides the error body's shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

impl Flavor {
    /// The family of the route at `path`: Anthropic's under `/v1/messages`, OpenAI's
    /// shape everywhere else (the operations routes use it too).
    pub fn of_path(path: &str) -> Flavor {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Flavor::Anthropic
        } else {
            Flavor::OpenAi
        }
    }
}

/// A request that cannot be served, with the HTTP status it maps to.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 about `field`; the message should name the field.
    pub fn field(field: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(field.to_string()),
        }
    }

    /// A 400 not tied to one field.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    /// A 500: the server failed, not the request.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
        }
    }

    /// Any status (401, 404, 405, 413, ...) with a message for people.
    pub fn with_status(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// A 503: the server cannot take the request now.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            param: None,
        }
    }

    fn openai_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            400..=499 => "invalid_request_error",
            503 => "server_unavailable",
            _ => "server_error",
        }
    }

    /// OpenAI's `code` for a client error.
    fn openai_code(&self) -> Option<&'static str> {
        Some(match self.status.as_u16() {
            401 => "invalid_api_key",
            404 if self.param.as_deref() == Some("model") => "model_not_found",
            404 => "not_found",
            405 => "method_not_allowed",
            413 => "request_too_large",
            400..=499 => "invalid_value",
            _ => return None,
        })
    }

    fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            503 => "overloaded_error",
            _ => "api_error",
        }
    }

    /// The body in `flavor`'s shape.
    pub fn body(&self, flavor: Flavor) -> serde_json::Value {
        match flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.openai_type(),
                "param": self.param,
                "code": self.openai_code(),
            }}),
            Flavor::Anthropic => json!({
                "type": "error",
                "error": {"type": self.anthropic_type(), "message": self.message},
            }),
        }
    }

    /// The full HTTP response in `flavor`'s shape.
    pub fn into_response_as(self, flavor: Flavor) -> Response {
        (self.status, Json(self.body(flavor))).into_response()
    }

    /// The error as one SSE frame, for a failure after the stream has started.
    pub fn sse_frame(&self, flavor: Flavor) -> String {
        match flavor {
            Flavor::OpenAi => format!("data: {}\n\n", self.body(flavor)),
            Flavor::Anthropic => format!("event: error\ndata: {}\n\n", self.body(flavor)),
        }
    }
}

/// An error already bound to its route's shape (what handlers return).
#[derive(Debug)]
pub struct RouteError(pub ApiError, pub Flavor);

impl IntoResponse for RouteError {
    fn into_response(self) -> Response {
        self.0.into_response_as(self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_shape_names_the_field() {
        let e = ApiError::field("temperature", "temperature must be between 0 and 2, got 3");
        let b = e.body(Flavor::OpenAi);
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "temperature");
        assert!(b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("temperature"));
        assert!(b["error"].get("code").is_some());
    }

    #[test]
    fn anthropic_shape() {
        let e = ApiError::field("max_tokens", "max_tokens is required");
        let b = e.body(Flavor::Anthropic);
        assert_eq!(b["type"], "error");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["message"], "max_tokens is required");
    }
}
