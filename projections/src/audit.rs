//! Audit projection: every state change of every room and every account's journal
//! facts, kept so the admin API (which may not read the journal) and `spindle audit`
//! answer from one place with one rendering.
//!
//! Tables:
//! - `room_log`: room id, 0x00, position BE -> [`StateChange`] JSON: each state event
//!   (with the value it replaced) and each redaction of a state event
//! - `room_state`: room id, 0x00, type, 0x00, state key -> `{"event_id", "content"}`:
//!   the current value, to name the previous value of the next change
//! - `state_events`: event id -> room, 0x00, type, 0x00, state key: so a redaction can
//!   say which state entry it hit (one point read)
//! - `user_log`: user id, 0x00, position BE -> [`UserEntry`] JSON
//! - `tokens`: token hash -> user id (a revocation names only the hash)
//! - `admins`: user id -> position of the `AdminPromoted` fact
//!
//! Facts are attributed to an account generically: the fact's `user_id` field, else
//! the owner of its `token_hash`, else the record's principal when it is a user id. A
//! fact kind this module does not know is still listed (its `type` tag and its fields)
//! with secrets removed: any field whose name contains `password`, `token`, `secret`
//! or `private` is dropped, so neither a token nor its hash is ever shown.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// One state change (or the redaction of a state event) in a room.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct StateChange {
    /// Journal position.
    pub position: u64,
    /// The event's `origin_server_ts` (ms since the Unix epoch).
    pub origin_server_ts: u64,
    /// The state event (or the redaction event).
    pub event_id: String,
    /// Its sender.
    pub sender: String,
    /// State event type (of the redacted event, for a redaction).
    pub event_type: String,
    /// State key (of the redacted event, for a redaction).
    pub state_key: String,
    /// The value before: `{"event_id", "content"}`, or `null` if the key was unset.
    pub prev: Option<Value>,
    /// The new content; `null` for a redaction.
    pub new: Option<Value>,
    /// For a redaction: the redacted state event's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redacts: Option<String>,
}

/// One journal fact or membership change concerning an account.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct UserEntry {
    /// Journal position.
    pub position: u64,
    /// When it was appended (ms since the Unix epoch; for a membership change, the
    /// event's `origin_server_ts`).
    pub ts: u64,
    /// The fact's `type` tag (`account_registered`, `device_created`, `token_issued`,
    /// ...) or `membership` for a membership event about the user.
    pub kind: String,
    /// Who asked (the record's principal; the sender of a membership event).
    pub by: String,
    /// The fact's fields without secrets, or for a membership change
    /// `{room_id, event_id, membership, reason?}`.
    pub details: Value,
}

/// The version of this projection's rows ([`crate::ProjectionDb::ensure_layout`]): 2
/// since only an `m.room.redaction` records a redaction (layout 1 also took any event
/// with a `redacts` key naming a state event, and read every message; tables written
/// in layout 1 are rebuilt from the journal).
pub const LAYOUT: u32 = 2;

/// The audit projection.
pub struct Audit {
    room_log: Table,
    room_state: Table,
    state_events: Table,
    user_log: Table,
    tokens: Table,
    admins: Table,
}

/// A filter over a room's changes (all `None`: everything).
#[derive(Debug, Clone, Default)]
pub struct RoomFilter {
    /// Only this event type.
    pub event_type: Option<String>,
    /// Only this sender.
    pub sender: Option<String>,
    /// Only changes with `origin_server_ts >= since_ts`.
    pub since_ts: Option<u64>,
    /// Only changes with `origin_server_ts < until_ts`.
    pub until_ts: Option<u64>,
}

impl RoomFilter {
    fn admits(&self, c: &StateChange) -> bool {
        self.event_type.as_deref().is_none_or(|t| t == c.event_type)
            && self.sender.as_deref().is_none_or(|s| s == c.sender)
            && self.since_ts.is_none_or(|t| c.origin_server_ts >= t)
            && self.until_ts.is_none_or(|t| c.origin_server_ts < t)
    }
}

fn secret_field(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["password", "token", "secret", "private"]
        .iter()
        .any(|s| n.contains(s))
}

/// A fact's JSON without its `type` tag and without secret fields.
pub fn sanitize(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        o.remove("type");
        o.retain(|k, _| !secret_field(k));
        for (_, inner) in o.iter_mut() {
            if inner.is_object() {
                *inner = sanitize(inner.take());
            }
        }
    }
    v
}

impl Audit {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Audit, String> {
        Ok(Audit {
            room_log: db.table("audit", "room_log")?,
            room_state: db.table("audit", "room_state")?,
            state_events: db.table("audit", "state_events")?,
            user_log: db.table("audit", "user_log")?,
            tokens: db.table("audit", "tokens")?,
            admins: db.table("audit", "admins")?,
        })
    }

