//! The invariants of BRIEF §3, checked against an in-process server:
//! authorization on every room route (§3.7), history visibility, read-your-writes
//! (§3.5), tokens never run ahead (§3.6), our rooms are chains (§3.8), transaction
//! idempotency, group commit sharing fsyncs (§3.4), long-poll wake-up, and room
//! versions 11 and 12.

mod common;

use std::{collections::BTreeSet, time::Duration};

use common::{Client, TestServer, enc, ids, sync_pos, sync_timeline_ids, txn, uid};
use reqwest::Method;
use serde_json::{Value, json};

fn timeline_filter(limit: u32) -> String {
    enc(&json!({ "room": { "timeline": { "limit": limit }, "include_leave": true } }).to_string())
}

// ---------------------------------------------------------------------------------
// Authorization on every read route (BRIEF §3.7)
// ---------------------------------------------------------------------------------

/// One request a non-member makes, and the exact answer expected.
struct Row {
    method: Method,
    /// The route template exactly as written in the api sources.
    template: &'static str,
    path: String,
    body: Option<Value>,
    status: u16,
    errcode: &'static str,
}

const ROOMS: &str = "/_matrix/client/v3/rooms/{room_id}";
/// Room routes of the v1 endpoints (spaces, timestamps, relations).
const ROOMS_V1: &str = "/_matrix/client/v1/rooms/{room_id}";

/// Every (method, template) of a `/rooms/{room_id}/...` route in an api source file.
fn room_routes(source: &str) -> (usize, Vec<(Method, String)>) {
    routes_under(source, &[ROOMS, ROOMS_V1])
}

