//! The content repository (spec: client-server API "Content repository"): uploads
//! (`POST /_matrix/media/v3/upload`, async `POST /_matrix/media/v1/create` + `PUT
//! /_matrix/media/v3/upload/{serverName}/{mediaId}`), authenticated downloads and
//! thumbnails (`/_matrix/client/v1/media/...`), `/config`, URL previews, and the
//! legacy unauthenticated `/_matrix/media/v3/{download,thumbnail,config}` endpoints
//! (served unless `media.legacy_unauthenticated` is off, as the spec's freeze allows).
//!
//! Bytes are content-addressed blobs written durably before the `MediaUploaded` fact
//! that names them; metadata is read from the `media` projection. Thumbnails are
//! made with the `image` crate and cached on disk (derived, disposable). Every media
//! answer carries a restrictive `Content-Security-Policy`, `nosniff`, and a
//! `Content-Disposition` that is `inline` only for the spec's safe types.

use std::{net::IpAddr, path::PathBuf, time::Duration};

use axum::{
    Json, Router,
    body::Bytes,
    extract::{DefaultBodyLimit, FromRequest, Path, Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post, put},
};
use serde_json::{Value, json};
use spindle_journal::{CommandBody, Fact};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{Query, Requester},
};

/// Largest thumbnail side served, pixels (requests are clamped to it).
pub const MAX_THUMBNAIL_SIDE: u32 = 1600;
/// Largest image side decoded for thumbnailing (bigger: 413 `M_TOO_LARGE`).
pub const MAX_DECODE_SIDE: u32 = 12_000;
/// How long an id from `/create` may wait for its upload, ms (spec: `unused_expires_at`).
pub const CREATE_EXPIRES_MS: u64 = 24 * 3600 * 1000;
/// Largest HTML page read for a URL preview, bytes.
pub const PREVIEW_MAX_BYTES: usize = 1024 * 1024;

/// Content types served `inline` (spec: "Serving inline content"); everything else
/// is an `attachment`.
const INLINE_TYPES: [&str; 23] = [
    "text/css",
    "text/plain",
    "text/csv",
    "application/json",
    "application/ld+json",
    "image/jpeg",
    "image/gif",
    "image/png",
    "image/apng",
    "image/webp",
    "image/avif",
    "video/mp4",
    "video/webm",
    "video/ogg",
    "video/quicktime",
    "audio/mp4",
    "audio/webm",
    "audio/aac",
    "audio/mpeg",
    "audio/ogg",
    "audio/wave",
    "audio/wav",
    "audio/x-wav",
];

const CSP: &str = "sandbox; default-src 'none'; script-src 'none'; plugin-types application/pdf; style-src 'unsafe-inline'; media-src 'self'; object-src 'self';";

pub(crate) fn routes(max_upload_bytes: usize, url_preview: bool) -> Router<AppState> {
    let uploads = Router::new()
        .route("/_matrix/media/v3/upload", post(upload))
        .route(
            "/_matrix/media/v3/upload/{server}/{media_id}",
            put(upload_to),
        )
        .layer(DefaultBodyLimit::max(max_upload_bytes));
    Router::new()
        .merge(uploads)
        .route("/_matrix/media/v1/create", post(create))
        .route("/_matrix/client/v1/media/config", get(config))
        .route(
            "/_matrix/client/v1/media/download/{server}/{media_id}",
            get(download),
        )
        .route(
            "/_matrix/client/v1/media/download/{server}/{media_id}/{filename}",
            get(download_named),
        )
        .route(
            "/_matrix/client/v1/media/thumbnail/{server}/{media_id}",
            get(thumbnail),
        )
        .route(
            "/_matrix/federation/v1/media/download/{media_id}",
            get(crate::remote_media::federation_download),
        )
        .route(
            "/_matrix/federation/v1/media/thumbnail/{media_id}",
            get(crate::remote_media::federation_thumbnail),
        )
        .route("/_matrix/media/v3/config", get(legacy_config))
        .route(
            "/_matrix/media/v3/download/{server}/{media_id}",
            get(legacy_download),
        )
        .route(
            "/_matrix/media/v3/download/{server}/{media_id}/{filename}",
            get(legacy_download_named),
        )
        .route(
            "/_matrix/media/v3/thumbnail/{server}/{media_id}",
            get(legacy_thumbnail),
        )
        .merge(if url_preview {
            // Off by default: then the endpoints are not served at all (404).
            Router::new()
                .route("/_matrix/client/v1/media/preview_url", get(preview_url))
                .route("/_matrix/media/v3/preview_url", get(legacy_preview_url))
        } else {
            Router::new()
        })
}

