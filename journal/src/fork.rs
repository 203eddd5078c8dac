//! The fork window: how a room's state stays right when another server's events fork
//! the room's history (BRIEF §3.8, SPEC §4b "Forks").
//!
//! A room whose events all come through this server is a chain and never needs any of
//! this. A room another server takes part in keeps, for its last `fork_window` events
//! (default [`DEFAULT_FORK_WINDOW`]), the state *after* each of them as a persistent map
//! ([`StateMap`], structural sharing: one event costs one path of the map, not a copy).
//! The room state *before* a remote event is then (spec: room version 2+, "the state
//! before E is the resolution of the states after its `prev_events`"):
//!
//! - the current state, when its `prev_events` are exactly the forward extremities (the
//!   common case: no fork, nothing resolved);
//! - otherwise the resolution of the states after each of its `prev_events`, looked up
//!   in the window.
//!
//! The current state is the resolution of the states after every forward extremity.
//!
//! Resolution ([`resolve`]) first tries the window merge: every slot on which the states
//! differ is a non-power slot, one candidate replaced all the others along the window's
//! history, each replacement later by (`origin_server_ts`, event id) than what it
//! replaced (the order state resolution v2 applies them in), and every winner still
//! passes the auth rules against the merged state. Such a fork needs no state
//! resolution: its sides touched disjoint slots, or one slot one after the other.
//! Anything else (two sides that both changed one slot, a power event on a side, a
//! history older than the window) goes through ruma's state resolution v2
//! (`ruma::state_res::resolve`, with the conflicted state subgraph of v2.1 from room
//! version 12). `journal/tests/state_res_oracle.rs` resolves random forks both ways and
//! requires equal answers.
//!
//! A `prev_event` older than the window has no recorded state: it is taken as the
//! current state (counted in [`crate::JournalStats`] `forks_beyond_window`), which is
//! what applying the event in log order gave before the window existed.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque},
    sync::Arc,
};

use ruma::{OwnedEventId, events::StateEventType, state_res::StateMap as RumaStateMap};
use spindle_core::{pdu::Pdu, room_version};

/// A state slot: (event type, state key).
pub type Slot = (String, String);

/// A room state: slot -> the state event that holds it. Cloning is O(1).
pub type StateMap = imbl::HashMap<Slot, Arc<Pdu>>;

/// Events a room's fork window remembers the state after (the seeds' 512: a fork deeper
/// than this on either side has no recorded state to resolve against).
pub const DEFAULT_FORK_WINDOW: usize = 512;

/// How a set of states was resolved: what the fork-case counters count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForkCase {
    /// One state, or identical states: nothing to resolve.
    Linear,
    /// The states differed only in ways the window merge settles (module docs).
    Merged,
    /// State resolution v2 ran.
    Resolved,
}

/// One event of the window.
#[derive(Clone)]
struct WindowEvent {
    state_after: StateMap,
    /// For a state event: the event that held its slot in the state before it.
    replaced: Option<OwnedEventId>,
}

/// The last events of a room with the state after each (module docs).
#[derive(Clone)]
pub struct ForkWindow {
    cap: usize,
    order: VecDeque<OwnedEventId>,
    events: HashMap<OwnedEventId, WindowEvent>,
}

impl ForkWindow {
    /// An empty window remembering at most `cap` events (at least 1).
    pub fn new(cap: usize) -> ForkWindow {
        ForkWindow {
            cap: cap.max(1),
            order: VecDeque::new(),
            events: HashMap::new(),
        }
    }

    /// Events remembered now.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Most events remembered.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The remembered events oldest first, each with the state after it and, for a
    /// state event, the event that held its slot before it (what snapshots store).
    pub(crate) fn entries(
        &self,
    ) -> impl Iterator<Item = (&OwnedEventId, &StateMap, Option<&OwnedEventId>)> {
        self.order.iter().map(|id| {
            let e = &self.events[id];
            (id, &e.state_after, e.replaced.as_ref())
        })
    }

    /// A window holding `entries` (oldest first, as [`ForkWindow::entries`] gives them).
    /// Errors: more entries than `cap`, or an event twice.
    pub(crate) fn from_entries(
        cap: usize,
        entries: Vec<(OwnedEventId, StateMap, Option<OwnedEventId>)>,
    ) -> Result<ForkWindow, String> {
        let mut w = ForkWindow::new(cap);
        if entries.len() > w.cap {
            return Err(format!(
                "{} window events for a window of {cap}",
                entries.len()
            ));
        }
        for (id, state_after, replaced) in entries {
            w.order.push_back(id.clone());
            let event = WindowEvent {
                state_after,
                replaced,
            };
            if w.events.insert(id.clone(), event).is_some() {
                return Err(format!("{id} twice in the window"));
            }
        }
        Ok(w)
    }

