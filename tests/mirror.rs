//! Shadow traffic (`route[].mirror`) through tokentap to simulated backends: the paired
//! verdict on the same prompts, a primary that never sees nor waits on its mirror (down,
//! hanging or slow), the mirror's own cap, exact counts and curve.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::time::Duration;

use common::{
    closed_loop, fetch, proxy, proxy_addr, sim, stats, stats_where, upstream_named as upstream,
    Closed,
};

/// A simulator on a runtime of its own thread (stopped when dropped): a mirror's backend
/// whose timers and work must not share the primary's simulator's runtime, or its copies
/// would delay the primary's tokens inside the test rather than in tokentap.
struct Apart {
    addr: SocketAddr,
    engine: std::sync::Arc<tokentap::sim::Engine>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Apart {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        let _ = self.thread.take().map(std::thread::JoinHandle::join);
    }
}

fn sim_apart(curve: &'static str, model: &'static str) -> Apart {
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let s = sim(curve).ttft(20.0).model(model).await;
            addr_tx.send((s.addr, s.engine.clone())).unwrap();
            let _ = stopped.await;
            drop(s);
        });
    });
    let (addr, engine) = addr_rx.recv().unwrap();
    Apart {
        addr,
        engine,
        stop: Some(stop),
        thread: Some(thread),
    }
}

/// A route to `a` that mirrors to `b` (`mirror` its table).
fn config(a: SocketAddr, b: SocketAddr, mirror: &str) -> String {
    format!(
        "[[upstream]]\nname = \"a\"\nurl = \"http://{a}\"\n\
         [[upstream]]\nname = \"b\"\nurl = \"http://{b}\"\n\
         [[route]]\nsplit = {{ a = 1 }}\nmirror = {{ upstream = \"b\", {mirror} }}\n"
    )
}

/// b 10% slower per token, mirrored at 20% of 32 clients' traffic: the paired verdict
/// names a, with a narrow CI around what the two backends did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_paired_verdict_names_the_faster_on_the_same_prompts() {
    // Latencies compared: alone on the machine.
    let _machine = common::whole_machine().await;
    // 50 and 55 ms a token, each simulator on a thread of its own: neither's steps wait on
    // the 32 clients' work nor on the other's.
    let (a, b) = (sim_apart("1:50", "a"), sim_apart("1:55", "b"));
    let tap = proxy(
        &[],
        &config(a.addr, b.addr, "percent = 20, max_in_flight = 64"),
    )
    .await;
    let r = closed_loop(proxy_addr(&tap), Closed::of(32, 12.0).with_usage()).await;
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let admin = tap.shared().config.listen.admin;
    let c = fetch(admin, "GET", "/compare?a=a&b=b", b"").await;
    assert_eq!(c.status, 200);
    let c: serde_json::Value = serde_json::from_slice(&c.body).unwrap();
    assert!(c["method"].as_str().unwrap().starts_with("paired"), "{c:#}");
    // What the backends did, as they sent it: 10% apart on a quiet machine, less where the
    // machine stalled both (a stall adds the same time to a stream on either).
    let sent = |s: &Apart| s.engine.stats().sent_tpot_ms_geomean.unwrap();
    let truth = 100.0 * (sent(&b) / sent(&a) - 1.0);
    let t = &c["metrics"]["tpot_ms"];
    let ci = t["ci95_pct"].as_array().unwrap();
    let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
    let d = t["diff_pct"].as_f64().unwrap();
    assert_eq!(t["better"], "a", "sent {truth:.2}%: {c:#}");
    // A pair cancels the prompt's and the moment's noise, so the CI is narrow (an unpaired
    // one spans several percent) and lies near what was sent. The proxy times each token
    // as it reads it: with 32 clients, two simulators and the proxy on two cores, its own
    // reading moved the judged ratio a point from the sent one in a run of the whole suite
    // (11.1%, CI 10.7–11.5%, against 9.97% sent; on a quiet machine within 0.1), which no
    // interval over the pairs can know of.
    assert!(
        (d - truth).abs() < 1.5 && lo > 5.0,
        "sent {truth:.2}%: {c:#}"
    );
    assert!(lo <= d && d <= hi && hi - lo < 3.0, "{c:#}");
    assert!(
        lo - 1.5 <= truth && truth <= hi + 1.5,
        "sent {truth:.2}%: {c:#}"
    );
    assert!(c["pairs"].as_u64().unwrap() >= 30, "{c:#}");
    // The copies ran at a fifth of a's load: moved to a's along b's own curve, and said so.
    assert_eq!(c["matching"], "b_curve", "{c:#}");
    assert!(
        c["verdict"]
            .as_str()
            .unwrap()
            .contains("along b's own curve"),
        "{c:#}"
    );
    // Each TTFT waited on its own side's arrivals: not moved past the loads b ran at.
    assert_eq!(c["extrapolated"], true, "{c:#}");
    assert_eq!(
        c["metrics"]["ttft_ms"]["ci95_pct"],
        serde_json::Value::Null,
        "{c:#}"
    );
    let verdict = c["verdict"].as_str().unwrap();
    let ttft = verdict.split("; ").find(|p| p.starts_with("TTFT: "));
    assert!(
        ttft.is_some_and(|p| p.ends_with("as they ran, not moved past the loads b ran at")),
        "{c:#}"
    );
    // The same prompt, so the same length.
    assert_eq!(c["length_differs_pct"], 0.0, "{c:#}");
    // b is a mirror, a fifth of a's requests, and so marked.
    let s = stats(&tap).await;
    let (ua, ub) = (upstream(&s, "a"), upstream(&s, "b"));
    assert_eq!(
        (ua["mirror"].as_bool(), ub["mirror"].as_bool()),
        (Some(false), Some(true))
    );
    let share = ub["requests_total"].as_f64().unwrap() / ua["requests_total"].as_f64().unwrap();
    assert!((0.1..0.3).contains(&share), "{share}: {s:#}");
    // Either way round, the primary is a.
    let back = fetch(admin, "GET", "/compare?a=b&b=a", b"").await;
    let back: serde_json::Value = serde_json::from_slice(&back.body).unwrap();
    assert_eq!(back["a"], "a");
}

