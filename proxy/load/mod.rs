//! `tokentap load`: a load generator that measures from the client side.
//!
//! Closed loop (`--concurrency 1,16,64`: one phase per level, each worker on its own
//! keep-alive connection sending the next request when the last one ends) or open loop
//! (`--rate R`: Poisson arrivals). Per phase: TTFT, TPOT (vLLM's definition, from requests
//! that finished inside the measured window), ITL, single-stream T/s (1000 / mean TPOT) and
//! system T/s (tokens that arrived inside the measured window / its length), errors by kind.
//!
//! It stands apart from the proxy like any client: it reads the stream with its own JSON
//! handling and shares only the SSE framing helper.

mod client;
mod plot;
mod report;
pub mod workload;

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use clap::Args;

use crate::sim::SimDialect;

pub use client::{run_phase as phase, run_phase_with as phase_with, Options, Target};
pub use plot::svg as plot_svg;
pub use report::{table as report_table, LoadGoodput, PhaseReport, RequestRecord, Slo};

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// Base URL of the server (or of tokentap in front of it); http only.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// The API to speak: it sets the request body, how tokens are read from the stream, and
    /// the default path.
    #[arg(long, value_enum, default_value_t = SimDialect::Openai)]
    pub dialect: SimDialect,
    /// Request path (default: the dialect's own, e.g. /v1/chat/completions).
    #[arg(long)]
    pub path: Option<String>,
    /// Closed-loop concurrency levels: one phase per level.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub concurrency: Vec<usize>,
    /// Open loop instead: Poisson arrivals at this many requests per second.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Measured seconds per phase.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Seconds of load before each phase's measurement starts.
    #[arg(long, default_value_t = 5.0)]
    pub warmup: f64,
    /// `max_tokens` of each request.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u64,
    /// Ask for the usage chunk (`stream_options.include_usage`): exact token counts.
    #[arg(long)]
    pub include_usage: bool,
    /// Extra request header, `K:V` (repeatable), e.g. `--header "Authorization: Bearer sk-…"`.
    #[arg(long = "header", value_name = "K:V")]
    pub headers: Vec<String>,
    /// The model name sent.
    #[arg(long, default_value = "tokentap-sim")]
    pub model: String,
    /// The prompt sent.
    #[arg(
        long,
        default_value = "Tell me a long story about a lighthouse keeper."
    )]
    pub prompt: String,
    /// A shared-prefix workload instead of one prompt: N system prompts, each opening
    /// conversations (`--turns`), drawn by `--popularity`.
    #[arg(long, value_name = "N")]
    pub shared_prefixes: Option<usize>,
    /// Words of each shared system prompt (about 1.3 tokens each).
    #[arg(
        long,
        value_name = "W",
        default_value_t = 1200,
        requires = "shared_prefixes"
    )]
    pub prefix_words: usize,
    /// How the system prompts are drawn: uniform, zipf (1 / k) or zipf:S (1 / k^S).
    #[arg(long, default_value = "uniform", requires = "shared_prefixes")]
    pub popularity: workload::Popularity,
    /// Requests of each conversation: each sends the history so far back with its next
    /// question (closed loop: one conversation a client; open loop: arrivals go on with
    /// 256 conversations).
    #[arg(long, default_value_t = 1, requires = "shared_prefixes")]
    pub turns: u32,
    /// One JSON object per phase on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Judge each request as `vllm bench serve --goodput` does: `ttft:MS,tpot:MS,e2e:MS`
    /// (any of them; `attainment:PCT`, default 90, marks the SLO-bounded phase). Adds
    /// goodput and attainment to each phase.
    #[arg(long, value_name = "ttft:MS,tpot:MS,e2e:MS")]
    pub slo: Option<Slo>,
    /// Write one JSON line per request that ended inside a measured window to FILE: its
    /// phase, outcome, TTFT, TPOT, e2e latency and output tokens.
    #[arg(long, value_name = "FILE")]
    pub records: Option<std::path::PathBuf>,
    /// Seconds the requests still running when a phase's window ends may go on to finish
    /// (none is sent after it); 0 cuts them at the end. With `--records`, those that
    /// finish are recorded too (`after_window`), as `vllm bench serve` waits for every
    /// request it sent.
    #[arg(long, default_value_t = 0.0)]
    pub drain: f64,
    /// Draw single-stream and system T/s against concurrency (two axes) as an SVG to
    /// FILE, the SLO-bounded phase marked with `--slo`; closed loop only.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<std::path::PathBuf>,
}

impl LoadArgs {
    /// The command line's defaults, aimed at `url`.
    pub fn for_url(url: impl Into<String>) -> LoadArgs {
        LoadArgs {
            url: url.into(),
            dialect: SimDialect::Openai,
            path: None,
            concurrency: vec![1],
            rate: None,
            duration: 30.0,
            warmup: 5.0,
            max_tokens: 128,
            include_usage: false,
            headers: vec![],
            model: "tokentap-sim".into(),
            prompt: "Tell me a long story about a lighthouse keeper.".into(),
            shared_prefixes: None,
            prefix_words: 1200,
            popularity: workload::Popularity::Uniform,
            turns: 1,
            json: false,
            slo: None,
            records: None,
            drain: 0.0,
            plot: None,
        }
    }

