//! Limits that hold against hostile clients: one that stops reading is cut after
//! `client_write_timeout_secs` and its slot freed; connections past `max_connections` are
//! closed at once, counted and logged.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::time::{timeout, Instant};

const CHAT: &str = "/v1/chat/completions";
const BODY: &[u8] = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

/// A backend whose first response is an endless, fast chat stream (until the proxy goes
/// away), and every later one a short stream.
async fn firehose() -> (std::net::SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(AtomicU64::new(0));
    let count = Arc::clone(&served);
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut got = Vec::new();
                loop {
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    got.extend_from_slice(&buf[..n]);
                    if got.windows(4).any(|w| w == b"\r\n\r\n") && got.ends_with(b"}]}") {
                        break;
                    }
                }
                let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                if s.write_all(head).await.is_err() {
                    return;
                }
                let endless = count.fetch_add(1, SeqCst) == 0;
                let token = format!(
                    "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
                    "x".repeat(1000)
                );
                let chunk = format!("{:x}\r\n{token}\r\n", token.len());
                let events = if endless { usize::MAX } else { 3 };
                for _ in 0..events {
                    if s.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                }
                let done = chat_events(0, false).concat();
                let end = format!(
                    "{:x}\r\n{}\r\n0\r\n\r\n",
                    done.len(),
                    String::from_utf8_lossy(&done)
                );
                let _ = s.write_all(end.as_bytes()).await;
            });
        }
    });
    (addr, served)
}

fn request() -> Vec<u8> {
    let mut r = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        BODY.len()
    )
    .into_bytes();
    r.extend_from_slice(BODY);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_and_its_slot_freed() {
    let (backend, served) = firehose().await;
    let config =
        "max_concurrency = 1\nqueue_timeout_ms = 30000\n[server]\nclient_write_timeout_secs = 3\n";
    let running = proxy(&[("up", backend)], config).await;

    // A small receive buffer, so the proxy's writes block soon after the client stops.
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut slow = socket.connect(proxy_addr(&running)).await.unwrap();
    slow.write_all(&request()).await.unwrap();
    let mut read = 0;
    let mut buf = [0u8; 4096];
    while read < 64 * 1024 {
        let n = slow.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream ended early");
        read += n;
    }
    let stopped = Instant::now();
    // The client holds its connection open and reads nothing more.
    let st = stats_when(&running, |u| {
        u["in_flight"] == 0 && u["requests_total"] == 1
    })
    .await;
    let freed = stopped.elapsed();
    assert!(freed < Duration::from_secs(10), "freed after {freed:?}");
    assert!(
        freed >= Duration::from_secs(2),
        "cut before the timeout: {freed:?}"
    );
    assert_eq!(
        st["upstreams"][0]["requests_by_status"]["aborted"], 1,
        "{st}"
    );

    // The slot is free: the next client is served at once.
    let next = fetch(proxy_addr(&running), "POST", CHAT, BODY);
    let r = timeout(Duration::from_secs(10), next)
        .await
        .expect("the next client waited");
    assert_eq!(r.status, 200);
    assert!(String::from_utf8_lossy(&r.body).contains("[DONE]"));
    assert_eq!(served.load(SeqCst), 2);
    drop(slow);
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_connections_are_closed_at_once_and_counted() {
    let (_backend, running, addr) = in_front_of_nothing("[server]\nmax_connections = 3\n").await;
    let open = |n: u64| move |s: &serde_json::Value| s["connections"]["open"] == n;
    // wait_ready's probes have gone.
    stats_where(&running, open(0)).await;
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    stats_where(&running, open(3)).await;
    let mut fourth = TcpStream::connect(addr).await.unwrap();
    let _ = fourth
        .write_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut buf = [0u8; 64];
    let closed = timeout(Duration::from_secs(10), fourth.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the fourth connection was served: {closed:?}"
    );
    let st = stats(&running).await;
    assert_eq!(st["connections"]["refused_total"], 1, "{st}");
    assert_eq!(st["connections"]["max"], 3, "{st}");
    let metrics = fetch(running.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("tokentap_client_connections_refused_total 1"),
        "{text}"
    );

    // One leaves: a new connection is served.
    drop(idle.pop());
    stats_where(&running, open(2)).await;
    let r = fetch(addr, "GET", "/x", b"").await;
    assert_eq!(r.status, 404, "served by the upstream");
    running.stop();
}

/// Reads until the proxy closes the connection (0 or an error), within `within`; true if it
/// did.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let until = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(until, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

/// Connections that send nothing hold their place only for `request_head_timeout_secs`
/// from the accept: 64 of them at `max_connections = 64` keep a new client out no longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_hold_their_place_only_for_the_head_timeout() {
    let (_backend, running, addr) =
        in_front_of_nothing("[server]\nmax_connections = 64\nrequest_head_timeout_secs = 2\n")
            .await;
    let open = |n: u64| move |s: &serde_json::Value| s["connections"]["open"] == n;
    stats_where(&running, open(0)).await;
    let mut silent = Vec::new();
    for _ in 0..64 {
        silent.push(TcpStream::connect(addr).await.unwrap());
    }
    let full = Instant::now();
    stats_where(&running, open(64)).await;
    // Each is closed by the proxy, without an answer, after the head timeout.
    for s in &mut silent {
        assert!(
            closed_within(s, Duration::from_secs(20)).await,
            "a silent connection was kept"
        );
    }
    let freed = full.elapsed();
    assert!(freed < Duration::from_secs(10), "freed after {freed:?}");
    let r = fetch(addr, "GET", "/x", b"").await;
    assert_eq!(r.status, 404, "served by the upstream");
    let st = stats(&running).await;
    assert_eq!(st["connections"]["evicted_total"], 0, "{st}");
    running.stop();
}

