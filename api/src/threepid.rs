//! Third-party identifiers (spec: client-server API "Adding Account Administrative
//! Contact Information", and the homeserver side of the Identity Service API):
//! validating an email address by a link the server mails itself, adding, listing and
//! deleting an account's validated 3PIDs, and binding them to the user id on an
//! identity server (and unbinding them again).
//!
//! Validation sessions (`requestToken` → the emailed link → `/account/3pid/add`) are
//! ephemeral like user-interactive auth sessions: kept in memory, bounded
//! ([`VALIDATION_SESSIONS_MAX`]) and expiring (`email.validation_token_lifetime_ms`
//! for the link, [`VALIDATION_SESSION_LIFETIME_MS`] for the session), never
//! journaled; what a session leads to is (`ThreepidAdded`, `ThreepidRemoved`,
//! `ThreepidBound`, `ThreepidUnbound`, read back from the `accounts` projection).
//!
//! The email goes out from the request that asks for it (the client must learn whether
//! it could be sent), through lettre's SMTP transport to `[email] smtp_host`. The
//! link points at our own `submit_url`
//! (`/_matrix/client/unstable/add_threepid/email/submit_token`, Synapse's path),
//! which answers `GET` (the link in the email: a page, or a redirect to `next_link`)
//! and `POST` (the spec's `submit_url`, with the identity service's `submitToken`
//! parameters: `sid`, `client_secret`, `token`).
//!
//! Identity servers are reached at `https://<id_server>` (plain `http://` only with
//! `identity_servers.dangerous_plain_http_for_tests`), through addresses that pass
//! `identity_servers.ip_range_denylist`, as push gateways are. A bind carries the
//! client's `id_access_token`; an unbind is signed by this server (X-Matrix), as the
//! spec asks, since the client gives no token for it.

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{Query, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use lettre::{
    AsyncSmtpTransport, AsyncTransport, Tokio1Executor,
    message::{Mailbox, header::ContentType},
    transport::smtp::authentication::Credentials,
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{ClientAddr, JsonObject, Requester, opt_str},
};

/// Validation sessions kept at most; a new one past this first drops the expired
/// ones, then the oldest tenth.
pub const VALIDATION_SESSIONS_MAX: usize = 10_000;

/// How long a validation session (its `sid`) can be used for `/account/3pid/add`
/// after it was opened, ms (Synapse keeps sessions 24 hours).
pub const VALIDATION_SESSION_LIFETIME_MS: u64 = 24 * 3_600_000;

/// Longest `client_secret` and `sid` (spec: at most 255 characters).
pub const CLIENT_SECRET_MAX_BYTES: usize = 255;

/// Longest email address accepted, bytes (RFC 5321's path limit).
pub const EMAIL_MAX_BYTES: usize = 254;

/// Largest identity-server answer read, bytes.
pub const IDENTITY_RESPONSE_MAX_BYTES: usize = 64 * 1024;

/// The path of our `submit_url` (and of the link in the email).
pub const SUBMIT_TOKEN_PATH: &str = "/_matrix/client/unstable/add_threepid/email/submit_token";

/// How the SMTP connection is protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpTls {
    /// A plain connection upgraded with STARTTLS (required, not opportunistic).
    StartTls,
    /// TLS from the first byte (usually port 465).
    Implicit,
    /// Plain text (a relay on loopback).
    None,
}

/// Validation email settings (`[email]` in the config).
#[derive(Debug, Clone)]
pub struct EmailConfig {
    /// SMTP server host.
    pub smtp_host: String,
    /// SMTP server port.
    pub smtp_port: u16,
    /// SMTP AUTH user; empty: none.
    pub smtp_user: String,
    /// SMTP AUTH password.
    pub smtp_pass: String,
    /// Transport security.
    pub tls: SmtpTls,
    /// `From:` of the emails.
    pub notif_from: String,
    /// The server's name in the emails.
    pub app_name: String,
    /// How long an emailed link works, ms.
    pub validation_token_lifetime_ms: u64,
    /// Timeout of one SMTP exchange, ms.
    pub smtp_timeout_ms: u64,
}

/// Identity-server request settings (`[identity_servers]` in the config).
#[derive(Debug, Clone)]
pub struct IdentityConfig {
    /// Timeout of one request, ms.
    pub request_timeout_ms: u64,
    /// Ranges (CIDR) an identity server may not be at.
    pub ip_range_denylist: Vec<String>,
    /// Ranges exempt from the denylist.
    pub ip_range_allowlist: Vec<String>,
    /// `http://` instead of `https://` (tests only).
    pub plain_http: bool,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        IdentityConfig {
            request_timeout_ms: 10_000,
            ip_range_denylist: spindle_federation::client::DEFAULT_IP_RANGE_DENYLIST
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ip_range_allowlist: Vec::new(),
            plain_http: false,
        }
    }
}

/// Whether `s` is a mailbox lettre accepts as `From:` (`"Name <a@b>"` or `a@b`).
pub fn valid_mailbox(s: &str) -> bool {
    s.parse::<Mailbox>().is_ok()
}

/// Checks that an SMTP transport can be built from `config` (the TLS parameters need a
/// valid host name).
pub fn check_email_config(config: &EmailConfig) -> Result<(), String> {
    smtp_transport(config).map(|_| ())
}

fn smtp_transport(c: &EmailConfig) -> Result<AsyncSmtpTransport<Tokio1Executor>, String> {
    type T = AsyncSmtpTransport<Tokio1Executor>;
    let builder = match c.tls {
        SmtpTls::None => T::builder_dangerous(&c.smtp_host),
        SmtpTls::StartTls => T::starttls_relay(&c.smtp_host).map_err(|e| e.to_string())?,
        SmtpTls::Implicit => T::relay(&c.smtp_host).map_err(|e| e.to_string())?,
    };
    let mut builder = builder
        .port(c.smtp_port)
        .timeout(Some(Duration::from_millis(c.smtp_timeout_ms)));
    if !c.smtp_user.is_empty() {
        builder = builder.credentials(Credentials::new(c.smtp_user.clone(), c.smtp_pass.clone()));
    }
    Ok(builder.build())
}

/// What a validation session was opened for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Purpose {
    /// `POST /account/3pid/email/requestToken`: adding the address to an account.
    Add,
    /// `POST /register/email/requestToken`: registering with the address.
    Register,
}

