//! Usage injection end to end: a client that did not ask for usage gets none and the same
//! content; the proxy's counts are exact either way; a client that asked keeps its chunk.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use common::*;
use tokentap::sim::{Sim, SimArgs};

/// The data of each event, with the per-response id and timestamp blanked.
fn events(body: &[u8]) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    tokentap::sse::SseParser::new(1 << 20).push(body, |e| {
        let mut v: serde_json::Value = serde_json::from_slice(e.data)
            .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(e.data).into()));
        if let Some(o) = v.as_object_mut() {
            o.remove("id");
            o.remove("created");
        }
        out.push(v);
    });
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_usage_is_counted_and_hidden() {
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: "1:2".parse().unwrap(),
        ttft_ms: 1.0,
        ..SimArgs::defaults()
    })
    .await
    .unwrap();
    let tap = proxy(&[("sim", sim.addr)], "inject_usage = true\n").await;
    let path = "/v1/chat/completions";
    let plain = br#"{"model":"m","stream":true,"max_tokens":17,"messages":[]}"#;

    let direct = fetch(sim.addr, "POST", path, plain).await;
    let via = fetch(proxy_addr(&tap), "POST", path, plain).await;
    let (d, v) = (events(&direct.body), events(&via.body));
    assert!(
        d.iter().all(|e| e.get("usage").is_none()),
        "the sim sends no usage unasked"
    );
    assert_eq!(
        v, d,
        "the client sees what it would have seen without the proxy"
    );

    let asked = br#"{"model":"m","stream":true,"max_tokens":17,"stream_options":{"include_usage":true},"messages":[]}"#;
    let via = fetch(proxy_addr(&tap), "POST", path, asked).await;
    let usage: Vec<_> = events(&via.body)
        .into_iter()
        .filter(|e| e["usage"].is_object())
        .collect();
    assert_eq!(usage.len(), 1, "a client that asked keeps its usage chunk");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 17);

    let non_streaming = br#"{"model":"m","stream":false,"max_tokens":5,"messages":[]}"#;
    let whole = fetch(proxy_addr(&tap), "POST", path, non_streaming).await;
    let v: serde_json::Value = serde_json::from_slice(&whole.body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5);

    let s = stats_when(&tap, |u| u["requests_total"] == 3).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["output_tokens_total"], 17 + 17 + 5);
    assert_eq!(u["counts_exact"], true, "{u:#}");
    assert_eq!(u["estimated_output_tokens_total"], 0);
}

/// A long prompt (200 KB, past the 64 KiB read ahead), with a length or chunked: read
/// whole, usage asked for in it (the client's bytes otherwise as they came), counted
/// exactly, and the usage chunk kept from the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_is_counted_exactly_too() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sim = sim("1:2").ttft(1.0).await;
    let tap = proxy(&[("sim", sim.addr)], "inject_usage = true\n").await;
    let path = "/v1/chat/completions";
    let prompt = "a long prompt ".repeat(200_000 / 14);
    let body = format!(
        r#"{{"model":"m","stream":true,"max_tokens":9,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    );
    let via = fetch(proxy_addr(&tap), "POST", path, body.as_bytes()).await;
    assert_eq!(via.status, 200);
    assert!(events(&via.body).iter().all(|e| e.get("usage").is_none()));
    // Chunked, in 16 KiB chunks written one by one.
    let mut conn = tokio::net::TcpStream::connect(proxy_addr(&tap))
        .await
        .unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    for piece in body.as_bytes().chunks(16 << 10) {
        let mut chunk = format!("{:x}\r\n", piece.len()).into_bytes();
        chunk.extend_from_slice(piece);
        chunk.extend_from_slice(b"\r\n");
        conn.write_all(&chunk).await.unwrap();
    }
    conn.write_all(b"0\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(
        text.contains("[DONE]") && !text.contains("\"usage\":{"),
        "{text}"
    );

    let s = stats_when(&tap, |u| u["requests_total"] == 2).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["output_tokens_total"], 18, "{u:#}");
    assert_eq!(u["counts_exact"], true, "{u:#}");
    assert_eq!(u["estimated_output_tokens_total"], 0);
    assert!(
        u["input_tokens_total"].as_u64().unwrap() > 2 * 40_000,
        "{u:#}"
    );
}

