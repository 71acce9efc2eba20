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
    mod body;
    mod bytes;
    mod shape;

    /// The facts of a whole non-streamed reply: read from a shape of the replies this
    /// thread has seen, else walked (and then a shape); `None` for the parser.
    pub fn body(data: &[u8]) -> Option<Facts> {
        // Not a form feed, which `trim_ascii` takes and JSON does not.
        let json_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        let start = data
            .iter()
            .position(|b| !json_space(b))
            .unwrap_or(data.len());
        let end = data
            .iter()
            .rposition(|b| !json_space(b))
            .map_or(start, |i| i + 1);
        shape::body_facts(&data[start..end], body::body)
    }

    /// [`body`] by the walk alone.
    #[cfg(feature = "fuzzing")]
    pub fn walk(data: &[u8]) -> Option<Facts> {
        body::body(data)
    }

    use std::ops::Not;
    use std::sync::LazyLock;

    use aho_corasick::{packed, AhoCorasick, MatchKind};

    use super::Facts;

    /// The keys the scan reads, in the order of [`KEYS`].
    #[derive(Clone, Copy, PartialEq)]
    enum Key {
        Choices,
        Usage,
        Error,
        ToolCalls,
        Message,
        Index,
        FinishReason,
        Delta,
        /// A string of the delta that carries a token when it is not empty.
        DeltaText,
        /// The choice's text (completions), a token when it is not empty.
        ChoiceText,
    }

    const KEYS: [(&str, Key); 13] = [
        ("\"choices\"", Key::Choices),
        ("\"usage\"", Key::Usage),
        ("\"error\"", Key::Error),
        ("\"tool_calls\"", Key::ToolCalls),
        ("\"message\"", Key::Message),
        ("\"index\"", Key::Index),
        ("\"finish_reason\"", Key::FinishReason),
        ("\"delta\"", Key::Delta),
        ("\"content\"", Key::DeltaText),
        ("\"reasoning_content\"", Key::DeltaText),
        ("\"reasoning\"", Key::DeltaText),
        ("\"refusal\"", Key::DeltaText),
        ("\"text\"", Key::ChoiceText),
    ];

    /// Every key in one pass: a vectorised multi-pattern search (Teddy) where the CPU has
    /// one, else an automaton. No key is a prefix of another, and none can start inside
    /// another's match.
    enum Search {
        Packed(packed::Searcher),
        Automaton(AhoCorasick),
    }

    /// `None` only should the automaton refuse the keys (it does not): every chunk is parsed.
    static SEARCH: LazyLock<Option<Search>> = LazyLock::new(|| {
        let mut packed = packed::Config::new()
            .match_kind(packed::MatchKind::LeftmostFirst)
            .builder();
        packed.extend(KEYS.map(|(k, _)| k));
        match packed.build() {
            Some(s) => Some(Search::Packed(s)),
            None => automaton().map(Search::Automaton),
        }
    });

    fn automaton() -> Option<AhoCorasick> {
        AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostFirst)
            .build(KEYS.map(|(k, _)| k))
            .ok()
    }

    /// The automaton's answer (where the CPU has Teddy, the one `event` does not use).
    #[cfg(test)]
    pub fn event_by_automaton(data: &[u8]) -> Option<Facts> {
        scan_by(object(data)?, &Search::Automaton(automaton()?))
    }

    /// The scan's answer, without the shapes.
    #[cfg(test)]
    pub fn event_scanned(data: &[u8]) -> Option<Facts> {
        scan_by(object(data)?, SEARCH.as_ref()?)
    }

    /// The facts of an ordinary streamed chunk, or `None` (see [`scan`]): from a shape
    /// this thread has seen (see [`shape`]), else scanned.
    pub fn event(data: &[u8]) -> Option<Facts> {
        let search = SEARCH.as_ref()?;
        shape::facts(object(data)?, |data| scan_by(data, search))
    }

    /// `data` without the spaces around it, if it is an object.
    fn object(data: &[u8]) -> Option<&[u8]> {
        let data = data.trim_ascii();
        (data.first() == Some(&b'{') && data.last() == Some(&b'}')).then_some(data)
    }

    fn scan_by(data: &[u8], search: &Search) -> Option<Facts> {
        // The parser reads a choice from an array too (serde reads a struct from one, field
        // by field); the scan reads objects only, so an array in an array goes to the parser.
        if memchr::memmem::find(data, b",[").is_some()
            || memchr::memmem::find(data, b"[[").is_some()
        {
            return None;
        }
        match search {
            Search::Packed(s) => scan(data, s.find_iter(data)),
            Search::Automaton(a) => scan(data, a.find_iter(data)),
        }
    }

    /// The facts of an ordinary streamed chunk — one choice, a content/reasoning/refusal
    /// delta or a completion's text, an optional finish reason, no usage, tool calls,
    /// message or error — read from where its keys are. Anything else (or anything
    /// doubtful) is `None`, and the caller parses the chunk as JSON.
    ///
    /// Sound because an unescaped `"` cannot occur inside a JSON string: `"content"`
    /// followed by `:` can only be a key, and followed by anything else only a value. Where
    /// a key is, is checked: `choices` with no bracket before it (the top level), each of the
    /// choice's own members with no bracket since the member before it (or the choice's `{`,
    /// or the end of its delta), and the delta walked to its end (flat: strings and scalars). A key read with
    /// whitespace after it or after its colon goes to the parser.
    fn scan(data: &[u8], keys: impl Iterator<Item = aho_corasick::Match>) -> Option<Facts> {
        // How far the choice's own members are read (none before `choices`), and the
        // delta's span.
        let mut level: Option<usize> = None;
        let mut delta: Option<(usize, usize)> = None;
        let (mut indexes, mut finish, mut tokens) = (0, None, false);
        for m in keys {
            let key = KEYS[m.pattern().as_usize()].1;
            if matches!(key, Key::Error | Key::ToolCalls | Key::Message) {
                return None;
            }
            // A key whose quote is escaped is inside a string (`"x\"content":`): the
            // parser reads another key than the one matched.
            if m.start() > 0 && data[m.start() - 1] == b'\\' {
                return None;
            }
            let value = m.end() + 1;
            match data.get(m.end()) {
                Some(b':') => {}
                Some(b) if b.is_ascii_whitespace() => return None,
                // A string value that reads like a key.
                _ => continue,
            }
            let first = *data.get(value)?;
            if first.is_ascii_whitespace() {
                return None;
            }
            let in_delta = delta.is_some_and(|(from, to)| (from..to).contains(&m.start()));
            // One of the choice's own members: nothing opened or closed since the last.
            let of_choice =
                || level.is_some_and(|at| at <= m.start() && flat(&data[at..m.start()]));
            match key {
                Key::Choices if level.is_none() && flat(&data[1..m.start()]) => {
                    if data.get(value..value + 2) != Some(b"[{") {
                        return None;
                    }
                    level = Some(value + 2);
                }
                // The parser reads a usage object, and an array too (field by field).
                Key::Usage if !data[value..].starts_with(b"null") => return None,
                Key::Usage => {}
                Key::DeltaText if in_delta => tokens |= non_empty_string(&data[value..]),
                Key::ChoiceText | Key::FinishReason if in_delta => {}
                Key::Index if of_choice() => {
                    indexes += 1;
                    level = Some(value);
                }
                Key::Delta if delta.is_none() && first == b'{' && of_choice() => {
                    let end = flat_object_end(data, value)?;
                    delta = Some((value, end));
                    level = Some(end);
                }
                Key::ChoiceText if of_choice() => {
                    tokens |= non_empty_string(&data[value..]);
                    level = Some(value);
                }
                Key::FinishReason if finish.is_none() && of_choice() => {
                    finish = Some(match first {
                        b'n' if data[value..].starts_with(b"null") => false,
                        b'"' => true,
                        _ => return None,
                    });
                    level = Some(value);
                }
                // Not the delta's, nor the choice's: the parser does not count it either.
                Key::DeltaText if !of_choice() => {}
                _ => return None,
            }
        }
        if level.is_none() || indexes != 1 {
            return None;
        }
        Some(Facts {
            tokens: u32::from(tokens),
            finished: finish == Some(true),
            ..Facts::default()
        })
    }

    /// Whether `span` opens or closes nothing (a reduction the compiler vectorises).
    fn flat(span: &[u8]) -> bool {
        span.iter()
            .fold(false, |any, &b| {
                any | matches!(b, b'{' | b'}' | b'[' | b']')
            })
            .not()
    }

    /// Whether `value` is a string with at least one character.
    fn non_empty_string(value: &[u8]) -> bool {
        value.first() == Some(&b'"') && value.get(1).is_some_and(|&b| b != b'"')
    }

    /// The end of the string starting at `at` (just past its closing quote).
    fn string_end(data: &[u8], at: usize) -> Option<usize> {
        let mut i = at + 1;
        loop {
            let stop = stop_in_string(data, i)?;
            if data[stop] == b'"' {
                return Some(stop + 1);
            }
            i = stop + 2;
        }
    }

    /// The first `"` or `\\` from `from`: eight bytes at a time over the first 64 (a word's
    /// bytes tested for both at once), the rest by `memchr`, whose setup costs more than a
    /// key's or a short value's bytes.
    fn stop_in_string(data: &[u8], from: usize) -> Option<usize> {
        const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
        const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
        // The high bit of each byte of `word` equal to `byte`; below the first such byte (the
        // lowest), none is set (a borrow only carries upward).
        let equal = |word: u64, byte: u8| {
            let x = word ^ (ONES * u64::from(byte));
            x.wrapping_sub(ONES) & !x & HIGHS
        };
        let mut i = from;
        let short = data.len().min(from + 64);
        while i + 8 <= short {
            let mut word = [0u8; 8];
            word.copy_from_slice(&data[i..i + 8]);
            let found = {
                let word = u64::from_le_bytes(word);
                equal(word, b'"') | equal(word, b'\\')
            };
            if found != 0 {
                return Some(i + (found.trailing_zeros() / 8) as usize);
            }
            i += 8;
        }
        Some(i + memchr::memchr2(b'"', b'\\', data.get(i..)?)?)
    }

    /// The end of the object starting at `at` (just past its `}`) when its members are
    /// compact strings and scalars only; `None` for anything nested or spaced.
    fn flat_object_end(data: &[u8], at: usize) -> Option<usize> {
        let mut i = at + 1;
        if data.get(i) == Some(&b'}') {
            return Some(i + 1);
        }
        loop {
            if data.get(i) != Some(&b'"') {
                return None;
            }
            i = string_end(data, i)?;
            if data.get(i) != Some(&b':') {
                return None;
            }
            i += 1;
            if data.get(i) == Some(&b'"') {
                i = string_end(data, i)?;
            } else {
                let scalar = data
                    .get(i..)?
                    .iter()
                    .take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+'))
                    .count();
                if scalar == 0 {
                    return None;
                }
                i += scalar;
            }
            match data.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => return Some(i + 1),
                _ => return None,
            }
        }
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

