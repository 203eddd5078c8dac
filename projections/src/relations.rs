//! Relations projection (spec: "Forming relationships between events", "Event
//! replacements", "Threading", "Reference relations"): child events by parent, the
//! aggregations bundled into `unsigned.m.relations`, and each room's threads ordered by
//! latest activity.
//!
//! Tables (layout [`LAYOUT`]):
//! - `meta`: event id -> [`EventMeta`] in a compact binary row ([`EventMeta::encode`]:
//!   what a later relation needs to know about its parent, since apply reads only its
//!   own tables; 27 bytes plus the sender for an event that relates to nothing)
//! - `children`: parent, 0x00, position -> [`Child`]
//! - `by_rel`: parent, 0x00, rel type, 0x00, position -> [`Child`]
//! - `aggr`: parent -> [`Aggregation`] (latest edit, thread summary, reference count):
//!   one point read tells a renderer everything it bundles
//! - `participants`: thread root, 0x00, user -> empty
//! - `room_threads`: room, 0x00, position -> root (one row per thread, at its latest
//!   event; `GET /threads` pages through it newest first)
//! - `redacted`: event id, 0x00, room id -> empty, for a redaction that came before its
//!   target (federation), so the target is never indexed as a child
//!
//! A redaction counts only for an event of its own room (spec "Redactions": a
//! redaction naming another room's event redacts nothing).
//!
//! A redacted child stops counting (as Synapse drops its `event_relations` row): its
//! child rows go, and the aggregation is recomputed from the children left: the edit
//! falls back to the latest remaining valid one, a thread's count and latest event
//! move back (a thread left empty is no thread), a reference count drops.

use serde::{Deserialize, Serialize};
use spindle_journal::{Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// The version of this projection's row shapes ([`ProjectionDb::ensure_layout`]): 2
/// made `meta` rows binary with digests for the room and type (they were JSON with
/// both ids spelled out, about 130 bytes an event on disk, issue 18 item 5) and keyed
/// `redacted` by (target, room).
pub const LAYOUT: u32 = 2;

/// What the projection remembers of every event: enough to judge a later relation to
/// it (same room; for an edit, same sender and type, neither a state event nor an edit
/// itself; a thread root's sender is a participant), plus, for an event indexed as a
/// child, what a redaction of it must remove.
#[derive(Debug, Clone, PartialEq)]
pub struct EventMeta {
    /// [`room_digest`] of the room id: relations count only within a room, and
    /// equality is all that is asked of it.
    pub room: u128,
    /// Sender.
    pub sender: String,
    /// [`type_digest`] of the event type (an edit must keep the type).
    pub kind: u64,
    /// Whether its `m.relates_to.rel_type` is `m.replace` (an edit cannot be edited);
    /// `false` once it is redacted as a child.
    pub is_edit: bool,
    /// Whether it is a state event.
    pub state: bool,
    /// Set when it was indexed as a child of an event.
    pub child: Option<ChildMeta>,
}

/// What a redaction of a child must remove ([`EventMeta::child`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ChildMeta {
    /// The event it relates to (`m.relates_to.event_id`).
    pub parent: String,
    /// Its `rel_type`.
    pub rel_type: String,
    /// Its position (the key of its child rows).
    pub position: u64,
    /// Its `origin_server_ts` when it is a valid replacement of `parent`.
    pub edit_ts: Option<u64>,
}

