//! Pools end to end, with real processes: simulators as `tokentap sim` processes (killed
//! with SIGKILL, started again), dnsmasq as the DNS server discovery asks, and closed-loop
//! clients. A replica that dies is ejected and its requests fail over; discovery follows
//! records and files under load; caps hold per endpoint; least-loaded beats round robin on
//! a slow replica; a session keeps to its replica.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use tokentap::sim::{Sim, SimArgs};
use tokio::time::Instant;

const CHAT: &str = "/v1/chat/completions";

/// `tokentap sim` as a process of its own, on `addr`.
struct SimProc {
    child: Child,
    addr: SocketAddr,
}

impl SimProc {
    async fn start(addr: SocketAddr, curve: &str, model: &str) -> SimProc {
        let child = Command::new(env!("CARGO_BIN_EXE_tokentap"))
            .args(["sim", "--listen", &addr.to_string(), "--tpot-curve", curve])
            .args(["--ttft-ms", "5", "--max-tokens", "20", "--model", model])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while send(addr, "GET", "/health", b"", &[]).await.is_err() {
            assert!(
                Instant::now() < deadline,
                "the simulator on {addr} never answered"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        SimProc { child, addr }
    }

    fn kill(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }
}

impl Drop for SimProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request of a closed-loop client: when it started, whether it completed (200 and
/// the stream's `[DONE]`), and the model (the replica) that answered.
#[derive(Debug, Clone)]
struct Done {
    start: Instant,
    ok: bool,
    status: u16,
    model: Option<String>,
}

/// `clients` closed-loop clients of streaming chat requests for `secs`, each with the
/// headers `headers(client)`.
async fn closed_loop(
    proxy: SocketAddr,
    clients: usize,
    secs: f64,
    headers: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<Done> {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let out = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (out, h) = (Arc::clone(&out), headers(c));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                let done = one(proxy, &h).await;
                out.lock().unwrap().push(done);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    Arc::try_unwrap(out).unwrap().into_inner().unwrap()
}

async fn one(proxy: SocketAddr, headers: &[(String, String)]) -> Done {
    let body = br#"{"model":"m","stream":true,"max_tokens":20,"messages":[{"role":"user","content":"hi"}]}"#;
    let h: Vec<(&str, &str)> = headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let start = Instant::now();
    match send(proxy, "POST", CHAT, body, &h).await {
        Ok(r) => {
            let text = String::from_utf8_lossy(&r.body);
            Done {
                start,
                ok: r.status == 200 && !r.error && text.contains("[DONE]"),
                status: r.status,
                model: text
                    .split("\"model\":\"")
                    .nth(1)
                    .and_then(|m| m.split('"').next())
                    .map(str::to_owned),
            }
        }
        Err(_) => Done {
            start,
            ok: false,
            status: 0,
            model: None,
        },
    }
}

/// The endpoint of `/stats`' first upstream whose address is `url`.
fn endpoint<'a>(s: &'a serde_json::Value, url: &str) -> Option<&'a serde_json::Value> {
    s["upstreams"][0]["endpoints"]
        .as_array()?
        .iter()
        .find(|e| e["address"] == url)
}

fn pool_config(endpoints: &[SocketAddr], extra: &str) -> String {
    let list: Vec<String> = endpoints
        .iter()
        .map(|a| format!("\"http://{a}\""))
        .collect();
    format!(
        "[[upstream]]\nname = \"pool\"\nendpoints = [{}]\n{extra}",
        list.join(", ")
    )
}

/// Three replicas, 32 closed-loop clients, one SIGKILLed mid-run: the streams on it end as
/// errors, every request started a second after the kill succeeds, it is ejected within a
/// second, and started again it takes requests within its health interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_is_ejected_and_requests_fail_over() {
    let addrs = [free_addr(), free_addr(), free_addr()];
    let mut sims = Vec::new();
    for (i, a) in addrs.iter().enumerate() {
        sims.push(SimProc::start(*a, "1:5", &format!("r{i}")).await);
    }
    let health = "[upstream.health]\npath = \"/health\"\nevery_secs = 1\n";
    let tap = proxy(&[], &pool_config(&addrs, health)).await;
    let p = proxy_addr(&tap);
    let victim = format!("http://{}", addrs[1]);
    let load = tokio::spawn(closed_loop(p, 32, 6.0, |_| Vec::new()));

    tokio::time::sleep(Duration::from_millis(1500)).await;
    sims[1].kill();
    let killed = Instant::now();
    let s = stats_where(&tap, |s| {
        endpoint(s, &victim).is_some_and(|e| e["healthy"] == false)
    })
    .await;
    let ejected_after = killed.elapsed();
    let e = endpoint(&s, &victim).unwrap();
    assert!(
        ejected_after < Duration::from_secs(1),
        "ejected {ejected_after:?} after the kill: {e:#}"
    );
    assert!(e["last_error"].as_str().is_some(), "{e:#}");

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = endpoint(&stats(&tap).await, &victim).unwrap()["requests_total"]
        .as_u64()
        .unwrap();
    let addr = sims[1].addr;
    sims[1] = SimProc::start(addr, "1:5", "r1").await;
    let restarted = Instant::now();
    stats_where(&tap, |s| {
        endpoint(s, &victim).is_some_and(|e| e["requests_total"].as_u64() > Some(before))
    })
    .await;
    let back_after = restarted.elapsed();
    assert!(
        back_after < Duration::from_millis(2500),
        "it took requests again {back_after:?} after its restart (health every 1 s)"
    );

    let done = load.await.unwrap();
    let settled = killed + Duration::from_secs(1);
    let late_failures: Vec<&Done> = done
        .iter()
        .filter(|d| d.start >= settled && !d.ok)
        .collect();
    assert!(late_failures.is_empty(), "{late_failures:?}");
    let failed: Vec<u16> = done.iter().filter(|d| !d.ok).map(|d| d.status).collect();
    eprintln!(
        "{} requests, {} failed (statuses {failed:?}; 200 is a stream cut short), all started within {:?} of the kill; ejected after {ejected_after:?}, back {back_after:?} after its restart",
        done.len(),
        failed.len(),
        Duration::from_secs(1)
    );
    assert!(done.len() > 500, "{}", done.len());
    // No slot is left behind, on the pool or on any endpoint.
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    for e in s["upstreams"][0]["endpoints"].as_array().unwrap() {
        assert_eq!(e["in_flight"], 0, "{e:#}");
    }
}

/// A DNS server of our own: dnsmasq on a free port, answering from a hosts file read again
/// on SIGHUP.
struct Dns {
    child: Child,
    port: u16,
    hosts: std::path::PathBuf,
    _dir: tempdir::Dir,
}

mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Dns {
    fn start(name: &str, ips: &[&str]) -> Option<Dns> {
        let dnsmasq = ["/usr/sbin/dnsmasq", "/usr/bin/dnsmasq"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        let Some(dnsmasq) = dnsmasq else {
            assert!(
                std::env::var("CI").is_err(),
                "dnsmasq is missing (apt-get install dnsmasq); CI must have it"
            );
            eprintln!("skipped: dnsmasq is not installed");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("tokentap-dns-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let hosts = dir.join("hosts");
        let port = free_addr().port();
        let dns = Dns {
            child: Command::new(dnsmasq)
                .args([
                    "--keep-in-foreground",
                    "--conf-file=/dev/null",
                    "--no-resolv",
                    "--no-hosts",
                ])
                .arg(format!("--port={port}"))
                .args([
                    "--listen-address=127.0.0.1",
                    "--bind-interfaces",
                    "--local-ttl=0",
                ])
                .arg(format!("--addn-hosts={}", hosts.display()))
                .args(["--user=root", "--pid-file="])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
            port,
            hosts,
            _dir: tempdir::Dir(dir),
        };
        dns.set(name, ips, false);
        Some(dns)
    }

    /// `name` has the records `ips` (SIGHUP reads them again).
    fn set(&self, name: &str, ips: &[&str], reload: bool) {
        let text: String = ips.iter().map(|ip| format!("{ip} {name}\n")).collect();
        std::fs::write(&self.hosts, text).unwrap();
        if reload {
            let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
        }
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Simulators on 127.0.0.2 to 127.0.0.5, one port.
async fn four_sims() -> (Vec<Sim>, u16) {
    loop {
        let port = free_addr().port();
        let mut sims = Vec::new();
        for i in 2..=5 {
            let listen: SocketAddr = format!("127.0.0.{i}:{port}").parse().unwrap();
            match Sim::start(SimArgs {
                listen,
                tpot_curve: "1:5".parse().unwrap(),
                ttft_ms: 5.0,
                max_tokens: 20,
                ..SimArgs::defaults()
            })
            .await
            {
                Ok(sim) => sims.push(sim),
                Err(_) => break,
            }
        }
        if sims.len() == 4 {
            return (sims, port);
        }
    }
}

/// The endpoint addresses `/stats` shows, sorted.
fn addresses(s: &serde_json::Value) -> Vec<String> {
    let mut a: Vec<String> = s["upstreams"][0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["address"].as_str().unwrap().to_owned())
        .collect();
    a.sort();
    a
}

/// How the set changes under load, by `change(step)`, each followed within two seconds
/// (`every_secs = 1`), with no client error and no slot left behind.
async fn follows_under_load(
    tap: &tokentap::server::Running,
    port: u16,
    steps: &[&[&str]],
    change: impl Fn(&[&str]),
) {
    let want = |ips: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ips.iter().map(|ip| format!("http://{ip}:{port}")).collect();
        v.sort();
        v
    };
    stats_where(tap, |s| addresses(s) == want(steps[0])).await;
    let load = tokio::spawn(closed_loop(
        proxy_addr(tap),
        8,
        1.0 + steps.len() as f64 * 2.0,
        |_| Vec::new(),
    ));
    for ips in &steps[1..] {
        tokio::time::sleep(Duration::from_millis(500)).await;
        change(ips);
        let changed = Instant::now();
        stats_where(tap, |s| addresses(s) == want(ips)).await;
        let took = changed.elapsed();
        eprintln!("{} endpoints after {took:?}", ips.len());
        assert!(took < Duration::from_secs(3), "followed after {took:?}");
    }
    let done = load.await.unwrap();
    let failed: Vec<&Done> = done.iter().filter(|d| !d.ok).collect();
    assert!(
        failed.is_empty(),
        "{} of {}: {failed:?}",
        failed.len(),
        done.len()
    );
    assert!(done.len() > 100, "{}", done.len());
    let s = stats_when(tap, |u| u["in_flight"] == 0).await;
    for e in s["upstreams"][0]["endpoints"].as_array().unwrap() {
        assert_eq!(e["in_flight"], 0, "{e:#}");
    }
}

/// DNS records in dnsmasq go from three to two to four under load: followed within
/// `every_secs`, no client error, no slot leaked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_follows_the_records() {
    let (_sims, port) = four_sims().await;
    let name = "vllm.pool.test";
    let Some(dns) = Dns::start(name, &["127.0.0.2", "127.0.0.3", "127.0.0.4"]) else {
        return;
    };
    let config = format!(
        "[[upstream]]\nname = \"pool\"\ndiscover = {{ dns = \"{name}\", port = {port}, nameserver = \"127.0.0.1:{}\", every_secs = 1 }}\n",
        dns.port
    );
    let tap = proxy(&[], &config).await;
    let steps: [&[&str]; 3] = [
        &["127.0.0.2", "127.0.0.3", "127.0.0.4"],
        &["127.0.0.2", "127.0.0.4"],
        &["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"],
    ];
    follows_under_load(&tap, port, &steps, |ips| dns.set(name, ips, true)).await;
    // The Host the endpoints get is the name's.
    let s = stats(&tap).await;
    assert_eq!(s["upstreams"][0]["endpoints"].as_array().unwrap().len(), 4);
}

/// A file of endpoints, edited under load, the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_discovery_follows_the_file() {
    let (_sims, port) = four_sims().await;
    let dir = std::env::temp_dir().join(format!("tokentap-pool-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _gone = tempdir::Dir(dir.clone());
    let file = dir.join("endpoints.txt");
    let write = |ips: &[&str]| {
        let text: String = ips
            .iter()
            .map(|ip| format!("http://{ip}:{port}\n"))
            .collect();
        // Written aside and renamed in: the reader never sees half a file.
        let tmp = dir.join("endpoints.tmp");
        std::fs::write(&tmp, format!("# the pool\n{text}")).unwrap();
        std::fs::rename(&tmp, &file).unwrap();
    };
    let steps: [&[&str]; 3] = [
        &["127.0.0.2", "127.0.0.3", "127.0.0.4"],
        &["127.0.0.3"],
        &["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"],
    ];
    write(steps[0]);
    let config = format!(
        "[[upstream]]\nname = \"pool\"\ndiscover = {{ file = \"{}\", every_secs = 1 }}\n",
        file.display()
    );
    let tap = proxy(&[], &config).await;
    follows_under_load(&tap, port, &steps, write).await;

    // A bad line keeps the endpoints found before; an empty file empties the pool: 503.
    std::fs::write(&file, "http://127.0.0.2:1\nnot a url\n").unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(addresses(&stats(&tap).await).len(), 4);
    std::fs::write(&file, "# nothing\n").unwrap();
    stats_where(&tap, |s| addresses(s).is_empty()).await;
    let r = fetch(
        proxy_addr(&tap),
        "POST",
        CHAT,
        br#"{"model":"m","stream":true}"#,
    )
    .await;
    assert_eq!(r.status, 503);
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(body["error"]["code"], "no_healthy_endpoint", "{body}");
    assert_eq!(r.headers["x-tokentap-upstream"], "pool");
    let ready = fetch(tap.shared().config.listen.admin, "GET", "/readyz", b"").await;
    assert_eq!(ready.status, 503);
    assert_eq!(ready.body, b"not ready: no healthy endpoint: pool\n");
}

/// Three replicas with room for 128, a cap of 8 on each, 48 clients: each replica's batch
/// peaks at 8 (and reaches 6), the other 24 wait in the pool's queue, none gets 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_holds_on_each_endpoint() {
    let sims = [
        sim("1:5").model("a").await,
        sim("1:5").model("b").await,
        sim("1:5").model("c").await,
    ];
    let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let tap = proxy(
        &[],
        &pool_config(&addrs, "max_concurrency = 8\nmax_queue = 1000\n"),
    )
    .await;
    let run = common::closed_loop(proxy_addr(&tap), Closed::of(48, 2.0));
    let peaks = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let s = stats(&tap).await;
        let u = &s["upstreams"][0];
        assert_eq!(u["limit"], 24, "{u:#}");
        assert!(u["queued"].as_u64().unwrap() >= 20, "{u:#}");
        tokio::time::sleep(Duration::from_millis(400)).await;
        sims.iter()
            .map(|s| s.engine.stats().peak_batch)
            .collect::<Vec<_>>()
    };
    let (r, peaks) = tokio::join!(run, peaks);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    for peak in &peaks {
        assert!((6..=8).contains(peak), "peaks {peaks:?}");
    }
    // Every slot back: the upstream's and each endpoint's (an endpoint's count comes back
    // a moment after the upstream's, so both are awaited; a leak never gets there).
    let s = stats_when(&tap, |u| {
        u["in_flight"] == 0
            && u["queued"] == 0
            && (u["endpoints"].as_array().unwrap().iter()).all(|e| e["in_flight"] == 0)
    })
    .await;
    assert_eq!(s["upstreams"][0]["rejected_total"], 0);
    for e in s["upstreams"][0]["endpoints"].as_array().unwrap() {
        assert_eq!(e["limit"], 8, "{e:#}");
    }
}

/// One replica twice as slow per token: least-loaded sends it fewer requests than round
/// robin does, and the pool's TPOT p90 is lower for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_loaded_spares_a_slow_replica() {
    let mut figures = Vec::new();
    for balance in ["round_robin", "least_loaded"] {
        let sims = [
            sim("1:5,24:15").model("fast-1").await,
            sim("1:5,24:15").model("fast-2").await,
            sim("1:10,24:30").model("slow").await,
        ];
        let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
        let tap = proxy(
            &[],
            &pool_config(&addrs, &format!("balance = \"{balance}\"\n")),
        )
        .await;
        let r = common::closed_loop(proxy_addr(&tap), Closed::of(24, 3.0)).await;
        assert!(r.errors.is_empty(), "{:?}", r.errors);
        let requests: Vec<u64> = sims.iter().map(|s| s.engine.stats().completed).collect();
        let total: u64 = requests.iter().sum();
        let slow_share = requests[2] as f64 / total as f64;
        let p90 = r.tpot_ms.p90.unwrap();
        eprintln!("{balance}: requests {requests:?}, slow replica's share {slow_share:.3}, TPOT p90 {p90:.2} ms");
        figures.push((slow_share, p90));
    }
    let (rr, ll) = (figures[0], figures[1]);
    assert!(
        ll.0 < rr.0 * 0.85,
        "least-loaded share {} vs round robin {}",
        ll.0,
        rr.0
    );
    assert!(
        ll.1 < rr.1,
        "TPOT p90 least-loaded {} vs round robin {}",
        ll.1,
        rr.1
    );
}

/// Three replicas, one of them 2× slower per token and over the 30 ms TPOT SLO even alone
/// (40 ms): `slo_headroom` sends it nothing while the others have room, so the pool's
/// client-side TPOT p90 holds the SLO, where `least_loaded` (uncapped) sends it a third of
/// the requests and breaks it; at ≥ 0.8× `least_loaded`'s system T/s. Each endpoint's own
/// cap shows in `/stats`, the slow one's at its floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slo_headroom_holds_the_tpot_slo_where_least_loaded_breaks_it() {
    let mut figures = Vec::new();
    for balance in ["least_loaded", "slo_headroom"] {
        let sims = [
            sim("1:20,32:28").model("fast-1").await,
            sim("1:20,32:28").model("fast-2").await,
            sim("1:40,32:56").model("slow").await,
        ];
        let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
        let extra = match balance {
            "least_loaded" => String::new(),
            _ => {
                format!("balance = \"{balance}\"\nmax_queue = 1000\n[upstream.slo]\ntpot_ms = 30\n")
            }
        };
        let tap = proxy(&[], &pool_config(&addrs, &extra)).await;
        // Warmed up: the caps rise from 4 a replica by at most a quarter a second.
        let r = common::closed_loop(proxy_addr(&tap), Closed::of(24, 6.0).after(9.0)).await;
        assert!(r.errors.is_empty(), "{balance}: {:?}", r.errors);
        let requests: Vec<u64> = sims.iter().map(|s| s.engine.stats().completed).collect();
        let slow_share = requests[2] as f64 / requests.iter().sum::<u64>() as f64;
        let (p90, tps) = (r.tpot_ms.p90.unwrap(), r.system_tps.unwrap());
        let s = stats(&tap).await;
        let caps: Vec<String> = (s["upstreams"][0]["endpoints"].as_array().unwrap().iter())
            .map(|e| format!("{} {}", e["limit"], e["slo_headroom"]))
            .collect();
        eprintln!(
            "{balance}: requests {requests:?} (slow {:.1}%), TPOT p90 {p90:.1} ms, {tps:.0} T/s, TTFT p50 {:.0} ms; endpoints {caps:?}",
            100.0 * slow_share,
            r.ttft_ms.p50.unwrap()
        );
        figures.push((slow_share, p90, tps, s));
    }
    let (ll, sh) = (&figures[0], &figures[1]);
    assert!(ll.1 > 30.0, "least_loaded's TPOT p90 {:.1} ms", ll.1);
    assert!(sh.1 <= 30.0, "slo_headroom's TPOT p90 {:.1} ms", sh.1);
    assert!(
        sh.0 < 0.05,
        "slo_headroom sent the slow replica {:.3}",
        sh.0
    );
    assert!(
        sh.2 >= 0.8 * ll.2,
        "system T/s: slo_headroom {:.0}, least_loaded {:.0}",
        sh.2,
        ll.2
    );
    let u = &sh.3["upstreams"][0];
    assert_eq!(u["balance"], "slo_headroom");
    assert_eq!(u["slo"]["controller"], "per_endpoint");
    let limits: Vec<u64> = (u["endpoints"].as_array().unwrap().iter())
        .map(|e| e["limit"].as_u64().unwrap())
        .collect();
    assert!(limits[2] < limits[0].min(limits[1]), "caps {limits:?}");
    assert!(
        u["endpoints"][2]["slo_headroom"]["next_tpot_ms"]
            .as_f64()
            .unwrap()
            > 30.0
    );
}

/// `consistent_hash:header:x-session`: every request of a session goes to one replica while
/// it takes requests; when one replica dies, only its sessions move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_keeps_to_its_replica() {
    let addrs = [free_addr(), free_addr(), free_addr()];
    let mut sims = Vec::new();
    for (i, a) in addrs.iter().enumerate() {
        sims.push(SimProc::start(*a, "1:2", &format!("r{i}")).await);
    }
    let tap = proxy(
        &[],
        &pool_config(
            &addrs,
            "balance = \"consistent_hash:header:x-session\"\nmax_concurrency = 4\n",
        ),
    )
    .await;
    let p = proxy_addr(&tap);
    // Three at a time (under every cap): 30 sessions of 4 requests.
    let placed = || async move {
        let mut seen: Vec<Vec<Option<String>>> = vec![Vec::new(); 30];
        for group in (0..30).collect::<Vec<_>>().chunks(3) {
            let mut tasks = Vec::new();
            for &session in group {
                tasks.push(tokio::spawn(async move {
                    let h = [("x-session".to_owned(), format!("s{session}"))];
                    let mut models = Vec::new();
                    for _ in 0..4 {
                        let d = one(p, &h).await;
                        assert!(d.ok, "{d:?}");
                        models.push(d.model);
                    }
                    (session, models)
                }));
            }
            for t in tasks {
                let (session, models) = t.await.unwrap();
                seen[session] = models;
            }
        }
        seen
    };
    let before = placed().await;
    let mut home = Vec::new();
    for (s, models) in before.iter().enumerate() {
        assert!(
            models.iter().all(|m| m == &models[0]),
            "session {s}: {models:?}"
        );
        home.push(models[0].clone().unwrap());
    }
    let on_r1 = home.iter().filter(|m| *m == "r1").count();
    assert!(on_r1 > 0 && on_r1 < 30, "{home:?}");
    sims[1].kill();
    // The first request of an r1 session finds it gone (and ejects it); from then on:
    let _ = placed().await;
    let after = placed().await;
    for (s, models) in after.iter().enumerate() {
        assert!(
            models.iter().all(|m| m == &models[0]),
            "session {s}: {models:?}"
        );
        let now = models[0].clone().unwrap();
        if home[s] == "r1" {
            assert_ne!(now, "r1");
        } else {
            assert_eq!(now, home[s], "session {s} moved though its replica stayed");
        }
    }
}

