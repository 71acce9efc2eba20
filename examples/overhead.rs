//! What a proxy costs a token stream: tokentap and nginx (`proxy_buffering off`) side by
//! side, against the same paced SSE origin, measured from one process on one clock.
//!
//! Run: `cargo build --release && cargo run --release --example overhead`
//!      (`-- --shapes 512x20 --secs 10 --reps 3 --modes tokentap,nginx` to choose; nginx is
//!      skipped when absent)
//!
//! The origin sends OpenAI-shaped chunks every `interval` ms on each stream (the streams
//! spread evenly over one interval), each carrying its send time; the client records
//! receive − send per event (HDR histograms), TTFT, stalls (a gap over 3× the interval; each
//! run's line also counts those where the origin's own sends were that far apart) and
//! errors. The receive time is the kernel's receive stamp on the client socket
//! (`SO_TIMESTAMPNS`, brought onto the same monotonic clock at each read), so the load
//! side's own scheduling stays out of it; the time to the client task's read is printed
//! beside it ("at the app"). Measurement starts once every stream has
//! received its first event, plus a warm-up. Each shape runs **direct**, **through tokentap**
//! and **through nginx**, alternating, `reps` times; the table shows medians. "Added" is the
//! proxied percentile minus the direct one. The proxy runs pinned to CPU 1 with one worker
//! (`taskset -c 1`, nginx `worker_processes 1`, tokentap `threads = 1`); this process (origin
//! and client) re-executes itself pinned to CPU 0 (`TOKENTAP_OVERHEAD_CPUS=1,0` swaps them:
//! load, then proxy). CPU per event comes from the proxy's
//! `/proc/PID/task/*/schedstat` (ns), split between the kernel and the proxy's own code by
//! its system and user time (`/proc/PID/stat`), memory per stream from its RSS with all
//! streams open minus its RSS before. Each run's line gives the hypervisor's steal time on
//! both cores while it was measured (a VM's pause stalls every stream at once). A warning
//! says when the load side itself was saturated.
//!
//! `--scenarios` (default `plain,ops,many,tls,short`; also `pool`, three endpoints of one
//! origin, on 127.0.0.1, .2 and .3, against `plain`'s one) sets what else is switched on, on both
//! proxies alike: **plain** nothing; **ops** an access log to a file and a scrape every
//! second (tokentap's `/metrics` and `/stats`, nginx's `stub_status`); **many** 100
//! upstreams and 20 routes, the traffic to one of them (matched by the last route);
//! **tls** a TLS origin (tokentap `https://`, nginx `proxy_pass https://` with
//! `proxy_ssl_session_reuse on`; neither verifies the origin's certificate); **short**
//! 16-token replies sent at once, on 64 keep-alive client connections, as many requests
//! as the load side sustains: requests/s and CPU per request; **short-log** the same with
//! an access log to a file on both; **long** 200 KB prompts (16 system prompts of ~200 KB,
//! a question of each request's own) on 64 keep-alive connections, each client waiting
//! 100 ms between a reply and its next request, to a pool of three endpoints: tokentap with
//! `inject_usage`, a mirror of every request and `balance = "prefix"`, nginx with its mirror
//! module (the body in memory); "added request p50/p99" is the TTFT added, the reply being
//! sent at once (`TOKENTAP_OVERHEAD_LONG=usage,mirror,prefix` chooses which are on; nginx
//! mirrors when `mirror` is); **idle** keep-alive client connections (5,000 by default,
//! `--shapes 10000x0` for another count), each after one short reply, opened 64 at a
//! time and evenly over 5 s (`TOKENTAP_OVERHEAD_IDLE_GATHER` seconds; 0 for a burst): memory
//! per idle connection, idle 2 s or more; **json** short non-streamed replies (one JSON body with
//! its usage) on 64 keep-alive connections, as many as the proxy sustains, or with
//! `--rate R` R requests a second in all, open loop, latency from when each was due (one
//! thread releases each request as it falls due: tokio's timers fire on whole milliseconds).
//! `--shapes` applies to every
//! streaming scenario (default: plain gets 1x20,512x20,4000x160,9900x400, the others
//! 512x20).
//!
//! `--soak SECS [--soak-streams 512] [--soak-rate 50]` runs tokentap alone for SECS with
//! that many streams (each 500 events at 20 ms, then the next request on the same
//! connection) and that many short requests a second (each on a new connection): its RSS
//! each minute, the slope after warm-up, errors, stalls (and each second that had any,
//! with its longest gap), and `in_flight` at the end.
//!
//! `--host-check` says how long each CPU is taken from a thread spinning on it, with the
//! other CPU idle and busy, and how much of that was the guest's own run queue: a host
//! whose busy vCPUs lose milliseconds at a time cannot judge an added p99 under one.
//!
//! `TOKENTAP_OVERHEAD_WRAP` runs the proxy under a profiler (`perf record -o FILE --`,
//! `heaptrack -o FILE`): at the end the proxy itself gets SIGTERM and the profiler up to
//! 2 minutes to write its report.
//!
//! `TOKENTAP_OVERHEAD_SECTIONS` adds config sections of its own (`[tenants]`, or a second
//! upstream at the origin's `{url}` and a route between the two, say), and
//! `TOKENTAP_OVERHEAD_UPSTREAM` keys to the upstream (`max_concurrency = 48`, say).
//! `TOKENTAP_OVERHEAD_PATH=/raw` sends the requests to a path tokentap does not meter, to
//! see the cost of the proxy without the metering. `TOKENTAP_OVERHEAD_QUEUED=1` gives
//! tokentap's upstream a cap of `streams` and first sends `streams` requests that hold every
//! slot for 2 s: each measured stream waits in the queue before it streams.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fmt::Write as _;
use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use hdrhistogram::Histogram;
use nix::sys::socket::{recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags};
use pingora::tls::{PrivateKeyDer, ServerConfig, TlsAcceptor};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, Interest};
use tokio::net::TcpStream;

#[derive(Clone, Copy, Debug)]
struct Shape {
    streams: usize,
    interval_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Direct,
    Tokentap,
    /// Another build of tokentap (`TOKENTAP_OVERHEAD_BIN_B`: the image's musl binary, an
    /// earlier commit's), measured in the same invocation, run for run.
    TokentapB,
    Nginx,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Tokentap => "tokentap",
            Mode::TokentapB => "tokentap-b",
            Mode::Nginx => "nginx",
        }
    }
}

/// What else is on besides the streams (see the module's doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scenario {
    Plain,
    Ops,
    Many,
    Tls,
    Short,
    /// Short replies with the access log on (no scrapes).
    ShortLog,
    Pool,
    /// Long prompts: 200 KB request bodies, with usage asked for, a mirror and prefix
    /// balance on.
    Long,
    /// Idle keep-alive client connections, each after one short reply: memory per
    /// connection.
    Idle,
    /// Short non-streamed replies (one JSON body with its usage): as many as the proxy's
    /// one core sustains, or `--rate` a second in all, open loop.
    Json,
}

impl Scenario {
    fn parse(s: &str) -> Scenario {
        match s {
            "plain" => Scenario::Plain,
            "ops" => Scenario::Ops,
            "many" => Scenario::Many,
            "tls" => Scenario::Tls,
            "short" => Scenario::Short,
            "short-log" => Scenario::ShortLog,
            "pool" => Scenario::Pool,
            "long" => Scenario::Long,
            "idle" => Scenario::Idle,
            "json" => Scenario::Json,
            _ => panic!(
                "unknown scenario {s}: plain, ops, many, tls, short, short-log, pool, long, idle or json"
            ),
        }
    }

    /// Short replies, many a second (requests/s and CPU per request).
    fn short(self) -> bool {
        matches!(
            self,
            Scenario::Short | Scenario::ShortLog | Scenario::Long | Scenario::Idle | Scenario::Json
        )
    }

    /// The origin on three addresses (127.0.0.1, .2, .3), a pool of three endpoints.
    fn pool(self) -> bool {
        matches!(self, Scenario::Pool | Scenario::Long)
    }

    /// An access log to a file, on both proxies.
    fn logs(self) -> bool {
        matches!(self, Scenario::Ops | Scenario::ShortLog)
    }

    fn name(self) -> &'static str {
        match self {
            Scenario::Plain => "plain",
            Scenario::Ops => "ops (access log + scrapes every second)",
            Scenario::Many => "many (100 upstreams, 20 routes)",
            Scenario::Tls => "tls (TLS origin)",
            Scenario::Short => "short (16-token replies, 64 keep-alive connections)",
            Scenario::ShortLog => "short-log (short replies, an access log to a file)",
            Scenario::Pool => "pool (three endpoints of one origin: 127.0.0.1, .2, .3)",
            Scenario::Long => "long (200 KB prompts, inject_usage, a mirror, balance = prefix)",
            Scenario::Idle => "idle (keep-alive client connections after one short reply)",
            Scenario::Json => "json (short non-streamed replies, 64 keep-alive connections)",
        }
    }
}

/// How many client connections the short scenario keeps busy.
const SHORT_CLIENTS: usize = 64;
/// Events in one short reply.
const SHORT_EVENTS: usize = 16;
/// `--rate`: the json scenario's requests a second in all, open loop (unset: closed loop).
static RATE: std::sync::OnceLock<f64> = std::sync::OnceLock::new();

/// `--rate`'s clock: one thread releases each request as it falls due, whichever client
/// sends it, not each client's own timer: tokio's timers fire on whole milliseconds, which
/// would send a millisecond's requests at once. The thread sleeps to the next due time
/// (the kernel's default timer slack lets it wake up to ~50 µs late), and latency is
/// counted from the due time, not from the release, in every mode alike.
struct Pacer {
    start: Instant,
    rate: f64,
    /// A permit for each of its requests due, client by client: the `j`th request in all
    /// is client `j % clients`'s.
    gates: Vec<tokio::sync::Semaphore>,
}

