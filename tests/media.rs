//! The content repository (issue 4): uploads (direct and asynchronous), authenticated
//! and legacy downloads, thumbnails, limits, safe headers and URL preview refusals.

mod common;

use common::{Client, TestServer};
use serde_json::{Value, json};

/// A 64x48 RGB gradient PNG.
fn png() -> Vec<u8> {
    let img = image::RgbImage::from_fn(64, 48, |x, y| {
        image::Rgb([(x * 4) as u8, (y * 5) as u8, 128])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

struct Got {
    status: u16,
    headers: reqwest::header::HeaderMap,
    bytes: Vec<u8>,
}

impl Got {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.bytes).unwrap_or(Value::Null)
    }
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

async fn call(
    c: &Client,
    method: reqwest::Method,
    path: &str,
    body: Option<(Vec<u8>, &str)>,
) -> Got {
    let mut req = c.http.request(method, format!("{}{path}", c.base));
    if let Some(t) = &c.token {
        req = req.bearer_auth(t);
    }
    if let Some((b, ct)) = body {
        req = req.header("content-type", ct).body(b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    assert!(status < 500 || status == 504, "{path} answered {status}");
    let headers = resp.headers().clone();
    Got {
        status,
        headers,
        bytes: resp.bytes().await.unwrap().to_vec(),
    }
}

async fn upload(c: &Client, bytes: Vec<u8>, content_type: &str, filename: &str) -> String {
    let got = call(
        c,
        reqwest::Method::POST,
        &format!(
            "/_matrix/media/v3/upload?filename={}",
            common::enc(filename)
        ),
        Some((bytes, content_type)),
    )
    .await;
    assert_eq!(got.status, 200, "{}", String::from_utf8_lossy(&got.bytes));
    got.json()["content_uri"].as_str().unwrap().to_owned()
}

fn mxc_path(uri: &str) -> String {
    uri.strip_prefix("mxc://").unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn png_round_trip_thumbnails_and_safe_headers() {
    let srv = TestServer::start().await;
    let alice = srv.register("alice").await;
    let original = png();
    let uri = upload(&alice, original.clone(), "image/png", "pic ü.png").await;
    assert!(uri.starts_with("mxc://localhost:8008/"), "{uri}");
    let path = mxc_path(&uri);

    let got = call(
        &alice,
        reqwest::Method::GET,
        &format!("/_matrix/client/v1/media/download/{path}"),
        None,
    )
    .await;
    assert_eq!(got.status, 200);
    assert_eq!(got.bytes, original, "byte-identical download");
    assert_eq!(got.header("content-type"), "image/png");
    assert_eq!(
        got.header("content-disposition"),
        "inline; filename=\"pic _.png\"; filename*=utf-8''pic%20%C3%BC.png"
    );
    assert!(
        got.header("content-security-policy")
            .starts_with("sandbox; default-src 'none'")
    );
    assert_eq!(got.header("x-content-type-options"), "nosniff");
    // Authenticated media needs a token; the legacy endpoint does not (by default).
    let anon = srv.anon();
    let got = call(
        &anon,
        reqwest::Method::GET,
        &format!("/_matrix/client/v1/media/download/{path}"),
        None,
    )
    .await;
    assert_eq!(
        (got.status, got.json()["errcode"].clone()),
        (401, json!("M_MISSING_TOKEN"))
    );
    let got = call(
        &anon,
        reqwest::Method::GET,
        &format!("/_matrix/media/v3/download/{path}/other.png"),
        None,
    )
    .await;
    assert_eq!(got.bytes, original);
    assert_eq!(
        got.header("content-disposition"),
        "inline; filename=\"other.png\"; filename*=utf-8''other.png"
    );

    // Thumbnails: scale fits the box (64x48 into 32x32 is 32x24), crop fills it.
    let thumb = |w: u32, h: u32, m: &str| {
        format!("/_matrix/client/v1/media/thumbnail/{path}?width={w}&height={h}&method={m}")
    };
    for (w, h, m, want) in [
        (32, 32, "scale", (32, 24)),
        (16, 16, "crop", (16, 16)),
        (640, 480, "scale", (64, 48)),
    ] {
        let got = call(&alice, reqwest::Method::GET, &thumb(w, h, m), None).await;
        assert_eq!(got.status, 200);
        assert_eq!(got.header("content-type"), "image/png");
        let img = image::load_from_memory_with_format(&got.bytes, image::ImageFormat::Png)
            .expect("a valid PNG");
        assert_eq!((img.width(), img.height()), want, "{w}x{h} {m}");
        // Cached: the same answer again.
        let again = call(&alice, reqwest::Method::GET, &thumb(w, h, m), None).await;
        assert_eq!(again.bytes, got.bytes);
    }
    let bad = call(&alice, reqwest::Method::GET, &thumb(0, 10, "scale"), None).await;
    assert_eq!(
        (bad.status, bad.json()["errcode"].clone()),
        (400, json!("M_INVALID_PARAM"))
    );
    // Not an image: no thumbnail; an HTML upload is an attachment, never inline.
    let text = mxc_path(
        &upload(
            &alice,
            b"<script>alert(1)</script>".to_vec(),
            "text/html",
            "x.html",
        )
        .await,
    );
    let got = call(
        &alice,
        reqwest::Method::GET,
        &format!("/_matrix/client/v1/media/thumbnail/{text}?width=10&height=10"),
        None,
    )
    .await;
    assert_eq!(
        (got.status, got.json()["errcode"].clone()),
        (400, json!("M_UNKNOWN"))
    );
    let got = call(
        &alice,
        reqwest::Method::GET,
        &format!("/_matrix/client/v1/media/download/{text}"),
        None,
    )
    .await;
    assert_eq!(
        got.header("content-disposition"),
        "attachment; filename=\"x.html\"; filename*=utf-8''x.html"
    );
    let got = call(
        &alice,
        reqwest::Method::GET,
        "/_matrix/client/v1/media/download/localhost:8008/nope",
        None,
    )
    .await;
    assert_eq!(
        (got.status, got.json()["errcode"].clone()),
        (404, json!("M_NOT_FOUND"))
    );
    // The file is stored once, content-addressed under the data directory.
    let hash = blake3::hash(&original).to_hex().to_string();
    assert!(
        srv.dir
            .path()
            .join("data/media")
            .join(&hash[..2])
            .join(&hash)
            .is_file()
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_upload_limits_and_url_preview_refusals() {
    let srv = TestServer::start_with(|c| {
        c.media.max_upload_bytes = 100_000;
        c.media.url_preview = true;
    })
    .await;
    let alice = srv.register("alice").await;
    let bob = srv.register("bob").await;
    let cfg = call(
        &alice,
        reqwest::Method::GET,
        "/_matrix/client/v1/media/config",
        None,
    )
    .await;
    assert_eq!(cfg.json(), json!({ "m.upload.size": 100_000 }));
    let big = call(
        &alice,
        reqwest::Method::POST,
        "/_matrix/media/v3/upload",
        Some((vec![0u8; 100_001], "application/octet-stream")),
    )
    .await;
    assert_eq!(
        (big.status, big.json()["errcode"].clone()),
        (413, json!("M_TOO_LARGE"))
    );

    let created = call(
        &alice,
        reqwest::Method::POST,
        "/_matrix/media/v1/create",
        Some((b"{}".to_vec(), "application/json")),
    )
    .await
    .json();
    let path = mxc_path(created["content_uri"].as_str().unwrap());
    assert!(created["unused_expires_at"].as_u64().unwrap() > 0);
    let early = call(
        &alice,
        reqwest::Method::GET,
        &format!("/_matrix/client/v1/media/download/{path}"),
        None,
    )
    .await;
    assert_eq!(
        (early.status, early.json()["errcode"].clone()),
        (504, json!("M_NOT_YET_UPLOADED"))
    );
    let put = |c: &Client, body: &[u8]| {
        let (c, body, path) = (c.clone(), body.to_vec(), path.clone());
        async move {
            call(
                &c,
                reqwest::Method::PUT,
                &format!("/_matrix/media/v3/upload/{path}?filename=a.txt"),
                Some((body, "text/plain")),
            )
            .await
        }
    };
    let r = put(&bob, b"not yours").await;
    assert_eq!(
        (r.status, r.json()["errcode"].clone()),
        (403, json!("M_FORBIDDEN"))
    );
    let r = put(&alice, b"hello").await;
    assert_eq!((r.status, r.json()), (200, json!({})));
    let r = put(&alice, b"again").await;
    assert_eq!(
        (r.status, r.json()["errcode"].clone()),
        (409, json!("M_CANNOT_OVERWRITE_MEDIA"))
    );
    let got = call(
        &bob,
        reqwest::Method::GET,
        &format!("/_matrix/client/v1/media/download/{path}"),
        None,
    )
    .await;
    assert_eq!(got.bytes, b"hello");
    assert_eq!(got.header("content-type"), "text/plain");

    // URL previews refuse loopback and private targets.
    for url in [
        "http://127.0.0.1:9/",
        "http://localhost/",
        "http://[::1]/",
        "http://10.0.0.1/",
        "http://169.254.169.254/latest",
    ] {
        let r = call(
            &alice,
            reqwest::Method::GET,
            &format!(
                "/_matrix/client/v1/media/preview_url?url={}",
                common::enc(url)
            ),
            None,
        )
        .await;
        assert_eq!(
            (r.status, r.json()["errcode"].clone()),
            (403, json!("M_FORBIDDEN")),
            "{url}"
        );
    }
    let r = call(
        &alice,
        reqwest::Method::GET,
        "/_matrix/client/v1/media/preview_url?url=ftp%3A%2F%2Fexample.org",
        None,
    )
    .await;
    assert_eq!(r.status, 400);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previews_are_off_by_default_and_legacy_media_can_be_frozen() {
    let srv = TestServer::start_with(|c| c.media.legacy_unauthenticated = false).await;
    let alice = srv.register("alice").await;
    let r = call(
        &alice,
        reqwest::Method::GET,
        "/_matrix/client/v1/media/preview_url?url=http%3A%2F%2Fexample.org",
        None,
    )
    .await;
    assert_eq!(
        (r.status, r.json()["errcode"].clone()),
        (404, json!("M_UNRECOGNIZED"))
    );
    let path = mxc_path(&upload(&alice, b"x".to_vec(), "text/plain", "x.txt").await);
    let r = call(
        &srv.anon(),
        reqwest::Method::GET,
        &format!("/_matrix/media/v3/download/{path}"),
        None,
    )
    .await;
    assert_eq!(
        (r.status, r.json()["errcode"].clone()),
        (404, json!("M_NOT_FOUND"))
    );
    let r = call(
        &alice,
        reqwest::Method::GET,
        &format!("/_matrix/client/v1/media/download/{path}"),
        None,
    )
    .await;
    assert_eq!(r.bytes, b"x");
    srv.stop().await;
}
