//! Outbound federation requests: server name resolution, trust, the IP range denylist
//! and X-Matrix request signing (spec: server-server API, "Resolving server names",
//! "Request Authentication").
//!
//! Resolution follows the spec's order ("Resolving server names", steps 1-6): an IP
//! literal or an explicit port is used as is; otherwise
//! `https://<host>/.well-known/matrix/server` may delegate to another host (used as is
//! when it is an IP literal or has a port). The well-known fetch follows up to
//! [`WELL_KNOWN_MAX_REDIRECTS`] redirects, to `https` URLs only, each address checked
//! against the denylist like any other; its body is at most [`WELL_KNOWN_MAX_BYTES`].
//! An answer is cached for its `Cache-Control: max-age` or `Expires` lifetime, 24 h
//! without one, and within [5 min, 48 h] either way (`no-store`: 5 min); a failure
//! (no answer, not 200, not JSON, no `m.server`) is cached for an hour. Then
//! otherwise the SRV records `_matrix-fed._tcp.<host>`, then the deprecated
//! `_matrix._tcp.<host>` (of the delegated host when there was a delegation) name the
//! target and port; otherwise port 8448. With an SRV target the request still goes to
//! `https://<host>:<port>` with `Host: <host>` and the certificate checked for `<host>`:
//! only the address connected to is the target's (the DNS resolver maps `<host>` to
//! it). SRV answers are cached for an hour (at most [`SRV_CACHE_MAX`] names); among
//! the records the lowest priority wins, then the highest weight (no weighted random
//! choice). A hostname used both as a server name without a port (with an SRV record)
//! and with an explicit port connects to the SRV target in both cases.
//!
//! Every address a request is about to connect to is checked against the denylist
//! (private, loopback, link-local and other special ranges by default, as Synapse's
//! `federation_ip_range_blacklist`), after DNS resolution, so a name that resolves to a
//! private address is refused too. The allowlist punches holes in it (tests federate on
//! loopback with `127.0.0.0/8` allowed).

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use ipnet::IpNet;
use spindle_core::keys::ServerKey;

use crate::FederationConfig;

/// Errors of an outbound request.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The destination resolves only to denied addresses, or cannot be resolved.
    #[error("destination {0} is not allowed: {1}")]
    Denied(String, String),
    /// Connection, TLS or timeout failure.
    #[error("request to {0} failed: {1}")]
    Transport(String, String),
    /// The remote answered with an error status.
    #[error("{server} answered {status}: {body}")]
    Status {
        /// Destination.
        server: String,
        /// HTTP status.
        status: u16,
        /// Response body (truncated).
        body: String,
    },
    /// The response was not the JSON expected.
    #[error("bad response from {0}: {1}")]
    BadResponse(String, String),
    /// The response body is larger than the caller's limit.
    #[error("{0} answered more than {1} bytes")]
    TooLarge(String, usize),
}

/// The default outbound denylist: every range that is not the public internet.
pub const DEFAULT_IP_RANGE_DENYLIST: &[&str] = &[
    "127.0.0.0/8",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "192.0.0.0/24",
    "169.254.0.0/16",
    "192.88.99.0/24",
    "198.18.0.0/15",
    "192.0.2.0/24",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "0.0.0.0/8",
    "::1/128",
    "fe80::/10",
    "fc00::/7",
    "2001:db8::/32",
    "ff00::/8",
    "fec0::/10",
    "::/128",
];

/// Which addresses outbound federation may connect to.
#[derive(Debug, Clone)]
pub struct IpPolicy {
    deny: Vec<IpNet>,
    allow: Vec<IpNet>,
}

impl IpPolicy {
    /// Parses CIDR lists. Errors name the entry that is not a CIDR range.
    pub fn new(deny: &[String], allow: &[String]) -> Result<IpPolicy, String> {
        let parse = |list: &[String]| -> Result<Vec<IpNet>, String> {
            list.iter()
                .map(|s| {
                    s.parse::<IpNet>()
                        .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                        .map_err(|_| format!("{s:?} is not an IP range (CIDR)"))
                })
                .collect()
        };
        Ok(IpPolicy {
            deny: parse(deny)?,
            allow: parse(allow)?,
        })
    }

    /// Whether connecting to `ip` is allowed.
    pub fn allows(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        self.allow.iter().any(|n| n.contains(&ip)) || !self.deny.iter().any(|n| n.contains(&ip))
    }
}

