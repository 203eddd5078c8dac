//! Accounts projection: users, devices, access tokens (by hash) and profiles.
//!
//! Tables:
//! - `users`: user id -> [`Account`] JSON
//! - `devices`: user, 0x00, device -> [`Device`] JSON
//! - `tokens`: token hash -> [`TokenOwner`] JSON
//! - `device_tokens`: user, 0x00, device, 0x00, token hash -> empty (to revoke a device's tokens)
//! - `profiles`: user id -> [`Profile`] JSON
//! - `refresh_tokens`: refresh token hash -> [`RefreshOwner`] JSON
//! - `openid_tokens`: OpenID token hash -> [`OpenIdOwner`] JSON (expired rows stay:
//!   apply has no clock; the API compares `expires_at` with its own)
//! - `threepids`: user, 0x00, medium, 0x00, address -> [`Threepid`] JSON (spec: "Adding
//!   Account Administrative Contact Information")
//! - `threepid_owners`: medium, 0x00, address -> user id (one account per address)
//! - `threepid_binds`: user, 0x00, medium, 0x00, address, 0x00, identity server ->
//!   empty (the identity servers a 3PID was bound on, to unbind it later)
//!
//! A device's refresh tokens are listed in `device_tokens` too, as `r` + hash, so
//! deleting the device revokes them with its access tokens.

use serde::{Deserialize, Serialize};
use spindle_journal::{Fact, Interest, StoredRecord};

use crate::{
    runtime::Projection,
    store::{ApplyCtx, ProjectionDb, Table, key},
};

/// A local account.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Account {
    /// argon2 PHC string, if the account has a password.
    pub password_hash: Option<String>,
    /// The account was deactivated: no login, never registered again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deactivated: bool,
    /// A guest account (spec: "Guest Access"), until it upgrades.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub guest: bool,
}

/// A device.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Device {
    /// Device display name.
    pub display_name: Option<String>,
}

/// When and from where a device was last seen, as journaled (`DeviceSeen`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct DeviceSeen {
    /// ms since the Unix epoch.
    pub ts: u64,
    /// The client address (`None` when the server keeps none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<String>,
    /// The client's `User-Agent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_agent: Option<String>,
}

/// Who an access token belongs to.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TokenOwner {
    /// User id.
    pub user_id: String,
    /// Device id.
    pub device_id: String,
    /// When a refreshable access token stops working, ms since the Unix epoch (the
    /// API compares it with its clock; apply never reads a clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<u64>,
    /// The token is a guest's (copied from the account when the token is issued and
    /// cleared when the guest upgrades), so the auth check knows it from the one
    /// token read it makes anyway.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub guest: bool,
}

/// Who a refresh token belongs to, and the access token issued with it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RefreshOwner {
    /// User id.
    pub user_id: String,
    /// Device id.
    pub device_id: String,
    /// Hash of the access token issued with this refresh token.
    pub token_hash: String,
}

/// Who an OpenID token (spec: "OpenID") identifies, and until when.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct OpenIdOwner {
    /// User id.
    pub user_id: String,
    /// When the token stops working, ms since the Unix epoch.
    pub expires_at: u64,
}

/// A third-party identifier of an account (spec: `GET /account/3pid`).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Threepid {
    /// When its owner proved it, ms since the Unix epoch.
    pub validated_at: u64,
    /// When it was added to the account, ms since the Unix epoch.
    pub added_at: u64,
}

/// Profile fields (spec: client-server API "Profiles").
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Profile {
    /// Display name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub displayname: Option<String>,
    /// Avatar `mxc://` URI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avatar_url: Option<String>,
    /// Every other field (`m.tz`, namespaced custom keys; spec v1.16), by key.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub fields: std::collections::BTreeMap<String, serde_json::Value>,
}

/// A profile must stay under this many bytes (spec: "the total profile MUST be under
/// 64 KiB"), measured as the JSON of [`Profile::to_json`].
pub const MAX_PROFILE_BYTES: usize = 64 * 1024;

