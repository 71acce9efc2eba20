//! Every dialect end to end: `tokentap sim --dialect X` behind tokentap, driven by the load
//! generator speaking X. Token totals equal the sim's truth; TPOT and system T/s agree with
//! the load generator's within 2%; with 4 tokens per event, ITL is the per-token gap.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::time::Duration;

use common::*;
use tokentap::load::{self, LoadArgs, Mode};
use tokentap::sim::{SimDialect, UsageMode};

const WARMUP: Duration = Duration::from_millis(500);
const MEASURE: Duration = Duration::from_millis(2500);

fn args(addr: std::net::SocketAddr, dialect: SimDialect) -> LoadArgs {
    LoadArgs {
        dialect,
        concurrency: vec![],
        duration: MEASURE.as_secs_f64(),
        warmup: WARMUP.as_secs_f64(),
        max_tokens: 32,
        include_usage: true,
        model: "m".into(),
        prompt: "p".into(),
        ..LoadArgs::for_url(format!("http://{addr}"))
    }
}

fn within(a: Option<f64>, b: Option<f64>, tol: f64) -> bool {
    matches!((a, b), (Some(a), Some(b)) if (a - b).abs() <= tol * b)
}

/// Runs a phase through the proxy and reads `/stats` just before it ends.
async fn phase(
    tap: &tokentap::server::Running,
    a: &LoadArgs,
    c: usize,
) -> (load::PhaseReport, serde_json::Value) {
    let target = a.target().unwrap();
    let p = tokio::spawn(async move {
        load::phase(
            &target,
            Mode::Closed { concurrency: c },
            WARMUP,
            MEASURE,
            false,
        )
        .await
    });
    tokio::time::sleep(WARMUP + MEASURE - Duration::from_millis(100)).await;
    let s = stats(tap).await;
    (p.await.unwrap(), s["upstreams"][0].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dialect_through_the_proxy() {
    for dialect in [
        SimDialect::Openai,
        SimDialect::Responses,
        SimDialect::Anthropic,
        SimDialect::Tgi,
        SimDialect::Ollama,
        SimDialect::Llamacpp,
    ] {
        let sim = sim("1:16")
            .max_tokens(32)
            .dialect(dialect)
            .tokens_per_chunk(1)
            .usage(UsageMode::Auto)
            .await;
        let tap = proxy(&[("sim", sim.addr)], "[metrics]\nwindow_secs = 2\n").await;
        let a = args(proxy_addr(&tap), dialect);
        let (r, u) = phase(&tap, &a, 4).await;
        assert!(r.errors.is_empty(), "{dialect:?}: {:?}", r.errors);
        assert!(r.requests >= 8, "{dialect:?}: {}", r.requests);
        let f = |k: &str| u[k].as_f64();
        assert!(
            within(f("system_tps"), r.system_tps, 0.02),
            "{dialect:?}: system {:?} vs load {:?}",
            f("system_tps"),
            r.system_tps
        );
        assert!(
            within(u["tpot_ms"]["p50"].as_f64(), r.tpot_ms.p50, 0.02),
            "{dialect:?}: TPOT {} vs load {:?}",
            u["tpot_ms"]["p50"],
            r.tpot_ms.p50
        );

        // Whole requests: the proxy's totals equal the sim's truth, exactly.
        let before = stats_when(&tap, |u| u["in_flight"] == 0).await["upstreams"][0]
            ["output_tokens_total"]
            .as_u64()
            .unwrap();
        let target = a.target().unwrap();
        for _ in 0..3 {
            let (body, _) = target.workload.next(None);
            let resp = fetch(proxy_addr(&tap), "POST", &target.path, &body).await;
            assert_eq!(resp.status, 200, "{dialect:?}");
        }
        let s = stats_when(&tap, |u| {
            u["output_tokens_total"].as_u64().unwrap() >= before + 96
        })
        .await;
        let u = &s["upstreams"][0];
        assert_eq!(
            u["output_tokens_total"].as_u64().unwrap(),
            before + 96,
            "{dialect:?}: {u:#}"
        );
        assert_eq!(u["counts_exact"], true, "{dialect:?}: {u:#}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tokens_per_event_give_the_per_token_gap() {
    // llama.cpp says how many tokens each event carries (its `tokens` ids); OpenAI does
    // when the server sends a running usage count (vLLM's continuous usage stats).
    for (dialect, usage) in [
        (SimDialect::Llamacpp, UsageMode::Auto),
        (SimDialect::Openai, UsageMode::Continuous),
    ] {
        let sim = sim("1:16")
            .max_tokens(32)
            .dialect(dialect)
            .tokens_per_chunk(4)
            .usage(usage)
            .await;
        let tap = proxy(&[("sim", sim.addr)], "[metrics]\nwindow_secs = 2\n").await;
        let (r, u) = phase(&tap, &args(proxy_addr(&tap), dialect), 2).await;
        assert!(r.errors.is_empty(), "{dialect:?}: {:?}", r.errors);
        // A 16 ms step carries 4 tokens: 4 ms per token.
        let itl = u["itl_ms"]["p50"].as_f64().unwrap();
        assert!((3.6..4.4).contains(&itl), "{dialect:?}: ITL p50 {itl} ms");
        let tpot = u["tpot_ms"]["p50"].as_f64().unwrap();
        assert!(
            (3.6..4.6).contains(&tpot),
            "{dialect:?}: TPOT p50 {tpot} ms"
        );
        assert_eq!(u["tokens_per_event"]["p50"], 4, "{dialect:?}: {u:#}");
        assert!(
            within(u["system_tps"].as_f64(), r.system_tps, 0.02),
            "{dialect:?}: {} vs {:?}",
            u["system_tps"],
            r.system_tps
        );
    }
}
