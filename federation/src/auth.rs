//! Inbound request authentication (spec: server-server API, "Request Authentication"):
//! the `Authorization: X-Matrix origin=...,destination=...,key=...,sig=...` header is
//! checked against the origin's published key over `{method, uri, origin, destination,
//! content}`. A request without a valid signature answers 401 `M_UNAUTHORIZED`; one
//! addressed to another server (`destination`) is refused the same way.

use axum::{
    body::Bytes,
    extract::{FromRequest, Request},
};

use crate::{FedState, error::FedError};

/// Largest federation request body, bytes (a transaction of 50 PDUs of 64 KiB each, plus
/// EDUs, stays below it).
pub const MAX_FEDERATION_BODY_BYTES: usize = 4 * 1024 * 1024;

/// The parsed `X-Matrix` credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XMatrix {
    /// The requesting server.
    pub origin: String,
    /// The server the request is for (optional before spec v1.3).
    pub destination: Option<String>,
    /// Key id, e.g. `ed25519:a_bcd`.
    pub key: String,
    /// Unpadded base64 signature.
    pub sig: String,
}

/// Parses an `Authorization` header value of the `X-Matrix` scheme. Values may be
/// quoted (with `\"` escapes) or bare tokens, as the spec allows.
pub fn parse_x_matrix(header: &str) -> Option<XMatrix> {
    let rest = header.trim().strip_prefix("X-Matrix")?.trim_start();
    let mut origin = None;
    let mut destination = None;
    let mut key = None;
    let mut sig = None;
    let mut chars = rest.chars().peekable();
    loop {
        while matches!(chars.peek(), Some(' ') | Some(',')) {
            chars.next();
        }
        let mut name = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' {
                break;
            }
            name.push(c);
            chars.next();
        }
        if name.is_empty() {
            break;
        }
        chars.next()?; // '='
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next()? {
                    '\\' => value.push(chars.next()?),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        match name.trim().to_ascii_lowercase().as_str() {
            "origin" => origin = Some(value),
            "destination" => destination = Some(value),
            "key" => key = Some(value),
            "sig" => sig = Some(value),
            _ => {}
        }
    }
    Some(XMatrix {
        origin: origin?,
        destination,
        key: key?,
        sig: sig?,
    })
}

/// A request signed by another server: who sent it and its JSON body (if any).
#[derive(Debug)]
pub struct Signed {
    /// The authenticated origin server.
    pub origin: String,
    /// The body, parsed (`None` for requests without one).
    pub body: Option<serde_json::Value>,
}

impl FromRequest<FedState> for Signed {
    type Rejection = FedError;

    async fn from_request(req: Request, st: &FedState) -> Result<Self, Self::Rejection> {
        let method = req.method().as_str().to_owned();
        let uri = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_else(|| req.uri().path().to_owned());
        let header = req
            .headers()
            .get_all(axum::http::header::AUTHORIZATION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find_map(parse_x_matrix)
            .ok_or_else(|| FedError::unauthorized("missing or malformed X-Matrix authorization"))?;
        if let Some(dest) = &header.destination
            && dest != st.key.server_name()
        {
            return Err(FedError::unauthorized(format!(
                "this request is for {dest}, not for {}",
                st.key.server_name()
            )));
        }
        let bytes = Bytes::from_request(req, &())
            .await
            .map_err(|e| FedError::new(e.status(), "M_TOO_LARGE", e.body_text()))?;
        let body: Option<serde_json::Value> = if bytes.is_empty() {
            None
        } else {
            Some(serde_json::from_slice(&bytes).map_err(|e| {
                FedError::new(
                    axum::http::StatusCode::BAD_REQUEST,
                    "M_NOT_JSON",
                    e.to_string(),
                )
            })?)
        };
        let keys = st.keys.keys_of(&header.origin).await?;
        let Some(public) = keys.get(&header.key) else {
            return Err(FedError::unauthorized(format!(
                "{} has no key {}",
                header.origin, header.key
            )));
        };
        let mut signed = serde_json::json!({
            "method": method,
            "uri": uri,
            "origin": header.origin,
            "destination": header.destination.clone().unwrap_or_else(|| st.key.server_name().to_owned()),
        });
        if let Some(b) = &body {
            signed["content"] = b.clone();
        }
        // Lenient canonical form: a body may carry PDUs of room versions 1 to 5 with
        // numbers strict canonical JSON refuses; the request must still verify, and
        // each PDU is judged on its own later.
        let bytes = spindle_core::canonical::lenient_bytes(&signed);
        let public: ruma::serde::Base64 = ruma::serde::Base64::parse(public)
            .map_err(|_| FedError::unauthorized("bad origin key"))?;
        let signature: ruma::serde::Base64 = ruma::serde::Base64::parse(&header.sig)
            .map_err(|_| FedError::unauthorized("the request signature is not base64"))?;
        let algorithm = header
            .key
            .split_once(':')
            .map(|(a, _)| ruma::signatures::SigningKeyAlgorithm::from(a))
            .ok_or_else(|| FedError::unauthorized("bad key id"))?;
        ruma::signatures::verify_canonical_json_bytes(
            &algorithm,
            public.as_bytes(),
            signature.as_bytes(),
            &bytes,
        )
        .map_err(|e| FedError::unauthorized(format!("request signature: {e}")))?;
        // Counted only once the signature proves the origin: nobody can spend
        // another server's allowance.
        if let Some(limit) = &st.origin_limit
            && let Some(retry_after_ms) = limit(&header.origin)
        {
            return Err(FedError::limit_exceeded(retry_after_ms));
        }
        Ok(Signed {
            origin: header.origin,
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x_matrix_header_parses_quoted_and_bare_values() {
        let h = r#"X-Matrix origin="origin.hs.example.com",destination="destination.hs.example.com",key="ed25519:key1",sig="ABCDEF...""#;
        assert_eq!(
            parse_x_matrix(h),
            Some(XMatrix {
                origin: "origin.hs.example.com".into(),
                destination: Some("destination.hs.example.com".into()),
                key: "ed25519:key1".into(),
                sig: "ABCDEF...".into(),
            })
        );
        let bare = parse_x_matrix("X-Matrix origin=a.org,key=ed25519:1,sig=xyz").unwrap();
        assert_eq!(bare.origin, "a.org");
        assert_eq!(bare.destination, None);
        assert_eq!(parse_x_matrix("Bearer abc"), None);
        assert_eq!(parse_x_matrix("X-Matrix origin=\"a\""), None);
    }
}
