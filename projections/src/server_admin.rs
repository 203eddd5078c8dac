//! Server-admin projection: what the Synapse-compatible admin API
//! (`/_synapse/admin`, see `spindle_api::synapse_admin`) lists and nothing else
//! reads: when each account was created and whether it was erased, media per
//! uploader, event reports, and room shutdowns.
//!
//! Tables:
//! - `users`: user id -> [`UserMeta`] JSON
//! - `user_media`: uploader, 0x00, media id -> empty (the uploader's media; details
//!   are in the `media` projection)
//! - `media_owner`: media id -> uploader (to drop a deleted media id from `user_media`)
//! - `reports`: report id (position of the `ContentReported` record, big-endian) ->
//!   [`EventReport`] JSON; only reports of an event (Synapse's "event reports"), not
//!   of a whole room
//! - `shutdowns`: delete id -> [`Shutdown`] JSON
//! - `room_shutdowns`: room id, 0x00, delete id -> empty
//! - `blocked`: room id -> delete id of the shutdown that blocked it (local joins are
//!   refused)

use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// What the admin API shows about an account beyond the `accounts` projection.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct UserMeta {
    /// When the account was registered, ms since the epoch (the record's append time).
    pub creation_ts: u64,
    /// Deactivated with `erase: true`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub erased: bool,
}

/// One event report (`POST /rooms/{roomId}/report/{eventId}`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct EventReport {
    /// Report id: the position of the `ContentReported` record.
    pub id: u64,
    /// When it was reported, ms since the epoch.
    pub received_ts: u64,
    /// Room of the event.
    pub room_id: String,
    /// The reported event.
    pub event_id: String,
    /// The reporter.
    pub user_id: String,
    /// The reporter's reason.
    pub reason: Option<String>,
    /// The reporter's score (old clients still send it).
    pub score: Option<i64>,
}

/// A room shutdown, as journaled (`RoomShutDown`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Shutdown {
    /// The operation's id.
    pub delete_id: String,
    /// The room shut down.
    pub room_id: String,
    /// The admin who asked.
    pub requester: String,
    /// Local users made to leave.
    pub kicked_users: Vec<String>,
    /// Local users whose leave failed.
    pub failed_to_kick_users: Vec<String>,
    /// Local aliases of the room that were deleted.
    pub local_aliases: Vec<String>,
    /// The room the users were moved to, if one was created.
    pub new_room_id: Option<String>,
    /// When it completed, ms since the epoch.
    pub ts: u64,
}

/// The server-admin projection.
pub struct ServerAdmin {
    users: Table,
    user_media: Table,
    media_owner: Table,
    reports: Table,
    shutdowns: Table,
    room_shutdowns: Table,
    blocked: Table,
}

impl ServerAdmin {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<ServerAdmin, String> {
        Ok(ServerAdmin {
            users: db.table("server_admin", "users")?,
            user_media: db.table("server_admin", "user_media")?,
            media_owner: db.table("server_admin", "media_owner")?,
            reports: db.table("server_admin", "reports")?,
            shutdowns: db.table("server_admin", "shutdowns")?,
            room_shutdowns: db.table("server_admin", "room_shutdowns")?,
            blocked: db.table("server_admin", "blocked")?,
        })
    }

    /// The account's creation time and erasure (one point read); default if unknown.
    pub fn user(&self, user_id: &str) -> UserMeta {
        self.users
            .get(user_id.as_bytes())
            .and_then(|v| serde_json::from_slice(&v).ok())
            .unwrap_or_default()
    }

    /// Every media id `user_id` uploaded (or reserved), ordered by media id.
    pub fn media_of(&self, user_id: &str) -> Vec<String> {
        let prefix = key::prefix(&[user_id]);
        self.user_media
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .map(|(k, _)| String::from_utf8_lossy(&k[prefix.len()..]).into_owned())
            .collect()
    }

    /// Every event report, oldest first.
    pub fn reports(&self) -> Vec<EventReport> {
        self.reports
            .scan_prefix(&[], usize::MAX)
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect()
    }

    /// One event report (one point read).
    pub fn report(&self, id: u64) -> Option<EventReport> {
        serde_json::from_slice(&self.reports.get(&id.to_be_bytes())?).ok()
    }

