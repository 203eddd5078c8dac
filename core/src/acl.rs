//! Server access control lists (spec: client-server "Server Access Control Lists for
//! rooms", event `m.room.server_acl`; server-server "Server Access Control Lists"):
//! the pure rule deciding whether a server may take part in a room, from the ACL
//! event's content. The federation crate applies it to inbound requests and PDUs.
//!
//! The rule, in the spec's order: no ACL event: allow; an IP literal server name
//! with `allow_ip_literals: false`: deny; a `deny` glob matches: deny; an `allow`
//! glob matches: allow; otherwise deny (a missing `allow` denies everyone). The port
//! is never considered; globs (`*`, `?`) match case-insensitively.

use serde_json::Value;

/// The parsed content of an `m.room.server_acl` event.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServerAcl {
    /// Globs of allowed server names (default empty: nobody).
    pub allow: Vec<String>,
    /// Globs of denied server names (default empty).
    pub deny: Vec<String>,
    /// Whether IP literal server names may take part (default `true`; anything but a
    /// boolean counts as `true`).
    pub allow_ip_literals: bool,
}

impl ServerAcl {
    /// Reads an ACL event's content. Entries that are not strings are ignored, as is
    /// an `allow`/`deny` that is not a list.
    pub fn from_content(content: &Value) -> ServerAcl {
        let list = |k: &str| -> Vec<String> {
            content
                .get(k)
                .and_then(|v| v.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_ascii_lowercase))
                        .collect()
                })
                .unwrap_or_default()
        };
        ServerAcl {
            allow: list("allow"),
            deny: list("deny"),
            allow_ip_literals: content
                .get("allow_ip_literals")
                .and_then(|v| v.as_bool())
                .unwrap_or(true),
        }
    }

    /// Whether `server_name` (with or without a port) is allowed by this ACL.
    pub fn allows(&self, server_name: &str) -> bool {
        let host = host_of(server_name).to_ascii_lowercase();
        if !self.allow_ip_literals && is_ip_literal(&host) {
            return false;
        }
        if self.deny.iter().any(|g| glob_matches(g, &host)) {
            return false;
        }
        self.allow.iter().any(|g| glob_matches(g, &host))
    }
}

/// Whether `server_name` may take part in a room whose ACL content is `acl`
/// (`None`: the room has no ACL event, so everyone may).
pub fn server_allowed(acl: Option<&Value>, server_name: &str) -> bool {
    acl.is_none_or(|c| ServerAcl::from_content(c).allows(server_name))
}

/// The host of a server name, without the port (`[::1]:8448` -> `[::1]`).
fn host_of(server_name: &str) -> &str {
    if server_name.starts_with('[') {
        return match server_name.find(']') {
            Some(end) => &server_name[..=end],
            None => server_name,
        };
    }
    match server_name.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => server_name,
    }
}

fn is_ip_literal(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<std::net::IpAddr>().is_ok()
}

/// Glob matching (spec appendix "Glob-style matching"): `*` any run of characters,
/// `?` exactly one; everything else literal. Linear backtracking on the last `*`.
pub fn glob_matches(glob: &str, text: &str) -> bool {
    let (g, t): (Vec<char>, Vec<char>) = (glob.chars().collect(), text.chars().collect());
    let (mut gi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if gi < g.len() && (g[gi] == '?' || g[gi] == t[ti]) {
            gi += 1;
            ti += 1;
        } else if gi < g.len() && g[gi] == '*' {
            star = Some((gi, ti));
            gi += 1;
        } else if let Some((sg, st)) = star {
            gi = sg + 1;
            ti = st + 1;
            star = Some((sg, st + 1));
        } else {
            return false;
        }
    }
    while gi < g.len() && g[gi] == '*' {
        gi += 1;
    }
    gi == g.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn globs_match_like_the_spec_appendix() {
        assert!(glob_matches("*", "evil.com"));
        assert!(glob_matches("*.evil.com", "a.b.evil.com"));
        assert!(!glob_matches("*.evil.com", "evil.com"));
        assert!(glob_matches("evil.c?m", "evil.com"));
        assert!(!glob_matches("evil.c?m", "evil.cm"));
        assert!(glob_matches("a*b*c", "aXXbYYc"));
        assert!(!glob_matches("a*b*c", "aXXbYY"));
        assert!(glob_matches("", ""));
        assert!(!glob_matches("", "a"));
    }

    #[test]
    fn acl_rule_follows_the_spec_order() {
        // No ACL: everyone.
        assert!(server_allowed(None, "anyone.org"));
        let acl = json!({ "allow": ["*"], "deny": ["evil.com", "*.evil.com"], "allow_ip_literals": false });
        assert!(server_allowed(Some(&acl), "good.org"));
        // The port is not considered; matching ignores case.
        assert!(!server_allowed(Some(&acl), "evil.com:8448"));
        assert!(!server_allowed(Some(&acl), "EVIL.com"));
        assert!(!server_allowed(Some(&acl), "sub.evil.com"));
        assert!(!server_allowed(Some(&acl), "1.2.3.4:8448"));
        assert!(!server_allowed(Some(&acl), "[::1]:8448"));
        // IP literals are allowed unless `allow_ip_literals` is false.
        assert!(server_allowed(Some(&json!({ "allow": ["*"] })), "1.2.3.4"));
        assert!(server_allowed(
            Some(&json!({ "allow": ["*"], "allow_ip_literals": "no" })),
            "[::1]"
        ));
        // No allow list: nobody, not even the sender's server.
        assert!(!server_allowed(Some(&json!({ "deny": [] })), "good.org"));
        assert!(server_allowed(
            Some(&json!({ "allow": ["GOOD.org"] })),
            "good.org:443"
        ));
        assert!(!server_allowed(
            Some(&json!({ "allow": ["good.org"] })),
            "other.org"
        ));
    }
}