impl Pacer {
    fn start(rate: f64, clients: usize) -> Arc<Pacer> {
        let pacer = Arc::new(Pacer {
            // The first requests are due after the clients have connected.
            start: Instant::now() + Duration::from_millis(100),
            rate,
            gates: (0..clients)
                .map(|_| tokio::sync::Semaphore::new(0))
                .collect(),
        });
        if clients == 0 {
            return pacer;
        }
        // The thread ends with the run, once the run and its clients have let go of it.
        let weak = Arc::downgrade(&pacer);
        std::thread::spawn(move || {
            let mut j: u64 = 0;
            while let Some(p) = weak.upgrade() {
                let now = Instant::now();
                let mut due = p.due(j);
                while due <= now {
                    p.gates[(j % p.gates.len() as u64) as usize].add_permits(1);
                    j += 1;
                    due = p.due(j);
                }
                std::thread::sleep((due - now).min(Duration::from_millis(10)));
            }
        });
        pacer
    }

    /// When the `j`th request in all is due.
    fn due(&self, j: u64) -> Instant {
        self.start + Duration::from_secs_f64(j as f64 / self.rate)
    }

    /// When client `k`'s `i`th request is due.
    fn due_of(&self, k: usize, i: u64) -> Instant {
        self.due(i * self.gates.len() as u64 + k as u64)
    }
}

/// The long scenario's request body, bytes, and the distinct prompt prefixes it draws from.
const LONG_BYTES: usize = 200_000;
const LONG_PREFIXES: usize = 16;
/// What each long-prompt client waits between a reply and its next request: the load side
/// (client and origin on one core, each body written and read on loopback) stays below
/// saturation, so the added latency is the proxy's, not a queue's.
const LONG_THINK: Duration = Duration::from_millis(100);

/// One run's figures.
#[derive(Clone, Debug, Default)]
struct Run {
    /// Per-event latency to the kernel's receive stamp on the client socket.
    p50_us: f64,
    p99_us: f64,
    /// Per-event latency to the client task's read: adds the load side's own scheduling.
    app_p50_us: f64,
    app_p99_us: f64,
    ttft_p99_us: f64,
    events: u64,
    stalls: u64,
    /// Of them, gaps in the origin's own sends (the load side's core or the VM paused).
    origin_stalls: u64,
    errors: u64,
    cpu_us_per_event: Option<f64>,
    rss_kib_per_stream: Option<f64>,
    /// The load side's own state: its CPU share, and how late the origin sent (p99, ms).
    load_cpu_share: f64,
    origin_late_p99_ms: f64,
    /// The per-event latency at p10, p25, p75, p90 and p99.9, µs.
    spread_us: [u64; 5],
    /// Requests completed in the measured window, per second (short replies).
    requests_per_sec: f64,
    cpu_us_per_request: Option<f64>,
    /// The kernel's part of the proxy's CPU (system time over user + system time).
    kernel_share: Option<f64>,
    /// Time the hypervisor ran something else on the load's CPU (origin and client) and the
    /// proxy's while this run was measured, ms: a VM's pause shows here as stalls do.
    steal_ms: [u64; 2],
}

/// The CPUs of the load side (origin and client) and of the proxy: 0 and 1, or
/// `TOKENTAP_OVERHEAD_CPUS=LOAD,PROXY` (a VM whose CPU 1 is the noisier, say), two
/// different CPU numbers.
fn cpus() -> anyhow::Result<[usize; 2]> {
    let Ok(v) = std::env::var("TOKENTAP_OVERHEAD_CPUS") else {
        return Ok([0, 1]);
    };
    let parsed = v
        .split_once(',')
        .and_then(|(l, p)| Some([l.trim().parse().ok()?, p.trim().parse().ok()?]));
    match parsed {
        Some([load, proxy]) if load != proxy => Ok([load, proxy]),
        _ => anyhow::bail!(
            "TOKENTAP_OVERHEAD_CPUS={v:?}: two different CPU numbers, the load's then the proxy's (say 1,0)"
        ),
    }
}

/// [`cpus`] as `main` read them: the load side's (0) and the proxy's (1).
static CPUS: std::sync::OnceLock<[usize; 2]> = std::sync::OnceLock::new();

