//! What each request of a load asks: one prompt every time, or a shared-prefix workload —
//! `N` system prompts of `W` words, drawn with Zipf or uniform popularity, each opening
//! conversations whose history grows turn by turn (`--shared-prefixes`, `--prefix-words`,
//! `--popularity`, `--turns`). The traffic prefix caches and `balance = "prefix"` are for:
//! agents and chat products whose requests share a long system prompt and repeat the
//! conversation so far.

use std::sync::Mutex;

use bytes::Bytes;
use rand::Rng;
use serde_json::{json, Value};

use crate::sim::SimDialect;

/// How popular each system prompt is (`--popularity`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Popularity {
    Uniform,
    /// The k-th most popular drawn in proportion to 1 / k^s.
    Zipf(f64),
}

impl std::str::FromStr for Popularity {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uniform" => Ok(Popularity::Uniform),
            "zipf" => Ok(Popularity::Zipf(1.0)),
            _ => match s.strip_prefix("zipf:").map(str::parse::<f64>) {
                Some(Ok(e)) if e.is_finite() && e > 0.0 && e <= 10.0 => Ok(Popularity::Zipf(e)),
                _ => Err(format!(
                    "`{s}`: give uniform, zipf or zipf:S (S, the exponent, above 0 and at most 10)"
                )),
            },
        }
    }
}

/// The request's fixed parts: where and how it is asked.
#[derive(Debug, Clone)]
pub struct Shape {
    pub dialect: SimDialect,
    pub path: String,
    pub model: String,
    pub max_tokens: u64,
    pub include_usage: bool,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: &'static str,
    pub text: String,
}

/// What every request asks.
#[derive(Debug)]
pub enum Workload {
    /// The same body every time.
    One(Bytes),
    Shared(Shared),
}

/// A shared-prefix workload.
#[derive(Debug)]
pub struct Shared {
    shape: Shape,
    systems: Vec<String>,
    /// Cumulative popularity of `systems`, ending at 1.
    cumulative: Vec<f64>,
    turns: u32,
    /// The conversations open-loop arrivals go on with (closed-loop workers hold their own).
    open: Mutex<Vec<Conversation>>,
}

/// One client's conversation: its system prompt, its turns so far.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// Sent as `x-conversation-id` (what a session header would carry, for
    /// `balance = "consistent_hash:header:x-conversation-id"`).
    id: u64,
    system: usize,
    history: Vec<Message>,
    /// Turns asked in it; 0: not begun.
    asked: u32,
}

/// Conversations open-loop arrivals go on with.
const OPEN_CONVERSATIONS: usize = 256;

// === impl Workload ===

impl Workload {
    /// The next request of a client that keeps `conversation` (`None`: an open-loop
    /// arrival, which goes on with one of the workload's): its body, and its conversation's
    /// id with a shared-prefix workload.
    pub fn next(&self, conversation: Option<&mut Conversation>) -> (Bytes, Option<u64>) {
        match self {
            Workload::One(body) => (body.clone(), None),
            Workload::Shared(s) => match conversation {
                Some(c) => s.next(c),
                None => {
                    let mut open = s.open.lock().unwrap_or_else(|e| e.into_inner());
                    let i = rand::thread_rng().gen_range(0..open.len());
                    s.next(&mut open[i])
                }
            },
        }
    }
}

// === impl Shared ===

impl Shared {
    /// `n` system prompts of `words` words each, drawn by `popularity`, each conversation
    /// `turns` requests long.
    pub fn new(shape: Shape, n: usize, words: usize, popularity: Popularity, turns: u32) -> Shared {
        let weights: Vec<f64> = (1..=n)
            .map(|k| match popularity {
                Popularity::Uniform => 1.0,
                Popularity::Zipf(s) => 1.0 / (k as f64).powf(s),
            })
            .collect();
        let sum: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cumulative = weights
            .iter()
            .map(|w| {
                acc += w / sum;
                acc
            })
            .collect();
        Shared {
            shape,
            systems: (0..n).map(|i| system_prompt(i, words)).collect(),
            cumulative,
            turns: turns.max(1),
            open: Mutex::new(vec![Conversation::default(); OPEN_CONVERSATIONS]),
        }
    }

