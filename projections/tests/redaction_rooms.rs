//! A redaction counts only for an event of its own room (spec "Redactions": the
//! redaction names its target by event id, and a target in another room is not
//! redacted). The relations and search projections used to apply a redaction to any
//! event id they held; these records come straight from the journal, as a federated
//! redaction would (the client API refuses such a redaction before it is written).
//! Also: the search index is part of the search projection's digest (its rows left
//! the fjall tables in layout 2), so a rebuild is compared on what the index holds.

mod common;

use std::{sync::Arc, time::Duration};

use common::cmd;
use serde_json::json;
use spindle_core::keys::ServerKey;
use spindle_journal::{CommandBody, EventSpec, FjallStore, Journal};
use spindle_projections::{Projections, relations::ThreadSummary};

fn ev(kind: &str, content: serde_json::Value, redacts: Option<&str>) -> EventSpec {
    EventSpec {
        kind: kind.into(),
        state_key: None,
        content,
        redacts: redacts.map(str::to_owned),
    }
}

async fn create_room(journal: &Journal, key: &ServerKey, alice: &str) -> String {
    let state = |kind: &str, sk: &str, content: serde_json::Value| EventSpec {
        kind: kind.into(),
        state_key: Some(sk.into()),
        content,
        redacts: None,
    };
    let created = journal
        .submit(cmd(
            key,
            alice,
            CommandBody::CreateRoom {
                room_version: "11".into(),
                events: vec![
                    state("m.room.create", "", json!({ "room_version": "11" })),
                    state("m.room.member", alice, json!({ "membership": "join" })),
                    state(
                        "m.room.power_levels",
                        "",
                        json!({ "users": { alice: 100 } }),
                    ),
                ],
                alias: None,
            },
        ))
        .await
        .unwrap();
    created.room_id.unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redaction_in_another_room_redacts_nothing_in_relations_or_search() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let store = FjallStore::open(&dir.path().join("journal")).unwrap();
    let journal = Journal::open(Arc::new(store), key.clone()).unwrap();
    let live = Projections::start(&dir.path().join("live"), journal.clone()).unwrap();
    let alice = "@alice:example.org";
    let room_a = create_room(&journal, &key, alice).await;
    let room_b = create_room(&journal, &key, alice).await;
    let send = |room: &str, spec: EventSpec| {
        let c = cmd(
            &key,
            alice,
            CommandBody::SendEvent {
                room_id: room.to_owned(),
                event: spec,
                txn_id: None,
                precondition: None,
            },
        );
        let journal = journal.clone();
        async move {
            let out = journal.submit(c).await.unwrap();
            (out.event_ids[0].to_string(), out.position)
        }
    };
    let (root, _) = send(
        &room_a,
        ev(
            "m.room.message",
            json!({ "msgtype": "m.text", "body": "lighthouse" }),
            None,
        ),
    )
    .await;
    let (reply, reply_pos) = send(
        &room_a,
        ev(
            "m.room.message",
            json!({
                "msgtype": "m.text",
                "body": "keeper",
                "m.relates_to": { "rel_type": "m.thread", "event_id": root },
            }),
            None,
        ),
    )
    .await;
    // Room B names both of room A's events.
    for target in [&root, &reply] {
        send(&room_b, ev("m.room.redaction", json!({}), Some(target))).await;
    }
    let head = journal.durable_head();
    assert!(
        live.runtime
            .wait_for_all(head, Duration::from_secs(10))
            .await
    );

    let thread = |p: &Projections| p.relations.aggregation(&root).and_then(|a| a.thread);
    assert_eq!(
        thread(&live),
        Some(ThreadSummary {
            count: 1,
            latest_event_id: reply.clone(),
            latest_position: reply_pos,
        })
    );
    let mut indexed: Vec<String> = live
        .search
        .indexed()
        .unwrap()
        .into_iter()
        .map(|d| {
            assert_eq!(d.room_id, room_a);
            d.event_id
        })
        .collect();
    let mut want = vec![root.clone(), reply.clone()];
    want.sort();
    indexed.sort();
    assert_eq!(indexed, want);

    // The same redactions in room A do redact: the thread is gone, so is the root's text.
    for target in [&reply, &root] {
        send(&room_a, ev("m.room.redaction", json!({}), Some(target))).await;
    }
    let head = journal.durable_head();
    assert!(
        live.runtime
            .wait_for_all(head, Duration::from_secs(10))
            .await
    );
    assert_eq!(thread(&live), None);
    assert_eq!(live.relations.threads(&room_a, u64::MAX, 10), vec![]);
    assert_eq!(live.search.indexed().unwrap(), vec![]);

    // A rebuild from position 0 agrees, the search index included in its digest.
    let rebuilt = Projections::start(&dir.path().join("rebuilt"), journal.clone()).unwrap();
    assert!(
        rebuilt
            .runtime
            .wait_for_all(head, Duration::from_secs(10))
            .await
    );
    assert_eq!(live.runtime.digests(), rebuilt.runtime.digests());
    assert_eq!(thread(&rebuilt), None);
}
