//! A whole non-streamed reply (`chat.completion`, `text_completion`) read by one walk over
//! its bytes: the top-level object's members, each choice's, the usage's; every other
//! value skipped (a string eight bytes at a time, then by `memchr`; an object or array by
//! its brackets). No value is built and no key is copied.
//!
//! It answers the common reply only, and leaves to the parser (`None`) anything it does not
//! read as the parser would: a key with an escape, a member the parser reads given twice
//! (serde refuses a duplicate field), a streamed `delta`, a count that is not plain digits,
//! a text or finish reason of another type than it reads, trailing bytes. Where it answers
//! on JSON the parser reads, both say the same (a test and the fuzz target check it); it
//! does not check the JSON it skips, as the streamed scan does not.

use super::{string_end, Facts};
use crate::dialect::MAX_COUNT;

/// The facts of a non-streamed reply, or `None` for the parser to read it.
pub fn body(data: &[u8]) -> Option<Facts> {
    let mut w = Walk { data, at: 0 };
    let (mut choices, mut usage, mut error) = (None, None, None);
    w.members(|w, key| {
        match key {
            b"choices" => set(&mut choices, w.choices()?),
            b"usage" => set(&mut usage, w.usage()?),
            // The parser reads `error` as an `Option`: null is none.
            b"error" => set(&mut error, w.present()?),
            _ => w.skip(),
        }
    })?;
    w.ws();
    if w.at != data.len() {
        return None;
    }
    let choices = choices.unwrap_or_default();
    let usage = usage.flatten().unwrap_or_default();
    Some(Facts {
        tokens: choices.tokens,
        exact_total: usage.completion,
        finished: choices.finished,
        usage_only: choices.count == 0 && usage.completion.is_some(),
        error: error.unwrap_or(false),
        unparsed: 0,
        input_tokens: usage.prompt,
        cached_input_tokens: usage.cached,
    })
}

/// A token count at the start of `data` as the parser reads one: plain digits (no leading
/// zero but `0`, at most ten, as `MAX_COUNT` has; no fraction or exponent after) up to
/// `MAX_COUNT`; its value and length. A reply's shape reads its counts by it too.
pub(super) fn count_at(data: &[u8]) -> Option<(u64, usize)> {
    let digits = data.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 10 || (digits > 1 && data[0] == b'0') {
        return None;
    }
    if matches!(data.get(digits), Some(b'.' | b'e' | b'E' | b'-' | b'+')) {
        return None;
    }
    let n = data[..digits]
        .iter()
        .fold(0u64, |n, &d| n * 10 + u64::from(d - b'0'));
    (n <= MAX_COUNT).then_some((n, digits))
}

/// Sets a member read once; `None` (to the parser) when it is read twice.
fn set<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    slot.replace(value).is_none().then_some(())
}

#[derive(Default)]
struct Choices {
    tokens: u32,
    finished: bool,
    count: u32,
}

#[derive(Default)]
struct Usage {
    completion: Option<u64>,
    prompt: Option<u64>,
    cached: Option<u64>,
}

struct Walk<'a> {
    data: &'a [u8],
    at: usize,
}

