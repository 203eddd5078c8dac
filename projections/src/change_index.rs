//! Keys by the position of their latest change, indexed both ways.
//!
//! Incremental `/sync` (and every long-poll woken by a commit anywhere) asks "which of
//! this user's rooms changed after the token?". Asked room by room that costs a hash
//! lookup per joined room, for each of the timeline, receipts, typing, presence and
//! device lists: a user in 500 rooms paid for 500 rooms on every poll although one
//! changed. A [`ChangeIndex`] answers "what changed after P" by walking only the keys
//! that did (Synapse's `StreamChangeCache` has the same job), and "when did K last
//! change" with one hash lookup.
//!
//! Each key appears once, at its latest position, so the index holds one entry per key
//! that ever changed (no growth with traffic). Positions are journal positions or, for
//! the ephemeral streams (typing, presence), the process's counter values; the index
//! does not care which, as long as one index holds one kind.

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
};

/// See the [module documentation](self).
///
/// `known_after`: every change at a position after it is in the index. Keys whose
/// latest change is at or before it may be missing (a per-key log read lazily, see
/// [`crate::store::LastChange`]); [`ChangeIndex::changed_after`] answers `None` for such
/// an old position, and the caller checks its keys one by one instead.
#[derive(Debug, Default)]
pub struct ChangeIndex {
    latest: HashMap<Arc<str>, u64>,
    by_position: BTreeSet<(u64, Arc<str>)>,
    known_after: u64,
}

impl ChangeIndex {
    /// An empty index that knows every change after `known_after` (0: every change).
    pub fn new(known_after: u64) -> ChangeIndex {
        ChangeIndex {
            known_after,
            ..Default::default()
        }
    }

    /// The position of the key's latest change, if the index has it.
    pub fn get(&self, key: &str) -> Option<u64> {
        self.latest.get(key).copied()
    }

    /// Records a change of `key` at `position`; an older position than the one kept is
    /// ignored (positions only move forward). Returns the position kept.
    pub fn bump(&mut self, key: &str, position: u64) -> u64 {
        if let Some((k, &kept)) = self.latest.get_key_value(key) {
            if kept >= position {
                return kept;
            }
            let k = k.clone();
            self.by_position.remove(&(kept, k.clone()));
            self.by_position.insert((position, k.clone()));
            self.latest.insert(k, position);
            return position;
        }
        let k: Arc<str> = Arc::from(key);
        self.latest.insert(k.clone(), position);
        self.by_position.insert((position, k));
        position
    }

    /// Forgets a key (an evicted typing or presence room): it no longer counts as
    /// changed.
    pub fn remove(&mut self, key: &str) {
        if let Some((k, p)) = self.latest.remove_entry(key) {
            self.by_position.remove(&(p, k));
        }
    }

    /// Empties the index, which then knows every change after `known_after`.
    pub fn clear(&mut self, known_after: u64) {
        self.latest.clear();
        self.by_position.clear();
        self.known_after = known_after;
    }

    /// Keys whose latest change is after `after`, oldest change first, at most `limit`
    /// of them. `None` when the index cannot tell (`after` is before
    /// `known_after`) or more than `limit` keys changed: the caller then asks key by
    /// key, which costs what it cost before the index.
    pub fn changed_after(&self, after: u64, limit: usize) -> Option<Vec<Arc<str>>> {
        if after < self.known_after {
            return None;
        }
        let mut out = Vec::new();
        for (_, k) in self
            .by_position
            .range((after.saturating_add(1), Arc::<str>::from(""))..)
        {
            if out.len() == limit {
                return None;
            }
            out.push(k.clone());
        }
        Some(out)
    }

    /// Keys kept.
    pub fn len(&self) -> usize {
        self.latest.len()
    }

    /// Whether no key is kept.
    pub fn is_empty(&self) -> bool {
        self.latest.is_empty()
    }
}

/// Keys (room ids) sorted and each once, so "is K one of them" is a binary search:
/// a user's joined rooms as [`crate::membership::Memberships::joined_kept`] keeps them.
/// Derefs to the slice.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SortedKeys(Arc<[String]>);

impl SortedKeys {
    /// Sorts and deduplicates `keys`.
    pub fn new(mut keys: Vec<String>) -> SortedKeys {
        keys.sort_unstable();
        keys.dedup();
        SortedKeys(keys.into())
    }