/// Cached prompt tokens, as the backend reports them, per upstream and per endpoint: none
/// reported, no hit rate (never a guess); reported, the window's hit rate is the cached
/// share of the prompt tokens of the requests that said.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_prompt_tokens_are_metered_as_reported() {
    let mut with_cache = chat_events(4, false);
    let done = with_cache.pop().unwrap();
    with_cache.push(
        br#"data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":1000,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":800}}}

"#
        .to_vec(),
    );
    with_cache.push(done);
    let chunked = |events: Vec<Vec<u8>>| Reply::Chunked {
        status: 200,
        content_type: "text/event-stream",
        pieces: events,
        gap: std::time::Duration::ZERO,
        ending: Ending::Clean,
    };
    let backend = mock(vec![
        ("/v1/chat/completions", chunked(with_cache)),
        ("/v1/completions", chunked(chat_events(4, true))),
    ])
    .await;
    let tap = proxy(&[("b", backend.addr)], "").await;
    let body = br#"{"model":"m","stream":true,"messages":[]}"#;
    // Without a reported count: the prompt counted, no hit rate.
    fetch(proxy_addr(&tap), "POST", "/v1/completions", body).await;
    let s = stats_when(&tap, |u| u["requests_total"] == 1).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["input_tokens_total"], 3, "{u:#}");
    assert_eq!(u["cached_input_tokens_total"], 0, "{u:#}");
    assert_eq!(u["cache_hit_rate_pct"], serde_json::Value::Null, "{u:#}");
    // Three with 800 of 1,000 prompt tokens cached.
    for _ in 0..3 {
        fetch(proxy_addr(&tap), "POST", "/v1/chat/completions", body).await;
    }
    let s = stats_when(&tap, |u| u["requests_total"] == 4).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["input_tokens_total"], 3003, "{u:#}");
    assert_eq!(u["cached_input_tokens_total"], 2400, "{u:#}");
    assert_eq!(u["cache_hit_rate_pct"], 80.0, "{u:#}");
    let e = &u["endpoints"][0];
    assert_eq!(
        (&e["input_tokens_total"], &e["cached_input_tokens_total"]),
        (&3003.into(), &2400.into()),
        "{e:#}"
    );
    let admin = tap.shared().config.listen.admin;
    let metrics = String::from_utf8(fetch(admin, "GET", "/metrics", b"").await.body).unwrap();
    assert!(
        metrics.contains("tokentap_cached_input_tokens_total{upstream=\"b\"} 2400"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("input_tokens"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The simulator's prefix cache through tokentap, in two dialects: one system prompt of
/// ~1,000 tokens shared by every request; tokentap's cached tokens are the simulator's own
/// count, its hit rate theirs; a hit's TTFT is a miss's without the prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_s_prefix_cache_is_metered_as_it_reports_it() {
    use tokentap::sim::SimDialect;
    let system = "You are a careful assistant. ".repeat(140); // 4,060 bytes
    for (dialect, path) in [
        (SimDialect::Openai, "/v1/chat/completions"),
        (SimDialect::Anthropic, "/v1/messages"),
    ] {
        let backend = sim("1:2")
            .ttft(1.0)
            .max_tokens(4)
            .dialect(dialect)
            .prefix_cache(100_000, 0.05)
            .await;
        let tap = proxy(&[("b", backend.addr)], "").await;
        let mut ttfts = Vec::new();
        for i in 0..10 {
            let body = match dialect {
                SimDialect::Anthropic => format!(
                    r#"{{"model":"m","stream":true,"max_tokens":4,"system":"{system}","messages":[{{"role":"user","content":"question {i}"}}]}}"#
                ),
                _ => format!(
                    r#"{{"model":"m","stream":true,"max_tokens":4,"stream_options":{{"include_usage":true}},"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"question {i}"}}]}}"#
                ),
            };
            let start = std::time::Instant::now();
            let r = fetch(proxy_addr(&tap), "POST", path, body.as_bytes()).await;
            assert_eq!(r.status, 200);
            ttfts.push(r.frames.first().map(|f| f.0.duration_since(start.into())));
        }
        let s = stats_when(&tap, |u| u["requests_total"] == 10).await;
        let u = &s["upstreams"][0];
        let own = backend.engine.stats();
        assert_eq!(
            u["input_tokens_total"], own.prompt_tokens,
            "{dialect:?}: {u:#}"
        );
        assert_eq!(
            u["cached_input_tokens_total"], own.cached_prompt_tokens,
            "{dialect:?}: {u:#}"
        );
        let hit = u["cache_hit_rate_pct"].as_f64().unwrap();
        let theirs = 100.0 * own.cached_prompt_tokens as f64 / own.prompt_tokens as f64;
        assert!(
            (hit - theirs).abs() < 1e-9 && hit > 80.0,
            "{dialect:?}: {hit} {theirs}"
        );
        eprintln!("{dialect:?}: hit rate {hit:.1}%; time to the first bytes {ttfts:?}");
    }
}