fn cpu_of(side: usize) -> usize {
    CPUS.get().map_or(side, |c| c[side])
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [load_cpu, proxy_cpu] = cpus()?;
    let _ = CPUS.set([load_cpu, proxy_cpu]);
    // Pin this process (origin and client) to its CPU, by running again under taskset.
    if std::env::var_os("TOKENTAP_OVERHEAD_PINNED").is_none() && which("taskset") {
        let status = Command::new("taskset")
            .arg("-c")
            .arg(load_cpu.to_string())
            .arg(std::env::current_exe()?)
            .args(&args)
            .env("TOKENTAP_OVERHEAD_PINNED", "1")
            .status()?;
        std::process::exit(status.code().unwrap_or(1));
    }
    let opt = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let parse_shapes = |list: &str| -> Vec<Shape> {
        list.split(',')
            .map(|s| {
                let (n, ms) = s.split_once('x').expect("shape is STREAMSxMS");
                Shape {
                    streams: n.parse().expect("streams"),
                    interval_ms: ms.parse().expect("interval"),
                }
            })
            .collect()
    };
    let shapes = opt("--shapes");
    let scenarios: Vec<Scenario> = opt("--scenarios")
        .unwrap_or_else(|| "plain,ops,many,tls,short".into())
        .split(',')
        .map(Scenario::parse)
        .collect();
    let secs: u64 = opt("--secs").map_or(10, |s| s.parse().expect("secs"));
    if let Some(rate) = opt("--rate") {
        let rate: f64 = rate.parse().expect("requests a second");
        anyhow::ensure!(
            rate.is_finite() && rate > 0.0,
            "--rate {rate}: requests a second, above 0"
        );
        let _ = RATE.set(rate);
    }
    if args.iter().any(|a| a == "--host-check") {
        host_check();
        return Ok(());
    }
    let reps: usize = opt("--reps").map_or(3, |s| s.parse().expect("reps"));
    let only = opt("--modes");
    let (soft, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE)?;
    rlimit::setrlimit(rlimit::Resource::NOFILE, hard, hard)?;
    println!("open-file limit raised from {soft} to {hard}; origin + client pinned to CPU {load_cpu}, proxies to CPU {proxy_cpu} (taskset)");

    // TOKENTAP_OVERHEAD_BIN measures another build (an earlier commit's, say);
    // TOKENTAP_OVERHEAD_BIN_B adds one beside it ("tokentap-b"), run for run.
    let bin = std::env::var_os("TOKENTAP_OVERHEAD_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/tokentap"),
        PathBuf::from,
    );
    anyhow::ensure!(bin.exists(), "build the proxy first: cargo build --release");
    let bin_b = std::env::var_os("TOKENTAP_OVERHEAD_BIN_B").map(PathBuf::from);
    let nginx = which("nginx");
    if !nginx {
        println!("nginx not found: its column is skipped (Debian: apt-get install nginx)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    if let Some(secs) = opt("--soak") {
        let streams = opt("--soak-streams").map_or(512, |s| s.parse().expect("streams"));
        let rate = opt("--soak-rate").map_or(50, |s| s.parse().expect("rate"));
        return rt.block_on(soak(
            Duration::from_secs(secs.parse().expect("soak seconds")),
            streams,
            rate,
            &bin,
        ));
    }
    let mut report = String::new();
    for scenario in scenarios {
        let shapes = match (&shapes, scenario) {
            // One load: as many short requests as it sustains.
            (Some(list), Scenario::Idle) => parse_shapes(list),
            (None, Scenario::Idle) => parse_shapes("5000x0"),
            (_, s) if s.short() => vec![Shape {
                streams: SHORT_CLIENTS,
                interval_ms: 0,
            }],
            (Some(list), _) => parse_shapes(list),
            (None, Scenario::Plain) => parse_shapes("1x20,512x20,4000x160,9900x400"),
            (None, _) => parse_shapes("512x20"),
        };
        for shape in shapes {
            let modes: Vec<Mode> = [Mode::Direct, Mode::Tokentap, Mode::TokentapB, Mode::Nginx]
                .into_iter()
                .filter(|m| *m != Mode::Nginx || nginx)
                .filter(|m| *m != Mode::TokentapB || bin_b.is_some())
                .filter(|m| {
                    only.as_ref()
                        .is_none_or(|o| o.split(',').any(|n| n == m.name()))
                })
                .collect();
            let mut runs: Vec<(Mode, Run)> = Vec::new();
            for rep in 0..reps {
                for &mode in &modes {
                    let run = rt.block_on(run_once(
                        shape,
                        mode,
                        scenario,
                        Duration::from_secs(secs),
                        if mode == Mode::TokentapB {
                            bin_b.as_deref().unwrap_or(&bin)
                        } else {
                            &bin
                        },
                    ))?;
                    println!(
                        "{} {}x{}ms rep {} {:>8}: p50 {:.0} µs, p99 {:.0} µs (at the app {:.0}, {:.0}), {} events, {:.0} requests/s, stalls {} (the origin's own {}; steal {} / {} ms on the load's / the proxy's CPU), errors {}, cpu {} µs/event, {} µs/request (kernel {}), rss {} KiB/stream",
                        scenario.name(), shape.streams, shape.interval_ms, rep + 1, mode.name(), run.p50_us, run.p99_us, run.app_p50_us, run.app_p99_us, run.events, run.requests_per_sec, run.stalls, run.origin_stalls, run.steal_ms[0], run.steal_ms[1], run.errors,
                        run.cpu_us_per_event.map_or("-".into(), |v| format!("{v:.2}")),
                        run.cpu_us_per_request.map_or("-".into(), |v| format!("{v:.1}")),
                        run.kernel_share.map_or("-".into(), |v| format!("{:.0}%", v * 100.0)),
                        run.rss_kib_per_stream.map_or("-".into(), |v| format!("{v:.1}")),
                    );
                    let [p10, p25, p75, p90, p999] = run.spread_us;
                    println!(
                        "    p10 {p10} µs, p25 {p25}, p75 {p75}, p90 {p90}, p99.9 {p999}; TTFT p99 {:.1} ms",
                        run.ttft_p99_us / 1e3
                    );
                    runs.push((mode, run));
                }
            }
            report += &table(shape, scenario, &runs);
        }
    }
    println!("\n{report}");
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn table(shape: Shape, scenario: Scenario, runs: &[(Mode, Run)]) -> String {
    let of = |m: Mode, f: &dyn Fn(&Run) -> f64| {
        median(
            runs.iter()
                .filter(|(x, _)| *x == m)
                .map(|(_, r)| f(r))
                .collect(),
        )
    };
    let f = |v: f64| {
        if v.is_nan() {
            "-".to_owned()
        } else {
            format!("{v:.1}")
        }
    };
    // Runs of a mode measured (`--modes` may leave out the direct one).
    let reps = [Mode::Direct, Mode::Tokentap, Mode::TokentapB, Mode::Nginx]
        .iter()
        .map(|mode| runs.iter().filter(|(m, _)| m == mode).count())
        .max()
        .unwrap_or(0);
    if scenario == Scenario::Idle {
        let mut out = format!(
            "{}: {} connections (medians of {reps} runs)\n{:>9} | {:>28} | {:>6}\n",
            scenario.name(),
            shape.streams,
            "",
            "RSS KiB per idle connection",
            "errors"
        );
        for m in [Mode::Tokentap, Mode::TokentapB, Mode::Nginx] {
            if runs.iter().any(|(x, _)| *x == m) {
                let rss = of(m, &|r| r.rss_kib_per_stream.unwrap_or(f64::NAN));
                let errors = of(m, &|r| r.errors as f64);
                let _ = writeln!(out, "{:>9} | {:>28} | {errors:>6}", m.name(), f(rss));
            }
        }
        out.push('\n');
        return out;
    }
    let base50 = of(Mode::Direct, &|r| r.p50_us);
    let base99 = of(Mode::Direct, &|r| r.p99_us);
    let mut out = if scenario.short() {
        format!(
            "{}: {SHORT_EVENTS}-event replies on {} connections (medians of {reps} runs)\n{:>9} | {:>11} | {:>14} | {:>22} | {:>6}\n",
            scenario.name(), shape.streams, "", "requests/s", "CPU µs/request", "added request p50/p99", "errors"
        )
    } else {
        format!(
            "{}: {} streams × {} ms (medians of {reps} runs)\n{:>9} | {:>13} | {:>13} | {:>17} | {:>17} | {:>12} | {:>14} | {:>6} | {:>6}\n",
            scenario.name(), shape.streams, shape.interval_ms,
            "", "added p50 µs", "added p99 µs", "at the app p50/99", "TTFT added p99 µs", "CPU µs/event", "RSS KiB/stream", "stalls", "errors"
        )
    };
    let app50 = of(Mode::Direct, &|r| r.app_p50_us);
    let app99 = of(Mode::Direct, &|r| r.app_p99_us);
    let base_ttft = of(Mode::Direct, &|r| r.ttft_p99_us);
    for m in [Mode::Direct, Mode::Tokentap, Mode::TokentapB, Mode::Nginx] {
        if !runs.iter().any(|(x, _)| *x == m) {
            continue;
        }
        if scenario.short() {
            let _ = writeln!(
                out,
                "{:>9} | {:>11.0} | {:>14} | {:>22} | {:>6}",
                m.name(),
                of(m, &|r| r.requests_per_sec),
                f(of(m, &|r| r.cpu_us_per_request.unwrap_or(f64::NAN))),
                format!(
                    "{} / {} µs",
                    f(of(m, &|r| r.p50_us) - base50),
                    f(of(m, &|r| r.p99_us) - base99)
                ),
                of(m, &|r| r.errors as f64),
            );
            continue;
        }
        let _ = writeln!(
            out,
            "{:>9} | {:>13} | {:>13} | {:>17} | {:>17} | {:>12} | {:>14} | {:>6} | {:>6}",
            m.name(),
            f(of(m, &|r| r.p50_us) - base50),
            f(of(m, &|r| r.p99_us) - base99),
            format!(
                "{} / {}",
                f(of(m, &|r| r.app_p50_us) - app50),
                f(of(m, &|r| r.app_p99_us) - app99)
            ),
            f(of(m, &|r| r.ttft_p99_us) - base_ttft),
            f(of(m, &|r| r.cpu_us_per_event.unwrap_or(f64::NAN))),
            f(of(m, &|r| r.rss_kib_per_stream.unwrap_or(f64::NAN))),
            of(m, &|r| r.stalls as f64),
            of(m, &|r| r.errors as f64),
        );
    }
    // tokentap against nginx, run by run (each pair ran back to back), then the median.
    let unit = if scenario.short() { "request" } else { "event" };
    let cost = |r: &Run| {
        if scenario.short() {
            r.cpu_us_per_request
        } else {
            r.cpu_us_per_event
        }
    };
    let pair = |m: Mode| {
        runs.iter()
            .filter(move |(x, _)| *x == m)
            .map(|(_, r)| cost(r))
    };
    let b: Vec<f64> = pair(Mode::TokentapB)
        .zip(pair(Mode::Tokentap))
        .filter_map(|(b, t)| Some(b? / t?))
        .collect();
    if !b.is_empty() {
        let _ = writeln!(
            out,
            "tokentap-b / tokentap CPU per {unit}: {:.2}× (median of {} pairs: {})",
            median(b.clone()),
            b.len(),
            b.iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let ratios: Vec<f64> = pair(Mode::Tokentap)
        .zip(pair(Mode::Nginx))
        .filter_map(|(t, n)| Some(t? / n?))
        .collect();
    if !ratios.is_empty() {
        let _ = writeln!(
            out,
            "tokentap / nginx CPU per {unit}: {:.2}× (median of {} pairs: {})",
            median(ratios.clone()),
            ratios.len(),
            ratios
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    // Each proxy's CPU split between the kernel (its socket calls, with loopback's receive
    // processing and wake-ups on its core) and its own code: medians of the runs.
    let split: Vec<String> = [Mode::Tokentap, Mode::Nginx]
        .into_iter()
        .filter_map(|m| {
            let part = |kernel: bool| {
                median(
                    runs.iter()
                        .filter(|(x, _)| *x == m)
                        .filter_map(|(_, r)| {
                            let share = r.kernel_share?;
                            Some(cost(r)? * if kernel { share } else { 1.0 - share })
                        })
                        .collect(),
                )
            };
            let (kernel, user) = (part(true), part(false));
            (!kernel.is_nan()).then(|| format!("{} {kernel:.1} / {user:.1} µs", m.name()))
        })
        .collect();
    if !split.is_empty() {
        let _ = writeln!(out, "kernel / user CPU per {unit}: {}", split.join(", "));
    }
    let share = median(runs.iter().map(|(_, r)| r.load_cpu_share).collect());
    let late = median(runs.iter().map(|(_, r)| r.origin_late_p99_ms).collect());
    let _ = writeln!(
        out,
        "load side: CPU share {:.0}%, origin sends late by p99 {late:.2} ms",
        share * 100.0
    );
    if !scenario.short() && (share > 0.85 || late > shape.interval_ms as f64 / 4.0) {
        let _ = writeln!(
            out,
            "WARNING: the load generator itself was saturated; the figures above are bounded by it"
        );
    }
    out.push('\n');
    out
}

fn which(cmd: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {cmd}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The origin: every connection gets a chunked SSE stream of stamped chunks (or, `short`,
/// one 16-event reply per request, keep-alive), over TLS with `tls`.
struct Origin {
    addr: SocketAddr,
    epoch: Instant,
    late: Arc<Mutex<Histogram<u64>>>,
    stop: Arc<tokio::sync::Notify>,
}

/// What the origin's connections share.
struct Serve {
    interval: Duration,
    streams: usize,
    epoch: Instant,
    late: Arc<Mutex<Histogram<u64>>>,
    short: bool,
    /// Long prompts come in: read them in large reads.
    long: bool,
    /// Short replies are one JSON body, not a stream.
    json: bool,
}

async fn origin(
    interval: Duration,
    streams: usize,
    epoch: Instant,
    tls: Option<TlsAcceptor>,
    // Short replies (the scenario they are for), or streams.
    short: Option<Scenario>,
    pool: bool,
) -> Origin {
    // A backlog as deep as the kernel allows (`somaxconn`): `TcpListener::bind`'s 128
    // overflowed in the connection storm, and a proxy that connects upstream faster than
    // another met SYN retransmissions (1 s TTFTs) the slower one did not.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(65_535).unwrap();
    let addr = listener.local_addr().unwrap();
    let late = Arc::new(Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).unwrap(),
    ));
    let stop = Arc::new(tokio::sync::Notify::new());
    let serve = Arc::new(Serve {
        interval,
        streams,
        epoch,
        late: Arc::clone(&late),
        short: short.is_some(),
        long: short == Some(Scenario::Long),
        json: short == Some(Scenario::Json),
    });
    let n = Arc::new(AtomicU64::new(0));
    // A pool's other endpoints: the same origin on 127.0.0.2 and 127.0.0.3, same port.
    let mut listeners = vec![listener];
    for ip in ["127.0.0.2", "127.0.0.3"].into_iter().filter(|_| pool) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket
            .bind(format!("{ip}:{}", addr.port()).parse().unwrap())
            .unwrap();
        listeners.push(socket.listen(65_535).unwrap());
    }
    for listener in listeners {
        let (s, n, serve, tls) = (
            Arc::clone(&stop),
            Arc::clone(&n),
            Arc::clone(&serve),
            tls.clone(),
        );
        tokio::spawn(async move {
            loop {
                let (sock, _) = tokio::select! {
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                    _ = s.notified() => return,
                };
                let _ = sock.set_nodelay(true);
                let (serve, k, tls) = (Arc::clone(&serve), n.fetch_add(1, Relaxed), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        Some(tls) => {
                            if let Ok(sock) = tls.accept(sock).await {
                                connection(sock, &serve, k).await;
                            }
                        }
                        None => connection(sock, &serve, k).await,
                    }
                });
            }
        });
    }
    Origin {
        addr,
        epoch,
        late,
        stop,
    }
}

/// Reads one request (head and a `Content-Length` body) into `got`; false at the end.
/// `buf` is the connection's (64 KiB for long prompts: few reads, not fifty wake-ups a
/// request on the load side's core).
async fn read_request<S: AsyncRead + Unpin>(
    sock: &mut S,
    got: &mut Vec<u8>,
    buf: &mut [u8],
) -> bool {
    loop {
        if let Some(h) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..h]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if got.len() >= h + 4 + len {
                return true;
            }
        }
        match sock.read(buf).await {
            Ok(0) | Err(_) => return false,
            Ok(r) => got.extend_from_slice(&buf[..r]),
        }
    }
}

/// One stamped SSE event.
fn event(serve: &Serve) -> String {
    let t = serve.epoch.elapsed().as_nanos();
    format!(
        "data: {{\"id\":\"chatcmpl-overhead\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" tok\"}},\"finish_reason\":null}}],\"t\":{t}}}\n\n"
    )
}