/// A listener that accepts and never answers.
async fn hanging() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (addr, task)
}

/// With every request mirrored to a backend that is healthy, hangs, is down, or is slow,
/// the primary's clients see no error, none of the mirror's bytes, and the same TTFT and
/// TPOT as without a mirror (within 1 ms or 1%); copies over `max_in_flight` are skipped
/// and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_neither_sees_nor_waits_on_its_mirror() {
    // Latencies compared: alone on the machine.
    let _machine = common::whole_machine().await;
    let a = sim("1:10").ttft(20.0).model("primary-model").await;
    let slow = sim_apart("1:200", "mirror-model");
    let healthy = sim_apart("1:10", "mirror-model");
    let (hang, _hold) = hanging().await;
    let down = common::free_addr(); // nothing listens
                                    // Latencies are compared one client at a time: with several, the simulator's batch
                                    // steps make TTFT take a few values, and its median can land on either.
    let alone = proxy(&[("a", a.addr)], "").await;
    // Short answers (6 tokens, ~70 ms), so that each median is of some 40 requests.
    let one_client = Closed {
        max_tokens: 6,
        ..Closed::of(1, 3.0).with_usage()
    };
    let base = closed_loop(proxy_addr(&alone), one_client.clone()).await;
    assert!(base.errors.is_empty(), "{:?}", base.errors);
    let cases = [
        ("healthy", healthy.addr),
        ("hanging", hang),
        ("down", down),
        ("slow", slow.addr),
    ];
    for (what, b) in cases {
        let tap = proxy(&[], &config(a.addr, b, "max_in_flight = 4")).await;
        let busy = closed_loop(proxy_addr(&tap), Closed::of(8, 2.0).with_usage()).await;
        assert!(busy.errors.is_empty(), "{what}: {:?}", busy.errors);
        // Not slower with the mirror (faster by a millisecond was seen: the baseline's own
        // noise). The suite's light tests run beside this one, so a miss is measured again,
        // with and without the mirror back to back: a mirror that slows its primary does
        // so every time, a neighbour's burst once.
        let mut base = base.clone();
        let mut tries = Vec::new();
        let within = loop {
            let r = closed_loop(proxy_addr(&tap), one_client.clone()).await;
            assert!(r.errors.is_empty(), "{what}: {:?}", r.errors);
            let figures = [
                (
                    "TTFT p50",
                    base.ttft_ms.p50.unwrap(),
                    r.ttft_ms.p50.unwrap(),
                ),
                (
                    "TPOT p50",
                    base.tpot_ms.p50.unwrap(),
                    r.tpot_ms.p50.unwrap(),
                ),
            ];
            for (name, x, y) in figures {
                eprintln!("{what}: {name} {y:.2} ms with the mirror, {x:.2} without");
            }
            let within = (figures.iter()).all(|&(_, x, y)| y - x <= 1.0_f64.max(0.01 * x));
            tries.push(figures);
            if within || tries.len() == 3 {
                break within;
            }
            base = closed_loop(proxy_addr(&alone), one_client.clone()).await;
            assert!(base.errors.is_empty(), "{:?}", base.errors);
        };
        assert!(within, "{what}: with the mirror, without: {tries:?}");
        // Nothing of the mirror reaches a client.
        let body = br#"{"model":"m","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"hi"}]}"#;
        let resp = fetch(proxy_addr(&tap), "POST", "/v1/chat/completions", body).await;
        let text = String::from_utf8_lossy(&resp.body);
        assert!(
            text.contains("primary-model") && !text.contains("mirror-model"),
            "{text}"
        );
        assert_eq!(resp.headers["x-tokentap-upstream"], "a");
        let s = stats(&tap).await;
        let skipped = upstream(&s, "b")["shadow"]["skipped_total"]["max_in_flight"]
            .as_u64()
            .unwrap();
        // 8 clients against 4 copies at a time that hang or take seconds: the ones over are
        // skipped (a healthy mirror keeps up; a down one fails each copy at once).
        assert!(
            !matches!(what, "hanging" | "slow") || skipped > 0,
            "{what}: {s:#}"
        );
    }
}

