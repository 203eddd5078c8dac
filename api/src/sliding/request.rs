//! The request body of Simplified Sliding Sync (MSC4186), in the shape clients send on
//! the unstable path (matrix-rust-sdk / ruma `sync_events::v5`, Synapse): `lists` with
//! `ranges`, `required_state` as `[type, state_key]` pairs with `*`, `$LAZY` and `$ME`,
//! `is_invite`. The MSC's later spellings are accepted too (`range`, `is_invited`,
//! `required_state` as `{include, exclude, lazy_members}`).
//!
//! Our own serde types rather than ruma-client-api's: ruma's `v5::request` has no
//! `spaces` filter nor the later spellings, and the API crate reads JSON bodies itself
//! everywhere else. Field names follow ruma's.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde_json::Value;

use crate::{ApiResult, MatrixError};

/// Largest `timeline_limit` honoured; larger values are clamped.
pub const MAX_TIMELINE_LIMIT: usize = 100;
/// Most lists in one request.
pub const MAX_LISTS: usize = 100;
/// Most ranges per list.
pub const MAX_RANGES: usize = 10;
/// Most room subscriptions in one request.
pub const MAX_SUBSCRIPTIONS: usize = 500;
/// Most `required_state` entries per room config.
pub const MAX_REQUIRED_STATE: usize = 100;
/// Most rooms one list range returns (a range is clamped to this many rooms).
pub const MAX_RANGE_ROOMS: u64 = 1000;

/// One parsed request.
#[derive(Debug, Clone, Default)]
pub struct SlidingRequest {
    /// `conn_id` ("" when absent).
    pub conn_id: String,
    /// `txn_id`, echoed back.
    pub txn_id: Option<String>,
    /// `pos` from the body (the query parameter wins).
    pub pos: Option<String>,
    /// `timeout` from the body, ms (the query parameter wins).
    pub timeout: Option<u64>,
    /// `lists` by name.
    pub lists: BTreeMap<String, ListConfig>,
    /// `room_subscriptions` by room id.
    pub room_subscriptions: BTreeMap<String, RoomConfig>,
    /// `extensions`.
    pub extensions: Extensions,
}

/// A list: ranges into the filtered, recency-ordered room list, plus its room config.
#[derive(Debug, Clone, Default)]
pub struct ListConfig {
    /// Inclusive `[start, end]` ranges; `None`: the whole list.
    pub ranges: Option<Vec<(u64, u64)>>,
    /// Timeline limit and required state of the list's rooms.
    pub config: RoomConfig,
    /// `filters`.
    pub filters: ListFilters,
}

/// `filters` of a list.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ListFilters {
    /// Only rooms in (true) or not in (false) `m.direct`.
    #[serde(default)]
    pub is_dm: Option<bool>,
    /// Only rooms with (true) or without (false) `m.room.encryption`.
    #[serde(default)]
    pub is_encrypted: Option<bool>,
    /// Only invites (true) or no invites (false).
    #[serde(default, alias = "is_invited")]
    pub is_invite: Option<bool>,
    /// Only these room types (`null` for rooms without one).
    #[serde(default)]
    pub room_types: Option<Vec<Option<String>>>,
    /// Not these room types.
    #[serde(default)]
    pub not_room_types: Vec<Option<String>>,
    /// Only children (`m.space.child`) of these joined spaces.
    #[serde(default)]
    pub spaces: Option<Vec<String>>,
    /// Only rooms with one of these tags (`m.tag` room account data).
    #[serde(default)]
    pub tags: Option<Vec<String>>,
    /// Not rooms with any of these tags (wins over `tags`).
    #[serde(default)]
    pub not_tags: Vec<String>,
}

/// What to return for a room: `timeline_limit` and `required_state`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoomConfig {
    /// Most timeline events (clamped to [`MAX_TIMELINE_LIMIT`]).
    pub timeline_limit: usize,
    /// Required state.
    pub required_state: RequiredState,
}

impl RoomConfig {
    /// The superset of two configs (MSC4186 "Combining room configs").
    pub fn merge(&mut self, other: &RoomConfig) {
        self.timeline_limit = self.timeline_limit.max(other.timeline_limit);
        self.required_state.merge(&other.required_state);
    }
}

