//! Room directory projections: what the public room directory, the user directory
//! and `/timestamp_to_event` need, kept so each answer reads rows, not rooms.
//!
//! [`Directory`] tables:
//! - `published`: room id -> empty, for rooms whose directory visibility is `public`
//!   (`RoomVisibilitySet` facts)
//! - `public_join`: room id -> empty, for rooms whose current `m.room.join_rules` is
//!   `public` (the user directory searches their members)
//! - `join_rules`: room id -> the current `join_rule` (one point read, whatever the
//!   room's size, for the join path to decide whether a join is restricted)
//! - `members`: room, 0x00, user -> membership (to know a member event's transition)
//! - `joined`: room id -> joined member count (u64 BE), maintained per member event so
//!   a directory entry's `num_joined_members` is one point read
//! - `network_published`: `<appservice id>|<network id>`, 0x00, room id -> empty, for
//!   rooms an application service listed for one network (`AppserviceRoomListed`)
//!
//! [`EventTimes`] table (layout [`EVENT_TIMES_LAYOUT`]):
//! - `by_ts`: room, 0x00, origin_server_ts BE, position BE -> empty, so "the first
//!   event at or after / at or before time T" is one range seek; the event at a
//!   position is the timeline's `room_events` row (layout 1 kept the event id here
//!   too, about 35 bytes an event on disk, issue 18 item 5).

use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// The directory projection.
pub struct Directory {
    published: Table,
    public_join: Table,
    join_rules: Table,
    members: Table,
    joined: Table,
    network_published: Table,
}

impl Directory {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Directory, String> {
        Ok(Directory {
            published: db.table("directory", "published")?,
            public_join: db.table("directory", "public_join")?,
            join_rules: db.table("directory", "join_rules")?,
            members: db.table("directory", "members")?,
            joined: db.table("directory", "joined")?,
            network_published: db.table("directory", "network_published")?,
        })
    }

    /// Whether the room is published in the public room directory.
    pub fn is_published(&self, room_id: &str) -> bool {
        self.published.get(room_id.as_bytes()).is_some()
    }

    /// Every published room, ordered by room id (at most `limit`).
    pub fn published(&self, limit: usize) -> Vec<String> {
        self.published
            .scan_prefix(b"", limit)
            .into_iter()
            .map(|(k, _)| String::from_utf8_lossy(&k).into_owned())
            .collect()
    }

    /// Rooms an application service listed for a network, by third-party instance id
    /// (`<appservice id>|<network id>`; `None`: every network), ordered by instance
    /// then room id (at most `limit`).
    pub fn network_published(&self, instance_id: Option<&str>, limit: usize) -> Vec<String> {
        let prefix = match instance_id {
            Some(i) => key::prefix(&[i]),
            None => Vec::new(),
        };
        self.network_published
            .scan_prefix(&prefix, limit)
            .into_iter()
            .filter_map(|(k, _)| {
                let at = k.iter().position(|b| *b == 0)?;
                Some(String::from_utf8_lossy(&k[at + 1..]).into_owned())
            })
            .collect()
    }

    /// Every room whose join rule is `public`, ordered by room id (at most `limit`).
    pub fn public_join_rooms(&self, limit: usize) -> Vec<String> {
        self.public_join
            .scan_prefix(b"", limit)
            .into_iter()
            .map(|(k, _)| String::from_utf8_lossy(&k).into_owned())
            .collect()
    }

    /// The room's current `join_rule` (one point read), if it has join rules.
    pub fn join_rule(&self, room_id: &str) -> Option<String> {
        self.join_rules
            .get(room_id.as_bytes())
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// The room's joined member count (one point read).
    pub fn joined_count(&self, room_id: &str) -> u64 {
        self.joined
            .get(room_id.as_bytes())
            .and_then(|v| {
                v.get(..8)
                    .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
            })
            .unwrap_or(0)
    }
}

impl Projection for Directory {
    fn name(&self) -> &'static str {
        "directory"
    }

