//! Third-party identifiers (issue 15 item 10): email validation through an SMTP sink,
//! `/account/3pid` add, list and delete, binds and unbinds on an identity server, and
//! third-party invites. The SMTP sink and the identity server are written here, on
//! tokio listeners on loopback: no external service.

mod common;

use std::sync::Arc;

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::IntoResponse,
    routing::{get, post},
};
use common::{TestServer, uid};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::TcpListener,
    sync::mpsc,
};

/// One email the sink accepted: the envelope and the message as sent (dot-unstuffed).
#[derive(Debug, Clone)]
struct Mail {
    from: String,
    to: Vec<String>,
    data: String,
}

impl Mail {
    /// A header's value (first occurrence, unfolded).
    fn header(&self, name: &str) -> Option<String> {
        let head = self.data.split("\r\n\r\n").next()?;
        let prefix = format!("{}:", name.to_ascii_lowercase());
        head.split("\r\n")
            .find(|l| l.to_ascii_lowercase().starts_with(&prefix))
            .map(|l| l[prefix.len()..].trim().to_owned())
    }

    /// The body, with CRLF line ends made LF.
    fn body(&self) -> String {
        let (_, body) = self.data.split_once("\r\n\r\n").expect("a body");
        body.replace("\r\n", "\n")
    }

    /// The link line of the validation email.
    fn link(&self) -> String {
        self.body()
            .lines()
            .find(|l| l.starts_with("http"))
            .expect("a link in the email")
            .to_owned()
    }
}

/// A minimal SMTP server (RFC 5321 without extensions): accepts every message and
/// hands it to the returned channel.
async fn smtp_sink() -> (u16, mpsc::UnboundedReceiver<Mail>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let (read, mut write) = stream.into_split();
                let mut lines = BufReader::new(read);
                write.write_all(b"220 sink ESMTP\r\n").await.unwrap();
                let mut from = String::new();
                let mut to = Vec::new();
                loop {
                    let mut line = String::new();
                    if lines.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let upper = line.to_ascii_uppercase();
                    let reply: &[u8] = if upper.starts_with("EHLO") || upper.starts_with("HELO") {
                        b"250-sink\r\n250 8BITMIME\r\n"
                    } else if upper.starts_with("MAIL FROM:") {
                        from = line[10..].trim().to_owned();
                        b"250 ok\r\n"
                    } else if upper.starts_with("RCPT TO:") {
                        to.push(line[8..].trim().to_owned());
                        b"250 ok\r\n"
                    } else if upper.starts_with("DATA") {
                        write.write_all(b"354 go on\r\n").await.unwrap();
                        let mut data = String::new();
                        loop {
                            let mut l = String::new();
                            lines.read_line(&mut l).await.unwrap();
                            if l == ".\r\n" {
                                break;
                            }
                            data.push_str(l.strip_prefix('.').unwrap_or(&l));
                        }
                        // The CRLF before the final dot belongs to the terminator.
                        if data.ends_with("\r\n") {
                            data.truncate(data.len() - 2);
                        }
                        let _ = tx.send(Mail {
                            from: std::mem::take(&mut from),
                            to: std::mem::take(&mut to),
                            data,
                        });
                        b"250 queued\r\n"
                    } else if upper.starts_with("QUIT") {
                        let _ = write.write_all(b"221 bye\r\n").await;
                        return;
                    } else {
                        b"250 ok\r\n"
                    };
                    write.write_all(reply).await.unwrap();
                }
            });
        }
    });
    (port, rx)
}

/// The next email, within 10 s.
async fn next_mail(rx: &mut mpsc::UnboundedReceiver<Mail>) -> Mail {
    tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv())
        .await
        .expect("an email within 10 s")
        .expect("the sink runs")
}

/// What the fake identity server saw: (path, Authorization header, body).
type Seen = Arc<parking_lot::Mutex<Vec<(String, String, Value)>>>;

#[derive(Clone)]
struct Is {
    seen: Seen,
    /// `(medium, address, user id)`: the binds it holds.
    binds: Arc<parking_lot::Mutex<Vec<(String, String, String)>>>,
    /// The key it signs third-party invites with.
    key: Arc<spindle_core::keys::ServerKey>,
}

const PEPPER: &str = "matrixrocks";

/// `GET /_matrix/identity/v2/hash_details`.
async fn is_hash_details(State(is): State<Is>, h: HeaderMap) -> Json<Value> {
    is.seen
        .lock()
        .push(("hash_details".into(), auth_of(&h), Value::Null));
    Json(json!({ "algorithms": ["none", "sha256"], "lookup_pepper": PEPPER }))
}

fn lookup_hash(address: &str, medium: &str) -> String {
    use base64::Engine as _;
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(format!("{address} {medium} {PEPPER}").as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(digest)
}

/// `POST /_matrix/identity/v2/lookup` (sha256 only, as the client must pick it).
async fn is_lookup(
    State(is): State<Is>,
    h: HeaderMap,
    Json(body): Json<Value>,
) -> axum::response::Response {
    is.seen
        .lock()
        .push(("lookup".into(), auth_of(&h), body.clone()));
    if body["algorithm"] != "sha256" || body["pepper"] != PEPPER {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({ "errcode": "M_INVALID_PEPPER", "error": "bad pepper" })),
        )
            .into_response();
    }
    let mut mappings = serde_json::Map::new();
    for (m, a, u) in is.binds.lock().iter() {
        let hash = lookup_hash(a, m);
        if body["addresses"].as_array().unwrap().contains(&json!(hash)) {
            mappings.insert(hash, json!(u));
        }
    }
    Json(json!({ "mappings": mappings })).into_response()
}