/// `required_state`: which state entries to return.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequiredState {
    /// `(type, state_key)` entries; `*` is a wildcard in either place, `$ME` a state
    /// key meaning the requester. `$LAZY` is kept in [`RequiredState::lazy`].
    pub include: BTreeSet<(String, String)>,
    /// Entries filtered out of `include` (the MSC's later `exclude`).
    pub exclude: BTreeSet<(String, String)>,
    /// Lazy-loaded members: the member events of the timeline's senders.
    pub lazy: bool,
}

impl RequiredState {
    /// The union of two required states.
    pub fn merge(&mut self, other: &RequiredState) {
        self.include.extend(other.include.iter().cloned());
        self.exclude.retain(|e| other.exclude.contains(e));
        self.lazy |= other.lazy;
    }

    /// Whether `other` asks for nothing `self` does not already cover.
    pub fn covers(&self, other: &RequiredState) -> bool {
        (self.lazy || !other.lazy)
            && other
                .include
                .iter()
                .all(|(t, k)| self.include.contains(&(t.clone(), k.clone())))
            && self.exclude.iter().all(|e| other.exclude.contains(e))
    }

    /// Whether a state entry is asked for (the requester's own member event matches
    /// `$ME`; lazy members are decided separately).
    pub fn matches(&self, kind: &str, state_key: &str, me: &str) -> bool {
        Self::hit(&self.include, kind, state_key, me) && !self.excluded(kind, state_key, me)
    }

    /// Whether an `exclude` entry names the state entry (an entry taken from `include`
    /// itself needs only this check).
    pub fn excluded(&self, kind: &str, state_key: &str, me: &str) -> bool {
        !self.exclude.is_empty() && Self::hit(&self.exclude, kind, state_key, me)
    }

    fn hit(set: &BTreeSet<(String, String)>, kind: &str, state_key: &str, me: &str) -> bool {
        set.iter().any(|(t, k)| {
            (t == "*" || t == kind)
                && (k == "*" || k == state_key || (k == "$ME" && state_key == me))
        })
    }

    /// Whether any entry names every state key of `m.room.member` (or every type).
    pub fn all_members(&self) -> bool {
        self.include
            .iter()
            .any(|(t, k)| (t == "m.room.member" || t == "*") && k == "*")
            && !self.exclude.contains(&("m.room.member".into(), "*".into()))
    }
}

/// An extension's common settings (MSC3959/3960/3961/3885/3884).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ExtensionConfig {
    /// Whether the extension is on (sticky per request: absent means off).
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Lists whose rooms the extension covers (`*` or absent: all).
    #[serde(default)]
    pub lists: Option<Vec<String>>,
    /// Rooms the extension covers (`*` or absent: all subscribed rooms).
    #[serde(default)]
    pub rooms: Option<Vec<String>>,
    /// `to_device`: most events per response.
    #[serde(default)]
    pub limit: Option<u64>,
    /// `to_device`: the `next_batch` of the previous response.
    #[serde(default)]
    pub since: Option<String>,
}

impl ExtensionConfig {
    /// Whether the extension is on.
    pub fn on(&self) -> bool {
        self.enabled == Some(true)
    }
}

/// `extensions`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Extensions {
    /// `account_data`.
    #[serde(default)]
    pub account_data: ExtensionConfig,
    /// `receipts`.
    #[serde(default)]
    pub receipts: ExtensionConfig,
    /// `typing`.
    #[serde(default)]
    pub typing: ExtensionConfig,
    /// `to_device`.
    #[serde(default)]
    pub to_device: ExtensionConfig,
    /// `e2ee`.
    #[serde(default)]
    pub e2ee: ExtensionConfig,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawRequiredState {
    Pairs(Vec<(String, String)>),
    Object {
        #[serde(default)]
        include: Vec<RawElement>,
        #[serde(default)]
        exclude: Vec<RawElement>,
        #[serde(default)]
        lazy_members: bool,
    },
}

#[derive(Deserialize)]
struct RawElement {
    #[serde(rename = "type")]
    kind: Option<String>,
    state_key: Option<String>,
}

#[derive(Deserialize)]
struct RawRoomConfig {
    #[serde(default)]
    timeline_limit: Option<u64>,
    #[serde(default)]
    required_state: Option<RawRequiredState>,
}

