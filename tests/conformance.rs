//! HTTP/1.1 conformance on the client side (RFC 9110/9112), as raw bytes: what a client
//! sends, the status it must get, and exactly what reached a logging upstream. Every case
//! runs twice: with a free concurrency slot, and with the slot taken so that a request that
//! passes its checks waits in the queue first; the answers must be the same.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use tokentap::server::Running;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::{timeout, Instant};

const CHAT: &str = "/v1/chat/completions";
const BODY: &str = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

/// A request as the upstream read it: head and decoded body.
#[derive(Clone, Debug)]
struct Seen {
    head: String,
    body: Vec<u8>,
}

impl Seen {
    fn path(&self) -> &str {
        self.head.split_whitespace().nth(1).unwrap_or("")
    }

    fn fields(&self, name: &str) -> Vec<String> {
        self.head
            .lines()
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_owned())
            .collect()
    }
}

/// An upstream that logs every request it reads and answers each by its path; requests
/// to `/v1/completions` (the slot holder) wait for `release`.
struct Upstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    release: Arc<Notify>,
}

fn answer(path: &str) -> Vec<u8> {
    match path {
        "/hop" => b"HTTP/1.1 200 OK\r\nConnection: x-secret, keep-alive\r\nX-Secret: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nTrailer: x-t\r\nUpgrade: h2c\r\nTE: trailers\r\nX-Kept: 1\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        "/switch" => b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n".to_vec(),
        "/lf" => b"HTTP/1.1 200 OK\ntransfer-encoding: chunked\n\n5\nhello\n0\n\n".to_vec(),
        "/fold" => b"HTTP/1.1 200 OK\r\nX-Fold: a\r\n Injected: yes\r\nContent-Length: 2\r\n\r\nok".to_vec(),
        "/v1/completions" | CHAT => chunked_sse_response(chat_events(3, true)),
        _ => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec(),
    }
}

async fn upstream() -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let release = Arc::new(Notify::new());
    let (log, gate) = (Arc::clone(&seen), Arc::clone(&release));
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let (log, gate) = (Arc::clone(&log), Arc::clone(&gate));
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while let Some(req) = read_request(&mut s, &mut buf).await {
                    log.lock().unwrap().push(req.clone());
                    if req.path() == "/v1/completions" {
                        gate.notified().await;
                    }
                    if s.write_all(&answer(req.path())).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    Upstream {
        addr,
        seen,
        release,
    }
}

/// Reads one request (`Content-Length` or chunked); `buf` keeps bytes past it.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Seen> {
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if !fill(s, buf).await {
            return None;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    buf.drain(..head_end);
    let seen = Seen {
        head,
        body: Vec::new(),
    };
    let mut seen = seen;
    if let Some(n) = seen.fields("content-length").first() {
        let n: usize = n.parse().unwrap();
        while buf.len() < n {
            if !fill(s, buf).await {
                return None;
            }
        }
        seen.body = buf.drain(..n).collect();
    } else if !seen.fields("transfer-encoding").is_empty() {
        loop {
            let Some(line_end) = buf.windows(2).position(|w| w == b"\r\n") else {
                if !fill(s, buf).await {
                    return None;
                }
                continue;
            };
            let size = String::from_utf8_lossy(&buf[..line_end]).to_string();
            let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).unwrap();
            while buf.len() < line_end + 2 + size + 2 {
                if !fill(s, buf).await {
                    return None;
                }
            }
            let chunk: Vec<u8> = buf.drain(..line_end + 2 + size + 2).collect();
            if size == 0 {
                break;
            }
            seen.body
                .extend_from_slice(&chunk[line_end + 2..line_end + 2 + size]);
        }
    }
    Some(seen)
}

async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut tmp = [0u8; 16384];
    match s.read(&mut tmp).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&tmp[..n]);
            true
        }
    }
}

