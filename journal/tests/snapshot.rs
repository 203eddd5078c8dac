//! Write-model snapshots (issue 17 item 3): a restart reads only the records after the
//! last snapshot, restores the same write models as a full replay (fork windows
//! included), verifies the chain from the snapshot's checkpoint, and ignores a snapshot
//! it cannot use.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use parking_lot::Mutex;
use serde_json::json;
use spindle_core::{keys::ServerKey, pdu::PduTemplate};
use spindle_journal::{
    BreakKind, CommandBody, EncodedRecord, EventSpec, Fact, FjallStore, Journal, JournalOptions,
    JournalStore, SignedCommand, StoredRecord, chain, remote::VerifyKeys,
};

mod common;

use common::ALICE;

/// `body` as `principal`'s command, from device `DEV`.
fn signed(key: &ServerKey, principal: &str, body: CommandBody) -> SignedCommand {
    common::signed_by(key, principal, Some("DEV"), body)
}

const BOB: &str = "@bob:remote.org";

/// The fjall store, counting the records read through it, with records the test can
/// overwrite (tampering) without touching the chain's own bytes on disk.
struct CountingStore {
    inner: FjallStore,
    read: AtomicU64,
    tampered: Mutex<BTreeMap<u64, Vec<u8>>>,
}

impl CountingStore {
    fn open(dir: &Path) -> Arc<CountingStore> {
        Arc::new(CountingStore {
            inner: FjallStore::open(dir).unwrap(),
            read: AtomicU64::new(0),
            tampered: Mutex::new(BTreeMap::new()),
        })
    }

    fn reads(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }
}

