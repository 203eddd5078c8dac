//! Old room versions in the journal: a v1/v2 event carries its `$opaque:server` id in
//! its JSON and pairs each reference with the referenced event's reference hash, also
//! after a restart (the aggregate restores its head's hash from the log), and every
//! record passes `spindle journal check`'s deep check.

use std::sync::Arc;

use serde_json::json;
use spindle_core::{keys::ServerKey, pdu::Pdu};
use spindle_journal::{CommandBody, FjallStore, Journal, JournalStore, StoredRecord, chain};

mod common;

use common::{ALICE, signed, state};

async fn send(journal: &Journal, key: &ServerKey, room: &str, body: &str) -> String {
    journal
        .submit(signed(key, common::message(room, body, None)))
        .await
        .unwrap()
        .event_ids[0]
        .to_string()
}

fn events(store: &dyn JournalStore) -> Vec<Pdu> {
    store
        .read_raw_after(0, 1000)
        .unwrap()
        .into_iter()
        .filter_map(|(_, b)| {
            StoredRecord::from_bytes(&b)
                .unwrap()
                .pdu()
                .map(|p| (*p).clone())
        })
        .collect()
}

#[tokio::test]
async fn v1_and_v2_events_carry_ids_and_hashed_references_across_a_restart() {
    for version in ["1", "2"] {
        let dir = tempfile::tempdir().unwrap();
        let key = Arc::new(ServerKey::generate("example.org"));
        let room = {
            let store = Arc::new(FjallStore::open(dir.path()).unwrap());
            let journal = Journal::open(store, key.clone()).unwrap();
            let room = journal
                .submit(signed(
                    &key,
                    CommandBody::CreateRoom {
                        room_version: version.into(),
                        events: vec![
                            state(
                                "m.room.create",
                                "",
                                json!({ "room_version": version, "creator": ALICE }),
                            ),
                            state("m.room.member", ALICE, json!({ "membership": "join" })),
                            state(
                                "m.room.power_levels",
                                "",
                                json!({ "users": { ALICE: "100" }, "state_default": "50" }),
                            ),
                        ],
                        alias: None,
                    },
                ))
                .await
                .unwrap()
                .room_id
                .unwrap()
                .to_string();
            send(&journal, &key, &room, "before").await;
            room
        };
        // Restart: the aggregate is restored from the log, head hash included.
        let store = Arc::new(FjallStore::open(dir.path()).unwrap());
        let journal = Journal::open(store.clone(), key.clone()).unwrap();
        let after = send(&journal, &key, &room, "after").await;
        let pdus = events(&*store);
        assert_eq!(pdus.len(), 5, "v{version}");
        for (i, pdu) in pdus.iter().enumerate() {
            let json = pdu.federation_json();
            assert_eq!(json["event_id"], json!(pdu.event_id), "v{version}");
            assert!(
                pdu.event_id.as_str().ends_with(":example.org"),
                "v{version}: {}",
                pdu.event_id
            );
            if i == 0 {
                assert_eq!(json["prev_events"], json!([]));
                continue;
            }
            let prev = &pdus[i - 1];
            assert_eq!(
                json["prev_events"],
                json!([[prev.event_id, { "sha256": prev.reference_hash().unwrap() }]]),
                "v{version} event {i}"
            );
            for r in json["auth_events"].as_array().unwrap() {
                let id = r[0].as_str().unwrap();
                let target = pdus.iter().find(|p| p.event_id.as_str() == id).unwrap();
                assert_eq!(r[1], json!({ "sha256": target.reference_hash().unwrap() }));
            }
        }
        assert_eq!(pdus[4].event_id.as_str(), after);
        // Every record passes the deep check (ids, content hashes, signatures).
        let head = chain::walk(&*store, |r| {
            chain::deep_check(r, key.server_name(), &key.public_key_map())
        })
        .unwrap();
        assert_eq!(head.position, 5, "v{version}");
    }
}
