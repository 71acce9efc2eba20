//! Every dialect's fixture stream (tests/fixtures/, written from each API's published
//! documentation), fed whole, split at every byte offset and byte by byte, gives the same
//! token count, exact total, ending and first/last token-event positions.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use tokentap::dialect::{tokens_carried, Dialect, Facts};
use tokentap::ndjson::NdjsonParser;
use tokentap::sse::SseParser;

#[derive(Debug, Default, PartialEq)]
struct Summary {
    tokens: u64,
    exact: Option<u64>,
    finished: bool,
    error: bool,
    unparsed: u32,
    /// Ordinals (among all events) of the first and last token-bearing events.
    first: Option<usize>,
    last: Option<usize>,
}

fn run(dialect: Dialect, ndjson: bool, pieces: &[&[u8]]) -> Summary {
    let mut s = Summary::default();
    let mut ordinal = 0usize;
    let mut on = |f: Facts, s: &mut Summary| {
        let n = tokens_carried(&f, s.tokens);
        if n > 0 {
            s.first.get_or_insert(ordinal);
            s.last = Some(ordinal);
        }
        s.tokens += u64::from(n);
        if f.exact_total.is_some() {
            s.exact = f.exact_total;
        }
        s.finished |= f.finished;
        s.error |= f.error;
        s.unparsed += f.unparsed;
        ordinal += 1;
    };
    if ndjson {
        let mut p = NdjsonParser::new(1 << 20);
        for piece in pieces {
            p.push(piece, |e| on(dialect.event(&e), &mut s));
        }
        p.finish(|e| on(dialect.event(&e), &mut s));
    } else {
        let mut p = SseParser::new(1 << 20);
        for piece in pieces {
            p.push(piece, |e| on(dialect.event(&e), &mut s));
        }
    }
    s
}

/// A fixture and what it must give: (file, dialect, estimated-or-carried tokens, exact
/// total, finished, error).
type Case = (&'static str, Dialect, u64, Option<u64>, bool, bool);

const CASES: &[Case] = &[
    (
        "openai_chat_usage.sse",
        Dialect::OpenAi,
        9,
        Some(11),
        true,
        false,
    ),
    (
        "openai_vllm_continuous_usage.sse",
        Dialect::OpenAi,
        5,
        Some(5),
        true,
        false,
    ),
    ("openai_error.sse", Dialect::OpenAi, 2, None, false, true),
    ("responses.sse", Dialect::Responses, 5, Some(9), true, false),
    (
        "responses_incomplete.sse",
        Dialect::Responses,
        2,
        Some(2),
        true,
        false,
    ),
    (
        "anthropic.sse",
        Dialect::Anthropic,
        4,
        Some(15),
        true,
        false,
    ),
    (
        "anthropic_error.sse",
        Dialect::Anthropic,
        1,
        None,
        false,
        true,
    ),
    ("tgi.sse", Dialect::Tgi, 3, Some(3), true, false),
    (
        "ollama_chat.ndjson",
        Dialect::Ollama,
        4,
        Some(4),
        true,
        false,
    ),
    (
        "ollama_generate.ndjson",
        Dialect::Ollama,
        3,
        Some(5),
        true,
        false,
    ),
    ("llamacpp.sse", Dialect::LlamaCpp, 4, Some(4), true, false),
];

#[test]
fn every_fixture_split_anywhere_gives_the_same_facts() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for &(file, dialect, tokens, exact, finished, error) in CASES {
        let bytes = std::fs::read(dir.join(file)).unwrap();
        let ndjson = file.ends_with(".ndjson");
        let whole = run(dialect, ndjson, &[&bytes]);
        assert_eq!(
            (
                whole.tokens,
                whole.exact,
                whole.finished,
                whole.error,
                whole.unparsed
            ),
            (tokens, exact, finished, error, 0),
            "{file}: {whole:?}"
        );
        assert!(whole.first.is_some() && whole.last >= whole.first, "{file}");
        for cut in 0..=bytes.len() {
            let split = run(dialect, ndjson, &[&bytes[..cut], &bytes[cut..]]);
            assert_eq!(split, whole, "{file} cut at {cut}");
        }
        let bytewise: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(
            run(dialect, ndjson, &bytewise),
            whole,
            "{file} byte by byte"
        );
    }
}

#[test]
fn anthropic_usage_is_cumulative_not_summed() {
    let bytes = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/anthropic.sse"),
    )
    .unwrap();
    // Two message_delta events report 10 then 15: the total is 15, not 25.
    assert_eq!(run(Dialect::Anthropic, false, &[&bytes]).exact, Some(15));
}
