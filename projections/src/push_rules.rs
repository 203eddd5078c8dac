//! Push rule evaluation (spec: "Push Notifications", "Push Rules", "Conditions").
//!
//! The rule types, their JSON shapes, the server-default ruleset and the rule edits
//! (insert with `before`/`after`, enable, set actions, remove) are ruma's
//! (`ruma::push::Ruleset`). Evaluation is ours, because ruma's evaluator builds a
//! fresh regex for every wildcard `content.body` match and a fresh `WildMatch` for
//! every glob, on every event: the seed project's push rules recompiled globs per
//! evaluation (BRIEF §4). Here a ruleset is compiled once into [`CompiledRuleset`]
//! and every glob comes from one bounded [`GlobCache`]; patterns without wildcards
//! (all of the server-default rules) never build a regex at all.
//!
//! Evaluation is synchronous and deterministic; it reads only the flattened event and
//! the room context given to it.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use ruma::push::{
    Action, AnyPushRuleRef, FlattenedJson, PushCondition, RoomMemberCountIs, Ruleset,
    ScalarJsonValue,
};

/// Distinct globs kept compiled; past this the cache is emptied and refilled (a bound,
/// so a user cannot grow server memory with patterns).
pub const GLOB_CACHE_MAX: usize = 4096;

/// A compiled glob-style pattern (spec appendix "Glob-style matching"), matched
/// case-insensitively.
#[derive(Debug)]
pub enum Glob {
    /// No wildcard, whole-value match: a lowercase comparison.
    Exact(String),
    /// Anything else: a regex built once.
    Regex(regex::Regex),
}

impl Glob {
    /// Whether `value` matches.
    pub fn matches(&self, value: &str) -> bool {
        match self {
            Glob::Exact(p) => value.len() == p.len() && value.to_lowercase() == *p,
            Glob::Regex(re) => re.is_match(value),
        }
    }
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Translates a glob into a regex. `words`: the pattern must match a substring that
/// starts and ends at a word boundary (the `content.body` rule); otherwise the whole
/// value.
fn glob_regex(pattern: &str, words: bool) -> String {
    let mut body = String::new();
    for c in pattern.chars() {
        match c {
            '*' => body.push_str(".*"),
            '?' => body.push('.'),
            c => body.push_str(&regex::escape(&c.to_string())),
        }
    }
    if !words {
        return format!("(?is)^(?:{body})$");
    }
    // A boundary is the start or end of the value or a non-word character; a pattern
    // that itself starts (ends) with a non-word character carries its own boundary.
    let guard_start = pattern
        .chars()
        .next()
        .is_some_and(|c| is_word_char(c) || c == '*' || c == '?');
    let guard_end = pattern
        .chars()
        .last()
        .is_some_and(|c| is_word_char(c) || c == '*' || c == '?');
    format!(
        "(?is){}(?:{body}){}",
        if guard_start {
            "(?:^|[^A-Za-z0-9_])"
        } else {
            ""
        },
        if guard_end { "(?:[^A-Za-z0-9_]|$)" } else { "" }
    )
}

/// Compiled globs, shared by every ruleset and bounded by [`GLOB_CACHE_MAX`].
#[derive(Default)]
pub struct GlobCache {
    map: parking_lot::Mutex<HashMap<(String, bool), Arc<Glob>>>,
    compiles: AtomicU64,
}

impl GlobCache {
    /// The compiled glob for `pattern` (`words`: word-boundary substring match).
    pub fn get(&self, pattern: &str, words: bool) -> Arc<Glob> {
        let key = (pattern.to_owned(), words);
        if let Some(g) = self.map.lock().get(&key) {
            return g.clone();
        }
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let glob = if !words && !pattern.contains(['*', '?']) {
            Glob::Exact(pattern.to_lowercase())
        } else {
            match regex::Regex::new(&glob_regex(pattern, words)) {
                Ok(re) => Glob::Regex(re),
                // Escaped input always compiles; a pathological size limit does not
                // match anything rather than failing the projection.
                Err(_) => Glob::Regex(regex::Regex::new("[^\\s\\S]").expect("empty class")),
            }
        };
        let glob = Arc::new(glob);
        let mut map = self.map.lock();
        if map.len() >= GLOB_CACHE_MAX {
            map.clear();
        }
        map.insert(key, glob.clone());
        glob
    }