fn too_large(msg: &str) -> MatrixError {
    MatrixError::new(StatusCode::PAYLOAD_TOO_LARGE, "M_TOO_LARGE", msg)
}

fn random_media_id() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..24)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// Media ids are `[A-Za-z0-9_-]+` (spec: "Matrix Content (mxc://) URIs").
pub(crate) fn valid_media_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 255
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Reads the raw body (413 `M_TOO_LARGE` over `media.max_upload_bytes`).
async fn body_bytes(req: Request, s: &AppState) -> ApiResult<Bytes> {
    Bytes::from_request(req, s).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            too_large("Upload is larger than media.max_upload_bytes")
        } else {
            MatrixError::new(StatusCode::BAD_REQUEST, "M_UNKNOWN", e.body_text())
        }
    })
}

fn content_type_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Stores bytes as a blob (off the async threads), returns the hash.
async fn store_blob(s: &AppState, bytes: Bytes) -> ApiResult<String> {
    let blobs = s.blobs.clone();
    tokio::task::spawn_blocking(move || blobs.put(&bytes))
        .await
        .map_err(|e| MatrixError::internal(e.to_string()))?
        .map_err(|e| MatrixError::internal(format!("storing media: {e}")))
}

async fn journal_upload(
    s: &AppState,
    r: &Requester,
    media_id: &str,
    hash: String,
    content_type: Option<String>,
    filename: Option<String>,
    size: u64,
) -> ApiResult<()> {
    s.submit(
        &r.user_id,
        Some(&r.device_id),
        CommandBody::Fact {
            fact: Fact::MediaUploaded {
                media_id: media_id.to_owned(),
                uploader: r.user_id.clone(),
                content_hash: hash,
                content_type,
                filename,
                size,
            },
        },
    )
    .await?;
    Ok(())
}

/// `POST /_matrix/media/v3/upload?filename=`: stores the body, answers its
/// `content_uri`.
async fn upload(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    req: Request,
) -> ApiResult<Json<Value>> {
    crate::ratelimit::check_user(&s, &s.rate_limits.media_upload, &r.user_id)?;
    let content_type = content_type_of(req.headers());
    let bytes = body_bytes(req, &s).await?;
    let size = bytes.len() as u64;
    let hash = store_blob(&s, bytes).await?;
    let media_id = random_media_id();
    journal_upload(
        &s,
        &r,
        &media_id,
        hash,
        content_type,
        q.get("filename").map(str::to_owned),
        size,
    )
    .await?;
    Ok(Json(
        json!({ "content_uri": format!("mxc://{}/{media_id}", s.server_name()) }),
    ))
}

/// `POST /_matrix/media/v1/create`: reserves a media id for a later upload.
async fn create(State(s): State<AppState>, r: Requester) -> ApiResult<Json<Value>> {
    crate::ratelimit::check_user(&s, &s.rate_limits.media_create, &r.user_id)?;
    let media_id = random_media_id();
    let outcome = s
        .submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::MediaCreated {
                    media_id: media_id.clone(),
                    uploader: r.user_id.clone(),
                },
            },
        )
        .await?;
    s.wait_for(outcome.position).await?;
    Ok(Json(json!({
        "content_uri": format!("mxc://{}/{media_id}", s.server_name()),
        "unused_expires_at": crate::now_ms() + CREATE_EXPIRES_MS,
    })))
}