    /// The keys of a `BTreeMap` (sorted and unique by construction) whose value
    /// passes `keep`.
    pub fn from_map<V>(
        map: &std::collections::BTreeMap<String, V>,
        keep: impl Fn(&V) -> bool,
    ) -> SortedKeys {
        SortedKeys(
            map.iter()
                .filter(|(_, v)| keep(v))
                .map(|(k, _)| k.clone())
                .collect(),
        )
    }

    /// The kept copy of `key`, if it is one of the keys.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|x| x.as_str().cmp(key))
            .ok()
            .map(|i| self.0[i].as_str())
    }
}

impl std::ops::Deref for SortedKeys {
    type Target = [String];
    fn deref(&self) -> &[String] {
        &self.0
    }
}

/// The entries of `keys` that `changed` lists, sorted, each once: `changed` is what a
/// [`ChangeIndex::changed_after`] answered, so the cost follows the changed keys, not
/// `keys`. `None` when `changed` is `None`: the caller then looks at every key.
pub fn changed_among(changed: Option<Vec<Arc<str>>>, keys: &SortedKeys) -> Option<Vec<&str>> {
    let mut out: Vec<&str> = changed?.iter().filter_map(|k| keys.get(k)).collect();
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// [`changed_among`], or every key of `keys` when it cannot tell.
pub fn changed_or_all(changed: Option<Vec<Arc<str>>>, keys: &SortedKeys) -> Vec<&str> {
    changed_among(changed, keys).unwrap_or_else(|| keys.iter().map(String::as_str).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: Option<Vec<Arc<str>>>) -> Option<Vec<String>> {
        v.map(|v| v.iter().map(|k| k.to_string()).collect())
    }

    #[test]
    fn a_key_is_listed_once_at_its_latest_position() {
        let mut i = ChangeIndex::new(0);
        i.bump("!a", 3);
        i.bump("!b", 5);
        i.bump("!a", 7);
        i.bump("!b", 4); // older: ignored
        assert_eq!(i.len(), 2);
        assert_eq!(i.get("!a"), Some(7));
        assert_eq!(i.get("!b"), Some(5));
        assert_eq!(
            keys(i.changed_after(0, 10)),
            Some(vec!["!b".into(), "!a".into()])
        );
        assert_eq!(keys(i.changed_after(5, 10)), Some(vec!["!a".into()]));
        assert_eq!(keys(i.changed_after(7, 10)), Some(vec![]));
        assert_eq!(keys(i.changed_after(u64::MAX, 10)), Some(vec![]));
    }

    #[test]
    fn it_declines_positions_it_cannot_answer_for() {
        let mut i = ChangeIndex::new(10);
        i.bump("!a", 12);
        i.bump("!b", 13);
        assert_eq!(keys(i.changed_after(9, 10)), None, "before known_after");
        assert_eq!(
            keys(i.changed_after(10, 10)),
            Some(vec!["!a".into(), "!b".into()])
        );
        assert_eq!(keys(i.changed_after(10, 1)), None, "over the limit");
        assert_eq!(keys(i.changed_after(12, 1)), Some(vec!["!b".into()]));
        i.remove("!b");
        assert_eq!(i.get("!b"), None);
        assert_eq!(keys(i.changed_after(10, 10)), Some(vec!["!a".into()]));
        i.clear(0);
        assert!(i.is_empty());
        assert_eq!(keys(i.changed_after(0, 10)), Some(vec![]));
    }

    #[test]
    fn changed_among_keeps_the_callers_keys_that_changed() {
        let mut i = ChangeIndex::new(0);
        for (k, p) in [("!c", 4), ("!a", 5), ("!x", 6), ("!b", 2)] {
            i.bump(k, p);
        }
        let mine = SortedKeys::new(["!d", "!c", "!b", "!a", "!c"].map(String::from).to_vec());
        assert_eq!(
            &*mine,
            ["!a", "!b", "!c", "!d"].map(String::from).as_slice()
        );
        assert_eq!(
            changed_among(i.changed_after(3, 10), &mine),
            Some(vec!["!a", "!c"])
        );
        assert_eq!(
            changed_among(i.changed_after(3, 2), &mine),
            None,
            "over the limit"
        );
        assert_eq!(
            changed_or_all(i.changed_after(3, 2), &mine),
            vec!["!a", "!b", "!c", "!d"]
        );
        assert_eq!(
            changed_or_all(i.changed_after(6, 10), &mine),
            Vec::<&str>::new()
        );
    }
}
