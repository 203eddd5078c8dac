//! The Client-Server API (spec v1.19), served with axum.
//!
//! Reads come only from projections ([`spindle_projections::Projections`]); writes go
//! only through signed commands to the journal ([`spindle_journal::Journal`]). A write
//! answers once durable; every authenticated request first waits (bounded) until the
//! projections have applied everything acknowledged so far, so a client's next read
//! sees its write (read-your-writes, BRIEF §3.5) without writers waiting on readers.

pub mod access_log;
pub mod account;
pub mod admin;
pub mod appservice;
pub mod cross_signing;
pub mod delayed;
pub mod devices;
pub mod directory;
pub mod error;
pub mod extract;
pub mod guest;
pub mod hashing;
pub mod json_text;
pub mod key_backup;
pub mod keys;
pub mod lazy_members;
pub mod legacy;
pub mod media;
pub mod metrics;
pub mod mutual_rooms;
pub mod openid;
pub mod presence;
pub mod push;
pub mod ratelimit;
pub mod read;
pub mod relations;
pub mod remote_media;
pub mod reports;
pub mod rooms;
pub mod search;
pub mod sliding;
pub mod spaces;
pub mod state_render;
pub mod synapse_admin;
pub mod sync;
pub mod thirdparty;
pub mod threepid;
pub mod to_device;
pub mod typing;
pub mod uia;
pub mod upgrade;
pub mod visibility;
pub mod voip;

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    Router,
    http::{HeaderValue, Method, header},
    response::IntoResponse,
};
use spindle_core::keys::ServerKey;
use spindle_journal::{CommandBody, CommandEnvelope, Journal, Outcome, SignedCommand};
use spindle_projections::Projections;
use tower_http::cors::{Any, CorsLayer};

pub use error::{ApiResult, MatrixError};

/// How long a request waits for the projections to catch up with acknowledged writes.
pub const READ_YOUR_WRITES_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a request carrying a token from another process of a shared journal
/// (`journal.backend = "nats"`) waits for this process to reach it before the token is
/// refused as being from the future.
pub const SHARED_JOURNAL_TOKEN_WAIT: Duration = Duration::from_secs(10);

/// Longest a request that needs a room's full state (`/members`, `/joined_members`,
/// the whole `/state`, a remote member's event, a membership change of a remote user)
/// waits while the state is partial ([`AppState::wait_for_full_state`]); Synapse waits
/// without a bound.
pub const PARTIAL_STATE_WAIT: Duration = Duration::from_secs(60);

/// API settings (a subset of the server config).
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The server name, e.g. `localhost:8008`.
    pub server_name: String,
    /// Base URL clients should use (served in `/.well-known/matrix/client`).
    pub public_base_url: String,
    /// Open registration with `m.login.dummy`.
    pub registration_open: bool,
    /// Registration tokens accepted with `m.login.registration_token`.
    pub registration_tokens: Vec<String>,
    /// Serve guest accounts (`POST /register?kind=guest`; spec: "Guest Access").
    pub allow_guest_access: bool,
    /// Largest request body, bytes (bigger: 413 `M_TOO_LARGE`).
    pub max_request_bytes: usize,
    /// Largest `/sync` long-poll `timeout`, ms.
    pub max_sync_timeout_ms: u64,
    /// A request body idle this long between chunks is abandoned (408), ms.
    pub request_body_idle_timeout_ms: u64,
    /// Server admins by configuration (user ids); `spindle admin promote` adds more
    /// through the journal.
    pub admins: Vec<String>,
    /// Shared secret of `/_synapse/admin/v1/register`; empty: that endpoint is off.
    pub registration_shared_secret: String,
    /// Lifetime of an access token issued with a refresh token, ms.
    pub refreshable_access_token_lifetime_ms: u64,
    /// Serve presence (`presence.enabled`).
    pub presence_enabled: bool,
    /// The content repository.
    pub media: MediaConfig,
    /// TURN servers for calls (`GET /voip/turnServer`).
    pub voip: voip::VoipConfig,
    /// The body of `GET /.well-known/matrix/support` (`contacts` and/or
    /// `support_page`); `None`: nothing configured, the endpoint answers 404.
    pub support: Option<serde_json::Value>,
    /// The password-hashing pool (`[password_hashing]`).
    pub hashing: hashing::HashingConfig,
    /// Rate limits (`[rate_limits]`).
    pub rate_limits: ratelimit::RateLimitConfig,
    /// Take the client address from the last `X-Forwarded-For` entry (set by a
    /// reverse proxy in front of us) instead of the TCP peer.
    pub trust_x_forwarded_for: bool,
    /// Keep devices' `last_seen_ip` (in memory and in `DeviceSeen` facts).
    pub keep_client_addresses: bool,
    /// Longest delay of a delayed event, ms; 0: delayed events off (MSC4140).
    pub max_event_delay_duration_ms: u64,
    /// Scheduled delayed events per user at most.
    pub max_scheduled_delays_per_user: usize,
    /// Size limits of the in-memory maps.
    pub caches: CacheLimits,
    /// Validation emails of third-party identifiers (`[email]`); `None`: off.
    pub email: Option<threepid::EmailConfig>,
    /// Requests to identity servers (`[identity_servers]`).
    pub identity: threepid::IdentityConfig,
}

