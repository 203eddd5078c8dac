//! The state resolution oracle (issue 12 item 5, SPEC §4b "Forks"): random forks of a
//! room resolved twice, by the fork window (`fork::resolve`: the window merge where it
//! applies, else state resolution v2) and by ruma's state resolution v2 alone
//! (`fork::state_res_v2`). Both must give the same state, slot by slot. The same harness
//! run with a deliberately wrong merge (the first side always wins) must find
//! disagreements, so the oracle is known to be able to fail. Room version 1 resolves
//! with state resolution v1 (`fork::state_res_v1`): the same harness checks that the
//! window merge agrees with it, and fixed forks check its two orders (depth for
//! ordinary slots, auth-checked ascending depth for power levels).

use std::sync::Arc;

use rand::{Rng, SeedableRng, rngs::StdRng};
use ruma::{OwnedEventId, OwnedRoomId, OwnedUserId};
use serde_json::{Value, json};
use spindle_core::{
    keys::ServerKey,
    pdu::{Pdu, PduTemplate},
    room_version,
};
use spindle_journal::fork::{self, ForkCase, ForkWindow, Pool, StateMap};

const ALICE: &str = "@alice:a.example";
const BOB: &str = "@bob:b.example";
const CAROL: &str = "@carol:a.example";

/// A room being built event by event, with every event in a pool and a fork window.
struct Room {
    version: String,
    key: ServerKey,
    room_id: Option<OwnedRoomId>,
    pool: Pool,
    window: ForkWindow,
    ts: u64,
}

impl Room {
    /// Builds and authorizes an event after `prevs` (whose states the window holds);
    /// `None` when the auth rules refuse it there.
    fn event(
        &mut self,
        prevs: &[OwnedEventId],
        sender: &str,
        kind: &str,
        state_key: Option<&str>,
        content: Value,
        rng: &mut StdRng,
    ) -> Option<Arc<Pdu>> {
        let rules = room_version::rules(&self.version).unwrap();
        let states: Vec<&StateMap> = prevs
            .iter()
            .map(|p| self.window.state_after(p).unwrap())
            .collect();
        let before = if states.len() == 1 {
            states[0].clone()
        } else {
            oracle(&self.version, &states, &self.pool)
        };
        let sender_id = OwnedUserId::try_from(sender).unwrap();
        let raw = serde_json::value::to_raw_value(&content).unwrap();
        let types =
            spindle_core::auth::auth_types(&rules, kind, &sender_id, state_key, &raw).unwrap();
        let mut auth_events: Vec<OwnedEventId> = Vec::new();
        for (t, k) in types {
            if let Some(p) = before.get(&(t, k))
                && !auth_events.contains(&p.event_id)
            {
                auth_events.push(p.event_id.clone());
            }
        }
        self.ts += rng.random_range(1..500);
        let depth = prevs
            .iter()
            .filter_map(|p| self.pool.get(p))
            .map(|p| p.depth)
            .max()
            .unwrap_or(0)
            + 1;
        let pdu = PduTemplate {
            room_version: self.version.clone(),
            room_id: self.room_id.clone(),
            sender: sender_id,
            kind: kind.into(),
            state_key: state_key.map(str::to_owned),
            content,
            redacts: None,
            prev_events: prevs.to_vec(),
            auth_events,
            depth,
            origin_server_ts: self.ts,
        }
        .build_with_references(&self.key, &|id| {
            self.pool.get(id).and_then(|p| p.reference_hash().ok())
        })
        .unwrap();
        let auth_map = pdu
            .auth_events
            .iter()
            .filter_map(|id| self.pool.get(id).map(|p| (id.clone(), &**p)))
            .chain(
                before
                    .get(&("m.room.create".to_owned(), String::new()))
                    .map(|c| (c.event_id.clone(), &**c)),
            )
            .collect();
        if spindle_core::auth::authorize(&rules, &pdu, &auth_map, |t, k| {
            before.get(&(t.to_owned(), k.to_owned())).map(|p| &**p)
        })
        .is_err()
        {
            return None;
        }
        self.room_id = Some(pdu.room_id.clone());
        let pdu = Arc::new(pdu);
        self.pool.insert(pdu.event_id.clone(), pdu.clone());
        self.window.push(&pdu, &before);
        Some(pdu)
    }
}

/// The resolution the window must agree with: state resolution v1 for room version 1,
/// ruma's v2 for the others.
fn oracle(version: &str, states: &[&StateMap], pool: &Pool) -> StateMap {
    if version == "1" {
        fork::state_res_v1(version, states).unwrap()
    } else {
        fork::state_res_v2(version, states, pool).unwrap()
    }
}

