//! The Server-Server API (spec v1.19, "Server-Server API"), served with axum, and the
//! outbound side of federation.
//!
//! What it is:
//! - **Keys** ([`keys`]): our signing key, the key server and notary endpoints, and a
//!   bounded cache of other servers' keys.
//! - **Transport** ([`client`], [`auth`]): server name resolution, outbound TLS trust,
//!   the outbound IP range denylist, X-Matrix request signing and verification.
//! - **Inbound PDUs** ([`transactions`], [`joins`]): every PDU another server sends
//!   becomes a [`spindle_journal::CommandBody::RemotePdu`] command; the journal checks
//!   it and appends it or records why not. This crate never writes anything itself.
//! - **Reads** ([`reads`], [`queries`]): events, state, auth chains, backfill, missing
//!   events, alias and profile queries, from the projections only, each checking that
//!   the asking server may see the room.
//! - **End-to-end encryption** ([`e2ee`]): our users' device and cross-signing keys,
//!   key claims through the journal, device lists with their `stream_id`; and the
//!   calls that ask other servers for theirs.
//! - **The sender** ([`sender`]): a journal consumer that delivers our events,
//!   public receipts, to-device messages and device list changes to every other
//!   server concerned, one queue per destination, with retries; typing and presence
//!   ride along from memory.
//! - **EDUs** ([`edus`]): typing, receipts, presence, to-device messages, device list
//!   and cross-signing updates, both ways.
//!
//! What it is not (yet): joins take the full state (no partial-state joins), and
//! other servers' device lists are not cached; docs/federation.md keeps the list.
//!
//! Invariant: `federation` never imports `api`; both read projections and submit
//! commands to the journal.

pub mod acl;
pub mod auth;
pub mod backfill;
pub mod client;
pub mod devices;
pub mod directory;
pub mod e2ee;
pub mod edus;
pub mod error;
pub mod invites;
pub mod joins;
pub mod keys;
pub mod knocks;
pub mod media;
pub mod outbound;
pub mod partial;
pub mod queries;
pub mod reads;
pub mod sender;
pub mod spaces;
pub mod third_party;
pub mod transactions;

use std::{path::PathBuf, sync::Arc};

use axum::{
    Router,
    extract::State,
    routing::{get, post, put},
};
use serde::{Deserialize, Serialize};
use spindle_core::keys::ServerKey;
use spindle_journal::{CommandBody, CommandEnvelope, Journal, Outcome, SignedCommand};
use spindle_projections::Projections;

pub use client::FederationClient;
pub use error::{FedError, FedResult};
pub use keys::{KEY_VALIDITY_MS, KeyCache, load_or_create_key, server_keys_response};

/// Federation settings (`[federation]` in the config file; every field documented in
/// `spindle.example.toml`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FederationConfig {
    /// Serve the Server-Server API and send to other servers.
    pub enabled: bool,
    /// Address of the TLS federation listener (e.g. `0.0.0.0:8448`); empty: none
    /// (put a TLS reverse proxy in front of `bind` instead).
    pub tls_bind: String,
    /// PEM certificate chain of the TLS listener.
    pub tls_certificate_path: PathBuf,
    /// PEM private key of the TLS listener.
    pub tls_private_key_path: PathBuf,
    /// `m.server` served at `/.well-known/matrix/server` (e.g. `"matrix.example.org:443"`);
    /// empty: not served (404).
    pub well_known_server: String,
    /// Extra PEM CA bundles trusted for outbound federation, beside the system roots.
    pub trusted_ca_files: Vec<PathBuf>,
    /// Accept any certificate on outbound federation. For tests against self-signed
    /// peers only: anyone on the path can impersonate any server with this on.
    pub dangerous_skip_tls_verification_for_tests: bool,
    /// Address ranges (CIDR) outbound federation never connects to.
    pub ip_range_denylist: Vec<String>,
    /// Ranges exempt from the denylist (e.g. `["127.0.0.0/8"]` to federate on loopback).
    pub ip_range_allowlist: Vec<String>,
    /// Notaries asked for a server's keys when the server itself does not answer.
    pub trusted_key_servers: Vec<String>,
    /// Timeout of one outbound request, ms.
    pub request_timeout_ms: u64,
    /// First retry delay after a destination fails, ms (doubles each failure).
    pub retry_initial_ms: u64,
    /// Longest retry delay for a failing destination, ms.
    pub retry_max_ms: u64,
    /// Events of a federated room whose state the journal's fork window remembers: a
    /// remote event forking from further back is resolved against the current state
    /// (SPEC §4b "Forks"). Memory: one persistent-map path per event and room.
    pub fork_window: usize,
    /// Exchange presence with other servers: send our users' presence to the servers
    /// that share a room with them, and accept theirs. Off: no `m.presence` EDU is sent,
    /// and those received are dropped (presence is much of the EDU traffic of big
    /// rooms; many servers turn it off).
    pub presence: bool,
    /// Wait this long (ms) after a partial-state join before fetching the room's full
    /// state (MSC3902). 0, the default, fetches at once; tests set it to observe the
    /// partial state.
    pub partial_state_resync_delay_ms: u64,
    /// Show our users' device display names to other servers (`user/keys/query`'s
    /// `unsigned.device_display_name`, `user/devices/{userId}`'s
    /// `device_display_name`, outbound `m.device_list_update` EDUs). Off by default,
    /// as in Synapse: a device name often says more about its owner than they meant
    /// to tell every server they share a room with.
    pub allow_device_name_lookup_over_federation: bool,
}

