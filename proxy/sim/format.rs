//! What the simulator says, in each API's own words: the request fields it reads and the
//! events (SSE, or NDJSON for Ollama) and whole bodies it writes.

use clap::ValueEnum;
use serde_json::{json, Value};

use super::UsageMode;

/// The API dialect the simulator speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SimDialect {
    /// `/v1/chat/completions`, `/v1/completions`
    Openai,
    /// `/v1/responses`
    Responses,
    /// `/v1/messages`
    Anthropic,
    /// `/generate_stream`, `/generate`
    Tgi,
    /// `/api/chat`, `/api/generate` (NDJSON)
    Ollama,
    /// `/completion`
    Llamacpp,
}

/// One generation endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completions,
    Responses,
    Messages,
    TgiStream,
    TgiWhole,
    OllamaChat,
    OllamaGenerate,
    LlamaCpp,
}

/// What the simulator reads from a request.
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    pub max_tokens: Option<u64>,
    pub stream: bool,
    /// OpenAI's `stream_options.include_usage`.
    pub usage: bool,
}

impl SimDialect {
    /// The API's name, and the paths it serves, as the banner says them.
    pub fn describe(self) -> (&'static str, &'static str) {
        match self {
            SimDialect::Openai => ("OpenAI", "/v1/chat/completions, /v1/completions"),
            SimDialect::Responses => ("OpenAI Responses", "/v1/responses"),
            SimDialect::Anthropic => ("Anthropic Messages", "/v1/messages"),
            SimDialect::Tgi => ("Hugging Face TGI", "/generate_stream, /generate"),
            SimDialect::Ollama => ("Ollama", "/api/chat, /api/generate"),
            SimDialect::Llamacpp => ("llama.cpp server", "/completion"),
        }
    }
}

impl Api {
    /// The endpoint `dialect` serves at `path`.
    pub fn route(dialect: SimDialect, path: &str) -> Option<Api> {
        Some(match (dialect, path) {
            (SimDialect::Openai, "/v1/chat/completions") => Api::Chat,
            (SimDialect::Openai, "/v1/completions") => Api::Completions,
            (SimDialect::Responses, "/v1/responses") => Api::Responses,
            (SimDialect::Anthropic, "/v1/messages") => Api::Messages,
            (SimDialect::Tgi, "/generate_stream") => Api::TgiStream,
            (SimDialect::Tgi, "/generate") => Api::TgiWhole,
            (SimDialect::Ollama, "/api/chat") => Api::OllamaChat,
            (SimDialect::Ollama, "/api/generate") => Api::OllamaGenerate,
            (SimDialect::Llamacpp, "/completion") => Api::LlamaCpp,
            _ => return None,
        })
    }

    pub fn asked(self, v: &Value) -> Asked {
        let u = |p: &str| v.pointer(p).and_then(Value::as_u64);
        let b = |p: &str| v.pointer(p).and_then(Value::as_bool);
        let max_tokens = match self {
            Api::Chat | Api::Completions => u("/max_tokens").or(u("/max_completion_tokens")),
            Api::Responses => u("/max_output_tokens"),
            Api::Messages => u("/max_tokens"),
            Api::TgiStream | Api::TgiWhole => u("/parameters/max_new_tokens"),
            Api::OllamaChat | Api::OllamaGenerate => u("/options/num_predict"),
            Api::LlamaCpp => u("/n_predict"),
        };
        let stream = match self {
            Api::TgiStream => true,
            Api::TgiWhole => false,
            // Ollama streams unless told not to.
            Api::OllamaChat | Api::OllamaGenerate => b("/stream").unwrap_or(true),
            _ => b("/stream").unwrap_or(false),
        };
        Asked {
            max_tokens,
            stream,
            usage: b("/stream_options/include_usage").unwrap_or(false),
        }
    }
}

