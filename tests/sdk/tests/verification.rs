//! Verification between two users, as Element X does it, driven by matrix-rust-sdk
//! against the real `spindle` binary (issue 15 item 6): both bootstrap cross-signing
//! (UIA with their password), Alice asks to verify Bob (the SDK opens an encrypted
//! DM and sends `m.key.verification.request` in it), Bob accepts, they run SAS with
//! emoji, both confirm, and each then sees the other's identity as verified.
//!
//! What this exercises on the server: `/keys/device_signing/upload` behind UIA,
//! `/keys/query` with cross-signing keys, one-time key claims and to-device Olm
//! messages (the DM's room key), an encrypted room's timeline, and the signature
//! uploads at the end, which must put the *signed* user in the signer's
//! `device_lists.changed` (else the SDK never re-reads the identity it just signed).

#![recursion_limit = "256"]

mod common;

use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use common::{Server, WAIT};
use matrix_sdk::{
    Client,
    config::SyncSettings,
    encryption::verification::{SasVerification, Verification, VerificationRequest},
    ruma::{
        OwnedUserId,
        api::client::uiaa::{self, AuthData},
        events::key::verification::VerificationMethod,
    },
};

/// Bootstraps cross-signing for `client`, answering the UIA with `password`.
async fn bootstrap_cross_signing(client: &Client, password: &str) -> Result<()> {
    let user_id = client.user_id().ok_or_else(|| anyhow!("not logged in"))?;
    match client.encryption().bootstrap_cross_signing(None).await {
        Ok(()) => Ok(()),
        Err(e) => {
            let uiaa = e
                .as_uiaa_response()
                .ok_or_else(|| anyhow!("bootstrap_cross_signing failed without UIA: {e}"))?;
            let mut auth = uiaa::Password::new(
                uiaa::UserIdentifier::Matrix(uiaa::MatrixUserIdentifier::new(user_id.to_string())),
                password.to_owned(),
            );
            auth.session = uiaa.session.clone();
            client
                .encryption()
                .bootstrap_cross_signing(Some(AuthData::Password(auth)))
                .await?;
            Ok(())
        }
    }
}