/// The mirror's cap holds at its backend, its counts are exact (the usage the client asked
/// for comes to it too) and its curve is its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mirror_s_cap_holds_and_its_figures_are_its_own() {
    let _load = common::load_slot().await;
    let (a, b) = (
        sim("1:5").ttft(20.0).model("a").await,
        sim("1:5").ttft(20.0).model("b").await,
    );
    let tap = proxy(&[], &config(a.addr, b.addr, "max_in_flight = 3")).await;
    let r = closed_loop(proxy_addr(&tap), Closed::of(16, 3.0).with_usage()).await;
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let s = stats_where(&tap, |s| upstream(s, "b")["shadow"]["in_flight"] == 0).await;
    assert!(
        b.engine.stats().peak_batch <= 3,
        "{}",
        b.engine.stats().peak_batch
    );
    assert!(a.engine.stats().peak_batch >= 12);
    let ub = upstream(&s, "b");
    assert_eq!(ub["counts_exact"], true, "{ub:#}");
    assert!(
        ub["shadow"]["skipped_total"]["max_in_flight"]
            .as_u64()
            .unwrap()
            > 0
    );
    let curve = ub["curve"].as_array().unwrap();
    assert!(
        curve
            .iter()
            .all(|p| p["concurrency"].as_u64().unwrap() <= 4),
        "{curve:?}"
    );
    let metrics = fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8(metrics.body).unwrap();
    assert!(
        text.contains("tokentap_mirror_skipped_total{upstream=\"b\",reason=\"max_in_flight\"}"),
        "{text}"
    );
}

const CHAT: &str = "/v1/chat/completions";

fn chat(prompt: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "m", "stream": true, "max_tokens": 5,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": prompt}],
    })
    .to_string()
    .into_bytes()
}

