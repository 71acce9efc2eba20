//! The simulator's prefix cache, as vLLM's automatic prefix caching keeps one: the prompt
//! cut into blocks of [`BLOCK_TOKENS`] tokens (4 bytes a token, as the simulator counts
//! them), each block's hash chained to the one before it, so a block stands for the whole
//! prompt up to its end; a prompt's cached tokens are those of its longest run of leading
//! blocks held. Blocks are kept least-recently-used first out, up to the cache's size in
//! tokens. A miss costs prefill time on the simulator's one prefill unit.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};

use serde_json::Value;

/// Tokens a block holds (vLLM's default block size).
pub const BLOCK_TOKENS: u64 = 16;
/// Bytes a block holds: the simulator counts 4 bytes a token.
const BLOCK_BYTES: usize = 4 * BLOCK_TOKENS as usize;

/// Blocks held, least recently used first out.
pub struct PrefixCache {
    capacity: usize,
    /// Block hash → when it was last used, and the reverse, oldest first.
    used: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
    clock: u64,
}

impl PrefixCache {
    /// A cache of `tokens` tokens (whole blocks).
    pub fn new(tokens: u64) -> PrefixCache {
        PrefixCache {
            capacity: usize::try_from(tokens / BLOCK_TOKENS).unwrap_or(usize::MAX),
            used: HashMap::new(),
            by_age: BTreeMap::new(),
            clock: 0,
        }
    }

    /// Looks `prompt` up and keeps its blocks: the tokens of its leading blocks that were
    /// held (a partial last block is never cached, as vLLM's).
    pub fn admit(&mut self, prompt: &[u8]) -> u64 {
        let mut hash = 0x7369_6d5f_6361_6368_u64;
        let mut hits = 0;
        let mut leading = true;
        for block in prompt.chunks_exact(BLOCK_BYTES) {
            let mut h = foldhash::fast::FixedState::with_seed(hash).build_hasher();
            h.write(block);
            hash = h.finish();
            leading &= self.used.contains_key(&hash);
            if leading {
                hits += 1;
            }
            self.touch(hash);
        }
        hits * BLOCK_TOKENS
    }

    fn touch(&mut self, hash: u64) {
        self.clock += 1;
        if let Some(old) = self.used.insert(hash, self.clock) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, hash);
        while self.used.len() > self.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.used.remove(&oldest);
        }
    }
}

/// A request's prompt as text, in the order a model reads it: the system prompt or
/// instructions, then each message's content (text parts of a content list too), then a
/// completion's prompt or the Responses API's input. Keys and other fields are left out,
/// so the same conversation is the same prompt whatever else the request says.
pub fn prompt_text(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    let mut text = |v: &Value| match v {
        Value::String(s) => out.extend_from_slice(s.as_bytes()),
        Value::Array(parts) => {
            for p in parts {
                match p {
                    Value::String(s) => out.extend_from_slice(s.as_bytes()),
                    _ => {
                        if let Some(Value::String(s)) = p.get("text") {
                            out.extend_from_slice(s.as_bytes());
                        }
                    }
                }
            }
        }
        _ => {}
    };
    for key in ["system", "instructions"] {
        if let Some(s) = v.get(key) {
            text(s);
        }
    }
    if let Some(Value::Array(messages)) = v.get("messages") {
        for m in messages {
            if let Some(Value::String(role)) = m.get("role") {
                text(&Value::String(format!("<{role}>")));
            }
            if let Some(c) = m.get("content") {
                text(c);
            }
        }
    }
    for key in ["prompt", "input", "inputs"] {
        if let Some(p) = v.get(key) {
            text(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared prefix is a hit up to its last whole block; what follows a changed block
    /// is a miss even where equal (a block stands for all before it); the oldest blocks
    /// leave first.
    #[test]
    fn leading_blocks_hit_and_the_oldest_leave() {
        let mut c = PrefixCache::new(4 * BLOCK_TOKENS);
        let system = vec![b'a'; 2 * BLOCK_BYTES + 10];
        let mut one = system.clone();
        one.extend_from_slice(&[b'x'; BLOCK_BYTES]);
        assert_eq!(c.admit(&one), 0);
        let mut two = system.clone();
        two.extend_from_slice(&[b'y'; BLOCK_BYTES]);
        // Two whole blocks of the system prompt are shared; the third mixes in the tail.
        assert_eq!(c.admit(&two), 2 * BLOCK_TOKENS);
        assert_eq!(c.admit(&two), 3 * BLOCK_TOKENS);
        // A different first block: nothing after it is a hit.
        let mut other = vec![b'b'; BLOCK_BYTES];
        other.extend_from_slice(&system[BLOCK_BYTES..]);
        assert_eq!(c.admit(&other), 0);
        // Capacity 4 blocks: `one`'s are gone by now.
        assert_eq!(c.admit(&one), 0);
    }

    #[test]
    fn the_prompt_is_the_text_a_model_reads() {
        let v: Value = serde_json::from_str(
            r#"{"model":"m","max_tokens":5,"system":"S","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"text","text":"yo"}]}]}"#,
        )
        .unwrap_or_default();
        assert_eq!(prompt_text(&v), b"S<user>hi<assistant>yo");
        let v: Value = serde_json::from_str(r#"{"prompt":"P","stream":true}"#).unwrap_or_default();
        assert_eq!(prompt_text(&v), b"P");
    }
}