/// Hostnames whose connections go to an SRV target instead (hostname -> target).
type SrvTargets = Arc<parking_lot::Mutex<HashMap<String, String>>>;

/// A reqwest DNS resolver that drops the addresses `policy` denies (push gateways use
/// it too: one policy mechanism for every outbound request).
pub fn filtering_resolver(policy: Arc<IpPolicy>) -> Arc<FilteringResolver> {
    Arc::new(FilteringResolver {
        policy,
        srv_targets: None,
    })
}

/// A DNS resolver for reqwest that drops denied addresses (no DNS rebinding around
/// the denylist) and, for federation, connects hostnames with an SRV target to that
/// target.
pub struct FilteringResolver {
    policy: Arc<IpPolicy>,
    srv_targets: Option<SrvTargets>,
}

impl reqwest::dns::Resolve for FilteringResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        let target = self
            .srv_targets
            .as_ref()
            .and_then(|m| m.lock().get(name.as_str()).cloned());
        Box::pin(async move {
            let host = target.unwrap_or_else(|| name.as_str().to_owned());
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| policy.allows(a.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(format!("{host} resolves to no allowed address").into());
            }
            let it: reqwest::dns::Addrs = Box::new(addrs.into_iter());
            Ok(it)
        })
    }
}

/// Where to send requests for a server name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// `https://host:port` to connect to.
    pub base_url: String,
    /// The `Host` header to send when it is not the URL's authority (an SRV target's
    /// port is in the URL; the header names the host alone).
    pub host_header: Option<String>,
    /// The SRV target connected to, if an SRV record was used.
    pub srv_target: Option<String>,
}

impl Resolved {
    fn direct(base_url: String) -> Resolved {
        Resolved {
            base_url,
            host_header: None,
            srv_target: None,
        }
    }
}

/// One SRV record: target host, port, priority and weight (RFC 2782).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SrvRecord {
    /// Target host (no trailing dot; `.` means "no service").
    pub target: String,
    /// Port.
    pub port: u16,
    /// Lower is preferred.
    pub priority: u16,
    /// Higher is preferred among equal priorities.
    pub weight: u16,
}

/// Looks up SRV records by full name (e.g. `_matrix-fed._tcp.example.org`). The
/// system resolver ([`SystemSrvResolver`]) is the default; tests inject their own.
pub trait SrvResolver: Send + Sync {
    /// The records of `name`; empty when there are none or the lookup failed.
    fn lookup(
        &self,
        name: String,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<SrvRecord>> + Send + '_>>;
}

/// SRV lookups with hickory-resolver and the system's DNS settings (`/etc/resolv.conf`);
/// without readable settings no SRV record is ever found.
pub struct SystemSrvResolver {
    resolver: Option<hickory_resolver::TokioResolver>,
}

impl SystemSrvResolver {
    /// Reads the system's DNS settings.
    pub fn new() -> SystemSrvResolver {
        let resolver = hickory_resolver::TokioResolver::builder_tokio()
            .map(|b| b.build())
            .map_err(|e| tracing::warn!(error = %e, "no DNS settings: SRV lookups are off"))
            .ok();
        SystemSrvResolver { resolver }
    }
}

impl Default for SystemSrvResolver {
    fn default() -> Self {
        SystemSrvResolver::new()
    }
}

impl SrvResolver for SystemSrvResolver {
    fn lookup(
        &self,
        name: String,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<SrvRecord>> + Send + '_>> {
        Box::pin(async move {
            let Some(r) = &self.resolver else {
                return vec![];
            };
            match r.srv_lookup(name.as_str()).await {
                Ok(found) => found
                    .iter()
                    .map(|srv| SrvRecord {
                        target: srv.target().to_utf8().trim_end_matches('.').to_owned(),
                        port: srv.port(),
                        priority: srv.priority(),
                        weight: srv.weight(),
                    })
                    .collect(),
                Err(_) => vec![],
            }
        })
    }
}

/// The record to use: lowest priority, then highest weight, then target and port (a
/// stable choice); `None` when there is none or the best is `.` ("no service").
pub fn pick_srv(records: &[SrvRecord]) -> Option<SrvRecord> {
    let best = records.iter().min_by(|a, b| {
        a.priority
            .cmp(&b.priority)
            .then(b.weight.cmp(&a.weight))
            .then(a.target.cmp(&b.target))
            .then(a.port.cmp(&b.port))
    })?;
    (!best.target.is_empty() && best.target != ".").then(|| best.clone())
}

/// Most SRV answers kept in memory (one per remote host).
pub const SRV_CACHE_MAX: usize = 10_000;

/// A cached lookup answer (`None`: there was none) and when it expires.
type Cached<T> = (Option<T>, Instant);

/// Splits `host[:port]` (IPv6 literals in brackets).
fn split_host_port(name: &str) -> (String, Option<u16>) {
    if let Some(rest) = name.strip_prefix('[')
        && let Some((host, tail)) = rest.split_once(']')
    {
        let port = tail.strip_prefix(':').and_then(|p| p.parse().ok());
        return (format!("[{host}]"), port);
    }
    match name.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h.to_owned(), p.parse().ok()),
        _ => (name.to_owned(), None),
    }
}