    /// The state after `event_id`, if the window holds it.
    pub fn state_after(&self, event_id: &OwnedEventId) -> Option<&StateMap> {
        self.events.get(event_id).map(|e| &e.state_after)
    }

    /// Remembers `pdu` with the state before it; returns the state after it.
    pub fn push(&mut self, pdu: &Arc<Pdu>, before: &StateMap) -> StateMap {
        let mut after = before.clone();
        let mut replaced = None;
        if let Some(sk) = &pdu.state_key {
            let slot = (pdu.kind.to_string(), sk.clone());
            replaced = before.get(&slot).map(|p| p.event_id.clone());
            after.insert(slot, pdu.clone());
        }
        if self.order.len() == self.cap
            && let Some(old) = self.order.pop_front()
        {
            self.events.remove(&old);
        }
        self.order.push_back(pdu.event_id.clone());
        self.events.insert(
            pdu.event_id.clone(),
            WindowEvent {
                state_after: after.clone(),
                replaced,
            },
        );
        after
    }

    /// Whether `winner` replaced `loser` (`None`: the slot was empty) along the
    /// window's history, each step later by (`origin_server_ts`, event id).
    fn supersedes(&self, winner: &Pdu, loser: Option<&Pdu>, pool: &Pool) -> bool {
        let mut at = winner;
        loop {
            let Some(w) = self.events.get(&at.event_id) else {
                // Left the window without meeting the loser: not provable here.
                return false;
            };
            match (&w.replaced, loser) {
                (None, None) => return true,
                (None, Some(_)) => return false,
                (Some(r), _) => {
                    let Some(prev) = pool.get(r) else {
                        return false;
                    };
                    if order_key(prev) >= order_key(at) {
                        return false;
                    }
                    if loser.is_some_and(|l| l.event_id == *r) {
                        return true;
                    }
                    at = prev;
                }
            }
        }
    }
}

fn order_key(p: &Pdu) -> (u64, &str) {
    (u64::from(p.origin_server_ts.0), p.event_id.as_str())
}

/// Every event resolution may need, by id.
pub type Pool = HashMap<OwnedEventId, Arc<Pdu>>;

/// Spec "power event": power levels, join rules, create, or a member event that removes
/// someone else (leave or ban with a sender other than the state key).
pub fn is_power_event(p: &Pdu) -> bool {
    match p.kind.to_string().as_str() {
        "m.room.power_levels" | "m.room.join_rules" | "m.room.create" => {
            p.state_key.as_deref() == Some("")
        }
        "m.room.member" => {
            let m = p.content_value();
            let m = m.get("membership").and_then(|m| m.as_str());
            matches!(m, Some("leave") | Some("ban"))
                && p.state_key.as_deref() != Some(p.sender.as_str())
        }
        _ => false,
    }
}

/// The slots on which `states` differ, with each state's value there (in state order).
pub fn differing(states: &[&StateMap]) -> BTreeMap<Slot, Vec<Option<Arc<Pdu>>>> {
    let mut out = BTreeMap::new();
    let Some(first) = states.first() else {
        return out;
    };
    let mut slots: BTreeSet<&Slot> = BTreeSet::new();
    for s in states {
        // Two maps that share their root share every entry: nothing to compare.
        if s.ptr_eq(first) {
            continue;
        }
        for (slot, pdu) in s.iter() {
            if first.get(slot).is_none_or(|f| f.event_id != pdu.event_id) {
                slots.insert(slot);
            }
        }
        for slot in first.keys() {
            if !s.contains_key(slot) {
                slots.insert(slot);
            }
        }
    }
    for slot in slots {
        out.insert(
            slot.clone(),
            states.iter().map(|s| s.get(slot).cloned()).collect(),
        );
    }
    out
}

