//! Device details clients expect (issue 17 item 8): `last_seen_ip` and the user agent
//! per device, in `/devices` and `/admin/whois`, journaled as `DeviceSeen` facts only
//! on change (never per request) and applied by the accounts projection, and not kept at all with
//! `[devices] keep_client_addresses = false`.

mod common;

use std::time::Duration;

use common::{TestServer, enc, uid};
use serde_json::{Value, json};
use spindle_journal::Fact;

const UA: &str = "device-details-test/1.0";

/// Logs `localpart` in with a user agent, as a new device.
async fn login_with_ua(ts: &TestServer, localpart: &str, device_id: &str) -> common::Client {
    let body = json!({
        "type": "m.login.password",
        "identifier": { "type": "m.id.user", "user": localpart },
        "password": format!("password-{localpart}"),
        "device_id": device_id,
    });
    let resp = ts
        .anon()
        .raw(
            reqwest::Method::POST,
            "/_matrix/client/v3/login",
            Some(serde_json::to_vec(&body).unwrap()),
            &[("content-type", "application/json"), ("user-agent", UA)],
        )
        .await;
    let body = resp.ok();
    let mut c = ts.anon().with_token(body["access_token"].as_str());
    c.user_id = body["user_id"].as_str().unwrap().to_owned();
    c.device_id = device_id.to_owned();
    c
}

/// A GET sent with [`UA`], as a real client always sends its user agent.
async fn get_ua(c: &common::Client, path: &str) -> Value {
    c.raw(reqwest::Method::GET, path, None, &[("user-agent", UA)])
        .await
        .ok()
}

/// `DeviceSeen` facts in the journal, as (device, ip, user agent).
fn seen_facts(ts: &TestServer) -> Vec<(String, Option<String>, Option<String>)> {
    ts.server
        .journal
        .read_after(0, usize::MAX)
        .unwrap()
        .iter()
        .filter_map(|r| match r.fact() {
            Some(Fact::DeviceSeen {
                device_id,
                ip,
                user_agent,
                ..
            }) => Some((device_id, ip, user_agent)),
            _ => None,
        })
        .collect()
}

/// Waits (bounded) until the accounts projection has `n` devices with a `DeviceSeen`
/// (the fact is journaled in the background, after the answer).
async fn wait_seen(ts: &TestServer, user: &str, devices: &[&str]) {
    for _ in 0..500 {
        if devices.iter().all(|d| {
            ts.server
                .projections
                .accounts
                .device_seen(user, d)
                .is_some()
        }) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("DeviceSeen of {devices:?} never applied");
}

fn device<'a>(devices: &'a Value, id: &str) -> &'a Value {
    devices["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["device_id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {devices}"))
}

#[tokio::test]
async fn devices_report_address_and_user_agent_from_login_on_and_journal_only_changes() {
    let ts = TestServer::start().await;
    ts.register("alice").await;
    let alice = login_with_ua(&ts, "alice", "PHONE").await;
    // Fifty requests from the same address with the same client: no further fact.
    for _ in 0..50 {
        get_ua(&alice, "/_matrix/client/v3/account/whoami").await;
    }
    wait_seen(&ts, &alice.user_id, &["PHONE"]).await;
    let devices = get_ua(&alice, "/_matrix/client/v3/devices").await;
    let phone = device(&devices, "PHONE");
    assert_eq!(phone["last_seen_ip"], "127.0.0.1");
    assert!(
        phone["last_seen_ts"].as_u64().is_some_and(|t| t > 0),
        "{phone}"
    );
    let whois = get_ua(
        &alice,
        &format!("/_matrix/client/v3/admin/whois/{}", enc(&uid("alice"))),
    )
    .await;
    let conn = &whois["devices"]["PHONE"]["sessions"][0]["connections"][0];
    assert_eq!(conn["ip"], "127.0.0.1");
    assert_eq!(conn["user_agent"], UA);
    // The registration's device (reqwest sends no user agent) and the login's device:
    // one fact each, not one per request.
    let facts = seen_facts(&ts);
    assert_eq!(facts.len(), 2, "{facts:?}");
    let phone_facts: Vec<_> = facts.iter().filter(|f| f.0 == "PHONE").collect();
    assert_eq!(
        phone_facts,
        vec![&(
            "PHONE".to_owned(),
            Some("127.0.0.1".to_owned()),
            Some(UA.to_owned())
        )]
    );
    ts.stop().await;
}

#[tokio::test]
async fn last_seen_is_a_journal_fact_that_the_projection_applies() {
    let ts = TestServer::start().await;
    ts.register("bob").await;
    let bob = login_with_ua(&ts, "bob", "LAPTOP").await;
    // Journaled before the login answered (so it precedes what the session does).
    let facts = seen_facts(&ts);
    assert!(
        facts.contains(&("LAPTOP".into(), Some("127.0.0.1".into()), Some(UA.into()))),
        "{facts:?}"
    );
    // The accounts projection holds it (what a restart or a rebuild reads: the
    // in-memory map starts empty then).
    wait_seen(&ts, &bob.user_id, &["LAPTOP"]).await;
    let journaled = ts
        .server
        .projections
        .accounts
        .device_seen(&bob.user_id, "LAPTOP")
        .expect("DeviceSeen applied");
    assert_eq!(journaled.ip.as_deref(), Some("127.0.0.1"));
    assert_eq!(journaled.user_agent.as_deref(), Some(UA));
    // Deleting the device drops it.
    let del = bob
        .raw(
            reqwest::Method::DELETE,
            "/_matrix/client/v3/devices/LAPTOP",
            Some(
                serde_json::to_vec(&json!({ "auth": {
                    "type": "m.login.password",
                    "identifier": { "type": "m.id.user", "user": "bob" },
                    "password": "password-bob",
                }}))
                .unwrap(),
            ),
            &[("content-type", "application/json")],
        )
        .await;
    assert_eq!(del.status, 200, "{}", del.text);
    assert_eq!(
        ts.server
            .projections
            .accounts
            .device_seen(&bob.user_id, "LAPTOP"),
        None
    );
    ts.stop().await;
}

#[tokio::test]
async fn no_address_is_kept_when_the_operator_says_so() {
    let ts = TestServer::start_with(|c| c.devices.keep_client_addresses = false).await;
    ts.register("carol").await;
    let carol = login_with_ua(&ts, "carol", "TABLET").await;
    wait_seen(&ts, &carol.user_id, &["TABLET"]).await;
    let devices = get_ua(&carol, "/_matrix/client/v3/devices").await;
    let tablet = device(&devices, "TABLET");
    assert!(tablet.get("last_seen_ip").is_none(), "{tablet}");
    assert!(tablet["last_seen_ts"].as_u64().is_some(), "{tablet}");
    let facts = seen_facts(&ts);
    assert!(facts.iter().all(|(_, ip, _)| ip.is_none()), "{facts:?}");
    assert_eq!(facts.last().unwrap().2.as_deref(), Some(UA));
    ts.stop().await;
}
