//! Rebuild and verify projections from the journal