/// A reload changes the endpoints, the balance and the health settings live; an endpoint
/// kept by address keeps its state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_changes_the_pool_and_keeps_endpoints_by_address() {
    let sims = [
        sim("1:1").model("a").await,
        sim("1:1").model("b").await,
        sim("1:1").model("c").await,
    ];
    let [a, b, c] = [sims[0].addr, sims[1].addr, sims[2].addr];
    let tap = proxy(&[], &pool_config(&[a, b], "")).await;
    let p = proxy_addr(&tap);
    for _ in 0..20 {
        assert!(one(p, &[]).await.ok);
    }
    let s = stats(&tap).await;
    let b_url = format!("http://{b}");
    let b_before = endpoint(&s, &b_url).unwrap()["requests_total"]
        .as_u64()
        .unwrap();
    assert!(b_before > 0);
    let listen = &tap.shared().config.listen;
    let text = format!(
        "[listen]\nproxy = \"{}\"\nadmin = \"{}\"\n{}",
        listen.proxy,
        listen.admin,
        pool_config(
            &[b, c],
            "balance = \"round_robin\"\n[upstream.health]\nevery_secs = 1\n"
        )
    );
    let reloaded = tap
        .live()
        .apply(tokentap::config::Config::parse(&text, "reload").unwrap());
    assert!(reloaded.ok, "{reloaded:?}");
    let s = stats(&tap).await;
    assert_eq!(addresses(&s), {
        let mut v = vec![b_url.clone(), format!("http://{c}")];
        v.sort();
        v
    });
    assert_eq!(s["upstreams"][0]["balance"], "round_robin");
    assert_eq!(
        endpoint(&s, &b_url).unwrap()["requests_total"].as_u64(),
        Some(b_before)
    );
    for _ in 0..10 {
        assert!(one(p, &[]).await.ok);
    }
    let s = stats(&tap).await;
    // Round robin: five each.
    assert_eq!(
        endpoint(&s, &b_url).unwrap()["requests_total"].as_u64(),
        Some(b_before + 5)
    );
    assert_eq!(sims[0].engine.stats().completed, 20 - b_before);
}