/// At `max_connections`, a new client takes the place of the longest-idle keep-alive
/// connection, which is closed; idle connections close after `keepalive_timeout_secs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_make_room_and_time_out() {
    let (_backend, running, addr) =
        in_front_of_nothing("[server]\nmax_connections = 3\nkeepalive_timeout_secs = 3\n").await;
    let st = |key: &'static str, n: u64| move |s: &serde_json::Value| s["connections"][key] == n;
    stats_where(&running, st("open", 0)).await;
    let get = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut idle = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(get).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 404"), "{:?}", &buf[..n]);
        idle.push(s);
        // Each goes idle after the one before it.
        stats_where(&running, st("idle", idle.len() as u64)).await;
    }
    // A fourth client is served; the first (idle longest) is closed for it.
    let r = fetch(addr, "GET", "/x", b"").await;
    assert_eq!(r.status, 404, "the fourth client was refused");
    assert!(closed_within(&mut idle[0], Duration::from_secs(5)).await);
    let s = stats(&running).await;
    assert_eq!(s["connections"]["evicted_total"], 1, "{s}");
    assert_eq!(s["connections"]["refused_total"], 0, "{s}");
    // The other two idle out.
    let idled = Instant::now();
    for s in &mut idle[1..] {
        assert!(closed_within(s, Duration::from_secs(20)).await);
    }
    let after = idled.elapsed();
    assert!(after < Duration::from_secs(10), "idle for {after:?}");
    let metrics = fetch(running.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("tokentap_client_connections_evicted_total 1"),
        "{text}"
    );
    running.stop();
}

/// A connection serving a response is busy, not idle, however long the response takes: a
/// new client at `max_connections` takes an idle connection's place, not its; and its
/// keep-alive wait starts once its response has ended, so a response longer than
/// `keepalive_timeout_secs` does not close the connection after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_serving_a_long_response_is_neither_idle_nor_timed_out() {
    let slow = Reply::Chunked {
        status: 200,
        content_type: "text/plain",
        pieces: vec![b"part".to_vec(); 4],
        gap: Duration::from_millis(700),
        ending: Ending::Clean,
    };
    let backend = mock(vec![("/slow", slow)]).await;
    let config = "[server]\nmax_connections = 2\nkeepalive_timeout_secs = 1\n";
    let running = proxy(&[("up", backend.addr)], config).await;
    let addr = proxy_addr(&running);
    let st = |key: &'static str, n: u64| move |s: &serde_json::Value| s["connections"][key] == n;
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").into_bytes();
    // Its first request, then its second: each a 2.1 s response on one connection.
    let mut busy = TcpStream::connect(addr).await.unwrap();
    for round in 0..2 {
        busy.write_all(&get("/slow")).await.unwrap();
        let mut head = vec![0u8; 1024];
        let n = busy.read(&mut head).await.unwrap();
        assert!(head[..n].starts_with(b"HTTP/1.1 200"), "round {round}");
        if round == 0 {
            // Another client is served and goes idle while the first is busy: one idle.
            let mut idle = TcpStream::connect(addr).await.unwrap();
            idle.write_all(&get("/x")).await.unwrap();
            let n = idle.read(&mut head).await.unwrap();
            assert!(head[..n].starts_with(b"HTTP/1.1 404"));
            stats_where(&running, st("idle", 1)).await;
            // A third at the limit takes the idle one's place, not the busy one's.
            let r = fetch(addr, "GET", "/x", b"").await;
            assert_eq!(r.status, 404);
            assert!(closed_within(&mut idle, Duration::from_secs(5)).await);
        }
        // The rest of the response, to its terminating chunk.
        let mut body = head[..n].to_vec();
        while !body.ends_with(b"0\r\n\r\n") {
            let mut buf = [0u8; 1024];
            let n = timeout(Duration::from_secs(10), busy.read(&mut buf))
                .await
                .expect("the response ends")
                .unwrap();
            assert!(n > 0, "round {round}: closed mid-response");
            body.extend_from_slice(&buf[..n]);
        }
    }
    let s = stats(&running).await;
    assert_eq!(s["connections"]["evicted_total"], 1, "{s}");
    assert_eq!(s["connections"]["refused_total"], 0, "{s}");
    running.stop();
}

