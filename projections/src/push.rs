//! Push projection (spec: "Push Notifications"): each user's push rules, evaluated per
//! recipient as each event is applied, producing running notification and highlight
//! counts per room and per thread, and the list `GET /notifications` pages through.
//!
//! **The default recipient.** Most members of a room have the server-default rules,
//! and the server-default rules treat every member alike unless the event names them
//! (`.m.rule.invite_for_me` compares the state key with the user id,
//! `.m.rule.is_user_mention` looks for it in `m.mentions.user_ids`). So what an
//! event does is worked out once per event, for [`DEFAULT_RECIPIENT`] (a user of no
//! server, with the server-default rules, whom no event names), and stored once per
//! room: running counts under the user `""`, the notification in
//! `room_notifications`. A recipient's own rows are written only where its outcome
//! differs from the default's (its own rules, or the event names it): an
//! *exception*. A message in a room of 800 default-rule members writes a handful of
//! rows, not 800 of each (BRIEF §4: no per-member fan-out on the write path).
//! A user's count is the room's default count plus the user's own adjustments,
//! taken from the user's join, so it is exactly what evaluating every event for that
//! user would give.
//!
//! Tables (layout [`LAYOUT`]):
//! - `rules`: user -> ruma `Ruleset` JSON, for users who changed a rule (others have
//!   the server default)
//! - `rules_log`: user, 0x00, position -> empty (push rule changes, for `/sync`)
//! - `members`: room, 0x00, user -> join position (8 bytes BE) + display name (joined
//!   members, as the push projection itself saw them: apply reads only its own
//!   tables)
//! - `memberships`: user, 0x00, room, 0x00, join position -> leave position (8 bytes
//!   BE; `u64::MAX` while joined): the spans in which the room's default
//!   notifications are the user's (`GET /notifications`)
//! - `custom_members`: room, 0x00, user -> empty: joined members with rules of their
//!   own (a `rules` row); `pushered_members`: room, 0x00, user -> empty: joined
//!   members in `pushered`. With the members an event names, these are the only
//!   members a message is evaluated for one by one: a message costs the same in a
//!   room of 8 members and of 8,000
//! - `rooms`: room -> [`RoomRow`] (joined count, power levels, creators)
//! - `event_thread`: event id -> thread root (events that belong to a thread)
//! - `sent`: room, 0x00, user, 0x00, thread ("" for any) -> position of the user's last
//!   event (sending an event marks everything before it read, spec: "Receiving
//!   notifications")
//! - `counts`: room, 0x00, user, 0x00, thread ("" for the whole room, "main" for the
//!   main timeline, else the root id), 0x00, position -> running (notify, highlight),
//!   two u64 BE added with wrapping: for the user `""` the default recipient's counts
//!   (they only grow), for a user that user's adjustments to them (which may be
//!   negative: a muted room, the user's own events)
//! - `thread_latest`: room, 0x00, user, 0x00, thread -> latest notifying position
//!   (user `""`: the default recipient)
//! - `thread_recent`: room, 0x00, user, 0x00, position -> thread (one row per thread,
//!   at its latest notifying position: threads with unread notifications are found by
//!   a scan from the read position, never over every thread; user `""` as above)
//! - `room_notifications`: room, 0x00, position -> [`Notification`] (the default
//!   recipient's, with the sender, whose own event it is not); `room_highlights`: room, 0x00, position -> empty (those highlighted)
//! - `notifications`: user, 0x00, position -> [`Notification`] of an exception, or
//!   empty: the room's default notification at that position is not the user's (its
//!   rules suppress it)
//! - `highlights`: user, 0x00, position -> empty (exceptions that highlight)
//! - `queue`: position (BE), user -> room: the push queue, one row per notification
//!   of a user in `pushered`, in position order, which the push-gateway consumer reads
//!   by position (it asks the `pushers` projection for the user's pushers at delivery);
//!   a `PushQueuePruned { upto }` fact deletes the rows at or before `upto` (the
//!   consumer journals it once every reader of the queue is past them)
//! - `pushered`: user -> empty: users who ever set a pusher (an over-approximation the
//!   consumer narrows; it keeps users without pushers, most users and every bot, out
//!   of the queue, so their notifications cost the consumer nothing)
//!
//! A count is four range reads and two point reads whatever the room's size (BRIEF
//! §4): for the room's default and for the user's adjustments, the last running row
//! at or before `upto` minus the last at or before the read position (the user's join,
//! read receipt or own last event, whichever is latest); never a walk over events.

use std::{collections::HashMap, sync::Arc};

use parking_lot::Mutex;
use ruma::push::Ruleset;
use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    push_rules::{CompiledRuleset, GlobCache, RoomContext, flatten, power_value},
    runtime::Projection,
    store::{ApplyCtx, LastChange, ProjectionDb, Table, key},
};

/// Compiled rulesets kept in memory; past this the cache is emptied and refilled.
pub const RULESET_CACHE_MAX: usize = 10_000;

/// The version of this projection's row shapes ([`ProjectionDb::ensure_layout`]):
/// 2 since the default recipient (tables written in layout 1 are rebuilt).
pub const LAYOUT: u32 = 2;

/// The default recipient (see the module doc): a user id no server can have (`.invalid`
/// is reserved, RFC 2606). An event that names it anyway is evaluated for every
/// recipient one by one.
pub const DEFAULT_RECIPIENT: &str = "@default.recipient:spindle.invalid";

/// What the push projection keeps per room.
#[derive(Serialize, Deserialize, Debug, Clone, Default)]
pub struct RoomRow {
    /// Joined members.
    pub joined: u64,
    /// `users` of the power levels.
    #[serde(default)]
    pub users: serde_json::Map<String, serde_json::Value>,
    /// `users_default`.
    #[serde(default)]
    pub users_default: i64,
    /// `notifications` of the power levels.
    #[serde(default)]
    pub notifications: serde_json::Map<String, serde_json::Value>,
    /// Privileged creators (room version 12).
    #[serde(default)]
    pub creators: Vec<String>,
}

/// One notification (spec: `GET /notifications`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Notification {
    /// The room.
    pub room_id: String,
    /// The event.
    pub event_id: String,
    /// The matched rule's actions.
    pub actions: serde_json::Value,
    /// The event's `origin_server_ts` (ms).
    pub ts: u64,
    /// Whether the highlight tweak was set.
    pub highlight: bool,
    /// The event's sender, in a room's default notification (`room_notifications`):
    /// the sender's own event is not its notification. Empty in a user's own row.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sender: String,
}

/// Unread counts (spec: `UnreadNotificationCounts`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Unread notifying events.
    pub notification_count: u64,
    /// Of which highlighted.
    pub highlight_count: u64,
}

