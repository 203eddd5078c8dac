//! Server configuration (TOML). Every field has a default, so no file at all is a
//! valid configuration: `localhost:8008` on `127.0.0.1:8008`, data in `./data`, open
//! registration (loopback only). `spindle.example.toml` documents every field; a test
//! fails if one is missing there.

use std::{net::SocketAddr, path::PathBuf};

use serde::{Deserialize, Serialize};

/// The whole configuration.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The server name in user ids and room ids (`@alice:<server_name>`).
    pub server_name: String,
    /// Address and port to listen on.
    pub bind: SocketAddr,
    /// Where the journal, projections and signing key live.
    pub data_dir: PathBuf,
    /// Base URL clients should use; empty means `http://<bind>`.
    pub public_base_url: String,
    /// Registration policy.
    pub registration: Registration,
    /// Request limits.
    pub limits: Limits,
    /// Access-token lifetimes.
    pub sessions: Sessions,
    /// Presence (online/offline status).
    pub presence: Presence,
    /// The content repository.
    pub media: Media,
    /// The full-text search index (`POST /search`).
    pub search: Search,
    /// The journal's write-model snapshots (start-up time).
    pub journal: JournalConfig,
    /// Memory of the embedded storage engine, per database (docs/operations.md,
    /// "Memory"); the stores take it as it is.
    pub storage: spindle_journal::StorageMemory,
    /// Log filter (tracing `EnvFilter` syntax); `RUST_LOG` overrides it.
    pub log: String,
    /// Server admins (full user ids): they may use the admin API
    /// (`/_spindle/admin/v1`). `spindle admin promote` adds admins through the journal.
    pub admins: Vec<String>,
    /// TURN servers handed to clients for calls (`GET /voip/turnServer`).
    pub voip: Voip,
    /// Who to contact about this server (`GET /.well-known/matrix/support`).
    pub support: Support,
    /// Federation with other servers (the Server-Server API), see docs/federation.md.
    pub federation: spindle_federation::FederationConfig,
    /// The bounded password-hashing pool and the argon2 cost of new hashes.
    pub password_hashing: PasswordHashing,
    /// Rate limits (token buckets, modelled on Synapse's `rc_*`).
    pub rate_limits: RateLimits,
    /// What to trust from a reverse proxy in front of the server.
    pub reverse_proxy: ReverseProxy,
    /// Log format, colours and the access log (the filter is `log`).
    pub logging: Logging,
    /// What is kept about devices' use.
    pub devices: Devices,
    /// Prometheus metrics on a listener of their own.
    pub metrics: Metrics,
    /// Push delivery to push gateways (docs/push.md).
    pub push: Push,
    /// Delayed events (MSC4140, docs/push.md "Delayed events").
    pub delayed_events: DelayedEvents,
    /// Application services (bridges, bots; docs/appservices.md).
    pub appservices: AppServicesConfig,
    /// Size limits of the in-memory maps (docs/operations.md, "Memory").
    pub caches: Caches,
    /// Validation emails of third-party identifiers, sent over SMTP (off by default).
    pub email: Email,
    /// Requests to identity servers (3PID binds, unbinds, lookups, third-party invites).
    pub identity_servers: IdentityServers,
}

/// Size limits of the in-memory maps that grow with users or traffic
/// (docs/operations.md, "Memory"); each field says what is evicted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Caches {
    /// Sliding-sync connections over all devices; past it the least recently used is
    /// forgotten (its client starts the connection over after `M_UNKNOWN_POS`).
    pub sliding_sync_connections: usize,
    /// Room types the sliding-sync filters remember (emptied when full).
    pub sliding_sync_room_types: usize,
    /// Rooms with typing state; full, rooms where nobody types are dropped, then new
    /// rooms' typing notices are not kept.
    pub typing_rooms: usize,
    /// Users with a presence; full, the tenth least recently active are forgotten.
    pub presence_users: usize,
    /// Devices whose last use is held in memory; full, the tenth least recently used
    /// are dropped (they show their last journaled `DeviceSeen`).
    pub device_last_seen: usize,
    /// `/sync` room summaries cached by state root (emptied when full).
    pub sync_room_summaries: usize,
    /// Lazy-loading devices whose sent member events `/sync` remembers (emptied when
    /// full: each device is sent its timeline senders' members once more).
    pub sync_lazy_loaded_members_devices: usize,
    /// Bytes of room state rendered for `/state`, `/members`, `/sync` and sliding sync,
    /// kept by state root;
    /// full, the oldest renderings are dropped (0: no cache).
    pub rendered_state_bytes: usize,
    /// Bytes of parsed events kept by id (room lists, `/sync` and sliding sync read the
    /// same state events and newest messages again and again); full, the oldest are
    /// dropped (0: no cache). Counted as each PDU's JSON length plus 512 bytes.
    pub timeline_event_bytes: usize,
    /// Bytes of state-trie nodes kept by hash (every state read walks a path from a
    /// room's state root, and active rooms' paths repeat); full, the oldest are
    /// dropped (0: no cache). Counted as each node's length plus 128 bytes.
    pub state_node_bytes: usize,
}

impl Default for Caches {
    fn default() -> Self {
        let d = spindle_api::CacheLimits::default();
        Caches {
            sliding_sync_connections: d.sliding_sync_connections,
            sliding_sync_room_types: d.sliding_sync_room_types,
            typing_rooms: d.typing_rooms,
            presence_users: d.presence_users,
            device_last_seen: d.device_last_seen,
            sync_room_summaries: d.sync_room_summaries,
            sync_lazy_loaded_members_devices: d.sync_lazy_loaded_members_devices,
            rendered_state_bytes: d.rendered_state_bytes,
            timeline_event_bytes: spindle_projections::timeline::EVENT_CACHE_BYTES,
            state_node_bytes: spindle_projections::state::NODE_CACHE_BYTES,
        }
    }
}