/// `POST /_matrix/identity/v2/store-invite`: token `tok<n>`.
async fn is_store_invite(
    State(is): State<Is>,
    h: HeaderMap,
    Json(body): Json<Value>,
) -> Json<Value> {
    let n = {
        let mut seen = is.seen.lock();
        seen.push(("store-invite".into(), auth_of(&h), body.clone()));
        seen.iter().filter(|(p, _, _)| p == "store-invite").count()
    };
    Json(json!({
        "token": format!("tok{n}"),
        "public_keys": [
            { "public_key": is.key.public_key_base64(), "key_validity_url": "https://is.example/_matrix/identity/v2/pubkey/isvalid" },
        ],
        "display_name": "c...@e...",
    }))
}

fn auth_of(h: &HeaderMap) -> String {
    h.get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// `POST /_matrix/identity/v2/3pid/bind`: session `good` with secret `secret`
/// validated `bob@example.org`; the access token must be `is-token`.
async fn is_bind(
    State(is): State<Is>,
    h: HeaderMap,
    Json(body): Json<Value>,
) -> axum::response::Response {
    is.seen
        .lock()
        .push(("bind".into(), auth_of(&h), body.clone()));
    if auth_of(&h) != "Bearer is-token" {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({ "errcode": "M_UNAUTHORIZED", "error": "bad token" })),
        )
            .into_response();
    }
    if body["sid"] != "good" || body["client_secret"] != "secret" {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({ "errcode": "M_SESSION_NOT_VALIDATED", "error": "not validated" })),
        )
            .into_response();
    }
    let mxid = body["mxid"].as_str().unwrap().to_owned();
    is.binds
        .lock()
        .push(("email".into(), "bob@example.org".into(), mxid.clone()));
    Json(json!({
        "address": "bob@example.org",
        "medium": "email",
        "mxid": mxid,
        "not_before": 0,
        "not_after": 4_000_000_000_000u64,
        "ts": 1,
        "signatures": {},
    }))
    .into_response()
}

/// `POST /_matrix/identity/v2/3pid/unbind`: records the request (the test checks the
/// X-Matrix signature).
async fn is_unbind(State(is): State<Is>, h: HeaderMap, Json(body): Json<Value>) -> Json<Value> {
    is.seen
        .lock()
        .push(("unbind".into(), auth_of(&h), body.clone()));
    is.binds.lock().retain(|(m, a, u)| {
        !(body["threepid"]["medium"] == *m
            && body["threepid"]["address"] == *a
            && body["mxid"] == *u)
    });
    Json(json!({}))
}

/// A fake identity server on loopback; returns its `id_server` (`127.0.0.1:<port>`).
async fn identity_server() -> (String, Is) {
    let is = Is {
        seen: Arc::default(),
        binds: Arc::default(),
        key: Arc::new(spindle_core::keys::ServerKey::generate("is.example")),
    };
    let app = Router::new()
        .route("/_matrix/identity/v2/hash_details", get(is_hash_details))
        .route("/_matrix/identity/v2/lookup", post(is_lookup))
        .route("/_matrix/identity/v2/store-invite", post(is_store_invite))
        .route("/_matrix/identity/v2/3pid/bind", post(is_bind))
        .route("/_matrix/identity/v2/3pid/unbind", post(is_unbind))
        .route("/_matrix/identity/v2", get(|| async { Json(json!({})) }))
        .with_state(is.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr.to_string(), is)
}

/// A server that mails through the sink on `smtp_port` and talks plain HTTP to
/// identity servers on loopback.
async fn server(smtp_port: Option<u16>) -> TestServer {
    TestServer::start_with(|c| {
        if let Some(port) = smtp_port {
            c.email.enabled = true;
            c.email.smtp_host = "127.0.0.1".into();
            c.email.smtp_port = port;
            c.email.tls = "none".into();
            c.email.notif_from = "Spindle <noreply@example.org>".into();
            c.email.app_name = "Spindle Test".into();
        }
        c.identity_servers.ip_range_allowlist = vec!["127.0.0.1/32".into()];
        c.identity_servers.dangerous_plain_http_for_tests = true;
    })
    .await
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Opens the query string of `link` as a map.
fn query_of(link: &str) -> std::collections::HashMap<String, String> {
    let q = link.split_once('?').expect("a query").1;
    q.split('&')
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_owned(), v.replace("%3D", "="))
        })
        .collect()
}

#[tokio::test]
async fn without_email_config_request_token_is_medium_not_supported_and_capability_off() {
    let ts = server(None).await;
    let alice = ts.register("alice").await;
    let body = json!({ "client_secret": "secret", "email": "a@example.org", "send_attempt": 1 });
    let r = ts
        .anon()
        .post("/_matrix/client/v3/account/3pid/email/requestToken", &body)
        .await;
    r.expect_err(400, "M_THREEPID_MEDIUM_NOT_SUPPORTED");
    assert_eq!(
        r.body["error"],
        "Adding an email to your account is disabled on this server"
    );
    ts.anon()
        .post("/_matrix/client/v3/register/email/requestToken", &body)
        .await
        .expect_err(400, "M_THREEPID_MEDIUM_NOT_SUPPORTED");
    ts.anon()
        .post(
            "/_matrix/client/v3/account/3pid/msisdn/requestToken",
            &json!({ "client_secret": "s", "country": "GB", "phone_number": "1", "send_attempt": 1 }),
        )
        .await
        .expect_err(400, "M_THREEPID_MEDIUM_NOT_SUPPORTED");
    let caps = alice.get("/_matrix/client/v3/capabilities").await.ok();
    assert_eq!(
        caps["capabilities"]["m.3pid_changes"],
        json!({ "enabled": false })
    );
    assert_eq!(
        alice.get("/_matrix/client/v3/account/3pid").await.ok(),
        json!({ "threepids": [] })
    );
    ts.stop().await;
}