impl Profile {
    /// The profile as the spec's `GET /profile/{userId}` returns it: `displayname`,
    /// `avatar_url` and every other field, absent ones left out.
    pub fn to_json(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut out: serde_json::Map<String, serde_json::Value> = self
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if let Some(d) = &self.displayname {
            out.insert("displayname".into(), d.clone().into());
        }
        if let Some(a) = &self.avatar_url {
            out.insert("avatar_url".into(), a.clone().into());
        }
        out
    }

    /// Size of [`Profile::to_json`] in bytes (what [`MAX_PROFILE_BYTES`] limits).
    pub fn size_bytes(&self) -> usize {
        serde_json::to_vec(&self.to_json()).map_or(usize::MAX, |v| v.len())
    }
}

/// The accounts projection.
pub struct Accounts {
    users: Table,
    devices: Table,
    device_seen: Table,
    tokens: Table,
    device_tokens: Table,
    profiles: Table,
    refresh_tokens: Table,
    openid_tokens: Table,
    threepids: Table,
    threepid_owners: Table,
    threepid_binds: Table,
}

impl Accounts {
    /// Opens the tables.
    pub fn open(db: &ProjectionDb) -> Result<Accounts, String> {
        Ok(Accounts {
            users: db.table("accounts", "users")?,
            devices: db.table("accounts", "devices")?,
            device_seen: db.table("accounts", "device_seen")?,
            tokens: db.table("accounts", "tokens")?,
            device_tokens: db.table("accounts", "device_tokens")?,
            profiles: db.table("accounts", "profiles")?,
            refresh_tokens: db.table("accounts", "refresh_tokens")?,
            openid_tokens: db.table("accounts", "openid_tokens")?,
            threepids: db.table("accounts", "threepids")?,
            threepid_owners: db.table("accounts", "threepid_owners")?,
            threepid_binds: db.table("accounts", "threepid_binds")?,
        })
    }

    /// The account, if registered.
    pub fn user(&self, user_id: &str) -> Option<Account> {
        serde_json::from_slice(&self.users.get(user_id.as_bytes())?).ok()
    }

