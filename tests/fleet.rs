//! Caps across replicas, with a real `redis-server`: three tokentap processes in front of
//! one simulator with room for 128, `max_concurrency = 16` for the fleet. 96 clients spread
//! over them: the simulator's batch stays ≤ 16 (and reaches 12). Redis killed mid-run:
//! serving goes on at each replica's share, the batch ≤ 16 + 3; Redis back: ≤ 16 again
//! within `lease_secs`. A replica killed with SIGKILL while holding slots: they are free
//! within `lease_secs`.
//!
//! Needs `redis-server` (`apt-get install redis-server`); without it the tests say so and
//! pass, except in CI (`CI=true`), where they fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::process::{listen_section, Scratch, Tokentap};
use common::*;
use nix::sys::signal::Signal;
use tokentap::load::{self, LoadArgs, Mode, PhaseReport};
use tokentap::sim::{Curve, Sim, SimArgs};

const LEASE_SECS: u64 = 3;

/// One test at a time: each runs several processes, and two cores are few for both.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start(port: u16) -> Option<Redis> {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Redis { child, port })
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn redis_missing() -> bool {
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI needs redis-server: apt-get install redis-server"
        );
        eprintln!("skipped: no redis-server (apt-get install redis-server)");
    }
    !found
}

async fn sim() -> Sim {
    Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: "1:20,128:20".parse::<Curve>().unwrap(),
        ttft_ms: 10.0,
        max_batch: Some(128),
        max_tokens: 30,
        ..SimArgs::defaults()
    })
    .await
    .unwrap()
}

fn replica(dir: &Scratch, name: &str, redis: u16, sim: SocketAddr) -> Tokentap {
    let (listen, proxy, admin) = listen_section();
    let sub = dir.path(name);
    std::fs::create_dir_all(&sub).unwrap();
    let cfg = format!(
        "{listen}[cluster]\nredis_url = \"redis://127.0.0.1:{redis}\"\nlease_secs = {LEASE_SECS}\n\
         [[upstream]]\nname = \"sim\"\nurl = \"http://{sim}\"\nmax_concurrency = 16\nqueue_timeout_ms = 60000\n"
    );
    Tokentap::start(&sub, &cfg, proxy, admin, &[])
}

/// `clients` closed-loop clients on each replica for `secs`.
async fn load_all(proxies: Vec<SocketAddr>, clients: usize, secs: f64) -> Vec<PhaseReport> {
    let mut runs = Vec::new();
    for proxy in proxies {
        let target = LoadArgs {
            max_tokens: 30,
            ..LoadArgs::for_url(format!("http://{proxy}"))
        }
        .target()
        .unwrap();
        runs.push(tokio::spawn(async move {
            load::phase(
                &target,
                Mode::Closed {
                    concurrency: clients,
                },
                Duration::ZERO,
                Duration::from_secs_f64(secs),
                false,
            )
            .await
        }));
    }
    let mut out = Vec::new();
    for r in runs {
        out.push(r.await.unwrap());
    }
    out
}

/// The simulator's peak batch from now on (it keeps the peak itself, step by step).
async fn peak_from_now(sim: SocketAddr) {
    let r = send(sim, "POST", "/sim/peak/reset", b"", &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200);
}

async fn peak_batch(sim: SocketAddr) -> u64 {
    let r = send(sim, "GET", "/sim/stats", b"", &[]).await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    v["peak_batch"].as_u64().unwrap()
}