/// Asks for a validation email as `client` and returns the sid and the email.
async fn request_token(
    client: &common::Client,
    rx: &mut mpsc::UnboundedReceiver<Mail>,
    path: &str,
    email: &str,
    secret: &str,
) -> (String, Mail) {
    let r = client
        .post(
            path,
            &json!({ "client_secret": secret, "email": email, "send_attempt": 1 }),
        )
        .await
        .ok();
    let sid = r["sid"].as_str().expect("sid").to_owned();
    assert_eq!(
        r["submit_url"],
        json!(format!(
            "{}/_matrix/client/unstable/add_threepid/email/submit_token",
            client.base
        ))
    );
    (sid, next_mail(rx).await)
}

/// Completes `/account/3pid/add` through user-interactive auth with the password.
async fn add_3pid(client: &common::Client, sid: &str, secret: &str) -> common::Resp {
    let first = client
        .post(
            "/_matrix/client/v3/account/3pid/add",
            &json!({ "sid": sid, "client_secret": secret }),
        )
        .await;
    assert_eq!(first.status, 401, "{}", first.text);
    assert_eq!(
        first.body["flows"],
        json!([{ "stages": ["m.login.password"] }])
    );
    let session = first.body["session"].as_str().unwrap();
    let localpart = client.user_id[1..].split(':').next().unwrap();
    client
        .post(
            "/_matrix/client/v3/account/3pid/add",
            &json!({
                "sid": sid,
                "client_secret": secret,
                "auth": {
                    "type": "m.login.password",
                    "session": session,
                    "identifier": { "type": "m.id.user", "user": localpart },
                    "password": format!("password-{localpart}"),
                },
            }),
        )
        .await
}

#[tokio::test]
async fn an_email_validated_through_the_mailed_link_is_added_listed_and_deleted() {
    let (port, mut rx) = smtp_sink().await;
    let ts = server(Some(port)).await;
    let alice = ts.register("alice").await;
    let caps = alice.get("/_matrix/client/v3/capabilities").await.ok();
    assert_eq!(
        caps["capabilities"]["m.3pid_changes"],
        json!({ "enabled": true })
    );

    let (sid, mail) = request_token(
        &ts.anon(),
        &mut rx,
        "/_matrix/client/v3/account/3pid/email/requestToken",
        "Alice@Example.ORG",
        "secret=1",
    )
    .await;
    assert_eq!(mail.from, "<noreply@example.org>");
    assert_eq!(mail.to, vec!["<alice@example.org>".to_owned()]);
    assert_eq!(
        mail.header("From").unwrap(),
        "Spindle <noreply@example.org>"
    );
    assert_eq!(mail.header("Content-Transfer-Encoding").unwrap(), "7bit");
    assert_eq!(mail.header("To").unwrap(), "alice@example.org");
    assert_eq!(
        mail.header("Subject").unwrap(),
        "[Spindle Test] Validate your email"
    );
    let link = mail.link();
    let q = query_of(&link);
    assert_eq!(q["sid"], sid);
    assert_eq!(q["client_secret"], "secret=1");
    let token = q["token"].clone();
    assert_eq!(token.len(), 32);
    assert_eq!(
        link,
        format!(
            "{}/_matrix/client/unstable/add_threepid/email/submit_token?token={token}&client_secret=secret%3D1&sid={sid}",
            ts.base
        )
    );
    assert_eq!(
        mail.body(),
        format!(
            "Hello,\n\nA request was made to add the email address alice@example.org to your \
             account on localhost:8008.\n\nTo confirm it, open this link:\n\n{link}\n\n\
             If it was not you, ignore this email: nothing changes.\n"
        )
    );

    // The same send_attempt again: the same session, no second email.
    let again = ts
        .anon()
        .post(
            "/_matrix/client/v3/account/3pid/email/requestToken",
            &json!({ "client_secret": "secret=1", "email": "alice@example.org", "send_attempt": 1 }),
        )
        .await
        .ok();
    assert_eq!(again["sid"], json!(sid));

    // Before the link is opened, the session does not add anything.
    add_3pid(&alice, &sid, "secret=1")
        .await
        .expect_err(400, "M_THREEPID_AUTH_FAILED");

    // A wrong token is refused; the link (GET) validates.
    let wrong = ts
        .anon()
        .post(
            "/_matrix/client/unstable/add_threepid/email/submit_token",
            &json!({ "sid": sid, "client_secret": "secret=1", "token": "nope" }),
        )
        .await;
    wrong.expect_err(400, "M_TOKEN_INCORRECT");
    let page = ts.http.get(&link).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(
        page.text()
            .await
            .unwrap()
            .contains("Your email address is validated.")
    );
    // POSTing the token (the spec's submit_url) after the link: success again.
    let submitted = ts
        .anon()
        .post(
            "/_matrix/client/unstable/add_threepid/email/submit_token",
            &json!({ "sid": sid, "client_secret": "secret=1", "token": token }),
        )
        .await
        .ok();
    assert_eq!(submitted, json!({ "success": true }));

    let before = now_ms();
    add_3pid(&alice, &sid, "secret=1").await.ok();
    let listed = alice.get("/_matrix/client/v3/account/3pid").await.ok();
    let entry = &listed["threepids"][0];
    assert_eq!(listed["threepids"].as_array().unwrap().len(), 1);
    assert_eq!(entry["medium"], "email");
    assert_eq!(entry["address"], "alice@example.org");
    let validated_at = entry["validated_at"].as_u64().unwrap();
    let added_at = entry["added_at"].as_u64().unwrap();
    assert!(validated_at <= added_at && added_at >= before, "{listed}");

    // The address logs in (m.id.thirdparty, in any case); an unknown one fails like a
    // wrong password.
    let login = |address: &str| {
        json!({ "type": "m.login.password",
                "identifier": { "type": "m.id.thirdparty", "medium": "email", "address": address },
                "password": "password-alice" })
    };
    let logged_in = ts
        .anon()
        .post("/_matrix/client/v3/login", &login("ALICE@example.org"))
        .await
        .ok();
    assert_eq!(logged_in["user_id"], json!(uid("alice")));
    ts.anon()
        .post("/_matrix/client/v3/login", &login("nobody@example.org"))
        .await
        .expect_err(403, "M_FORBIDDEN");

    // The session is spent; another account cannot ask for the address now.
    add_3pid(&alice, &sid, "secret=1")
        .await
        .expect_err(400, "M_THREEPID_AUTH_FAILED");
    let taken = ts
        .anon()
        .post(
            "/_matrix/client/v3/account/3pid/email/requestToken",
            &json!({ "client_secret": "other", "email": "ALICE@example.org", "send_attempt": 1 }),
        )
        .await;
    taken.expect_err(400, "M_THREEPID_IN_USE");
    ts.anon()
        .post(
            "/_matrix/client/v3/register/email/requestToken",
            &json!({ "client_secret": "other", "email": "alice@example.org", "send_attempt": 1 }),
        )
        .await
        .expect_err(400, "M_THREEPID_IN_USE");

    // Delete: nothing was bound, so no identity server to ask.
    let deleted = alice
        .post(
            "/_matrix/client/v3/account/3pid/delete",
            &json!({ "medium": "email", "address": "alice@example.org" }),
        )
        .await
        .ok();
    assert_eq!(deleted, json!({ "id_server_unbind_result": "no-support" }));
    assert_eq!(
        alice.get("/_matrix/client/v3/account/3pid").await.ok(),
        json!({ "threepids": [] })
    );
    ts.stop().await;
}