/// `/metrics` has each endpoint's series for pools of at most `metrics.endpoint_labels`
/// endpoints, and the pool's count by state always.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_series_are_bounded() {
    let sims = [
        sim("1:1").model("a").await,
        sim("1:1").model("b").await,
        sim("1:1").model("c").await,
    ];
    let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    for (labels, series) in [(64, 3), (2, 0)] {
        let extra = format!(
            "[metrics]\nendpoint_labels = {labels}\n{}",
            pool_config(&addrs, "max_concurrency = 4\n")
        );
        let tap = proxy(&[], &extra).await;
        assert!(one(proxy_addr(&tap), &[]).await.ok);
        let text = String::from_utf8(
            fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"")
                .await
                .body,
        )
        .unwrap();
        assert!(
            text.contains("tokentap_endpoints{upstream=\"pool\",state=\"healthy\"} 3"),
            "{text}"
        );
        let healthy: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("tokentap_endpoint_healthy{"))
            .collect();
        assert_eq!(healthy.len(), series, "{healthy:?}");
        if series > 0 {
            let a = format!(
                "tokentap_endpoint_concurrency_limit{{upstream=\"pool\",endpoint=\"http://{}\"}} 4",
                addrs[0]
            );
            assert!(text.contains(&a), "{text}");
            assert_eq!(
                text.lines()
                    .filter(|l| l.starts_with("tokentap_endpoint_requests_total{"))
                    .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
                    .sum::<u64>(),
                1
            );
        }
    }
}

