//! Tamper evidence and torn tails: the hash chain links every record, a changed
//! record is named by position, a torn tail is truncated at start-up, corruption in
//! the middle refuses to start, and a format-1 journal is refused and migrated.

use std::{collections::BTreeMap, sync::Arc};

use parking_lot::Mutex;
use serde_json::json;
use spindle_core::keys::ServerKey;
use spindle_journal::{
    BreakKind, CommandBody, EncodedRecord, EventSpec, Fact, FjallStore, GENESIS_HASH, Journal,
    JournalStore, Record, StoredRecord, chain, record::v1::RecordV1, record_hash,
};

mod common;

use common::{ALICE, signed};

/// An in-memory store the tests can tamper with.
#[derive(Default)]
struct MemStore {
    rows: Mutex<BTreeMap<u64, Vec<u8>>>,
}

impl JournalStore for MemStore {
    fn append(&self, records: &[EncodedRecord]) -> Result<(), String> {
        let mut rows = self.rows.lock();
        for r in records {
            rows.insert(r.position, r.bytes.clone());
        }
        Ok(())
    }
    fn read_raw_after(&self, after: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, String> {
        Ok(self
            .rows
            .lock()
            .range(after + 1..)
            .take(limit)
            .map(|(k, v)| (*k, v.clone()))
            .collect())
    }
    fn room_positions(&self, _: &str, _: u64, _: usize) -> Result<Vec<u64>, String> {
        Ok(vec![])
    }
    fn truncate_from(&self, position: u64) -> Result<(), String> {
        self.rows.lock().retain(|k, _| *k < position);
        Ok(())
    }
}

impl MemStore {
    fn record(&self, position: u64) -> Record {
        let bytes = self.rows.lock()[&position].clone();
        StoredRecord::from_bytes(&bytes).unwrap().to_record()
    }
    fn put(&self, position: u64, bytes: Vec<u8>) {
        self.rows.lock().insert(position, bytes);
    }
}

/// Appends 1 registration, a room (create + join) and `messages` messages: 3 + messages records.
/// (After a restart, `fill` again appends 1 token fact + 2 room events.)
async fn fill(journal: &Journal, key: &ServerKey, messages: usize) -> String {
    let fact = if journal.durable_head() == 0 {
        Fact::AccountRegistered {
            user_id: ALICE.into(),
            password_hash: None,
            guest: false,
        }
    } else {
        Fact::TokenRevoked {
            token_hash: "h".into(),
        }
    };
    journal
        .submit(signed(key, CommandBody::Fact { fact }))
        .await
        .unwrap();
    let spec = |kind: &str, sk: &str, content| EventSpec {
        kind: kind.into(),
        state_key: Some(sk.into()),
        content,
        redacts: None,
    };
    let room = journal
        .submit(signed(
            key,
            CommandBody::CreateRoom {
                room_version: "11".into(),
                events: vec![
                    spec("m.room.create", "", json!({ "room_version": "11" })),
                    spec("m.room.member", ALICE, json!({ "membership": "join" })),
                ],
                alias: None,
            },
        ))
        .await
        .unwrap()
        .room_id
        .unwrap()
        .to_string();
    for i in 0..messages {
        journal
            .submit(signed(
                key,
                CommandBody::SendEvent {
                    room_id: room.clone(),
                    event: EventSpec {
                        kind: "m.room.message".into(),
                        state_key: None,
                        content: json!({ "msgtype": "m.text", "body": format!("m{i}") }),
                        redacts: None,
                    },
                    txn_id: None,
                    precondition: None,
                },
            ))
            .await
            .unwrap();
    }
    room
}

async fn filled(messages: usize) -> (Arc<MemStore>, Arc<ServerKey>) {
    let store = Arc::new(MemStore::default());
    let key = Arc::new(ServerKey::generate("example.org"));
    let journal = Journal::open(store.clone(), key.clone()).unwrap();
    fill(&journal, &key, messages).await;
    (store, key)
}

#[tokio::test]
async fn every_record_carries_the_previous_records_hash() {
    let (store, key) = filled(4).await;
    let rows = store.read_raw_after(0, 100).unwrap();
    assert_eq!(rows.len(), 7);
    let mut prev = GENESIS_HASH;
    for (pos, bytes) in &rows {
        let rec = StoredRecord::from_bytes(bytes).unwrap();
        assert_eq!(rec.position(), *pos);
        assert_eq!(rec.prev_hash(), prev, "position {pos}");
        prev = record_hash(bytes);
    }
    let head = chain::walk(&*store, |r| {
        chain::deep_check(r, key.server_name(), &key.public_key_map())
    })
    .unwrap();
    assert_eq!(head.position, 7);
    assert_eq!(head.hash, prev);
    // Reopening continues the chain.
    let journal = Journal::open(store.clone(), key.clone()).unwrap();
    fill(&journal, &key, 0).await;
    let rec8 = store.record(8);
    assert_eq!(rec8.prev_hash, prev);
    assert_eq!(chain::walk(&*store, |_| Ok(())).unwrap().position, 10);
}

#[tokio::test]
async fn a_changed_record_breaks_the_chain_at_the_next_position_and_refuses_to_start() {
    let (store, key) = filled(4).await;
    // Position 5 is the second message; change its body but keep its chain link.
    let mut rec = store.record(5);
    let text = String::from_utf8(rec.payload.clone()).unwrap();
    assert!(text.contains("\"m1\""));
    rec.payload = text.replace("\"m1\"", "\"forged\"").into_bytes();
    store.put(5, rec.encode());
    let brk = chain::walk(&*store, |_| Ok(())).unwrap_err();
    assert_eq!(brk.position, 6);
    assert_eq!(brk.kind, BreakKind::PrevHash);
    assert_eq!(brk.good.position, 5);
    // The deep check names the changed record itself: its content hash no longer
    // matches (a message's content is outside its reference hash, the hash is not).
    let brk = chain::walk(&*store, |r| {
        chain::deep_check(r, key.server_name(), &key.public_key_map())
    })
    .unwrap_err();
    assert_eq!(brk.position, 5);
    assert!(
        matches!(brk.kind, BreakKind::Content(ref m) if m.contains("content hash")),
        "{brk}"
    );
    // Start-up refuses: this is tampering, not a torn write.
    let err = Journal::open(store.clone(), key.clone())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("position 6"), "{err}");
    assert!(err.contains("refusing to start"), "{err}");
    assert_eq!(store.rows.lock().len(), 7, "nothing was truncated");
}

