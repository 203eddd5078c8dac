//! `/sync` assembly (issue 7): an in-process server on loopback, a user in N rooms of
//! 20 messages each, and the three syncs a client makes: the initial sync (every room
//! assembled), an incremental sync after one new message in one room, and a poll with
//! nothing new. The shape across room counts is the result: initial sync grows with
//! the rooms it returns; incremental sync and the poll should not grow with rooms that
//! did not change (beyond one in-memory check each).
//!
//! Run: `cargo bench --bench sync_assembly` (under `cargo test --all-targets`: one
//! pass with two rooms).

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use serde_json::{Value, json};

fn bench_mode() -> bool {
    std::env::args().any(|a| a == "--bench")
}

struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        assert!(resp.status().is_success(), "{path}: {}", resp.status());
        resp.json().await.unwrap()
    }
}

async fn setup(base: &str, rooms: usize) -> (Client, Vec<String>) {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let v: Value = http
        .post(format!("{base}/_matrix/client/v3/register"))
        .json(
            &json!({ "username": "bench", "password": "pw", "auth": { "type": "m.login.dummy" } }),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let client = Client {
        http,
        base: base.to_owned(),
        token: v["access_token"].as_str().unwrap().to_owned(),
    };
    let mut ids = Vec::new();
    for r in 0..rooms {
        let v = client
            .call(
                reqwest::Method::POST,
                "/_matrix/client/v3/createRoom",
                Some(json!({ "name": format!("room {r}") })),
            )
            .await;
        let room = v["room_id"].as_str().unwrap().to_owned();
        for i in 0..20 {
            client
                .call(
                    reqwest::Method::PUT,
                    &format!("/_matrix/client/v3/rooms/{room}/send/m.room.message/s{r}-{i}"),
                    Some(json!({ "msgtype": "m.text", "body": format!("message {i}") })),
                )
                .await;
        }
        ids.push(room);
    }
    (client, ids)
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sizes: Vec<usize> = if bench_mode() {
        vec![1, 10, 50]
    } else {
        vec![2]
    };
    let mut group = c.benchmark_group("sync");
    group.sample_size(20);
    for rooms in sizes {
        let dir = tempfile::tempdir().unwrap();
        let server = rt.block_on(async {
            spindle::Server::start(spindle::Config {
                bind: "127.0.0.1:0".parse().unwrap(),
                data_dir: dir.path().join("data"),
                log: "warn".into(),
                // The setup sends a burst no public default allows.
                rate_limits: spindle::config::RateLimits::lifted(),
                ..Default::default()
            })
            .await
            .unwrap()
        });
        let base = format!("http://{}", server.addr);
        let (client, ids) = rt.block_on(setup(&base, rooms));
        group.bench_with_input(BenchmarkId::new("initial", rooms), &rooms, |b, _| {
            b.iter(|| {
                rt.block_on(client.call(reqwest::Method::GET, "/_matrix/client/v3/sync", None))
            })
        });
        let mut n = 0u64;
        group.bench_with_input(
            BenchmarkId::new("incremental_one_new_message", rooms),
            &rooms,
            |b, _| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let mut total = std::time::Duration::ZERO;
                        for _ in 0..iters {
                            let since = client
                                .call(
                                    reqwest::Method::GET,
                                    "/_matrix/client/v3/sync?timeout=0&filter=%7B%22room%22%3A%7B%22timeline%22%3A%7B%22limit%22%3A1%7D%7D%7D",
                                    None,
                                )
                                .await["next_batch"]
                                .as_str()
                                .unwrap()
                                .to_owned();
                            n += 1;
                            client
                                .call(
                                    reqwest::Method::PUT,
                                    &format!("/_matrix/client/v3/rooms/{}/send/m.room.message/inc{n}", ids[0]),
                                    Some(json!({ "msgtype": "m.text", "body": "new" })),
                                )
                                .await;
                            let t0 = std::time::Instant::now();
                            let v = client
                                .call(
                                    reqwest::Method::GET,
                                    &format!("/_matrix/client/v3/sync?timeout=0&since={since}"),
                                    None,
                                )
                                .await;
                            total += t0.elapsed();
                            assert_eq!(v["rooms"]["join"].as_object().unwrap().len(), 1);
                        }
                        total
                    })
                })
            },
        );
        let since = rt.block_on(client.call(
            reqwest::Method::GET,
            "/_matrix/client/v3/sync?timeout=0",
            None,
        ))["next_batch"]
            .as_str()
            .unwrap()
            .to_owned();
        group.bench_with_input(
            BenchmarkId::new("poll_nothing_new", rooms),
            &rooms,
            |b, _| {
                b.iter(|| {
                    rt.block_on(client.call(
                        reqwest::Method::GET,
                        &format!("/_matrix/client/v3/sync?timeout=0&since={since}"),
                        None,
                    ))
                })
            },
        );
        rt.block_on(server.stop());
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