/// The push projection.
pub struct Push {
    rules: Table,
    rules_log: Table,
    members: Table,
    memberships: Table,
    custom_members: Table,
    pushered_members: Table,
    rooms: Table,
    event_thread: Table,
    sent: Table,
    counts: Table,
    thread_latest: Table,
    thread_recent: Table,
    room_notifications: Table,
    room_highlights: Table,
    notifications: Table,
    highlights: Table,
    queue: Table,
    pushered: Table,
    last_rules: LastChange,
    globs: GlobCache,
    /// The `pushered` table in memory (read for every notified member; it only
    /// grows, and apply is its only writer).
    pushered_users: parking_lot::RwLock<std::collections::HashSet<String>>,
    /// User -> their compiled rules if they changed any (`None`: the server default).
    compiled: Mutex<HashMap<String, Option<Arc<CompiledRuleset>>>>,
    /// The server-default rules of [`DEFAULT_RECIPIENT`].
    default_rules: CompiledRuleset,
    stats: PushStats,
}

/// What the push projection did (counting tests).
#[derive(Debug, Default)]
pub struct PushStats {
    /// Recipients whose rules were evaluated one by one (their own rules, or named
    /// by the event): the default recipient's evaluation covers the others.
    pub evaluations: std::sync::atomic::AtomicU64,
    /// Exceptions: recipients whose outcome differs from the default recipient's, so
    /// that rows of their own were written.
    pub exceptions: std::sync::atomic::AtomicU64,
}

/// How a recipient stands to an event's default outcome.
#[derive(Clone, Copy)]
struct Baseline {
    /// The default notification applies to the recipient (a joined member): an
    /// exception is stored against it. `false` for an invitee, who is not a member.
    member: bool,
    notify: bool,
    highlight: bool,
}

fn queue_key(pos: u64, user: &str) -> Vec<u8> {
    let mut k = pos.to_be_bytes().to_vec();
    k.extend_from_slice(user.as_bytes());
    k
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("rows serialize")
}

fn pair(v: &[u8]) -> (u64, u64) {
    let n = v
        .get(..8)
        .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
        .unwrap_or(0);
    let h = v
        .get(8..16)
        .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
        .unwrap_or(0);
    (n, h)
}

fn encode_pair(n: u64, h: u64) -> Vec<u8> {
    let mut v = n.to_be_bytes().to_vec();
    v.extend_from_slice(&h.to_be_bytes());
    v
}

fn join_position(member_row: &[u8]) -> u64 {
    member_row
        .get(..8)
        .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
        .unwrap_or(0)
}

/// The server-default ruleset for a user.
pub fn default_ruleset(user_id: &str) -> Option<Ruleset> {
    let user = ruma::UserId::parse(user_id).ok()?;
    Some(Ruleset::server_default(&user))
}

/// Applies one push-rule fact to a ruleset. Errors say why the edit does not apply
/// (unknown rule, bad position, server-default rule): the API checks the same before
/// it submits, so an error here only means a race, and the fact changes nothing.
pub fn apply_rule_fact(ruleset: &mut Ruleset, fact: &Fact) -> Result<(), String> {
    use ruma::push::{
        NewConditionalPushRule, NewPatternedPushRule, NewPushRule, NewSimplePushRule, RuleKind,
    };
    let kind_of = |k: &str| -> Result<RuleKind, String> {
        match k {
            "override" => Ok(RuleKind::Override),
            "underride" => Ok(RuleKind::Underride),
            "sender" => Ok(RuleKind::Sender),
            "room" => Ok(RuleKind::Room),
            "content" => Ok(RuleKind::Content),
            _ => Err(format!("unknown rule kind {k}")),
        }
    };
    match fact {
        Fact::PushRuleSet {
            kind,
            rule_id,
            rule,
            before,
            after,
            ..
        } => {
            let actions = crate::push_rules::clean_actions(&rule["actions"])
                .ok_or("actions must be a list of actions")?;
            let new = match kind.as_str() {
                "override" | "underride" => {
                    let conditions = match rule.get("conditions") {
                        None | Some(serde_json::Value::Null) => Vec::new(),
                        Some(c) => serde_json::from_value(c.clone())
                            .map_err(|e| format!("bad conditions: {e}"))?,
                    };
                    let r = NewConditionalPushRule::new(rule_id.clone(), conditions, actions);
                    if kind == "override" {
                        NewPushRule::Override(r)
                    } else {
                        NewPushRule::Underride(r)
                    }
                }
                "content" => {
                    let pattern = rule["pattern"]
                        .as_str()
                        .ok_or("content rules need a pattern")?;
                    NewPushRule::Content(NewPatternedPushRule::new(
                        rule_id.clone(),
                        pattern.to_owned(),
                        actions,
                    ))
                }
                "room" => NewPushRule::Room(NewSimplePushRule::new(
                    ruma::OwnedRoomId::try_from(rule_id.as_str())
                        .map_err(|e| format!("room rule id: {e}"))?,
                    actions,
                )),
                "sender" => NewPushRule::Sender(NewSimplePushRule::new(
                    ruma::OwnedUserId::try_from(rule_id.as_str())
                        .map_err(|e| format!("sender rule id: {e}"))?,
                    actions,
                )),
                k => return Err(format!("unknown rule kind {k}")),
            };
            ruleset
                .insert(new, after.as_deref(), before.as_deref())
                .map_err(|e| e.to_string())
        }
        Fact::PushRuleDeleted { kind, rule_id, .. } => ruleset
            .remove(kind_of(kind)?, rule_id)
            .map_err(|e| e.to_string()),
        Fact::PushRuleEnabledSet {
            kind,
            rule_id,
            enabled,
            ..
        } => ruleset
            .set_enabled(kind_of(kind)?, rule_id, *enabled)
            .map_err(|e| e.to_string()),
        Fact::PushRuleActionsSet {
            kind,
            rule_id,
            actions,
            ..
        } => {
            let actions = crate::push_rules::clean_actions(actions)
                .ok_or("actions must be a list of actions")?;
            ruleset
                .set_actions(kind_of(kind)?, rule_id, actions)
                .map_err(|e| e.to_string())
        }
        _ => Ok(()),
    }
}

/// The user a push-rule fact belongs to.
fn rule_fact_user(fact: &Fact) -> Option<&str> {
    match fact {
        Fact::PushRuleSet { user_id, .. }
        | Fact::PushRuleDeleted { user_id, .. }
        | Fact::PushRuleEnabledSet { user_id, .. }
        | Fact::PushRuleActionsSet { user_id, .. } => Some(user_id),
        _ => None,
    }
}

