//! Small per-user projections: filters, account data, receipts with unread counts,
//! and room aliases. One job each.

use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, LastChange, ProjectionDb, Table, key},
};

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("rows serialize")
}

/// Filters (spec: "Filtering"). Table `filters`: user, 0x00, filter id -> filter JSON.
pub struct Filters {
    filters: Table,
}

impl Filters {
    /// Opens the table.
    pub fn open(db: &ProjectionDb) -> Result<Filters, String> {
        Ok(Filters {
            filters: db.table("filters", "filters")?,
        })
    }

    /// A stored filter.
    pub fn get(&self, user_id: &str, filter_id: &str) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.filters.get(&key::join(&[user_id, filter_id]))?).ok()
    }
}

impl Projection for Filters {
    fn name(&self) -> &'static str {
        "filters"
    }
    fn tables(&self) -> Vec<Table> {
        vec![self.filters.clone()]
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if let Some(Fact::FilterCreated {
            user_id,
            filter_id,
            filter,
        }) = record.fact()
        {
            ctx.put(
                &self.filters,
                key::join(&[&user_id, &filter_id]),
                json(&filter),
            );
        }
        Ok(())
    }
}

/// Account data (spec: "Client Config"). Tables: `data`: user, 0x00, room ("" for
/// global), 0x00, type -> content; `log`: user, 0x00, position -> [room, type] (what
/// changed since a sync token).
pub struct AccountData {
    data: Table,
    log: Table,
    last: LastChange,
}

impl AccountData {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<AccountData, String> {
        Ok(AccountData {
            data: db.table("account_data", "data")?,
            log: db.table("account_data", "log")?,
            last: LastChange::default(),
        })
    }

    /// One entry (`room_id` `None` for global account data).
    pub fn get(
        &self,
        user_id: &str,
        room_id: Option<&str>,
        data_type: &str,
    ) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.data.get(&key::join(&[
            user_id,
            room_id.unwrap_or(""),
            data_type,
        ]))?)
        .ok()
    }

    /// Every entry of a scope (global or one room): (type, content).
    pub fn all(&self, user_id: &str, room_id: Option<&str>) -> Vec<(String, serde_json::Value)> {
        let prefix = key::prefix(&[user_id, room_id.unwrap_or("")]);
        self.data
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    String::from_utf8_lossy(&k[prefix.len()..]).into_owned(),
                    serde_json::from_slice(&v).ok()?,
                ))
            })
            .collect()
    }

    /// Position of the user's latest account data change (memory after the first ask).
    pub fn last_change(&self, user_id: &str) -> u64 {
        self.last.get(user_id, &self.log)
    }

    /// (room or "", type) pairs changed in `(after, upto]`, deduplicated, in order.
    pub fn changes(&self, user_id: &str, after: u64, upto: u64) -> Vec<(String, String)> {
        if upto <= after {
            return vec![];
        }
        let rows = self.log.scan_range(
            &key::with_pos(&[user_id], after + 1),
            &key::with_pos(&[user_id], upto.saturating_add(1)),
            false,
            usize::MAX,
        );
        let mut out: Vec<(String, String)> = Vec::new();
        for (_, v) in rows {
            if let Ok(pair) = serde_json::from_slice::<(String, String)>(&v)
                && !out.contains(&pair)
            {
                out.push(pair);
            }
        }
        out
    }
}

impl Projection for AccountData {
    fn name(&self) -> &'static str {
        "account_data"
    }
    fn tables(&self) -> Vec<Table> {
        vec![self.data.clone(), self.log.clone()]
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if let Some(Fact::AccountDataSet {
            user_id,
            room_id,
            data_type,
            content,
        }) = record.fact()
        {
            let room = room_id.unwrap_or_default();
            ctx.put(
                &self.data,
                key::join(&[&user_id, &room, &data_type]),
                json(&content),
            );
            ctx.put(
                &self.log,
                key::with_pos(&[&user_id], record.position()),
                json(&(room, data_type)),
            );
            let (last, pos) = (self.last.clone(), record.position());
            ctx.after_commit(move || last.bump(user_id, pos));
        }
        Ok(())
    }
}

/// A stored receipt.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Receipt {
    /// The event read up to.
    pub event_id: String,
    /// Position of that event.
    pub event_position: u64,
    /// Server time the receipt was set (ms).
    pub ts: u64,
    /// Thread id, if threaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread_id: Option<String>,
}

/// Receipts and unread counts. Tables:
/// - `receipts`: room, 0x00, user, 0x00, receipt type -> [`Receipt`]
/// - `log`: room, 0x00, position -> (user, type) (receipts changed since a token)
/// - `event_pos`: event id -> position (to place receipts)
/// - `counts`: room, 0x00, position -> running count of notifying events in the room
/// - `own_counts`: room, 0x00, user, 0x00, position -> running count of the user's own
///
/// An unread count is four seeks (two "last entry at or before" pairs), never a walk
/// over the events after the receipt (BRIEF §4, first finding).
pub struct Receipts {
    receipts: Table,
    log: Table,
    event_pos: Table,
    counts: Table,
    own_counts: Table,
    last: LastChange,
}

