//! Recorded-journal snapshot tests (BRIEF §2: "snapshot-testing projections from
//! recorded journals").
//!
//! `tests/journals/*.jsonl` are small journals recorded from scripted scenarios
//! (`regenerate_recorded_journals` below). Each is imported into a fresh data
//! directory, every projection registered in the runtime replays it from position 0,
//! and each projection's rendering (`Projection::render`) is compared with its insta
//! snapshot in `tests/snapshots/`. A change in any projection's behaviour, and any new
//! projection, shows up here as a snapshot to review: see docs/testing.md
//! ("Snapshot tests") for how to review and accept (`cargo insta review`, or
//! `INSTA_UPDATE=always cargo test --test snapshots` then `git diff tests/snapshots`).

mod common;

use std::path::{Path, PathBuf};

use common::{TestServer, enc, txn, uid};
use serde_json::json;

fn journals_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/journals")
}

fn recorded_journals() -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(journals_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .map(|p| (p.file_stem().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_projection_replays_each_recorded_journal_to_its_snapshot() {
    let journals = recorded_journals();
    assert_eq!(
        journals.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        vec![
            "chatty_room",
            "edits_reactions_threads",
            "membership_and_power",
            "room_upgrade"
        ]
    );
    for (name, file) in journals {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let header = spindle_replay::export::import(&file, &data).unwrap();
        let replayed = spindle_replay::replay_offline(&data, &header.server_name)
            .await
            .unwrap();
        assert_eq!(replayed.journal.durable_head(), header.head);
        let renders = replayed.projections.runtime.renders();
        assert!(renders.len() >= 8, "every registered projection renders");
        for (projection, text) in renders {
            insta::assert_snapshot!(format!("{name}__{projection}"), text);
        }
        // Export is deterministic: the imported journal exports to the very same bytes.
        let mut again = Vec::new();
        spindle_replay::export::export(
            |after, limit| Ok(replayed.journal.read_after(after, limit)?),
            &header.server_name,
            header.signing_key.clone(),
            &mut again,
        )
        .unwrap();
        assert!(
            again == std::fs::read(&file).unwrap(),
            "{name}: re-export differs from the recorded file"
        );
    }
}

/// Regenerates `tests/journals/*.jsonl` from the scenarios below (new room ids, event
/// ids and timestamps each time, so every snapshot changes: review them as a whole).
/// `cargo test --test snapshots -- --ignored regenerate_recorded_journals`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "rewrites tests/journals; run by hand"]
async fn regenerate_recorded_journals() {
    record("chatty_room", chatty_room).await;
    record("membership_and_power", membership_and_power).await;
    record("edits_reactions_threads", edits_reactions_threads).await;
    record("room_upgrade", room_upgrade).await;
}

async fn record<F, Fut>(name: &str, scenario: F)
where
    F: FnOnce(TestServer) -> Fut,
    Fut: std::future::Future<Output = TestServer>,
{
    let ts = TestServer::start().await;
    let ts = scenario(ts).await;
    let journal = ts.server.journal.clone();
    let key = journal.key().clone();
    let mut out = Vec::new();
    spindle_replay::export::export(
        |after, limit| Ok(journal.read_after(after, limit)?),
        key.server_name(),
        spindle_replay::export::SigningKey {
            key_id: key.key_id(),
            public_key: key.public_key_base64(),
        },
        &mut out,
    )
    .unwrap();
    std::fs::write(journals_dir().join(format!("{name}.jsonl")), out).unwrap();
    ts.stop().await;
}

/// Two users chatting: 24 messages, receipts, a topic and name, a profile change,
/// account data and a filter.
async fn chatty_room(ts: TestServer) -> TestServer {
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice
        .create_room(json!({ "name": "Chatty", "topic": "small talk", "preset": "public_chat" }))
        .await;
    bob.join(&room).await;
    let mut last = String::new();
    for i in 0..24 {
        let who = if i % 3 == 0 { &bob } else { &alice };
        last = who.send_text(&room, &format!("message {i}")).await;
    }
    bob.post(
        &format!(
            "/_matrix/client/v3/rooms/{}/receipt/m.read/{}",
            enc(&room),
            enc(&last)
        ),
        &json!({}),
    )
    .await
    .ok();
    alice
        .put(
            &format!(
                "/_matrix/client/v3/profile/{}/displayname",
                enc(&alice.user_id)
            ),
            &json!({ "displayname": "Alice A." }),
        )
        .await
        .ok();
    alice
        .put(
            &format!(
                "/_matrix/client/v3/user/{}/account_data/m.direct",
                enc(&alice.user_id)
            ),
            &json!({ uid("bob"): [room.clone()] }),
        )
        .await
        .ok();
    bob.post(
        &format!("/_matrix/client/v3/user/{}/filter", enc(&bob.user_id)),
        &json!({ "room": { "timeline": { "limit": 10 } } }),
    )
    .await
    .ok();
    alice
        .put_state(
            &room,
            "m.room.topic",
            "",
            json!({ "topic": "smaller talk" }),
        )
        .await;
    ts
}

/// Joins, leaves, an invite, a kick, a ban and an unban, and power-level changes.
async fn membership_and_power(ts: TestServer) -> TestServer {
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let carol = ts.register("carol").await;
    let dave = ts.register("dave").await;
    let room = alice
        .create_room(json!({ "name": "Moderated", "preset": "public_chat" }))
        .await;
    bob.join(&room).await;
    alice.invite(&room, &carol.user_id).await;
    carol.join(&room).await;
    dave.join(&room).await;
    dave.send_text(&room, "hello all").await;
    dave.leave(&room).await;
    dave.join(&room).await;
    let pl = alice
        .get(&format!(
            "/_matrix/client/v3/rooms/{}/state/m.room.power_levels",
            enc(&room)
        ))
        .await
        .ok();
    let mut raised = pl.clone();
    raised["users"][&bob.user_id] = json!(50);
    raised["kick"] = json!(50);
    alice
        .put_state(&room, "m.room.power_levels", "", raised.clone())
        .await;
    bob.post(
        &format!("/_matrix/client/v3/rooms/{}/kick", enc(&room)),
        &json!({ "user_id": carol.user_id, "reason": "off topic" }),
    )
    .await
    .ok();
    alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/ban", enc(&room)),
            &json!({ "user_id": dave.user_id, "reason": "spam" }),
        )
        .await
        .ok();
    alice
        .post(
            &format!("/_matrix/client/v3/rooms/{}/unban", enc(&room)),
            &json!({ "user_id": dave.user_id }),
        )
        .await
        .ok();
    let mut lowered = raised;
    lowered["users"][&bob.user_id] = json!(0);
    alice
        .put_state(&room, "m.room.power_levels", "", lowered)
        .await;
    carol.join(&room).await;
    bob.leave(&room).await;
    ts
}

/// Edits, reactions, a thread and redactions, as plain events with `m.relates_to`.
async fn edits_reactions_threads(ts: TestServer) -> TestServer {
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let room = alice.create_room(json!({ "preset": "public_chat" })).await;
    bob.join(&room).await;
    let root = alice.send_text(&room, "thread root").await;
    let typo = bob.send_text(&room, "helo").await;
    let send = |c: &common::Client, kind: &'static str, content: serde_json::Value| {
        let (c, room) = (c.clone(), room.clone());
        async move {
            c.send_txn(&room, kind, &txn(), &content).await.ok()["event_id"]
                .as_str()
                .unwrap()
                .to_owned()
        }
    };
    send(
        &bob,
        "m.room.message",
        json!({
            "msgtype": "m.text", "body": "* hello",
            "m.new_content": { "msgtype": "m.text", "body": "hello" },
            "m.relates_to": { "rel_type": "m.replace", "event_id": typo },
        }),
    )
    .await;
    let reaction = send(
        &alice,
        "m.reaction",
        json!({
            "m.relates_to": { "rel_type": "m.annotation", "event_id": typo, "key": "👍" },
        }),
    )
    .await;
    send(
        &bob,
        "m.reaction",
        json!({
            "m.relates_to": { "rel_type": "m.annotation", "event_id": root, "key": "🎉" },
        }),
    )
    .await;
    for i in 0..3 {
        let who = if i % 2 == 0 { &bob } else { &alice };
        send(
            who,
            "m.room.message",
            json!({
                "msgtype": "m.text", "body": format!("in thread {i}"),
                "m.relates_to": { "rel_type": "m.thread", "event_id": root, "is_falling_back": true,
                                  "m.in_reply_to": { "event_id": root } },
            }),
        )
        .await;
    }
    let oops = alice.send_text(&room, "wrong room, sorry").await;
    for target in [&oops, &reaction] {
        alice
            .put(
                &format!(
                    "/_matrix/client/v3/rooms/{}/redact/{}/{}",
                    enc(&room),
                    enc(target),
                    txn()
                ),
                &json!({ "reason": "mistake" }),
            )
            .await
            .ok();
    }
    ts
}

/// A room upgrade done by hand (no upgrade endpoint yet): the new room names its
/// predecessor, the old room gets an `m.room.tombstone`, the alias moves, members follow.
async fn room_upgrade(ts: TestServer) -> TestServer {
    let alice = ts.register("alice").await;
    let bob = ts.register("bob").await;
    let old = alice
        .create_room(
            json!({ "room_alias_name": "lobby", "name": "Lobby", "preset": "public_chat" }),
        )
        .await;
    bob.join(&old).await;
    let last = bob.send_text(&old, "see you in the new room").await;
    let new = alice
        .create_room(json!({
            "name": "Lobby",
            "preset": "public_chat",
            "room_version": "11",
            "creation_content": { "predecessor": { "room_id": old, "event_id": last } },
        }))
        .await;
    alice
        .put_state(
            &old,
            "m.room.tombstone",
            "",
            json!({ "body": "This room has been replaced", "replacement_room": new }),
        )
        .await;
    let alias = format!("#lobby:{}", common::SERVER_NAME);
    alice
        .request(
            reqwest::Method::DELETE,
            &format!("/_matrix/client/v3/directory/room/{}", enc(&alias)),
            None,
        )
        .await
        .ok();
    alice
        .put(
            &format!("/_matrix/client/v3/directory/room/{}", enc(&alias)),
            &json!({ "room_id": new }),
        )
        .await
        .ok();
    bob.join(&new).await;
    bob.leave(&old).await;
    bob.send_text(&new, "made it").await;
    ts
}