impl Caches {
    /// The API's limits.
    pub fn to_api(&self) -> spindle_api::CacheLimits {
        spindle_api::CacheLimits {
            sliding_sync_connections: self.sliding_sync_connections,
            sliding_sync_room_types: self.sliding_sync_room_types,
            typing_rooms: self.typing_rooms,
            presence_users: self.presence_users,
            device_last_seen: self.device_last_seen,
            sync_room_summaries: self.sync_room_summaries,
            sync_lazy_loaded_members_devices: self.sync_lazy_loaded_members_devices,
            rendered_state_bytes: self.rendered_state_bytes,
        }
    }
}

/// Application services (docs/appservices.md).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AppServicesConfig {
    /// Registration files in Synapse's YAML format (Synapse's
    /// `app_service_config_files`), loaded at start; a bad file stops the server.
    pub registration_files: Vec<PathBuf>,
    /// Timeout of one request to an application service (transactions, user and
    /// alias queries, pings), ms.
    pub request_timeout_ms: u64,
    /// First retry delay after a transaction failed, ms (doubles per failure).
    pub retry_initial_ms: u64,
    /// Longest retry delay, ms. Transactions are retried until they are delivered.
    pub retry_max_ms: u64,
    /// Most room events per transaction (and as many ephemeral and to-device entries;
    /// Synapse's 100).
    pub transaction_events_max: usize,
    /// Address ranges (CIDR) an application service may not be at; the default is the
    /// federation default.
    pub ip_range_denylist: Vec<String>,
    /// Ranges exempt from the denylist: a bridge on the same machine needs
    /// `["127.0.0.1/32", "::1/128"]`.
    pub ip_range_allowlist: Vec<String>,
}

impl Default for AppServicesConfig {
    fn default() -> Self {
        AppServicesConfig {
            registration_files: Vec::new(),
            request_timeout_ms: 30_000,
            retry_initial_ms: 1_000,
            retry_max_ms: 256_000,
            transaction_events_max: 100,
            ip_range_denylist: spindle_federation::client::DEFAULT_IP_RANGE_DENYLIST
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ip_range_allowlist: Vec::new(),
        }
    }
}

impl AppServicesConfig {
    /// The API's outbound settings.
    pub fn to_api(&self) -> spindle_api::appservice::AppServiceSettings {
        spindle_api::appservice::AppServiceSettings {
            request_timeout_ms: self.request_timeout_ms,
            ip_range_denylist: self.ip_range_denylist.clone(),
            ip_range_allowlist: self.ip_range_allowlist.clone(),
        }
    }
}

/// Push delivery to push gateways (docs/push.md).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Push {
    /// Deliver notifications to the HTTP pushers' gateways.
    pub enabled: bool,
    /// Timeout of one notify request, ms.
    pub request_timeout_ms: u64,
    /// First retry delay after a gateway failed, ms (doubles per failure).
    pub retry_initial_ms: u64,
    /// Longest retry delay, ms.
    pub retry_max_ms: u64,
    /// A notification not delivered this long after its event was appended is
    /// dropped (ms; 2 h, about as long as Synapse retries one notification).
    pub max_notification_age_ms: u64,
    /// Notify requests in flight per gateway.
    pub concurrent_requests_per_gateway: usize,
    /// A worker stops adding events to a batch past this many notifications (every
    /// notification of one event always goes in the same batch; nothing is dropped).
    pub batch_notifications_max: usize,
    /// `counts.unread` counts rooms with unread notifications (Synapse's default)
    /// rather than notifications.
    pub group_unread_count_by_room: bool,
    /// Address ranges (CIDR) a push gateway may not be at (Synapse's
    /// `ip_range_blacklist`); the default is the federation default.
    pub ip_range_denylist: Vec<String>,
    /// Ranges exempt from the denylist (Synapse's `ip_range_whitelist`), e.g.
    /// `["127.0.0.1/32"]` for a gateway on loopback.
    pub ip_range_allowlist: Vec<String>,
}

impl Default for Push {
    fn default() -> Self {
        Push {
            enabled: true,
            request_timeout_ms: 10_000,
            retry_initial_ms: 1_000,
            retry_max_ms: 600_000,
            max_notification_age_ms: 7_200_000,
            concurrent_requests_per_gateway: 16,
            batch_notifications_max: 2_000,
            group_unread_count_by_room: true,
            ip_range_denylist: spindle_federation::client::DEFAULT_IP_RANGE_DENYLIST
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ip_range_allowlist: Vec::new(),
        }
    }
}

/// Delayed events (MSC4140).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DelayedEvents {
    /// Longest delay a client may ask for, ms; 0 turns delayed events off (Synapse's
    /// `max_event_delay_duration`, off by default).
    pub max_event_delay_duration_ms: u64,
    /// Scheduled delayed events per user at most (beyond: 429 `M_LIMIT_EXCEEDED`).
    pub max_scheduled_per_user: usize,
}

impl Default for DelayedEvents {
    fn default() -> Self {
        DelayedEvents {
            max_event_delay_duration_ms: 0,
            max_scheduled_per_user: 100,
        }
    }
}

