//! Tenants end to end, against a simulator and closed-loop clients: a tenant that floods
//! does not take a light one's share (fair queuing), `high` gets the lion's share and `low`
//! a trickle, a request that would wait past its timeout is
//! refused at once with `Retry-After`, and a tenant's output-token budget holds with
//! OpenAI's headers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use tokio::time::Instant;

const CHAT: &str = "/v1/chat/completions";

/// One simulator, cap 8; tenant A floods with 40 clients, tenant B has 4: the fair queue
/// serves B's requests first beside A's flood (B's TTFT p50 at most a quarter of A's) and
/// B gets at least 35% of the tokens (a FIFO: about 4 / 44). The simulator frees slots in
/// cohorts: without the slot held a moment for the tenant the queue owes, B's next request
/// arrived just after each cohort went to A's waiters and B read 32–34%.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_does_not_take_a_light_ones_share() {
    let _load = common::load_slot().await;
    let sim = sim("1:10").await;
    let tap = proxy(
        &[("u", sim.addr)],
        "max_concurrency = 8\nmax_queue = 1000\nqueue_timeout_ms = 60000\n[tenants]\nkey = \"header:x-tenant\"\n",
    )
    .await;
    let at = proxy_addr(&tap);
    let (a, b) = tokio::join!(
        closed_loop(
            at,
            Closed::of(40, 6.0)
                .after(2.0)
                .with_usage()
                .header("x-tenant: a")
        ),
        closed_loop(
            at,
            Closed::of(4, 6.0)
                .after(2.0)
                .with_usage()
                .header("x-tenant: b")
        ),
    );
    assert!(
        a.errors.is_empty() && b.errors.is_empty(),
        "{:?} {:?}",
        a.errors,
        b.errors
    );
    let share = b.output_tokens as f64 / (a.output_tokens + b.output_tokens) as f64;
    let (ta, tb) = (a.ttft_ms.p50.unwrap(), b.ttft_ms.p50.unwrap());
    eprintln!(
        "A: {} requests, TTFT p50 {ta:.0} ms; B: {} requests, TTFT p50 {tb:.0} ms (p90 {:?}, TPOT p50 {:?}), {:.1}% of the tokens",
        a.requests,
        b.requests,
        b.ttft_ms.p90,
        b.tpot_ms.p50,
        100.0 * share
    );
    assert!(share >= 0.35, "B's share {share:.3}");
    assert!(tb <= ta / 4.0, "TTFT p50: B {tb:.0} ms, A {ta:.0} ms");
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let tenants = s["tenants"]["top"].as_array().unwrap();
    let names: Vec<&str> = tenants
        .iter()
        .map(|t| t["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(names[..2], ["a", "b"], "{names:?}");
    assert!(tenants[1]["output_share_pct"].as_f64().unwrap() >= 35.0);
    let metrics = fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("tokentap_tenant_output_tokens_total{tenant=\"b\"}"));
}