/// Every (method, template) of a route under one of `prefixes` in an api source file,
/// and how many `.route(` calls name such a path.
fn routes_under(source: &str, prefixes: &[&str]) -> (usize, Vec<(Method, String)>) {
    // rustfmt may put the path on the line after `.route(`, so whitespace is skipped.
    let needles: Vec<String> = prefixes.iter().map(|p| format!("\"{p}")).collect();
    let count = source
        .split(".route(")
        .skip(1)
        .filter(|chunk| needles.iter().any(|n| chunk.trim_start().starts_with(n)))
        .count();
    let mut out = Vec::new();
    for chunk in source.split(".route(").skip(1) {
        let Some(rest) = chunk.trim_start().strip_prefix('"') else {
            continue;
        };
        let Some(end) = rest.find('"') else { continue };
        let template = &rest[..end];
        if !prefixes.iter().any(|p| template.starts_with(p)) {
            continue;
        }
        // The last route's chunk runs to the end of the file: stop at the end of the
        // function that builds the router.
        let handlers = rest[end..].split("\n}").next().unwrap_or_default();
        let mut methods = Vec::new();
        for (name, m) in [
            ("get(", Method::GET),
            ("post(", Method::POST),
            ("put(", Method::PUT),
            ("delete(", Method::DELETE),
        ] {
            let mut from = 0;
            while let Some(i) = handlers[from..].find(name) {
                let at = from + i;
                let before = handlers[..at].chars().last();
                if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    methods.push(m.clone());
                }
                from = at + name.len();
            }
        }
        assert!(!methods.is_empty(), "no method found for route {template}");
        for m in methods {
            out.push((m, template.to_owned()));
        }
    }
    (count, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_member_is_refused_on_every_room_route_and_nothing_leaks() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let eve = ts.register("eve").await;

    const SECRET_BODY: &str = "secret-body-5b2e8f1d";
    const SECRET_NAME: &str = "secret-name-0c9a7e44";
    const SECRET_TOPIC: &str = "secret-topic-d41f3a90";
    const SECRET_ALIAS_LOCAL: &str = "secret-alias-73ce";
    let secrets = [SECRET_BODY, SECRET_NAME, SECRET_TOPIC, SECRET_ALIAS_LOCAL];

    let room = alice
        .create_room(
            json!({ "preset": "private_chat", "name": SECRET_NAME, "topic": SECRET_TOPIC }),
        )
        .await;
    let secret = alice.send_text(&room, SECRET_BODY).await;
    let alias = format!("#{SECRET_ALIAS_LOCAL}:{}", common::SERVER_NAME);
    alice
        .put(
            &format!("/_matrix/client/v3/directory/room/{}", enc(&alias)),
            &json!({ "room_id": room }),
        )
        .await
        .ok();
    alice
        .post(
            &format!(
                "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
                enc(&room),
                enc(&secret)
            ),
            &json!({}),
        )
        .await
        .ok();
    let before_ids = alice.all_event_ids(&room).await;
    let mut before_state = alice
        .get(&format!("/_matrix/client/v3/rooms/{}/state", enc(&room)))
        .await
        .ok();
    common::strip_age(&mut before_state);

    let r = enc(&room);
    let x = enc(&secret);
    let a = enc(&alice.user_id);
    let e = enc(&eve.user_id);
    let row = |method: Method,
               template: &'static str,
               suffix: String,
               body: Option<Value>,
               status: u16,
               errcode: &'static str| Row {
        method,
        template,
        path: format!(
            "/_matrix/client/{}/rooms/{r}{suffix}",
            if template.starts_with(ROOMS_V1) {
                "v1"
            } else {
                "v3"
            }
        ),
        body,
        status,
        errcode,
    };
    use Method as M;
    const F: &str = "M_FORBIDDEN";
    const NF: &str = "M_NOT_FOUND";
    let table = vec![
        // Reads (api/src/read.rs and rooms.rs).
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/event/{event_id}",
            format!("/event/{x}"),
            None,
            404,
            NF,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/state",
            "/state".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}",
            "/state/m.room.name".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}",
            "/state/m.room.topic".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/",
            "/state/m.room.name/".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/{state_key}",
            format!("/state/m.room.member/{a}"),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/{state_key}",
            format!("/state/m.room.member/{e}"),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/messages",
            "/messages?dir=b&limit=100".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/messages",
            "/messages?dir=f&limit=100".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/messages",
            "/messages?dir=f&from=t0&limit=100".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/context/{event_id}",
            format!("/context/{x}?limit=20"),
            None,
            404,
            NF,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/members",
            "/members".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/joined_members",
            "/joined_members".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/aliases",
            "/aliases".into(),
            None,
            403,
            F,
        ),
        // Writes that would reveal or change the room.
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/receipt/{receipt_type}/{event_id}",
            format!("/receipt/m.read/{x}"),
            Some(json!({})),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/receipt/{receipt_type}/{event_id}",
            format!("/receipt/m.read.private/{x}"),
            Some(json!({})),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/read_markers",
            "/read_markers".into(),
            Some(json!({ "m.fully_read": secret, "m.read": secret })),
            403,
            F,
        ),
        row(
            M::PUT,
            "/_matrix/client/v3/rooms/{room_id}/typing/{user_id}",
            format!("/typing/{e}"),
            Some(json!({ "typing": true, "timeout": 30000 })),
            403,
            F,
        ),
        row(
            M::PUT,
            "/_matrix/client/v3/rooms/{room_id}/send/{event_type}/{txn_id}",
            format!("/send/m.room.message/{}", txn()),
            Some(json!({ "msgtype": "m.text", "body": "eve" })),
            403,
            F,
        ),
        row(
            M::PUT,
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}",
            "/state/m.room.name".into(),
            Some(json!({ "name": "eve was here" })),
            403,
            F,
        ),
        row(
            M::PUT,
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/",
            "/state/m.room.name/".into(),
            Some(json!({ "name": "eve was here" })),
            403,
            F,
        ),
        row(
            M::PUT,
            "/_matrix/client/v3/rooms/{room_id}/state/{event_type}/{state_key}",
            format!("/state/m.room.member/{e}"),
            Some(json!({ "membership": "join" })),
            403,
            F,
        ),
        row(
            M::PUT,
            "/_matrix/client/v3/rooms/{room_id}/redact/{event_id}/{txn_id}",
            format!("/redact/{x}/{}", txn()),
            Some(json!({})),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/join",
            "/join".into(),
            Some(json!({})),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/invite",
            "/invite".into(),
            Some(json!({ "user_id": eve.user_id })),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/leave",
            "/leave".into(),
            Some(json!({})),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/kick",
            "/kick".into(),
            Some(json!({ "user_id": alice.user_id })),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/ban",
            "/ban".into(),
            Some(json!({ "user_id": alice.user_id })),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/unban",
            "/unban".into(),
            Some(json!({ "user_id": alice.user_id })),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/forget",
            "/forget".into(),
            Some(json!({})),
            404,
            NF,
        ),
        // Rooms (issue 3): spaces, timestamps, upgrades, reports.
        row(
            M::GET,
            "/_matrix/client/v1/rooms/{room_id}/hierarchy",
            "/hierarchy".into(),
            None,
            403,
            F,
        ),
        row(
            M::GET,
            "/_matrix/client/v1/rooms/{room_id}/timestamp_to_event",
            "/timestamp_to_event?ts=0&dir=f".into(),
            None,
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/upgrade",
            "/upgrade".into(),
            Some(json!({ "new_version": "11" })),
            403,
            F,
        ),
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/report/{event_id}",
            format!("/report/{x}"),
            Some(json!({ "reason": "eve" })),
            404,
            NF,
        ),
        // The legacy room snapshot (api/src/legacy.rs).
        row(
            M::GET,
            "/_matrix/client/v3/rooms/{room_id}/initialSync",
            "/initialSync".into(),
            None,
            403,
            F,
        ),
        // Anyone may report a room (spec); the answer is 200 `{}` whether or not the
        // room exists, so it reveals nothing.
        row(
            M::POST,
            "/_matrix/client/v3/rooms/{room_id}/report",
            "/report".into(),
            Some(json!({ "reason": "eve" })),
            200,
            "",
        ),
        // Relations and threads (api/src/relations.rs, spec v1 paths).
        Row {
            method: M::GET,
            template: "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}",
            path: format!("/_matrix/client/v1/rooms/{r}/relations/{x}"),
            body: None,
            status: 404,
            errcode: NF,
        },
        Row {
            method: M::GET,
            template: "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}/{rel_type}",
            path: format!("/_matrix/client/v1/rooms/{r}/relations/{x}/m.thread"),
            body: None,
            status: 404,
            errcode: NF,
        },
        Row {
            method: M::GET,
            template: "/_matrix/client/v1/rooms/{room_id}/relations/{event_id}/{rel_type}/{event_type}",
            path: format!("/_matrix/client/v1/rooms/{r}/relations/{x}/m.annotation/m.reaction"),
            body: None,
            status: 404,
            errcode: NF,
        },
        Row {
            method: M::GET,
            template: "/_matrix/client/v1/rooms/{room_id}/threads",
            path: format!("/_matrix/client/v1/rooms/{r}/threads"),
            body: None,
            status: 403,
            errcode: F,
        },
    ];

    // The table covers every /rooms/{room_id}/... route the api serves.
    let mut served = Vec::new();
    for (file, source) in [
        ("read.rs", include_str!("../api/src/read.rs")),
        ("rooms.rs", include_str!("../api/src/rooms.rs")),
        ("spaces.rs", include_str!("../api/src/spaces.rs")),
        ("upgrade.rs", include_str!("../api/src/upgrade.rs")),
        ("reports.rs", include_str!("../api/src/reports.rs")),
        ("relations.rs", include_str!("../api/src/relations.rs")),
        ("legacy.rs", include_str!("../api/src/legacy.rs")),
    ] {
        let (count, routes) = room_routes(source);
        let distinct: BTreeSet<&String> = routes.iter().map(|(_, t)| t).collect();
        assert_eq!(
            distinct.len(),
            count,
            "{file}: every `.route(\"{ROOMS}...` line was parsed"
        );
        served.extend(routes);
    }
    assert_eq!(
        served.len(),
        35,
        "room routes served (update the table when adding one): {served:?}"
    );
    for (method, template) in &served {
        assert!(
            table
                .iter()
                .any(|r| r.method == method && r.template == template),
            "route {method} {template} is not in the authorization table"
        );
    }
    for r in &table {
        assert!(
            served.iter().any(|(m, t)| m == r.method && t == r.template),
            "table row {} {} names a route the api does not serve",
            r.method,
            r.template
        );
    }

    for row in &table {
        let resp = eve
            .request(row.method.clone(), &row.path, row.body.as_ref())
            .await;
        let want_errcode = (row.status != 200).then_some(row.errcode);
        assert_eq!(
            (resp.status, resp.errcode()),
            (row.status, want_errcode),
            "{} {} as a non-member: {}",
            row.method,
            row.path,
            resp.text
        );
        for s in secrets {
            assert!(
                !resp.text.contains(s),
                "{} {} leaked {s}: {}",
                row.method,
                row.path,
                resp.text
            );
        }
        // A room that does not exist answers exactly like one the user may not see.
        if row.method == Method::GET {
            let ghost = row.path.replacen(&r, &enc("!nosuchroom:localhost:8008"), 1);
            let resp = eve.get(&ghost).await;
            assert_eq!(
                (resp.status, resp.errcode()),
                (row.status, want_errcode),
                "GET {ghost}: {}",
                resp.text
            );
        }
    }

    // /sync shows nothing of the room, with or without leave rooms.
    for query in [
        "".to_string(),
        format!("filter={}", timeline_filter(100)),
        "full_state=true".into(),
    ] {
        let resp = eve.get(&format!("/_matrix/client/v3/sync?{query}")).await;
        assert_eq!(resp.status, 200, "{}", resp.text);
        for section in ["join", "invite", "leave", "knock"] {
            assert!(
                resp.body["rooms"][section].get(&room).is_none(),
                "sync {query} shows the room in {section}: {}",
                resp.text
            );
        }
        assert!(
            !resp.text.contains(&room),
            "sync {query} names the room: {}",
            resp.text
        );
        for s in secrets {
            assert!(!resp.text.contains(s), "sync {query} leaked {s}");
        }
    }
    // The legacy endpoints show nothing of the room: not its event by id, not its
    // stream (peeking needs a world-readable room), not in the initial sync.
    eve.get(&format!("/_matrix/client/v3/events/{x}"))
        .await
        .expect_err(404, NF);
    eve.get(&format!("/_matrix/client/v3/events?room_id={r}&timeout=0"))
        .await
        .expect_err(403, F);
    for path in [
        "/_matrix/client/v3/events?from=t0&timeout=0",
        "/_matrix/client/v3/initialSync?archived=true",
    ] {
        let resp = eve.get(path).await;
        assert_eq!(resp.status, 200, "{}", resp.text);
        assert!(
            !resp.text.contains(&room),
            "{path} names the room: {}",
            resp.text
        );
        for s in secrets {
            assert!(!resp.text.contains(s), "{path} leaked {s}");
        }
    }
    // /search finds nothing of the room, even when the filter names it.
    for word in ["secret", SECRET_BODY, SECRET_NAME, SECRET_TOPIC] {
        for filter in [json!({}), json!({ "rooms": [room] })] {
            let resp = eve
                .post(
                    "/_matrix/client/v3/search",
                    &json!({ "search_categories": { "room_events": {
                        "search_term": word, "filter": filter, "include_state": true,
                        "event_context": { "include_profile": true }
                    } } }),
                )
                .await;
            assert_eq!(resp.status, 200, "{}", resp.text);
            let found = &resp.body["search_categories"]["room_events"];
            assert_eq!(found["results"], json!([]), "search {word}: {}", resp.text);
            assert_eq!(found["count"], 0, "search {word}: {}", resp.text);
            assert!(
                !resp.text.contains(&room),
                "search names the room: {}",
                resp.text
            );
        }
    }
    // Sliding sync (MSC4186) shows nothing of the room either: not in a list, and a
    // subscription to it is ignored.
    let resp = eve
        .post(
            "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync",
            &json!({
                "lists": { "all": { "ranges": [[0, 99]], "timeline_limit": 10,
                    "required_state": [["*", "*"]] } },
                "room_subscriptions": { (room.clone()): { "timeline_limit": 10,
                    "required_state": [["*", "*"], ["m.room.member", "$LAZY"]] } },
                "extensions": { "account_data": { "enabled": true }, "receipts": { "enabled": true },
                    "typing": { "enabled": true } }
            }),
        )
        .await;
    assert_eq!(resp.status, 200, "{}", resp.text);
    assert_eq!(resp.body["lists"]["all"]["count"], 0, "{}", resp.text);
    assert!(
        !resp.text.contains(&room),
        "sliding sync names the room: {}",
        resp.text
    );
    for s in secrets {
        assert!(!resp.text.contains(s), "sliding sync leaked {s}");
    }
    // The admin audit trail (api/src/admin.rs): not an admin, so 403 for the room and
    // for alice's account, and nothing of either in the answer.
    for path in [
        format!("/_spindle/admin/v1/audit/rooms/{r}"),
        format!("/_spindle/admin/v1/audit/users/{a}"),
    ] {
        let resp = eve.get(&path).await;
        resp.expect_err(403, F);
        for s in secrets {
            assert!(!resp.text.contains(s), "{path} leaked {s}");
        }
        assert!(!resp.text.contains(&secret), "{path} leaked the event id");
    }
    // The Synapse admin API (api/src/synapse_admin.rs), every route read from its
    // source: 403 for a non-admin (the two public routes aside: the version, and
    // shared-secret registration, off here), and nothing of the
    // room or of alice's account in the answer, whatever eve sends.
    let (count, admin_routes) = routes_under(
        include_str!("../api/src/synapse_admin.rs"),
        &["/_synapse/admin/"],
    );
    assert_eq!(
        count, 22,
        "Synapse admin routes in api/src/synapse_admin.rs"
    );
    assert_eq!(admin_routes.len(), 26, "(method, route) pairs");
    let public = [
        "/_synapse/admin/v1/server_version",
        "/_synapse/admin/v1/register",
    ];
    for (method, template) in admin_routes {
        let path = template
            .replace("{room_id}", &r)
            .replace("{user_id}", &a)
            .replace("{delete_id}", "x")
            .replace("{report_id}", "1")
            .replace("{server_name}", common::SERVER_NAME)
            .replace("{media_id}", "m");
        let body = json!({ "admin": true, "new_password": "pw", "password": "pw",
                           "erase": true, "block": true });
        let resp = eve.request(method.clone(), &path, Some(&body)).await;
        if !public.contains(&template.as_str()) {
            assert_eq!(
                (resp.status, resp.errcode()),
                (403, Some(F)),
                "{method} {path} as a non-admin: {}",
                resp.text
            );
        }
        for s in secrets {
            assert!(!resp.text.contains(s), "{method} {path} leaked {s}");
        }
        assert!(
            !resp.text.contains(&secret),
            "{method} {path} leaked the event id"
        );
    }
    // Nothing eve sent changed the room.
    assert_eq!(alice.all_event_ids(&room).await, before_ids);
    let mut after_state = alice
        .get(&format!("/_matrix/client/v3/rooms/{}/state", enc(&room)))
        .await
        .ok();
    common::strip_age(&mut after_state);
    assert_eq!(after_state, before_state);
    assert_eq!(
        alice
            .get(&format!("/_matrix/client/v3/rooms/{}/aliases", enc(&room)))
            .await
            .ok(),
        json!({ "aliases": [alias] })
    );
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_state_key_with_trailing_slash_reads_and_writes_the_state_event() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let eve = ts.register("eve").await;
    let room = alice
        .create_room(json!({ "preset": "private_chat", "name": "The Room" }))
        .await;
    let path = format!("/_matrix/client/v3/rooms/{}/state/m.room.name/", enc(&room));
    let with_slash = alice.get(&path).await;
    assert_eq!(
        (with_slash.status, with_slash.body.clone()),
        (200, json!({ "name": "The Room" })),
        "{}",
        with_slash.text
    );
    let without = alice.get(path.trim_end_matches('/')).await;
    assert_eq!(
        (without.status, without.body),
        (200, json!({ "name": "The Room" }))
    );
    let put = alice.put(&path, &json!({ "name": "Renamed" })).await.ok();
    let name_event = alice.get(&format!("{path}?format=event")).await.ok();
    assert_eq!(name_event["event_id"], put["event_id"]);
    assert_eq!(name_event["content"], json!({ "name": "Renamed" }));
    // And a non-member gets the same refusal as without the slash.
    eve.get(&path).await.expect_err(403, "M_FORBIDDEN");
    eve.put(&path, &json!({ "name": "eve" }))
        .await
        .expect_err(403, "M_FORBIDDEN");
    ts.stop().await;
}