impl Default for FederationConfig {
    fn default() -> Self {
        FederationConfig {
            enabled: true,
            tls_bind: String::new(),
            tls_certificate_path: PathBuf::new(),
            tls_private_key_path: PathBuf::new(),
            well_known_server: String::new(),
            trusted_ca_files: Vec::new(),
            dangerous_skip_tls_verification_for_tests: false,
            ip_range_denylist: client::DEFAULT_IP_RANGE_DENYLIST
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ip_range_allowlist: Vec::new(),
            trusted_key_servers: Vec::new(),
            request_timeout_ms: 30_000,
            retry_initial_ms: 1_000,
            retry_max_ms: 3_600_000,
            fork_window: spindle_journal::fork::DEFAULT_FORK_WINDOW,
            presence: true,
            partial_state_resync_delay_ms: 0,
            allow_device_name_lookup_over_federation: false,
        }
    }
}

/// Everything a federation handler needs (cheap to clone).
#[derive(Clone)]
pub struct FedState {
    /// Our signing key.
    pub key: Arc<ServerKey>,
    /// The journal (the only writer).
    pub journal: Journal,
    /// The projections (reads).
    pub projections: Projections,
    /// Outbound requests.
    pub client: FederationClient,
    /// Remote server keys.
    pub keys: KeyCache,
    /// Settings.
    pub config: Arc<FederationConfig>,
    /// `/send` responses by (origin, txn id), for retried transactions.
    pub txns: Arc<parking_lot::Mutex<transactions::TxnCache>>,
    /// The per-origin rate limit of inbound requests (`[rate_limits.federation_origin]`,
    /// kept by the api crate's limiters): called once per authenticated request with
    /// the origin; `Some(retry_after_ms)` refuses it with 429 `M_LIMIT_EXCEEDED`.
    /// `None`: no limit.
    pub origin_limit: Option<OriginLimit>,
    /// Where typing and presence EDUs from other servers go (the api crate's in-memory
    /// state, wired by the binary); `None`: they are dropped.
    pub ephemeral: Option<Arc<dyn edus::EphemeralSink>>,
    /// Remote users whose device list is being fetched ([`devices::spawn_resync`]),
    /// with whether another fetch was asked for meanwhile.
    pub device_resyncs: Arc<parking_lot::Mutex<std::collections::HashMap<String, bool>>>,
    /// When a key query last asked for each remote user's list
    /// ([`devices::refresh_untracked`]).
    pub device_refetched:
        Arc<parking_lot::Mutex<std::collections::HashMap<String, std::time::Instant>>>,
}

/// See [`FedState::origin_limit`].
pub type OriginLimit = Arc<dyn Fn(&str) -> Option<u64> + Send + Sync>;