/// `PUT /_matrix/media/v3/upload/{serverName}/{mediaId}`: the upload for an id from
/// `/create`. Someone else's id: 403 `M_FORBIDDEN`; already uploaded: 409
/// `M_CANNOT_OVERWRITE_MEDIA` (decided by the journal); unknown: 404.
async fn upload_to(
    State(s): State<AppState>,
    r: Requester,
    q: Query,
    Path((server, media_id)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Json<Value>> {
    if server != s.server_name() || !valid_media_id(&media_id) {
        return Err(MatrixError::not_found("Unknown media id"));
    }
    let record = s
        .projections
        .media
        .get(&media_id)
        .ok_or_else(|| MatrixError::not_found("Unknown media id"))?;
    if record.uploader != r.user_id {
        return Err(MatrixError::forbidden(
            "This media id belongs to someone else",
        ));
    }
    if record.content_hash.is_some() {
        return Err(cannot_overwrite());
    }
    crate::ratelimit::check_user(&s, &s.rate_limits.media_upload, &r.user_id)?;
    let content_type = content_type_of(req.headers());
    let bytes = body_bytes(req, &s).await?;
    let size = bytes.len() as u64;
    let hash = store_blob(&s, bytes).await?;
    journal_upload(
        &s,
        &r,
        &media_id,
        hash,
        content_type,
        q.get("filename").map(str::to_owned),
        size,
    )
    .await?;
    Ok(Json(json!({})))
}

/// 409 `M_CANNOT_OVERWRITE_MEDIA`.
pub fn cannot_overwrite() -> MatrixError {
    MatrixError::new(
        StatusCode::CONFLICT,
        "M_CANNOT_OVERWRITE_MEDIA",
        "Media has already been uploaded",
    )
}

async fn config(State(s): State<AppState>, _r: Requester) -> Json<Value> {
    Json(json!({ "m.upload.size": s.config.media.max_upload_bytes }))
}

fn legacy_enabled(s: &AppState) -> ApiResult<()> {
    if s.config.media.legacy_unauthenticated {
        Ok(())
    } else {
        Err(MatrixError::not_found(
            "Unauthenticated media is frozen on this server: use /_matrix/client/v1/media",
        ))
    }
}

async fn legacy_config(State(s): State<AppState>) -> ApiResult<Json<Value>> {
    legacy_enabled(&s)?;
    Ok(Json(
        json!({ "m.upload.size": s.config.media.max_upload_bytes }),
    ))
}

/// The stored media of a local mxc, with its bytes.
async fn load(
    s: &AppState,
    server: &str,
    media_id: &str,
) -> ApiResult<(spindle_projections::media::MediaRecord, Vec<u8>)> {
    if server != s.server_name() {
        // Remote media is fetched by the callers (`remote_media::fetch`).
        return Err(MatrixError::not_found("Unknown media"));
    }
    let record = s
        .projections
        .media
        .get(media_id)
        // Quarantined media (Synapse admin API) is not served, as in Synapse.
        .filter(|m| m.quarantined_by.is_none())
        .ok_or_else(|| MatrixError::not_found("Unknown media"))?;
    let Some(hash) = record.content_hash.clone() else {
        return Err(MatrixError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "M_NOT_YET_UPLOADED",
            "The media has not been uploaded yet",
        ));
    };
    let blobs = s.blobs.clone();
    let bytes = tokio::task::spawn_blocking(move || blobs.get(&hash))
        .await
        .map_err(|e| MatrixError::internal(e.to_string()))?
        .map_err(|e| MatrixError::internal(format!("reading media: {e}")))?;
    Ok((record, bytes))
}

/// `Content-Disposition` for a file name: `inline` only for safe types, the name in
/// both the quoted ASCII form and RFC 5987's `filename*`.
fn disposition(content_type: &str, filename: Option<&str>) -> String {
    let base = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let kind = if INLINE_TYPES.contains(&base.as_str()) {
        "inline"
    } else {
        "attachment"
    };
    match filename.filter(|f| !f.is_empty()) {
        None => kind.to_owned(),
        Some(name) => {
            let ascii: String = name
                .chars()
                .map(|c| {
                    if c.is_ascii_graphic() && c != '"' && c != '\\' || c == ' ' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            let mut encoded = String::new();
            for b in name.bytes() {
                if b.is_ascii_alphanumeric() || b"!#$&+-.^_`|~".contains(&b) {
                    encoded.push(b as char);
                } else {
                    encoded.push_str(&format!("%{b:02X}"));
                }
            }
            format!("{kind}; filename=\"{ascii}\"; filename*=utf-8''{encoded}")
        }
    }
}

/// A media response with the safety headers (spec: "Serving inline content").
fn media_response(bytes: Vec<u8>, content_type: &str, disposition: String) -> Response {
    let mut resp = bytes.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_str(content_type)
            .unwrap_or(HeaderValue::from_static("application/octet-stream")),
    );
    h.insert(
        header::CONTENT_DISPOSITION,
        HeaderValue::from_str(&disposition).unwrap_or(HeaderValue::from_static("attachment")),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::HeaderName::from_static("cross-origin-resource-policy"),
        HeaderValue::from_static("cross-origin"),
    );
    resp
}

/// One of our media files with its type and disposition (what the federation
/// download answers).
pub(crate) async fn local_file(
    s: &AppState,
    media_id: &str,
) -> ApiResult<spindle_federation::media::MediaPart> {
    let (record, bytes) = load(s, s.server_name(), media_id).await?;
    let content_type = record
        .content_type
        .clone()
        .unwrap_or_else(|| "application/octet-stream".into());
    Ok(spindle_federation::media::MediaPart {
        content_disposition: Some(disposition(&content_type, record.filename.as_deref())),
        content_type,
        bytes,
    })
}

/// Whether `server` is another server (its media is fetched over federation).
fn is_remote(s: &AppState, server: &str) -> bool {
    server != s.server_name()
}

async fn serve_download(
    s: &AppState,
    server: &str,
    media_id: &str,
    name: Option<&str>,
    allow_remote: bool,
) -> ApiResult<Response> {
    if is_remote(s, server) {
        if !allow_remote {
            return Err(MatrixError::not_found("Unknown media (allow_remote=false)"));
        }
        let part = crate::remote_media::fetch(s, server, media_id, None).await?;
        // The remote's file name, but our own inline/attachment decision.
        let remote_name = part
            .content_disposition
            .as_deref()
            .and_then(crate::remote_media::filename_of);
        let name = name.map(str::to_owned).or(remote_name);
        return Ok(media_response(
            part.bytes.clone(),
            &part.content_type,
            disposition(&part.content_type, name.as_deref()),
        ));
    }
    let part = local_file(s, media_id).await?;
    let record_name = name.is_none();
    let content_type = part.content_type.clone();
    let disp = if record_name {
        part.content_disposition
            .clone()
            .unwrap_or_else(|| disposition(&content_type, None))
    } else {
        disposition(&content_type, name)
    };
    Ok(media_response(part.bytes, &content_type, disp))
}

fn allow_remote(q: &Query) -> bool {
    q.get("allow_remote") != Some("false")
}

/// `GET /_matrix/client/v1/media/download/{serverName}/{mediaId}`.
async fn download(
    State(s): State<AppState>,
    _r: Requester,
    Path((server, media_id)): Path<(String, String)>,
) -> ApiResult<Response> {
    serve_download(&s, &server, &media_id, None, true).await
}

/// `GET /_matrix/client/v1/media/download/{serverName}/{mediaId}/{fileName}`.
async fn download_named(
    State(s): State<AppState>,
    _r: Requester,
    Path((server, media_id, filename)): Path<(String, String, String)>,
) -> ApiResult<Response> {
    serve_download(&s, &server, &media_id, Some(&filename), true).await
}

async fn legacy_download(
    State(s): State<AppState>,
    q: Query,
    Path((server, media_id)): Path<(String, String)>,
) -> ApiResult<Response> {
    legacy_enabled(&s)?;
    serve_download(&s, &server, &media_id, None, allow_remote(&q)).await
}

async fn legacy_download_named(
    State(s): State<AppState>,
    q: Query,
    Path((server, media_id, filename)): Path<(String, String, String)>,
) -> ApiResult<Response> {
    legacy_enabled(&s)?;
    serve_download(&s, &server, &media_id, Some(&filename), allow_remote(&q)).await
}

/// Thumbnail parameters: width, height (clamped to [`MAX_THUMBNAIL_SIDE`]), method.
pub(crate) fn thumbnail_params(q: &Query) -> ApiResult<(u32, u32, bool)> {
    let side = |name: &str| -> ApiResult<u32> {
        let v = q
            .get(name)
            .ok_or_else(|| MatrixError::missing_param(format!("{name} is required")))?;
        let n: u32 = v.parse().map_err(|_| {
            MatrixError::invalid_param(format!("{name} must be a positive integer"))
        })?;
        if n == 0 {
            return Err(MatrixError::invalid_param(format!(
                "{name} must be positive"
            )));
        }
        Ok(n.min(MAX_THUMBNAIL_SIDE))
    };
    let crop = match q.get("method") {
        None | Some("scale") => false,
        Some("crop") => true,
        Some(other) => {
            return Err(MatrixError::invalid_param(format!(
                "method must be scale or crop, not {other:?}"
            )));
        }
    };
    Ok((side("width")?, side("height")?, crop))
}

/// Makes a thumbnail (PNG, or JPEG for JPEG sources): `scale` fits inside the box
/// keeping the aspect ratio, `crop` fills the box and crops the middle. Never upscales.
fn make_thumbnail(
    bytes: &[u8],
    width: u32,
    height: u32,
    crop: bool,
) -> Result<(Vec<u8>, &'static str), MatrixError> {
    use image::{ImageFormat, ImageReader, imageops::FilterType};
    let cannot = || {
        MatrixError::new(
            StatusCode::BAD_REQUEST,
            "M_UNKNOWN",
            "Cannot generate thumbnails for the requested content",
        )
    };
    let reader = ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|_| cannot())?;
    let format = reader.format().ok_or_else(cannot)?;
    let (w, h) = reader.into_dimensions().map_err(|_| cannot())?;
    if w > MAX_DECODE_SIDE || h > MAX_DECODE_SIDE {
        return Err(too_large("Content is too large to thumbnail"));
    }
    let img = image::load_from_memory_with_format(bytes, format).map_err(|_| cannot())?;
    let thumb = if crop {
        let (tw, th) = (width.min(w), height.min(h));
        img.resize_to_fill(tw, th, FilterType::Triangle)
    } else if width >= w && height >= h {
        img
    } else {
        img.resize(width, height, FilterType::Triangle)
    };
    let (out_format, mime) = match format {
        ImageFormat::Jpeg => (ImageFormat::Jpeg, "image/jpeg"),
        _ => (ImageFormat::Png, "image/png"),
    };
    let thumb = if out_format == ImageFormat::Jpeg {
        image::DynamicImage::ImageRgb8(thumb.to_rgb8())
    } else {
        thumb
    };
    let mut out = std::io::Cursor::new(Vec::new());
    thumb
        .write_to(&mut out, out_format)
        .map_err(|e| MatrixError::internal(e.to_string()))?;
    Ok((out.into_inner(), mime))
}

/// A thumbnail of one of our media files (cached on disk by content hash, size and
/// method).
pub(crate) async fn local_thumbnail(
    s: &AppState,
    media_id: &str,
    (width, height, crop): (u32, u32, bool),
) -> ApiResult<spindle_federation::media::MediaPart> {
    let (record, bytes) = load(s, s.server_name(), media_id).await?;
    let hash = record.content_hash.clone().unwrap_or_default();
    let method = if crop { "crop" } else { "scale" };
    let cache: PathBuf = s.blobs.dir().join("thumbnails");
    let stem = format!("{hash}-{width}x{height}-{method}");
    let part = |bytes: Vec<u8>, mime: &str, ext: &str| spindle_federation::media::MediaPart {
        content_type: mime.to_owned(),
        content_disposition: Some(format!("inline; filename=\"thumbnail.{ext}\"")),
        bytes,
    };
    // Cached by content hash and size: equal uploads share thumbnails.
    for (ext, mime) in [("png", "image/png"), ("jpg", "image/jpeg")] {
        let path = cache.join(format!("{stem}.{ext}"));
        if let Ok(data) = tokio::fs::read(&path).await {
            return Ok(part(data, mime, ext));
        }
    }
    let (data, mime) =
        tokio::task::spawn_blocking(move || make_thumbnail(&bytes, width, height, crop))
            .await
            .map_err(|e| MatrixError::internal(e.to_string()))??;
    let ext = if mime == "image/jpeg" { "jpg" } else { "png" };
    // The cache is derived data: a failed write only costs a later recomputation.
    let path = cache.join(format!("{stem}.{ext}"));
    let tmp = cache.join(format!(".{stem}.{}.tmp", std::process::id()));
    let to_write = data.clone();
    let _ = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        std::fs::create_dir_all(path.parent().expect("parent"))?;
        std::fs::write(&tmp, &to_write)?;
        std::fs::rename(&tmp, &path)
    })
    .await;
    Ok(part(data, mime, ext))
}

