//! Room versions served by Spindle (spec: "Room Versions").
//!
//! We create, join and accept rooms of every stable version, 1 to 12. What differs
//! between them is carried by ruma's [`RoomVersionRules`]: the event id format (v1/v2
//! `$opaque:server` ids carried in the event JSON, v3 standard base64 reference hashes,
//! v4+ URL-safe ones), how `prev_events`/`auth_events` are written (v1/v2 pair each id
//! with its reference hash), the authorization rules (string power levels tolerated
//! before v10, knocking from v7, restricted joins from v8, the create event's sender
//! as creator from v11, creators with infinite power and the room id derived from the
//! create event from v12), the redaction algorithm, and strict canonical JSON from v6.
//!
//! Every version federates. Local rooms are chains, so no version needs state
//! resolution for our own events; a fork that another server's events open is settled
//! by the journal's fork window, state resolution v2 (v2 to v12) or v1 (room version 1),
//! see `spindle_journal::fork`.

use ruma::{
    RoomVersionId,
    room_version_rules::{
        EventIdFormatVersion, EventsReferenceFormatVersion, RoomIdFormatVersion,
        RoomVersionDisposition, RoomVersionRules,
    },
};

/// The room version used by `createRoom` when the client does not ask for one.
/// Synapse's default is 10 as well; stock clients all handle it.
pub const DEFAULT_ROOM_VERSION: &str = "10";

/// Room versions we can create and join, in the order `/capabilities` lists them.
pub const SUPPORTED: [&str; 12] = [
    "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12",
];

/// Returns the ruma rules for a supported version string, `None` otherwise.
pub fn rules(version: &str) -> Option<RoomVersionRules> {
    if !SUPPORTED.contains(&version) {
        return None;
    }
    RoomVersionId::try_from(version).ok()?.rules()
}

/// `"stable"` or `"unstable"`, as `/capabilities` lists the version (ruma's
/// disposition; every version in [`SUPPORTED`] is stable in spec v1.19). `None` for a
/// version we do not serve.
pub fn stability(version: &str) -> Option<&'static str> {
    rules(version).map(|r| match r.disposition {
        RoomVersionDisposition::Stable => "stable",
        _ => "unstable",
    })
}

/// Whether rooms of this version take their id from the create event (v12+).
pub fn room_id_from_create(version: &str) -> bool {
    rules(version).is_some_and(|r| r.room_id_format == RoomIdFormatVersion::V2)
}

/// Whether the create event of this version carries `content.creator` (v1 to v10;
/// from v11 the creator is the create event's sender).
pub fn create_has_creator_field(version: &str) -> bool {
    rules(version).is_some_and(|r| !r.authorization.use_room_create_sender)
}

/// Whether event ids of this version are `$opaque:server` and carried in the event's
/// JSON (v1 and v2) rather than derived from its reference hash.
pub fn event_id_in_json(rules: &RoomVersionRules) -> bool {
    rules.event_id_format == EventIdFormatVersion::V1
}

/// Whether `prev_events` and `auth_events` pair each id with its reference hash
/// (`[["$id:server", {"sha256": "..."}]]`, v1 and v2).
pub fn references_carry_hashes(rules: &RoomVersionRules) -> bool {
    rules.events_reference_format == EventsReferenceFormatVersion::V1
}

/// A power level as the auth rules of a version read it: an integer, or (before v10,
/// where the rules do not require integers) a string holding one, as ruma parses it
/// (`" 50"`, `"+50"`). `None` for anything else.
pub fn power_level(value: &serde_json::Value, rules: &RoomVersionRules) -> Option<i64> {
    match value {
        serde_json::Value::Number(n) => n.as_i64(),
        serde_json::Value::String(_) if !rules.authorization.integer_power_levels => {
            ruma::serde::deserialize_v1_powerlevel(value)
                .ok()
                .map(i64::from)
        }
        _ => None,
    }
}

/// Power-level content with every string level rewritten as the integer it holds
/// (what a v10+ room requires), for copying an old room's levels into an upgraded
/// room. Values that are not levels are left alone.
pub fn integer_power_levels(content: &serde_json::Value) -> serde_json::Value {
    let old = RoomVersionRules::V1;
    let fix = |v: &mut serde_json::Value| {
        if v.is_string()
            && let Some(i) = power_level(v, &old)
        {
            *v = i.into();
        }
    };
    let mut content = content.clone();
    if let Some(map) = content.as_object_mut() {
        for (k, v) in map.iter_mut() {
            match k.as_str() {
                "events" | "users" | "notifications" => {
                    if let Some(inner) = v.as_object_mut() {
                        inner.values_mut().for_each(fix);
                    }
                }
                _ => fix(v),
            }
        }
    }
    content
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_version_one_to_twelve_has_rules_and_is_stable() {
        for v in SUPPORTED {
            assert!(rules(v).is_some(), "{v}");
            assert_eq!(stability(v), Some("stable"), "{v}");
        }
        assert!(rules("13").is_none());
        assert!(rules("org.matrix.msc2870").is_none());
    }

    #[test]
    fn string_power_levels_count_only_before_v10() {
        let v9 = rules("9").unwrap();
        let v10 = rules("10").unwrap();
        assert_eq!(power_level(&json!("50"), &v9), Some(50));
        assert_eq!(power_level(&json!(" +7"), &v9), Some(7));
        assert_eq!(power_level(&json!("50"), &v10), None);
        assert_eq!(power_level(&json!(50), &v10), Some(50));
        assert_eq!(power_level(&json!("x"), &v9), None);
    }

    #[test]
    fn upgrade_rewrites_string_levels_as_integers() {
        let old = json!({"ban": "50", "users": {"@a:x": "100"}, "events": {"m.room.name": "75"},
                         "notifications": {"room": "20"}, "kick": 40});
        assert_eq!(
            integer_power_levels(&old),
            json!({"ban": 50, "users": {"@a:x": 100}, "events": {"m.room.name": 75},
                   "notifications": {"room": 20}, "kick": 40})
        );
    }
}
