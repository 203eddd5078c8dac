//! Outbound federation requests: server name resolution, trust, the IP range denylist
//! and X-Matrix request signing (spec: server-server API, "Resolving server names",
//! "Request Authentication").
//!
//! Resolution follows the spec's order: an IP literal or an explicit port is used as
//! is; otherwise `https://<host>/.well-known/matrix/server` (cached: 24 h on success,
//! 1 h on failure) may delegate to another host; otherwise port 8448. SRV records are
//! not consulted yet (see docs/federation.md).
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

/// A reqwest DNS resolver that drops the addresses `policy` denies (push gateways use
/// it too: one policy mechanism for every outbound request).
pub fn filtering_resolver(policy: Arc<IpPolicy>) -> Arc<FilteringResolver> {
    Arc::new(FilteringResolver { policy })
}

/// A DNS resolver for reqwest that drops denied addresses (no DNS rebinding around
/// the denylist).
pub struct FilteringResolver {
    policy: Arc<IpPolicy>,
}

impl reqwest::dns::Resolve for FilteringResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
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
}

/// Splits `host[:port]` (IPv6 literals in brackets).
fn split_host_port(name: &str) -> (String, Option<u16>) {
    if let Some(rest) = name.strip_prefix('[') {
        if let Some((host, tail)) = rest.split_once(']') {
            let port = tail.strip_prefix(':').and_then(|p| p.parse().ok());
            return (format!("[{host}]"), port);
        }
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
    http: reqwest::Client,
    key: Arc<ServerKey>,
    policy: Arc<IpPolicy>,
    well_known: Arc<parking_lot::Mutex<HashMap<String, (Option<String>, Instant)>>>,
}

/// Most well-known results kept in memory (one per remote server name).
const WELL_KNOWN_CACHE_MAX: usize = 10_000;

impl FederationClient {
    /// Builds the client from the federation settings. Errors on an unreadable CA
    /// file or a bad CIDR.
    pub fn new(key: Arc<ServerKey>, config: &FederationConfig) -> Result<FederationClient, String> {
        let policy = Arc::new(IpPolicy::new(
            &config.ip_range_denylist,
            &config.ip_range_allowlist,
        )?);
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .dns_resolver(Arc::new(FilteringResolver {
                policy: policy.clone(),
            }))
            .timeout(Duration::from_millis(config.request_timeout_ms))
            .connect_timeout(Duration::from_secs(10))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("Spindle/", env!("CARGO_PKG_VERSION")));
        for path in &config.trusted_ca_files {
            let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("{}: {e}", path.display()))?
            {
                builder = builder.add_root_certificate(cert);
            }
        }
        if config.dangerous_skip_tls_verification_for_tests {
            tracing::warn!(
                "federation.dangerous_skip_tls_verification_for_tests is on: outbound \
                 federation accepts any certificate. Never use this outside tests."
            );
            builder = builder.danger_accept_invalid_certs(true);
        }
        let http = builder.build().map_err(|e| e.to_string())?;
        Ok(FederationClient {
            http,
            key,
            policy,
            well_known: Arc::default(),
        })
    }

    /// Our server name.
    pub fn server_name(&self) -> &str {
        self.key.server_name()
    }

    /// Resolves a server name to the base URL to connect to (spec: "Resolving server
    /// names", steps 1-3 and 6; SRV steps are not taken).
    pub async fn resolve(&self, server_name: &str) -> Result<Resolved, ClientError> {
        let (host, port) = split_host_port(server_name);
        if is_ip_literal(&host) {
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
            return Ok(Resolved {
                base_url: format!("https://{host}:{}", port.unwrap_or(8448)),
            });
        }
        if let Some(port) = port {
            return Ok(Resolved {
                base_url: format!("https://{host}:{port}"),
            });
        }
        if let Some(delegated) = self.well_known(&host).await {
            let (dhost, dport) = split_host_port(&delegated);
            return Ok(Resolved {
                base_url: format!("https://{dhost}:{}", dport.unwrap_or(8448)),
            });
        }
        Ok(Resolved {
            base_url: format!("https://{host}:8448"),
        })
    }

    async fn well_known(&self, host: &str) -> Option<String> {
        if let Some((v, until)) = self.well_known.lock().get(host)
            && *until > Instant::now()
        {
            return v.clone();
        }
        let url = format!("https://{host}/.well-known/matrix/server");
        let found = async {
            let resp = self.http.get(&url).send().await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let body: serde_json::Value = resp.json().await.ok()?;
            body.get("m.server")?.as_str().map(str::to_owned)
        }
        .await;
        let ttl = if found.is_some() {
            Duration::from_secs(24 * 3600)
        } else {
            Duration::from_secs(3600)
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
        let resp = self
            .http
            .request(method, &url)
            .header(reqwest::header::AUTHORIZATION, auth)
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
        let resp = self
            .http
            .get(&url)
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
