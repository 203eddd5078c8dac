//! State trie shapes across state sizes (issue 7): point lookup and single-key update
//! of the content-addressed trie, against a plain `HashMap` (which cannot share
//! structure between versions, so an update that keeps the old version must clone it)
//! and against the `im` crate's persistent hash map (structural sharing, but no content
//! addressing). The log keeps a state version per event, so "update" always means
//! "make a new version and keep the old one".
//!
//! Run: `cargo bench --bench state_trie`. Under `cargo test --all-targets` each
//! benchmark runs once on the smallest size only, to keep the test suite cheap.

use std::collections::HashMap;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use spindle_core::trie::{self, MemStore, Root};

/// Whether the binary runs under `cargo bench` (else: test mode, one quick pass).
fn bench_mode() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn sizes() -> Vec<usize> {
    if bench_mode() {
        vec![100, 1_000, 10_000, 100_000]
    } else {
        vec![100]
    }
}

fn member(i: usize) -> String {
    format!("@user{i}:example.org")
}

fn build_trie(n: usize) -> (MemStore, Root) {
    let store = MemStore::default();
    let mut root = Root::empty();
    for i in 0..n {
        root = trie::insert(
            &store,
            root,
            "m.room.member",
            &member(i),
            format!("$event{i}").as_bytes(),
        )
        .unwrap();
    }
    (store, root)
}

type Key = (String, String);

fn build_maps(n: usize) -> (HashMap<Key, String>, im::HashMap<Key, String>) {
    let map: HashMap<Key, String> = (0..n)
        .map(|i| {
            (
                ("m.room.member".to_owned(), member(i)),
                format!("$event{i}"),
            )
        })
        .collect();
    let persistent: im::HashMap<Key, String> = map.clone().into_iter().collect();
    (map, persistent)
}

fn bench(c: &mut Criterion) {
    let mut lookups = c.benchmark_group("state_lookup");
    for n in sizes() {
        let (store, root) = build_trie(n);
        let (map, persistent) = build_maps(n);
        let probe = member(n / 2);
        let key = ("m.room.member".to_owned(), probe.clone());
        lookups.bench_with_input(BenchmarkId::new("trie", n), &n, |b, _| {
            b.iter(|| trie::lookup(&store, root, "m.room.member", &probe).unwrap())
        });
        lookups.bench_with_input(BenchmarkId::new("hashmap", n), &n, |b, _| {
            b.iter(|| map.get(&key).map(String::len))
        });
        lookups.bench_with_input(BenchmarkId::new("im", n), &n, |b, _| {
            b.iter(|| persistent.get(&key).map(String::len))
        });
    }
    lookups.finish();

    // A new version with one entry changed, the old version kept.
    let mut updates = c.benchmark_group("state_update_keep_version");
    for n in sizes() {
        let (store, root) = build_trie(n);
        let (map, persistent) = build_maps(n);
        let probe = member(n / 2);
        let key = ("m.room.member".to_owned(), probe.clone());
        updates.bench_with_input(BenchmarkId::new("trie", n), &n, |b, _| {
            b.iter(|| trie::insert(&store, root, "m.room.member", &probe, b"$changed").unwrap())
        });
        updates.bench_with_input(BenchmarkId::new("im", n), &n, |b, _| {
            b.iter(|| persistent.update(key.clone(), "$changed".to_owned()).len())
        });
        // Cloning a 100k-entry map per event is the quadratic shape persistence avoids;
        // it is measured up to 10k so the run finishes.
        if n <= 10_000 {
            updates.bench_with_input(BenchmarkId::new("hashmap_clone", n), &n, |b, _| {
                b.iter(|| {
                    let mut m = map.clone();
                    m.insert(key.clone(), "$changed".to_owned());
                    m.len()
                })
            });
        }
    }
    updates.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