/// A room of `version` with alice (100), bob (50) and carol (0) joined, public.
fn base(version: &str, rng: &mut StdRng) -> (Room, OwnedEventId) {
    let mut room = Room {
        version: version.into(),
        key: ServerKey::generate("a.example"),
        room_id: if room_version::room_id_from_create(version) {
            None
        } else {
            Some(OwnedRoomId::try_from("!oracle:a.example").unwrap())
        },
        pool: Pool::new(),
        window: ForkWindow::new(4096),
        ts: 1_700_000_000_000,
    };
    // The create event has no prev state: seed the window with an empty predecessor.
    let create = {
        let pdu = PduTemplate {
            room_version: version.into(),
            room_id: room.room_id.clone(),
            sender: OwnedUserId::try_from(ALICE).unwrap(),
            kind: "m.room.create".into(),
            state_key: Some(String::new()),
            content: if version == "12" {
                json!({})
            } else {
                json!({ "creator": ALICE, "room_version": version })
            },
            redacts: None,
            prev_events: vec![],
            auth_events: vec![],
            depth: 1,
            origin_server_ts: room.ts,
        }
        .build(&room.key)
        .unwrap();
        room.room_id = Some(pdu.room_id.clone());
        let pdu = Arc::new(pdu);
        room.pool.insert(pdu.event_id.clone(), pdu.clone());
        room.window.push(&pdu, &StateMap::new());
        pdu
    };
    let mut head = create.event_id.clone();
    let mut users = json!({ ALICE: 100, BOB: 50 });
    if version == "12" {
        // v12: the creator's power is implied and may not be listed.
        users = json!({ BOB: 50 });
    }
    let steps: Vec<(&str, &str, Option<&str>, Value)> = vec![
        (
            ALICE,
            "m.room.member",
            Some(ALICE),
            json!({ "membership": "join" }),
        ),
        (
            ALICE,
            "m.room.power_levels",
            Some(""),
            json!({ "users": users, "users_default": 0, "events_default": 0, "state_default": 50,
                    "ban": 50, "kick": 50, "redact": 50, "invite": 0 }),
        ),
        (
            ALICE,
            "m.room.join_rules",
            Some(""),
            json!({ "join_rule": "public" }),
        ),
        (
            ALICE,
            "m.room.history_visibility",
            Some(""),
            json!({ "history_visibility": "shared" }),
        ),
        (ALICE, "m.room.topic", Some(""), json!({ "topic": "base" })),
        (
            BOB,
            "m.room.member",
            Some(BOB),
            json!({ "membership": "join" }),
        ),
        (
            CAROL,
            "m.room.member",
            Some(CAROL),
            json!({ "membership": "join" }),
        ),
    ];
    for (sender, kind, sk, content) in steps {
        head = room
            .event(&[head], sender, kind, sk, content, rng)
            .unwrap_or_else(|| panic!("base event {kind} refused"))
            .event_id
            .clone();
    }
    (room, head)
}

/// Whether forks may touch power events (forcing state resolution).
#[derive(Clone, Copy)]
enum Mix {
    /// Topics, names, joins, leaves, messages: what the window merge may settle.
    Ordinary,
    /// Also power levels changes, kicks and bans.
    WithPower,
}

/// One side of a fork: `n` random events in a chain after `from`. Returns its head.
fn side(
    room: &mut Room,
    from: &OwnedEventId,
    n: usize,
    tag: &str,
    mix: Mix,
    rng: &mut StdRng,
) -> OwnedEventId {
    let mut head = from.clone();
    for i in 0..n {
        let newcomer = format!("@{tag}{i}:c.example");
        let pick = rng.random_range(0..if matches!(mix, Mix::WithPower) { 9 } else { 7 });
        let ev = match pick {
            0 => room.event(
                std::slice::from_ref(&head),
                CAROL,
                "m.room.message",
                None,
                json!({ "body": format!("{tag}{i}") }),
                rng,
            ),
            1 => {
                let who = if rng.random_bool(0.5) { ALICE } else { BOB };
                room.event(
                    &[head.clone()],
                    who,
                    "m.room.topic",
                    Some(""),
                    json!({ "topic": format!("{tag}{i}") }),
                    rng,
                )
            }
            2 => room.event(
                &[head.clone()],
                BOB,
                "m.room.name",
                Some(""),
                json!({ "name": format!("{tag}{i}") }),
                rng,
            ),
            3 => room.event(
                &[head.clone()],
                &newcomer,
                "m.room.member",
                Some(&newcomer),
                json!({ "membership": "join" }),
                rng,
            ),
            4 => {
                let m = if rng.random_bool(0.5) {
                    "leave"
                } else {
                    "join"
                };
                room.event(
                    &[head.clone()],
                    CAROL,
                    "m.room.member",
                    Some(CAROL),
                    json!({ "membership": m }),
                    rng,
                )
            }
            5 => room.event(
                &[head.clone()],
                CAROL,
                "m.room.avatar",
                Some(""),
                json!({ "url": "mxc://a/b" }),
                rng,
            ),
            6 => room.event(
                &[head.clone()],
                ALICE,
                "org.example.slot",
                Some(tag),
                json!({ "v": i }),
                rng,
            ),
            7 => {
                let level = rng.random_range(0..60);
                let mut users = json!({ BOB: 50, CAROL: level });
                if room.version != "12" {
                    users[ALICE] = json!(100);
                }
                room.event(
                    &[head.clone()],
                    ALICE,
                    "m.room.power_levels",
                    Some(""),
                    json!({ "users": users, "users_default": 0, "events_default": 0, "state_default": 50,
                            "ban": 50, "kick": 50, "redact": 50, "invite": 0 }),
                    rng,
                )
            }
            _ => room.event(
                &[head.clone()],
                BOB,
                "m.room.member",
                Some(CAROL),
                json!({ "membership": "ban" }),
                rng,
            ),
        };
        if let Some(ev) = ev {
            head = ev.event_id.clone();
        }
    }
    head
}

