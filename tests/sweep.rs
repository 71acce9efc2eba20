//! The batching table, short (80-token replies, so the first token's longer gap weighs
//! little in each request's TPOT): `tokentap load` against `tokentap sim` reproduces the sim's
//! curve, and tokentap's `/stats` agrees with the load generator's own figures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use tokentap::load::{self, LoadArgs, Mode, PhaseReport};
use tokentap::sim::Curve;

const LEVELS: [usize; 3] = [1, 12, 48];
const WARMUP: Duration = Duration::from_secs(1);
const MEASURE: Duration = Duration::from_secs(4);

fn target(addr: SocketAddr) -> std::sync::Arc<load::Target> {
    LoadArgs {
        duration: MEASURE.as_secs_f64(),
        warmup: WARMUP.as_secs_f64(),
        max_tokens: 80,
        include_usage: true,
        model: "m".into(),
        prompt: "p".into(),
        ..LoadArgs::for_url(format!("http://{addr}"))
    }
    .target()
    .unwrap()
}

fn within(got: Option<f64>, want: f64, tol: f64) -> bool {
    got.is_some_and(|g| (g - want).abs() <= tol * want)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_against_sim_reproduces_the_reference_curve() {
    let sim = sim(Curve::reference()).ttft(10.0).max_tokens(80).await;
    let target = target(sim.addr);
    let curve = Curve::reference();
    for c in LEVELS {
        let r = load::phase(
            &target,
            Mode::Closed { concurrency: c },
            WARMUP,
            MEASURE,
            false,
        )
        .await;
        assert!(r.errors.is_empty(), "{r:?}");
        // Nearly all clients decode at once; a few are in their 10 ms prefill.
        let tpot = curve.tpot_ms(c as f64);
        assert!(
            within(r.tpot_ms.p50, tpot, 0.05),
            "c={c}: TPOT p50 {:?} vs {tpot}",
            r.tpot_ms.p50
        );
        assert!(
            within(r.single_stream_tps, 1000.0 / tpot, 0.05),
            "c={c}: {:?}",
            r.single_stream_tps
        );
        assert!(
            within(r.system_tps, c as f64 * 1000.0 / tpot, 0.05),
            "c={c}: system {:?}",
            r.system_tps
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_stats_agree_with_the_load_generator() {
    let sim = sim(Curve::reference()).ttft(10.0).max_tokens(80).await;
    let tap = proxy(&[("sim", sim.addr)], "[metrics]\nwindow_secs = 2\n").await;
    let target = target(proxy_addr(&tap));
    let mut seen: Vec<(usize, PhaseReport, serde_json::Value)> = Vec::new();
    for c in LEVELS {
        let t = std::sync::Arc::clone(&target);
        let phase = tokio::spawn(async move {
            load::phase(&t, Mode::Closed { concurrency: c }, WARMUP, MEASURE, false).await
        });
        // Sample the proxy's 2 s window at the end of the measured window, while the
        // load is still steady.
        tokio::time::sleep(WARMUP + MEASURE - Duration::from_millis(100)).await;
        let s = stats(&tap).await;
        let r = phase.await.unwrap();
        seen.push((c, r, s["upstreams"][0].clone()));
    }
    for (c, r, u) in &seen {
        assert!(r.errors.is_empty(), "{r:?}");
        let f = |k: &str| u[k].as_f64();
        assert!(
            within(f("system_tps"), r.system_tps.unwrap(), 0.03),
            "c={c}: proxy {:?} vs load {:?}",
            f("system_tps"),
            r.system_tps
        );
        assert!(
            within(f("single_stream_tps"), r.single_stream_tps.unwrap(), 0.03),
            "c={c}: proxy {:?} vs load {:?}",
            f("single_stream_tps"),
            r.single_stream_tps
        );
        assert!(
            within(u["tpot_ms"]["p50"].as_f64(), r.tpot_ms.p50.unwrap(), 0.03),
            "c={c}: proxy {} vs load {:?}",
            u["tpot_ms"]["p50"],
            r.tpot_ms.p50
        );
    }
    let u = &seen.last().unwrap().2;
    let curve = Curve::reference();
    for (bucket, c) in [(1u64, 1usize), (16, 12), (64, 48)] {
        let p = u["curve"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["concurrency"] == bucket)
            .unwrap_or_else(|| panic!("bucket {bucket}: {u:#}"));
        let want = curve.tpot_ms(c as f64);
        assert!(
            within(p["tpot_ms_p50"].as_f64(), want, 0.05),
            "bucket {bucket}: {p} vs {want}"
        );
    }
}
