//! API dialects: turn one framed event (or a whole non-streaming body) into facts —
//! tokens carried, an exact usage count, a finish, an error. A dialect never touches the
//! meter; the service records the facts.
//!
//! The dialect is chosen from the request path alone, and the framing from the response's
//! content type; tokentap never guesses a dialect from the bytes.

pub mod anthropic;
pub mod llamacpp;
pub mod ollama;
pub mod openai;
pub mod responses;
pub mod tgi;

use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use crate::sse::Event;

/// What one event (or one whole body) says about the generation.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    /// Generated tokens this event carries, by the estimate of one per token-bearing part.
    pub tokens: u32,
    /// An exact count of output tokens so far, reported by the stream itself.
    pub exact_total: Option<u64>,
    /// The stream reached a terminal event (a finish reason or a `[DONE]` marker).
    pub finished: bool,
    /// The stream reported an error in-band.
    pub error: bool,
    /// An OpenAI chunk with an empty `choices` and a `usage`: the final usage-only chunk.
    pub usage_only: bool,
    /// Events that could not be understood (broken JSON where JSON was due).
    pub unparsed: u32,
    /// The prompt's tokens, when the stream or body reports them (cached ones included).
    pub input_tokens: Option<u64>,
    /// Of those, the tokens read from the backend's prefix cache, when it reports them
    /// (OpenAI's `usage.prompt_tokens_details.cached_tokens`, Anthropic's
    /// `cache_read_input_tokens`).
    pub cached_input_tokens: Option<u64>,
}

// === impl Facts ===

impl Facts {
    /// Folds the facts of a later event into these (one fragment can hold several events).
    pub fn merge(&mut self, later: Facts) {
        self.tokens += later.tokens;
        if later.input_tokens.is_some() {
            self.input_tokens = later.input_tokens;
        }
        if later.cached_input_tokens.is_some() {
            self.cached_input_tokens = later.cached_input_tokens;
        }
        if later.exact_total.is_some() {
            self.exact_total = later.exact_total;
        }
        self.finished |= later.finished;
        self.usage_only |= later.usage_only;
        self.error |= later.error;
        self.unparsed += later.unparsed;
    }
}

/// The most tokens one request may report, in or out: four billion, a thousand times the
/// longest context any model takes. A count past it is no count (see [`count`]).
pub const MAX_COUNT: u64 = 1 << 32;

/// Reads a token count a stream reports (`usage.completion_tokens` and the like). A count
/// no request can reach (past [`MAX_COUNT`], as a negative or fractional one is no `u64`)
/// fails the event, which is then unparsed: the request keeps its estimate, and a
/// sum of counts can never wrap.
pub fn count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<u64>::deserialize(d)? {
        Some(n) if n > MAX_COUNT => Err(de::Error::custom("a token count past MAX_COUNT")),
        n => Ok(n),
    }
}

/// The API dialects tokentap meters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// OpenAI `/v1/chat/completions` and `/v1/completions` (and every server that copies them:
    /// vLLM, SGLang, llama.cpp's server, TGI's OpenAI route, Ollama's `/v1`).
    OpenAi,
    /// OpenAI's Responses API, `/v1/responses`.
    Responses,
    /// Anthropic Messages, `/v1/messages`.
    Anthropic,
    /// Hugging Face TGI's native `/generate_stream` and `/generate`.
    Tgi,
    /// Ollama's native `/api/chat` and `/api/generate` (NDJSON when streaming).
    Ollama,
    /// llama.cpp server's native `/completion`.
    LlamaCpp,
}

/// How a response body is framed, from its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Sse,
    Ndjson,
    /// One JSON document (a non-streaming response).
    Json,
}

impl Framing {
    /// The framing a `Content-Type` announces, if tokentap reads it.
    pub fn from_content_type(content_type: &[u8]) -> Option<Framing> {
        // The two a backend sends, whole: what the search below answers for them, without
        // its forty-odd windows.
        if content_type.eq_ignore_ascii_case(b"application/json") {
            return Some(Framing::Json);
        }
        if content_type.eq_ignore_ascii_case(b"text/event-stream") {
            return Some(Framing::Sse);
        }
        // Without a lowercased copy: this runs on every response.
        let has = |needle: &[u8]| {
            content_type
                .windows(needle.len())
                .any(|w| w.eq_ignore_ascii_case(needle))
        };
        if has(b"text/event-stream") {
            Some(Framing::Sse)
        } else if has(b"ndjson") || has(b"jsonl") || has(b"json-seq") {
            Some(Framing::Ndjson)
        } else if has(b"json") {
            Some(Framing::Json)
        } else {
            None
        }
    }
}

