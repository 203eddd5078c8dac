//! Media over federation, the content repository's side (spec: server-server API
//! "Content Repository"; client-server "Content repository", remote media).
//!
//! - **Serving**: `GET /_matrix/federation/v1/media/download/{mediaId}` and
//!   `/thumbnail/{mediaId}` answer our own media to other servers as `multipart/mixed`
//!   (a JSON part `{}`, then the media part; never a redirect), authenticated with the
//!   federation crate's `X-Matrix` check. They live here, not in `federation`, because
//!   the blobs and the thumbnailer are the content repository's (as `openid/userinfo`
//!   lives with the OpenID tokens). With federation disabled they answer 404
//!   `M_UNRECOGNIZED`.
//! - **Fetching**: `/_matrix/client/v1/media/download|thumbnail/{serverName}/...` for
//!   another server's media asks that server over federation
//!   ([`spindle_federation::media::fetch_remote_media`]) and keeps the answer in
//!   [`RemoteMediaCache`]: in memory, at most `[media] remote_cache_bytes` bytes in
//!   total (oldest evicted first), lost on restart (a cache, not data: nothing is
//!   journaled). A remote file larger than `max_upload_bytes` is 502 `M_TOO_LARGE`,
//!   one the remote does not have is 404 `M_NOT_FOUND`, an unreachable server 502
//!   `M_UNKNOWN` (the spec's answers).

