//! Authenticated media over federation (spec: server-server API, "Content Repository",
//! v1.11): the `multipart/mixed` answer of `GET /_matrix/federation/v1/media/download/
//! {mediaId}` and `/thumbnail/{mediaId}` (a JSON part, `{}`, then the media part), and
//! fetching another server's media through those endpoints.
//!
//! The endpoints themselves are served by the api crate's content repository (it owns
//! the blobs and the thumbnailer), authenticated with [`crate::auth::Signed`]; this
//! module is the wire format and the outbound fetch. A media part that is a `Location`
//! redirect is followed once (through the same IP denylist). A server that does not
//! serve the federation endpoints (404/400 `M_UNRECOGNIZED`) is asked the deprecated
//! `GET /_matrix/media/v3/download/{serverName}/{mediaId}?allow_remote=false` (or
//! `/thumbnail`) instead, as the spec's transition note says.

use crate::{FedState, client::ClientError, transactions::urlencode};

/// One media file as the content repository serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaPart {
    /// `Content-Type` of the media (`application/octet-stream` when not given).
    pub content_type: String,
    /// `Content-Disposition` as the origin sent it, if it did.
    pub content_disposition: Option<String>,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// Why a remote media fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum MediaFetchError {
    /// The origin does not have it (404), or refused (4xx).
    #[error("the remote server has no such media")]
    NotFound,
    /// Larger than the limit the caller gave.
    #[error("the remote media is larger than {0} bytes")]
    TooLarge(usize),
    /// Unreachable, an error status, or an answer that is not the spec's shape.
    #[error("{0}")]
    Failed(String),
}

/// A `multipart/mixed` body of two parts, the JSON metadata `{}` and the media:
/// `(Content-Type header value, body)`. The boundary is random and checked not to
/// occur in the media.
pub fn multipart_mixed(media: &MediaPart) -> (String, Vec<u8>) {
    let boundary = loop {
        let b: String = (0..32)
            .map(|_| char::from(b"0123456789abcdef"[rand::random_range(0..16)]))
            .collect();
        if !contains(&media.bytes, b.as_bytes()) {
            break b;
        }
    };
    let mut body = Vec::with_capacity(media.bytes.len() + 256);
    body.extend_from_slice(
        format!("--{boundary}\r\nContent-Type: application/json\r\n\r\n{{}}\r\n").as_bytes(),
    );
    body.extend_from_slice(
        format!("--{boundary}\r\nContent-Type: {}\r\n", media.content_type).as_bytes(),
    );
    if let Some(d) = &media.content_disposition {
        body.extend_from_slice(format!("Content-Disposition: {d}\r\n").as_bytes());
    }
    body.extend_from_slice(b"\r\n");
    body.extend_from_slice(&media.bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (format!("multipart/mixed; boundary={boundary}"), body)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    find(hay, needle, 0).is_some()
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    (from..=hay.len() - needle.len()).find(|&i| &hay[i..i + needle.len()] == needle)
}

/// The boundary parameter of a `multipart/mixed` content type.
fn boundary_of(content_type: &str) -> Option<String> {
    let (kind, params) = content_type.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/mixed") {
        return None;
    }
    params.split(';').find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"').to_owned())
    })
}

/// One part of a multipart body: its headers (names lower-cased) and its bytes.
type Part = (Vec<(String, String)>, Vec<u8>);