impl JournalStore for CountingStore {
    fn append(&self, records: &[EncodedRecord]) -> Result<(), String> {
        self.inner.append(records)
    }
    fn read_raw_after(&self, after: u64, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, String> {
        let mut rows = self.inner.read_raw_after(after, limit)?;
        let tampered = self.tampered.lock();
        for (p, b) in &mut rows {
            if let Some(t) = tampered.get(p) {
                *b = t.clone();
            }
        }
        self.read.fetch_add(rows.len() as u64, Ordering::Relaxed);
        Ok(rows)
    }
    fn room_positions(&self, room: &str, after: u64, limit: usize) -> Result<Vec<u64>, String> {
        self.inner.room_positions(room, after, limit)
    }
    fn truncate_from(&self, position: u64) -> Result<(), String> {
        self.inner.truncate_from(position)
    }
    fn last_position(&self) -> Result<u64, String> {
        self.inner.last_position()
    }
    fn load_snapshot(&self) -> Result<Option<Vec<u8>>, String> {
        self.inner.load_snapshot()
    }
    fn save_snapshot(&self, bytes: &[u8]) -> Result<(), String> {
        self.inner.save_snapshot(bytes)
    }
    fn delete_snapshot(&self) -> Result<(), String> {
        self.inner.delete_snapshot()
    }
    fn txn_position(&self, key: &[u8]) -> Result<Option<u64>, String> {
        self.inner.txn_position(key)
    }
    fn index_txns(&self, entries: &[(Vec<u8>, u64)]) -> Result<(), String> {
        self.inner.index_txns(entries)
    }
}

fn options(snapshot_every_records: u64) -> JournalOptions {
    JournalOptions {
        snapshot_every_records,
        ..JournalOptions::default()
    }
}

fn open(store: &Arc<CountingStore>, key: &Arc<ServerKey>, every: u64) -> Journal {
    Journal::open_with(store.clone(), key.clone(), options(every)).unwrap()
}

fn restored(j: &Journal) -> u64 {
    j.stats().restored.load(Ordering::Relaxed)
}

fn message(room: &str, i: usize, txn: Option<String>) -> CommandBody {
    CommandBody::SendEvent {
        room_id: room.into(),
        event: EventSpec {
            kind: "m.room.message".into(),
            state_key: None,
            content: json!({ "msgtype": "m.text", "body": format!("m{i}") }),
            redacts: None,
        },
        txn_id: txn,
        precondition: None,
    }
}

fn state(kind: &str, key: &str, content: serde_json::Value) -> EventSpec {
    EventSpec {
        kind: kind.into(),
        state_key: Some(key.into()),
        content,
        redacts: None,
    }
}

/// A registration and a room (create + join): 3 records.
async fn room(journal: &Journal, key: &ServerKey) -> String {
    journal
        .submit(signed(
            key,
            ALICE,
            CommandBody::Fact {
                fact: Fact::AccountRegistered {
                    user_id: ALICE.into(),
                    password_hash: None,
                    guest: false,
                },
            },
        ))
        .await
        .unwrap();
    journal
        .submit(signed(
            key,
            ALICE,
            CommandBody::CreateRoom {
                room_version: "11".into(),
                events: vec![
                    state("m.room.create", "", json!({ "room_version": "11" })),
                    state("m.room.member", ALICE, json!({ "membership": "join" })),
                ],
                alias: None,
            },
        ))
        .await
        .unwrap()
        .room_id
        .unwrap()
        .to_string()
}

async fn send(
    journal: &Journal,
    key: &ServerKey,
    room: &str,
    from: usize,
    n: usize,
) -> Vec<String> {
    let mut ids = Vec::new();
    for i in from..from + n {
        let o = journal
            .submit(signed(key, ALICE, message(room, i, Some(format!("t{i}")))))
            .await
            .unwrap();
        ids.push(o.event_ids[0].to_string());
    }
    ids
}

#[tokio::test]
async fn restart_reads_only_the_records_after_the_last_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let (room, first_ids) = {
        let store = CountingStore::open(dir.path());
        let j = open(&store, &key, 1000);
        let room = room(&j, &key).await;
        let ids = send(&j, &key, &room, 0, 97).await;
        assert_eq!(j.durable_head(), 100);
        assert_eq!(j.stats().snapshots_saved.load(Ordering::Relaxed), 0);
        drop(j);
        close(store).await;
        (room, ids)
    };
    // First restart: no snapshot yet, all 100 records read and replayed; 100 >= 50
    // saves one at 100.
    {
        let store = CountingStore::open(dir.path());
        let j = open(&store, &key, 50);
        assert_eq!(restored(&j), 100);
        assert_eq!(store.reads(), 100);
        assert_eq!(j.stats().snapshots_saved.load(Ordering::Relaxed), 1);
        // 7 more: fewer than 50 since the snapshot, so no background snapshot.
        send(&j, &key, &room, 97, 7).await;
        assert_eq!(j.durable_head(), 107);
        drop(j);
        close(store).await;
    }
    // Second restart: the store gives the checkpoint record (to check its hash) and the
    // 7 records after it, nothing else.
    let store = CountingStore::open(dir.path());
    let j = open(&store, &key, 50);
    assert_eq!(restored(&j), 7);
    assert_eq!(store.reads(), 1 + 7);
    assert_eq!(j.durable_head(), 107);
    assert_eq!(j.stats().snapshots_saved.load(Ordering::Relaxed), 0);
    // The restored aggregate is the room's: the next event chains on the head, a
    // retried transaction id from before the snapshot answers its old event, and the
    // account registered before the snapshot is still taken.
    let again = j
        .submit(signed(&key, ALICE, message(&room, 5, Some("t5".into()))))
        .await
        .unwrap();
    assert_eq!(again.event_ids[0].to_string(), first_ids[5]);
    let next = j
        .submit(signed(&key, ALICE, message(&room, 200, None)))
        .await
        .unwrap();
    assert_eq!(next.position, 108);
    let rec = j.read_after(107, 1).unwrap().remove(0);
    let prev = j.read_after(106, 1).unwrap().remove(0);
    let pdu = rec.pdu().unwrap();
    assert_eq!(pdu.prev_events, vec![prev.pdu().unwrap().event_id.clone()]);
    assert_eq!(pdu.depth, prev.pdu().unwrap().depth + 1);
    let dup = j
        .submit(signed(
            &key,
            ALICE,
            CommandBody::Fact {
                fact: Fact::AccountRegistered {
                    user_id: ALICE.into(),
                    password_hash: None,
                    guest: false,
                },
            },
        ))
        .await;
    assert!(
        dup.is_err(),
        "the registration before the snapshot is remembered"
    );
}