fn thread_of(content: &serde_json::Value) -> (Option<String>, Option<String>) {
    // (m.thread root, related event id). Only an event id: a thread root is a key part
    // of the running counts, and a string such as "main" or one holding 0x00 would
    // write into another thread's (or the whole room's) counts.
    let rel = &content["m.relates_to"];
    let target = rel["event_id"]
        .as_str()
        .filter(|id| !id.contains('\0') && ruma::EventId::parse(id).is_ok())
        .map(str::to_owned);
    if rel["rel_type"] == "m.thread" {
        return (target.clone(), target);
    }
    (None, target)
}

impl Push {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Push, String> {
        let t = |name: &str| db.table("push", name);
        let globs = GlobCache::default();
        let push = Push {
            rules: t("rules")?,
            rules_log: t("rules_log")?,
            members: t("members")?,
            memberships: t("memberships")?,
            custom_members: t("custom_members")?,
            pushered_members: t("pushered_members")?,
            rooms: t("rooms")?,
            event_thread: t("event_thread")?,
            sent: t("sent")?,
            counts: t("counts")?,
            thread_latest: t("thread_latest")?,
            thread_recent: t("thread_recent")?,
            room_notifications: t("room_notifications")?,
            room_highlights: t("room_highlights")?,
            notifications: t("notifications")?,
            highlights: t("highlights")?,
            queue: t("queue")?,
            pushered: t("pushered")?,
            last_rules: LastChange::default(),
            default_rules: CompiledRuleset::compile(
                &default_ruleset(DEFAULT_RECIPIENT).ok_or("the default recipient's id")?,
                &globs,
            ),
            globs,
            compiled: Mutex::new(HashMap::new()),
            stats: PushStats::default(),
            pushered_users: Default::default(),
        };
        push.reload();
        Ok(push)
    }

    /// A user's ruleset: stored edits over the server default (kept current with the
    /// server default's rule list).
    pub fn ruleset(&self, user_id: &str) -> Option<Ruleset> {
        let mut set = match self.rules.get(user_id.as_bytes()) {
            Some(v) => serde_json::from_slice::<Ruleset>(&v).ok()?,
            None => return default_ruleset(user_id),
        };
        if let Some(d) = default_ruleset(user_id) {
            set.update_with_server_default(d);
        }
        Some(set)
    }

    /// Position of the user's latest push rule change (memory after the first ask).
    pub fn rules_last_change(&self, user_id: &str) -> u64 {
        self.last_rules.get(user_id, &self.rules_log)
    }

    /// What apply did: evaluations and exceptions (counting tests).
    pub fn stats(&self) -> &PushStats {
        &self.stats
    }

    /// Globs compiled so far (counting tests).
    pub fn glob_compiles(&self) -> u64 {
        self.globs.compiles()
    }

    fn last_pair(&self, table: &Table, parts: &[&str], at: u64) -> (u64, u64) {
        let start = key::with_pos(parts, 0);
        let end = key::with_pos(parts, at.saturating_add(1));
        table
            .scan_range(&start, &end, true, 1)
            .first()
            .map(|(_, v)| pair(v))
            .unwrap_or((0, 0))
    }

    /// Position of the user's last own event in the room (`thread` "" for any).
    pub fn last_sent(&self, room_id: &str, user_id: &str, thread: &str) -> u64 {
        self.sent
            .get(&key::join(&[room_id, user_id, thread]))
            .and_then(|v| {
                v.get(..8)
                    .map(|b| u64::from_be_bytes(b.try_into().expect("8")))
            })
            .unwrap_or(0)
    }

    /// The position of the user's join of the room, if the user is joined.
    fn joined_at(&self, room_id: &str, user_id: &str) -> Option<u64> {
        self.members
            .get(&key::join(&[room_id, user_id]))
            .map(|v| join_position(&v))
    }

    /// Unread counts for `user_id` in `room_id` in `(from, upto]`, where `from` is the
    /// read receipt's position; the user's join and own last event count as read too.
    /// `thread`: "" for the whole room, "main" for the main timeline, or a thread root.
    /// Zero for a user who is not joined (invited and left rooms have no counts).
    /// Four range reads and two point reads, whatever the room's size.
    pub fn unread(
        &self,
        room_id: &str,
        user_id: &str,
        thread: &str,
        from: u64,
        upto: u64,
    ) -> Counts {
        if upto <= from {
            // Read up to `upto`: no read needed (the join and the own event only ever
            // move `from` later).
            return Counts::default();
        }
        let Some(joined) = self.joined_at(room_id, user_id) else {
            return Counts::default();
        };
        // Only the user's last own event is kept: one sent after `upto` (a count taken
        // at an older position) cannot say what was read by then, so it is ignored
        // (the user's own events never count: the sender's adjustments take them out).
        let sent = self.last_sent(room_id, user_id, thread);
        let mut from = from.max(joined);
        if sent <= upto {
            from = from.max(sent);
        }
        if upto <= from {
            return Counts::default();
        }
        let span = |parts: &[&str]| {
            let (n1, h1) = self.last_pair(&self.counts, parts, upto);
            let (n0, h0) = self.last_pair(&self.counts, parts, from);
            (n1.wrapping_sub(n0), h1.wrapping_sub(h0))
        };
        let (rn, rh) = span(&[room_id, "", thread]);
        let (un, uh) = span(&[room_id, user_id, thread]);
        // Adjustments never take a count below zero; clamped all the same.
        let total = |a: u64, b: u64| (a.wrapping_add(b) as i64).max(0) as u64;
        Counts {
            notification_count: total(rn, un),
            highlight_count: total(rh, uh),
        }
    }

    /// Threads of a room whose latest notification for the user (or for the room's
    /// default recipient) is in `(after, upto]` and after the user's join, newest
    /// first, at most `limit`: the candidates for per-thread unread counts (a
    /// candidate may count zero for the user).
    pub fn threads_notified(
        &self,
        room_id: &str,
        user_id: &str,
        after: u64,
        upto: u64,
        limit: usize,
    ) -> Vec<String> {
        let Some(joined) = self.joined_at(room_id, user_id) else {
            return vec![];
        };
        let after = after.max(joined);
        if upto <= after {
            return vec![];
        }
        let mut rows: Vec<(u64, String)> = Vec::new();
        for who in [user_id, ""] {
            rows.extend(
                self.thread_recent
                    .scan_range(
                        &key::with_pos(&[room_id, who], after + 1),
                        &key::with_pos(&[room_id, who], upto.saturating_add(1)),
                        true,
                        limit,
                    )
                    .into_iter()
                    .map(|(k, v)| {
                        (
                            key::trailing_pos(&k),
                            String::from_utf8_lossy(&v).into_owned(),
                        )
                    }),
            );
        }
        rows.sort_by_key(|r| std::cmp::Reverse(r.0));
        let mut out: Vec<String> = Vec::new();
        for (_, thread) in rows {
            if out.len() == limit {
                break;
            }
            if !out.contains(&thread) {
                out.push(thread);
            }
        }
        out
    }

