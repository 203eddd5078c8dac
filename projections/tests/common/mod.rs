//! What the runtime tests share: a journal of facts, a signed command.

// Each test binary uses part of this module.
#![allow(dead_code)]

use std::sync::Arc;

use spindle_core::keys::ServerKey;
use spindle_journal::{CommandBody, CommandEnvelope, Fact, FjallStore, Journal, SignedCommand};

/// `body` as a command of `principal` (device `DEV`), signed with `key`.
pub(crate) fn cmd(key: &ServerKey, principal: &str, body: CommandBody) -> SignedCommand {
    SignedCommand::sign(
        key,
        CommandEnvelope {
            principal: principal.into(),
            device_id: Some("DEV".into()),
            issued_at: 1_700_000_000_000,
            body,
        },
    )
    .unwrap()
}

/// A journal in `dir` (fresh key for example.org) holding `n` facts.
pub(crate) async fn journal_with(n: usize, dir: &std::path::Path) -> Journal {
    let key = Arc::new(ServerKey::generate("example.org"));
    let journal = Journal::open(Arc::new(FjallStore::open(dir).unwrap()), key).unwrap();
    append_facts(&journal, 0..n).await;
    journal
}

/// Appends one fact (a `TokenRevoked` of token hash `h<i>`) per `i`, each durable
/// before the next.
pub(crate) async fn append_facts(journal: &Journal, range: std::ops::Range<usize>) {
    for i in range {
        let cmd = SignedCommand::sign(
            journal.key(),
            CommandEnvelope {
                principal: "@a:example.org".into(),
                device_id: None,
                issued_at: 1,
                body: CommandBody::Fact {
                    fact: Fact::TokenRevoked {
                        token_hash: format!("h{i}"),
                    },
                },
            },
        )
        .unwrap();
        journal.submit(cmd).await.unwrap();
    }
}