// === impl Dialect ===

impl Dialect {
    /// Its name in the access log.
    pub fn label(self) -> &'static str {
        match self {
            Dialect::OpenAi => "openai",
            Dialect::Responses => "responses",
            Dialect::Anthropic => "anthropic",
            Dialect::Tgi => "tgi",
            Dialect::Ollama => "ollama",
            Dialect::LlamaCpp => "llamacpp",
        }
    }

    /// The GenAI semantic conventions' `gen_ai.operation.name` of a request to `path`:
    /// `chat` for a conversation (chat completions, the Responses API, Anthropic messages,
    /// Ollama's chat), `text_completion` for a prompt completed.
    pub fn operation(self, path: &str) -> &'static str {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        match self {
            Dialect::OpenAi if ends_with(path, "/chat/completions") => "chat",
            Dialect::Ollama if ends_with(path, "/api/chat") => "chat",
            Dialect::Responses | Dialect::Anthropic => "chat",
            Dialect::OpenAi | Dialect::Ollama | Dialect::Tgi | Dialect::LlamaCpp => {
                "text_completion"
            }
        }
    }

    /// `gen_ai.provider.name`: the API the upstream speaks (`openai` for the OpenAI API, the
    /// Responses API included, whoever serves it: vLLM, SGLang…).
    pub fn provider(self) -> &'static str {
        match self {
            Dialect::OpenAi | Dialect::Responses => "openai",
            Dialect::Anthropic => "anthropic",
            Dialect::Tgi => "tgi",
            Dialect::Ollama => "ollama",
            Dialect::LlamaCpp => "llama.cpp",
        }
    }

    /// The dialect of a request path, or `None` for traffic that is not generation
    /// (model lists, health checks, embeddings…), which is forwarded and counted only.
    /// Case-blind, as a server may be; `path` is read as the server reads it
    /// ([`canonical`](crate::routing::path::canonical)) by the caller.
    pub fn from_path(path: &str) -> Option<Dialect> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        let ends = |s: &str| ends_with(path, s);
        if ends("/api/chat") || ends("/api/generate") {
            Some(Dialect::Ollama)
        } else if ends("/chat/completions") || ends("/completions") {
            Some(Dialect::OpenAi)
        } else if ends("/responses") {
            Some(Dialect::Responses)
        } else if ends("/messages") {
            Some(Dialect::Anthropic)
        } else if ends("/generate_stream") || ends("/generate") {
            Some(Dialect::Tgi)
        } else if ends("/completion") {
            Some(Dialect::LlamaCpp)
        } else {
            None
        }
    }

    /// Facts of one streamed event.
    pub fn event(self, event: &Event<'_>) -> Facts {
        match self {
            Dialect::OpenAi => openai::event(event),
            Dialect::Responses => responses::event(event),
            Dialect::Anthropic => anthropic::event(event),
            Dialect::Tgi => tgi::event(event),
            Dialect::Ollama => ollama::event(event),
            Dialect::LlamaCpp => llamacpp::event(event),
        }
    }

    /// Facts of a whole non-streaming response body.
    pub fn body(self, body: &[u8]) -> Facts {
        match self {
            Dialect::OpenAi => openai::body(body),
            Dialect::Responses => responses::body(body),
            Dialect::Anthropic => anthropic::body(body),
            Dialect::Tgi => tgi::body(body),
            Dialect::Ollama => ollama::body(body),
            Dialect::LlamaCpp => llamacpp::body(body),
        }
    }
}

/// Whether `path` ends with `suffix`, ASCII case ignored.
fn ends_with(path: &str, suffix: &str) -> bool {
    let (path, suffix) = (path.as_bytes(), suffix.as_bytes());
    path.len() >= suffix.len() && path[path.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
}

/// Whether a value is a non-empty string (or a non-empty array or object of content parts).
/// Reads the value without keeping it.
#[derive(Default)]
pub(crate) struct NonEmpty(pub bool);

impl<'de> Deserialize<'de> for NonEmpty {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NonEmpty;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any value")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<NonEmpty, E> {
                Ok(NonEmpty(!s.is_empty()))
            }
            fn visit_unit<E>(self) -> Result<NonEmpty, E> {
                Ok(NonEmpty(false))
            }
            fn visit_bool<E>(self, _: bool) -> Result<NonEmpty, E> {
                Ok(NonEmpty(false))
            }
            fn visit_i64<E>(self, _: i64) -> Result<NonEmpty, E> {
                Ok(NonEmpty(false))
            }
            fn visit_u64<E>(self, _: u64) -> Result<NonEmpty, E> {
                Ok(NonEmpty(false))
            }
            fn visit_f64<E>(self, _: f64) -> Result<NonEmpty, E> {
                Ok(NonEmpty(false))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NonEmpty, A::Error> {
                let mut any = false;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    any = true;
                }
                Ok(NonEmpty(any))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NonEmpty, A::Error> {
                let mut any = false;
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
                    any = true;
                }
                Ok(NonEmpty(any))
            }
        }
        d.deserialize_any(V)
    }
}