    /// The thread root an event belongs to, if it is in a thread.
    pub fn thread_root(&self, event_id: &str) -> Option<String> {
        self.event_thread
            .get(event_id.as_bytes())
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// The rooms the user is or was joined to, with each span's join and leave
    /// positions (`u64::MAX` while joined).
    fn spans(&self, user_id: &str) -> Vec<(String, u64, u64)> {
        let prefix = key::prefix(&[user_id]);
        self.memberships
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                let room = k.get(prefix.len()..k.len().checked_sub(9)?)?;
                let leave = u64::from_be_bytes(v.get(..8)?.try_into().ok()?);
                Some((
                    String::from_utf8_lossy(room).into_owned(),
                    key::trailing_pos(&k),
                    leave,
                ))
            })
            .collect()
    }

    /// A user's notifications at positions below `before`, newest first, at most
    /// `limit`; `highlights_only` for `only=highlight`. The user's exceptions merged
    /// with the default notifications of every room in the spans the user was joined
    /// (one range read per span, then one point read per default notification to see
    /// whether the user has an exception at its position).
    pub fn notifications(
        &self,
        user_id: &str,
        before: u64,
        limit: usize,
        highlights_only: bool,
    ) -> Vec<(u64, Notification)> {
        if limit == 0 {
            return vec![];
        }
        let spans = self.spans(user_id);
        let (own, of_room) = if highlights_only {
            (&self.highlights, &self.room_highlights)
        } else {
            (&self.notifications, &self.room_notifications)
        };
        enum Candidate {
            Own,
            Room(String),
        }
        // Each source is read newest first, `fetch` rows at most; a source that filled
        // its `fetch` may hold older rows, so only candidates at or above the highest
        // such cut are known to be complete. Too few of them: read again, deeper.
        let mut fetch = limit;
        loop {
            let mut cut = 0u64;
            let mut candidates: std::collections::BTreeMap<u64, Candidate> = Default::default();
            // Newest first in `[lo, hi)` under `part`, raising `cut` if the read was full.
            let mut read = |table: &Table, part: &str, lo: u64, hi: u64| {
                let rows = table.scan_range(
                    &key::with_pos(&[part], lo),
                    &key::with_pos(&[part], hi),
                    true,
                    fetch,
                );
                if rows.len() == fetch {
                    cut = cut.max(rows.last().map_or(0, |(k, _)| key::trailing_pos(k)));
                }
                rows
            };
            for (k, v) in read(own, user_id, 0, before) {
                // An empty row in `notifications` is a suppression, not a notification.
                if highlights_only || !v.is_empty() {
                    candidates.insert(key::trailing_pos(&k), Candidate::Own);
                }
            }
            for (room, join, leave) in &spans {
                let end = (*leave).min(before);
                if end <= join.saturating_add(1) {
                    continue;
                }
                for (k, _) in read(of_room, room, join + 1, end) {
                    candidates
                        .entry(key::trailing_pos(&k))
                        .or_insert_with(|| Candidate::Room(room.clone()));
                }
            }
            let mut out = Vec::new();
            for (&pos, candidate) in candidates.iter().rev() {
                if pos < cut || out.len() == limit {
                    break;
                }
                let row = match candidate {
                    Candidate::Own => self.notifications.get(&key::with_pos(&[user_id], pos)),
                    Candidate::Room(room) => {
                        match self.notifications.get(&key::with_pos(&[user_id], pos)) {
                            Some(own) => Some(own),
                            None => self.room_notifications.get(&key::with_pos(&[room], pos)),
                        }
                    }
                };
                let Some(n) = row
                    .filter(|v| !v.is_empty())
                    .and_then(|v| serde_json::from_slice::<Notification>(&v).ok())
                else {
                    continue;
                };
                // The sender's own event is in the room's default notifications.
                if (highlights_only && !n.highlight) || n.sender == user_id {
                    continue;
                }
                out.push((pos, n));
            }
            if out.len() >= limit || cut == 0 {
                return out;
            }
            fetch = fetch.saturating_mul(4);
        }
    }

    /// The notifications of the event at `position` (the push queue), one per
    /// notified user, ordered by user id; at most `limit`.
    pub fn queued_at(&self, position: u64, limit: usize) -> Vec<(String, Notification)> {
        let prefix = position.to_be_bytes();
        self.queue
            .scan_prefix(&prefix, limit)
            .into_iter()
            .filter_map(|(k, room)| {
                let user = String::from_utf8_lossy(&k[8..]).into_owned();
                let v = match self.notifications.get(&key::with_pos(&[&user], position)) {
                    Some(own) => own,
                    None => self.room_notifications.get(&key::with_pos(
                        &[std::str::from_utf8(&room).ok()?],
                        position,
                    ))?,
                };
                Some((user, serde_json::from_slice(&v).ok()?))
            })
            .collect()
    }

    /// Rows in the push queue (every row read: for tests and the admin, not a hot
    /// path).
    pub fn queue_len(&self) -> usize {
        self.queue.scan_prefix(&[], usize::MAX).len()
    }

    /// The position of the oldest push-queue row, if any (one row read).
    pub fn queue_first(&self) -> Option<u64> {
        self.queue
            .scan_prefix(&[], 1)
            .first()
            .map(|(k, _)| u64::from_be_bytes(k[..8].try_into().expect("8-byte position")))
    }

    /// The user's own compiled rules, or `None` for a user with the server default
    /// (no stored edits). Cached; an edit drops the user's entry.
    fn custom_rules(&self, ctx: &ApplyCtx, user_id: &str) -> Option<Arc<CompiledRuleset>> {
        if let Some(c) = self.compiled.lock().get(user_id) {
            return c.clone();
        }
        let compiled = ctx.get(&self.rules, user_id.as_bytes()).and_then(|v| {
            let mut set: Ruleset = serde_json::from_slice(&v).ok()?;
            if let Some(d) = default_ruleset(user_id) {
                set.update_with_server_default(d);
            }
            Some(Arc::new(CompiledRuleset::compile(&set, &self.globs)))
        });
        let mut cache = self.compiled.lock();
        if cache.len() >= RULESET_CACHE_MAX {
            cache.clear();
        }
        cache.insert(user_id.to_owned(), compiled.clone());
        compiled
    }

    fn latest_pair(&self, ctx: &ApplyCtx, parts: &[&str], before: u64) -> (u64, u64) {
        let below = key::with_pos(parts, before);
        match ctx.staged_last_below(&self.counts, &key::prefix(parts), &below) {
            Some(v) => pair(&v),
            None => self.last_pair(&self.counts, parts, before.saturating_sub(1)),
        }
    }

    /// Adds `(dn, dh)` (wrapping: adjustments may be negative) to the running counts
    /// under `parts` at `pos`.
    fn bump(&self, ctx: &ApplyCtx, parts: &[&str], pos: u64, dn: i64, dh: i64) {
        let (n, h) = self.latest_pair(ctx, parts, pos);
        ctx.put(
            &self.counts,
            key::with_pos(parts, pos),
            encode_pair(n.wrapping_add(dn as u64), h.wrapping_add(dh as u64)),
        );
    }

    /// Marks `thread` as notified at `pos` for `who` (`""`: the default recipient).
    fn note_thread(&self, ctx: &ApplyCtx, room: &str, who: &str, thread: &str, pos: u64) {
        let latest_key = key::join(&[room, who, thread]);
        if let Some(old) = ctx.get(&self.thread_latest, &latest_key)
            && old.len() == 8
        {
            let old = u64::from_be_bytes(old[..8].try_into().expect("8"));
            ctx.delete(&self.thread_recent, key::with_pos(&[room, who], old));
        }
        ctx.put(&self.thread_latest, latest_key, pos.to_be_bytes().to_vec());
        ctx.put(
            &self.thread_recent,
            key::with_pos(&[room, who], pos),
            thread.as_bytes().to_vec(),
        );
    }

    /// The rooms `user` is joined to now (as this projection saw them).
    fn current_rooms(&self, ctx: &ApplyCtx, user: &str) -> Vec<String> {
        let prefix = key::prefix(&[user]);
        ctx.scan_prefix(&self.memberships, &prefix)
            .into_iter()
            .filter(|(_, v)| v.as_slice() == u64::MAX.to_be_bytes())
            .filter_map(|(k, _)| {
                let room = k.get(prefix.len()..k.len().checked_sub(9)?)?;
                Some(String::from_utf8_lossy(room).into_owned())
            })
            .collect()
    }

    /// Queues a notification of `user` for the push gateways, if the user ever set
    /// a pusher.
    fn enqueue(&self, ctx: &ApplyCtx, room: &str, user: &str, pos: u64) {
        if self.pushered_users.read().contains(user) {
            ctx.put(&self.queue, queue_key(pos, user), room.as_bytes().to_vec());
        }
    }

    /// Stores an exception: `user`'s outcome (`own`: its notification, `None` when
    /// the event does not notify it) where it differs from `base`.
    #[allow(clippy::too_many_arguments)]
    fn except(
        &self,
        ctx: &ApplyCtx,
        room: &str,
        user: &str,
        threads: (Option<&str>, &str),
        pos: u64,
        base: Baseline,
        own: Option<Notification>,
    ) {
        use std::sync::atomic::Ordering::Relaxed;
        self.stats.exceptions.fetch_add(1, Relaxed);
        let (thread, thread_key) = threads;
        let (on, oh) = own.as_ref().map_or((false, false), |n| (true, n.highlight));
        if base.member {
            let dn = i64::from(on) - i64::from(base.notify);
            let dh = i64::from(oh) - i64::from(base.highlight);
            if dn != 0 || dh != 0 {
                self.bump(ctx, &[room, user, ""], pos, dn, dh);
                self.bump(ctx, &[room, user, thread_key], pos, dn, dh);
            }
        }
        let nkey = key::with_pos(&[user], pos);
        match own {
            Some(n) => {
                if let Some(t) = thread
                    && !(base.member && base.notify)
                {
                    self.note_thread(ctx, room, user, t, pos);
                }
                if n.highlight {
                    ctx.put(&self.highlights, nkey.clone(), Vec::new());
                }
                ctx.put(&self.notifications, nkey, json(&n));
                self.enqueue(ctx, room, user, pos);
            }
            None if base.member && base.notify => ctx.put(&self.notifications, nkey, Vec::new()),
            None => {}
        }
    }

    fn apply_fact(&self, ctx: &mut ApplyCtx, record: &StoredRecord, fact: Fact) {
        let Some(user) = rule_fact_user(&fact).map(str::to_owned) else {
            return;
        };
        let stored = ctx.get(&self.rules, user.as_bytes());
        let first_edit = stored.is_none();
        let mut ruleset = match stored.and_then(|v| serde_json::from_slice::<Ruleset>(&v).ok()) {
            Some(r) => r,
            None => match default_ruleset(&user) {
                Some(r) => r,
                None => return,
            },
        };
        if let Err(e) = apply_rule_fact(&mut ruleset, &fact) {
            tracing::debug!(user, error = %e, "push rule edit does not apply");
            return;
        }
        ctx.put(&self.rules, user.clone().into_bytes(), json(&ruleset));
        if first_edit {
            for room in self.current_rooms(ctx, &user) {
                ctx.put(&self.custom_members, key::join(&[&room, &user]), Vec::new());
            }
        }
        ctx.put(
            &self.rules_log,
            key::with_pos(&[&user], record.position()),
            Vec::new(),
        );
        // Later events of this batch must see the edit: the cache is refreshed now
        // (it is only read by apply, which is single-threaded).
        self.compiled.lock().remove(&user);
        let (last, pos) = (self.last_rules.clone(), record.position());
        ctx.after_commit(move || last.bump(user, pos));
    }

    fn apply_event(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let pdu = record.pdu().ok_or("unreadable PDU")?;
        let pos = record.position();
        let room = pdu.room_id.to_string();
        let sender = pdu.sender.to_string();
        let kind = pdu.kind.to_string();
        let content = pdu.content_value();
        let event_id = pdu.event_id.to_string();

        // Thread membership: an m.thread relation names the root; any other relation
        // inherits the thread of the event it relates to (one hop per event, so chains
        // of any depth resolve).
        let (root, target) = thread_of(&content);
        let thread = match root {
            Some(r) => Some(r),
            None => target.and_then(|t| {
                ctx.get(&self.event_thread, t.as_bytes())
                    .map(|v| String::from_utf8_lossy(&v).into_owned())
            }),
        };
        if let Some(t) = &thread {
            ctx.put(
                &self.event_thread,
                event_id.clone().into_bytes(),
                t.clone().into_bytes(),
            );
        }
        let thread_key = thread.clone().unwrap_or_else(|| "main".to_owned());
        for t in ["", thread_key.as_str()] {
            ctx.put(
                &self.sent,
                key::join(&[&room, &sender, t]),
                pos.to_be_bytes().to_vec(),
            );
        }

        let room_row: RoomRow = ctx
            .get(&self.rooms, room.as_bytes())
            .and_then(|v| serde_json::from_slice(&v).ok())
            .unwrap_or_default();
        // Recipients: joined members but the sender (user, display name), and the
        // target of an invite, who is not a member.
        let prefix = key::prefix(&[&room]);
        let membership = content["membership"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let invitee = pdu.state_key.as_ref().filter(|target| {
            kind == "m.room.member"
                && membership == "invite"
                && **target != sender
                && ctx
                    .get(&self.members, &key::join(&[&room, target]))
                    .is_none()
        });
        let sender_joined = ctx
            .get(&self.members, &key::join(&[&room, &sender]))
            .is_some();
        let recipients = (room_row.joined as usize + usize::from(invitee.is_some()))
            .saturating_sub(usize::from(sender_joined));
        if recipients > 0
            && let Some(flat) = flatten(&pdu.json)
        {
            let sender_power = room_row
                .users
                .get(&sender)
                .and_then(power_value)
                .unwrap_or(room_row.users_default);
            let rctx = RoomContext {
                member_count: room_row.joined,
                sender_power,
                notifications: Some(&room_row.notifications),
                sender_is_creator: room_row.creators.contains(&sender),
            };
            let ts = u64::from(pdu.origin_server_ts.0);
            // Whom the server-default rules treat apart: the state key's user
            // (`.m.rule.invite_for_me`, matched case-insensitively) and the users in
            // `m.mentions.user_ids` (`.m.rule.is_user_mention`).
            let state_key_lower = pdu.state_key.as_deref().map(str::to_lowercase);
            let mentioned: Vec<&str> = content["m.mentions"]["user_ids"]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            let named = |user: &str| {
                mentioned.contains(&user)
                    || state_key_lower
                        .as_deref()
                        .is_some_and(|k| k == user.to_lowercase())
            };
            // An event naming the default recipient itself is evaluated for everyone.
            let trusted = !named(DEFAULT_RECIPIENT);
            let actions_of =
                |o: Option<crate::push_rules::Outcome>| o.map(|o| o.actions).unwrap_or_default();
            let default_actions = actions_of(self.default_rules.evaluate(&flat, &rctx, ""));
            let default_json = serde_json::to_value(&default_actions).unwrap_or_default();
            let notification = |actions: serde_json::Value, highlight: bool| Notification {
                room_id: room.clone(),
                event_id: event_id.clone(),
                actions,
                ts,
                highlight,
                sender: String::new(),
            };
            let base = Baseline {
                member: true,
                notify: default_actions.iter().any(|a| a.should_notify()),
                highlight: default_actions.iter().any(|a| a.is_highlight()),
            };
            let threads = (thread.as_deref(), thread_key.as_str());
            if base.notify {
                let dh = i64::from(base.highlight);
                self.bump(ctx, &[&room, "", ""], pos, 1, dh);
                self.bump(ctx, &[&room, "", &thread_key], pos, 1, dh);
                if let Some(t) = &thread {
                    self.note_thread(ctx, &room, "", t, pos);
                }
                let rkey = key::with_pos(&[&room], pos);
                if base.highlight {
                    ctx.put(&self.room_highlights, rkey.clone(), Vec::new());
                }
                // The sender's own event is not its notification: its counts are
                // adjusted back (so a count taken at a position before the sender's
                // last own event is still exact), and the room's notification names it.
                if sender_joined {
                    self.bump(ctx, &[&room, &sender, ""], pos, -1, -dh);
                    self.bump(ctx, &[&room, &sender, &thread_key], pos, -1, -dh);
                }
                ctx.put(
                    &self.room_notifications,
                    rkey,
                    json(&Notification {
                        sender: sender.clone(),
                        ..notification(default_json.clone(), base.highlight)
                    }),
                );
            }
            // Whom to evaluate one by one: the members with rules of their own, those
            // with pushers (their notifications are queued), and those the event names;
            // every member when the event names the default recipient or is an invite
            // (`.m.rule.invite_for_me` matches the state key case-insensitively, so the
            // member it names is not found by its key; other membership events, joins
            // and leaves, match it for nobody).
            let invite = kind == "m.room.member" && membership == "invite";
            let members: Vec<(Vec<u8>, Vec<u8>)> = if trusted && !invite {
                let mut set = std::collections::BTreeMap::new();
                for table in [&self.custom_members, &self.pushered_members] {
                    for (k, _) in ctx.scan_prefix(table, &prefix) {
                        if let Some(v) = ctx.get(&self.members, &k) {
                            set.insert(k, v);
                        }
                    }
                }
                for user in &mentioned {
                    let k = key::join(&[&room, user]);
                    if let Some(v) = ctx.get(&self.members, &k) {
                        set.insert(k, v);
                    }
                }
                set.into_iter().collect()
            } else {
                ctx.scan_prefix(&self.members, &prefix)
            };
            // The invitee's row: keyed like a member's, with no join position.
            let invitee = invitee.map(|u| ([prefix.as_slice(), u.as_bytes()].concat(), Vec::new()));
            for (k, v) in members.iter().chain(invitee.iter()) {
                let user = String::from_utf8_lossy(&k[prefix.len()..]);
                if user == sender {
                    continue;
                }
                let base = Baseline {
                    member: !v.is_empty(),
                    ..base
                };
                let own_rules = match self.custom_rules(ctx, &user) {
                    Some(rules) => Some(rules),
                    None if !trusted || named(&user) || !base.member => default_ruleset(&user)
                        .map(|r| Arc::new(CompiledRuleset::compile(&r, &self.globs))),
                    None => None,
                };
                let Some(rules) = own_rules else {
                    // The default recipient's outcome is this member's.
                    if base.notify {
                        self.enqueue(ctx, &room, &user, pos);
                    }
                    continue;
                };
                self.stats
                    .evaluations
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let display_name = v.get(8..).map(String::from_utf8_lossy).unwrap_or_default();
                let actions = actions_of(rules.evaluate(&flat, &rctx, &display_name));
                let notify = actions.iter().any(|a| a.should_notify());
                let highlight = actions.iter().any(|a| a.is_highlight());
                let actions_json = serde_json::to_value(&actions).unwrap_or_default();
                if base.member && actions_json == default_json {
                    if notify {
                        self.enqueue(ctx, &room, &user, pos);
                    }
                    continue;
                }
                // Neither notifies: nothing to store.
                if !(notify || base.member && base.notify) {
                    continue;
                }
                let own = notify.then(|| notification(actions_json, highlight));
                self.except(ctx, &room, &user, threads, pos, base, own);
            }
        }

        // The room after the event.
        if pdu.state_key.is_none() {
            return Ok(());
        }
        let state_key = pdu.state_key.clone().unwrap_or_default();
        let mut row = room_row;
        match kind.as_str() {
            "m.room.member" => {
                let mkey = key::join(&[&room, &state_key]);
                let was = ctx.get(&self.members, &mkey);
                if membership == "join" {
                    let joined_at = was.as_deref().map_or(pos, join_position);
                    let name = content["displayname"].as_str().unwrap_or_default();
                    let mut v = joined_at.to_be_bytes().to_vec();
                    v.extend_from_slice(name.as_bytes());
                    ctx.put(&self.members, mkey, v);
                    if was.is_none() {
                        row.joined += 1;
                        ctx.put(
                            &self.memberships,
                            key::with_pos(&[&state_key, &room], pos),
                            u64::MAX.to_be_bytes().to_vec(),
                        );
                        let mkey = key::join(&[&room, &state_key]);
                        if ctx.get(&self.rules, state_key.as_bytes()).is_some() {
                            ctx.put(&self.custom_members, mkey.clone(), Vec::new());
                        }
                        if ctx.get(&self.pushered, state_key.as_bytes()).is_some() {
                            ctx.put(&self.pushered_members, mkey, Vec::new());
                        }
                    }
                } else if let Some(was) = was {
                    ctx.delete(&self.custom_members, mkey.clone());
                    ctx.delete(&self.pushered_members, mkey.clone());
                    ctx.delete(&self.members, mkey);
                    row.joined = row.joined.saturating_sub(1);
                    ctx.put(
                        &self.memberships,
                        key::with_pos(&[&state_key, &room], join_position(&was)),
                        pos.to_be_bytes().to_vec(),
                    );
                }
            }
            "m.room.power_levels" if state_key.is_empty() => {
                row.users = content["users"].as_object().cloned().unwrap_or_default();
                row.users_default = content
                    .get("users_default")
                    .and_then(power_value)
                    .unwrap_or(0);
                row.notifications = content["notifications"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
            }
            "m.room.create" if state_key.is_empty() => {
                if pdu.room_version == "12" {
                    let mut creators = vec![sender.clone()];
                    if let Some(extra) = content["additional_creators"].as_array() {
                        creators.extend(extra.iter().filter_map(|c| c.as_str().map(str::to_owned)));
                    }
                    row.creators = creators;
                } else {
                    // Before any power levels, the creator has 100 (spec: auth rules).
                    row.users.insert(sender.clone(), serde_json::json!(100));
                }
            }
            _ => return Ok(()),
        }
        ctx.put(&self.rooms, room.into_bytes(), json(&row));
        Ok(())
    }
}

impl Projection for Push {
    fn name(&self) -> &'static str {
        "push"
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.rules.clone(),
            self.rules_log.clone(),
            self.members.clone(),
            self.memberships.clone(),
            self.custom_members.clone(),
            self.pushered_members.clone(),
            self.rooms.clone(),
            self.event_thread.clone(),
            self.sent.clone(),
            self.counts.clone(),
            self.thread_latest.clone(),
            self.thread_recent.clone(),
            self.room_notifications.clone(),
            self.room_highlights.clone(),
            self.notifications.clone(),
            self.highlights.clone(),
            self.queue.clone(),
            self.pushered.clone(),
        ]
    }

    fn reload(&self) {
        self.compiled.lock().clear();
        *self.pushered_users.write() = self
            .pushered
            .scan_prefix(&[], usize::MAX)
            .into_iter()
            .map(|(k, _)| String::from_utf8_lossy(&k).into_owned())
            .collect();
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        if record.is_event() {
            return self.apply_event(ctx, record);
        }
        if let Some(fact) = record.fact() {
            if let Fact::PusherSet { user_id, .. } = &fact {
                if ctx.get(&self.pushered, user_id.as_bytes()).is_none() {
                    for room in self.current_rooms(ctx, user_id) {
                        ctx.put(
                            &self.pushered_members,
                            key::join(&[&room, user_id]),
                            Vec::new(),
                        );
                    }
                }
                ctx.put(&self.pushered, user_id.clone().into_bytes(), Vec::new());
                // At once, for the rest of the batch (a batch applied again after a
                // failed commit stages the same row again).
                self.pushered_users.write().insert(user_id.clone());
            }
            if let Fact::PushQueuePruned { upto } = fact {
                // The queue is keyed by position first: the rows to delete are a prefix
                // range, read once (nothing after `upto`).
                let end = upto.saturating_add(1).to_be_bytes();
                for k in ctx.scan_keys_range(&self.queue, &[], &end, usize::MAX) {
                    ctx.delete(&self.queue, k);
                }
                return Ok(());
            }
            self.apply_fact(ctx, record, fact);
        }
        Ok(())
    }
}