    /// The request target these arguments describe.
    pub fn target(&self) -> anyhow::Result<Arc<Target>> {
        let uri: http::Uri = self
            .url
            .parse()
            .with_context(|| format!("`{}` is not a URL", self.url))?;
        if uri.scheme_str() != Some("http") {
            bail!("`{}`: the load generator speaks plain http only", self.url);
        }
        let host = uri.host().context("the URL has no host")?;
        let port = uri.port_u16().unwrap_or(80);
        let addr: SocketAddr = (host.trim_start_matches('[').trim_end_matches(']'), port)
            .to_socket_addrs()
            .with_context(|| format!("cannot resolve {host}"))?
            .next()
            .context("the host resolves to no address")?;
        let mut headers = Vec::new();
        for h in &self.headers {
            let (k, v) = h
                .split_once(':')
                .with_context(|| format!("`{h}` is not K:V"))?;
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
        let path = self
            .path
            .clone()
            .unwrap_or_else(|| client::default_path(self.dialect).to_owned());
        let shape = workload::Shape {
            dialect: self.dialect,
            path: path.clone(),
            model: self.model.clone(),
            max_tokens: self.max_tokens,
            include_usage: self.include_usage,
        };
        let workload = match self.shared_prefixes {
            Some(0) => bail!("--shared-prefixes must be at least 1"),
            Some(n) if n > 100_000 => bail!("--shared-prefixes must be at most 100000"),
            Some(_) if self.prefix_words == 0 || self.prefix_words > 100_000 => {
                bail!("--prefix-words must be between 1 and 100000")
            }
            Some(_) if self.turns == 0 || self.turns > 1000 => {
                bail!("--turns must be between 1 and 1000")
            }
            Some(n) => workload::Workload::Shared(workload::Shared::new(
                shape,
                n,
                self.prefix_words,
                self.popularity,
                self.turns,
            )),
            None => {
                let one = [workload::Message {
                    role: "user",
                    text: self.prompt.clone(),
                }];
                workload::Workload::One(Bytes::from(workload::body(&shape, &one).to_string()))
            }
        };
        Ok(Arc::new(Target {
            addr,
            host: match uri.port_u16() {
                Some(p) => format!("{host}:{p}"),
                None => host.to_owned(),
            },
            path,
            dialect: self.dialect,
            headers,
            workload,
        }))
    }
}

/// How a phase drives load.
#[derive(Debug, Clone, Copy)]
pub enum Mode {
    Closed { concurrency: usize },
    Open { rate: f64 },
}

/// `tokentap load`.
pub fn run_blocking(args: LoadArgs) -> anyhow::Result<()> {
    let target = args.target()?;
    if !(args.duration.is_finite()
        && args.duration > 0.0
        && args.warmup.is_finite()
        && args.warmup >= 0.0)
    {
        bail!("--duration must be a number of seconds > 0 and --warmup one ≥ 0");
    }
    let modes: Vec<Mode> = match args.rate {
        Some(rate) if rate.is_finite() && rate > 0.0 => vec![Mode::Open { rate }],
        Some(_) => bail!("--rate must be > 0"),
        None if args.concurrency.contains(&0) => {
            bail!("--concurrency levels must be ≥ 1")
        }
        None => args
            .concurrency
            .iter()
            .map(|&c| Mode::Closed { concurrency: c })
            .collect(),
    };
    if args.plot.is_some() && args.rate.is_some() {
        bail!("--plot draws T/s against concurrency: give --concurrency levels, not --rate");
    }
    // Opened before the load, so that a bad path fails at once.
    let mut records = match &args.records {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot write --records {}", path.display()))?,
        )),
        None => None,
    };
    let rt = tokio::runtime::Runtime::new()?;
    let warmup = Duration::from_secs_f64(args.warmup);
    let duration = Duration::from_secs_f64(args.duration);
    if !(args.drain.is_finite() && args.drain >= 0.0) {
        bail!("--drain must be a number of seconds ≥ 0");
    }
    let options = client::Options {
        slo: args.slo,
        records: records.is_some(),
        progress: !args.json,
        drain: Duration::from_secs_f64(args.drain),
    };
    let mut reports = Vec::new();
    rt.block_on(async {
        for mode in modes {
            let (r, recs) = client::run_phase_with(&target, mode, warmup, duration, &options).await;
            if args.json {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            } else {
                eprintln!("{}", r.one_line());
            }
            if let Some(out) = records.as_mut() {
                use std::io::Write as _;
                for rec in &recs {
                    writeln!(out, "{}", serde_json::to_string(rec).unwrap_or_default())?;
                }
            }
            reports.push(r);
        }
        anyhow::Ok(())
    })?;
    if let Some(mut out) = records {
        use std::io::Write as _;
        out.flush()?;
    }
    if !args.json {
        println!("{}", report::table(&reports));
    }
    if let Some(path) = &args.plot {
        let svg = plot::svg(&reports, args.slo.as_ref());
        std::fs::write(path, svg)
            .with_context(|| format!("cannot write --plot {}", path.display()))?;
        if !args.json {
            println!("plot: {}", path.display());
        }
    }
    Ok(())
}