/// Size limits of the API's in-memory maps (`[caches]` in the config; docs/operations.md
/// "Memory"). Each map holds at most its limit; what is evicted, and what that costs a
/// client, is said per field. None of them is data: the journal has everything they
/// hold or it is ephemeral by the spec (typing, presence).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheLimits {
    /// Simplified Sliding Sync connections (MSC4186) kept, over all devices; past it the
    /// least recently used connection is forgotten (its next request, with a `pos`,
    /// answers `M_UNKNOWN_POS` and the client starts the connection over).
    pub sliding_sync_connections: usize,
    /// Room types (`m.room.create` `type`) the sliding-sync filters remember; full, the
    /// map is emptied and refilled from the state projection.
    pub sliding_sync_room_types: usize,
    /// Rooms with typing state; full, rooms where nobody types any more are dropped,
    /// and if every room still has a typist a new room's typing notice is not kept.
    pub typing_rooms: usize,
    /// Users with a presence; full, the tenth least recently active are forgotten
    /// (they read as offline until they set a presence again).
    pub presence_users: usize,
    /// Devices whose last use is kept in memory; full, the tenth least recently used
    /// are dropped (their `last_seen_*` falls back to the last journaled `DeviceSeen`,
    /// at most an hour older).
    pub device_last_seen: usize,
    /// `/sync` room summaries cached by state root; full, the cache is emptied.
    pub sync_room_summaries: usize,
    /// Lazy-loading devices whose sent member events `/sync` remembers
    /// ([`lazy_members`]); full, the record is emptied (each device is sent its
    /// timeline senders' member events once more).
    pub sync_lazy_loaded_members_devices: usize,
    /// Bytes of rendered room state (`/state`, `/members`, `/sync` state, sliding sync's
    /// non-member `required_state`) kept by state root
    /// ([`state_render`]); full, the oldest renderings are dropped. 0 turns it off.
    pub rendered_state_bytes: usize,
}

impl Default for CacheLimits {
    fn default() -> Self {
        CacheLimits {
            sliding_sync_connections: 10_000,
            sliding_sync_room_types: 100_000,
            typing_rooms: 10_000,
            presence_users: 100_000,
            device_last_seen: 100_000,
            sync_room_summaries: 10_000,
            sync_lazy_loaded_members_devices: 10_000,
            rendered_state_bytes: 32 * 1024 * 1024,
        }
    }
}

/// Content repository settings (`[media]` in the config).
#[derive(Debug, Clone)]
pub struct MediaConfig {
    /// Where blobs (and the thumbnail cache) live: `<data>/media`.
    pub dir: std::path::PathBuf,
    /// Largest upload, bytes (bigger: 413 `M_TOO_LARGE`).
    pub max_upload_bytes: usize,
    /// Serve `preview_url`.
    pub url_preview: bool,
    /// Let previews fetch private, loopback and link-local addresses.
    pub url_preview_allow_private: bool,
    /// Serve the legacy unauthenticated `/_matrix/media/v3` download, thumbnail,
    /// config and preview endpoints.
    pub legacy_unauthenticated: bool,
    /// Bytes of remote media kept in memory ([`remote_media::RemoteMediaCache`]).
    pub remote_cache_bytes: usize,
}