/// Pushers (spec: `GET /pushers`, `POST /pushers/set`). Tables: `pushers`: user, 0x00,
/// app id, 0x00, pushkey -> `Pusher` JSON; `by_key`: app id, 0x00, pushkey, 0x00, user
/// -> empty (to remove other users' pushers for the same key unless `append`); `meta`:
/// user, 0x00, app id, 0x00, pushkey -> [`PusherMeta`] (the device that set it and
/// when); `by_device`: user, 0x00, device, 0x00, app id, 0x00, pushkey -> empty.
///
/// A pusher belongs to the device (access token) that set it: `DeviceDeleted` (logout,
/// device deletion, a password change with `logout_devices`, deactivation) removes the
/// device's pushers, as Synapse removes pushers with their access token.
pub struct Pushers {
    pushers: Table,
    by_key: Table,
    meta: Table,
    by_device: Table,
}

/// What is kept about a pusher beside the spec's object.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PusherMeta {
    /// The device whose access token set the pusher.
    pub device_id: Option<String>,
    /// When it was last set (the record's append time, ms).
    pub ts: u64,
}

/// An HTTP pusher as the push-gateway consumer needs it.
#[derive(Debug, Clone)]
pub struct HttpPusher {
    /// `app_id`.
    pub app_id: String,
    /// `pushkey`.
    pub pushkey: String,
    /// `data.url`: the gateway's notify URL.
    pub url: String,
    /// `data` without `url` (spec: the `data` sent to the gateway).
    pub data: serde_json::Map<String, serde_json::Value>,
    /// `data.format == "event_id_only"`.
    pub event_id_only: bool,
    /// When the pusher was last set, ms.
    pub ts: u64,
}

