//! Matrix errors (spec: client-server API "Standard error response"): every failure
//! leaves as `{"errcode": "M_...", "error": "..."}` with the right HTTP status.

use axum::{
    Json,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use spindle_journal::JournalError;

/// A Matrix error response.
#[derive(Debug, Clone)]
pub struct MatrixError {
    /// HTTP status.
    pub status: StatusCode,
    /// `errcode`, e.g. `M_FORBIDDEN`.
    pub errcode: &'static str,
    /// Human-readable text.
    pub error: String,
    /// Extra top-level fields (e.g. `soft_logout`, UIA `flows`).
    pub extra: Option<serde_json::Value>,
}

impl MatrixError {
    /// A new error.
    pub fn new(status: StatusCode, errcode: &'static str, error: impl Into<String>) -> Self {
        MatrixError {
            status,
            errcode,
            error: error.into(),
            extra: None,
        }
    }
    /// 403 `M_FORBIDDEN`.
    pub fn forbidden(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "M_FORBIDDEN", msg)
    }
    /// 404 `M_NOT_FOUND`.
    pub fn not_found(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "M_NOT_FOUND", msg)
    }
    /// 400 `M_INVALID_PARAM`.
    pub fn invalid_param(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "M_INVALID_PARAM", msg)
    }
    /// 400 `M_BAD_JSON`.
    pub fn bad_json(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "M_BAD_JSON", msg)
    }
    /// 400 `M_NOT_JSON`.
    pub fn not_json(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "M_NOT_JSON", msg)
    }
    /// 400 `M_MISSING_PARAM`.
    pub fn missing_param(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "M_MISSING_PARAM", msg)
    }
    /// 500 `M_UNKNOWN` (server-side failures only; never for client input).
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "M_UNKNOWN", msg)
    }
    /// 404 `M_UNRECOGNIZED` for unknown endpoints.
    pub fn unrecognized() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "M_UNRECOGNIZED",
            "Unrecognized request",
        )
    }
    /// 429 `M_LIMIT_EXCEEDED` with `retry_after_ms` (and a `Retry-After` header).
    pub fn limit_exceeded(msg: impl Into<String>, retry_after_ms: u64) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "M_LIMIT_EXCEEDED", msg)
            .with_extra(serde_json::json!({ "retry_after_ms": retry_after_ms }))
    }
    /// Adds extra top-level fields.
    pub fn with_extra(mut self, extra: serde_json::Value) -> Self {
        self.extra = Some(extra);
        self
    }
}

impl IntoResponse for MatrixError {
    fn into_response(self) -> Response {
        let mut body = serde_json::json!({ "errcode": self.errcode, "error": self.error });
        if let (Some(serde_json::Value::Object(extra)), Some(map)) =
            (self.extra, body.as_object_mut())
        {
            for (k, v) in extra {
                map.insert(k, v);
            }
        }
        // Rate limits (spec v1.19 "Rate limiting"): `retry_after_ms` in the body, and
        // the same wait in whole seconds, rounded up, as `Retry-After`.
        let retry_after_s = (self.status == StatusCode::TOO_MANY_REQUESTS)
            .then(|| body.get("retry_after_ms").and_then(|v| v.as_u64()))
            .flatten()
            .map(|ms| ms.div_ceil(1000));
        let mut resp = (self.status, Json(body)).into_response();
        if let Some(s) = retry_after_s {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        resp
    }
}

impl From<JournalError> for MatrixError {
    fn from(e: JournalError) -> Self {
        match &e {
            JournalError::Forbidden(m) => MatrixError::forbidden(m.clone()),
            JournalError::BadState(m) => {
                MatrixError::new(StatusCode::FORBIDDEN, "M_BAD_STATE", m.clone())
            }
            JournalError::UnknownRoom(_) => MatrixError::not_found(e.to_string()),
            JournalError::UserInUse => MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_USER_IN_USE",
                "User ID already taken.",
            ),
            JournalError::AliasInUse => MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_ROOM_IN_USE",
                "Room alias already taken",
            ),
            JournalError::TooLarge(m) => {
                MatrixError::new(StatusCode::PAYLOAD_TOO_LARGE, "M_TOO_LARGE", m.clone())
            }
            JournalError::BadJson(m) | JournalError::MissingPrevEvents(m) => {
                MatrixError::bad_json(m.clone())
            }
            JournalError::UnsupportedRoomVersion(v) => MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_UNSUPPORTED_ROOM_VERSION",
                format!("Room version {v} is not supported"),
            ),
            JournalError::MediaExists(_) => crate::media::cannot_overwrite(),
            JournalError::Unavailable(m) => {
                MatrixError::new(StatusCode::SERVICE_UNAVAILABLE, "M_UNKNOWN", m.clone())
            }
            JournalError::BadSignature | JournalError::Storage(_) => {
                MatrixError::internal(e.to_string())
            }
        }
    }
}

/// Result alias for handlers.
pub type ApiResult<T> = Result<T, MatrixError>;

/// A federation failure as the local client sees it (status and errcode kept).
pub fn from_federation(e: spindle_federation::FedError) -> MatrixError {
    MatrixError::new(e.status, e.errcode, e.error)
}
