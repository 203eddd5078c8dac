//! Application services (spec v1.19: Application Service API; Client-Server API
//! "Application service" sections): the registrations, their namespaces, `as_token`
//! authentication, and the requests the homeserver makes to an application service
//! (user and alias queries, `/ping`).
//!
//! Registrations are Synapse's YAML files (`id`, `url`, `as_token`, `hs_token`,
//! `sender_localpart`, `namespaces.{users,aliases,rooms}` of `{regex, exclusive}`,
//! `rate_limited`, `receive_ephemeral` / `de.sorunome.msc2409.push_ephemeral`,
//! `org.matrix.msc3202`, `io.element.msc4190`, `protocols`), listed in the server
//! config and loaded at start ([`AppServices::load`]); a bad file stops the server with
//! the file and the field named. They are configuration, not state: nothing here
//! writes, and every change an application service makes (users it registers, devices,
//! room events, directory listings) is a journal command like any client's.
//!
//! Namespace regexes match from the start of the id, as Synapse's do (Python's
//! `re.match`): `@irc_.*` matches `@irc_alice:example.org`; anchor with `$` to bound
//! the end. The sender (`@<sender_localpart>:<server>`) belongs to its application
//! service like a user of an exclusive namespace.
//!
//! The transaction pusher (events to `PUT /_matrix/app/v1/transactions/{txnId}`) is a
//! journal consumer and lives in the server crate (`src/appservice.rs`), which may
//! read the journal; this module serves the API side.

use std::{collections::HashMap, path::Path, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    extract::{Path as UrlPath, State},
    http::StatusCode,
    routing::{post, put},
};
use serde_json::{Value, json};
use spindle_federation::client::{IpPolicy, filtering_resolver};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester, opt_str},
};

/// The path prefix of the Application Service API on the application service.
pub const APP_SERVICE_PREFIX: &str = "/_matrix/app/v1";

/// One namespace entry: a regex (anchored at the start) and whether it is exclusive.
#[derive(Debug, Clone)]
pub struct Namespace {
    /// The regex as written in the registration.
    pub source: String,
    regex: regex::Regex,
    /// Only this application service may create ids in this namespace.
    pub exclusive: bool,
}

impl Namespace {
    /// Compiles a namespace regex, anchored at the start of the id (Synapse's
    /// `re.match`). Errors carry the regex engine's message.
    pub fn new(source: &str, exclusive: bool) -> Result<Namespace, String> {
        let regex = regex::Regex::new(&format!("^(?:{source})")).map_err(|e| e.to_string())?;
        Ok(Namespace {
            source: source.to_owned(),
            regex,
            exclusive,
        })
    }

    /// Whether `id` is in this namespace.
    pub fn matches(&self, id: &str) -> bool {
        self.regex.is_match(id)
    }
}

/// One registered application service.
#[derive(Debug, Clone)]
pub struct AppService {
    /// `id`: unique, never changes (the consumer's cursor is named after it).
    pub id: String,
    /// `url` without a trailing `/`; `None` (`url: null`): no transactions, queries or
    /// pings.
    pub url: Option<String>,
    /// `as_token`: what the application service authenticates with.
    pub as_token: String,
    /// `hs_token`: what we authenticate with (`Authorization: Bearer`).
    pub hs_token: String,
    /// `@<sender_localpart>:<server_name>`.
    pub sender: String,
    /// `namespaces.users`.
    pub users: Vec<Namespace>,
    /// `namespaces.aliases`.
    pub aliases: Vec<Namespace>,
    /// `namespaces.rooms`.
    pub rooms: Vec<Namespace>,
    /// `rate_limited` (default `true`, as Synapse and the spec: requests made as
    /// masqueraded users are rate limited; the sender never is).
    pub rate_limited: bool,
    /// `receive_ephemeral`: receipts (and the other ephemeral data served) in
    /// transactions under `ephemeral`, and to-device messages under
    /// `de.sorunome.msc2409.to_device`.
    pub receive_ephemeral: bool,
    /// `de.sorunome.msc2409.push_ephemeral`: the same under the MSC2409 keys
    /// (`de.sorunome.msc2409.ephemeral`).
    pub receive_ephemeral_unstable: bool,
    /// `org.matrix.msc3202`: device-list changes of namespaced users' rooms in
    /// transactions (`org.matrix.msc3202.device_lists`).
    pub msc3202: bool,
    /// `io.element.msc4190`: `POST /register` answers without an access token, and
    /// devices are made with `PUT /devices/{deviceId}`.
    pub msc4190: bool,
    /// `protocols` (third-party networks it bridges).
    pub protocols: Vec<String>,
}

