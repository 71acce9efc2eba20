//! A/B through the proxy: two simulated backends, one 10% slower per token at every batch
//! size, split 50/50 under 32 closed-loop clients (the load at which power-of-two strata
//! split the arms); `/compare` names the faster one at matched concurrency.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use tokentap::sim::Curve;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_names_the_faster_backend() {
    // 32 clients whose per-token timing is what is compared: alone on the machine.
    let _machine = common::whole_machine().await;
    let fast = sim(Curve::reference()).ttft(10.0).max_tokens(24).await;
    let slow = sim(Curve::reference().scaled(1.1))
        .ttft(10.0)
        .max_tokens(24)
        .await;
    let tap = proxy(
        &[("fast", fast.addr), ("slow", slow.addr)],
        "[[route]]\npath_prefix = \"/\"\nsplit = { \"fast\" = 50, \"slow\" = 50 }\n",
    )
    .await;
    let admin = tap.shared().config.listen.admin;
    let load = Closed {
        max_tokens: 24,
        ..Closed::of(32, 8.0).with_usage()
    };
    let r = closed_loop(proxy_addr(&tap), load).await;
    assert!(r.errors.is_empty(), "{:?}", r.errors);

    let resp = fetch(admin, "GET", "/compare", b"").await;
    assert_eq!(resp.status, 200);
    let c: serde_json::Value = serde_json::from_slice(&resp.body).unwrap();
    assert_eq!(
        (c["a"].as_str(), c["b"].as_str()),
        (Some("fast"), Some("slow")),
        "the first split's arms"
    );
    let t = &c["metrics"]["tpot_ms"];
    assert_eq!(t["significant"], true, "{c:#}");
    assert_eq!(t["better"], "fast", "{c:#}");
    let diff = t["diff_pct"].as_f64().unwrap();
    assert!((7.0..13.0).contains(&diff), "about 10% slower: {diff}");
    assert!(
        c["verdict"].as_str().unwrap().starts_with("fast is "),
        "{}",
        c["verdict"]
    );
    assert_eq!(c["reason"], serde_json::Value::Null, "{c:#}");
    let o = &c["overlap"];
    assert!(o["a_requests"].as_u64().unwrap() >= 50, "{o}");
    assert!(o["b_requests"].as_u64().unwrap() >= 50, "{o}");
    assert!(c["method"].as_str().unwrap().starts_with("regression"));
    assert!(c["cross_check"]["tpot_ms"].is_object());

    // The arms are named the other way round on request.
    let swapped: serde_json::Value = serde_json::from_slice(
        &fetch(admin, "GET", "/compare?a=slow&b=fast", b"")
            .await
            .body,
    )
    .unwrap();
    assert_eq!(swapped["metrics"]["tpot_ms"]["better"], "fast");
    assert!(swapped["metrics"]["tpot_ms"]["diff_pct"].as_f64().unwrap() < 0.0);

    // /stats carries each upstream's route and weight.
    let s = stats(&tap).await;
    assert_eq!(s["upstreams"][1]["arms"][0]["weight"], 50);
    assert_eq!(s["upstreams"][1]["arms"][0]["share_pct"], 50.0);

    let ghost = fetch(admin, "GET", "/compare?a=ghost&b=fast", b"").await;
    assert_eq!(ghost.status, 404);
    let e: serde_json::Value = serde_json::from_slice(&ghost.body).unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains("ghost"));
    // An upstream against itself is a mistake, not "not enough data".
    let same = fetch(admin, "GET", "/compare?a=fast&b=fast", b"").await;
    assert_eq!(same.status, 400);
    let e: serde_json::Value = serde_json::from_slice(&same.body).unwrap();
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("same upstream"), "{message}");

    assert_eq!(
        fetch(admin, "POST", "/compare/reset", b"").await.status,
        200
    );
    let after: serde_json::Value =
        serde_json::from_slice(&fetch(admin, "GET", "/compare", b"").await.body).unwrap();
    assert_eq!(after["metrics"]["tpot_ms"]["significant"], false);
    assert!(after["verdict"]
        .as_str()
        .unwrap()
        .starts_with("not enough data"));
}
