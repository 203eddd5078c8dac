//! Timeline projection: every event by id, the room stream index keyed by
//! (room, position), redactions, and each room's last activity (room-list recency).
//!
//! Tables:
//! - `events`: event id -> [`StoredEvent`] (JSON: position, room version, PDU JSON,
//!   sending device and txn id)
//! - `room_events`: room id, 0x00, position BE -> event id
//! - `redactions`: redacted event id -> redaction event id (first redaction wins)
//! - `rooms`: room id -> last position (also kept in memory for recency sorts)

use std::{collections::HashMap, sync::Arc};

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use spindle_core::pdu::Pdu;
use spindle_journal::StoredRecord;

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// An event as the timeline projection keeps it.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct StoredEvent {
    /// Journal position.
    pub position: u64,
    /// Room version.
    pub room_version: String,
    /// Room id (needed for v12 create events, whose JSON has none).
    pub room_id: String,
    /// Canonical PDU JSON.
    pub pdu: String,
    /// Device that sent it (local sends).
    pub device_id: Option<String>,
    /// Client transaction id (local sends).
    pub txn_id: Option<String>,
}

impl StoredEvent {
    /// Parses the PDU.
    pub fn parse(&self, event_id: &str) -> Option<Pdu> {
        Pdu::parse(
            self.pdu.as_bytes(),
            &self.room_version,
            ruma::OwnedEventId::try_from(event_id).ok(),
            ruma::OwnedRoomId::try_from(self.room_id.as_str()).ok(),
        )
        .ok()
    }
}

/// A loaded event: the PDU plus where it sits.
#[derive(Debug, Clone)]
pub struct EventRecord {
    /// Journal position.
    pub position: u64,
    /// The PDU.
    pub pdu: Arc<Pdu>,
    /// Sending device.
    pub device_id: Option<String>,
    /// Client txn id.
    pub txn_id: Option<String>,
}

/// The timeline projection.
pub struct Timeline {
    events: Table,
    room_events: Table,
    redactions: Table,
    rooms: Table,
    recency: Arc<RwLock<HashMap<String, u64>>>,
}

impl Timeline {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Timeline, String> {
        Ok(Timeline {
            events: db.table("timeline", "events")?,
            room_events: db.table("timeline", "room_events")?,
            redactions: db.table("timeline", "redactions")?,
            rooms: db.table("timeline", "rooms")?,
            recency: Arc::default(),
        })
    }

    /// Loads an event by id (one point read).
    pub fn event(&self, event_id: &str) -> Option<EventRecord> {
        let raw = self.events.get(event_id.as_bytes())?;
        let stored: StoredEvent = serde_json::from_slice(&raw).ok()?;
        let pdu = stored.parse(event_id)?;
        Some(EventRecord {
            position: stored.position,
            pdu: Arc::new(pdu),
            device_id: stored.device_id,
            txn_id: stored.txn_id,
        })
    }

    /// Event ids of a room with positions in `(after, upto]`, ascending, at most `limit`.
    pub fn range_forward(
        &self,
        room_id: &str,
        after: u64,
        upto: u64,
        limit: usize,
    ) -> Vec<(u64, String)> {
        if upto <= after {
            return vec![];
        }
        let start = key::with_pos(&[room_id], after + 1);
        let end = key::with_pos(&[room_id], upto.saturating_add(1));
        self.decode(self.room_events.scan_range(&start, &end, false, limit))
    }

    /// Event ids of a room with positions in `[from, before)`, descending, at most `limit`.
    pub fn range_backward(
        &self,
        room_id: &str,
        before: u64,
        from: u64,
        limit: usize,
    ) -> Vec<(u64, String)> {
        if before <= from {
            return vec![];
        }
        let start = key::with_pos(&[room_id], from);
        let end = key::with_pos(&[room_id], before);
        self.decode(self.room_events.scan_range(&start, &end, true, limit))
    }

    fn decode(&self, rows: Vec<(Vec<u8>, Vec<u8>)>) -> Vec<(u64, String)> {
        rows.into_iter()
            .map(|(k, v)| {
                (
                    key::trailing_pos(&k),
                    String::from_utf8_lossy(&v).into_owned(),
                )
            })
            .collect()
    }

    /// The redaction that redacted `event_id`, if any.
    pub fn redacted_by(&self, event_id: &str) -> Option<String> {
        self.redactions
            .get(event_id.as_bytes())
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// Position of the room's latest event (in memory; no store read).
    pub fn last_activity(&self, room_id: &str) -> Option<u64> {
        self.recency.read().get(room_id).copied()
    }
}

impl Projection for Timeline {
    fn name(&self) -> &'static str {
        "timeline"
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.events.clone(),
            self.room_events.clone(),
            self.redactions.clone(),
            self.rooms.clone(),
        ]
    }

    fn reload(&self) {
        let mut map = self.recency.write();
        map.clear();
        for (k, v) in self.rooms.all() {
            if v.len() == 8 {
                map.insert(
                    String::from_utf8_lossy(&k).into_owned(),
                    u64::from_be_bytes(v[..8].try_into().expect("8")),
                );
            }
        }
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if !record.is_event() {
            return Ok(());
        }
        let pdu = record.pdu().ok_or("unreadable PDU")?;
        let room = pdu.room_id.to_string();
        let event_id = pdu.event_id.to_string();
        let stored = StoredEvent {
            position: record.position(),
            room_version: pdu.room_version.clone(),
            room_id: room.clone(),
            pdu: String::from_utf8_lossy(&pdu.json).into_owned(),
            device_id: record.device_id().map(str::to_owned),
            txn_id: record.txn_id().map(str::to_owned),
        };
        ctx.put(
            &self.events,
            event_id.clone().into_bytes(),
            serde_json::to_vec(&stored).map_err(|e| e.to_string())?,
        );
        ctx.put(
            &self.room_events,
            key::with_pos(&[&room], record.position()),
            event_id.into_bytes(),
        );
        ctx.put(
            &self.rooms,
            room.clone().into_bytes(),
            record.position().to_be_bytes().to_vec(),
        );
        if pdu.kind.to_string() == "m.room.redaction"
            && let Some(target) = &pdu.redacts
        {
            let k = target.to_string().into_bytes();
            if ctx.get(&self.redactions, &k).is_none() {
                ctx.put(&self.redactions, k, pdu.event_id.to_string().into_bytes());
            }
        }
        let recency = self.recency.clone();
        let pos = record.position();
        ctx.after_commit(move || {
            recency.write().insert(room, pos);
        });
        Ok(())
    }
}