/// The write-model digest of the journal in `dir` replayed from position 0 (the
/// snapshot deleted first), with the records it replayed.
async fn full_replay_digest(dir: &Path, key: &Arc<ServerKey>) -> (String, u64) {
    let store = CountingStore::open(dir);
    store.delete_snapshot().unwrap();
    let j = open(&store, key, 0);
    let digest = j.write_model_digest().await;
    let n = restored(&j);
    drop(j);
    close(store).await;
    (digest, n)
}

/// Drops the last handle on a store once the journal's threads (appender, background
/// snapshot) have let theirs go, so the directory can be opened again.
async fn close(store: Arc<CountingStore>) {
    for _ in 0..500 {
        if Arc::strong_count(&store) == 1 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the journal's threads still hold the store");
}

#[tokio::test]
async fn a_background_snapshot_while_serving_bounds_the_next_restart() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let digest = {
        let store = CountingStore::open(dir.path());
        let j = open(&store, &key, 40);
        let room = room(&j, &key).await;
        send(&j, &key, &room, 0, 60).await;
        // The appender started one snapshot once 40 records were durable; wait for it.
        for _ in 0..500 {
            if j.stats().snapshots_saved.load(Ordering::Relaxed) >= 1 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(j.stats().snapshots_saved.load(Ordering::Relaxed), 1);
        assert_eq!(j.durable_head(), 63);
        let digest = j.write_model_digest().await;
        drop(j);
        close(store).await;
        digest
    };
    let store = CountingStore::open(dir.path());
    let j = open(&store, &key, 1000);
    // One message at a time: the batch that reached 40 was record 40 alone, so the
    // snapshot is at 40 and the restart replays the 23 records after it.
    assert_eq!(restored(&j), 23);
    assert_eq!(store.reads(), 1 + 23);
    assert_eq!(j.write_model_digest().await, digest);
    drop(j);
    close(store).await;
    let (full, all) = full_replay_digest(dir.path(), &key).await;
    assert_eq!(all, 63);
    assert_eq!(full, digest);
}

#[tokio::test]
async fn an_unusable_snapshot_is_ignored_and_the_journal_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let store = CountingStore::open(dir.path());
    {
        let j = open(&store, &key, 0);
        let room = room(&j, &key).await;
        send(&j, &key, &room, 0, 10).await;
    }
    // A good snapshot at 13, then variations on it.
    drop(open(&store, &key, 1));
    let good = store.load_snapshot().unwrap().unwrap();
    assert_eq!(restored(&open(&store, &key, 0)), 0);
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    cases.push(("garbage", b"\xa1\x66format\x18\x63".to_vec()));
    // Format 1 (the layout before fork windows: a bare CBOR map with a `format` field
    // and a checkpoint that matches the journal).
    let mut old = Vec::new();
    let rec13 = store.read_raw_after(12, 1).unwrap().remove(0).1;
    ciborium::into_writer(
        &json!({
            "format": 1,
            "position": 13,
            "hash": spindle_journal::record_hash(&rec13).to_vec(),
            "models": { "rooms": {} },
        }),
        &mut old,
    )
    .unwrap();
    cases.push(("format 1", old));
    // The current magic with another format number.
    let mut other = good.clone();
    other[8..12].copy_from_slice(&1u32.to_be_bytes());
    cases.push(("format field 1", other));
    // Truncated.
    cases.push(("truncated", good[..good.len() / 2].to_vec()));
    for (what, bytes) in cases {
        store.save_snapshot(&bytes).unwrap();
        let j = open(&store, &key, 0);
        assert_eq!(restored(&j), 13, "{what}");
        assert_eq!(j.durable_head(), 13, "{what}");
    }
    // Another fork-window size: the windows a full replay builds would differ.
    store.save_snapshot(&good).unwrap();
    let other_window = JournalOptions {
        fork_window: 64,
        snapshot_every_records: 0,
        ..JournalOptions::default()
    };
    let j = Journal::open_with(store.clone(), key.clone(), other_window).unwrap();
    assert_eq!(restored(&j), 13);
    drop(j);
    // A checkpoint the journal does not have (a snapshot from a longer journal, e.g.
    // before a backup was restored): the hash at 13 differs.
    let other_dir = tempfile::tempdir().unwrap();
    let other_store = CountingStore::open(other_dir.path());
    {
        let j = open(&other_store, &key, 0);
        let room = room(&j, &key).await;
        send(&j, &key, &room, 100, 10).await;
    }
    drop(open(&other_store, &key, 1));
    store
        .save_snapshot(&other_store.load_snapshot().unwrap().unwrap())
        .unwrap();
    let j = open(&store, &key, 0);
    assert_eq!(restored(&j), 13);
    drop(j);
    // The good one still works.
    store.save_snapshot(&good).unwrap();
    assert_eq!(restored(&open(&store, &key, 0)), 0);
}

