//! Counting guard for answers written as JSON text (BRIEF §4): the sliding sync writes
//! its events' `content` as stored, so the content parses of a window do not grow with
//! the events it holds. Its own test binary: the parse counter is process-wide, and
//! other tests' servers would add to it.

mod common;

use common::TestServer;
use serde_json::json;
use spindle_core::pdu::content_parses;

const SS: &str = "/_matrix/client/unstable/org.matrix.simplified_msc3575/sync";

/// The Element X window over 11 named rooms of 6 messages each: the only contents
/// parsed are the 11 `m.room.name` events the room names come from, whether the window
/// carries 3 or 6 timeline events per room (66 or 99 events in all with the 3 required
/// state events a room; the value rendering parsed 77 and 110 contents): neither the
/// timeline nor the required state is parsed to be written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_parses_no_event_it_sends() {
    let ts = TestServer::start().await;
    let eli = ts.register("eli").await;
    let mut rooms = Vec::new();
    for i in 0..11 {
        let room = eli
            .create_room(json!({ "preset": "private_chat", "name": format!("room {i}") }))
            .await;
        for j in 0..6 {
            eli.send_text(&room, &format!("message {j} \"quoted\" in room {i}"))
                .await;
        }
        rooms.push(room);
    }
    let head = ts.server.journal.durable_head();
    assert!(
        ts.server
            .projections
            .runtime
            .wait_for_all(head, std::time::Duration::from_secs(10))
            .await
    );
    let mut parses = Vec::new();
    for (conn, limit) in [("three", 3), ("six", 6)] {
        let body = json!({
            "conn_id": conn,
            "lists": { "all_rooms": {
                "ranges": [[0, 10]],
                "timeline_limit": limit,
                "required_state": [
                    ["m.room.name", ""],
                    ["m.room.create", ""],
                    ["m.room.member", "$LAZY"],
                ],
            } }
        });
        let before = content_parses();
        let answer = eli.post(SS, &body).await.ok();
        parses.push(content_parses() - before);
        let answered = answer["rooms"].as_object().unwrap();
        assert_eq!(answered.len(), 11);
        for (i, room) in rooms.iter().enumerate() {
            let r = &answered[room];
            assert_eq!(r["name"], json!(format!("room {i}")));
            let timeline = r["timeline"].as_array().unwrap();
            assert_eq!(timeline.len(), limit);
            assert_eq!(
                timeline[limit - 1]["content"],
                json!({ "msgtype": "m.text", "body": format!("message 5 \"quoted\" in room {i}") })
            );
            assert_eq!(timeline[limit - 1]["unsigned"]["membership"], "join");
            let kinds: Vec<&str> = r["required_state"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["type"].as_str().unwrap())
                .collect();
            assert_eq!(kinds, ["m.room.create", "m.room.name", "m.room.member"]);
            assert_eq!(
                r["required_state"][1]["content"],
                json!({ "name": format!("room {i}") })
            );
        }
    }
    assert_eq!(
        parses,
        [11, 11],
        "content parses of a window (3, 6 events a room)"
    );
}
