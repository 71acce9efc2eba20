//! Live reload as an operator does it, on the real binary: 256 streaming clients through
//! two upstreams while the split is reloaded 20 times (SIGHUP and `POST /reload` in turn,
//! weights 90/10 and 10/90): no client sees an error, the new weights show in `/stats`
//! within a second of each reload, no slot is leaked, and a broken file keeps the running
//! config and is counted as a failure. A Kubernetes-style ConfigMap update (the `..data`
//! symlink swapped to a new directory) is seen and loaded without a signal. A new admin
//! token ends the `/events` streams the old one opened.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::process::{listen_section, Scratch, Tokentap};
use common::*;
use nix::sys::signal::Signal;
use tokentap::sim::{Sim, SimArgs};

const CLIENTS: usize = 256;
const RELOADS: usize = 20;

fn config(listen: &str, a: &Sim, b: &Sim, weights: (u32, u32)) -> String {
    format!(
        "{listen}[server]\ngrace_period_secs = 5\nwatch_config = false\n\
         [[upstream]]\nname = \"a\"\nurl = \"http://{}\"\nmax_concurrency = 1024\n\
         [[upstream]]\nname = \"b\"\nurl = \"http://{}\"\nmax_concurrency = 1024\n\
         [[route]]\npath_prefix = \"/\"\nsplit = {{ a = {}, b = {} }}\n",
        a.addr, b.addr, weights.0, weights.1
    )
}