const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";

/// A reply of `SHORT_EVENTS` events, whole.
fn short_reply(serve: &Serve) -> String {
    let mut whole = String::from(SSE_HEAD);
    for i in 0..SHORT_EVENTS {
        let mut data = event(serve);
        if i + 1 == SHORT_EVENTS {
            data = data.replace("\"finish_reason\":null", "\"finish_reason\":\"stop\"");
            data += "data: [DONE]\n\n";
        }
        let _ = write!(whole, "{:x}\r\n{data}\r\n", data.len());
    }
    whole + "0\r\n\r\n"
}

/// A non-streamed reply of `SHORT_EVENTS` tokens, stamped once, with its usage.
fn json_reply(serve: &Serve) -> String {
    let t = serve.epoch.elapsed().as_nanos();
    let body = format!(
        "{{\"id\":\"chatcmpl-overhead\",\"object\":\"chat.completion\",\"model\":\"m\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}},\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":9,\"completion_tokens\":{SHORT_EVENTS},\"total_tokens\":{}}},\"t\":{t}}}",
        " tok".repeat(SHORT_EVENTS),
        9 + SHORT_EVENTS
    );
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// The value of header `name` (lower case, with its colon) in a request head.
fn header_value<'a>(head: &'a [u8], name: &str) -> Option<&'a str> {
    let head = std::str::from_utf8(head).ok()?;
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name.trim_end_matches(':'))
            .then(|| v.trim())
    })
}

/// Serves the requests of one connection, keep-alive: a short reply (`short`, or the
/// request's `x-overhead-short`), a slot holder's (`x-overhead-hold`), a stream of
/// `x-overhead-events` events and its end, or a stream without end.
async fn connection<S: AsyncRead + AsyncWrite + Unpin>(mut sock: S, serve: &Serve, k: u64) {
    let mut got = Vec::new();
    let mut buf = vec![0u8; if serve.long { 64 << 10 } else { 4 << 10 }];
    loop {
        if !read_request(&mut sock, &mut got, &mut buf).await {
            return;
        }
        let head_end = got
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or(got.len());
        let head = got[..head_end].to_vec();
        got.clear();
        if serve.json {
            if sock.write_all(json_reply(serve).as_bytes()).await.is_err() {
                return;
            }
            continue;
        }
        if serve.short || header_value(&head, "x-overhead-short").is_some() {
            if sock.write_all(short_reply(serve).as_bytes()).await.is_err() {
                return;
            }
            continue;
        }
        if header_value(&head, "x-overhead-hold").is_some() {
            // A slot holder: a short stream after 2 s, then close.
            tokio::time::sleep(Duration::from_secs(2)).await;
            let data = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
            let whole = format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{data}", data.len());
            let _ = sock.write_all(whole.as_bytes()).await;
            let _ = sock.shutdown().await;
            return;
        }
        let events: Option<u64> =
            header_value(&head, "x-overhead-events").and_then(|v| v.parse().ok());
        if sock.write_all(SSE_HEAD.as_bytes()).await.is_err() {
            return;
        }
        // Streams start spread evenly over one interval, as independent clients would
        // (tokio's timers then fire them in 1 ms groups).
        let interval = serve.interval;
        let offset = interval.mul_f64((k % serve.streams as u64) as f64 / serve.streams as f64);
        let mut due = tokio::time::Instant::now() + offset;
        let mut sent = 0;
        loop {
            tokio::time::sleep_until(due).await;
            let now = tokio::time::Instant::now();
            let _ = serve
                .late
                .lock()
                .unwrap()
                .record(now.saturating_duration_since(due).as_micros().max(1) as u64);
            let mut data = event(serve);
            sent += 1;
            let last = events.is_some_and(|n| sent >= n);
            if last {
                data = data.replace("\"finish_reason\":null", "\"finish_reason\":\"stop\"");
                data += "data: [DONE]\n\n";
            }
            let mut chunk = format!("{:x}\r\n{data}\r\n", data.len());
            if last {
                chunk += "0\r\n\r\n";
            }
            if sock.write_all(chunk.as_bytes()).await.is_err() || sock.flush().await.is_err() {
                return;
            }
            if last {
                break;
            }
            due += interval;
        }
    }
}

/// A TLS acceptor with a fresh self-signed certificate for 127.0.0.1 (the proxies do not
/// verify it).
fn tls_acceptor() -> TlsAcceptor {
    pingora::tls::install_default_crypto_provider();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let config = ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
        )
        .unwrap();
    TlsAcceptor::from(Arc::new(config))
}

