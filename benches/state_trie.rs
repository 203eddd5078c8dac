//! State trie shapes across state sizes: point lookup and single-key update, against a
//! plain `HashMap` (which cannot share structure between versions, so an update that
//! keeps the old version must clone it). Run with `cargo bench --bench state_trie`.

use std::collections::HashMap;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use spindle_core::trie::{self, MemStore, Root};

fn build(n: usize) -> (MemStore, Root) {
    let store = MemStore::default();
    let mut root = Root::empty();
    for i in 0..n {
        let key = format!("@user{i}:example.org");
        root = trie::insert(
            &store,
            root,
            "m.room.member",
            &key,
            format!("$event{i}").as_bytes(),
        )
        .unwrap();
    }
    (store, root)
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("state_trie");
    for n in [100usize, 1_000, 10_000] {
        let (store, root) = build(n);
        let probe = format!("@user{}:example.org", n / 2);
        group.bench_with_input(BenchmarkId::new("lookup", n), &n, |b, _| {
            b.iter(|| trie::lookup(&store, root, "m.room.member", &probe).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("insert_new_version", n), &n, |b, _| {
            b.iter(|| trie::insert(&store, root, "m.room.member", &probe, b"$changed").unwrap())
        });
        let map: HashMap<(String, String), String> = (0..n)
            .map(|i| {
                (
                    ("m.room.member".to_owned(), format!("@user{i}:example.org")),
                    format!("$event{i}"),
                )
            })
            .collect();
        group.bench_with_input(
            BenchmarkId::new("hashmap_clone_and_insert", n),
            &n,
            |b, _| {
                b.iter(|| {
                    let mut m = map.clone();
                    m.insert(
                        ("m.room.member".to_owned(), probe.clone()),
                        "$changed".to_owned(),
                    );
                    m.len()
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