/// 24 `high` clients against 24 `low` ones, cap 8, the default ageing (5 s): `high` gets
/// the lion's share (≥ 90% of the tokens) at a TTFT p50 at most a fifth of `low`'s, and
/// `low` is still served, at least once in every 30 s (here: every ageing bound and a
/// request's time). Every aged `low` request jumping the bands gave `low` a third.
/// (`queue_timeout_ms` is long so that the `low` requests past the trickle's turn wait
/// rather than being refused at once and sent again in a loop.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn high_gets_the_lions_share_and_low_a_trickle() {
    let _load = common::load_slot().await;
    // Requests of ~0.3 s: 26 slots freed a second, so that every `low` request aged past
    // the bound jumping the bands (24 every ~5.3 s) would take a sixth of them and more.
    let sim = sim("1:10").await;
    let tap = proxy(
        &[("u", sim.addr)],
        "max_concurrency = 8\nmax_queue = 1000\nqueue_timeout_ms = 300000\n[tenants]\nkey = \"header:x-tenant\"\npriority = \"header:x-priority\"\n",
    )
    .await;
    let at = proxy_addr(&tap);
    let load = |priority: &str, secs: f64| {
        Closed::of(24, secs)
            .after(3.0)
            .with_usage()
            .header(&format!("x-tenant: {priority}"))
            .header(&format!("x-priority: {priority}"))
    };
    // `low`'s requests served, as tokentap's tenant book counts them, each half second;
    // and the book as it stands just before the load ends.
    let served = Arc::new(Mutex::new(Vec::<(Instant, u64)>::new()));
    let book = Arc::new(Mutex::new(serde_json::Value::Null));
    let watch = {
        let (served, book, tap) = (Arc::clone(&served), Arc::clone(&book), &tap);
        async move {
            let until = Instant::now() + Duration::from_millis(14_500);
            while Instant::now() < until {
                let s = stats(tap).await;
                *book.lock().unwrap() = s["tenants"].clone();
                let low = (s["tenants"]["top"].as_array().into_iter().flatten())
                    .find(|t| t["tenant"] == "low")
                    .map_or(0, |t| t["requests_total"].as_u64().unwrap_or(0));
                served.lock().unwrap().push((Instant::now(), low));
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    // `low` arrives once `high` has the slots and a queue (none of its requests is let in
    // at once): every `low` request served is one the trickle let through.
    let low = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        closed_loop(at, load("low", 11.0)).await
    };
    let (high, low, ()) = tokio::join!(closed_loop(at, load("high", 12.0)), low, watch);
    assert!(high.errors.is_empty() && low.errors.is_empty());
    let share = high.output_tokens as f64 / (high.output_tokens + low.output_tokens) as f64;
    // TTFT as tokentap's tenant book has it, under the load: `low`'s requests served in
    // the measured time began before it (each waits its turn in the trickle), so the
    // clients' report, which keeps the requests begun inside it, has none.
    let book = book.lock().unwrap().clone();
    let ttft = |tenant: &str| {
        (book["top"].as_array().unwrap().iter())
            .find(|t| t["tenant"] == tenant)
            .and_then(|t| t["ttft_ms"]["p50"].as_f64())
            .unwrap()
    };
    let (th, tl) = (ttft("high"), ttft("low"));
    // The longest time `low` went without a request served, once the trickle began.
    let served = served.lock().unwrap().clone();
    let first = served.iter().position(|&(_, n)| n > 0).unwrap();
    let mut gap = Duration::ZERO;
    let mut last = served[first].0;
    for w in served[first..].windows(2) {
        if w[1].1 > w[0].1 {
            last = w[1].0;
        }
        gap = gap.max(w[1].0 - last);
    }
    eprintln!(
        "high: {} requests, TTFT p50 {th:.0} ms, {:.1}% of the tokens; low: {} requests, TTFT p50 {tl:.0} ms; low's longest wait for a request served {:.1} s",
        high.requests,
        100.0 * share,
        low.output_tokens / 30,
        gap.as_secs_f64()
    );
    assert!(share >= 0.90, "high's share {share:.3}");
    assert!(th <= 0.2 * tl, "TTFT p50: high {th:.0} ms, low {tl:.0} ms");
    assert!(low.output_tokens > 0);
    assert!(gap <= Duration::from_secs(8), "low went {gap:?} unserved");
}

/// Cap 2, `queue_timeout_ms = 1000`, 24 clients of ~0.9 s requests: once slots have been
/// freeing, a request that cannot start within the timeout is refused at once (the 429s'
/// p90 ≤ 150 ms after arrival, against 1,000 ms for a wait run out), each with
/// `Retry-After`; no admitted request waits past its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_predicted_past_the_timeout_is_refused_at_once() {
    let _load = common::load_slot().await;
    let sim = sim("1:30").await;
    let tap = proxy(
        &[("u", sim.addr)],
        "max_concurrency = 2\nqueue_timeout_ms = 1000\n",
    )
    .await;
    let at = proxy_addr(&tap);
    let body = br#"{"model":"m","stream":true,"max_tokens":30,"messages":[{"role":"user","content":"hi"}]}"#;
    let start = Instant::now();
    let end = start + Duration::from_secs(8);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..24 {
        let seen = Arc::clone(&seen);
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                let sent = Instant::now();
                let Ok(r) = send(at, "POST", CHAT, body, &[]).await else {
                    continue;
                };
                let ms = sent.elapsed().as_secs_f64() * 1e3;
                let retry = r
                    .headers
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned());
                let code = String::from_utf8_lossy(&r.body).contains("predicted_wait");
                seen.lock().unwrap().push((sent, r.status, ms, retry, code));
                if r.status == 429 {
                    // As a client told to wait would, briefly.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    // After the first slots have freed (the rate is known).
    let late: Vec<_> = seen
        .iter()
        .filter(|s| s.0 >= start + Duration::from_secs(3))
        .collect();
    let mut refused: Vec<f64> = late.iter().filter(|s| s.1 == 429).map(|s| s.2).collect();
    refused.sort_by(f64::total_cmp);
    assert!(refused.len() >= 20, "{} refused", refused.len());
    let p90 = refused[refused.len() * 9 / 10];
    let ok = late.iter().filter(|s| s.1 == 200).count();
    eprintln!(
        "{} requests after 3 s: {ok} served, {} refused, their p90 {p90:.1} ms",
        late.len(),
        refused.len()
    );
    assert!(p90 <= 150.0, "the 429s' p90 {p90:.1} ms");
    assert!(late.iter().filter(|s| s.1 == 429).all(|s| s.3.is_some()));
    assert!(late.iter().filter(|s| s.1 == 429).any(|s| s.4));
    assert!(ok > 0);
    let s = stats(&tap).await;
    let waits = &s["upstreams"][0];
    assert!(
        waits["rejected_by_reason"]["predicted_wait"]
            .as_u64()
            .unwrap()
            > 0
    );
    // No admitted request waited past its timeout: every 200 ended within the timeout
    // and a request's own time (0.9 s) plus slack.
    let worst_ok = (seen.iter().filter(|s| s.1 == 200).map(|s| s.2)).fold(0.0, f64::max);
    assert!(worst_ok <= 1000.0 + 900.0 + 500.0, "{worst_ok:.0} ms");
}

/// A tenant's budget of 3,000 output tokens a minute: over 10 s after its first minute's
/// bucket is spent it gets at most the budget's share plus what was in flight; refused with
/// `Retry-After` and `x-ratelimit-*-tokens`; another tenant is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_budget_holds_and_says_when_to_come_back() {
    let _load = common::load_slot().await;
    let sim = sim("1:2").await;
    let tap = proxy(
        &[("u", sim.addr)],
        "[tenants]\nkey = \"header:x-tenant\"\n[[tenants.override]]\ntenant = \"t\"\noutput_tokens_per_minute = 3000\n",
    )
    .await;
    let at = proxy_addr(&tap);
    let (t, other) = tokio::join!(
        closed_loop(
            at,
            Closed::of(8, 10.0)
                .after(4.0)
                .with_usage()
                .header("x-tenant: t")
        ),
        closed_loop(
            at,
            Closed::of(2, 10.0)
                .after(4.0)
                .with_usage()
                .header("x-tenant: u")
        ),
    );
    // Measured after the bucket's first 3,000 are spent: 10 s refill 500, plus up to 8
    // requests of 30 in flight at the window's edges.
    let bound = (500.0 + 8.0 * 30.0) * 1.15;
    eprintln!(
        "t: {} tokens in 10 s ({} requests, refused {:?}); u: {} tokens, refused {:?}",
        t.output_tokens, t.requests, t.errors, other.output_tokens, other.errors
    );
    assert!(
        (t.output_tokens as f64) <= bound,
        "{} > {bound}",
        t.output_tokens
    );
    assert!(t.output_tokens >= 300, "{}", t.output_tokens);
    assert!(t.errors.get("http_429").copied().unwrap_or(0) > 0);
    assert!(other.errors.is_empty(), "{:?}", other.errors);
    let r = send(
        at,
        "POST",
        CHAT,
        br#"{"model":"m","stream":true,"max_tokens":30,"messages":[{"role":"user","content":"hi"}]}"#,
        &[("x-tenant", "t")],
    )
    .await
    .unwrap();
    assert_eq!(r.status, 429);
    for h in [
        "retry-after",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ] {
        assert!(r.headers.contains_key(h), "{h} missing: {:?}", r.headers);
    }
    assert_eq!(r.headers["x-ratelimit-limit-tokens"], "3000");
    assert!(String::from_utf8_lossy(&r.body).contains("output_token_budget"));
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let t = (s["tenants"]["top"].as_array().unwrap().iter())
        .find(|x| x["tenant"] == "t")
        .unwrap()
        .clone();
    assert!(
        t["refused_by_cause"]["output_token_budget"]
            .as_u64()
            .unwrap()
            > 0
    );
}

