//! `tokentap demo`: two simulated backends with different batching curves, the proxy in
//! front of them with a 50/50 split, and a load generator stepping through concurrency
//! levels — with the live figures printed every second and the concurrency→TPOT curve of
//! each upstream at the end. Needs no config and no GPU.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use tokio::sync::watch;

use crate::admin::UpstreamReport;
use crate::config::Config;
use crate::load::{self, LoadArgs, Mode, PhaseReport};
use crate::meter::MeterStats;
use crate::server::Running;
use crate::sim::{Curve, Sim, SimArgs};

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Where the proxy listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Where the admin API listens.
    #[arg(long, default_value = "127.0.0.1:9191")]
    pub admin: SocketAddr,
    /// Total clients per phase, across both backends (each gets about half).
    #[arg(long, value_delimiter = ',', default_value = "2,8,32,128")]
    pub levels: Vec<usize>,
    /// Seconds per phase (default: the duration split evenly, or 10 s).
    #[arg(long)]
    pub phase_secs: Option<f64>,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u64,
}

/// The two simulated backends: a small model that is fast alone but saturates early, and a
/// big-batch deployment that is slower alone but holds its TPOT under load.
const BACKENDS: [(&str, &str); 2] = [
    ("small-fast", "1:12,16:15,64:28,128:50"),
    ("big-batch", "1:22,16:23,64:26,128:31"),
];

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(demo(args))
}

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.levels.is_empty() && !args.levels.contains(&0),
        "--levels must be ≥ 1 each"
    );
    let mut sims = Vec::new();
    for (name, curve) in BACKENDS {
        let sim = Sim::start(SimArgs {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            tpot_curve: curve.parse::<Curve>().map_err(anyhow::Error::msg)?,
            ttft_ms: 40.0,
            max_tokens: args.max_tokens,
            ..SimArgs::defaults()
        })
        .await
        .with_context(|| format!("starting the {name} simulator"))?;
        sims.push((name, curve, sim));
    }
    let config = Config::parse(&demo_config(&args, &sims), "the demo's embedded config")?;
    let window = config.window.as_secs();
    let running = Running::start(config);
    running
        .wait_ready(Duration::from_secs(10))
        .await
        .with_context(|| {
            format!(
                "the proxy did not start on {} / {}",
                args.listen, args.admin
            )
        })?;

    println!("tokentap demo: two simulated backends behind tokentap, split 50/50");
    for (name, curve, sim) in &sims {
        println!(
            "  {name:<11} http://{}  TPOT curve (batch:ms) {curve}",
            sim.addr
        );
    }
    println!("  proxy       http://{}   (try: curl -N http://{}/v1/chat/completions -d '{{\"stream\":true,\"max_tokens\":8}}')", args.listen, args.listen);
    println!(
        "  /stats      http://{}/stats    /metrics http://{}/metrics    window {window} s\n",
        args.admin, args.admin
    );

    let phase = Duration::from_secs_f64(
        args.phase_secs
            .or(args.duration.map(|d| d / args.levels.len() as f64))
            .unwrap_or(10.0)
            .max(1.0),
    );
    let target = LoadArgs {
        duration: phase.as_secs_f64(),
        warmup: 0.0,
        max_tokens: args.max_tokens,
        include_usage: true,
        model: "tokentap-sim".into(),
        prompt: "Tell me about lighthouses.".into(),
        ..LoadArgs::for_url(format!("http://{}", args.listen))
    }
    .target()?;
    let (level_tx, level_rx) = watch::channel(0usize);
    let reports = Arc::new(Mutex::new(Vec::new()));
    let driver = tokio::spawn(drive(
        target,
        args.levels.clone(),
        phase,
        level_tx,
        Arc::clone(&reports),
    ));

    let deadline = args
        .duration
        .map(|d| tokio::time::Instant::now() + Duration::from_secs_f64(d));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let started = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => break,
        }
        let clients = *level_rx.borrow();
        print!("{}", live_table(&running, started.elapsed(), clients));
        if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
            break;
        }
    }
    driver.abort();
    let reports = std::mem::take(&mut *reports.lock().unwrap_or_else(PoisonError::into_inner));

    println!("\nconcurrency→TPOT curve per upstream, measured by tokentap (since start):");
    for s in stats(&running) {
        print!("{}", curve_table(&s.meter));
    }
    if !reports.is_empty() {
        println!("\nthe load generator's own view (client side, both backends together):");
        print!("{}", load::report_table(&reports));
    }
    match crate::admin::compare(&running.shared(), None) {
        Ok(c) => println!("\nA/B verdict (GET /compare): {}", c.verdict),
        Err((_, e)) => println!("\nA/B verdict: {e}"),
    }
    drop(sims);
    tokio::task::spawn_blocking(move || running.stop()).await?;
    Ok(())
}

