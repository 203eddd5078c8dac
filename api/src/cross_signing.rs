//! Cross-signing (spec: client-server API "Cross-signing"):
//! `POST /keys/device_signing/upload` and `POST /keys/signatures/upload`.
//!
//! Every signature is checked with the spec's rules before it is journaled: a
//! self-signing or user-signing key must carry the master key's signature; a signature
//! on one's own device must come from one's self-signing key; on one's own master key,
//! from one of one's devices; on another user's master key, from one's user-signing
//! key. A bad one is refused with `M_INVALID_SIGNATURE`.

use std::collections::BTreeMap;

use axum::{Json, Router, extract::State, response::IntoResponse, routing::post};
use serde_json::{Map, Value, json};
use spindle_core::e2ee::{cross_signing_public_key, verify_signature};
use spindle_journal::{CommandBody, Fact, SignatureAdded};

use crate::{
    ApiResult, AppState, MatrixError,
    extract::{JsonObject, Requester},
    keys::invalid_signature,
};

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route(
            "/_matrix/client/v3/keys/device_signing/upload",
            post(device_signing_upload),
        )
        // MSC1756's unstable path, still probed by Element Web.
        .route(
            "/_matrix/client/unstable/keys/device_signing/upload",
            post(device_signing_upload),
        )
        .route(
            "/_matrix/client/v3/keys/signatures/upload",
            post(signatures_upload),
        )
}

/// Checks a cross-signing key object: owner, usage, exactly one ed25519 key.
/// Returns its (key id, public key).
fn check_key(r: &Requester, v: &Value, usage: &str) -> ApiResult<(String, String)> {
    if v.get("user_id").and_then(|u| u.as_str()) != Some(r.user_id.as_str()) {
        return Err(MatrixError::bad_json(format!(
            "{usage} key: user_id must be {}",
            r.user_id
        )));
    }
    let usages = v.get("usage").and_then(|u| u.as_array());
    if !usages.is_some_and(|u| u.iter().any(|x| x.as_str() == Some(usage))) {
        return Err(MatrixError::bad_json(format!(
            "{usage} key: usage must contain {usage:?}"
        )));
    }
    let (id, public) = cross_signing_public_key(v).ok_or_else(|| {
        MatrixError::bad_json(format!("{usage} key: keys must hold exactly one key"))
    })?;
    if !id.starts_with("ed25519:") {
        return Err(MatrixError::bad_json(format!(
            "{usage} key must be ed25519"
        )));
    }
    Ok((id, public))
}

/// `POST /_matrix/client/v3/keys/device_signing/upload`: the user's master,
/// self-signing and user-signing keys. Replacing an existing master key (or uploading
/// different keys while one exists) needs user-interactive auth with the password; the
/// first upload does not (spec v1.11, MSC3967). Self-signing and user-signing keys
/// must be signed by the master key: else 400 `M_INVALID_SIGNATURE`.
async fn device_signing_upload(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<axum::response::Response> {
    let get = |name: &str| body.get(name).filter(|v| !v.is_null()).cloned();
    let (master, self_signing, user_signing) = (
        get("master_key"),
        get("self_signing_key"),
        get("user_signing_key"),
    );
    let stored = s.projections.device_keys.cross_signing_keys(&r.user_id);
    let master_pub = match &master {
        Some(m) => Some(check_key(&r, m, "master")?),
        None => stored.master.as_ref().and_then(cross_signing_public_key),
    };
    let Some((master_id, master_pub)) = master_pub else {
        return Err(MatrixError::missing_param(
            "master_key is required (none uploaded yet)",
        ));
    };
    for (v, usage) in [
        (&self_signing, "self_signing"),
        (&user_signing, "user_signing"),
    ] {
        if let Some(v) = v {
            check_key(&r, v, usage)?;
            verify_signature(v, &r.user_id, &master_id, &master_pub)
                .map_err(|e| invalid_signature(format!("{usage} key: {e}")))?;
        }
    }
    let unchanged = |new: &Option<Value>, old: &Option<Value>| {
        new.as_ref()
            .is_none_or(|n| old.as_ref().is_some_and(|o| strip(o) == strip(n)))
    };
    let needs_auth = stored.master.is_some()
        && !(unchanged(&master, &stored.master)
            && unchanged(&self_signing, &stored.self_signing)
            && unchanged(&user_signing, &stored.user_signing));
    // The session is bound to the keys being uploaded (crate::uia).
    if needs_auth
        && let Some(challenge) = crate::devices::user_interactive_auth(
            &s,
            &r,
            "POST /keys/device_signing/upload",
            json!({
                "master_key": master,
                "self_signing_key": self_signing,
                "user_signing_key": user_signing,
            }),
            &body,
        )
        .await?
    {
        return Ok(challenge);
    }
    let outcome = s
        .submit(
            &r.user_id,
            Some(&r.device_id),
            CommandBody::Fact {
                fact: Fact::CrossSigningKeysUploaded {
                    user_id: r.user_id.clone(),
                    master_key: master,
                    self_signing_key: self_signing,
                    user_signing_key: user_signing,
                },
            },
        )
        .await?;
    s.wait_for(outcome.position).await?;
    Ok(Json(json!({})).into_response())
}

/// The object without `signatures` and `unsigned`: what a signature covers.
fn strip(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("signatures");
        m.remove("unsigned");
    }
    v
}