// ---------------------------------------------------------------------------------
// History visibility
// ---------------------------------------------------------------------------------

struct Story {
    alice: Client,
    bob: Client,
    room: String,
    /// The createRoom events (all sent while visibility was `shared` or set by them).
    setup: Vec<String>,
    m: Vec<String>,
    invite: String,
    join: String,
}

/// alice creates a room with `history_visibility`, sends m1 m2, invites bob, sends m3,
/// bob joins, alice sends m4.
async fn story(ts: &TestServer, visibility: &str) -> Story {
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({
            "preset": "private_chat",
            "initial_state": [{ "type": "m.room.history_visibility", "state_key": "", "content": { "history_visibility": visibility } }],
        }))
        .await;
    let setup = alice.all_event_ids(&room).await;
    // create, alice's join, power levels, join rules, history visibility (shared),
    // guest access, history visibility (the requested one).
    assert_eq!(setup.len(), 7);
    let m1 = alice.send_text(&room, "m1").await;
    let m2 = alice.send_text(&room, "m2").await;
    alice.invite(&room, &bob.user_id).await;
    let invite = alice.all_event_ids(&room).await.last().unwrap().clone();
    let m3 = alice.send_text(&room, "m3").await;
    bob.join(&room).await;
    let join = alice.all_event_ids(&room).await.last().unwrap().clone();
    let m4 = alice.send_text(&room, "m4").await;
    let mut all = setup.clone();
    all.extend([
        m1.clone(),
        m2.clone(),
        invite.clone(),
        m3.clone(),
        join.clone(),
        m4.clone(),
    ]);
    assert_eq!(alice.all_event_ids(&room).await, all);
    Story {
        alice,
        bob,
        room,
        setup,
        m: vec![m1, m2, m3, m4],
        invite,
        join,
    }
}