/// `backend_metrics_path`: each endpoint's own metrics are scraped, and its batch buckets
/// the curve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_endpoints_backend_is_scraped() {
    let sims = [sim("1:2").model("a").await, sim("1:2").model("b").await];
    let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let extra = "backend_metrics_path = \"/metrics\"\nbackend_scrape_ms = 100\n";
    let tap = proxy(&[], &pool_config(&addrs, extra)).await;
    let s = stats_when(&tap, |u| {
        u["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["backend"]["running"].is_number())
    })
    .await;
    assert_eq!(s["upstreams"][0]["concurrency_source"], "backend", "{s:#}");
    let r = common::closed_loop(proxy_addr(&tap), Closed::of(4, 1.0)).await;
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let s = stats(&tap).await;
    let curve = s["upstreams"][0]["curve"].as_array().unwrap();
    assert!(!curve.is_empty(), "{s:#}");
}

/// A listener that accepts connections and never answers (nor reads).
async fn hung() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    (addr, task)
}

/// Sequential streaming requests through `proxy`: each one's status (0: no answer) and
/// whether it completed.
async fn sequential(proxy: SocketAddr, n: usize) -> Vec<(u16, bool)> {
    let mut out = Vec::new();
    for _ in 0..n {
        let d = one(proxy, &[]).await;
        out.push((d.status, d.ok));
    }
    out
}

