//! Deterministic, readable renderings of projection tables for snapshot tests
//! (`tests/snapshots.rs`): the default [`crate::Projection::render`] prints every
//! table, sorted by name, one row per line, so a projection added later is covered
//! without writing anything. A projection whose rows are opaque (trie nodes) overrides
//! `render` with a view that says more.
//!
//! Keys: components separated by 0x00 print as `a | b`; a trailing 0x00 + 8-byte
//! big-endian position prints as `@N`; an 8-byte key prints as `@N`; anything else
//! that is not printable UTF-8 prints as hex. Values: JSON prints as stored (compact);
//! printable text prints quoted; 8 bytes print as a number; empty prints as `-`;
//! anything else prints as hex.

use crate::store::Table;

fn printable(s: &str) -> bool {
    !s.chars().any(|c| c.is_control())
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::from("0x");
    for b in bytes {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

fn text_parts(bytes: &[u8]) -> Option<String> {
    let parts: Option<Vec<&str>> = bytes
        .split(|b| *b == 0)
        .map(|p| std::str::from_utf8(p).ok().filter(|s| printable(s)))
        .collect();
    parts.map(|p| p.join(" | "))
}

/// Renders a key (see the module doc).
pub fn render_key(k: &[u8]) -> String {
    if k.len() == 8 {
        return format!("@{}", u64::from_be_bytes(k.try_into().expect("8 bytes")));
    }
    if k.len() > 9 && k[k.len() - 9] == 0 {
        let (head, pos) = k.split_at(k.len() - 8);
        if let Some(text) = text_parts(&head[..head.len() - 1]) {
            let pos = u64::from_be_bytes(pos.try_into().expect("8 bytes"));
            return format!("{text} | @{pos}");
        }
    }
    text_parts(k).unwrap_or_else(|| hex(k))
}

/// Renders a value (see the module doc).
pub fn render_value(v: &[u8]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    if let Ok(s) = std::str::from_utf8(v) {
        if serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok() {
            return s.to_owned();
        }
        if printable(s) {
            return format!("{s:?}");
        }
    }
    if v.len() == 8 {
        return u64::from_be_bytes(v.try_into().expect("8 bytes")).to_string();
    }
    hex(v)
}

/// Renders every row of `tables`, sorted by table name then key.
pub fn render_tables(mut tables: Vec<Table>) -> String {
    tables.sort_by(|a, b| a.name().cmp(b.name()));
    let mut out = String::new();
    for t in tables {
        render_table_into(&mut out, &t);
    }
    out
}

/// Renders one table: a `## name (N rows)` heading, then `key => value` lines.
pub fn render_table_into(out: &mut String, t: &Table) {
    let rows: Vec<(Vec<u8>, Vec<u8>)> = t.all().collect();
    out.push_str(&format!("## {} ({} rows)\n", t.name(), rows.len()));
    for (k, v) in rows {
        out.push_str(&render_key(&k));
        out.push_str(" => ");
        out.push_str(&render_value(&v));
        out.push('\n');
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_values_render_readably() {
        let mut k = b"!room:x\0@alice:x".to_vec();
        k.push(0);
        k.extend_from_slice(&42u64.to_be_bytes());
        assert_eq!(render_key(&k), "!room:x | @alice:x | @42");
        assert_eq!(render_key(&7u64.to_be_bytes()), "@7");
        assert_eq!(render_key(b"$ev"), "$ev");
        assert_eq!(render_key(&[0xff, 0x01]), "0xff01");
        assert_eq!(render_value(br#"{"a":1}"#), r#"{"a":1}"#);
        assert_eq!(render_value(b"join"), "\"join\"");
        assert_eq!(render_value(&9u64.to_be_bytes()), "9");
        assert_eq!(render_value(b""), "-");
        assert_eq!(render_value(&[1, 2, 3]), "0x010203");
    }
}