#[tokio::test]
async fn request_token_refuses_bad_input_with_matrix_errors() {
    let (port, mut rx) = smtp_sink().await;
    let ts = server(Some(port)).await;
    let anon = ts.anon();
    let path = "/_matrix/client/v3/account/3pid/email/requestToken";
    for (body, status, errcode) in [
        (
            json!({ "email": "a@example.org", "send_attempt": 1 }),
            400,
            "M_MISSING_PARAM",
        ),
        (
            json!({ "client_secret": "s", "send_attempt": 1 }),
            400,
            "M_MISSING_PARAM",
        ),
        (
            json!({ "client_secret": "s", "email": "a@example.org" }),
            400,
            "M_MISSING_PARAM",
        ),
        (
            json!({ "client_secret": "bad secret", "email": "a@example.org", "send_attempt": 1 }),
            400,
            "M_INVALID_PARAM",
        ),
        (
            json!({ "client_secret": "s", "email": "not-an-address", "send_attempt": 1 }),
            400,
            "M_INVALID_PARAM",
        ),
        (
            json!({ "client_secret": "s", "email": "a@example.org", "send_attempt": "1" }),
            400,
            "M_BAD_JSON",
        ),
        (
            json!({ "client_secret": "s", "email": "a@example.org", "send_attempt": 1, "next_link": "javascript:alert(1)" }),
            400,
            "M_INVALID_PARAM",
        ),
    ] {
        anon.post(path, &body).await.expect_err(status, errcode);
    }
    assert!(rx.try_recv().is_err(), "no email for a refused request");

    // A registration email says so, and the link redirects to next_link.
    let r = anon
        .post(
            "/_matrix/client/v3/register/email/requestToken",
            &json!({ "client_secret": "s", "email": "new@example.org", "send_attempt": 1,
                     "next_link": "https://app.example.org/done" }),
        )
        .await
        .ok();
    let mail = next_mail(&mut rx).await;
    assert!(
        mail.body().starts_with(
            "Hello,\n\nA request was made to register an account on localhost:8008 with the \
             email address new@example.org.\n"
        ),
        "{}",
        mail.body()
    );
    let no_redirect = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let resp = no_redirect.get(mail.link()).send().await.unwrap();
    assert_eq!(resp.status(), 302);
    assert_eq!(
        resp.headers()["location"].to_str().unwrap(),
        "https://app.example.org/done"
    );
    // A registration session does not add a 3PID to an account.
    let bob = ts.register("bob").await;
    add_3pid(&bob, r["sid"].as_str().unwrap(), "s")
        .await
        .expect_err(400, "M_THREEPID_AUTH_FAILED");
    // The validated registration session completes an open registration
    // (m.login.email.identity), and the new account has the address.
    let reg = "/_matrix/client/v3/register";
    let first = anon
        .post(reg, &json!({ "username": "newbie", "password": "pw" }))
        .await;
    assert_eq!(first.status, 401);
    assert_eq!(
        first.body["flows"],
        json!([{ "stages": ["m.login.dummy"] }, { "stages": ["m.login.email.identity"] }])
    );
    let session = first.body["session"].as_str().unwrap().to_owned();
    let email_auth = |sid: &str| {
        json!({ "username": "newbie", "password": "pw", "auth": {
            "type": "m.login.email.identity", "session": session,
            "threepid_creds": { "sid": sid, "client_secret": "s" } } })
    };
    let refused = anon.post(reg, &email_auth("nope")).await;
    assert_eq!(
        (refused.status, refused.errcode()),
        (401, Some("M_UNAUTHORIZED"))
    );
    let done = anon
        .post(reg, &email_auth(r["sid"].as_str().unwrap()))
        .await
        .ok();
    assert_eq!(done["user_id"], json!(uid("newbie")));
    let newbie = anon.with_token(done["access_token"].as_str());
    let listed = newbie.get("/_matrix/client/v3/account/3pid").await.ok();
    assert_eq!(listed["threepids"][0]["address"], "new@example.org");
    assert_eq!(listed["threepids"].as_array().unwrap().len(), 1);
    // A link with a wrong token is a page saying so, not a server error.
    let bad = ts
        .http
        .get(format!(
            "{}/_matrix/client/unstable/add_threepid/email/submit_token?token=x&client_secret=s&sid=nope",
            ts.base
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    ts.stop().await;
}

#[tokio::test]
async fn a_uia_session_of_3pid_add_authorizes_only_its_own_sid() {
    let (port, mut rx) = smtp_sink().await;
    let ts = server(Some(port)).await;
    let alice = ts.register("alice").await;
    let first = alice
        .post(
            "/_matrix/client/v3/account/3pid/add",
            &json!({ "sid": "one", "client_secret": "s" }),
        )
        .await;
    let session = first.body["session"].as_str().unwrap().to_owned();
    // The session opened for sid "one" cannot add sid "two".
    alice
        .post(
            "/_matrix/client/v3/account/3pid/add",
            &json!({ "sid": "two", "client_secret": "s",
                     "auth": { "type": "m.login.password", "session": session,
                               "identifier": { "type": "m.id.user", "user": "alice" },
                               "password": "password-alice" } }),
        )
        .await
        .expect_err(403, "M_UNKNOWN");
    // Nor delete a device.
    alice
        .request(
            reqwest::Method::DELETE,
            &format!("/_matrix/client/v3/devices/{}", alice.device_id),
            Some(
                &json!({ "auth": { "type": "m.login.password", "session": session,
                                    "identifier": { "type": "m.id.user", "user": "alice" },
                                    "password": "password-alice" } }),
            ),
        )
        .await
        .expect_err(403, "M_UNKNOWN");
    assert!(rx.try_recv().is_err());
    ts.stop().await;
}

#[tokio::test]
async fn bind_goes_to_the_identity_server_and_delete_unbinds_signed_by_the_homeserver() {
    let (port, mut rx) = smtp_sink().await;
    let ts = server(Some(port)).await;
    let (id_server, is) = identity_server().await;
    let bob = ts.register("bob").await;

    // Errors of the identity server are passed on.
    bob.post(
        "/_matrix/client/v3/account/3pid/bind",
        &json!({ "sid": "bad", "client_secret": "secret", "id_server": id_server, "id_access_token": "is-token" }),
    )
    .await
    .expect_err(400, "M_SESSION_NOT_VALIDATED");
    bob.post(
        "/_matrix/client/v3/account/3pid/bind",
        &json!({ "sid": "good", "client_secret": "secret", "id_server": id_server, "id_access_token": "wrong" }),
    )
    .await
    .expect_err(401, "M_UNAUTHORIZED");
    bob.post(
        "/_matrix/client/v3/account/3pid/bind",
        &json!({ "sid": "good", "client_secret": "secret", "id_server": "not a host", "id_access_token": "is-token" }),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
    bob.post(
        "/_matrix/client/v3/account/3pid/bind",
        &json!({ "sid": "good", "client_secret": "secret", "id_server": id_server }),
    )
    .await
    .expect_err(400, "M_MISSING_PARAM");

    let ok = bob
        .post(
            "/_matrix/client/v3/account/3pid/bind",
            &json!({ "sid": "good", "client_secret": "secret", "id_server": id_server, "id_access_token": "is-token" }),
        )
        .await
        .ok();
    assert_eq!(ok, json!({}));
    {
        let seen = is.seen.lock();
        let (path, auth, body) = seen.last().unwrap();
        assert_eq!((path.as_str(), auth.as_str()), ("bind", "Bearer is-token"));
        assert_eq!(
            *body,
            json!({ "sid": "good", "client_secret": "secret", "mxid": uid("bob") })
        );
    }
    assert_eq!(is.binds.lock().len(), 1);

    // Unbind without id_server: the identity server the bind went through, signed.
    let r = bob
        .post(
            "/_matrix/client/v3/account/3pid/unbind",
            &json!({ "medium": "email", "address": "bob@example.org" }),
        )
        .await
        .ok();
    assert_eq!(r, json!({ "id_server_unbind_result": "success" }));
    assert!(is.binds.lock().is_empty());
    {
        let seen = is.seen.lock();
        let (path, auth, body) = seen.last().unwrap();
        assert_eq!(path, "unbind");
        let want_body = json!({ "mxid": uid("bob"), "threepid": { "medium": "email", "address": "bob@example.org" } });
        assert_eq!(*body, want_body);
        let x = spindle_federation::auth::parse_x_matrix(auth).expect("an X-Matrix header");
        assert_eq!(x.origin, "localhost:8008");
        assert_eq!(x.destination.as_deref(), Some(id_server.as_str()));
        let key = &ts.server.state.key;
        assert_eq!(x.key, key.key_id());
        let signed = spindle_core::canonical::to_object(json!({
            "method": "POST",
            "uri": "/_matrix/identity/v2/3pid/unbind",
            "origin": "localhost:8008",
            "destination": id_server,
            "content": want_body,
        }))
        .unwrap();
        key.verify_bytes(&spindle_core::canonical::to_bytes(&signed), &x.sig)
            .expect("the unbind is signed by the homeserver");
    }
    // Nothing bound any more: no identity server known.
    let r = bob
        .post(
            "/_matrix/client/v3/account/3pid/unbind",
            &json!({ "medium": "email", "address": "bob@example.org" }),
        )
        .await
        .ok();
    assert_eq!(r, json!({ "id_server_unbind_result": "no-support" }));

    // Bind again, then delete: the delete unbinds where the bind went.
    bob.post(
        "/_matrix/client/v3/account/3pid/bind",
        &json!({ "sid": "good", "client_secret": "secret", "id_server": id_server, "id_access_token": "is-token" }),
    )
    .await
    .ok();
    let r = bob
        .post(
            "/_matrix/client/v3/account/3pid/delete",
            &json!({ "medium": "email", "address": "Bob@Example.org" }),
        )
        .await
        .ok();
    assert_eq!(r, json!({ "id_server_unbind_result": "success" }));
    assert!(is.binds.lock().is_empty());
    let unbinds = is
        .seen
        .lock()
        .iter()
        .filter(|(p, _, _)| p == "unbind")
        .count();
    assert_eq!(unbinds, 2);
    // An identity server that is not there: no-support, never a server error.
    let r = bob
        .post(
            "/_matrix/client/v3/account/3pid/unbind",
            &json!({ "medium": "email", "address": "bob@example.org", "id_server": "127.0.0.1:9" }),
        )
        .await
        .ok();
    assert_eq!(r, json!({ "id_server_unbind_result": "no-support" }));
    assert!(rx.try_recv().is_err());
    ts.stop().await;
}

/// The identity server's `signed` block for `mxid` and `token`.
fn signed_block(is: &Is, mxid: &str, token: &str) -> Value {
    let mut obj =
        spindle_core::canonical::to_object(json!({ "mxid": mxid, "token": token })).unwrap();
    is.key.sign_json(&mut obj).unwrap();
    serde_json::to_value(obj).unwrap()
}

#[tokio::test]
async fn a_third_party_invite_is_stored_on_the_identity_server_and_claimed_on_bind() {
    let ts = server(None).await;
    let (id_server, is) = identity_server().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;

    // Bad 3PID invites are refused before any identity server is asked.
    let invite = |extra: Value| {
        let mut b = json!({ "id_server": id_server, "id_access_token": "is-token", "medium": "email", "address": "Carol@Example.org" });
        for (k, v) in extra.as_object().unwrap() {
            if v.is_null() {
                b.as_object_mut().unwrap().remove(k);
            } else {
                b[k] = v.clone();
            }
        }
        b
    };
    let path = format!("/_matrix/client/v3/rooms/{}/invite", common::enc(&room));
    alice
        .post(&path, &invite(json!({ "medium": "carrier-pigeon" })))
        .await
        .expect_err(400, "M_INVALID_PARAM");
    alice
        .post(&path, &invite(json!({ "id_access_token": null })))
        .await
        .expect_err(400, "M_MISSING_PARAM");
    assert!(is.seen.lock().is_empty());
    // Only a member invites.
    let mallory = ts.register("mallory").await;
    mallory
        .post(&path, &invite(json!({})))
        .await
        .expect_err(403, "M_FORBIDDEN");

    alice.post(&path, &invite(json!({}))).await.ok();
    {
        let seen = is.seen.lock();
        let paths: Vec<&str> = seen.iter().map(|(p, _, _)| p.as_str()).collect();
        assert_eq!(paths, ["hash_details", "lookup", "store-invite"]);
        assert!(seen.iter().all(|(_, auth, _)| auth == "Bearer is-token"));
        assert_eq!(
            seen[1].2,
            json!({ "addresses": [lookup_hash("carol@example.org", "email")], "algorithm": "sha256", "pepper": PEPPER })
        );
        assert_eq!(
            seen[2].2,
            json!({
                "medium": "email",
                "address": "carol@example.org",
                "room_id": room,
                "sender": uid("alice"),
                "room_join_rules": "invite",
                "sender_display_name": "alice",
            })
        );
    }
    let state_path = format!(
        "/_matrix/client/v3/rooms/{}/state/m.room.third_party_invite/tok1",
        common::enc(&room)
    );
    let public_key = is.key.public_key_base64();
    assert_eq!(
        alice.get(&state_path).await.ok(),
        json!({
            "display_name": "c...@e...",
            "key_validity_url": "https://is.example/_matrix/identity/v2/pubkey/isvalid",
            "public_key": public_key,
            "public_keys": [{ "public_key": public_key, "key_validity_url": "https://is.example/_matrix/identity/v2/pubkey/isvalid" }],
        })
    );

    // Carol registers and binds the address: the identity server calls onbind.
    let carol = ts.register("carol").await;
    let onbind = |signed: Value, mxid: &str| {
        json!({
            "medium": "email",
            "address": "carol@example.org",
            "mxid": mxid,
            "invites": [{
                "medium": "email",
                "address": "carol@example.org",
                "mxid": mxid,
                "room_id": room,
                "sender": uid("alice"),
                "signed": signed,
            }],
        })
    };
    let anon = ts.anon();
    // A block signed by another key invites no one.
    let forger = spindle_core::keys::ServerKey::generate("forger.example");
    let mut forged =
        spindle_core::canonical::to_object(json!({ "mxid": uid("carol"), "token": "tok1" }))
            .unwrap();
    forger.sign_json(&mut forged).unwrap();
    anon.put(
        "/_matrix/federation/v1/3pid/onbind",
        &onbind(serde_json::to_value(forged).unwrap(), &uid("carol")),
    )
    .await
    .ok();
    let member_path = format!(
        "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
        common::enc(&room),
        common::enc(&uid("carol"))
    );
    alice.get(&member_path).await.expect_err(404, "M_NOT_FOUND");
    // Not one of our users: 400.
    anon.put(
        "/_matrix/federation/v1/3pid/onbind",
        &onbind(
            signed_block(&is, "@x:elsewhere.example", "tok1"),
            "@x:elsewhere.example",
        ),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");

    let signed = signed_block(&is, &uid("carol"), "tok1");
    let r = anon
        .put(
            "/_matrix/federation/v1/3pid/onbind",
            &onbind(signed.clone(), &uid("carol")),
        )
        .await
        .ok();
    assert_eq!(r, json!({}));
    assert_eq!(
        alice.get(&member_path).await.ok(),
        json!({
            "membership": "invite",
            "third_party_invite": { "display_name": "c...@e...", "signed": signed },
        })
    );
    let sync = carol.sync("").await;
    assert!(sync["rooms"]["invite"].get(&room).is_some(), "{sync}");
    carol.join(&room).await;

    // A 3PID the identity server knows: an ordinary invite of its user.
    let bob = ts.register("bob").await;
    is.binds.lock().push((
        "email".into(),
        "bob@example.org".into(),
        bob.user_id.clone(),
    ));
    alice
        .post(&path, &invite(json!({ "address": "bob@example.org" })))
        .await
        .ok();
    let bob_member = format!(
        "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
        common::enc(&room),
        common::enc(&bob.user_id)
    );
    assert_eq!(
        alice.get(&bob_member).await.ok(),
        json!({ "membership": "invite", "displayname": "bob" })
    );
    assert_eq!(
        is.seen
            .lock()
            .iter()
            .filter(|(p, _, _)| p == "store-invite")
            .count(),
        1
    );

    // createRoom's invite_3pid does the same after the room exists.
    let room2 = alice
        .create_room(json!({
            "name": "Second",
            "invite_3pid": [{ "id_server": id_server, "id_access_token": "is-token", "medium": "email", "address": "dave@example.org" }],
        }))
        .await;
    let stored = is.seen.lock().last().unwrap().2.clone();
    assert_eq!(stored["room_id"], json!(room2));
    assert_eq!(stored["room_name"], json!("Second"));
    let st = alice
        .get(&format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.third_party_invite/tok2",
            common::enc(&room2)
        ))
        .await
        .ok();
    assert_eq!(st["display_name"], "c...@e...");
    // A malformed invite_3pid creates no room.
    alice
        .post(
            "/_matrix/client/v3/createRoom",
            &json!({ "invite_3pid": [{ "id_server": id_server }] }),
        )
        .await
        .expect_err(400, "M_MISSING_PARAM");
    // exchange_third_party_invite needs a signed request from the invitee's server.
    anon.put(
        &format!(
            "/_matrix/federation/v1/exchange_third_party_invite/{}",
            common::enc(&room)
        ),
        &json!({}),
    )
    .await
    .expect_err(401, "M_UNAUTHORIZED");
    ts.stop().await;
}

/// A `spindle --config FILE` process (the in-process server keeps the data directory
/// locked until its runtime ends).
struct Proc {
    child: std::process::Child,
    base: String,
}

impl Proc {
    fn start(config: &std::path::Path) -> Proc {
        use std::io::BufRead as _;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_spindle"))
            .arg("--config")
            .arg(config)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn spindle");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(rest) = line.strip_prefix("spindle: serving on ") {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_owned());
                }
                eprintln!("[spindle] {line}");
            }
        });
        let base = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("spindle reports its address");
        Proc { child, base }
    }

    fn stop(mut self) {
        let status = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
        assert!(self.child.wait().unwrap().success());
    }
}