impl Pushers {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Pushers, String> {
        Ok(Pushers {
            pushers: db.table("pushers", "pushers")?,
            by_key: db.table("pushers", "by_key")?,
            meta: db.table("pushers", "meta")?,
            by_device: db.table("pushers", "by_device")?,
        })
    }

    /// A user's pushers, ordered by (app id, pushkey).
    pub fn of_user(&self, user_id: &str) -> Vec<serde_json::Value> {
        self.pushers
            .scan_prefix(&key::prefix(&[user_id]), crate::push::PUSHERS_PER_USER_MAX)
            .into_iter()
            .filter_map(|(_, v)| serde_json::from_slice(&v).ok())
            .collect()
    }

    /// A user's HTTP pushers with what delivery needs, ordered by (app id, pushkey).
    pub fn http_of_user(&self, user_id: &str) -> Vec<HttpPusher> {
        let prefix = key::prefix(&[user_id]);
        self.pushers
            .scan_prefix(&prefix, crate::push::PUSHERS_PER_USER_MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                let p: serde_json::Value = serde_json::from_slice(&v).ok()?;
                if p["kind"] != "http" {
                    return None;
                }
                let mut data = p["data"].as_object().cloned().unwrap_or_default();
                let url = data.remove("url")?.as_str()?.to_owned();
                let ts = self
                    .meta
                    .get(&k)
                    .and_then(|m| serde_json::from_slice::<PusherMeta>(&m).ok())
                    .map(|m| m.ts)
                    .unwrap_or(0);
                Some(HttpPusher {
                    app_id: p["app_id"].as_str()?.to_owned(),
                    pushkey: p["pushkey"].as_str()?.to_owned(),
                    event_id_only: data.get("format").and_then(|f| f.as_str())
                        == Some("event_id_only"),
                    url,
                    data,
                    ts,
                })
            })
            .collect()
    }

    fn remove(&self, ctx: &ApplyCtx, user_id: &str, app_id: &str, pushkey: &str) {
        let k = key::join(&[user_id, app_id, pushkey]);
        if let Some(m) = ctx
            .get(&self.meta, &k)
            .and_then(|m| serde_json::from_slice::<PusherMeta>(&m).ok())
            && let Some(device) = m.device_id
        {
            ctx.delete(
                &self.by_device,
                key::join(&[user_id, &device, app_id, pushkey]),
            );
        }
        ctx.delete(&self.meta, k.clone());
        ctx.delete(&self.by_key, key::join(&[app_id, pushkey, user_id]));
        ctx.delete(&self.pushers, k);
    }
}

