//! Prometheus metrics (issue 17 item 6): served on their own listener, requests counted
//! by route template and status, the rest read from the server's counters.

mod common;

use common::TestServer;

async fn scrape(ts: &TestServer) -> String {
    let addr = ts.server.metrics_addr.expect("metrics enabled");
    let resp = ts
        .http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap()
}

fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test]
async fn metrics_count_requests_by_route_template_on_their_own_listener() {
    let ts = TestServer::start_with(|c| {
        c.metrics.enabled = true;
        c.metrics.bind = "127.0.0.1:0".parse().unwrap();
    })
    .await;
    let anon = ts.anon();
    for _ in 0..3 {
        anon.get("/_matrix/client/versions").await.ok();
    }
    let alice = ts.register("alice").await;
    let room = alice.create_room(serde_json::json!({})).await;
    alice.send_text(&room, "one").await;
    alice.send_text(&room, "two").await;
    // Not on the Client-Server port.
    anon.get("/metrics").await.expect_err(404, "M_UNRECOGNIZED");
    // The scrape does not wait for the projections (it reads them as they are): let
    // them reach the head first, so the lag is exactly 0.
    let head = ts.server.journal.durable_head();
    assert!(
        ts.server
            .projections
            .runtime
            .wait_for(head, std::time::Duration::from_secs(10))
            .await
    );
    let text = scrape(&ts).await;
    assert_eq!(
        value(
            &text,
            r#"spindle_http_requests_total{method="GET",route="/_matrix/client/versions",status="200"}"#
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            r#"spindle_http_requests_total{method="PUT",route="/_matrix/client/v3/rooms/{room_id}/send/{event_type}/{txn_id}",status="200"}"#
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            r#"spindle_http_requests_total{method="GET",route="unmatched",status="404"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            r#"spindle_http_request_duration_seconds_count{method="GET",route="/_matrix/client/versions"}"#
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        value(&text, "spindle_journal_head_position"),
        Some(head as f64)
    );
    assert_eq!(
        value(
            &text,
            r#"spindle_projection_lag_records{projection="accounts"}"#
        ),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value(&text, "spindle_password_hashing_completed"),
        Some(1.0)
    );
    assert_eq!(
        value(&text, "spindle_password_hashing_queue_depth"),
        Some(0.0)
    );
    assert_eq!(value(&text, "spindle_sync_long_polls"), Some(0.0));
    assert!(value(&text, "spindle_process_resident_memory_bytes").is_some_and(|v| v > 0.0));
    ts.stop().await;
}

/// The write-model snapshot counters and the bounded maps' sizes are exported, and
/// docs/metrics.md lists every metric the server renders.
#[tokio::test]
async fn snapshot_counters_and_cache_sizes_are_exported_and_every_metric_is_documented() {
    let ts = TestServer::start_with(|c| {
        c.metrics.enabled = true;
        c.metrics.bind = "127.0.0.1:0".parse().unwrap();
        c.journal.snapshot_every_records = 4;
    })
    .await;
    let alice = ts.register("alice").await;
    let room = alice.create_room(serde_json::json!({})).await;
    alice.send_text(&room, "one").await;
    alice.send_text(&room, "two").await;
    // The background snapshot runs on its own thread: poll until it is counted.
    let mut text = scrape(&ts).await;
    for _ in 0..100 {
        if value(&text, r#"spindle_journal_snapshots{outcome="saved"}"#) >= Some(1.0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        text = scrape(&ts).await;
    }
    assert!(
        value(&text, r#"spindle_journal_snapshots{outcome="saved"}"#) >= Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, r#"spindle_journal_snapshots{outcome="failed"}"#),
        Some(0.0)
    );
    assert!(
        value(&text, "spindle_journal_snapshot_position") >= Some(4.0),
        "{text}"
    );
    assert!(
        value(&text, "spindle_journal_snapshot_bytes") > Some(0.0),
        "{text}"
    );
    // A fresh data directory: nothing to restore.
    assert_eq!(value(&text, "spindle_journal_restored_records"), Some(0.0));
    // Two sends with txn ids: two misses of the hot set, read in the index, not found.
    assert_eq!(
        value(&text, r#"spindle_journal_txn_index{kind="reads"}"#),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        value(&text, r#"spindle_journal_txn_index{kind="hits"}"#),
        Some(0.0)
    );
    assert_eq!(
        value(&text, r#"spindle_cache_entries{cache="journal_txn_ids"}"#),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        value(&text, r#"spindle_cache_limit{cache="journal_txn_ids"}"#),
        Some(10_000.0)
    );
    assert_eq!(
        value(
            &text,
            r#"spindle_cache_limit{cache="sliding_sync_connections"}"#
        ),
        Some(10_000.0)
    );
    assert_eq!(
        value(
            &text,
            r#"spindle_cache_entries{cache="sliding_sync_connections"}"#
        ),
        Some(0.0)
    );
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metrics.md")).unwrap();
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/grafana-dashboard.json"
    ))
    .unwrap();
    serde_json::from_str::<serde_json::Value>(&dashboard).expect("the dashboard is JSON");
    let mut names = Vec::new();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            let shown = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            assert!(
                docs.contains(&format!("`{shown}`")),
                "docs/metrics.md does not list `{shown}`"
            );
            names.push(shown);
        }
    }
    assert!(names.len() >= 24, "{names:?}");
    // Every metric the dashboard queries exists.
    let mut rest = dashboard.as_str();
    while let Some(i) = rest.find("spindle_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        assert!(
            names.iter().any(|n| n == name || n == base),
            "docs/grafana-dashboard.json queries `{name}`, which the server does not export"
        );
        rest = &tail[end..];
    }
    ts.stop().await;
}