/// Writes one response.
pub struct Writer {
    pub api: Api,
    pub id: String,
    pub model: String,
    pub created: u64,
    pub prompt_tokens: u64,
    /// Of those, held in the prefix cache (`--prefix-cache-tokens`; `None`: no cache, and
    /// usage says nothing of it).
    pub cached_tokens: Option<u64>,
    /// Report usage (or the dialect's exact count) at the end.
    pub usage: bool,
    /// OpenAI only: usage on every chunk too (vLLM's `continuous_usage_stats`).
    pub continuous: bool,
    /// The request set the token limit: generation ends by it (`length`, `max_tokens`,
    /// `incomplete`…); otherwise it ends as a natural stop does.
    pub limited: bool,
    seq: u64,
}

impl Writer {
    pub fn new(
        api: Api,
        id: String,
        model: String,
        prompt_tokens: u64,
        mode: UsageMode,
        asked: &Asked,
    ) -> Writer {
        let usage = match mode {
            UsageMode::Auto => !matches!(api, Api::Chat | Api::Completions) || asked.usage,
            UsageMode::Always | UsageMode::Continuous => true,
            UsageMode::Never => false,
        };
        Writer {
            api,
            id,
            model,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            prompt_tokens,
            cached_tokens: None,
            usage,
            continuous: mode == UsageMode::Continuous,
            limited: asked.max_tokens.is_some(),
            seq: 0,
        }
    }