/// Validation emails of third-party identifiers (spec: "Adding Account Administrative
/// Contact Information"): `POST /account/3pid/email/requestToken` and
/// `/register/email/requestToken` send a link through this SMTP server. Off by default:
/// those endpoints then answer 400 `M_THREEPID_MEDIUM_NOT_SUPPORTED`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Email {
    /// Send validation emails (and advertise `m.3pid_changes`).
    pub enabled: bool,
    /// SMTP server host name.
    pub smtp_host: String,
    /// SMTP server port (587: message submission with STARTTLS).
    pub smtp_port: u16,
    /// SMTP AUTH user name; empty: no authentication.
    pub smtp_user: String,
    /// SMTP AUTH password.
    pub smtp_pass: String,
    /// `"starttls"` (plain connection upgraded with STARTTLS, required), `"tls"`
    /// (implicit TLS, usually port 465) or `"none"` (plain text: a relay on loopback
    /// only).
    pub tls: String,
    /// The `From:` of the emails, e.g. `"Example Matrix <noreply@example.org>"`.
    pub notif_from: String,
    /// The name the emails give the server (`%(app)s` in Synapse's templates).
    pub app_name: String,
    /// How long a validation link works after it was sent, ms (Synapse: 1 hour).
    pub validation_token_lifetime_ms: u64,
    /// Timeout of one SMTP exchange, ms.
    pub smtp_timeout_ms: u64,
}

impl Default for Email {
    fn default() -> Self {
        Email {
            enabled: false,
            smtp_host: "localhost".into(),
            smtp_port: 587,
            smtp_user: String::new(),
            smtp_pass: String::new(),
            tls: "starttls".into(),
            notif_from: String::new(),
            app_name: "Matrix".into(),
            validation_token_lifetime_ms: 3_600_000,
            smtp_timeout_ms: 30_000,
        }
    }
}

impl Email {
    /// The api crate's mail settings; `None` when email is off.
    pub fn to_api(&self) -> Option<spindle_api::threepid::EmailConfig> {
        self.enabled.then(|| spindle_api::threepid::EmailConfig {
            smtp_host: self.smtp_host.clone(),
            smtp_port: self.smtp_port,
            smtp_user: self.smtp_user.clone(),
            smtp_pass: self.smtp_pass.clone(),
            tls: match self.tls.as_str() {
                "tls" => spindle_api::threepid::SmtpTls::Implicit,
                "none" => spindle_api::threepid::SmtpTls::None,
                _ => spindle_api::threepid::SmtpTls::StartTls,
            },
            notif_from: self.notif_from.clone(),
            app_name: self.app_name.clone(),
            validation_token_lifetime_ms: self.validation_token_lifetime_ms,
            smtp_timeout_ms: self.smtp_timeout_ms,
        })
    }
}

/// Requests to identity servers (spec: Identity Service API): `/account/3pid/bind`,
/// unbinds, and the lookups and `store-invite` of third-party invites. An identity
/// server is reached at `https://<id_server>`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct IdentityServers {
    /// Timeout of one request to an identity server, ms.
    pub request_timeout_ms: u64,
    /// Address ranges (CIDR) an identity server may not be at; the default is the
    /// federation default.
    pub ip_range_denylist: Vec<String>,
    /// Ranges exempt from the denylist, e.g. `["127.0.0.1/32"]`.
    pub ip_range_allowlist: Vec<String>,
    /// Talk plain `http://` to identity servers. For tests against an identity server
    /// on loopback only: anyone on the path can read and change the requests.
    pub dangerous_plain_http_for_tests: bool,
}

impl Default for IdentityServers {
    fn default() -> Self {
        IdentityServers {
            request_timeout_ms: 10_000,
            ip_range_denylist: spindle_federation::client::DEFAULT_IP_RANGE_DENYLIST
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ip_range_allowlist: Vec::new(),
            dangerous_plain_http_for_tests: false,
        }
    }
}

impl IdentityServers {
    /// The api crate's identity-server settings.
    pub fn to_api(&self) -> spindle_api::threepid::IdentityConfig {
        spindle_api::threepid::IdentityConfig {
            request_timeout_ms: self.request_timeout_ms,
            ip_range_denylist: self.ip_range_denylist.clone(),
            ip_range_allowlist: self.ip_range_allowlist.clone(),
            plain_http: self.dangerous_plain_http_for_tests,
        }
    }
}

/// Prometheus metrics (docs/metrics.md).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Metrics {
    /// Serve `GET /metrics` on `bind`.
    pub enabled: bool,
    /// Address of the metrics listener (keep it private: it is unauthenticated).
    pub bind: SocketAddr,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            enabled: false,
            bind: "127.0.0.1:9090".parse().expect("valid address"),
        }
    }
}

/// Device details kept for `/devices` and `/admin/whois`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Devices {
    /// Keep each device's last client address (`last_seen_ip`), in memory and in the
    /// journal's `DeviceSeen` facts. `false`: no address is kept anywhere (the time and
    /// user agent still are); addresses journaled before stay in the journal.
    pub keep_client_addresses: bool,
}

impl Default for Devices {
    fn default() -> Self {
        Devices {
            keep_client_addresses: true,
        }
    }
}

/// How logs are written (to stderr).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Logging {
    /// `"text"` (one human-readable line per event) or `"json"` (one JSON object per
    /// line: `timestamp`, `level`, `target`, `message` and the event's fields).
    pub format: String,
    /// ANSI colours: `"auto"` (only when stderr is a terminal), `"always"`, `"never"`.
    pub color: String,
    /// One `info` line per request (target `spindle::access`): method, path with
    /// secrets removed, status, duration in ms, user.
    pub access_log: bool,
}

impl Default for Logging {
    fn default() -> Self {
        Logging {
            format: "text".into(),
            color: "auto".into(),
            access_log: true,
        }
    }
}

