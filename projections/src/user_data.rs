//! Small per-user projections: filters, account data, receipts with unread counts,
//! and room aliases. One job each.

use std::collections::HashMap;

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, Interest, StoredRecord};

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

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
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

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
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

/// Receipts (spec: "Receipts", threaded receipts included). Tables:
/// - `receipts`: room, 0x00, user, 0x00, receipt type, 0x00, thread id ("" for an
///   unthreaded receipt, "main" for the main timeline) -> [`Receipt`]
/// - `log`: room, 0x00, position -> (user, type, thread) (receipts changed since a token)
/// - `event_pos`: event id -> position (to place receipts)
///
/// Unread counts live in the push projection ([`crate::push::Push::unread`]); they are
/// measured from [`Receipts::read_position`].
pub struct Receipts {
    receipts: Table,
    log: Table,
    event_pos: Table,
    last: LastChange,
    /// Where the checkpoint is read when `last` starts again ([`Projection::reload`]).
    db: ProjectionDb,
    /// `read_position(room, user, None)` answers by `room\0user`, each with the room's
    /// [`Receipts::last_change`] read before it: current while that is unchanged (every
    /// receipt written bumps it after its commit). At most [`READ_POSITIONS_KEPT`],
    /// dropped all at once when full.
    read_positions: RwLock<HashMap<String, (u64, Option<u64>)>>,
}

/// How many (room, user) read positions [`Receipts`] keeps in memory (about 200 bytes
/// each with the map's own table: 6-7 MiB when full): every `/sync`, sliding window
/// and push badge asks one per room shown.
pub const READ_POSITIONS_KEPT: usize = 32_768;

impl Receipts {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Receipts, String> {
        Ok(Receipts {
            receipts: db.table("receipts", "receipts")?,
            log: db.table("receipts", "log")?,
            event_pos: db.table("receipts", "event_pos")?,
            last: LastChange::known_after(db.checkpoint("receipts")),
            db: db.clone(),
            read_positions: RwLock::default(),
        })
    }

    /// A user's receipt of one type in a room; `thread` "" for the unthreaded one.
    pub fn get(
        &self,
        room_id: &str,
        user_id: &str,
        receipt_type: &str,
        thread: &str,
    ) -> Option<Receipt> {
        serde_json::from_slice(&self.receipts.get(&key::join(&[
            room_id,
            user_id,
            receipt_type,
            thread,
        ]))?)
        .ok()
    }

    /// Every receipt in a room: (user, type, receipt); a threaded receipt carries its
    /// `thread_id`.
    pub fn all(&self, room_id: &str) -> Vec<(String, String, Receipt)> {
        let prefix = key::prefix(&[room_id]);
        self.receipts
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                let rest = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                let (user, rest) = rest.split_once('\0')?;
                let (kind, _thread) = rest.split_once('\0')?;
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

    /// Rooms with a receipt change after `after`, at most `limit` (memory; `None`:
    /// more did, or `after` is older than this process knows: ask
    /// [`Receipts::last_change`] room by room).
    pub fn rooms_changed_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Option<Vec<std::sync::Arc<str>>> {
        self.last.changed_after(after, limit)
    }

    /// Receipts changed in a room in `(after, upto]`: (user, type, thread).
    pub fn changes(&self, room_id: &str, after: u64, upto: u64) -> Vec<(String, String, String)> {
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

    /// The (user, type, thread) of the room's latest `limit` receipt changes at or
    /// before `upto`, newest first (one bounded reverse scan; duplicates possible).
    pub fn recent(&self, room_id: &str, upto: u64, limit: usize) -> Vec<(String, String, String)> {
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

    /// The position up to which the user has read (spec: "Marking notifications as
    /// read": the more recent of `m.read` and `m.read.private`). `thread`: `None` for
    /// the room as a whole (unthreaded and main-timeline receipts), `Some(t)` for one
    /// thread (`"main"` or a root: unthreaded receipts and that thread's). Four point
    /// reads; for the room as a whole, memory while the room's receipts are unchanged
    /// since the last ask (its [`Receipts::last_change`], memory too).
    pub fn read_position(&self, room_id: &str, user_id: &str, thread: Option<&str>) -> Option<u64> {
        if thread.is_some() {
            return self.stored_read_position(room_id, user_id, thread);
        }
        // The room's last change first, then the rows: a receipt committed in between
        // is in the answer but not in `at`, so the next ask reads again.
        let at = self.last_change(room_id);
        let k = format!("{room_id}\0{user_id}");
        if let Some(&(kept_at, position)) = self.read_positions.read().get(&k)
            && kept_at == at
        {
            return position;
        }
        let position = self.stored_read_position(room_id, user_id, None);
        let mut kept = self.read_positions.write();
        if kept.len() >= READ_POSITIONS_KEPT {
            kept.clear();
        }
        kept.insert(k, (at, position));
        position
    }

    /// How many read positions are kept in memory (at most [`READ_POSITIONS_KEPT`]).
    pub fn read_positions_kept(&self) -> usize {
        self.read_positions.read().len()
    }

    fn stored_read_position(
        &self,
        room_id: &str,
        user_id: &str,
        thread: Option<&str>,
    ) -> Option<u64> {
        let threads = ["", thread.unwrap_or("main")];
        ["m.read", "m.read.private"]
            .iter()
            .flat_map(|t| threads.iter().map(move |th| (t, th)))
            .filter_map(|(t, th)| self.get(room_id, user_id, t, th))
            .map(|r| r.event_position)
            .max()
    }
}

impl Projection for Receipts {
    fn name(&self) -> &'static str {
        "receipts"
    }
    /// At start, after a failed commit, or on new tables (an online rebuild, whose
    /// rows may not match the remembered positions): start again from the checkpoint.
    fn reload(&self) {
        self.last.reset(self.db.checkpoint("receipts"));
        // New tables may place receipts at positions the kept answers never saw.
        self.read_positions.write().clear();
    }
    fn tables(&self) -> Vec<Table> {
        vec![
            self.receipts.clone(),
            self.log.clone(),
            self.event_pos.clone(),
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
                    let thread = thread_id.clone().unwrap_or_default();
                    let k = key::join(&[&room_id, &user_id, &receipt_type, &thread]);
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
                        json(&(user_id, receipt_type, thread)),
                    );
                    let (last, pos) = (self.last.clone(), record.position());
                    ctx.after_commit(move || last.bump(room_id, pos));
                }
            }
        }
        Ok(())
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

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
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