/// Event types that count as unread notifications (the default push rules notify
/// for these; full push-rule evaluation is a later projection).
const NOTIFYING: [&str; 3] = ["m.room.message", "m.room.encrypted", "m.sticker"];

fn last_count(table: &Table, prefix_parts: &[&str], at: u64) -> u64 {
    let start = key::with_pos(prefix_parts, 0);
    let end = key::with_pos(prefix_parts, at.saturating_add(1));
    table
        .scan_range(&start, &end, true, 1)
        .first()
        .and_then(|(_, v)| {
            v.get(..8)
                .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
        })
        .unwrap_or(0)
}

impl Receipts {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Receipts, String> {
        Ok(Receipts {
            receipts: db.table("receipts", "receipts")?,
            log: db.table("receipts", "log")?,
            event_pos: db.table("receipts", "event_pos")?,
            counts: db.table("receipts", "counts")?,
            own_counts: db.table("receipts", "own_counts")?,
            last: LastChange::default(),
        })
    }

    /// A user's receipt of one type in a room.
    pub fn get(&self, room_id: &str, user_id: &str, receipt_type: &str) -> Option<Receipt> {
        serde_json::from_slice(
            &self
                .receipts
                .get(&key::join(&[room_id, user_id, receipt_type]))?,
        )
        .ok()
    }

    /// Every receipt in a room: (user, type, receipt).
    pub fn all(&self, room_id: &str) -> Vec<(String, String, Receipt)> {
        let prefix = key::prefix(&[room_id]);
        self.receipts
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                let rest = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                let (user, kind) = rest.split_once('\0')?;
                Some((
                    user.to_owned(),
                    kind.to_owned(),
                    serde_json::from_slice(&v).ok()?,
                ))
            })
            .collect()
    }

    /// Position of the room's latest receipt change (memory after the first ask).
    pub fn last_change(&self, room_id: &str) -> u64 {
        self.last.get(room_id, &self.log)
    }

    /// Receipts changed in a room in `(after, upto]`: (user, type).
    pub fn changes(&self, room_id: &str, after: u64, upto: u64) -> Vec<(String, String)> {
        if upto <= after {
            return vec![];
        }
        self.log
            .scan_range(
                &key::with_pos(&[room_id], after + 1),
                &key::with_pos(&[room_id], upto.saturating_add(1)),
                false,
                usize::MAX,
            )
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect()
    }

    /// The (user, type) pairs of the room's latest `limit` receipt changes at or before
    /// `upto`, newest first (one bounded reverse scan; duplicates possible).
    pub fn recent(&self, room_id: &str, upto: u64, limit: usize) -> Vec<(String, String)> {
        self.log
            .scan_range(
                &key::with_pos(&[room_id], 0),
                &key::with_pos(&[room_id], upto.saturating_add(1)),
                true,
                limit,
            )
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect()
    }

    /// Unread notifying events for `user_id` in `room_id` in `(from, upto]`, not counting
    /// the user's own. `from` is the position of the user's read receipt (or their join).
    pub fn unread(&self, room_id: &str, user_id: &str, from: u64, upto: u64) -> u64 {
        if upto <= from {
            return 0;
        }
        let all =
            last_count(&self.counts, &[room_id], upto) - last_count(&self.counts, &[room_id], from);
        let own = last_count(&self.own_counts, &[room_id, user_id], upto)
            - last_count(&self.own_counts, &[room_id, user_id], from);
        all.saturating_sub(own)
    }

    /// The position up to which the user has read (max of `m.read` and `m.read.private`).
    pub fn read_position(&self, room_id: &str, user_id: &str) -> Option<u64> {
        ["m.read", "m.read.private"]
            .iter()
            .filter_map(|t| self.get(room_id, user_id, t))
            .map(|r| r.event_position)
            .max()
    }
}

