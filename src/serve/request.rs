//! What the parts of a request's handling share: the endpoint it came to
//! and the error answer.

use serde_json::{json, Value};

/// An error answer: HTTP status and message, sent as OpenAI's error body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
        }
    }
    pub fn kind(&self) -> &'static str {
        match self.status {
            400 | 413 | 422 => "invalid_request_error",
            404 => "not_found_error",
            503 => "server_busy",
            _ => "server_error",
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.status}})
    }
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}
