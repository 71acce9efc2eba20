//! Ways round metering, caps and budgets, each closed (issue 63): a path the backend decodes
//! (`/v1/chat/%63ompletions`, `//v1/…`, `/v1/./…`), a compressed reply, a `max_tokens` after
//! a long prompt, a client naming itself as tokentap names its folds. Each against a
//! backend that behaves as the real ones do: it routes the decoded path (as uvicorn does),
//! compresses when asked (or always), reports its usage.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// The paths a decoding backend serves as its chat completions.
const CHAT_PATHS: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/chat/%63ompletions",
    "//v1/chat/completions",
    "/v1/./chat/completions",
    "/v1/x/../chat/%63%6F%6D%70%6C%65%74%69%6F%6E%73/",
];

/// How the backend answers `Accept-Encoding: gzip`.
#[derive(Clone, Copy, PartialEq)]
enum Coding {
    /// Compresses when the request asks for gzip (as most servers behind a gzip
    /// middleware do).
    WhenAsked,
    /// Compresses whatever was asked.
    Always,
}

/// A backend that routes every path of [`CHAT_PATHS`] to a chat stream of `tokens` tokens
/// with usage, `gap` between events; counts its requests, the most at once, and the
/// `Accept-Encoding` each asked with.
struct Backend {
    addr: SocketAddr,
    requests: Arc<AtomicU64>,
    peak: Arc<AtomicU64>,
    encodings: Arc<Mutex<Vec<String>>>,
}

async fn backend(tokens: usize, gap: Duration, coding: Coding) -> Backend {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicU64::new(0));
    let peak = Arc::new(AtomicU64::new(0));
    let now = Arc::new(AtomicU64::new(0));
    let encodings = Arc::new(Mutex::new(Vec::new()));
    let (rq, pk, enc) = (
        Arc::clone(&requests),
        Arc::clone(&peak),
        Arc::clone(&encodings),
    );
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let (rq, pk, now, enc) = (
                Arc::clone(&rq),
                Arc::clone(&pk),
                Arc::clone(&now),
                Arc::clone(&enc),
            );
            tokio::spawn(async move {
                while let Some(message) = read_message(&mut s).await {
                    let end = message.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
                    let head = String::from_utf8_lossy(&message[..end]).to_ascii_lowercase();
                    let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
                    let accept = (head.lines())
                        .find_map(|l| l.strip_prefix("accept-encoding:"))
                        .map_or(String::new(), |v| v.trim().to_owned());
                    enc.lock().unwrap().push(accept.clone());
                    if !CHAT_PATHS.iter().any(|p| p.eq_ignore_ascii_case(&path)) {
                        let _ = s
                            .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                            .await;
                        continue;
                    }
                    rq.fetch_add(1, SeqCst);
                    let at_once = now.fetch_add(1, SeqCst) + 1;
                    pk.fetch_max(at_once, SeqCst);
                    let gzip = coding == Coding::Always || accept.contains("gzip");
                    // Bytes no client could read as SSE unless it undid the coding: what a
                    // compressed stream is to a reader that does not.
                    let events: Vec<Vec<u8>> = if gzip {
                        (0..tokens + 2)
                            .map(|i| vec![0x1f, 0x8b, i as u8, 0xff])
                            .collect()
                    } else {
                        chat_events(tokens, true)
                    };
                    let coded = if gzip {
                        "content-encoding: gzip\r\n"
                    } else {
                        ""
                    };
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n{coded}transfer-encoding: chunked\r\n\r\n"
                    );
                    let mut ok = s.write_all(head.as_bytes()).await.is_ok();
                    for e in events {
                        if !ok {
                            break;
                        }
                        tokio::time::sleep(gap).await;
                        let mut chunk = format!("{:x}\r\n", e.len()).into_bytes();
                        chunk.extend_from_slice(&e);
                        chunk.extend_from_slice(b"\r\n");
                        ok = s.write_all(&chunk).await.is_ok();
                    }
                    ok = ok && s.write_all(b"0\r\n\r\n").await.is_ok();
                    now.fetch_sub(1, SeqCst);
                    if !ok {
                        return;
                    }
                }
            });
        }
    });
    Backend {
        addr,
        requests,
        peak,
        encodings,
    }
}