/// One validation session.
#[derive(Debug, Clone)]
pub struct ValidationSession {
    /// The client's secret (compared exactly).
    pub client_secret: String,
    /// `"email"`.
    pub medium: &'static str,
    /// The canonical address.
    pub address: String,
    /// What it was opened for.
    pub purpose: Purpose,
    /// The highest `send_attempt` seen.
    pub send_attempt: u64,
    /// The token the email carries.
    pub token: String,
    /// When the last email was sent, ms (the token works until this plus the
    /// configured lifetime).
    pub token_sent_ms: u64,
    /// Where to send the user after the link was opened.
    pub next_link: Option<String>,
    /// When it was opened, ms.
    pub created_ms: u64,
    /// When the token was submitted, ms.
    pub validated_at: Option<u64>,
}

#[derive(Default)]
struct SessionMaps {
    by_sid: HashMap<String, ValidationSession>,
    /// (client secret, address, purpose) -> sid: a retry finds its session.
    by_request: HashMap<(String, String, Purpose), String>,
}

/// The validation sessions in flight (bounded, expiring).
#[derive(Default)]
pub struct ValidationSessions {
    maps: parking_lot::Mutex<SessionMaps>,
}

/// What [`ValidationSessions::request`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requested {
    /// The session id.
    pub sid: String,
    /// The token to email now; `None` when `send_attempt` was not higher than one
    /// already seen (spec: "the server should respond with success but not resend").
    pub send_token: Option<String>,
}

fn live(s: &ValidationSession, now: u64) -> bool {
    now.saturating_sub(s.created_ms) < VALIDATION_SESSION_LIFETIME_MS
}

impl ValidationSessions {
    /// Sessions kept now.
    pub fn len(&self) -> usize {
        self.maps.lock().by_sid.len()
    }

    /// Whether no session is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Opens a session for (`client_secret`, `address`, `purpose`), or continues the
    /// live one.
    pub fn request(
        &self,
        client_secret: &str,
        address: &str,
        purpose: Purpose,
        send_attempt: u64,
        next_link: Option<String>,
        now: u64,
    ) -> Requested {
        let mut maps = self.maps.lock();
        let request_key = (client_secret.to_owned(), address.to_owned(), purpose);
        if let Some(sid) = maps.by_request.get(&request_key).cloned()
            && let Some(s) = maps.by_sid.get_mut(&sid)
            && live(s, now)
        {
            if send_attempt <= s.send_attempt {
                return Requested {
                    sid,
                    send_token: None,
                };
            }
            s.send_attempt = send_attempt;
            s.token_sent_ms = now;
            if next_link.is_some() {
                s.next_link = next_link;
            }
            return Requested {
                sid,
                send_token: Some(s.token.clone()),
            };
        }
        if maps.by_sid.len() >= VALIDATION_SESSIONS_MAX {
            maps.by_sid.retain(|_, s| live(s, now));
        }
        if maps.by_sid.len() >= VALIDATION_SESSIONS_MAX {
            let mut by_age: Vec<(u64, String)> = maps
                .by_sid
                .iter()
                .map(|(k, s)| (s.created_ms, k.clone()))
                .collect();
            by_age.sort();
            for (_, k) in by_age
                .into_iter()
                .take((VALIDATION_SESSIONS_MAX / 10).max(1))
            {
                maps.by_sid.remove(&k);
            }
        }
        let SessionMaps { by_sid, by_request } = &mut *maps;
        by_request.retain(|_, sid| by_sid.contains_key(sid));
        let sid = crate::account::random_string(24);
        let token = crate::account::random_string(32);
        by_sid.insert(
            sid.clone(),
            ValidationSession {
                client_secret: client_secret.to_owned(),
                medium: "email",
                address: address.to_owned(),
                purpose,
                send_attempt,
                token: token.clone(),
                token_sent_ms: now,
                next_link,
                created_ms: now,
                validated_at: None,
            },
        );
        by_request.insert(request_key, sid.clone());
        Requested {
            sid,
            send_token: Some(token),
        }
    }

    /// Submits `token` for `sid` (spec: identity service `submitToken`): 400
    /// `M_INVALID_PARAM` for an unknown session or secret, `M_SESSION_EXPIRED` once the
    /// link's lifetime has passed, `M_TOKEN_INCORRECT` for a wrong token. Returns the
    /// session's `next_link`. Submitting again after success succeeds again.
    pub fn submit(
        &self,
        sid: &str,
        client_secret: &str,
        token: &str,
        token_lifetime_ms: u64,
        now: u64,
    ) -> Result<Option<String>, MatrixError> {
        let mut maps = self.maps.lock();
        let s = maps
            .by_sid
            .get_mut(sid)
            .filter(|s| live(s, now) && s.client_secret == client_secret)
            .ok_or_else(|| {
                MatrixError::new(
                    StatusCode::BAD_REQUEST,
                    "M_INVALID_PARAM",
                    "Unknown session or client secret",
                )
            })?;
        if s.token != token {
            return Err(MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_TOKEN_INCORRECT",
                "The validation token is incorrect",
            ));
        }
        if s.validated_at.is_none() {
            if now.saturating_sub(s.token_sent_ms) >= token_lifetime_ms {
                return Err(MatrixError::new(
                    StatusCode::BAD_REQUEST,
                    "M_SESSION_EXPIRED",
                    "The validation token has expired",
                ));
            }
            s.validated_at = Some(now);
        }
        Ok(s.next_link.clone())
    }

    /// The live session `sid` opened with `client_secret` for `purpose`, validated:
    /// `(medium, address, validated_at)`.
    pub fn validated(
        &self,
        sid: &str,
        client_secret: &str,
        purpose: Purpose,
        now: u64,
    ) -> Option<(&'static str, String, u64)> {
        let maps = self.maps.lock();
        let s = maps.by_sid.get(sid)?;
        if !live(s, now) || s.client_secret != client_secret || s.purpose != purpose {
            return None;
        }
        Some((s.medium, s.address.clone(), s.validated_at?))
    }

    /// Forgets `sid` (its 3PID was added: a session is spent once).
    pub fn remove(&self, sid: &str) {
        let mut maps = self.maps.lock();
        if let Some(s) = maps.by_sid.remove(sid) {
            maps.by_request
                .remove(&(s.client_secret, s.address, s.purpose));
        }
    }
}

/// Third-party identifier state: the validation sessions, the SMTP transport (when
/// email is on) and the identity-server client.
pub struct Threepids {
    /// Validation sessions in flight.
    pub sessions: ValidationSessions,
    email: Option<(EmailConfig, AsyncSmtpTransport<Tokio1Executor>)>,
    identity: IdentityClient,
}