async fn serve_thumbnail(
    s: &AppState,
    server: &str,
    media_id: &str,
    q: &Query,
) -> ApiResult<Response> {
    let params = thumbnail_params(q)?;
    let part = if is_remote(s, server) {
        if !allow_remote(q) {
            return Err(MatrixError::not_found("Unknown media (allow_remote=false)"));
        }
        let remote = crate::remote_media::fetch(s, server, media_id, Some(params)).await?;
        if !remote.content_type.starts_with("image/") {
            return Err(MatrixError::new(
                StatusCode::BAD_GATEWAY,
                "M_UNKNOWN",
                "The remote server answered a thumbnail that is not an image",
            ));
        }
        remote.as_ref().clone()
    } else {
        local_thumbnail(s, media_id, params).await?
    };
    let disp = disposition(&part.content_type, Some("thumbnail"));
    let disp = part
        .content_disposition
        .clone()
        .filter(|_| !is_remote(s, server))
        .unwrap_or(disp);
    Ok(media_response(part.bytes, &part.content_type, disp))
}

/// `GET /_matrix/client/v1/media/thumbnail/{serverName}/{mediaId}?width&height&method`.
async fn thumbnail(
    State(s): State<AppState>,
    _r: Requester,
    q: Query,
    Path((server, media_id)): Path<(String, String)>,
) -> ApiResult<Response> {
    serve_thumbnail(&s, &server, &media_id, &q).await
}