/// `sticky`: a key is mirrored always or never; a long prompt is copied whole, one over
/// 8 MiB is not copied, and counted; a copy goes on when its primary's client leaves, unless
/// `cancel_with_client`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_is_sticky_long_bodies_are_counted_and_copies_outlive_their_clients() {
    let _load = common::load_slot().await;
    let (a, b) = (
        sim("1:2").ttft(20.0).model("a").await,
        sim("1:2").ttft(20.0).model("b").await,
    );
    let mirror = "percent = 50, sticky = \"header:x-user-id\"";
    let tap = proxy(&[], &config(a.addr, b.addr, mirror)).await;
    let p = proxy_addr(&tap);
    for key in 0..40 {
        for _ in 0..3 {
            let id = format!("user-{key}");
            let r = common::send(p, "POST", CHAT, &chat("hi"), &[("x-user-id", &id)])
                .await
                .unwrap();
            assert_eq!(r.status, 200);
        }
    }
    let s = stats_where(&tap, |s| upstream(s, "b")["shadow"]["in_flight"] == 0).await;
    let copies = upstream(&s, "b")["requests_total"].as_u64().unwrap();
    assert_eq!(copies % 3, 0, "each key all or nothing: {copies}");
    assert!((30..=90).contains(&copies), "about half the keys: {copies}");
    // A long prompt (900 KiB, past the 64 KiB read ahead) is read whole and copied, the
    // copy the same prompt; past 8 MiB it is sent on as it comes, not copied, and counted.
    let every = proxy(&[], &config(a.addr, b.addr, "max_in_flight = 4")).await;
    let prompts = |s: &tokentap::sim::Sim| s.engine.stats().prompt_tokens;
    let before = (prompts(&a), prompts(&b));
    let long = "x".repeat(900 << 10);
    let r = common::send(proxy_addr(&every), "POST", CHAT, &chat(&long), &[]).await;
    assert_eq!(r.unwrap().status, 200);
    stats_where(&every, |s| {
        upstream(s, "b")["requests_total"] == 1 && upstream(s, "b")["shadow"]["in_flight"] == 0
    })
    .await;
    let sent = (prompts(&a) - before.0, prompts(&b) - before.1);
    assert!(
        sent.0 > 200_000 && sent.0 == sent.1,
        "prompt tokens {sent:?}"
    );
    let longer = "x".repeat(9 << 20);
    let r = common::send(proxy_addr(&every), "POST", CHAT, &chat(&longer), &[]).await;
    assert_eq!(r.unwrap().status, 200);
    let s = stats_where(&every, |s| {
        upstream(s, "a")["in_flight"] == 0 && upstream(s, "a")["requests_total"] == 2
    })
    .await;
    let skipped = &upstream(&s, "b")["shadow"]["skipped_total"];
    assert_eq!(skipped["body_unread"], 1, "{skipped}");
    assert_eq!(upstream(&s, "b")["requests_total"], 1);

    // A client that leaves mid-stream: its copy runs to its end by default…
    let (slow_a, slow_b) = (
        sim("1:20").ttft(20.0).model("a").await,
        sim("1:20").ttft(20.0).model("b").await,
    );
    for (cancel, want) in [(false, "ok"), (true, "aborted")] {
        let extra = format!("cancel_with_client = {cancel}");
        let tap = proxy(&[], &config(slow_a.addr, slow_b.addr, &extra)).await;
        let p = proxy_addr(&tap);
        let mut conn = tokio::net::TcpStream::connect(p).await.unwrap();
        let body = String::from_utf8(chat("hi"))
            .unwrap()
            .replace("\"max_tokens\":5", "\"max_tokens\":30");
        let head = format!(
            "POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        conn.write_all(head.as_bytes()).await.unwrap();
        let mut first = [0u8; 512];
        let _ = conn.read(&mut first).await.unwrap();
        drop(conn); // gone after its first bytes
        let s = stats_where(&tap, |s| {
            let b = upstream(s, "b");
            b["requests_total"] == 1 && b["in_flight"] == 0
        })
        .await;
        let by = &upstream(&s, "b")["requests_by_status"];
        assert_eq!(by[want], 1, "cancel_with_client = {cancel}: {by}");
        assert_eq!(upstream(&s, "a")["requests_by_status"]["aborted"], 1);
    }
}

/// A copy goes the primary's way, with no client: it is counted by model and in the GenAI
/// histograms as its primary is, and an endpoint of the mirror that closes before its
/// response head is ejected as a primary's would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_is_metered_and_judged_as_a_primary_is() {
    let _load = common::load_slot().await;
    let a = sim("1:5").ttft(20.0).model("a").await;
    let good = sim("1:5").ttft(20.0).model("b").await;
    let closes = common::mock(vec![(
        "/v1/chat/completions",
        common::Reply::Raw {
            pieces: Vec::new(),
            gap: Duration::ZERO,
            close: true,
        },
    )])
    .await;
    let text = format!(
        "[metrics]\nmodel_label = true\nsemconv = true\n\
         [[upstream]]\nname = \"a\"\nurl = \"http://{}\"\n\
         [[upstream]]\nname = \"b\"\nendpoints = [\"http://{}\", \"http://{}\"]\n\
         balance = \"round_robin\"\n\
         [[route]]\nsplit = {{ a = 1 }}\nmirror = {{ upstream = \"b\" }}\n",
        a.addr, closes.addr, good.addr
    );
    let tap = proxy(&[], &text).await;
    let r = closed_loop(proxy_addr(&tap), Closed::of(2, 1.5).with_usage()).await;
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let s = stats_where(&tap, |s| upstream(s, "b")["shadow"]["in_flight"] == 0).await;
    let ub = upstream(&s, "b");
    let closing = format!("http://{}", closes.addr);
    let e = ub["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["address"] == closing.as_str())
        .unwrap();
    assert_eq!(e["ejections_total"], 1, "{e:#}");
    assert_eq!(e["healthy"], false, "{e:#}");
    assert!(
        e["last_error"]
            .as_str()
            .unwrap()
            .contains("before its response head"),
        "{e:#}"
    );
    let admin = tap.shared().config.listen.admin;
    let metrics = String::from_utf8(fetch(admin, "GET", "/metrics", b"").await.body).unwrap();
    let line = |prefix: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(prefix) && l.contains("\"b\""))
            .map(str::to_owned)
    };
    let models = line("tokentap_model_requests_total{");
    assert!(
        models.as_deref().is_some_and(|l| !l.ends_with(" 0")),
        "the copies by model: {models:?}"
    );
    let gen_ai = line("gen_ai_server_request_duration_seconds_count{");
    assert!(
        gen_ai
            .as_deref()
            .is_some_and(|l| l.contains("server_address=\"b\"")),
        "the copies' GenAI figures: {gen_ai:?}"
    );
}