impl AppService {
    /// Whether the user is the sender or in any user namespace (Synapse's
    /// `is_interested_in_user`): it may masquerade as them and log in as them.
    pub fn is_interested_in_user(&self, user_id: &str) -> bool {
        user_id == self.sender || self.users.iter().any(|n| n.matches(user_id))
    }

    /// Whether the user is the sender or in an exclusive user namespace.
    pub fn is_exclusive_user(&self, user_id: &str) -> bool {
        user_id == self.sender || self.users.iter().any(|n| n.exclusive && n.matches(user_id))
    }

    /// Whether the alias is in any alias namespace.
    pub fn is_interested_in_alias(&self, alias: &str) -> bool {
        self.aliases.iter().any(|n| n.matches(alias))
    }

    /// Whether the alias is in an exclusive alias namespace.
    pub fn is_exclusive_alias(&self, alias: &str) -> bool {
        self.aliases.iter().any(|n| n.exclusive && n.matches(alias))
    }

    /// Whether the room id is in a room namespace.
    pub fn is_interested_in_room_id(&self, room_id: &str) -> bool {
        self.rooms.iter().any(|n| n.matches(room_id))
    }

    /// Whether it wants ephemeral data (either key).
    pub fn wants_ephemeral(&self) -> bool {
        self.receive_ephemeral || self.receive_ephemeral_unstable
    }

    /// Parses a registration (YAML text) for `server_name`. Errors name the field.
    pub fn from_yaml(text: &str, server_name: &str) -> Result<AppService, String> {
        let value: Value = serde_norway::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
        Self::from_value(&value, server_name)
    }

    /// [`AppService::from_yaml`] from an already parsed document. The checks are
    /// Synapse's (`_load_appservice`): `id`, `as_token`, `hs_token` and
    /// `sender_localpart` strings; `url` a string or an explicit `null`; `namespaces`
    /// an object whose lists hold `{regex: string, exclusive: bool}`; booleans where
    /// booleans belong.
    pub fn from_value(v: &Value, server_name: &str) -> Result<AppService, String> {
        let obj = v
            .as_object()
            .ok_or("the registration must be a YAML mapping")?;
        let string = |name: &str| -> Result<String, String> {
            match obj.get(name) {
                Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
                Some(Value::String(_)) => Err(format!("`{name}` must not be empty")),
                Some(_) => Err(format!("`{name}` must be a string")),
                None => Err(format!("required field `{name}` is missing")),
            }
        };
        let flag = |name: &str, default: bool| -> Result<bool, String> {
            match obj.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(format!("`{name}` must be true or false")),
            }
        };
        let id = string("id")?;
        let as_token = string("as_token")?;
        let hs_token = string("hs_token")?;
        let localpart = string("sender_localpart")?;
        // `url` must be there: a forgotten one silently turning transactions off is
        // what Synapse's explicit-null rule prevents.
        let url = match obj.get("url") {
            Some(Value::String(s)) if !s.is_empty() => {
                let parsed = reqwest::Url::parse(s).map_err(|e| format!("`url` {s:?}: {e}"))?;
                if parsed.scheme() != "http" && parsed.scheme() != "https" {
                    return Err(format!("`url` {s:?} must be http or https"));
                }
                Some(s.trim_end_matches('/').to_owned())
            }
            Some(Value::Null) => None,
            Some(_) => return Err("`url` must be a string or null".into()),
            None => return Err("required field `url` is missing (write `url: null` for an application service that gets no traffic)".into()),
        };
        if !localpart.bytes().all(
            |b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'=' | b'-' | b'/' | b'+'),
        ) {
            return Err(format!(
                "`sender_localpart` {localpart:?} has characters not allowed in a user id (a-z 0-9 . _ = - / +)"
            ));
        }
        let sender = format!("@{localpart}:{server_name}");
        let namespaces = match obj.get("namespaces") {
            Some(Value::Object(m)) => m,
            Some(_) => return Err("`namespaces` must be a mapping".into()),
            None => return Err("required field `namespaces` is missing".into()),
        };
        let list = |kind: &str| -> Result<Vec<Namespace>, String> {
            let entries = match namespaces.get(kind) {
                None | Some(Value::Null) => return Ok(Vec::new()),
                Some(Value::Array(a)) => a,
                Some(_) => return Err(format!("`namespaces.{kind}` must be a list")),
            };
            entries
                .iter()
                .enumerate()
                .map(|(i, e)| {
                    let at = format!("namespaces.{kind}[{i}]");
                    let regex = e
                        .get("regex")
                        .and_then(|r| r.as_str())
                        .ok_or_else(|| format!("`{at}.regex` must be a string"))?;
                    let exclusive = e
                        .get("exclusive")
                        .and_then(|x| x.as_bool())
                        .ok_or_else(|| format!("`{at}.exclusive` must be true or false"))?;
                    Namespace::new(regex, exclusive).map_err(|err| format!("`{at}.regex`: {err}"))
                })
                .collect()
        };
        let protocols = match obj.get("protocols") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|p| {
                    p.as_str()
                        .map(str::to_owned)
                        .ok_or("`protocols` must be a list of strings")
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err("`protocols` must be a list of strings".into()),
        };
        Ok(AppService {
            id,
            url,
            as_token,
            hs_token,
            sender,
            users: list("users")?,
            aliases: list("aliases")?,
            rooms: list("rooms")?,
            rate_limited: flag("rate_limited", true)?,
            receive_ephemeral: flag("receive_ephemeral", false)?,
            receive_ephemeral_unstable: flag("de.sorunome.msc2409.push_ephemeral", false)?,
            msc3202: flag("org.matrix.msc3202", false)?,
            msc4190: flag("io.element.msc4190", false)?,
            protocols,
        })
    }
}

