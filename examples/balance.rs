//! `least_loaded`, `consistent_hash` and `prefix` side by side on one shared-prefix
//! workload: four simulated replicas, each with a prefix cache holding about a quarter of
//! 16 system prompts of 1,200 words, a miss prefilled on its one serial prefill unit; 24
//! closed-loop clients of `tokentap load`'s shared-prefix workload (uniform or Zipf, turns
//! of growing history). Per balance: requests, TTFT p50/p90, system T/s, the replicas'
//! own cache hit rate and tokentap's, from usage.
//!
//! Run: `cargo run --release --example balance` (about 2 minutes);
//! `-- --popularity zipf --turns 4 --secs 20` for another workload.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tokentap::config::Config;
use tokentap::load::workload::Popularity;
use tokentap::load::{self, LoadArgs, Mode};
use tokentap::server::Running;
use tokentap::sim::{Sim, SimArgs};

const PROMPTS: usize = 16;
const WORDS: usize = 1200;
const REPLICAS: usize = 4;
const CLIENTS: usize = 24;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut popularity = Popularity::Uniform;
    let (mut turns, mut secs) = (1u32, 30.0f64);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_default();
        match a.as_str() {
            "--popularity" => popularity = v.parse().map_err(anyhow::Error::msg)?,
            "--turns" => turns = v.parse()?,
            "--secs" => secs = v.parse()?,
            _ => anyhow::bail!(
                "usage: balance [--popularity uniform|zipf[:S]] [--turns N] [--secs S]"
            ),
        }
    }
    // A system prompt's tokens as the simulator counts them (4 bytes a token), so that each
    // replica's cache holds about a quarter of them (and a conversation's own turns).
    let prompt_tokens = tokentap::load::workload::words(0, WORDS).len() as u64 / 4;
    println!(
        "{REPLICAS} replicas caching ~{prompt_tokens}×5 tokens each, {PROMPTS} shared prompts of {WORDS} words ({popularity:?}, {turns} turn(s)), {CLIENTS} clients, {secs} s each\n"
    );
    println!(
        "{:<42} {:>8} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "balance", "requests", "TTFT p50", "TTFT p90", "T/s", "hit (sims)", "hit (tap)"
    );
    for balance in [
        "least_loaded",
        "consistent_hash:header:x-conversation-id",
        "prefix",
    ] {
        let mut sims = Vec::new();
        for _ in 0..REPLICAS {
            sims.push(
                Sim::start(SimArgs {
                    listen: "127.0.0.1:0".parse()?,
                    tpot_curve: "1:5".parse().map_err(anyhow::Error::msg)?,
                    ttft_ms: 5.0,
                    prefix_cache_tokens: Some(5 * prompt_tokens),
                    prefill_ms_per_token: 0.02,
                    ..SimArgs::defaults()
                })
                .await?,
            );
        }
        let free = || std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr());
        let (proxy, admin) = (free()?, free()?);
        let endpoints: Vec<String> = sims
            .iter()
            .map(|s| format!("\"http://{}\"", s.addr))
            .collect();
        let config = Config::parse(
            &format!(
                "[listen]\nproxy = \"{proxy}\"\nadmin = \"{admin}\"\n\
                 [[upstream]]\nname = \"pool\"\nendpoints = [{}]\nbalance = \"{balance}\"\n\
                 max_concurrency = 12\nmax_queue = 1000\n",
                endpoints.join(", ")
            ),
            "balance example",
        )?;
        let running = Running::start(config);
        running.wait_ready(Duration::from_secs(10)).await?;
        let target = LoadArgs {
            max_tokens: 8,
            include_usage: true,
            model: "m".into(),
            shared_prefixes: Some(PROMPTS),
            prefix_words: WORDS,
            popularity,
            turns,
            ..LoadArgs::for_url(format!("http://{proxy}"))
        }
        .target()?;
        let r = load::phase(
            &target,
            Mode::Closed {
                concurrency: CLIENTS,
            },
            Duration::from_secs(3),
            Duration::from_secs_f64(secs),
            false,
        )
        .await;
        let (prompt, cached) = sims.iter().fold((0, 0), |(p, c), s| {
            let st = s.engine.stats();
            (p + st.prompt_tokens, c + st.cached_prompt_tokens)
        });
        let s = tokentap::admin::stats(&running.shared(), &running.transport);
        let u = &s.upstreams[0];
        let m = &u.meter;
        let ours = 100.0 * m.cached_input_tokens_total as f64 / m.input_tokens_total.max(1) as f64;
        println!(
            "{balance:<42} {:>8} {:>8.0}ms {:>8.0}ms {:>10.0} {:>11.1}% {:>11.1}%",
            r.requests,
            r.ttft_ms.p50.unwrap_or(f64::NAN),
            r.ttft_ms.p90.unwrap_or(f64::NAN),
            r.system_tps.unwrap_or(0.0),
            100.0 * cached as f64 / prompt.max(1) as f64,
            ours,
        );
        if !r.errors.is_empty() {
            println!("  errors: {:?}", r.errors);
        }
        running.stop();
    }
    Ok(())
}