/// Sends `POST path` as written (no client library normalises it), with `headers`; the
/// status and the body.
async fn post(proxy: SocketAddr, path: &str, headers: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {proxy}\r\ncontent-type: application/json\r\n{headers}content-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let message = read_message(&mut s).await.unwrap();
    let end = message.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let status = String::from_utf8_lossy(&message[..end])
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    (status, message[end..].to_vec())
}

const BODY: &[u8] =
    br#"{"model":"m","stream":true,"max_tokens":30,"messages":[{"role":"user","content":"hi"}]}"#;

/// Every spelling of the chat path the backend decodes is metered as the plain one: its
/// tokens counted, its requests generation requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoded_path_is_metered_as_the_plain_one() {
    let b = backend(30, Duration::ZERO, Coding::WhenAsked).await;
    let tap = proxy(&[("u", b.addr)], "").await;
    for path in CHAT_PATHS {
        let (status, body) = post(proxy_addr(&tap), path, "", BODY).await;
        assert_eq!(status, 200, "{path}: {}", String::from_utf8_lossy(&body));
    }
    let n = CHAT_PATHS.len() as u64;
    let s = stats_when(&tap, |u| u["requests_total"] == n && u["in_flight"] == 0).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["output_tokens_total"], 30 * n, "{u:#}");
    assert_eq!(u["counts_exact"], true, "{u:#}");
}

/// A cap of 1 with a queue of 1: four requests at once to `/v1/chat/%63ompletions` get one
/// slot, one place in the queue and two 429s, and the backend never runs two at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoded_path_is_capped() {
    let b = backend(10, Duration::from_millis(50), Coding::WhenAsked).await;
    let tap = proxy(&[("u", b.addr)], "max_concurrency = 1\nmax_queue = 1\n").await;
    let at = proxy_addr(&tap);
    let sent: Vec<_> = (0..4)
        .map(|i| {
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20 * i)).await;
                post(at, CHAT_PATHS[1 + i as usize % 4], "", BODY).await.0
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in sent {
        statuses.push(t.await.unwrap());
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 200, 429, 429]);
    assert_eq!(b.peak.load(SeqCst), 1);
}

/// A tenant's budget of 100 output tokens a minute is spent whatever path its requests
/// take: of five 30-token requests (four by encoded paths), three are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_encoded_path_is_budgeted() {
    let b = backend(30, Duration::ZERO, Coding::WhenAsked).await;
    let tap = proxy(&[("u", b.addr)], BUDGET).await;
    let mut statuses = Vec::new();
    for path in CHAT_PATHS.iter().rev() {
        statuses.push(
            post(proxy_addr(&tap), path, "x-tenant: t\r\n", BODY)
                .await
                .0,
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    assert_eq!(b.requests.load(SeqCst), 3);
    // The budget's 429s are the upstream's 429s too.
    let s = stats(&tap).await;
    let u = &s["upstreams"][0];
    assert_eq!(u["rejected_total"], 2, "{u:#}");
    assert_eq!(u["rejected_by_reason"]["output_token_budget"], 2, "{u:#}");
    let metrics = fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.lines()
            .any(|l| l.starts_with("tokentap_rejected_requests_total{")
                && l.contains("reason=\"output_token_budget\"")
                && l.ends_with(" 2")),
        "{text}"
    );
}

const BUDGET: &str = "[tenants]\nkey = \"header:x-tenant\"\noutput_tokens_per_minute = 100\n";

/// A client that asks for gzip from a backend that compresses when asked: tokentap asks
/// the backend for `identity` on a metered request, so the stream is read and charged; a
/// 100-token budget admits three 30-token requests, not the backend's every reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_asking_for_gzip_is_charged_its_tokens() {
    let b = backend(30, Duration::ZERO, Coding::WhenAsked).await;
    let tap = proxy(&[("u", b.addr)], BUDGET).await;
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let headers = "x-tenant: t\r\naccept-encoding: gzip, br\r\n";
        let (status, _) = post(proxy_addr(&tap), CHAT_PATHS[0], headers, BODY).await;
        statuses.push(status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
    assert!(
        b.encodings.lock().unwrap().iter().all(|e| e == "identity"),
        "{:?}",
        b.encodings.lock().unwrap()
    );
    let s = stats_when(&tap, |u| u["in_flight"] == 0).await;
    assert_eq!(s["upstreams"][0]["output_tokens_total"], 90);
}