    /// A room's state changes with position > `after`, ascending, at most `limit` that
    /// pass `filter`. Returns them and the position to continue after (`None` when the
    /// room has no more rows). Reads at most `limit` rows past the last one returned
    /// plus the rows the filter drops (an admin tool, not a client path).
    pub fn room_changes(
        &self,
        room_id: &str,
        filter: &RoomFilter,
        after: u64,
        limit: usize,
    ) -> (Vec<StateChange>, Option<u64>) {
        let mut out = Vec::new();
        let mut cursor = after;
        let end = key::with_pos(&[room_id], u64::MAX);
        loop {
            let start = key::with_pos(&[room_id], cursor.saturating_add(1));
            let rows = self.room_log.scan_range(&start, &end, false, 256);
            if rows.is_empty() {
                return (out, None);
            }
            for (k, v) in rows {
                cursor = key::trailing_pos(&k);
                if let Ok(c) = serde_json::from_slice::<StateChange>(&v)
                    && filter.admits(&c)
                {
                    out.push(c);
                    if out.len() >= limit {
                        return (out, Some(cursor));
                    }
                }
            }
        }
    }

    /// An account's audit entries with position > `after`, ascending, at most `limit`.
    pub fn user_entries(
        &self,
        user_id: &str,
        after: u64,
        limit: usize,
    ) -> (Vec<UserEntry>, Option<u64>) {
        let start = key::with_pos(&[user_id], after.saturating_add(1));
        let end = key::with_pos(&[user_id], u64::MAX);
        let rows = self.user_log.scan_range(&start, &end, false, limit);
        let next = (rows.len() == limit)
            .then(|| rows.last().map(|(k, _)| key::trailing_pos(k)))
            .flatten();
        let out = rows
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect();
        (out, next)
    }

    /// Whether `user_id` was made a server admin by a journal fact (`spindle admin
    /// promote`); the config's `admins` list is checked by the caller.
    pub fn is_admin(&self, user_id: &str) -> bool {
        self.admins.get(user_id.as_bytes()).is_some()
    }

    fn log_user(&self, ctx: &ApplyCtx, user: &str, entry: &UserEntry) {
        ctx.put(
            &self.user_log,
            key::with_pos(&[user], entry.position),
            serde_json::to_vec(entry).expect("serializes"),
        );
    }

    fn apply_event(&self, ctx: &ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let pdu = record.pdu().ok_or("unreadable PDU")?;
        let room = pdu.room_id.as_str();
        let position = record.position();
        let ts = u64::from(pdu.origin_server_ts.0);
        let content = pdu.content_value();
        if let Some(sk) = &pdu.state_key {
            let kind = pdu.kind.to_string();
            let state_key = key::join(&[room, &kind, sk]);
            let prev = ctx
                .get(&self.room_state, &state_key)
                .and_then(|v| serde_json::from_slice::<Value>(&v).ok());
            let change = StateChange {
                position,
                origin_server_ts: ts,
                event_id: pdu.event_id.to_string(),
                sender: pdu.sender.to_string(),
                event_type: kind.clone(),
                state_key: sk.clone(),
                prev,
                new: Some(content.clone()),
                redacts: None,
            };
            ctx.put(
                &self.room_log,
                key::with_pos(&[room], position),
                serde_json::to_vec(&change).expect("serializes"),
            );
            ctx.put(
                &self.room_state,
                state_key.clone(),
                serde_json::to_vec(&json!({ "event_id": pdu.event_id, "content": content }))
                    .expect("serializes"),
            );
            ctx.put(
                &self.state_events,
                pdu.event_id.as_bytes().to_vec(),
                state_key,
            );
            if kind == "m.room.member" {
                let mut details = json!({
                    "room_id": room,
                    "event_id": pdu.event_id,
                    "membership": content.get("membership").cloned().unwrap_or(Value::Null),
                });
                if let Some(r) = content.get("reason") {
                    details["reason"] = r.clone();
                }
                self.log_user(
                    ctx,
                    sk,
                    &UserEntry {
                        position,
                        ts,
                        kind: "membership".into(),
                        by: pdu.sender.to_string(),
                        details,
                    },
                );
            }
        } else if pdu.kind.to_string() == "m.room.redaction"
            && let Some(target) = &pdu.redacts
            && let Some(sk) = ctx.get(&self.state_events, target.as_bytes())
        {
            let parts: Vec<&[u8]> = sk.splitn(3, |b| *b == 0).collect();
            let text = |i: usize| {
                String::from_utf8_lossy(parts.get(i).copied().unwrap_or(b"")).into_owned()
            };
            let prev = ctx
                .get(&self.room_state, &sk)
                .and_then(|v| serde_json::from_slice::<Value>(&v).ok())
                .filter(|v| v["event_id"] == target.as_str());
            let change = StateChange {
                position,
                origin_server_ts: ts,
                event_id: pdu.event_id.to_string(),
                sender: pdu.sender.to_string(),
                event_type: text(1),
                state_key: text(2),
                prev,
                new: None,
                redacts: Some(target.to_string()),
            };
            ctx.put(
                &self.room_log,
                key::with_pos(&[room], position),
                serde_json::to_vec(&change).expect("serializes"),
            );
        }
        Ok(())
    }

