//! Concurrency caps end to end: the backend never sees more than the cap, over-queue
//! requests get 429 + Retry-After, and random disconnects leak no slot.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::time::Duration;

use common::*;
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CHAT: &str = "/v1/chat/completions";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_never_sees_more_than_the_cap() {
    let sim = sim("1:5,64:8").max_tokens(30).await;
    let tap = proxy(
        &[("sim", sim.addr)],
        "max_concurrency = 16\nmax_queue = 1000\n",
    )
    .await;
    let load = Closed::of(64, 2.0);
    let phase = tokio::spawn(closed_loop(proxy_addr(&tap), load));
    // Read the backend's peak while the load still runs: when the phase ends, its clients
    // all leave at once, and the backend only notices each abort at its next decode step
    // while the freed slots are already refilled from the queue.
    tokio::time::sleep(Duration::from_millis(1900)).await;
    let peak = sim.engine.stats().peak_batch;
    let r = phase.await.unwrap();
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.requests > 100, "{}", r.requests);
    assert!(peak <= 16, "the backend saw {peak} at once");
    assert!(peak >= 12, "the cap was reached: {peak}");
    let s = stats_when(&tap, |u| u["in_flight"] == 0 && u["queued"] == 0).await;
    assert_eq!(s["upstreams"][0]["limit"], 16);
    assert_eq!(s["upstreams"][0]["rejected_total"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_queue_clients_get_429_with_retry_after() {
    let sim = sim("1:10").max_tokens(100_000).await;
    let tap = proxy(
        &[("sim", sim.addr)],
        "max_concurrency = 1\nmax_queue = 1\nqueue_timeout_ms = 400\n",
    )
    .await;
    let addr = proxy_addr(&tap);
    // A holds the only slot.
    let mut a = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = br#"{"stream":true}"#;
    let req = format!("POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
    a.write_all(req.as_bytes()).await.unwrap();
    a.write_all(body).await.unwrap();
    let mut buf = [0u8; 1024];
    assert!(a.read(&mut buf).await.unwrap() > 0);
    // B waits in the queue, C finds it full.
    let b = tokio::spawn(async move { fetch(addr, "POST", CHAT, br#"{"stream":true}"#).await });
    stats_when(&tap, |u| u["queued"] == 1).await;
    let c = fetch(addr, "POST", CHAT, br#"{"stream":true}"#).await;
    assert_eq!(c.status, 429);
    assert_eq!(c.headers.get("retry-after").unwrap(), "1");
    let v: serde_json::Value = serde_json::from_slice(&c.body).unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_exceeded");
    assert_eq!(v["error"]["code"], "queue_full");
    // B's wait runs out.
    let b = b.await.unwrap();
    assert_eq!(b.status, 429);
    let v: serde_json::Value = serde_json::from_slice(&b.body).unwrap();
    assert_eq!(v["error"]["code"], "queue_timeout");
    drop(a);
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["rejected_total"], 2);
    assert_eq!(u["rejected_by_reason"]["queue_full"], 1);
    assert_eq!(u["rejected_by_reason"]["queue_timeout"], 1);
    let metrics = String::from_utf8(
        fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"")
            .await
            .body,
    )
    .unwrap();
    for want in [
        "tokentap_concurrency_limit{upstream=\"sim\"} 1",
        "tokentap_queued_requests{upstream=\"sim\"} 0",
        "tokentap_rejected_requests_total{upstream=\"sim\",reason=\"queue_full\"} 1",
        "tokentap_queue_wait_seconds_bucket{upstream=\"sim\"",
    ] {
        assert!(metrics.contains(want), "missing {want}:\n{metrics}");
    }
}

/// One client that goes away at a random moment: before its answer, in the queue, or
/// mid-stream; or reads to the end.
async fn fickle_client(addr: std::net::SocketAddr, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return;
    };
    let max_tokens = rng.gen_range(1..40);
    let body = format!(r#"{{"stream":true,"max_tokens":{max_tokens}}}"#);
    let req = format!("POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    if s.write_all(req.as_bytes()).await.is_err() {
        return;
    }
    let give_up_after = match rng.gen_range(0..4) {
        0 => Some(Duration::from_millis(rng.gen_range(0..20))), // likely still queued
        1 => Some(Duration::from_millis(rng.gen_range(20..200))), // likely streaming
        _ => None,
    };
    let read_all = async {
        let mut buf = [0u8; 4096];
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    match give_up_after {
        Some(t) => {
            let _ = tokio::time::timeout(t, read_all).await;
        }
        None => read_all.await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_fickle_clients_leak_no_slot() {
    let sim = sim("1:3,32:4").max_tokens(40).await;
    let tap = proxy(
        &[("sim", sim.addr)],
        "max_concurrency = 8\nmax_queue = 10000\nqueue_timeout_ms = 60000\n",
    )
    .await;
    let addr = proxy_addr(&tap);
    let mut tasks = tokio::task::JoinSet::new();
    for seed in 0..1000u64 {
        if tasks.len() >= 64 {
            tasks.join_next().await;
        }
        tasks.spawn(fickle_client(addr, seed));
    }
    while tasks.join_next().await.is_some() {}
    let s = stats_when(&tap, |u| {
        u["in_flight"] == 0 && u["queued"] == 0 && u["requests_total"].as_u64().unwrap() >= 990
    })
    .await;
    let u = &s["upstreams"][0];
    assert!(
        u["requests_by_status"]["aborted"].as_u64().unwrap() > 100,
        "{u:#}"
    );
    assert!(
        u["requests_by_status"]["ok"].as_u64().unwrap() > 100,
        "{u:#}"
    );
    assert_eq!(
        tap.shared().upstreams[0].limiter.stats().in_flight,
        0,
        "every permit came back"
    );
    // (The sim's own peak may pass 8 here: an aborted stream frees its slot at once, while
    // the backend only notices the abort at its next decode step.)
}
