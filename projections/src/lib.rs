//! The projection runtime and every read model, each tailing the journal from its own checkpoint
