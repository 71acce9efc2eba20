//! The OpenAI chat/completions dialect.
//!
//! A chunk carries tokens when one of its choices has a non-empty `delta.content`,
//! `delta.reasoning_content` / `delta.reasoning`, `delta.refusal`, tool-call name or
//! arguments (chat), or `text` (completions); each such choice counts one token. A role-only
//! or empty delta carries none. `usage.completion_tokens` is exact and cumulative (vLLM's
//! `continuous_usage_stats` sends it on every chunk), so the last one seen is the total.
//! A top-level `error` object is an in-band error.
//!
//! Chunks are read with typed serde visitors that count instead of collecting, so a chunk
//! is parsed without building a `serde_json::Value` or allocating per choice (a string with
//! escapes still goes through serde_json's scratch buffer).

use std::fmt;

use serde::de::{Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;

use super::{Facts, NonEmpty};
use crate::sse::Event;

/// A scan of the bytes for the common chunk, without a JSON parse.
mod fast {
    use std::sync::LazyLock;

    use memchr::memmem::Finder;

    use super::Facts;

    /// The byte patterns the scan looks for, each searcher built once.
    struct Patterns {
        choices: Finder<'static>,
        usage: Finder<'static>,
        error: Finder<'static>,
        tool_calls: Finder<'static>,
        index: Finder<'static>,
        finish_reason: Finder<'static>,
        token_keys: [Finder<'static>; 5],
    }

    static P: LazyLock<Patterns> = LazyLock::new(|| Patterns {
        choices: Finder::new(b"\"choices\":["),
        usage: Finder::new(b"\"usage\":{"),
        error: Finder::new(b"\"error\""),
        tool_calls: Finder::new(b"\"tool_calls\""),
        index: Finder::new(b"\"index\":"),
        finish_reason: Finder::new(b"\"finish_reason\":"),
        token_keys: [
            Finder::new(b"\"content\":\""),
            Finder::new(b"\"reasoning_content\":\""),
            Finder::new(b"\"reasoning\":\""),
            Finder::new(b"\"refusal\":\""),
            Finder::new(b"\"text\":\""),
        ],
    });

    /// Whether `"key":"` is followed by at least one character of the string.
    fn non_empty_string(data: &[u8], key: &Finder<'_>) -> bool {
        let mut from = 0;
        while let Some(i) = key.find(&data[from..]) {
            let after = from + i + key.needle().len();
            if data.get(after).is_some_and(|&b| b != b'"') {
                return true;
            }
            from = after;
        }
        false
    }

    /// The facts of an ordinary streamed chunk — one choice, a content/reasoning/refusal/
    /// text delta or none, an optional finish reason, no usage, tool calls or error — read
    /// straight from the bytes. Anything else (or anything doubtful) is `None`, and the
    /// caller parses the chunk as JSON.
    ///
    /// Sound because an unescaped `"` cannot occur inside a JSON string: a byte pattern
    /// such as `"content":"` can only be a key followed by a string value.
    pub fn event(data: &[u8]) -> Option<Facts> {
        let p = &*P;
        let data = data.trim_ascii();
        if data.first() != Some(&b'{') || data.last() != Some(&b'}') {
            return None;
        }
        // The patterns are compact JSON: a chunk with whitespace around any colon (found
        // by the `dialects` fuzz target: `"choices":[` compact, `"content": "x"` not) goes
        // to the parser, which reads any spacing.
        let spaced = memchr::memchr_iter(b':', data).any(|i| {
            data.get(i + 1).is_some_and(u8::is_ascii_whitespace)
                || i.checked_sub(1)
                    .and_then(|j| data.get(j))
                    .is_some_and(u8::is_ascii_whitespace)
        });
        if spaced {
            return None;
        }
        // Shapes the scan does not handle go to the parser.
        let one_choice = p.index.find_iter(data).take(2).count() == 1;
        if !one_choice
            || p.choices.find(data).is_none()
            || p.usage.find(data).is_some()
            || p.error.find(data).is_some()
            || p.tool_calls.find(data).is_some()
        {
            return None;
        }
        let tokens = p.token_keys.iter().any(|k| non_empty_string(data, k));
        let finished = match p.finish_reason.find(data) {
            Some(i) => {
                let v = data[i + p.finish_reason.needle().len()..].trim_ascii_start();
                if v.starts_with(b"null") {
                    false
                } else if v.starts_with(b"\"") {
                    true
                } else {
                    return None;
                }
            }
            None => false,
        };
        Some(Facts {
            tokens: u32::from(tokens),
            finished,
            ..Facts::default()
        })
    }
}

/// Facts of one SSE event.
pub fn event(event: &Event<'_>) -> Facts {
    let data = event.data;
    if data == b"[DONE]" {
        return Facts {
            finished: true,
            ..Facts::default()
        };
    }
    if let Some(facts) = fast::event(data) {
        return facts;
    }
    match serde_json::from_slice::<Chunk>(data) {
        Ok(chunk) => chunk.facts(),
        Err(_) => Facts {
            unparsed: 1,
            ..Facts::default()
        },
    }
}

/// Facts of a whole non-streaming JSON response.
pub fn body(body: &[u8]) -> Facts {
    event(&Event {
        name: b"",
        data: body,
    })
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Chunk {
    choices: Choices,
    usage: Option<Usage>,
    error: Option<IgnoredAny>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Usage {
    completion_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
}

impl Chunk {
    fn facts(&self) -> Facts {
        Facts {
            tokens: self.choices.tokens,
            exact_total: self.usage.as_ref().and_then(|u| u.completion_tokens),
            finished: self.choices.finished,
            usage_only: self.choices.count == 0
                && self
                    .usage
                    .as_ref()
                    .is_some_and(|u| u.completion_tokens.is_some()),
            error: self.error.is_some(),
            unparsed: 0,
            input_tokens: self.usage.as_ref().and_then(|u| u.prompt_tokens),
        }
    }
}

/// The sum over a `choices` array, read element by element without collecting.
#[derive(Default)]
struct Choices {
    tokens: u32,
    finished: bool,
    count: u32,
}

impl<'de> Deserialize<'de> for Choices {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Choices;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of choices")
            }
            fn visit_unit<E>(self) -> Result<Choices, E> {
                Ok(Choices::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Choices, A::Error> {
                let mut sum = Choices::default();
                while let Some(choice) = seq.next_element::<Choice>()? {
                    sum.count += 1;
                    sum.tokens += u32::from(choice.carries_tokens());
                    sum.finished |= choice.finish_reason.is_some();
                }
                Ok(sum)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Choice {
    delta: Option<Delta>,
    /// The message of a non-streaming chat response; its content is not counted (usage is).
    text: NonEmpty,
    finish_reason: Option<IgnoredAny>,
}

impl Choice {
    fn carries_tokens(&self) -> bool {
        self.text.0 || self.delta.as_ref().is_some_and(Delta::carries_tokens)
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Delta {
    content: NonEmpty,
    reasoning_content: NonEmpty,
    reasoning: NonEmpty,
    refusal: NonEmpty,
    tool_calls: ToolCalls,
}

impl Delta {
    fn carries_tokens(&self) -> bool {
        self.content.0
            || self.reasoning_content.0
            || self.reasoning.0
            || self.refusal.0
            || self.tool_calls.0
    }
}

/// Whether any tool-call delta carries a name or argument text.
#[derive(Default)]
struct ToolCalls(bool);

impl<'de> Deserialize<'de> for ToolCalls {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Call {
            function: Option<Function>,
        }
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Function {
            name: NonEmpty,
            arguments: NonEmpty,
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ToolCalls;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of tool calls")
            }
            fn visit_unit<E>(self) -> Result<ToolCalls, E> {
                Ok(ToolCalls(false))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ToolCalls, A::Error> {
                let mut any = false;
                while let Some(call) = seq.next_element::<Call>()? {
                    any |= call.function.is_some_and(|f| f.name.0 || f.arguments.0);
                }
                Ok(ToolCalls(any))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(data: &str) -> Facts {
        event(&Event {
            name: b"",
            data: data.as_bytes(),
        })
    }

    #[test]
    fn role_only_and_empty_deltas_carry_no_token() {
        let f = facts(
            r#"{"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
        );
        assert_eq!(f, Facts::default());
        let f = facts(r#"{"choices":[{"index":0,"delta":{},"finish_reason":null}]}"#);
        assert_eq!(f.tokens, 0);
    }

    #[test]
    fn token_bearing_fields() {
        for delta in [
            r#"{"content":"Hi"}"#,
            r#"{"content":"\n"}"#,
            r#"{"reasoning_content":"think"}"#,
            r#"{"reasoning":"think"}"#,
            r#"{"refusal":"no"}"#,
            r#"{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\""}}]}"#,
            r#"{"tool_calls":[{"index":0,"id":"c1","type":"function","function":{"name":"f","arguments":""}}]}"#,
        ] {
            let f = facts(&format!(r#"{{"choices":[{{"index":0,"delta":{delta}}}]}}"#));
            assert_eq!(f.tokens, 1, "{delta}");
        }
        let f = facts(r#"{"choices":[{"index":0,"text":"Hello","finish_reason":null}]}"#);
        assert_eq!(f.tokens, 1);
        let f = facts(
            r#"{"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}"#,
        );
        assert_eq!(f.tokens, 2, "one token per choice (n > 1)");
    }

    #[test]
    fn usage_finish_error_done() {
        let f = facts(
            r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":128,"total_tokens":137}}"#,
        );
        assert_eq!(f.exact_total, Some(128));
        assert_eq!(f.tokens, 0);
        let f = facts(
            r#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}],"usage":null}"#,
        );
        assert!(f.finished);
        assert_eq!(f.exact_total, None);
        let f = facts(r#"{"error":{"message":"overloaded","type":"server_error"}}"#);
        assert!(f.error);
        assert!(facts("[DONE]").finished);
        assert_eq!(facts(r#"{"choices":[{"delta":{"content":"x"#).unparsed, 1);
        assert_eq!(facts("not json").unparsed, 1);
    }

    /// The scan agrees with the parser wherever it answers.
    #[test]
    fn fast_path_agrees_with_the_parser() {
        let chunks = [
            r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a \"quoted\" word"},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"reasoning_content":"hmm"},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"text":"w","finish_reason":"length"}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"\"content\":\"x"},"finish_reason":null}]}"#,
            r#"  {"choices":[{"index" : 0,"delta":{"content":""},"finish_reason" : null}]}  "#,
            r#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"usage":{"completion_tokens":3}}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}"#,
            r#"{"error":{"message":"boom"}}"#,
            // Found by fuzzing: compact `"choices":[`, spaced keys inside.
            r#"{"id":"x","choices":[ {"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}], "usage": null}"#,
            r#"{"choices":[{"index":0,"delta":{"content" :"Hel"},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}"#,
        ];
        let mut answered = 0;
        for c in chunks {
            let parsed = serde_json::from_slice::<Chunk>(c.as_bytes())
                .map(|c| c.facts())
                .expect("valid JSON");
            if let Some(f) = fast::event(c.as_bytes()) {
                answered += 1;
                assert_eq!(f, parsed, "{c}");
            }
            assert_eq!(facts(c), parsed, "{c}");
        }
        assert!(
            answered >= 5,
            "the fast path takes the common chunks ({answered})"
        );
    }

    #[test]
    fn non_streaming_body() {
        let f = body(br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#);
        assert_eq!(f.exact_total, Some(2));
        assert!(f.finished);
        assert_eq!(f.tokens, 0);
    }
}

/// Fuzzing's check of the fast path: where it answers and the chunk is JSON of the shape
/// the parser reads, both say the same.
#[cfg(feature = "fuzzing")]
pub fn fast_path_agrees(data: &[u8]) {
    if let (Some(fast), Ok(chunk)) = (fast::event(data), serde_json::from_slice::<Chunk>(data)) {
        assert_eq!(fast, chunk.facts(), "fast path and parser disagree");
    }
}