/// A replica that accepts and never answers, and one whose stream goes silent after its
/// first event: each fails `eject_after` (3) requests at `read_timeout_secs` (1 s), is
/// ejected with the cause named, and takes no more; every later request completes on the
/// good replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_replica_is_ejected_after_eject_after_timeouts() {
    let good = sim("1:2").model("good").await;
    let (wedged, _accepting) = hung().await;
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let event = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n";
    let mut first = head.as_bytes().to_vec();
    first.extend_from_slice(format!("{:x}\r\n", event.len()).as_bytes());
    first.extend_from_slice(event);
    first.extend_from_slice(b"\r\n");
    let silent = mock(vec![(
        CHAT,
        Reply::Raw {
            pieces: vec![first, b"0\r\n\r\n".to_vec()],
            gap: Duration::from_secs(120),
            close: false,
        },
    )])
    .await;
    for (bad, cause) in [
        (wedged, "no response head within read_timeout_secs (1 s)"),
        (
            silent.addr,
            "its response body silent for read_timeout_secs (1 s)",
        ),
    ] {
        let extra = "balance = \"round_robin\"\nread_timeout_secs = 1\neject_after = 3\n";
        let tap = proxy(&[], &pool_config(&[good.addr, bad], extra)).await;
        let done = sequential(proxy_addr(&tap), 12).await;
        let failed = done.iter().filter(|d| !d.1).count();
        assert_eq!(failed, 3, "{cause}: {done:?}");
        // The three failures came first (alternating with the good one); none after.
        assert!(done[6..].iter().all(|d| d.1), "{cause}: {done:?}");
        let s = stats(&tap).await;
        let e = endpoint(&s, &format!("http://{bad}")).unwrap();
        assert_eq!(e["healthy"], false, "{e:#}");
        assert_eq!(e["ejections_total"], 1, "{e:#}");
        assert_eq!(e["requests_total"], 3, "{e:#}");
        assert_eq!(e["last_error"], cause, "{e:#}");
        eprintln!("{cause}: {done:?}");
    }
}