fn is_ip_literal(host: &str) -> bool {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<IpAddr>()
        .is_ok()
}

/// The outbound federation client (cheap to clone).
#[derive(Clone)]
pub struct FederationClient {
    /// Requests to resolved servers (hostnames with an SRV target connect to it).
    http: reqwest::Client,
    /// Well-known fetches (a hostname's own addresses, never an SRV target; follows
    /// redirects).
    plain: reqwest::Client,
    /// The port well-known is fetched from (443; tests move it).
    well_known_port: u16,
    key: Arc<ServerKey>,
    policy: Arc<IpPolicy>,
    well_known: Arc<parking_lot::Mutex<HashMap<String, Cached<String>>>>,
    srv: Arc<dyn SrvResolver>,
    srv_cache: Arc<parking_lot::Mutex<HashMap<String, Cached<SrvRecord>>>>,
    srv_targets: SrvTargets,
}

/// Most well-known results kept in memory (one per remote server name).
const WELL_KNOWN_CACHE_MAX: usize = 10_000;

/// Most redirects one well-known fetch follows (the spec: "should follow 30x
/// redirects, being careful to avoid redirect loops").
pub const WELL_KNOWN_MAX_REDIRECTS: usize = 5;

/// Largest well-known body read, in bytes (Synapse's limit).
pub const WELL_KNOWN_MAX_BYTES: usize = 50 * 1024;

/// Lifetime of a well-known answer without cache headers (the spec's recommendation).
const WELL_KNOWN_DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Shortest and longest lifetime of a well-known answer, whatever its headers say (the
/// spec recommends a 48 h cap; the floor keeps a `max-age=0` host from being asked on
/// every request).
const WELL_KNOWN_MIN_TTL: Duration = Duration::from_secs(5 * 60);
const WELL_KNOWN_MAX_TTL: Duration = Duration::from_secs(48 * 3600);
/// Lifetime of a failed well-known fetch.
const WELL_KNOWN_FAILURE_TTL: Duration = Duration::from_secs(3600);

/// How long a well-known answer may be cached, from its `Cache-Control` and `Expires`
/// headers at `now` (see the module docs).
fn well_known_ttl(headers: &reqwest::header::HeaderMap, now: std::time::SystemTime) -> Duration {
    let control = headers
        .get_all(reqwest::header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|d| d.trim().to_ascii_lowercase())
        .collect::<Vec<_>>();
    let period = if control.iter().any(|d| d == "no-store") {
        Some(Duration::ZERO)
    } else if let Some(age) = control.iter().find_map(|d| {
        d.strip_prefix("max-age=")?
            .trim_matches('"')
            .parse::<u64>()
            .ok()
    }) {
        Some(Duration::from_secs(age))
    } else {
        headers
            .get(reqwest::header::EXPIRES)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| httpdate::parse_http_date(v).ok())
            .map(|at| at.duration_since(now).unwrap_or(Duration::ZERO))
    };
    period
        .unwrap_or(WELL_KNOWN_DEFAULT_TTL)
        .clamp(WELL_KNOWN_MIN_TTL, WELL_KNOWN_MAX_TTL)
}

impl FederationClient {
    /// Builds the client from the federation settings. Errors on an unreadable CA
    /// file or a bad CIDR.
    pub fn new(key: Arc<ServerKey>, config: &FederationConfig) -> Result<FederationClient, String> {
        Self::with_srv_resolver(key, config, Arc::new(SystemSrvResolver::new()))
    }

