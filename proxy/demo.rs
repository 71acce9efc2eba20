//! `tokentap demo`: two simulated backends with different batching curves, the proxy in
//! front of them with a 50/50 split and an adaptive cap on one, and a load generator
//! stepping through concurrency levels once (48 s by default). While it runs: `top`'s view
//! of its own admin API (redrawn in place on a terminal, a line a second otherwise) and the
//! dashboard; at the end, every phase, each upstream's curve, the SLO held and the A/B
//! verdict. Needs no config and no GPU.

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
use crate::top;

#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Seconds the demo runs: the levels once in the default 48 s (12 s each); a longer run
    /// goes round them again.
    #[arg(long, default_value_t = 48.0)]
    pub duration: f64,
    /// Where the proxy listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Where the admin API (and the dashboard) listens.
    #[arg(long, default_value = "127.0.0.1:9191")]
    pub admin: SocketAddr,
    /// Total clients per phase, across both backends (each gets about half).
    #[arg(long, value_delimiter = ',', default_value = "2,8,32,128")]
    pub levels: Vec<usize>,
    /// Seconds per load level.
    #[arg(long, default_value_t = 12.0)]
    pub phase_secs: f64,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u64,
}

/// The two simulated backends: a small model that is fast alone but saturates early, and a
/// big-batch deployment that is slower alone but holds its TPOT under load, served by a
/// pool of three replicas (one of which is killed for part of a phase, and restarted).
const BACKENDS: [(&str, &str, usize); 2] = [
    ("small-fast", "1:12,16:15,64:28,128:50", 1),
    ("big-batch", "1:22,16:23,64:26,128:31", 3),
];
/// small-fast's adaptive cap holds this TPOT p90, ms: met up to ~40 in flight on its curve,
/// so the 128-client phase makes it cap and queue.
const SLO_TPOT_MS: f64 = 20.0;
/// What each backend is told it is, for cost per token and the roofline: a 32B model in
/// FP8 on one H100 SXM at $2.50 an hour (a 105 T/s roofline), and a 70B one in FP8 on an
/// H200 a replica, three at $3.50 each (68 T/s). Both are judged against TTFT ≤ 500 ms
/// (small-fast's queue breaks it in the 128-client phase) and big-batch against e2e ≤ 2 s.
const ECONOMICS: [&str; 2] = [
    "cost_per_hour = 2.5\ncost_currency = \"USD\"\ngpus = 1\n\
     model = { params_b = 32, bytes_per_param = 1 }\ngpu = \"h100-sxm\"\n",
    "cost_per_hour = 10.5\ncost_currency = \"USD\"\ngpus = 3\n\
     model = { weight_gb = 70.6 }\ngpu = \"h200\"\n",
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
    anyhow::ensure!(
        args.duration.is_finite() && args.duration >= 1.0,
        "--duration must be at least 1 second"
    );
    let mut sims = Vec::new();
    for (name, curve, replicas) in BACKENDS {
        let mut pool = Vec::new();
        for _ in 0..replicas {
            let sim = start_sim(
                curve,
                SocketAddr::from(([127, 0, 0, 1], 0)),
                args.max_tokens,
            )
            .await
            .with_context(|| format!("starting the {name} simulator"))?;
            pool.push(sim);
        }
        sims.push((name, curve, pool));
    }
    let config = Config::parse(&demo_config(&args, &sims), "the demo's embedded config")?;
    let window = config.window.as_secs();
    for addr in [args.listen, args.admin] {
        crate::server::can_listen(addr).with_context(|| {
            format!(
                "cannot listen on {addr} (another demo running? --listen/--admin choose others)"
            )
        })?;
    }
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

    anyhow::ensure!(
        args.phase_secs.is_finite() && args.phase_secs >= 1.0,
        "--phase-secs must be at least 1 second"
    );
    let phase = Duration::from_secs_f64(args.phase_secs.min(args.duration));
    let phases = ((args.duration / phase.as_secs_f64()).round() as usize).max(1);
    println!("tokentap demo: two simulated backends behind tokentap, split 50/50");
    for (name, curve, pool) in &sims {
        let urls: Vec<String> = pool.iter().map(|s| format!("http://{}", s.addr)).collect();
        let what = if pool.len() > 1 {
            " (a pool: least loaded, health checked every second)"
        } else {
            ""
        };
        println!("  {name:<11} {}{what}", urls.join(" "));
        println!("  {:<11} TPOT curve (batch:ms) {curve}", "");
    }
    println!(
        "  small-fast has an adaptive cap holding TPOT p90 ≤ {SLO_TPOT_MS} ms ([upstream.slo])"
    );
    println!("  proxy       http://{}   (try: curl -N http://{}/v1/chat/completions -d '{{\"stream\":true,\"max_tokens\":8}}')", args.listen, args.listen);
    println!(
        "  dashboard   http://{}/   (tokentap top --admin http://{} in another terminal)",
        args.admin, args.admin
    );
    println!(
        "  /stats      http://{}/stats    /metrics http://{}/metrics    window {window} s",
        args.admin, args.admin
    );
    println!(
        "  load        {phases} phases of {:.0} s: {} clients\n",
        phase.as_secs_f64(),
        args.levels
            .iter()
            .cycle()
            .take(phases)
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );

    let target = LoadArgs {
        duration: phase.as_secs_f64(),
        warmup: 0.0,
        max_tokens: args.max_tokens,
        include_usage: true,
        model: "tokentap-sim".into(),
        prompt: "Tell me about lighthouses.".into(),
        headers: vec![format!("x-tenant: {DEMO_TENANT}")],
        ..LoadArgs::for_url(format!("http://{}", args.listen))
    }
    .target()?;
    let (note_tx, note) = watch::channel(String::new());
    let (stop_tx, stop) = watch::channel(false);
    let reports = Arc::new(Mutex::new(Vec::new()));
    // The last replica of the pool is killed a quarter into the second-to-last phase and
    // started again at three quarters: ejected at once, its requests failing over, back
    // after its next health check.
    let chaos = sims
        .iter_mut()
        .find(|(_, _, pool)| pool.len() > 1)
        .zip((phases >= 2).then(|| phases - 2))
        .and_then(|((name, curve, pool), at_phase)| {
            let sim = pool.pop()?;
            println!(
                "  in phase {}, replica http://{} of {name} is killed, then started again\n",
                at_phase + 1,
                sim.addr
            );
            Some(Chaos {
                upstream: name,
                curve,
                addr: sim.addr,
                max_tokens: args.max_tokens,
                at_phase,
                sim: Some(sim),
            })
        });
    // The figures of the last phase's last second, taken before its end cuts the requests
    // still running (each would count as an abandoned request).
    let last = Arc::new(Mutex::new(Vec::new()));
    let snapshot = {
        let (live, transport, last) = (
            Arc::clone(&running.live),
            Arc::clone(&running.transport),
            Arc::clone(&last),
        );
        move || {
            let now = crate::admin::stats(&live.load(), &transport).upstreams;
            *last.lock().unwrap_or_else(PoisonError::into_inner) = now;
        }
    };
    let driver = tokio::spawn(drive(
        target,
        args.levels.iter().copied().cycle().take(phases).collect(),
        phase,
        (note_tx, stop_tx),
        Arc::clone(&reports),
        chaos,
        snapshot,
    ));
    let token = std::env::var(crate::config::ADMIN_TOKEN_ENV).ok();
    let source = top::Source::parse(&args.admin.to_string(), token)?;
    top::show("tokentap demo", top::client_watch(source), note, stop).await?;
    driver.abort();
    let mut ups = std::mem::take(&mut *last.lock().unwrap_or_else(PoisonError::into_inner));
    if ups.is_empty() {
        ups = stats(&running);
    }
    let reports = std::mem::take(&mut *reports.lock().unwrap_or_else(PoisonError::into_inner));

    println!("\nconcurrency→TPOT curve per upstream, measured by tokentap (since start):");
    for s in &ups {
        print!("{}", curve_table(&s.meter));
    }
    for u in &ups {
        print!("{}", decisions(u));
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

/// What the figures decide for one upstream, at the end: the SLO and its goodput, cost per
/// token, the roofline, the endpoints needed.
fn decisions(u: &UpstreamReport) -> String {
    let mut out = String::new();
    let name = &u.meter.name;
    let window = "over the last window";
    if let Some(slo) = &u.slo {
        let met = match slo.met {
            Some(true) => "met",
            Some(false) => "missed",
            None => "no traffic",
        };
        if slo.tpot_ms.is_some() {
            let tick = match slo.current_tpot_ms.zip(slo.tpot_ms) {
                Some((now, slo)) if now <= slo => "met",
                Some(_) => "missed",
                None => "no traffic",
            };
            let _ = writeln!(
                out,
                "\n{name}: the adaptive cap holds TPOT p{} ≤ {} ms: cap now {}, TPOT p{} of the last second {} ms ({tick})",
                slo.percentile,
                f(slo.tpot_ms, 0),
                u.limit.map_or_else(|| "-".into(), |l| l.to_string()),
                slo.percentile,
                f(slo.current_tpot_ms, 1),
            );
        } else {
            let _ = writeln!(out, "\n{name}:");
        }
        let set: Vec<String> = [
            ("TTFT", slo.ttft_ms),
            ("TPOT", slo.tpot_ms),
            ("e2e", slo.e2e_ms),
        ]
        .iter()
        .filter_map(|(n, v)| v.map(|v| format!("{n} ≤ {v} ms")))
        .collect();
        if let Some(g) = &u.meter.goodput {
            let _ = writeln!(
                out,
                "  goodput ({}) {window}: {} req/s, {}% of requests good ({met} against {}%)",
                set.join(", "),
                f(g.requests_per_sec, 1),
                f(g.attainment_pct, 0),
                slo.attainment_pct
            );
        }
    }
    if let Some(c) = &u.cost {
        let unit = c.currency.as_deref().unwrap_or("");
        let _ = writeln!(
            out,
            "  cost: {} {unit} per million output tokens now, {} at the SLO-bounded load ({} T/s on its endpoints)",
            f(c.per_million_output_tokens, 3),
            f(c.per_million_at_slo_bounded, 3),
            f(c.pool_slo_bounded_system_tps, 0),
        );
    }
    if let Some(r) = &u.roofline {
        let gpu = r.gpu.as_deref().unwrap_or("its GPU");
        let mbu = match (&r.problem, r.mbu_pct, r.mbu_at_concurrency) {
            (Some(p), ..) => p.clone(),
            (None, Some(m), Some(c)) => format!("MBU {m:.0}% at {c} in flight"),
            _ => "MBU: no supported curve point yet".into(),
        };
        let _ = writeln!(
            out,
            "  roofline: {:.1} GB on {gpu}: {:.1} T/s a stream at most; {mbu}",
            r.weight_gb, r.single_stream_ceiling_tps
        );
    }
    let c = &u.capacity;
    match (c.endpoints_needed, &c.reason) {
        (Some(n), _) => {
            let _ = writeln!(
                out,
                "  capacity: demand {} T/s ({}), {} T/s an endpoint within the SLO ({}): {n} endpoints needed with {}% headroom, {} now: {}",
                f(c.demand_tps, 0),
                c.demand_from.unwrap_or("-").replace('_', " "),
                f(c.slo_bounded_tps_per_endpoint, 0),
                c.basis.unwrap_or("-"),
                c.headroom_pct,
                c.endpoints_now,
                c.advice.as_deref().unwrap_or("-")
            );
        }
        (None, Some(why)) => {
            let _ = writeln!(out, "  capacity: {why}");
        }
        (None, None) => {}
    }
    out
}

/// The tenant the demo's clients send as (`x-tenant`).
const DEMO_TENANT: &str = "demo-clients";

/// The demo's config: both backends behind one 50/50 route, an SLO on the first, the
/// second a pool with health checks.
fn demo_config(args: &DemoArgs, sims: &[(&str, &str, Vec<Sim>)]) -> String {
    let mut c = format!(
        "[listen]\nproxy = \"{}\"\nadmin = \"{}\"\n[metrics]\nwindow_secs = 5\nmodel_label = true\n",
        args.listen, args.admin
    );
    for (i, (name, _, pool)) in sims.iter().enumerate() {
        let urls: Vec<String> = pool
            .iter()
            .map(|s| format!("\"http://{}\"", s.addr))
            .collect();
        let _ = write!(
            c,
            "[[upstream]]\nname = \"{name}\"\nendpoints = [{}]\n",
            urls.join(", ")
        );
        c.push_str(ECONOMICS[i % ECONOMICS.len()]);
        if i == 0 {
            let _ = write!(
                c,
                "[upstream.slo]\ntpot_ms = {SLO_TPOT_MS}\npercentile = 90\nttft_ms = 500\n"
            );
        } else {
            let _ = write!(c, "[upstream.slo]\nttft_ms = 500\ne2e_ms = 2000\n");
        }
        if pool.len() > 1 {
            let _ = write!(c, "[upstream.health]\nevery_secs = 1\n");
        }
    }
    // Who each request belongs to, for the tenants' figures (the demo's clients are one).
    c.push_str("[tenants]\nkey = \"header:x-tenant\"\n");
    let split: Vec<String> = sims
        .iter()
        .map(|(n, _, _)| format!("\"{n}\" = 50"))
        .collect();
    let _ = write!(
        c,
        "[[route]]\nname = \"demo\"\npath_prefix = \"/\"\nsplit = {{ {} }}\n",
        split.join(", ")
    );
    c
}

async fn start_sim(curve: &str, listen: SocketAddr, max_tokens: u64) -> anyhow::Result<Sim> {
    Ok(Sim::start(SimArgs {
        listen,
        tpot_curve: curve.parse::<Curve>().map_err(anyhow::Error::msg)?,
        ttft_ms: 40.0,
        max_tokens,
        ..SimArgs::defaults()
    })
    .await?)
}

/// A replica of a pool killed for part of a phase.
struct Chaos {
    upstream: &'static str,
    curve: &'static str,
    addr: SocketAddr,
    max_tokens: u64,
    at_phase: usize,
    sim: Option<Sim>,
}

impl Chaos {
    /// Kills or restarts the replica as `into` (the share of phase `phase` done) says; what
    /// the view should say of it.
    async fn step(&mut self, phase: usize, into: f64) -> Option<String> {
        if phase != self.at_phase {
            return None;
        }
        let (up, addr) = (self.upstream, self.addr);
        if into < 0.25 {
            None
        } else if into < 0.75 {
            self.sim.take(); // killed: its listener and connections closed
            Some(format!(
                "  — replica {addr} of {up} killed: ejected, its requests fail over"
            ))
        } else {
            if self.sim.is_none() {
                self.sim = start_sim(self.curve, addr, self.max_tokens).await.ok();
            }
            Some(format!(
                "  — replica {addr} of {up} started again: back after its health check"
            ))
        }
    }
}

/// Runs the phases in turn, saying which one runs; stops the view after the last.
async fn drive(
    target: Arc<load::Target>,
    phases: Vec<usize>,
    phase: Duration,
    (note, stop): (watch::Sender<String>, watch::Sender<bool>),
    reports: Arc<Mutex<Vec<PhaseReport>>>,
    mut chaos: Option<Chaos>,
    snapshot: impl Fn() + Send,
) {
    let started = tokio::time::Instant::now();
    let total = phases.len();
    for (i, &c) in phases.iter().enumerate() {
        let say = |elapsed: Duration| {
            format!(
                "t={:>2}s  phase {}/{total}: {c} clients",
                elapsed.as_secs(),
                i + 1
            )
        };
        let _ = note.send(say(started.elapsed()));
        let phase_start = tokio::time::Instant::now();
        let run = load::phase(
            &target,
            Mode::Closed { concurrency: c },
            Duration::ZERO,
            phase,
            false,
        );
        tokio::pin!(run);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let r = loop {
            tokio::select! {
                r = &mut run => break r,
                _ = tick.tick() => {
                    let into = phase_start.elapsed().as_secs_f64() / phase.as_secs_f64();
                    let event = match chaos.as_mut() {
                        Some(c) => c.step(i, into).await,
                        None => None,
                    };
                    let _ = note.send(say(started.elapsed()) + event.as_deref().unwrap_or(""));
                    if i + 1 == total {
                        snapshot();
                    }
                }
            }
        };
        reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(r);
    }
    let _ = stop.send(true);
}

fn stats(running: &Running) -> Vec<UpstreamReport> {
    crate::admin::stats(&running.shared(), &running.transport).upstreams
}

fn f(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

/// One upstream's curve as a table like the reference table (`sim::Curve::reference`).
pub fn curve_table(s: &MeterStats) -> String {
    let mut out = format!(
        "\n{}\n{:>12} {:>10} {:>10} {:>14} {:>12} {:>9}\n",
        s.name, "concurrency", "TPOT p50", "TPOT p90", "1-stream T/s", "system T/s", "samples"
    );
    for p in s.curve.iter().filter(|p| !p.sparse) {
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