async fn legacy_thumbnail(
    State(s): State<AppState>,
    q: Query,
    Path((server, media_id)): Path<(String, String)>,
) -> ApiResult<Response> {
    legacy_enabled(&s)?;
    serve_thumbnail(&s, &server, &media_id, &q).await
}

/// Whether an address is one a URL preview must never fetch unless
/// `media.url_preview_allow_private` is on: loopback, private, link-local, shared
/// (CGNAT), unspecified, multicast, documentation and unique-local ranges.
pub fn is_private(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || o[0] == 0
                || (o[0] == 100 && (64..128).contains(&o[1]))
                || (o[0] == 192 && o[1] == 0 && o[2] == 0)
                || (o[0] == 198 && (18..20).contains(&o[1]))
                || o[0] >= 240
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_private(IpAddr::V4(v4));
            }
            let s = v6.segments();
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] == 0x2001 && s[1] == 0x0db8)
        }
    }
}

/// The `content` of `<meta property|name="NAME" content="...">` in an HTML page.
fn meta(html: &str, name: &str) -> Option<String> {
    let lower = html.to_ascii_lowercase();
    let mut from = 0;
    while let Some(i) = lower[from..].find("<meta") {
        let start = from + i;
        let end = start + lower[start..].find('>')?;
        let tag = &html[start..end];
        let tag_lower = &lower[start..end];
        if tag_lower.contains(&format!("property=\"{name}\""))
            || tag_lower.contains(&format!("name=\"{name}\""))
        {
            let c = tag_lower.find("content=\"")? + 9;
            let len = tag[c..].find('"')?;
            return Some(tag[c..c + len].to_owned());
        }
        from = end;
    }
    None
}

