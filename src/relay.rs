//! Typing and presence across the processes of a deployment on a shared journal
//! (SPEC §6 "Ephemeral data", issue 14): both live in each process's memory, so every
//! change made in one process (by a client, or by a federation EDU it received) goes to
//! the others over the journal's ephemeral channel and is applied there as if made
//! locally, minus the relay. A syncing client then sees the same typists and presence
//! on whichever process it uses, and the federation feed on the writer sends our
//! users' changes whatever process they were made on. At most once: a change lost
//! while NATS is unreachable is not repeated (typing expires, presence is refreshed by
//! the next change or [`spindle_api::presence::RELAY_REFRESH_MS`]).

use std::time::Duration;

use spindle_api::{
    presence::Presence,
    typing::{MAX_TYPING_TIMEOUT_MS, Relayed, Typing},
};
use spindle_journal::EphemeralChannel;
use spindle_projections::Projections;

/// Relays this process's typing and presence changes into `channel` and applies the
/// other processes' ones, until the channel closes. `presence_enabled`: `[presence]
/// enabled` (relayed presence is ignored when off, as local presence is).
pub(crate) fn start(
    channel: EphemeralChannel,
    typing: Typing,
    presence: Presence,
    projections: Projections,
    presence_enabled: bool,
) {
    let (tx, mut changes) = tokio::sync::mpsc::unbounded_channel::<Relayed>();
    typing.relay_to(tx);
    let send = channel.send;
    tokio::spawn(async move {
        while let Some(change) = changes.recv().await {
            let Ok(bytes) = serde_json::to_vec(&change) else {
                continue;
            };
            match send.try_send(bytes) {
                Ok(()) | Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {}
                Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return,
            }
        }
    });
    let mut recv = channel.recv;
    tokio::spawn(async move {
        while let Some(bytes) = recv.recv().await {
            match serde_json::from_slice::<Relayed>(&bytes) {
                Ok(Relayed::Typing {
                    room_id,
                    user_id,
                    typing: on,
                    timeout_ms,
                }) => typing.apply_relayed_typing(
                    &room_id,
                    &user_id,
                    on,
                    Duration::from_millis(timeout_ms.min(MAX_TYPING_TIMEOUT_MS)),
                ),
                Ok(Relayed::Presence {
                    user_id,
                    presence: state,
                    status_msg,
                    active_ms,
                }) if presence_enabled => {
                    let rooms = crate::federation_edus::joined_rooms(&projections, &user_id);
                    presence
                        .apply_relayed(&typing, &user_id, &state, status_msg, &rooms, active_ms);
                }
                Ok(Relayed::Presence { .. }) => {}
                Err(e) => tracing::debug!(error = %e, "an unreadable relayed ephemeral change"),
            }
        }
    });
}