    /// Facts (visibility) and state events (join rules, members, names): a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS.and(Interest::STATE_EVENTS)
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.published.clone(),
            self.public_join.clone(),
            self.join_rules.clone(),
            self.members.clone(),
            self.joined.clone(),
            self.network_published.clone(),
        ]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if let Some(Fact::RoomVisibilitySet {
            room_id,
            visibility,
        }) = record.fact()
        {
            if visibility == "public" {
                ctx.put(&self.published, room_id.into_bytes(), Vec::new());
            } else {
                ctx.delete(&self.published, room_id.into_bytes());
            }
            return Ok(());
        }
        if let Some(Fact::AppserviceRoomListed {
            appservice_id,
            network_id,
            room_id,
            visibility,
        }) = record.fact()
        {
            let instance = format!("{appservice_id}|{network_id}");
            let k = key::join(&[&instance, &room_id]);
            if visibility == "public" {
                ctx.put(&self.network_published, k, Vec::new());
            } else {
                ctx.delete(&self.network_published, k);
            }
            return Ok(());
        }
        // Outliers (state imported on a remote join) and resolved state count too.
        if !record.applies_to_state() {
            return Ok(());
        }
        let pdu = record.room_pdu().ok_or("unreadable PDU")?;
        let Some(state_key) = &pdu.state_key else {
            return Ok(());
        };
        let room = pdu.room_id.to_string();
        match pdu.kind.to_string().as_str() {
            "m.room.join_rules" if state_key.is_empty() => {
                let rule = pdu
                    .content_value()
                    .get("join_rule")
                    .and_then(|v| v.as_str())
                    .unwrap_or("")
                    .to_owned();
                let public = rule == "public";
                ctx.put(
                    &self.join_rules,
                    room.clone().into_bytes(),
                    rule.into_bytes(),
                );
                if public {
                    ctx.put(&self.public_join, room.into_bytes(), Vec::new());
                } else {
                    ctx.delete(&self.public_join, room.into_bytes());
                }
            }
            "m.room.member" => {
                let new = pdu
                    .content_value()
                    .get("membership")
                    .and_then(|v| v.as_str())
                    .unwrap_or("leave")
                    .to_owned();
                let k = key::join(&[&room, state_key]);
                let old = ctx.get(&self.members, &k);
                let was_joined = old.as_deref() == Some(b"join".as_slice());
                let is_joined = new == "join";
                ctx.put(&self.members, k, new.into_bytes());
                if was_joined != is_joined {
                    let count = ctx
                        .get(&self.joined, room.as_bytes())
                        .and_then(|v| {
                            v.get(..8)
                                .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
                        })
                        .unwrap_or(0);
                    let count = if is_joined {
                        count + 1
                    } else {
                        count.saturating_sub(1)
                    };
                    ctx.put(
                        &self.joined,
                        room.into_bytes(),
                        count.to_be_bytes().to_vec(),
                    );
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// The version of [`EventTimes`]' row shapes ([`ProjectionDb::ensure_layout`]): 2
/// dropped the event id from `by_ts` values.
pub const EVENT_TIMES_LAYOUT: u32 = 2;

/// The event-time index (spec: `GET /rooms/{roomId}/timestamp_to_event`).
pub struct EventTimes {
    by_ts: Table,
}

impl EventTimes {
    /// Opens the table.
    pub fn open(db: &ProjectionDb) -> Result<EventTimes, String> {
        Ok(EventTimes {
            by_ts: db.table("event_times", "by_ts")?,
        })
    }

    fn ts_key(room_id: &str, ts: u64) -> Vec<u8> {
        let mut k = key::prefix(&[room_id]);
        k.extend_from_slice(&ts.to_be_bytes());
        k
    }

    /// Up to `limit` events of the room from time `ts` in direction `forward` (at or
    /// after `ts`, oldest first; else at or before `ts`, newest first): (timestamp,
    /// position); the event id at a position is
    /// [`Timeline::event_id_at`](crate::timeline::Timeline::event_id_at). One range seek.
    pub fn from(&self, room_id: &str, ts: u64, forward: bool, limit: usize) -> Vec<(u64, u64)> {
        let (start, end) = if forward {
            let mut end = key::prefix(&[room_id]);
            *end.last_mut().expect("non-empty") = 1;
            (Self::ts_key(room_id, ts), end)
        } else {
            (
                key::prefix(&[room_id]),
                Self::ts_key(room_id, ts.saturating_add(1)),
            )
        };
        let prefix_len = key::prefix(&[room_id]).len();
        self.by_ts
            .scan_range(&start, &end, !forward, limit)
            .into_iter()
            .filter_map(|(k, _)| {
                let rest = k.get(prefix_len..)?;
                let ts = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
                let pos = u64::from_be_bytes(rest.get(8..16)?.try_into().ok()?);
                Some((ts, pos))
            })
            .collect()
    }
}

impl Projection for EventTimes {
    fn name(&self) -> &'static str {
        "event_times"
    }

    /// Room records only: a fact (a receipt, a login) does not wake it.
    fn interest(&self) -> Interest {
        Interest::ROOM
    }

    fn tables(&self) -> Vec<Table> {
        vec![self.by_ts.clone()]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if !record.is_event() {
            return Ok(());
        }
        let pdu = record.pdu().ok_or("unreadable PDU")?;
        let mut k = Self::ts_key(pdu.room_id.as_str(), u64::from(pdu.origin_server_ts.0));
        k.extend_from_slice(&record.position().to_be_bytes());
        ctx.put(&self.by_ts, k, Vec::new());
        Ok(())
    }
}