fn title(html: &str) -> Option<String> {
    let lower = html.to_ascii_lowercase();
    let start = lower.find("<title")?;
    let open_end = start + lower[start..].find('>')? + 1;
    let close = open_end + lower[open_end..].find("</title")?;
    Some(html[open_end..close].trim().to_owned())
}

async fn serve_preview(s: &AppState, q: &Query) -> ApiResult<Json<Value>> {
    let raw = q
        .get("url")
        .ok_or_else(|| MatrixError::missing_param("url is required"))?;
    let url =
        reqwest::Url::parse(raw).map_err(|_| MatrixError::invalid_param("url is not a URL"))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(MatrixError::invalid_param(
            "only http and https URLs are previewed",
        ));
    }
    let host = url
        .host_str()
        .ok_or_else(|| MatrixError::invalid_param("url has no host"))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = url.port_or_known_default().unwrap_or(80);
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
        .await
        .map_err(|_| {
            MatrixError::new(
                StatusCode::BAD_GATEWAY,
                "M_UNKNOWN",
                "Could not resolve the host",
            )
        })?
        .collect();
    let Some(first) = addrs.first().copied() else {
        return Err(MatrixError::new(
            StatusCode::BAD_GATEWAY,
            "M_UNKNOWN",
            "Could not resolve the host",
        ));
    };
    if !s.config.media.url_preview_allow_private && addrs.iter().any(|a| is_private(a.ip())) {
        return Err(MatrixError::forbidden(
            "URL previews of private, loopback and link-local addresses are not allowed",
        ));
    }
    // Connect to the address that was checked (no second resolution to rebind), and
    // follow no redirects (a redirect could lead anywhere).
    let client = reqwest::Client::builder()
        .no_proxy()
        .resolve(&host, first)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(10))
        .build()
        .map_err(|e| MatrixError::internal(e.to_string()))?;
    let mut resp = client.get(url.clone()).send().await.map_err(|e| {
        MatrixError::new(
            StatusCode::BAD_GATEWAY,
            "M_UNKNOWN",
            format!("fetching the page: {e}"),
        )
    })?;
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| MatrixError::new(StatusCode::BAD_GATEWAY, "M_UNKNOWN", e.to_string()))?
    {
        body.extend_from_slice(&chunk);
        if body.len() > PREVIEW_MAX_BYTES {
            break;
        }
    }
    let html = String::from_utf8_lossy(&body);
    let mut out = serde_json::Map::new();
    if let Some(t) = meta(&html, "og:title").or_else(|| title(&html)) {
        out.insert("og:title".into(), json!(t));
    }
    if let Some(d) = meta(&html, "og:description").or_else(|| meta(&html, "description")) {
        out.insert("og:description".into(), json!(d));
    }
    Ok(Json(Value::Object(out)))
}

