//! User-interactive authentication sessions (spec: client-server API
//! "User-Interactive Authentication API").
//!
//! A session is bound to the operation that opened it: the action (the endpoint, e.g.
//! `DELETE /devices/{deviceId}`), the parameters of the request that matter to it
//! (which device, which devices, which new password...) and, for an authenticated
//! request, the user. A request naming a session opened for anything else is refused
//! with 403 (Synapse 1.163 `check_ui_auth`: "Requested operation has changed during
//! the UI authentication session.", errcode `M_UNKNOWN` as Synapse sends it), so a
//! session completed for deleting one device cannot delete another, change the
//! password or upload cross-signing keys. Synapse binds the URI and method and only
//! warns when the body changes; we also bind the parameters that choose what the
//! operation does, which the spec asks clients to repeat unchanged. An unknown or
//! expired session is 400 `M_UNKNOWN` (Synapse: "Unknown session ID").
//!
//! A registration session remembers its first request's parameters (`username`, the
//! password as a hash, `device_id`, `initial_device_display_name`, `inhibit_login`,
//! `refresh_token`): a later request of the session that leaves one out uses the
//! remembered one (spec: "Registration", as Synapse keeps the session's
//! `clientdict`).
//!
//! Sessions are ephemeral, like typing and presence: kept in memory (at most
//! [`UIA_SESSIONS_MAX`], each for [`UIA_SESSION_LIFETIME_MS`]), never journaled; a
//! restart forgets them and a client starts its flow again (the completed operation
//! itself is a journal fact, so nothing acknowledged is lost).

use std::collections::HashMap;

use axum::http::StatusCode;
use serde_json::{Map, Value};

use crate::MatrixError;

/// How long a session can be used after it was opened, ms (Synapse's
/// `SESSION_EXPIRE_MS`: 48 hours).
pub const UIA_SESSION_LIFETIME_MS: u64 = 48 * 3_600_000;

/// Sessions kept at most; a new one past this first drops the expired ones, then the
/// oldest tenth (one pass per tenth of the bound).
pub const UIA_SESSIONS_MAX: usize = 10_000;

/// What a session was opened for.
#[derive(Debug, Clone, PartialEq)]
pub struct UiaOperation {
    /// The authenticated user; `None` for registration.
    pub user_id: Option<String>,
    /// The endpoint, e.g. `"DELETE /devices/{deviceId}"`.
    pub action: &'static str,
    /// The parameters that choose what the operation does (compared exactly).
    pub params: Value,
}

/// One session.
#[derive(Debug, Clone)]
pub struct UiaSession {
    /// The operation it was opened for.
    pub op: UiaOperation,
    /// Stages completed so far (spec: `completed`).
    pub completed: Vec<String>,
    /// Parameters remembered for later requests of the session (registration).
    pub remembered: Map<String, Value>,
    /// When it was opened, ms since the epoch.
    pub created_ms: u64,
}

/// The sessions in flight.
#[derive(Default)]
pub struct UiaSessions {
    map: parking_lot::Mutex<HashMap<String, UiaSession>>,
}

fn changed() -> MatrixError {
    MatrixError::new(
        StatusCode::FORBIDDEN,
        "M_UNKNOWN",
        "Requested operation has changed during the UI authentication session.",
    )
}

fn unknown(sid: &str) -> MatrixError {
    MatrixError::new(
        StatusCode::BAD_REQUEST,
        "M_UNKNOWN",
        format!("Unknown session ID: {sid}"),
    )
}