/// A proxy process under test.
struct Proxy {
    child: Child,
    addr: SocketAddr,
    /// Processes whose CPU and memory count (nginx: master and worker).
    pids: Vec<u32>,
    dir: PathBuf,
    /// Where to scrape, and what (the ops scenario).
    scrape: Option<(SocketAddr, Vec<&'static str>)>,
}

/// The first process below `root` whose name is one of `names` (a wrapped proxy).
fn descendant(root: u32, names: &[&str]) -> Option<u32> {
    let mut below = children(root);
    while let Some(pid) = below.pop() {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if names.contains(&comm.trim_end()) {
            return Some(pid);
        }
        below.extend(children(pid));
    }
    None
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // Under TOKENTAP_OVERHEAD_WRAP the child is the wrapper (heaptrack, perf): the proxy
        // itself gets the signal, and the wrapper the time to write its report.
        let wrapped = std::env::var_os("TOKENTAP_OVERHEAD_WRAP").is_some();
        let pid = if wrapped {
            descendant(self.child.id(), &["tokentap", "nginx"]).unwrap_or(self.child.id())
        } else {
            self.child.id()
        };
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(if wrapped { 120 } else { 5 });
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // What nginx complained about (e.g. too few worker_connections) is worth seeing;
        // not that its worker_connections exceed the open-file limit, which is deliberate
        // (see start_proxy).
        let log = std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| !l.contains("[notice]") && !l.contains("exceed open file resource limit"))
            .collect();
        if !lines.is_empty() {
            println!(
                "    nginx error.log: {} lines, the last: {}",
                lines.len(),
                lines[lines.len() - 1]
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The config of `scenario`'s extra upstreams and routes for tokentap: 100 upstreams, 20
/// routes, the traffic (`/v1/`) matched by the last; the others split over the rest.
fn many_tokentap(url: &str) -> String {
    let mut c = String::new();
    for i in 0..100 {
        let _ = write!(c, "[[upstream]]\nname = \"u{i}\"\nurl = \"{url}\"\n");
    }
    for r in 0..19 {
        let split: Vec<String> = (1 + r * 5..1 + r * 5 + 5)
            .map(|u| format!("u{u} = 1"))
            .collect();
        let _ = write!(
            c,
            "[[route]]\npath_prefix = \"/r{r}/\"\nsplit = {{ {} }}\n",
            split.join(", ")
        );
    }
    c + "[[route]]\npath_prefix = \"/v1/\"\nsplit = { u0 = 1 }\n"
}

/// The same for nginx: 100 upstream blocks, 20 locations.
fn many_nginx(origin: SocketAddr, scheme: &str) -> (String, String) {
    let mut ups = String::new();
    for i in 0..100 {
        let _ = writeln!(ups, "upstream u{i} {{ server {origin}; keepalive 1024; }}");
    }
    let mut locs = String::new();
    for r in 0..19 {
        let _ = writeln!(
            locs,
            "location /r{r}/ {{ proxy_pass {scheme}://u{}; }}",
            1 + r * 5
        );
    }
    locs += &format!("location /v1/ {{ proxy_pass {scheme}://u0; }}\n");
    (ups, locs)
}

/// Starts the proxy of `mode` in front of `origin`; `cap`: tokentap's upstream gets this
/// concurrency cap, with a queue as deep.
async fn start_proxy(
    mode: Mode,
    scenario: Scenario,
    origin: SocketAddr,
    bin: &Path,
    cap: Option<usize>,
) -> Option<Proxy> {
    let dir = std::env::temp_dir().join(format!(
        "tokentap-overhead-{}-{}",
        std::process::id(),
        mode.name()
    ));
    std::fs::create_dir_all(&dir).ok()?;
    let addr = free_port();
    let status = free_port();
    let tls = scenario == Scenario::Tls;
    let scheme = if tls { "https" } else { "http" };
    let (child, scrape) = match mode {
        Mode::Direct => return None,
        Mode::Tokentap | Mode::TokentapB => {
            let conf = dir.join("tokentap.toml");
            let url = format!("{scheme}://{origin}");
            let port = origin.port();
            let upstreams = match scenario {
                Scenario::Many => many_tokentap(&url),
                Scenario::Pool => format!(
                    "[[upstream]]\nname = \"origin\"\nendpoints = [\"http://127.0.0.1:{port}\", \"http://127.0.0.2:{port}\", \"http://127.0.0.3:{port}\"]\n"
                ),
                Scenario::Long => format!(
                    "[[upstream]]\nname = \"origin\"\nendpoints = [\"http://127.0.0.1:{port}\", \"http://127.0.0.2:{port}\", \"http://127.0.0.3:{port}\"]\n\
                     balance = \"{}\"\ninject_usage = {}\n\
                     [[upstream]]\nname = \"shadow\"\nurl = \"http://127.0.0.1:{port}\"\n\
                     [[route]]\nsplit = {{ origin = 1 }}\n{}",
                    if long_on("prefix") { "prefix" } else { "least_loaded" },
                    long_on("usage"),
                    if long_on("mirror") {
                        "mirror = { upstream = \"shadow\", max_in_flight = 64 }\n"
                    } else {
                        ""
                    },
                ),
                _ => format!(
                    "[[upstream]]\nname = \"origin\"\nurl = \"{url}\"\n{}{}{}\n",
                    if tls { "tls_verify = false\n" } else { "" },
                    cap.map_or(String::new(), |n| format!(
                        "max_concurrency = {n}\nmax_queue = {n}\nqueue_timeout_ms = 60000\n"
                    )),
                    // TOKENTAP_OVERHEAD_UPSTREAM="max_concurrency = 48" adds upstream keys.
                    std::env::var("TOKENTAP_OVERHEAD_UPSTREAM").unwrap_or_default(),
                ),
            };
            let log = if scenario.logs() {
                format!("[log]\naccess = \"{}\"\n", dir.join("access.log").display())
            } else {
                String::new()
            };
            std::fs::write(
                &conf,
                format!(
                    "[listen]\nproxy = \"{addr}\"\nadmin = \"{status}\"\n[server]\nthreads = 1\ngrace_period_secs = 0\n{}\n{log}{}\n{upstreams}",
                    // TOKENTAP_OVERHEAD_SERVER="work_stealing = false" adds [server] settings.
                    std::env::var("TOKENTAP_OVERHEAD_SERVER").unwrap_or_default(),
                    // TOKENTAP_OVERHEAD_SECTIONS adds sections of its own ("[tenants]…").
                    std::env::var("TOKENTAP_OVERHEAD_SECTIONS")
                        .unwrap_or_default()
                        .replace("{url}", &url),
                ),
            )
            .ok()?;
            // TOKENTAP_OVERHEAD_WRAP="valgrind --tool=callgrind" profiles the proxy.
            let wrap = std::env::var("TOKENTAP_OVERHEAD_WRAP").unwrap_or_default();
            let mut cmd = Command::new("taskset");
            cmd.args(["-c", &cpu_of(1).to_string()])
                .args(wrap.split_whitespace())
                .arg(bin)
                .arg("run")
                .arg("--config")
                .arg(&conf);
            let child = cmd
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()?;
            (child, vec!["/metrics", "/stats"])
        }
        Mode::Nginx => {
            // nginx starts closing connections once fewer than 1/16 of `worker_connections`
            // are free ("worker_connections are not enough, reusing connections"): 9,900
            // streams hold 19,800 connections, so it needs 22,000 slots: more than the
            // 20,000 files it may open, of which it uses fewer than 19,810.
            let conf = dir.join("nginx.conf");
            let d = dir.display();
            let port = origin.port();
            let (ups, locs) = match scenario {
                Scenario::Many => many_nginx(origin, scheme),
                Scenario::Pool => (
                    format!("upstream origin {{ server 127.0.0.1:{port}; server 127.0.0.2:{port}; server 127.0.0.3:{port}; keepalive 1024; keepalive_requests 1000000; }}\n"),
                    format!("location / {{ proxy_pass {scheme}://origin; }}\n"),
                ),
                // Its mirror module copies each request (the body held in memory: 1 MiB
                // of buffer, no temporary file); it has no usage to ask for, nor prefixes.
                Scenario::Long => (
                    format!("upstream origin {{ server 127.0.0.1:{port}; server 127.0.0.2:{port}; server 127.0.0.3:{port}; keepalive 1024; keepalive_requests 1000000; }}\n\
                             upstream shadow {{ server 127.0.0.1:{port}; keepalive 1024; keepalive_requests 1000000; }}\n\
                             client_body_buffer_size 1m; client_max_body_size 16m;\n"),
                    if long_on("mirror") {
                        format!("location / {{ mirror /mirror; mirror_request_body on; proxy_pass {scheme}://origin; }}\n\
                                 location = /mirror {{ internal; proxy_pass {scheme}://shadow$request_uri; }}\n")
                    } else {
                        format!("location / {{ proxy_pass {scheme}://origin; }}\n")
                    },
                ),
                _ => (
                    format!("upstream origin {{ server {origin}; keepalive 1024; keepalive_requests 1000000; }}\n"),
                    format!("location / {{ proxy_pass {scheme}://origin; }}\n"),
                ),
            };
            let access = if scenario.logs() {
                format!("access_log {d}/access.log;\n")
            } else {
                "access_log off;\n".into()
            };
            let status_server = if scenario == Scenario::Ops {
                format!("server {{ listen {status}; location /status {{ stub_status; }} }}\n")
            } else {
                String::new()
            };
            std::fs::write(
                &conf,
                format!(
                    "worker_processes 1;\nworker_rlimit_nofile 20000;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
                     events {{ worker_connections 22000; multi_accept on; }}\n\
                     http {{ {access} client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
                       keepalive_requests 1000000; keepalive_timeout 600s;\n\
                       proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off; proxy_read_timeout 600s;\n\
                       proxy_ssl_session_reuse on;\n\
                       {ups}{status_server}\
                       server {{ listen {addr};\n{locs} }} }}\n"
                ),
            )
            .ok()?;
            // The profiler wraps nginx too (callgrind with `--trace-children=yes` follows its
            // master into the worker), so that both are counted alike.
            let wrap = std::env::var("TOKENTAP_OVERHEAD_WRAP").unwrap_or_default();
            let child = Command::new("taskset")
                .args(["-c", &cpu_of(1).to_string()])
                .args(wrap.split_whitespace())
                .arg("nginx")
                .arg("-c")
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()?;
            (child, vec!["/status"])
        }
    };
    // Ready when it accepts.
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(addr).await.is_err() {
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // nginx's master listens before it forks its worker: wait for the worker, whose CPU
    // and memory are most of what counts.
    let forked = Instant::now() + Duration::from_secs(5);
    while mode == Mode::Nginx && children(child.id()).is_empty() && Instant::now() < forked {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut pids = vec![child.id()];
    pids.extend(children(child.id()));
    Some(Proxy {
        child,
        addr,
        pids,
        dir,
        scrape: (scenario == Scenario::Ops).then_some((status, scrape)),
    })
}

/// Every second until `stop`, GETs each of `paths` at `at` (a Prometheus and a dashboard
/// scraping), on a fresh connection each; counts the failures into `errors`.
async fn scraper(
    at: SocketAddr,
    paths: Vec<&'static str>,
    stop: Arc<tokio::sync::Notify>,
    errors: Arc<AtomicU64>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.notified() => return,
        }
        for path in &paths {
            let ok = async {
                let mut s = TcpStream::connect(at).await.ok()?;
                let req = format!("GET {path} HTTP/1.1\r\nhost: {at}\r\nconnection: close\r\n\r\n");
                s.write_all(req.as_bytes()).await.ok()?;
                let mut body = Vec::new();
                s.read_to_end(&mut body).await.ok()?;
                body.starts_with(b"HTTP/1.1 200").then_some(())
            }
            .await;
            if ok.is_none() {
                errors.fetch_add(1, Relaxed);
            }
        }
    }
}

fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// `--host-check`: how long each of the two CPUs is taken away from a thread that spins on
/// it, with the other CPU idle and with it busy, and how much of that the guest's own
/// scheduler kept it waiting (its run delay, `/proc/thread-self/schedstat`): the rest is
/// the hypervisor's, which a VM's steal time (counted in 10 ms ticks) may not show. An
/// added p99 under a millisecond cannot be judged on a host whose busy vCPUs lose
/// milliseconds at a time.
fn host_check() {
    const SECS: u64 = 5;
    let run_delay_us = || {
        std::fs::read_to_string("/proc/thread-self/schedstat")
            .ok()
            .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map(|ns| ns / 1000)
    };
    let spin = move |cpu: usize, secs: u64| {
        std::thread::spawn(move || {
            let mut set = nix::sched::CpuSet::new();
            let pinned = set.set(cpu).is_ok()
                && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).is_ok();
            let waited_before = run_delay_us();
            let (end, mut last) = (Instant::now() + Duration::from_secs(secs), Instant::now());
            // Room for a gap every 0.2 ms: the loop does not allocate.
            let mut gaps: Vec<u64> = Vec::with_capacity(secs as usize * 5_000);
            while last < end {
                let now = Instant::now();
                let gap = now.duration_since(last).as_micros() as u64;
                if gap >= 200 && gaps.len() < gaps.capacity() {
                    gaps.push(gap);
                }
                last = now;
            }
            let waited = run_delay_us()
                .zip(waited_before)
                .map(|(b, a)| b.saturating_sub(a));
            (pinned, gaps, waited)
        })
    };
    let [load, proxy] = [cpu_of(0), cpu_of(1)];
    println!(
        "--host-check: a thread spinning {SECS} s on each CPU; gaps of 0.2 ms or more in its clock"
    );
    for (cpu, other) in [(load, proxy), (proxy, load)] {
        for other_busy in [false, true] {
            let busy = other_busy.then(|| spin(other, SECS + 1));
            let measured = spin(cpu, SECS).join();
            let busy_pinned = busy.map(|b| b.join().is_ok_and(|(pinned, ..)| pinned));
            let Ok((pinned, mut gaps, waited)) = measured else {
                println!("  CPU {cpu}: the spinning thread failed");
                continue;
            };
            gaps.sort_unstable();
            let over_ms = gaps.iter().filter(|&&g| g >= 1000).count();
            let lost: u64 = gaps.iter().sum();
            let unpinned = !pinned || busy_pinned == Some(false);
            println!(
                "  CPU {cpu}, CPU {other} {}: {} gaps ≥ 0.2 ms, {over_ms} ≥ 1 ms, the longest {:.1} ms, {:.1} ms lost a second ({} of it waiting in the guest's run queue){}",
                if other_busy { "busy" } else { "idle" },
                gaps.len(),
                gaps.last().copied().unwrap_or(0) as f64 / 1e3,
                lost as f64 / 1e3 / SECS as f64,
                waited.map_or("unknown".into(), |us| format!("{:.1} ms", us as f64 / 1e3 / SECS as f64)),
                if unpinned { " (not pinned: sched_setaffinity failed)" } else { "" },
            );
        }
    }
}

/// Steal time of the load's CPU and the proxy's so far, ms (`/proc/stat`, in clock ticks of
/// 10 ms).
fn steal_ms() -> [u64; 2] {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    [cpu_of(0), cpu_of(1)].map(|cpu| {
        let name = format!("cpu{cpu}");
        stat.lines()
            .find_map(|l| l.strip_prefix(name.as_str())?.strip_prefix(' '))
            .and_then(|l| l.split_whitespace().nth(7)?.parse::<u64>().ok())
            .map_or(0, |ticks| ticks * 10)
    })
}

/// User and system time of `pids` (every thread, living or ended), in clock ticks.
fn user_system_ticks(pids: &[u32]) -> (u64, u64) {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|s| {
            // The fields after the command's name, which is in parentheses and may hold
            // spaces: utime and stime are the 14th and 15th fields, the 12th and 13th here.
            let mut f = s.rsplit_once(')')?.1.split_whitespace().skip(11);
            Some((
                f.next()?.parse::<u64>().ok()?,
                f.next()?.parse::<u64>().ok()?,
            ))
        })
        .fold((0, 0), |(u, s), (du, ds)| (u + du, s + ds))
}

/// CPU time of all threads of `pids`, ns.
fn cpu_ns(pids: &[u32]) -> u64 {
    pids.iter()
        .flat_map(|pid| {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten()
                .flatten()
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum()
}

fn rss_kib(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok())
        .filter_map(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum()
}

fn self_cpu_ns() -> u64 {
    cpu_ns(&[std::process::id()])
}

/// All client streams' tallies.
struct Tally {
    /// Send to the kernel's receive stamp, and send to the client task's read, µs.
    lat: Histogram<u64>,
    app_lat: Histogram<u64>,
    ttft: Vec<u64>,
    events: u64,
    /// Whole replies (the short scenario).
    requests: u64,
    stalls: u64,
    /// Gaps in the origin's own sends over 3× the interval.
    origin_stalls: u64,
    errors: u64,
}

impl Tally {
    /// Empty, keeping the TTFTs already seen.
    fn new(ttft: Vec<u64>) -> Tally {
        let hist = || Histogram::new_with_bounds(1, 60_000_000, 3).unwrap();
        Tally {
            lat: hist(),
            app_lat: hist(),
            ttft,
            events: 0,
            requests: 0,
            stalls: 0,
            origin_stalls: 0,
            errors: 0,
        }
    }
}

async fn run_once(
    shape: Shape,
    mode: Mode,
    scenario: Scenario,
    measure: Duration,
    bin: &Path,
) -> anyhow::Result<Run> {
    let interval = Duration::from_millis(shape.interval_ms);
    let epoch = Instant::now();
    let short = scenario.short();
    let tls = (scenario == Scenario::Tls).then(tls_acceptor);
    let replies = short.then_some(scenario);
    let origin = origin(
        interval,
        shape.streams,
        epoch,
        tls,
        replies,
        scenario.pool(),
    )
    .await;
    let queued = mode == Mode::Tokentap && std::env::var_os("TOKENTAP_OVERHEAD_QUEUED").is_some();
    let proxy = start_proxy(
        mode,
        scenario,
        origin.addr,
        bin,
        queued.then_some(shape.streams),
    )
    .await;
    anyhow::ensure!(
        mode == Mode::Direct || proxy.is_some(),
        "{} did not start",
        mode.name()
    );
    let target = proxy.as_ref().map_or(origin.addr, |p| p.addr);
    let pids = proxy.as_ref().map(|p| p.pids.clone()).unwrap_or_default();
    let rss_before = rss_kib(&pids);

    // Open the streams (at most 256 connects in flight), then warm up for two intervals.
    let warm = Duration::from_secs(2).max(interval * 3);
    let tally = Arc::new(Mutex::new(Tally::new(Vec::new())));
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = Arc::new(tokio::sync::Notify::new());
    let sem = Arc::new(tokio::sync::Semaphore::new(256));
    let mut tasks = Vec::with_capacity(shape.streams);
    let mut holders = Vec::new();
    if queued {
        for _ in 0..shape.streams {
            holders.push(tokio::spawn(hold(target)));
        }
        // Every slot is held before the measured streams arrive.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let gather = idle_gather();
    let pacer = RATE
        .get()
        .filter(|_| scenario == Scenario::Json)
        .map(|&rate| Pacer::start(rate, shape.streams));
    for k in 0..shape.streams {
        let (tally, measuring, stop, sem, pacer) = (
            Arc::clone(&tally),
            Arc::clone(&measuring),
            Arc::clone(&stop),
            Arc::clone(&sem),
            pacer.clone(),
        );
        tasks.push(tokio::spawn(async move {
            if scenario == Scenario::Idle {
                // Connections gather over seconds, not in one burst: what they hold idle,
                // not the high-water mark of serving their first requests all at once.
                tokio::time::sleep(gather.mul_f64(k as f64 / shape.streams as f64)).await;
            }
            if scenario == Scenario::Json {
                json_client(target, k, pacer, tally, measuring, stop).await;
            } else if short {
                short_client(target, scenario, tally, measuring, stop).await;
            } else {
                client(target, interval, epoch, tally, measuring, stop, sem).await;
            }
        }));
    }
    let scrape_errors = Arc::new(AtomicU64::new(0));
    if let Some((at, paths)) = proxy.as_ref().and_then(|p| p.scrape.clone()) {
        tasks.push(tokio::spawn(scraper(
            at,
            paths,
            Arc::clone(&stop),
            Arc::clone(&scrape_errors),
        )));
    }
    // Measure only once every stream is open and streaming (a connection storm through the
    // proxy is not what this measures), then after a further warm-up.
    let opened = Instant::now();
    let started = |t: &Tally| t.ttft.len() as u64 + t.errors;
    while started(&tally.lock().unwrap()) < shape.streams as u64
        && opened.elapsed() < Duration::from_secs(60)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(warm).await;
    let rss_open = rss_kib(&pids);
    origin.late.lock().unwrap().reset();
    {
        let mut t = tally.lock().unwrap();
        *t = Tally::new(std::mem::take(&mut t.ttft));
    }
    let (cpu0, self0, wall0) = (cpu_ns(&pids), self_cpu_ns(), Instant::now());
    let ticks0 = user_system_ticks(&pids);
    let steal0 = steal_ms();
    measuring.store(true, Relaxed);
    tokio::time::sleep(measure).await;
    measuring.store(false, Relaxed);
    let (cpu1, self1, wall) = (cpu_ns(&pids), self_cpu_ns(), wall0.elapsed());
    let ticks1 = user_system_ticks(&pids);
    let steal1 = steal_ms();
    let (user, system) = (ticks1.0 - ticks0.0, ticks1.1 - ticks0.1);
    stop.notify_waiters();
    for t in tasks.into_iter().chain(holders) {
        t.abort();
    }
    origin.stop.notify_waiters();
    drop(proxy);

    let t = tally.lock().unwrap();
    let (lat, app_lat) = (&t.lat, &t.app_lat);
    let mut ttft = t.ttft.clone();
    ttft.sort_unstable();
    let late = origin.late.lock().unwrap();
    let _ = origin.epoch;
    Ok(Run {
        p50_us: lat.value_at_quantile(0.5) as f64,
        p99_us: lat.value_at_quantile(0.99) as f64,
        app_p50_us: app_lat.value_at_quantile(0.5) as f64,
        app_p99_us: app_lat.value_at_quantile(0.99) as f64,
        ttft_p99_us: ttft
            .get(((ttft.len() as f64 * 0.99) as usize).min(ttft.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0) as f64,
        events: t.events,
        stalls: t.stalls,
        origin_stalls: t.origin_stalls,
        errors: t.errors + scrape_errors.load(Relaxed),
        cpu_us_per_event: (!pids.is_empty() && t.events > 0)
            .then(|| cpu1.saturating_sub(cpu0) as f64 / 1e3 / t.events as f64),
        requests_per_sec: t.requests as f64 / wall.as_secs_f64(),
        cpu_us_per_request: (!pids.is_empty() && t.requests > 0)
            .then(|| cpu1.saturating_sub(cpu0) as f64 / 1e3 / t.requests as f64),
        rss_kib_per_stream: (!pids.is_empty())
            .then(|| rss_open.saturating_sub(rss_before) as f64 / shape.streams as f64),
        load_cpu_share: (self1 - self0) as f64 / wall.as_nanos() as f64,
        origin_late_p99_ms: late.value_at_quantile(0.99) as f64 / 1e3,
        spread_us: [0.1, 0.25, 0.75, 0.9, 0.999].map(|q| lat.value_at_quantile(q)),
        kernel_share: (user + system > 0).then(|| system as f64 / (user + system) as f64),
        steal_ms: [0, 1].map(|i| steal1[i].saturating_sub(steal0[i])),
    })
}

/// A request that holds a concurrency slot for 2 s (`TOKENTAP_OVERHEAD_QUEUED`).
async fn hold(target: SocketAddr) {
    let Ok(mut s) = TcpStream::connect(target).await else {
        return;
    };
    let body = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hold"}]}"#;
    let req = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: origin\r\nx-overhead-hold: 1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
    if s.write_all(req.as_bytes()).await.is_err() || s.write_all(body).await.is_err() {
        return;
    }
    let mut sink = Vec::new();
    let _ = s.read_to_end(&mut sink).await;
}

async fn client(
    target: SocketAddr,
    interval: Duration,
    epoch: Instant,
    tally: Arc<Mutex<Tally>>,
    measuring: Arc<std::sync::atomic::AtomicBool>,
    stop: Arc<tokio::sync::Notify>,
    sem: Arc<tokio::sync::Semaphore>,
) {
    let permit = sem.acquire().await;
    let Ok(mut s) = TcpStream::connect(target).await else {
        tally.lock().unwrap().errors += 1;
        return;
    };
    drop(permit);
    let _ = s.set_nodelay(true);
    // The kernel stamps each received segment (CLOCK_REALTIME): the receive time that the
    // load side's own scheduling does not move.
    let _ = setsockopt(&s, sockopt::ReceiveTimestampns, &true);
    let mut cmsg = nix::cmsg_space!(nix::sys::time::TimeSpec);
    let body = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let path =
        std::env::var("TOKENTAP_OVERHEAD_PATH").unwrap_or_else(|_| "/v1/chat/completions".into());
    let req = format!("POST {path} HTTP/1.1\r\nhost: origin\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
    if s.write_all(req.as_bytes()).await.is_err() || s.write_all(body).await.is_err() {
        tally.lock().unwrap().errors += 1;
        return;
    }
    let sent = Instant::now();
    let mut buf = vec![0u8; 16 * 1024];
    let mut carry: Vec<u8> = Vec::new();
    let mut last: Option<Instant> = None;
    let mut last_sent: Option<u64> = None;
    let mut first = true;
    let stopped = stop.notified();
    tokio::pin!(stopped);
    loop {
        let (n, stamped) = tokio::select! {
            r = read_stamped(&s, &mut buf, &mut cmsg) => match r { Ok((0, _)) | Err(_) => { tally.lock().unwrap().errors += 1; return; } Ok(r) => r },
            _ = &mut stopped => return,
        };
        let now = Instant::now();
        let now_ns = epoch.elapsed().as_nanos() as u64;
        // The kernel's stamp on this one clock: now, less how long the bytes waited.
        let waited = stamped
            .and_then(|k| SystemTime::now().duration_since(k).ok())
            .map_or(0, |w| w.as_nanos() as u64);
        let wire_ns = now_ns.saturating_sub(waited);
        carry.extend_from_slice(&buf[..n]);
        let mut stamps = Vec::new();
        let mut consumed = 0;
        while let Some(i) = memchr::memmem::find(&carry[consumed..], b"\"t\":") {
            let start = consumed + i + 4;
            let digits = carry[start..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            if start + digits >= carry.len() {
                break; // the number may go on in the next read
            }
            let t: u64 = std::str::from_utf8(&carry[start..start + digits])
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(now_ns);
            stamps.push(t);
            consumed = start + digits;
        }
        carry.drain(..consumed);
        if stamps.is_empty() {
            continue;
        }
        let mut t = tally.lock().unwrap();
        if first {
            first = false;
            t.ttft.push(now.duration_since(sent).as_micros() as u64);
        }
        if measuring.load(Relaxed) {
            for st in &stamps {
                let us = |at: u64| at.saturating_sub(*st).max(1000) / 1000;
                let _ = t.lat.record(us(wire_ns));
                let _ = t.app_lat.record(us(now_ns));
            }
            t.events += stamps.len() as u64;
            if last.is_some_and(|l| now.duration_since(l) > interval * 3) {
                t.stalls += 1;
            }
            // The origin's own sends that far apart (its core, shared with the load side,
            // was busy or the VM paused): the stall is not the proxy's.
            let gap = interval.as_nanos() as u64 * 3;
            if last_sent.is_some_and(|l| stamps[0].saturating_sub(l) > gap) {
                t.origin_stalls += 1;
            }
        }
        last = Some(now);
        last_sent = stamps.last().copied();
    }
}

/// Counts of the soak so far.
#[derive(Default)]
struct SoakCounts {
    streams: AtomicU64,
    short: AtomicU64,
    errors: AtomicU64,
    stalls: AtomicU64,
    /// Stalls by the second of the soak they ended in, and the longest gap of each second
    /// (ms): a burst on every stream at once is a pause, of the proxy or of the load side.
    stalled_at: Mutex<std::collections::BTreeMap<u64, (u64, u64)>>,
}

/// The soak (see the module's doc).
async fn soak(length: Duration, streams: usize, rate: u64, bin: &Path) -> anyhow::Result<()> {
    const EVENTS: u64 = 500;
    let interval = Duration::from_millis(20);
    let epoch = Instant::now();
    let origin = origin(interval, streams, epoch, None, None, false).await;
    let proxy = start_proxy(Mode::Tokentap, Scenario::Ops, origin.addr, bin, None)
        .await
        .ok_or_else(|| anyhow::anyhow!("tokentap did not start"))?;
    let (target, admin) = (proxy.addr, proxy.scrape.as_ref().map(|s| s.0));
    let counts = Arc::new(SoakCounts::default());
    let soak_start = Instant::now();
    let stop = Arc::new(tokio::sync::Notify::new());
    let ending = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..streams {
        let (counts, ending) = (Arc::clone(&counts), Arc::clone(&ending));
        tasks.push(tokio::spawn(async move {
            // Spread the first connects over a second.
            tokio::time::sleep(Duration::from_millis((i as u64 * 1000) / streams as u64)).await;
            let req = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: origin\r\nx-overhead-events: {EVENTS}\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}");
            let mut buf = vec![0u8; 16 * 1024];
            'connect: while !ending.load(Relaxed) {
                let Ok(mut s) = TcpStream::connect(target).await else {
                    counts.errors.fetch_add(1, Relaxed);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                while !ending.load(Relaxed) {
                    if s.write_all(req.as_bytes()).await.is_err() {
                        counts.errors.fetch_add(1, Relaxed);
                        continue 'connect;
                    }
                    let mut tail: Vec<u8> = Vec::new();
                    let mut events = 0;
                    let mut last = Instant::now();
                    loop {
                        let n = match tokio::time::timeout(interval * 50, s.read(&mut buf)).await {
                            Ok(Ok(n)) if n > 0 => n,
                            _ => {
                                counts.errors.fetch_add(1, Relaxed);
                                continue 'connect;
                            }
                        };
                        if last.elapsed() > interval * 3 && events > 0 {
                            counts.stalls.fetch_add(1, Relaxed);
                            let gap = last.elapsed().as_millis() as u64;
                            let mut at = counts.stalled_at.lock().unwrap();
                            let e = at.entry(soak_start.elapsed().as_secs()).or_default();
                            *e = (e.0 + 1, e.1.max(gap));
                        }
                        last = Instant::now();
                        events += memchr::memmem::find_iter(&buf[..n], b"\"t\":").count();
                        tail.extend_from_slice(&buf[..n]);
                        if tail.len() > 16 {
                            tail.drain(..tail.len() - 16);
                        }
                        if tail.ends_with(b"\r\n0\r\n\r\n") {
                            break;
                        }
                    }
                    if events as u64 != EVENTS {
                        counts.errors.fetch_add(1, Relaxed);
                    }
                    counts.streams.fetch_add(1, Relaxed);
                }
            }
        }));
    }
    // Short requests at `rate` a second, each on its own connection.
    {
        let (counts, ending) = (Arc::clone(&counts), Arc::clone(&ending));
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1) / rate.max(1) as u32);
            while !ending.load(Relaxed) {
                tick.tick().await;
                let counts = Arc::clone(&counts);
                tokio::spawn(async move {
                    let ok = async {
                        let mut s = TcpStream::connect(target).await.ok()?;
                        let req = "POST /v1/chat/completions HTTP/1.1\r\nhost: origin\r\nx-overhead-short: 1\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                        s.write_all(req.as_bytes()).await.ok()?;
                        let mut got = Vec::new();
                        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
                            .await
                            .ok()?
                            .ok()?;
                        let events = memchr::memmem::find_iter(&got, b"\"t\":").count();
                        (got.starts_with(b"HTTP/1.1 200") && events == SHORT_EVENTS).then_some(())
                    }
                    .await;
                    match ok {
                        Some(()) => counts.short.fetch_add(1, Relaxed),
                        None => counts.errors.fetch_add(1, Relaxed),
                    };
                });
            }
        }));
    }
    // The origin's lateness each second it was over 20 ms: a stall that the origin's own
    // sends share is a pause of the load process, not of the proxy.
    let origin_late: Arc<Mutex<std::collections::BTreeMap<u64, u64>>> = Arc::default();
    {
        let (late, record, stop) = (
            Arc::clone(&origin.late),
            Arc::clone(&origin_late),
            Arc::clone(&stop),
        );
        tasks.push(tokio::spawn(async move {
            let stopped = stop.notified();
            tokio::pin!(stopped);
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = &mut stopped => return,
                    _ = tick.tick() => {}
                }
                let worst_ms = {
                    let mut h = late.lock().unwrap();
                    let worst = h.max() / 1000;
                    h.reset();
                    worst
                };
                if worst_ms > 20 {
                    let sec = soak_start.elapsed().as_secs();
                    record.lock().unwrap().insert(sec, worst_ms);
                }
            }
        }));
    }
    let scrape_errors = Arc::new(AtomicU64::new(0));
    if let Some((at, paths)) = proxy.scrape.clone() {
        tasks.push(tokio::spawn(scraper(
            at,
            paths,
            Arc::clone(&stop),
            Arc::clone(&scrape_errors),
        )));
    }
    println!("soak: {streams} streams ({EVENTS} events at 20 ms each, then the next), {rate} short requests/s, access log on, /metrics and /stats scraped every second, for {length:?}");
    println!(
        "{:>6} | {:>9} | {:>16} | {:>14} | {:>6} | {:>6}",
        "minute", "RSS MiB", "streams finished", "short finished", "errors", "stalls"
    );
    let started = Instant::now();
    let mut samples: Vec<(f64, f64)> = Vec::new();
    let mut minute = 0u64;
    while started.elapsed() < length {
        let next = Duration::from_secs(60 * (minute + 1)).min(length);
        tokio::time::sleep(next.saturating_sub(started.elapsed())).await;
        minute += 1;
        let rss = rss_kib(&proxy.pids) as f64 / 1024.0;
        samples.push((started.elapsed().as_secs_f64() / 60.0, rss));
        println!(
            "{:>6} | {rss:>9.1} | {:>16} | {:>14} | {:>6} | {:>6}",
            minute,
            counts.streams.load(Relaxed),
            counts.short.load(Relaxed),
            counts.errors.load(Relaxed) + scrape_errors.load(Relaxed),
            counts.stalls.load(Relaxed),
        );
    }
    ending.store(true, Relaxed);
    stop.notify_waiters();
    for t in tasks {
        t.abort();
    }
    // Every stream the clients dropped ends at the proxy: in flight back to 0.
    let mut in_flight = None;
    if let Some(admin) = admin {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let v = admin_get(admin, "/stats").await.and_then(|b| {
                let v: serde_json::Value = serde_json::from_slice(&b).ok()?;
                v["upstreams"][0]["in_flight"].as_u64()
            });
            in_flight = v;
            if v == Some(0) || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // The slope after warm-up: the first fifth of the run (at most 5 minutes) left out.
    let warm = (samples.len() / 5).clamp(1, 5);
    let fit = &samples[warm.min(samples.len().saturating_sub(2))..];
    let n = fit.len() as f64;
    let (mx, my) = (
        fit.iter().map(|p| p.0).sum::<f64>() / n,
        fit.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxy: f64 = fit.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = fit.iter().map(|p| (p.0 - mx).powi(2)).sum();
    println!(
        "RSS slope after minute {warm}: {:.3} MiB/min over {} samples; errors {}; stalls {}; in flight at the end {}",
        if sxx > 0.0 { sxy / sxx } else { f64::NAN },
        fit.len(),
        counts.errors.load(Relaxed) + scrape_errors.load(Relaxed),
        counts.stalls.load(Relaxed),
        in_flight.map_or("unknown".into(), |v| v.to_string()),
    );
    let late = origin_late.lock().unwrap();
    for (sec, (n, longest)) in counts.stalled_at.lock().unwrap().iter() {
        // The origin's worst lateness in the second before, the same, or the next.
        let origin = (sec.saturating_sub(1)..=sec + 1)
            .filter_map(|s| late.get(&s))
            .max()
            .map_or("on time".to_string(), |ms| format!("up to {ms} ms late"));
        println!("    stalls in second {sec}: {n}, the longest gap {longest} ms; the origin's sends {origin}");
    }
    for (sec, ms) in late.iter() {
        println!("    the origin sent up to {ms} ms late in second {sec}");
    }
    origin.stop.notify_waiters();
    Ok(())
}

/// A GET to tokentap's admin API: the body of a 200.
async fn admin_get(at: SocketAddr, path: &str) -> Option<Vec<u8>> {
    let mut s = TcpStream::connect(at).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nhost: {at}\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut got = Vec::new();
    s.read_to_end(&mut got).await.ok()?;
    let end = got.windows(4).position(|w| w == b"\r\n\r\n")?;
    got.starts_with(b"HTTP/1.1 200")
        .then(|| got[end + 4..].to_vec())
}

/// The short scenario's client: one keep-alive connection, one request after another as
/// fast as the replies come; each reply's time from the request's write to its last byte
/// (reconnecting, not counted as an error, when the server closes between replies).
async fn short_client(
    target: SocketAddr,
    scenario: Scenario,
    tally: Arc<Mutex<Tally>>,
    measuring: Arc<std::sync::atomic::AtomicBool>,
    stop: Arc<tokio::sync::Notify>,
) {
    let long = scenario == Scenario::Long;
    let path =
        std::env::var("TOKENTAP_OVERHEAD_PATH").unwrap_or_else(|_| "/v1/chat/completions".into());
    let mut asked = 0u64;
    let mut wire = || {
        asked += 1;
        let body = if long {
            long_body(asked)
        } else {
            br#"{"model":"m","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"hi"}]}"#.to_vec()
        };
        let req = format!("POST {path} HTTP/1.1\r\nhost: origin\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
        let mut wire = req.into_bytes();
        wire.extend_from_slice(&body);
        wire
    };
    let stopped = stop.notified();
    tokio::pin!(stopped);
    let mut buf = vec![0u8; 16 * 1024];
    // Idle connections open 64 at a time, as they gather in life: the memory they hold
    // idle, not a burst's high-water mark (the allocator keeps a burst's pages).
    static IDLE_GATE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(64);
    let gate = match scenario {
        Scenario::Idle => IDLE_GATE.acquire().await.ok(),
        _ => None,
    };
    'connect: loop {
        let Ok(mut s) = TcpStream::connect(target).await else {
            tally.lock().unwrap().errors += 1;
            return;
        };
        let _ = s.set_nodelay(true);
        loop {
            let wire = wire();
            let sent = Instant::now();
            if s.write_all(&wire).await.is_err() {
                continue 'connect;
            }
            let mut got: Vec<u8> = Vec::new();
            let mut first = None;
            loop {
                let n = tokio::select! {
                    r = s.read(&mut buf) => r.unwrap_or(0),
                    _ = &mut stopped => return,
                };
                if n == 0 {
                    if got.is_empty() {
                        continue 'connect;
                    }
                    tally.lock().unwrap().errors += 1;
                    continue 'connect;
                }
                first.get_or_insert_with(Instant::now);
                got.extend_from_slice(&buf[..n]);
                if got.ends_with(b"\r\n0\r\n\r\n") {
                    break;
                }
                // A reply that is not chunked (a proxy's error) is an error, not a wait.
                let head = memchr::memmem::find(&got, b"\r\n\r\n").map(|h| &got[..h]);
                if head.is_some_and(|h| memchr::memmem::find(h, b"chunked").is_none()) {
                    tally.lock().unwrap().errors += 1;
                    continue 'connect;
                }
            }
            let done = Instant::now();
            let events = memchr::memmem::find_iter(&got, b"\"t\":").count() as u64;
            let ok = got.starts_with(b"HTTP/1.1 200") && events == SHORT_EVENTS as u64;
            let counted = {
                let mut t = tally.lock().unwrap();
                count(&mut t, ok, first, sent, done, events, &measuring)
            };
            if !counted {
                continue;
            }
            if scenario == Scenario::Idle {
                // Idle from now on, the connection kept.
                drop(gate);
                stopped.as_mut().await;
                return;
            }
            if long {
                tokio::select! {
                    () = tokio::time::sleep(LONG_THINK) => {}
                    _ = &mut stopped => return,
                }
            }
        }
    }
}

/// How long the idle scenario's connections take to open, evenly spread: 5 s, or
/// `TOKENTAP_OVERHEAD_IDLE_GATHER` seconds (0: as fast as 64 at a time go).
fn idle_gather() -> Duration {
    let secs = std::env::var("TOKENTAP_OVERHEAD_IDLE_GATHER").ok();
    Duration::from_secs_f64(secs.and_then(|s| s.parse().ok()).unwrap_or(5.0))
}

/// Non-streamed short replies on one connection: back to back, or with `--rate`, client
/// `k` sending its share of the rate as the [`Pacer`] releases it, each request's latency
/// counted from when it was due (a late reply delays the next request, and that delay is
/// counted, not hidden).
async fn json_client(
    target: SocketAddr,
    k: usize,
    pacer: Option<Arc<Pacer>>,
    tally: Arc<Mutex<Tally>>,
    measuring: Arc<std::sync::atomic::AtomicBool>,
    stop: Arc<tokio::sync::Notify>,
) {
    let body = br#"{"model":"m","stream":false,"max_tokens":16,"messages":[{"role":"user","content":"hi"}]}"#;
    let mut wire = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: origin\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
    wire.extend_from_slice(body);
    let mut sent_so_far = 0;
    let stopped = stop.notified();
    tokio::pin!(stopped);
    let mut buf = vec![0u8; 16 * 1024];
    'connect: loop {
        let Ok(mut s) = TcpStream::connect(target).await else {
            tally.lock().unwrap().errors += 1;
            return;
        };
        let _ = s.set_nodelay(true);
        loop {
            let sent = match &pacer {
                Some(p) => {
                    tokio::select! {
                        permit = p.gates[k].acquire() => match permit {
                            Ok(permit) => permit.forget(),
                            Err(_) => return,
                        },
                        _ = &mut stopped => return,
                    }
                    let due = p.due_of(k, sent_so_far);
                    sent_so_far += 1;
                    due
                }
                None => Instant::now(),
            };
            if s.write_all(&wire).await.is_err() {
                tally.lock().unwrap().errors += 1;
                continue 'connect;
            }
            let mut got: Vec<u8> = Vec::new();
            let mut first = None;
            let whole = loop {
                if let Some(n) = response_length(&got) {
                    if got.len() >= n {
                        break n;
                    }
                }
                let n = tokio::select! {
                    r = s.read(&mut buf) => r.unwrap_or(0),
                    _ = &mut stopped => return,
                };
                if n == 0 {
                    tally.lock().unwrap().errors += 1;
                    continue 'connect;
                }
                first.get_or_insert_with(Instant::now);
                got.extend_from_slice(&buf[..n]);
            };
            let done = Instant::now();
            let ok = got.starts_with(b"HTTP/1.1 200")
                && memchr::memmem::find(&got[..whole], b"\"t\":").is_some();
            let counted = {
                let mut t = tally.lock().unwrap();
                count(&mut t, ok, first, sent, done, 1, &measuring)
            };
            if !counted {
                continue 'connect;
            }
        }
    }
}

