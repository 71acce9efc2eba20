//! The batching table end to end: `tokentap sim` (the reference curve, 128-token replies)
//! behind tokentap, driven by the load generator at 1, 16 and 64 clients; prints the load
//! generator's client-side figures beside tokentap's `/stats` for each level.
//!
//! Run: `cargo run --release --example sweep` (about 70 s)
//! While it runs: `curl http://<admin>/stats` (the address is printed).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use tokentap::config::Config;
use tokentap::load::{self, LoadArgs, Mode};
use tokentap::server::Running;
use tokentap::sim::{Sim, SimArgs};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse()?,
        ..SimArgs::defaults()
    })
    .await?;
    let free = || std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr());
    let (proxy, admin) = (free()?, free()?);
    let config = Config::parse(
        &format!("[listen]\nproxy = \"{proxy}\"\nadmin = \"{admin}\"\n[metrics]\nwindow_secs = 10\n[[upstream]]\nname = \"sim\"\nurl = \"http://{}\"\n", sim.addr),
        "sweep",
    )?;
    let running = Running::start(config);
    running.wait_ready(Duration::from_secs(10)).await?;
    println!(
        "sim http://{}  proxy http://{proxy}  admin http://{admin}/stats",
        sim.addr
    );
    let target = LoadArgs {
        duration: 15.0,
        warmup: 5.0,
        max_tokens: 128,
        include_usage: true,
        model: "m".into(),
        prompt: "p".into(),
        ..LoadArgs::for_url(format!("http://{proxy}"))
    }
    .target()?;
    println!(
        "{:>5} | {:>22} | {:>22} | {:>22}",
        "conc", "TPOT p50 ms load/tap", "1-stream T/s load/tap", "system T/s load/tap"
    );
    for c in [1, 16, 64] {
        let t = target.clone();
        let phase = tokio::spawn(async move {
            load::phase(
                &t,
                Mode::Closed { concurrency: c },
                Duration::from_secs(5),
                Duration::from_secs(15),
                false,
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(19_900)).await;
        let s = tokentap::admin::stats(&running.shared(), &running.transport)
            .upstreams
            .remove(0)
            .meter;
        let r = phase.await?;
        let f = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
        println!(
            "{c:>5} | {:>22} | {:>22} | {:>22}",
            format!("{}/{}", f(r.tpot_ms.p50), f(s.tpot_ms.p50)),
            format!("{}/{}", f(r.single_stream_tps), f(s.single_stream_tps)),
            format!("{}/{}", f(r.system_tps), f(s.system_tps)),
        );
    }
    let s = tokentap::admin::stats(&running.shared(), &running.transport)
        .upstreams
        .remove(0)
        .meter;
    print!("{}", tokentap::demo::curve_table(&s));
    tokio::task::spawn_blocking(move || running.stop()).await?;
    Ok(())
}