    /// Every account, ordered by user id (the server-admin user list; cost grows with
    /// the number of accounts, which that list reports in full as `total`).
    pub fn users(&self) -> Vec<(String, Account)> {
        self.users
            .scan_prefix(&[], usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    String::from_utf8_lossy(&k).into_owned(),
                    serde_json::from_slice(&v).ok()?,
                ))
            })
            .collect()
    }

    /// Resolves a token hash (one point read).
    pub fn token(&self, token_hash: &str) -> Option<TokenOwner> {
        serde_json::from_slice(&self.tokens.get(token_hash.as_bytes())?).ok()
    }

    /// A user's devices, ordered by device id.
    pub fn devices(&self, user_id: &str) -> Vec<(String, Device)> {
        let prefix = key::prefix(&[user_id]);
        self.devices
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

    /// One device.
    pub fn device(&self, user_id: &str, device_id: &str) -> Option<Device> {
        serde_json::from_slice(&self.devices.get(&key::join(&[user_id, device_id]))?).ok()
    }

    /// When and from where the device was last seen, as last journaled.
    pub fn device_seen(&self, user_id: &str, device_id: &str) -> Option<DeviceSeen> {
        serde_json::from_slice(&self.device_seen.get(&key::join(&[user_id, device_id]))?).ok()
    }

    /// The user's profile (empty if never set).
    pub fn profile(&self, user_id: &str) -> Profile {
        self.profiles
            .get(user_id.as_bytes())
            .and_then(|v| serde_json::from_slice(&v).ok())
            .unwrap_or_default()
    }

    /// Resolves a refresh token hash (one point read).
    pub fn refresh_token(&self, refresh_token_hash: &str) -> Option<RefreshOwner> {
        serde_json::from_slice(&self.refresh_tokens.get(refresh_token_hash.as_bytes())?).ok()
    }

    /// Resolves an OpenID token hash (one point read); expiry is the caller's check.
    pub fn openid_token(&self, token_hash: &str) -> Option<OpenIdOwner> {
        serde_json::from_slice(&self.openid_tokens.get(token_hash.as_bytes())?).ok()
    }

    /// The user's third-party identifiers as (medium, address, row), ordered by
    /// medium then address.
    pub fn threepids(&self, user_id: &str) -> Vec<(String, String, Threepid)> {
        let prefix = key::prefix(&[user_id]);
        self.threepids
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, v)| {
                let rest = &k[prefix.len()..];
                let sep = rest.iter().position(|b| *b == 0)?;
                Some((
                    String::from_utf8_lossy(&rest[..sep]).into_owned(),
                    String::from_utf8_lossy(&rest[sep + 1..]).into_owned(),
                    serde_json::from_slice(&v).ok()?,
                ))
            })
            .collect()
    }

    /// The local account a third-party identifier belongs to (one point read).
    pub fn threepid_owner(&self, medium: &str, address: &str) -> Option<String> {
        self.threepid_owners
            .get(&key::join(&[medium, address]))
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// The identity servers `user_id` bound this identifier on, ordered by name.
    pub fn threepid_binds(&self, user_id: &str, medium: &str, address: &str) -> Vec<String> {
        let prefix = key::prefix(&[user_id, medium, address]);
        self.threepid_binds
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .map(|(k, _)| String::from_utf8_lossy(&k[prefix.len()..]).into_owned())
            .collect()
    }

    /// Every (medium, address) `user_id` has bound on some identity server, ordered,
    /// without repeats.
    pub fn bound_threepids(&self, user_id: &str) -> Vec<(String, String)> {
        let prefix = key::prefix(&[user_id]);
        let mut out: Vec<(String, String)> = self
            .threepid_binds
            .scan_prefix(&prefix, usize::MAX)
            .into_iter()
            .filter_map(|(k, _)| {
                let mut parts = k[prefix.len()..].split(|b| *b == 0);
                let medium = String::from_utf8_lossy(parts.next()?).into_owned();
                let address = String::from_utf8_lossy(parts.next()?).into_owned();
                Some((medium, address))
            })
            .collect();
        out.dedup();
        out
    }

    /// Stages a refreshable access token and its refresh token.
    fn issue_refreshable(
        &self,
        ctx: &ApplyCtx,
        mut owner: TokenOwner,
        token_hash: String,
        refresh_token_hash: String,
    ) {
        owner.guest = self.is_guest(ctx, &owner.user_id);
        let refresh = RefreshOwner {
            user_id: owner.user_id.clone(),
            device_id: owner.device_id.clone(),
            token_hash: token_hash.clone(),
        };
        ctx.put(
            &self.device_tokens,
            key::join(&[&owner.user_id, &owner.device_id, &token_hash]),
            Vec::new(),
        );
        ctx.put(
            &self.device_tokens,
            key::join(&[
                &owner.user_id,
                &owner.device_id,
                &format!("r{refresh_token_hash}"),
            ]),
            Vec::new(),
        );
        ctx.put(
            &self.refresh_tokens,
            refresh_token_hash.into_bytes(),
            serde_json::to_vec(&refresh).expect("rows serialize"),
        );
        ctx.put(
            &self.tokens,
            token_hash.into_bytes(),
            serde_json::to_vec(&owner).expect("rows serialize"),
        );
    }

    fn revoke_refresh(&self, ctx: &ApplyCtx, refresh_token_hash: &str) {
        if let Some(owner) = ctx
            .get(&self.refresh_tokens, refresh_token_hash.as_bytes())
            .and_then(|v| serde_json::from_slice::<RefreshOwner>(&v).ok())
        {
            ctx.delete(
                &self.device_tokens,
                key::join(&[
                    &owner.user_id,
                    &owner.device_id,
                    &format!("r{refresh_token_hash}"),
                ]),
            );
        }
        ctx.delete(&self.refresh_tokens, refresh_token_hash.as_bytes().to_vec());
    }

    /// Whether `user_id` is a guest account, as this batch sees it.
    fn is_guest(&self, ctx: &ApplyCtx, user_id: &str) -> bool {
        ctx.get(&self.users, user_id.as_bytes())
            .and_then(|v| serde_json::from_slice::<Account>(&v).ok())
            .is_some_and(|a| a.guest)
    }

    fn revoke(&self, ctx: &ApplyCtx, token_hash: &str) {
        if let Some(owner) = ctx
            .get(&self.tokens, token_hash.as_bytes())
            .and_then(|v| serde_json::from_slice::<TokenOwner>(&v).ok())
        {
            ctx.delete(
                &self.device_tokens,
                key::join(&[&owner.user_id, &owner.device_id, token_hash]),
            );
        }
        ctx.delete(&self.tokens, token_hash.as_bytes().to_vec());
    }
}

