//! Invariants for the fuzz targets in `fuzz/` (feature `fuzzing`, never in a release):
//! each function takes the fuzzer's bytes and panics where an invariant breaks. They live
//! here, beside the code, so the targets are one line each.

use crate::config::FileConfig;
use crate::dialect::{openai, Dialect};
use crate::ndjson::NdjsonParser;
use crate::sse::{Event, SseParser};
use crate::usage::{self, UsageStripper};

pub use crate::service::fuzzing::{chunked, request_head, response_head};

type Owned = Vec<(Vec<u8>, Vec<u8>)>;

fn owned(events: &mut Owned) -> impl FnMut(Event<'_>) + '_ {
    |e| events.push((e.name.to_vec(), e.data.to_vec()))
}

/// Split points chosen by the input's first byte, and the rest of the input.
fn splits(data: &[u8]) -> Option<(Vec<usize>, &[u8])> {
    let (&seed, body) = data.split_first()?;
    let n = body.len();
    let s = usize::from(seed);
    let mut at = vec![s % (n + 1), (s * 7) % (n + 1), n / 2];
    at.sort_unstable();
    Some((at, body))
}

fn pieces<'a>(body: &'a [u8], at: &[usize]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    let mut from = 0;
    for &a in at {
        out.push(&body[from..a]);
        from = a;
    }
    out.push(&body[from..]);
    out
}

/// SSE framing: the same events and oversized count whole, split at three points, and a
/// byte at a time; each event's data is bytes of the input (the parser never alters them).
pub fn sse(data: &[u8]) {
    let Some((at, body)) = splits(data) else {
        return;
    };
    for max in [64, 1 << 20] {
        let run = |parts: &[&[u8]]| {
            let mut p = SseParser::new(max);
            let mut events = Owned::new();
            for part in parts {
                p.push(part, owned(&mut events));
            }
            (events, p.oversized_events())
        };
        let whole = run(&[body]);
        assert_eq!(whole, run(&pieces(body, &at)), "split at {at:?}");
        if body.len() <= 1024 {
            let bytes: Vec<&[u8]> = body.chunks(1).collect();
            assert_eq!(whole, run(&bytes), "a byte at a time");
        }
        for (_, data) in &whole.0 {
            for line in data.split(|&b| b == b'\n') {
                assert!(
                    memchr::memmem::find(body, line).is_some(),
                    "data not from the input"
                );
            }
        }
    }
}

/// NDJSON framing: the same lines whole and split, each a line of the input.
pub fn ndjson(data: &[u8]) {
    let Some((at, body)) = splits(data) else {
        return;
    };
    for max in [64, 1 << 20] {
        let run = |parts: &[&[u8]]| {
            let mut p = NdjsonParser::new(max);
            let mut events = Owned::new();
            for part in parts {
                p.push(part, owned(&mut events));
            }
            p.finish(owned(&mut events));
            (events, p.oversized_events())
        };
        let whole = run(&[body]);
        assert_eq!(whole, run(&pieces(body, &at)), "split at {at:?}");
        for (_, line) in &whole.0 {
            assert!(
                memchr::memmem::find(body, line).is_some(),
                "line not from the input"
            );
        }
    }
}

/// Every dialect on every event SSE and NDJSON find, and on the whole input as a body:
/// never a panic; the OpenAI fast path agrees with the parser.
pub fn dialects(data: &[u8]) {
    let mut events = Owned::new();
    SseParser::new(1 << 20).push(data, owned(&mut events));
    let mut lines = Owned::new();
    let mut nd = NdjsonParser::new(1 << 20);
    nd.push(data, owned(&mut lines));
    nd.finish(owned(&mut lines));
    let all = [
        Dialect::OpenAi,
        Dialect::Responses,
        Dialect::Anthropic,
        Dialect::Tgi,
        Dialect::Ollama,
        Dialect::LlamaCpp,
    ];
    for d in all {
        for (name, data) in events.iter().chain(&lines) {
            let f = d.event(&Event { name, data });
            assert!(f.tokens <= u32::try_from(data.len()).unwrap_or(u32::MAX).max(1) * 64);
        }
        let _ = d.body(data);
    }
    openai::fast_path_agrees(data);
    openai::body_shapes_agree(data);
    for (_, data) in &events {
        openai::fast_path_agrees(data);
        openai::body_shapes_agree(data);
    }
}

/// The usage stripper: the same output whole and split; an input with no usage in it
/// passes unchanged; the request rewrite, when it applies, gives JSON.
pub fn usage(data: &[u8]) {
    let Some((at, body)) = splits(data) else {
        return;
    };
    let run = |parts: &[&[u8]]| {
        let mut s = UsageStripper::new(1 << 20);
        let mut out = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            out.extend_from_slice(&s.push(part, i + 1 == parts.len()));
        }
        out
    };
    let whole = run(&[body]);
    assert_eq!(whole, run(&pieces(body, &at)), "split at {at:?}");
    assert!(whole.len() <= body.len());
    if memchr::memmem::find(body, b"usage").is_none() {
        assert_eq!(whole, body, "bytes changed without a usage chunk");
    }
    if let Some(rewritten) = usage::request_with_usage(body) {
        assert!(serde_json::from_slice::<serde_json::Value>(&rewritten).is_ok());
    }
}

/// Config parsing and validation never panic (upstream hosts replaced by a loopback
/// address, so validation never waits on DNS).
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(mut file) = toml::from_str::<FileConfig>(text) else {
        return;
    };
    for u in &mut file.upstream {
        let literal = u.url.parse::<http::Uri>().ok().and_then(|uri| {
            uri.host().map(|h| {
                h.trim_matches(['[', ']'])
                    .parse::<std::net::IpAddr>()
                    .is_ok()
            })
        });
        if literal != Some(true) {
            u.url = "http://127.0.0.1:1".into();
        }
    }
    let _ = file.validate();
}
