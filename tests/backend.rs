//! `backend_metrics`: the backend's own running count as the curve's concurrency axis.
//! Three tokentap replicas in front of one simulator (which exports vLLM's names at
//! `/metrics`), each carrying a third of 48 clients: each replica's curve fills the 33–64
//! bucket, the backend's batch, not the 9–16 one its own in-flight count would give. A
//! backend whose metrics do not answer leaves the curve on tokentap's own count, and the
//! failures are counted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use tokentap::sim::{Curve, Sim, SimArgs};

/// Samples of `stats`' only upstream's curve, by bucket.
fn samples(stats: &serde_json::Value) -> Vec<(u64, u64)> {
    stats["upstreams"][0]["curve"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["concurrency"].as_u64().unwrap(),
                p["samples"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_each_draw_the_backend_s_batch() {
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: "1:10,64:20,128:30".parse::<Curve>().unwrap(),
        ttft_ms: 20.0,
        max_batch: Some(128),
        max_tokens: 400,
        ..SimArgs::defaults()
    })
    .await
    .unwrap();
    let extra = format!(
        "backend_metrics = \"http://{}/metrics\"\nbackend_scrape_ms = 100\n",
        sim.addr
    );
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(proxy(&[("sim", sim.addr)], &extra).await);
    }
    // A closed loop of 16 clients on each replica, all at once.
    let mut loops = Vec::new();
    for r in &replicas {
        let load = Closed {
            max_tokens: 400,
            ..Closed::of(16, 5.0)
        };
        loops.push(tokio::spawn(closed_loop(proxy_addr(r), load)));
    }
    let mut reports = Vec::new();
    for l in loops {
        reports.push(l.await.unwrap());
    }
    for r in &reports {
        assert!(r.errors.is_empty(), "{:?}", r.errors);
    }
    for r in &replicas {
        let s = stats(r).await;
        let u = &s["upstreams"][0];
        assert_eq!(u["concurrency_source"], "backend", "{u:#}");
        let curve = samples(&s);
        let total: u64 = curve.iter().map(|(_, n)| n).sum();
        let at = |c: u64| curve.iter().find(|(b, _)| *b == c).map_or(0, |(_, n)| *n);
        assert!(
            at(64) as f64 >= 0.8 * total as f64,
            "the 33–64 bucket holds {} of {total} samples: {curve:?}",
            at(64)
        );
        assert!(at(16) as f64 <= 0.05 * total as f64, "{curve:?}");
        let point = u["curve"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["concurrency"] == 64)
            .unwrap();
        // The backend's rate at that batch, not this replica's third of it: ~48 × 1000/18.
        let system = point["system_tps"].as_f64().unwrap();
        assert!((1800.0..3500.0).contains(&system), "{point:#}");
        let backend = &u["backend"];
        assert!(backend["age_ms"].as_u64().unwrap() < 1000, "{backend:#}");
        assert_eq!(backend["scrape_failures_total"], 0);
    }
    let metrics = fetch(
        replicas[0].shared().config.listen.admin,
        "GET",
        "/metrics",
        b"",
    )
    .await;
    let text = String::from_utf8(metrics.body).unwrap();
    for series in [
        "tokentap_backend_running_requests{upstream=\"sim\"}",
        "tokentap_backend_waiting_requests{upstream=\"sim\"}",
        "tokentap_backend_kv_cache_percent{upstream=\"sim\"}",
        "tokentap_backend_scrape_failures_total{upstream=\"sim\"} 0",
    ] {
        assert!(text.contains(series), "{series} missing");
    }
    for r in replicas {
        r.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_that_do_not_answer_leave_the_proxy_s_count() {
    let backend = mock(vec![]).await;
    // Nothing listens on the discard port.
    let extra = "backend_metrics = \"http://127.0.0.1:9/metrics\"\nbackend_scrape_ms = 100\n";
    let tap = proxy(&[("up", backend.addr)], extra).await;
    let s = stats_when(&tap, |u| {
        u["backend"]["scrape_failures_total"].as_u64() >= Some(2)
    })
    .await;
    let u = &s["upstreams"][0];
    assert_eq!(u["concurrency_source"], "proxy");
    assert_eq!(u["backend"]["running"], serde_json::Value::Null);
    assert_eq!(u["backend"]["age_ms"], serde_json::Value::Null);
    tap.stop();
}
