//! llama.cpp server's native `/completion`. Each event's `tokens` array (when the server
//! returns token ids) says how many tokens it carries — one or several with speculative
//! decoding — else a non-empty `content` counts one. The `stop: true` event ends the stream
//! with `timings.predicted_n` (or `tokens_predicted`), the exact output count.

use serde::de::IgnoredAny;
use serde::Deserialize;

use super::{parse, Count, Facts, NonEmpty};
use crate::sse::Event;

#[derive(Deserialize, Default)]
#[serde(default)]
struct Ev {
    content: NonEmpty,
    tokens: Count,
    stop: bool,
    #[serde(deserialize_with = "super::count")]
    tokens_predicted: Option<u64>,
    timings: Option<Timings>,
    error: Option<IgnoredAny>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Timings {
    #[serde(deserialize_with = "super::count")]
    predicted_n: Option<u64>,
}

pub fn event(event: &Event<'_>) -> Facts {
    let ev: Ev = match parse(event.data) {
        Ok(ev) => ev,
        Err(f) => return f,
    };
    let tokens = if ev.tokens.0 > 0 {
        ev.tokens.0
    } else {
        u32::from(ev.content.0)
    };
    let exact = ev
        .timings
        .and_then(|t| t.predicted_n)
        .or(ev.tokens_predicted);
    Facts {
        // The final event repeats no tokens; its `tokens` are the ids of the whole reply
        // in some versions, so it never counts as a token event.
        tokens: if ev.stop { 0 } else { tokens },
        exact_total: exact.filter(|_| ev.stop),
        finished: ev.stop,
        error: ev.error.is_some(),
        ..Facts::default()
    }
}

/// `"stream": false`: one object with `stop: true` and the counts.
pub fn body(body: &[u8]) -> Facts {
    event(&Event {
        name: b"",
        data: body,
    })
}