/// Bad input: a tenant header of 60 KB (hashed, never shown), a secret key header (hashed),
/// a priority that is not one of the three (normal, counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_tenant_headers_are_hashed_and_a_bad_priority_is_counted() {
    let _load = common::load_slot().await;
    let sim = sim("1:2").await;
    let tap = proxy(
        &[("u", sim.addr)],
        "max_concurrency = 4\n[server]\nmax_request_head_bytes = 131072\n[tenants]\nkey = \"header:x-tenant\"\npriority = \"header:x-priority\"\n",
    )
    .await;
    let at = proxy_addr(&tap);
    let body = br#"{"model":"m","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
    let long = "z".repeat(60 * 1024);
    for headers in [
        vec![("x-tenant", long.as_str())],
        vec![("x-tenant", "ok-tenant"), ("x-priority", "urgent")],
    ] {
        let r = send(at, "POST", CHAT, body, &headers).await.unwrap();
        assert_eq!(r.status, 200);
    }
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    let t = &s["tenants"];
    assert_eq!(t["invalid_priority_total"], 1);
    let names: Vec<String> = (t["top"].as_array().unwrap().iter())
        .map(|x| x["tenant"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("key-") && n.len() == 20),
        "{names:?}"
    );
    assert!(names.iter().all(|n| !n.contains("zzz")));
    assert!(names.contains(&"ok-tenant".to_owned()));
}
