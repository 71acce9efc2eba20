//! API dialects: turn one framed event (or a whole non-streaming body) into facts —
//! tokens carried, an exact usage count, a finish, an error. A dialect never touches the
//! meter; the service records the facts.
//!
//! The dialect is chosen from the request path alone, and the framing from the response's
//! content type; tokentap never guesses a dialect from the bytes.

pub mod openai;

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
    /// Events that could not be understood (broken JSON where JSON was due).
    pub unparsed: u32,
}

// === impl Facts ===

impl Facts {
    /// Folds the facts of a later event into these (one fragment can hold several events).
    pub fn merge(&mut self, later: Facts) {
        self.tokens += later.tokens;
        if later.exact_total.is_some() {
            self.exact_total = later.exact_total;
        }
        self.finished |= later.finished;
        self.error |= later.error;
        self.unparsed += later.unparsed;
    }
}

/// The API dialects tokentap meters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// OpenAI `/v1/chat/completions` and `/v1/completions` (and every server that copies them:
    /// vLLM, SGLang, llama.cpp's server, TGI's OpenAI route, Ollama's `/v1`).
    OpenAi,
}

// === impl Dialect ===

impl Dialect {
    /// The dialect of a request path, or `None` for traffic that is not generation
    /// (model lists, health checks, embeddings…), which is forwarded and counted only.
    pub fn from_path(path: &str) -> Option<Dialect> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        if path.ends_with("/chat/completions") || path.ends_with("/completions") {
            return Some(Dialect::OpenAi);
        }
        None
    }

    /// Facts of one streamed event.
    pub fn event(self, event: &Event<'_>) -> Facts {
        match self {
            Dialect::OpenAi => openai::event(event),
        }
    }

    /// Facts of a whole non-streaming response body.
    pub fn body(self, body: &[u8]) -> Facts {
        match self {
            Dialect::OpenAi => openai::body(body),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(Dialect::from_path("/v1/models"), None);
        assert_eq!(Dialect::from_path("/v1/embeddings"), None);
    }
}