    /// One shutdown by delete id.
    pub fn shutdown(&self, delete_id: &str) -> Option<Shutdown> {
        serde_json::from_slice(&self.shutdowns.get(delete_id.as_bytes())?).ok()
    }

    /// Whether a shutdown blocked the room (one point read).
    pub fn is_blocked(&self, room_id: &str) -> bool {
        self.blocked.get(room_id.as_bytes()).is_some()
    }

    /// Every shutdown of a room, ordered by delete id.
    pub fn shutdowns_of(&self, room_id: &str) -> Vec<Shutdown> {
        let prefix = key::prefix(&[room_id]);
        self.room_shutdowns
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, _)| self.shutdown(&String::from_utf8_lossy(&k[prefix.len()..])))
            .collect()
    }
}

fn json<T: Serialize>(v: &T) -> Result<Vec<u8>, String> {
    serde_json::to_vec(v).map_err(|e| e.to_string())
}

impl Projection for ServerAdmin {
    fn name(&self) -> &'static str {
        "server_admin"
    }

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.users.clone(),
            self.user_media.clone(),
            self.media_owner.clone(),
            self.reports.clone(),
            self.shutdowns.clone(),
            self.room_shutdowns.clone(),
            self.blocked.clone(),
        ]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let ts = record.appended_at();
        match record.fact() {
            Some(Fact::AccountRegistered { user_id, .. }) => {
                let meta = UserMeta {
                    creation_ts: ts,
                    erased: false,
                };
                ctx.put(&self.users, user_id.into_bytes(), json(&meta)?);
            }
            Some(Fact::AccountDeactivated {
                user_id,
                erase: true,
            }) => {
                let mut meta: UserMeta = ctx
                    .get(&self.users, user_id.as_bytes())
                    .and_then(|v| serde_json::from_slice(&v).ok())
                    .unwrap_or_default();
                meta.erased = true;
                ctx.put(&self.users, user_id.into_bytes(), json(&meta)?);
            }
            Some(
                Fact::MediaCreated { media_id, uploader }
                | Fact::MediaUploaded {
                    media_id, uploader, ..
                },
            ) => {
                ctx.put(
                    &self.user_media,
                    key::join(&[&uploader, &media_id]),
                    Vec::new(),
                );
                ctx.put(
                    &self.media_owner,
                    media_id.into_bytes(),
                    uploader.into_bytes(),
                );
            }
            Some(Fact::MediaDeleted { media_id }) => {
                if let Some(owner) = ctx.get(&self.media_owner, media_id.as_bytes()) {
                    let owner = String::from_utf8_lossy(&owner).into_owned();
                    ctx.delete(&self.user_media, key::join(&[&owner, &media_id]));
                    ctx.delete(&self.media_owner, media_id.into_bytes());
                }
            }
            Some(Fact::ContentReported {
                reporter,
                room_id,
                event_id: Some(event_id),
                reason,
                score,
            }) => {
                let report = EventReport {
                    id: record.position(),
                    received_ts: ts,
                    room_id,
                    event_id,
                    user_id: reporter,
                    reason,
                    score,
                };
                ctx.put(
                    &self.reports,
                    record.position().to_be_bytes().to_vec(),
                    json(&report)?,
                );
            }
            Some(Fact::ContentReportDeleted { report_id }) => {
                ctx.delete(&self.reports, report_id.to_be_bytes().to_vec());
            }
            Some(Fact::RoomShutDown {
                room_id,
                delete_id,
                requester,
                kicked_users,
                failed_to_kick_users,
                local_aliases,
                new_room_id,
                block,
                ..
            }) => {
                if block {
                    ctx.put(
                        &self.blocked,
                        room_id.clone().into_bytes(),
                        delete_id.clone().into_bytes(),
                    );
                }
                ctx.put(
                    &self.room_shutdowns,
                    key::join(&[&room_id, &delete_id]),
                    Vec::new(),
                );
                let shutdown = Shutdown {
                    delete_id: delete_id.clone(),
                    room_id,
                    requester,
                    kicked_users,
                    failed_to_kick_users,
                    local_aliases,
                    new_room_id,
                    ts,
                };
                ctx.put(&self.shutdowns, delete_id.into_bytes(), json(&shutdown)?);
            }
            _ => {}
        }
        Ok(())
    }
}