/// A response's whole length, head and `Content-Length` body, once its head is in.
fn response_length(got: &[u8]) -> Option<usize> {
    let head = memchr::memmem::find(got, b"\r\n\r\n")? + 4;
    let len = header_value(&got[..head], "content-length")?
        .parse::<usize>()
        .ok()?;
    Some(head + len)
}

/// Tallies one short reply: false when it was not whole (an error).
fn count(
    t: &mut Tally,
    ok: bool,
    first: Option<Instant>,
    sent: Instant,
    done: Instant,
    events: u64,
    measuring: &std::sync::atomic::AtomicBool,
) -> bool {
    if !ok {
        t.errors += 1;
        return false;
    }
    if let Some(f) = first {
        if t.ttft.len() < 100_000 {
            t.ttft.push(f.duration_since(sent).as_micros() as u64);
        }
    }
    if measuring.load(Relaxed) {
        let us = done.duration_since(sent).as_micros().max(1) as u64;
        let _ = t.lat.record(us);
        let _ = t.app_lat.record(us);
        t.events += events;
        t.requests += 1;
    }
    true
}

/// Whether the long scenario has `feature` on (`TOKENTAP_OVERHEAD_LONG`, a list of `usage`,
/// `mirror` and `prefix`; all three when unset).
fn long_on(feature: &str) -> bool {
    std::env::var("TOKENTAP_OVERHEAD_LONG").map_or(true, |on| on.split(',').any(|f| f == feature))
}

