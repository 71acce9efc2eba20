//! Ollama's native API (`/api/chat`, `/api/generate`): NDJSON lines when streaming. A line
//! whose `message.content` / `message.thinking` / `message.tool_calls` (chat) or `response`
//! / `thinking` (generate) is non-empty carries a token; the `done: true` line ends the
//! stream with `eval_count`, the exact output count (and `eval_duration`, Ollama's own
//! decode time). `{"error": …}` is an in-band error.

use serde::de::IgnoredAny;
use serde::Deserialize;

use super::{parse, Facts, NonEmpty};
use crate::sse::Event;

#[derive(Deserialize, Default)]
#[serde(default)]
struct Line {
    message: Option<Message>,
    response: NonEmpty,
    thinking: NonEmpty,
    done: bool,
    #[serde(deserialize_with = "super::count")]
    eval_count: Option<u64>,
    #[serde(deserialize_with = "super::count")]
    prompt_eval_count: Option<u64>,
    error: Option<IgnoredAny>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Message {
    content: NonEmpty,
    thinking: NonEmpty,
    tool_calls: NonEmpty,
}

pub fn event(event: &Event<'_>) -> Facts {
    let line: Line = match parse(event.data) {
        Ok(l) => l,
        Err(f) => return f,
    };
    let in_message = line
        .message
        .is_some_and(|m| m.content.0 || m.thinking.0 || m.tool_calls.0);
    Facts {
        tokens: u32::from(in_message || line.response.0 || line.thinking.0),
        exact_total: line.eval_count.filter(|_| line.done),
        input_tokens: line.prompt_eval_count.filter(|_| line.done),
        finished: line.done,
        error: line.error.is_some(),
        ..Facts::default()
    }
}

/// `"stream": false`: one object with `done: true` and `eval_count`.
pub fn body(body: &[u8]) -> Facts {
    let mut f = event(&Event {
        name: b"",
        data: body,
    });
    f.tokens = 0;
    f
}
