//! Usage injection (per upstream `inject_usage = true`): a streaming OpenAI request that did
//! not ask for `stream_options.include_usage` gets it added, so the proxy's counts are
//! exact; the final usage-only chunk that this makes the server send is then taken out of
//! the response, so clients that index `choices[0]` on every chunk keep working.
//!
//! What such a client sees differently: nothing is removed but that one chunk; OpenAI (and
//! servers that copy it closely) also add `"usage": null` to every other chunk once usage is
//! requested. Bytes of a partial event are held until its end arrives, so a response being
//! rewritten is forwarded event by event rather than fragment by fragment.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::dialect::Dialect;
use crate::sse::SseParser;

/// Where usage is asked for in a request body: `text` written in at byte `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insertion {
    pub at: usize,
    pub text: &'static [u8],
}

/// The request body with usage asked for, or `None` to leave it alone (not JSON, not
/// streaming, or usage already asked for either way): the body as it came with
/// [`insertion`]'s text written in.
pub fn request_with_usage(body: &[u8]) -> Option<Bytes> {
    let Insertion { at, text } = insertion(body)?;
    let mut out = BytesMut::with_capacity(body.len() + text.len());
    out.extend_from_slice(&body[..at]);
    out.extend_from_slice(text);
    out.extend_from_slice(&body[at..]);
    Some(out.freeze())
}

/// Where to ask for usage in a request body, or `None` to leave it alone (not JSON, not
/// streaming, or usage already asked for either way). The client's bytes are kept as they
/// came, with `"stream_options":{"include_usage":true},` (or `"include_usage":true` in its
/// own `stream_options`) written in: one pass over the body that builds nothing of it (a
/// long prompt is skipped over, not parsed into values), and no copy (the caller sends the
/// body's two parts around the text).
pub fn insertion(body: &[u8]) -> Option<Insertion> {
    let top: Top = serde_json::from_slice(body).ok()?;
    if top.stream != Some(true) {
        return None;
    }
    // An object (a struct reads from an array too).
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    match top.stream_options.0 {
        None => Some(Insertion {
            at: open + 1,
            text: br#""stream_options":{"include_usage":true},"#,
        }),
        Some(raw) => {
            let options: serde_json::Map<String, Value> = serde_json::from_str(raw.get()).ok()?;
            if options.contains_key("include_usage") {
                return None; // the client decided; its answer stands
            }
            let start = (raw.get().as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
            if body.get(start) != Some(&b'{') {
                return None;
            }
            let text: &[u8] = if options.is_empty() {
                br#""include_usage":true"#
            } else {
                br#""include_usage":true,"#
            };
            Some(Insertion {
                at: start + 1,
                text,
            })
        }
    }
}

/// What usage injection reads of a request body: the rest is skipped, never built.
#[derive(Deserialize)]
struct Top<'a> {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default, borrow)]
    stream_options: Present<'a>,
}

/// A field as it came, `null` included (an `Option` would read `null` as absent).
#[derive(Default)]
struct Present<'a>(Option<&'a RawValue>);

impl<'de: 'a, 'a> Deserialize<'de> for Present<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&RawValue>::deserialize(d).map(|raw| Present(Some(raw)))
    }
}

/// Removes usage-only events from an SSE response, holding back only the bytes of an
/// event that has not ended yet.
#[derive(Debug)]
pub struct UsageStripper {
    pending: Vec<u8>,
    max_event_bytes: usize,
    /// Reads each complete event (its buffers kept from one event to the next).
    parser: SseParser,
}

impl UsageStripper {
    pub fn new(max_event_bytes: usize) -> Self {
        UsageStripper {
            pending: Vec::new(),
            max_event_bytes,
            parser: SseParser::new(usize::MAX),
        }
    }

    /// The bytes to forward for this fragment.
    pub fn push(&mut self, chunk: &[u8], end_of_stream: bool) -> Bytes {
        self.pending.extend_from_slice(chunk);
        let mut out = BytesMut::with_capacity(self.pending.len());
        let mut start = 0;
        while let Some(end) = event_end(&self.pending[start..], end_of_stream) {
            let event = &self.pending[start..start + end];
            if !is_usage_only(&mut self.parser, event) {
                out.extend_from_slice(event);
            }
            start += end;
        }
        // An unterminated tail at the end, or one too big to be a usage chunk, goes as is.
        if end_of_stream || self.pending.len() - start > self.max_event_bytes {
            out.extend_from_slice(&self.pending[start..]);
            start = self.pending.len();
        }
        self.pending.drain(..start);
        out.freeze()
    }
}

