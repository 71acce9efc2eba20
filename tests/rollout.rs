//! Progressive rollouts against real processes: two simulators behind tokentap, 24
//! closed-loop clients, the route's `rollout` stepping `b`'s share on the comparison at
//! matched concurrency. Shares are read from the simulators' own request counts (their
//! shadow copies, marked `x-tokentap-shadow`, counted apart: a copy serves no client).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{closed_loop, fetch, proxy, proxy_addr, sim, Closed};
use serde_json::Value;
use tokentap::server::Running;
use tokentap::sim::Sim;

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
    let _load = common::load_slot().await;
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
    let _load = common::load_slot().await;
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
    let _load = common::load_slot().await;
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
    let _load = common::load_slot().await;
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
    let _load = common::load_slot().await;
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

/// `a` and `b` (with the upstream keys `a_keys` and `b_keys`: their caps) behind tokentap
/// on route `chat`, whose further keys (its `rollout`, `spill`…) are `route`.
async fn capped(a: &Sim, b: &Sim, (a_keys, b_keys): (&str, &str), route: &str) -> Running {
    let text = format!(
        "[[upstream]]\nname = \"a\"\nurl = \"http://{}\"\n{a_keys}\
         [[upstream]]\nname = \"b\"\nurl = \"http://{}\"\n{b_keys}\
         [[route]]\nname = \"chat\"\nsplit = {{ a = 1, b = 1 }}\n{route}",
        a.addr, b.addr
    );
    proxy(&[], &text).await
}

/// The simulator's own figures, as `GET /sim/stats` gives them.
async fn sim_stats(s: &Sim) -> Value {
    let r = fetch(s.addr, "GET", "/sim/stats", b"").await;
    assert_eq!(r.status, 200);
    serde_json::from_slice(&r.body).unwrap()
}

/// At the first step `to` is asked for copies of 88.9% of `from`'s requests; with
/// `max_concurrency = 4` on `to` the copies take its free slots or are not sent: the
/// simulator's own peak batch stays within 4, no live request is refused for them, and
/// `/rollout` says what they cost and how many were not sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shadow_keeps_to_s_cap() {
    let _load = common::load_slot().await;
    let (a, b) = (sim("1:5").await, sim("1:5").await);
    let route = "rollout = { from = \"a\", to = \"b\", every_secs = 3600 }\n";
    let tap = capped(&a, &b, ("", "max_concurrency = 4\n"), route).await;
    // `b`'s peak read while the clients still run: when they leave at the end, a copy cut
    // with its client frees its slot at once, and the simulator notices the closed
    // connection a moment later (a peak of 5 with 3 aborted was seen so), as any backend.
    let during = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        sim_stats(&b).await
    };
    let (r, sb) = tokio::join!(closed_loop(proxy_addr(&tap), Closed::of(24, 2.5)), during);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    eprintln!("b: {sb}");
    assert!(sb["peak_batch"].as_u64().unwrap() <= 4, "{sb}");
    assert!(
        sb["shadow_requests"].as_u64().unwrap() > 0,
        "no copy sent: {sb}"
    );
    let ro = rollout(&tap).await;
    eprintln!("{ro:#}");
    assert_eq!(ro["percent"], 10.0);
    assert!(ro["shadow_sent_total"].as_u64().unwrap() > 0, "{ro:#}");
    assert!(ro["shadow_skipped_total"].as_u64().unwrap() > 0, "{ro:#}");
    assert!(ro["shadow_rps"].as_f64().unwrap() > 0.0, "{ro:#}");
    let s = common::stats(&tap).await;
    let ub = common::upstream_named(&s, "b");
    assert!(
        ub["shadow"]["skipped_total"]["cap"].as_u64().unwrap() > 0,
        "{:#}",
        ub["shadow"]
    );
}