/// `GET /_matrix/client/v1/media/preview_url?url=`: off unless `media.url_preview`;
/// refuses hosts resolving to private, loopback or link-local addresses unless
/// `media.url_preview_allow_private`. Returns `og:title` and `og:description` (images
/// in previews are not fetched).
async fn preview_url(State(s): State<AppState>, _r: Requester, q: Query) -> ApiResult<Json<Value>> {
    serve_preview(&s, &q).await
}

async fn legacy_preview_url(
    State(s): State<AppState>,
    _r: Requester,
    q: Query,
) -> ApiResult<Json<Value>> {
    legacy_enabled(&s)?;
    serve_preview(&s, &q).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_ranges_are_recognized() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_private(ip.parse().unwrap()), "{ip} is private");
        }
        for ip in ["93.184.216.34", "2606:2800:220:1::1", "8.8.8.8"] {
            assert!(!is_private(ip.parse().unwrap()), "{ip} is public");
        }
    }

    #[test]
    fn only_safe_types_are_inline_and_names_are_quoted() {
        assert_eq!(
            disposition("image/png", Some("a b.png")),
            "inline; filename=\"a b.png\"; filename*=utf-8''a%20b.png"
        );
        assert_eq!(disposition("text/html", None), "attachment");
        assert_eq!(
            disposition("image/svg+xml", Some("x\".svg")),
            "attachment; filename=\"x_.svg\"; filename*=utf-8''x%22.svg"
        );
        assert_eq!(disposition("text/plain; charset=utf-8", None), "inline");
    }
}