#[derive(Deserialize)]
struct RawList {
    #[serde(default)]
    ranges: Option<Vec<(u64, u64)>>,
    #[serde(default)]
    range: Option<(u64, u64)>,
    #[serde(flatten)]
    config: RawRoomConfig,
    #[serde(default)]
    filters: Option<ListFilters>,
}

#[derive(Deserialize)]
struct RawRequest {
    #[serde(default)]
    conn_id: Option<String>,
    #[serde(default)]
    txn_id: Option<String>,
    #[serde(default)]
    pos: Option<String>,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    lists: BTreeMap<String, RawList>,
    #[serde(default)]
    room_subscriptions: BTreeMap<String, RawRoomConfig>,
    #[serde(default)]
    extensions: Option<Extensions>,
}

fn required_state(raw: Option<RawRequiredState>) -> ApiResult<RequiredState> {
    let mut out = RequiredState::default();
    match raw {
        None => {}
        Some(RawRequiredState::Pairs(pairs)) => {
            for (t, k) in pairs {
                if k == "$LAZY" {
                    if t == "m.room.member" || t == "*" {
                        out.lazy = true;
                    }
                    continue;
                }
                out.include.insert((t, k));
            }
        }
        Some(RawRequiredState::Object {
            include,
            exclude,
            lazy_members,
        }) => {
            let elem = |e: RawElement| {
                (
                    e.kind.unwrap_or_else(|| "*".into()),
                    e.state_key.unwrap_or_else(|| "*".into()),
                )
            };
            out.include = include.into_iter().map(elem).collect();
            out.exclude = exclude.into_iter().map(elem).collect();
            out.lazy = lazy_members;
        }
    }
    if out.include.len() + out.exclude.len() > MAX_REQUIRED_STATE {
        return Err(MatrixError::bad_json(format!(
            "required_state has more than {MAX_REQUIRED_STATE} entries"
        )));
    }
    Ok(out)
}

fn room_config(raw: RawRoomConfig) -> ApiResult<RoomConfig> {
    Ok(RoomConfig {
        timeline_limit: raw
            .timeline_limit
            .unwrap_or(0)
            .min(MAX_TIMELINE_LIMIT as u64) as usize,
        required_state: required_state(raw.required_state)?,
    })
}

