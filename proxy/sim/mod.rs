//! `tokentap sim`: a simulated continuously batching LLM backend that streams as one API
//! dialect does (OpenAI, Responses, Anthropic, TGI, Ollama, llama.cpp), event for event.
//!
//! One decode step lasts `tpot(b)`, b being the requests decoding at that moment, from a
//! piecewise-linear curve; every decoding request receives `tokens_per_chunk` tokens per
//! step as one SSE event. A new request waits `ttft_ms` (+ a per-prompt-token cost) of
//! prefill, then joins the batch at the next step. Steps are scheduled against absolute
//! deadlines, so the rate does not drift; a client that goes away stops being generated for.
//!
//! It stands apart from the proxy, like a real backend: it shares only plain helpers.

mod cache;
mod curve;
mod engine;
mod format;
mod http;

use std::net::SocketAddr;
use std::sync::Arc;

use clap::{Args, ValueEnum};

pub use curve::Curve;
pub use engine::{Engine, SimStats};
pub use format::SimDialect;

/// When to send the usage chunk at the end of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum UsageMode {
    /// Like the real API: OpenAI when the request asks (`stream_options.include_usage`),
    /// the other dialects always (their final event carries the count).
    Auto,
    Always,
    Never,
    /// OpenAI: usage on every chunk as well, like vLLM's `continuous_usage_stats`.
    Continuous,
}

#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Decode step time (ms) by batch size, piecewise-linear through these points
    /// (by default Llama 3.1 70B FP8 on one H100: 20 ms alone, 36 ms at 128 in flight).
    #[arg(long, default_value = "1:20,16:22,64:26,128:36")]
    pub tpot_curve: Curve,
    /// Prefill time before the first token, ms.
    #[arg(long, default_value_t = 50.0)]
    pub ttft_ms: f64,
    /// Extra prefill time per prompt token (estimated as 4 bytes of prompt each), ms.
    #[arg(long, default_value_t = 0.0)]
    pub prefill_ms_per_token: f64,
    /// A prefix cache of this many tokens (blocks of 16, least recently used out, as vLLM's
    /// automatic prefix caching): a prompt's leading blocks held are not prefilled again,
    /// and usage reports them (`prompt_tokens_details.cached_tokens`, Anthropic's
    /// `cache_read_input_tokens`). With it, prefill runs on one serial unit: each uncached
    /// token costs `--prefill-ms-per-token` there, so a miss costs TTFT and capacity.
    /// Default: none.
    #[arg(long)]
    pub prefix_cache_tokens: Option<u64>,
    /// Requests beyond this many (prefilling or decoding) wait in a queue. Default: no limit.
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// Output tokens when the request gives no `max_tokens`.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u64,
    /// Tokens carried by each streamed event.
    #[arg(long, default_value_t = 1)]
    pub tokens_per_chunk: u64,
    /// The usage chunk at the end of streams.
    #[arg(long, value_enum, default_value_t = UsageMode::Auto)]
    pub usage: UsageMode,
    /// The model name reported.
    #[arg(long, default_value = "tokentap-sim")]
    pub model: String,
    /// The API it speaks (and the paths it serves).
    #[arg(long, value_enum, default_value_t = SimDialect::Openai)]
    pub dialect: SimDialect,
    /// Switch to `--switch-curve` after this many seconds (to show a cap re-converging).
    /// The curve can also be changed at any time with `POST /sim/curve` and a body such as
    /// `1:30,16:33,64:39,128:54`.
    #[arg(long, requires = "switch_curve")]
    pub switch_after: Option<f64>,
    /// The curve switched to after `--switch-after`.
    #[arg(long)]
    pub switch_curve: Option<Curve>,
}

impl SimArgs {
    /// The defaults, as the command line gives them.
    pub fn defaults() -> SimArgs {
        SimArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            tpot_curve: Curve::reference(),
            ttft_ms: 50.0,
            prefill_ms_per_token: 0.0,
            prefix_cache_tokens: None,
            max_batch: None,
            max_tokens: 128,
            tokens_per_chunk: 1,
            usage: UsageMode::Auto,
            model: "tokentap-sim".into(),
            dialect: SimDialect::Openai,
            switch_after: None,
            switch_curve: None,
        }
    }
}

/// A simulator serving on a bound listener.
pub struct Sim {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    task: tokio::task::JoinHandle<()>,
}

impl Sim {
    /// Binds `args.listen` (port 0 picks a free port) and serves on the current runtime.
    pub async fn start(args: SimArgs) -> std::io::Result<Sim> {
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        let addr = listener.local_addr()?;
        let switch = args.switch_after.zip(args.switch_curve.clone());
        let engine = Engine::start(args);
        if let Some((after, curve)) = switch {
            let e = Arc::clone(&engine);
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_secs_f64(after.max(0.0))).await;
                e.set_curve(curve);
            });
        }
        let task = tokio::spawn(http::serve(listener, Arc::clone(&engine)));
        Ok(Sim { addr, engine, task })
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.task.abort();
        self.engine.shutdown();
    }
}

/// `tokentap sim`: serves until Ctrl-C.
pub fn run_blocking(args: SimArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let curve = args.tpot_curve.to_string();
        let (api, paths) = args.dialect.describe();
        let sim = Sim::start(args).await?;
        eprintln!(
            "tokentap sim: the {api} API on http://{} (POST {paths}; GET /v1/models), decode step by batch size {curve} ms; GET /sim/stats for its own figures",
            sim.addr
        );
        tokio::signal::ctrl_c().await?;
        Ok(())
    })
}