/// Password hashing (argon2id on a fixed pool of threads with a bounded queue).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PasswordHashing {
    /// Hashing threads: at most this many hashes run at once, each holding
    /// `m_cost_kib` of memory. `0`: the number of cores.
    pub pool_size: usize,
    /// Password checks that may wait for a thread; more at once are answered 429
    /// `M_LIMIT_EXCEEDED` at once, without hashing. At least 1.
    pub queue_len: usize,
    /// argon2id memory cost of new hashes, KiB. Existing hashes keep their own cost.
    pub m_cost_kib: u32,
    /// argon2id iterations of new hashes.
    pub t_cost: u32,
    /// argon2id parallelism (lanes) of new hashes.
    pub p_cost: u32,
}

impl Default for PasswordHashing {
    fn default() -> Self {
        let d = spindle_api::hashing::HashingConfig::default();
        PasswordHashing {
            pool_size: d.pool_size,
            queue_len: d.queue_len,
            m_cost_kib: d.m_cost_kib,
            t_cost: d.t_cost,
            p_cost: d.p_cost,
        }
    }
}

impl PasswordHashing {
    /// The API crate's form of these settings.
    pub fn to_api(&self) -> spindle_api::hashing::HashingConfig {
        spindle_api::hashing::HashingConfig {
            pool_size: self.pool_size,
            queue_len: self.queue_len,
            m_cost_kib: self.m_cost_kib,
            t_cost: self.t_cost,
            p_cost: self.p_cost,
        }
    }
}

/// One token bucket: `burst_count` actions at once, refilled at `per_second`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// Actions regained per second (fractional allowed); `0` turns this limit off.
    pub per_second: f64,
    /// Actions allowed at once from a full bucket (at least 1 when `per_second > 0`).
    pub burst_count: u32,
}

impl Rate {
    /// No limit.
    pub const OFF: Rate = Rate {
        per_second: 0.0,
        burst_count: 0,
    };
}

impl From<spindle_api::ratelimit::Rate> for Rate {
    fn from(r: spindle_api::ratelimit::Rate) -> Self {
        Rate {
            per_second: r.per_second,
            burst_count: r.burst_count,
        }
    }
}

impl From<Rate> for spindle_api::ratelimit::Rate {
    fn from(r: Rate) -> Self {
        spindle_api::ratelimit::Rate::new(r.per_second, r.burst_count)
    }
}

/// Rate limits. Each names the Synapse setting it follows and has Synapse's default.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimits {
    /// Apply rate limits at all (`false` lifts every one).
    pub enabled: bool,
    /// Server admins pass every per-user limit.
    pub exempt_admins: bool,
    /// Buckets kept per limit at most (idle ones are evicted; beyond it new keys share
    /// one bucket).
    pub max_keys: usize,
    /// Events sent and rooms created per user (`rc_message`).
    pub message: Rate,
    /// Login attempts per client address (`rc_login.address`).
    pub login_address: Rate,
    /// Successful logins per account (`rc_login.account`).
    pub login_account: Rate,
    /// Failed logins per account (`rc_login.failed_attempts`).
    pub login_failed_attempts: Rate,
    /// Registrations per client address (`rc_registration`).
    pub registration: Rate,
    /// Registration-token validity checks per address (`rc_registration_token_validity`).
    pub registration_token_validity: Rate,
    /// Validation emails asked for, per client address and per email address
    /// (`rc_3pid_validation`).
    pub threepid_validation: Rate,
    /// Joins per user (`rc_joins.local`).
    pub joins: Rate,
    /// Invites into one room (`rc_invites.per_room`).
    pub invites_per_room: Rate,
    /// Invites received by one user (`rc_invites.per_user`).
    pub invites_per_user: Rate,
    /// Invites sent by one user (`rc_invites.per_issuer`).
    pub invites_per_issuer: Rate,
    /// Media uploads per user.
    pub media_upload: Rate,
    /// Media ids reserved with `POST /_matrix/media/v1/create` per user (`rc_media_create`).
    pub media_create: Rate,
    /// Inbound federation requests per origin server (`rc_federation`, as a bucket).
    pub federation_origin: Rate,
}

impl Default for RateLimits {
    fn default() -> Self {
        let d = spindle_api::ratelimit::RateLimitConfig::default();
        RateLimits {
            enabled: d.enabled,
            exempt_admins: d.exempt_admins,
            max_keys: d.max_keys,
            message: d.message.into(),
            login_address: d.login_address.into(),
            login_account: d.login_account.into(),
            login_failed_attempts: d.login_failed_attempts.into(),
            registration: d.registration.into(),
            registration_token_validity: d.registration_token_validity.into(),
            threepid_validation: d.threepid_validation.into(),
            joins: d.joins.into(),
            invites_per_room: d.invites_per_room.into(),
            invites_per_user: d.invites_per_user.into(),
            invites_per_issuer: d.invites_per_issuer.into(),
            media_upload: d.media_upload.into(),
            media_create: d.media_create.into(),
            federation_origin: d.federation_origin.into(),
        }
    }
}