impl Threepids {
    /// Builds the state; an email config whose transport cannot be built, or bad IP
    /// ranges, turn that part off (the server config refuses both before start).
    pub fn new(email: Option<EmailConfig>, identity: &IdentityConfig) -> Threepids {
        let email = email.and_then(|c| match smtp_transport(&c) {
            Ok(t) => Some((c, t)),
            Err(e) => {
                tracing::error!(error = %e, "email: no SMTP transport, validation emails are off");
                None
            }
        });
        Threepids {
            sessions: ValidationSessions::default(),
            email,
            identity: IdentityClient::new(identity),
        }
    }

    /// Whether validation emails are sent (`m.3pid_changes`).
    pub fn email_enabled(&self) -> bool {
        self.email.is_some()
    }

    /// The identity-server client.
    pub fn identity(&self) -> &IdentityClient {
        &self.identity
    }
}

impl Default for Threepids {
    fn default() -> Self {
        Threepids::new(None, &IdentityConfig::default())
    }
}

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v3/account/3pid",
            get(list).post(bind_deprecated),
        )
        .route(
            "/_matrix/client/v3/account/3pid/email/requestToken",
            post(request_token_add),
        )
        .route(
            "/_matrix/client/v3/register/email/requestToken",
            post(request_token_register),
        )
        .route(
            "/_matrix/client/v3/account/3pid/msisdn/requestToken",
            post(msisdn_not_supported),
        )
        .route(
            "/_matrix/client/v3/register/msisdn/requestToken",
            post(msisdn_not_supported),
        )
        .route(SUBMIT_TOKEN_PATH, get(submit_token_link).post(submit_token))
        .route("/_matrix/client/v3/account/3pid/add", post(add))
        .route("/_matrix/client/v3/account/3pid/delete", post(delete))
        .route("/_matrix/client/v3/account/3pid/bind", post(bind))
        .route("/_matrix/client/v3/account/3pid/unbind", post(unbind))
}

fn medium_not_supported(msg: &str) -> MatrixError {
    MatrixError::new(
        StatusCode::BAD_REQUEST,
        "M_THREEPID_MEDIUM_NOT_SUPPORTED",
        msg,
    )
}

/// `POST /account/3pid/msisdn/requestToken`, `/register/msisdn/requestToken`: this
/// server sends no SMS (400 `M_THREEPID_MEDIUM_NOT_SUPPORTED`, MSC4178 as Synapse).
async fn msisdn_not_supported() -> MatrixError {
    medium_not_supported("Adding phone numbers to an account is not supported on this server")
}

/// A `client_secret` or `sid` as the spec allows: 1 to 255 of `[0-9a-zA-Z.=_-]`.
fn valid_secret(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= CLIENT_SECRET_MAX_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'=' | b'_' | b'-'))
}

fn required_str(body: &serde_json::Map<String, Value>, name: &str) -> ApiResult<String> {
    opt_str(body, name)?.ok_or_else(|| MatrixError::missing_param(format!("{name} is required")))
}

fn client_secret_of(body: &serde_json::Map<String, Value>) -> ApiResult<String> {
    let secret = required_str(body, "client_secret")?;
    if !valid_secret(&secret) {
        return Err(MatrixError::invalid_param(
            "client_secret must be 1 to 255 characters of [0-9a-zA-Z.=_-]",
        ));
    }
    Ok(secret)
}

/// The canonical form of an email address (lower case, as Synapse stores them), or 400
/// `M_INVALID_PARAM`.
pub fn canonical_email(address: &str) -> ApiResult<String> {
    let a = address.trim().to_lowercase();
    if a.len() > EMAIL_MAX_BYTES || a.parse::<lettre::Address>().is_err() {
        return Err(MatrixError::invalid_param("Unable to parse email address"));
    }
    Ok(a)
}

/// Percent-encodes a query value (everything but RFC 3986 unreserved).
fn query_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The shared part of both `requestToken` endpoints (spec: "Adding Account
/// Administrative Contact Information", `POST /register/email/requestToken`).
async fn request_token(
    s: &AppState,
    addr: &ClientAddr,
    body: serde_json::Map<String, Value>,
    purpose: Purpose,
) -> ApiResult<Json<Value>> {
    let Some((config, transport)) = &s.threepids.email else {
        return Err(medium_not_supported(match purpose {
            Purpose::Add => "Adding an email to your account is disabled on this server",
            Purpose::Register => "Email-based registration is disabled on this server",
        }));
    };
    let client_secret = client_secret_of(&body)?;
    let address = canonical_email(&required_str(&body, "email")?)?;
    let send_attempt = match body.get("send_attempt") {
        Some(Value::Number(n)) => n.as_u64().ok_or_else(|| {
            MatrixError::invalid_param("send_attempt must be a non-negative integer")
        })?,
        None | Some(Value::Null) => {
            return Err(MatrixError::missing_param("send_attempt is required"));
        }
        Some(_) => return Err(MatrixError::bad_json("send_attempt must be an integer")),
    };
    let next_link = opt_str(&body, "next_link")?;
    if let Some(link) = &next_link
        && !(link.starts_with("https://") || link.starts_with("http://"))
    {
        return Err(MatrixError::invalid_param(
            "next_link must use either the http or https scheme",
        ));
    }
    // Per client address and per email address (Synapse's rc_3pid_validation): both
    // must have room before either counts.
    let limit = &s.rate_limits.threepid_validation;
    let (by_client, by_email) = (addr.rate_key(), format!("email:{address}"));
    limit.peek(&by_client)?;
    limit.peek(&by_email)?;
    limit.record(&by_client);
    limit.record(&by_email);
    if s.projections
        .accounts
        .threepid_owner("email", &address)
        .is_some()
    {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_THREEPID_IN_USE",
            "Email is already in use",
        ));
    }
    let now = crate::now_ms();
    let requested = s.threepids.sessions.request(
        &client_secret,
        &address,
        purpose,
        send_attempt,
        next_link,
        now,
    );
    if let Some(token) = requested.send_token {
        let link = format!(
            "{}{SUBMIT_TOKEN_PATH}?token={}&client_secret={}&sid={}",
            s.config.public_base_url.trim_end_matches('/'),
            query_encode(&token),
            query_encode(&client_secret),
            query_encode(&requested.sid),
        );
        let message = validation_email(config, &s.config.server_name, &address, purpose, &link)?;
        if let Err(e) = transport.send(message).await {
            tracing::warn!(error = %e, "email: the validation email was not sent");
            return Err(MatrixError::new(
                StatusCode::BAD_GATEWAY,
                "M_UNKNOWN",
                "The validation email could not be sent",
            ));
        }
    }
    let submit_url = format!(
        "{}{SUBMIT_TOKEN_PATH}",
        s.config.public_base_url.trim_end_matches('/')
    );
    Ok(Json(
        json!({ "sid": requested.sid, "submit_url": submit_url }),
    ))
}