/// A backend that compresses whatever it is asked: the body cannot be read, so each
/// request keeps its reservation (30) rather than giving it all back; the budget still
/// holds at three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_body_keeps_its_reservation() {
    let b = backend(30, Duration::ZERO, Coding::Always).await;
    let tap = proxy(&[("u", b.addr)], BUDGET).await;
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let (status, _) = post(proxy_addr(&tap), CHAT_PATHS[0], "x-tenant: t\r\n", BODY).await;
        statuses.push(status);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
}

/// A 100 KB prompt with `max_tokens = 590` after it (SDKs write `messages` first), on a
/// budget of 600 a minute: the first request reserves its 590, so a second one beside it is
/// refused (reading only the first 64 KiB, each reserved the tenant's mean, 64, and both
/// ran).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_after_a_long_prompt_is_reserved() {
    let b = backend(20, Duration::from_millis(50), Coding::WhenAsked).await;
    let tap = proxy(
        &[("u", b.addr)],
        "[tenants]\nkey = \"header:x-tenant\"\noutput_tokens_per_minute = 600\n",
    )
    .await;
    let prompt = "word ".repeat(20_000);
    let body = format!(
        r#"{{"model":"m","stream":true,"messages":[{{"role":"user","content":"{prompt}"}}],"max_tokens":590}}"#
    );
    assert!(body.len() > 100_000);
    let at = proxy_addr(&tap);
    let first = {
        let body = body.clone();
        tokio::spawn(
            async move { post(at, CHAT_PATHS[0], "x-tenant: t\r\n", body.as_bytes()).await },
        )
    };
    // The second once the first is running at the backend.
    while b.requests.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (second, text) = post(at, CHAT_PATHS[0], "x-tenant: t\r\n", body.as_bytes()).await;
    assert_eq!(second, 429, "{}", String::from_utf8_lossy(&text));
    assert!(String::from_utf8_lossy(&text).contains("output_token_budget"));
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(b.requests.load(SeqCst), 1);
}

/// A client naming itself `other` (or `default`) is kept apart from the tenants `/metrics`
/// folds under `other`: one series of each name, none dropped by Prometheus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_named_other_is_kept_apart_from_the_fold() {
    let b = backend(5, Duration::ZERO, Coding::WhenAsked).await;
    let tap = proxy(
        &[("u", b.addr)],
        "[metrics]\ntenant_labels = 2\n[tenants]\nkey = \"header:x-tenant\"\n",
    )
    .await;
    // A client calling itself `other` the most (labelled), then `a` (labelled), then `c`
    // and one calling itself `default`, folded.
    for (tenant, n) in [("other", 4), ("a", 2), ("c", 1), ("default", 1)] {
        for _ in 0..n {
            let header = format!("x-tenant: {tenant}\r\n");
            assert_eq!(
                post(proxy_addr(&tap), CHAT_PATHS[0], &header, BODY).await.0,
                200
            );
        }
    }
    stats_when(&tap, |u| u["requests_total"] == 8 && u["in_flight"] == 0).await;
    let metrics = fetch(tap.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8_lossy(&metrics.body);
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("tokentap_tenant_requests_total{"))
        .collect();
    let names: Vec<&str> = series
        .iter()
        .map(|l| l.split('"').nth(1).unwrap())
        .collect();
    let mut unique = names.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "{series:#?}");
    assert!(
        names.contains(&"a") && names.contains(&"other"),
        "{series:#?}"
    );
    // The client named `other` is a tenant of its own (its name hashed), and the fold holds
    // the two past the labels.
    assert!(names.iter().any(|n| n.starts_with("key-")), "{series:#?}");
    let other = series.iter().find(|l| l.contains("\"other\"")).unwrap();
    assert!(other.ends_with(" 2"), "{series:#?}");
}
