//! Guest accounts in the accounts projection (spec: "Guest Access"): the guest flag
//! of `AccountRegistered` reaches the account and every token issued to it,
//! `GuestUpgraded` clears both, and a rebuild from position 0 agrees.

use std::{sync::Arc, time::Duration};

use spindle_core::keys::ServerKey;
use spindle_journal::{CommandBody, CommandEnvelope, Fact, FjallStore, Journal, SignedCommand};
use spindle_projections::Projections;

fn fact(key: &ServerKey, principal: &str, fact: Fact) -> SignedCommand {
    SignedCommand::sign(
        key,
        CommandEnvelope {
            principal: principal.into(),
            device_id: None,
            issued_at: 1_700_000_000_000,
            body: CommandBody::Fact { fact },
        },
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_flag_follows_the_account_and_its_tokens_through_an_upgrade() {
    let dir = tempfile::tempdir().unwrap();
    let key = Arc::new(ServerKey::generate("example.org"));
    let store = FjallStore::open(&dir.path().join("journal")).unwrap();
    let journal = Journal::open(Arc::new(store), key.clone()).unwrap();
    let live = Projections::start(&dir.path().join("live"), journal.clone()).unwrap();
    let guest = "@1:example.org";
    let full = "@alice:example.org";
    let submit = |principal: &str, f: Fact| journal.submit(fact(&key, principal, f));
    for (user, is_guest) in [(guest, true), (full, false)] {
        submit(
            user,
            Fact::AccountRegistered {
                user_id: user.into(),
                password_hash: None,
                guest: is_guest,
            },
        )
        .await
        .unwrap();
        submit(
            user,
            Fact::DeviceCreated {
                user_id: user.into(),
                device_id: "DEV".into(),
                display_name: None,
            },
        )
        .await
        .unwrap();
        submit(
            user,
            Fact::TokenIssued {
                user_id: user.into(),
                device_id: "DEV".into(),
                token_hash: format!("h-{user}"),
            },
        )
        .await
        .unwrap();
    }
    submit(
        guest,
        Fact::RefreshableTokenIssued {
            user_id: guest.into(),
            device_id: "DEV".into(),
            token_hash: "h-guest-2".into(),
            refresh_token_hash: "r-guest-2".into(),
            expires_at: 5,
        },
    )
    .await
    .unwrap();
    let head = journal.durable_head();
    assert!(live.runtime.wait_for(head, Duration::from_secs(10)).await);
    assert!(live.accounts.user(guest).unwrap().guest);
    assert!(!live.accounts.user(full).unwrap().guest);
    assert!(live.accounts.token(&format!("h-{guest}")).unwrap().guest);
    assert!(live.accounts.token("h-guest-2").unwrap().guest);
    assert!(!live.accounts.token(&format!("h-{full}")).unwrap().guest);

    submit(
        guest,
        Fact::GuestUpgraded {
            user_id: guest.into(),
            password_hash: Some("$argon2id$stub".into()),
        },
    )
    .await
    .unwrap();
    let head = journal.durable_head();
    assert!(
        live.runtime
            .wait_for_all(head, Duration::from_secs(10))
            .await
    );
    let rebuilt = Projections::start(&dir.path().join("rebuilt"), journal.clone()).unwrap();
    assert!(
        rebuilt
            .runtime
            .wait_for_all(head, Duration::from_secs(10))
            .await
    );
    for p in [&live, &rebuilt] {
        let account = p.accounts.user(guest).unwrap();
        assert!(!account.guest);
        assert_eq!(account.password_hash.as_deref(), Some("$argon2id$stub"));
        let owner = p.accounts.token(&format!("h-{guest}")).unwrap();
        assert_eq!((owner.user_id.as_str(), owner.guest), (guest, false));
        let refreshable = p.accounts.token("h-guest-2").unwrap();
        assert_eq!(
            (refreshable.guest, refreshable.expires_at),
            (false, Some(5))
        );
        // The refresh token itself is untouched.
        assert_eq!(
            p.accounts.refresh_token("r-guest-2").unwrap().token_hash,
            "h-guest-2"
        );
    }
    assert_eq!(live.runtime.digests(), rebuilt.runtime.digests());
}
