//! To-device inbox projection (spec: client-server API "Send-to-Device messaging").
//!
//! Every [`Fact::ToDeviceSent`] is fanned out into the inbox of each target device
//! (the `*` wildcard means every device the user has at that position, which this
//! projection tracks itself from device facts, so the expansion is deterministic). A
//! message stays in the inbox until the device acknowledges it with
//! [`Fact::ToDeviceAcknowledged`] (it synced again with a later `since`), or the device
//! is deleted. Messages to devices that do not exist (or to remote users: there is no
//! federation yet) are dropped.
//!
//! Tables:
//! - `devices`: user, 0x00, device -> empty (the devices that exist)
//! - `inbox`: user, 0x00, device, 0x00, position BE -> JSON array of to-device events
//!   `{sender, type, content}` from the record at that position

use serde_json::{Value, json};
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, LastChange, ProjectionDb, Table, key},
};

/// The to-device inbox projection.
pub struct ToDevice {
    devices: Table,
    inbox: Table,
    last: LastChange,
}

/// Messages waiting for a device, as returned by [`ToDevice::pending`].
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    /// To-device events `{sender, type, content}`, oldest first.
    pub events: Vec<Value>,
    /// Position of the last record whose messages are in `events`.
    pub last_position: Option<u64>,
    /// More messages in the asked range were left out (the page was full).
    pub truncated: bool,
}

impl ToDevice {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<ToDevice, String> {
        Ok(ToDevice {
            devices: db.table("to_device", "devices")?,
            inbox: db.table("to_device", "inbox")?,
            last: LastChange::default(),
        })
    }

    /// To-device messages for (user, device) from records in `(after, upto]`, oldest
    /// first, at most `limit_events` events (whole records only: a record's messages for
    /// one device are never split, so a page may hold one record over the limit when a
    /// single record carries more). One range scan over the device's own inbox.
    pub fn pending(
        &self,
        user_id: &str,
        device_id: &str,
        after: u64,
        upto: u64,
        limit_events: usize,
    ) -> Pending {
        let mut out = Pending {
            events: Vec::new(),
            last_position: None,
            truncated: false,
        };
        if upto <= after {
            return out;
        }
        let rows = self.inbox.scan_range(
            &key::with_pos(&[user_id, device_id], after + 1),
            &key::with_pos(&[user_id, device_id], upto.saturating_add(1)),
            false,
            limit_events.max(1) + 1,
        );
        for (k, v) in rows {
            if !out.events.is_empty() && out.events.len() >= limit_events {
                out.truncated = true;
                break;
            }
            if let Ok(Value::Array(events)) = serde_json::from_slice::<Value>(&v) {
                out.events.extend(events);
            }
            out.last_position = Some(key::trailing_pos(&k));
        }
        out
    }

    /// Position of the oldest message still in the device's inbox (one seek): the sync
    /// handler journals an acknowledgement only when there is something to delete.
    pub fn oldest(&self, user_id: &str, device_id: &str) -> Option<u64> {
        self.inbox
            .scan_prefix(&key::prefix(&[user_id, device_id]), 1)
            .first()
            .map(|(k, _)| key::trailing_pos(k))
    }

    /// Position of the latest message for the device (memory after the first ask):
    /// a waiting `/sync` checks it on every commit.
    pub fn last_change(&self, user_id: &str, device_id: &str) -> u64 {
        self.last
            .get(&format!("{user_id}\u{0}{device_id}"), &self.inbox)
    }

    fn device_exists(&self, ctx: &ApplyCtx, user_id: &str, device_id: &str) -> bool {
        ctx.get(&self.devices, &key::join(&[user_id, device_id]))
            .is_some()
    }
}

impl Projection for ToDevice {
    fn name(&self) -> &'static str {
        "to_device"
    }

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
    }

    fn tables(&self) -> Vec<Table> {
        vec![self.devices.clone(), self.inbox.clone()]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let Some(fact) = record.fact() else {
            return Ok(());
        };
        match fact {
            Fact::DeviceCreated {
                user_id, device_id, ..
            } => {
                ctx.put(
                    &self.devices,
                    key::join(&[&user_id, &device_id]),
                    Vec::new(),
                );
            }
            Fact::DeviceDeleted { user_id, device_id } => {
                ctx.delete(&self.devices, key::join(&[&user_id, &device_id]));
                for (k, _) in ctx.scan_prefix(&self.inbox, &key::prefix(&[&user_id, &device_id])) {
                    ctx.delete(&self.inbox, k);
                }
            }
            Fact::ToDeviceSent {
                sender,
                event_type,
                messages,
                ..
            } => {
                let position = record.position();
                for (user_id, by_device) in messages {
                    // device id -> events for it from this record, in device-id order.
                    let mut per_device: std::collections::BTreeMap<String, Vec<Value>> =
                        Default::default();
                    for (device_id, content) in by_device {
                        let event =
                            json!({ "sender": sender, "type": event_type, "content": content });
                        let targets: Vec<String> = if device_id == "*" {
                            let prefix = key::prefix(&[&user_id]);
                            ctx.scan_prefix(&self.devices, &prefix)
                                .into_iter()
                                .map(|(k, _)| {
                                    String::from_utf8_lossy(&k[prefix.len()..]).into_owned()
                                })
                                .collect()
                        } else if self.device_exists(ctx, &user_id, &device_id) {
                            vec![device_id]
                        } else {
                            vec![]
                        };
                        for d in targets {
                            per_device.entry(d).or_default().push(event.clone());
                        }
                    }
                    for (device_id, events) in per_device {
                        ctx.put(
                            &self.inbox,
                            key::with_pos(&[&user_id, &device_id], position),
                            serde_json::to_vec(&events).map_err(|e| e.to_string())?,
                        );
                        let last = self.last.clone();
                        let k = format!("{user_id}\u{0}{device_id}");
                        ctx.after_commit(move || last.bump(k, position));
                    }
                }
            }
            Fact::ToDeviceAcknowledged {
                user_id,
                device_id,
                upto,
            } => {
                for (k, _) in ctx.scan_prefix(&self.inbox, &key::prefix(&[&user_id, &device_id])) {
                    if key::trailing_pos(&k) > upto {
                        break;
                    }
                    ctx.delete(&self.inbox, k);
                }
            }
            _ => {}
        }
        Ok(())
    }
}
