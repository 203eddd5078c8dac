//! Audit trails (issue 6): the admin API lists every state change of a room with the
//! value it replaced, and an account's journal facts, to server admins only; the
//! `spindle audit` verbs print the same from a data directory.

mod common;

use std::path::Path;

use common::{TestServer, enc, txn, uid};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_spindle");

fn event_ids(changes: &Value) -> Vec<String> {
    changes
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["event_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_room_lists_state_changes_with_previous_values_to_admins_only() {
    let ts = TestServer::start_with(|c| c.admins = vec![uid("alice")]).await;
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "name": "Audited" })).await;
    let one = alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "one" }))
        .await;
    let two = alice
        .put_state(&room, "m.room.topic", "", json!({ "topic": "two" }))
        .await;
    alice.invite(&room, &bob.user_id).await;
    bob.join(&room).await;
    let message = bob.send_text(&room, "messages are not state").await;
    let redaction = alice
        .put(
            &format!(
                "/_matrix/client/v3/rooms/{}/redact/{}/{}",
                enc(&room),
                enc(&two),
                txn()
            ),
            &json!({ "reason": "wrong topic" }),
        )
        .await
        .ok()["event_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/_spindle/admin/v1/audit/rooms/{}", enc(&room));

    // Not an admin: 403, for this room or any other (even a member of the room).
    bob.get(&path).await.expect_err(403, "M_FORBIDDEN");
    bob.get(&format!(
        "/_spindle/admin/v1/audit/users/{}",
        enc(&alice.user_id)
    ))
    .await
    .expect_err(403, "M_FORBIDDEN");

    let topics = alice.get(&format!("{path}?type=m.room.topic")).await.ok();
    assert_eq!(
        topics["changes"],
        json!([
            {
                "position": topics["changes"][0]["position"],
                "origin_server_ts": topics["changes"][0]["origin_server_ts"],
                "event_id": one, "sender": alice.user_id,
                "event_type": "m.room.topic", "state_key": "",
                "prev": null, "new": { "topic": "one" },
            },
            {
                "position": topics["changes"][1]["position"],
                "origin_server_ts": topics["changes"][1]["origin_server_ts"],
                "event_id": two, "sender": alice.user_id,
                "event_type": "m.room.topic", "state_key": "",
                "prev": { "event_id": one, "content": { "topic": "one" } },
                "new": { "topic": "two" },
            },
            {
                "position": topics["changes"][2]["position"],
                "origin_server_ts": topics["changes"][2]["origin_server_ts"],
                "event_id": redaction, "sender": alice.user_id,
                "event_type": "m.room.topic", "state_key": "",
                "prev": { "event_id": two, "content": { "topic": "two" } },
                "new": null, "redacts": two,
            },
        ])
    );
    let all = alice.get(&path).await.ok();
    let ids = event_ids(&all["changes"]);
    assert!(!ids.contains(&message), "a message is not a state change");
    let kinds: Vec<(String, String)> = all["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["event_type"].as_str().unwrap().to_owned(),
                c["state_key"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let member = |u: &str| ("m.room.member".to_owned(), u.to_owned());
    let state = |t: &str| (t.to_owned(), String::new());
    assert_eq!(
        kinds,
        vec![
            state("m.room.create"),
            member(&alice.user_id),
            state("m.room.power_levels"),
            state("m.room.join_rules"),
            state("m.room.history_visibility"),
            state("m.room.guest_access"),
            state("m.room.name"),
            state("m.room.topic"),
            state("m.room.topic"),
            member(&bob.user_id),
            member(&bob.user_id),
            state("m.room.topic"),
        ]
    );
    // Bob's join names the invite it replaced.
    let join = &all["changes"][10];
    assert_eq!(join["new"]["membership"], "join");
    assert_eq!(join["prev"]["content"]["membership"], "invite");
    assert_eq!(join["prev"]["event_id"], all["changes"][9]["event_id"]);
    // Filters: by sender, and by time (origin_server_ts is the event's).
    let by_bob = alice
        .get(&format!("{path}?sender={}", enc(&bob.user_id)))
        .await
        .ok();
    assert_eq!(event_ids(&by_bob["changes"]), vec![ids[10].clone()]);
    let ts10 = all["changes"][10]["origin_server_ts"].as_u64().unwrap();
    let until = alice.get(&format!("{path}?until_ts={ts10}")).await.ok();
    let before: Vec<String> = all["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["origin_server_ts"].as_u64().unwrap() < ts10)
        .map(|c| c["event_id"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        before.len() >= 7,
        "the room's creation events precede bob's join"
    );
    assert_eq!(event_ids(&until["changes"]), before);
    let since = alice
        .get(&format!("{path}?since_ts={ts10}&type=m.room.member"))
        .await
        .ok();
    assert_eq!(event_ids(&since["changes"]), vec![ids[10].clone()]);
    // Paging: pages of 4 concatenate to the whole list.
    let mut paged = Vec::new();
    let mut from = 0;
    loop {
        let page = alice.get(&format!("{path}?limit=4&from={from}")).await.ok();
        paged.extend(event_ids(&page["changes"]));
        match page["next_from"].as_u64() {
            Some(n) => from = n,
            None => break,
        }
    }
    assert_eq!(paged, ids);
    alice
        .get(&format!("{path}?limit=abc"))
        .await
        .expect_err(400, "M_INVALID_PARAM");

    // The user audit: registration, the display name set with it, device, token
    // (never the token or its hash), where the device was first seen, and memberships.
    let user = alice
        .get(&format!(
            "/_spindle/admin/v1/audit/users/{}",
            enc(&bob.user_id)
        ))
        .await
        .ok();
    let kinds: Vec<&str> = user["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        vec![
            "account_registered",
            "profile_set",
            "device_created",
            "token_issued",
            "device_seen",
            "membership",
            "membership"
        ]
    );
    let text = user.to_string();
    let token = bob.token.clone().unwrap();
    assert!(!text.contains(&token));
    assert!(!text.contains("token_hash"), "{text}");
    assert!(!text.contains("password"), "{text}");
    assert!(!text.contains(&spindle_api::extract::token_hash(&token)));
    assert_eq!(user["entries"][6]["details"]["membership"], "join");
    assert_eq!(user["entries"][5]["by"], alice.user_id);

    // Projection status for admins: every projection ready, none behind the head. The
    // search index does not gate reads (SPEC §3); a search waits for it to catch up.
    alice
        .post(
            "/_matrix/client/v3/search",
            &json!({"search_categories": {"room_events": {"search_term": "x"}}}),
        )
        .await
        .ok();
    bob.get("/_spindle/admin/v1/projections")
        .await
        .expect_err(403, "M_FORBIDDEN");
    let status = alice.get("/_spindle/admin/v1/projections").await.ok();
    let head = status["head"].as_u64().unwrap();
    assert!(head >= 14, "{status}");
    assert_eq!(status["applied"], head);
    let list = status["projections"].as_array().unwrap();
    assert!(list.iter().any(|p| p["name"] == "audit"));
    for p in list {
        assert_eq!(p["ready"], true, "{p}");
        assert_eq!(p["lag"], 0, "{p}");
        assert_eq!(p["checkpoint"], head, "{p}");
    }
    ts.stop().await;
}

/// Runs the binary with a config for `data` (server name of the test server).
fn spindle(dir: &Path, data: &Path, args: &[&str]) -> (bool, String, String) {
    let config = dir.join("spindle.toml");
    std::fs::write(
        &config,
        format!(
            "server_name = \"{}\"\ndata_dir = \"{}\"\nlog = \"warn\"\n",
            common::SERVER_NAME,
            data.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(args)
        .arg("--config")
        .arg(&config)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// The CLI on a recorded journal: import it, print the room's audit (text and JSON),
/// promote an admin offline, and export the journal back.
#[test]
fn audit_verbs_read_an_imported_recorded_journal() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let recorded =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/journals/membership_and_power.jsonl");
    let (ok, out, err) = spindle(
        dir.path(),
        &data,
        &[
            "journal",
            "import",
            recorded.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
        ],
    );
    assert!(ok, "{out}{err}");
    let header: Value = serde_json::from_str(
        std::fs::read_to_string(&recorded)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let head = header["head"].as_u64().unwrap();
    assert!(out.contains(&format!("head {head}")), "{out}");

    // `spindle storage`: every keyspace of both databases, the journal's records
    // keyspace holding one item per record, and the totals.
    let (ok, report, err) = spindle(dir.path(), &data, &["storage"]);
    assert!(ok, "{err}");
    let rows: Vec<Vec<&str>> = report.lines().map(|l| l.split('\t').collect()).collect();
    let records = rows
        .iter()
        .find(|r| r[0] == "journal" && r[1] == "records")
        .unwrap_or_else(|| panic!("{report}"));
    assert_eq!(records[3], head.to_string(), "{report}");
    assert_eq!(rows.last().unwrap(), &vec!["records", &*head.to_string()]);
    let totals: Vec<&Vec<&str>> = rows.iter().filter(|r| r[0] == "total").collect();
    assert_eq!(totals.len(), 2, "{report}");
    // The journal is on disk; the projections are built at the first start, not yet.
    assert!(
        totals[0][1] == "journal" && totals[0][3].parse::<u64>().unwrap() > 0,
        "{report}"
    );
    assert_eq!(
        totals[1],
        &vec!["total", "projections", "0", "0"],
        "{report}"
    );

    // The room is the one whose create event comes first.
    let room = std::fs::read_to_string(&recorded)
        .unwrap()
        .lines()
        .find_map(|l| {
            let v: Value = serde_json::from_str(l).ok()?;
            (v["payload"]["type"] == "m.room.create")
                .then(|| v["room_id"].as_str().unwrap().to_owned())
        })
        .unwrap();
    let (ok, text, err) = spindle(dir.path(), &data, &["audit", "room", &room]);
    assert!(ok, "{err}");
    let (ok, json_lines, _) = spindle(dir.path(), &data, &["audit", "room", &room, "--json"]);
    assert!(ok);
    let changes: Vec<Value> = json_lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(text.lines().count(), changes.len());
    // create, alice join, power levels, join rules, history visibility, guest access,
    // name, bob join,
    // carol invite + join, dave join, leave, join, power levels, carol kicked, dave
    // banned, unbanned, power levels, carol join, bob leave.
    assert_eq!(changes.len(), 20, "{text}");
    let memberships: Vec<(&str, &str)> = changes
        .iter()
        .filter(|c| c["event_type"] == "m.room.member")
        .map(|c| {
            (
                c["state_key"].as_str().unwrap(),
                c["new"]["membership"].as_str().unwrap(),
            )
        })
        .collect();
    let (a, b, cr, d) = (uid("alice"), uid("bob"), uid("carol"), uid("dave"));
    assert_eq!(
        memberships,
        vec![
            (a.as_str(), "join"),
            (b.as_str(), "join"),
            (cr.as_str(), "invite"),
            (cr.as_str(), "join"),
            (d.as_str(), "join"),
            (d.as_str(), "leave"),
            (d.as_str(), "join"),
            (cr.as_str(), "leave"),
            (d.as_str(), "ban"),
            (d.as_str(), "leave"),
            (cr.as_str(), "join"),
            (b.as_str(), "leave"),
        ]
    );
    // The kick: sent by bob, reason kept, previous value carol's join.
    let kick = changes
        .iter()
        .find(|c| c["state_key"] == cr.as_str() && c["new"]["membership"] == "leave")
        .unwrap();
    assert_eq!(kick["sender"], b.as_str());
    assert_eq!(kick["new"]["reason"], "off topic");
    assert_eq!(kick["prev"]["content"]["membership"], "join");
    let (ok, pl, _) = spindle(
        dir.path(),
        &data,
        &[
            "audit",
            "room",
            &room,
            "--type",
            "m.room.power_levels",
            "--sender",
            &a,
        ],
    );
    assert!(ok);
    assert_eq!(pl.lines().count(), 3, "{pl}");
    assert!(
        pl.lines().nth(1).unwrap().contains(&format!("\"{b}\":50")),
        "{pl}"
    );

    // Offline promotion is a journal fact; unknown accounts are refused.
    let (ok, _, err) = spindle(dir.path(), &data, &["admin", "promote", &uid("nobody")]);
    assert!(!ok);
    assert!(err.contains("no such account"), "{err}");
    let (ok, out, err) = spindle(dir.path(), &data, &["admin", "promote", &b]);
    assert!(ok, "{err}");
    assert!(out.contains(&format!("position {}", head + 1)), "{out}");
    let (ok, user, _) = spindle(dir.path(), &data, &["audit", "user", &b]);
    assert!(ok);
    let last = user.lines().last().unwrap();
    assert!(last.starts_with(&format!("{}\t", head + 1)), "{user}");
    assert!(last.contains("\tadmin_promoted\t"), "{user}");
    let (ok, _, err) = spindle(dir.path(), &data, &["journal", "check"]);
    assert!(ok, "{err}");
}
