//! Progressive rollouts against real processes: two simulators behind tokentap, 24
//! closed-loop clients, the route's `rollout` stepping `b`'s share on the comparison at
//! matched concurrency. Shares are read from the simulators' own request counts (their
//! shadow copies, marked `x-tokentap-shadow`, counted apart: a copy serves no client).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{closed_loop, fetch, proxy, proxy_addr, sim, Closed};
use serde_json::Value;
use tokentap::server::Running;
use tokentap::sim::Sim;

/// One scenario at a time: each runs 24 clients, and two at once on two cores would
/// blur the speeds compared.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const A: &str = "1:20,16:22,64:26";

/// `a`'s curve scaled by `factor` (per decode step: per output token).
fn scaled(factor: f64) -> String {
    A.split(',')
        .map(|p| {
            let (b, ms) = p.split_once(':').unwrap();
            format!("{b}:{}", ms.parse::<f64>().unwrap() * factor)
        })
        .collect::<Vec<_>>()
        .join(",")
}

struct Setup {
    a: Sim,
    b: Sim,
    tap: Running,
    load: tokio::task::JoinHandle<()>,
    started: Instant,
}

/// `a` and `b` (b's decode `factor` × a's) behind tokentap with `rollout` on route `chat`,
/// and 24 clients for `secs`.
async fn setup(factor: f64, rollout: &str, secs: f64) -> Setup {
    let a = sim(A).ttft(5.0).await;
    let b = sim(scaled(factor).as_str()).ttft(5.0).await;
    let config = format!(
        "[[route]]\nname = \"chat\"\nsplit = {{ a = 1, b = 1 }}\nrollout = {{ from = \"a\", to = \"b\", {rollout} }}\n"
    );
    let tap = proxy(&[("a", a.addr), ("b", b.addr)], &config).await;
    let at = proxy_addr(&tap);
    let load = tokio::spawn(async move {
        closed_loop(at, Closed::of(24, secs)).await;
    });
    Setup {
        a,
        b,
        tap,
        load,
        started: Instant::now(),
    }
}

fn admin(tap: &Running) -> SocketAddr {
    tap.shared().config.listen.admin
}

async fn rollout(tap: &Running) -> Value {
    let resp = fetch(admin(tap), "GET", "/rollout", b"").await;
    assert_eq!(resp.status, 200);
    let v: Value = serde_json::from_slice(&resp.body).unwrap();
    v["rollouts"][0].clone()
}

/// Live (not shadow) requests each simulator has had.
fn live(s: &Sim) -> u64 {
    let st = s.engine.stats();
    st.requests - st.shadow_requests
}