/// A response as the client read it.
#[derive(Debug, Default)]
struct Got {
    status: u16,
    head: String,
    /// The body, its chunk framing (if any) decoded.
    body: Vec<u8>,
    chunked: bool,
    /// The proxy closed the connection after the response.
    closed: bool,
}

impl Got {
    fn has_field(&self, name: &str) -> bool {
        self.head.lines().skip(1).any(|l| {
            l.split_once(':')
                .is_some_and(|(n, _)| n.trim().eq_ignore_ascii_case(name))
        })
    }
}

/// Reads one response; then whether the connection closes (within `linger`).
async fn read_response(s: &mut TcpStream, linger: Duration) -> Got {
    let mut buf = Vec::new();
    let mut got = Got::default();
    let mut eof = false;
    // Past any 1xx (`100 Continue`).
    while got.status < 200 {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let more = fill(s, &mut buf).await;
            assert!(more, "closed before a response head: {buf:?}");
        };
        got.head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        got.status = got.head[9..12].parse().unwrap();
        buf.drain(..head_end);
    }
    let lower = got.head.to_ascii_lowercase();
    let length = lower
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse::<usize>().unwrap());
    got.chunked = lower.contains("transfer-encoding: chunked");
    if got.chunked {
        loop {
            let Some(line_end) = buf.windows(2).position(|w| w == b"\r\n") else {
                assert!(fill(s, &mut buf).await, "chunked body cut");
                continue;
            };
            let size = String::from_utf8_lossy(&buf[..line_end]).to_string();
            let size = usize::from_str_radix(size.trim(), 16).unwrap();
            while buf.len() < line_end + 2 + size + 2 {
                assert!(fill(s, &mut buf).await, "chunked body cut");
            }
            let chunk: Vec<u8> = buf.drain(..line_end + 2 + size + 2).collect();
            if size == 0 {
                break;
            }
            got.body
                .extend_from_slice(&chunk[line_end + 2..line_end + 2 + size]);
        }
    } else if let Some(n) = length {
        while buf.len() < n {
            assert!(fill(s, &mut buf).await, "body cut");
        }
        got.body = buf.drain(..n).collect();
    } else if got.status != 204 && got.status != 304 {
        while fill(s, &mut buf).await {}
        got.body = std::mem::take(&mut buf);
        eof = true;
    }
    got.closed = eof
        || matches!(
            timeout(linger, fill(s, &mut buf)).await,
            Ok(false) // end of stream (or a reset)
        );
    got
}

/// The proxy and its logging upstream: one slot on the upstream, short client timeouts.
struct Env {
    running: Running,
    up: Upstream,
}

async fn env() -> Env {
    let up = upstream().await;
    let config = "max_concurrency = 1\nqueue_timeout_ms = 20000\n[server]\nrequest_head_timeout_secs = 1\nrequest_body_timeout_secs = 1\nmax_request_head_bytes = 8192\nmax_request_body_bytes = 200000\n";
    let running = proxy(&[("up", up.addr)], config).await;
    Env { running, up }
}

impl Env {
    fn addr(&self) -> SocketAddr {
        proxy_addr(&self.running)
    }

    /// Requests the upstream read since the last call, without the slot holder's.
    fn seen(&self) -> Vec<Seen> {
        let mut seen = self.up.seen.lock().unwrap();
        std::mem::take(&mut *seen)
            .into_iter()
            .filter(|s| s.path() != "/v1/completions")
            .collect()
    }