    /// `by_limit` when the request's token limit ended generation, else `natural`.
    fn ended(&self, by_limit: &'static str, natural: &'static str) -> &'static str {
        if self.limited {
            by_limit
        } else {
            natural
        }
    }

    /// OpenAI's `finish_reason` (and Ollama's `done_reason`), by how generation ended.
    fn finish_reason(&self) -> &'static str {
        self.ended("length", "stop")
    }

    /// A Responses API event: its `type` and `sequence_number` set.
    fn event(&mut self, kind: &str, mut v: Value) -> String {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.sse(Some(kind), &v)
    }

    /// The Responses API's output message, with `text` so far.
    fn message_item(&self, status: &str, text: &str) -> Value {
        json!({"id": format!("msg_{}", self.id), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]})
    }

    /// The Responses API's response object.
    fn response_object(&self, status: &str, output: Value, usage: Value) -> Value {
        let incomplete = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        json!({"id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "parallel_tool_calls": true, "tool_choice": "auto",
            "tools": [], "temperature": 1.0, "top_p": 1.0, "text": {"format": {"type": "text"}},
            "error": null, "incomplete_details": incomplete, "metadata": {}, "usage": usage})
    }

    /// How a Responses generation ended (the response's status, and its message's).
    fn response_status(&self) -> &'static str {
        self.ended("incomplete", "completed")
    }

    pub fn content_type(&self) -> &'static str {
        match self.api {
            Api::OllamaChat | Api::OllamaGenerate => "application/x-ndjson",
            _ => "text/event-stream",
        }
    }

    fn sse(&mut self, name: Option<&str>, v: &Value) -> String {
        self.seq += 1;
        match name {
            Some(n) => format!("event: {n}\ndata: {v}\n\n"),
            None => format!("data: {v}\n\n"),
        }
    }

    /// Events before the first token.
    pub fn start(&mut self) -> String {
        let (id, model) = (self.id.clone(), self.model.clone());
        match self.api {
            Api::Chat => self.sse(None, &json!({"id": id, "object": "chat.completion.chunk", "created": self.created, "model": model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]})),
            Api::Responses => {
                let r = self.response_object("in_progress", json!([]), Value::Null);
                let mut s = self.event("response.created", json!({"response": r}));
                s += &self.event("response.in_progress", json!({"response": r}));
                let mut item = self.message_item("in_progress", "");
                item["content"] = json!([]);
                s += &self.event("response.output_item.added", json!({"output_index": 0, "item": item}));
                let part = json!({"type": "output_text", "text": "", "annotations": []});
                let item_id = format!("msg_{id}");
                s + &self.event("response.content_part.added", json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}))
            }
            Api::Messages => {
                let m = json!({"id": id, "type": "message", "role": "assistant", "content": [], "model": model, "stop_reason": null,
                    "usage": self.anthropic_usage(1)});
                let mut s = self.sse(Some("message_start"), &json!({"type": "message_start", "message": m}));
                s += &self.sse(Some("content_block_start"), &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}));
                s + &self.sse(Some("ping"), &json!({"type": "ping"}))
            }
            _ => String::new(),
        }
    }

    /// One decode step's event(s): `k` tokens, `produced` so far including them.
    pub fn tokens(&mut self, k: u64, produced: u64, last: bool) -> String {
        let text = " tok".repeat(k as usize);
        let (id, model) = (self.id.clone(), self.model.clone());
        match self.api {
            Api::Chat | Api::Completions => {
                let finish = if last { json!(self.finish_reason()) } else { Value::Null };
                let choice = if self.api == Api::Chat {
                    json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
                };
                let object = if self.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" };
                let mut v = json!({"id": id, "object": object, "created": self.created, "model": model, "choices": [choice]});
                if self.continuous {
                    v["usage"] = self.openai_usage(produced);
                }
                self.sse(None, &v)
            }
            Api::Responses => {
                let v = json!({"item_id": format!("msg_{id}"), "output_index": 0, "content_index": 0, "delta": text, "logprobs": []});
                self.event("response.output_text.delta", v)
            }
            Api::Messages => self.sse(Some("content_block_delta"), &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})),
            Api::TgiStream | Api::TgiWhole => {
                // TGI streams one token per event: k tokens are k events in one write.
                (0..k)
                    .map(|i| {
                        let n = produced - k + i + 1;
                        let end = last && i + 1 == k;
                        let v = json!({"index": n, "token": {"id": 1000 + n, "text": " tok", "logprob": -0.5, "special": false},
                            "generated_text": if end { json!(" tok".repeat(produced as usize)) } else { Value::Null },
                            "details": if end && self.usage { json!({"finish_reason": self.ended("length", "eos_token"), "generated_tokens": produced, "seed": null}) } else { Value::Null }});
                        self.sse(None, &v)
                    })
                    .collect()
            }
            Api::OllamaChat => format!("{}\n", json!({"model": model, "created_at": "2026-11-29T00:00:00Z", "message": {"role": "assistant", "content": text}, "done": false})),
            Api::OllamaGenerate => format!("{}\n", json!({"model": model, "created_at": "2026-11-29T00:00:00Z", "response": text, "done": false})),
            Api::LlamaCpp => {
                let ids: Vec<u64> = (produced - k..produced).map(|i| 1000 + i).collect();
                self.sse(None, &json!({"content": text, "tokens": ids, "stop": false, "id_slot": 0}))
            }
        }
    }

    /// Events after the last token.
    pub fn end(&mut self, produced: u64) -> String {
        let (id, model) = (self.id.clone(), self.model.clone());
        match self.api {
            Api::Chat | Api::Completions => {
                let mut s = String::new();
                if self.usage {
                    let object = if self.api == Api::Chat {
                        "chat.completion.chunk"
                    } else {
                        "text_completion"
                    };
                    let v = json!({"id": id, "object": object, "created": self.created, "model": model, "choices": [], "usage": self.openai_usage(produced)});
                    s = self.sse(None, &v);
                }
                s + "data: [DONE]\n\n"
            }
            Api::Responses => {
                let usage = if self.usage {
                    self.usage_io(produced)
                } else {
                    Value::Null
                };
                let text = " tok".repeat(produced as usize);
                let item_id = format!("msg_{id}");
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                let mut s = self.event("response.output_text.done", json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}));
                s += &self.event("response.content_part.done", json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}));
                let status = self.response_status();
                let item = self.message_item(self.ended("incomplete", "completed"), &text);
                s += &self.event(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": item}),
                );
                let r = self.response_object(status, json!([item]), usage);
                s + &self.event(&format!("response.{status}"), json!({"response": r}))
            }
            Api::Messages => {
                let mut s = self.sse(
                    Some("content_block_stop"),
                    &json!({"type": "content_block_stop", "index": 0}),
                );
                let stop = self.ended("max_tokens", "end_turn");
                let mut delta = json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}});
                if self.usage {
                    delta["usage"] = json!({"output_tokens": produced});
                }
                s += &self.sse(Some("message_delta"), &delta);
                s + &self.sse(Some("message_stop"), &json!({"type": "message_stop"}))
            }
            Api::TgiStream | Api::TgiWhole => String::new(),
            Api::OllamaChat | Api::OllamaGenerate => {
                let mut v = json!({"model": model, "created_at": "2026-11-29T00:00:01Z", "done": true, "done_reason": self.finish_reason()});
                if self.api == Api::OllamaChat {
                    v["message"] = json!({"role": "assistant", "content": ""});
                } else {
                    v["response"] = json!("");
                }
                if self.usage {
                    v["prompt_eval_count"] = json!(self.prompt_tokens);
                    v["eval_count"] = json!(produced);
                }
                format!("{v}\n")
            }
            Api::LlamaCpp => {
                let stop_type = self.ended("limit", "eos");
                let mut v = json!({"content": "", "tokens": [], "stop": true, "id_slot": 0, "stop_type": stop_type});
                if self.usage {
                    v["tokens_predicted"] = json!(produced);
                    v["timings"] = json!({"prompt_n": self.prompt_tokens, "predicted_n": produced});
                }
                self.sse(None, &v)
            }
        }
    }

    /// A whole (non-streaming) response.
    pub fn whole(&self, produced: u64) -> Value {
        let text = " tok".repeat(produced as usize);
        let (id, model, p) = (&self.id, &self.model, self.prompt_tokens);
        let finish = self.finish_reason();
        match self.api {
            Api::Chat => {
                json!({"id": id, "object": "chat.completion", "created": self.created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}],
                "usage": self.openai_usage(produced)})
            }
            Api::Completions => {
                json!({"id": id, "object": "text_completion", "created": self.created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}], "usage": self.openai_usage(produced)})
            }
            Api::Responses => {
                let status = self.response_status();
                let item = self.message_item(self.ended("incomplete", "completed"), &text);
                self.response_object(status, json!([item]), self.usage_io(produced))
            }
            Api::Messages => {
                let stop = self.ended("max_tokens", "end_turn");
                json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": [{"type": "text", "text": text}],
                "stop_reason": stop, "stop_sequence": null, "usage": self.anthropic_usage(produced)})
            }
            Api::TgiStream | Api::TgiWhole => {
                let reason = self.ended("length", "eos_token");
                json!({"generated_text": text, "details": {"finish_reason": reason, "generated_tokens": produced}})
            }
            Api::OllamaChat => {
                json!({"model": model, "created_at": "2026-11-29T00:00:01Z", "message": {"role": "assistant", "content": text},
                "done": true, "done_reason": finish, "prompt_eval_count": p, "eval_count": produced})
            }
            Api::OllamaGenerate => {
                json!({"model": model, "created_at": "2026-11-29T00:00:01Z", "response": text, "done": true,
                "done_reason": finish, "prompt_eval_count": p, "eval_count": produced})
            }
            Api::LlamaCpp => {
                let stop_type = self.ended("limit", "eos");
                json!({"content": text, "stop": true, "stop_type": stop_type, "tokens_predicted": produced,
                "timings": {"prompt_n": p, "predicted_n": produced}})
            }
        }
    }

    fn openai_usage(&self, produced: u64) -> Value {
        let mut u = json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": produced, "total_tokens": self.prompt_tokens + produced});
        if let Some(cached) = self.cached_tokens {
            u["prompt_tokens_details"] = json!({"cached_tokens": cached});
        }
        u
    }

    /// Anthropic's: `input_tokens` without the tokens read from the cache, which it counts
    /// apart.
    fn anthropic_usage(&self, produced: u64) -> Value {
        match self.cached_tokens {
            Some(cached) => json!({"input_tokens": self.prompt_tokens - cached,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0, "output_tokens": produced}),
            None => json!({"input_tokens": self.prompt_tokens, "output_tokens": produced}),
        }
    }

    fn usage_io(&self, produced: u64) -> Value {
        json!({"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens.unwrap_or(0)},
            "output_tokens": produced, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + produced})
    }
}