type Resolver = fn(&str, &[&StateMap], &ForkWindow, &Pool) -> (StateMap, ForkCase);

fn window_resolver(
    v: &str,
    states: &[&StateMap],
    w: &ForkWindow,
    pool: &Pool,
) -> (StateMap, ForkCase) {
    fork::resolve(v, states, Some(w), pool).unwrap()
}

/// A wrong merge: every differing slot takes the first state's value.
fn first_side_wins(
    _v: &str,
    states: &[&StateMap],
    _w: &ForkWindow,
    _pool: &Pool,
) -> (StateMap, ForkCase) {
    let mut out = (*states[0]).clone();
    for s in &states[1..] {
        for (slot, p) in s.iter() {
            if !out.contains_key(slot) {
                out.insert(slot.clone(), p.clone());
            }
        }
    }
    (out, ForkCase::Merged)
}

fn ids(s: &StateMap) -> std::collections::BTreeMap<(String, String), String> {
    s.iter()
        .map(|(k, p)| (k.clone(), p.event_id.to_string()))
        .collect()
}

/// Resolves `forks` random forks both ways; returns (disagreements, merged, resolved).
fn run(
    version: &str,
    forks: usize,
    seed: u64,
    mix: Mix,
    resolver: Resolver,
) -> (usize, usize, usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut disagree, mut merged, mut resolved) = (0, 0, 0);
    for f in 0..forks {
        let (mut room, head) = base(version, &mut rng);
        // Some shared history after the base, then the fork.
        let trunk = side(
            &mut room,
            &head,
            rng.random_range(0..4),
            &format!("t{f}x"),
            Mix::Ordinary,
            &mut rng,
        );
        let a = side(
            &mut room,
            &trunk,
            rng.random_range(1..8),
            "a",
            mix,
            &mut rng,
        );
        let b = side(
            &mut room,
            &trunk,
            rng.random_range(1..8),
            "b",
            mix,
            &mut rng,
        );
        let (sa, sb) = (
            room.window.state_after(&a).unwrap().clone(),
            room.window.state_after(&b).unwrap().clone(),
        );
        let states = [&sa, &sb];
        let oracle = oracle(version, &states, &room.pool);
        let (ours, case) = resolver(version, &states, &room.window, &room.pool);
        match case {
            ForkCase::Merged => merged += 1,
            ForkCase::Resolved => resolved += 1,
            ForkCase::Linear => {}
        }
        if ids(&ours) != ids(&oracle) {
            disagree += 1;
        }
    }
    eprintln!(
        "v{version} seed {seed}: {forks} forks, {merged} merged by the window, {resolved} through state resolution, {disagree} disagreements"
    );
    (disagree, merged, resolved)
}

#[test]
fn window_merge_agrees_with_state_resolution_v2_on_random_forks() {
    for version in ["10", "11", "12"] {
        let (disagree, merged, resolved) = run(version, 150, 7, Mix::Ordinary, window_resolver);
        assert_eq!(
            disagree, 0,
            "v{version}: the window merge disagreed with ruma's resolve"
        );
        // Both paths ran: the test is not vacuous.
        assert!(
            merged >= 30,
            "v{version}: only {merged} forks took the window merge"
        );
        assert!(
            resolved >= 10,
            "v{version}: only {resolved} forks needed state resolution"
        );
    }
}

#[test]
fn forks_with_power_events_agree_too() {
    for version in ["10", "12"] {
        let (disagree, _merged, resolved) = run(version, 120, 11, Mix::WithPower, window_resolver);
        assert_eq!(
            disagree, 0,
            "v{version}: disagreement on forks with power events"
        );
        assert!(
            resolved >= 30,
            "v{version}: only {resolved} forks needed state resolution"
        );
    }
}

