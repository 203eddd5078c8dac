//! Membership projection: per-user room memberships, per-room member lists, and a
//! per-user log of membership changes, whose latest position tells a waiting `/sync`
//! that the user's room list changed.
//!
//! Tables:
//! - `user_rooms`: user, 0x00, room -> [`Membership`] JSON
//! - `room_members`: room, 0x00, user -> [`Membership`] JSON
//! - `user_log`: user, 0x00, position BE -> room id

use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, LastChange, ProjectionDb, Table, key},
};

/// A user's membership in a room, as of the latest member event.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Membership {
    /// `join`, `invite`, `leave`, `ban` or `knock`.
    pub membership: String,
    /// Position of the member event.
    pub position: u64,
    /// The member event's id.
    pub event_id: String,
    /// Who sent the member event (differs from the user for invites, kicks, bans).
    pub sender: String,
    /// `displayname` from the member event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub displayname: Option<String>,
    /// `avatar_url` from the member event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avatar_url: Option<String>,
    /// The user forgot the room (spec: `/forget`); cleared by the next member event.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub forgotten: bool,
}

/// The membership projection.
pub struct Memberships {
    user_rooms: Table,
    room_members: Table,
    user_log: Table,
    last: LastChange,
}

fn decode(v: &[u8]) -> Option<Membership> {
    serde_json::from_slice(v).ok()
}

impl Memberships {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Memberships, String> {
        Ok(Memberships {
            user_rooms: db.table("membership", "user_rooms")?,
            room_members: db.table("membership", "room_members")?,
            user_log: db.table("membership", "user_log")?,
            last: LastChange::default(),
        })
    }

    /// Every room the user has a membership in (any state), with that membership.
    pub fn rooms_of(&self, user_id: &str) -> Vec<(String, Membership)> {
        let prefix = key::prefix(&[user_id]);
        self.user_rooms
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    String::from_utf8_lossy(&k[prefix.len()..]).into_owned(),
                    decode(&v)?,
                ))
            })
            .collect()
    }

    /// The user's current membership in a room.
    pub fn get(&self, room_id: &str, user_id: &str) -> Option<Membership> {
        decode(&self.user_rooms.get(&key::join(&[user_id, room_id]))?)
    }

    /// Every member of a room (any membership), ordered by user id.
    pub fn members(&self, room_id: &str) -> Vec<(String, Membership)> {
        let prefix = key::prefix(&[room_id]);
        self.room_members
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    String::from_utf8_lossy(&k[prefix.len()..]).into_owned(),
                    decode(&v)?,
                ))
            })
            .collect()
    }

    /// Position of the user's latest membership change (memory after the first ask).
    pub fn last_change(&self, user_id: &str) -> u64 {
        self.last.get(user_id, &self.user_log)
    }
}

impl Projection for Memberships {
    fn name(&self) -> &'static str {
        "membership"
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.user_rooms.clone(),
            self.room_members.clone(),
            self.user_log.clone(),
        ]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if let Some(Fact::RoomForgotten { user_id, room_id }) = record.fact() {
            let k = key::join(&[&user_id, &room_id]);
            if let Some(mut m) = ctx.get(&self.user_rooms, &k).and_then(|v| decode(&v)) {
                m.forgotten = true;
                ctx.put(
                    &self.user_rooms,
                    k,
                    serde_json::to_vec(&m).map_err(|e| e.to_string())?,
                );
            }
            return Ok(());
        }
        // Outliers (state imported on a remote join) and resolved state count too.
        if !record.applies_to_state() {
            return Ok(());
        }
        let pdu = record.room_pdu().ok_or("unreadable PDU")?;
        if pdu.kind.to_string() != "m.room.member" {
            return Ok(());
        }
        let Some(user) = pdu.state_key.clone() else {
            return Ok(());
        };
        let content = pdu.content_value();
        let m = Membership {
            membership: content
                .get("membership")
                .and_then(|v| v.as_str())
                .unwrap_or("leave")
                .to_owned(),
            position: record.position(),
            event_id: pdu.event_id.to_string(),
            sender: pdu.sender.to_string(),
            displayname: content
                .get("displayname")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
            avatar_url: content
                .get("avatar_url")
                .and_then(|v| v.as_str())
                .map(str::to_owned),
            forgotten: false,
        };
        let room = pdu.room_id.to_string();
        let bytes = serde_json::to_vec(&m).map_err(|e| e.to_string())?;
        ctx.put(&self.user_rooms, key::join(&[&user, &room]), bytes.clone());
        ctx.put(&self.room_members, key::join(&[&room, &user]), bytes);
        ctx.put(
            &self.user_log,
            key::with_pos(&[&user], record.position()),
            room.into_bytes(),
        );
        let (last, pos) = (self.last.clone(), record.position());
        ctx.after_commit(move || last.bump(user, pos));
        Ok(())
    }
}
