//! Anthropic Messages (`/v1/messages`). A `content_block_delta` carrying text, thinking or
//! tool-input JSON is a token event (a signature delta is not generated text).
//! `message_delta.usage.output_tokens` is **cumulative** (a server-tool turn can send
//! several): the last one is the total, never the sum. `message_start`'s usage is the
//! count so far at the start and is not taken as the total. `message_stop` ends the stream;
//! `ping` carries nothing; `error` is an in-band error.

use std::borrow::Cow;

use serde::Deserialize;

use super::{parse, Facts, NonEmpty};
use crate::sse::Event;

#[derive(Deserialize, Default)]
#[serde(default)]
struct Ev<'a> {
    #[serde(borrow, rename = "type")]
    kind: Cow<'a, str>,
    delta: Option<Delta>,
    usage: Option<Usage>,
    message: Option<Start>,
}

/// `message_start`'s message: its usage holds the prompt's tokens.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Start {
    usage: Option<Usage>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Delta {
    text: NonEmpty,
    thinking: NonEmpty,
    partial_json: NonEmpty,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Usage {
    #[serde(deserialize_with = "super::count")]
    output_tokens: Option<u64>,
    #[serde(deserialize_with = "super::count")]
    input_tokens: Option<u64>,
    #[serde(deserialize_with = "super::count")]
    cache_read_input_tokens: Option<u64>,
    #[serde(deserialize_with = "super::count")]
    cache_creation_input_tokens: Option<u64>,
}

impl Usage {
    /// The prompt's tokens: Anthropic counts those read from and written to its cache
    /// apart from `input_tokens`; tokentap counts the prompt whole, as OpenAI does.
    fn prompt(&self) -> Option<u64> {
        let parts = [
            self.cache_read_input_tokens,
            self.cache_creation_input_tokens,
        ];
        self.input_tokens
            .map(|n| n + parts.iter().flatten().sum::<u64>())
    }
}

pub fn event(event: &Event<'_>) -> Facts {
    let ev: Ev = match parse(event.data) {
        Ok(ev) => ev,
        Err(f) => return f,
    };
    match ev.kind.as_ref() {
        "content_block_delta" => Facts {
            tokens: u32::from(
                ev.delta
                    .is_some_and(|d| d.text.0 || d.thinking.0 || d.partial_json.0),
            ),
            ..Facts::default()
        },
        "message_start" => {
            let usage = ev.message.and_then(|m| m.usage);
            Facts {
                input_tokens: usage.as_ref().and_then(Usage::prompt),
                cached_input_tokens: usage.and_then(|u| u.cache_read_input_tokens),
                ..Facts::default()
            }
        }
        "message_delta" => Facts {
            input_tokens: ev.usage.as_ref().and_then(Usage::prompt),
            cached_input_tokens: ev.usage.as_ref().and_then(|u| u.cache_read_input_tokens),
            exact_total: ev.usage.and_then(|u| u.output_tokens),
            ..Facts::default()
        },
        "message_stop" => Facts {
            finished: true,
            ..Facts::default()
        },
        "error" => Facts {
            error: true,
            ..Facts::default()
        },
        _ => Facts::default(), // content_block_start/stop, ping
    }
}

/// A non-streaming message: `usage.output_tokens`, or an error object.
pub fn body(body: &[u8]) -> Facts {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct Whole<'a> {
        #[serde(borrow, rename = "type")]
        kind: Cow<'a, str>,
        usage: Option<Usage>,
    }
    match parse::<Whole>(body) {
        Ok(w) => Facts {
            input_tokens: w.usage.as_ref().and_then(Usage::prompt),
            cached_input_tokens: w.usage.as_ref().and_then(|u| u.cache_read_input_tokens),
            exact_total: w.usage.and_then(|u| u.output_tokens),
            finished: true,
            error: w.kind == "error",
            ..Facts::default()
        },
        Err(f) => f,
    }
}
