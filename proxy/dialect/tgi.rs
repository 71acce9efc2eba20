//! Hugging Face TGI's native API (`/generate_stream`, `/generate`). Every streamed event
//! carries exactly one token (special tokens included: they cost a decode step too); the
//! last one has `generated_text` and `details.generated_tokens`, the exact count. An
//! `{"error": …}` event is an in-band error.

use serde::de::IgnoredAny;
use serde::Deserialize;

use super::{parse, Facts};
use crate::sse::Event;

#[derive(Deserialize, Default)]
#[serde(default)]
struct Ev {
    token: Option<IgnoredAny>,
    generated_text: Option<IgnoredAny>,
    details: Option<Details>,
    error: Option<IgnoredAny>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Details {
    #[serde(deserialize_with = "super::count")]
    generated_tokens: Option<u64>,
}

pub fn event(event: &Event<'_>) -> Facts {
    let ev: Ev = match parse(event.data) {
        Ok(ev) => ev,
        Err(f) => return f,
    };
    Facts {
        tokens: u32::from(ev.token.is_some()),
        exact_total: ev.details.as_ref().and_then(|d| d.generated_tokens),
        finished: ev.generated_text.is_some() || ev.details.is_some(),
        error: ev.error.is_some(),
        ..Facts::default()
    }
}

/// `/generate`: `{"generated_text": …, "details": {"generated_tokens": N}}`.
pub fn body(body: &[u8]) -> Facts {
    let mut f = event(&Event {
        name: b"",
        data: body,
    });
    f.tokens = 0;
    f.finished |= f.unparsed == 0 && !f.error;
    f
}
