//! Start-up cost of the journal at a given length (docs/benchmarks.md, "Start-up").
//!
//! `startup fill DIR N`: a journal of N records in DIR (one account, one room, N - 3
//! messages with transaction ids as clients send them, appended in runs of
//! `MAX_BATCH_COMMANDS` by 4 writers; background snapshots off, so the journal ends with none).
//! `startup open DIR full|snapshot|save`: opens it once and prints the open time (ms),
//! the records replayed and the process RSS after open (KiB). `full` deletes the
//! snapshot first and saves none (every record replayed, as before snapshots);
//! `snapshot` uses the stored one and saves none; `save` replays what it must and
//! saves a snapshot at the head (the time includes the save).

use std::{
    sync::{Arc, atomic::Ordering},
    time::Instant,
};

use serde_json::json;
use spindle_core::keys::ServerKey;
use spindle_journal::{
    CommandBody, CommandEnvelope, EventSpec, Fact, FjallStore, Journal, JournalOptions,
    JournalStore, SignedCommand,
};

const ALICE: &str = "@alice:example.org";

fn signed(key: &ServerKey, body: CommandBody) -> SignedCommand {
    let envelope = CommandEnvelope {
        principal: ALICE.into(),
        device_id: Some("DEV".into()),
        issued_at: 1_700_000_000_000,
        body,
    };
    SignedCommand::sign(key, envelope).unwrap()
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn key_of(dir: &std::path::Path) -> Arc<ServerKey> {
    let path = dir.join("bench.key");
    if let Ok(pkcs8) = std::fs::read(&path) {
        let version = std::fs::read_to_string(dir.join("bench.key.version")).unwrap();
        return Arc::new(ServerKey::from_pkcs8("example.org", &version, &pkcs8).unwrap());
    }
    let key = ServerKey::generate("example.org");
    std::fs::write(&path, key.pkcs8()).unwrap();
    std::fs::write(dir.join("bench.key.version"), key.version()).unwrap();
    Arc::new(key)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&args[2]);
    std::fs::create_dir_all(&dir).unwrap();
    let key = key_of(&dir);
    let store = Arc::new(FjallStore::open(&dir.join("journal")).unwrap());
    match args[1].as_str() {
        "fill" => {
            let n: usize = args[3].parse().unwrap();
            let options = JournalOptions {
                snapshot_every_records: 0,
                ..JournalOptions::default()
            };
            let j = Journal::open_with(store, key.clone(), options).unwrap();
            let fact = Fact::AccountRegistered {
                user_id: ALICE.into(),
                password_hash: None,
                guest: false,
            };
            j.submit(signed(&key, CommandBody::Fact { fact }))
                .await
                .unwrap();
            let spec = |kind: &str, sk: &str, content| EventSpec {
                kind: kind.into(),
                state_key: Some(sk.into()),
                content,
                redacts: None,
            };
            let room = j
                .submit(signed(
                    &key,
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
            // Writers sign their commands on blocking threads and hand them to the
            // journal as runs of MAX_BATCH_COMMANDS (one durable write per run), so a
            // fill of 10M records takes minutes, not hours.
            let writers = 4;
            let run = spindle_journal::MAX_BATCH_COMMANDS;
            let total = n - 3;
            let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let mut tasks = Vec::new();
            for _ in 0..writers {
                let (j, key, room, next) = (j.clone(), key.clone(), room.clone(), next.clone());
                tasks.push(tokio::spawn(async move {
                    loop {
                        let from = next.fetch_add(run, Ordering::Relaxed);
                        if from >= total {
                            break;
                        }
                        let to = (from + run).min(total);
                        let (key2, room2) = (key.clone(), room.clone());
                        let cmds = tokio::task::spawn_blocking(move || {
                            (from..to)
                                .map(|i| {
                                    let body = CommandBody::SendEvent {
                                        room_id: room2.clone(),
                                        event: EventSpec {
                                            kind: "m.room.message".into(),
                                            state_key: None,
                                            content: json!({ "msgtype": "m.text", "body": format!("message {i}") }),
                                            redacts: None,
                                        },
                                        txn_id: Some(format!("t{i}")),
                                        precondition: None,
                                    };
                                    signed(&key2, body)
                                })
                                .collect::<Vec<_>>()
                        })
                        .await
                        .unwrap();
                        for r in j.submit_batch(cmds).await {
                            r.unwrap();
                        }
                        if to % 100_000 < run {
                            eprintln!("{} records", j.durable_head());
                        }
                    }
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
            println!("filled: {} records", j.durable_head());
        }
        "open" => {
            let mode = args[3].as_str();
            if mode == "full" {
                store.delete_snapshot().unwrap();
            }
            let options = JournalOptions {
                snapshot_every_records: if mode == "save" { 1 } else { 0 },
                ..JournalOptions::default()
            };
            let rss_before = rss_kib();
            let started = Instant::now();
            let j = Journal::open_with(store.clone(), key, options).unwrap();
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            let snapshot = store.load_snapshot().unwrap().map_or(0, |b| b.len());
            println!(
                "open {mode}: head {} replayed {} in {ms:.0} ms, RSS {} KiB (before open {rss_before} KiB), snapshot {snapshot} bytes",
                j.durable_head(),
                j.stats().restored.load(Ordering::Relaxed),
                rss_kib(),
            );
        }
        other => panic!("unknown command {other}"),
    }
}