    /// Sends `pieces` (each its own write, 50 ms apart) and reads the response; with
    /// `queued`, a slot holder has the upstream's only slot until the proxy has read the
    /// request (and, for a request that passes its checks, queued it).
    async fn exchange(&self, pieces: &[&[u8]], queued: bool) -> Got {
        let holder = if queued {
            let addr = self.addr();
            let held = tokio::spawn(async move {
                let body = br#"{"model":"m","prompt":"x","stream":true}"#;
                fetch(addr, "POST", "/v1/completions", body).await
            });
            stats_when(&self.running, |u| u["in_flight"] == 1).await;
            Some(held)
        } else {
            None
        };
        let mut s = TcpStream::connect(self.addr()).await.unwrap();
        for (i, p) in pieces.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            // The proxy may close on a bad head before the rest is written.
            if s.write_all(p).await.is_err() {
                break;
            }
        }
        let response = read_response(&mut s, Duration::from_millis(300));
        tokio::pin!(response);
        let got = if let Some(held) = holder {
            // The slot is released once the request waits for it, unless it was answered
            // without reaching the queue.
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut answered = None;
            while answered.is_none() {
                if stats(&self.running).await["upstreams"][0]["queued"] == 1 {
                    break;
                }
                assert!(Instant::now() < deadline, "neither queued nor answered");
                let tick = tokio::time::sleep(Duration::from_millis(10));
                tokio::select! {
                    got = &mut response => answered = Some(got),
                    _ = tick => {}
                }
            }
            self.up.release.notify_one();
            let got = match answered {
                Some(got) => got,
                None => timeout(Duration::from_secs(10), response).await.unwrap(),
            };
            assert_eq!(held.await.unwrap().status, 200);
            got
        } else {
            timeout(Duration::from_secs(10), response).await.unwrap()
        };
        stats_when(&self.running, |u| u["in_flight"] == 0).await;
        got
    }
}

/// One case: the bytes sent, the status expected, and a check of what reached the
/// upstream.
struct Case {
    name: &'static str,
    send: Vec<Vec<u8>>,
    status: u16,
    upstream: fn(&[Seen]),
    client: fn(&Got),
}

fn nothing(seen: &[Seen]) {
    assert!(seen.is_empty(), "the upstream got {seen:#?}");
}

fn any(_: &Got) {}

fn closed(got: &Got) {
    assert!(got.closed, "the connection was kept: {got:?}");
}

fn one_chat(seen: &[Seen]) {
    assert_eq!(seen.len(), 1, "{seen:#?}");
    assert_eq!(seen[0].path(), CHAT);
    assert_eq!(seen[0].body, BODY.as_bytes());
    assert_eq!(seen[0].fields("content-length"), [BODY.len().to_string()]);
    assert!(seen[0].fields("transfer-encoding").is_empty());
}

fn chat(extra: &str, body: &str) -> Vec<u8> {
    format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\n{extra}\r\n{body}").into_bytes()
}

fn chunked(body: &str, size: usize) -> String {
    let mut out = String::new();
    for piece in body.as_bytes().chunks(size) {
        out.push_str(&format!(
            "{:x}\r\n{}\r\n",
            piece.len(),
            std::str::from_utf8(piece).unwrap()
        ));
    }
    out.push_str("0\r\n\r\n");
    out
}