    fn apply_fact(&self, ctx: &ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let raw: Value = serde_json::from_slice(record.payload()).map_err(|e| e.to_string())?;
        let kind = raw["type"].as_str().unwrap_or("unknown").to_owned();
        match record.fact() {
            Some(Fact::TokenIssued {
                user_id,
                token_hash,
                ..
            }) => {
                ctx.put(&self.tokens, token_hash.into_bytes(), user_id.into_bytes());
            }
            Some(Fact::AdminPromoted { user_id }) => {
                ctx.put(
                    &self.admins,
                    user_id.into_bytes(),
                    record.position().to_be_bytes().to_vec(),
                );
            }
            Some(Fact::AdminRevoked { user_id }) => {
                ctx.delete(&self.admins, user_id.into_bytes());
            }
            _ => {}
        }
        let principal = record.principal();
        let user = raw["user_id"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| {
                raw["token_hash"].as_str().and_then(|h| {
                    ctx.get(&self.tokens, h.as_bytes())
                        .map(|u| String::from_utf8_lossy(&u).into_owned())
                })
            })
            .or_else(|| principal.starts_with('@').then(|| principal.to_owned()));
        if let Some(user) = user {
            self.log_user(
                ctx,
                &user,
                &UserEntry {
                    position: record.position(),
                    ts: record.appended_at(),
                    kind,
                    by: principal.to_owned(),
                    details: sanitize(raw),
                },
            );
        }
        Ok(())
    }
}

impl Projection for Audit {
    fn name(&self) -> &'static str {
        "audit"
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.room_log.clone(),
            self.room_state.clone(),
            self.state_events.clone(),
            self.user_log.clone(),
            self.tokens.clone(),
            self.admins.clone(),
        ]
    }

    /// Facts, state events and redactions (one may redact a state event): messages
    /// change nothing here and do not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
            .and(Interest::STATE_EVENTS)
            .and(Interest::REDACTIONS)
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if record.is_event() {
            self.apply_event(ctx, record)
        } else {
            self.apply_fact(ctx, record)
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for ms since the Unix epoch (UTC, proleptic Gregorian).
pub fn iso8601(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil from days (H. Hinnant).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

fn short(v: &Option<Value>) -> String {
    match v {
        None => "-".into(),
        Some(v) => v.to_string(),
    }
}

/// The text rendering of room changes (`spindle audit room` and the admin API's
/// `format=text`): one line per change, tab-separated: position, time, event id,
/// sender, type, state key, previous value (`{event_id, content}` or `-`), `->`, new
/// content (or `REDACTED <event id>`).
pub fn render_room_text(changes: &[StateChange]) -> String {
    let mut out = String::new();
    for c in changes {
        let new = match &c.redacts {
            Some(target) => format!("REDACTED {target}"),
            None => short(&c.new),
        };
        out.push_str(&format!(
            "{}\t{}\t{}\t{}\t{}\t{:?}\t{}\t->\t{}\n",
            c.position,
            iso8601(c.origin_server_ts),
            c.event_id,
            c.sender,
            c.event_type,
            c.state_key,
            short(&c.prev),
            new
        ));
    }
    out
}

/// The text rendering of an account's entries (`spindle audit user`): position, time,
/// kind, by, details.
pub fn render_user_text(entries: &[UserEntry]) -> String {
    let mut out = String::new();
    for e in entries {
        out.push_str(&format!(
            "{}\t{}\t{}\tby {}\t{}\n",
            e.position,
            iso8601(e.ts),
            e.kind,
            e.by,
            e.details
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso8601_is_utc() {
        assert_eq!(iso8601(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso8601(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(iso8601(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn secrets_are_dropped_from_any_fact() {
        let v = sanitize(json!({
            "type": "token_issued", "user_id": "@a:x", "device_id": "D", "token_hash": "h",
            "password_hash": "p", "nested": { "client_secret": "s", "ok": 1 }
        }));
        assert_eq!(
            v,
            json!({ "user_id": "@a:x", "device_id": "D", "nested": { "ok": 1 } })
        );
    }
}