    /// Globs compiled so far (cache misses): a counting test asserts it does not grow
    /// with the number of events evaluated.
    pub fn compiles(&self) -> u64 {
        self.compiles.load(Ordering::Relaxed)
    }
}

/// The room as an event sees it, for the conditions that depend on the room.
#[derive(Debug, Clone, Default)]
pub struct RoomContext<'a> {
    /// Joined members before the event (`room_member_count`).
    pub member_count: u64,
    /// The sender's power level (`sender_notification_permission`).
    pub sender_power: i64,
    /// `notifications` levels of the power levels (`room` defaults to 50).
    pub notifications: Option<&'a serde_json::Map<String, serde_json::Value>>,
    /// Whether the sender is a privileged creator (room version 12): always permitted.
    pub sender_is_creator: bool,
}

impl RoomContext<'_> {
    fn sender_may_notify(&self, key: &str) -> bool {
        if self.sender_is_creator {
            return true;
        }
        let required = self
            .notifications
            .and_then(|n| n.get(key))
            .and_then(power_value)
            .or_else(|| (key == "room").then_some(50));
        required.is_some_and(|r| self.sender_power >= r)
    }
}

/// A power level value: an integer, or (older rooms) a string holding one.
pub fn power_value(v: &serde_json::Value) -> Option<i64> {
    match v {
        serde_json::Value::Number(n) => n.as_i64(),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

enum Cond {
    Match { key: String, glob: Arc<Glob> },
    DisplayName,
    MemberCount(RoomMemberCountIs),
    SenderPermission(String),
    PropertyIs { key: String, value: ScalarJsonValue },
    PropertyContains { key: String, value: ScalarJsonValue },
    Never,
}

enum Test {
    Conditions(Vec<Cond>),
    Content(Arc<Glob>),
    Room(String),
    Sender(String),
}

struct Rule {
    rule_id: String,
    actions: Vec<Action>,
    test: Test,
}

/// What an event does for one recipient: the matched rule's actions.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The matching rule.
    pub rule_id: String,
    /// Its actions (may be empty: the rule suppresses notifications).
    pub actions: Vec<Action>,
}

impl Outcome {
    /// Whether the event notifies.
    pub fn notify(&self) -> bool {
        self.actions.iter().any(|a| a.should_notify())
    }
    /// Whether the notification is highlighted.
    pub fn highlight(&self) -> bool {
        self.actions.iter().any(|a| a.is_highlight())
    }
}

/// A user's enabled rules in priority order, with every glob compiled.
pub struct CompiledRuleset {
    rules: Vec<Rule>,
}

fn compile_condition(c: &PushCondition, globs: &GlobCache) -> Cond {
    #[allow(deprecated)] // `contains_display_name` is deprecated, still defined (v1.17).
    match c {
        PushCondition::EventMatch(d) => Cond::Match {
            key: d.key.clone(),
            glob: globs.get(&d.pattern, d.key == "content.body"),
        },
        PushCondition::ContainsDisplayName => Cond::DisplayName,
        PushCondition::RoomMemberCount(d) => Cond::MemberCount(d.is),
        PushCondition::SenderNotificationPermission(d) => {
            Cond::SenderPermission(d.key.as_str().to_owned())
        }
        PushCondition::EventPropertyIs(d) => Cond::PropertyIs {
            key: d.key.clone(),
            value: d.value.clone(),
        },
        PushCondition::EventPropertyContains(d) => Cond::PropertyContains {
            key: d.key.clone(),
            value: d.value.clone(),
        },
        // Unrecognised conditions never match (spec: "Conditions").
        _ => Cond::Never,
    }
}

impl CompiledRuleset {
    /// Compiles the enabled rules of `ruleset`, in the spec's priority order.
    pub fn compile(ruleset: &Ruleset, globs: &GlobCache) -> CompiledRuleset {
        let mut rules = Vec::new();
        for rule in ruleset.iter() {
            if !rule.enabled() {
                continue;
            }
            let test = match rule {
                AnyPushRuleRef::Override(r) | AnyPushRuleRef::Underride(r) => Test::Conditions(
                    r.conditions
                        .iter()
                        .map(|c| compile_condition(c, globs))
                        .collect(),
                ),
                AnyPushRuleRef::Content(r) => Test::Content(globs.get(&r.pattern, true)),
                AnyPushRuleRef::Room(r) => Test::Room(r.rule_id.to_string()),
                AnyPushRuleRef::Sender(r) => Test::Sender(r.rule_id.to_string()),
                _ => continue,
            };
            rules.push(Rule {
                rule_id: rule.rule_id().to_owned(),
                actions: rule.actions().to_vec(),
                test,
            });
        }
        CompiledRuleset { rules }
    }

    /// The first matching rule for an event sent by someone else (own events never
    /// notify; the caller skips them). `display_name` is the recipient's in the room.
    pub fn evaluate(
        &self,
        event: &FlattenedJson,
        room: &RoomContext<'_>,
        display_name: &str,
    ) -> Option<Outcome> {
        let body = event.get_str("content.body");
        let matched = self.rules.iter().find(|rule| match &rule.test {
            Test::Conditions(conds) => conds.iter().all(|c| match c {
                Cond::Match { key, glob } => event.get_str(key).is_some_and(|v| glob.matches(v)),
                Cond::DisplayName => {
                    !display_name.is_empty() && body.is_some_and(|b| has_word(b, display_name))
                }
                Cond::MemberCount(is) => std::ops::RangeBounds::contains(
                    is,
                    &ruma::UInt::new_saturating(room.member_count),
                ),
                Cond::SenderPermission(key) => room.sender_may_notify(key),
                Cond::PropertyIs { key, value } => event.get(key).is_some_and(|v| v == value),
                Cond::PropertyContains { key, value } => event
                    .get(key)
                    .and_then(|v| v.as_array())
                    .is_some_and(|a| a.contains(value)),
                Cond::Never => false,
            }),
            Test::Content(glob) => body.is_some_and(|b| glob.matches(b)),
            Test::Room(id) => event.get_str("room_id") == Some(id.as_str()),
            Test::Sender(id) => event.get_str("sender") == Some(id.as_str()),
        })?;
        Some(Outcome {
            rule_id: matched.rule_id.clone(),
            actions: matched.actions.clone(),
        })
    }
}

/// Whether `needle` occurs in `haystack` case-insensitively at word boundaries, taken
/// literally (a display name is not a glob).
fn has_word(haystack: &str, needle: &str) -> bool {
    let h = haystack.to_lowercase();
    let n = needle.to_lowercase();
    let mut from = 0;
    while let Some(i) = h[from..].find(&n) {
        let start = from + i;
        let end = start + n.len();
        let before_ok = !n.starts_with(is_word_char)
            || !h[..start].chars().next_back().is_some_and(is_word_char);
        let after_ok =
            !n.ends_with(is_word_char) || !h[end..].chars().next().is_some_and(is_word_char);
        if before_ok && after_ok {
            return true;
        }
        from = start + h[start..].chars().next().map_or(1, char::len_utf8);
    }
    false
}

/// Actions as the client sent them, historical `dont_notify` and `coalesce` included:
/// they are kept and read back as sent (as Synapse does), and are no-ops in
/// evaluation (spec: "Historical Actions"; ruma keeps them as custom actions, which
/// neither notify nor highlight).
pub fn clean_actions(actions: &serde_json::Value) -> Option<Vec<Action>> {
    actions.as_array()?;
    serde_json::from_value(actions.clone()).ok()
}

/// Flattens a PDU's JSON for matching (spec: "dot-separated property paths").
pub fn flatten(pdu_json: &[u8]) -> Option<FlattenedJson> {
    let raw: ruma::serde::Raw<serde_json::Value> = ruma::serde::Raw::from_json(
        serde_json::value::RawValue::from_string(String::from_utf8(pdu_json.to_vec()).ok()?)
            .ok()?,
    );
    Some(FlattenedJson::from_raw(&raw))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(v: serde_json::Value) -> FlattenedJson {
        flatten(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn globs_follow_the_spec_examples_and_compile_once() {
        let cache = GlobCache::default();
        let words = cache.get("ex*ple", true);
        assert!(words.matches("An example event."));
        assert!(words.matches("exple"));
        assert!(words.matches("An exciting triple-whammy"));
        assert!(!words.matches("examples"));
        let whole = cache.get("lunc?*", false);
        assert!(whole.matches("Lunch plans"));
        assert!(whole.matches("LUNCH"));
        assert!(!whole.matches(" lunch"));
        assert!(!whole.matches("lunc"));
        let exact = cache.get("m.notice", false);
        assert!(matches!(*exact, Glob::Exact(_)));
        assert!(exact.matches("M.NOTICE"));
        assert!(!exact.matches("m.notices"));
        assert_eq!(cache.compiles(), 3);
        for _ in 0..100 {
            cache.get("ex*ple", true);
            cache.get("m.notice", false);
        }
        assert_eq!(cache.compiles(), 3);
        // Regex syntax in a pattern is literal.
        assert!(!cache.get("[a-z]*", true).matches("matrix"));
        assert!(cache.get("[a-z]*", true).matches("see [a-z] here"));
    }

    #[test]
    fn display_names_match_literally_at_word_boundaries() {
        assert!(has_word("hey Alice!", "alice"));
        assert!(!has_word("malice", "alice"));
        assert!(has_word("a*b here", "a*b"));
        assert!(!has_word("aXb here", "a*b"));
    }

    #[test]
    fn server_default_rules_evaluate_per_the_spec() {
        let globs = GlobCache::default();
        let bob: ruma::OwnedUserId = "@bob:x".try_into().unwrap();
        let rules = CompiledRuleset::compile(&Ruleset::server_default(&bob), &globs);
        let room = RoomContext {
            member_count: 3,
            ..Default::default()
        };
        let msg = |content: serde_json::Value| {
            event(
                serde_json::json!({ "type": "m.room.message", "sender": "@a:x", "room_id": "!r:x", "content": content }),
            )
        };
        let out = rules
            .evaluate(
                &msg(serde_json::json!({ "msgtype": "m.text", "body": "hi" })),
                &room,
                "Bob",
            )
            .unwrap();
        assert_eq!(out.rule_id, ".m.rule.message");
        assert!(out.notify() && !out.highlight());
        let out = rules
            .evaluate(
                &msg(serde_json::json!({ "msgtype": "m.notice", "body": "hi" })),
                &room,
                "Bob",
            )
            .unwrap();
        assert_eq!(out.rule_id, ".m.rule.suppress_notices");
        assert!(!out.notify());
        let out = rules
            .evaluate(
                &msg(serde_json::json!({ "body": "hi", "m.mentions": { "user_ids": ["@bob:x"] } })),
                &room,
                "Bob",
            )
            .unwrap();
        assert_eq!(out.rule_id, ".m.rule.is_user_mention");
        assert!(out.notify() && out.highlight());
        // @room needs the sender's power: 0 < 50 by default.
        let at_room = msg(serde_json::json!({ "body": "all", "m.mentions": { "room": true } }));
        assert_eq!(
            rules.evaluate(&at_room, &room, "Bob").unwrap().rule_id,
            ".m.rule.message"
        );
        let admin = RoomContext {
            member_count: 3,
            sender_power: 100,
            ..Default::default()
        };
        assert_eq!(
            rules.evaluate(&at_room, &admin, "Bob").unwrap().rule_id,
            ".m.rule.is_room_mention"
        );
        let two = RoomContext {
            member_count: 2,
            ..Default::default()
        };
        assert_eq!(
            rules
                .evaluate(&msg(serde_json::json!({ "body": "hi" })), &two, "Bob")
                .unwrap()
                .rule_id,
            ".m.rule.room_one_to_one"
        );
        let tomb = event(
            serde_json::json!({ "type": "m.room.tombstone", "state_key": "", "sender": "@a:x", "content": {} }),
        );
        let out = rules.evaluate(&tomb, &room, "Bob").unwrap();
        assert_eq!(out.rule_id, ".m.rule.tombstone");
        assert!(out.highlight());
        let invite = event(
            serde_json::json!({ "type": "m.room.member", "state_key": "@bob:x", "sender": "@a:x", "content": { "membership": "invite" } }),
        );
        assert_eq!(
            rules.evaluate(&invite, &room, "").unwrap().rule_id,
            ".m.rule.invite_for_me"
        );
        let call =
            event(serde_json::json!({ "type": "m.call.invite", "sender": "@a:x", "content": {} }));
        assert_eq!(
            rules.evaluate(&call, &room, "").unwrap().rule_id,
            ".m.rule.call"
        );
        let edit = msg(
            serde_json::json!({ "body": "x", "m.relates_to": { "rel_type": "m.replace", "event_id": "$e" } }),
        );
        assert_eq!(
            rules.evaluate(&edit, &room, "").unwrap().rule_id,
            ".m.rule.suppress_edits"
        );
        let reaction =
            event(serde_json::json!({ "type": "m.reaction", "sender": "@a:x", "content": {} }));
        assert!(!rules.evaluate(&reaction, &room, "").unwrap().notify());
        let topic = event(
            serde_json::json!({ "type": "m.room.topic", "state_key": "", "sender": "@a:x", "content": {} }),
        );
        assert!(rules.evaluate(&topic, &room, "").is_none());
        assert_eq!(
            globs.compiles(),
            11,
            "default rules are exact patterns only"
        );
    }
}
