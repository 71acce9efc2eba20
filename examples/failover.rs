//! A replica dies under load: tokentap's pool against nginx's upstream block, each with its
//! defaults, side by side.
//!
//! Three simulated replicas (`tokentap sim`'s engine in this process: 5 ms a token, 20
//! tokens, 5 ms to the first), 32 closed-loop clients of streaming chat requests for 16 s,
//! one new connection a request. At 3 s the second replica is killed (its listener and every
//! connection closed, as a process that dies); at 6 s it is started again on its address.
//! Through tokentap (`endpoints = [...]`, `[upstream.health] every_secs = 1`, everything
//! else default: passive ejection, a failed connect retried on another endpoint) and through
//! nginx (`server a; server b; server c;`: `max_fails=1 fail_timeout=10s`,
//! `proxy_next_upstream error timeout`, `proxy_buffering off`), one after the other.
//!
//! Per proxy: requests, those that failed (not a 200 that ended with `[DONE]`), those that
//! failed having started more than a second after the kill, and how long after its restart
//! the replica served again; three runs of each, alternating.
//!
//! Then `/metrics` at three pools of 16 endpoints each (48 simulated replicas) under 96
//! clients: its size and how long a scrape takes.
//!
//! `cargo run --release --example failover` (needs `nginx` on the PATH for its row).

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokentap::config::Config;
use tokentap::server::Running;
use tokentap::sim::{Sim, SimArgs};
use tokio::net::TcpStream;
use tokio::time::Instant;

const CLIENTS: usize = 32;
const RUN: Duration = Duration::from_secs(16);
/// Runs of each proxy, alternating.
const REPS: usize = 3;
const KILL_AT: Duration = Duration::from_secs(3);
const RESTART_AT: Duration = Duration::from_secs(6);

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        println!(
            "{CLIENTS} clients, 3 replicas, the second killed at {KILL_AT:?} and started again at {RESTART_AT:?}, {RUN:?} in all\n"
        );
        println!(
            "{:<9} {:>8} {:>7} {:>24} {:>26}",
            "proxy", "requests", "failed", "failed, started ≥1 s after", "serves again after restart"
        );
        for _ in 0..REPS {
        for proxy in ["tokentap", "nginx"] {
            match run(proxy).await {
                Ok(r) => println!(
                    "{proxy:<9} {:>8} {:>7} {:>24} {:>26}",
                    r.requests,
                    r.failed,
                    r.failed_late,
                    r.back.map_or_else(|| "never (in the run)".into(), |d| format!("{:.2} s", d.as_secs_f64()))
                ),
                Err(e) => println!("{proxy:<9} skipped: {e:#}"),
            }
        }
        }
        scrape().await
    })
}