impl RateLimits {
    /// Every limit with its config key, for validation.
    fn named(&self) -> [(&'static str, Rate); 14] {
        [
            ("message", self.message),
            ("login_address", self.login_address),
            ("login_account", self.login_account),
            ("login_failed_attempts", self.login_failed_attempts),
            ("registration", self.registration),
            (
                "registration_token_validity",
                self.registration_token_validity,
            ),
            ("threepid_validation", self.threepid_validation),
            ("joins", self.joins),
            ("invites_per_room", self.invites_per_room),
            ("invites_per_user", self.invites_per_user),
            ("invites_per_issuer", self.invites_per_issuer),
            ("media_upload", self.media_upload),
            ("media_create", self.media_create),
            ("federation_origin", self.federation_origin),
        ]
    }

    /// The API crate's form of these settings.
    pub fn to_api(&self) -> spindle_api::ratelimit::RateLimitConfig {
        spindle_api::ratelimit::RateLimitConfig {
            enabled: self.enabled,
            exempt_admins: self.exempt_admins,
            max_keys: self.max_keys,
            message: self.message.into(),
            login_address: self.login_address.into(),
            login_account: self.login_account.into(),
            login_failed_attempts: self.login_failed_attempts.into(),
            registration: self.registration.into(),
            registration_token_validity: self.registration_token_validity.into(),
            threepid_validation: self.threepid_validation.into(),
            joins: self.joins.into(),
            invites_per_room: self.invites_per_room.into(),
            invites_per_user: self.invites_per_user.into(),
            invites_per_issuer: self.invites_per_issuer.into(),
            media_upload: self.media_upload.into(),
            media_create: self.media_create.into(),
            federation_origin: self.federation_origin.into(),
        }
    }

    /// Every limit off (what the test harnesses start with).
    pub fn lifted() -> RateLimits {
        RateLimits {
            enabled: false,
            ..RateLimits::default()
        }
    }
}

/// A reverse proxy in front of the server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ReverseProxy {
    /// Take the client address (per-address rate limits, device `last_seen_ip`) from
    /// the last `X-Forwarded-For` entry. Only behind a proxy that sets it: otherwise a
    /// client picks its own address.
    pub trust_x_forwarded_for: bool,
}

/// TURN settings (spec: client-server API "Voice over IP"). Either a shared secret
/// (the TURN REST API coturn and eturnal implement: time-limited credentials) or a
/// static username and password; no `turn_uris` means no TURN server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Voip {
    /// TURN URIs (`turn:` or `turns:`), e.g. `"turn:turn.example.org:3478?transport=udp"`.
    pub turn_uris: Vec<String>,
    /// Secret shared with the TURN server (coturn `static-auth-secret`); empty: none.
    pub turn_shared_secret: String,
    /// Static TURN username (used only without a shared secret).
    pub turn_username: String,
    /// Static TURN password (used only without a shared secret).
    pub turn_password: String,
    /// Lifetime of the credentials handed out, seconds (`ttl`).
    pub turn_ttl_s: u64,
}

impl Default for Voip {
    fn default() -> Self {
        Voip {
            turn_uris: Vec::new(),
            turn_shared_secret: String::new(),
            turn_username: String::new(),
            turn_password: String::new(),
            turn_ttl_s: 86_400,
        }
    }
}

/// Server support information (spec: "Getting the support information for a server").
/// With neither contacts nor a page, `/.well-known/matrix/support` answers 404.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Support {
    /// Contacts: each has a `role` (`m.role.admin`, `m.role.security` or a namespaced
    /// role) and at least one of `matrix_id` and `email_address`.
    pub contacts: Vec<SupportContact>,
    /// A web page with support information; empty: none.
    pub support_page: String,
}

/// One support contact.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SupportContact {
    /// `m.role.admin`, `m.role.security`, or a namespaced role.
    pub role: String,
    /// A Matrix user id to contact; empty: none.
    pub matrix_id: String,
    /// An email address to contact; empty: none.
    pub email_address: String,
}

/// Who may register.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Registration {
    /// Open registration with `m.login.dummy`. `"auto"` (default): open when bound to a
    /// loopback address, closed otherwise; `"open"`; `"closed"`.
    pub mode: String,
    /// Must be `true` to run open registration on a non-loopback address.
    pub allow_open_registration_on_public_bind: bool,
    /// Registration tokens accepted with `m.login.registration_token`.
    pub tokens: Vec<String>,
    /// Shared secret for `/_synapse/admin/v1/register` (HMAC-SHA1, as Synapse's
    /// `registration_shared_secret`); empty (default): that endpoint is off.
    pub shared_secret: String,
    /// Serve guest accounts (spec: "Guest Access"; Synapse's `allow_guest_access`):
    /// `POST /register?kind=guest`. Off (default): that answers 403 `M_FORBIDDEN`.
    /// Guests registered while it was on keep their (restricted) access.
    pub allow_guest_access: bool,
}

/// Limits on what clients may send or ask for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body in bytes (larger: 413 `M_TOO_LARGE`). Events are further
    /// capped at 65536 bytes by the spec.
    pub max_request_bytes: usize,
    /// Largest `/sync` long-poll `timeout` honoured, in milliseconds.
    pub max_sync_timeout_ms: u64,
    /// A request body that stalls this long between chunks is abandoned with 408
    /// (a client that declares more than it sends must not hold a connection forever).
    pub request_body_idle_timeout_ms: u64,
}

/// Session settings (spec: "Refreshing access tokens").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Sessions {
    /// Lifetime of an access token issued with a refresh token (a client that asked
    /// for `refresh_token: true`), ms. Tokens issued without one never expire.
    pub refreshable_access_token_lifetime_ms: u64,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions {
            refreshable_access_token_lifetime_ms: 300_000,
        }
    }
}