/// The share (percent) `/stats` gives upstream `name` in route 0.
fn share(stats: &serde_json::Value, name: &str) -> f64 {
    stats["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == name)
        .and_then(|u| u["arms"][0]["share_pct"].as_f64())
        .unwrap_or(f64::NAN)
}

async fn admin_json(admin: std::net::SocketAddr, path: &str) -> serde_json::Value {
    let r = fetch(admin, "GET", path, b"").await;
    assert_eq!(r.status, 200);
    serde_json::from_slice(&r.body).unwrap()
}

/// Closed-loop streaming clients, each counting whole streams (200, `[DONE]` last) and
/// anything else.
struct Clients {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Clients {
    /// `n` clients through `proxy`, returned once each has had a whole stream.
    async fn start(proxy: std::net::SocketAddr, n: usize) -> Clients {
        let stop = Arc::new(AtomicBool::new(false));
        let (ok, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let mut tasks = Vec::new();
        for _ in 0..n {
            let (stop, ok, errors) = (Arc::clone(&stop), Arc::clone(&ok), Arc::clone(&errors));
            tasks.push(tokio::spawn(async move {
                let body =
                    br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
                while !stop.load(SeqCst) {
                    match send(proxy, "POST", "/v1/chat/completions", body, &[]).await {
                        Ok(r)
                            if r.status == 200
                                && !r.error
                                && r.body.ends_with(b"data: [DONE]\n\n") =>
                        {
                            ok.fetch_add(1, SeqCst);
                        }
                        Ok(r) => {
                            errors.fetch_add(1, SeqCst);
                            eprintln!(
                                "client: {} {:?}",
                                r.status,
                                String::from_utf8_lossy(&r.body)
                            );
                        }
                        Err(e) => {
                            errors.fetch_add(1, SeqCst);
                            eprintln!("client: {e}");
                        }
                    }
                }
            }));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while ok.load(SeqCst) < n as u64 {
            assert!(Instant::now() < deadline, "clients did not get going");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Clients {
            stop,
            ok,
            errors,
            tasks,
        }
    }

    /// Stops them; the whole streams and the errors they had.
    async fn stop(self) -> (u64, u64) {
        self.stop.store(true, SeqCst);
        for t in self.tasks {
            t.await.unwrap();
        }
        (self.ok.load(SeqCst), self.errors.load(SeqCst))
    }
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_split_reloads_under_256_streams_without_an_error_or_a_leaked_slot() {
    let sim_args = || SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        ttft_ms: 5.0,
        tpot_curve: "1:3,256:6".parse().unwrap(),
        max_tokens: 12,
        ..SimArgs::defaults()
    };
    let a = Sim::start(sim_args()).await.unwrap();
    let b = Sim::start(sim_args()).await.unwrap();
    let dir = Scratch::new("reload");
    let (listen, proxy, admin) = listen_section();
    let mut tap = Tokentap::start(
        &dir.0,
        &config(&listen, &a, &b, (90, 10)),
        proxy,
        admin,
        &[],
    );

    // All clients streaming before the first reload.
    let clients = Clients::start(proxy, CLIENTS).await;

    for i in 0..RELOADS {
        let weights = if i % 2 == 0 { (10, 90) } else { (90, 10) };
        std::fs::write(&tap.config, config(&listen, &a, &b, weights)).unwrap();
        let asked = Instant::now();
        if i % 2 == 0 {
            tap.signal(Signal::SIGHUP);
        } else {
            let r = fetch(admin, "POST", "/reload", b"").await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(v["ok"], true);
            assert_eq!(v["problems"].as_array().map(Vec::len), Some(0));
        }
        loop {
            let s = admin_json(admin, "/stats").await;
            if share(&s, "a") == f64::from(weights.0) && share(&s, "b") == f64::from(weights.1) {
                break;
            }
            assert!(
                asked.elapsed() < Duration::from_secs(1),
                "reload {i}: the weights {weights:?} are not in /stats after 1 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Traffic flows between reloads.
        let before = clients.ok.load(SeqCst);
        while clients.ok.load(SeqCst) < before + 64 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    // A broken file: refused with every problem, the running config kept, counted.
    std::fs::write(
        &tap.config,
        format!(
            "{listen}[[upstream]]\nname = \"a\"\nurl = \"ftp://nowhere\"\nmax_queue = 2000000\n"
        ),
    )
    .unwrap();
    let r = fetch(admin, "POST", "/reload", b"").await;
    assert_eq!(r.status, 422);
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["ok"], false);
    let problems: Vec<String> = v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_owned())
        .collect();
    assert!(
        problems.iter().any(|p| p.starts_with("upstream[0].url:")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("upstream[0].max_queue:")),
        "{problems:?}"
    );
    tap.signal(Signal::SIGHUP);
    tap.log_line(&["config reload refused", "SIGHUP"], Duration::from_secs(5));
    tap.log_line(&["upstream[0].url"], Duration::from_secs(5));
    let s = admin_json(admin, "/stats").await;
    assert_eq!(
        (share(&s, "a"), share(&s, "b")),
        (90.0, 10.0),
        "the running split stays"
    );
    let m = fetch(admin, "GET", "/metrics", b"").await;
    let m = String::from_utf8_lossy(&m.body);
    assert_eq!(
        metric(&m, "tokentap_config_reloads_total{result=\"success\"}"),
        RELOADS as f64
    );
    assert_eq!(
        metric(&m, "tokentap_config_reloads_total{result=\"failure\"}"),
        2.0
    );
    assert!(metric(&m, "tokentap_config_last_reload_success_timestamp_seconds") > 1.7e9);

    let (ok, errors) = clients.stop().await;
    assert_eq!(errors, 0, "client errors");
    // Every slot came back: nothing in flight or queued on either upstream.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = admin_json(admin, "/stats").await;
        let busy: Vec<_> = s["upstreams"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|u| u["in_flight"] != 0 || u["queued"] != 0)
            .map(|u| u["name"].clone())
            .collect();
        if busy.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "slots leaked on {busy:?}: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let served: u64 = admin_json(admin, "/stats").await["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["requests_total"].as_u64().unwrap_or(0))
        .sum();
    assert!(served >= ok, "{served} requests recorded");
    tap.signal(Signal::SIGTERM);
    let (status, _) = tap.wait_exit(Duration::from_secs(10)).expect("exits");
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_admin_token_ends_the_event_streams_the_old_one_opened() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = Scratch::new("events-token");
    let token = dir.path("token");
    std::fs::write(&token, "old-token\n").unwrap();
    let (listen, proxy, admin) = listen_section();
    let cfg = format!(
        "{listen}[admin]\ntoken_file = \"{}\"\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n",
        token.display()
    );
    let tap = Tokentap::start(&dir.0, &cfg, proxy, admin, &[]);
    let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
    let req =
        format!("GET /events HTTP/1.1\r\nHost: {admin}\r\nAuthorization: Bearer old-token\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    while !String::from_utf8_lossy(&got).contains("event: snapshot") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("a snapshot")
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    std::fs::write(&token, "new-token\n").unwrap();
    tap.signal(Signal::SIGHUP);
    // The stream ends within a few snapshots of the reload.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "the old token's stream still runs 10 s after the reload"
        );
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("the stream ended after the token changed")
            .unwrap();
        if n == 0 {
            break;
        }
    }
}

/// A ConfigMap as Kubernetes mounts it: `tokentap.toml` → `..data/tokentap.toml`, `..data`
/// → a directory of this version; an update writes a new directory and swaps `..data` to
/// it in one rename. Under 64 streaming clients, with no signal: the new weights in
/// `/stats` within 2 s, no client error; a broken file keeps the running config and is
/// reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_update_reloads_without_a_signal() {
    let sim_args = || SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        ttft_ms: 5.0,
        tpot_curve: "1:3,64:4".parse().unwrap(),
        max_tokens: 12,
        ..SimArgs::defaults()
    };
    let a = Sim::start(sim_args()).await.unwrap();
    let b = Sim::start(sim_args()).await.unwrap();
    let dir = Scratch::new("configmap");
    let version = |n: usize, text: &str| {
        let v = dir.path(&format!("..2026_12_03_00_00_0{n}.000{n}"));
        std::fs::create_dir_all(&v).unwrap();
        std::fs::write(v.join("tokentap.toml"), text).unwrap();
        v
    };
    let swap = |to: &std::path::Path| {
        let tmp = dir.path("..data_tmp");
        std::os::unix::fs::symlink(to.file_name().unwrap(), &tmp).unwrap();
        std::fs::rename(&tmp, dir.path("..data")).unwrap();
    };
    let (listen, proxy, admin) = listen_section();
    let with_watch =
        |w: (u32, u32)| config(&listen, &a, &b, w).replace("watch_config = false\n", "");
    let first = version(1, "");
    std::os::unix::fs::symlink(first.file_name().unwrap(), dir.path("..data")).unwrap();
    std::os::unix::fs::symlink("..data/tokentap.toml", dir.path("tokentap.toml")).unwrap();
    // Written through the symlinks, into the first version's directory.
    let tap = Tokentap::start(&dir.0, &with_watch((90, 10)), proxy, admin, &[]);

    let clients = Clients::start(proxy, 64).await;

    let second = version(2, &with_watch((10, 90)));
    swap(&second);
    std::fs::remove_dir_all(&first).unwrap();
    let swapped = Instant::now();
    loop {
        let s = admin_json(admin, "/stats").await;
        if share(&s, "a") == 10.0 && share(&s, "b") == 90.0 {
            break;
        }
        assert!(
            swapped.elapsed() < Duration::from_secs(2),
            "the new weights are not in /stats 2 s after the ConfigMap swap"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "new weights in /stats {:?} after the swap",
        swapped.elapsed()
    );
    tap.log_line(
        &["config reloaded", "config file changed"],
        Duration::from_secs(5),
    );

    // A broken file: refused, reported, the running config kept.
    let third = version(3, "[[upstream]]\nname = ");
    swap(&third);
    tap.log_line(
        &["config reload refused", "config file changed"],
        Duration::from_secs(5),
    );
    let m = String::from_utf8(fetch(admin, "GET", "/metrics", b"").await.body).unwrap();
    assert_eq!(
        metric(&m, "tokentap_config_reloads_total{result=\"failure\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "tokentap_config_reloads_total{result=\"success\"}"),
        1.0
    );
    let s = admin_json(admin, "/stats").await;
    assert_eq!((share(&s, "a"), share(&s, "b")), (10.0, 90.0));

    let (ok, errors) = clients.stop().await;
    assert_eq!(errors, 0, "{ok} ok");
}