/// Everything a handler needs: one `Arc` around [`Shared`], so the state each request
/// extracts is one pointer copy (it was some fifty `Arc` counts up and down a request,
/// 5-8% of a small request's CPU). Fields are read through `Deref`.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The fields of [`AppState`].
#[derive(Clone)]
pub struct Shared {
    /// The journal (writes).
    pub journal: Journal,
    /// The projections (reads).
    pub projections: Projections,
    /// The server key (signs command envelopes).
    pub key: Arc<ServerKey>,
    /// Settings.
    pub config: Arc<ApiConfig>,
    /// Ephemeral typing notifications.
    pub typing: typing::Typing,
    /// `/sync` room summaries cached by state root.
    pub summaries: Arc<parking_lot::Mutex<HashMap<[u8; 32], serde_json::Value>>>,
    /// Simplified Sliding Sync connections (MSC4186), in memory.
    pub sliding: Arc<sliding::Connections>,
    /// The member events each lazy-loading device was sent by `/sync`, in memory.
    pub lazy_members: Arc<lazy_members::SentMembers>,
    /// Room states rendered as client JSON, by state root ([`state_render`]).
    pub state_render: state_render::StateRenderCache,
    /// Becomes `true` when the server shuts down: waiting long-polls answer at once.
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    /// When, from where and with what each device was last used (in memory; changes
    /// are journaled as `DeviceSeen`).
    pub last_seen: devices::LastSeen,
    /// Presence (in memory, ephemeral like typing).
    pub presence: presence::Presence,
    /// User-interactive authentication sessions (in memory, ephemeral, bounded).
    pub uia: Arc<uia::UiaSessions>,
    /// Media blobs (content-addressed files).
    pub blobs: Arc<spindle_journal::blobs::BlobStore>,
    /// Media fetched from other servers, in memory (bounded).
    pub remote_media: Arc<remote_media::RemoteMediaCache>,
    /// Federation (remote joins, aliases, profiles); `None` when it is disabled.
    pub federation: Option<spindle_federation::FedState>,
    /// The bounded password-hashing pool (every argon2 hash and check runs there).
    pub hashing: hashing::HashPool,
    /// Rate limiters (token buckets per user, address, room).
    pub rate_limits: Arc<ratelimit::RateLimits>,
    /// Prometheus metrics (served on `[metrics] bind` when enabled).
    pub metrics: Arc<metrics::Metrics>,
    /// The registered application services (`[appservices] registration_files`).
    pub appservices: Arc<appservice::AppServices>,
    /// The next numeric guest localpart, once the first guest registration found it
    /// ([`guest::next_localpart`]).
    pub guest_ids: Arc<parking_lot::Mutex<Option<u64>>>,
    /// Third-party identifiers: validation sessions (in memory, ephemeral, bounded),
    /// the SMTP transport and the identity-server client.
    pub threepids: Arc<threepid::Threepids>,
}