/// Content repository settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Media {
    /// Largest media upload in bytes (larger: 413 `M_TOO_LARGE`).
    pub max_upload_bytes: usize,
    /// Serve URL previews (`preview_url`). Off by default: the server fetches what
    /// clients ask for.
    pub url_preview: bool,
    /// Let URL previews fetch private, loopback and link-local addresses.
    pub url_preview_allow_private: bool,
    /// Serve the legacy unauthenticated `/_matrix/media/v3` download and thumbnail
    /// endpoints (the spec lets servers freeze them).
    pub legacy_unauthenticated: bool,
    /// Bytes of media fetched from other servers kept in memory (files and
    /// thumbnails; oldest evicted first; `0`: nothing is cached). One remote file may
    /// be at most `max_upload_bytes` (larger: 502 `M_TOO_LARGE`).
    pub remote_cache_bytes: usize,
}

impl Default for Media {
    fn default() -> Self {
        Media {
            max_upload_bytes: 50 * 1024 * 1024,
            url_preview: false,
            url_preview_allow_private: false,
            legacy_unauthenticated: true,
            remote_cache_bytes: 64 * 1024 * 1024,
        }
    }
}

/// Presence settings (spec: "Presence").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Presence {
    /// Serve presence. Off: `PUT .../status` is accepted and ignored, `GET` answers
    /// `offline`, and `/sync` carries no presence events.
    pub enabled: bool,
}

impl Default for Presence {
    fn default() -> Self {
        Presence { enabled: true }
    }
}

/// Search index settings (`POST /search`, the `search` projection).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Search {
    /// Heap budget of the index writer, bytes: documents are buffered up to this much
    /// before they are flushed to a segment. At least 15000000 (tantivy's minimum).
    pub writer_heap_bytes: usize,
}

/// Journal settings: how often the write models are snapshotted (docs/operations.md
/// "Start-up cost").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct JournalConfig {
    /// Records between write-model snapshots: a start-up that replayed at least this
    /// many saves one, and while serving one is taken in the background each time this
    /// many records were appended since the last. A restart replays at most about this
    /// many records (plus what was appended while the last snapshot was being taken).
    /// 0: never save one (a stored one is still used).
    pub snapshot_every_records: u64,
    /// Client transaction ids held in memory (the most recent; at least 1024). Every
    /// one is also in the journal's on-disk index, so a retry of an older one still
    /// gets its first answer (one index read and one record read).
    pub txn_ids_cached: usize,
    /// Where the journal lives: `embedded` (the default: fjall in `<data_dir>/journal`,
    /// fsync before acknowledgement) or `nats` (a NATS JetStream stream several Spindle
    /// processes share, `[journal.nats]`; docs/scale-out.md).
    pub backend: JournalBackend,
    /// The JetStream stream and this process's part in it (`backend = "nats"` only).
    pub nats: spindle_journal::NatsOptions,
}

/// `journal.backend`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum JournalBackend {
    /// The embedded fjall journal.
    #[default]
    Embedded,
    /// A NATS JetStream stream ([`spindle_journal::nats`]).
    Nats,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            snapshot_every_records: spindle_journal::snapshot::DEFAULT_SNAPSHOT_EVERY_RECORDS,
            txn_ids_cached: spindle_journal::txn::DEFAULT_TXN_IDS_CACHED,
            backend: JournalBackend::Embedded,
            nats: spindle_journal::NatsOptions::default(),
        }
    }
}

impl Default for Search {
    fn default() -> Self {
        Search {
            writer_heap_bytes: spindle_projections::search::WRITER_HEAP_BYTES_DEFAULT,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            server_name: "localhost:8008".into(),
            bind: "127.0.0.1:8008".parse().expect("valid address"),
            data_dir: PathBuf::from("./data"),
            public_base_url: String::new(),
            registration: Registration::default(),
            limits: Limits::default(),
            sessions: Sessions::default(),
            presence: Presence::default(),
            media: Media::default(),
            search: Search::default(),
            journal: JournalConfig::default(),
            storage: spindle_journal::StorageMemory::default(),
            log: "info,fjall=warn,lsm_tree=warn,ruma_state_res=warn,tantivy=warn".into(),
            admins: Vec::new(),
            voip: Voip::default(),
            support: Support::default(),
            federation: spindle_federation::FederationConfig::default(),
            password_hashing: PasswordHashing::default(),
            rate_limits: RateLimits::default(),
            reverse_proxy: ReverseProxy::default(),
            logging: Logging::default(),
            devices: Devices::default(),
            metrics: Metrics::default(),
            push: Push::default(),
            delayed_events: DelayedEvents::default(),
            appservices: AppServicesConfig::default(),
            caches: Caches::default(),
            email: Email::default(),
            identity_servers: IdentityServers::default(),
        }
    }
}

impl Default for Registration {
    fn default() -> Self {
        Registration {
            mode: "auto".into(),
            allow_open_registration_on_public_bind: false,
            tokens: Vec::new(),
            shared_secret: String::new(),
            allow_guest_access: false,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_request_bytes: 1024 * 1024,
            max_sync_timeout_ms: 60_000,
            request_body_idle_timeout_ms: 30_000,
        }
    }
}

impl Config {
    /// Parses TOML. Unknown fields are errors (a typo must not silently fall back).
    pub fn from_toml(text: &str) -> Result<Config, String> {
        let c: Config = toml::from_str(text).map_err(|e| e.to_string())?;
        c.validate()?;
        Ok(c)
    }

    /// Whether open (`m.login.dummy`) registration is on.
    pub fn registration_open(&self) -> bool {
        match self.registration.mode.as_str() {
            "open" => true,
            "closed" => false,
            _ => self.bind.ip().is_loopback(),
        }
    }

