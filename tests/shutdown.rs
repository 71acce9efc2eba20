//! Shutdown as a container runtime asks for it, on the real binary: SIGTERM stops
//! accepting at once and exits as soon as nothing is in flight (within a second when idle),
//! lets a running stream finish within `server.grace_period_secs` and cuts what is still
//! open after it, exiting 0 either way; SIGINT exits at once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::time::Duration;

use common::process::{listen_section, Scratch, Tokentap};
use common::*;
use nix::sys::signal::Signal;
use tokentap::sim::Sim;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn start(dir: &Scratch, backend: &Sim, grace_secs: u64) -> Tokentap {
    let (listen, proxy, admin) = listen_section();
    let config = format!(
        "{listen}[server]\ngrace_period_secs = {grace_secs}\n[[upstream]]\nname = \"sim\"\nurl = \"http://{}\"\n",
        backend.addr
    );
    Tokentap::start(&dir.0, &config, proxy, admin, &[])
}

/// Sends a streaming chat request and waits for its first body bytes; the connection.
async fn streaming(proxy: std::net::SocketAddr) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before the stream began");
        got.extend_from_slice(&buf[..n]);
    }
    (s, got)
}

/// Reads the rest of a response until the connection closes (or 20 s pass): the text, and
/// whether the proxy closed it.
async fn rest(mut s: TcpStream, mut got: Vec<u8>) -> (String, bool) {
    let read = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut got)).await;
    (String::from_utf8_lossy(&got).into_owned(), read.is_ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_on_an_idle_proxy_exits_within_a_second() {
    let backend = sim(&format!("1:{0},64:{0}", 5.0)).max_tokens(4).await;
    let dir = Scratch::new("term-idle");
    let mut tap = start(&dir, &backend, 30);
    // An idle keep-alive client does not hold the exit back.
    let r = fetch(tap.proxy, "GET", "/v1/models", b"").await;
    assert_eq!(r.status, 200);
    let _idle = TcpStream::connect(tap.proxy).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    tap.signal(Signal::SIGTERM);
    let (status, took) = tap.wait_exit(Duration::from_secs(5)).expect("exits");
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(1), "took {took:?}");
    tap.log_line(&["SIGTERM", "draining"], Duration::from_secs(1));
    tap.log_line(&["drained"], Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_running_stream_finish_and_refuses_new_connections() {
    let backend = sim(&format!("1:{0},64:{0}", 20.0)).max_tokens(60).await; // ~1.2 s of tokens
    let dir = Scratch::new("term-stream");
    let mut tap = start(&dir, &backend, 30);
    let proxy = tap.proxy;
    let ready = fetch(tap.admin, "GET", "/readyz", b"").await;
    assert_eq!((ready.status, &ready.body[..]), (200, &b"ready\n"[..]));
    let (s, first) = streaming(proxy).await;
    tap.signal(Signal::SIGTERM);
    tap.log_line(&["SIGTERM", "draining"], Duration::from_secs(5));
    // Not ready (a Service stops sending traffic), alive (no restart), no token needed.
    let ready = fetch(tap.admin, "GET", "/readyz", b"").await;
    assert_eq!(
        ready.status,
        503,
        "{}",
        String::from_utf8_lossy(&ready.body)
    );
    assert!(String::from_utf8_lossy(&ready.body).contains("draining"));
    assert_eq!(fetch(tap.admin, "GET", "/healthz", b"").await.status, 200);
    // The listener stopped: a new connection is refused or closed unanswered.
    let refused = match TcpStream::connect(proxy).await {
        Err(_) => true,
        Ok(mut c) => {
            let _ = c
                .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                .await;
            let mut buf = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(2), c.read_to_end(&mut buf)).await;
            matches!(read, Ok(Ok(0)) | Ok(Err(_)))
        }
    };
    assert!(refused, "a new connection was served while draining");
    let (text, closed) = rest(s, first).await;
    assert!(text.contains("data: [DONE]"), "the stream was cut: {text}");
    assert!(
        closed,
        "the keep-alive connection stays open after its stream while draining"
    );
    let (status, _) = tap.wait_exit(Duration::from_secs(5)).expect("exits");
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grace_period_ends_what_is_still_running() {
    let backend = sim(&format!("1:{0},64:{0}", 20.0)).max_tokens(1000).await; // 20 s of tokens
    let dir = Scratch::new("term-grace");
    let mut tap = start(&dir, &backend, 1);
    let (s, first) = streaming(tap.proxy).await;
    tap.signal(Signal::SIGTERM);
    let (status, took) = tap.wait_exit(Duration::from_secs(5)).expect("exits");
    assert!(status.success(), "{status:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "took {took:?}"
    );
    let (text, closed) = rest(s, first).await;
    assert!(
        closed && !text.contains("[DONE]"),
        "the stream should have been cut"
    );
    tap.log_line(&["cut_connections", "1"], Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_exits_at_once() {
    let backend = sim(&format!("1:{0},64:{0}", 20.0)).max_tokens(1000).await;
    let dir = Scratch::new("int");
    let mut tap = start(&dir, &backend, 30);
    let (_s, _) = streaming(tap.proxy).await;
    tap.signal(Signal::SIGINT);
    let (status, took) = tap.wait_exit(Duration::from_secs(5)).expect("exits");
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_millis(500), "took {took:?}");
}