/// The validation email: plain text, the link on a line of its own.
fn validation_email(
    config: &EmailConfig,
    server_name: &str,
    address: &str,
    purpose: Purpose,
    link: &str,
) -> ApiResult<lettre::Message> {
    let from: Mailbox = config
        .notif_from
        .parse()
        .map_err(|_| MatrixError::internal("email.notif_from is not an address"))?;
    let to: Mailbox = address
        .parse()
        .map_err(|_| MatrixError::invalid_param("Unable to parse email address"))?;
    let app = &config.app_name;
    let (subject, what) = match purpose {
        Purpose::Add => (
            format!("[{app}] Validate your email"),
            format!("add the email address {address} to your account on {server_name}"),
        ),
        Purpose::Register => (
            format!("[{app}] Validate your email"),
            format!("register an account on {server_name} with the email address {address}"),
        ),
    };
    let text = format!(
        "Hello,\n\nA request was made to {what}.\n\nTo confirm it, open this link:\n\n{link}\n\n\
         If it was not you, ignore this email: nothing changes.\n"
    );
    // 7bit when it fits (ASCII, no line over SMTP's 998 bytes), so the link stays whole
    // on one line of the message as sent (lettre would pick quoted-printable for lines
    // over 76 characters and break the link with soft line breaks); else lettre's pick.
    let fits_7bit = text.is_ascii() && text.lines().all(|l| l.len() <= 998 && !l.contains('\r'));
    let body = if fits_7bit {
        lettre::message::Body::dangerous_pre_encoded(
            text.replace('\n', "\r\n").into_bytes(),
            lettre::message::header::ContentTransferEncoding::SevenBit,
        )
    } else {
        lettre::message::Body::new(text)
    };
    lettre::Message::builder()
        .from(from)
        .to(to)
        .subject(subject)
        .header(ContentType::TEXT_PLAIN)
        .body(body)
        .map_err(|e| MatrixError::internal(format!("building the email: {e}")))
}

/// `POST /account/3pid/email/requestToken` (spec: "Adding Account Administrative
/// Contact Information"): no access token needed. 400 `M_THREEPID_IN_USE` when an
/// account here has the address, `M_THREEPID_MEDIUM_NOT_SUPPORTED` when email is off.
/// `id_server` and `id_access_token` are ignored: this server validates the address
/// itself (so `M_SERVER_NOT_TRUSTED` is never the answer).
async fn request_token_add(
    State(s): State<AppState>,
    addr: ClientAddr,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    request_token(&s, &addr, body, Purpose::Add).await
}

/// `POST /register/email/requestToken` (spec: "Account registration"): the same as
/// [`request_token_add`] for a registration.
async fn request_token_register(
    State(s): State<AppState>,
    addr: ClientAddr,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    request_token(&s, &addr, body, Purpose::Register).await
}

fn token_lifetime(s: &AppState) -> u64 {
    s.threepids
        .email
        .as_ref()
        .map_or(0, |(c, _)| c.validation_token_lifetime_ms)
}

/// `POST` of our `submit_url` (spec: `submit_url` of `requestToken`, with the identity
/// service's `POST /validate/email/submitToken` parameters and answers): `{"success":
/// true}`, or 400 `M_INVALID_PARAM` / `M_TOKEN_INCORRECT` / `M_SESSION_EXPIRED`.
async fn submit_token(
    State(s): State<AppState>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let sid = required_str(&body, "sid")?;
    let client_secret = required_str(&body, "client_secret")?;
    let token = required_str(&body, "token")?;
    s.threepids.sessions.submit(
        &sid,
        &client_secret,
        &token,
        token_lifetime(&s),
        crate::now_ms(),
    )?;
    Ok(Json(json!({ "success": true })))
}

fn page(status: StatusCode, text: &str) -> Response {
    let html = format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Email validation</title></head>\
         <body><p>{text}</p></body></html>\n"
    );
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        html,
    )
        .into_response()
}

/// `GET` of our `submit_url`: the link in the email. A small page saying whether the
/// address is validated, or a redirect (302) to the session's `next_link`.
async fn submit_token_link(
    State(s): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let get = |k: &str| q.get(k).map(String::as_str).unwrap_or_default();
    match s.threepids.sessions.submit(
        get("sid"),
        get("client_secret"),
        get("token"),
        token_lifetime(&s),
        crate::now_ms(),
    ) {
        Ok(Some(next)) => (StatusCode::FOUND, [(header::LOCATION, next)]).into_response(),
        Ok(None) => page(
            StatusCode::OK,
            "Your email address is validated. Return to your Matrix client to continue.",
        ),
        Err(e) => page(
            StatusCode::BAD_REQUEST,
            match e.errcode {
                "M_SESSION_EXPIRED" => {
                    "This link has expired. Ask your Matrix client to send a new one."
                }
                _ => "This link is not valid.",
            },
        ),
    }
}

/// `GET /account/3pid` (spec: "Adding Account Administrative Contact Information"):
/// the account's 3PIDs with `validated_at` and `added_at`, ordered by medium, then
/// address.
async fn list(State(s): State<AppState>, r: Requester) -> Json<Value> {
    let threepids: Vec<Value> = s
        .projections
        .accounts
        .threepids(&r.user_id)
        .into_iter()
        .map(|(medium, address, t)| {
            json!({
                "medium": medium,
                "address": address,
                "validated_at": t.validated_at,
                "added_at": t.added_at,
            })
        })
        .collect();
    Json(json!({ "threepids": threepids }))
}

/// `POST /account/3pid/add` (spec: "Adding Account Administrative Contact
/// Information"; user-interactive auth bound to `sid` and `client_secret`): adds the
/// address a validated session proved. 400 `M_THREEPID_AUTH_FAILED` for a session that
/// is unknown, expired, not validated or opened for registration (as Synapse);
/// `M_THREEPID_IN_USE` when another account has the address meanwhile.
async fn add(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Response> {
    let client_secret = client_secret_of(&body)?;
    let sid = required_str(&body, "sid")?;
    let params = json!({
        "sid": sid,
        "client_secret": blake3::hash(client_secret.as_bytes()).to_hex().to_string(),
    });
    if r.appservice.is_none()
        && let Some(challenge) =
            crate::devices::user_interactive_auth(&s, &r, "POST /account/3pid/add", params, &body)
                .await?
    {
        return Ok(challenge);
    }
    let now = crate::now_ms();
    let (medium, address, validated_at) = s
        .threepids
        .sessions
        .validated(&sid, &client_secret, Purpose::Add, now)
        .ok_or_else(|| {
            MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_THREEPID_AUTH_FAILED",
                "No validated 3pid session found",
            )
        })?;
    match s.projections.accounts.threepid_owner(medium, &address) {
        Some(owner) if owner == r.user_id => {}
        Some(_) => {
            return Err(MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_THREEPID_IN_USE",
                "Email is already in use",
            ));
        }
        None => {
            let fact = Fact::ThreepidAdded {
                user_id: r.user_id.clone(),
                medium: medium.to_owned(),
                address,
                validated_at,
                added_at: now,
            };
            s.submit_and_wait(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
                .await?;
        }
    }
    s.threepids.sessions.remove(&sid);
    Ok(Json(json!({})).into_response())
}