/// What bob sees through `/messages` (both directions), `/sync` and `/event` equals
/// `visible`, and every other event of the room answers 404 on `/event` and `/context`.
/// `unchecked` (bob's own invite, see the ignored `history_visibility_joined_hides_own_invite`)
/// is left out of the comparison.
async fn assert_bob_sees(s: &Story, visible: &[String], unchecked: Option<&str>) {
    let keep = |v: Vec<String>| -> Vec<String> {
        v.into_iter()
            .filter(|id| Some(id.as_str()) != unchecked)
            .collect()
    };
    let forward = keep(ids(
        &s.bob.messages(&s.room, "dir=f&limit=100").await["chunk"],
    ));
    assert_eq!(forward, visible, "bob's /messages dir=f");
    let mut backward = keep(ids(
        &s.bob.messages(&s.room, "dir=b&limit=100").await["chunk"],
    ));
    backward.reverse();
    assert_eq!(backward, visible, "bob's /messages dir=b");
    let sync = s
        .bob
        .sync(&format!("filter={}", timeline_filter(100)))
        .await;
    assert_eq!(
        keep(sync_timeline_ids(&sync, "join", &s.room)),
        visible,
        "bob's initial /sync timeline"
    );
    assert_eq!(
        sync["rooms"]["join"][&s.room]["timeline"]["limited"],
        json!(false)
    );
    let all = s.alice.all_event_ids(&s.room).await;
    for id in &all {
        if Some(id.as_str()) == unchecked {
            continue;
        }
        let ev = s.bob.event(&s.room, id).await;
        let ctx = s.bob.context(&s.room, id, 4).await;
        if visible.contains(id) {
            assert_eq!(
                (ev.status, ev.body["event_id"].as_str()),
                (200, Some(id.as_str())),
                "{}",
                ev.text
            );
            assert_eq!(
                (ctx.status, ctx.body["event"]["event_id"].as_str()),
                (200, Some(id.as_str())),
                "{}",
                ctx.text
            );
        } else {
            ev.expect_err(404, "M_NOT_FOUND");
            ctx.expect_err(404, "M_NOT_FOUND");
            // Not in any answer bob gets.
            assert!(
                !sync.to_string().contains(id.as_str()),
                "bob's /sync names hidden event {id}"
            );
        }
    }
}