/// 8 bytes of the blake3 hash of an event type ([`EventMeta::kind`]). Someone who
/// picks both types can find a colliding pair in about 2^32 tries; all it buys is an
/// edit of their own event under another type being bundled.
pub fn type_digest(s: &str) -> u64 {
    let h = blake3::hash(s.as_bytes());
    u64::from_be_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// 16 bytes of the blake3 hash of a room id ([`EventMeta::room`]): room ids of room
/// versions 1-11 are picked by the creating server, so a colliding pair must cost
/// more than 2^32 tries (about 2^64 here).
pub fn room_digest(s: &str) -> u128 {
    let h = blake3::hash(s.as_bytes());
    u128::from_be_bytes(h.as_bytes()[..16].try_into().expect("16 bytes"))
}

const STATE: u8 = 1;
const IS_EDIT: u8 = 2;
const CHILD: u8 = 4;
const EDIT_TS: u8 = 8;

impl EventMeta {
    /// The row: flags (1 byte: state, is an edit, child, has `edit_ts`), room digest
    /// (16 bytes) and type digest (8 bytes), big endian, the sender (2-byte length, UTF-8);
    /// for a child then its position and, if set, `edit_ts` (8 bytes each), its
    /// `rel_type` and parent (2-byte length, UTF-8 each).
    pub fn encode(&self) -> Vec<u8> {
        let mut flags = 0;
        for (on, bit) in [(self.state, STATE), (self.is_edit, IS_EDIT)] {
            if on {
                flags |= bit;
            }
        }
        if let Some(c) = &self.child {
            flags |= CHILD;
            if c.edit_ts.is_some() {
                flags |= EDIT_TS;
            }
        }
        let mut out = Vec::with_capacity(27 + self.sender.len());
        out.push(flags);
        out.extend_from_slice(&self.room.to_be_bytes());
        out.extend_from_slice(&self.kind.to_be_bytes());
        let text = |out: &mut Vec<u8>, s: &str| {
            // Ids are at most 255 bytes (spec "Identifier grammar"); longer text is cut
            // at the 2-byte length's limit rather than written unreadable.
            let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
            out.extend_from_slice(&(b.len() as u16).to_be_bytes());
            out.extend_from_slice(b);
        };
        text(&mut out, &self.sender);
        if let Some(c) = &self.child {
            out.extend_from_slice(&c.position.to_be_bytes());
            if let Some(ts) = c.edit_ts {
                out.extend_from_slice(&ts.to_be_bytes());
            }
            text(&mut out, &c.rel_type);
            text(&mut out, &c.parent);
        }
        out
    }

    /// Reads a row [`EventMeta::encode`] wrote; `None` if it is cut short or not UTF-8.
    pub fn decode(row: &[u8]) -> Option<EventMeta> {
        let mut r = Reader { row, at: 0 };
        let flags = r.take(1)?[0];
        let room = u128::from_be_bytes(r.take(16)?.try_into().ok()?);
        let kind = r.num()?;
        let sender = r.text()?;
        let child = if flags & CHILD != 0 {
            let position = r.num()?;
            let edit_ts = if flags & EDIT_TS != 0 {
                Some(r.num()?)
            } else {
                None
            };
            Some(ChildMeta {
                rel_type: r.text()?,
                parent: r.text()?,
                position,
                edit_ts,
            })
        } else {
            None
        };
        Some(EventMeta {
            room,
            sender,
            kind,
            is_edit: flags & IS_EDIT != 0,
            state: flags & STATE != 0,
            child,
        })
    }
}

/// A cursor over an [`EventMeta`] row.
struct Reader<'a> {
    row: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let b = self.row.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(b)
    }

    fn num(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }

    fn text(&mut self) -> Option<String> {
        let n = u16::from_be_bytes(self.take(2)?.try_into().ok()?) as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

/// One child of a parent event.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Child {
    /// The child event.
    pub event_id: String,
    /// Its `rel_type`.
    pub rel_type: String,
    /// Its event type.
    pub kind: String,
}

/// A thread summary (spec: `m.thread` aggregation).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct ThreadSummary {
    /// Events with an `m.thread` relation to the root.
    pub count: u64,
    /// The latest of them.
    pub latest_event_id: String,
    /// Its position.
    pub latest_position: u64,
}

/// Everything bundled for one parent event.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Aggregation {
    /// The most recent valid replacement: (event id, origin_server_ts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edit: Option<(String, u64)>,
    /// The thread this event is the root of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<ThreadSummary>,
    /// Number of `m.reference` children.
    #[serde(default)]
    pub references: u64,
}

/// The relations projection.
pub struct Relations {
    meta: Table,
    children: Table,
    by_rel: Table,
    aggr: Table,
    participants: Table,
    room_threads: Table,
    redacted: Table,
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("rows serialize")
}

/// A page of children: positions and the children, in the order asked.
pub type ChildPage = Vec<(u64, Child)>;

impl Relations {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Relations, String> {
        let t = |name: &str| db.table("relations", name);
        Ok(Relations {
            meta: t("meta")?,
            children: t("children")?,
            by_rel: t("by_rel")?,
            aggr: t("aggr")?,
            participants: t("participants")?,
            room_threads: t("room_threads")?,
            redacted: t("redacted")?,
        })
    }

    /// What is bundled for `event_id` (one point read; `None` for most events).
    pub fn aggregation(&self, event_id: &str) -> Option<Aggregation> {
        serde_json::from_slice(&self.aggr.get(event_id.as_bytes())?).ok()
    }

    /// Whether `user_id` sent the thread root or an event in the thread.
    pub fn participated(&self, root: &str, user_id: &str) -> bool {
        self.participants
            .get(&key::join(&[root, user_id]))
            .is_some()
    }