/// Resolves `states` (module docs): the window merge when it applies, else state
/// resolution v2. `window` proves supersession for the merge; `pool` holds every event
/// the room's auth chains and states name (auth history, window state events). A state
/// resolution that fails (an event missing from `pool`) falls back to the first state
/// and says why.
pub fn resolve(
    version: &str,
    states: &[&StateMap],
    window: Option<&ForkWindow>,
    pool: &Pool,
) -> Result<(StateMap, ForkCase), String> {
    let diff = differing(states);
    let Some(first) = states.first() else {
        return Ok((StateMap::new(), ForkCase::Linear));
    };
    if diff.is_empty() {
        return Ok(((*first).clone(), ForkCase::Linear));
    }
    if let Some(w) = window
        && let Some(merged) = window_merge(version, first, &diff, w, pool)
    {
        return Ok((merged, ForkCase::Merged));
    }
    let v1 = room_version::rules(version).is_some_and(|r| r.state_res.v2_rules().is_none());
    if v1 {
        state_res_v1(version, states).map(|s| (s, ForkCase::Resolved))
    } else {
        state_res_v2(version, states, pool).map(|s| (s, ForkCase::Resolved))
    }
}

/// The window merge (module docs), or `None` when the fork needs state resolution.
fn window_merge(
    version: &str,
    first: &StateMap,
    diff: &BTreeMap<Slot, Vec<Option<Arc<Pdu>>>>,
    window: &ForkWindow,
    pool: &Pool,
) -> Option<StateMap> {
    let mut merged = first.clone();
    let mut winners = Vec::new();
    for (slot, values) in diff {
        let mut candidates: Vec<Option<&Arc<Pdu>>> = Vec::new();
        for v in values {
            if !candidates
                .iter()
                .any(|c| c.map(|p| &p.event_id) == v.as_ref().map(|p| &p.event_id))
            {
                candidates.push(v.as_ref());
            }
        }
        if candidates.iter().flatten().any(|p| is_power_event(p)) {
            return None;
        }
        let winner = candidates.iter().flatten().find(|w| {
            candidates
                .iter()
                .filter(|c| c.map(|p| &p.event_id) != Some(&w.event_id))
                .all(|c| window.supersedes(w, c.map(|p| &**p), pool))
        })?;
        merged.insert(slot.clone(), (*winner).clone());
        winners.push((*winner).clone());
    }
    let rules = room_version::rules(version)?;
    for w in &winners {
        let auth: HashMap<OwnedEventId, &Pdu> = w
            .auth_events
            .iter()
            .filter_map(|id| pool.get(id).map(|p| (id.clone(), &**p)))
            .chain(
                merged
                    .get(&("m.room.create".to_owned(), String::new()))
                    .map(|c| (c.event_id.clone(), &**c)),
            )
            .collect();
        spindle_core::auth::authorize(&rules, w, &auth, |t, k| {
            merged.get(&(t.to_owned(), k.to_owned())).map(|p| &**p)
        })
        .ok()?;
    }
    Some(merged)
}

/// Every event reachable from `ids` through `auth_events` (the ids included).
fn auth_closure<'a>(
    ids: impl IntoIterator<Item = &'a OwnedEventId>,
    pool: &Pool,
) -> HashSet<OwnedEventId> {
    let mut seen = HashSet::new();
    let mut stack: Vec<OwnedEventId> = ids.into_iter().cloned().collect();
    while let Some(id) = stack.pop() {
        if !seen.insert(id.clone()) {
            continue;
        }
        if let Some(p) = pool.get(&id) {
            stack.extend(p.auth_events.iter().cloned());
        }
    }
    seen
}

