//! New clients at `server.max_connections`: what taking an idle connection's place costs.
//!
//! tokentap (the release build, or `TOKENTAP_EVICT_BIN`; `TOKENTAP_EVICT_BIN_B` beside it,
//! run for run) with `max_connections` = IDLE, in front of a small origin in this process.
//! IDLE keep-alive clients each send one request and stay, until they are parked (idle
//! past a second); then NEW clients, 16 at a time, each send one request and
//! stay, so that each takes the place of the connection idle longest. Per run: the proxy's
//! CPU per new client (every thread's, `/proc/PID/task/*/schedstat`), the evictions it
//! counted, and new clients a second (the load side's pace as much as the proxy's).
//!
//! `cargo build --release && cargo run --release --example evict [-- IDLE NEW REPS]`
//! (8,000, 4,000 and 3 by default; the open-file limit must allow IDLE + NEW on each side).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const REQUEST: &[u8] = b"GET /v1/models HTTP/1.1\r\nhost: origin\r\n\r\n";
const REPLY: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n";
/// New clients at once.
const AT_ONCE: usize = 16;

fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().context("IDLE NEW REPS are counts"))
        .collect::<anyhow::Result<_>>()?;
    let (idle, new, reps) = (
        args.first().copied().unwrap_or(8_000),
        args.get(1).copied().unwrap_or(4_000),
        args.get(2).copied().unwrap_or(3),
    );
    let (_, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE)?;
    rlimit::setrlimit(rlimit::Resource::NOFILE, hard, hard)?;
    anyhow::ensure!(
        (idle + new + 256) as u64 <= hard,
        "the open-file limit ({hard}) is too low for {idle} + {new} connections"
    );
    let bin = std::env::var_os("TOKENTAP_EVICT_BIN").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/tokentap"),
        PathBuf::from,
    );
    anyhow::ensure!(bin.exists(), "build the proxy first: cargo build --release");
    let mut bins = vec![("tokentap", bin)];
    if let Some(b) = std::env::var_os("TOKENTAP_EVICT_BIN_B") {
        bins.push(("tokentap-b", PathBuf::from(b)));
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let origin = origin().await?;
        println!("{idle} idle clients parked at max_connections = {idle}, then {new} new ones, {AT_ONCE} at a time");
        for rep in 1..=reps {
            for (name, bin) in &bins {
                let run = one_run(bin, origin, idle, new).await?;
                println!(
                    "rep {rep} {name:>10}: {:.1} µs of the proxy's CPU per new client, {} evicted, {:.0} new clients/s",
                    run.cpu_us_per_client, run.evicted, run.per_sec
                );
            }
        }
        anyhow::Ok(())
    })
}

struct Run {
    cpu_us_per_client: f64,
    evicted: u64,
    per_sec: f64,
}

async fn one_run(bin: &Path, origin: SocketAddr, idle: usize, new: usize) -> anyhow::Result<Run> {
    let (proxy, admin) = (free_port()?, free_port()?);
    let dir = std::env::temp_dir().join(format!("tokentap-evict-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("tokentap.toml");
    std::fs::write(
        &config,
        format!(
            "[listen]\nproxy = \"{proxy}\"\nadmin = \"{admin}\"\n\
             [server]\nmax_connections = {idle}\nkeepalive_timeout_secs = 300\n\
             [[upstream]]\nname = \"origin\"\nurl = \"http://{origin}\"\n"
        ),
    )?;
    let child = Command::new(bin)
        .args(["run", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let proxy_process = Stopped(child);
    let pid = proxy_process.0.id();
    let ready = Instant::now();
    while stats(admin).await.is_err() {
        anyhow::ensure!(
            ready.elapsed() < Duration::from_secs(10),
            "the proxy did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The idle ones, 200 at a time, until they are parked.
    let mut held = clients(proxy, idle, 200).await?;
    let parking = Instant::now();
    // (A build before stop 57 left a few in a thousand in their task: a readiness left from
    // their request that brought no byte kept them waiting there, evictable, unparked.)
    while connections(admin, "parked").await? < idle as u64 * 99 / 100 {
        anyhow::ensure!(
            parking.elapsed() < Duration::from_secs(30),
            "not every idle connection parked: {}",
            stats(admin).await?["connections"]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (cpu0, evicted0, t0) = (
        cpu_ns(pid),
        connections(admin, "evicted_total").await?,
        Instant::now(),
    );
    held.extend(clients(proxy, new, AT_ONCE).await?);
    let elapsed = t0.elapsed().as_secs_f64();
    let (cpu1, evicted1) = (cpu_ns(pid), connections(admin, "evicted_total").await?);
    drop(proxy_process);
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Run {
        cpu_us_per_client: (cpu1 - cpu0) as f64 / 1e3 / new as f64,
        evicted: evicted1 - evicted0,
        per_sec: new as f64 / elapsed,
    })
}

/// The proxy, stopped (SIGTERM, then killed) when dropped.
struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `count` connections to the proxy that have had their one reply, `at_once` opening at a
/// time.
async fn clients(
    proxy: SocketAddr,
    count: usize,
    at_once: usize,
) -> anyhow::Result<Vec<TcpStream>> {
    let gate = Arc::new(tokio::sync::Semaphore::new(at_once));
    let opening: Vec<_> = (0..count)
        .map(|_| {
            let gate = Arc::clone(&gate);
            tokio::spawn(async move {
                let _turn = gate.acquire().await?;
                one_request(proxy).await
            })
        })
        .collect();
    let mut opened = Vec::with_capacity(count);
    for o in opening {
        opened.push(o.await??);
    }
    Ok(opened)
}

/// A connection to the proxy that has had its one reply.
async fn one_request(proxy: SocketAddr) -> anyhow::Result<TcpStream> {
    let mut tcp = TcpStream::connect(proxy).await?;
    tcp.write_all(REQUEST).await?;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"\r\n\r\nok\n") {
        let n = tcp.read(&mut buf).await?;
        anyhow::ensure!(
            n > 0,
            "closed before its reply: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    Ok(tcp)
}

/// An origin that answers every request on a connection with a 3-byte body.
async fn origin() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n) = tcp.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    while let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        got.drain(..end + 4);
                        if tcp.write_all(REPLY).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    Ok(addr)
}

fn free_port() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// The admin's `/stats`.
async fn stats(admin: SocketAddr) -> anyhow::Result<serde_json::Value> {
    let mut tcp = TcpStream::connect(admin).await?;
    let req = format!("GET /stats HTTP/1.1\r\nhost: {admin}\r\nconnection: close\r\n\r\n");
    tcp.write_all(req.as_bytes()).await?;
    let mut got = Vec::new();
    tcp.read_to_end(&mut got).await?;
    let at = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no head")?;
    Ok(serde_json::from_slice(&got[at + 4..])?)
}

/// `connections.FIELD` of the admin's `/stats`.
async fn connections(admin: SocketAddr, field: &str) -> anyhow::Result<u64> {
    let s = stats(admin).await?;
    s["connections"][field]
        .as_u64()
        .with_context(|| format!("no connections.{field} in /stats"))
}

/// CPU time of every thread of `pid`, ns.
fn cpu_ns(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}