/// The `m.login.email.identity` stage of a registration (spec: "Email-based (identity /
/// homeserver)"): `auth.threepid_creds` (or the older `threepidCreds`) names a
/// registration session that validated an address no account has. Returns the sid,
/// the address and when it was validated; else the error the 401 challenge carries
/// (`M_UNAUTHORIZED`, as Synapse; `M_THREEPID_IN_USE` for a taken address).
pub(crate) fn registration_email(
    s: &AppState,
    auth: Option<&Value>,
    now: u64,
) -> Result<(String, String, u64), MatrixError> {
    let creds = auth
        .and_then(|a| a.get("threepid_creds").or_else(|| a.get("threepidCreds")))
        .and_then(Value::as_object);
    let field = |k: &str| {
        creds
            .and_then(|c| c.get(k))
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let (sid, client_secret) = (field("sid"), field("client_secret"));
    let (_, address, validated_at) = s
        .threepids
        .sessions
        .validated(sid, client_secret, Purpose::Register, now)
        .ok_or_else(|| {
            MatrixError::new(
                StatusCode::UNAUTHORIZED,
                "M_UNAUTHORIZED",
                "No validated email session found",
            )
        })?;
    if s.projections
        .accounts
        .threepid_owner("email", &address)
        .is_some()
    {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_THREEPID_IN_USE",
            "Email is already in use",
        ));
    }
    Ok((sid.to_owned(), address, validated_at))
}

/// The `medium` of a request: `email` or `msisdn` (the spec's enum), else 400.
fn medium_of(body: &serde_json::Map<String, Value>) -> ApiResult<String> {
    let medium = required_str(body, "medium")?;
    if !matches!(medium.as_str(), "email" | "msisdn") {
        return Err(MatrixError::invalid_param("medium must be email or msisdn"));
    }
    Ok(medium)
}

/// The address of a request in the form it is stored (emails in lower case).
fn address_of(body: &serde_json::Map<String, Value>, medium: &str) -> ApiResult<String> {
    let address = required_str(body, "address")?;
    Ok(if medium == "email" {
        address.trim().to_lowercase()
    } else {
        address
    })
}

/// An `id_server` as the spec gives it: a host name with an optional port.
fn id_server_of(body: &serde_json::Map<String, Value>) -> ApiResult<Option<String>> {
    match opt_str(body, "id_server")? {
        None => Ok(None),
        Some(server) => {
            if ruma::ServerName::parse(&server).is_err() {
                return Err(MatrixError::invalid_param(
                    "id_server must be a host name with an optional port",
                ));
            }
            Ok(Some(server))
        }
    }
}

/// Unbinds (`medium`, `address`) of `user_id` from `id_server` (or from every identity
/// server it was bound through, when `None`): `"success"` when each asked identity
/// server unbound it, `"no-support"` when none is known or one refused or could not
/// be reached. Each successful unbind is journaled (`ThreepidUnbound`).
pub(crate) async fn unbind_everywhere(
    s: &AppState,
    user_id: &str,
    medium: &str,
    address: &str,
    id_server: Option<String>,
) -> ApiResult<&'static str> {
    let servers = match id_server {
        Some(server) => vec![server],
        None => s
            .projections
            .accounts
            .threepid_binds(user_id, medium, address),
    };
    if servers.is_empty() {
        return Ok("no-support");
    }
    let mut result = "success";
    for server in servers {
        match s
            .threepids
            .identity
            .unbind(&s.key, &server, user_id, medium, address)
            .await
        {
            Ok(()) => {
                let fact = Fact::ThreepidUnbound {
                    user_id: user_id.to_owned(),
                    medium: medium.to_owned(),
                    address: address.to_owned(),
                    id_server: server,
                };
                s.submit_and_wait(user_id, None, CommandBody::Fact { fact })
                    .await?;
            }
            Err(e) => {
                tracing::info!(id_server = %server, error = %e.error, "3pid unbind refused or failed");
                result = "no-support";
            }
        }
    }
    Ok(result)
}