    /// [`FederationClient::new`] with SRV lookups done by `srv` (tests).
    pub fn with_srv_resolver(
        key: Arc<ServerKey>,
        config: &FederationConfig,
        srv: Arc<dyn SrvResolver>,
    ) -> Result<FederationClient, String> {
        let policy = Arc::new(IpPolicy::new(
            &config.ip_range_denylist,
            &config.ip_range_allowlist,
        )?);
        let srv_targets: SrvTargets = Arc::default();
        let mut roots = Vec::new();
        for path in &config.trusted_ca_files {
            let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
            roots.extend(
                reqwest::Certificate::from_pem_bundle(&pem)
                    .map_err(|e| format!("{}: {e}", path.display()))?,
            );
        }
        if config.dangerous_skip_tls_verification_for_tests {
            tracing::warn!(
                "federation.dangerous_skip_tls_verification_for_tests is on: outbound \
                 federation accepts any certificate. Never use this outside tests."
            );
        }
        // Well-known fetches follow redirects (the spec asks them to), to `https` only
        // and never to a denied IP literal (names are checked by the DNS resolver).
        let redirect_policy = policy.clone();
        let well_known_redirects = reqwest::redirect::Policy::custom(move |attempt| {
            let url = attempt.url();
            if attempt.previous().len() > WELL_KNOWN_MAX_REDIRECTS {
                return attempt.error("too many redirects");
            }
            if url.scheme() != "https" {
                return attempt.error("a well-known redirect must stay on https");
            }
            let denied_ip = url
                .host_str()
                .and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse().ok())
                .is_some_and(|ip: IpAddr| !redirect_policy.allows(ip));
            if denied_ip {
                return attempt.error("a well-known redirect to a denied address");
            }
            attempt.follow()
        });
        let build = |targets: Option<SrvTargets>,
                     redirects: reqwest::redirect::Policy|
         -> Result<reqwest::Client, String> {
            let mut builder = reqwest::Client::builder()
                .use_rustls_tls()
                .dns_resolver(Arc::new(FilteringResolver {
                    policy: policy.clone(),
                    srv_targets: targets,
                }))
                .timeout(Duration::from_millis(config.request_timeout_ms))
                .connect_timeout(Duration::from_secs(10))
                .redirect(redirects)
                .user_agent(concat!("Spindle/", env!("CARGO_PKG_VERSION")));
            for cert in &roots {
                builder = builder.add_root_certificate(cert.clone());
            }
            if config.dangerous_skip_tls_verification_for_tests {
                builder = builder.danger_accept_invalid_certs(true);
            }
            builder.build().map_err(|e| e.to_string())
        };
        Ok(FederationClient {
            http: build(Some(srv_targets.clone()), reqwest::redirect::Policy::none())?,
            plain: build(None, well_known_redirects)?,
            well_known_port: 443,
            key,
            policy,
            well_known: Arc::default(),
            srv,
            srv_cache: Arc::default(),
            srv_targets,
        })
    }

    /// The same client fetching `/.well-known/matrix/server` from `port` instead of 443
    /// (tests, which cannot listen on 443).
    pub fn with_well_known_port(mut self, port: u16) -> FederationClient {
        self.well_known_port = port;
        self
    }

    /// Our server name.
    pub fn server_name(&self) -> &str {
        self.key.server_name()
    }

    /// Resolves a server name to the base URL to connect to (spec: "Resolving server
    /// names", every step; see the module docs).
    pub async fn resolve(&self, server_name: &str) -> Result<Resolved, ClientError> {
        let (host, port) = split_host_port(server_name);
        if is_ip_literal(&host) {
            self.check_ip_literal(server_name, &host)?;
            return Ok(Resolved::direct(format!(
                "https://{host}:{}",
                port.unwrap_or(8448)
            )));
        }
        if let Some(port) = port {
            return Ok(Resolved::direct(format!("https://{host}:{port}")));
        }
        if let Some(delegated) = self.well_known(&host).await {
            let (dhost, dport) = split_host_port(&delegated);
            // A delegation to an IP literal never passes the DNS resolver's filter:
            // check it here, or well-known would reach the denied ranges.
            if is_ip_literal(&dhost) {
                self.check_ip_literal(server_name, &dhost)?;
            }
            if is_ip_literal(&dhost) || dport.is_some() {
                return Ok(Resolved::direct(format!(
                    "https://{dhost}:{}",
                    dport.unwrap_or(8448)
                )));
            }
            return Ok(self.via_srv(&dhost).await);
        }
        Ok(self.via_srv(&host).await)
    }

    /// Refuses an IP literal (`1.2.3.4`, `[::1]`) the IP policy denies: connections to
    /// IP literals skip the DNS resolver, where every other address is filtered.
    fn check_ip_literal(&self, server_name: &str, host: &str) -> Result<(), ClientError> {
        let ip: IpAddr = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| ClientError::Denied(server_name.into(), "bad IP".into()))?;
        if !self.policy.allows(ip) {
            return Err(ClientError::Denied(
                server_name.into(),
                "address in federation.ip_range_denylist".into(),
            ));
        }
        Ok(())
    }

    /// Steps 3.3-3.5 and 4-6: the host's SRV target, else port 8448.
    async fn via_srv(&self, host: &str) -> Resolved {
        match self.srv_of(host).await {
            Some(rec) => {
                self.srv_targets
                    .lock()
                    .insert(host.to_owned(), rec.target.clone());
                Resolved {
                    base_url: format!("https://{host}:{}", rec.port),
                    host_header: Some(host.to_owned()),
                    srv_target: Some(format!("{}:{}", rec.target, rec.port)),
                }
            }
            None => {
                self.srv_targets.lock().remove(host);
                Resolved::direct(format!("https://{host}:8448"))
            }
        }
    }

    /// `_matrix-fed._tcp.<host>`, then `_matrix._tcp.<host>` (cached for an hour).
    async fn srv_of(&self, host: &str) -> Option<SrvRecord> {
        if let Some((v, until)) = self.srv_cache.lock().get(host)
            && *until > Instant::now()
        {
            return v.clone();
        }
        let mut found = pick_srv(&self.srv.lookup(format!("_matrix-fed._tcp.{host}")).await);
        if found.is_none() {
            found = pick_srv(&self.srv.lookup(format!("_matrix._tcp.{host}")).await);
        }
        let mut cache = self.srv_cache.lock();
        if cache.len() >= SRV_CACHE_MAX {
            let now = Instant::now();
            cache.retain(|_, (_, until)| *until > now);
            if cache.len() >= SRV_CACHE_MAX {
                cache.clear();
            }
        }
        cache.insert(
            host.to_owned(),
            (found.clone(), Instant::now() + Duration::from_secs(3600)),
        );
        found
    }

    async fn well_known(&self, host: &str) -> Option<String> {
        if let Some((v, until)) = self.well_known.lock().get(host)
            && *until > Instant::now()
        {
            return v.clone();
        }
        let url = if self.well_known_port == 443 {
            format!("https://{host}/.well-known/matrix/server")
        } else {
            format!(
                "https://{host}:{}/.well-known/matrix/server",
                self.well_known_port
            )
        };
        let found: Option<(String, Duration)> = async {
            let resp = self.plain.get(&url).send().await.ok()?;
            let (headers, body) = read_limited(host, resp, WELL_KNOWN_MAX_BYTES).await.ok()?;
            let body: serde_json::Value = serde_json::from_slice(&body).ok()?;
            let server = body.get("m.server")?.as_str()?.to_owned();
            Some((
                server,
                well_known_ttl(&headers, std::time::SystemTime::now()),
            ))
        }
        .await;
        let (found, ttl) = match found {
            Some((server, ttl)) => (Some(server), ttl),
            None => (None, WELL_KNOWN_FAILURE_TTL),
        };
        let mut cache = self.well_known.lock();
        if cache.len() >= WELL_KNOWN_CACHE_MAX {
            let now = Instant::now();
            cache.retain(|_, (_, until)| *until > now);
            if cache.len() >= WELL_KNOWN_CACHE_MAX {
                cache.clear();
            }
        }
        cache.insert(host.to_owned(), (found.clone(), Instant::now() + ttl));
        found
    }

    /// The `Authorization` header for a request (spec: "Request Authentication"): the
    /// JSON object `{method, uri, origin, destination, content?}` signed with our key.
    pub fn authorization(
        &self,
        method: &str,
        uri: &str,
        destination: &str,
        content: Option<&serde_json::Value>,
    ) -> String {
        let mut req = serde_json::json!({
            "method": method,
            "uri": uri,
            "origin": self.key.server_name(),
            "destination": destination,
        });
        if let Some(c) = content {
            req["content"] = c.clone();
        }
        let obj = spindle_core::canonical::to_object(req).unwrap_or_default();
        let bytes = spindle_core::canonical::to_bytes(&obj);
        let sig = self.key.sign_bytes(&bytes);
        format!(
            "X-Matrix origin=\"{}\",destination=\"{}\",key=\"{}\",sig=\"{}\"",
            self.key.server_name(),
            destination,
            self.key.key_id(),
            sig
        )
    }

    /// Sends a signed request and parses the JSON answer. `path_and_query` starts with
    /// `/_matrix/`.
    pub async fn request(
        &self,
        method: reqwest::Method,
        destination: &str,
        path_and_query: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value, ClientError> {
        let resolved = self.resolve(destination).await?;
        let auth = self.authorization(method.as_str(), path_and_query, destination, body);
        let url = format!("{}{}", resolved.base_url, path_and_query);
        let mut req = self
            .http
            .request(method, &url)
            .header(reqwest::header::AUTHORIZATION, auth);
        if let Some(h) = &resolved.host_header {
            req = req.header(reqwest::header::HOST, h);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| ClientError::Transport(destination.into(), error_chain(&e)))?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| ClientError::Transport(destination.into(), e.to_string()))?;
        if !status.is_success() {
            let mut body = String::from_utf8_lossy(&bytes).into_owned();
            body.truncate(500);
            return Err(ClientError::Status {
                server: destination.into(),
                status: status.as_u16(),
                body,
            });
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| ClientError::BadResponse(destination.into(), e.to_string()))
    }

    /// Sends a signed request and returns the answer's headers and body as bytes, at
    /// most `max_bytes` of them ([`ClientError::TooLarge`] beyond; the body is read in
    /// chunks and abandoned at the limit). An error status is [`ClientError::Status`].
    pub async fn request_bytes(
        &self,
        method: reqwest::Method,
        destination: &str,
        path_and_query: &str,
        max_bytes: usize,
    ) -> Result<(reqwest::header::HeaderMap, Vec<u8>), ClientError> {
        let resolved = self.resolve(destination).await?;
        let auth = self.authorization(method.as_str(), path_and_query, destination, None);
        let url = format!("{}{}", resolved.base_url, path_and_query);
        let mut req = self
            .http
            .request(method, &url)
            .header(reqwest::header::AUTHORIZATION, auth);
        if let Some(h) = &resolved.host_header {
            req = req.header(reqwest::header::HOST, h);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| ClientError::Transport(destination.into(), error_chain(&e)))?;
        read_limited(destination, resp, max_bytes).await
    }

    /// An unauthenticated GET of any URL (a `Location` a remote server redirects media
    /// to), through the same denylist, at most `max_bytes`.
    pub async fn get_url_bytes(
        &self,
        url: &str,
        max_bytes: usize,
    ) -> Result<(reqwest::header::HeaderMap, Vec<u8>), ClientError> {
        let resp = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| ClientError::Transport(url.into(), error_chain(&e)))?;
        read_limited(url, resp, max_bytes).await
    }

    /// An unauthenticated GET (the key server).
    pub async fn get_unsigned(
        &self,
        destination: &str,
        path: &str,
    ) -> Result<serde_json::Value, ClientError> {
        let resolved = self.resolve(destination).await?;
        let url = format!("{}{}", resolved.base_url, path);
        let mut req = self.http.get(&url);
        if let Some(h) = &resolved.host_header {
            req = req.header(reqwest::header::HOST, h);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| ClientError::Transport(destination.into(), error_chain(&e)))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(ClientError::Status {
                server: destination.into(),
                status: status.as_u16(),
                body: String::new(),
            });
        }
        resp.json()
            .await
            .map_err(|e| ClientError::BadResponse(destination.into(), e.to_string()))
    }
}