/// The length of the first complete event (through its blank line) in `buf`.
fn event_end(buf: &[u8], end_of_stream: bool) -> Option<usize> {
    let mut line_start = 0;
    let mut i = 0;
    while i < buf.len() {
        let b = buf[i];
        if b == b'\n' || b == b'\r' {
            let mut next = i + 1;
            if b == b'\r' {
                match buf.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    // A CR at the very end may be half of a CRLF: wait for the next byte.
                    None if !end_of_stream => return None,
                    None => {}
                }
            }
            if i == line_start {
                return Some(next);
            }
            line_start = next;
            i = next;
        } else {
            i += 1;
        }
    }
    None
}

/// Whether one complete event (through its blank line) is OpenAI's usage-only chunk.
fn is_usage_only(parser: &mut SseParser, event: &[u8]) -> bool {
    let mut usage_only = false;
    let mut any = false;
    parser.push(event, |e| {
        any = true;
        usage_only = Dialect::OpenAi.event(&e).usage_only;
    });
    any && usage_only
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_include_usage_only_where_it_is_missing() {
        let got = request_with_usage(br#"{"model":"m","stream":true,"stream_options":{"x":1}}"#)
            .expect("rewritten");
        let v: Value = serde_json::from_slice(&got).expect("json");
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"x": 1, "include_usage": true})
        );
        assert!(
            request_with_usage(br#"{"stream":true,"stream_options":{"include_usage":false}}"#)
                .is_none()
        );
        assert!(
            request_with_usage(br#"{"stream":false}"#).is_none(),
            "never into non-streaming requests"
        );
        assert!(
            request_with_usage(br#"{"stream":true"#).is_none(),
            "malformed bodies go untouched"
        );
        assert!(request_with_usage(b"[1,2]").is_none());
        assert!(
            request_with_usage(b"[true]").is_none(),
            "an array is no request"
        );
        assert!(
            request_with_usage(br#"{"stream":true,"stream_options":null}"#).is_none(),
            "a stream_options that is there stays the client's"
        );
        assert!(
            request_with_usage(br#"{"stream":true,"stream":true}"#).is_none(),
            "a duplicate key is left to the upstream"
        );
    }

    #[test]
    fn the_client_bytes_are_kept_with_the_option_written_in() {
        let got = |body: &[u8]| request_with_usage(body).map(|b| b.to_vec());
        assert_eq!(
            got(b" {\"model\":\"m\", \"temperature\":0.70,\"stream\":true}").as_deref(),
            Some(&b" {\"stream_options\":{\"include_usage\":true},\"model\":\"m\", \"temperature\":0.70,\"stream\":true}"[..])
        );
        assert_eq!(
            got(b"{\"stream\":true,\"stream_options\": { } }").as_deref(),
            Some(&b"{\"stream\":true,\"stream_options\": {\"include_usage\":true } }"[..])
        );
        // A long prompt goes through as it came, keys in their order, escapes as written.
        let prompt = "word \\u00e9 ".repeat(20_000);
        let body = format!(
            "{{\"messages\":[{{\"role\":\"user\",\"content\":\"{prompt}\"}}],\"stream\":true,\"stream_options\":{{\"continuous_usage_stats\":false}}}}"
        );
        let out = got(body.as_bytes()).expect("rewritten");
        let want = body.replace(
            "\"stream_options\":{",
            "\"stream_options\":{\"include_usage\":true,",
        );
        assert_eq!(out, want.as_bytes());
    }

    #[test]
    fn strips_the_usage_chunk_however_the_stream_is_split() {
        let content = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}],\"usage\":null}\r\n\r\n";
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1,\"total_tokens\":2}}\r\n\r\n";
        let done = "data: [DONE]\r\n\r\n";
        let input = format!("{content}{usage}{done}");
        let want = format!("{content}{done}");
        let bytes = input.as_bytes();
        for cut in 0..=bytes.len() {
            let mut s = UsageStripper::new(1 << 20);
            let mut out = Vec::new();
            out.extend_from_slice(&s.push(&bytes[..cut], false));
            out.extend_from_slice(&s.push(&bytes[cut..], true));
            assert_eq!(String::from_utf8(out).expect("utf8"), want, "cut at {cut}");
        }
    }
}