/// `POST /account/3pid/delete` (spec: "Adding Account Administrative Contact
/// Information"): unbinds the address from `id_server`, or from every identity server
/// it was bound through, then removes it from the account (`ThreepidRemoved`).
/// Answers `id_server_unbind_result`. An address the account does not have is 200
/// too (nothing to remove), as Synapse.
async fn delete(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let medium = medium_of(&body)?;
    let address = address_of(&body, &medium)?;
    let id_server = id_server_of(&body)?;
    let result = unbind_everywhere(&s, &r.user_id, &medium, &address, id_server).await?;
    let has = s
        .projections
        .accounts
        .threepids(&r.user_id)
        .iter()
        .any(|(m, a, _)| *m == medium && *a == address);
    let bound = !s
        .projections
        .accounts
        .threepid_binds(&r.user_id, &medium, &address)
        .is_empty();
    if has || bound {
        let fact = Fact::ThreepidRemoved {
            user_id: r.user_id.clone(),
            medium,
            address,
        };
        s.submit_and_wait(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
            .await?;
    }
    Ok(Json(json!({ "id_server_unbind_result": result })))
}

/// `POST /account/3pid/unbind` (spec: "Adding Account Administrative Contact
/// Information"): unbinds the address from `id_server`, or from every identity server
/// it was bound through, keeping it on the account.
async fn unbind(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let medium = medium_of(&body)?;
    let address = address_of(&body, &medium)?;
    let id_server = id_server_of(&body)?;
    let result = unbind_everywhere(&s, &r.user_id, &medium, &address, id_server).await?;
    Ok(Json(json!({ "id_server_unbind_result": result })))
}

/// `POST /account/3pid/bind` (spec: "Adding Account Administrative Contact
/// Information"): asks `id_server` (`POST /_matrix/identity/v2/3pid/bind`, with the
/// client's `id_access_token`) to bind the 3PID its session validated to the user id,
/// and remembers the bind (`ThreepidBound`) so a delete can unbind it. The identity
/// server's errors are passed on (spec: "simply proxy any errors").
async fn bind(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    bind_with(&s, &r, &body).await
}

/// `POST /account/3pid` (deprecated; spec: equivalent to `/3pid/bind`), with the
/// credentials in `three_pid_creds`.
async fn bind_deprecated(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let creds = match body.get("three_pid_creds") {
        Some(Value::Object(c)) => c.clone(),
        None | Some(Value::Null) => {
            return Err(MatrixError::missing_param("three_pid_creds is required"));
        }
        Some(_) => return Err(MatrixError::bad_json("three_pid_creds must be an object")),
    };
    bind_with(&s, &r, &creds).await
}

async fn bind_with(
    s: &AppState,
    r: &Requester,
    body: &serde_json::Map<String, Value>,
) -> ApiResult<Json<Value>> {
    let client_secret = client_secret_of(body)?;
    let sid = required_str(body, "sid")?;
    let id_server =
        id_server_of(body)?.ok_or_else(|| MatrixError::missing_param("id_server is required"))?;
    let id_access_token = required_str(body, "id_access_token")?;
    let answer = s
        .threepids
        .identity
        .post(
            &id_server,
            "/_matrix/identity/v2/3pid/bind",
            IdentityAuth::Bearer(&id_access_token),
            &json!({ "sid": sid, "client_secret": client_secret, "mxid": r.user_id }),
        )
        .await?;
    let (Some(medium), Some(address)) = (
        answer.get("medium").and_then(Value::as_str),
        answer.get("address").and_then(Value::as_str),
    ) else {
        return Err(bad_gateway(
            "The identity server's answer has no medium or address",
        ));
    };
    if answer.get("mxid").and_then(Value::as_str) != Some(r.user_id.as_str()) {
        return Err(bad_gateway("The identity server bound another user id"));
    }
    let fact = Fact::ThreepidBound {
        user_id: r.user_id.clone(),
        medium: medium.to_owned(),
        address: address.to_owned(),
        id_server,
    };
    s.submit_and_wait(&r.user_id, Some(&r.device_id), CommandBody::Fact { fact })
        .await?;
    Ok(Json(json!({})))
}

fn bad_gateway(msg: impl Into<String>) -> MatrixError {
    MatrixError::new(StatusCode::BAD_GATEWAY, "M_UNKNOWN", msg)
}

/// The errcodes an identity server's error is passed on with (the spec's; any other
/// is passed on as `M_UNKNOWN`).
fn known_errcode(errcode: &str) -> &'static str {
    const KNOWN: &[&str] = &[
        "M_SESSION_NOT_VALIDATED",
        "M_NO_VALID_SESSION",
        "M_SESSION_EXPIRED",
        "M_INVALID_PARAM",
        "M_INVALID_PEPPER",
        "M_UNAUTHORIZED",
        "M_TERMS_NOT_SIGNED",
        "M_FORBIDDEN",
        "M_NOT_FOUND",
        "M_THREEPID_IN_USE",
        "M_UNRECOGNIZED",
        "M_MISSING_PARAMS",
        "M_MISSING_PARAM",
        "M_BAD_JSON",
        "M_NOT_JSON",
        "M_UNKNOWN_TOKEN",
        "M_LIMIT_EXCEEDED",
        "M_TOKEN_INCORRECT",
        "M_INVALID_EMAIL",
    ];
    KNOWN
        .iter()
        .find(|k| **k == errcode)
        .copied()
        .unwrap_or("M_UNKNOWN")
}

/// How a request to an identity server authenticates.
pub enum IdentityAuth<'a> {
    /// The client's `id_access_token`.
    Bearer(&'a str),
    /// Signed by this server (X-Matrix, spec: server-server "Request Authentication").
    Signed(&'a spindle_core::keys::ServerKey),
    /// None (`GET /_matrix/identity/v2/pubkey/...`).
    None,
}

/// Requests to identity servers (spec: Identity Service API v2).
pub struct IdentityClient {
    http: Option<reqwest::Client>,
    policy: Option<Arc<spindle_federation::client::IpPolicy>>,
    scheme: &'static str,
}

impl IdentityClient {
    /// A client with `config`'s timeout and address policy (a bad range list leaves
    /// it unable to send; the server config refuses one before start).
    pub fn new(config: &IdentityConfig) -> IdentityClient {
        let policy = spindle_federation::client::IpPolicy::new(
            &config.ip_range_denylist,
            &config.ip_range_allowlist,
        )
        .map(Arc::new)
        .ok();
        let http = policy.as_ref().and_then(|p| {
            reqwest::Client::builder()
                .use_rustls_tls()
                .no_proxy()
                .dns_resolver(spindle_federation::client::filtering_resolver(p.clone()))
                .timeout(Duration::from_millis(config.request_timeout_ms))
                .connect_timeout(Duration::from_millis(config.request_timeout_ms.min(10_000)))
                .redirect(reqwest::redirect::Policy::none())
                .user_agent(concat!("Spindle/", env!("CARGO_PKG_VERSION")))
                .build()
                .ok()
        });
        IdentityClient {
            http,
            policy,
            scheme: if config.plain_http { "http" } else { "https" },
        }
    }

    /// Sends `method path` with `body` to `id_server` and parses its JSON answer. An
    /// error answer with a Matrix error is passed on with its status (4xx) and errcode;
    /// anything else (unreachable, 5xx, not JSON) is 502 `M_UNKNOWN`.
    pub async fn request(
        &self,
        method: reqwest::Method,
        id_server: &str,
        path: &str,
        auth: IdentityAuth<'_>,
        body: Option<&Value>,
    ) -> ApiResult<Value> {
        let (Some(http), Some(policy)) = (&self.http, &self.policy) else {
            return Err(bad_gateway("No identity-server client"));
        };
        let host = ruma::ServerName::parse(id_server)
            .map_err(|_| MatrixError::invalid_param("id_server is not a host name"))?;
        let ip_host = host.host().trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = ip_host.parse::<std::net::IpAddr>()
            && !policy.allows(ip)
        {
            return Err(MatrixError::new(
                StatusCode::BAD_REQUEST,
                "M_SERVER_NOT_TRUSTED",
                "The identity server's address is not allowed",
            ));
        }
        let url = format!("{}://{id_server}{path}", self.scheme);
        let mut req = http.request(method.clone(), &url);
        match auth {
            IdentityAuth::Bearer(token) => req = req.bearer_auth(token),
            IdentityAuth::Signed(key) => {
                req = req.header(
                    header::AUTHORIZATION,
                    x_matrix(key, method.as_str(), path, id_server, body),
                );
            }
            IdentityAuth::None => {}
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.map_err(|e| {
            tracing::info!(id_server, error = %e, "identity server unreachable");
            bad_gateway("The identity server could not be reached")
        })?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|_| bad_gateway("The identity server's answer was cut short"))?;
        if bytes.len() > IDENTITY_RESPONSE_MAX_BYTES {
            return Err(bad_gateway("The identity server's answer is too large"));
        }
        let json: Option<Value> = serde_json::from_slice(&bytes).ok();
        if status.is_success() {
            return json
                .filter(Value::is_object)
                .ok_or_else(|| bad_gateway("The identity server's answer is not a JSON object"));
        }
        let errcode = json
            .as_ref()
            .and_then(|j| j.get("errcode"))
            .and_then(Value::as_str);
        match errcode {
            Some(code) if status.is_client_error() => Err(MatrixError::new(
                status,
                known_errcode(code),
                json.as_ref()
                    .and_then(|j| j.get("error"))
                    .and_then(Value::as_str)
                    .unwrap_or("The identity server refused the request")
                    .to_owned(),
            )),
            _ => Err(bad_gateway(format!(
                "The identity server answered {}",
                status.as_u16()
            ))),
        }
    }

    /// `POST` [`IdentityClient::request`].
    pub async fn post(
        &self,
        id_server: &str,
        path: &str,
        auth: IdentityAuth<'_>,
        body: &Value,
    ) -> ApiResult<Value> {
        self.request(reqwest::Method::POST, id_server, path, auth, Some(body))
            .await
    }

    /// `POST /_matrix/identity/v2/3pid/unbind`, signed by this server (spec: identity
    /// service "Association"; the client gives no token for it).
    pub async fn unbind(
        &self,
        key: &spindle_core::keys::ServerKey,
        id_server: &str,
        user_id: &str,
        medium: &str,
        address: &str,
    ) -> ApiResult<()> {
        self.post(
            id_server,
            "/_matrix/identity/v2/3pid/unbind",
            IdentityAuth::Signed(key),
            &json!({ "mxid": user_id, "threepid": { "medium": medium, "address": address } }),
        )
        .await
        .map(|_| ())
    }
}

/// A third-party invite as `/invite` and `createRoom`'s `invite_3pid` give it (spec:
/// "Third-party invites").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invite3pid {
    /// The identity server to ask.
    pub id_server: String,
    /// The client's access token on it.
    pub id_access_token: String,
    /// `email` or `msisdn`.
    pub medium: String,
    /// The invitee's address.
    pub address: String,
}

