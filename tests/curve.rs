//! The curve on real streams: 24 streams started at once, three tokens to an event (counted
//! one each until the exact usage count arrives at the end), cannot produce a point faster
//! than the backend can run at that concurrency, and `POST /curve/reset` empties the
//! curve's window while `/metrics`' counters keep counting.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use tokentap::sim::{Curve, Sim, SimArgs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_point_is_faster_than_the_backend_can_run() {
    let curve = "1:20,8:22,32:30";
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: curve.parse::<Curve>().unwrap(),
        ttft_ms: 10.0,
        max_tokens: 150,
        tokens_per_chunk: 3,
        ..SimArgs::defaults()
    })
    .await
    .unwrap();
    let tap = proxy(&[("sim", sim.addr)], "").await;
    let load = Closed {
        max_tokens: 150,
        ..Closed::of(24, 4.0).with_usage()
    };
    let report = closed_loop(proxy_addr(&tap), load).await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["counts_exact"], true, "{u:#}");
    let tpot_at = |c: f64| {
        // The simulator's curve, interpolated as it does: its per-token time at c.
        let pts = [(1.0, 20.0), (8.0, 22.0), (32.0, 30.0)];
        let i = pts
            .iter()
            .position(|p| p.0 >= c)
            .unwrap_or(pts.len() - 1)
            .max(1);
        let ((c0, t0), (c1, t1)) = (pts[i - 1], pts[i]);
        t0 + (t1 - t0) * ((c.min(c1) - c0) / (c1 - c0)).max(0.0)
    };
    let mut supported = 0;
    for p in u["curve"].as_array().unwrap() {
        let c = p["concurrency"].as_f64().unwrap();
        let Some(system) = p["system_tps"].as_f64() else {
            continue;
        };
        // At most c streams, each at most 3 tokens every TPOT(c) (10% for timing).
        let ceiling = c * 3.0 * 1000.0 / tpot_at(c) * 1.1;
        if p["sparse"] == false {
            supported += 1;
            assert!(
                system <= ceiling,
                "{system:.0} T/s at ≤{c} in flight, over {ceiling:.0}: {p:#}"
            );
        }
    }
    assert!(supported >= 1, "{u:#}");

    let admin = tap.shared().config.listen.admin;
    let before = fetch(admin, "GET", "/metrics", b"").await;
    let before = String::from_utf8(before.body).unwrap();
    assert!(before.contains("tokentap_curve_tokens_total{upstream=\"sim\",concurrency=\"32\"}"));
    let reset = fetch(admin, "POST", "/curve/reset", b"").await;
    assert_eq!(reset.status, 200);
    let s = stats(&tap).await;
    assert_eq!(s["upstreams"][0]["curve"], serde_json::json!([]));
    let after = fetch(admin, "GET", "/metrics", b"").await;
    let after = String::from_utf8(after.body).unwrap();
    let line = |text: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("tokentap_curve_tokens_total{upstream=\"sim\",concurrency=\"32\"}")
            })
            .map(str::to_owned)
    };
    assert_eq!(
        line(&before),
        line(&after),
        "the counters keep their counts"
    );
    tap.stop();
}
