//! The direct path: what the upstream receives, a request never sent twice, a closed pooled
//! connection not reused, `100 Continue`, every response framing on one connection, a body
//! ended by close, an upstream dying mid-body, pipelining, the read timeout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const BODY: &[u8] = br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

/// How the test backend answers.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// A short chat stream, chunked, keep-alive.
    Chunked,
    /// Like `Chunked`, but a connection serves one request, then closes on the next after
    /// reading it, without answering.
    Once,
    /// HTTP/1.0 style: no length, the body ends when the connection closes.
    UntilClose,
    /// Like `Chunked` (a keep-alive response), but the connection is closed right after;
    /// the head reaches the test once it is closed.
    ClosesIdle,
}

/// A backend that hands every request head it answers to the test.
struct Backend {
    addr: std::net::SocketAddr,
    heads: mpsc::UnboundedReceiver<String>,
    connections: Arc<AtomicU64>,
    /// Requests read, answered or not.
    requests: Arc<AtomicU64>,
}

async fn backend(mode: Mode) -> Backend {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, heads) = mpsc::unbounded_channel();
    let connections = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let (conns, reqs) = (Arc::clone(&connections), Arc::clone(&requests));
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            conns.fetch_add(1, SeqCst);
            let (tx, reqs) = (tx.clone(), Arc::clone(&reqs));
            tokio::spawn(async move {
                let mut served = 0;
                while let Some(head) = read_head_and_body(&mut s).await {
                    reqs.fetch_add(1, SeqCst);
                    if mode == Mode::Once && served == 1 {
                        return; // closes without an answer
                    }
                    if mode != Mode::ClosesIdle {
                        tx.send(head.clone()).unwrap();
                    }
                    let events = chat_events(3, true);
                    let out = if mode == Mode::UntilClose {
                        let mut out =
                            b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n".to_vec();
                        out.extend(events.concat());
                        out
                    } else {
                        chunked_sse_response(events)
                    };
                    if s.write_all(&out).await.is_err() || mode == Mode::UntilClose {
                        return;
                    }
                    if mode == Mode::ClosesIdle {
                        drop(s);
                        tx.send(head).unwrap();
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
        requests,
    }
}

/// Reads a chunked response to its last chunk; returns it as text.
async fn read_chunked_response(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut tmp = [0u8; 4096];
    while !got.ends_with(b"0\r\n\r\n") {
        let n = s.read(&mut tmp).await.unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&tmp[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
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

/// A connection whose request head (`Expect: 100-continue`, `BODY`'s length) was sent and
/// answered `100 Continue`; the body is the caller's to send. The wait has a deadline, so a
/// proxy that never sends the 100 fails.
async fn continued(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
        BODY.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut tmp = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut tmp))
        .await
        .expect("no 100 Continue")
        .unwrap();
    let first = String::from_utf8_lossy(&tmp[..n]).into_owned();
    assert!(first.starts_with("HTTP/1.1 100"), "{first}");
    s
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then_some(v.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_fields_stay_behind() {
    let mut b = backend(Mode::Chunked).await;
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

    // The client gets the whole stream, chunked.
    let text = read_chunked_response(&mut s).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("x-tokentap-upstream: up"), "{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_upstream_dropped_is_not_sent_again() {
    // The second request goes out on the pooled connection, which the backend reads and
    // closes: the client gets a 502, and the generation is not asked for twice.
    let b = backend(Mode::Once).await;
    let running = proxy(&[("up", b.addr)], "").await;
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let r = fetch(proxy_addr(&running), "POST", "/v1/chat/completions", BODY).await;
        statuses.push(r.status);
    }
    assert_eq!(statuses, [200, 502, 200]);
    assert_eq!(b.requests.load(SeqCst), 3, "a request was sent twice");
    assert_eq!(b.connections.load(SeqCst), 2);
    let st = stats_when(&running, |u| u["requests_total"] == 3).await;
    let up = &st["upstreams"][0];
    assert_eq!(up["requests_by_status"]["ok"], 2, "{st}");
    assert_eq!(up["requests_by_status"]["upstream_error"], 1, "{st}");
    assert_eq!(up["in_flight"], 0);
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_the_upstream_closed_is_not_reused() {
    // Each response is keep-alive, so its connection is pooled; the backend closes it while
    // it idles there. The next request goes out on a new connection instead of failing.
    let mut b = backend(Mode::ClosesIdle).await;
    let running = proxy(&[("up", b.addr)], "").await;
    for _ in 0..3 {
        let r = fetch(proxy_addr(&running), "POST", "/v1/chat/completions", BODY).await;
        assert_eq!(r.status, 200);
        b.heads.recv().await.unwrap(); // closed by now
    }
    assert_eq!(b.requests.load(SeqCst), 3);
    assert_eq!(b.connections.load(SeqCst), 3);
    let st = stats_when(&running, |u| u["requests_total"] == 3).await;
    assert_eq!(st["upstreams"][0]["requests_by_status"]["ok"], 3, "{st}");
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_expecting_100_continue_gets_it() {
    let mut b = backend(Mode::Chunked).await;
    let running = proxy(&[("up", b.addr)], "").await;
    let mut s = continued(proxy_addr(&running)).await;
    s.write_all(BODY).await.unwrap();
    let rest = read_chunked_response(&mut s).await;
    assert!(rest.contains("HTTP/1.1 200"), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let upstream_head = b.heads.recv().await.unwrap();
    assert_eq!(header(&upstream_head, "expect"), None, "{upstream_head}");
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_ended_by_close_reaches_the_client_chunked() {
    let b = backend(Mode::UntilClose).await;
    let running = proxy(&[("up", b.addr)], "").await;
    let mut s = TcpStream::connect(proxy_addr(&running)).await.unwrap();
    for _ in 0..2 {
        // Twice on one client connection: it survives the upstream's close.
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
            BODY.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        s.write_all(BODY).await.unwrap();
        let text = read_chunked_response(&mut s).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(
            text.to_ascii_lowercase()
                .contains("transfer-encoding: chunked"),
            "{text}"
        );
        assert!(text.contains("data: [DONE]"), "{text}");
    }
    let st = stats_when(&running, |u| u["requests_total"] == 2).await;
    assert_eq!(st["upstreams"][0]["requests_by_status"]["ok"], 2, "{st}");
    running.stop();
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

/// `raw` cut at the byte offsets `at`, each piece sent on its own.
fn raw(raw: &[u8], at: &[usize]) -> Reply {
    let mut pieces = Vec::new();
    let mut from = 0;
    for &to in at.iter().chain([&raw.len()]) {
        pieces.push(raw[from..to].to_vec());
        from = to;
    }
    Reply::Raw {
        pieces,
        gap: Duration::from_millis(2),
        close: false,
    }
}

/// POSTs `BODY` to each path in turn on one client connection; the status, whether it had a
/// `Content-Length`, and the body of each.
async fn on_one_connection(
    addr: std::net::SocketAddr,
    paths: &[&str],
) -> Vec<(u16, bool, Vec<u8>)> {
    use http_body_util::{BodyExt, Full};
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let mut got = Vec::new();
    for path in paths {
        sender.ready().await.expect("the connection was not kept");
        let req = http::Request::builder()
            .method("POST")
            .uri(*path)
            .header("host", "x")
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from_static(BODY)))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let length = resp.headers().contains_key(http::header::CONTENT_LENGTH);
        let body = resp
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec();
        got.push((status, length, body));
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_framing_reaches_the_client_intact_on_one_connection() {
    let events = chat_events(3, true).concat();
    let head = |framing: &str| {
        format!("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{framing}\r\n").into_bytes()
    };
    let mut length = head(&format!("Content-Length: {}\r\n", events.len()));
    length.extend_from_slice(&events);
    // Chunk extensions, events cut across chunks, a trailer.
    let mut chunked = head("Transfer-Encoding: chunked\r\n");
    for piece in events.chunks(37) {
        chunked.extend_from_slice(format!("{:x};ext=1\r\n", piece.len()).as_bytes());
        chunked.extend_from_slice(piece);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\nX-Trailer: 1\r\n\r\n");
    let mut hinted = b"HTTP/1.1 103 Early Hints\r\nLink: </s>\r\n\r\n".to_vec();
    hinted.extend_from_slice(&chunked);
    // Both framings: `Transfer-Encoding` wins, and the proxy drops the length.
    let both = [&chunked[..17], b"Content-Length: 5\r\n", &chunked[17..]].concat();
    let bytewise: Vec<usize> = (1..60).chain([chunked.len() - 3]).collect();
    let empty = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n";
    let backend = mock(vec![
        ("/v1/chat/completions?length", raw(&length, &[20, 90, 300])),
        (
            "/v1/chat/completions?chunked",
            raw(&chunked, &[10, 75, 76, 77, 200]),
        ),
        ("/v1/chat/completions?bytewise", raw(&chunked, &bytewise)),
        ("/v1/chat/completions?hinted", raw(&hinted, &[20, 50])),
        ("/v1/chat/completions?both", raw(&both, &[])),
        ("/v1/chat/completions?empty", raw(empty, &[])),
        (
            "/v1/chat/completions?nocontent",
            raw(b"HTTP/1.1 204 No Content\r\n\r\n", &[]),
        ),
    ])
    .await;
    let running = proxy(&[("up", backend.addr)], "").await;
    let paths = [
        "/v1/chat/completions?length",
        "/v1/chat/completions?chunked",
        "/v1/chat/completions?bytewise",
        "/v1/chat/completions?hinted",
        "/v1/chat/completions?both",
        "/v1/chat/completions?empty",
        "/v1/chat/completions?nocontent",
    ];
    let got = on_one_connection(proxy_addr(&running), &paths).await;
    // The direct path forwards a chunked body as it came: extensions and trailer included
    // (pingora-proxy would re-frame it).
    let mut s = TcpStream::connect(proxy_addr(&running)).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions?chunked HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
        BODY.len()
    );
    s.write_all(&[req.as_bytes(), BODY].concat()).await.unwrap();
    let mut raw_resp = Vec::new();
    let mut tmp = [0u8; 4096];
    while !raw_resp.ends_with(b"X-Trailer: 1\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut tmp))
            .await
            .expect("the body never ended")
            .unwrap();
        assert!(n > 0, "closed early");
        raw_resp.extend_from_slice(&tmp[..n]);
    }
    let body_at = |r: &[u8]| r.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    assert_eq!(
        raw_resp[body_at(&raw_resp)..],
        chunked[body_at(&chunked)..],
        "the chunked body was re-framed"
    );
    for (i, (status, length, body)) in got.iter().enumerate() {
        let (want_status, want_length, want_body) = match i {
            0 => (200, true, &events[..]),
            1..=4 => (200, false, &events[..]),
            5 => (200, true, &b""[..]),
            _ => (204, false, &b""[..]),
        };
        assert_eq!(*status, want_status, "{}", paths[i]);
        assert_eq!(*length, want_length, "{}", paths[i]);
        assert_eq!(body, want_body, "{}", paths[i]);
    }
    let st = stats_when(&running, |u| u["requests_total"] == 8).await;
    let up = &st["upstreams"][0];
    assert_eq!(up["requests_by_status"]["ok"], 8, "{up}");
    assert_eq!(up["output_tokens_total"], 18, "{up}");
    assert_eq!(up["in_flight"], 0);
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_dies_mid_body_cuts_the_client_and_counts_an_error() {
    let events = chat_events(3, true).concat();
    let mut chunked =
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    chunked.extend_from_slice(format!("{:x}\r\n", events.len()).as_bytes());
    chunked.extend_from_slice(&events[..events.len() / 2]); // the chunk never ends
    let mut short = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {}\r\n\r\n",
        events.len()
    )
    .into_bytes();
    short.extend_from_slice(&events[..events.len() / 2]);
    let dies = |bytes: Vec<u8>| Reply::Raw {
        pieces: vec![bytes],
        gap: Duration::ZERO,
        close: true,
    };
    let backend = mock(vec![
        ("/v1/chat/completions?chunked", dies(chunked)),
        ("/v1/chat/completions?short", dies(short)),
    ])
    .await;
    let running = proxy(&[("up", backend.addr)], "").await;
    for path in ["/v1/chat/completions?chunked", "/v1/chat/completions?short"] {
        let r = fetch(proxy_addr(&running), "POST", path, BODY).await;
        assert_eq!(r.status, 200, "{path}");
        assert!(r.error, "{path}: the client should see the body cut");
    }
    let st = stats_when(&running, |u| u["requests_total"] == 2).await;
    let up = &st["upstreams"][0];
    assert_eq!(up["requests_by_status"]["upstream_error"], 2, "{up}");
    assert_eq!(up["in_flight"], 0);
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_request_closes_the_connection_after_the_first_response() {
    // As pingora-proxy without pipelining: the first response, then the connection closes
    // (the client retries the second on a new one, RFC 9112 §9.3.2).
    let b = backend(Mode::Chunked).await;
    let running = proxy(&[("up", b.addr)], "").await;
    let one = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{}",
        BODY.len(),
        String::from_utf8_lossy(BODY)
    );
    let mut s = TcpStream::connect(proxy_addr(&running)).await.unwrap();
    s.write_all(format!("{one}{one}").as_bytes()).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
        .await
        .expect("the connection was kept open")
        .unwrap();
    let text = String::from_utf8_lossy(&got);
    assert_eq!(text.matches("HTTP/1.1 200").count(), 1, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    assert!(text.ends_with("0\r\n\r\n"), "{text}");
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_slow_to_send_its_body_holds_no_slot() {
    // One slot. A sends its head and waits for `100 Continue` (so the proxy has read the
    // head and is waiting for the body); B's whole request must not queue behind it.
    let b = backend(Mode::Chunked).await;
    let cap = "max_concurrency = 1\nqueue_timeout_ms = 60000\n";
    let running = proxy(&[("up", b.addr)], cap).await;
    let mut a = continued(proxy_addr(&running)).await;
    let fetched = fetch(proxy_addr(&running), "POST", "/v1/chat/completions", BODY);
    let r = tokio::time::timeout(Duration::from_secs(10), fetched)
        .await
        .expect("B queued behind a body that never came");
    assert_eq!(r.status, 200);
    a.write_all(BODY).await.unwrap();
    assert!(read_chunked_response(&mut a).await.contains("data: [DONE]"));
    running.stop();
}