impl Projection for Receipts {
    fn name(&self) -> &'static str {
        "receipts"
    }
    fn tables(&self) -> Vec<Table> {
        vec![
            self.receipts.clone(),
            self.log.clone(),
            self.event_pos.clone(),
            self.counts.clone(),
            self.own_counts.clone(),
        ]
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        match record.is_event() {
            true => {
                let pdu = record.pdu().ok_or("unreadable PDU")?;
                ctx.put(
                    &self.event_pos,
                    pdu.event_id.to_string().into_bytes(),
                    record.position().to_be_bytes().to_vec(),
                );
                let kind = pdu.kind.to_string();
                if pdu.state_key.is_none() && NOTIFYING.contains(&kind.as_str()) {
                    let room = pdu.room_id.to_string();
                    let sender = pdu.sender.to_string();
                    // The running counts only ever grow, so "the last row" is found
                    // through the staged batch first, then the table.
                    let prev = self.latest(ctx, &self.counts, &[&room], record.position());
                    ctx.put(
                        &self.counts,
                        key::with_pos(&[&room], record.position()),
                        (prev + 1).to_be_bytes().to_vec(),
                    );
                    let prev_own =
                        self.latest(ctx, &self.own_counts, &[&room, &sender], record.position());
                    ctx.put(
                        &self.own_counts,
                        key::with_pos(&[&room, &sender], record.position()),
                        (prev_own + 1).to_be_bytes().to_vec(),
                    );
                }
            }
            false => {
                if let Some(Fact::ReceiptSet {
                    user_id,
                    room_id,
                    event_id,
                    receipt_type,
                    thread_id,
                    ts,
                }) = record.fact()
                {
                    let Some(pos) = ctx.get(&self.event_pos, event_id.as_bytes()) else {
                        return Ok(());
                    };
                    let event_position =
                        u64::from_be_bytes(pos[..8].try_into().map_err(|_| "bad event_pos")?);
                    let k = key::join(&[&room_id, &user_id, &receipt_type]);
                    // Receipts never move backwards (spec: a receipt for an older event is ignored).
                    if let Some(old) = ctx
                        .get(&self.receipts, &k)
                        .and_then(|v| serde_json::from_slice::<Receipt>(&v).ok())
                        && old.event_position >= event_position
                    {
                        return Ok(());
                    }
                    ctx.put(
                        &self.receipts,
                        k,
                        json(&Receipt {
                            event_id,
                            event_position,
                            ts,
                            thread_id,
                        }),
                    );
                    ctx.put(
                        &self.log,
                        key::with_pos(&[&room_id], record.position()),
                        json(&(user_id, receipt_type)),
                    );
                    let (last, pos) = (self.last.clone(), record.position());
                    ctx.after_commit(move || last.bump(room_id, pos));
                }
            }
        }
        Ok(())
    }
}

impl Receipts {
    fn latest(&self, ctx: &ApplyCtx, table: &Table, parts: &[&str], before: u64) -> u64 {
        // Staged rows of this batch are newer than anything committed; otherwise one
        // reverse seek in the table.
        let below = key::with_pos(parts, before);
        match ctx.staged_last_below(table, &key::prefix(parts), &below) {
            Some(v) => v
                .get(..8)
                .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
                .unwrap_or(0),
            None => last_count(table, parts, before.saturating_sub(1)),
        }
    }
}

/// Room aliases. Tables: `aliases`: alias -> [`AliasTarget`]; `room_aliases`: room,
/// 0x00, alias -> empty.
pub struct Aliases {
    aliases: Table,
    room_aliases: Table,
}

/// Where an alias points.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct AliasTarget {
    /// The room.
    pub room_id: String,
    /// Who created the alias.
    pub creator: String,
}

impl Aliases {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Aliases, String> {
        Ok(Aliases {
            aliases: db.table("aliases", "aliases")?,
            room_aliases: db.table("aliases", "room_aliases")?,
        })
    }

    /// Resolves an alias.
    pub fn resolve(&self, alias: &str) -> Option<AliasTarget> {
        serde_json::from_slice(&self.aliases.get(alias.as_bytes())?).ok()
    }

    /// A room's local aliases.
    pub fn of_room(&self, room_id: &str) -> Vec<String> {
        let prefix = key::prefix(&[room_id]);
        self.room_aliases
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .map(|(k, _)| String::from_utf8_lossy(&k[prefix.len()..]).into_owned())
            .collect()
    }
}

impl Projection for Aliases {
    fn name(&self) -> &'static str {
        "aliases"
    }
    fn tables(&self) -> Vec<Table> {
        vec![self.aliases.clone(), self.room_aliases.clone()]
    }
    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        match record.fact() {
            Some(Fact::AliasSet {
                alias,
                room_id,
                creator,
            }) => {
                ctx.put(
                    &self.room_aliases,
                    key::join(&[&room_id, &alias]),
                    Vec::new(),
                );
                ctx.put(
                    &self.aliases,
                    alias.into_bytes(),
                    json(&AliasTarget { room_id, creator }),
                );
            }
            Some(Fact::AliasDeleted { alias }) => {
                if let Some(t) = ctx
                    .get(&self.aliases, alias.as_bytes())
                    .and_then(|v| serde_json::from_slice::<AliasTarget>(&v).ok())
                {
                    ctx.delete(&self.room_aliases, key::join(&[&t.room_id, &alias]));
                }
                ctx.delete(&self.aliases, alias.into_bytes());
            }
            _ => {}
        }
        Ok(())
    }
}