/// Facts of a whole non-streaming JSON response: walked for its members where it is the
/// common reply, else parsed.
pub fn body(body: &[u8]) -> Facts {
    if let Some(facts) = fast::body(body) {
        return facts;
    }
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
    #[serde(deserialize_with = "super::count")]
    completion_tokens: Option<u64>,
    #[serde(deserialize_with = "super::count")]
    prompt_tokens: Option<u64>,
    prompt_tokens_details: Option<PromptDetails>,
}

/// `usage.prompt_tokens_details` (OpenAI, vLLM, SGLang): the prompt's cached tokens.
#[derive(Deserialize, Default)]
#[serde(default)]
struct PromptDetails {
    #[serde(deserialize_with = "super::count")]
    cached_tokens: Option<u64>,
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
            cached_input_tokens: (self.usage.as_ref())
                .and_then(|u| u.prompt_tokens_details.as_ref())
                .and_then(|d| d.cached_tokens),
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
            // Text with colons and spaces stays on the fast path; values that read like keys.
            r#"{"choices":[{"index":0,"delta":{"content":"Note: a \"text\": b"},"finish_reason":null}]}"#,
            r#"{"object":"text","choices":[{"index":0,"delta":{"content":"content"},"finish_reason":"content"}]}"#,
            r#"{"choices":[{"index":0,"message":{"content":"not a delta"},"finish_reason":"stop"}]}"#,
        ];
        let mut answered = 0;
        for c in chunks {
            assert_eq!(
                fast::event(c.as_bytes()),
                fast::event_by_automaton(c.as_bytes())
            );
            let parsed = serde_json::from_slice::<Chunk>(c.as_bytes())
                .map(|c| c.facts())
                .expect("valid JSON");
            if let Some(f) = fast::event(c.as_bytes()) {
                answered += 1;
                assert_eq!(f, parsed, "{c}");
            }
            assert_eq!(facts(c), parsed, "{c}");
        }
        // Shapes the parser refuses, the scan leaves to it.
        for c in [
            r#"{"choices":{"index":0,"delta":{"content":"x"}}}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null,"finish_reason":"stop"}]}"#,
        ] {
            assert_eq!(fast::event(c.as_bytes()), None, "{c}");
        }
        assert!(
            answered >= 8,
            "the fast path takes the common chunks ({answered})"
        );
    }

    /// Chunks the scan once read wrong, each as the parser reads it: a choice given as an
    /// array (serde reads a struct from one), a usage array, keys behind an escaped quote.
    #[test]
    fn chunks_the_parser_reads_otherwise_go_to_it() {
        for c in [
            r#"{"choices":[{"index":0,"delta":{"content":"a"}},[null,null,"stop"]]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"}},[null,"hi"]]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"}}],"usage":[5,7]}"#,
            r#"{"choices":[{"index":0,"delta":{"x\"content":"a"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"a"},"x\"finish_reason":"stop"}]}"#,
        ] {
            let parsed = serde_json::from_slice::<Chunk>(c.as_bytes())
                .unwrap()
                .facts();
            assert_eq!(fast::event_scanned(c.as_bytes()), None, "{c}");
            assert_eq!(facts(c), parsed, "{c}");
        }
    }

    /// JSON's punctuation, `null` and a number: pieces every mutation test inserts.
    pub(super) const PUNCTUATION: [&[u8]; 11] = [
        b"\"", b":", b" ", b",", b"{", b"}", b"[", b"]", b"\\", b"null", b"0",
    ];

    /// One of `seeds` with one to three edits: one of `pieces` inserted (seven in ten) or
    /// a few bytes cut, each at a random place.
    pub(super) fn mutated(
        rng: &mut rand::rngs::StdRng,
        seeds: &[&str],
        pieces: &[&[u8]],
    ) -> Vec<u8> {
        use rand::Rng;
        let mut c = seeds[rng.gen_range(0..seeds.len())].as_bytes().to_vec();
        for _ in 0..rng.gen_range(1..4) {
            let at = rng.gen_range(0..=c.len());
            if rng.gen_bool(0.7) {
                let p = pieces[rng.gen_range(0..pieces.len())];
                c.splice(at..at, p.iter().copied());
            } else {
                let to = (at + rng.gen_range(1..4)).min(c.len());
                c.drain(at..to);
            }
        }
        c
    }

    /// Mutated chunks (keys, quotes, escapes, spacing and brackets inserted, bytes cut):
    /// wherever the scan answers and the parser reads the chunk, they agree.
    #[test]
    fn fast_path_agrees_with_the_parser_on_mutated_chunks() {
        use rand::{rngs::StdRng, SeedableRng};
        let seeds = [
            r#"{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":"stop"}],"usage":null}"#,
            r#"{"choices":[{"index":0,"text":"w","finish_reason":null}]}"#,
        ];
        let before: [&[u8]; 4] = [b",[null,\"x\"]", b"\"usage\":[1,2]", b"\"x\\\"", b"[["];
        let after: [&[u8]; 11] = [
            b"\"content\"",
            b"\"content\":\"x\"",
            b"\"index\":1",
            b"\"usage\":{}",
            b"\"text\"",
            b"\"refusal\":\"\"",
            b"\"finish_reason\":\"stop\"",
            b"\"choices\":[]",
            b"\"reasoning\":\"r\"",
            b"\"message\":{}",
            b"\n",
        ];
        let pieces = [&before[..], &PUNCTUATION, &after].concat();
        let mut rng = StdRng::seed_from_u64(18);
        let (mut compared, mut answered) = (0, 0);
        for _ in 0..30_000 {
            let c = mutated(&mut rng, &seeds, &pieces);
            let fast = fast::event(&c);
            let scanned = fast::event_scanned(&c);
            assert_eq!(scanned, fast::event_by_automaton(&c));
            // A shape answers what the scan answers (and may answer where it does not).
            if scanned.is_some() {
                assert_eq!(fast, scanned, "{}", String::from_utf8_lossy(&c));
            }
            answered += usize::from(fast.is_some());
            if let (Some(f), Ok(chunk)) = (fast, serde_json::from_slice::<Chunk>(&c)) {
                compared += 1;
                assert_eq!(f, chunk.facts(), "{}", String::from_utf8_lossy(&c));
            }
        }
        assert!(
            compared > 2_000 && answered > compared,
            "{compared} {answered}"
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

/// Fuzzing's check of the fast paths (a streamed chunk's scan, a whole reply's walk):
/// where one answers and the bytes are JSON of the shape the parser reads, both say the
/// same.
#[cfg(feature = "fuzzing")]
pub fn fast_path_agrees(data: &[u8]) {
    let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
        return;
    };
    if let Some(fast) = fast::event(data) {
        assert_eq!(fast, chunk.facts(), "fast path and parser disagree");
    }
    if let Some(walked) = fast::body(data) {
        assert_eq!(walked, chunk.facts(), "body walk and parser disagree");
    }
}

/// For the fuzzer: a reply read through the replies' shapes this thread has learned (from
/// the inputs before it) says what the walk says of it, JSON or not.
#[cfg(feature = "fuzzing")]
pub fn body_shapes_agree(data: &[u8]) {
    assert_eq!(
        fast::body(data),
        fast::walk(data),
        "a reply's shape and the walk disagree"
    );
}