/// The demo's config: both simulators behind one 50/50 route.
fn demo_config(args: &DemoArgs, sims: &[(&str, &str, Sim)]) -> String {
    let mut c = format!(
        "[listen]\nproxy = \"{}\"\nadmin = \"{}\"\n[metrics]\nwindow_secs = 5\n",
        args.listen, args.admin
    );
    for (name, _, sim) in sims {
        let _ = write!(
            c,
            "[[upstream]]\nname = \"{name}\"\nurl = \"http://{}\"\n",
            sim.addr
        );
    }
    let split: Vec<String> = sims
        .iter()
        .map(|(n, _, _)| format!("\"{n}\" = 50"))
        .collect();
    let _ = write!(
        c,
        "[[route]]\npath_prefix = \"/\"\nsplit = {{ {} }}\n",
        split.join(", ")
    );
    c
}

/// Steps through the levels, round and round, reporting which one runs.
async fn drive(
    target: Arc<load::Target>,
    levels: Vec<usize>,
    phase: Duration,
    level: watch::Sender<usize>,
    reports: Arc<Mutex<Vec<PhaseReport>>>,
) {
    for &c in levels.iter().cycle() {
        let _ = level.send(c);
        let r = load::phase(
            &target,
            Mode::Closed { concurrency: c },
            Duration::ZERO,
            phase,
            false,
        )
        .await;
        reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(r);
    }
}

fn stats(running: &Running) -> Vec<UpstreamReport> {
    crate::admin::stats(&running.shared(), &running.transport).upstreams
}

fn f(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

fn live_table(running: &Running, elapsed: Duration, clients: usize) -> String {
    let mut out = format!(
        "t={:>3}s  {clients} clients  {:<11} {:>9} {:>6} {:>12} {:>11} {:>16} {:>9}\n",
        elapsed.as_secs(),
        "upstream",
        "in-flight",
        "conc",
        "1-stream T/s",
        "system T/s",
        "TPOT p50/p90 ms",
        "TTFT p50"
    );
    for s in stats(running) {
        let s = &s.meter;
        let _ = writeln!(
            out,
            "{:>22}{:<11} {:>9} {:>6} {:>12} {:>11} {:>16} {:>9}",
            "",
            s.name,
            s.in_flight,
            f(s.concurrency, 1),
            f(s.single_stream_tps, 1),
            f(s.system_tps, 0),
            format!("{}/{}", f(s.tpot_ms.p50, 1), f(s.tpot_ms.p90, 1)),
            f(s.ttft_ms.p50, 0),
        );
    }
    out
}

/// One upstream's curve as a table like DESIGN §1's.
pub fn curve_table(s: &MeterStats) -> String {
    let mut out = format!(
        "\n{}\n{:>12} {:>10} {:>10} {:>14} {:>12} {:>9}\n",
        s.name, "concurrency", "TPOT p50", "TPOT p90", "1-stream T/s", "system T/s", "samples"
    );
    for p in &s.curve {
        let _ = writeln!(
            out,
            "{:>12} {:>10} {:>10} {:>14} {:>12} {:>9}",
            format!("≤{}", p.concurrency),
            f(p.tpot_ms_p50, 1),
            f(p.tpot_ms_p90, 1),
            f(p.single_stream_tps, 1),
            f(p.system_tps, 0),
            p.samples
        );
    }
    out
}