    /// Children of `parent` with positions in `[lo, hi]`, newest first (`backward`) or
    /// oldest first, at most `limit`; `rel_type` narrows to one relation type.
    pub fn children(
        &self,
        parent: &str,
        rel_type: Option<&str>,
        lo: u64,
        hi: u64,
        backward: bool,
        limit: usize,
    ) -> ChildPage {
        if hi < lo {
            return vec![];
        }
        let (table, parts): (&Table, Vec<&str>) = match rel_type {
            Some(r) => (&self.by_rel, vec![parent, r]),
            None => (&self.children, vec![parent]),
        };
        table
            .scan_range(
                &key::with_pos(&parts, lo),
                &key::with_pos(&parts, hi.saturating_add(1)),
                backward,
                limit,
            )
            .into_iter()
            .filter_map(|(k, v)| Some((key::trailing_pos(&k), serde_json::from_slice(&v).ok()?)))
            .collect()
    }

    /// A room's thread roots whose latest event is at a position `<= before`, newest
    /// first, at most `limit`: (latest position, root).
    pub fn threads(&self, room_id: &str, before: u64, limit: usize) -> Vec<(u64, String)> {
        self.room_threads
            .scan_range(
                &key::with_pos(&[room_id], 0),
                &key::with_pos(&[room_id], before.saturating_add(1)),
                true,
                limit,
            )
            .into_iter()
            .map(|(k, v)| {
                (
                    key::trailing_pos(&k),
                    String::from_utf8_lossy(&v).into_owned(),
                )
            })
            .collect()
    }

    fn get_meta(&self, ctx: &ApplyCtx, event_id: &str) -> Option<EventMeta> {
        EventMeta::decode(&ctx.get(&self.meta, event_id.as_bytes())?)
    }

    fn get_aggr(&self, ctx: &ApplyCtx, event_id: &str) -> Aggregation {
        ctx.get(&self.aggr, event_id.as_bytes())
            .and_then(|v| serde_json::from_slice(&v).ok())
            .unwrap_or_default()
    }

    /// The children of `parent` with `rel_type` left in the tables (this batch's
    /// writes included), oldest first.
    fn remaining(&self, ctx: &ApplyCtx, parent: &str, rel_type: &str) -> Vec<(u64, Child)> {
        ctx.scan_prefix(&self.by_rel, &key::prefix(&[parent, rel_type]))
            .into_iter()
            .filter_map(|(k, v)| Some((key::trailing_pos(&k), serde_json::from_slice(&v).ok()?)))
            .collect()
    }

    /// A redaction in `room` of `target`: when it is a child indexed in that room, its
    /// rows go and its parent's aggregation is recomputed from the children left
    /// (module doc). A target not seen yet is remembered in `redacted`; a target in
    /// another room is left alone.
    fn redact(&self, ctx: &mut ApplyCtx, room: &str, target: &str) {
        let Some(mut meta) = self.get_meta(ctx, target) else {
            ctx.put(&self.redacted, key::join(&[target, room]), Vec::new());
            return;
        };
        if meta.room != room_digest(room) {
            return;
        }
        let Some(child) = meta.child.take() else {
            return;
        };
        let ChildMeta {
            parent,
            rel_type,
            position: pos,
            ..
        } = child;
        meta.is_edit = false;
        ctx.put(&self.meta, target.as_bytes().to_vec(), meta.encode());
        ctx.delete(&self.children, key::with_pos(&[&parent], pos));
        ctx.delete(&self.by_rel, key::with_pos(&[&parent, &rel_type], pos));
        let mut aggr = self.get_aggr(ctx, &parent);
        match rel_type.as_str() {
            "m.replace" => {
                if aggr.edit.as_ref().is_some_and(|(id, _)| id == target) {
                    aggr.edit = self
                        .remaining(ctx, &parent, "m.replace")
                        .into_iter()
                        .filter_map(|(_, c)| {
                            let ts = self.get_meta(ctx, &c.event_id)?.child?.edit_ts?;
                            Some((c.event_id, ts))
                        })
                        .max_by(|(a, ta), (b, tb)| (ta, a).cmp(&(tb, b)));
                }
            }
            "m.thread" => {
                let Some(summary) = aggr.thread.as_mut() else {
                    return;
                };
                // The parent's room is the child's (a child is indexed only then), and
                // the child's is the redaction's (checked above).
                summary.count = summary.count.saturating_sub(1);
                if summary.latest_event_id == target {
                    ctx.delete(
                        &self.room_threads,
                        key::with_pos(&[room], summary.latest_position),
                    );
                    match self.remaining(ctx, &parent, "m.thread").pop() {
                        Some((latest_pos, latest)) if summary.count > 0 => {
                            summary.latest_event_id = latest.event_id;
                            summary.latest_position = latest_pos;
                            ctx.put(
                                &self.room_threads,
                                key::with_pos(&[room], latest_pos),
                                parent.clone().into_bytes(),
                            );
                        }
                        _ => aggr.thread = None,
                    }
                } else if summary.count == 0 {
                    ctx.delete(
                        &self.room_threads,
                        key::with_pos(&[room], summary.latest_position),
                    );
                    aggr.thread = None;
                }
            }
            "m.reference" => aggr.references = aggr.references.saturating_sub(1),
            _ => return,
        }
        if aggr == Aggregation::default() {
            ctx.delete(&self.aggr, parent.into_bytes());
        } else {
            ctx.put(&self.aggr, parent.into_bytes(), json(&aggr));
        }
    }
}

