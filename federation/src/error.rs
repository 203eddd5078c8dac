//! Matrix errors of the Server-Server API (`{errcode, error}` with the HTTP status the
//! spec gives), and the mapping from journal refusals.

use axum::{
    Json,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use spindle_journal::JournalError;

/// An error answered to another server.
#[derive(Debug, Clone)]
pub struct FedError {
    /// HTTP status.
    pub status: StatusCode,
    /// Matrix error code, e.g. `M_FORBIDDEN`.
    pub errcode: &'static str,
    /// Human-readable reason.
    pub error: String,
    /// The room version, for `M_INCOMPATIBLE_ROOM_VERSION` (spec: `make_join`).
    pub room_version: Option<String>,
    /// How long to wait before retrying, ms (`M_LIMIT_EXCEEDED`).
    pub retry_after_ms: Option<u64>,
}

impl FedError {
    /// Any status and code.
    pub fn new(status: StatusCode, errcode: &'static str, error: impl Into<String>) -> FedError {
        FedError {
            status,
            errcode,
            error: error.into(),
            room_version: None,
            retry_after_ms: None,
        }
    }
    /// Adds the `room_version` field (`M_INCOMPATIBLE_ROOM_VERSION`).
    pub fn with_room_version(mut self, version: &str) -> FedError {
        self.room_version = Some(version.to_owned());
        self
    }
    /// 401 `M_UNAUTHORIZED`: the request is not signed by the origin it names.
    pub fn unauthorized(error: impl Into<String>) -> FedError {
        FedError::new(StatusCode::UNAUTHORIZED, "M_UNAUTHORIZED", error)
    }
    /// 403 `M_FORBIDDEN`.
    pub fn forbidden(error: impl Into<String>) -> FedError {
        FedError::new(StatusCode::FORBIDDEN, "M_FORBIDDEN", error)
    }
    /// 404 `M_NOT_FOUND`.
    pub fn not_found(error: impl Into<String>) -> FedError {
        FedError::new(StatusCode::NOT_FOUND, "M_NOT_FOUND", error)
    }
    /// 400 `M_BAD_JSON`.
    pub fn bad_json(error: impl Into<String>) -> FedError {
        FedError::new(StatusCode::BAD_REQUEST, "M_BAD_JSON", error)
    }
    /// 400 `M_INVALID_PARAM`.
    pub fn invalid_param(error: impl Into<String>) -> FedError {
        FedError::new(StatusCode::BAD_REQUEST, "M_INVALID_PARAM", error)
    }
    /// 429 `M_LIMIT_EXCEEDED` with `retry_after_ms`.
    pub fn limit_exceeded(retry_after_ms: u64) -> FedError {
        let mut e = FedError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "M_LIMIT_EXCEEDED",
            "Too many requests from your server",
        );
        e.retry_after_ms = Some(retry_after_ms);
        e
    }
    /// 500 `M_UNKNOWN` (storage failures only; never for remote input).
    pub fn internal(error: impl Into<String>) -> FedError {
        FedError::new(StatusCode::INTERNAL_SERVER_ERROR, "M_UNKNOWN", error)
    }
}

impl IntoResponse for FedError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({ "errcode": self.errcode, "error": self.error });
        if let Some(v) = self.room_version {
            body["room_version"] = v.into();
        }
        if let Some(ms) = self.retry_after_ms {
            body["retry_after_ms"] = ms.into();
        }
        (self.status, Json(body)).into_response()
    }
}

impl From<JournalError> for FedError {
    fn from(e: JournalError) -> FedError {
        match &e {
            JournalError::Forbidden(m) | JournalError::BadState(m) => FedError::forbidden(m),
            JournalError::UnknownRoom(_) => FedError::not_found(e.to_string()),
            JournalError::TooLarge(m) => {
                FedError::new(StatusCode::PAYLOAD_TOO_LARGE, "M_TOO_LARGE", m)
            }
            JournalError::BadJson(m) | JournalError::MissingPrevEvents(m) => FedError::bad_json(m),
            JournalError::UnsupportedRoomVersion(v) => FedError::new(
                StatusCode::BAD_REQUEST,
                "M_INCOMPATIBLE_ROOM_VERSION",
                format!("room version {v} is not supported"),
            ),
            _ => FedError::internal(e.to_string()),
        }
    }
}

/// Result of a federation handler.
pub type FedResult<T> = Result<T, FedError>;