/// bob leaves, alice sends m5. bob sees nothing after his leave (not m5, on no
/// route), and still sees the events he saw while joined. Returns (bob's visible list
/// through `/messages` after leaving, the leave event id).
async fn leave_then_m5(s: &Story, visible_before: &[String]) -> (Vec<String>, String) {
    let since = s.bob.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    s.bob.leave(&s.room).await;
    let leave = s.alice.all_event_ids(&s.room).await.last().unwrap().clone();
    let m5 = s.alice.send_text(&s.room, "m5").await;
    assert_eq!(s.alice.all_event_ids(&s.room).await.last(), Some(&m5));

    s.bob
        .event(&s.room, &m5)
        .await
        .expect_err(404, "M_NOT_FOUND");
    s.bob
        .context(&s.room, &m5, 10)
        .await
        .expect_err(404, "M_NOT_FOUND");
    let forward = ids(&s.bob.messages(&s.room, "dir=f&limit=100").await["chunk"]);
    let mut backward = ids(&s.bob.messages(&s.room, "dir=b&limit=100").await["chunk"]);
    backward.reverse();
    assert_eq!(
        forward, backward,
        "bob's /messages after leaving, both directions"
    );
    // What bob saw while joined, then his leave, end the list; nothing is new to him.
    let tail = [s.join.clone(), s.m[3].clone(), leave.clone()];
    assert!(
        forward.ends_with(&tail),
        "bob's /messages after leaving ends with join, m4, leave: {forward:?}"
    );
    for id in &forward {
        assert!(
            visible_before.contains(id) || id == &leave || id == &s.invite,
            "{id} became visible to bob after he left"
        );
    }
    // Earlier events stay visible; their context stops at bob's leave.
    let m4 = &s.m[3];
    let ev = s.bob.event(&s.room, m4).await.ok();
    assert_eq!(ev["event_id"], json!(m4));
    let ctx = s.bob.context(&s.room, m4, 10).await.ok();
    assert_eq!(
        ids(&ctx["events_after"]),
        vec![leave.clone()],
        "bob's /context of m4 stops at his leave"
    );
    let ctx_alice = s.alice.context(&s.room, m4, 10).await.ok();
    assert_eq!(
        ids(&ctx_alice["events_after"]),
        vec![leave.clone(), m5.clone()]
    );
    // Incremental sync: the room moves to `leave`, ending with the leave event.
    let sync = s
        .bob
        .sync(&format!("since={since}&filter={}", timeline_filter(100)))
        .await;
    assert!(sync["rooms"]["join"].get(&s.room).is_none());
    assert_eq!(
        sync_timeline_ids(&sync, "leave", &s.room),
        vec![leave.clone()]
    );
    assert!(!sync.to_string().contains(m5.as_str()));
    // A later incremental sync shows nothing of the room.
    let next = sync["next_batch"].as_str().unwrap();
    let sync = s
        .bob
        .sync(&format!("since={next}&filter={}", timeline_filter(100)))
        .await;
    assert!(!sync.to_string().contains(&s.room), "{sync}");
    (forward, leave)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_visibility_joined() {
    let ts = TestServer::start().await;
    let s = story(&ts, "joined").await;
    // The createRoom events were sent while visibility was `shared` (and the change to
    // `joined` is visible under the before-or-after rule); m1..m3 were sent while bob
    // was not joined.
    let mut visible = s.setup.clone();
    visible.extend([s.join.clone(), s.m[3].clone()]);
    assert_bob_sees(&s, &visible, Some(&s.invite)).await;
    leave_then_m5(&s, &visible).await;
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_visibility_joined_hides_own_invite() {
    let ts = TestServer::start().await;
    let s = story(&ts, "joined").await;
    let mut visible = s.setup.clone();
    visible.extend([s.join.clone(), s.m[3].clone()]);
    assert_bob_sees(&s, &visible, None).await;
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_visibility_invited() {
    let ts = TestServer::start().await;
    let s = story(&ts, "invited").await;
    let mut visible = s.setup.clone();
    visible.extend([
        s.invite.clone(),
        s.m[2].clone(),
        s.join.clone(),
        s.m[3].clone(),
    ]);
    assert_bob_sees(&s, &visible, None).await;
    leave_then_m5(&s, &visible).await;
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_visibility_shared() {
    let ts = TestServer::start().await;
    let s = story(&ts, "shared").await;
    let all = s.alice.all_event_ids(&s.room).await;
    assert_bob_sees(&s, &all, None).await;
    leave_then_m5(&s, &all).await;
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_history_stays_visible_after_leaving() {
    let ts = TestServer::start().await;
    let s = story(&ts, "shared").await;
    let all = s.alice.all_event_ids(&s.room).await;
    let (after, leave) = leave_then_m5(&s, &all).await;
    let mut want = all.clone();
    want.push(leave);
    assert_eq!(after, want);
    ts.stop().await;
}

// ---------------------------------------------------------------------------------
// Read-your-writes (BRIEF §3.5)
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_your_writes() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    let filter = timeline_filter(50);
    let mut since = alice.sync(&format!("filter={filter}")).await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    for i in 0..50 {
        let body = format!("ryw {i}");
        let id = alice.send_text(&room, &body).await;
        let ev = alice.event(&room, &id).await.ok();
        assert_eq!(
            (ev["event_id"].as_str(), ev["content"]["body"].as_str()),
            (Some(id.as_str()), Some(body.as_str()))
        );
        assert_eq!(
            ev["unsigned"]["transaction_id"]
                .as_str()
                .map(|t| t.starts_with("txn")),
            Some(true)
        );
        let page = alice.messages(&room, "dir=b&limit=1").await;
        assert_eq!(
            ids(&page["chunk"]),
            vec![id.clone()],
            "iteration {i}: /messages"
        );
        let sync = alice.sync(&format!("since={since}&filter={filter}")).await;
        assert_eq!(
            sync_timeline_ids(&sync, "join", &room),
            vec![id.clone()],
            "iteration {i}: /sync"
        );
        since = sync["next_batch"].as_str().unwrap().to_owned();
    }
    ts.stop().await;
}

// ---------------------------------------------------------------------------------
// Tokens never run ahead (BRIEF §3.6)
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_tokens_never_run_ahead_of_projections() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    // bob writes continuously while alice syncs, so the journal keeps moving ahead.
    let writer = {
        let (bob, room) = (bob.clone(), room.clone());
        tokio::spawn(async move {
            for i in 0..60 {
                bob.send_text(&room, &format!("load {i}")).await;
            }
        })
    };
    let mut since: Option<String> = None;
    let mut checked = 0;
    while !writer.is_finished() || checked < 20 {
        let query = match &since {
            Some(s) => format!("since={s}"),
            None => String::new(),
        };
        let sync = alice.sync(&query).await;
        let next = sync["next_batch"].as_str().unwrap().to_owned();
        let pos = sync_pos(&next);
        for (name, cp) in ts.server.projections.runtime.checkpoints() {
            // No token is built from a projection that does not gate reads (the search
            // index, SPEC §3): it may lag, and `/search` waits for it alone.
            if !ts.server.projections.runtime.gates_reads(name) {
                continue;
            }
            assert!(
                pos <= cp,
                "next_batch {next} is ahead of projection {name} (checkpoint {cp})"
            );
        }
        assert!(pos <= ts.server.journal.durable_head());
        if let Some(prev) = &since {
            assert!(
                pos >= sync_pos(prev),
                "tokens never go backwards: {prev} then {next}"
            );
        }
        // Every event in the answer is at or before the token.
        for ev in sync["rooms"]["join"][&room]["timeline"]["events"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let rec = ts
                .server
                .projections
                .timeline
                .event(ev["event_id"].as_str().unwrap())
                .unwrap();
            assert!(
                rec.position <= pos,
                "event at {} in a response with token {next}",
                rec.position
            );
        }
        since = Some(next);
        checked += 1;
    }
    writer.await.unwrap();
    eprintln!("checked {checked} sync tokens against the projection checkpoints");
    ts.stop().await;
}

// ---------------------------------------------------------------------------------
// Our rooms are chains (BRIEF §3.8)
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_rooms_are_chains() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let room = alice
        .create_room(json!({ "preset": "private_chat", "name": "chain" }))
        .await;
    let other = bob.create_room(json!({ "preset": "private_chat" })).await;
    alice.invite(&room, &bob.user_id).await;
    bob.join(&room).await;
    alice.invite(&room, &carol.user_id).await;
    carol.join(&room).await;
    // 30 sends, concurrently from three users, interleaved with traffic in another room.
    let mut tasks = Vec::new();
    for (who, n) in [(alice.clone(), 10), (bob.clone(), 10), (carol.clone(), 10)] {
        let (room, other) = (room.clone(), other.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..n {
                who.send_text(&room, &format!("{} {i}", who.user_id)).await;
                if who.user_id == uid("bob") {
                    who.send_text(&other, "elsewhere").await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    carol.leave(&room).await;
    alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/kick", enc(&room)),
            &json!({ "user_id": bob.user_id }),
        )
        .await
        .ok();
    alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "done" }))
        .await;
    // Reading the projection directly bypasses the API's wait for acknowledged writes.
    let head = ts.server.journal.durable_head();
    assert!(
        ts.server
            .projections
            .runtime
            .wait_for(head, std::time::Duration::from_secs(10))
            .await
    );

    // From the journal.
    let mut records = Vec::new();
    let mut after = 0;
    loop {
        let batch = ts.server.journal.read_after(after, 1000).unwrap();
        let Some(last) = batch.last() else { break };
        after = last.position();
        records.extend(batch);
    }
    let pdus: Vec<_> = records
        .iter()
        .filter(|r| r.room_id() == Some(room.as_str()))
        .map(|r| (r.position(), r.pdu().expect("an event record parses")))
        .collect();
    // 7 createRoom events (create, join, power levels, join rules, history visibility,
    // guest access, name), 2 invites, 2 joins, 30 messages, leave, kick, topic.
    assert_eq!(pdus.len(), 7 + 4 + 30 + 3);
    let mut prev: Option<String> = None;
    for (i, (pos, pdu)) in pdus.iter().enumerate() {
        assert_eq!(
            pdu.depth,
            i as u64 + 1,
            "depth of event {i} at position {pos}"
        );
        let prevs: Vec<String> = pdu.prev_events.iter().map(|e| e.to_string()).collect();
        match &prev {
            None => {
                assert_eq!(pdu.kind.to_string(), "m.room.create");
                assert!(
                    prevs.is_empty(),
                    "m.room.create has no prev_events: {prevs:?}"
                );
            }
            Some(p) => assert_eq!(
                prevs,
                vec![p.clone()],
                "event {i} at position {pos} has exactly the previous event as prev_event"
            ),
        }
        prev = Some(pdu.event_id.to_string());
    }
    // The timeline projection holds the same chain, in the same order.
    let rows = ts
        .server
        .projections
        .timeline
        .range_forward(&room, 0, u64::MAX, 10_000);
    assert_eq!(
        rows.iter()
            .map(|(p, id)| (*p, id.clone()))
            .collect::<Vec<_>>(),
        pdus.iter()
            .map(|(p, pdu)| (*p, pdu.event_id.to_string()))
            .collect::<Vec<_>>()
    );
    for (_, id) in &rows {
        let rec = ts.server.projections.timeline.event(id).unwrap();
        let from_journal = &pdus
            .iter()
            .find(|(_, p)| p.event_id.as_str() == id)
            .unwrap()
            .1;
        assert_eq!(rec.pdu.prev_events, from_journal.prev_events);
        assert_eq!(rec.pdu.depth, from_journal.depth);
    }
    // And the client sees the same order.
    assert_eq!(
        alice.all_event_ids(&room).await,
        rows.iter().map(|(_, id)| id.clone()).collect::<Vec<_>>()
    );
    ts.stop().await;
}

// ---------------------------------------------------------------------------------
// Transaction ids
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_ids_are_idempotent_per_device() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    let content = json!({ "msgtype": "m.text", "body": "once" });
    let first = alice
        .send_txn(&room, "m.room.message", "same-txn", &content)
        .await
        .ok();
    let again = alice
        .send_txn(&room, "m.room.message", "same-txn", &content)
        .await
        .ok();
    assert_eq!(first, again);
    let id = first["event_id"].as_str().unwrap().to_owned();
    // Even with other content, the retry answers the original event.
    let changed = alice
        .send_txn(
            &room,
            "m.room.message",
            "same-txn",
            &json!({ "msgtype": "m.text", "body": "twice" }),
        )
        .await
        .ok();
    assert_eq!(changed["event_id"], json!(id));
    let bodies = |page: &Value| -> Vec<String> {
        page["chunk"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["type"] == "m.room.message")
            .map(|e| e["content"]["body"].as_str().unwrap().to_owned())
            .collect()
    };
    let page = alice.messages(&room, "dir=b&limit=100").await;
    assert_eq!(bodies(&page), vec!["once"]);
    assert_eq!(
        page["chunk"][0]["unsigned"]["transaction_id"],
        json!("same-txn")
    );

    // Another device of the same user, same txn id: a new event.
    let phone = ts.login("alice", Some("PHONE")).await;
    assert_ne!(phone.device_id, alice.device_id);
    let other = phone
        .send_txn(
            &room,
            "m.room.message",
            "same-txn",
            &json!({ "msgtype": "m.text", "body": "from phone" }),
        )
        .await
        .ok();
    let other_id = other["event_id"].as_str().unwrap().to_owned();
    assert_ne!(other_id, id);
    let page = alice.messages(&room, "dir=b&limit=100").await;
    assert_eq!(bodies(&page), vec!["from phone", "once"]);
    // transaction_id is shown only to the sending device.
    assert_eq!(page["chunk"][0]["unsigned"].get("transaction_id"), None);
    assert_eq!(
        page["chunk"][1]["unsigned"]["transaction_id"],
        json!("same-txn")
    );
    let page = phone.messages(&room, "dir=b&limit=2").await;
    assert_eq!(
        page["chunk"][0]["unsigned"]["transaction_id"],
        json!("same-txn")
    );
    assert_eq!(page["chunk"][1]["unsigned"].get("transaction_id"), None);
    // The phone retrying keeps its own event.
    let retry = phone
        .send_txn(&room, "m.room.message", "same-txn", &json!({}))
        .await
        .ok();
    assert_eq!(retry["event_id"], json!(other_id));
    assert_eq!(
        bodies(&alice.messages(&room, "dir=b&limit=100").await).len(),
        2
    );
    ts.stop().await;
}

// ---------------------------------------------------------------------------------
// Durable before acknowledged, with shared fsyncs (BRIEF §3.4)
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sends_share_fsyncs() {
    const N: usize = 8;
    let ts = TestServer::start().await;
    let mut clients = Vec::new();
    for i in 0..N {
        let c = ts.register(&format!("user{i}")).await;
        let room = c.create_room(json!({ "preset": "private_chat" })).await;
        clients.push((c, room));
    }
    let fsyncs_before = ts
        .server
        .journal
        .stats()
        .fsyncs
        .load(std::sync::atomic::Ordering::SeqCst);
    let appended_before = ts
        .server
        .journal
        .stats()
        .appended
        .load(std::sync::atomic::Ordering::SeqCst);
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for (c, room) in clients.clone() {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            c.send_text(&room, "concurrent").await
        }));
    }
    let mut event_ids = Vec::new();
    for t in tasks {
        event_ids.push(t.await.unwrap());
    }
    let fsyncs = ts
        .server
        .journal
        .stats()
        .fsyncs
        .load(std::sync::atomic::Ordering::SeqCst)
        - fsyncs_before;
    let appended = ts
        .server
        .journal
        .stats()
        .appended
        .load(std::sync::atomic::Ordering::SeqCst)
        - appended_before;
    eprintln!(
        "{N} concurrent sends into {N} rooms: {fsyncs} fsyncs for {appended} appended records"
    );
    assert_eq!(appended, N as u64);
    assert!(fsyncs >= 1, "an acknowledged write was fsynced");
    assert!(fsyncs <= N as u64, "{fsyncs} fsyncs for {N} sends");
    // Every acknowledged event is durable and readable (direct projection reads wait
    // for the projections first, as every API request does).
    let head = ts.server.journal.durable_head();
    assert!(
        ts.server
            .projections
            .runtime
            .wait_for(head, std::time::Duration::from_secs(10))
            .await
    );
    for ((c, room), id) in clients.iter().zip(&event_ids) {
        let rec = ts
            .server
            .projections
            .timeline
            .event(id)
            .expect("acknowledged event is projected");
        assert!(rec.position <= head);
        assert_eq!(
            ids(&c.messages(room, "dir=b&limit=1").await["chunk"]),
            vec![id.clone()]
        );
    }
    ts.stop().await;
}