/// `/metrics` of three pools × 16 endpoints under load: its size, and scrape times.
async fn scrape() -> anyhow::Result<()> {
    let mut sims = Vec::new();
    let mut text = format!(
        "[listen]\nproxy = \"{}\"\nadmin = \"{}\"\n",
        free()?,
        free()?
    );
    for pool in 0..3 {
        let mut list = Vec::new();
        for _ in 0..16 {
            let sim = replica(free()?).await?;
            list.push(format!("\"http://{}\"", sim.addr));
            sims.push(sim);
        }
        text.push_str(&format!(
            "[[upstream]]\nname = \"pool-{pool}\"\nendpoints = [{}]\nmax_concurrency = 8\n",
            list.join(", ")
        ));
    }
    text.push_str("[[route]]\nsplit = { \"pool-0\" = 1, \"pool-1\" = 1, \"pool-2\" = 1 }\n");
    let config = Config::parse(&text, "scrape")?;
    let (proxy, admin) = (config.listen.proxy, config.listen.admin);
    let running = Running::start(config);
    running.wait_ready(Duration::from_secs(10)).await?;
    let end = Instant::now() + Duration::from_secs(8);
    let mut clients = Vec::new();
    for _ in 0..96 {
        clients.push(tokio::spawn(async move {
            while Instant::now() < end {
                one(proxy).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut times = Vec::new();
    let mut size = 0;
    while Instant::now() + Duration::from_millis(200) < end {
        let t = Instant::now();
        let body = get(admin, "/metrics").await?;
        times.push(t.elapsed());
        size = body.len();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for c in clients {
        c.await?;
    }
    times.sort();
    let series = get(admin, "/metrics")
        .await?
        .split(|&b| b == b'\n')
        .filter(|l| l.starts_with(b"tokentap_endpoint_"))
        .count();
    println!(
        "\n/metrics, 3 pools × 16 endpoints, 96 clients: {size} bytes ({series} per-endpoint series); scrape p50 {:.1} ms, max {:.1} ms over {} scrapes",
        times[times.len() / 2].as_secs_f64() * 1e3,
        times[times.len() - 1].as_secs_f64() * 1e3,
        times.len()
    );
    tokio::task::spawn_blocking(move || running.stop()).await?;
    drop(sims);
    Ok(())
}

/// A GET's body.
async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<Bytes> {
    let stream = TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))?;
    let resp = sender.send_request(req).await?;
    Ok(resp.into_body().collect().await?.to_bytes())
}

struct Result {
    requests: usize,
    failed: usize,
    failed_late: usize,
    back: Option<Duration>,
}

async fn replica(listen: SocketAddr) -> anyhow::Result<Sim> {
    Ok(Sim::start(SimArgs {
        listen,
        tpot_curve: "1:5".parse().map_err(anyhow::Error::msg)?,
        ttft_ms: 5.0,
        max_tokens: 20,
        ..SimArgs::defaults()
    })
    .await?)
}

fn free() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

async fn run(proxy: &str) -> anyhow::Result<Result> {
    let mut sims = Vec::new();
    for _ in 0..3 {
        sims.push(Some(replica(free()?).await?));
    }
    let addrs: Vec<SocketAddr> = sims.iter().flatten().map(|s| s.addr).collect();
    let listen = free()?;
    let dir = std::env::temp_dir().join(format!("tokentap-failover-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut nginx = None;
    let mut tap = None;
    match proxy {
        "tokentap" => {
            let list: Vec<String> = addrs.iter().map(|a| format!("\"http://{a}\"")).collect();
            let text = format!(
                "[listen]\nproxy = \"{listen}\"\nadmin = \"{}\"\n[[upstream]]\nname = \"pool\"\nendpoints = [{}]\n[upstream.health]\nevery_secs = 1\n",
                free()?,
                list.join(", ")
            );
            let running = Running::start(Config::parse(&text, "failover")?);
            running.wait_ready(Duration::from_secs(10)).await?;
            tap = Some(running);
        }
        _ => {
            let servers: String = addrs.iter().map(|a| format!("server {a}; ")).collect();
            let d = dir.display();
            let conf = dir.join("nginx.conf");
            std::fs::write(
                &conf,
                format!(
                    "worker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log crit;\n\
                     events {{ worker_connections 4096; }}\n\
                     http {{ access_log off; client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
                       upstream pool {{ {servers} keepalive 64; }}\n\
                       server {{ listen {listen}; location / {{ proxy_pass http://pool; proxy_http_version 1.1;\n\
                         proxy_set_header Connection \"\"; proxy_buffering off; }} }} }}\n"
                ),
            )?;
            let child = Command::new("nginx")
                .arg("-c")
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()?;
            nginx = Some(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            while TcpStream::connect(listen).await.is_err() {
                anyhow::ensure!(Instant::now() < deadline, "nginx did not start");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    let start = Instant::now();
    let end = start + RUN;
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let done = Arc::clone(&done);
        clients.push(tokio::spawn(async move {
            while Instant::now() < end {
                let began = Instant::now();
                let ok = one(listen).await;
                done.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((began, ok));
            }
        }));
    }
    tokio::time::sleep_until(start + KILL_AT).await;
    let victim = addrs[1];
    sims[1] = None;
    let killed = Instant::now();
    tokio::time::sleep_until(start + RESTART_AT).await;
    let back_sim = replica(victim).await?;
    let restarted = Instant::now();
    let before = back_sim.engine.stats().completed + back_sim.engine.stats().decoding;
    let mut back = None;
    while Instant::now() < end {
        let s = back_sim.engine.stats();
        if s.completed + s.decoding + s.prefilling > before {
            back = Some(restarted.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for c in clients {
        c.await?;
    }
    let done = std::mem::take(&mut *done.lock().unwrap_or_else(|p| p.into_inner()));
    if let Some(mut child) = nginx {
        let _ = child.kill();
        let _ = child.wait();
    }
    if let Some(tap) = tap {
        tokio::task::spawn_blocking(move || tap.stop()).await?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    let settled = killed + Duration::from_secs(1);
    Ok(Result {
        requests: done.len(),
        failed: done.iter().filter(|(_, ok)| !ok).count(),
        failed_late: done.iter().filter(|(t, ok)| *t >= settled && !ok).count(),
        back,
    })
}

/// One streaming request on a new connection: a 200 whose stream ended with `[DONE]`.
async fn one(proxy: SocketAddr) -> bool {
    let go = async {
        let stream = TcpStream::connect(proxy).await.ok()?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .ok()?;
        tokio::spawn(conn);
        let body = r#"{"model":"m","stream":true,"max_tokens":20,"messages":[{"role":"user","content":"hi"}]}"#;
        let req = http::Request::post("/v1/chat/completions")
            .header("host", proxy.to_string())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .ok()?;
        let resp = sender.send_request(req).await.ok()?;
        if resp.status() != 200 {
            return Some(false);
        }
        let bytes = resp.into_body().collect().await.ok()?.to_bytes();
        Some(memchr::memmem::find(&bytes, b"[DONE]").is_some())
    };
    tokio::time::timeout(Duration::from_secs(10), go)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}