impl Invite3pid {
    /// Reads one from a request object: 400 `M_MISSING_PARAM` / `M_BAD_JSON` /
    /// `M_INVALID_PARAM` for a missing, mistyped or malformed field.
    pub fn parse(body: &serde_json::Map<String, Value>) -> ApiResult<Invite3pid> {
        let id_server = id_server_of(body)?
            .ok_or_else(|| MatrixError::missing_param("id_server is required"))?;
        let id_access_token = required_str(body, "id_access_token")?;
        let medium = medium_of(body)?;
        let address = address_of(body, &medium)?;
        Ok(Invite3pid {
            id_server,
            id_access_token,
            medium,
            address,
        })
    }
}

/// Which user id an identity server has bound a 3PID to (spec: identity service v2
/// "Lookup": `GET /hash_details`, then `POST /lookup` with the address hashed as
/// `sha256` over `"<address> <medium> <pepper>"`, unpadded URL-safe base64, or in
/// the clear with `none` when the server offers only that).
pub async fn lookup(identity: &IdentityClient, invite: &Invite3pid) -> ApiResult<Option<String>> {
    use base64::Engine as _;
    use sha2::Digest as _;
    let auth = || IdentityAuth::Bearer(&invite.id_access_token);
    let details = identity
        .request(
            reqwest::Method::GET,
            &invite.id_server,
            "/_matrix/identity/v2/hash_details",
            auth(),
            None,
        )
        .await?;
    let algorithms: Vec<&str> = details
        .get("algorithms")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let pepper = details
        .get("lookup_pepper")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let (algorithm, hashed) = if algorithms.contains(&"sha256") {
        let digest = sha2::Sha256::digest(
            format!("{} {} {pepper}", invite.address, invite.medium).as_bytes(),
        );
        (
            "sha256",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(digest),
        )
    } else if algorithms.contains(&"none") {
        ("none", format!("{} {}", invite.address, invite.medium))
    } else {
        return Err(bad_gateway(
            "The identity server offers no lookup algorithm this server knows",
        ));
    };
    let answer = identity
        .post(
            &invite.id_server,
            "/_matrix/identity/v2/lookup",
            auth(),
            &json!({ "addresses": [hashed], "algorithm": algorithm, "pepper": pepper }),
        )
        .await?;
    Ok(answer
        .get("mappings")
        .and_then(|m| m.get(&hashed))
        .and_then(Value::as_str)
        .filter(|u| ruma::UserId::parse(*u).is_ok())
        .map(str::to_owned))
}