// ---------------------------------------------------------------------------------
// Long-poll wake-up
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_sync_wakes_on_a_send() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let since = bob.sync("").await["next_batch"]
        .as_str()
        .unwrap()
        .to_owned();
    let poll = {
        let bob = bob.clone();
        let since = since.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let sync = bob.sync(&format!("since={since}&timeout=30000")).await;
            (started.elapsed(), sync)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let id = alice.send_text(&room, "wake up").await;
    let (elapsed, sync) = poll.await.unwrap();
    assert_eq!(sync_timeline_ids(&sync, "join", &room), vec![id]);
    // Generous bound: far below the 30 s timeout, so the poll woke on the send.
    assert!(
        elapsed < Duration::from_secs(10),
        "long-poll took {elapsed:?}"
    );
    ts.stop().await;
}

// ---------------------------------------------------------------------------------
// Room versions 11 and 12
// ---------------------------------------------------------------------------------

/// createRoom with `version`, invite + join, sends from both, and the create event as
/// `/state` shows it.
async fn room_version_case(version: &str) {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    {
        let room = alice.create_room(json!({ "preset": "private_chat", "room_version": version, "name": format!("v{version}") })).await;
        alice.invite(&room, &bob.user_id).await;
        bob.join(&room).await;
        let a = alice.send_text(&room, "hello").await;
        let b = bob.send_text(&room, "hi").await;
        let state = alice
            .get(&format!("/_matrix/client/v3/rooms/{}/state", enc(&room)))
            .await
            .ok();
        let creates: Vec<&Value> = state
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["type"] == "m.room.create")
            .collect();
        assert_eq!(creates.len(), 1);
        let create = creates[0];
        assert_eq!(create["content"]["room_version"], json!(version));
        assert_eq!(create["state_key"], json!(""));
        assert_eq!(create["sender"], json!(alice.user_id));
        assert_eq!(create["room_id"], json!(room));
        assert_eq!(
            create["content"].get("creator"),
            None,
            "v{version}: creator is the sender, not a content field"
        );
        let create_id = create["event_id"].as_str().unwrap();
        let single = alice
            .get(&format!(
                "/_matrix/client/v3/rooms/{}/state/m.room.create",
                enc(&room)
            ))
            .await
            .ok();
        assert_eq!(single, create["content"]);
        if version == "12" {
            assert_eq!(
                room,
                format!("!{}", create_id.strip_prefix('$').unwrap()),
                "v12 room id is the create event's reference hash"
            );
            // v12: the creator has unlimited power, not a power-levels entry.
            let pl = alice
                .get(&format!(
                    "/_matrix/client/v3/rooms/{}/state/m.room.power_levels",
                    enc(&room)
                ))
                .await
                .ok();
            assert_eq!(pl["users"].get(&alice.user_id), None);
        } else {
            assert!(
                room.ends_with(&format!(":{}", common::SERVER_NAME)),
                "{room}"
            );
            assert_ne!(
                room.trim_start_matches('!'),
                create_id.trim_start_matches('$')
            );
        }
        let all = alice.all_event_ids(&room).await;
        assert_eq!(&all[all.len() - 2..], &[a.clone(), b.clone()]);
        assert_eq!(
            ids(&bob.messages(&room, "dir=b&limit=2").await["chunk"]),
            vec![b, a]
        );
        let name = bob
            .get(&format!(
                "/_matrix/client/v3/rooms/{}/state/m.room.name",
                enc(&room)
            ))
            .await
            .ok();
        assert_eq!(name, json!({ "name": format!("v{version}") }));
    }
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_version_11() {
    room_version_case("11").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_version_12() {
    room_version_case("12").await;
}

// ---------------------------------------------------------------------------------
// Pagination: no gap, no duplicate
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pagination_and_sync_prev_batch_are_gapless() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    for i in 0..30 {
        alice.send_text(&room, &format!("p{i}")).await;
    }
    let all = alice.all_event_ids(&room).await;
    assert_eq!(all.len(), 6 + 30);
    // Backwards with every page size, following `end` until it is omitted.
    for limit in [1, 5, 7, 36] {
        let mut seen = Vec::new();
        let mut from: Option<String> = None;
        loop {
            let q = match &from {
                Some(f) => format!("dir=b&limit={limit}&from={f}"),
                None => format!("dir=b&limit={limit}"),
            };
            let page = alice.messages(&room, &q).await;
            let chunk = ids(&page["chunk"]);
            assert!(chunk.len() <= limit);
            seen.extend(chunk);
            match page["end"].as_str() {
                Some(e) => from = Some(e.to_owned()),
                None => break,
            }
            assert!(
                seen.len() <= all.len(),
                "limit {limit}: more events than the room has"
            );
        }
        let mut want = all.clone();
        want.reverse();
        assert_eq!(seen, want, "limit {limit}: backwards pagination");
    }
    // Forwards from the start.
    let mut seen = Vec::new();
    let mut from = "t0".to_string();
    loop {
        let page = alice
            .messages(&room, &format!("dir=f&limit=8&from={from}"))
            .await;
        let chunk = ids(&page["chunk"]);
        if chunk.is_empty() {
            break;
        }
        seen.extend(chunk);
        from = page["end"]
            .as_str()
            .expect("a non-empty forward page has an end")
            .to_owned();
    }
    assert_eq!(seen, all, "forwards pagination");
    // A limited sync timeline continues through prev_batch into /messages.
    let sync = alice.sync(&format!("filter={}", timeline_filter(10))).await;
    let joined = &sync["rooms"]["join"][&room];
    assert_eq!(joined["timeline"]["limited"], json!(true));
    let timeline = ids(&joined["timeline"]["events"]);
    assert_eq!(timeline, all[all.len() - 10..].to_vec());
    let prev = joined["timeline"]["prev_batch"].as_str().unwrap();
    let mut older = ids(&alice
        .messages(&room, &format!("dir=b&limit=100&from={prev}"))
        .await["chunk"]);
    older.reverse();
    assert_eq!(older, all[..all.len() - 10].to_vec());
    ts.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_omits_end_at_the_start_of_the_room() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(json!({ "preset": "private_chat" })).await;
    let all = alice.all_event_ids(&room).await;
    assert_eq!(all.len(), 6);
    let page = alice.messages(&room, "dir=b&limit=6").await;
    assert_eq!(ids(&page["chunk"]).len(), 6);
    assert_eq!(page.get("end"), None, "{page}");
    ts.stop().await;
}
