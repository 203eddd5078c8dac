//! Journal append, strict vs group commit (issue 7): what durability costs per record.
//!
//! - `strict`: one writer, each message submitted after the previous one is durable:
//!   one fsync per record, the cost every acknowledged write pays alone.
//! - `group_commit/N`: N writers, each sending to its own room at the same time; the
//!   appender takes everything queued into one batch and one fsync, so concurrent
//!   writers share fsyncs (BRIEF §3.4 keeps fsync-before-ack either way).
//!
//! Reported per batch of 32 records; the fsync count per run is printed once so the
//! coalescing is visible beside the time. Absolute times are this disk's fsync latency.
//!
//! Run: `cargo bench --bench journal_append` (under `cargo test --all-targets`: one pass).

use std::sync::{Arc, atomic::Ordering};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use serde_json::json;
use spindle_core::keys::ServerKey;
use spindle_journal::{
    CommandBody, CommandEnvelope, EventSpec, FjallStore, Journal, SignedCommand,
};

const ALICE: &str = "@alice:example.org";
const RECORDS: usize = 32;

fn signed(key: &ServerKey, body: CommandBody) -> SignedCommand {
    let envelope = CommandEnvelope {
        principal: ALICE.into(),
        device_id: Some("DEV".into()),
        issued_at: 1_700_000_000_000,
        body,
    };
    SignedCommand::sign(key, envelope).unwrap()
}

fn state(kind: &str, key: &str, content: serde_json::Value) -> EventSpec {
    EventSpec {
        kind: kind.into(),
        state_key: Some(key.into()),
        content,
        redacts: None,
    }
}

fn message(room: &str, body: &str) -> CommandBody {
    CommandBody::SendEvent {
        room_id: room.into(),
        event: EventSpec {
            kind: "m.room.message".into(),
            state_key: None,
            content: json!({ "msgtype": "m.text", "body": body }),
            redacts: None,
        },
        txn_id: None,
        precondition: None,
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    key: Arc<ServerKey>,
    journal: Journal,
    rooms: Vec<String>,
}

async fn fixture(rooms: usize) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let journal =
        Journal::open(Arc::new(FjallStore::open(dir.path()).unwrap()), key.clone()).unwrap();
    let mut ids = Vec::new();
    for _ in 0..rooms {
        let created = journal
            .submit(signed(
                &key,
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
            .unwrap();
        ids.push(created.room_id.unwrap().to_string());
    }
    Fixture {
        _dir: dir,
        key,
        journal,
        rooms: ids,
    }
}

/// Appends `RECORDS` messages with `writers` concurrent writers; returns fsyncs used.
async fn run(f: &Fixture, writers: usize) -> u64 {
    let before = f.journal.stats().fsyncs.load(Ordering::Relaxed);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (journal, key, room) = (f.journal.clone(), f.key.clone(), f.rooms[w].clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..RECORDS / writers {
                journal
                    .submit(signed(&key, message(&room, &format!("m{i}"))))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    f.journal.stats().fsyncs.load(Ordering::Relaxed) - before
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("journal_append_32_records");
    group.sample_size(10);
    for writers in [1usize, 4, 8] {
        let f = rt.block_on(fixture(writers));
        let fsyncs = rt.block_on(run(&f, writers));
        eprintln!("journal_append: {writers} writer(s): {fsyncs} fsyncs for {RECORDS} records");
        let name = if writers == 1 {
            "strict".to_owned()
        } else {
            "group_commit".to_owned()
        };
        group.bench_with_input(BenchmarkId::new(name, writers), &writers, |b, &w| {
            b.iter(|| rt.block_on(run(&f, w)))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