    /// The next request of `c`: its next turn, or the first of a new conversation when it
    /// has had its turns.
    fn next(&self, c: &mut Conversation) -> (Bytes, Option<u64>) {
        let mut rng = rand::thread_rng();
        if c.asked == 0 || c.asked >= self.turns {
            let u: f64 = rng.gen();
            let system = self.cumulative.partition_point(|&p| p < u);
            *c = Conversation {
                id: rng.gen(),
                system: system.min(self.systems.len() - 1),
                history: Vec::new(),
                asked: 0,
            };
        } else {
            // The reply to the last turn, as the client would send it back: a stand-in of
            // about the tokens it asked for (what came back is not kept).
            c.history.push(Message {
                role: "assistant",
                text: words(
                    c.asked as usize * 7919 + c.system,
                    self.shape.max_tokens as usize,
                ),
            });
        }
        c.asked += 1;
        c.history.push(Message {
            role: "user",
            text: format!("Turn {}: {}", c.asked, words(rng.gen_range(0..1 << 20), 24)),
        });
        let mut messages = Vec::with_capacity(c.history.len() + 1);
        messages.push(Message {
            role: "system",
            text: self.systems[c.system].clone(),
        });
        messages.extend(c.history.iter().cloned());
        let body = Bytes::from(body(&self.shape, &messages).to_string());
        (body, Some(c.id))
    }
}

/// The `i`-th system prompt: `words` words, distinct from its first.
fn system_prompt(i: usize, n: usize) -> String {
    format!("You are assistant {i}. {}", words(i, n.saturating_sub(4)))
}

/// `n` words of a fixed vocabulary, the same for the same `seed`.
pub fn words(seed: usize, n: usize) -> String {
    const VOCABULARY: [&str; 16] = [
        "the",
        "keeper",
        "of",
        "lighthouse",
        "answers",
        "every",
        "question",
        "with",
        "care",
        "and",
        "a",
        "short",
        "clear",
        "reason",
        "before",
        "tools",
    ];
    let mut x = (seed as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(n * 7);
    for k in 0..n {
        // xorshift: cheap, and the same everywhere.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if k > 0 {
            out.push(' ');
        }
        out.push_str(VOCABULARY[(x % 16) as usize]);
    }
    out
}