    /// Checks the rules a config must satisfy to start: a valid server name, a known
    /// registration mode, and no open registration on a public address without the
    /// explicit opt-in.
    pub fn validate(&self) -> Result<(), String> {
        if ruma::ServerName::parse(&self.server_name).is_err() {
            return Err(format!(
                "server_name {:?} is not a valid server name",
                self.server_name
            ));
        }
        if !["auto", "open", "closed"].contains(&self.registration.mode.as_str()) {
            return Err(format!(
                "registration.mode must be auto, open or closed (got {:?})",
                self.registration.mode
            ));
        }
        if self.registration_open()
            && !self.bind.ip().is_loopback()
            && !self.registration.allow_open_registration_on_public_bind
        {
            return Err(format!(
                "refusing to start: open registration on the non-loopback address {} lets anyone create accounts. \
                 Set registration.allow_open_registration_on_public_bind = true to allow it, or use registration.tokens \
                 with registration.mode = \"closed\"",
                self.bind
            ));
        }
        let fed = &self.federation;
        if !fed.tls_bind.is_empty() {
            if fed.tls_bind.parse::<SocketAddr>().is_err() {
                return Err(format!(
                    "federation.tls_bind {:?} is not an address:port",
                    fed.tls_bind
                ));
            }
            if fed.tls_certificate_path.as_os_str().is_empty()
                || fed.tls_private_key_path.as_os_str().is_empty()
            {
                return Err(
                    "federation.tls_bind needs federation.tls_certificate_path and federation.tls_private_key_path"
                        .into(),
                );
            }
        }
        spindle_federation::client::IpPolicy::new(&fed.ip_range_denylist, &fed.ip_range_allowlist)
            .map_err(|e| format!("federation: {e}"))?;
        spindle_federation::client::IpPolicy::new(
            &self.push.ip_range_denylist,
            &self.push.ip_range_allowlist,
        )
        .map_err(|e| format!("push: {e}"))?;
        if self.search.writer_heap_bytes < spindle_projections::search::WRITER_HEAP_BYTES_MIN {
            return Err(format!(
                "search.writer_heap_bytes must be at least {} (got {})",
                spindle_projections::search::WRITER_HEAP_BYTES_MIN,
                self.search.writer_heap_bytes
            ));
        }
        if self.journal.backend == JournalBackend::Nats {
            self.journal.nats.validate()?;
        }
        if self.storage.memtable_bytes < spindle_journal::StorageMemory::MEMTABLE_MIN {
            return Err(format!(
                "storage.memtable_bytes must be at least {} (got {})",
                spindle_journal::StorageMemory::MEMTABLE_MIN,
                self.storage.memtable_bytes
            ));
        }
        if self.storage.write_ahead_bytes < spindle_journal::StorageMemory::WRITE_AHEAD_MIN {
            return Err(format!(
                "storage.write_ahead_bytes must be at least {} (got {})",
                spindle_journal::StorageMemory::WRITE_AHEAD_MIN,
                self.storage.write_ahead_bytes
            ));
        }
        if self.registration.tokens.iter().any(|t| t.trim().is_empty()) {
            return Err("registration.tokens must not contain empty tokens".into());
        }
        let url = &self.public_base_url;
        if !url.is_empty() && !url.starts_with("http://") && !url.starts_with("https://") {
            return Err(format!(
                "public_base_url must start with http:// or https:// (got {:?})",
                self.public_base_url
            ));
        }
        if self.limits.request_body_idle_timeout_ms == 0 {
            return Err("limits.request_body_idle_timeout_ms must be positive".into());
        }
        if self.sessions.refreshable_access_token_lifetime_ms < 1_000 {
            return Err(
                "sessions.refreshable_access_token_lifetime_ms must be at least 1000".into(),
            );
        }
        if self.limits.max_request_bytes < 65_536 {
            return Err("limits.max_request_bytes must be at least 65536".into());
        }
        let voip = &self.voip;
        if let Some(bad) = voip
            .turn_uris
            .iter()
            .find(|u| !u.starts_with("turn:") && !u.starts_with("turns:"))
        {
            return Err(format!(
                "voip.turn_uris entries must start with turn: or turns: (got {bad:?})"
            ));
        }
        if !voip.turn_uris.is_empty()
            && voip.turn_shared_secret.is_empty()
            && (voip.turn_username.is_empty() || voip.turn_password.is_empty())
        {
            return Err(
                "voip.turn_uris needs voip.turn_shared_secret, or voip.turn_username and voip.turn_password"
                    .into(),
            );
        }
        if voip.turn_ttl_s == 0 {
            return Err("voip.turn_ttl_s must be positive".into());
        }
        if !["text", "json"].contains(&self.logging.format.as_str()) {
            return Err(format!(
                "logging.format must be text or json (got {:?})",
                self.logging.format
            ));
        }
        if !["auto", "always", "never"].contains(&self.logging.color.as_str()) {
            return Err(format!(
                "logging.color must be auto, always or never (got {:?})",
                self.logging.color
            ));
        }
        self.password_hashing.to_api().params()?;
        if self.password_hashing.queue_len == 0 {
            return Err("password_hashing.queue_len must be at least 1".into());
        }
        if self.password_hashing.pool_size > 1024 {
            return Err("password_hashing.pool_size must be at most 1024".into());
        }
        for (name, r) in self.rate_limits.named() {
            if !r.per_second.is_finite() || r.per_second < 0.0 {
                return Err(format!(
                    "rate_limits.{name}.per_second must be a non-negative number (0 turns the limit off)"
                ));
            }
            if r.per_second > 0.0 && r.burst_count == 0 {
                return Err(format!(
                    "rate_limits.{name}.burst_count must be at least 1 (or set per_second = 0 to turn the limit off)"
                ));
            }
        }
        if self.rate_limits.max_keys == 0 {
            return Err("rate_limits.max_keys must be at least 1".into());
        }
        let email = &self.email;
        if !["starttls", "tls", "none"].contains(&email.tls.as_str()) {
            return Err(format!(
                "email.tls must be starttls, tls or none (got {:?})",
                email.tls
            ));
        }
        if email.enabled {
            if email.smtp_host.is_empty() {
                return Err("email.enabled needs email.smtp_host".into());
            }
            if !spindle_api::threepid::valid_mailbox(&email.notif_from) {
                return Err(format!(
                    "email.notif_from must be an address such as \"Example <noreply@example.org>\" (got {:?})",
                    email.notif_from
                ));
            }
        }
        if let Some(api) = email.to_api() {
            spindle_api::threepid::check_email_config(&api).map_err(|e| format!("email: {e}"))?;
        }
        if email.validation_token_lifetime_ms < 60_000 {
            return Err("email.validation_token_lifetime_ms must be at least 60000".into());
        }
        if email.smtp_timeout_ms == 0 || self.identity_servers.request_timeout_ms == 0 {
            return Err(
                "email.smtp_timeout_ms and identity_servers.request_timeout_ms must be positive"
                    .into(),
            );
        }
        spindle_federation::client::IpPolicy::new(
            &self.identity_servers.ip_range_denylist,
            &self.identity_servers.ip_range_allowlist,
        )
        .map_err(|e| format!("identity_servers: {e}"))?;
        for c in &self.support.contacts {
            if c.role.is_empty() || (c.matrix_id.is_empty() && c.email_address.is_empty()) {
                return Err(
                    "support.contacts entries need a role and a matrix_id or an email_address"
                        .into(),
                );
            }
            if !c.matrix_id.is_empty() && ruma::UserId::parse(&c.matrix_id).is_err() {
                return Err(format!(
                    "support.contacts: {:?} is not a user id",
                    c.matrix_id
                ));
            }
        }
        Ok(())
    }