impl Projection for Accounts {
    fn name(&self) -> &'static str {
        "accounts"
    }

    /// Facts only: a message does not wake it.
    fn interest(&self) -> Interest {
        Interest::FACTS
    }

    fn tables(&self) -> Vec<Table> {
        vec![
            self.users.clone(),
            self.devices.clone(),
            self.tokens.clone(),
            self.device_tokens.clone(),
            self.profiles.clone(),
            self.refresh_tokens.clone(),
            self.openid_tokens.clone(),
            self.device_seen.clone(),
            self.threepids.clone(),
            self.threepid_owners.clone(),
            self.threepid_binds.clone(),
        ]
    }

    fn apply(&self, ctx: &mut ApplyCtx, record: &StoredRecord) -> Result<(), String> {
        let Some(fact) = record.fact() else {
            return Ok(());
        };
        let json = |v: &dyn erased::Ser| v.to_vec();
        match fact {
            Fact::AccountRegistered {
                user_id,
                password_hash,
                guest,
            } => {
                ctx.put(
                    &self.users,
                    user_id.into_bytes(),
                    json(&Account {
                        password_hash,
                        deactivated: false,
                        guest,
                    }),
                );
            }
            Fact::GuestUpgraded {
                user_id,
                password_hash,
            } => {
                let Some(mut a) = ctx
                    .get(&self.users, user_id.as_bytes())
                    .and_then(|v| serde_json::from_slice::<Account>(&v).ok())
                else {
                    return Ok(());
                };
                a.guest = false;
                if password_hash.is_some() {
                    a.password_hash = password_hash;
                }
                ctx.put(&self.users, user_id.clone().into_bytes(), json(&a));
                // The guest's live access tokens become a full account's.
                let prefix = key::prefix(&[&user_id]);
                for (k, _) in ctx.scan_prefix(&self.device_tokens, &prefix) {
                    let Some(hash) = k.rsplit(|b| *b == 0).next() else {
                        continue;
                    };
                    if hash.first() == Some(&b'r') {
                        continue;
                    }
                    if let Some(mut owner) = ctx
                        .get(&self.tokens, hash)
                        .and_then(|v| serde_json::from_slice::<TokenOwner>(&v).ok())
                    {
                        owner.guest = false;
                        ctx.put(&self.tokens, hash.to_vec(), json(&owner));
                    }
                }
            }
            Fact::DeviceCreated {
                user_id,
                device_id,
                display_name,
            }
            | Fact::DeviceRenamed {
                user_id,
                device_id,
                display_name,
            } => {
                ctx.put(
                    &self.devices,
                    key::join(&[&user_id, &device_id]),
                    json(&Device { display_name }),
                );
            }
            Fact::DeviceSeen {
                user_id,
                device_id,
                ts,
                ip,
                user_agent,
            } => {
                // Only for a device that exists (the fact may trail its deletion).
                let k = key::join(&[&user_id, &device_id]);
                if ctx.get(&self.devices, &k).is_some() {
                    ctx.put(
                        &self.device_seen,
                        k,
                        json(&DeviceSeen { ts, ip, user_agent }),
                    );
                }
            }
            Fact::DeviceDeleted { user_id, device_id } => {
                ctx.delete(&self.devices, key::join(&[&user_id, &device_id]));
                ctx.delete(&self.device_seen, key::join(&[&user_id, &device_id]));
                let prefix = key::prefix(&[&user_id, &device_id]);
                for (k, _) in ctx.scan_prefix(&self.device_tokens, &prefix) {
                    let hash = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                    match hash.strip_prefix('r') {
                        Some(refresh) => self.revoke_refresh(ctx, refresh),
                        None => self.revoke(ctx, &hash),
                    }
                }
            }
            Fact::TokenIssued {
                user_id,
                device_id,
                token_hash,
            } => {
                ctx.put(
                    &self.tokens,
                    token_hash.clone().into_bytes(),
                    json(&TokenOwner {
                        guest: self.is_guest(ctx, &user_id),
                        user_id: user_id.clone(),
                        device_id: device_id.clone(),
                        expires_at: None,
                    }),
                );
                ctx.put(
                    &self.device_tokens,
                    key::join(&[&user_id, &device_id, &token_hash]),
                    Vec::new(),
                );
            }
            Fact::TokenRevoked { token_hash } => self.revoke(ctx, &token_hash),
            // A device deleted before this record leaves nothing to attach to.
            Fact::RefreshableTokenIssued {
                user_id,
                device_id,
                token_hash,
                refresh_token_hash,
                expires_at,
            } if ctx
                .get(&self.devices, &key::join(&[&user_id, &device_id]))
                .is_some() =>
            {
                let owner = TokenOwner {
                    user_id,
                    device_id,
                    expires_at: Some(expires_at),
                    guest: false,
                };
                self.issue_refreshable(ctx, owner, token_hash, refresh_token_hash);
            }
            Fact::TokenRefreshed {
                user_id,
                device_id,
                old_refresh_token_hash,
                token_hash,
                refresh_token_hash,
                expires_at,
            } => {
                // Only a live refresh token yields a new pair (its device may have been
                // deleted, or the token revoked, after the API looked it up).
                let old = ctx
                    .get(&self.refresh_tokens, old_refresh_token_hash.as_bytes())
                    .and_then(|v| serde_json::from_slice::<RefreshOwner>(&v).ok());
                if let Some(old) = old.filter(|o| o.user_id == user_id && o.device_id == device_id)
                {
                    self.revoke(ctx, &old.token_hash);
                    self.revoke_refresh(ctx, &old_refresh_token_hash);
                    let owner = TokenOwner {
                        user_id,
                        device_id,
                        expires_at: Some(expires_at),
                        guest: false,
                    };
                    self.issue_refreshable(ctx, owner, token_hash, refresh_token_hash);
                }
            }
            Fact::PasswordChanged {
                user_id,
                password_hash,
            } => {
                if let Some(mut a) = ctx
                    .get(&self.users, user_id.as_bytes())
                    .and_then(|v| serde_json::from_slice::<Account>(&v).ok())
                {
                    a.password_hash = Some(password_hash);
                    ctx.put(&self.users, user_id.into_bytes(), json(&a));
                }
            }
            Fact::AccountDeactivated { user_id, erase } => {
                if let Some(mut a) = ctx
                    .get(&self.users, user_id.as_bytes())
                    .and_then(|v| serde_json::from_slice::<Account>(&v).ok())
                {
                    a.password_hash = None;
                    a.deactivated = true;
                    ctx.put(&self.users, user_id.clone().into_bytes(), json(&a));
                }
                if erase {
                    ctx.delete(&self.profiles, user_id.into_bytes());
                }
            }
            Fact::ProfileSet {
                user_id,
                displayname,
                avatar_url,
            } => {
                let mut p: Profile = ctx
                    .get(&self.profiles, user_id.as_bytes())
                    .and_then(|v| serde_json::from_slice(&v).ok())
                    .unwrap_or_default();
                if let Some(d) = displayname {
                    p.displayname = d;
                }
                if let Some(a) = avatar_url {
                    p.avatar_url = a;
                }
                ctx.put(&self.profiles, user_id.into_bytes(), json(&p));
            }
            Fact::ProfileFieldSet {
                user_id,
                key,
                value,
            } => {
                let mut p: Profile = ctx
                    .get(&self.profiles, user_id.as_bytes())
                    .and_then(|v| serde_json::from_slice(&v).ok())
                    .unwrap_or_default();
                match value {
                    Some(v) => {
                        p.fields.insert(key, v);
                    }
                    None => {
                        p.fields.remove(&key);
                    }
                }
                // The limit holds in the read model even if two writes raced past the
                // API's check: the one that would break it is not applied.
                if p.size_bytes() < MAX_PROFILE_BYTES {
                    ctx.put(&self.profiles, user_id.into_bytes(), json(&p));
                }
            }
            Fact::OpenIdTokenIssued {
                user_id,
                token_hash,
                expires_at,
            } => {
                ctx.put(
                    &self.openid_tokens,
                    token_hash.into_bytes(),
                    json(&OpenIdOwner {
                        user_id,
                        expires_at,
                    }),
                );
            }
            Fact::ThreepidAdded {
                user_id,
                medium,
                address,
                validated_at,
                added_at,
            } => {
                let owner_key = key::join(&[&medium, &address]);
                // One account per address, even if two adds raced past the API's check:
                // the later one is not applied.
                if let Some(owner) = ctx.get(&self.threepid_owners, &owner_key)
                    && owner.as_slice() != user_id.as_bytes()
                {
                    return Ok(());
                }
                ctx.put(
                    &self.threepid_owners,
                    owner_key,
                    user_id.clone().into_bytes(),
                );
                ctx.put(
                    &self.threepids,
                    key::join(&[&user_id, &medium, &address]),
                    json(&Threepid {
                        validated_at,
                        added_at,
                    }),
                );
            }
            Fact::ThreepidRemoved {
                user_id,
                medium,
                address,
            } => {
                let owner_key = key::join(&[&medium, &address]);
                if ctx
                    .get(&self.threepid_owners, &owner_key)
                    .is_some_and(|o| o.as_slice() == user_id.as_bytes())
                {
                    ctx.delete(&self.threepid_owners, owner_key);
                }
                ctx.delete(&self.threepids, key::join(&[&user_id, &medium, &address]));
                let prefix = key::prefix(&[&user_id, &medium, &address]);
                for (k, _) in ctx.scan_prefix(&self.threepid_binds, &prefix) {
                    ctx.delete(&self.threepid_binds, k);
                }
            }
            Fact::ThreepidBound {
                user_id,
                medium,
                address,
                id_server,
            } => {
                ctx.put(
                    &self.threepid_binds,
                    key::join(&[&user_id, &medium, &address, &id_server]),
                    Vec::new(),
                );
            }
            Fact::ThreepidUnbound {
                user_id,
                medium,
                address,
                id_server,
            } => {
                ctx.delete(
                    &self.threepid_binds,
                    key::join(&[&user_id, &medium, &address, &id_server]),
                );
            }
            _ => {}
        }
        Ok(())
    }
}

/// Tiny helper so `apply` can serialize any of the row types the same way.
mod erased {
    pub(super) trait Ser {
        fn to_vec(&self) -> Vec<u8>;
    }
    impl<T: serde::Serialize> Ser for T {
        fn to_vec(&self) -> Vec<u8> {
            serde_json::to_vec(self).expect("rows serialize")
        }
    }
}