/// Pushers listed per user at most (a bound on `GET /pushers`).
pub const PUSHERS_PER_USER_MAX: usize = 1000;

impl Projection for Pushers {
    fn name(&self) -> &'static str {
        "pushers"
    }

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.pushers.clone(),
            self.by_key.clone(),
            self.meta.clone(),
            self.by_device.clone(),
        ]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        match record.fact() {
            Some(Fact::PusherSet {
                user_id,
                pusher,
                append,
            }) => {
                let app_id = pusher["app_id"].as_str().unwrap_or_default().to_owned();
                let pushkey = pusher["pushkey"].as_str().unwrap_or_default().to_owned();
                if !append {
                    let prefix = key::prefix(&[&app_id, &pushkey]);
                    for (k, _) in ctx.scan_prefix(&self.by_key, &prefix) {
                        let other = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                        if other != user_id {
                            self.remove(ctx, &other, &app_id, &pushkey);
                        }
                    }
                }
                // A pusher set again (perhaps from another device) moves to that device.
                self.remove(ctx, &user_id, &app_id, &pushkey);
                let device_id = record.device_id().map(str::to_owned);
                if let Some(device) = &device_id {
                    ctx.put(
                        &self.by_device,
                        key::join(&[&user_id, device, &app_id, &pushkey]),
                        Vec::new(),
                    );
                }
                ctx.put(
                    &self.meta,
                    key::join(&[&user_id, &app_id, &pushkey]),
                    json(&PusherMeta {
                        device_id,
                        ts: record.appended_at(),
                    }),
                );
                ctx.put(
                    &self.by_key,
                    key::join(&[&app_id, &pushkey, &user_id]),
                    Vec::new(),
                );
                ctx.put(
                    &self.pushers,
                    key::join(&[&user_id, &app_id, &pushkey]),
                    json(&pusher),
                );
            }
            Some(Fact::PusherDeleted {
                user_id,
                app_id,
                pushkey,
            }) => self.remove(ctx, &user_id, &app_id, &pushkey),
            Some(Fact::DeviceDeleted { user_id, device_id }) => {
                let prefix = key::prefix(&[&user_id, &device_id]);
                for (k, _) in ctx.scan_prefix(&self.by_device, &prefix) {
                    let rest = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                    if let Some((app_id, pushkey)) = rest.split_once('\0') {
                        self.remove(ctx, &user_id, app_id, pushkey);
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default recipient stands for every member with the server-default rules whom
    /// an event does not name. That holds while the server default of two users differs
    /// only in `.m.rule.invite_for_me` and `.m.rule.is_user_mention` (what `named` looks
    /// at): a ruma upgrade that adds a rule on the user id, localpart or display name
    /// fails here and must extend `named`.
    #[test]
    fn a_thread_root_that_is_not_an_event_id_is_no_thread() {
        let rel = |id: &str| serde_json::json!({ "m.relates_to": { "rel_type": "m.thread", "event_id": id } });
        assert_eq!(
            thread_of(&rel("$root:example.org")),
            (
                Some("$root:example.org".into()),
                Some("$root:example.org".into())
            )
        );
        for hostile in [
            "main",
            "",
            "main\u{0}00000000",
            "$root\u{0}00000000",
            "@user:example.org",
        ] {
            assert_eq!(thread_of(&rel(hostile)), (None, None), "{hostile:?}");
        }
    }

    #[test]
    fn the_server_default_differs_between_users_only_in_the_rules_that_name_them() {
        let alice = "@alice:a.example";
        let rules = |user: &str| serde_json::to_value(default_ruleset(user).unwrap()).unwrap();
        let a = rules(alice);
        let mut naming: Vec<String> = Vec::new();
        for kind in ["override", "content", "room", "sender", "underride"] {
            for rule in a[kind].as_array().into_iter().flatten() {
                let text = rule.to_string();
                if text.contains("alice") || text.contains("display_name") {
                    naming.push(rule["rule_id"].as_str().unwrap().to_owned());
                }
            }
        }
        naming.sort();
        assert_eq!(
            naming,
            vec![".m.rule.invite_for_me", ".m.rule.is_user_mention"]
        );
        // Apart from the user id in those two, the default recipient's rules are anyone's.
        let d = rules(DEFAULT_RECIPIENT)
            .to_string()
            .replace(DEFAULT_RECIPIENT, alice);
        assert_eq!(serde_json::from_str::<serde_json::Value>(&d).unwrap(), a);
    }
}