/// Outbound settings for requests to application services (`[appservices]`).
#[derive(Debug, Clone)]
pub struct AppServiceSettings {
    /// Timeout of one request to an application service, ms.
    pub request_timeout_ms: u64,
    /// Address ranges an application service may not be at.
    pub ip_range_denylist: Vec<String>,
    /// Ranges exempt from the denylist (e.g. `127.0.0.1/32` for a bridge on loopback).
    pub ip_range_allowlist: Vec<String>,
}

impl Default for AppServiceSettings {
    fn default() -> Self {
        AppServiceSettings {
            request_timeout_ms: 30_000,
            ip_range_denylist: Vec::new(),
            ip_range_allowlist: Vec::new(),
        }
    }
}

/// Why a request to an application service failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AsRequestError {
    /// The registration has `url: null`.
    NoUrl,
    /// The address is in a denied range (`[appservices] ip_range_denylist`).
    Denied(String),
    /// Timed out.
    Timeout,
    /// Could not connect, or the connection broke.
    Connection(String),
    /// Answered with a status other than 2xx.
    Status(u16, String),
}

impl std::fmt::Display for AsRequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AsRequestError::NoUrl => write!(f, "the application service has no url"),
            AsRequestError::Denied(host) => write!(
                f,
                "{host} is in a denied address range ([appservices] ip_range_allowlist)"
            ),
            AsRequestError::Timeout => write!(f, "timed out"),
            AsRequestError::Connection(e) => write!(f, "connection failed: {e}"),
            AsRequestError::Status(s, _) => write!(f, "answered HTTP {s}"),
        }
    }
}

/// Every registered application service, looked up by token, id, user and alias.
pub struct AppServices {
    list: Vec<Arc<AppService>>,
    /// blake3 of each `as_token`: the lookup compares hashes, so its timing says
    /// nothing about a token's characters.
    by_token: HashMap<[u8; 32], Arc<AppService>>,
    http: reqwest::Client,
    policy: Arc<IpPolicy>,
}

impl std::fmt::Debug for AppServices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppServices")
            .field("ids", &self.list.iter().map(|a| &a.id).collect::<Vec<_>>())
            .finish()
    }
}

