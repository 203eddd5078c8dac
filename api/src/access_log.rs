//! The access log (issue 17 item 5): one line per request at `info`, target
//! `spindle::access`, with the method, the path (secrets in the query removed), the
//! status, the duration in milliseconds and the authenticated user (`-` when none).
//! Switched off with `[logging] access_log = false`.
//!
//! The user is known only once a handler's [`crate::extract::Requester`] has checked
//! the access token; the middleware hands each request an empty [`RequestUser`] slot
//! that the extractor fills, so no token is looked up twice.

use std::sync::{Arc, OnceLock};

use axum::{extract::Request, middleware::Next, response::Response};

/// The slot the `Requester` extractor writes the authenticated user id into.
#[derive(Clone, Default)]
pub struct RequestUser(Arc<OnceLock<String>>);

impl RequestUser {
    /// Records the request's user (the first call wins).
    pub fn set(&self, user_id: &str) {
        let _ = self.0.set(user_id.to_owned());
    }

    /// The user, if one authenticated.
    pub fn get(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }
}

/// Query parameters whose values never reach the log: access, login and registration
/// tokens, passwords, client secrets, signatures.
fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["token", "password", "secret", "sig", "code"]
        .iter()
        .any(|s| k.contains(s))
}

/// The path and query as logged: every value of a secret parameter replaced by
/// `<redacted>`, the rest kept as sent.
pub fn loggable_path(uri: &axum::http::Uri) -> String {
    let path = uri.path();
    let Some(query) = uri.query() else {
        return path.to_owned();
    };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _))
                if crate::extract::url_query(k)
                    .first()
                    .is_some_and(|(k, _)| is_secret(k)) =>
            {
                format!("{k}=<redacted>")
            }
            _ => pair.to_owned(),
        })
        .collect();
    format!("{path}?{}", query.join("&"))
}

/// The middleware: logs one line when the response is ready.
pub async fn access_log(mut req: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let method = req.method().clone();
    let path = loggable_path(req.uri());
    let user = RequestUser::default();
    req.extensions_mut().insert(user.clone());
    let resp = next.run(req).await;
    let duration_ms = (started.elapsed().as_secs_f64() * 1000.0 * 100.0).round() / 100.0;
    tracing::info!(
        target: "spindle::access",
        method = %method,
        path = %path,
        status = resp.status().as_u16(),
        duration_ms,
        user = user.get().unwrap_or("-"),
        "request"
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_the_query_are_redacted_and_the_rest_is_kept() {
        let uri: axum::http::Uri =
            "/_matrix/client/v3/sync?since=s12&access_token=spt_abc&timeout=30000"
                .parse()
                .unwrap();
        assert_eq!(
            loggable_path(&uri),
            "/_matrix/client/v3/sync?since=s12&access_token=<redacted>&timeout=30000"
        );
        let uri: axum::http::Uri =
            "/_matrix/client/v1/register/m.login.registration_token/validity?token=hunter2"
                .parse()
                .unwrap();
        assert_eq!(
            loggable_path(&uri),
            "/_matrix/client/v1/register/m.login.registration_token/validity?token=<redacted>"
        );
        // Percent-encoded key names are recognised too.
        let uri: axum::http::Uri = "/x?access%5Ftoken=a&loginToken=b&client_secret=c&flag"
            .parse()
            .unwrap();
        assert_eq!(
            loggable_path(&uri),
            "/x?access%5Ftoken=<redacted>&loginToken=<redacted>&client_secret=<redacted>&flag"
        );
        let uri: axum::http::Uri = "/x?=a&&b=c".parse().unwrap();
        assert_eq!(loggable_path(&uri), "/x?=a&&b=c");
        let uri: axum::http::Uri = "/_matrix/client/v3/login".parse().unwrap();
        assert_eq!(loggable_path(&uri), "/_matrix/client/v3/login");
    }
}
