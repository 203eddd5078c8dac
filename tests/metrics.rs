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