impl Projection for Relations {
    fn name(&self) -> &'static str {
        "relations"
    }

    /// Room records only: a fact (a receipt, a login) does not wake it.
    fn interest(&self) -> Interest {
        Interest::ROOM
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.meta.clone(),
            self.children.clone(),
            self.by_rel.clone(),
            self.aggr.clone(),
            self.participants.clone(),
            self.room_threads.clone(),
            self.redacted.clone(),
        ]
    }

    /// Every table row by row, `meta` decoded: `event id => sender, room #digest, type
    /// #digest, flags` and, for a child, `child of <parent> (<rel_type>) @position`
    /// with its `edit_ts`.
    fn render(&self) -> String {
        let mut tables = self.tables();
        tables.sort_by(|a, b| a.name().cmp(b.name()));
        let mut out = String::new();
        for t in tables {
            if t.name() != self.meta.name() {
                crate::render::render_table_into(&mut out, &t);
                continue;
            }
            let rows: Vec<(Vec<u8>, Vec<u8>)> = t.all().collect();
            out.push_str(&format!("## {} ({} rows)\n", t.name(), rows.len()));
            for (k, v) in rows {
                out.push_str(&crate::render::render_key(&k));
                out.push_str(" => ");
                match EventMeta::decode(&v) {
                    Some(m) => {
                        out.push_str(&format!(
                            "{} room #{:032x} type #{:016x}",
                            m.sender, m.room, m.kind
                        ));
                        for (on, word) in [(m.state, " state"), (m.is_edit, " edit")] {
                            if on {
                                out.push_str(word);
                            }
                        }
                        if let Some(c) = m.child {
                            out.push_str(&format!(
                                ", child of {} ({}) @{}",
                                c.parent, c.rel_type, c.position
                            ));
                            if let Some(ts) = c.edit_ts {
                                out.push_str(&format!(" edit_ts {ts}"));
                            }
                        }
                    }
                    None => out.push_str(&crate::render::render_value(&v)),
                }
                out.push('\n');
            }
            out.push('\n');
        }
        out
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if !record.is_event() {
            return Ok(());
        }
        let pdu = record.pdu().ok_or("unreadable PDU")?;
        let pos = record.position();
        let event_id = pdu.event_id.to_string();
        let room = pdu.room_id.to_string();
        let sender = pdu.sender.to_string();
        let kind = pdu.kind.to_string();
        let content = pdu.content_value();
        let rel = &content["m.relates_to"];
        let rel_type = rel["rel_type"].as_str().unwrap_or_default().to_owned();
        if kind == "m.room.redaction"
            && let Some(target) = &pdu.redacts
        {
            self.redact(ctx, &room, target.as_str());
        }
        let room_hash = room_digest(&room);
        let mut meta = EventMeta {
            room: room_hash,
            sender: sender.clone(),
            kind: type_digest(&kind),
            is_edit: rel_type == "m.replace",
            state: pdu.state_key.is_some(),
            child: None,
        };
        let redacted_key = key::join(&[&event_id, &room]);
        if ctx.get(&self.redacted, &redacted_key).is_some() {
            // Redacted before it arrived: no relation, no content worth indexing.
            ctx.delete(&self.redacted, redacted_key);
            meta.is_edit = false;
            ctx.put(&self.meta, event_id.into_bytes(), meta.encode());
            return Ok(());
        }
        let parent = rel["event_id"].as_str().map(str::to_owned);
        // Relations only count within a room, to an event we know, from an event not
        // redacted already.
        let parent_meta = parent
            .as_deref()
            .filter(|_| !rel_type.is_empty())
            .and_then(|p| self.get_meta(ctx, p))
            .filter(|m| m.room == room_hash);
        let (Some(parent), Some(parent_meta)) = (parent, parent_meta) else {
            ctx.put(&self.meta, event_id.clone().into_bytes(), meta.encode());
            return Ok(());
        };
        // A valid replacement (spec: "Validity of replacement events"): same sender
        // and type, neither a state event, the original not itself an edit, and new
        // content given.
        let edit_ts = (rel_type == "m.replace"
            && parent_meta.sender == sender
            && parent_meta.kind == meta.kind
            && !parent_meta.state
            && pdu.state_key.is_none()
            && !parent_meta.is_edit
            && content["m.new_content"].is_object())
        .then(|| u64::from(pdu.origin_server_ts.0));
        meta.child = Some(ChildMeta {
            parent: parent.clone(),
            rel_type: rel_type.clone(),
            position: pos,
            edit_ts,
        });
        ctx.put(&self.meta, event_id.clone().into_bytes(), meta.encode());
        let child = Child {
            event_id: event_id.clone(),
            rel_type: rel_type.clone(),
            kind: kind.clone(),
        };
        ctx.put(&self.children, key::with_pos(&[&parent], pos), json(&child));
        ctx.put(
            &self.by_rel,
            key::with_pos(&[&parent, &rel_type], pos),
            json(&child),
        );
        let mut aggr = self.get_aggr(ctx, &parent);
        match rel_type.as_str() {
            "m.replace" => {
                let Some(ts) = edit_ts else {
                    return Ok(());
                };
                let newer = aggr
                    .edit
                    .as_ref()
                    .is_none_or(|(id, t)| (ts, event_id.as_str()) > (*t, id.as_str()));
                if newer {
                    aggr.edit = Some((event_id, ts));
                }
            }
            "m.thread" => {
                let summary = aggr.thread.get_or_insert_with(ThreadSummary::default);
                if summary.count > 0 {
                    ctx.delete(
                        &self.room_threads,
                        key::with_pos(&[&room], summary.latest_position),
                    );
                } else {
                    ctx.put(
                        &self.participants,
                        key::join(&[&parent, &parent_meta.sender]),
                        Vec::new(),
                    );
                }
                summary.count += 1;
                summary.latest_event_id = event_id;
                summary.latest_position = pos;
                ctx.put(
                    &self.room_threads,
                    key::with_pos(&[&room], pos),
                    parent.clone().into_bytes(),
                );
                ctx.put(
                    &self.participants,
                    key::join(&[&parent, &sender]),
                    Vec::new(),
                );
            }
            "m.reference" => aggr.references += 1,
            _ => return Ok(()),
        }
        ctx.put(&self.aggr, parent.into_bytes(), json(&aggr));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_rows_read_back_as_written_and_stay_small() {
        let plain = EventMeta {
            room: room_digest("!room:example.org"),
            sender: "@alice:example.org".into(),
            kind: type_digest("m.room.message"),
            is_edit: false,
            state: false,
            child: None,
        };
        // flags 1 + room 16 + type 8 + sender 2 + 18
        assert_eq!(plain.encode().len(), 45);
        assert_eq!(EventMeta::decode(&plain.encode()), Some(plain.clone()));
        let edit = EventMeta {
            is_edit: true,
            state: true,
            child: Some(ChildMeta {
                parent: "$parent".into(),
                rel_type: "m.replace".into(),
                position: 42,
                edit_ts: Some(1_700_000_000_123),
            }),
            ..plain.clone()
        };
        // + position 8 + edit_ts 8 + rel_type 2 + 9 + parent 2 + 7
        assert_eq!(edit.encode().len(), 45 + 36);
        assert_eq!(EventMeta::decode(&edit.encode()), Some(edit.clone()));
        let child = EventMeta {
            child: Some(ChildMeta {
                edit_ts: None,
                ..edit.child.clone().unwrap()
            }),
            ..edit.clone()
        };
        assert_eq!(EventMeta::decode(&child.encode()), Some(child.clone()));
        // A row cut short anywhere reads as nothing, not as a wrong row.
        let row = edit.encode();
        for n in 0..row.len() {
            assert_eq!(EventMeta::decode(&row[..n]), None, "cut at {n}");
        }
        assert_ne!(type_digest("m.room.message"), type_digest("m.room.messagE"));
    }
}