impl FedState {
    /// Builds the state. Errors on bad trust settings (unreadable CA file, bad CIDR).
    pub fn new(
        key: Arc<ServerKey>,
        journal: Journal,
        projections: Projections,
        config: FederationConfig,
    ) -> Result<FedState, String> {
        let client = FederationClient::new(key.clone(), &config)?;
        let keys = KeyCache::new(
            key.clone(),
            client.clone(),
            config.trusted_key_servers.clone(),
        );
        Ok(FedState {
            key,
            journal,
            projections,
            client,
            keys,
            config: Arc::new(config),
            txns: Arc::default(),
            origin_limit: None,
            ephemeral: None,
            device_resyncs: Arc::default(),
            device_refetched: Arc::default(),
        })
    }

    /// The same state with the per-origin rate limit `limit` (see
    /// [`FedState::origin_limit`]).
    pub fn with_origin_limit(mut self, limit: OriginLimit) -> FedState {
        self.origin_limit = Some(limit);
        self
    }

    /// The same state with typing and presence EDUs from other servers handed to
    /// `sink` (see [`FedState::ephemeral`]).
    pub fn with_ephemeral(mut self, sink: Arc<dyn edus::EphemeralSink>) -> FedState {
        self.ephemeral = Some(sink);
        self
    }

    /// Our server name.
    pub fn server_name(&self) -> &str {
        self.key.server_name()
    }

    /// Signs and submits a command with `principal` (a server name for remote PDUs).
    pub async fn submit(&self, principal: &str, body: CommandBody) -> FedResult<Outcome> {
        Ok(self.submit_journal(principal, body).await?)
    }

    /// [`FedState::submit`] keeping the journal's refusal as it is.
    pub async fn submit_journal(
        &self,
        principal: &str,
        body: CommandBody,
    ) -> Result<Outcome, spindle_journal::JournalError> {
        let envelope = CommandEnvelope {
            principal: principal.to_owned(),
            device_id: None,
            issued_at: now_ms(),
            body,
        };
        let cmd = SignedCommand::sign(&self.key, envelope)
            .map_err(spindle_journal::JournalError::BadJson)?;
        self.journal.submit(cmd).await
    }

    /// [`FedState::submit_journal`] for a run of commands with one durable write
    /// ([`spindle_journal::Journal::submit_batch`]): one result per command, in order.
    pub async fn submit_journal_batch(
        &self,
        principal: &str,
        bodies: Vec<CommandBody>,
    ) -> Vec<Result<Outcome, spindle_journal::JournalError>> {
        let mut results = Vec::with_capacity(bodies.len());
        let mut signed = Vec::with_capacity(bodies.len());
        for body in bodies {
            let envelope = CommandEnvelope {
                principal: principal.to_owned(),
                device_id: None,
                issued_at: now_ms(),
                body,
            };
            match SignedCommand::sign(&self.key, envelope) {
                Ok(cmd) => {
                    signed.push(cmd);
                    results.push(None);
                }
                Err(e) => results.push(Some(Err(spindle_journal::JournalError::BadJson(e)))),
            }
        }
        let mut appended = self.journal.submit_batch(signed).await.into_iter();
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| appended.next().expect("one result per signed command")))
            .collect()
    }

    /// Waits (bounded, 10 s) until the projections have applied `position`.
    pub async fn wait_for(&self, position: u64) -> FedResult<()> {
        if self
            .projections
            .runtime
            .wait_for(position, std::time::Duration::from_secs(10))
            .await
        {
            Ok(())
        } else {
            Err(FedError::internal("projections did not catch up in time"))
        }
    }
}

