//! OpenAI's Responses API (`/v1/responses`): typed SSE events. Every `response.*.delta`
//! with a non-empty `delta` (output text, reasoning text and summaries, refusals,
//! function-call and custom-tool arguments) carries a token; audio deltas do not count.
//! `response.completed`, `.incomplete` and `.failed` end the stream and carry the exact
//! `usage.output_tokens`; `.failed` and an `error` event are in-band errors.

use std::borrow::Cow;

use serde::Deserialize;

use super::{parse, Facts, NonEmpty};
use crate::sse::Event;

#[derive(Deserialize, Default)]
#[serde(default)]
struct Ev<'a> {
    #[serde(borrow, rename = "type")]
    kind: Cow<'a, str>,
    delta: NonEmpty,
    response: Option<Response>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Response {
    usage: Option<Usage>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Usage {
    #[serde(deserialize_with = "super::count")]
    output_tokens: Option<u64>,
    #[serde(deserialize_with = "super::count")]
    input_tokens: Option<u64>,
}

pub fn event(event: &Event<'_>) -> Facts {
    let ev: Ev = match parse(event.data) {
        Ok(ev) => ev,
        Err(f) => return f,
    };
    let kind = ev.kind.as_ref();
    let terminal = matches!(
        kind,
        "response.completed" | "response.incomplete" | "response.failed"
    );
    Facts {
        tokens: u32::from(
            kind.starts_with("response.")
                && kind.ends_with(".delta")
                && !kind.contains("audio")
                && ev.delta.0,
        ),
        input_tokens: ev
            .response
            .as_ref()
            .and_then(|r| r.usage.as_ref())
            .and_then(|u| u.input_tokens)
            .filter(|_| terminal),
        exact_total: ev
            .response
            .and_then(|r| r.usage)
            .and_then(|u| u.output_tokens)
            .filter(|_| terminal),
        finished: terminal,
        error: matches!(kind, "error" | "response.failed"),
        ..Facts::default()
    }
}

/// A non-streaming response object: `usage.output_tokens` at the top level.
pub fn body(body: &[u8]) -> Facts {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct Whole {
        usage: Option<Usage>,
        error: Option<serde::de::IgnoredAny>,
        status: Option<String>,
    }
    match parse::<Whole>(body) {
        Ok(w) => Facts {
            input_tokens: w.usage.as_ref().and_then(|u| u.input_tokens),
            exact_total: w.usage.and_then(|u| u.output_tokens),
            finished: true,
            error: w.error.is_some() || w.status.as_deref() == Some("failed"),
            ..Facts::default()
        },
        Err(f) => f,
    }
}