/// A long prompt's request body ([`LONG_BYTES`]): one of [`LONG_PREFIXES`] system prompts
/// (an agent's tools and context), then a short question of its own.
fn long_body(n: u64) -> Vec<u8> {
    let prefix = n % LONG_PREFIXES as u64;
    let words = format!("context {prefix} tool schema and documents ");
    let system = words.repeat(LONG_BYTES / words.len());
    format!(
        r#"{{"model":"m","stream":true,"max_tokens":16,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question {n}"}}]}}"#
    )
    .into_bytes()
}

/// One read, with the kernel's receive stamp of its last segment (none when the kernel
/// gave none).
async fn read_stamped(
    s: &TcpStream,
    buf: &mut [u8],
    cmsg: &mut Vec<u8>,
) -> std::io::Result<(usize, Option<SystemTime>)> {
    loop {
        s.readable().await?;
        let read = s.try_io(Interest::READABLE, || {
            let mut iov = [IoSliceMut::new(buf)];
            let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut *cmsg), MsgFlags::empty())
                .map_err(std::io::Error::from)?;
            let stamp = msg.cmsgs().ok().and_then(|mut c| {
                c.find_map(|c| match c {
                    ControlMessageOwned::ScmTimestampns(ts) => Some(
                        SystemTime::UNIX_EPOCH
                            + Duration::new(ts.tv_sec() as u64, ts.tv_nsec() as u32),
                    ),
                    _ => None,
                })
            });
            Ok((msg.bytes, stamp))
        });
        match read {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}
