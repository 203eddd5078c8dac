//! Relations projection (spec: "Forming relationships between events", "Event
//! replacements", "Threading", "Reference relations"): child events by parent, the
//! aggregations bundled into `unsigned.m.relations`, and each room's threads ordered by
//! latest activity.
//!
//! Tables:
//! - `meta`: event id -> [`EventMeta`] (what a later relation needs to know about its
//!   parent: apply reads only its own tables)
//! - `children`: parent, 0x00, position -> [`Child`]
//! - `by_rel`: parent, 0x00, rel type, 0x00, position -> [`Child`]
//! - `aggr`: parent -> [`Aggregation`] (latest edit, thread summary, reference count):
//!   one point read tells a renderer everything it bundles
//! - `participants`: thread root, 0x00, user -> empty
//! - `room_threads`: room, 0x00, position -> root (one row per thread, at its latest
//!   event; `GET /threads` pages through it newest first)
//! - `redacted`: event id -> empty, for a redaction that came before its target
//!   (federation), so the target is never indexed as a child
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

/// What the projection remembers of every event.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct EventMeta {
    /// Room.
    pub room: String,
    /// Sender.
    pub sender: String,
    /// Event type.
    pub kind: String,
    /// `m.relates_to.rel_type`, "" if none.
    pub rel_type: String,
    /// Whether it is a state event.
    pub state: bool,
    /// The event it relates to (`m.relates_to.event_id`) when it was indexed as a
    /// child; "" otherwise (and in rows written before redactions were handled).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub parent: String,
    /// Its position, for the child rows a redaction removes (0 unless a child).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub position: u64,
    /// Its `origin_server_ts` when it is a valid replacement of `parent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edit_ts: Option<u64>,
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

fn is_zero(n: &u64) -> bool {
    *n == 0
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
        serde_json::from_slice(&ctx.get(&self.meta, event_id.as_bytes())?).ok()
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

    /// A redaction of `target`: when it is an indexed child, its rows go and its
    /// parent's aggregation is recomputed from the children left (module doc). A
    /// target not seen yet is remembered in `redacted`.
    fn redact(&self, ctx: &mut ApplyCtx, target: &str) {
        let Some(mut meta) = self.get_meta(ctx, target) else {
            ctx.put(&self.redacted, target.as_bytes().to_vec(), Vec::new());
            return;
        };
        if meta.parent.is_empty() {
            return;
        }
        let parent = std::mem::take(&mut meta.parent);
        let rel_type = std::mem::take(&mut meta.rel_type);
        let pos = meta.position;
        meta.edit_ts = None;
        ctx.put(&self.meta, target.as_bytes().to_vec(), json(&meta));
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
                            let ts = self.get_meta(ctx, &c.event_id)?.edit_ts?;
                            Some((c.event_id, ts))
                        })
                        .max_by(|(a, ta), (b, tb)| (ta, a).cmp(&(tb, b)));
                }
            }
            "m.thread" => {
                let Some(summary) = aggr.thread.as_mut() else {
                    return;
                };
                let room = self
                    .get_meta(ctx, &parent)
                    .map(|m| m.room)
                    .unwrap_or_default();
                summary.count = summary.count.saturating_sub(1);
                if summary.latest_event_id == target {
                    ctx.delete(
                        &self.room_threads,
                        key::with_pos(&[&room], summary.latest_position),
                    );
                    match self.remaining(ctx, &parent, "m.thread").pop() {
                        Some((latest_pos, latest)) if summary.count > 0 => {
                            summary.latest_event_id = latest.event_id;
                            summary.latest_position = latest_pos;
                            ctx.put(
                                &self.room_threads,
                                key::with_pos(&[&room], latest_pos),
                                parent.clone().into_bytes(),
                            );
                        }
                        _ => aggr.thread = None,
                    }
                } else if summary.count == 0 {
                    ctx.delete(
                        &self.room_threads,
                        key::with_pos(&[&room], summary.latest_position),
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
            self.redact(ctx, target.as_str());
        }
        let mut meta = EventMeta {
            room: room.clone(),
            sender: sender.clone(),
            kind: kind.clone(),
            rel_type: rel_type.clone(),
            state: pdu.state_key.is_some(),
            parent: String::new(),
            position: 0,
            edit_ts: None,
        };
        if ctx.get(&self.redacted, event_id.as_bytes()).is_some() {
            // Redacted before it arrived: no relation, no content worth indexing.
            ctx.delete(&self.redacted, event_id.clone().into_bytes());
            meta.rel_type = String::new();
            ctx.put(&self.meta, event_id.into_bytes(), json(&meta));
            return Ok(());
        }
        let parent = rel["event_id"].as_str().map(str::to_owned);
        // Relations only count within a room, to an event we know, from an event not
        // redacted already.
        let parent_meta = parent
            .as_deref()
            .filter(|_| !rel_type.is_empty())
            .and_then(|p| self.get_meta(ctx, p))
            .filter(|m| m.room == room);
        let (Some(parent), Some(parent_meta)) = (parent, parent_meta) else {
            ctx.put(&self.meta, event_id.clone().into_bytes(), json(&meta));
            return Ok(());
        };
        meta.parent = parent.clone();
        meta.position = pos;
        // A valid replacement (spec: "Validity of replacement events"): same sender
        // and type, neither a state event, the original not itself an edit, and new
        // content given.
        if rel_type == "m.replace"
            && parent_meta.sender == sender
            && parent_meta.kind == kind
            && !parent_meta.state
            && pdu.state_key.is_none()
            && parent_meta.rel_type != "m.replace"
            && content["m.new_content"].is_object()
        {
            meta.edit_ts = Some(u64::from(pdu.origin_server_ts.0));
        }
        ctx.put(&self.meta, event_id.clone().into_bytes(), json(&meta));
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
                let Some(ts) = meta.edit_ts else {
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