/// Paused at 10% on a route with `spill = true`, `from` full (24 clients against its 8
/// slots): its overflow queues rather than spilling to `to`, so `to` serves 10% ± 3 of the
/// live requests by the simulators' own counts, and `/rollout` reports that share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spill_keeps_a_paused_step_s_share() {
    let _load = common::load_slot().await;
    let (a, b) = (sim("1:5").await, sim("1:5").await);
    let route = "spill = true\nrollout = { from = \"a\", to = \"b\", every_secs = 3600 }\n";
    let tap = capped(&a, &b, ("max_concurrency = 8\n", ""), route).await;
    let paused = fetch(admin(&tap), "POST", "/rollout/chat", b"pause").await;
    assert_eq!(paused.status, 200);
    let r = closed_loop(proxy_addr(&tap), Closed::of(24, 3.0)).await;
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let (a_n, b_n) = (live(&a), live(&b));
    let share = 100.0 * b_n as f64 / (a_n + b_n) as f64;
    eprintln!("live requests: a {a_n}, b {b_n} ({share:.1}%)");
    assert!((7.0..=13.0).contains(&share), "a {a_n}, b {b_n}");
    let ro = rollout(&tap).await;
    assert_eq!(
        (ro["state"].as_str(), ro["percent"].as_f64()),
        (Some("paused"), Some(10.0))
    );
    let served = ro["served_percent"].as_f64().unwrap();
    assert!((7.0..=13.0).contains(&served), "{ro:#}");
}

/// `POST /rollout/chat` whose head comes before a reload and whose body (`pause`) after:
/// the steer applies to the rollout live then, and its answer, `GET /rollout` and the
/// state file agree — with the rollout kept by the reload, and with one the reload changed
/// (started afresh).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steer_racing_a_reload_agrees_in_all_three_views() {
    let _load = common::load_slot().await;
    let (a, b) = (sim(A).await, sim(A).await);
    let scratch = common::process::Scratch::new("rollout-steer");
    let file = scratch.path("rollouts.json");
    let route = |every: u64| {
        format!(
            "[rollouts]\nstate_file = \"{}\"\n\
             [[route]]\nname = \"chat\"\nsplit = {{ a = 1, b = 1 }}\n\
             rollout = {{ from = \"a\", to = \"b\", every_secs = {every} }}\n",
            file.display()
        )
    };
    let tap = proxy(&[("a", a.addr), ("b", b.addr)], &route(3600)).await;
    let listen = tap.shared().config.listen.clone();
    let whole = |every: u64| {
        let text = format!(
            "[listen]\nproxy = \"{}\"\nadmin = \"{}\"\n\
             [[upstream]]\nname = \"a\"\nurl = \"http://{}\"\n\
             [[upstream]]\nname = \"b\"\nurl = \"http://{}\"\n{}",
            listen.proxy,
            listen.admin,
            a.addr,
            b.addr,
            route(every)
        );
        tokentap::config::Config::parse(&text, "test").unwrap()
    };
    // The same rollout (kept, running), then a changed one (afresh, running).
    for every in [3600, 1800] {
        let reload = || assert!(tap.live().apply(whole(every)).ok);
        let (status, answer) = steer_around(admin(&tap), "pause", reload).await;
        assert_eq!(status, 200, "{answer:#}");
        let listed = rollout(&tap).await;
        let saved: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        let states = (
            answer["state"].as_str(),
            listed["state"].as_str(),
            saved["rollouts"][0]["state"].as_str(),
        );
        eprintln!("every_secs = {every}: {states:?}");
        assert_eq!(states, (Some("paused"), Some("paused"), Some("paused")));
        // The rollout steered is the one the reload put in force.
        assert_eq!(answer["every_secs"], every, "{answer:#}");
        assert_eq!(listed["every_secs"], every, "{listed:#}");
        // Running again for the next round (a kept rollout stays paused across a reload).
        let resumed = fetch(admin(&tap), "POST", "/rollout/chat", b"resume").await;
        assert_eq!(resumed.status, 200);
    }
}

/// `POST /rollout/chat` with `body` as its body: its head sent, then `between` run while
/// the admin waits for the body, then the body; the answer's status and JSON.
async fn steer_around(admin: SocketAddr, body: &str, between: impl FnOnce()) -> (u16, Value) {
    use tokio::io::AsyncWriteExt;
    let mut conn = tokio::net::TcpStream::connect(admin).await.unwrap();
    let head = format!(
        "POST /rollout/chat HTTP/1.1\r\nhost: {admin}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    // Nothing tells a client that its head has been read and its body is awaited: a pause
    // long enough for the admin to be there.
    tokio::time::sleep(Duration::from_millis(200)).await;
    between();
    conn.write_all(body.as_bytes()).await.unwrap();
    let resp = common::read_message(&mut conn).await.unwrap();
    let end = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = String::from_utf8_lossy(&resp[..end]);
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_slice(&resp[end..]).unwrap())
}