#[test]
fn a_wrong_merge_is_caught_by_the_oracle() {
    let (disagree, _, _) = run("10", 150, 7, Mix::Ordinary, first_side_wins);
    assert!(
        disagree >= 20,
        "the oracle found only {disagree} disagreements with a wrong merge"
    );
}

#[test]
fn window_merge_agrees_with_state_resolution_v1_on_random_forks() {
    let (disagree, merged, resolved) = run("1", 120, 5, Mix::Ordinary, window_resolver);
    assert_eq!(
        disagree, 0,
        "v1: the window merge disagreed with state resolution v1"
    );
    assert!(
        merged >= 20,
        "v1: only {merged} forks took the window merge"
    );
    assert!(
        resolved >= 5,
        "v1: only {resolved} forks needed state resolution"
    );
    let (disagree, _, _) = run("1", 120, 5, Mix::Ordinary, first_side_wins);
    assert!(
        disagree >= 15,
        "v1: a wrong merge gave only {disagree} disagreements"
    );
}

/// Room version 1: of two concurrent topics the deeper one wins, even when it is the
/// older by timestamp (v2 would order them by timestamp); of two concurrent power
/// levels, the one the other cannot follow under the auth rules wins, whichever is
/// deeper.
#[test]
fn v1_resolution_orders_topics_by_depth_and_power_levels_by_auth() {
    let mut rng = StdRng::seed_from_u64(3);
    let (mut room, head) = base("1", &mut rng);
    let msg = |room: &mut Room, prev: &OwnedEventId, rng: &mut StdRng| {
        room.event(
            std::slice::from_ref(prev),
            CAROL,
            "m.room.message",
            None,
            json!({ "body": "." }),
            rng,
        )
        .unwrap()
        .event_id
        .clone()
    };
    // Side b first (earlier timestamps), two events deeper than side a.
    let b1 = msg(&mut room, &head, &mut rng);
    let b2 = msg(&mut room, &b1, &mut rng);
    let topic_b = room
        .event(
            &[b2],
            BOB,
            "m.room.topic",
            Some(""),
            json!({ "topic": "deep" }),
            &mut rng,
        )
        .unwrap();
    let topic_a = room
        .event(
            std::slice::from_ref(&head),
            ALICE,
            "m.room.topic",
            Some(""),
            json!({ "topic": "late" }),
            &mut rng,
        )
        .unwrap();
    assert!(topic_a.origin_server_ts > topic_b.origin_server_ts);
    assert!(topic_b.depth > topic_a.depth);
    let (sa, sb) = (
        room.window.state_after(&topic_a.event_id).unwrap().clone(),
        room.window.state_after(&topic_b.event_id).unwrap().clone(),
    );
    let (resolved, case) = fork::resolve("1", &[&sa, &sb], Some(&room.window), &room.pool).unwrap();
    assert_eq!(case, ForkCase::Resolved);
    let topic = &resolved[&("m.room.topic".to_owned(), String::new())];
    assert_eq!(topic.event_id, topic_b.event_id);
    // Power levels: alice demotes bob on one side; bob lowers state_default on the
    // other. Whichever is deeper, bob's cannot follow alice's, so alice's stands.
    for bob_deeper in [true, false] {
        let levels = |users: Value, state_default: u64| {
            json!({ "users": users, "users_default": 0, "events_default": 0,
                    "state_default": state_default, "ban": 50, "kick": 50, "redact": 50,
                    "invite": 0 })
        };
        let mut from_a = head.clone();
        let mut from_b = head.clone();
        if bob_deeper {
            from_b = msg(&mut room, &from_b, &mut rng);
        } else {
            from_a = msg(&mut room, &from_a, &mut rng);
        }
        let alice_pl = room
            .event(
                &[from_a],
                ALICE,
                "m.room.power_levels",
                Some(""),
                levels(json!({ ALICE: 100, BOB: 0 }), 50),
                &mut rng,
            )
            .unwrap();
        let bob_pl = room
            .event(
                &[from_b],
                BOB,
                "m.room.power_levels",
                Some(""),
                levels(json!({ ALICE: 100, BOB: 50 }), 40),
                &mut rng,
            )
            .unwrap();
        assert_eq!(bob_pl.depth > alice_pl.depth, bob_deeper);
        let (sa, sb) = (
            room.window.state_after(&alice_pl.event_id).unwrap().clone(),
            room.window.state_after(&bob_pl.event_id).unwrap().clone(),
        );
        for states in [[&sa, &sb], [&sb, &sa]] {
            let (resolved, case) =
                fork::resolve("1", &states, Some(&room.window), &room.pool).unwrap();
            assert_eq!(case, ForkCase::Resolved);
            let pl = &resolved[&("m.room.power_levels".to_owned(), String::new())];
            assert_eq!(pl.event_id, alice_pl.event_id, "bob deeper: {bob_deeper}");
        }
    }
}