/// Reads a response of at most `max_bytes` (error statuses become
/// [`ClientError::Status`]).
async fn read_limited(
    destination: &str,
    mut resp: reqwest::Response,
    max_bytes: usize,
) -> Result<(reqwest::header::HeaderMap, Vec<u8>), ClientError> {
    let status = resp.status();
    let headers = resp.headers().clone();
    if status.is_success() && resp.content_length().is_some_and(|n| n > max_bytes as u64) {
        return Err(ClientError::TooLarge(destination.into(), max_bytes));
    }
    let limit = if status.is_success() { max_bytes } else { 500 };
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| ClientError::Transport(destination.into(), error_chain(&e)))?
    {
        if body.len() + chunk.len() > limit {
            if status.is_success() {
                return Err(ClientError::TooLarge(destination.into(), max_bytes));
            }
            body.extend_from_slice(&chunk[..limit - body.len()]);
            break;
        }
        body.extend_from_slice(&chunk);
    }
    if !status.is_success() {
        return Err(ClientError::Status {
            server: destination.into(),
            status: status.as_u16(),
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    Ok((headers, body))
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_port_split_like_the_spec_reads_server_names() {
        assert_eq!(split_host_port("example.org"), ("example.org".into(), None));
        assert_eq!(
            split_host_port("localhost:8448"),
            ("localhost".into(), Some(8448))
        );
        assert_eq!(split_host_port("[::1]:8008"), ("[::1]".into(), Some(8008)));
        assert_eq!(split_host_port("[::1]"), ("[::1]".into(), None));
        assert!(is_ip_literal("[::1]") && is_ip_literal("1.2.3.4") && !is_ip_literal("a.b"));
    }

    struct FakeSrv(
        HashMap<String, Vec<SrvRecord>>,
        parking_lot::Mutex<Vec<String>>,
    );

    impl SrvResolver for FakeSrv {
        fn lookup(
            &self,
            name: String,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Vec<SrvRecord>> + Send + '_>>
        {
            self.1.lock().push(name.clone());
            let out = self.0.get(&name).cloned().unwrap_or_default();
            Box::pin(async move { out })
        }
    }

    fn rec(target: &str, port: u16, priority: u16, weight: u16) -> SrvRecord {
        SrvRecord {
            target: target.into(),
            port,
            priority,
            weight,
        }
    }

    #[test]
    fn the_lowest_priority_then_highest_weight_srv_record_wins() {
        let records = [
            rec("b.example", 8001, 10, 5),
            rec("a.example", 8002, 5, 1),
            rec("c.example", 8003, 5, 9),
        ];
        assert_eq!(pick_srv(&records), Some(rec("c.example", 8003, 5, 9)));
        assert_eq!(pick_srv(&[rec(".", 0, 0, 0)]), None);
        assert_eq!(pick_srv(&[]), None);
    }

    #[test]
    fn a_well_known_answer_lives_as_its_headers_say_within_bounds() {
        use reqwest::header::{CACHE_CONTROL, EXPIRES, HeaderMap, HeaderValue};
        let now = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let with = |pairs: &[(reqwest::header::HeaderName, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(k.clone(), HeaderValue::from_str(v).unwrap());
            }
            well_known_ttl(&h, now)
        };
        let hours = |n: u64| Duration::from_secs(n * 3600);
        assert_eq!(with(&[]), hours(24));
        assert_eq!(with(&[(CACHE_CONTROL, "public, max-age=7200")]), hours(2));
        assert_eq!(with(&[(CACHE_CONTROL, "max-age=0")]), WELL_KNOWN_MIN_TTL);
        assert_eq!(with(&[(CACHE_CONTROL, "no-store")]), WELL_KNOWN_MIN_TTL);
        assert_eq!(with(&[(CACHE_CONTROL, "max-age=9999999")]), hours(48));
        // `Expires` one hour after `now` (2023-11-14T22:13:20Z).
        assert_eq!(
            with(&[(EXPIRES, "Tue, 14 Nov 2023 23:13:20 GMT")]),
            hours(1)
        );
        // max-age wins over Expires; a past Expires is the floor.
        assert_eq!(
            with(&[
                (CACHE_CONTROL, "max-age=10800"),
                (EXPIRES, "Tue, 14 Nov 2023 23:13:20 GMT")
            ]),
            hours(3)
        );
        assert_eq!(
            with(&[(EXPIRES, "Mon, 01 Jan 2001 00:00:00 GMT")]),
            WELL_KNOWN_MIN_TTL
        );
    }

    /// Found by a fresh-eyes review: a well-known answer naming an IP literal went
    /// straight to the connection, past the denylist the DNS resolver applies.
    #[tokio::test]
    async fn a_well_known_delegation_to_a_denied_ip_literal_is_refused() {
        let key = Arc::new(ServerKey::generate("us.test"));
        let config = FederationConfig::default();
        let srv = Arc::new(FakeSrv(HashMap::new(), parking_lot::Mutex::default()));
        let c = FederationClient::with_srv_resolver(key, &config, srv).unwrap();
        let later = Instant::now() + Duration::from_secs(600);
        for (name, target) in [
            ("inside.test", "10.0.0.5:80"),
            ("loop.test", "[::1]:8448"),
            ("public.test", "93.184.216.34"),
        ] {
            c.well_known
                .lock()
                .insert(name.into(), (Some(target.into()), later));
        }
        assert!(matches!(
            c.resolve("inside.test").await,
            Err(ClientError::Denied(n, _)) if n == "inside.test"
        ));
        assert!(matches!(
            c.resolve("loop.test").await,
            Err(ClientError::Denied(..))
        ));
        assert_eq!(
            c.resolve("public.test").await.unwrap(),
            Resolved::direct("https://93.184.216.34:8448".into())
        );
    }

    #[tokio::test]
    async fn srv_records_are_asked_after_well_known_matrix_fed_first() {
        let key = Arc::new(ServerKey::generate("us.test"));
        let config = FederationConfig::default();
        let srv = Arc::new(FakeSrv(
            [
                (
                    "_matrix-fed._tcp.fed.test".to_owned(),
                    vec![rec("fed-target.test", 8443, 0, 0)],
                ),
                (
                    "_matrix._tcp.fed.test".to_owned(),
                    vec![rec("legacy-target.test", 9999, 0, 0)],
                ),
                (
                    "_matrix._tcp.old.test".to_owned(),
                    vec![rec("old-target.test", 7000, 0, 0)],
                ),
            ]
            .into_iter()
            .collect(),
            parking_lot::Mutex::default(),
        ));
        let c = FederationClient::with_srv_resolver(key, &config, srv.clone()).unwrap();
        // `.test` names have no well-known (no DNS): the SRV steps decide.
        let r = c.resolve("fed.test").await.unwrap();
        assert_eq!(r.base_url, "https://fed.test:8443");
        assert_eq!(r.host_header.as_deref(), Some("fed.test"));
        assert_eq!(r.srv_target.as_deref(), Some("fed-target.test:8443"));
        assert_eq!(
            c.srv_targets.lock().get("fed.test").map(String::as_str),
            Some("fed-target.test")
        );
        // The deprecated _matrix._tcp only when _matrix-fed._tcp has nothing.
        let r = c.resolve("old.test").await.unwrap();
        assert_eq!(r.base_url, "https://old.test:7000");
        assert_eq!(r.srv_target.as_deref(), Some("old-target.test:7000"));
        // No record: port 8448. An explicit port: no lookup at all.
        let r = c.resolve("plain.test").await.unwrap();
        assert_eq!(r, Resolved::direct("https://plain.test:8448".into()));
        let r = c.resolve("ported.test:1234").await.unwrap();
        assert_eq!(r, Resolved::direct("https://ported.test:1234".into()));
        // Cached: asking again looks nothing up.
        let asked = srv.1.lock().len();
        c.resolve("fed.test").await.unwrap();
        assert_eq!(srv.1.lock().len(), asked);
        assert_eq!(
            *srv.1.lock(),
            vec![
                "_matrix-fed._tcp.fed.test",
                "_matrix-fed._tcp.old.test",
                "_matrix._tcp.old.test",
                "_matrix-fed._tcp.plain.test",
                "_matrix._tcp.plain.test",
            ]
        );
    }

    #[test]
    fn denylist_blocks_private_ranges_and_allowlist_reopens_them() {
        let deny: Vec<String> = DEFAULT_IP_RANGE_DENYLIST
            .iter()
            .map(|s| s.to_string())
            .collect();
        let p = IpPolicy::new(&deny, &[]).unwrap();
        assert!(!p.allows("127.0.0.1".parse().unwrap()));
        assert!(!p.allows("10.1.2.3".parse().unwrap()));
        assert!(!p.allows("::ffff:192.168.0.1".parse().unwrap()));
        assert!(!p.allows("::1".parse().unwrap()));
        assert!(p.allows("93.184.216.34".parse().unwrap()));
        let p = IpPolicy::new(&deny, &["127.0.0.0/8".into()]).unwrap();
        assert!(p.allows("127.0.0.1".parse().unwrap()));
        assert!(!p.allows("10.1.2.3".parse().unwrap()));
        assert!(IpPolicy::new(&["nonsense".into()], &[]).is_err());
    }
}