/// The key that must have made a signature by `signer` on (`target_user`, `target`),
/// and the stored object it signs. Errors are the failure to report for that entry.
fn signing_rule(
    s: &AppState,
    r: &Requester,
    target_user: &str,
    target: &str,
) -> Result<(Value, Vec<(String, String)>), MatrixError> {
    let keys = &s.projections.device_keys;
    let own = target_user == r.user_id;
    let mut target_cs = keys.cross_signing_keys(target_user);
    // A remote user's master key: the one in our copy of their device list (the
    // signature is kept here and shown in our key queries, as Synapse does).
    if target_cs.master.is_none() && !s.is_local_user(target_user) {
        target_cs.master = keys
            .remote_device_list(target_user)
            .and_then(|l| l.master_key);
    }
    let is_master = target_cs
        .master
        .as_ref()
        .and_then(cross_signing_public_key)
        .is_some_and(|(_, p)| p == target);
    let mine = keys.cross_signing_keys(&r.user_id);
    let pk = |v: &Option<Value>| v.as_ref().and_then(cross_signing_public_key);
    if own && !is_master {
        // One of my devices, signed by my self-signing key.
        let device = keys
            .device_key(target_user, target)
            .ok_or_else(|| MatrixError::not_found(format!("unknown device {target}")))?;
        let ssk = pk(&mine.self_signing)
            .ok_or_else(|| invalid_signature("no self-signing key uploaded"))?;
        return Ok((device, vec![ssk]));
    }
    if own && is_master {
        // My master key, signed by one of my devices.
        let devices = keys
            .device_keys(&r.user_id)
            .into_iter()
            .filter_map(|(d, v)| {
                let id = format!("ed25519:{d}");
                let public = v.get("keys")?.get(&id)?.as_str()?.to_owned();
                Some((id, public))
            })
            .collect();
        return Ok((target_cs.master.clone().expect("is_master"), devices));
    }
    if is_master {
        // Another user's master key, signed by my user-signing key.
        let usk = pk(&mine.user_signing)
            .ok_or_else(|| invalid_signature("no user-signing key uploaded"))?;
        return Ok((target_cs.master.clone().expect("is_master"), vec![usk]));
    }
    Err(MatrixError::invalid_param(format!(
        "{target} is not a key of {target_user} that you may sign"
    )))
}

/// `POST /_matrix/client/v3/keys/signatures/upload`: signatures by the requester on
/// device keys and master keys. Each entry is checked (the object must be the stored
/// one, the signature must verify with the key the rules require); a bad entry is
/// reported under `failures` with `M_INVALID_SIGNATURE` (or why it could not be
/// checked) and the good ones are journaled.
async fn signatures_upload(
    State(s): State<AppState>,
    r: Requester,
    JsonObject(body): JsonObject,
) -> ApiResult<Json<Value>> {
    let mut added = Vec::new();
    let mut failures: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
    for (target_user, objects) in &body {
        let objects = objects
            .as_object()
            .ok_or_else(|| MatrixError::bad_json("values must be objects"))?;
        for (target, signed) in objects {
            let result = (|| -> Result<Vec<SignatureAdded>, MatrixError> {
                let (stored, signers) = signing_rule(&s, &r, target_user, target)?;
                if strip(&stored) != strip(signed) {
                    return Err(invalid_signature(
                        "the signed object differs from the stored key",
                    ));
                }
                let sigs = signed
                    .get("signatures")
                    .and_then(|v| v.get(&r.user_id))
                    .and_then(|v| v.as_object())
                    .ok_or_else(|| invalid_signature("no signature by the requester"))?;
                let mut out = Vec::new();
                for (signer_key_id, sig) in sigs {
                    let Some((_, public)) = signers.iter().find(|(id, _)| id == signer_key_id)
                    else {
                        // Signatures the object already carried (e.g. its own
                        // self-signature) are not new.
                        if stored
                            .get("signatures")
                            .and_then(|v| v.get(&r.user_id))
                            .and_then(|v| v.get(signer_key_id))
                            == Some(sig)
                        {
                            continue;
                        }
                        return Err(invalid_signature(format!(
                            "{signer_key_id} may not sign this key"
                        )));
                    };
                    verify_signature(signed, &r.user_id, signer_key_id, public)
                        .map_err(|e| invalid_signature(e.to_string()))?;
                    out.push(SignatureAdded {
                        user_id: target_user.clone(),
                        key_id: target.clone(),
                        signer: r.user_id.clone(),
                        signer_key_id: signer_key_id.clone(),
                        signature: sig
                            .as_str()
                            .ok_or_else(|| invalid_signature("signatures are strings"))?
                            .to_owned(),
                    });
                }
                Ok(out)
            })();
            match result {
                Ok(sigs) => added.extend(sigs),
                Err(e) => {
                    failures.entry(target_user.clone()).or_default().insert(
                        target.clone(),
                        json!({ "errcode": e.errcode, "error": e.error }),
                    );
                }
            }
        }
    }
    if !added.is_empty() {
        let outcome = s
            .submit(
                &r.user_id,
                Some(&r.device_id),
                CommandBody::Fact {
                    fact: Fact::SignaturesUploaded { signatures: added },
                },
            )
            .await?;
        s.wait_for(outcome.position).await?;
    }
    Ok(Json(json!({ "failures": failures })))
}