#[tokio::test]
async fn removed_and_reordered_records_are_named() {
    let (store, _) = filled(3).await;
    let four = store.rows.lock().remove(&4).unwrap();
    let brk = chain::walk(&*store, |_| Ok(())).unwrap_err();
    assert_eq!(brk.position, 5);
    assert_eq!(
        brk.kind,
        BreakKind::Position {
            expected: 4,
            found: 5
        }
    );
    // Swapping two records' bytes: the record under key 4 says position 5.
    let five = store.rows.lock()[&5].clone();
    store.put(4, five);
    store.put(5, four);
    let brk = chain::walk(&*store, |_| Ok(())).unwrap_err();
    assert_eq!(brk.position, 4);
    assert_eq!(
        brk.kind,
        BreakKind::Position {
            expected: 4,
            found: 5
        }
    );
}

#[tokio::test]
async fn torn_tail_is_truncated_on_start() {
    let (store, key) = filled(2).await;
    let good = chain::walk(&*store, |_| Ok(())).unwrap();
    assert_eq!(good.position, 5);
    // A write that never completed: the first half of what would have been record 6.
    let mut next = store.record(5);
    next.position = 6;
    next.prev_hash = good.hash;
    let bytes = next.encode();
    store.put(6, bytes[..bytes.len() / 2].to_vec());
    let journal = Journal::open(store.clone(), key.clone()).unwrap();
    assert_eq!(journal.durable_head(), 5);
    assert_eq!(store.rows.lock().len(), 5, "the torn record is gone");
    // The chain continues from the last good record.
    fill(&journal, &key, 0).await;
    assert_eq!(store.record(6).prev_hash, good.hash);
    assert_eq!(chain::walk(&*store, |_| Ok(())).unwrap().position, 8);
}

#[tokio::test]
async fn an_unreadable_record_followed_by_good_ones_refuses_to_start() {
    let (store, key) = filled(3).await;
    store.put(3, b"not a record".to_vec());
    let err = Journal::open(store.clone(), key.clone())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("position 3"), "{err}");
    assert!(err.contains("unreadable"), "{err}");
    assert_eq!(store.rows.lock().len(), 6);
}

