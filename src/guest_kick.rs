//! The guest-kick reactor (spec: client-server API, "Guest Access", "Server
//! behaviour": "If the `m.room.guest_access` event is changed to stop this from being
//! the case, the server MUST set those users' `m.room.member` state to `leave`").
//!
//! A journal consumer with its durable cursor (`<data>/consumers/guest-kick.json`,
//! starting at the journal head the first time): for every `m.room.guest_access`
//! state event applied to a room (sent here or by another server), once the
//! projections have applied it, it reads the room's *current* guest access and, unless
//! it is `can_join`, leaves every local guest still joined, each by a `SendEvent`
//! command of the guest's own `leave` (as Synapse's `kick_guest_users` does: the guest
//! is the sender, so no power level is needed). At least once: a leave repeated after
//! a restart finds the guest gone and appends nothing (the membership precondition).
//!
//! Cost: nothing on a server that never had a guest (the cursor file remembers whether
//! an `AccountRegistered` with `guest: true` went by, so ordinary rooms' creation
//! reads nothing here); else a change whose own content is `can_join` costs nothing,
//! and any other change one state lookup and one scan of the room's members, which is
//! rare. Records are searched as bytes before any is parsed.

use std::path::Path;

use spindle_journal::{
    CommandBody, CommandEnvelope, EventSpec, Journal, MembershipPrecondition, SignedCommand,
    StoredRecord,
};
use spindle_projections::Projections;

/// Records read from the journal per step.
const READ_BATCH: usize = 256;

/// The event type whose changes the reactor watches.
const GUEST_ACCESS: &str = "m.room.guest_access";

/// The cursor-file entry that says whether a guest was ever registered (1) or not (0).
const GUESTS_SEEN: &str = "guests_seen";

/// Whether `needle` occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Whether a record registers a guest account.
fn registers_guest(rec: &StoredRecord) -> bool {
    !rec.carries_pdu()
        && contains(rec.payload(), b"\"guest\":true")
        && matches!(
            rec.fact(),
            Some(spindle_journal::Fact::AccountRegistered { guest: true, .. })
        )
}

/// Starts the reactor (it runs until `shutdown` turns true). Errors on an unreadable
/// cursor file.
pub(crate) fn start(
    journal: Journal,
    projections: Projections,
    server_name: String,
    consumers_dir: &Path,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<(), String> {
    let mut cursors = journal.cursors(consumers_dir, "guest-kick")?;
    let start = cursors.get("").unwrap_or_else(|| journal.durable_head());
    let seen = cursors.get(GUESTS_SEEN);
    tokio::spawn(async move {
        let run = async {
            // A cursor file made now (a new data directory, or the file removed): the
            // accounts applied up to the start say whether guests exist; once.
            let mut guests_seen = match seen {
                Some(v) => v > 0,
                None => {
                    projections
                        .runtime
                        .wait_for(start, std::time::Duration::from_secs(60))
                        .await;
                    let any = projections.accounts.users().iter().any(|(_, a)| a.guest);
                    if let Err(e) = cursors.set(GUESTS_SEEN, u64::from(any)) {
                        tracing::warn!(error = %e, "guest-kick: cursor not saved");
                    }
                    any
                }
            };
            let mut after = start;
            while let Some(batch) = crate::reactor::read_applied(
                &journal,
                &projections,
                after,
                READ_BATCH,
                "guest-kick",
            )
            .await
            {
                let mut rooms: Vec<String> = Vec::new();
                for rec in &batch {
                    if !guests_seen && registers_guest(rec) {
                        guests_seen = true;
                        if let Err(e) = cursors.set(GUESTS_SEEN, 1) {
                            tracing::warn!(error = %e, "guest-kick: cursor not saved");
                        }
                    }
                    if guests_seen
                        && let Some(room) = guest_access_change(rec)
                        && !rooms.contains(&room)
                    {
                        rooms.push(room);
                    }
                }
                for room in rooms {
                    kick_guests(&journal, &projections, &server_name, &room).await;
                }
                after = batch.last().map(|r| r.position()).unwrap_or(after);
                // A kick is its own command (at least once: repeated after a restart it
                // appends nothing), so the cursor is saved now and then, not per batch.
                if let Err(e) = cursors.advance("", after) {
                    tracing::warn!(error = %e, "guest-kick: cursor not saved");
                }
            }
        };
        tokio::select! {
            _ = run => {}
            _ = shutdown.wait_for(|s| *s) => {}
        }
    });
    Ok(())
}

/// The room of a record that sets `m.room.guest_access` to anything but `can_join`
/// (any record applied to room state). The payload is searched for the type before a
/// PDU is parsed, so other records cost one byte scan.
fn guest_access_change(rec: &StoredRecord) -> Option<String> {
    if !rec.applies_to_state() || !contains(rec.payload(), GUEST_ACCESS.as_bytes()) {
        return None;
    }
    let pdu = rec.room_pdu()?;
    (pdu.kind.to_string() == GUEST_ACCESS
        && pdu.state_key.as_deref() == Some("")
        && pdu.content_value()["guest_access"] != "can_join")
        .then(|| pdu.room_id.to_string())
}

/// Whether the room's current `m.room.guest_access` is `can_join`.
fn allows_guests(projections: &Projections, room_id: &str) -> bool {
    projections
        .state
        .current_root(room_id)
        .and_then(|root| projections.state.lookup(root, GUEST_ACCESS, ""))
        .and_then(|id| projections.timeline.event(&id))
        .is_some_and(|ev| ev.pdu.content_value()["guest_access"] == "can_join")
}

/// Leaves every local guest joined to `room_id`, unless the room allows guests now.
async fn kick_guests(journal: &Journal, projections: &Projections, server: &str, room_id: &str) {
    if allows_guests(projections, room_id) {
        return;
    }
    let suffix = format!(":{server}");
    for (user_id, m) in projections.membership.members(room_id) {
        if m.membership != "join"
            || !user_id.ends_with(&suffix)
            || !projections.accounts.user(&user_id).is_some_and(|a| a.guest)
        {
            continue;
        }
        let envelope = CommandEnvelope {
            principal: user_id.clone(),
            device_id: None,
            issued_at: spindle_api::now_ms(),
            body: CommandBody::SendEvent {
                room_id: room_id.to_owned(),
                event: EventSpec {
                    kind: "m.room.member".into(),
                    state_key: Some(user_id.clone()),
                    content: serde_json::json!({ "membership": "leave" }),
                    redacts: None,
                },
                txn_id: None,
                precondition: Some(MembershipPrecondition {
                    allowed: vec!["join".into()],
                    unchanged_ok: true,
                }),
            },
        };
        let result = match SignedCommand::sign(journal.key(), envelope) {
            Ok(cmd) => journal.submit(cmd).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match result {
            Ok(_) => {
                tracing::info!(user = %user_id, room = %room_id, "guest-kick: guest left the room (guest access turned off)")
            }
            Err(e) => {
                tracing::warn!(user = %user_id, room = %room_id, error = %e, "guest-kick: leave failed")
            }
        }
    }
}