/// The server part of a user id or room alias (`@a:b.org` -> `b.org`).
pub fn server_of(id: &str) -> Option<&str> {
    id.split_once(':').map(|(_, s)| s)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The key routes alone (served even with federation disabled: clients and tools
/// fetch a server's key).
pub fn key_routes(st: FedState) -> Router {
    Router::new()
        .route("/_matrix/key/v2/server", get(keys::keys))
        .route("/_matrix/key/v2/server/{key_id}", get(keys::keys))
        .route("/_matrix/key/v2/query", post(keys::query_many))
        .route("/_matrix/key/v2/query/{server_name}", get(keys::query_one))
        .with_state(st)
}

/// Every federation request starts once the projections have applied everything
/// acknowledged before it arrived: a server that hears of our event and asks for it
/// (`/event`, `/state_ids`, `/backfill`) must find it.
async fn read_your_writes(
    State(st): State<FedState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let head = st.journal.durable_head();
    if head > st.projections.runtime.applied()
        && let Err(e) = st.wait_for(head).await
    {
        return axum::response::IntoResponse::into_response(e);
    }
    next.run(req).await
}

/// Every Server-Server route this crate serves (see docs/federation.md).
pub fn router(st: FedState) -> Router {
    let well_known = st.config.well_known_server.clone();
    let mut r = Router::new()
        .route("/_matrix/federation/v1/version", get(queries::version))
        .route(
            "/_matrix/federation/v1/3pid/onbind",
            axum::routing::put(third_party::on_bind),
        )
        .route(
            "/_matrix/federation/v1/exchange_third_party_invite/{room_id}",
            axum::routing::put(third_party::exchange),
        )
        .route(
            "/_matrix/federation/v1/query/directory",
            get(queries::directory),
        )
        .route(
            "/_matrix/federation/v1/query/profile",
            get(queries::profile),
        )
        .route(
            "/_matrix/federation/v1/make_join/{room_id}/{user_id}",
            get(joins::make_join),
        )
        .route(
            "/_matrix/federation/v1/send_join/{room_id}/{event_id}",
            put(joins::send_join_v1),
        )
        .route(
            "/_matrix/federation/v2/send_join/{room_id}/{event_id}",
            put(joins::send_join_v2),
        )
        .route(
            "/_matrix/federation/v1/make_leave/{room_id}/{user_id}",
            get(joins::make_leave),
        )
        .route(
            "/_matrix/federation/v1/send_leave/{room_id}/{event_id}",
            put(joins::send_leave_v1),
        )
        .route(
            "/_matrix/federation/v2/send_leave/{room_id}/{event_id}",
            put(joins::send_leave_v2),
        )
        .route(
            "/_matrix/federation/v1/send/{txn_id}",
            put(transactions::send),
        )
        .route(
            "/_matrix/federation/v1/invite/{room_id}/{event_id}",
            put(invites::invite_v1),
        )
        .route(
            "/_matrix/federation/v2/invite/{room_id}/{event_id}",
            put(invites::invite_v2),
        )
        .route("/_matrix/federation/v1/event/{event_id}", get(reads::event))
        .route("/_matrix/federation/v1/state/{room_id}", get(reads::state))
        .route(
            "/_matrix/federation/v1/state_ids/{room_id}",
            get(reads::state_ids),
        )
        .route(
            "/_matrix/federation/v1/event_auth/{room_id}/{event_id}",
            get(reads::event_auth),
        )
        .route(
            "/_matrix/federation/v1/backfill/{room_id}",
            get(reads::backfill),
        )
        .route(
            "/_matrix/federation/v1/get_missing_events/{room_id}",
            post(reads::get_missing_events),
        )
        .route(
            "/_matrix/federation/v1/make_knock/{room_id}/{user_id}",
            get(knocks::make_knock),
        )
        .route(
            "/_matrix/federation/v1/send_knock/{room_id}/{event_id}",
            put(knocks::send_knock),
        )
        .route(
            "/_matrix/federation/v1/publicRooms",
            get(directory::public_rooms_get).post(directory::public_rooms_post),
        )
        .route(
            "/_matrix/federation/v1/hierarchy/{room_id}",
            get(spaces::hierarchy),
        )
        .route(
            "/_matrix/federation/v1/user/keys/query",
            post(e2ee::query_keys),
        )
        .route(
            "/_matrix/federation/v1/user/keys/claim",
            post(e2ee::claim_keys),
        )
        .route(
            "/_matrix/federation/v1/user/devices/{user_id}",
            get(e2ee::user_devices),
        );
    if !well_known.is_empty() {
        r = r.route(
            "/.well-known/matrix/server",
            get(move || async move { axum::Json(serde_json::json!({ "m.server": well_known })) }),
        );
    }
    // Unknown paths fall through to the Client-Server router's `M_UNRECOGNIZED`.
    // Layers run outside-in: the ACL guard sees the projections caught up.
    r.route_layer(axum::middleware::from_fn_with_state(st.clone(), acl::guard))
        .route_layer(axum::middleware::from_fn_with_state(
            st.clone(),
            read_your_writes,
        ))
        .with_state(st.clone())
        .layer(axum::extract::DefaultBodyLimit::max(
            auth::MAX_FEDERATION_BODY_BYTES,
        ))
        .merge(key_routes(st))
}