#[tokio::test]
async fn the_chain_is_verified_from_the_checkpoint_and_journal_check_walks_everything() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let store = CountingStore::open(dir.path());
    {
        let j = open(&store, &key, 0);
        let room = room(&j, &key).await;
        send(&j, &key, &room, 0, 17).await;
    }
    drop(open(&store, &key, 1));
    // Record 5 changed after the snapshot at 20 was taken.
    let mut rec = StoredRecord::from_bytes(&store.read_raw_after(4, 1).unwrap()[0].1)
        .unwrap()
        .to_record();
    rec.appended_at += 1;
    store.tampered.lock().insert(5, rec.encode());
    // Start-up reads the checkpoint record only and does not see it...
    let before = store.reads();
    let j = open(&store, &key, 0);
    assert_eq!(restored(&j), 0);
    assert_eq!(store.reads() - before, 1);
    drop(j);
    // ...`spindle journal check` (a full walk) names it...
    let brk = chain::walk(&*store, |_| Ok(())).unwrap_err();
    assert_eq!(brk.position, 6);
    assert_eq!(brk.kind, BreakKind::PrevHash);
    // ...and so does a start-up without the snapshot, which refuses to open.
    store.delete_snapshot().unwrap();
    let err = Journal::open_with(store.clone(), key.clone(), options(0))
        .err()
        .unwrap();
    assert!(err.to_string().contains("position 6"), "{err}");
}

fn keys_of(k: &ServerKey) -> VerifyKeys {
    BTreeMap::from([(
        k.server_name().to_owned(),
        BTreeMap::from([(k.key_id(), k.public_key_base64())]),
    )])
}

/// A federated room: alice (here) created it, bob (remote.org) joined, so it has a fork
/// window.
struct Federated {
    key: Arc<ServerKey>,
    remote: ServerKey,
    room: String,
    create: String,
    power: String,
    join_rules: String,
}

impl Federated {
    #[allow(clippy::too_many_arguments)]
    fn remote_pdu(
        &self,
        sender: &str,
        kind: &str,
        state_key: Option<&str>,
        content: serde_json::Value,
        prev: &str,
        auth: Vec<&str>,
        depth: u64,
        origin_server_ts: u64,
    ) -> serde_json::Value {
        PduTemplate {
            room_version: "11".into(),
            room_id: Some(self.room.as_str().try_into().unwrap()),
            sender: sender.try_into().unwrap(),
            kind: kind.into(),
            state_key: state_key.map(str::to_owned),
            content,
            redacts: None,
            prev_events: vec![prev.try_into().unwrap()],
            auth_events: auth.into_iter().map(|a| a.try_into().unwrap()).collect(),
            depth,
            origin_server_ts,
        }
        .build(&self.remote)
        .unwrap()
        .federation_json()
    }

    async fn ingest(&self, j: &Journal, pdu: serde_json::Value) -> String {
        j.submit(signed(
            &self.key,
            "remote.org",
            CommandBody::RemotePdu {
                room_id: self.room.clone(),
                pdu,
                keys: keys_of(&self.remote),
                event_id: None,
                auth_events: Vec::new(),
            },
        ))
        .await
        .unwrap()
        .event_ids[0]
            .to_string()
    }

    async fn alice_state(
        &self,
        j: &Journal,
        kind: &str,
        key: &str,
        content: serde_json::Value,
    ) -> String {
        j.submit(signed(
            &self.key,
            ALICE,
            CommandBody::SendEvent {
                room_id: self.room.clone(),
                event: state(kind, key, content),
                txn_id: None,
                precondition: None,
            },
        ))
        .await
        .unwrap()
        .event_ids[0]
            .to_string()
    }