/// Polls the rollout until `cond` holds, within `limit` of the load's start; the rollout
/// then, and when.
async fn until(s: &Setup, limit: Duration, cond: impl Fn(&Value) -> bool) -> (Value, Duration) {
    loop {
        let r = rollout(&s.tap).await;
        if cond(&r) {
            return (r, s.started.elapsed());
        }
        assert!(
            s.started.elapsed() < limit,
            "not within {limit:?}: {}",
            serde_json::to_string_pretty(&r).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn percents(r: &Value) -> Vec<f64> {
    (r["history"].as_array().unwrap().iter())
        .map(|t| t["percent"].as_f64().unwrap())
        .collect()
}

const STEPS: &str =
    "steps = [10, 50, 100], every_secs = 5, max_tpot_ratio = 1.05, min_requests = 20";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_faster_b_is_promoted_and_then_serves_nearly_everything() {
    let _one = ONE_AT_A_TIME.lock().await;
    let s = setup(0.9, STEPS, 70.0).await;
    let (r, at) = until(&s, Duration::from_secs(45), |r| r["state"] == "promoted").await;
    eprintln!("promoted after {at:?}: {:?}", percents(&r));
    assert_eq!(percents(&r), vec![10.0, 50.0, 100.0]);
    // Every step up rested on an evaluation that showed b within 1.05× with 95% confidence.
    for e in r["evaluations"].as_array().unwrap() {
        if e["decision"] == "advance" {
            assert!(e["tpot"]["ci95"][1].as_f64().unwrap() <= 1.05, "{e}");
        }
    }
    // After: b serves what the clients send (its copies have stopped).
    let (a0, b0) = (live(&s.a), live(&s.b));
    let shadow0 = s.b.engine.stats().shadow_requests;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let (a1, b1) = (live(&s.a) - a0, live(&s.b) - b0);
    let share = b1 as f64 / (a1 + b1) as f64;
    eprintln!("after promotion: a {a1}, b {b1} ({:.1}%)", share * 100.0);
    assert!(share >= 0.9, "a {a1}, b {b1}");
    assert!(
        s.b.engine.stats().shadow_requests - shadow0 <= 24,
        "copies after promotion"
    );
    let m = fetch(admin(&s.tap), "GET", "/metrics", b"").await;
    let text = String::from_utf8(m.body).unwrap();
    assert!(
        text.contains("tokentap_rollout_percent{route=\"chat\"} 100"),
        "{text}"
    );
    assert!(text.contains("tokentap_rollout_state{route=\"chat\",state=\"promoted\"} 1"));
    s.load.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slower_b_is_rolled_back_having_served_no_more_than_its_first_step() {
    let _one = ONE_AT_A_TIME.lock().await;
    let s = setup(1.25, STEPS, 40.0).await;
    let (r, at) = until(&s, Duration::from_secs(30), |r| r["state"] == "rolled_back").await;
    eprintln!("rolled back after {at:?}: {}", r["history"]);
    let why = r["history"].as_array().unwrap().last().unwrap()["why"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(why.contains("worse"), "{why}");
    assert!(
        percents(&r).iter().all(|&p| p <= 10.0),
        "{:?}",
        percents(&r)
    );
    // By the simulators' own counts: b's live share never above its first step's.
    let (a_n, b_n) = (live(&s.a), live(&s.b));
    let share = b_n as f64 / (a_n + b_n) as f64;
    eprintln!("live requests: a {a_n}, b {b_n} ({:.1}%)", share * 100.0);
    assert!(share <= 0.12, "a {a_n}, b {b_n}");
    // Rolled back: b gets nothing more.
    let b_then = live(&s.b);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        live(&s.b) - b_then <= 24,
        "b still served after the rollback"
    );
    s.load.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_equal_b_advances_only_on_evidence_and_never_flaps() {
    let _one = ONE_AT_A_TIME.lock().await;
    let s = setup(1.0, STEPS, 36.0).await;
    tokio::time::sleep(Duration::from_secs(34)).await;
    let r = rollout(&s.tap).await;
    let p = percents(&r);
    eprintln!("equal b: {p:?}, state {}", r["state"]);
    assert!(p.windows(2).all(|w| w[1] > w[0]), "a step back: {p:?}");
    assert_ne!(r["state"], "rolled_back", "{r:#}");
    // Each step up came after an evaluation that said "not worse"; none before it.
    let evals = r["evaluations"].as_array().unwrap();
    let advances = evals.iter().filter(|e| e["decision"] == "advance").count();
    assert_eq!(advances, p.len() - 1, "{r:#}");
    for e in evals.iter().filter(|e| e["decision"] == "advance") {
        assert!(e["tpot"]["ci95"][1].as_f64().unwrap() <= 1.05, "{e}");
    }
    s.load.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_b_that_starts_failing_at_half_is_rolled_back_within_one_evaluation() {
    let _one = ONE_AT_A_TIME.lock().await;
    let s = setup(0.9, STEPS, 50.0).await;
    until(&s, Duration::from_secs(40), |r| r["percent"] == 50.0).await;
    s.b.engine.set_fail(100.0);
    let failing = Instant::now();
    let (r, _) = until(&s, Duration::from_secs(50), |r| r["state"] == "rolled_back").await;
    let took = failing.elapsed();
    eprintln!(
        "rolled back {took:?} after b started failing: {}",
        r["history"]
    );
    let why = r["history"].as_array().unwrap().last().unwrap()["why"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(why.contains("fails"), "{why}");
    // Within one evaluation: every 5 s, on a 1 s tick, seen by a 250 ms poll.
    assert!(took <= Duration::from_millis(6_500), "{took:?}");
    let judged_failing = (r["evaluations"].as_array().unwrap().iter())
        .filter(|e| e["percent"] == 50.0)
        .count();
    assert_eq!(
        judged_failing, 1,
        "one evaluation at 50%: {:#}",
        r["evaluations"]
    );
    s.load.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steered_by_post_and_shown_in_stats() {
    let _one = ONE_AT_A_TIME.lock().await;
    let s = setup(1.0, "every_secs = 3600", 6.0).await;
    let post = |body: &'static str, route: &'static str| {
        let at = admin(&s.tap);
        async move { fetch(at, "POST", &format!("/rollout/{route}"), body.as_bytes()).await }
    };
    let r = post("pause", "chat").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(post("pause", "chat").await.status, 409);
    assert_eq!(post("rollback", "chat").await.status, 400);
    assert_eq!(post("pause", "nope").await.status, 404);
    assert_eq!(post(r#"{"action": "resume"}"#, "chat").await.status, 200);
    let r = post("promote", "chat").await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        (v["state"].as_str(), v["percent"].as_f64()),
        (Some("promoted"), Some(100.0))
    );
    let stats = fetch(admin(&s.tap), "GET", "/stats", b"").await;
    let stats: Value = serde_json::from_slice(&stats.body).unwrap();
    assert_eq!(
        stats["rollouts"][0]["state"], "promoted",
        "{}",
        stats["rollouts"]
    );
    let whys: Vec<&str> = (v["history"].as_array().unwrap().iter())
        .map(|t| t["why"].as_str().unwrap())
        .collect();
    assert_eq!(
        whys,
        [
            "started",
            "paused by POST /rollout",
            "resumed by POST /rollout",
            "promoted by POST /rollout"
        ]
    );
    s.load.abort();
}