/// Splits a `multipart/mixed` body into its parts (RFC 2046 §5.1; preamble and
/// epilogue ignored). `None` when the content type has no boundary or the body does
/// not follow it.
pub fn parse_multipart(content_type: &str, body: &[u8]) -> Option<Vec<Part>> {
    let boundary = boundary_of(content_type)?;
    let delim = format!("--{boundary}");
    let mut parts = Vec::new();
    let mut pos = find(body, delim.as_bytes(), 0)? + delim.len();
    loop {
        if body.get(pos..pos + 2) == Some(b"--") {
            return Some(parts);
        }
        // Skip transport padding and the CRLF after the delimiter.
        while matches!(body.get(pos), Some(b' ' | b'\t')) {
            pos += 1;
        }
        if body.get(pos..pos + 2) == Some(b"\r\n") {
            pos += 2;
        } else if body.get(pos) == Some(&b'\n') {
            pos += 1;
        }
        let next = find(body, format!("\r\n{delim}").as_bytes(), pos)
            .map(|i| (i, i + 2 + delim.len()))
            .or_else(|| {
                find(body, format!("\n{delim}").as_bytes(), pos).map(|i| (i, i + 1 + delim.len()))
            })?;
        let part = &body[pos..next.0];
        let (head, content) = match find(part, b"\r\n\r\n", 0) {
            Some(i) => (&part[..i], &part[i + 4..]),
            None if part.starts_with(b"\r\n") => (&part[..0], &part[2..]),
            None => match find(part, b"\n\n", 0) {
                Some(i) => (&part[..i], &part[i + 2..]),
                None => return None,
            },
        };
        let headers = String::from_utf8_lossy(head)
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                Some((k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            })
            .collect();
        parts.push((headers, content.to_vec()));
        pos = next.1;
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn reqwest_header(
    h: &reqwest::header::HeaderMap,
    name: reqwest::header::HeaderName,
) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

fn fetch_error(e: ClientError) -> MediaFetchError {
    match e {
        ClientError::TooLarge(_, n) => MediaFetchError::TooLarge(n),
        ClientError::Status { status, .. } if (400..500).contains(&status) && status != 429 => {
            MediaFetchError::NotFound
        }
        e => MediaFetchError::Failed(e.to_string()),
    }
}

fn unrecognized(e: &ClientError) -> bool {
    matches!(e, ClientError::Status { status: 400 | 404, body, .. } if body.contains("M_UNRECOGNIZED"))
}

/// Fetches media `media_id` of `server` (which must not be us): the file, or with
/// `thumbnail` (`width=..&height=..&method=..`, already validated) a thumbnail of it,
/// at most `max_bytes`.
pub async fn fetch_remote_media(
    st: &FedState,
    server: &str,
    media_id: &str,
    thumbnail: Option<&str>,
    max_bytes: usize,
) -> Result<MediaPart, MediaFetchError> {
    let id = urlencode(media_id);
    let path = match thumbnail {
        None => format!("/_matrix/federation/v1/media/download/{id}"),
        Some(q) => format!("/_matrix/federation/v1/media/thumbnail/{id}?{q}"),
    };
    // Room for the multipart framing and the JSON part beside the media.
    let framed_max = max_bytes.saturating_add(64 * 1024);
    let answer = st
        .client
        .request_bytes(reqwest::Method::GET, server, &path, framed_max)
        .await;
    let (headers, body) = match answer {
        Ok(a) => a,
        Err(e) if unrecognized(&e) => {
            return fetch_legacy(st, server, media_id, thumbnail, max_bytes).await;
        }
        Err(e) => return Err(fetch_error(e)),
    };
    let content_type = reqwest_header(&headers, reqwest::header::CONTENT_TYPE).unwrap_or_default();
    let parts = parse_multipart(&content_type, &body).ok_or_else(|| {
        MediaFetchError::Failed(format!(
            "{server} answered media that is not multipart/mixed"
        ))
    })?;
    let [_, (part_headers, bytes)] = <[Part; 2]>::try_from(parts).map_err(|p| {
        MediaFetchError::Failed(format!("{server} answered {} parts, not 2", p.len()))
    })?;
    if let Some(location) = header(&part_headers, "location") {
        let (h, bytes) = st
            .client
            .get_url_bytes(location, max_bytes)
            .await
            .map_err(fetch_error)?;
        return Ok(MediaPart {
            content_type: reqwest_header(&h, reqwest::header::CONTENT_TYPE)
                .unwrap_or_else(|| "application/octet-stream".into()),
            content_disposition: reqwest_header(&h, reqwest::header::CONTENT_DISPOSITION),
            bytes,
        });
    }
    if bytes.len() > max_bytes {
        return Err(MediaFetchError::TooLarge(max_bytes));
    }
    Ok(MediaPart {
        content_type: header(&part_headers, "content-type")
            .unwrap_or("application/octet-stream")
            .to_owned(),
        content_disposition: header(&part_headers, "content-disposition").map(str::to_owned),
        bytes,
    })
}

/// The deprecated unauthenticated fetch, for servers without the federation media
/// endpoints.
async fn fetch_legacy(
    st: &FedState,
    server: &str,
    media_id: &str,
    thumbnail: Option<&str>,
    max_bytes: usize,
) -> Result<MediaPart, MediaFetchError> {
    let (s, id) = (urlencode(server), urlencode(media_id));
    let path = match thumbnail {
        None => format!("/_matrix/media/v3/download/{s}/{id}?allow_remote=false"),
        Some(q) => format!("/_matrix/media/v3/thumbnail/{s}/{id}?{q}&allow_remote=false"),
    };
    let base = st
        .client
        .resolve(server)
        .await
        .map_err(|e| MediaFetchError::Failed(e.to_string()))?
        .base_url;
    let (h, bytes) = st
        .client
        .get_url_bytes(&format!("{base}{path}"), max_bytes)
        .await
        .map_err(fetch_error)?;
    Ok(MediaPart {
        content_type: reqwest_header(&h, reqwest::header::CONTENT_TYPE)
            .unwrap_or_else(|| "application/octet-stream".into()),
        content_disposition: reqwest_header(&h, reqwest::header::CONTENT_DISPOSITION),
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multipart_answer_parses_back_into_its_two_parts() {
        let media = MediaPart {
            content_type: "image/png".into(),
            content_disposition: Some("inline; filename=\"a.png\"".into()),
            bytes: b"\x89PNG\r\n--not-a-boundary\r\n\r\nbytes".to_vec(),
        };
        let (ct, body) = multipart_mixed(&media);
        assert!(ct.starts_with("multipart/mixed; boundary="));
        let parts = parse_multipart(&ct, &body).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].1, b"{}");
        assert_eq!(
            header(&parts[0].0, "content-type"),
            Some("application/json")
        );
        assert_eq!(header(&parts[1].0, "content-type"), Some("image/png"));
        assert_eq!(
            header(&parts[1].0, "content-disposition"),
            Some("inline; filename=\"a.png\"")
        );
        assert_eq!(parts[1].1, media.bytes);
        // The spec's example shape, with a Location part and a quoted boundary.
        let body = b"--6067d4698f8d40a0a794ea7d7379d53a\r\nContent-Type: application/json\r\n\r\n{}\r\n--6067d4698f8d40a0a794ea7d7379d53a\r\nLocation: https://cdn.example.org/a\r\n\r\n\r\n--6067d4698f8d40a0a794ea7d7379d53a--\r\n";
        let parts = parse_multipart(
            "multipart/mixed; boundary=\"6067d4698f8d40a0a794ea7d7379d53a\"",
            body,
        )
        .unwrap();
        assert_eq!(
            header(&parts[1].0, "location"),
            Some("https://cdn.example.org/a")
        );
        assert_eq!(parts[1].1, b"");
        assert!(parse_multipart("application/json", body).is_none());
        assert!(parse_multipart("multipart/mixed; boundary=x", b"garbage").is_none());
    }
}