fn only_429s(reports: &[PhaseReport]) {
    for r in reports {
        for (kind, n) in &r.errors {
            assert!(
                kind.contains("429"),
                "{n} errors of kind {kind}: {:?}",
                r.errors
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_for_the_fleet_through_three_replicas_and_redis_going_away() {
    if redis_missing() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let mut redis = Redis::start(free_addr().port()).unwrap();
    let sim = sim().await;
    let dir = Scratch::new("fleet");
    let taps: Vec<Tokentap> = ["a", "b", "c"]
        .iter()
        .map(|n| replica(&dir, n, redis.port, sim.addr))
        .collect();

    // 96 clients, 32 on each replica.
    let reports = load_all(taps.iter().map(|t| t.proxy).collect(), 32, 6.0).await;
    only_429s(&reports);
    let stats: serde_json::Value = serde_json::from_slice(
        &send(sim.addr, "GET", "/sim/stats", b"", &[])
            .await
            .unwrap()
            .body,
    )
    .unwrap();
    let peak = stats["peak_batch"].as_u64().unwrap();
    assert!(
        (12..=16).contains(&peak),
        "the simulator's peak batch was {peak}: {stats}"
    );
    let done: u64 = reports.iter().map(|r| r.requests).sum();
    assert!(done > 50, "{done} requests");

    // Redis goes away mid-run, then comes back.
    let running = tokio::spawn(load_all(taps.iter().map(|t| t.proxy).collect(), 32, 12.0));
    // Watched once the streams the last run's end abandoned have left the simulator (it
    // notices a client gone at its next token).
    tokio::time::sleep(Duration::from_secs(1)).await;
    peak_from_now(sim.addr).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    redis.kill();
    // Every replica notices, says so once, and goes on at its share.
    let noticed = Instant::now() + Duration::from_secs(LEASE_SECS + 2);
    for t in &taps {
        loop {
            let m = send(t.admin, "GET", "/metrics", b"", &[]).await.unwrap();
            if String::from_utf8_lossy(&m.body).contains("tokentap_cluster_degraded 1") {
                break;
            }
            assert!(
                Instant::now() < noticed,
                "a replica did not notice Redis going away: {}\n{}",
                String::from_utf8_lossy(&m.body)
                    .lines()
                    .filter(|l| l.contains("cluster"))
                    .collect::<Vec<_>>()
                    .join("\n"),
                t.stderr()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let down = peak_batch(sim.addr).await;
    assert!(down <= 16 + 3, "with Redis away the batch reached {down}");
    assert!(
        down >= 8,
        "with Redis away serving slowed to a batch of {down}"
    );

    let _redis = Redis::start(redis.port).unwrap();
    // Back within lease_secs: after that, the fleet limit holds again.
    tokio::time::sleep(Duration::from_secs(LEASE_SECS + 1)).await;
    for t in &taps {
        let m = send(t.admin, "GET", "/metrics", b"", &[]).await.unwrap();
        let text = String::from_utf8_lossy(&m.body).into_owned();
        assert!(text.contains("tokentap_cluster_degraded 0"), "{text}");
    }
    peak_from_now(sim.addr).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let back = peak_batch(sim.addr).await;
    let reports = running.await.unwrap();
    only_429s(&reports);
    assert!(back <= 16, "with Redis back the batch reached {back}");
    for t in &taps {
        assert!(
            t.stderr().matches("Redis unreachable").count() == 1,
            "{}",
            t.stderr()
        );
    }
    // Nothing leaked: every replica's slots and queue empty once the clients are gone.
    for t in &taps {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let s = send(t.admin, "GET", "/stats", b"", &[]).await.unwrap();
            let s: serde_json::Value = serde_json::from_slice(&s.body).unwrap();
            let u = &s["upstreams"][0];
            if u["in_flight"] == 0 && u["queued"] == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "a slot leaked: {u:#}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // And no lease is left in Redis: those taken while it was away were registered on
    // rejoining and freed with their requests.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = Command::new("redis-cli")
            .args([
                "-p",
                &redis.port.to_string(),
                "ZCARD",
                "tokentap:sim:leases",
            ])
            .output()
            .unwrap();
        let n = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if n == "0" {
            break;
        }
        assert!(Instant::now() < deadline, "{n} leases left in Redis");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_s_slots_are_free_within_the_lease() {
    if redis_missing() {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let redis = Redis::start(free_addr().port()).unwrap();
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: "1:20,128:20".parse::<Curve>().unwrap(),
        ttft_ms: 10.0,
        max_tokens: 2000,
        ..SimArgs::defaults()
    })
    .await
    .unwrap();
    let dir = Scratch::new("fleet-kill");
    let a = replica(&dir, "a", redis.port, sim.addr);
    let b = replica(&dir, "b", redis.port, sim.addr);
    // a takes all 16 slots with 40 s streams.
    let a_load = {
        let target = LoadArgs {
            max_tokens: 2000,
            ..LoadArgs::for_url(format!("http://{}", a.proxy))
        }
        .target()
        .unwrap();
        tokio::spawn(async move {
            load::phase(
                &target,
                Mode::Closed { concurrency: 16 },
                Duration::ZERO,
                Duration::from_secs(30),
                false,
            )
            .await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = send(a.admin, "GET", "/stats", b"", &[]).await.unwrap();
        let s: serde_json::Value = serde_json::from_slice(&s.body).unwrap();
        if s["upstreams"][0]["in_flight"] == 16 {
            break;
        }
        assert!(Instant::now() < deadline, "a never held 16: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.signal(Signal::SIGKILL);
    let killed = Instant::now();
    a_load.abort();
    // b gets a slot once a's leases expire: within lease_secs (and a scheduling margin).
    let resp = send(
        b.proxy,
        "POST",
        "/v1/chat/completions",
        br#"{"stream":true,"max_tokens":2,"messages":[{"role":"user","content":"hi"}]}"#,
        &[],
    )
    .await
    .unwrap();
    let waited = killed.elapsed();
    assert_eq!(resp.status, 200);
    assert!(
        waited <= Duration::from_secs(LEASE_SECS) + Duration::from_millis(1500),
        "b waited {waited:?} for a slot a held when it died"
    );
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_from_the_start_it_serves_on_a_share_that_does_not_grow() {
    let _one = ONE_AT_A_TIME.lock().await;
    let sim = sim().await;
    let dir = Scratch::new("fleet-none");
    // Nothing listens on this port: Redis is away from the start.
    let tap = replica(&dir, "a", free_addr().port(), sim.addr);
    let target = LoadArgs {
        max_tokens: 30,
        ..LoadArgs::for_url(format!("http://{}", tap.proxy))
    }
    .target()
    .unwrap();
    let report = load::phase(
        &target,
        Mode::Closed { concurrency: 8 },
        Duration::ZERO,
        Duration::from_secs(3),
        false,
    )
    .await;
    only_429s(std::slice::from_ref(&report));
    assert!(report.requests > 0, "it served nothing");
    let m = send(tap.admin, "GET", "/metrics", b"", &[]).await.unwrap();
    let text = String::from_utf8_lossy(&m.body).into_owned();
    assert!(text.contains("tokentap_cluster_degraded 1"), "{text}");
    // The fleet's size was never read: the share stays at what it started with (1), so
    // replicas starting together during an outage cannot add up to more than the limit.
    assert_eq!(peak_batch(sim.addr).await, 1);
    assert_eq!(
        tap.stderr().matches("Redis unreachable").count(),
        1,
        "{}",
        tap.stderr()
    );
}
