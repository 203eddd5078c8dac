//! placeholder until the state trie lands