/// A streaming request in the dialect's own shape, of `messages` (a system prompt, then
/// alternating user and assistant turns, ending with the user's). Dialects that take one
/// prompt string get the messages' texts one after another.
pub fn body(shape: &Shape, messages: &[Message]) -> Value {
    let Shape {
        dialect,
        path,
        model,
        max_tokens,
        include_usage,
    } = shape;
    let chat = |ms: &[Message]| -> Value {
        ms.iter()
            .map(|m| json!({"role": m.role, "content": m.text}))
            .collect()
    };
    let text = || {
        (messages.iter())
            .map(|m| m.text.as_str())
            .collect::<Vec<_>>()
            .join("\n\n")
    };
    let usage = |mut b: Value| {
        if *include_usage {
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    };
    match dialect {
        SimDialect::Openai
            if path.ends_with("/completions") && !path.ends_with("/chat/completions") =>
        {
            usage(
                json!({"model": model, "prompt": text(), "max_tokens": max_tokens, "stream": true}),
            )
        }
        SimDialect::Openai => usage(
            json!({"model": model, "messages": chat(messages), "max_tokens": max_tokens, "stream": true}),
        ),
        SimDialect::Responses => {
            // One question: the plain-text input; a conversation: its messages.
            let input = match messages {
                [one] => json!(one.text),
                _ => chat(messages),
            };
            json!({"model": model, "input": input, "max_output_tokens": max_tokens, "stream": true})
        }
        SimDialect::Anthropic => {
            // The system prompt is the request's own field; the turns are the messages.
            let (system, turns) = match messages.split_first() {
                Some((s, rest)) if s.role == "system" => (Some(s.text.as_str()), rest),
                _ => (None, messages),
            };
            let mut b = json!({"model": model, "messages": chat(turns), "max_tokens": max_tokens, "stream": true});
            if let Some(system) = system {
                b["system"] = json!(system);
            }
            b
        }
        SimDialect::Tgi => {
            json!({"inputs": text(), "parameters": {"max_new_tokens": max_tokens, "details": true}})
        }
        SimDialect::Ollama if path.ends_with("/generate") => {
            json!({"model": model, "prompt": text(), "stream": true, "options": {"num_predict": max_tokens}})
        }
        SimDialect::Ollama => {
            json!({"model": model, "messages": chat(messages), "stream": true, "options": {"num_predict": max_tokens}})
        }
        SimDialect::Llamacpp => {
            json!({"prompt": text(), "n_predict": max_tokens, "stream": true})
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            dialect: SimDialect::Openai,
            path: "/v1/chat/completions".into(),
            model: "m".into(),
            max_tokens: 16,
            include_usage: true,
        }
    }

    fn messages((body, _): &(Bytes, Option<u64>)) -> Vec<Value> {
        let v: Value = serde_json::from_slice(body).unwrap();
        v["messages"].as_array().unwrap().clone()
    }

    #[test]
    fn a_conversation_grows_then_starts_again_on_a_drawn_system_prompt() {
        let w = Workload::Shared(Shared::new(shape(), 4, 100, Popularity::Uniform, 3));
        let mut c = Conversation::default();
        let turns: Vec<Vec<Value>> = (0..4).map(|_| messages(&w.next(Some(&mut c)))).collect();
        assert_eq!(
            turns.iter().map(Vec::len).collect::<Vec<_>>(),
            [2, 4, 6, 2],
            "system + user, then each turn adds the reply and the next question"
        );
        // The history is sent back as it was: each turn extends the one before it.
        assert_eq!(turns[1][..2], turns[0][..]);
        assert_eq!(turns[2][..4], turns[1][..]);
        let system = turns[0][0]["content"].as_str().unwrap();
        assert!(system.starts_with("You are assistant "));
        assert_eq!(system.split(' ').count(), 100);
        // Open-loop arrivals go on with the workload's own conversations.
        assert_eq!(messages(&w.next(None)).len(), 2);
    }

    #[test]
    fn zipf_draws_the_first_prompt_most() {
        let s = Shared::new(shape(), 16, 8, Popularity::Zipf(1.0), 1);
        let mut seen = [0u32; 16];
        for _ in 0..20_000 {
            let mut c = Conversation::default();
            s.next(&mut c);
            seen[c.system] += 1;
        }
        // 1 / H(16) ≈ 29.6% for the first, half that for the second.
        let first = f64::from(seen[0]) / 20_000.0;
        assert!((first - 0.296).abs() < 0.02, "{seen:?}");
        assert!(seen[0] > seen[1] && seen[1] > seen[15], "{seen:?}");
        assert!("zipf:0".parse::<Popularity>().is_err());
        assert_eq!("zipf:1.2".parse(), Ok(Popularity::Zipf(1.2)));
    }

    #[test]
    fn each_dialect_carries_the_system_prompt_first() {
        let ms = [
            Message {
                role: "system",
                text: "S".into(),
            },
            Message {
                role: "user",
                text: "U".into(),
            },
        ];
        let anthropic = body(
            &Shape {
                dialect: SimDialect::Anthropic,
                ..shape()
            },
            &ms,
        );
        assert_eq!(anthropic["system"], "S");
        assert_eq!(anthropic["messages"].as_array().unwrap().len(), 1);
        let completion = body(
            &Shape {
                path: "/v1/completions".into(),
                ..shape()
            },
            &ms,
        );
        assert_eq!(completion["prompt"], "S\n\nU");
    }
}
