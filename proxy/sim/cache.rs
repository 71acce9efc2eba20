//! The simulator's prefix cache, as vLLM's automatic prefix caching keeps one: the prompt
//! cut into blocks of [`BLOCK_TOKENS`] tokens (4 bytes a token, as the simulator counts
//! them), each block's hash chained to the one before it, so a block stands for the whole
//! prompt up to its end; a prompt's cached tokens are those of its longest run of leading
//! blocks held. Blocks are kept least-recently-used first out, up to the cache's size in
//! tokens. A miss costs prefill time on the simulator's one prefill unit.

use serde_json::Value;

use crate::prefix::{blocks, BlockLru};

/// Tokens a block holds (vLLM's default block size).
pub const BLOCK_TOKENS: u64 = 16;
/// Bytes a block holds: the simulator counts 4 bytes a token.
const BLOCK_BYTES: usize = 4 * BLOCK_TOKENS as usize;

/// Blocks held, least recently used first out.
pub struct PrefixCache(BlockLru);

impl PrefixCache {
    /// A cache of `tokens` tokens (whole blocks).
    pub fn new(tokens: u64) -> PrefixCache {
        PrefixCache(BlockLru::new(
            usize::try_from(tokens / BLOCK_TOKENS).unwrap_or(usize::MAX),
        ))
    }

    /// Looks `prompt` up and keeps its blocks: the tokens of its leading blocks that were
    /// held (a partial last block is never cached, as vLLM's).
    pub fn admit(&mut self, prompt: &[u8]) -> u64 {
        let hits = self.0.admit(blocks(prompt, BLOCK_BYTES, usize::MAX));
        hits as u64 * BLOCK_TOKENS
    }
}

/// A request's prompt as text, in the order a model reads it: the system prompt or
/// instructions, then each message's content (text parts of a content list too), then a
/// completion's prompt or the Responses API's input. Keys and other fields are left out,
/// so the same conversation is the same prompt whatever else the request says.
pub fn prompt_text(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    for key in ["system", "instructions"] {
        if let Some(s) = v.get(key) {
            text(s, &mut out);
        }
    }
    if let Some(Value::Array(messages)) = v.get("messages") {
        for m in messages {
            if let Some(Value::String(role)) = m.get("role") {
                out.extend_from_slice(format!("<{role}>").as_bytes());
            }
            if let Some(c) = m.get("content") {
                text(c, &mut out);
            }
        }
    }
    for key in ["prompt", "input", "inputs"] {
        if let Some(p) = v.get(key) {
            text(p, &mut out);
        }
    }
    out
}

/// Appends the text of `v`: a string, or the strings and `text` parts of a list.
fn text(v: &Value, out: &mut Vec<u8>) {
    let parts = match v {
        Value::Array(parts) => parts.as_slice(),
        Value::String(_) => std::slice::from_ref(v),
        _ => return,
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A shared prefix is a hit up to its last whole block; what follows a changed block
    /// is a miss even where equal (a block stands for all before it); the oldest blocks
    /// leave first, a chain's tail before its head.
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
        // Capacity 4 blocks: tails went first, so `one` keeps the shared head, not its own
        // last block.
        assert_eq!(c.admit(&one), 2 * BLOCK_TOKENS);
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
