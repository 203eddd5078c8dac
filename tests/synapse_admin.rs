//! The Synapse-compatible admin API (`/_synapse/admin`, issue 17 item 7): every route
//! answers 403 `M_FORBIDDEN` to a non-admin, and each one's answer carries Synapse's
//! field names with the real values.

mod common;

use common::{Client, TestServer, enc, uid};
use reqwest::Method;
use serde_json::{Value, json};

const SECRET: &str = "shared-secret-for-tests";

async fn start() -> TestServer {
    TestServer::start_with(|c| {
        c.admins = vec![uid("root")];
        c.registration.shared_secret = SECRET.into();
    })
    .await
}

/// Every route of the Synapse admin API (method, path) with real ids filled in.
fn routes(room: &str, user: &str, media: &str) -> Vec<(Method, String)> {
    let (r, u) = (enc(room), enc(user));
    vec![
        (Method::GET, "/_synapse/admin/v2/users".into()),
        (Method::GET, format!("/_synapse/admin/v2/users/{u}")),
        (Method::PUT, format!("/_synapse/admin/v2/users/{u}")),
        (Method::POST, format!("/_synapse/admin/v1/deactivate/{u}")),
        (
            Method::POST,
            format!("/_synapse/admin/v1/reset_password/{u}"),
        ),
        (
            Method::GET,
            format!("/_synapse/admin/v1/users/{u}/joined_rooms"),
        ),
        (Method::GET, format!("/_synapse/admin/v1/whois/{u}")),
        (Method::POST, format!("/_synapse/admin/v1/users/{u}/login")),
        (Method::GET, format!("/_synapse/admin/v1/users/{u}/admin")),
        (Method::PUT, format!("/_synapse/admin/v1/users/{u}/admin")),
        (Method::GET, format!("/_synapse/admin/v1/users/{u}/media")),
        (Method::GET, "/_synapse/admin/v1/rooms".into()),
        (Method::GET, format!("/_synapse/admin/v1/rooms/{r}")),
        (Method::GET, format!("/_synapse/admin/v1/rooms/{r}/members")),
        (Method::GET, format!("/_synapse/admin/v1/rooms/{r}/state")),
        (Method::DELETE, format!("/_synapse/admin/v2/rooms/{r}")),
        (
            Method::GET,
            format!("/_synapse/admin/v2/rooms/{r}/delete_status"),
        ),
        (
            Method::GET,
            "/_synapse/admin/v2/rooms/delete_status/abc".into(),
        ),
        (Method::GET, "/_synapse/admin/v1/event_reports".into()),
        (Method::GET, "/_synapse/admin/v1/event_reports/1".into()),
        (Method::DELETE, "/_synapse/admin/v1/event_reports/1".into()),
        (
            Method::POST,
            format!("/_synapse/admin/v1/media/quarantine/localhost:8008/{media}"),
        ),
        (
            Method::DELETE,
            format!("/_synapse/admin/v1/media/localhost:8008/{media}"),
        ),
    ]
}