impl AppServices {
    /// No application services.
    pub fn empty() -> AppServices {
        Self::new(Vec::new(), &AppServiceSettings::default()).expect("no registrations")
    }

    /// Loads every registration file. Errors name the file and what is wrong with
    /// it; ids and `as_token`s must be unique across files (as Synapse requires).
    pub fn load(
        files: &[impl AsRef<Path>],
        server_name: &str,
        settings: &AppServiceSettings,
    ) -> Result<AppServices, String> {
        let mut list = Vec::new();
        for file in files {
            let file = file.as_ref();
            let text = std::fs::read_to_string(file)
                .map_err(|e| format!("application service registration {}: {e}", file.display()))?;
            let reg = AppService::from_yaml(&text, server_name)
                .map_err(|e| format!("application service registration {}: {e}", file.display()))?;
            list.push((file.display().to_string(), reg));
        }
        Self::new(list, settings)
    }

    /// Builds the set from parsed registrations (`(where it came from, registration)`).
    pub fn new(
        list: Vec<(String, AppService)>,
        settings: &AppServiceSettings,
    ) -> Result<AppServices, String> {
        let mut ids: HashMap<String, String> = HashMap::new();
        let mut by_token = HashMap::new();
        let mut out = Vec::new();
        for (origin, reg) in list {
            if let Some(first) = ids.insert(reg.id.clone(), origin.clone()) {
                return Err(format!(
                    "application service id {:?} is registered twice ({first} and {origin})",
                    reg.id
                ));
            }
            let reg = Arc::new(reg);
            let hash = *blake3::hash(reg.as_token.as_bytes()).as_bytes();
            if by_token.insert(hash, reg.clone()).is_some() {
                return Err(format!(
                    "application service {origin}: its as_token is also another registration's"
                ));
            }
            out.push(reg);
        }
        let policy = Arc::new(IpPolicy::new(
            &settings.ip_range_denylist,
            &settings.ip_range_allowlist,
        )?);
        let http = reqwest::Client::builder()
            .use_rustls_tls()
            .no_proxy()
            .dns_resolver(filtering_resolver(policy.clone()))
            .timeout(Duration::from_millis(settings.request_timeout_ms.max(1)))
            .connect_timeout(Duration::from_millis(
                settings.request_timeout_ms.clamp(1, 10_000),
            ))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("Spindle/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(AppServices {
            list: out,
            by_token,
            http,
            policy,
        })
    }

    /// Every registration, in config order.
    pub fn all(&self) -> &[Arc<AppService>] {
        &self.list
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The application service whose `as_token` this is.
    pub fn by_token(&self, token: &str) -> Option<&Arc<AppService>> {
        self.by_token.get(blake3::hash(token.as_bytes()).as_bytes())
    }

    /// The application service with this id.
    pub fn get(&self, id: &str) -> Option<&Arc<AppService>> {
        self.list.iter().find(|a| a.id == id)
    }

    /// The application service that holds the user exclusively (its sender or an
    /// exclusive user namespace), if any.
    pub fn exclusive_user_owner(&self, user_id: &str) -> Option<&Arc<AppService>> {
        self.list.iter().find(|a| a.is_exclusive_user(user_id))
    }

    /// Whether `requester` may take or change `alias` (Synapse's `can_modify_alias`):
    /// refused when an application service holds it exclusively and the requester is
    /// neither that application service nor its sender.
    pub fn may_use_alias(&self, alias: &str, user_id: &str, via: Option<&AppService>) -> bool {
        let mut exclusive = false;
        for a in self.list.iter().filter(|a| a.is_interested_in_alias(alias)) {
            if via.is_some_and(|v| v.id == a.id) || a.sender == user_id {
                return true;
            }
            exclusive |= a.is_exclusive_alias(alias);
        }
        !exclusive
    }

    /// Whether per-user rate limits skip `user_id`: an application service's sender
    /// always; a user in a user namespace of an application service registered with
    /// `rate_limited: false`.
    pub fn rate_exempt(&self, user_id: &str) -> bool {
        self.list.iter().any(|a| {
            a.sender == user_id || (!a.rate_limited && a.users.iter().any(|n| n.matches(user_id)))
        })
    }

    /// Whether an address passes the outbound policy.
    fn check_url(&self, url: &str) -> Result<(), AsRequestError> {
        if let Some(host) = reqwest::Url::parse(url)
            .ok()
            .and_then(|u| u.host_str().map(|h| h.trim_matches(['[', ']']).to_owned()))
            && let Ok(ip) = host.parse::<std::net::IpAddr>()
            && !self.policy.allows(ip)
        {
            // An address literal never goes through the resolver: check it here.
            return Err(AsRequestError::Denied(host));
        }
        Ok(())
    }

    /// Sends one request to an application service (`path` under its `url`, with
    /// `Authorization: Bearer <hs_token>`) and returns the JSON answer (`null` when the
    /// body is not JSON).
    pub async fn request(
        &self,
        a: &AppService,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, AsRequestError> {
        let base = a.url.as_deref().ok_or(AsRequestError::NoUrl)?;
        let url = format!("{base}{path}");
        self.check_url(&url)?;
        let mut req = self.http.request(method, &url).bearer_auth(&a.hs_token);
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.map_err(|e| {
            if e.is_timeout() {
                AsRequestError::Timeout
            } else {
                AsRequestError::Connection(e.to_string())
            }
        })?;
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(AsRequestError::Status(status.as_u16(), text));
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// Asks the application services interested in `user_id` whether it exists
    /// (`GET /_matrix/app/v1/users/{userId}`); one that answers 200 has created it.
    pub async fn query_user(&self, user_id: &str) -> bool {
        for a in self
            .list
            .iter()
            .filter(|a| a.is_interested_in_user(user_id))
        {
            if a.url.is_none() {
                continue;
            }
            let path = format!("{APP_SERVICE_PREFIX}/users/{}", urlencode(user_id));
            match self.request(a, reqwest::Method::GET, &path, None).await {
                Ok(_) => return true,
                Err(AsRequestError::Status(404, _)) => {}
                Err(e) => {
                    tracing::warn!(appservice = %a.id, user = %user_id, error = %e, "appservice: user query failed")
                }
            }
        }
        false
    }

    /// Asks the application services interested in `alias` whether it exists
    /// (`GET /_matrix/app/v1/rooms/{roomAlias}`); one that answers 200 has created the
    /// room and the alias before answering (spec).
    pub async fn query_alias(&self, alias: &str) -> bool {
        for a in self.list.iter().filter(|a| a.is_interested_in_alias(alias)) {
            if a.url.is_none() {
                continue;
            }
            let path = format!("{APP_SERVICE_PREFIX}/rooms/{}", urlencode(alias));
            match self.request(a, reqwest::Method::GET, &path, None).await {
                Ok(_) => return true,
                Err(AsRequestError::Status(404, _)) => {}
                Err(e) => {
                    tracing::warn!(appservice = %a.id, alias = %alias, error = %e, "appservice: alias query failed")
                }
            }
        }
        false
    }
}

/// Percent-encodes a path segment (everything but unreserved characters).
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// 400 `M_EXCLUSIVE` (spec: an id reserved by an application service).
pub fn exclusive_error(what: &str) -> MatrixError {
    MatrixError::new(
        StatusCode::BAD_REQUEST,
        "M_EXCLUSIVE",
        format!("This {what} is reserved by an application service"),
    )
}

/// Refuses a user id an ordinary client (or another application service) may not
/// register: 400 `M_EXCLUSIVE` when an application service other than `via` holds it.
pub fn check_user_not_exclusive(
    s: &AppState,
    user_id: &str,
    via: Option<&AppService>,
) -> ApiResult<()> {
    match s.appservices.exclusive_user_owner(user_id) {
        Some(owner) if via.is_none_or(|v| v.id != owner.id) => Err(exclusive_error("user ID")),
        _ => Ok(()),
    }
}

/// Refuses an alias the requester may not take or remove: 400 `M_EXCLUSIVE`.
pub fn check_alias_allowed(s: &AppState, r: &Requester, alias: &str) -> ApiResult<()> {
    if s.appservices
        .may_use_alias(alias, &r.user_id, r.appservice.as_deref())
    {
        Ok(())
    } else {
        Err(exclusive_error("alias"))
    }
}

/// A local alias's room: from the `aliases` projection, else (for an alias in an
/// application service's namespace) after asking the application service, which may
/// create the room and alias before it answers.
pub async fn resolve_local_alias(s: &AppState, alias: &str) -> ApiResult<Option<String>> {
    if let Some(t) = s.projections.aliases.resolve(alias) {
        return Ok(Some(t.room_id));
    }
    if s.appservices.query_alias(alias).await {
        // The application service's writes were acknowledged before it answered.
        s.wait_for_acknowledged().await?;
        return Ok(s.projections.aliases.resolve(alias).map(|t| t.room_id));
    }
    Ok(None)
}

/// Whether a local user exists, asking the interested application services about an
/// unknown one (it may register the user before answering).
pub async fn local_user_exists(s: &AppState, user_id: &str) -> ApiResult<bool> {
    if s.projections.accounts.user(user_id).is_some() {
        return Ok(true);
    }
    if s.appservices.query_user(user_id).await {
        s.wait_for_acknowledged().await?;
        return Ok(s.projections.accounts.user(user_id).is_some());
    }
    Ok(false)
}

/// Registers each application service's sender (`@<sender_localpart>:<server>`) that
/// has no account yet (`AccountRegistered`, no password), so it can join rooms and
/// has a profile. Run at start.
pub async fn register_senders(s: &AppState) -> ApiResult<()> {
    for a in s.appservices.all() {
        if s.projections.accounts.user(&a.sender).is_some() {
            continue;
        }
        let localpart = a
            .sender
            .strip_prefix('@')
            .and_then(|u| u.split_once(':'))
            .map(|(l, _)| l.to_owned())
            .unwrap_or_default();
        match crate::account::register_account(s, &a.sender, &localpart, None).await {
            Ok(()) => {
                tracing::info!(appservice = %a.id, sender = %a.sender, "registered the application service's sender")
            }
            // Taken meanwhile (another start): fine.
            Err(e) if e.errcode == "M_USER_IN_USE" => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v1/appservice/{appservice_id}/ping",
            post(ping),
        )
        .route(
            "/_matrix/client/v3/directory/list/appservice/{network_id}/{room_id}",
            put(set_network_visibility),
        )
}

/// The application service behind the request, or 403 `M_FORBIDDEN`.
fn requester_appservice(r: &Requester) -> ApiResult<&Arc<AppService>> {
    r.appservice
        .as_ref()
        .ok_or_else(|| MatrixError::forbidden("Only application services may use this endpoint"))
}

/// `POST /_matrix/client/v1/appservice/{appserviceId}/ping` (spec v1.7): calls the
/// application service's `POST /_matrix/app/v1/ping` with the `transaction_id` and
/// answers the round trip's `duration_ms`. 403 `M_FORBIDDEN` unless the `as_token`
/// is this application service's; 400 `M_URL_NOT_SET` without a url; 502
/// `M_BAD_STATUS` (with `status` and `body`) or `M_CONNECTION_FAILED`; 504
/// `M_CONNECTION_TIMEOUT`.
async fn ping(
    State(s): State<AppState>,
    r: Requester,
    UrlPath(appservice_id): UrlPath<String>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let a = requester_appservice(&r)?;
    if a.id != appservice_id {
        return Err(MatrixError::forbidden(
            "Provided access token is not the appservice's as_token",
        ));
    }
    let txn_id = opt_str(&body, "transaction_id")?;
    if a.url.is_none() {
        return Err(MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_URL_NOT_SET",
            "Application service doesn't have a URL configured",
        ));
    }
    let mut payload = json!({});
    if let Some(t) = txn_id {
        payload["transaction_id"] = json!(t);
    }
    let started = std::time::Instant::now();
    let path = format!("{APP_SERVICE_PREFIX}/ping");
    match s
        .appservices
        .request(a, reqwest::Method::POST, &path, Some(&payload))
        .await
    {
        Ok(_) => Ok(Json(
            json!({ "duration_ms": started.elapsed().as_millis() as u64 }),
        )),
        Err(AsRequestError::Timeout) => Err(MatrixError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "M_CONNECTION_TIMEOUT",
            "Connection to application service timed out",
        )),
        Err(AsRequestError::Status(status, text)) => Err(MatrixError::new(
            StatusCode::BAD_GATEWAY,
            "M_BAD_STATUS",
            format!("Ping returned status {status}"),
        )
        .with_extra(json!({ "status": status, "body": text }))),
        Err(e) => Err(MatrixError::new(
            StatusCode::BAD_GATEWAY,
            "M_CONNECTION_FAILED",
            format!("Ping failed: {e}"),
        )),
    }
}

/// `PUT /_matrix/client/v3/directory/list/appservice/{networkId}/{roomId}`: lists
/// (`public`) or unlists (`private`) a room in the application service's directory
/// for one network, an `AppserviceRoomListed` fact. `GET /publicRooms` with
/// `third_party_instance_id` `<appservice id>|<network id>` (Synapse's instance id)
/// shows that list; `include_all_networks` adds every network's rooms.
async fn set_network_visibility(
    State(s): State<AppState>,
    r: Requester,
    UrlPath((network_id, room_id)): UrlPath<(String, String)>,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let a = requester_appservice(&r)?.clone();
    let visibility = opt_str(&body, "visibility")?
        .ok_or_else(|| MatrixError::missing_param("visibility is required"))?;
    if visibility != "public" && visibility != "private" {
        return Err(MatrixError::bad_json(
            "visibility must be public or private",
        ));
    }
    if s.projections.state.room(&room_id).is_none() {
        return Err(MatrixError::not_found("Room not found"));
    }
    let fact = Fact::AppserviceRoomListed {
        appservice_id: a.id.clone(),
        network_id,
        room_id,
        visibility,
    };
    s.submit(
        &r.user_id,
        Some(r.device_id.as_str()).filter(|d| !d.is_empty()),
        CommandBody::Fact { fact },
    )
    .await?;
    Ok(Json(json!({})))
}

#[cfg(test)]
mod tests {
    use super::*;

    const REG: &str = r#"
id: telegram
url: "http://127.0.0.1:29317/"
as_token: "as-secret"
hs_token: "hs-secret"
sender_localpart: telegrambot
rate_limited: false
de.sorunome.msc2409.push_ephemeral: true
namespaces:
  users:
    - exclusive: true
      regex: '@telegram_.*:example\.org'
    - exclusive: false
      regex: '@shared_.*'
  aliases:
    - exclusive: true
      regex: '#telegram_.*:example\.org'
  rooms: []
"#;

    fn set(regs: &[&str]) -> Result<AppServices, String> {
        let list = regs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                Ok((
                    format!("reg{i}.yaml"),
                    AppService::from_yaml(r, "example.org")?,
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        AppServices::new(list, &AppServiceSettings::default())
    }

    #[test]
    fn namespaces_match_from_the_start_like_synapse() {
        let a = AppService::from_yaml(REG, "example.org").unwrap();
        assert_eq!(a.id, "telegram");
        assert_eq!(a.url.as_deref(), Some("http://127.0.0.1:29317"));
        assert_eq!(a.sender, "@telegrambot:example.org");
        assert!(!a.rate_limited);
        assert!(a.wants_ephemeral() && !a.receive_ephemeral);
        assert!(a.is_exclusive_user("@telegram_123:example.org"));
        assert!(a.is_exclusive_user("@telegrambot:example.org"));
        assert!(!a.is_exclusive_user("@alice:example.org"));
        // Anchored at the start only (Python's re.match): a prefix elsewhere is no match.
        assert!(!a.is_interested_in_user("@xtelegram_1:example.org"));
        assert!(a.is_interested_in_user("@shared_x:example.org"));
        assert!(!a.is_exclusive_user("@shared_x:example.org"));
        assert!(a.is_exclusive_alias("#telegram_chat:example.org"));
        assert!(!a.is_interested_in_alias("#other:example.org"));
        assert!(!a.is_interested_in_room_id("!abc:example.org"));
    }

    #[test]
    fn bad_registrations_name_the_field() {
        let cases = [
            ("id: x\n", "required field `as_token` is missing"),
            (
                "id: x\nas_token: a\nhs_token: h\nsender_localpart: bot\nnamespaces: {}\n",
                "required field `url` is missing",
            ),
            (
                "id: x\nurl: null\nas_token: a\nhs_token: h\nsender_localpart: Bot\nnamespaces: {}\n",
                "`sender_localpart` \"Bot\"",
            ),
            (
                "id: x\nurl: null\nas_token: a\nhs_token: h\nsender_localpart: bot\nnamespaces:\n  users:\n    - regex: '@a.*'\n",
                "`namespaces.users[0].exclusive` must be true or false",
            ),
            (
                "id: x\nurl: null\nas_token: a\nhs_token: h\nsender_localpart: bot\nnamespaces:\n  users:\n    - regex: '@a(('\n      exclusive: true\n",
                "`namespaces.users[0].regex`",
            ),
            (
                "id: x\nurl: ftp://h\nas_token: a\nhs_token: h\nsender_localpart: bot\nnamespaces: {}\n",
                "must be http or https",
            ),
            ("{{{", "not YAML"),
            (
                "id: x\nurl: null\nas_token: a\nhs_token: h\nsender_localpart: bot\n",
                "required field `namespaces` is missing",
            ),
        ];
        for (text, want) in cases {
            let err = AppService::from_yaml(text, "example.org").unwrap_err();
            assert!(err.contains(want), "{text:?}: {err}");
        }
        let ok =
            "id: x\nurl: null\nas_token: a\nhs_token: h\nsender_localpart: bot\nnamespaces: {}\n";
        let a = AppService::from_yaml(ok, "example.org").unwrap();
        assert_eq!(a.url, None);
        assert!(
            a.rate_limited,
            "rate limited unless the registration says otherwise"
        );
    }

    #[test]
    fn tokens_and_ids_are_unique_and_found_by_hash() {
        let s = set(&[REG]).unwrap();
        assert_eq!(s.by_token("as-secret").unwrap().id, "telegram");
        assert!(s.by_token("hs-secret").is_none());
        assert!(s.by_token("as-secre").is_none());
        let other = REG.replace("id: telegram", "id: other");
        assert!(set(&[REG, &other]).unwrap_err().contains("as_token"));
        let same_id = REG.replace("as-secret", "as-2");
        assert!(
            set(&[REG, &same_id])
                .unwrap_err()
                .contains("registered twice")
        );
    }

    #[test]
    fn exclusive_owners_aliases_and_rate_exemptions() {
        let irc = r#"
id: irc
url: null
as_token: irc-as
hs_token: irc-hs
sender_localpart: ircbot
namespaces:
  users:
    - exclusive: false
      regex: '@irc_.*'
  aliases:
    - exclusive: false
      regex: '#telegram_shared.*'
"#;
        let s = set(&[REG, irc]).unwrap();
        assert_eq!(
            s.exclusive_user_owner("@telegram_1:example.org")
                .unwrap()
                .id,
            "telegram"
        );
        assert!(s.exclusive_user_owner("@irc_1:example.org").is_none());
        let tg = s.get("telegram").unwrap().clone();
        let irc = s.get("irc").unwrap().clone();
        // A normal user may not take an exclusive alias; its application service and
        // its sender may; another application service interested in it may too.
        assert!(!s.may_use_alias("#telegram_a:example.org", "@alice:example.org", None));
        assert!(s.may_use_alias("#telegram_a:example.org", "@alice:example.org", Some(&tg)));
        assert!(s.may_use_alias("#telegram_a:example.org", "@telegrambot:example.org", None));
        assert!(!s.may_use_alias("#telegram_a:example.org", "@ircbot:example.org", Some(&irc)));
        assert!(s.may_use_alias(
            "#telegram_shared:example.org",
            "@ircbot:example.org",
            Some(&irc)
        ));
        assert!(s.may_use_alias("#free:example.org", "@alice:example.org", None));
        // Rate limits: senders always exempt; users only with rate_limited: false.
        assert!(s.rate_exempt("@telegram_1:example.org"));
        assert!(s.rate_exempt("@ircbot:example.org"));
        assert!(!s.rate_exempt("@irc_1:example.org"));
        assert!(!s.rate_exempt("@alice:example.org"));
    }
}
