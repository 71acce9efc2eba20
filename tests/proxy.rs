//! The core's must-shows, end to end through an in-process tokentap on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::time::Duration;

use common::*;
use tokentap::sim::{Sim, SimArgs};

const CHAT: &str = "/v1/chat/completions";

fn sse(pieces: Vec<Vec<u8>>, gap_ms: u64) -> Reply {
    Reply::Chunked {
        status: 200,
        content_type: "text/event-stream",
        pieces,
        gap: Duration::from_millis(gap_ms),
        ending: Ending::Clean,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_forwarded_byte_for_byte() {
    let json_body = br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#.to_vec();
    let completions: Vec<Vec<u8>> = (0..5)
        .map(|i| format!("data: {{\"choices\":[{{\"index\":0,\"text\":\"w{i}\",\"finish_reason\":null}}]}}\r\n\r\n").into_bytes())
        .chain([b"data: [DONE]\r\n\r\n".to_vec()])
        .collect();
    // Split one event across two chunks, inside a UTF-8 sequence.
    let mut split = chat_events(3, false);
    let e = split.remove(1);
    let cut = e.iter().position(|&b| b == 0xC3).unwrap() + 1;
    split.insert(1, e[cut..].to_vec());
    split.insert(1, e[..cut].to_vec());
    let backend = mock(vec![
        ("/v1/chat/completions", sse(chat_events(20, true), 0)),
        (
            "/v1/chat/completions?nousage",
            sse(chat_events(20, false), 0),
        ),
        ("/v1/chat/completions?split", sse(split, 1)),
        ("/v1/completions", sse(completions, 0)),
        (
            "/v1/chat/completions?whole",
            Reply::Whole {
                status: 200,
                content_type: "application/json",
                body: json_body,
            },
        ),
        (
            "/v1/models",
            Reply::Whole {
                status: 200,
                content_type: "application/json",
                body: br#"{"object":"list","data":[]}"#.to_vec(),
            },
        ),
        (
            "/v1/chat/completions?429",
            Reply::Whole {
                status: 429,
                content_type: "application/json",
                body: br#"{"error":{"message":"slow down"}}"#.to_vec(),
            },
        ),
        (
            "/v1/chat/completions?500",
            Reply::Whole {
                status: 500,
                content_type: "text/plain",
                body: b"boom".to_vec(),
            },
        ),
        (
            "/v1/chat/completions?malformed",
            Reply::Whole {
                status: 400,
                content_type: "application/json",
                body: br#"{"error":{"message":"body is not JSON"}}"#.to_vec(),
            },
        ),
    ])
    .await;
    let tap = proxy(&[("mock", backend.addr)], "").await;
    let cases: &[(&str, &str, &[u8])] = &[
        (
            "POST",
            "/v1/chat/completions",
            br#"{"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
        (
            "POST",
            "/v1/chat/completions?nousage",
            br#"{"stream":true}"#,
        ),
        ("POST", "/v1/chat/completions?split", br#"{"stream":true}"#),
        (
            "POST",
            "/v1/completions",
            br#"{"stream":true,"prompt":"x"}"#,
        ),
        ("POST", "/v1/chat/completions?whole", br#"{"stream":false}"#),
        ("GET", "/v1/models", b""),
        ("POST", "/v1/chat/completions?429", b"{}"),
        ("POST", "/v1/chat/completions?500", b"{}"),
        ("POST", "/v1/chat/completions?malformed", b"{not json"),
    ];
    for &(method, path, body) in cases {
        let direct = fetch(backend.addr, method, path, body).await;
        let via = fetch(proxy_addr(&tap), method, path, body).await;
        assert_eq!(via.status, direct.status, "{path}");
        assert_eq!(via.body, direct.body, "{path}: body differs");
        assert_eq!(
            via.headers
                .get("x-tokentap-upstream")
                .map(|v| v.to_str().unwrap()),
            Some("mock"),
            "{path}"
        );
    }
    let s = stats_when(&tap, |u| u["requests_total"] == 9).await;
    let u = &s["upstreams"][0];
    // 20 (exact) + 20 + 3 + 5 (estimated) + 7 (non-streaming usage).
    assert_eq!(u["output_tokens_total"], 55, "{u:#}");
    assert_eq!(u["counts_exact"], false);
    assert_eq!(u["requests_by_status"]["ok"], 6, "{u:#}");
    assert_eq!(u["requests_by_status"]["4xx"], 2);
    assert_eq!(u["requests_by_status"]["5xx"], 1);
    assert_eq!(u["errors_total"], 1);
    assert_eq!(u["in_flight"], 0);
    assert_eq!(u["unparsed_events_total"], 0);
    assert_eq!(u["estimated_output_tokens_total"], 28);
    assert_eq!(u["tokens_per_event"]["max"], 1);
    let metrics = fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8(metrics.body).unwrap();
    for name in [
        "tokentap_requests_total{upstream=\"mock\",status=\"ok\"} 6",
        "tokentap_output_tokens_total{upstream=\"mock\"} 55",
        "tokentap_estimated_output_tokens_total{upstream=\"mock\"} 28",
        "tokentap_build_info{version=\"",
        "tokentap_e2e_seconds_bucket{upstream=\"mock\"",
        "tokentap_tokens_per_event_bucket{upstream=\"mock\",le=\"1\"}",
        "tokentap_in_flight_requests{upstream=\"mock\"} 0",
        "tokentap_system_tokens_per_second{upstream=\"mock\"}",
        "tokentap_single_stream_tokens_per_second{upstream=\"mock\"}",
        "tokentap_ttft_seconds_bucket{upstream=\"mock\"",
        "tokentap_tpot_seconds_bucket{upstream=\"mock\"",
        "tokentap_itl_seconds_bucket{upstream=\"mock\"",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
    // No cap, no NaN: a figure without a value is left out; so is a curve bucket without
    // the support of a point (these few gaps; tests/curve.rs has one with it).
    assert!(!text.contains("NaN"), "{text}");
    assert!(!text.contains("tokentap_curve_tokens_total{"), "{text}");
    assert!(!text.contains("tokentap_concurrency_limit{"), "{text}");
    let health = fetch(tap.shared().config.listen.admin, "GET", "/healthz", b"").await;
    assert_eq!(health.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragments_arrive_as_they_are_sent() {
    let backend = mock(vec![(CHAT, sse(chat_events(6, false), 50))]).await;
    let tap = proxy(&[("mock", backend.addr)], "").await;
    let resp = fetch(proxy_addr(&tap), "POST", CHAT, br#"{"stream":true}"#).await;
    let times: Vec<_> = resp.frames.iter().map(|(t, _)| *t).collect();
    assert!(
        times.len() >= 8,
        "one fragment per event, got {}",
        times.len()
    );
    // Nine writes 50 ms apart: had the proxy buffered, they would arrive in one lump.
    let spread = *times.last().unwrap() - times[0];
    assert!(spread >= Duration::from_millis(300), "spread {spread:?}");
    let gaps_over_25ms = times
        .windows(2)
        .filter(|w| w[1] - w[0] >= Duration::from_millis(25))
        .count();
    assert!(
        gaps_over_25ms >= 7,
        "fragments were lumped: {:?}",
        times.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_match_a_backend_of_known_rate() {
    // 8 streams decoding together at a flat 20 ms per token: 50 T/s each, 400 T/s in all.
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: "1:20".parse().unwrap(),
        ttft_ms: 30.0,
        ..SimArgs::defaults()
    })
    .await
    .unwrap();
    let tap = proxy(&[("sim", sim.addr)], "[metrics]\nwindow_secs = 2\n").await;
    let addr = proxy_addr(&tap);
    let body = br#"{"stream":true,"max_tokens":200,"stream_options":{"include_usage":true}}"#;
    let clients: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { fetch(addr, "POST", CHAT, body).await }))
        .collect();
    // Read /stats mid-stream, once the window holds only steady decoding (≥ 2.4 s in).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while sim.engine.stats().tokens < 8 * 125 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the simulator stalled"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let s = stats(&tap).await;
    let u = &s["upstreams"][0];
    let close =
        |v: &serde_json::Value, want: f64| (v.as_f64().unwrap() - want).abs() <= 0.02 * want;
    assert!(
        close(&u["system_tps"], 400.0),
        "system_tps {}",
        u["system_tps"]
    );
    assert!(
        close(&u["single_stream_tps"], 50.0),
        "single_stream_tps {}",
        u["single_stream_tps"]
    );
    assert!(
        close(&u["tpot_ms"]["p50"], 20.0),
        "tpot p50 {}",
        u["tpot_ms"]["p50"]
    );
    assert!(
        close(&u["concurrency"], 8.0),
        "concurrency {}",
        u["concurrency"]
    );
    assert_eq!(u["in_flight"], 8);
    for c in clients {
        assert_eq!(c.await.unwrap().status, 200);
    }
    let s = stats_when(&tap, |u| u["requests_total"] == 8).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["output_tokens_total"], 8 * 200, "exact totals from usage");
    assert_eq!(u["counts_exact"], true);
    assert_eq!(u["in_flight"], 0);
    let curve = u["curve"].as_array().unwrap();
    let b8 = curve
        .iter()
        .find(|p| p["concurrency"] == 8)
        .expect("bucket 8");
    assert!(close(&b8["tpot_ms_p50"], 20.0), "{b8}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_aborts_the_upstream_and_frees_the_slot() {
    let sim = Sim::start(SimArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        tpot_curve: "1:10".parse().unwrap(),
        max_tokens: 10_000,
        ..SimArgs::defaults()
    })
    .await
    .unwrap();
    let tap = proxy(&[("sim", sim.addr)], "").await;
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(proxy_addr(&tap))
            .await
            .unwrap();
        let body = br#"{"stream":true}"#;
        let req = format!("POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len());
        s.write_all(req.as_bytes()).await.unwrap();
        s.write_all(body).await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while got.windows(5).filter(|w| w == b"data:").count() < 5 {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
    } // dropped mid-stream
    let s = stats_when(&tap, |u| u["requests_by_status"]["aborted"] == 1).await;
    assert_eq!(s["upstreams"][0]["in_flight"], 0);
    assert_eq!(
        s["upstreams"][0]["errors_total"], 0,
        "a client leaving is not the backend's error"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sim.engine.stats().aborted < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the backend never saw the abort"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sim.engine.stats().decoding, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset_and_garbage_pass_through_and_count_as_errors() {
    let events = chat_events(10, false);
    let sent: Vec<u8> = events[..4].concat();
    let garbage: Vec<u8> = (0..2000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let backend = mock(vec![
        (
            "/v1/chat/completions?reset",
            Reply::Chunked {
                status: 200,
                content_type: "text/event-stream",
                pieces: events[..4].to_vec(),
                gap: Duration::from_millis(5),
                ending: Ending::Reset,
            },
        ),
        (
            "/v1/chat/completions?garbage",
            Reply::Whole {
                status: 200,
                content_type: "text/event-stream",
                body: garbage.clone(),
            },
        ),
        (
            "/v1/chat/completions?badjson",
            sse(
                vec![
                    b"data: {\"choices\":[{\"delta\":{\"content\":\"x\n\n".to_vec(),
                    b"data: [DONE]\n\n".to_vec(),
                ],
                0,
            ),
        ),
    ])
    .await;
    let tap = proxy(&[("mock", backend.addr)], "").await;
    let reset = fetch(
        proxy_addr(&tap),
        "POST",
        "/v1/chat/completions?reset",
        b"{}",
    )
    .await;
    assert_eq!(reset.status, 200);
    assert_eq!(reset.body, sent, "the client gets what the upstream sent");
    assert!(
        reset.error,
        "then the connection ends in an error, not a clean end"
    );
    let g = fetch(
        proxy_addr(&tap),
        "POST",
        "/v1/chat/completions?garbage",
        b"{}",
    )
    .await;
    assert_eq!(g.body, garbage);
    let b = fetch(
        proxy_addr(&tap),
        "POST",
        "/v1/chat/completions?badjson",
        b"{}",
    )
    .await;
    assert_eq!(b.status, 200);
    let s = stats_when(&tap, |u| u["requests_total"] == 3).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["in_flight"], 0);
    assert_eq!(u["requests_by_status"]["upstream_error"], 1, "{u:#}");
    assert_eq!(
        u["requests_by_status"]["truncated"], 1,
        "garbage never reaches a terminal event: {u:#}"
    );
    assert_eq!(u["errors_total"], 2);
    assert_eq!(u["unparsed_events_total"], 1, "the broken JSON event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_is_a_502_and_an_error() {
    let dead = free_addr();
    let tap = proxy(&[("dead", dead)], "").await;
    let r = fetch(proxy_addr(&tap), "POST", CHAT, br#"{"stream":true}"#).await;
    assert_eq!(r.status, 502);
    let s = stats_when(&tap, |u| u["requests_total"] == 1).await;
    assert_eq!(s["upstreams"][0]["requests_by_status"]["upstream_error"], 1);
    assert_eq!(s["upstreams"][0]["in_flight"], 0);
}