async fn upload(c: &Client, bytes: &[u8]) -> String {
    let r = c
        .raw(
            Method::POST,
            "/_matrix/media/v3/upload?filename=a.png",
            Some(bytes.to_vec()),
            &[("content-type", "image/png")],
        )
        .await
        .ok();
    r["content_uri"]
        .as_str()
        .unwrap()
        .rsplit('/')
        .next()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn non_admin_gets_403_on_every_route_and_nothing_changes() {
    let t = start().await;
    let _root = t.register("root").await;
    let alice = t.register("alice").await;
    let bob = t.register("bob").await;
    let room = alice.create_room(json!({"name": "Secret"})).await;
    let media = upload(&alice, b"png-bytes").await;
    for (method, path) in routes(&room, &alice.user_id, &media) {
        let body = json!({"admin": true, "new_password": "x", "password": "y"});
        let resp = bob.request(method.clone(), &path, Some(&body)).await;
        assert_eq!(
            (resp.status, resp.errcode()),
            (403, Some("M_FORBIDDEN")),
            "{method} {path} as a non-admin: {}",
            resp.text
        );
        // Without a token: 401, never the data.
        let anon = t.anon().request(method.clone(), &path, Some(&body)).await;
        assert_eq!(anon.status, 401, "{method} {path} without a token");
    }
    // Nothing changed: alice is still no admin, still in her room, media served.
    let root = t.login("root", None).await;
    let a = root
        .get(&format!("/_synapse/admin/v2/users/{}", enc(&alice.user_id)))
        .await
        .ok();
    assert_eq!(
        (a["admin"].clone(), a["deactivated"].clone()),
        (json!(false), json!(false))
    );
    let rooms = root
        .get(&format!(
            "/_synapse/admin/v1/users/{}/joined_rooms",
            enc(&alice.user_id)
        ))
        .await
        .ok();
    assert_eq!(rooms, json!({"joined_rooms": [room], "total": 1}));
    t.stop().await;
}

#[tokio::test]
async fn server_version_is_public() {
    let t = start().await;
    let v = t.anon().get("/_synapse/admin/v1/server_version").await.ok();
    assert_eq!(
        v,
        json!({"server_version": format!("Spindle {}", env!("CARGO_PKG_VERSION"))})
    );
    t.stop().await;
}

fn mac(nonce: &str, user: &str, password: &str, admin: bool) -> String {
    spindle_api::synapse_admin::registration_mac(SECRET, nonce, user, password, admin, None)
}

#[tokio::test]
async fn shared_secret_registration_as_synapse_defines_it() {
    let t = start().await;
    let anon = t.anon();
    let nonce = anon.get("/_synapse/admin/v1/register").await.ok()["nonce"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(nonce.len(), 64);
    // A wrong MAC is 403 and spends the nonce.
    let bad = anon
        .post(
            "/_synapse/admin/v1/register",
            &json!({"nonce": nonce, "username": "carol", "password": "pw-carol",
                    "admin": true, "mac": mac(&nonce, "carol", "pw-carol", false)}),
        )
        .await;
    bad.expect_err(403, "M_FORBIDDEN");
    let again = anon
        .post(
            "/_synapse/admin/v1/register",
            &json!({"nonce": nonce, "username": "carol", "password": "pw-carol",
                    "admin": true, "mac": mac(&nonce, "carol", "pw-carol", true)}),
        )
        .await;
    again.expect_err(400, "M_UNKNOWN");
    let nonce = anon.get("/_synapse/admin/v1/register").await.ok()["nonce"]
        .as_str()
        .unwrap()
        .to_owned();
    let ok = anon
        .post(
            "/_synapse/admin/v1/register",
            &json!({"nonce": nonce, "username": "Carol", "password": "pw-carol",
                    "displayname": "Carol C", "admin": true,
                    "mac": mac(&nonce, "Carol", "pw-carol", true)}),
        )
        .await
        .ok();
    assert_eq!(ok["user_id"], json!(uid("carol")));
    assert_eq!(ok["home_server"], json!("localhost:8008"));
    let carol = anon.with_token(ok["access_token"].as_str());
    let who = carol.get("/_matrix/client/v3/account/whoami").await.ok();
    assert_eq!(who["user_id"], json!(uid("carol")));
    assert_eq!(who["device_id"], ok["device_id"]);
    // Carol is an admin (by a journal fact) and may use the admin API.
    let me = carol
        .get(&format!(
            "/_synapse/admin/v1/users/{}/admin",
            enc(&uid("carol"))
        ))
        .await
        .ok();
    assert_eq!(me, json!({"admin": true}));
    let details = carol
        .get(&format!("/_synapse/admin/v2/users/{}", enc(&uid("carol"))))
        .await
        .ok();
    assert_eq!(details["displayname"], json!("Carol C"));
    // The same user again: taken.
    let nonce = anon.get("/_synapse/admin/v1/register").await.ok()["nonce"]
        .as_str()
        .unwrap()
        .to_owned();
    anon.post(
        "/_synapse/admin/v1/register",
        &json!({"nonce": nonce, "username": "carol", "password": "p",
                "mac": mac(&nonce, "carol", "p", false)}),
    )
    .await
    .expect_err(400, "M_USER_IN_USE");
    t.stop().await;
}

#[tokio::test]
async fn shared_secret_registration_is_off_without_a_secret() {
    let t = TestServer::start().await;
    t.anon()
        .get("/_synapse/admin/v1/register")
        .await
        .expect_err(400, "M_UNKNOWN");
    t.stop().await;
}

#[tokio::test]
async fn users_list_filters_orders_and_pages() {
    let t = start().await;
    let root = t.register("root").await;
    for name in ["dave", "erin", "frank"] {
        t.register(name).await;
    }
    root.put(
        &format!("/_synapse/admin/v2/users/{}", enc(&uid("erin"))),
        &json!({"displayname": "Zed Erin"}),
    )
    .await
    .ok();
    root.post(
        &format!("/_synapse/admin/v1/deactivate/{}", enc(&uid("frank"))),
        &json!({"erase": true}),
    )
    .await
    .ok();
    let names = |v: &Value| -> Vec<String> {
        v["users"]
            .as_array()
            .unwrap()
            .iter()
            .map(|u| u["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let all = root.get("/_synapse/admin/v2/users").await.ok();
    assert_eq!(names(&all), [uid("dave"), uid("erin"), uid("root")]);
    assert_eq!(all["total"], json!(3));
    assert!(all.get("next_token").is_none());
    let dave = &all["users"][0];
    for field in [
        "name",
        "user_type",
        "is_guest",
        "admin",
        "deactivated",
        "shadow_banned",
        "displayname",
        "avatar_url",
        "creation_ts",
        "erased",
        "last_seen_ts",
        "locked",
    ] {
        assert!(
            dave.get(field).is_some(),
            "list entry lacks {field}: {dave}"
        );
    }
    assert_eq!(dave["displayname"], json!("dave"));
    assert!(dave["creation_ts"].as_u64().unwrap() > 1_700_000_000_000);
    assert_eq!(all["users"][2]["admin"], json!(true));

    let with_deactivated = root
        .get("/_synapse/admin/v2/users?deactivated=true")
        .await
        .ok();
    assert_eq!(
        names(&with_deactivated),
        [uid("dave"), uid("erin"), uid("frank"), uid("root")]
    );
    assert_eq!(with_deactivated["users"][2]["deactivated"], json!(true));
    assert_eq!(with_deactivated["users"][2]["erased"], json!(true));

    let page = root
        .get("/_synapse/admin/v2/users?from=0&limit=2")
        .await
        .ok();
    assert_eq!(names(&page), [uid("dave"), uid("erin")]);
    assert_eq!(page["next_token"], json!("2"));
    let page2 = root
        .get("/_synapse/admin/v2/users?from=2&limit=2")
        .await
        .ok();
    assert_eq!(names(&page2), [uid("root")]);
    assert!(page2.get("next_token").is_none());

    let admins = root.get("/_synapse/admin/v2/users?admins=true").await.ok();
    assert_eq!(names(&admins), [uid("root")]);
    let no_admins = root.get("/_synapse/admin/v2/users?admins=false").await.ok();
    assert_eq!(names(&no_admins), [uid("dave"), uid("erin")]);
    let by_name = root.get("/_synapse/admin/v2/users?name=zed").await.ok();
    assert_eq!(names(&by_name), [uid("erin")]);
    let by_display = root
        .get("/_synapse/admin/v2/users?order_by=displayname&dir=b")
        .await
        .ok();
    // Byte order, as SQLite's default collation: "Zed Erin" < "dave" < "root".
    assert_eq!(names(&by_display), [uid("root"), uid("dave"), uid("erin")]);
    root.get("/_synapse/admin/v2/users?order_by=nonsense")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    root.get("/_synapse/admin/v2/users?admins=maybe")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    t.stop().await;
}

#[tokio::test]
async fn put_user_creates_modifies_and_admin_flag_round_trips() {
    let t = start().await;
    let root = t.register("root").await;
    let gina = uid("gina");
    let path = format!("/_synapse/admin/v2/users/{}", enc(&gina));
    root.get(&path).await.expect_err(404, "M_NOT_FOUND");
    let created = root
        .put(
            &path,
            &json!({"password": "pw-gina-1", "displayname": "Gina", "admin": false}),
        )
        .await;
    assert_eq!(created.status, 201, "{}", created.text);
    assert_eq!(created.body["name"], json!(gina));
    assert_eq!(created.body["displayname"], json!("Gina"));
    assert_eq!(created.body["admin"], json!(false));
    assert_eq!(created.body["threepids"], json!([]));
    // She can log in with that password.
    let login = |pw: &'static str| {
        let t = &t;
        async move {
            t.anon()
                .post(
                    "/_matrix/client/v3/login",
                    &json!({"type": "m.login.password",
                            "identifier": {"type": "m.id.user", "user": "gina"},
                            "password": pw}),
                )
                .await
        }
    };
    let session = login("pw-gina-1").await.ok();
    let gina_client = t.anon().with_token(session["access_token"].as_str());
    let room = gina_client.create_room(json!({})).await;
    // Modify: new display name (propagated to her room), admin on.
    let modified = root
        .put(&path, &json!({"displayname": "Gina G", "admin": true}))
        .await
        .ok();
    assert_eq!(modified["displayname"], json!("Gina G"));
    assert_eq!(modified["admin"], json!(true));
    let member = gina_client
        .get(&format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.member/{}",
            enc(&room),
            enc(&gina)
        ))
        .await
        .ok();
    assert_eq!(member["displayname"], json!("Gina G"));
    let admin_path = format!("/_synapse/admin/v1/users/{}/admin", enc(&gina));
    assert_eq!(root.get(&admin_path).await.ok(), json!({"admin": true}));
    assert_eq!(
        root.put(&admin_path, &json!({"admin": false})).await.ok(),
        json!({})
    );
    assert_eq!(root.get(&admin_path).await.ok(), json!({"admin": false}));
    // The config admin cannot demote themself.
    root.put(
        &format!("/_synapse/admin/v1/users/{}/admin", enc(&uid("root"))),
        &json!({"admin": false}),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
    // New password through PUT logs her devices out (logout_devices defaults to true).
    root.put(&path, &json!({"password": "pw-gina-2"}))
        .await
        .ok();
    gina_client
        .get("/_matrix/client/v3/account/whoami")
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    login("pw-gina-1").await.expect_err(403, "M_FORBIDDEN");
    let session = login("pw-gina-2").await.ok();
    // reset_password with logout_devices: false keeps the session.
    let gina_client = t.anon().with_token(session["access_token"].as_str());
    assert_eq!(
        root.post(
            &format!("/_synapse/admin/v1/reset_password/{}", enc(&gina)),
            &json!({"new_password": "pw-gina-3", "logout_devices": false}),
        )
        .await
        .ok(),
        json!({})
    );
    gina_client
        .get("/_matrix/client/v3/account/whoami")
        .await
        .ok();
    login("pw-gina-3").await.ok();
    t.stop().await;
}

#[tokio::test]
async fn deactivate_login_as_whois_and_joined_rooms() {
    let t = start().await;
    let root = t.register("root").await;
    let hank = t.register("hank").await;
    let room = hank.create_room(json!({})).await;
    let hank_id = hank.user_id.clone();
    // Login as hank: a working token for him, on a new device.
    let login = root
        .post(
            &format!("/_synapse/admin/v1/users/{}/login", enc(&hank_id)),
            &json!({}),
        )
        .await
        .ok();
    let puppet = t.anon().with_token(login["access_token"].as_str());
    let who = puppet.get("/_matrix/client/v3/account/whoami").await.ok();
    assert_eq!(who["user_id"], json!(hank_id));
    root.post(
        &format!("/_synapse/admin/v1/users/{}/login", enc(&uid("root"))),
        &json!({}),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
    // An expiring one stops working at valid_until_ms (here: already in the past is refused).
    root.post(
        &format!("/_synapse/admin/v1/users/{}/login", enc(&hank_id)),
        &json!({"valid_until_ms": 1}),
    )
    .await
    .expect_err(400, "M_INVALID_PARAM");
    let whois = root
        .get(&format!("/_synapse/admin/v1/whois/{}", enc(&hank_id)))
        .await
        .ok();
    assert_eq!(whois["user_id"], json!(hank_id));
    assert_eq!(whois["devices"].as_object().unwrap().len(), 2);
    assert_eq!(
        root.get(&format!(
            "/_synapse/admin/v1/users/{}/joined_rooms",
            enc(&hank_id)
        ))
        .await
        .ok(),
        json!({"joined_rooms": [room.clone()], "total": 1})
    );
    let out = root
        .post(
            &format!("/_synapse/admin/v1/deactivate/{}", enc(&hank_id)),
            &json!({"erase": false}),
        )
        .await
        .ok();
    assert_eq!(out, json!({"id_server_unbind_result": "success"}));
    puppet
        .get("/_matrix/client/v3/account/whoami")
        .await
        .expect_err(401, "M_UNKNOWN_TOKEN");
    assert_eq!(
        root.get(&format!(
            "/_synapse/admin/v1/users/{}/joined_rooms",
            enc(&hank_id)
        ))
        .await
        .ok(),
        json!({"joined_rooms": [], "total": 0})
    );
    let details = root
        .get(&format!("/_synapse/admin/v2/users/{}", enc(&hank_id)))
        .await
        .ok();
    assert_eq!(details["deactivated"], json!(true));
    assert_eq!(details["erased"], json!(false));
    root.post(
        &format!("/_synapse/admin/v1/deactivate/{}", enc(&uid("nobody"))),
        &json!({}),
    )
    .await
    .expect_err(404, "M_NOT_FOUND");
    t.stop().await;
}

#[tokio::test]
async fn rooms_list_details_members_state() {
    let t = start().await;
    let root = t.register("root").await;
    let ivy = t.register("ivy").await;
    let jack = t.register("jack").await;
    let a = ivy
        .create_room(
            json!({"name": "Alpha", "preset": "public_chat", "visibility": "public",
                            "room_alias_name": "alpha"}),
        )
        .await;
    jack.join(&a).await;
    let b = jack.create_room(json!({"name": "Beta"})).await;
    let list = root.get("/_synapse/admin/v1/rooms").await.ok();
    assert_eq!(list["total_rooms"], json!(2));
    assert_eq!(list["offset"], json!(0));
    let ids: Vec<&str> = list["rooms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["room_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [a.as_str(), b.as_str()]);
    let alpha = &list["rooms"][0];
    assert_eq!(alpha["name"], json!("Alpha"));
    assert_eq!(alpha["canonical_alias"], json!("#alpha:localhost:8008"));
    assert_eq!(alpha["joined_members"], json!(2));
    assert_eq!(alpha["joined_local_members"], json!(2));
    assert_eq!(alpha["creator"], json!(ivy.user_id));
    assert_eq!(alpha["public"], json!(true));
    assert_eq!(alpha["join_rules"], json!("public"));
    assert_eq!(alpha["federatable"], json!(true));
    assert_eq!(alpha["encryption"], Value::Null);
    assert!(alpha["state_events"].as_u64().unwrap() >= 7);
    let by_size = root
        .get("/_synapse/admin/v1/rooms?order_by=joined_members&dir=b")
        .await
        .ok();
    assert_eq!(by_size["rooms"][0]["room_id"], json!(b));
    let search = root
        .get("/_synapse/admin/v1/rooms?search_term=bet")
        .await
        .ok();
    assert_eq!(search["total_rooms"], json!(1));
    assert_eq!(search["rooms"][0]["room_id"], json!(b));
    let paged = root.get("/_synapse/admin/v1/rooms?limit=1").await.ok();
    assert_eq!(paged["next_batch"], json!(1));
    let paged2 = root
        .get("/_synapse/admin/v1/rooms?from=1&limit=1")
        .await
        .ok();
    assert_eq!(paged2["prev_batch"], json!(0));
    assert!(paged2.get("next_batch").is_none());

    let details = root
        .get(&format!("/_synapse/admin/v1/rooms/{}", enc(&a)))
        .await
        .ok();
    assert_eq!(details["name"], json!("Alpha"));
    assert_eq!(details["joined_local_devices"], json!(2));
    assert_eq!(details["forgotten"], json!(false));
    let members = root
        .get(&format!("/_synapse/admin/v1/rooms/{}/members", enc(&a)))
        .await
        .ok();
    let mut want = vec![ivy.user_id.clone(), jack.user_id.clone()];
    want.sort();
    assert_eq!(members, json!({"members": want, "total": 2}));
    let state = root
        .get(&format!("/_synapse/admin/v1/rooms/{}/state", enc(&a)))
        .await
        .ok();
    let names: Vec<&Value> = state["state"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.room.name")
        .map(|e| &e["content"]["name"])
        .collect();
    assert_eq!(names, [&json!("Alpha")]);
    assert_eq!(
        state["state"].as_array().unwrap().len() as u64,
        details["state_events"].as_u64().unwrap()
    );
    root.get(&format!(
        "/_synapse/admin/v1/rooms/{}",
        enc("!nope:localhost:8008")
    ))
    .await
    .expect_err(404, "M_NOT_FOUND");
    t.stop().await;
}

#[tokio::test]
async fn delete_room_removes_everyone_blocks_and_moves_them() {
    let t = start().await;
    let root = t.register("root").await;
    let kim = t.register("kim").await;
    let lee = t.register("lee").await;
    let room = kim
        .create_room(json!({"preset": "public_chat", "visibility": "public",
                            "room_alias_name": "doomed"}))
        .await;
    lee.join(&room).await;
    let resp = root
        .request(
            Method::DELETE,
            &format!("/_synapse/admin/v2/rooms/{}", enc(&room)),
            Some(
                &json!({"new_room_user_id": uid("root"), "room_name": "Gone",
                         "message": "This room was shut down", "block": true}),
            ),
        )
        .await
        .ok();
    let delete_id = resp["delete_id"].as_str().unwrap().to_owned();
    let status = root
        .get(&format!(
            "/_synapse/admin/v2/rooms/delete_status/{delete_id}"
        ))
        .await
        .ok();
    assert_eq!(status["status"], json!("complete"));
    let mut kicked: Vec<String> = status["shutdown_room"]["kicked_users"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    kicked.sort();
    assert_eq!(kicked, [kim.user_id.clone(), lee.user_id.clone()]);
    assert_eq!(status["shutdown_room"]["failed_to_kick_users"], json!([]));
    assert_eq!(
        status["shutdown_room"]["local_aliases"],
        json!(["#doomed:localhost:8008"])
    );
    let new_room = status["shutdown_room"]["new_room_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let by_room = root
        .get(&format!(
            "/_synapse/admin/v2/rooms/{}/delete_status",
            enc(&room)
        ))
        .await
        .ok();
    assert_eq!(by_room["results"][0]["delete_id"], json!(delete_id));
    // Nobody is left; both are in the new room, which holds the message.
    let members = root
        .get(&format!("/_synapse/admin/v1/rooms/{}/members", enc(&room)))
        .await
        .ok();
    assert_eq!(members, json!({"members": [], "total": 0}));
    let new_members = root
        .get(&format!(
            "/_synapse/admin/v1/rooms/{}/members",
            enc(&new_room)
        ))
        .await
        .ok();
    let mut want = vec![kim.user_id.clone(), lee.user_id.clone(), uid("root")];
    want.sort();
    assert_eq!(new_members["members"], json!(want));
    let msgs = kim.messages(&new_room, "dir=b&limit=5").await;
    let bodies: Vec<&Value> = msgs["chunk"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "m.room.message")
        .map(|e| &e["content"]["body"])
        .collect();
    assert_eq!(bodies, [&json!("This room was shut down")]);
    // The alias is gone, and the room is blocked for local joins.
    t.anon()
        .get(&format!(
            "/_matrix/client/v3/directory/room/{}",
            enc("#doomed:localhost:8008")
        ))
        .await
        .expect_err(404, "M_NOT_FOUND");
    kim.post(
        &format!("/_matrix/client/v3/rooms/{}/join", enc(&room)),
        &json!({}),
    )
    .await
    .expect_err(403, "M_FORBIDDEN");
    t.stop().await;
}

#[tokio::test]
async fn event_reports_list_get_delete() {
    let t = start().await;
    let root = t.register("root").await;
    let mia = t.register("mia").await;
    let ned = t.register("ned").await;
    let room = mia
        .create_room(json!({"name": "Reported", "preset": "public_chat"}))
        .await;
    ned.join(&room).await;
    let ev1 = mia.send_text(&room, "bad one").await;
    let ev2 = mia.send_text(&room, "bad two").await;
    for (ev, reason) in [(&ev1, "spam"), (&ev2, "abuse")] {
        ned.post(
            &format!("/_matrix/client/v3/rooms/{}/report/{}", enc(&room), enc(ev)),
            &json!({"reason": reason, "score": -100}),
        )
        .await
        .ok();
    }
    let list = root.get("/_synapse/admin/v1/event_reports").await.ok();
    assert_eq!(list["total"], json!(2));
    let newest = &list["event_reports"][0];
    assert_eq!(newest["event_id"], json!(ev2));
    assert_eq!(newest["reason"], json!("abuse"));
    assert_eq!(newest["user_id"], json!(ned.user_id));
    assert_eq!(newest["sender"], json!(mia.user_id));
    assert_eq!(newest["name"], json!("Reported"));
    assert_eq!(newest["score"], json!(-100));
    assert_eq!(newest["room_id"], json!(room));
    let forward = root
        .get("/_synapse/admin/v1/event_reports?dir=f&limit=1")
        .await
        .ok();
    assert_eq!(forward["event_reports"][0]["event_id"], json!(ev1));
    assert_eq!(forward["next_token"], json!(1));
    let id = newest["id"].as_u64().unwrap();
    let one = root
        .get(&format!("/_synapse/admin/v1/event_reports/{id}"))
        .await
        .ok();
    assert_eq!(one["event_json"]["content"]["body"], json!("bad two"));
    assert_eq!(
        root.request(
            Method::DELETE,
            &format!("/_synapse/admin/v1/event_reports/{id}"),
            None
        )
        .await
        .ok(),
        json!({})
    );
    root.get(&format!("/_synapse/admin/v1/event_reports/{id}"))
        .await
        .expect_err(404, "M_NOT_FOUND");
    let list = root.get("/_synapse/admin/v1/event_reports").await.ok();
    assert_eq!(list["total"], json!(1));
    root.get("/_synapse/admin/v1/event_reports/abc")
        .await
        .expect_err(400, "M_INVALID_PARAM");
    t.stop().await;
}

#[tokio::test]
async fn media_list_quarantine_delete() {
    let t = start().await;
    let root = t.register("root").await;
    let ola = t.register("ola").await;
    let m1 = upload(&ola, b"first-bytes").await;
    let m2 = upload(&ola, b"second-bytes-longer").await;
    let list = root
        .get(&format!(
            "/_synapse/admin/v1/users/{}/media",
            enc(&ola.user_id)
        ))
        .await
        .ok();
    assert_eq!(list["total"], json!(2));
    let ids: Vec<&str> = list["media"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["media_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [m1.as_str(), m2.as_str()]);
    assert_eq!(list["media"][1]["media_length"], json!(19));
    assert_eq!(list["media"][1]["media_type"], json!("image/png"));
    assert_eq!(list["media"][1]["upload_name"], json!("a.png"));
    assert_eq!(list["media"][1]["quarantined_by"], Value::Null);
    let by_len = root
        .get(&format!(
            "/_synapse/admin/v1/users/{}/media?order_by=media_length&dir=b&limit=1",
            enc(&ola.user_id)
        ))
        .await
        .ok();
    assert_eq!(by_len["media"][0]["media_id"], json!(m2));
    assert_eq!(by_len["next_token"], json!(1));
    let download = |id: String| {
        let ola = ola.clone();
        async move {
            ola.get(&format!(
                "/_matrix/client/v1/media/download/localhost:8008/{id}"
            ))
            .await
        }
    };
    assert_eq!(download(m1.clone()).await.status, 200);
    assert_eq!(
        root.post(
            &format!("/_synapse/admin/v1/media/quarantine/localhost:8008/{m1}"),
            &json!({}),
        )
        .await
        .ok(),
        json!({})
    );
    download(m1.clone()).await.expect_err(404, "M_NOT_FOUND");
    let list = root
        .get(&format!(
            "/_synapse/admin/v1/users/{}/media",
            enc(&ola.user_id)
        ))
        .await
        .ok();
    assert_eq!(list["media"][0]["quarantined_by"], json!(uid("root")));
    let deleted = root
        .request(
            Method::DELETE,
            &format!("/_synapse/admin/v1/media/localhost:8008/{m2}"),
            None,
        )
        .await
        .ok();
    assert_eq!(deleted, json!({"deleted_media": [m2.clone()], "total": 1}));
    download(m2.clone()).await.expect_err(404, "M_NOT_FOUND");
    let list = root
        .get(&format!(
            "/_synapse/admin/v1/users/{}/media",
            enc(&ola.user_id)
        ))
        .await
        .ok();
    assert_eq!(list["total"], json!(1));
    root.request(
        Method::DELETE,
        &format!("/_synapse/admin/v1/media/localhost:8008/{m2}"),
        None,
    )
    .await
    .expect_err(404, "M_NOT_FOUND");
    t.stop().await;
}