/// Polls `f` every 50 ms until it gives `Some`, at most [`WAIT`].
async fn until<T, F, Fut>(what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn spawn_sync(client: &Client) -> tokio::task::JoinHandle<()> {
    let client = client.clone();
    tokio::spawn(async move {
        let settings = SyncSettings::default().timeout(Duration::from_secs(2));
        if let Err(e) = client.sync(settings).await {
            eprintln!("sync of {:?} ended: {e}", client.user_id());
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_users_verify_each_other_with_sas_over_an_encrypted_dm() -> Result<()> {
    let server = Server::start().await?;
    let result = flow(&server).await;
    if result.is_err() {
        eprintln!("--- spindle stderr ---\n{}", server.log_tail());
    }
    drop(server.child);
    result
}

async fn flow(server: &Server) -> Result<()> {
    server.register("alice").await?;
    server.register("bob").await?;
    let alice = server.login("alice").await?;
    let bob = server.login("bob").await?;
    let alice_id: OwnedUserId = alice.user_id().unwrap().to_owned();
    let bob_id: OwnedUserId = bob.user_id().unwrap().to_owned();
    // One sync each first, so the SDK has uploaded the device keys it created at login.
    alice.sync_once(SyncSettings::default()).await?;
    bob.sync_once(SyncSettings::default()).await?;
    bootstrap_cross_signing(&alice, "password-alice").await?;
    bootstrap_cross_signing(&bob, "password-bob").await?;
    let syncs = [spawn_sync(&alice), spawn_sync(&bob)];

    // Alice sees Bob's cross-signing identity, not verified yet.
    let bob_identity = until("Bob's identity on Alice's side", || async {
        alice
            .encryption()
            .request_user_identity(&bob_id)
            .await
            .ok()
            .flatten()
    })
    .await?;
    assert!(
        !bob_identity.is_verified(),
        "Bob is not verified before SAS"
    );
    // And Bob Alice's: the SDK drops a verification request from a device it has not
    // fetched yet (a client race, not a server one; a person's client has usually
    // fetched its room-mates' keys long before).
    until("Alice's identity on Bob's side", || async {
        bob.encryption()
            .request_user_identity(&alice_id)
            .await
            .ok()
            .flatten()
    })
    .await?;

    // The DM first (the SDK would create it inside request_verification; doing it here
    // lets Bob join before the request arrives, as a person would).
    let dm = alice.create_dm(&bob_id).await?;
    let dm_id = dm.room_id().to_owned();
    let invited = until("Bob's invite to the DM", || async { bob.get_room(&dm_id) }).await?;
    invited.join().await?;
    until("Bob in the DM on Alice's side", || async {
        let room = alice.get_room(&dm_id)?;
        let members = room.members(matrix_sdk::RoomMemberships::JOIN).await.ok()?;
        members.iter().any(|m| m.user_id() == bob_id).then_some(())
    })
    .await?;

    // Alice's client knows the room as her DM with Bob from `m.direct`, which her
    // sync brings back (else the SDK opens another DM for the request).
    until("the DM in Alice's m.direct", || async {
        alice
            .get_dm_room(&bob_id)
            .filter(|r| r.room_id() == dm_id)
            .map(|_| ())
    })
    .await?;
    let alice_request: VerificationRequest = bob_identity
        .request_verification_with_methods(vec![VerificationMethod::SasV1])
        .await?;
    let flow_id = alice_request.flow_id().to_owned();
    let bob_request = match until("the request on Bob's side", || async {
        bob.encryption()
            .get_verification_request(&alice_id, &flow_id)
            .await
    })
    .await
    {
        Ok(r) => r,
        Err(e) => {
            let room = bob.get_room(&dm_id).unwrap();
            let msgs = room
                .messages(matrix_sdk::room::MessagesOptions::backward())
                .await?;
            for ev in msgs.chunk {
                eprintln!(
                    "bob sees: {:?} {}",
                    ev.kind.encryption_info().is_some(),
                    ev.raw().json().get()
                );
            }
            return Err(e);
        }
    };
    bob_request
        .accept_with_methods(vec![VerificationMethod::SasV1])
        .await?;
    until("the request ready on Alice's side", || async {
        alice_request.is_ready().then_some(())
    })
    .await?;
    let alice_sas: SasVerification = alice_request
        .start_sas()
        .await?
        .ok_or_else(|| anyhow!("start_sas gave no SAS"))?;
    let bob_sas = until("the SAS on Bob's side", || async {
        match bob.encryption().get_verification(&alice_id, &flow_id).await {
            Some(Verification::SasV1(sas)) => Some(sas),
            _ => None,
        }
    })
    .await?;
    bob_sas.accept().await?;
    until("the emoji on both sides", || async {
        (alice_sas.can_be_presented() && bob_sas.can_be_presented()).then_some(())
    })
    .await?;
    let (a, b) = (alice_sas.emoji().unwrap(), bob_sas.emoji().unwrap());
    let symbols = |e: &[matrix_sdk::encryption::verification::Emoji; 7]| {
        e.iter().map(|e| e.symbol).collect::<Vec<_>>()
    };
    assert_eq!(symbols(&a), symbols(&b), "both sides show the same emoji");
    alice_sas.confirm().await?;
    bob_sas.confirm().await?;
    until("SAS done on both sides", || async {
        (alice_sas.is_done() && bob_sas.is_done()).then_some(())
    })
    .await?;

    // Each side now trusts the other's identity, read back through the server.
    until("Bob verified on Alice's side", || async {
        let id = alice.encryption().get_user_identity(&bob_id).await.ok()??;
        id.is_verified().then_some(())
    })
    .await?;
    until("Alice verified on Bob's side", || async {
        let id = bob.encryption().get_user_identity(&alice_id).await.ok()??;
        id.is_verified().then_some(())
    })
    .await?;
    for s in syncs {
        s.abort();
    }
    Ok(())
}