impl AppState {
    /// Builds the state. `shutdown` turning `true` ends every waiting long-poll.
    pub fn new(
        journal: Journal,
        projections: Projections,
        config: ApiConfig,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> AppState {
        let clock = Arc::new(ratelimit::SystemClock::default());
        Self::new_with_clock(journal, projections, config, shutdown, clock)
    }

    /// [`AppState::new`] with the rate limiters on `clock` (tests step a
    /// [`ratelimit::ManualClock`] instead of sleeping).
    pub fn new_with_clock(
        journal: Journal,
        projections: Projections,
        config: ApiConfig,
        shutdown: tokio::sync::watch::Receiver<bool>,
        clock: Arc<dyn ratelimit::Clock>,
    ) -> AppState {
        let rate_limits = Arc::new(ratelimit::RateLimits::new(
            config.rate_limits.clone(),
            clock,
        ));
        let key = journal.key().clone();
        let blobs = Arc::new(spindle_journal::blobs::BlobStore::new(&config.media.dir));
        let hashing = hashing::HashPool::start(&config.hashing);
        let last_seen = devices::LastSeen::with_limit(
            config.keep_client_addresses,
            config.caches.device_last_seen,
        );
        let caches = config.caches.clone();
        let threepids = Arc::new(threepid::Threepids::new(
            config.email.clone(),
            &config.identity,
        ));
        AppState(Arc::new(Shared {
            threepids,
            metrics: Arc::new(metrics::Metrics::new()),
            rate_limits,
            hashing,
            remote_media: Arc::new(remote_media::RemoteMediaCache::new(
                config.media.remote_cache_bytes,
            )),
            blobs,
            journal,
            projections,
            key,
            config: Arc::new(config),
            typing: typing::Typing::with_limit(caches.typing_rooms),
            summaries: Arc::default(),
            state_render: state_render::StateRenderCache::new(caches.rendered_state_bytes),
            lazy_members: Arc::new(lazy_members::SentMembers::with_limit(
                caches.sync_lazy_loaded_members_devices,
            )),
            sliding: Arc::new(sliding::Connections::with_limits(
                caches.sliding_sync_connections,
                caches.sliding_sync_room_types,
            )),
            shutdown,
            last_seen,
            presence: presence::Presence::with_limit(caches.presence_users),
            uia: Arc::default(),
            federation: None,
            appservices: Arc::new(appservice::AppServices::empty()),
            guest_ids: Arc::default(),
        }))
    }

    /// The same state with these application services registered.
    pub fn with_appservices(mut self, appservices: Arc<appservice::AppServices>) -> AppState {
        Arc::make_mut(&mut self.0).appservices = appservices;
        self
    }

    /// The same state with federation on: remote joins, aliases and profiles go
    /// through `fed`.
    pub fn with_federation(mut self, fed: spindle_federation::FedState) -> AppState {
        Arc::make_mut(&mut self.0).federation = Some(fed);
        self
    }

    /// Signs and submits a command as `principal`/`device`. Returns once the records
    /// are durable; it does not wait for the projections (the writer never waits on a
    /// reader, BRIEF §2). Reads wait instead: see [`AppState::wait_for_acknowledged`].
    pub async fn submit(
        &self,
        principal: &str,
        device_id: Option<&str>,
        body: CommandBody,
    ) -> ApiResult<Outcome> {
        let envelope = CommandEnvelope {
            principal: principal.to_owned(),
            device_id: device_id.map(str::to_owned),
            issued_at: now_ms(),
            body,
        };
        let cmd = SignedCommand::sign(&self.key, envelope).map_err(MatrixError::bad_json)?;
        Ok(self.journal.submit(cmd).await?)
    }

    /// [`AppState::submit`] for a run of commands, `(principal, device id, body)` each,
    /// appended with one durable write ([`Journal::submit_batch`]): one result per
    /// command, in the order given; a command that fails (signing, or any refusal of
    /// the journal) fails alone. Returns once every accepted command is durable.
    pub async fn submit_batch(
        &self,
        commands: Vec<(String, Option<String>, CommandBody)>,
    ) -> Vec<ApiResult<Outcome>> {
        let mut results: Vec<Option<ApiResult<Outcome>>> = Vec::with_capacity(commands.len());
        let mut signed = Vec::with_capacity(commands.len());
        for (principal, device_id, body) in commands {
            let envelope = CommandEnvelope {
                principal,
                device_id,
                issued_at: now_ms(),
                body,
            };
            match SignedCommand::sign(&self.key, envelope) {
                Ok(cmd) => {
                    signed.push(cmd);
                    results.push(None);
                }
                Err(e) => results.push(Some(Err(MatrixError::bad_json(e)))),
            }
        }
        let mut appended = self.journal.submit_batch(signed).await.into_iter();
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    appended
                        .next()
                        .expect("one journal result per signed command")
                        .map_err(MatrixError::from)
                })
            })
            .collect()
    }

    /// [`AppState::submit`], then waits until every projection has applied the
    /// command: for writes whose effect the same handler reads (profile propagation),
    /// or that must hold before the answer leaves (a logout revokes its token, a login
    /// answers with a token that works).
    pub async fn submit_and_wait(
        &self,
        principal: &str,
        device_id: Option<&str>,
        body: CommandBody,
    ) -> ApiResult<Outcome> {
        let outcome = self.submit(principal, device_id, body).await?;
        self.wait_for(outcome.position).await?;
        Ok(outcome)
    }

    /// Waits (bounded) until the projections have applied everything acknowledged
    /// before this call: every authenticated request starts with it, so a read sees
    /// every write that was acknowledged before the read began, its own or anyone
    /// else's (BRIEF §3.5, and what users of a single homeserver expect). Costs
    /// nothing when the projections are caught up.
    pub async fn wait_for_acknowledged(&self) -> ApiResult<()> {
        let head = self.journal.durable_head();
        if head > self.projections.runtime.applied() {
            self.wait_for(head).await?;
        }
        Ok(())
    }

    /// Waits (bounded) until the accounts projection (access tokens, devices) has
    /// applied everything acknowledged before this call: a token issued or revoked just
    /// before is seen as such. The only wait of routes that read nothing else
    /// ([`reads_only_its_token`]).
    pub async fn wait_for_tokens(&self) -> ApiResult<()> {
        let head = self.journal.durable_head();
        if self
            .projections
            .runtime
            .wait_for_projection("accounts", head, READ_YOUR_WRITES_TIMEOUT)
            .await
        {
            Ok(())
        } else {
            Err(MatrixError::internal(
                "projections did not catch up in time",
            ))
        }
    }

    /// Waits while the room's state here is partial (a partial-state join, MSC3902:
    /// the state projection flips when it applies the completion), at most
    /// [`PARTIAL_STATE_WAIT`]: how `/members` answers the full member list, as the MSC
    /// says (callers: see [`PARTIAL_STATE_WAIT`]). Returns at once for any other room. After the bound it returns anyway and
    /// the caller answers from the partial state.
    pub async fn wait_for_full_state(&self, room_id: &str) -> ApiResult<()> {
        let deadline = tokio::time::Instant::now() + PARTIAL_STATE_WAIT;
        while self.projections.state.is_partial(room_id) {
            if tokio::time::Instant::now() >= deadline {
                tracing::info!(room = %room_id, "the room's state is still partial; answering from it");
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        // The state projection has the completion; the other projections (the member
        // list of `/joined_members` is the membership projection's) catch up to it too.
        if let Some(position) = self.projections.state.completed_at(room_id) {
            self.wait_for(position).await?;
        }
        Ok(())
    }

    /// Waits (bounded) for the projections to reach `position`.
    pub async fn wait_for(&self, position: u64) -> ApiResult<()> {
        if self
            .projections
            .runtime
            .wait_for(position, READ_YOUR_WRITES_TIMEOUT)
            .await
        {
            Ok(())
        } else {
            Err(MatrixError::internal(
                "projections did not catch up in time",
            ))
        }
    }

    /// Our server name.
    pub fn server_name(&self) -> &str {
        &self.config.server_name
    }

    /// Whether `user_id` (`@localpart:server_name`) names a user of this server: the
    /// part after the first `:` is our server name. Not a validity check.
    pub fn is_local_user(&self, user_id: &str) -> bool {
        user_id
            .split_once(':')
            .is_some_and(|(_, server)| server == self.server_name())
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The whole Client-Server router, with CORS (spec: "Web Browser Clients"), the body
/// limit, and Matrix errors for unknown endpoints and methods.
pub fn router(state: AppState) -> Router {
    let cors = CorsLayer::new()
        .allow_origin(Any)
        .allow_methods([
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::DELETE,
            Method::OPTIONS,
        ])
        .allow_headers([
            header::HeaderName::from_static("x-requested-with"),
            header::CONTENT_TYPE,
            header::AUTHORIZATION,
        ]);
    let limit = state.config.max_request_bytes;
    let media_limit = state.config.media.max_upload_bytes;
    let body_idle = Duration::from_millis(state.config.request_body_idle_timeout_ms);
    Router::new()
        .merge(account::routes())
        .merge(admin::routes())
        .merge(appservice::routes())
        .merge(synapse_admin::routes())
        .merge(devices::routes())
        .merge(presence::routes())
        .merge(directory::routes())
        .merge(spaces::routes())
        .merge(upgrade::routes())
        .merge(reports::routes())
        .merge(rooms::routes())
        .merge(read::routes())
        .merge(search::routes())
        .merge(sync::routes())
        .merge(legacy::routes())
        .merge(sliding::routes())
        .merge(push::routes())
        .merge(delayed::routes())
        .merge(relations::routes())
        .merge(typing::routes())
        .merge(keys::routes())
        .merge(cross_signing::routes())
        .merge(key_backup::routes())
        .merge(media::routes(media_limit, state.config.media.url_preview))
        .merge(to_device::routes())
        .merge(voip::routes())
        .merge(thirdparty::routes())
        .merge(threepid::routes())
        .merge(openid::routes())
        .merge(mutual_rooms::routes())
        .fallback(|| async { MatrixError::unrecognized() })
        .method_not_allowed_fallback(|| async {
            MatrixError::new(
                axum::http::StatusCode::METHOD_NOT_ALLOWED,
                "M_UNRECOGNIZED",
                "Unrecognized request method",
            )
        })
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            read_your_writes,
        ))
        .with_state(state)
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(body_idle))
        .layer(cors)
        .layer(axum::middleware::map_response(matrix_error_bodies))
}

