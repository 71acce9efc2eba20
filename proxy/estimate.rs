//! Token estimates where the stream gives no exact count.
//!
//! By default a token-bearing event counts one token (right for most servers, which send one
//! token per event; wrong with speculative decoding or coalesced writes). With
//! `estimate = "tokenizer"` on an upstream, the generated text of each token-bearing event
//! is counted with OpenAI's o200k BPE (the `bpe-openai` crate, vocabulary built in; chosen
//! over tiktoken-rs after measuring both, see `benches/tokenizer.rs`). For other models'
//! vocabularies that is still an estimate, and labelled as one; an exact count that arrives
//! later replaces it either way.

use serde_json::Value;

use crate::dialect::Dialect;

/// How tokens without an exact count are estimated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Estimate {
    /// One token per token-bearing event.
    #[default]
    Events,
    /// The event's generated text through the o200k tokenizer.
    Tokenizer,
}

/// The o200k token count of the generated text in one event's data, or `None` when the
/// dialect's events say their own count (llama.cpp's token ids, TGI's one per event) or the
/// data is not JSON.
pub fn tokenizer_count(dialect: Dialect, data: &[u8]) -> Option<u32> {
    let v: Value = serde_json::from_slice(data).ok()?;
    let mut n = 0usize;
    let mut add = |s: Option<&Value>| {
        if let Some(t) = s.and_then(Value::as_str) {
            n += count(t);
        }
    };
    match dialect {
        Dialect::OpenAi => {
            for c in v
                .get("choices")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                for f in ["content", "reasoning_content", "reasoning", "refusal"] {
                    add(c.get("delta").and_then(|d| d.get(f)));
                }
                add(c.get("text"));
                for call in c
                    .pointer("/delta/tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    add(call.pointer("/function/name"));
                    add(call.pointer("/function/arguments"));
                }
            }
        }
        Dialect::Responses => add(v.get("delta")),
        Dialect::Anthropic => {
            for f in ["text", "thinking", "partial_json"] {
                add(v.get("delta").and_then(|d| d.get(f)));
            }
        }
        Dialect::Ollama => {
            for p in [
                "/message/content",
                "/message/thinking",
                "/response",
                "/thinking",
            ] {
                add(v.pointer(p));
            }
        }
        Dialect::Tgi | Dialect::LlamaCpp => return None,
    }
    u32::try_from(n).ok()
}

/// o200k tokens in `text`.
pub fn count(text: &str) -> usize {
    bpe_openai::o200k_base().count(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_generated_text() {
        let chunk =
            br#"{"choices":[{"index":0,"delta":{"content":"Hello, world! How are you today?"}}]}"#;
        let n = tokenizer_count(Dialect::OpenAi, chunk).expect("json");
        assert!((7..=10).contains(&n), "{n}");
        let a = br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" lighthouse"}}"#;
        assert!(tokenizer_count(Dialect::Anthropic, a).expect("json") >= 1);
        assert_eq!(
            tokenizer_count(Dialect::LlamaCpp, br#"{"content":"x","tokens":[1,2]}"#),
            None
        );
    }
}
