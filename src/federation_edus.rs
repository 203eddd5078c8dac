//! Typing and presence over federation: the glue between the api crate's in-memory
//! state and the federation crate (which never imports the api crate).
//!
//! - [`Sink`] receives typing and presence EDUs from other servers
//!   ([`spindle_federation::edus::EphemeralSink`]) and records them like local ones.
//! - [`run_feed`] watches the same state for changes by our own users and queues the
//!   EDUs on the federation sender: `m.typing` per (room, user) that started or stopped
//!   typing, to the other servers in the room; `m.presence` batched per destination
//!   (one EDU with every changed user), to the servers that share a room with each
//!   user, when `[federation] presence` and `[presence] enabled` are on. Changes made
//!   by remote users are never echoed back.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::{Value, json};
use spindle_api::{presence::Presence, typing::Typing};
use spindle_federation::{edus::EphemeralSink, sender::FederationSender, server_of};
use spindle_projections::Projections;

/// Records remote typing and presence in the api crate's state.
pub struct Sink {
    /// Typing state (also the counter presence changes take their values from).
    pub typing: Typing,
    /// Presence state.
    pub presence: Presence,
    /// Joined rooms of a remote user, under which its presence is recorded.
    pub projections: Projections,
}

pub(crate) fn joined_rooms(p: &Projections, user_id: &str) -> Vec<String> {
    p.membership
        .rooms_of(user_id)
        .into_iter()
        .filter(|(_, m)| m.membership == "join")
        .map(|(r, _)| r)
        .collect()
}

impl EphemeralSink for Sink {
    fn typing(&self, room_id: &str, user_id: &str, typing: bool, timeout_ms: u64) {
        self.typing.set(
            room_id,
            user_id,
            typing,
            std::time::Duration::from_millis(timeout_ms),
        );
    }

    fn presence(
        &self,
        user_id: &str,
        presence: &str,
        status_msg: Option<String>,
        last_active_ago: u64,
    ) {
        let rooms = joined_rooms(&self.projections, user_id);
        if rooms.is_empty() {
            // No room shared with anyone here: nobody could see it.
            return;
        }
        let last_active = spindle_api::now_ms().saturating_sub(last_active_ago);
        self.presence.set(
            &self.typing,
            user_id,
            presence,
            Some(status_msg),
            &rooms,
            last_active,
        );
    }
}

/// Queues our users' typing and presence changes on the federation sender until
/// `shutdown` (see the module docs). `send_presence`: `[federation] presence` and
/// `[presence] enabled` both on.
pub async fn run_feed(
    sender: FederationSender,
    typing: Typing,
    presence: Presence,
    server_name: String,
    send_presence: bool,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let ours = |u: &str| server_of(u) == Some(server_name.as_str());
    let mut changes = typing.subscribe();
    let mut seen = typing.current();
    // Our users typing per room, as last sent.
    let mut typists: HashMap<String, BTreeSet<String>> = HashMap::new();
    loop {
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = shutdown.changed() => return,
        }
        let before = seen;
        for (room_id, serial) in typing.rooms_changed_after(before) {
            seen = seen.max(serial);
            let now: BTreeSet<String> = typing
                .users(&room_id)
                .into_iter()
                .filter(|u| ours(u))
                .collect();
            let was = typists.remove(&room_id).unwrap_or_default();
            for (user, on) in now
                .difference(&was)
                .map(|u| (u, true))
                .chain(was.difference(&now).map(|u| (u, false)))
            {
                let edu = json!({
                    "edu_type": "m.typing",
                    "content": { "room_id": room_id, "user_id": user, "typing": on },
                });
                sender.queue_room_edu(&room_id, edu).await;
            }
            if !now.is_empty() {
                typists.insert(room_id, now);
            }
        }
        let (changed, upto) = presence.changed_after_with_rooms(before);
        seen = seen.max(upto);
        if !send_presence {
            continue;
        }
        let now_ms = spindle_api::now_ms();
        let mut per_dest: BTreeMap<String, Vec<Value>> = BTreeMap::new();
        // The rooms each change was recorded under are the user's joined rooms at the
        // change (kept in memory by the presence state: no store read here).
        for (user, rooms) in changed.into_iter().filter(|(u, _)| ours(u)) {
            let Some(c) = presence.content(&user, now_ms) else {
                continue;
            };
            let mut entry = json!({
                "user_id": user,
                "presence": c["presence"],
                "last_active_ago": c["last_active_ago"],
                "currently_active": c["currently_active"],
            });
            if let Some(m) = c.get("status_msg") {
                entry["status_msg"] = m.clone();
            }
            let mut dests = BTreeSet::new();
            for room in rooms {
                dests.extend(sender.other_servers(&room).await);
            }
            for d in dests {
                per_dest.entry(d).or_default().push(entry.clone());
            }
        }
        for (dest, push) in per_dest {
            let edu = json!({ "edu_type": "m.presence", "content": { "push": push } });
            sender.queue_edu(&dest, edu);
        }
    }
}