/// Invites a 3PID to `room_id` as the requester (spec: "Third-party invites"): when the
/// identity server knows its user id, an ordinary invite of that user; else the
/// identity server stores the invite (`POST /_matrix/identity/v2/store-invite`) and an
/// `m.room.third_party_invite` state event (state key: the identity server's token)
/// carries its display name and public keys, for the invitee to claim once they bind
/// the address (`/_matrix/federation/v1/3pid/onbind`).
pub(crate) async fn invite_3pid(
    s: &AppState,
    r: &Requester,
    room_id: &str,
    invite: &Invite3pid,
) -> ApiResult<()> {
    // `createRoom` calls this right after appending the room: read it back first.
    s.wait_for_acknowledged().await?;
    let joined = s
        .projections
        .membership
        .get(room_id, &r.user_id)
        .is_some_and(|m| m.membership == "join");
    if !joined {
        return Err(MatrixError::forbidden("You are not joined to this room"));
    }
    if let Some(user_id) = lookup(&s.threepids.identity, invite).await? {
        return crate::rooms::invite_user(s, r, room_id, &user_id, None)
            .await
            .map(|_| ());
    }
    let mut request = json!({
        "medium": invite.medium,
        "address": invite.address,
        "room_id": room_id,
        "sender": r.user_id,
    });
    if let Some(root) = s.projections.state.current_root(room_id) {
        let field = |kind: &str, key: &str| {
            crate::visibility::state_content(s, root, kind, "")
                .and_then(|c| c.get(key).and_then(Value::as_str).map(str::to_owned))
        };
        for (name, kind, key) in [
            ("room_name", "m.room.name", "name"),
            ("room_alias", "m.room.canonical_alias", "alias"),
            ("room_avatar_url", "m.room.avatar", "url"),
            ("room_join_rules", "m.room.join_rules", "join_rule"),
            ("room_type", "m.room.create", "type"),
        ] {
            if let Some(v) = field(kind, key) {
                request[name] = json!(v);
            }
        }
    }
    let profile = s.projections.accounts.profile(&r.user_id);
    if let Some(d) = profile.displayname {
        request["sender_display_name"] = json!(d);
    }
    if let Some(a) = profile.avatar_url {
        request["sender_avatar_url"] = json!(a);
    }
    let stored = s
        .threepids
        .identity
        .post(
            &invite.id_server,
            "/_matrix/identity/v2/store-invite",
            IdentityAuth::Bearer(&invite.id_access_token),
            &request,
        )
        .await?;
    let token = stored
        .get("token")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| bad_gateway("The identity server's store-invite answer has no token"))?;
    let public_keys: Vec<Value> = stored
        .get("public_keys")
        .and_then(Value::as_array)
        .map(|keys| {
            keys.iter()
                .filter(|k| k.get("public_key").is_some_and(Value::is_string))
                .map(|k| {
                    let mut out = json!({ "public_key": k["public_key"] });
                    if let Some(url) = k.get("key_validity_url").filter(|u| u.is_string()) {
                        out["key_validity_url"] = url.clone();
                    }
                    out
                })
                .collect()
        })
        .unwrap_or_default();
    let Some(first) = public_keys.first().cloned() else {
        return Err(bad_gateway(
            "The identity server's store-invite answer has no public key",
        ));
    };
    let display_name = stored
        .get("display_name")
        .and_then(Value::as_str)
        .unwrap_or("a third-party invitee");
    let mut content = json!({
        "display_name": display_name,
        "public_key": first["public_key"],
        "public_keys": public_keys,
    });
    if let Some(url) = first.get("key_validity_url") {
        content["key_validity_url"] = url.clone();
    }
    crate::rooms::send_spec(
        s,
        r,
        room_id,
        spindle_journal::EventSpec {
            kind: "m.room.third_party_invite".into(),
            state_key: Some(token.to_owned()),
            content,
            redacts: None,
        },
        None,
    )
    .await?;
    Ok(())
}

/// The X-Matrix `Authorization` header of a request to `destination` (spec:
/// server-server API "Request Authentication"; identity servers check unbinds with it).
fn x_matrix(
    key: &spindle_core::keys::ServerKey,
    method: &str,
    uri: &str,
    destination: &str,
    content: Option<&Value>,
) -> String {
    let mut req = json!({
        "method": method,
        "uri": uri,
        "origin": key.server_name(),
        "destination": destination,
    });
    if let Some(c) = content {
        req["content"] = c.clone();
    }
    let obj = spindle_core::canonical::to_object(req).unwrap_or_default();
    let sig = key.sign_bytes(&spindle_core::canonical::to_bytes(&obj));
    format!(
        "X-Matrix origin=\"{}\",destination=\"{destination}\",key=\"{}\",sig=\"{sig}\"",
        key.server_name(),
        key.key_id(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_with_the_same_send_attempt_sends_nothing() {
        let s = ValidationSessions::default();
        let first = s.request("sec", "a@b.c", Purpose::Add, 1, None, 0);
        assert!(first.send_token.is_some());
        let again = s.request("sec", "a@b.c", Purpose::Add, 1, None, 10);
        assert_eq!(
            (again.sid.as_str(), again.send_token),
            (first.sid.as_str(), None)
        );
        let more = s.request("sec", "a@b.c", Purpose::Add, 2, None, 20);
        assert_eq!(more.sid, first.sid);
        assert_eq!(more.send_token, first.send_token);
        // Another purpose is another session.
        let reg = s.request("sec", "a@b.c", Purpose::Register, 1, None, 30);
        assert_ne!(reg.sid, first.sid);
    }

    #[test]
    fn a_token_validates_once_within_its_lifetime() {
        let s = ValidationSessions::default();
        let r = s.request("sec", "a@b.c", Purpose::Add, 1, None, 0);
        let token = r.send_token.unwrap();
        let e = s.submit(&r.sid, "sec", "wrong", 1_000, 10).unwrap_err();
        assert_eq!(e.errcode, "M_TOKEN_INCORRECT");
        let e = s.submit(&r.sid, "other", &token, 1_000, 10).unwrap_err();
        assert_eq!(e.errcode, "M_INVALID_PARAM");
        let e = s.submit(&r.sid, "sec", &token, 1_000, 1_000).unwrap_err();
        assert_eq!(e.errcode, "M_SESSION_EXPIRED");
        assert!(s.validated(&r.sid, "sec", Purpose::Add, 10).is_none());
        // A new send restarts the token's lifetime.
        s.request("sec", "a@b.c", Purpose::Add, 2, None, 1_500);
        assert_eq!(s.submit(&r.sid, "sec", &token, 1_000, 2_000).unwrap(), None);
        assert_eq!(
            s.validated(&r.sid, "sec", Purpose::Add, 2_000),
            Some(("email", "a@b.c".to_owned(), 2_000))
        );
        assert!(
            s.validated(&r.sid, "sec", Purpose::Register, 2_000)
                .is_none()
        );
        assert!(
            s.validated(&r.sid, "sec", Purpose::Add, VALIDATION_SESSION_LIFETIME_MS)
                .is_none()
        );
        s.remove(&r.sid);
        assert!(s.is_empty());
    }

    #[test]
    fn sessions_are_bounded_oldest_dropped_first() {
        let s = ValidationSessions::default();
        let first = s.request("s", "0@x.y", Purpose::Add, 1, None, 0);
        for i in 1..VALIDATION_SESSIONS_MAX as u64 {
            s.request("s", &format!("{i}@x.y"), Purpose::Add, 1, None, i);
        }
        assert_eq!(s.len(), VALIDATION_SESSIONS_MAX);
        s.request("s", "last@x.y", Purpose::Add, 1, None, 1 << 20);
        assert_eq!(
            s.len(),
            VALIDATION_SESSIONS_MAX - VALIDATION_SESSIONS_MAX / 10 + 1
        );
        let token = first.send_token.unwrap();
        assert!(s.submit(&first.sid, "s", &token, u64::MAX, 1).is_err());
    }

    #[test]
    fn emails_are_canonical_and_checked() {
        assert_eq!(
            canonical_email(" Alice@Example.ORG ").unwrap(),
            "alice@example.org"
        );
        assert_eq!(
            canonical_email("not an address").unwrap_err().errcode,
            "M_INVALID_PARAM"
        );
        assert!(valid_secret("abc.=_-XYZ09"));
        assert!(!valid_secret("a b"));
        assert!(!valid_secret(""));
    }
}
