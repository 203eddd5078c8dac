//! Room versions served by Spindle (spec: "Room Versions").
//!
//! We create and accept rooms of versions 10, 11 and 12. Version 12 derives the room id
//! from the create event's reference hash (MSC4291) and treats the room creator(s) as
//! having infinite power (MSC4289); ruma's rules carry those differences.

use ruma::{RoomVersionId, room_version_rules::RoomVersionRules};

/// The room version used by `createRoom` when the client does not ask for one.
/// Synapse's default is 10 as well; stock clients all handle it.
pub const DEFAULT_ROOM_VERSION: &str = "10";

/// Room versions we can create and join, in the order `/capabilities` lists them.
pub const SUPPORTED: [&str; 3] = ["10", "11", "12"];

/// Returns the ruma rules for a supported version string, `None` otherwise.
pub fn rules(version: &str) -> Option<RoomVersionRules> {
    if !SUPPORTED.contains(&version) {
        return None;
    }
    RoomVersionId::try_from(version).ok()?.rules()
}

/// Whether rooms of this version take their id from the create event (v12+).
pub fn room_id_from_create(version: &str) -> bool {
    version == "12"
}
