//! Projection apply throughput (issue 7): records per second each projection applies
//! during a rebuild, in batches of 512 committed with their checkpoint (as the runtime
//! does). The journal holds a room with members joining and chatting, the workload a
//! rebuild replays most.
//!
//! Run: `cargo bench --bench projection_apply` (under `cargo test --all-targets`: one
//! pass over a small journal).

use std::{sync::Arc, time::Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use serde_json::json;
use spindle_core::keys::ServerKey;
use spindle_journal::{
    CommandBody, CommandEnvelope, EventSpec, FjallStore, Journal, SignedCommand, StoredRecord,
};
use spindle_projections::{
    Projection, ProjectionDb, membership::Memberships, state::State, store::ApplyCtx,
    timeline::Timeline, user_data::Receipts,
};

const ALICE: &str = "@alice:example.org";
const BATCH: usize = 512;

fn bench_mode() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn signed(key: &ServerKey, principal: &str, body: CommandBody) -> SignedCommand {
    let envelope = CommandEnvelope {
        principal: principal.into(),
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

fn send(room: &str, event: EventSpec) -> CommandBody {
    CommandBody::SendEvent {
        room_id: room.into(),
        event,
        txn_id: None,
        precondition: None,
    }
}

/// A journal with one public room: `members` joins, then `messages` messages.
async fn journal(dir: &std::path::Path, members: usize, messages: usize) -> Vec<StoredRecord> {
    let key = Arc::new(ServerKey::generate("example.org"));
    let journal = Journal::open(Arc::new(FjallStore::open(dir).unwrap()), key.clone()).unwrap();
    let created = journal
        .submit(signed(
            &key,
            ALICE,
            CommandBody::CreateRoom {
                room_version: "11".into(),
                events: vec![
                    state("m.room.create", "", json!({ "room_version": "11" })),
                    state("m.room.member", ALICE, json!({ "membership": "join" })),
                    state("m.room.join_rules", "", json!({ "join_rule": "public" })),
                ],
                alias: None,
            },
        ))
        .await
        .unwrap();
    let room = created.room_id.unwrap().to_string();
    for i in 0..members {
        let user = format!("@member{i}:example.org");
        journal
            .submit(signed(
                &key,
                &user,
                send(
                    &room,
                    state("m.room.member", &user, json!({ "membership": "join" })),
                ),
            ))
            .await
            .unwrap();
    }
    for i in 0..messages {
        let user = format!("@member{}:example.org", i % members.max(1));
        journal
            .submit(signed(
                &key,
                &user,
                send(
                    &room,
                    EventSpec {
                        kind: "m.room.message".into(),
                        state_key: None,
                        content: json!({ "msgtype": "m.text", "body": format!("message {i}") }),
                        redacts: None,
                    },
                ),
            ))
            .await
            .unwrap();
    }
    let mut out = Vec::new();
    loop {
        let after = out.last().map(StoredRecord::position).unwrap_or(0);
        let recs = journal.read_after(after, 4096).unwrap();
        if recs.is_empty() {
            return out;
        }
        out.extend(recs);
    }
}

fn apply_all(p: &dyn Projection, db: &ProjectionDb, records: &[StoredRecord]) {
    for chunk in records.chunks(BATCH) {
        let mut ctx = ApplyCtx::new();
        for r in chunk {
            p.apply(&mut ctx, r).unwrap();
        }
        ctx.commit(db, p.name(), chunk.last().unwrap().position())
            .unwrap();
    }
}

fn bench(c: &mut Criterion) {
    let (members, messages) = if bench_mode() { (200, 2000) } else { (5, 20) };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let jdir = tempfile::tempdir().unwrap();
    let records = rt.block_on(journal(jdir.path(), members, messages));
    let mut group = c.benchmark_group("projection_apply");
    group.sample_size(10);
    group.throughput(Throughput::Elements(records.len() as u64));
    type Open = fn(&ProjectionDb) -> Arc<dyn Projection>;
    let projections: [(&str, Open); 4] = [
        ("timeline", |db| Arc::new(Timeline::open(db).unwrap())),
        ("state", |db| Arc::new(State::open(db).unwrap())),
        ("membership", |db| Arc::new(Memberships::open(db).unwrap())),
        ("receipts", |db| Arc::new(Receipts::open(db).unwrap())),
    ];
    for (name, open) in projections {
        group.bench_with_input(
            BenchmarkId::new(name, records.len()),
            &records,
            |b, records| {
                b.iter_custom(|iters| {
                    let mut total = std::time::Duration::ZERO;
                    for _ in 0..iters {
                        let dir = tempfile::tempdir().unwrap();
                        let db = ProjectionDb::open(dir.path()).unwrap();
                        let p = open(&db);
                        let t0 = Instant::now();
                        apply_all(p.as_ref(), &db, records);
                        total += t0.elapsed();
                    }
                    total
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