/// Read-your-writes for every served route, authenticated or not (BRIEF §3.5): the
/// request starts only once the projections have applied everything acknowledged
/// before it arrived. Unauthenticated reads (alias resolution, public profiles,
/// `register/available`, the public room list) need it as much as authenticated ones:
/// a client that just created an alias resolves it next. Free when caught up; the
/// `Requester` extractor's own wait is then a no-op.
async fn read_your_writes(
    axum::extract::State(state): axum::extract::State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str());
    // A route that reads only its access token waits in the `Requester` extractor,
    // for the accounts projection alone.
    if !reads_only_its_token(req.method(), route)
        && let Err(e) = state.wait_for_acknowledged().await
    {
        return e.into_response();
    }
    next.run(req).await
}

/// Routes whose handlers read no projection but the access token's owner: a message
/// send (`PUT /rooms/{roomId}/send/{eventType}/{txnId}`; the journal authorizes it
/// against its own write model and deduplicates its transaction id). They wait only
/// for the accounts projection ([`AppState::wait_for_tokens`]), not for every
/// projection to apply what was acknowledged before: a send right after another does
/// not wait for the first one's projections. Read-your-writes is unchanged: it is a
/// property of reads, and every read still waits for every projection.
pub fn reads_only_its_token(method: &Method, route: Option<&str>) -> bool {
    method == Method::PUT
        && route == Some("/_matrix/client/v3/rooms/{room_id}/send/{event_type}/{txn_id}")
}

/// Every error leaves as a Matrix error: responses produced outside our handlers
/// (axum's path decoding, URI too long, HEAD on an unknown path, ...) are rewritten
/// into `{errcode, error}` with their status kept.
async fn matrix_error_bodies(resp: axum::response::Response) -> axum::response::Response {
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let status = resp.status();
    if is_json || !(status.is_client_error() || status.is_server_error()) {
        let mut resp = resp;
        resp.headers_mut()
            .entry(header::CONTENT_TYPE)
            .or_insert(HeaderValue::from_static("application/json"));
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let errcode = match status.as_u16() {
        400 => "M_INVALID_PARAM",
        401 => "M_MISSING_TOKEN",
        404 | 405 => "M_UNRECOGNIZED",
        413 | 414 | 431 => "M_TOO_LARGE",
        _ => "M_UNKNOWN",
    };
    let error = if text.trim().is_empty() {
        status.canonical_reason().unwrap_or("Error").to_owned()
    } else {
        text
    };
    let mut out = MatrixError::new(status, errcode, error).into_response();
    for (k, v) in parts.headers.iter() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}