/// A keep-alive connection idle past a second parks, with no task of its own, and is the
/// same connection for the client: its next request is served, one its client closes is
/// counted closed at once, a new client at `max_connections` still takes the place of the
/// one idle longest (closed at once, long before its keep-alive deadline), and those
/// parked when the server stops are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_connections_are_served_evicted_and_closed() {
    let (_backend, running, addr) =
        in_front_of_nothing("[server]\nmax_connections = 3\nkeepalive_timeout_secs = 60\n").await;
    let st = |key: &'static str, n: u64| move |s: &serde_json::Value| s["connections"][key] == n;
    let both = |open: u64, parked: u64| {
        move |s: &serde_json::Value| {
            s["connections"]["open"] == open && s["connections"]["parked"] == parked
        }
    };
    // Served, idle, parked; served again from the lot, and parked again.
    let mut first = TcpStream::connect(addr).await.unwrap();
    ask(&mut first).await;
    stats_where(&running, st("parked", 1)).await;
    ask(&mut first).await;
    let s = stats(&running).await;
    assert_eq!(s["connections"]["open"], 1, "{s}");
    stats_where(&running, st("parked", 1)).await;
    // A client that closes while parked is counted closed (within stats_where's wait,
    // far sooner than its keep-alive deadline).
    let mut gone = TcpStream::connect(addr).await.unwrap();
    ask(&mut gone).await;
    stats_where(&running, both(2, 2)).await;
    drop(gone);
    stats_where(&running, both(1, 1)).await;
    // Three parked at the limit: a fourth client takes the place of the first, which
    // is closed at once.
    let mut second = TcpStream::connect(addr).await.unwrap();
    ask(&mut second).await;
    let mut third = TcpStream::connect(addr).await.unwrap();
    ask(&mut third).await;
    stats_where(&running, both(3, 3)).await;
    let r = fetch(addr, "GET", "/x", b"").await;
    assert_eq!(r.status, 404, "the fourth client was refused");
    assert!(
        closed_within(&mut first, Duration::from_secs(2)).await,
        "evicted, kept"
    );
    let s = stats_where(&running, both(2, 2)).await;
    assert_eq!(s["connections"]["evicted_total"], 1, "{s}");
    assert_eq!(s["connections"]["refused_total"], 0, "{s}");
    // The others are still served.
    ask(&mut second).await;
    let metrics = fetch(running.shared().config.listen.admin, "GET", "/metrics", b"").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("tokentap_client_connections_parked "),
        "{text}"
    );
    // Parked when the server stops: closed.
    stats_where(&running, both(2, 2)).await;
    running.stop();
    for s in [&mut second, &mut third] {
        assert!(
            closed_within(s, Duration::from_secs(5)).await,
            "a parked connection outlived the server"
        );
    }
}

/// A parked connection still idles out at its keep-alive deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_connections_idle_out_at_their_deadline() {
    let (_backend, running, addr) =
        in_front_of_nothing("[server]\nkeepalive_timeout_secs = 3\n").await;
    let mut idle = TcpStream::connect(addr).await.unwrap();
    ask(&mut idle).await;
    let answered = Instant::now();
    stats_where(&running, |s| s["connections"]["parked"] == 1).await;
    assert!(closed_within(&mut idle, Duration::from_secs(10)).await);
    let after = answered.elapsed();
    assert!(
        after > Duration::from_secs(2) && after < Duration::from_secs(5),
        "closed after {after:?}"
    );
    stats_where(&running, |s| {
        s["connections"]["open"] == 0 && s["connections"]["parked"] == 0
    })
    .await;
    running.stop();
}

/// A proxy with `config`, in front of a backend that has no route (every path a 404).
async fn in_front_of_nothing(
    config: &str,
) -> (Mock, tokentap::server::Running, std::net::SocketAddr) {
    let backend = mock(vec![]).await;
    let running = proxy(&[("up", backend.addr)], config).await;
    let addr = proxy_addr(&running);
    (backend, running, addr)
}

/// Asks for `/x` on `s` and reads its 404 whole: its head and its body may come in two
/// reads (the backend's two writes, relayed as they came).
async fn ask(s: &mut TcpStream) {
    s.write_all(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let got = timeout(Duration::from_secs(5), read_message(s))
        .await
        .unwrap()
        .expect("a response before the connection closed");
    assert!(
        got.starts_with(b"HTTP/1.1 404"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
}
