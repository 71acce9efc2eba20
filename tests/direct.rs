//! The direct streaming path (`server.direct_streaming`): what the upstream receives, a
//! pooled connection the upstream had closed, the read timeout, and the same bytes as
//! pingora-proxy's path.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const BODY: &[u8] = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

/// A backend that hands every request head it reads to the test and answers with a short
/// chat stream. With `once`, a connection serves one request, then closes on the next
/// without answering: a keep-alive connection the server dropped while it sat in the pool.
struct Backend {
    addr: std::net::SocketAddr,
    heads: mpsc::UnboundedReceiver<String>,
    connections: Arc<AtomicU64>,
}

async fn backend(once: bool) -> Backend {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, heads) = mpsc::unbounded_channel();
    let connections = Arc::new(AtomicU64::new(0));
    let conns = Arc::clone(&connections);
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            conns.fetch_add(1, SeqCst);
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut served = 0;
                while let Some(head) = read_head_and_body(&mut s).await {
                    if once && served == 1 {
                        return; // closes without an answer
                    }
                    tx.send(head).unwrap();
                    let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
                    for e in chat_events(3, true) {
                        out.extend_from_slice(format!("{:x}\r\n", e.len()).as_bytes());
                        out.extend_from_slice(&e);
                        out.extend_from_slice(b"\r\n");
                    }
                    out.extend_from_slice(b"0\r\n\r\n");
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                    served += 1;
                }
            });
        }
    });
    Backend {
        addr,
        heads,
        connections,
    }
}

/// Reads a request head and its `Content-Length` body; returns the head.
async fn read_head_and_body(s: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i + 4]).to_string();
            let len: usize = head
                .to_ascii_lowercase()
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < i + 4 + len {
                let n = s.read(&mut tmp).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&tmp[..n]);
            }
            return Some(head);
        }
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then_some(v.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_fields_stay_behind() {
    let mut b = backend(false).await;
    let running = proxy(&[("up", b.addr)], "").await;
    let mut s = TcpStream::connect(proxy_addr(&running)).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: example.test\r\ncontent-type: application/json\r\n\
         authorization: Bearer k\r\nx-keep: 1\r\nconnection: keep-alive, x-hop\r\nx-hop: secret\r\n\
         keep-alive: timeout=5\r\nte: trailers\r\nproxy-authorization: Basic x\r\ntrailer: x-t\r\n\
         content-length: {}\r\n\r\n",
        BODY.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s.write_all(BODY).await.unwrap();
    let head = b.heads.recv().await.unwrap();
    for gone in [
        "x-hop",
        "keep-alive",
        "te",
        "proxy-authorization",
        "trailer",
        "transfer-encoding",
    ] {
        assert_eq!(header(&head, gone), None, "{gone} was forwarded:\n{head}");
    }
    assert_eq!(header(&head, "authorization"), Some("Bearer k"));
    assert_eq!(header(&head, "x-keep"), Some("1"));
    assert_eq!(header(&head, "host"), Some(b.addr.to_string().as_str()));
    assert_eq!(
        header(&head, "content-length"),
        Some(BODY.len().to_string().as_str())
    );
    assert!(
        head.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
        "{head}"
    );

    // The client gets the whole stream, chunked, and the connection stays usable.
    let mut got = Vec::new();
    let mut tmp = [0u8; 4096];
    while !got.ends_with(b"0\r\n\r\n") {
        let n = s.read(&mut tmp).await.unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&tmp[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("x-tokentap-upstream: up"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_the_upstream_closed_is_retried() {
    let b = backend(true).await;
    let running = proxy(&[("up", b.addr)], "").await;
    for _ in 0..3 {
        let r = fetch(proxy_addr(&running), "POST", "/v1/chat/completions", BODY).await;
        assert_eq!(r.status, 200);
        assert!(!r.error);
        assert!(String::from_utf8_lossy(&r.body).contains("data: [DONE]"));
    }
    // Each request after the first found its pooled connection dead and opened another.
    assert_eq!(b.connections.load(SeqCst), 3);
    let st = stats_when(&running, |u| u["requests_total"] == 3).await;
    assert_eq!(st["upstreams"][0]["requests_by_status"]["ok"], 3, "{st}");
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_paths_forward_the_same_bytes() {
    let mut seen = Vec::new();
    for extra in ["", "[server]\ndirect_streaming = false\n"] {
        let b = backend(false).await;
        let running = proxy(&[("up", b.addr)], extra).await;
        let r = fetch(proxy_addr(&running), "POST", "/v1/chat/completions", BODY).await;
        assert_eq!(r.status, 200);
        let st = stats_when(&running, |u| u["requests_total"] == 1).await;
        assert_eq!(st["upstreams"][0]["output_tokens_total"], 3, "{st}");
        let headers: Vec<(String, String)> = r
            .headers
            .iter()
            .filter(|(n, _)| *n != http::header::DATE)
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        seen.push((r.body, headers));
        running.stop();
    }
    assert_eq!(seen[0], seen[1]);
}

/// `pieces` of a chat stream sent `gap` apart by a backend behind a proxy whose upstream read
/// timeout is 1 s; returns what the client got and how long it took.
async fn paced(pieces: Vec<Vec<u8>>, gap: Duration) -> (Resp, Duration, serde_json::Value) {
    let backend = mock(vec![(
        "/v1/chat/completions",
        Reply::Chunked {
            status: 200,
            content_type: "text/event-stream",
            pieces,
            gap,
            ending: Ending::Clean,
        },
    )])
    .await;
    // Appended to the (only) upstream's table.
    let running = proxy(&[("up", backend.addr)], "read_timeout_secs = 1\n").await;
    let start = Instant::now();
    let r = fetch(proxy_addr(&running), "POST", "/v1/chat/completions", BODY).await;
    let took = start.elapsed();
    let st = stats_when(&running, |u| u["requests_total"] == 1).await;
    running.stop();
    (r, took, st["upstreams"][0].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_silent_past_the_read_timeout_is_cut() {
    let (r, took, up) = paced(chat_events(2, false), Duration::from_secs(30)).await;
    assert_eq!(r.status, 200);
    assert!(r.error, "the body should end in an error, not complete");
    assert!(String::from_utf8_lossy(&r.body).contains("assistant"));
    assert!(took >= Duration::from_millis(900), "cut after {took:?}");
    assert_eq!(up["requests_by_status"]["upstream_error"], 1, "{up}");
    assert_eq!(up["in_flight"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_read_timeout_with_shorter_gaps_completes() {
    // 1.35 s in all (four pieces 450 ms apart), never silent for 1 s.
    let (r, _, up) = paced(chat_events(2, false), Duration::from_millis(450)).await;
    assert_eq!(r.status, 200);
    assert!(!r.error);
    assert!(String::from_utf8_lossy(&r.body).contains("[DONE]"));
    assert_eq!(up["requests_by_status"]["ok"], 1, "{up}");
}