/// "/health is fine, the model is broken": an endpoint whose health path answers 200 and
/// whose generations all answer 500 is ejected after eject_after (3) of them and stays out
/// for eject_secs (3 s) through passing checks every second; back, failing again, it is
/// out twice as long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passing_health_check_does_not_undo_an_ejection() {
    let good = sim("1:2").model("good").await;
    let broken = mock(vec![
        (
            "/health",
            Reply::Whole {
                status: 200,
                content_type: "application/json",
                body: b"{}".to_vec(),
            },
        ),
        (
            CHAT,
            Reply::Whole {
                status: 500,
                content_type: "application/json",
                body: br#"{"error":{"message":"model broken"}}"#.to_vec(),
            },
        ),
    ])
    .await;
    let bad = format!("http://{}", broken.addr);
    let extra = "balance = \"round_robin\"\neject_after = 3\neject_secs = 3\n\
                 [upstream.health]\npath = \"/health\"\nevery_secs = 1\n";
    let tap = proxy(&[], &pool_config(&[good.addr, broken.addr], extra)).await;
    let p = proxy_addr(&tap);
    let requests = |s: &serde_json::Value| endpoint(s, &bad).unwrap()["requests_total"].as_u64();
    // Until it is ejected.
    let mut sent = 0;
    while endpoint(&stats(&tap).await, &bad).unwrap()["healthy"] == true {
        one(p, &[]).await;
        sent += 1;
        assert!(sent < 20, "never ejected");
    }
    let ejected = Instant::now();
    let s = stats(&tap).await;
    let (at_ejection, e) = (requests(&s), endpoint(&s, &bad).unwrap().clone());
    assert_eq!(at_ejection, Some(3), "{e:#}");
    // Traffic goes on through two passing checks: none reaches it, and it stays out.
    while ejected.elapsed() < Duration::from_millis(2500) {
        let d = one(p, &[]).await;
        assert!(d.ok, "{d:?}");
        let s = stats(&tap).await;
        let e = endpoint(&s, &bad).unwrap();
        assert_eq!(
            e["healthy"],
            false,
            "back {:?} after its ejection: {e:#}",
            ejected.elapsed()
        );
        assert_eq!(e["health_checks_pass"], true, "{e:#}");
        assert_eq!(requests(&s), at_ejection);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Its ejection ends; it fails three more and is out for 6 s.
    let mut s = stats(&tap).await;
    while requests(&s) < Some(6) || endpoint(&s, &bad).unwrap()["healthy"] == true {
        one(p, &[]).await;
        s = stats(&tap).await;
        assert!(
            ejected.elapsed() < Duration::from_secs(15),
            "not ejected again"
        );
    }
    let e = endpoint(&s, &bad).unwrap();
    assert_eq!(e["ejections_total"], 2, "{e:#}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let left = e["ejected_until"].as_f64().unwrap() - now;
    assert!(
        (5.0..=6.1).contains(&left),
        "the second ejection: {left:.2} s left: {e:#}"
    );
}

/// A pool of three with a cap of 8 each under 24 closed-loop clients, one replica
/// SIGKILLed: the requests it held fail, their clients come back at once and the connects
/// to it are retried elsewhere, yet neither survivor's own batch ever passes 8, and no
/// slot is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_never_passes_a_survivors_cap() {
    let survivors = [sim("1:5").model("a").await, sim("1:5").model("b").await];
    let victim_addr = free_addr();
    let mut victim = SimProc::start(victim_addr, "1:5", "v").await;
    let addrs = [survivors[0].addr, victim_addr, survivors[1].addr];
    let extra = "max_concurrency = 8\nmax_queue = 1000\n\
                 [upstream.health]\npath = \"/health\"\nevery_secs = 1\n";
    let tap = proxy(&[], &pool_config(&addrs, extra)).await;
    let load = tokio::spawn(closed_loop(proxy_addr(&tap), 24, 5.0, |_| Vec::new()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    victim.kill();
    let done = load.await.unwrap();
    let peaks: Vec<u64> = survivors
        .iter()
        .map(|s| s.engine.stats().peak_batch)
        .collect();
    let failed = done.iter().filter(|d| !d.ok).count();
    eprintln!(
        "{} requests, {failed} failed; survivors' peak batches {peaks:?}",
        done.len()
    );
    assert!(
        peaks.iter().all(|&p| p <= 8),
        "survivors' peaks {peaks:?} over their cap of 8"
    );
    assert!(
        peaks.iter().all(|&p| p >= 6),
        "the survivors were loaded: {peaks:?}"
    );
    let s = stats_when(&tap, |u| u["in_flight"] == 0 && u["queued"] == 0).await;
    for e in s["upstreams"][0]["endpoints"].as_array().unwrap() {
        assert_eq!(e["in_flight"], 0, "{e:#}");
    }
}

/// One run of `clients` closed-loop streaming chat clients through `proxy` for `secs`, each
/// request's system prompt drawn from `prompts` by `pick`: each request's client-side
/// TTFT (ms).
async fn prompted_loop(
    proxy: SocketAddr,
    clients: usize,
    secs: f64,
    prompts: Arc<Vec<String>>,
) -> Vec<f64> {
    drawn_loop(proxy, clients, secs, prompts, false).await
}

/// [`prompted_loop`]; `hot`: half the requests carry the first prompt, the rest drawn
/// uniformly.
async fn drawn_loop(
    proxy: SocketAddr,
    clients: usize,
    secs: f64,
    prompts: Arc<Vec<String>>,
    hot: bool,
) -> Vec<f64> {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let prompts = Arc::clone(&prompts);
        tasks.push(tokio::spawn(async move {
            let mut ttfts = Vec::new();
            let mut i = c * 7919;
            while Instant::now() < end {
                i = i.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                let k = if hot && (i >> 20) % 2 == 0 {
                    0
                } else {
                    (i >> 8) % prompts.len()
                };
                let system = &prompts[k];
                let body = format!(
                    r#"{{"model":"m","stream":true,"max_tokens":8,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question {i}"}}]}}"#
                );
                let start = Instant::now();
                if let Ok(r) = send(proxy, "POST", CHAT, body.as_bytes(), &[]).await {
                    // The first token's event (the role-only chunk comes at once).
                    let token = |f: &[u8]| {
                        memchr::memmem::find(f, br#""content":""#)
                            .is_some_and(|at| f.get(at + 11) != Some(&b'"'))
                    };
                    if let Some((at, _)) = r.frames.iter().find(|(_, f)| token(f)) {
                        ttfts.push(at.duration_since(start).as_secs_f64() * 1e3);
                    }
                }
            }
            ttfts
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Sixteen system prompts of 1,200 words each.
fn shared_prompts() -> Arc<Vec<String>> {
    let words = |p: usize| -> String {
        (0..1200)
            .map(|w| format!("w{}x{}", p, w % 97))
            .collect::<Vec<_>>()
            .join(" ")
    };
    Arc::new((0..16).map(words).collect())
}

/// The tokens of one of `prompts`, as the simulator counts them (4 bytes a token).
fn tokens_of(prompts: &[String]) -> u64 {
    prompts[0].len() as u64 / 4
}

/// Four replicas whose prefix caches each hold five of `prompts`, a miss prefilled at
/// 0.02 ms a token on one serial unit.
async fn caching_replicas(prompts: &[String]) -> Vec<Sim> {
    let mut sims = Vec::new();
    for _ in 0..4 {
        sims.push(sim("1:5").prefix_cache(5 * tokens_of(prompts), 0.02).await);
    }
    sims
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Sixteen shared system prompts of ~1,200 words, four replicas whose prefix caches each
/// hold about a quarter of them, a miss costing prefill on the replica's one prefill unit,
/// 24 clients: `prefix` keeps each prompt on a replica that holds it, so the replicas hit
/// their caches (≥ 80%) and the TTFT p50 is at most half of `least_loaded`'s, which sends
/// every prompt everywhere; tokentap's hit rate from usage is the replicas' own count;
/// no replica's batch passes its cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_keeps_prompts_where_they_are_cached() {
    let prompts = shared_prompts();
    let mut figures = Vec::new();
    for balance in ["least_loaded", "prefix"] {
        let sims = caching_replicas(&prompts).await;
        let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
        let extra = format!(
            "balance = \"{balance}\"\nmax_concurrency = 12\nmax_queue = 1000\ninject_usage = true\n"
        );
        let tap = proxy(&[], &pool_config(&addrs, &extra)).await;
        let ttfts = prompted_loop(proxy_addr(&tap), 24, 6.0, Arc::clone(&prompts)).await;
        let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
        let (prompt, cached) = sims.iter().fold((0, 0), |(p, c), s| {
            let st = s.engine.stats();
            (p + st.prompt_tokens, c + st.cached_prompt_tokens)
        });
        let theirs = 100.0 * cached as f64 / prompt as f64;
        let u = &s["upstreams"][0];
        let ours = 100.0 * u["cached_input_tokens_total"].as_f64().unwrap()
            / u["input_tokens_total"].as_f64().unwrap();
        let peaks: Vec<u64> = sims.iter().map(|s| s.engine.stats().peak_batch).collect();
        let each: Vec<String> = (sims.iter())
            .zip(u["endpoints"].as_array().unwrap())
            .map(|(s, e)| {
                let st = s.engine.stats();
                format!(
                    "{:.0}% of {} (index {})",
                    100.0 * st.cached_prompt_tokens as f64 / st.prompt_tokens.max(1) as f64,
                    st.prompt_tokens / tokens_of(&prompts),
                    e["prefix_index_blocks"]
                )
            })
            .collect();
        eprintln!("{balance}: each replica {each:?}");
        let p50 = median(ttfts.clone());
        eprintln!(
            "{balance}: {} requests, TTFT p50 {p50:.0} ms, hit rate {theirs:.1}% (tokentap's {ours:.1}%), peaks {peaks:?}",
            ttfts.len()
        );
        assert!(
            (ours - theirs).abs() <= 3.0,
            "{balance}: {ours} against {theirs}"
        );
        assert!(peaks.iter().all(|&p| p <= 12), "{balance}: {peaks:?}");
        figures.push((p50, theirs));
    }
    let ((ll_p50, _), (px_p50, px_hit)) = (figures[0], figures[1]);
    assert!(px_hit >= 80.0, "prefix hit rate {px_hit:.1}%");
    assert!(
        px_p50 <= 0.5 * ll_p50,
        "TTFT p50: prefix {px_p50:.0} ms, least_loaded {ll_p50:.0} ms"
    );
}

/// Bad input under `balance = "prefix"`: a 30 MB prompt, a body that is not JSON and an
/// empty messages list are forwarded as they would be under any balance (the backend's
/// answer, whatever it is), chosen by load; none is lost and no slot is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_prompts_under_prefix_are_forwarded_and_chosen_by_load() {
    let sims = [sim("1:2").model("a").await, sim("1:2").model("b").await];
    let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let tap = proxy(&[], &pool_config(&addrs, "balance = \"prefix\"\n")).await;
    let p = proxy_addr(&tap);
    let huge = format!(
        r#"{{"model":"m","stream":true,"max_tokens":4,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "z".repeat(30_000_000)
    );
    let r = send(p, "POST", CHAT, huge.as_bytes(), &[]).await.unwrap();
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).contains("[DONE]"));
    let direct = send(sims[0].addr, "POST", CHAT, b"not json", &[])
        .await
        .unwrap();
    let via = send(p, "POST", CHAT, b"not json", &[]).await.unwrap();
    assert_eq!(
        (via.status, via.body.len()),
        (direct.status, direct.body.len())
    );
    let empty = br#"{"model":"m","stream":true,"max_tokens":4,"messages":[]}"#;
    for _ in 0..4 {
        let r = send(p, "POST", CHAT, empty, &[]).await.unwrap();
        assert_eq!(r.status, 200);
    }
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let served: u64 = s["upstreams"][0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            assert_eq!(e["in_flight"], 0, "{e:#}");
            e["requests_total"].as_u64().unwrap()
        })
        .sum();
    assert_eq!(served, 6);
}

/// One prompt taking half the traffic, the other 15 sharing the rest: the hot prefix
/// spills past its replica's load bound rather than waiting on it, no replica passes its
/// cap, and the TTFT p90 is reported (docs/pools.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_spreads_and_no_replica_passes_its_cap() {
    let prompts = shared_prompts();
    let sims = caching_replicas(&prompts).await;
    let addrs: Vec<SocketAddr> = sims.iter().map(|s| s.addr).collect();
    let extra =
        "balance = \"prefix\"\nmax_concurrency = 12\nmax_queue = 1000\ninject_usage = true\n";
    let tap = proxy(&[], &pool_config(&addrs, extra)).await;
    let mut ttfts = drawn_loop(proxy_addr(&tap), 24, 6.0, Arc::clone(&prompts), true).await;
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let peaks: Vec<u64> = sims.iter().map(|s| s.engine.stats().peak_batch).collect();
    ttfts.sort_by(f64::total_cmp);
    let p90 = ttfts[ttfts.len() * 9 / 10];
    let u = &s["upstreams"][0];
    eprintln!(
        "hot prefix: {} requests, TTFT p50 {:.0} ms p90 {p90:.0} ms, hit rate {:.1}%, peaks {peaks:?}",
        ttfts.len(),
        median(ttfts.clone()),
        u["cache_hit_rate_pct"].as_f64().unwrap_or(0.0)
    );
    // Half of 24 clients on one prompt is 12 in flight on its replica on average, its
    // cap: only by spilling past the load bound do they all get served.
    assert!(peaks.iter().all(|&p| p <= 12), "{peaks:?}");
    assert!(ttfts.len() > 500, "{}", ttfts.len());
}