    /// An invite of carol (ours) to a room on remote.org: kept as an outlier.
    async fn outlier_invite(&self, j: &Journal) -> String {
        let pdu = PduTemplate {
            room_version: "11".into(),
            room_id: Some("!elsewhere:remote.org".try_into().unwrap()),
            sender: BOB.try_into().unwrap(),
            kind: "m.room.member".into(),
            state_key: Some("@carol:example.org".into()),
            content: json!({ "membership": "invite" }),
            redacts: None,
            prev_events: vec![
                "$someprev000000000000000000000000000000000000"
                    .try_into()
                    .unwrap(),
            ],
            auth_events: vec![],
            depth: 9,
            origin_server_ts: 1_700_000_000_900,
        }
        .build(&self.remote)
        .unwrap()
        .federation_json();
        j.submit(signed(
            &self.key,
            "remote.org",
            CommandBody::RemoteOutlier {
                room_id: "!elsewhere:remote.org".into(),
                room_version: "11".into(),
                pdu,
                keys: keys_of(&self.remote),
                invite_room_state: None,
            },
        ))
        .await
        .unwrap()
        .event_ids[0]
            .to_string()
    }
}

/// (kind, event id) of the event and resolved-state records after `after`.
fn records_after(j: &Journal, after: u64) -> Vec<(&'static str, String)> {
    j.read_after(after, 1000)
        .unwrap()
        .iter()
        .filter_map(|r| {
            let kind = if r.is_state_resolved() {
                "resolved"
            } else if r.is_event() {
                "event"
            } else {
                return None;
            };
            Some((kind, r.event_id()?.to_owned()))
        })
        .collect()
}

