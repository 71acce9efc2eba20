//! What a proxy costs a token stream: tokentap and nginx (`proxy_buffering off`) side by
//! side, against the same paced SSE origin, measured from one process on one clock.
//!
//! Run: `cargo build --release && cargo run --release --example overhead`
//!      (`-- --shapes 512x20 --secs 10 --reps 3 --modes tokentap,nginx` to choose; nginx is
//!      skipped when absent)
//!
//! The origin sends OpenAI-shaped chunks every `interval` ms on each stream (the streams
//! spread evenly over one interval), each carrying its send time; the client records
//! receive − send per event (HDR histograms), TTFT, stalls (a gap over 3× the interval) and
//! errors. The receive time is the kernel's receive stamp on the client socket
//! (`SO_TIMESTAMPNS`, brought onto the same monotonic clock at each read), so the load
//! side's own scheduling stays out of it; the time to the client task's read is printed
//! beside it ("at the app"). Measurement starts once every stream has
//! received its first event, plus a warm-up. Each shape runs **direct**, **through tokentap**
//! and **through nginx**, alternating, `reps` times; the table shows medians. "Added" is the
//! proxied percentile minus the direct one. The proxy runs pinned to CPU 1 with one worker
//! (`taskset -c 1`, nginx `worker_processes 1`, tokentap `threads = 1`); this process (origin
//! and client) re-executes itself pinned to CPU 0. CPU per event comes from the proxy's
//! `/proc/PID/task/*/schedstat` (ns), memory per stream from its RSS with all streams open
//! minus its RSS before. A warning says when the load side itself was saturated.
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
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
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
    Nginx,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Direct => "direct",
            Mode::Tokentap => "tokentap",
            Mode::Nginx => "nginx",
        }
    }
}

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
    errors: u64,
    cpu_us_per_event: Option<f64>,
    rss_kib_per_stream: Option<f64>,
    /// The load side's own state: its CPU share, and how late the origin sent (p99, ms).
    load_cpu_share: f64,
    origin_late_p99_ms: f64,
    /// The per-event latency at p10, p25, p75, p90 and p99.9, µs.
    spread_us: [u64; 5],
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // Pin this process (origin and client) to CPU 0, by running again under taskset.
    if std::env::var_os("TOKENTAP_OVERHEAD_PINNED").is_none() && which("taskset") {
        let status = Command::new("taskset")
            .arg("-c")
            .arg("0")
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
    let shapes: Vec<Shape> = opt("--shapes")
        .unwrap_or_else(|| "1x20,512x20,4000x160,9900x400".into())
        .split(',')
        .map(|s| {
            let (n, ms) = s.split_once('x').expect("shape is STREAMSxMS");
            Shape {
                streams: n.parse().expect("streams"),
                interval_ms: ms.parse().expect("interval"),
            }
        })
        .collect();
    let secs: u64 = opt("--secs").map_or(10, |s| s.parse().expect("secs"));
    let reps: usize = opt("--reps").map_or(3, |s| s.parse().expect("reps"));
    let only = opt("--modes");
    let (soft, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE)?;
    rlimit::setrlimit(rlimit::Resource::NOFILE, hard, hard)?;
    println!("open-file limit raised from {soft} to {hard}; origin + client pinned to CPU 0, proxies to CPU 1 (taskset)");

    // TOKENTAP_OVERHEAD_BIN measures another build (an earlier commit's, say).
    let bin = std::env::var_os("TOKENTAP_OVERHEAD_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/tokentap"),
        PathBuf::from,
    );
    anyhow::ensure!(bin.exists(), "build the proxy first: cargo build --release");
    let nginx = which("nginx");
    if !nginx {
        println!("nginx not found: its column is skipped (Debian: apt-get install nginx)");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut report = String::new();
    for shape in shapes {
        let modes: Vec<Mode> = [Mode::Direct, Mode::Tokentap, Mode::Nginx]
            .into_iter()
            .filter(|m| *m != Mode::Nginx || nginx)
            .filter(|m| {
                only.as_ref()
                    .is_none_or(|o| o.split(',').any(|n| n == m.name()))
            })
            .collect();
        let mut runs: Vec<(Mode, Run)> = Vec::new();
        for rep in 0..reps {
            for &mode in &modes {
                let run = rt.block_on(run_once(shape, mode, Duration::from_secs(secs), &bin))?;
                println!(
                    "{}x{}ms rep {} {:>8}: p50 {:.0} µs, p99 {:.0} µs (at the app {:.0}, {:.0}), {} events, stalls {}, errors {}, cpu {} µs/event, rss {} KiB/stream",
                    shape.streams, shape.interval_ms, rep + 1, mode.name(), run.p50_us, run.p99_us, run.app_p50_us, run.app_p99_us, run.events, run.stalls, run.errors,
                    run.cpu_us_per_event.map_or("-".into(), |v| format!("{v:.2}")),
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
        report += &table(shape, &runs);
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

fn table(shape: Shape, runs: &[(Mode, Run)]) -> String {
    let of = |m: Mode, f: &dyn Fn(&Run) -> f64| {
        median(
            runs.iter()
                .filter(|(x, _)| *x == m)
                .map(|(_, r)| f(r))
                .collect(),
        )
    };
    let base50 = of(Mode::Direct, &|r| r.p50_us);
    let base99 = of(Mode::Direct, &|r| r.p99_us);
    let app50 = of(Mode::Direct, &|r| r.app_p50_us);
    let app99 = of(Mode::Direct, &|r| r.app_p99_us);
    let base_ttft = of(Mode::Direct, &|r| r.ttft_p99_us);
    let mut out = format!(
        "{} streams × {} ms (medians of {} runs)\n{:>9} | {:>13} | {:>13} | {:>17} | {:>15} | {:>12} | {:>14} | {:>6} | {:>6}\n",
        shape.streams, shape.interval_ms, runs.iter().filter(|(m, _)| *m == Mode::Direct).count(),
        "", "added p50 µs", "added p99 µs", "at the app p50/99", "TTFT added p99", "CPU µs/event", "RSS KiB/stream", "stalls", "errors"
    );
    for m in [Mode::Direct, Mode::Tokentap, Mode::Nginx] {
        if !runs.iter().any(|(x, _)| *x == m) {
            continue;
        }
        let f = |v: f64| {
            if v.is_nan() {
                "-".to_owned()
            } else {
                format!("{v:.1}")
            }
        };
        let _ = writeln!(
            out,
            "{:>9} | {:>13} | {:>13} | {:>17} | {:>15} | {:>12} | {:>14} | {:>6} | {:>6}",
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
    let share = median(runs.iter().map(|(_, r)| r.load_cpu_share).collect());
    let late = median(runs.iter().map(|(_, r)| r.origin_late_p99_ms).collect());
    let _ = writeln!(
        out,
        "load side: CPU share {:.0}%, origin sends late by p99 {late:.2} ms",
        share * 100.0
    );
    if share > 0.85 || late > shape.interval_ms as f64 / 4.0 {
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

/// The origin: every connection gets a chunked SSE stream of stamped chunks.
struct Origin {
    addr: SocketAddr,
    epoch: Instant,
    late: Arc<Mutex<Histogram<u64>>>,
    stop: Arc<tokio::sync::Notify>,
}

async fn origin(interval: Duration, streams: usize, epoch: Instant) -> Origin {
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
    let (l, s) = (Arc::clone(&late), Arc::clone(&stop));
    let n = Arc::new(AtomicU64::new(0));
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = tokio::select! {
                a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                _ = s.notified() => return,
            };
            let (l, k) = (Arc::clone(&l), n.fetch_add(1, Relaxed));
            tokio::spawn(async move {
                let _ = sock.set_nodelay(true);
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                // Request head and body (a small JSON with Content-Length).
                loop {
                    let Ok(r) = sock.read(&mut buf).await else {
                        return;
                    };
                    if r == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..r]);
                    if let Some(h) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&got[..h]).to_ascii_lowercase();
                        let len = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if got.len() >= h + 4 + len {
                            break;
                        }
                    }
                }
                if memchr::memmem::find(&got, b"x-overhead-hold").is_some() {
                    // A slot holder: a short stream after 2 s, then close.
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    let data = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
                    let whole = format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{data}", data.len());
                    let _ = sock.write_all(whole.as_bytes()).await;
                    return;
                }
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";
                if sock.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                // Streams start spread evenly over one interval, as independent clients
                // would (tokio's timers then fire them in 1 ms groups).
                let offset = interval.mul_f64((k % streams as u64) as f64 / streams as f64);
                let mut due = tokio::time::Instant::now() + offset;
                loop {
                    tokio::time::sleep_until(due).await;
                    let now = tokio::time::Instant::now();
                    let _ = l
                        .lock()
                        .unwrap()
                        .record(now.saturating_duration_since(due).as_micros().max(1) as u64);
                    let t = epoch.elapsed().as_nanos();
                    let data = format!(
                        "data: {{\"id\":\"chatcmpl-overhead\",\"object\":\"chat.completion.chunk\",\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" tok\"}},\"finish_reason\":null}}],\"t\":{t}}}\n\n"
                    );
                    let chunk = format!("{:x}\r\n{data}\r\n", data.len());
                    if sock.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                    due += interval;
                }
            });
        }
    });
    Origin {
        addr,
        epoch,
        late,
        stop,
    }
}

/// A proxy process under test.
struct Proxy {
    child: Child,
    addr: SocketAddr,
    /// Processes whose CPU and memory count (nginx: master and worker).
    pids: Vec<u32>,
    dir: PathBuf,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
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

/// Starts the proxy of `mode` in front of `origin`; `cap`: tokentap's upstream gets this
/// concurrency cap, with a queue as deep.
async fn start_proxy(
    mode: Mode,
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
    let child = match mode {
        Mode::Direct => return None,
        Mode::Tokentap => {
            let conf = dir.join("tokentap.toml");
            std::fs::write(
                &conf,
                format!(
                    "[listen]\nproxy = \"{addr}\"\nadmin = \"{}\"\n[server]\nthreads = 1\ngrace_period_secs = 0\n{}\n[[upstream]]\nname = \"origin\"\nurl = \"http://{origin}\"\n{}",
                    free_port(),
                    // TOKENTAP_OVERHEAD_SERVER="work_stealing = false" adds [server] settings.
                    std::env::var("TOKENTAP_OVERHEAD_SERVER").unwrap_or_default(),
                    cap.map_or(String::new(), |n| format!(
                        "max_concurrency = {n}\nmax_queue = {n}\nqueue_timeout_ms = 60000\n"
                    )),
                ),
            )
            .ok()?;
            // TOKENTAP_OVERHEAD_WRAP="valgrind --tool=callgrind" profiles the proxy.
            let wrap = std::env::var("TOKENTAP_OVERHEAD_WRAP").unwrap_or_default();
            let mut cmd = Command::new("taskset");
            cmd.args(["-c", "1"])
                .args(wrap.split_whitespace())
                .arg(bin)
                .arg("run")
                .arg("--config")
                .arg(&conf);
            cmd.stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()?
        }
        Mode::Nginx => {
            // nginx starts closing connections once fewer than 1/16 of `worker_connections`
            // are free ("worker_connections are not enough, reusing connections"): 9,900
            // streams hold 19,800 connections, so it needs 22,000 slots: more than the
            // 20,000 files it may open, of which it uses fewer than 19,810.
            let conf = dir.join("nginx.conf");
            let d = dir.display();
            std::fs::write(
                &conf,
                format!(
                    "worker_processes 1;\nworker_rlimit_nofile 20000;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
                     events {{ worker_connections 22000; multi_accept on; }}\n\
                     http {{ access_log off; client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
                       upstream origin {{ server {origin}; keepalive 1024; }}\n\
                       server {{ listen {addr}; location / {{ proxy_pass http://origin; proxy_http_version 1.1; proxy_set_header Connection \"\";\n\
                         proxy_buffering off; proxy_read_timeout 600s; }} }} }}\n"
                ),
            )
            .ok()?;
            Command::new("taskset")
                .args(["-c", "1"])
                .arg("nginx")
                .arg("-c")
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()?
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
    let mut pids = vec![child.id()];
    pids.extend(children(child.id()));
    Some(Proxy {
        child,
        addr,
        pids,
        dir,
    })
}

fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
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
    stalls: u64,
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
            stalls: 0,
            errors: 0,
        }
    }
}

async fn run_once(shape: Shape, mode: Mode, measure: Duration, bin: &Path) -> anyhow::Result<Run> {
    let interval = Duration::from_millis(shape.interval_ms);
    let epoch = Instant::now();
    let origin = origin(interval, shape.streams, epoch).await;
    let queued = mode == Mode::Tokentap && std::env::var_os("TOKENTAP_OVERHEAD_QUEUED").is_some();
    let proxy = start_proxy(mode, origin.addr, bin, queued.then_some(shape.streams)).await;
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
    for _ in 0..shape.streams {
        let (tally, measuring, stop, sem) = (
            Arc::clone(&tally),
            Arc::clone(&measuring),
            Arc::clone(&stop),
            Arc::clone(&sem),
        );
        tasks.push(tokio::spawn(async move {
            client(target, interval, epoch, tally, measuring, stop, sem).await
        }));
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
    measuring.store(true, Relaxed);
    tokio::time::sleep(measure).await;
    measuring.store(false, Relaxed);
    let (cpu1, self1, wall) = (cpu_ns(&pids), self_cpu_ns(), wall0.elapsed());
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
        errors: t.errors,
        cpu_us_per_event: (!pids.is_empty() && t.events > 0)
            .then(|| (cpu1 - cpu0) as f64 / 1e3 / t.events as f64),
        rss_kib_per_stream: (!pids.is_empty())
            .then(|| rss_open.saturating_sub(rss_before) as f64 / shape.streams as f64),
        load_cpu_share: (self1 - self0) as f64 / wall.as_nanos() as f64,
        origin_late_p99_ms: late.value_at_quantile(0.99) as f64 / 1e3,
        spread_us: [0.1, 0.25, 0.75, 0.9, 0.999].map(|q| lat.value_at_quantile(q)),
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
        }
        last = Some(now);
    }
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