/// The tokens a fragment carried, given the tokens already counted for its request: a
/// running exact count on token-bearing events (vLLM's continuous usage) is trusted over
/// the one-per-event estimate.
pub fn tokens_carried(facts: &Facts, counted: u64) -> u32 {
    match facts.exact_total {
        Some(total) if facts.tokens > 0 && total > counted => {
            u32::try_from(total - counted).unwrap_or(u32::MAX)
        }
        _ => facts.tokens,
    }
}

/// Parses `data` as `T`, or reports it unparsed.
pub(crate) fn parse<'a, T: Deserialize<'a>>(data: &'a [u8]) -> Result<T, Facts> {
    serde_json::from_slice(data).map_err(|_| Facts {
        unparsed: 1,
        ..Facts::default()
    })
}

/// The length of an array (0 for anything else), read without keeping it.
#[derive(Default)]
pub(crate) struct Count(pub u32);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array")
            }
            fn visit_unit<E>(self) -> Result<Count, E> {
                Ok(Count(0))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Count, A::Error> {
                let mut n = 0;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Count(n))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt's cached tokens, as each API reports them; the prompt counted whole
    /// (Anthropic's cache reads and writes are apart from its `input_tokens`).
    #[test]
    fn cached_prompt_tokens_as_each_api_reports_them() {
        let ev = |dialect: Dialect, data: &str| {
            dialect.event(&Event {
                name: b"",
                data: data.as_bytes(),
            })
        };
        let f = ev(
            Dialect::OpenAi,
            r#"{"choices":[],"usage":{"prompt_tokens":1200,"completion_tokens":30,"prompt_tokens_details":{"cached_tokens":1024}}}"#,
        );
        assert_eq!(
            (f.input_tokens, f.cached_input_tokens),
            (Some(1200), Some(1024))
        );
        let f = ev(
            Dialect::OpenAi,
            r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":30}}"#,
        );
        assert_eq!((f.input_tokens, f.cached_input_tokens), (Some(12), None));
        let f = ev(
            Dialect::OpenAi,
            r#"{"choices":[],"usage":{"prompt_tokens":12,"prompt_tokens_details":null}}"#,
        );
        assert_eq!((f.input_tokens, f.cached_input_tokens), (Some(12), None));
        let f = ev(
            Dialect::Anthropic,
            r#"{"type":"message_start","message":{"usage":{"input_tokens":10,"cache_read_input_tokens":1000,"cache_creation_input_tokens":200,"output_tokens":1}}}"#,
        );
        assert_eq!(
            (f.input_tokens, f.cached_input_tokens),
            (Some(1210), Some(1000))
        );
        let f = ev(
            Dialect::Anthropic,
            r#"{"type":"message_start","message":{"usage":{"input_tokens":10,"output_tokens":1}}}"#,
        );
        assert_eq!((f.input_tokens, f.cached_input_tokens), (Some(10), None));
    }

    #[test]
    fn dialect_from_path() {
        assert_eq!(
            Dialect::from_path("/v1/chat/completions"),
            Some(Dialect::OpenAi)
        );
        assert_eq!(
            Dialect::from_path("/v1/completions?x=1"),
            Some(Dialect::OpenAi)
        );
        assert_eq!(
            Dialect::from_path("/openai/v1/chat/completions/"),
            Some(Dialect::OpenAi)
        );
        assert_eq!(
            Dialect::from_path("/v1/responses"),
            Some(Dialect::Responses)
        );
        assert_eq!(Dialect::from_path("/v1/messages"), Some(Dialect::Anthropic));
        assert_eq!(Dialect::from_path("/generate_stream"), Some(Dialect::Tgi));
        assert_eq!(Dialect::from_path("/generate"), Some(Dialect::Tgi));
        assert_eq!(Dialect::from_path("/api/chat"), Some(Dialect::Ollama));
        assert_eq!(Dialect::from_path("/api/generate"), Some(Dialect::Ollama));
        assert_eq!(Dialect::from_path("/completion"), Some(Dialect::LlamaCpp));
        assert_eq!(Dialect::from_path("/v1/models"), None);
        assert_eq!(Dialect::from_path("/v1/embeddings"), None);
    }
}