impl UiaSessions {
    /// Sessions kept now.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Whether no session is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Opens a session for `op` at `now`; returns its id.
    pub fn open(&self, op: UiaOperation, now: u64) -> String {
        let sid = crate::account::random_string(24);
        let mut map = self.map.lock();
        if map.len() >= UIA_SESSIONS_MAX {
            map.retain(|_, s| now.saturating_sub(s.created_ms) < UIA_SESSION_LIFETIME_MS);
        }
        if map.len() >= UIA_SESSIONS_MAX {
            let mut by_age: Vec<(u64, String)> =
                map.iter().map(|(k, s)| (s.created_ms, k.clone())).collect();
            by_age.sort();
            for (_, k) in by_age.into_iter().take((UIA_SESSIONS_MAX / 10).max(1)) {
                map.remove(&k);
            }
        }
        map.insert(
            sid.clone(),
            UiaSession {
                op,
                completed: Vec::new(),
                remembered: Map::new(),
                created_ms: now,
            },
        );
        sid
    }

    /// The live session `sid`, whatever it was opened for.
    pub fn get(&self, sid: &str, now: u64) -> Option<UiaSession> {
        self.map
            .lock()
            .get(sid)
            .filter(|s| now.saturating_sub(s.created_ms) < UIA_SESSION_LIFETIME_MS)
            .cloned()
    }

    /// Resumes `sid` for `op`: 400 `M_UNKNOWN` when it is unknown or expired, 403
    /// `M_UNKNOWN` when it was opened for another operation (or user).
    pub fn resume(
        &self,
        sid: &str,
        op: &UiaOperation,
        now: u64,
    ) -> Result<UiaSession, MatrixError> {
        let session = self.get(sid, now).ok_or_else(|| unknown(sid))?;
        if session.op != *op {
            return Err(changed());
        }
        Ok(session)
    }

    /// Records that `stage` of `sid` was completed.
    pub fn complete_stage(&self, sid: &str, stage: &str) {
        if let Some(s) = self.map.lock().get_mut(sid)
            && !s.completed.iter().any(|c| c == stage)
        {
            s.completed.push(stage.to_owned());
        }
    }

    /// Remembers `params` for later requests of `sid` (a key already remembered is
    /// replaced).
    pub fn remember(&self, sid: &str, params: Map<String, Value>) {
        if let Some(s) = self.map.lock().get_mut(sid) {
            s.remembered.extend(params);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn op(action: &'static str, params: Value) -> UiaOperation {
        UiaOperation {
            user_id: Some("@a:x".into()),
            action,
            params,
        }
    }

    #[test]
    fn a_session_serves_only_the_operation_that_opened_it() {
        let s = UiaSessions::default();
        let a = op("DELETE /devices/{deviceId}", json!({ "device_id": "A" }));
        let sid = s.open(a.clone(), 1_000);
        assert!(s.resume(&sid, &a, 2_000).is_ok());
        let b = op("DELETE /devices/{deviceId}", json!({ "device_id": "B" }));
        let e = s.resume(&sid, &b, 2_000).unwrap_err();
        assert_eq!((e.status.as_u16(), e.errcode), (403, "M_UNKNOWN"));
        let mut other_user = a.clone();
        other_user.user_id = Some("@b:x".into());
        assert_eq!(s.resume(&sid, &other_user, 2_000).unwrap_err().status, 403);
        let e = s.resume("nope", &a, 2_000).unwrap_err();
        assert_eq!((e.status.as_u16(), e.errcode), (400, "M_UNKNOWN"));
        // Expired.
        assert_eq!(
            s.resume(&sid, &a, 1_000 + UIA_SESSION_LIFETIME_MS)
                .unwrap_err()
                .status,
            400
        );
    }

    #[test]
    fn sessions_are_bounded_oldest_dropped_first() {
        let s = UiaSessions::default();
        let first = s.open(op("x", json!({})), 0);
        for i in 1..UIA_SESSIONS_MAX as u64 {
            s.open(op("x", json!({})), i);
        }
        assert_eq!(s.len(), UIA_SESSIONS_MAX);
        let last = s.open(op("x", json!({})), UIA_SESSIONS_MAX as u64);
        assert_eq!(s.len(), UIA_SESSIONS_MAX - UIA_SESSIONS_MAX / 10 + 1);
        assert!(s.get(&first, 1).is_none());
        assert!(s.get(&last, 1).is_some());
    }
}