    /// The base URL clients should use: `public_base_url`, else `http://<bind>` for a
    /// specific address, else (bound to all interfaces) `https://<server_name>` as
    /// Synapse assumes.
    pub fn base_url(&self) -> String {
        if !self.public_base_url.is_empty() {
            self.public_base_url.clone()
        } else if self.bind.ip().is_unspecified() {
            format!("https://{}", self.server_name)
        } else {
            format!("http://{}", self.bind)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_paths(v: &toml::Value, prefix: &str, out: &mut Vec<String>) {
        if let toml::Value::Table(t) = v {
            for (k, v) in t {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.push(path.clone());
                key_paths(v, &path, out);
            }
        }
    }

    #[test]
    fn example_config_documents_every_field() {
        let example =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/spindle.example.toml"))
                .unwrap();
        let mut parsed =
            Config::from_toml(&example).expect("the example config parses and validates");
        // The one deliberate difference: the example turns delayed events on (as
        // Synapse's sample config does); the default is off.
        assert_eq!(
            parsed.delayed_events.max_event_delay_duration_ms,
            86_400_000
        );
        parsed.delayed_events.max_event_delay_duration_ms = 0;
        assert_eq!(parsed, Config::default(), "the example shows the defaults");
        let mut want = Vec::new();
        key_paths(
            &toml::Value::try_from(Config::default()).unwrap(),
            "",
            &mut want,
        );
        let mut have = Vec::new();
        key_paths(
            &toml::from_str::<toml::Value>(&example).unwrap(),
            "",
            &mut have,
        );
        for field in &want {
            assert!(
                have.contains(field),
                "config field `{field}` is missing from spindle.example.toml"
            );
        }
        assert_eq!(want.len(), 182);
    }

    #[test]
    fn storage_settings_below_the_engine_minimums_are_refused() {
        let err = Config::from_toml("[storage]\nmemtable_bytes = 1000\n").unwrap_err();
        assert!(
            err.contains("storage.memtable_bytes must be at least 1048576 (got 1000)"),
            "{err}"
        );
        let err = Config::from_toml("[storage]\nwrite_ahead_bytes = 67108863\n").unwrap_err();
        assert!(
            err.contains("storage.write_ahead_bytes must be at least 67108864 (got 67108863)"),
            "{err}"
        );
        let ok = Config::from_toml("[storage]\nblock_cache_bytes = 0\n").unwrap();
        assert_eq!(ok.storage.block_cache_bytes, 0);
        assert_eq!(ok.storage.memtable_bytes, 8 * 1024 * 1024);
    }

    #[test]
    fn open_registration_on_public_bind_needs_opt_in() {
        let err = Config::from_toml("bind = \"0.0.0.0:8008\"\n[registration]\nmode = \"open\"\n")
            .unwrap_err();
        assert!(err.contains("refusing to start"), "{err}");
        // auto mode on a public bind means closed: starts fine.
        let c = Config::from_toml("bind = \"0.0.0.0:8008\"\n").unwrap();
        assert!(!c.registration_open());
        let c = Config::from_toml("bind = \"0.0.0.0:8008\"\n[registration]\nmode = \"open\"\nallow_open_registration_on_public_bind = true\n").unwrap();
        assert!(c.registration_open());
        assert!(Config::default().registration_open());
        assert!(Config::from_toml("typo = 1\n").is_err());
        assert!(Config::from_toml("[registration]\ntokens = [\"a\", \"\"]\n").is_err());
        assert!(Config::from_toml("public_base_url = \"not a url\"\n").is_err());
    }
}