/// State resolution v1, for room version 1 (spec: room version 1, "State resolution";
/// ruma implements only v2). The states' union is taken slot by slot: a slot only some
/// states hold is not conflicted (v1 has no notion of absent state). Conflicted power
/// levels, then join rules, then memberships are settled one slot at a time against the
/// unconflicted state plus what was settled so far: their candidates in ascending depth
/// (ties: descending SHA-1 of the event id), each replacing the last as long as it
/// passes the auth rules; the first to fail stops the slot at its predecessor. Every
/// other conflicted slot takes the first candidate by descending depth (ties:
/// ascending SHA-1) that passes the auth rules, else the last one. This is the order
/// Synapse applies (its `state/v1.py`), which the spec's text describes.
pub fn state_res_v1(version: &str, states: &[&StateMap]) -> Result<StateMap, String> {
    use sha1::Digest as _;
    let rules = room_version::rules(version).ok_or("unsupported room version")?;
    let mut resolved = StateMap::new();
    let mut conflicted: BTreeMap<Slot, Vec<Arc<Pdu>>> = BTreeMap::new();
    for s in states {
        for (slot, p) in s.iter() {
            let list = conflicted.entry(slot.clone()).or_default();
            if !list.iter().any(|q| q.event_id == p.event_id) {
                list.push(p.clone());
            }
        }
    }
    conflicted.retain(|slot, list| {
        if list.len() == 1 {
            resolved.insert(slot.clone(), list[0].clone());
            false
        } else {
            true
        }
    });
    let sha1_hex = |p: &Pdu| {
        let digest = sha1::Sha1::digest(p.event_id.as_str().as_bytes());
        digest
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    // Descending depth, then ascending SHA-1 of the id.
    let ordered = |list: &[Arc<Pdu>]| -> Vec<Arc<Pdu>> {
        let mut v: Vec<(u64, String, Arc<Pdu>)> = list
            .iter()
            .map(|p| (p.depth, sha1_hex(p), p.clone()))
            .collect();
        v.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        v.into_iter().map(|(_, _, p)| p).collect()
    };
    let passes = |p: &Pdu, state: &StateMap| {
        spindle_core::auth::authorize_against_state(&rules, p, |t, k| {
            state.get(&(t.to_owned(), k.to_owned())).map(|e| &**e)
        })
        .is_ok()
    };
    let auth_slot =
        |kind: &str, resolved: &mut StateMap, conflicted: &BTreeMap<Slot, Vec<Arc<Pdu>>>| {
            for (slot, list) in conflicted.iter().filter(|(slot, _)| slot.0 == kind) {
                let mut ascending = ordered(list);
                ascending.reverse();
                let mut state = resolved.clone();
                let mut winner = ascending[0].clone();
                for p in &ascending[1..] {
                    state.insert(slot.clone(), winner.clone());
                    if !passes(p, &state) {
                        break;
                    }
                    winner = p.clone();
                }
                resolved.insert(slot.clone(), winner);
            }
        };
    for kind in ["m.room.power_levels", "m.room.join_rules", "m.room.member"] {
        auth_slot(kind, &mut resolved, &conflicted);
    }
    let settled = resolved.clone();
    for (slot, list) in &conflicted {
        if settled.contains_key(slot) {
            continue;
        }
        let candidates = ordered(list);
        let winner = candidates
            .iter()
            .find(|p| passes(p, &settled))
            .unwrap_or_else(|| candidates.last().expect("a conflicted slot has candidates"));
        resolved.insert(slot.clone(), winner.clone());
    }
    Ok(resolved)
}

/// State resolution v2 (v2.1 for room version 12) through ruma.
pub fn state_res_v2(version: &str, states: &[&StateMap], pool: &Pool) -> Result<StateMap, String> {
    let rules = room_version::rules(version).ok_or("unsupported room version")?;
    let v2 = rules
        .state_res
        .v2_rules()
        .ok_or("room version 1 forks need state resolution v1, which is not implemented")?;
    let ruma_maps: Vec<RumaStateMap<OwnedEventId>> = states
        .iter()
        .map(|s| {
            s.iter()
                .map(|((t, k), p)| {
                    (
                        (StateEventType::from(t.as_str()), k.clone()),
                        p.event_id.clone(),
                    )
                })
                .collect()
        })
        .collect();
    // Each state's auth chain: the events its state events cite, recursively.
    let auth_chains: Vec<ruma::state_res::utils::event_id_set::EventIdSet<OwnedEventId>> = states
        .iter()
        .map(|s| {
            let cited = s.values().flat_map(|p| p.auth_events.iter());
            auth_closure(cited, pool).into_iter().collect()
        })
        .collect();
    let fetch = |id: &ruma::EventId| pool.get(id).cloned();
    let subgraph = |conflicted: &RumaStateMap<Vec<OwnedEventId>>| {
        Some(
            conflicted_subgraph(conflicted.values().flatten(), pool)
                .into_iter()
                .collect(),
        )
    };
    let resolved = ruma::state_res::resolve(
        &rules.authorization,
        v2,
        ruma_maps.iter(),
        auth_chains,
        fetch,
        subgraph,
    )
    .map_err(|e| format!("state resolution failed: {e}"))?;
    let mut out = StateMap::new();
    for ((t, k), id) in resolved {
        let p = pool
            .get(&id)
            .ok_or_else(|| format!("state resolution chose {id}, which is not known here"))?;
        out.insert((t.to_string(), k), p.clone());
    }
    Ok(out)
}

/// The conflicted state subgraph (room version 12, MSC4297): the events on an
/// `auth_events` path from one conflicted state event to another, both ends included.
///
/// The walk keeps its own stack (a remote server decides how deep an auth graph is,
/// so recursion would let it overflow ours) and visits each event once.
fn conflicted_subgraph<'a>(
    conflicted: impl IntoIterator<Item = &'a OwnedEventId>,
    pool: &Pool,
) -> HashSet<OwnedEventId> {
    let conflicted: HashSet<OwnedEventId> = conflicted.into_iter().cloned().collect();
    // reaches[x]: x is conflicted or one of its auth events reaches a conflicted event.
    // An event is entered into `reaches` when first seen (so a malformed, cyclic auth
    // graph ends too) and settled when its last auth event is done.
    let mut reaches: HashMap<OwnedEventId, bool> = HashMap::new();
    fn auth_of<'p>(pool: &'p Pool, id: &OwnedEventId) -> &'p [OwnedEventId] {
        pool.get(id).map_or(&[], |p| p.auth_events.as_slice())
    }
    let mut out = HashSet::new();
    for c in &conflicted {
        out.insert(c.clone());
        for start in auth_of(pool, c) {
            if reaches.contains_key(start) {
                continue;
            }
            reaches.insert(start.clone(), conflicted.contains(start));
            // (event, index of the next auth event to look at)
            let mut stack: Vec<(&OwnedEventId, usize)> = vec![(start, 0)];
            while let Some((id, next)) = stack.last_mut() {
                let id: &OwnedEventId = id;
                if let Some(a) = auth_of(pool, id).get(*next) {
                    *next += 1;
                    match reaches.get(a) {
                        Some(true) => {
                            reaches.insert(id.clone(), true);
                        }
                        Some(false) => {}
                        None => {
                            reaches.insert(a.clone(), conflicted.contains(a));
                            stack.push((a, 0));
                        }
                    }
                } else {
                    let done = reaches.get(id).copied().unwrap_or(false);
                    stack.pop();
                    if done && let Some((parent, _)) = stack.last() {
                        reaches.insert((*parent).clone(), true);
                    }
                }
            }
        }
    }
    // Every event below a conflicted event that leads to another conflicted event.
    let below = auth_closure(conflicted.iter(), pool);
    for id in below {
        if reaches.get(&id).copied().unwrap_or(false) {
            out.insert(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use spindle_core::{keys::ServerKey, pdu::PduTemplate};

    fn event(key: &ServerKey, n: u64, auth: Vec<OwnedEventId>) -> Arc<Pdu> {
        let pdu = PduTemplate {
            room_version: "12".into(),
            room_id: Some("!r:a.test".try_into().unwrap()),
            sender: "@u:a.test".try_into().unwrap(),
            kind: "m.room.member".into(),
            state_key: Some(format!("@u{n}:a.test")),
            content: json!({ "membership": "join" }),
            redacts: None,
            prev_events: vec![],
            auth_events: auth,
            depth: n + 1,
            origin_server_ts: n,
        }
        .build(key)
        .unwrap();
        Arc::new(pdu)
    }

    /// Found in review: the walk recursed once per auth event, so a remote auth chain a
    /// few thousand events deep overflowed the stack and took the server down. Two
    /// conflicted events at the ends of a 20,000-event auth chain: the whole chain is
    /// the subgraph, and an event off the path is not.
    #[test]
    fn a_deep_auth_chain_is_walked_without_recursion() {
        let key = ServerKey::generate("a.test");
        let mut pool = Pool::new();
        let off_path = event(&key, 999_999, vec![]);
        pool.insert(off_path.event_id.clone(), off_path.clone());
        let bottom = event(&key, 0, vec![]);
        let mut chain = vec![bottom.event_id.clone()];
        pool.insert(bottom.event_id.clone(), bottom);
        for n in 1..20_000u64 {
            let mut auth = vec![chain.last().unwrap().clone()];
            if n == 1 {
                auth.push(off_path.event_id.clone());
            }
            let e = event(&key, n, auth);
            chain.push(e.event_id.clone());
            pool.insert(e.event_id.clone(), e);
        }
        let ends = [chain[0].clone(), chain.last().unwrap().clone()];
        let got = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || conflicted_subgraph(ends.iter(), &pool))
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(got.len(), chain.len());
        assert!(chain.iter().all(|id| got.contains(id)));
        assert!(!got.contains(&off_path.event_id));
    }
}