/// What fjall can actually leave behind after a crash: its write-ahead journal is
/// append-only with a start marker, items and a checksummed end marker per batch; on
/// recovery an unterminated last batch is discarded (truncated), so one of our
/// group-commit batches is either entirely there or entirely absent. Cutting bytes off
/// the end of fjall's journal file reproduces a write torn mid-batch.
#[test]
fn fjall_discards_a_batch_torn_mid_write() {
    let dir = tempfile::tempdir().unwrap();
    let key = ServerKey::generate("example.org");
    let mut prev = GENESIS_HASH;
    let mut encoded = |position: u64| {
        let rec = Record {
            format: spindle_journal::RECORD_FORMAT,
            position,
            prev_hash: prev,
            appended_at: position,
            kind: spindle_journal::RecordKind::Fact,
            room_id: Some("!r:example.org".into()),
            event_id: None,
            room_version: None,
            principal: ALICE.into(),
            device_id: None,
            txn_id: None,
            command_signature: key.sign_bytes(b"x"),
            payload: serde_json::to_vec(&Fact::TokenRevoked {
                token_hash: format!("{position}"),
            })
            .unwrap(),
        };
        let bytes = rec.encode();
        prev = record_hash(&bytes);
        EncodedRecord {
            position,
            room_id: rec.room_id,
            bytes,
            txn_key: None,
        }
    };
    let batches: Vec<Vec<EncodedRecord>> = vec![
        (1..=3).map(&mut encoded).collect(),
        (4..=6).map(&mut encoded).collect(),
        (7..=9).map(&mut encoded).collect(),
    ];
    {
        let store = FjallStore::open(dir.path()).unwrap();
        for b in &batches {
            store.append(b).unwrap();
        }
    }
    // The newest write-ahead journal file (fjall names them `<n>.jnl`).
    let mut journals: Vec<(u64, std::path::PathBuf)> = walk_files(dir.path())
        .into_iter()
        .filter_map(|p| {
            let n = p
                .file_name()?
                .to_str()?
                .strip_suffix(".jnl")?
                .parse()
                .ok()?;
            Some((n, p))
        })
        .collect();
    journals.sort();
    let (_, wal) = journals.pop().expect("a fjall journal file");
    // fjall preallocates its journal files (zeros after the data), so a write torn
    // mid-batch looks like the batch's last bytes never reached the disk: zero them.
    let mut bytes = std::fs::read(&wal).unwrap();
    let end = bytes.iter().rposition(|b| *b != 0).unwrap() + 1;
    bytes[end - 5..end].fill(0);
    std::fs::write(&wal, &bytes).unwrap();

    let store = FjallStore::open(dir.path()).unwrap();
    let head = chain::walk(&store, |_| Ok(())).unwrap();
    assert_eq!(head.position, 6, "the torn third batch is gone, whole");
    assert_eq!(head.hash, record_hash(&batches[1][2].bytes));
    assert_eq!(
        store.room_positions("!r:example.org", 0, 100).unwrap(),
        vec![1, 2, 3, 4, 5, 6]
    );
}

fn walk_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk_files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_format_1_journal_is_refused_with_a_way_forward_and_migrates() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("journal");
    {
        // A format-1 journal: old envelopes, no format marker.
        let db = fjall::Database::builder(&dir).open().unwrap();
        let records = db
            .keyspace("records", fjall::KeyspaceCreateOptions::default)
            .unwrap();
        for pos in 1..=3u64 {
            let old = RecordV1 {
                format: 1,
                position: pos,
                appended_at: pos,
                kind: spindle_journal::RecordKind::Fact,
                room_id: None,
                event_id: None,
                room_version: None,
                principal: ALICE.into(),
                device_id: None,
                txn_id: None,
                command_signature: "sig".into(),
                payload: serde_json::to_vec(&Fact::TokenRevoked {
                    token_hash: format!("h{pos}"),
                })
                .unwrap(),
            };
            records
                .insert(
                    pos.to_be_bytes(),
                    rkyv::to_bytes::<rkyv::rancor::Error>(&old)
                        .unwrap()
                        .to_vec(),
                )
                .unwrap();
        }
        db.persist(fjall::PersistMode::SyncAll).unwrap();
    }
    let err = FjallStore::open(&dir).err().unwrap();
    assert!(err.contains("record format 1"), "{err}");
    assert!(err.contains("spindle journal migrate"), "{err}");

    let done = spindle_journal::migrate::migrate_format1(&dir).unwrap();
    assert_eq!(done.records, 3);
    assert_eq!(done.kept, root.path().join("journal.format1"));
    let store = FjallStore::open(&dir).unwrap();
    let head = chain::walk(&store, |_| Ok(())).unwrap();
    assert_eq!(head, done.head);
    assert_eq!(head.position, 3);
    let recs = store.read_after(0, 10).unwrap();
    assert_eq!(
        recs[2].fact(),
        Some(Fact::TokenRevoked {
            token_hash: "h3".into()
        })
    );
    // Migrating again says there is nothing to do.
    drop(store);
    let again = spindle_journal::migrate::migrate_format1(&dir).unwrap_err();
    assert!(again.contains("nothing to migrate"), "{again}");
}