impl Walk<'_> {
    fn peek(&self) -> Option<u8> {
        self.data.get(self.at).copied()
    }

    /// Past JSON's whitespace (not a form feed, which `is_ascii_whitespace` takes and the
    /// parser refuses).
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// Past `byte` (and the spaces before it), or `None`.
    fn expect(&mut self, byte: u8) -> Option<()> {
        self.ws();
        (self.peek() == Some(byte)).then(|| self.at += 1)
    }

    /// Whether the next value is `null` (then read), else left to read.
    fn null(&mut self) -> Option<bool> {
        self.ws();
        let null = self.data.get(self.at..)?.starts_with(b"null");
        if null {
            self.at += 4;
        }
        Some(null)
    }

    /// Past a value the parser reads as an `Option`: whether it is not null.
    fn present(&mut self) -> Option<bool> {
        if self.null()? {
            return Some(false);
        }
        self.skip()?;
        Some(true)
    }

    /// An object's members, each key handed to `member` with the walk at its value.
    fn members(&mut self, mut member: impl FnMut(&mut Self, &[u8]) -> Option<()>) -> Option<()> {
        self.expect(b'{')?;
        self.ws();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Some(());
        }
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return None;
            }
            // An escaped key may spell one the parser reads.
            let from = self.at + 1;
            let stop = super::stop_in_string(self.data, from)?;
            if self.data[stop] == b'\\' {
                return None;
            }
            let key = &self.data[from..stop];
            self.at = stop + 1;
            self.expect(b':')?;
            member(self, key)?;
            self.ws();
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// `choices`: an array of objects.
    fn choices(&mut self) -> Option<Choices> {
        let mut sum = Choices::default();
        self.expect(b'[')?;
        self.ws();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Some(sum);
        }
        loop {
            let (mut text, mut finish) = (None, None);
            self.members(|w, key| match key {
                b"text" => set(&mut text, w.text()?),
                b"finish_reason" => set(&mut finish, w.present()?),
                // A streamed chunk's delta, in a body: the parser reads it.
                b"delta" => None,
                _ => w.skip(),
            })?;
            sum.count += 1;
            sum.tokens += u32::from(text.unwrap_or(false));
            sum.finished |= finish.unwrap_or(false);
            self.ws();
            match self.peek()? {
                b',' => self.at += 1,
                b']' => {
                    self.at += 1;
                    return Some(sum);
                }
                _ => return None,
            }
        }
    }

    /// A completion's `text`: whether it is a non-empty string (null: no text).
    fn text(&mut self) -> Option<bool> {
        if self.null()? {
            return Some(false);
        }
        if self.peek() != Some(b'"') {
            return None;
        }
        let end = string_end(self.data, self.at)?;
        let non_empty = end - self.at > 2;
        self.at = end;
        Some(non_empty)
    }

    /// `usage`: null, or an object with its counts.
    fn usage(&mut self) -> Option<Option<Usage>> {
        if self.null()? {
            return Some(None);
        }
        let (mut completion, mut prompt, mut details) = (None, None, None);
        self.members(|w, key| match key {
            b"completion_tokens" => set(&mut completion, w.count()?),
            b"prompt_tokens" => set(&mut prompt, w.count()?),
            b"prompt_tokens_details" => set(&mut details, w.details()?),
            _ => w.skip(),
        })?;
        Some(Some(Usage {
            completion: completion.flatten(),
            prompt: prompt.flatten(),
            cached: details.flatten().flatten(),
        }))
    }

    /// `prompt_tokens_details`: null, or an object with its `cached_tokens`.
    fn details(&mut self) -> Option<Option<Option<u64>>> {
        if self.null()? {
            return Some(None);
        }
        let mut cached = None;
        self.members(|w, key| match key {
            b"cached_tokens" => set(&mut cached, w.count()?),
            _ => w.skip(),
        })?;
        Some(Some(cached.flatten()))
    }

    /// A token count: null, or plain digits up to [`MAX_COUNT`] (anything else the
    /// parser reads, and refuses).
    fn count(&mut self) -> Option<Option<u64>> {
        if self.null()? {
            return Some(None);
        }
        let (n, digits) = count_at(&self.data[self.at..])?;
        self.at += digits;
        Some(Some(n))
    }

    /// Past any value: a string, an object or array (by its brackets, strings skipped
    /// whole), or a scalar.
    fn skip(&mut self) -> Option<()> {
        self.ws();
        match self.peek()? {
            b'"' => self.at = string_end(self.data, self.at)?,
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.peek()? {
                        b'"' => {
                            self.at = string_end(self.data, self.at)?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.at += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.at += 1;
                }
            }
            _ => {
                let scalar = self.data[self.at..]
                    .iter()
                    .take_while(|b| !matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                    .count();
                if scalar == 0 {
                    return None;
                }
                self.at += scalar;
            }
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::tests::{mutated, PUNCTUATION};
    use super::super::super::Chunk;
    use super::*;

    fn parsed(b: &[u8]) -> Option<Facts> {
        serde_json::from_slice::<Chunk>(b).ok().map(|c| c.facts())
    }

    const BODIES: [&str; 12] = [
        r#"{"id":"chatcmpl-1","object":"chat.completion","created":1733000000,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14,"prompt_tokens_details":{"cached_tokens":8}},"system_fingerprint":null}"#,
        r#"{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":"length"},{"index":1,"text":"","finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":16,"total_tokens":19}}"#,
        "{\n  \"choices\" : [ {\"index\": 0, \"message\": {\"content\": \"a \\\"quoted\\\" [word] {x}\"}, \"finish_reason\": \"stop\"} ],\n  \"usage\": {\"completion_tokens\": 7, \"prompt_tokens_details\": null}\n}\n",
        r#"{"choices":[],"usage":{"completion_tokens":5,"prompt_tokens":9}}"#,
        r#"{"choices":[{"index":0,"message":{"tool_calls":[{"id":"t","function":{"name":"f","arguments":"{\"a\":[1,2]}"}}]},"finish_reason":"tool_calls"}],"usage":null}"#,
        r#"{"error":{"message":"boom","type":"server_error"}}"#,
        r#"{"error":null,"choices":[{"text":"x"}]}"#,
        r#"{}"#,
        r#"{"usage":{"completion_tokens":null,"prompt_tokens":0}}"#,
        r#"{"choices":[{"message":{"content":"x"},"finish_reason":{"type":"stop"}}],"usage":{"prompt_tokens_details":{"cached_tokens":4294967296}}}"#,
        r#"{"model":"m","choices":[{"index":0,"message":{"content":"ü, 🦀"},"finish_reason":"stop"}],"usage":{"total_tokens":1.5,"completion_tokens":1}}"#,
        r#"{"choices":[{"index":0,"text":null,"finish_reason":null}]}"#,
    ];

    /// A string's end read a byte at a time: the reference `string_end` is held to.
    fn plain_string_end(data: &[u8]) -> Option<usize> {
        let mut i = 1;
        while i < data.len() {
            match data[i] {
                b'"' => return Some(i + 1),
                b'\\' => i += 2,
                _ => i += 1,
            }
        }
        None
    }

    /// `string_end` agrees with a byte-by-byte reading for quotes, escapes and the end of
    /// the data at every place, before, across and past its first 64 bytes.
    #[test]
    fn a_string_ends_at_its_first_unescaped_quote() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(48);
        let mut ends = [0usize; 2];
        for _ in 0..100_000 {
            let len = rng.gen_range(0..120);
            let mut data = vec![b'"'];
            data.extend((0..len).map(|_| match rng.gen_range(0..40) {
                0 => b'"',
                1 => b'\\',
                _ => b'a',
            }));
            let want = plain_string_end(&data);
            assert_eq!(string_end(&data, 0), want, "{data:?}");
            ends[usize::from(want.is_some_and(|e| e > 65))] += 1;
        }
        assert!(ends[1] > 1_000, "strings past the first 64 bytes: {ends:?}");
    }

    /// A string's end, found by words, is where the byte-by-byte search finds it: for an
    /// escape or the closing quote at every offset, near and past the words' 64 bytes.
    #[test]
    fn a_string_ends_where_it_ends_at_every_offset() {
        for len in 0..80 {
            for tail in [&b"\"\""[..], b"\\\\\"", b"\\\"x\"", b"\""] {
                let mut data = b"\"".to_vec();
                data.extend(std::iter::repeat_n(b'a', len));
                data.extend_from_slice(tail);
                data.extend_from_slice(b",\"k\":1}");
                assert_eq!(
                    string_end(&data, 0),
                    plain_string_end(&data),
                    "{len} {tail:?}"
                );
            }
        }
        assert_eq!(string_end(b"\"abc", 0), None);
    }

    /// The walk answers the common replies, as the parser reads them.
    #[test]
    fn answers_the_common_replies_as_the_parser_does() {
        for b in BODIES {
            let walked = body(b.as_bytes());
            assert!(walked.is_some(), "walked: {b}");
            assert_eq!(walked, parsed(b.as_bytes()), "{b}");
        }
    }

    /// What the parser reads otherwise (or refuses) is left to it.
    #[test]
    fn leaves_the_rest_to_the_parser() {
        for b in [
            r#"{"choices":[{"delta":{"content":"x"}}]}"#,
            r#"{"choices":[{"finish_reason":"stop","finish_reason":null}]}"#,
            r#"{"usage":{"completion_tokens":1},"usage":null}"#,
            r#"{"usage":{"completion_tokens":1.0}}"#,
            r#"{"usage":{"completion_tokens":-1}}"#,
            r#"{"usage":{"completion_tokens":4294967297}}"#,
            r#"{"usage":{"completion_tokens":"3"}}"#,
            r#"{"usage":{"completion_tokens":01}}"#,
            r#"{"us\u0061ge":{"completion_tokens":1}}"#,
            r#"{"choices":[{"text":["a"]}]}"#,
            r#"{"choices":null}"#,
            r#"{"choices":[[0,"x"]]}"#,
            r#"{"usage":[1,2]}"#,
            r#"{"choices":[]} x"#,
            r#"{"choices":[{"text":"x"}"#,
            "{\"choices\":[]}\x0c",
            "{\x0c\"choices\":[]}",
            r#"[]"#,
            "",
        ] {
            assert_eq!(body(b.as_bytes()), None, "{b}");
        }
    }

    /// Mutated replies (keys, quotes, escapes, spacing and brackets inserted, bytes cut):
    /// wherever the walk answers and the parser reads the reply, they agree.
    #[test]
    fn agrees_with_the_parser_on_mutated_replies() {
        use rand::{rngs::StdRng, SeedableRng};
        let own: [&[u8]; 13] = [
            b"1.5",
            b"\"text\":\"x\"",
            b"\"delta\":{}",
            b"\"usage\":{}",
            b"\"usage\":null",
            b"\"error\":1",
            b"\"finish_reason\":\"stop\"",
            b"\"choices\":[]",
            b"\"completion_tokens\":3",
            b"\"prompt_tokens\":4",
            b"\"cached_tokens\":5",
            b"\"prompt_tokens_details\":{}",
            b"\n",
        ];
        let pieces = [&PUNCTUATION[..], &own].concat();
        let mut rng = StdRng::seed_from_u64(48);
        let (mut compared, mut answered) = (0, 0);
        for _ in 0..30_000 {
            let b = mutated(&mut rng, &BODIES, &pieces);
            let walked = body(&b);
            // Through the replies' shapes too (learned from these bodies as they come).
            assert_eq!(
                super::super::body(&b),
                walked,
                "{}",
                String::from_utf8_lossy(&b)
            );
            answered += usize::from(walked.is_some());
            if let (Some(w), Some(p)) = (walked, parsed(&b)) {
                compared += 1;
                assert_eq!(w, p, "{}", String::from_utf8_lossy(&b));
            }
        }
        assert!(
            compared > 3_000 && answered >= compared,
            "{compared} {answered}"
        );
    }
}