impl SlidingRequest {
    /// Parses a request body. Wrong shapes: 400 `M_BAD_JSON`; too many lists, ranges or
    /// subscriptions, or a range whose start is past its end: 400 `M_INVALID_PARAM`.
    pub fn parse(body: Value) -> ApiResult<SlidingRequest> {
        let raw: RawRequest = serde_json::from_value(body)
            .map_err(|e| MatrixError::bad_json(format!("Invalid sliding sync request: {e}")))?;
        if raw.lists.len() > MAX_LISTS {
            return Err(MatrixError::invalid_param(format!(
                "at most {MAX_LISTS} lists"
            )));
        }
        if raw.room_subscriptions.len() > MAX_SUBSCRIPTIONS {
            return Err(MatrixError::invalid_param(format!(
                "at most {MAX_SUBSCRIPTIONS} room subscriptions"
            )));
        }
        let mut lists = BTreeMap::new();
        for (name, l) in raw.lists {
            let ranges = match (l.ranges, l.range) {
                (Some(r), _) => Some(r),
                (None, Some(r)) => Some(vec![r]),
                (None, None) => None,
            };
            if let Some(r) = &ranges {
                if r.len() > MAX_RANGES {
                    return Err(MatrixError::invalid_param(format!(
                        "list {name:?} has more than {MAX_RANGES} ranges"
                    )));
                }
                if let Some((a, b)) = r.iter().find(|(a, b)| a > b) {
                    return Err(MatrixError::invalid_param(format!(
                        "list {name:?} has an inverted range [{a}, {b}]"
                    )));
                }
            }
            lists.insert(
                name,
                ListConfig {
                    ranges,
                    config: room_config(l.config)?,
                    filters: l.filters.unwrap_or_default(),
                },
            );
        }
        let mut room_subscriptions = BTreeMap::new();
        for (room, c) in raw.room_subscriptions {
            room_subscriptions.insert(room, room_config(c)?);
        }
        Ok(SlidingRequest {
            conn_id: raw.conn_id.unwrap_or_default(),
            txn_id: raw.txn_id,
            pos: raw.pos,
            timeout: raw.timeout,
            lists,
            room_subscriptions,
            extensions: raw.extensions.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn element_x_shape_parses_with_lazy_and_me() {
        let r = SlidingRequest::parse(json!({
            "conn_id": "room-list",
            "lists": { "all_rooms": {
                "ranges": [[0, 10]],
                "timeline_limit": 3,
                "required_state": [["m.room.name", ""], ["m.room.member", "$LAZY"], ["m.room.member", "$ME"]],
                "filters": { "not_room_types": ["m.space"], "is_invite": false }
            }},
            "extensions": { "typing": { "enabled": true, "lists": ["all_rooms"] } }
        }))
        .unwrap();
        let l = &r.lists["all_rooms"];
        assert_eq!(l.ranges, Some(vec![(0, 10)]));
        assert_eq!(l.config.timeline_limit, 3);
        assert!(l.config.required_state.lazy);
        assert!(l.config.required_state.matches("m.room.name", "", "@me:x"));
        assert!(
            l.config
                .required_state
                .matches("m.room.member", "@me:x", "@me:x")
        );
        assert!(
            !l.config
                .required_state
                .matches("m.room.member", "@other:x", "@me:x")
        );
        assert_eq!(l.filters.not_room_types, vec![Some("m.space".to_owned())]);
        assert_eq!(l.filters.is_invite, Some(false));
        assert!(r.extensions.typing.on());
        assert!(!r.extensions.receipts.on());
    }

    #[test]
    fn later_msc_spellings_parse_to_the_same_config() {
        let r = SlidingRequest::parse(json!({
            "lists": { "a": {
                "range": [0, 4], "timeline_limit": 500,
                "required_state": { "include": [{}], "exclude": [{"type": "m.room.create", "state_key": ""}], "lazy_members": true },
                "filters": { "is_invited": true }
            }}
        }))
        .unwrap();
        let l = &r.lists["a"];
        assert_eq!(l.ranges, Some(vec![(0, 4)]));
        assert_eq!(l.config.timeline_limit, MAX_TIMELINE_LIMIT);
        assert!(l.config.required_state.matches("m.room.topic", "", "@me:x"));
        assert!(
            !l.config
                .required_state
                .matches("m.room.create", "", "@me:x")
        );
        assert!(l.config.required_state.lazy);
        assert_eq!(l.filters.is_invite, Some(true));
        // `excluded` alone decides an entry taken from `include` (sliding sync's
        // concrete entries), whatever `include` says.
        let rs = &l.config.required_state;
        assert!(rs.excluded("m.room.create", "", "@me:x"));
        assert!(!rs.excluded("m.room.create", "other", "@me:x"));
        assert!(!rs.excluded("m.room.topic", "", "@me:x"));
        let me = RequiredState {
            include: [("m.room.member".into(), "$ME".into())].into(),
            exclude: [("m.room.member".into(), "$ME".into())].into(),
            lazy: false,
        };
        assert!(me.excluded("m.room.member", "@me:x", "@me:x"));
        assert!(!me.excluded("m.room.member", "@other:x", "@me:x"));
        assert!(!me.matches("m.room.member", "@me:x", "@me:x"));
    }

    #[test]
    fn bad_shapes_are_client_errors() {
        for body in [
            json!({ "lists": { "a": { "ranges": [[5, 1]], "timeline_limit": 1 } } }),
            json!({ "lists": { "a": { "ranges": "all" } } }),
            json!({ "room_subscriptions": { "!r:x": { "timeline_limit": -1 } } }),
        ] {
            let e = SlidingRequest::parse(body.clone()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body}");
        }
    }

    #[test]
    fn merged_configs_are_supersets() {
        let mut a = RoomConfig {
            timeline_limit: 1,
            required_state: RequiredState {
                include: [("m.room.name".into(), "".into())].into(),
                ..Default::default()
            },
        };
        let b = RoomConfig {
            timeline_limit: 20,
            required_state: RequiredState {
                include: [("m.room.topic".into(), "".into())].into(),
                lazy: true,
                ..Default::default()
            },
        };
        assert!(!a.required_state.covers(&b.required_state));
        a.merge(&b);
        assert_eq!(a.timeline_limit, 20);
        assert!(a.required_state.covers(&b.required_state));
        assert!(a.required_state.matches("m.room.name", "", "@me:x"));
        assert!(a.required_state.lazy);
    }
}