use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use axum::{
    extract::{FromRequest, Path, Request, State},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use spindle_federation::media::{MediaFetchError, MediaPart};

use crate::{ApiResult, AppState, MatrixError, extract::Query};

/// Remote media kept in memory, bounded by total bytes.
pub struct RemoteMediaCache {
    max_bytes: usize,
    inner: parking_lot::Mutex<CacheInner>,
}

#[derive(Default)]
struct CacheInner {
    map: HashMap<String, Arc<MediaPart>>,
    order: VecDeque<String>,
    bytes: usize,
}

impl RemoteMediaCache {
    /// A cache holding at most `max_bytes` of media bytes (`0`: none).
    pub fn new(max_bytes: usize) -> RemoteMediaCache {
        RemoteMediaCache {
            max_bytes,
            inner: parking_lot::Mutex::default(),
        }
    }

    /// The cached answer for `key`.
    pub fn get(&self, key: &str) -> Option<Arc<MediaPart>> {
        self.inner.lock().map.get(key).cloned()
    }

    /// Keeps `part` under `key`, evicting the oldest entries to stay within the bound
    /// (a part larger than the whole cache is not kept).
    pub fn put(&self, key: String, part: Arc<MediaPart>) {
        let size = part.bytes.len();
        if size > self.max_bytes {
            return;
        }
        let mut c = self.inner.lock();
        if let Some(old) = c.map.insert(key.clone(), part) {
            c.bytes -= old.bytes.len();
        } else {
            c.order.push_back(key);
        }
        c.bytes += size;
        while c.bytes > self.max_bytes {
            let Some(oldest) = c.order.pop_front() else {
                break;
            };
            if let Some(gone) = c.map.remove(&oldest) {
                c.bytes -= gone.bytes.len();
            }
        }
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Another server's media (or, with `thumbnail`, a thumbnail of it made by that
/// server), from the cache or over federation.
pub(crate) async fn fetch(
    s: &AppState,
    server: &str,
    media_id: &str,
    thumbnail: Option<(u32, u32, bool)>,
) -> ApiResult<Arc<MediaPart>> {
    let Some(fed) = &s.federation else {
        return Err(MatrixError::not_found(
            "Remote media is not available (federation is disabled)",
        ));
    };
    if !crate::media::valid_media_id(media_id) {
        return Err(MatrixError::not_found("Unknown media"));
    }
    let query = thumbnail.map(|(w, h, crop)| {
        format!(
            "width={w}&height={h}&method={}",
            if crop { "crop" } else { "scale" }
        )
    });
    let key = format!("{server}/{media_id}?{}", query.as_deref().unwrap_or(""));
    if let Some(hit) = s.remote_media.get(&key) {
        return Ok(hit);
    }
    let max = s.config.media.max_upload_bytes;
    let part =
        spindle_federation::media::fetch_remote_media(fed, server, media_id, query.as_deref(), max)
            .await
            .map_err(|e| match e {
                MediaFetchError::NotFound => MatrixError::not_found("Unknown media"),
                MediaFetchError::TooLarge(_) => MatrixError::new(
                    StatusCode::BAD_GATEWAY,
                    "M_TOO_LARGE",
                    "The remote content is too large to serve",
                ),
                MediaFetchError::Failed(m) => MatrixError::new(
                    StatusCode::BAD_GATEWAY,
                    "M_UNKNOWN",
                    format!("Fetching the remote media failed: {m}"),
                ),
            })?;
    let part = Arc::new(part);
    s.remote_media.put(key, part.clone());
    Ok(part)
}

/// The `filename` of a `Content-Disposition` header (`filename*=utf-8''...` preferred,
/// then `filename="..."`).
pub(crate) fn filename_of(disposition: &str) -> Option<String> {
    let mut plain = None;
    for param in disposition.split(';').skip(1) {
        let Some((k, v)) = param.split_once('=') else {
            continue;
        };
        match k.trim().to_ascii_lowercase().as_str() {
            "filename*" => {
                let v = v.trim();
                let encoded = v.split_once("''").map(|(_, e)| e).unwrap_or(v);
                let mut out = Vec::new();
                let b = encoded.as_bytes();
                let mut i = 0;
                while i < b.len() {
                    if b[i] == b'%'
                        && let Some(byte) = b
                            .get(i + 1..i + 3)
                            .and_then(|h| std::str::from_utf8(h).ok())
                            .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        out.push(byte);
                        i += 3;
                        continue;
                    }
                    out.push(b[i]);
                    i += 1;
                }
                if let Ok(name) = String::from_utf8(out) {
                    return Some(name);
                }
            }
            "filename" => plain = Some(v.trim().trim_matches('"').to_owned()),
            _ => {}
        }
    }
    plain.filter(|n| !n.is_empty())
}

/// The federation crate's state, or 404 `M_UNRECOGNIZED` (federation disabled: the
/// endpoint does not exist).
fn fed(s: &AppState) -> ApiResult<&spindle_federation::FedState> {
    s.federation.as_ref().ok_or_else(|| {
        MatrixError::new(
            StatusCode::NOT_FOUND,
            "M_UNRECOGNIZED",
            "Unrecognized request",
        )
    })
}

fn fed_error(e: spindle_federation::FedError) -> Response {
    e.into_response()
}

fn multipart(part: &MediaPart) -> Response {
    let (content_type, body) = spindle_federation::media::multipart_mixed(part);
    let mut resp = body.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(&content_type).unwrap_or(HeaderValue::from_static("multipart/mixed")),
    );
    resp
}

/// `GET /_matrix/federation/v1/media/download/{mediaId}` (signed): one of our media
/// files as `multipart/mixed`. Unknown: 404 `M_NOT_FOUND`; reserved but not uploaded:
/// 504 `M_NOT_YET_UPLOADED`.
pub(crate) async fn federation_download(
    State(s): State<AppState>,
    Path(media_id): Path<String>,
    req: Request,
) -> Response {
    let fed = match fed(&s) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = spindle_federation::auth::Signed::from_request(req, fed).await {
        return fed_error(e);
    }
    match crate::media::local_file(&s, &media_id).await {
        Ok(part) => multipart(&part),
        Err(e) => e.into_response(),
    }
}

/// `GET /_matrix/federation/v1/media/thumbnail/{mediaId}?width&height&method` (signed):
/// a thumbnail of one of our media files as `multipart/mixed`, made as the
/// Client-Server thumbnail is (same limits and errors).
pub(crate) async fn federation_thumbnail(
    State(s): State<AppState>,
    Path(media_id): Path<String>,
    q: Query,
    req: Request,
) -> Response {
    let fed = match fed(&s) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = spindle_federation::auth::Signed::from_request(req, fed).await {
        return fed_error(e);
    }
    let params = match crate::media::thumbnail_params(&q) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    match crate::media::local_thumbnail(&s, &media_id, params).await {
        Ok(part) => multipart(&part),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(n: usize) -> Arc<MediaPart> {
        Arc::new(MediaPart {
            content_type: "text/plain".into(),
            content_disposition: None,
            bytes: vec![b'x'; n],
        })
    }

    #[test]
    fn the_cache_stays_within_its_byte_bound_evicting_the_oldest() {
        let c = RemoteMediaCache::new(100);
        c.put("a".into(), part(40));
        c.put("b".into(), part(40));
        assert_eq!((c.len(), c.bytes()), (2, 80));
        c.put("c".into(), part(40));
        assert_eq!((c.len(), c.bytes()), (2, 80));
        assert!(c.get("a").is_none() && c.get("b").is_some() && c.get("c").is_some());
        // Larger than the whole cache: not kept, nothing evicted.
        c.put("huge".into(), part(101));
        assert_eq!((c.len(), c.bytes()), (2, 80));
        let off = RemoteMediaCache::new(0);
        off.put("a".into(), part(1));
        assert!(off.is_empty());
    }

    #[test]
    fn remote_file_names_are_read_from_content_disposition() {
        assert_eq!(
            filename_of("inline; filename=\"cat.png\""),
            Some("cat.png".into())
        );
        assert_eq!(
            filename_of("attachment; filename=\"x\"; filename*=utf-8''caf%C3%A9.txt"),
            Some("café.txt".into())
        );
        assert_eq!(filename_of("inline"), None);
    }
}