#[tokio::test]
async fn threepids_and_binds_survive_a_restart_with_rebuilt_projections() {
    let (port, mut rx) = smtp_sink().await;
    let (id_server, is) = identity_server().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = dir.path().join("spindle.toml");
    std::fs::write(
        &config,
        format!(
            "server_name = \"{}\"\nbind = \"127.0.0.1:0\"\ndata_dir = \"{}\"\nlog = \"warn\"\n\
             rate_limits = {{ enabled = false }}\n\
             [email]\nenabled = true\nsmtp_host = \"127.0.0.1\"\nsmtp_port = {port}\ntls = \"none\"\n\
             notif_from = \"noreply@example.org\"\n\
             [identity_servers]\nip_range_allowlist = [\"127.0.0.1/32\"]\ndangerous_plain_http_for_tests = true\n",
            common::SERVER_NAME,
            data.display()
        ),
    )
    .unwrap();
    let proc = Proc::start(&config);
    let http = common::http();
    let alice = common::register(&proc.base, &http, "alice").await;
    let (sid, mail) = request_token(
        &alice,
        &mut rx,
        "/_matrix/client/v3/account/3pid/email/requestToken",
        "alice@example.org",
        "s",
    )
    .await;
    assert_eq!(http.get(mail.link()).send().await.unwrap().status(), 200);
    add_3pid(&alice, &sid, "s").await.ok();
    alice
        .post(
            "/_matrix/client/v3/account/3pid/bind",
            &json!({ "sid": "good", "client_secret": "secret", "id_server": id_server, "id_access_token": "is-token" }),
        )
        .await
        .ok();
    let listed = alice.get("/_matrix/client/v3/account/3pid").await.ok();
    assert_eq!(listed["threepids"][0]["address"], "alice@example.org");
    proc.stop();

    // Every projection rebuilt from the journal on start.
    std::fs::remove_dir_all(data.join("projections")).unwrap();
    let proc = Proc::start(&config);
    let alice = common::Client {
        base: proc.base.clone(),
        ..alice.clone()
    };
    assert_eq!(
        alice.get("/_matrix/client/v3/account/3pid").await.ok(),
        listed
    );
    // The bind record came back too: the unbind knows where to go.
    let r = alice
        .post(
            "/_matrix/client/v3/account/3pid/unbind",
            &json!({ "medium": "email", "address": "bob@example.org" }),
        )
        .await
        .ok();
    assert_eq!(r, json!({ "id_server_unbind_result": "success" }));
    assert!(is.binds.lock().is_empty());
    proc.stop();
}

