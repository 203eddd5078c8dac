//! Room versions 1 to 12 (issue 15, item 1): create, invite, join, send, redact and
//! upgrade in every version; each version's event id format; the auth rules that
//! differ (string power levels before v10, knocking from v7); `/capabilities`.

mod common;

use common::{TestServer, enc, ids};
use serde_json::json;

const ALL: [&str; 12] = [
    "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12",
];

fn state_path(room: &str, kind: &str) -> String {
    format!("/_matrix/client/v3/rooms/{}/state/{}", enc(room), kind)
}

/// Asserts `id` has the event id format of `version` (spec: room versions, "Event IDs").
fn assert_event_id_format(version: &str, id: &str) {
    let body = id.strip_prefix('$').unwrap_or_else(|| panic!("{id}"));
    match version {
        "1" | "2" => {
            let (opaque, server) = body.split_once(':').unwrap_or_else(|| panic!("{id}"));
            assert_eq!(server, common::SERVER_NAME, "v{version}: {id}");
            assert_eq!(opaque.len(), 24, "v{version}: {id}");
        }
        _ => {
            assert_eq!(body.len(), 43, "v{version}: {id}");
            assert!(!body.contains(':'), "v{version}: {id}");
            let url_safe = body
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            let standard = body
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '+' || c == '/');
            if version == "3" {
                assert!(standard, "v3 ids are standard base64: {id}");
            } else {
                assert!(url_safe, "v{version} ids are URL-safe base64: {id}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_list_every_version_as_stable_with_default_10() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let caps = alice.get("/_matrix/client/v3/capabilities").await.ok();
    let mut expected = serde_json::Map::new();
    for v in ALL {
        expected.insert(v.into(), json!("stable"));
    }
    assert_eq!(
        caps["capabilities"]["m.room_versions"],
        json!({ "default": "10", "available": expected })
    );
    // createRoom without a version still makes a v10 room.
    let room = alice.create_room(json!({})).await;
    let create = alice.get(&state_path(&room, "m.room.create")).await.ok();
    assert_eq!(create["room_version"], json!("10"));
    ts.stop().await;
}

/// Every version: create (with the version's create content and id formats), invite
/// and join, sends from both, an auth refusal (bob at level 0 may not rename), a
/// redaction, then an upgrade to the next version (12 goes to 1, so every version is
/// upgraded from and to).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_room_version_creates_joins_sends_redacts_and_upgrades() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    for (i, version) in ALL.iter().copied().enumerate() {
        let room = alice
            .create_room(json!({
                "preset": "private_chat",
                "room_version": version,
                "name": format!("v{version}"),
            }))
            .await;
        if version == "12" {
            assert!(!room.contains(':'), "v12 room ids have no server: {room}");
        } else {
            assert!(
                room.ends_with(&format!(":{}", common::SERVER_NAME)),
                "v{version}: {room}"
            );
        }
        alice.invite(&room, &bob.user_id).await;
        bob.join(&room).await;
        let a = alice.send_text(&room, "hello").await;
        let b = bob.send_text(&room, "hi").await;
        assert_event_id_format(version, &a);
        assert_event_id_format(version, &b);

        let state = alice
            .get(&format!("/_matrix/client/v3/rooms/{}/state", enc(&room)))
            .await
            .ok();
        let create = state
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["type"] == "m.room.create")
            .cloned()
            .unwrap();
        assert_event_id_format(version, create["event_id"].as_str().unwrap());
        assert_eq!(create["content"]["room_version"], json!(version));
        let creator_field = create["content"].get("creator").cloned();
        if matches!(version, "11" | "12") {
            assert_eq!(creator_field, None, "v{version}");
        } else {
            assert_eq!(creator_field, Some(json!(alice.user_id)), "v{version}");
        }
        for e in state.as_array().unwrap() {
            assert_event_id_format(version, e["event_id"].as_str().unwrap());
        }

        // The events come back in order, from /messages and from /event.
        let all = alice.all_event_ids(&room).await;
        assert_eq!(&all[all.len() - 2..], &[a.clone(), b.clone()], "v{version}");
        let ev = bob.event(&room, &a).await.ok();
        assert_eq!(ev["event_id"], json!(a));
        assert_eq!(ev["content"]["body"], json!("hello"));

        // Bob (level 0) may not rename the room: state_default is 50 in every version.
        bob.put(
            &state_path(&room, "m.room.name"),
            &json!({ "name": "bob's" }),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");

        // Redaction: the version's algorithm strips the body; the redaction's id has
        // the version's format too.
        let red = alice
            .put(
                &format!(
                    "/_matrix/client/v3/rooms/{}/redact/{}/{}",
                    enc(&room),
                    enc(&b),
                    common::txn()
                ),
                &json!({ "reason": "test" }),
            )
            .await
            .ok();
        assert_event_id_format(version, red["event_id"].as_str().unwrap());
        let redacted = alice.event(&room, &b).await.ok();
        assert_eq!(redacted["content"], json!({}), "v{version}");
        assert_eq!(
            redacted["unsigned"]["redacted_because"]["event_id"],
            red["event_id"]
        );

        // Upgrade to the next version.
        let next = ALL[(i + 1) % ALL.len()];
        let last_before = alice.all_event_ids(&room).await.last().cloned().unwrap();
        let new = alice
            .post(
                &format!("/_matrix/client/v3/rooms/{}/upgrade", enc(&room)),
                &json!({ "new_version": next }),
            )
            .await
            .ok()["replacement_room"]
            .as_str()
            .unwrap()
            .to_owned();
        let new_create = alice.get(&state_path(&new, "m.room.create")).await.ok();
        assert_eq!(new_create["room_version"], json!(next), "v{version}");
        assert_eq!(
            new_create["predecessor"],
            json!({ "room_id": room, "event_id": last_before })
        );
        assert_eq!(
            alice.get(&state_path(&new, "m.room.name")).await.ok(),
            json!({ "name": format!("v{version}") })
        );
        assert_eq!(
            alice.get(&state_path(&room, "m.room.tombstone")).await.ok()["replacement_room"],
            json!(new)
        );
        // The copied join rule is `invite` (private_chat): Bob follows by invitation.
        alice.invite(&new, &bob.user_id).await;
        bob.join(&new).await;
        let c = bob.send_text(&new, "moved").await;
        assert_event_id_format(next, &c);
        assert_eq!(
            ids(&alice.messages(&new, "dir=b&limit=1").await["chunk"]),
            vec![c]
        );
    }
    ts.stop().await;
}

/// Before v10 the auth rules read a string power level as the integer it holds
/// (ruma's rules); from v10 the levels must be integers (400 here, before the event is
/// built). Upgrading such a room writes the levels as integers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_rooms_accept_string_power_levels_and_upgrades_make_them_integers() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let string_levels = |alice: &str, bob: &str| {
        json!({
            "users": { alice: "100", bob: "50" },
            "users_default": "0",
            "events": { "m.room.name": "50", "m.room.power_levels": "100", "m.room.tombstone": "100" },
            "events_default": "0", "state_default": "50", "ban": "50", "kick": "50",
            "redact": "50", "invite": "0",
        })
    };
    for version in ["1", "5", "9"] {
        let room = alice
            .create_room(json!({ "preset": "public_chat", "room_version": version }))
            .await;
        bob.join(&room).await;
        bob.put(&state_path(&room, "m.room.name"), &json!({ "name": "no" }))
            .await
            .expect_err(403, "M_FORBIDDEN");
        alice
            .put_state(
                &room,
                "m.room.power_levels",
                "",
                string_levels(&alice.user_id, &bob.user_id),
            )
            .await;
        // Bob's "50" meets the room name's "50".
        bob.put_state(&room, "m.room.name", "", json!({ "name": "bob's" }))
            .await;
        // Alice's "100" still outranks Bob's "50": he may not change the levels.
        bob.put(
            &state_path(&room, "m.room.power_levels"),
            &string_levels(&bob.user_id, &alice.user_id),
        )
        .await
        .expect_err(403, "M_FORBIDDEN");
        let new = alice
            .post(
                &format!("/_matrix/client/v3/rooms/{}/upgrade", enc(&room)),
                &json!({ "new_version": "10" }),
            )
            .await
            .ok()["replacement_room"]
            .as_str()
            .unwrap()
            .to_owned();
        let pl = alice
            .get(&state_path(&new, "m.room.power_levels"))
            .await
            .ok();
        assert_eq!(pl["users"][&alice.user_id], json!(100), "v{version}: {pl}");
        assert_eq!(pl["users"][&bob.user_id], json!(50), "v{version}: {pl}");
        assert_eq!(pl["events"]["m.room.name"], json!(50), "v{version}: {pl}");
        assert_eq!(pl["state_default"], json!(50), "v{version}: {pl}");
    }
    for version in ["10", "11"] {
        let room = alice.create_room(json!({ "room_version": version })).await;
        alice
            .put(
                &state_path(&room, "m.room.power_levels"),
                &string_levels(&alice.user_id, &bob.user_id),
            )
            .await
            .expect_err(400, "M_BAD_JSON");
    }
    ts.stop().await;
}

/// Knocking exists from room version 7: an older room refuses a knock join rule's
/// knock (the auth rules know no `knock` membership there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn knocking_is_refused_before_v7_and_accepted_from_v7() {
    let ts = TestServer::start().await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    for (version, allowed) in [("6", false), ("7", true)] {
        let room = alice
            .create_room(json!({ "preset": "private_chat", "room_version": version }))
            .await;
        let r = alice
            .put(
                &state_path(&room, "m.room.join_rules"),
                &json!({ "join_rule": "knock" }),
            )
            .await;
        let knock = bob
            .post(
                &format!("/_matrix/client/v3/knock/{}", enc(&room)),
                &json!({}),
            )
            .await;
        if allowed {
            assert_eq!(r.status, 200, "{}", r.text);
            assert_eq!(knock.ok()["room_id"], json!(room));
        } else {
            // The join rule itself is only a state event; the knock is what v6 refuses.
            knock.expect_err(403, "M_FORBIDDEN");
        }
    }
    ts.stop().await;
}