/// Copies a closed fjall directory (a second journal with the same records).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), dest).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fork_window_restores_from_a_snapshot_as_a_full_replay_builds_it() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let remote = ServerKey::generate("remote.org");
    let store = CountingStore::open(dir.path());
    let j = open(&store, &key, 0);
    let created = j
        .submit(signed(
            &key,
            ALICE,
            CommandBody::CreateRoom {
                room_version: "11".into(),
                events: vec![
                    state("m.room.create", "", json!({ "room_version": "11" })),
                    state("m.room.member", ALICE, json!({ "membership": "join" })),
                    state(
                        "m.room.power_levels",
                        "",
                        json!({ "users": { ALICE: 100 }, "events_default": 0, "state_default": 50 }),
                    ),
                    state("m.room.join_rules", "", json!({ "join_rule": "public" })),
                ],
                alias: None,
            },
        ))
        .await
        .unwrap();
    let ids: Vec<String> = created.event_ids.iter().map(|e| e.to_string()).collect();
    let f = Federated {
        key: key.clone(),
        remote,
        room: created.room_id.unwrap().to_string(),
        create: ids[0].clone(),
        power: ids[2].clone(),
        join_rules: ids[3].clone(),
    };
    let join = f.remote_pdu(
        BOB,
        "m.room.member",
        Some(BOB),
        json!({ "membership": "join" }),
        &ids[3],
        vec![&f.create, &f.power, &f.join_rules],
        5,
        1_700_000_000_500,
    );
    let join = f.ingest(&j, join).await;
    let power = f
        .alice_state(
            &j,
            "m.room.power_levels",
            "",
            json!({ "users": { ALICE: 100, BOB: 50 }, "events_default": 0, "state_default": 50 }),
        )
        .await;
    let topic = f
        .alice_state(&j, "m.room.topic", "", json!({ "topic": "alice's" }))
        .await;
    let invite = f.outlier_invite(&j).await;
    drop(j);
    // The snapshot: taken with the window open (two servers joined).
    drop(open(&store, &key, 1));
    assert!(store.load_snapshot().unwrap().is_some());
    let j = open(&store, &key, 0);
    let at_snapshot = j.durable_head();
    let model = j.room_model(&f.room).await.unwrap();
    assert_eq!(model.joined_servers, vec!["example.org", "remote.org"]);
    assert_eq!(
        model.window.as_deref(),
        Some(&[power.clone(), topic.clone()][..])
    );
    // After it: alice's name and bob's message extend the window.
    let name = f
        .alice_state(&j, "m.room.name", "", json!({ "name": "before" }))
        .await;
    let bob_msg = f.remote_pdu(
        BOB,
        "m.room.message",
        None,
        json!({ "body": "hi" }),
        &name,
        vec![&f.create, &power, &join],
        9,
        1_700_000_000_600,
    );
    let bob_msg = f.ingest(&j, bob_msg).await;
    let head = j.durable_head();
    drop(j);
    close(store).await;

    // Journal A restarts from the snapshot; journal B (a copy) replays everything.
    let dir_b = tempfile::tempdir().unwrap();
    copy_dir(dir.path(), dir_b.path());
    let store = CountingStore::open(dir.path());
    let a = open(&store, &key, 0);
    assert_eq!(restored(&a), head - at_snapshot);
    assert_eq!(head - at_snapshot, 2);
    let store_b = CountingStore::open(dir_b.path());
    store_b.delete_snapshot().unwrap();
    let b = open(&store_b, &key, 0);
    assert_eq!(restored(&b), head);
    // Same state, same window, same outliers: every write model equal.
    let (ma, mb) = (
        a.room_model(&f.room).await.unwrap(),
        b.room_model(&f.room).await.unwrap(),
    );
    assert_eq!(ma, mb);
    assert_eq!(
        ma.window.as_deref(),
        Some(&[power.clone(), topic.clone(), name.clone(), bob_msg.clone()][..])
    );
    assert_eq!(ma.state[&("m.room.topic".to_owned(), String::new())], topic);
    assert_eq!(
        a.room_model("!elsewhere:remote.org")
            .await
            .unwrap()
            .outliers,
        1
    );
    assert_eq!(
        a.room_model("!elsewhere:remote.org").await.unwrap().state
            [&("m.room.member".to_owned(), "@carol:example.org".to_owned())],
        invite
    );
    assert_eq!(a.write_model_digest().await, b.write_model_digest().await);

    // The next fork resolves the same way on both: bob sets the topic after the power
    // levels (a fork from before alice's topic, inside the window), later than alice's,
    // so his wins by state resolution v2 and nothing is reasserted.
    let bob_topic = f.remote_pdu(
        BOB,
        "m.room.topic",
        Some(""),
        json!({ "topic": "bob's" }),
        &power,
        vec![&f.create, &power, &join],
        7,
        1_700_000_001_000,
    );
    let from = a.durable_head();
    let ta = f.ingest(&a, bob_topic.clone()).await;
    let tb = f.ingest(&b, bob_topic).await;
    assert_eq!(ta, tb);
    assert_eq!(records_after(&a, from), records_after(&b, from));
    assert_eq!(records_after(&a, from), vec![("event", ta.clone())]);
    for j in [&a, &b] {
        assert_eq!(j.stats().forks_resolved.load(Ordering::Relaxed), 1);
    }
    // An older topic from bob forked from alice's name: loses to bob's own later one
    // already current; resolution reasserts it after the event, on both.
    let old_topic = f.remote_pdu(
        BOB,
        "m.room.topic",
        Some(""),
        json!({ "topic": "bob's older" }),
        &name,
        vec![&f.create, &power, &join],
        9,
        1_700_000_000_700,
    );
    let from = a.durable_head();
    let oa = f.ingest(&a, old_topic.clone()).await;
    let ob = f.ingest(&b, old_topic).await;
    assert_eq!(oa, ob);
    assert_eq!(records_after(&a, from), records_after(&b, from));
    assert_eq!(
        records_after(&a, from),
        vec![("event", oa.clone()), ("resolved", ta.clone())]
    );
    let ma = a.room_model(&f.room).await.unwrap();
    assert_eq!(ma, b.room_model(&f.room).await.unwrap());
    assert_eq!(ma.state[&("m.room.topic".to_owned(), String::new())], ta);
    assert_eq!(a.write_model_digest().await, b.write_model_digest().await);
    assert_eq!(
        a.stats().forks_resolved.load(Ordering::Relaxed)
            + a.stats().forks_merged.load(Ordering::Relaxed),
        b.stats().forks_resolved.load(Ordering::Relaxed)
            + b.stats().forks_merged.load(Ordering::Relaxed),
    );
}