#[tokio::test]
async fn validation_emails_are_rate_limited_per_client_and_per_address() {
    let (port, mut rx) = smtp_sink().await;
    let ts = TestServer::start_with(|c| {
        c.email.enabled = true;
        c.email.smtp_host = "127.0.0.1".into();
        c.email.smtp_port = port;
        c.email.tls = "none".into();
        c.email.notif_from = "noreply@example.org".into();
        c.rate_limits.enabled = true;
    })
    .await;
    let anon = ts.anon();
    let path = "/_matrix/client/v3/account/3pid/email/requestToken";
    // rc_3pid_validation's burst: 5, each with a new client secret (a new session).
    for i in 0..5 {
        anon.post(
            path,
            &json!({ "client_secret": format!("s{i}"), "email": "a@example.org", "send_attempt": 1 }),
        )
        .await
        .ok();
        next_mail(&mut rx).await;
    }
    let r = anon
        .post(
            path,
            &json!({ "client_secret": "s5", "email": "a@example.org", "send_attempt": 1 }),
        )
        .await;
    r.expect_err(429, "M_LIMIT_EXCEEDED");
    assert!(r.body["retry_after_ms"].as_u64().unwrap() > 0);
    // The client's bucket is full too, whatever the address.
    anon.post(
        path,
        &json!({ "client_secret": "s6", "email": "b@example.org", "send_attempt": 1 }),
    )
    .await
    .expect_err(429, "M_LIMIT_EXCEEDED");
    assert!(rx.try_recv().is_err());
    ts.stop().await;
}