fn cases() -> Vec<Case> {
    let len = format!("Content-Length: {}\r\n", BODY.len());
    vec![
        Case {
            name: "a plain generation request",
            send: vec![chat(&len, BODY)],
            status: 200,
            upstream: one_chat,
            client: |g| assert!(g.body.ends_with(b"data: [DONE]\n\n") && !g.closed),
        },
        Case {
            name: "equal repeated Content-Length values become one",
            send: vec![chat(&format!("{len}{len}"), BODY)],
            status: 200,
            upstream: one_chat,
            client: any,
        },
        Case {
            name: "unequal Content-Length values",
            send: vec![chat(&format!("{len}Content-Length: 3\r\n"), BODY)],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a chunked body read whole is sent with its length",
            send: vec![chat("Transfer-Encoding: chunked\r\n", &chunked(BODY, 7))],
            status: 200,
            upstream: one_chat,
            client: any,
        },
        Case {
            name: "a chunked body sent in pieces, extensions and a trailer",
            send: vec![
                chat("Transfer-Encoding: chunked\r\n", "5;a=b\r\n"),
                format!(
                    "{}\r\n{:x}\r\n{}\r\n0\r\nX-T: 1\r\n\r\n",
                    &BODY[..5],
                    BODY.len() - 5,
                    &BODY[5..]
                )
                .into_bytes(),
            ],
            status: 200,
            upstream: one_chat,
            client: any,
        },
        Case {
            name: "the smuggling differential: a bare LF in a chunk extension",
            send: vec![
                chat(
                    "Transfer-Encoding: chunked\r\n",
                    "2;\nxx\r\n28\r\n0\r\n\r\n",
                ),
                b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            ],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a bare LF after chunk data",
            send: vec![chat("Transfer-Encoding: chunked\r\n", "2\r\n{}\n0\r\n\r\n")],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "Transfer-Encoding beside Content-Length",
            send: vec![chat(
                &format!("{len}Transfer-Encoding: chunked\r\n"),
                &chunked(BODY, 100),
            )],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a transfer coding other than chunked",
            send: vec![chat(
                "Transfer-Encoding: gzip, chunked\r\n",
                &chunked(BODY, 100),
            )],
            status: 501,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "HTTP/1.1 without Host",
            send: vec![format!("POST {CHAT} HTTP/1.1\r\n{len}\r\n{BODY}").into_bytes()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "two Host fields",
            send: vec![chat(&format!("Host: y\r\n{len}"), BODY)],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a space in the request-target",
            send: vec![b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a control byte in the request-target",
            send: vec![b"GET /a\x01b HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a malformed head",
            send: vec![b"GET / HTTP/1.1\r\nHost x\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a head larger than max_request_head_bytes",
            send: vec![format!(
                "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
                "a".repeat(9000)
            )
            .into_bytes()],
            status: 431,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a head trickled past request_head_timeout_secs",
            send: vec![b"GET / HTTP/1.1\r\n".to_vec(), b"Host: x\r\n".to_vec()],
            status: 408,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a body that misses request_body_timeout_secs",
            send: vec![chat("Content-Length: 10\r\n", "{\"a\"")],
            status: 408,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a body larger than max_request_body_bytes",
            send: vec![chat("Content-Length: 300000\r\n", "")],
            status: 413,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "an Expect the proxy cannot meet",
            send: vec![chat(&format!("{len}Expect: magic\r\n"), BODY)],
            status: 417,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "an HTTP/1.0 client gets no chunks: a body ended by close",
            send: vec![format!("POST {CHAT} HTTP/1.0\r\n{len}\r\n{BODY}").into_bytes()],
            status: 200,
            upstream: |seen| {
                assert_eq!(seen.len(), 1);
                assert!(seen[0]
                    .head
                    .starts_with(&format!("POST {CHAT} HTTP/1.1\r\n")));
                assert_eq!(seen[0].fields("host").len(), 1);
            },
            client: |g| {
                assert!(!g.chunked && !g.has_field("transfer-encoding"), "{g:?}");
                assert!(g.closed);
                assert_eq!(g.body, chat_events(3, true).concat());
            },
        },
        Case {
            name: "hop-by-hop response fields stay behind",
            send: vec![b"GET /hop HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 200,
            upstream: |seen| assert_eq!(seen.len(), 1),
            client: |g| {
                for f in [
                    "x-secret",
                    "keep-alive",
                    "proxy-connection",
                    "trailer",
                    "upgrade",
                    "te",
                ] {
                    assert!(!g.has_field(f), "{f} reached the client: {}", g.head);
                }
                assert!(g.has_field("x-kept") && g.body == b"ok", "{g:?}");
            },
        },
        Case {
            name: "an unexpected 101",
            send: vec![b"GET /switch HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 502,
            upstream: |seen| assert_eq!(seen.len(), 1),
            client: closed,
        },
        Case {
            name: "an LF-only chunked response",
            send: vec![b"GET /lf HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 200,
            upstream: |seen| assert_eq!(seen.len(), 1),
            client: |g| assert_eq!(g.body, b"hello"),
        },
        Case {
            name: "a POST without a body reaches the upstream with Content-Length: 0",
            send: vec![format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\n\r\n").into_bytes()],
            status: 200,
            upstream: |seen| {
                assert_eq!(seen.len(), 1);
                assert_eq!(seen[0].fields("content-length"), ["0"]);
            },
            client: any,
        },
        Case {
            name: "an upgrade request goes through pingora-proxy",
            send: vec![b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n".to_vec()],
            status: 404, // the upstream's answer
            upstream: |seen| {
                assert_eq!(seen.len(), 1);
                assert_eq!(seen[0].path(), "/ws");
            },
            client: any,
        },
        Case {
            name: "an upgrade request gets the same head checks",
            send: vec![b"GET /ws HTTP/1.1\r\nHost: x\r\nHost: y\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "an upgrade request with a chunked body is read strictly, not by pingora-proxy",
            send: vec![b"POST /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: upgrade\r\nTransfer-Encoding: chunked\r\n\r\n2;\nxx\r\n0\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "chunk extensions past the bound",
            send: vec![chat("Transfer-Encoding: chunked\r\n", &format!("1;{}\r\nx\r\n0\r\n\r\n", "a".repeat(9000)))],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "an absolute-form target goes upstream in origin-form, routed by its path",
            send: vec![format!(
                "POST http://other.example{CHAT} HTTP/1.1\r\nHost: a\r\n{len}\r\n{BODY}"
            )
            .into_bytes()],
            status: 200,
            upstream: |seen| {
                one_chat(seen);
                assert!(seen[0].head.starts_with(&format!("POST {CHAT} HTTP/1.1\r\n")));
                let host = seen[0].fields("host");
                assert!(host.len() == 1 && host[0].starts_with("127.0.0.1:"), "{host:?}");
                assert!(!seen[0].head.contains("other.example"), "{}", seen[0].head);
            },
            client: |g| assert!(g.body.ends_with(b"data: [DONE]\n\n"), "{g:?}"),
        },
        Case {
            name: "a target in no form (relative path)",
            send: vec![b"GET private/x HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a target in no form (a bare word)",
            send: vec![b"GET echo HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "a target in no form (a scheme that is not http)",
            send: vec![b"GET x:y/private/z HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "an asterisk-form target on a method other than OPTIONS",
            send: vec![b"GET * HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 400,
            upstream: nothing,
            client: closed,
        },
        Case {
            name: "OPTIONS * is a valid head, which no route (a path prefix) matches",
            send: vec![b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 404,
            upstream: nothing,
            client: |g| assert!(String::from_utf8_lossy(&g.body).contains("no_route"), "{g:?}"),
        },
        Case {
            name: "an obs-fold in the upstream's head reaches the client unfolded",
            send: vec![b"GET /fold HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()],
            status: 200,
            upstream: |seen| assert_eq!(seen.len(), 1),
            client: |g| {
                for line in g.head.split("\r\n").skip(1) {
                    assert!(!line.starts_with([' ', '\t']), "a fold: {:?}", g.head);
                    assert!(!line.to_ascii_lowercase().starts_with("injected"), "{:?}", g.head);
                }
                assert!(g.head.contains("X-Fold: a   Injected: yes\r\n"), "{:?}", g.head);
                assert_eq!(g.body, b"ok");
            },
        },
        Case {
            name: "pipelined requests: the first answered, then the connection closes",
            send: vec![[chat(&len, BODY), chat(&len, BODY)].concat()],
            status: 200,
            upstream: one_chat,
            client: closed,
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_case_gets_its_answer_and_the_upstream_exactly_what_it_should() {
    let env = env().await;
    for queued in [false, true] {
        for case in cases() {
            eprintln!("case: {} (queued: {queued})", case.name);
            let pieces: Vec<&[u8]> = case.send.iter().map(Vec::as_slice).collect();
            let got = env.exchange(&pieces, queued).await;
            let at = format!("{} (queued: {queued})", case.name);
            assert_eq!(got.status, case.status, "{at}: {got:?}");
            let seen = env.seen();
            let checks = std::panic::AssertUnwindSafe(|| {
                (case.upstream)(&seen);
                (case.client)(&got);
            });
            if let Err(e) = std::panic::catch_unwind(checks) {
                panic!("{at}: {:?}", e.downcast_ref::<String>());
            }
        }
    }
    let st = stats(&env.running).await;
    assert_eq!(st["upstreams"][0]["in_flight"], 0, "{st}");
    env.running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_meter_counts_the_same_whichever_way_a_request_arrives() {
    let env = env().await;
    let long = format!(
        r#"{{"model":"m","stream":true,"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "y".repeat(100 * 1024)
    );
    let len = |body: &str| format!("Content-Length: {}\r\n", body.len());
    let shapes: Vec<(&str, Vec<Vec<u8>>, bool, &str)> = vec![
        (
            "Content-Length, HTTP/1.1",
            vec![chat(&len(BODY), BODY)],
            false,
            BODY,
        ),
        (
            "chunked",
            vec![chat("Transfer-Encoding: chunked\r\n", &chunked(BODY, 9))],
            false,
            BODY,
        ),
        (
            "HTTP/1.0",
            vec![format!("POST {CHAT} HTTP/1.0\r\n{}\r\n{BODY}", len(BODY)).into_bytes()],
            false,
            BODY,
        ),
        ("queued", vec![chat(&len(BODY), BODY)], true, BODY),
        (
            "100 Continue",
            vec![
                chat(&format!("{}Expect: 100-continue\r\n", len(BODY)), ""),
                BODY.as_bytes().to_vec(),
            ],
            false,
            BODY,
        ),
        (
            "a 100 KiB body, streamed",
            vec![chat(&len(&long), &long)],
            false,
            &long,
        ),
        (
            "a 100 KiB chunked body, streamed",
            vec![chat(
                "Transfer-Encoding: chunked\r\n",
                &chunked(&long, 4096),
            )],
            false,
            &long,
        ),
        (
            "a 100 KiB chunked body, queued",
            vec![chat(
                "Transfer-Encoding: chunked\r\n",
                &chunked(&long, 4096),
            )],
            true,
            &long,
        ),
    ];
    let mut requests = 0;
    for (name, send, queued, body) in shapes {
        let pieces: Vec<&[u8]> = send.iter().map(Vec::as_slice).collect();
        eprintln!("shape: {name}");
        let before = stats(&env.running).await["upstreams"][0].clone();
        let got = env.exchange(&pieces, queued).await;
        assert_eq!(got.status, 200, "{name}: {got:?}");
        assert_eq!(got.body, chat_events(3, true).concat(), "{name}");
        let seen = env.seen();
        assert_eq!(seen.len(), 1, "{name}");
        assert_eq!(
            seen[0].body,
            body.as_bytes(),
            "{name}: the body the upstream got"
        );
        requests += 1 + u64::from(queued); // the slot holder is a request too
        let after = stats_when(&env.running, |u| u["requests_total"] == requests).await;
        let after = &after["upstreams"][0];
        let delta = |key: &str| after[key].as_u64().unwrap() - before[key].as_u64().unwrap();
        let held = u64::from(queued);
        assert_eq!(
            delta("output_tokens_total"),
            3 * (1 + held),
            "{name}: {after}"
        );
        assert_eq!(
            after["requests_by_status"]["ok"].as_u64().unwrap()
                - before["requests_by_status"]["ok"].as_u64().unwrap_or(0),
            1 + held,
            "{name}: {after}"
        );
        assert_eq!(after["counts_exact"], true, "{name}");
    }
    env.running.stop();
}

/// Upstreams that misbehave after the request was sent, as raw bytes: a head trickled a
/// line at a time, and generation bodies tokentap cannot read or whose count is absurd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_upstreams_get_bounded_answers_and_honest_counts() {
    let sse = chunked_sse_response_with;
    let raw = |bytes: Vec<u8>| Reply::Raw {
        pieces: vec![bytes],
        gap: Duration::ZERO,
        close: false,
    };
    // A head begun at once, then one field every 0.5 s for 15 s.
    let mut trickle = vec![b"HTTP/1.1 200 OK\r\n".to_vec()];
    trickle.extend((0..30).map(|i| format!("x-line-{i}: 1\r\n").into_bytes()));
    trickle.push(b"content-length: 0\r\n\r\n".to_vec());
    // 2^64 - 1 tokens: a u64 that a sum would wrap.
    let absurd = {
        let mut events = chat_events(3, false);
        let done = events.pop().unwrap();
        events.push(br#"data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":18446744073709551615,"total_tokens":3}}"#.iter().chain(b"\n\n").copied().collect());
        events.push(done);
        events
    };
    let backend = mock(vec![
        (
            "/trickle",
            Reply::Raw {
                pieces: trickle,
                gap: Duration::from_millis(500),
                close: true,
            },
        ),
        (
            "/gzip/v1/chat/completions",
            raw(sse(vec![b"\x1f\x8b\x08\x00 not text".to_vec()], "content-encoding: gzip\r\n")),
        ),
        (
            "/coded/v1/chat/completions",
            raw(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: gzip, chunked\r\n\r\n5\r\n\x1f\x8b\x08\x00x\r\n0\r\n\r\n".to_vec()),
        ),
        ("/absurd/v1/chat/completions", raw(sse(absurd, ""))),
        ("/v1/chat/completions", raw(sse(chat_events(3, true), ""))),
    ])
    .await;
    let running = proxy(&[("up", backend.addr)], "read_timeout_secs = 2\n").await;
    let addr = proxy_addr(&running);

    // 4. The whole head within read_timeout_secs of its first byte: 504, not after 15 s.
    let started = Instant::now();
    let r = fetch(addr, "GET", "/trickle", b"").await;
    let took = started.elapsed();
    assert_eq!(r.status, 504, "{}", String::from_utf8_lossy(&r.body));
    assert!(
        took < Duration::from_secs(8),
        "the trickled head held the client {took:?}"
    );

    let up = |s: &serde_json::Value| s["upstreams"][0].clone();
    let chat = |path: &'static str| async move {
        let r = fetch(addr, "POST", path, BODY.as_bytes()).await;
        assert_eq!(r.status, 200, "{path}");
        r
    };
    // A plain exact stream first: counts are exact.
    chat(CHAT).await;
    let st = stats_when(&running, |u| u["output_tokens_total"] == 3).await;
    assert_eq!(up(&st)["counts_exact"], true, "{st}");
    assert_eq!(up(&st)["unparsed_events_total"], 0, "{st}");

    // 5. An absurd count is unparsed; the estimate (3) stands, and the total never wraps.
    chat("/absurd/v1/chat/completions").await;
    let st = stats_when(&running, |u| u["requests_by_status"]["ok"] == 2).await;
    assert_eq!(up(&st)["output_tokens_total"], 6, "{st}");
    assert_eq!(up(&st)["unparsed_events_total"], 1, "{st}");
    assert_eq!(up(&st)["counts_exact"], false, "{st}");

    // 8. Bodies under a content or transfer coding are forwarded as they came, and
    // counted as unparsed: never as a generation of 0 exact tokens.
    let gz = chat("/gzip/v1/chat/completions").await;
    assert!(gz.body.starts_with(b"\x1f\x8b"), "forwarded as it came");
    chat("/coded/v1/chat/completions").await;
    let st = stats_when(&running, |u| u["requests_by_status"]["ok"] == 4).await;
    assert_eq!(up(&st)["unparsed_events_total"], 3, "{st}");
    assert_eq!(up(&st)["output_tokens_total"], 6, "{st}");
    assert_eq!(up(&st)["counts_exact"], false, "{st}");
    running.stop();
}