/// The X-Matrix `Authorization` of a request from `key`'s server.
fn x_matrix(
    key: &spindle_core::keys::ServerKey,
    method: &str,
    uri: &str,
    content: &Value,
) -> String {
    let req = json!({ "method": method, "uri": uri, "origin": key.server_name(),
                      "destination": common::SERVER_NAME, "content": content });
    let obj = spindle_core::canonical::to_object(req).unwrap();
    let sig = key.sign_bytes(&spindle_core::canonical::to_bytes(&obj));
    format!(
        "X-Matrix origin=\"{}\",destination=\"{}\",key=\"{}\",sig=\"{sig}\"",
        key.server_name(),
        common::SERVER_NAME,
        key.key_id()
    )
}

#[tokio::test]
async fn the_invitees_server_exchanges_a_third_party_invite_of_ours() {
    let ts = server(None).await;
    let (id_server, is) = identity_server().await;
    let remote = spindle_core::keys::ServerKey::generate("remote.test");
    let other = spindle_core::keys::ServerKey::generate("other.test");
    for key in [&remote, &other] {
        ts.server.federation.keys.pin(
            key.server_name(),
            [(key.key_id(), key.public_key_base64())]
                .into_iter()
                .collect(),
            3_600_000,
        );
    }
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/invite", common::enc(&room)),
            &json!({ "id_server": id_server, "id_access_token": "is-token", "medium": "email", "address": "carol@example.org" }),
        )
        .await
        .ok();
    let carol = "@carol:remote.test";
    let signed = signed_block(&is, carol, "tok1");
    let body = json!({
        "type": "m.room.member",
        "room_id": room,
        "sender": uid("alice"),
        "state_key": carol,
        "content": {
            "membership": "invite",
            "third_party_invite": { "display_name": "c...@e...", "signed": signed },
        },
    });
    let path = format!(
        "/_matrix/federation/v1/exchange_third_party_invite/{}",
        common::enc(&room)
    );
    let anon = ts.anon();
    let put = |key: &spindle_core::keys::ServerKey, body: &Value| {
        let auth = x_matrix(key, "PUT", &path, body);
        let body = serde_json::to_vec(body).unwrap();
        let anon = anon.clone();
        let path = path.clone();
        async move {
            anon.raw(
                reqwest::Method::PUT,
                &path,
                Some(body),
                &[("authorization", auth.as_str())],
            )
            .await
        }
    };
    // Only the invitee's server may ask.
    put(&other, &body).await.expect_err(403, "M_FORBIDDEN");
    // A block for another user id is refused.
    let mut wrong = body.clone();
    wrong["content"]["third_party_invite"]["signed"] =
        signed_block(&is, "@dave:remote.test", "tok1");
    put(&remote, &wrong).await.expect_err(403, "M_FORBIDDEN");
    // An unknown token.
    let mut unknown = body.clone();
    unknown["content"]["third_party_invite"]["signed"] = signed_block(&is, carol, "tok9");
    put(&remote, &unknown).await.expect_err(404, "M_NOT_FOUND");

    assert_eq!(put(&remote, &body).await.ok(), json!({}));
    let member = alice
        .get(&format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
            common::enc(&room),
            common::enc(carol)
        ))
        .await
        .ok();
    assert_eq!(
        member,
        json!({ "membership": "invite", "third_party_invite": { "display_name": "c...@e...", "signed": signed } })
    );
    ts.stop().await;
}
